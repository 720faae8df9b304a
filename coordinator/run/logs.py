"""Structured logs (structlog) with secrets redacted from every event, and `redact` for any JSON-able value.

    handle = configure_logging(run_dir, console=True, secrets=playbook_secret_values)
    log = structlog.get_logger("coordinator.run.launch")
    log.info("rank_started", node="m1", rank=0)
    ...
    handle.close()

Outputs: with a `run_dir`, one JSON object per line in `<run_dir>/coordinator.log.jsonl` (appended; created with
its directory); with `console=True`, readable lines on stderr (stdout stays free for `--json` results). Both,
one or none may be on.

What is secret (`collect_secrets`):
- the value of every environment variable whose NAME looks secret (`SECRET_NAME_PATTERNS`, case-insensitive:
  `*TOKEN*`, `*KEY*`, `*SECRET*`, `*PASSWORD*`, `*PASSWD*`, `*CREDENTIAL*`, `HF_TOKEN`, `AWS_*`), plus the
  values of the names in `secret_env_names` (e.g. the playbook's env entries marked secret);
- every string in `secrets` (values the caller knows are secret).

How it is redacted (`Redactor`): every occurrence of a secret inside any string, at any depth (dict values and
keys, list/tuple items, exception text, the event message) becomes `***`; longer secrets are matched first, so
a secret containing another is removed whole. A dict entry whose key is an environment-variable-style name
(`HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`: upper case) that looks secret has its whole value replaced, whatever it
is. Secrets shorter than `MIN_SECRET_LEN` characters are matched only as a whole string (replacing every "1"
inside other text would destroy the log without protecting anything); such values of environment variables
are not treated as secrets at all (`FOO_KEY=1` is a flag, not a credential). Objects that are not JSON-able
(exceptions, paths) are turned into their `str` only when that text contains a secret.

Redaction runs after exception formatting and before either renderer, so nothing reaches a file or the
terminal unredacted.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

REDACTED = "***"
MIN_SECRET_LEN = 4
LOG_FILE_NAME = "coordinator.log.jsonl"
SECRET_NAME_PATTERNS: tuple[str, ...] = (
    "*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*", "HF_TOKEN", "AWS_*",
)  # fmt: skip
_ENV_STYLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def is_secret_name(name: str) -> bool:
    """True when an environment variable called `name` probably holds a secret (case-insensitive)."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in SECRET_NAME_PATTERNS)


def collect_secrets(
    env: Mapping[str, str] | None = None,
    *,
    secret_env_names: Iterable[str] = (),
    secrets: Iterable[str] = (),
) -> tuple[str, ...]:
    """Every secret string to redact: `env` values (default `os.environ`) under secret-looking names or
    `secret_env_names` (at least MIN_SECRET_LEN long), then the explicit `secrets` (empty strings dropped).
    Deduplicated, order kept."""
    env = os.environ if env is None else env
    extra = set(secret_env_names)
    found = [v for k, v in env.items() if (k in extra or is_secret_name(k)) and len(v) >= MIN_SECRET_LEN]
    found += [s for s in secrets if s]
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class Redactor:
    """Replaces secrets in strings and nested values. Also a structlog processor (call it with an event)."""

    secrets: tuple[str, ...]
    _pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _short: frozenset[str] = field(init=False, repr=False, compare=False)
    _whole: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        longs = sorted({s for s in self.secrets if len(s) >= MIN_SECRET_LEN}, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(s) for s in longs)) if longs else None
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_short", frozenset(s for s in self.secrets if 0 < len(s) < MIN_SECRET_LEN))
        object.__setattr__(self, "_whole", frozenset(s for s in self.secrets if s))

    def text(self, value: str) -> str:
        """`value` with every secret replaced by `***`."""
        if value in self._short:
            return REDACTED
        return self._pattern.sub(REDACTED, value) if self._pattern is not None else value

    def value(self, obj: Any) -> Any:
        """A redacted copy of `obj`: dicts and lists/tuples recursively (tuples and sets come back as lists,
        as JSON would have them), strings and bytes by text, numbers/bools/None as they are unless their text IS
        a secret; anything else by its `str` when that contains a secret, else unchanged."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for key, val in obj.items():
                new_key = self.text(key) if isinstance(key, str) else key
                if isinstance(key, str) and _ENV_STYLE_NAME.fullmatch(key) and is_secret_name(key) \
                        and val not in (None, ""):
                    out[new_key] = REDACTED
                else:
                    out[new_key] = self.value(val)
            return out
        if isinstance(obj, list | tuple | set | frozenset):
            return [self.value(v) for v in obj]
        if isinstance(obj, bytes):
            return self.text(obj.decode("utf-8", errors="replace"))
        if obj is None or isinstance(obj, bool | int | float):
            # A number is redacted only when it IS a secret (a PIN), not when its digits contain one.
            return REDACTED if obj is not None and str(obj) in self._whole else obj
        as_text = str(obj)
        redacted = self.text(as_text)
        return redacted if redacted != as_text else obj

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        """structlog processor: the whole event, redacted."""
        result: EventDict = self.value(event_dict)
        return result


def redact(obj: Any, secrets: Iterable[str]) -> Any:
    """A copy of the JSON-able `obj` with every secret of `secrets` replaced by `***` (see the module doc).
    For repeated use build one `Redactor(tuple(secrets))` instead (it compiles the pattern once)."""
    return Redactor(tuple(secrets)).value(obj)


class _TeeLogger:
    """The wrapped logger: writes the JSON line to the log file and the readable line to the console."""

    def __init__(self, file: TextIO | None, console: TextIO | None, name: str | None = None) -> None:
        self._file = file
        self._console = console
        self.name = name  # what `structlog.get_logger(name)` was given

    def msg(self, json_line: str, console_line: str) -> None:
        if self._file is not None:
            self._file.write(json_line + "\n")
            self._file.flush()
        if self._console is not None:
            self._console.write(console_line + "\n")
            self._console.flush()

    log = debug = info = warn = warning = error = err = critical = exception = fatal = msg


def _add_logger_name(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", None)
    if name and "logger" not in event_dict:
        event_dict["logger"] = name
    return event_dict


class _RenderBoth:
    """Final processor: (json line, console line) as the positional arguments of `_TeeLogger.msg`."""

    def __init__(self, colors: bool) -> None:
        self._json = structlog.processors.JSONRenderer(default=str, sort_keys=False)
        self._console = structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=0)

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> tuple[tuple[str, str],
                                                                                             dict[str, Any]]:
        # Each renderer gets its own copy: the console renderer pops keys.
        return (str(self._json(logger, method, dict(event_dict))),
                str(self._console(logger, method, dict(event_dict)))), {}


@dataclass
class LoggingHandle:
    """What `configure_logging` set up. `close()` flushes and closes the log file (idempotent)."""

    log_file: Path | None
    redactor: Redactor
    _file: TextIO | None = None

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


_current: LoggingHandle | None = None


def configure_logging(
    run_dir: Path | None,
    *,
    console: bool,
    secrets: Iterable[str] = (),
    secret_env_names: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    level: int = logging.INFO,
    console_stream: TextIO | None = None,
) -> LoggingHandle:
    """Configure structlog for this process (replacing any earlier configuration and closing its file).

    `run_dir`: JSON lines go to `<run_dir>/coordinator.log.jsonl` (None: no file). `console`: readable lines on
    `console_stream` (default: the current sys.stderr; colours only on a terminal and without NO_COLOR).
    Secrets: see `collect_secrets` (`env` defaults to os.environ). Raises OSError when the log file cannot be
    opened."""
    global _current
    if _current is not None:
        _current.close()
    redactor = Redactor(collect_secrets(env, secret_env_names=secret_env_names, secrets=secrets))
    file: TextIO | None = None
    path: Path | None = None
    if run_dir is not None:
        path = Path(run_dir) / LOG_FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path.open("a", encoding="utf-8")
    stream = (console_stream or sys.stderr) if console else None
    colors = bool(stream is not None and stream.isatty() and "NO_COLOR" not in os.environ)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,  # tracebacks become text BEFORE redaction
            redactor,
            _RenderBoth(colors),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *args: _TeeLogger(file, stream, str(args[0]) if args else None),
        cache_logger_on_first_use=False,
    )
    _current = LoggingHandle(path, redactor, file)
    return _current



def current_redactor() -> Redactor:
    """The redactor of the last `configure_logging` (one knowing no secret before any), so writers of
    summary.json or events can `current_redactor().value(doc)` without the secrets being passed down to them."""
    return _current.redactor if _current is not None else Redactor(())
