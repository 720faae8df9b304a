"""Configuration sources that remember where each value came from.

`parse_yaml` / `load_yaml` read YAML with PyYAML's *safe* loader and return a `YamlSource`: the plain Python value
plus a map from key path (tuple of mapping keys and sequence indices, e.g. `("nodes", 1, "port")`) to the 1-based
line it was written on. Anything wrong with the text itself becomes a `ConfigError` carrying `file:line`:

- syntax errors (line of PyYAML's problem mark, column in the message);
- duplicate mapping keys (PyYAML would silently keep the last one), reported at the second occurrence;
- more than one document, or tags the safe loader cannot construct.

It also keeps the source text of unquoted scalars YAML 1.1 did not read as strings, so that places where a user
means a string (env values) get `off` / `1.10` / `010` back instead of False / 1.1 / 8 (`YamlSource.as_written`).

`config_error_from_validation` turns a pydantic `ValidationError` into one `ConfigError` whose lines each read
`file:line: key.path: message`, with a "did you mean" for unknown keys. It is shared by the inventory and playbook
loaders so that every configuration file reports problems the same way, as are the pydantic field types at the
end (`Name`, `EnvName`, `EnvValue`).
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from coordinator.errors import ConfigError

KeyPath = tuple[Any, ...]
"""A path into a loaded document: mapping keys (as constructed: usually str) and sequence indices (int)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_NULL_TAG = "tag:yaml.org,2002:null"
MAX_REPORTED_ERRORS = 10
MAX_KEY_PATHS = 100_000


@dataclass(frozen=True)
class YamlSource:
    """A loaded document: `value` is what `yaml.safe_load` would return; `lines` maps key paths to 1-based lines.

    The line of a mapping entry is the line of its key; the line of a sequence item is where the item starts;
    the root `()` is where the document's first node starts. `texts` holds the source text of every unquoted
    scalar that YAML 1.1 did not read as a string (`off` -> False, `1.10` -> 1.1, `010` -> 8), by key path.
    """

    path: str
    value: Any
    lines: Mapping[KeyPath, int]
    texts: Mapping[KeyPath, str] = field(default_factory=dict)

    def line_for(self, key_path: Sequence[Any]) -> int | None:
        """Line of `key_path`, or of its nearest ancestor that exists in the file (None for an empty file)."""
        key = tuple(key_path)
        while True:
            line = self.lines.get(key)
            if line is not None:
                return line
            if not key:
                return None
            key = key[:-1]

    def where(self, key_path: Sequence[Any]) -> str:
        """`file:line` of `key_path` (nearest ancestor), or just `file`."""
        line = self.line_for(key_path)
        return self.path if line is None else f"{self.path}:{line}"

    def as_written(self, key_path: Sequence[Any]) -> Any:
        """The value at `key_path` (None if absent) with every unquoted non-string scalar at or below it replaced by
        its text as written: for places where the user means a string (`env: {DEBUG: off, V: 1.10}` gives "off",
        "1.10"). Mapping keys and nulls are left as YAML read them."""
        prefix = tuple(key_path)
        value: Any = self.value
        for part in prefix:
            if not isinstance(value, Mapping | list):
                return None
            try:
                value = value[part]
            except (KeyError, IndexError, TypeError):
                return None
        return self._with_texts(value, prefix)

    def _with_texts(self, value: Any, at: KeyPath) -> Any:
        if isinstance(value, Mapping):
            return {k: self._with_texts(v, (*at, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._with_texts(v, (*at, i)) for i, v in enumerate(value)]
        text = self.texts.get(at)
        return value if text is None or isinstance(value, str) else text

    def error(self, key_path: Sequence[Any], message: str) -> ConfigError:
        """A ConfigError located at `key_path` (nearest existing ancestor)."""
        return ConfigError(message, path=self.path, line=self.line_for(key_path))


def read_text(path: str | Path, what: str) -> str:
    """The file's text (UTF-8). Unreadable or undecodable files are a ConfigError naming `what` it should be."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found", path=str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", path=str(path)) from None


def load_yaml(path: str | Path, what: str = "file") -> YamlSource:
    """Read and parse `path`; see `parse_yaml`. `what` names the file in errors ("inventory", "playbook")."""
    return parse_yaml(read_text(path, what), str(path))


def parse_yaml(text: str, path: str) -> YamlSource:
    """Parse one YAML document safely, keeping line numbers. `path` is only used in messages.

    Raises ConfigError (with `path:line`) on syntax errors, duplicate keys, several documents or unsafe tags.
    An empty document gives `value=None`.
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return YamlSource(path, None, {})
        walker = _Walker(loader, path)
        walker.lines[()] = root.start_mark.line + 1
        walker.walk(root, (), weak=False)
        value = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        raise _yaml_error(exc, path) from None
    except yaml.YAMLError as exc:  # e.g. ReaderError: a control character in the text
        raise ConfigError(f"invalid YAML: {exc}", path=path) from None
    finally:
        loader.dispose()
    return YamlSource(path, value, walker.lines, walker.texts)


def _yaml_error(exc: yaml.MarkedYAMLError, path: str) -> ConfigError:
    mark = exc.problem_mark or exc.context_mark
    line = None if mark is None else mark.line + 1
    if isinstance(exc, yaml.composer.ComposerError) and "single document" in (exc.context or ""):
        return ConfigError("invalid YAML: a second document ('---') starts here; the file must hold exactly one",
                           path=path, line=line)
    problem = exc.problem or exc.context or "syntax error"
    message = f"invalid YAML: {problem}"
    if mark is not None:
        message += f" (column {mark.column + 1})"
    if exc.context and exc.problem and exc.context_mark is not None and exc.context_mark is not mark:
        message += f", {exc.context} at line {exc.context_mark.line + 1}"
    if "'\\t'" in problem:
        message += "; indent with spaces, not tabs"
    return ConfigError(message, path=path, line=line)


class _Walker:
    """Walks the composed tree once: records the line of every key path and the text of plain non-string scalars,
    and rejects duplicate keys.

    Entries reached through `<<` merge keys are `weak`: they never overwrite what the mapping says itself. Recursive
    aliases are cut (`active`); an aliased subtree is walked once per use, so its keys get lines under every path
    that uses it, and MAX_KEY_PATHS stops alias bombs.
    """

    def __init__(self, loader: yaml.SafeLoader, path: str) -> None:
        self.loader = loader
        self.path = path
        self.lines: dict[KeyPath, int] = {}
        self.texts: dict[KeyPath, str] = {}
        self.active: set[int] = set()

    def walk(self, node: Node, prefix: KeyPath, *, weak: bool) -> None:
        if isinstance(node, ScalarNode):
            # `1.10`, `010`, `off`, `2024-01-01` unquoted: remember the text for places that want strings.
            if node.style is None and node.tag not in (_STR_TAG, _NULL_TAG):
                self._set(self.texts, prefix, node.value, weak)
            return
        if id(node) in self.active:
            return
        self.active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                for index, item in enumerate(node.value):
                    self._set(self.lines, (*prefix, index), item.start_mark.line + 1, weak)
                    self.walk(item, (*prefix, index), weak=weak)
            elif isinstance(node, MappingNode):
                self._walk_mapping(node, prefix, weak=weak)
        finally:
            self.active.discard(id(node))

    def _walk_mapping(self, node: MappingNode, prefix: KeyPath, *, weak: bool) -> None:
        seen: dict[Any, int] = {}
        merges: list[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merges.extend(value_node.value if isinstance(value_node, SequenceNode) else [value_node])
                continue
            line = key_node.start_mark.line + 1
            key = self.loader.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                raise ConfigError("a mapping key must be a plain value, not a list or mapping",
                                  path=self.path, line=line) from None
            if first is not None:
                raise ConfigError(f"duplicate key {format_value(key)} (first at line {first})",
                                  path=self.path, line=line)
            seen[key] = line
            self._set(self.lines, (*prefix, key), line, weak)
            self.walk(value_node, (*prefix, key), weak=weak)
        for merged in merges:  # after the explicit keys, which `<<` never overrides
            self.walk(merged, prefix, weak=True)

    def _set(self, table: dict[KeyPath, Any], key: KeyPath, value: Any, weak: bool) -> None:
        if len(self.lines) + len(self.texts) > MAX_KEY_PATHS:
            # Only aliases can make a small file this big ("billion laughs"); no real configuration comes close.
            raise ConfigError(f"more than {MAX_KEY_PATHS} values (runaway YAML aliases?)", path=self.path,
                              line=self.lines.get(key[:-1]))
        if weak:
            table.setdefault(key, value)
        else:
            table[key] = value


# --- presenting locations and validation errors -------------------------------------------------------------


def format_key_path(key_path: Iterable[Any]) -> str:
    """`("nodes", 1, "port")` -> `nodes[1].port`; pydantic's `[key]` marker (a bad dict key) is dropped."""
    out = ""
    for part in key_path:
        if part == "[key]":
            continue
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def format_value(value: Any) -> str:
    """A user's value as it would read in YAML, shortened: 'abc', 12, true, null, a list/mapping."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate, or `` if none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_key_message(key: Any, known: Iterable[str]) -> str:
    """The standard message for a key that is not allowed here: suggestion if one is close, else the allowed list."""
    known = sorted(known)
    hint = did_you_mean(str(key), known)
    return f"unknown key {format_value(key)}{hint or '; allowed: ' + ', '.join(known)}"


def config_error_from_validation(
    exc: ValidationError,
    *,
    model: type[BaseModel],
    path: str,
    line_for: Callable[[Sequence[Any]], int | None],
    label: Callable[[Sequence[Any]], str] = format_key_path,
    hidden_fields: frozenset[str] = frozenset(),
) -> ConfigError:
    """One ConfigError for all of pydantic's errors, earliest line first.

    The first error gives the ConfigError's `line` and `message`; further ones follow on their own lines, each
    prefixed `path:line:`. `line_for` maps a pydantic location to a line (nearest ancestor); `label` renders the
    location for the message. `hidden_fields` are model fields that may not be written in the file (never suggested).
    """
    found: list[tuple[int, str]] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        line = line_for(loc)
        found.append((line if line is not None else 0, _describe(err, loc, model, label, hidden_fields)))
    found.sort(key=lambda item: item[0])
    first_line, first_message = found[0]
    rest = [f"{path}:{ln}: {msg}" if ln else f"{path}: {msg}" for ln, msg in found[1:MAX_REPORTED_ERRORS]]
    if len(found) > MAX_REPORTED_ERRORS:
        rest.append(f"... and {len(found) - MAX_REPORTED_ERRORS} more")
    message = "\n".join([first_message, *rest])
    return ConfigError(message, path=path, line=first_line or None)


def _describe(
    err: Any, loc: KeyPath, model: type[BaseModel], label: Callable[[Sequence[Any]], str], hidden: frozenset[str]
) -> str:
    kind: str = err["type"]
    value = err.get("input")
    ctx: dict[str, Any] = err.get("ctx") or {}
    if kind in ("extra_forbidden", "missing"):
        where = label(loc[:-1])
    elif loc and loc[-1] == "[key]":
        where = label(loc[:-2])  # a bad mapping key: name the mapping; the message names the key
    else:
        where = label(loc)
    prefix = f"{where}: " if where else ""
    if kind == "extra_forbidden":
        sub = _model_at(model, loc[:-1])
        known = [name for name in sub.model_fields if name not in hidden] if sub is not None else []
        return prefix + unknown_key_message(loc[-1], known)
    if kind == "missing":
        return f"{prefix}missing required key '{loc[-1]}'"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return prefix + str(ctx["error"])
    if kind.startswith("int_"):
        return f"{prefix}must be an integer (got {format_value(value)})"
    if kind.startswith("float_"):
        return f"{prefix}must be a number (got {format_value(value)})"
    if kind.startswith("bool_"):
        return f"{prefix}must be true or false (got {format_value(value)})"
    if kind.startswith("string_"):
        return f"{prefix}must be a string (got {format_value(value)})"
    if kind in ("list_type", "tuple_type"):
        return f"{prefix}must be a list (got {format_value(value)})"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"{prefix}must be a mapping (got {format_value(value)})"
    if kind in ("literal_error", "enum"):
        return f"{prefix}must be one of {ctx.get('expected', '')} (got {format_value(value)})"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()), "")
        return f"{prefix}must be {bounds[kind]} {limit} (got {format_value(value)})"
    if kind == "too_short":
        minimum = ctx.get("min_length", 1)
        return prefix + ("must not be empty" if minimum == 1 else f"must have at least {minimum} items")
    return prefix + str(err["msg"])


def _model_at(model: type[BaseModel], loc: KeyPath) -> type[BaseModel] | None:
    """The pydantic model class found by following `loc` through `model`'s field annotations, if any."""
    current: Any = model
    for part in loc:
        current = _unwrap_model(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
            continue
        origin = typing.get_origin(current)
        args = typing.get_args(current)
        if origin in (list, tuple, Sequence) and args:
            current = args[0]
        elif origin in (dict, Mapping) and len(args) == 2:
            current = args[1]
        else:
            return None
    current = _unwrap_model(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap_model(annotation: Any) -> Any:
    """Strip Annotated[...] and Optional[...] down to the interesting type."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if origin in (typing.Union, types.UnionType) and len(args) == 1:
            annotation = args[0]
            continue
        return annotation


# --- small value helpers shared by the loaders ------------------------------------------------------------


def scalar_to_str(value: Any) -> Any:
    """How a user means a YAML scalar written where a string belongs: `false` -> "false", `8` -> "8", `1.5` -> "1.5".

    Anything else (null, lists, mappings) is returned unchanged for the caller's type check to reject.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return value


# --- field types shared by the inventory and the playbook -------------------------------------------------------

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
"""Node and playbook names: safe in file names, shell words and ssh_config `Host` lines."""
MAX_NAME_LENGTH = 200
"""Names become parts of file names (a run id is the playbook name plus 21 characters; the temp dir's name adds
22 more), and a file name is at most 255 bytes."""

ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_name(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `name: 2024` is a fine name that YAML happens to read as a number
    if isinstance(value, str) and not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"invalid name {format_value(value)}: use only letters, digits, '_', '.' and '-'")
    if isinstance(value, str) and len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"name of {len(value)} characters; at most {MAX_NAME_LENGTH} (names become parts of file "
                         "names, which are limited to 255 bytes)")
    return value


def check_env_name(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"environment variable name read as the boolean {format_value(value)} "
                         "(YAML 1.1 turns yes/no/on/off/true/false into booleans): quote it")
    if not isinstance(value, str) or not ENV_NAME_PATTERN.fullmatch(value):
        raise ValueError(f"invalid environment variable name {format_value(value)}: use letters, digits and '_', "
                         "not starting with a digit")
    return value


def check_env_value(value: Any) -> Any:
    value = scalar_to_str(value)
    if not isinstance(value, str):
        raise ValueError(f"environment value must be a string, number or boolean (got {format_value(value)}); "
                         'write "" for an empty value')
    if "\0" in value:
        raise ValueError("environment value contains a NUL character")
    return value


Name = Annotated[str, BeforeValidator(check_name)]
"""A node or playbook name, matching NAME_PATTERN."""

EnvName = Annotated[str, BeforeValidator(check_env_name)]
"""An environment variable name (`[A-Za-z_][A-Za-z0-9_]*`); a YAML boolean key gets a quoting hint."""

EnvValue = Annotated[str, BeforeValidator(check_env_value)]
"""An environment value: strings as written; numbers and booleans as the user typed them (`false` -> "false")."""
