"""An Ansible inventory, YAML or INI, as an inventory: group vars inherited, the connection vars mapped, this
project's own node keys honoured, templates refused (see the package docstring)."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from coordinator.config.inventory.project import NodeSpec, build_node
from coordinator.config.yamlsrc import (
    KeyPath,
    YamlSource,
    config_error_from_validation,
    format_key_path,
    format_value,
    unknown_key_message,
)
from coordinator.errors import ConfigError
from coordinator.models import Node

_ANSIBLE_GROUP_KEYS = ("hosts", "children", "vars")


# Legacy names first so that the modern ones win when both are set.
_ANSIBLE_VARS: dict[str, str] = {
    "ansible_ssh_host": "host",
    "ansible_ssh_user": "user",
    "ansible_ssh_port": "port",
    "ansible_host": "host",
    "ansible_user": "user",
    "ansible_port": "port",
    "ansible_ssh_private_key_file": "identity",
    "ansible_python_interpreter": "python",
    "ansible_connection": "connection",
}


_OWN_VARS = ("workdir", "known_hosts", "ips", "labels", "env")


_ANSIBLE_CONNECTIONS = {"local": "local", "ssh": "ssh", "smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh"}


@dataclass
class _Vars:
    """Variables with the line each was set on."""

    values: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int | None] = field(default_factory=dict)

    def set(self, key: str, value: Any, line: int | None) -> None:
        self.values[key] = value
        self.lines[key] = line

    def update(self, other: _Vars) -> None:
        self.values.update(other.values)
        self.lines.update(other.lines)


@dataclass
class _Group:
    name: str
    vars: _Vars = field(default_factory=_Vars)
    parents: set[str] = field(default_factory=set)


@dataclass
class _Host:
    name: str
    line: int | None
    vars: _Vars = field(default_factory=_Vars)
    groups: set[str] = field(default_factory=set)


@dataclass
class _AnsibleInventory:
    path: str
    groups: dict[str, _Group] = field(default_factory=dict)
    hosts: dict[str, _Host] = field(default_factory=dict)

    def group(self, name: str, parent: str | None) -> _Group:
        group = self.groups.setdefault(name, _Group(name))
        if parent is not None and parent != name:
            group.parents.add(parent)
        return group

    def add_host(self, pattern: str, group: str, line: int | None) -> list[_Host]:
        """Hosts named by `pattern` (with `[01:10]`/`[a:f]` ranges and an optional `:port`), in `group`."""
        out = []
        for raw in expand_host_pattern(pattern, path=self.path, line=line):
            name, port = _split_port(raw)
            host = self.hosts.get(name)
            if host is None:
                host = self.hosts[name] = _Host(name, line)
            host.groups.add(group)
            if port is not None:
                host.vars.set("ansible_port", port, line)
            out.append(host)
        return out


def expand_host_pattern(pattern: str, *, path: str = "", line: int | None = None) -> list[str]:
    """Ansible host ranges: `node[01:03]` -> node01, node02, node03; `[a:c]` -> a, b, c (optionally `:step`)."""
    match = re.search(r"\[([0-9]+|[a-zA-Z]):([0-9]+|[a-zA-Z])(?::([0-9]+))?\]", pattern)
    if match is None:
        return [pattern]
    start, end, step_text = match.group(1), match.group(2), match.group(3)
    step = int(step_text) if step_text else 1
    head, tail = pattern[: match.start()], pattern[match.end():]
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(start), int(end) + 1, max(step, 1))]
    elif start.isalpha() and end.isalpha():
        items = [chr(c) for c in range(ord(start), ord(end) + 1, max(step, 1))]
    else:
        raise ConfigError(f"host range {format_value(match.group(0))} mixes letters and digits", path=path, line=line)
    if not items:
        raise ConfigError(f"host range {format_value(match.group(0))} is empty", path=path, line=line)
    return [expanded for item in items for expanded in expand_host_pattern(head + item + tail, path=path, line=line)]


def _split_port(name: str) -> tuple[str, str | None]:
    """`host:2222` -> ("host", "2222"); IPv6 addresses (several ':') are left whole."""
    if name.count(":") == 1:
        host, port = name.split(":")
        if port.isdigit():
            return host, port
    return name, None


def _resolve_ansible(inv: _AnsibleInventory) -> list[Node]:
    """Inherit vars (all < parent groups < child groups < host) and turn each host into a Node."""
    depth = _group_depths(inv)
    nodes: list[Node] = []
    for host in inv.hosts.values():
        groups = _ancestors(inv, host.groups) | {"all"}
        merged = _Vars()
        for name in sorted(groups, key=lambda g: (depth.get(g, 0), g)):
            if name in inv.groups:
                merged.update(inv.groups[name].vars)
        merged.update(host.vars)
        nodes.append(_ansible_node(inv.path, host, merged))
    return nodes


def _ancestors(inv: _AnsibleInventory, groups: set[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(groups)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inv.groups:
            stack.extend(inv.groups[name].parents)
    return seen


def _group_depths(inv: _AnsibleInventory) -> dict[str, int]:
    """`all` is 0, a top-level group 1, a child one more than its deepest parent. A cycle is a ConfigError."""
    depths: dict[str, int] = {"all": 0}
    visiting: set[str] = set()

    def depth(name: str) -> int:
        if name in depths:
            return depths[name]
        if name in visiting:
            raise ConfigError(f"group '{name}' is its own ancestor (cycle in children)", path=inv.path)
        visiting.add(name)
        parents = inv.groups[name].parents - {name} if name in inv.groups else set()
        depths[name] = 1 + max((depth(p) for p in parents), default=0)
        visiting.discard(name)
        return depths[name]

    for name in inv.groups:
        depth(name)
    return depths


def _ansible_node(path: str, host: _Host, merged: _Vars) -> Node:
    raw: dict[str, Any] = {"name": host.name, "host": host.name}
    origin: dict[str, tuple[str, int | None]] = {"name": ("name", host.line), "host": ("host", host.line)}
    for var in [*_ANSIBLE_VARS, *_OWN_VARS]:
        if var not in merged.values:
            continue
        value, line = merged.values[var], merged.lines.get(var)
        if _is_template(value):
            raise ConfigError(f"host {host.name}: {var}: templated values ({{{{ ... }}}}) are not supported here",
                              path=path, line=line)
        key = _ANSIBLE_VARS.get(var, var)
        if var == "ansible_connection":
            value = _ANSIBLE_CONNECTIONS.get(str(value), value)
            if value not in ("local", "ssh"):
                raise ConfigError(f"host {host.name}: ansible_connection {format_value(value)} is not supported "
                                  "(use ssh or local)", path=path, line=line)
        if var == "ansible_python_interpreter" and str(value).startswith("auto"):
            continue  # Ansible's interpreter discovery: let the node default apply
        raw[key] = value
        origin[key] = (var, line)

    def line_for(loc: Sequence[Any]) -> int | None:
        return origin[loc[0]][1] if loc and loc[0] in origin else host.line

    def label(loc: Sequence[Any]) -> str:
        if not loc:
            return f"host {host.name}"
        var = origin[loc[0]][0] if loc[0] in origin else str(loc[0])
        return f"host {host.name}: {format_key_path((var, *loc[1:]))}"

    try:
        spec = NodeSpec.model_validate(raw)
        return build_node(spec, None, f"{path}:{host.line}" if host.line else path)
    except ValidationError as exc:
        raise config_error_from_validation(exc, model=NodeSpec, path=path, line_for=line_for, label=label) from None


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def as_written(src: YamlSource, where: KeyPath, value: Any) -> Any:
    """env/labels mappings as typed (see YamlSource.as_written); every other var as YAML read it."""
    return src.as_written(where) if where[-1] in ("env", "labels") and isinstance(value, Mapping) else value


def from_ansible_yaml(src: YamlSource) -> list[Node]:
    inv = _AnsibleInventory(src.path)

    def visit(name: str, body: Any, where: KeyPath, parent: str | None) -> None:
        group = inv.group(name, parent)
        if body is None:
            return
        if not isinstance(body, Mapping):
            raise src.error(where, f"group '{name}' must be a mapping of hosts/children/vars")
        for key in body:
            if key not in _ANSIBLE_GROUP_KEYS:
                raise src.error((*where, key), f"group '{name}': {unknown_key_message(key, _ANSIBLE_GROUP_KEYS)}")
        hosts = body.get("hosts")
        if hosts is not None:
            if not isinstance(hosts, Mapping):
                raise src.error((*where, "hosts"), f"group '{name}': hosts must be a mapping of `name:` (with "
                                                   "optional vars under each), not a list")
            for host_name, host_vars in hosts.items():
                host_where = (*where, "hosts", host_name)
                if host_vars is not None and not isinstance(host_vars, Mapping):
                    raise src.error(host_where, f"host {host_name}: vars must be a mapping")
                for host in inv.add_host(str(host_name), name, src.line_for(host_where)):
                    for var, value in (host_vars or {}).items():
                        host.vars.set(str(var), as_written(src, (*host_where, var), value),
                                      src.line_for((*host_where, var)))
        group_vars = body.get("vars")
        if group_vars is not None:
            if not isinstance(group_vars, Mapping):
                raise src.error((*where, "vars"), f"group '{name}': vars must be a mapping")
            for var, value in group_vars.items():
                group.vars.set(str(var), as_written(src, (*where, "vars", var), value),
                               src.line_for((*where, "vars", var)))
        children = body.get("children")
        if children is not None:
            if not isinstance(children, Mapping):
                raise src.error((*where, "children"), f"group '{name}': children must be a mapping of groups")
            for child, child_body in children.items():
                visit(str(child), child_body, (*where, "children", child), name)

    for name, body in src.value.items():
        visit(str(name), body, (name,), None if str(name) == "all" else "all")
    return _resolve_ansible(inv)


INI_HEADER = re.compile(r"\[([^\]\s:]+)(?::([A-Za-z]+))?\]")


# A host line: a name (maybe with `[01:09]` ranges or `:port`, never ending in ':' like a YAML key), then vars.
INI_HOST_LINE = re.compile(r"[A-Za-z0-9_.\[][^\s=#;{}\"']*(?<!:)(?:\s+[A-Za-z_]\w*=\S.*)?")


def _parse_ini_value(text: str) -> Any:
    """Ansible reads inline host vars as Python literals when they are ones, else as strings."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def from_ansible_ini(text: str, path: str) -> list[Node]:
    inv = _AnsibleInventory(path)
    inv.group("ungrouped", "all")
    section, kind = "ungrouped", "hosts"
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        header = INI_HEADER.fullmatch(line)
        if header:
            section, kind = header.group(1), (header.group(2) or "hosts")
            if kind not in ("hosts", "vars", "children"):
                raise ConfigError(f"unknown section kind ':{kind}' (use [{section}], [{section}:vars] or "
                                  f"[{section}:children])", path=path, line=number)
            inv.group(section, None if section == "all" else "all")
            continue
        if kind == "vars":
            name, sep, value = line.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"[{section}:vars]: expected `name=value`, got {format_value(line)}",
                                  path=path, line=number)
            value = value.strip()
            # :vars values are strings in Ansible; structured ones (ips, labels, env) are read as literals.
            inv.groups[section].vars.set(name.strip(), _parse_ini_value(value) if value[:1] in "[{" else value,
                                         number)
        elif kind == "children":
            child = line.split()[0]
            inv.group(child, section)
        else:
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as exc:
                raise ConfigError(f"cannot split host line: {exc}", path=path, line=number) from None
            if not tokens:
                continue
            hosts = inv.add_host(tokens[0], section, number)
            for token in tokens[1:]:
                name, sep, value = token.partition("=")
                if not sep or not name:
                    raise ConfigError(f"host {tokens[0]}: expected `name=value` after the host name, got "
                                      f"{format_value(token)}", path=path, line=number)
                for host in hosts:
                    host.vars.set(name, _parse_ini_value(value), number)
    return _resolve_ansible(inv)


def looks_like_ansible_yaml(value: Mapping[Any, Any]) -> bool:
    """Top-level keys are groups: each body empty or a mapping of only hosts/children/vars, at least one not empty."""
    bodies = [body for body in value.values() if body is not None]
    return bool(bodies) and all(
        isinstance(body, Mapping) and body and all(key in _ANSIBLE_GROUP_KEYS for key in body) for body in bodies
    )
