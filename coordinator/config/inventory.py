"""Load the fleet: `load_inventory(path) -> Inventory`.

Three formats, recognised by content (the extension only breaks ties):

1. The project's YAML: `defaults:` (optional) merged into every entry of `nodes:` (see `InventorySpec`).
2. An MLX hostfile (JSON), list form `[{"ssh": "user@host", "ips": [...], "rdma": [...]}]` or dict form
   `{"backend": ..., "envs": ["K=V"], "hosts": [...]}`. Nodes are named after their host (sanitised; `-2`, `-3`
   appended to repeats); `envs` go to every node; `rdma` and `backend` are accepted but not kept (the coordinator
   derives devices and the playbook picks the backend). As in `mlx.launch`, the literal host `127.0.0.1` (no user)
   runs locally, without SSH.
3. An Ansible inventory, YAML (`all: {hosts:, vars:, children:}`) or INI (`[group]`, `[group:vars]`,
   `[group:children]`). Group vars are inherited (parents first, deeper groups win, host vars win over groups).
   `ansible_host` (default: the inventory name), `ansible_user`, `ansible_port`, `ansible_ssh_private_key_file`,
   `ansible_python_interpreter` and `ansible_connection` (local | ssh) are mapped; this project's own node keys
   that Ansible has no name for (`workdir`, `known_hosts`, `ips`, `labels`, `env`) are honoured as plain vars and
   validated; every other var is ignored. Jinja-templated values are rejected (nothing here renders them).

Every problem is a `ConfigError` with `file:line`. Unquoted env and label values are kept as typed (`off`, `1.10`),
not as YAML 1.1 reads them (False, 1.1). Strings are kept as written: `~` is not expanded (paths are on
the node, or are resolved by the transport). A `connection: local` node without a host gets `127.0.0.1`, the one
host `mlx.launch` starts without SSH; node defaults that nothing sets come from `coordinator.models.Node`.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from coordinator.config.yamlsrc import (
    EnvName,
    EnvValue,
    KeyPath,
    Name,
    YamlSource,
    check_env_name,
    config_error_from_validation,
    format_key_path,
    format_value,
    parse_yaml,
    read_text,
    scalar_to_str,
    unknown_key_message,
)
from coordinator.errors import ConfigError
from coordinator.models import LOCAL_HOST, Connection, Inventory, Node


class InventoryFormat(StrEnum):
    YAML = "yaml"
    MLX_HOSTFILE = "mlx-hostfile"
    ANSIBLE_YAML = "ansible-yaml"
    ANSIBLE_INI = "ansible-ini"


# --- field checks ---------------------------------------------------------------------------------------------

# Letters, digits and the punctuation of DNS names, IPv4/IPv6 addresses (':' and '%zone'), ssh_config aliases.
_HOST_PATTERN = re.compile(r"[A-Za-z0-9_.:%-]+")
_USER_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_host(value: Any) -> Any:
    """An ssh target without user: non-empty, no whitespace or shell metacharacters, not starting with '-'."""
    if not isinstance(value, str):
        return value  # the str type check reports it
    if not value:
        raise ValueError("host must not be empty")
    if value.startswith("-"):
        raise ValueError(f"host {format_value(value)} starts with '-': ssh would read it as an option")
    if "@" in value:
        raise ValueError(f"host {format_value(value)} contains '@': put the user in `user:`")
    if not _HOST_PATTERN.fullmatch(value):
        raise ValueError(f"host {format_value(value)} contains whitespace or characters not allowed in a host name "
                         "or address")
    return value


def check_user(value: Any) -> Any:
    """A login name: letters, digits, '_', '.', '-', not starting with '-' or '.'."""
    value = scalar_to_str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(value, str) and not _USER_PATTERN.fullmatch(value):
        raise ValueError(f"invalid user {format_value(value)}: use letters, digits, '_', '.', '-' (not first)")
    return value


def check_port(value: Any) -> Any:
    """An int 1..65535 (a string of digits is accepted: Ansible INI vars are strings)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or not 1 <= number <= 65535:
        raise ValueError(f"must be an integer 1..65535 (got {format_value(value)})")
    return number


def check_ip(value: Any) -> Any:
    """An IPv4 or IPv6 address (for the data plane: ring needs addresses, not names)."""
    if not isinstance(value, str):
        raise ValueError(f"must be an IP address (got {format_value(value)})")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{format_value(value)} is not a valid IP address") from None
    return value


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _check_path_string(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        if any(ord(ch) < 32 for ch in value):
            raise ValueError(f"{format_value(value)} contains a control character")
    return value


def _label_key(value: Any) -> Any:
    value = scalar_to_str(value)
    if isinstance(value, str) and not value:
        raise ValueError("label name must not be empty")
    return value


def _label_value(value: Any) -> Any:
    value = scalar_to_str(value)
    if not isinstance(value, str):
        raise ValueError(f"label value must be a string, number or boolean (got {format_value(value)})")
    return value


Host = Annotated[str, BeforeValidator(check_host)]
User = Annotated[str, BeforeValidator(check_user)]
Port = Annotated[int, BeforeValidator(check_port)]
IpAddress = Annotated[str, BeforeValidator(check_ip)]
PathString = Annotated[str, BeforeValidator(_check_path_string)]
LabelKey = Annotated[str, BeforeValidator(_label_key)]
LabelValue = Annotated[str, BeforeValidator(_label_value)]


# --- the project's YAML -----------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSettings(_Strict):
    """Keys that `defaults:` may set for every node and each node may override. None = not set."""

    connection: Connection | None = None
    user: User | None = None
    port: Port | None = None
    python: PathString | None = None
    workdir: PathString | None = None
    identity: PathString | None = None
    known_hosts: PathString | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)


class DefaultsSpec(NodeSettings):
    """`defaults:`: merged into every node (a node's `env` is merged key by key over these)."""


class NodeSpec(NodeSettings):
    """One entry of `nodes:` as written."""

    name: Name
    host: Host | None = None  # required unless connection is local
    ips: Annotated[tuple[IpAddress, ...], BeforeValidator(_one_or_many)] = ()
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)


class InventorySpec(_Strict):
    """The project's inventory file."""

    defaults: DefaultsSpec = Field(default_factory=DefaultsSpec)
    nodes: Annotated[list[NodeSpec], Field(min_length=1)]

    @field_validator("defaults", mode="before")
    @classmethod
    def _null_defaults(cls, value: Any) -> Any:
        return {} if value is None else value  # `defaults:` with everything commented out


def build_node(spec: NodeSpec, defaults: NodeSettings | None, source: str | None) -> Node:
    """Merge `defaults` under `spec` into a Node. Unset keys take `Node`'s own defaults. Raises ValueError if an
    ssh node has no host."""
    base = defaults or NodeSettings()
    connection = spec.connection or base.connection or Connection.SSH
    host = spec.host
    if host is None:
        if connection is not Connection.LOCAL:
            raise ValueError("missing required key 'host' (only `connection: local` nodes may omit it)")
        host = LOCAL_HOST
    kwargs: dict[str, Any] = {}
    for key in ("user", "port", "python", "workdir", "identity", "known_hosts"):
        value = getattr(spec, key)
        if value is None:
            value = getattr(base, key)
        if value is not None:
            kwargs[key] = value
    if connection is Connection.LOCAL:
        # A local node IS this machine: by default it runs the coordinator's own interpreter (which has mlx and
        # mlx-lm as dependencies), and relative paths mean "relative to where the coordinator runs", made
        # absolute now because ranks start in another directory.
        kwargs.setdefault("python", sys.executable)
        for key in ("python", "workdir"):
            value = kwargs.get(key)
            if isinstance(value, str) and not value.startswith(("/", "~")) and ("/" in value or key == "workdir"):
                kwargs[key] = os.path.abspath(value)
    env = {**base.env, **spec.env}
    return Node(name=spec.name, host=host, connection=connection, ips=spec.ips, labels=tuple(spec.labels.items()),
                env=tuple(env.items()), source=source, **kwargs)


def _with_written_strings(src: YamlSource) -> Any:
    """`src.value` with env and label values as the user typed them (`off` stays "off", `1.10` stays "1.10")."""
    value = src.value
    if not isinstance(value, dict):
        return value
    value = dict(value)
    defaults = value.get("defaults")
    if isinstance(defaults, dict) and isinstance(defaults.get("env"), dict):
        value["defaults"] = {**defaults, "env": src.as_written(("defaults", "env"))}
    nodes = value.get("nodes")
    if isinstance(nodes, list):
        value["nodes"] = [
            {**node, **{key: src.as_written(("nodes", index, key)) for key in ("env", "labels")
                        if isinstance(node.get(key), dict)}} if isinstance(node, dict) else node
            for index, node in enumerate(nodes)
        ]
    return value


def _from_project_yaml(src: YamlSource) -> list[Node]:
    try:
        spec = InventorySpec.model_validate(_with_written_strings(src))
    except ValidationError as exc:
        raise config_error_from_validation(exc, model=InventorySpec, path=src.path, line_for=src.line_for) from None
    nodes: list[Node] = []
    first_line: dict[str, int | None] = {}
    for index, node_spec in enumerate(spec.nodes):
        where = ("nodes", index)
        if node_spec.name in first_line:
            raise src.error((*where, "name"), f"nodes[{index}].name: duplicate node name '{node_spec.name}' "
                                              f"(first defined at line {first_line[node_spec.name]})")
        first_line[node_spec.name] = src.line_for((*where, "name"))
        try:
            nodes.append(build_node(node_spec, spec.defaults, src.where(where)))
        except ValueError as exc:
            raise src.error(where, f"nodes[{index}]: {exc}") from None
    return nodes


# --- MLX hostfile -----------------------------------------------------------------------------------------------


def _check_ssh_target(value: Any) -> Any:
    if isinstance(value, str):
        user, _, host = value.rpartition("@")
        if user:
            check_user(user)
        check_host(host)
    return value


def _check_env_assignment(value: Any) -> Any:
    if isinstance(value, str):
        name, sep, _ = value.partition("=")
        if not sep:
            raise ValueError(f"{format_value(value)} is not of the form NAME=value")
        check_env_name(name)
    return value


class HostfileHost(_Strict):
    """One host of an MLX hostfile (mlx `Host`: ssh, ips, rdma)."""

    ssh: Annotated[str, BeforeValidator(_check_ssh_target)]
    ips: Annotated[tuple[IpAddress, ...], BeforeValidator(_one_or_many)] = ()
    rdma: list[Any] = Field(default_factory=list)  # accepted, not kept: the coordinator derives RDMA devices


class HostfileSpec(_Strict):
    """An MLX hostfile in dict form (the list form is `hosts` alone)."""

    backend: str = ""  # accepted, not kept: the playbook chooses the backend
    envs: list[Annotated[str, BeforeValidator(_check_env_assignment)]] = Field(default_factory=list)
    hosts: Annotated[list[HostfileHost], Field(min_length=1)]


def sanitise_name(raw: str) -> str:
    """A node name from a host: characters outside [A-Za-z0-9_.-] become '-', leading '-'/'.' are dropped."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).lstrip("-.")
    return name or "node"


def _from_hostfile(src: YamlSource) -> list[Node]:
    list_form = isinstance(src.value, list)
    data = {"hosts": src.value} if list_form else src.value

    def source_path(loc: Sequence[Any]) -> KeyPath:
        return tuple(loc[1:]) if list_form and loc and loc[0] == "hosts" else tuple(loc)

    try:
        spec = HostfileSpec.model_validate(data)
    except ValidationError as exc:
        raise config_error_from_validation(exc, model=HostfileSpec, path=src.path,
                                           line_for=lambda loc: src.line_for(source_path(loc))) from None
    env = tuple((name, value) for name, _, value in (e.partition("=") for e in spec.envs))
    nodes: list[Node] = []
    used: set[str] = set()
    for index, host in enumerate(spec.hosts):
        user, _, hostname = host.ssh.rpartition("@")
        base = sanitise_name(hostname)
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}-{n}"
        used.add(name)
        local = host.ssh == LOCAL_HOST  # exactly mlx.launch's rule for running a rank without ssh
        nodes.append(Node(name=name, host=hostname, user=user or None,
                          connection=Connection.LOCAL if local else Connection.SSH, ips=host.ips, env=env,
                          source=src.where(source_path(("hosts", index)))))
    return nodes


# --- Ansible ----------------------------------------------------------------------------------------------------

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


def _as_written(src: YamlSource, where: KeyPath, value: Any) -> Any:
    """env/labels mappings as typed (see YamlSource.as_written); every other var as YAML read it."""
    return src.as_written(where) if where[-1] in ("env", "labels") and isinstance(value, Mapping) else value


def _from_ansible_yaml(src: YamlSource) -> list[Node]:
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
                        host.vars.set(str(var), _as_written(src, (*host_where, var), value),
                                      src.line_for((*host_where, var)))
        group_vars = body.get("vars")
        if group_vars is not None:
            if not isinstance(group_vars, Mapping):
                raise src.error((*where, "vars"), f"group '{name}': vars must be a mapping")
            for var, value in group_vars.items():
                group.vars.set(str(var), _as_written(src, (*where, "vars", var), value),
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


_INI_HEADER = re.compile(r"\[([^\]\s:]+)(?::([A-Za-z]+))?\]")
# A host line: a name (maybe with `[01:09]` ranges or `:port`, never ending in ':' like a YAML key), then vars.
_INI_HOST_LINE = re.compile(r"[A-Za-z0-9_.\[][^\s=#;{}\"']*(?<!:)(?:\s+[A-Za-z_]\w*=\S.*)?")


def _parse_ini_value(text: str) -> Any:
    """Ansible reads inline host vars as Python literals when they are ones, else as strings."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _from_ansible_ini(text: str, path: str) -> list[Node]:
    inv = _AnsibleInventory(path)
    inv.group("ungrouped", "all")
    section, kind = "ungrouped", "hosts"
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        header = _INI_HEADER.fullmatch(line)
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


def _looks_like_ansible_yaml(value: Mapping[Any, Any]) -> bool:
    """Top-level keys are groups: each body empty or a mapping of only hosts/children/vars, at least one not empty."""
    bodies = [body for body in value.values() if body is not None]
    return bool(bodies) and all(
        isinstance(body, Mapping) and body and all(key in _ANSIBLE_GROUP_KEYS for key in body) for body in bodies
    )


# --- detection and entry point ----------------------------------------------------------------------------------


def _significant_lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", ";")):
            yield stripped


def _json_source(text: str, path: str, value: Any) -> YamlSource:
    """The JSON value with line numbers borrowed from YAML (JSON is almost always YAML), else without lines.
    Duplicate keys, which `json` silently collapses, are still reported."""
    try:
        src = parse_yaml(text, path)
    except ConfigError as exc:
        if exc.message.startswith("duplicate key"):
            raise
        return YamlSource(path, value, {})
    return YamlSource(path, value, src.lines)


class JsonSyntaxError(ConfigError):
    """Invalid JSON, located `file:line:col: message` (the form editors and compilers use)."""

    def __init__(self, message: str, *, path: str, line: int, column: int) -> None:
        self.column = column  # before super().__init__, which renders the location
        super().__init__(message, path=path, line=line)

    def location_message(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.message}"


def _json_error(exc: json.JSONDecodeError, path: str) -> ConfigError:
    return JsonSyntaxError(f"invalid JSON: {exc.msg}", path=path, line=exc.lineno, column=exc.colno)


def _parse(text: str, path: str) -> tuple[InventoryFormat, YamlSource | None]:
    suffix = Path(path).suffix.lower()
    first = next(_significant_lines(text), "")
    if suffix in (".ini", ".cfg") or _INI_HEADER.fullmatch(first):
        return InventoryFormat.ANSIBLE_INI, None
    if suffix == ".json" or first.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            if suffix == ".json":
                raise _json_error(exc, path) from None
            try:
                src = parse_yaml(text, path)
            except ConfigError:
                if suffix in (".yaml", ".yml"):
                    raise
                raise _json_error(exc, path) from None
        else:
            src = _json_source(text, path, value)
    else:
        try:
            src = parse_yaml(text, path)
        except ConfigError:
            if _INI_HOST_LINE.fullmatch(first):
                return InventoryFormat.ANSIBLE_INI, None
            raise
    value = src.value
    if isinstance(value, list) or (isinstance(value, Mapping) and isinstance(value.get("hosts"), list)
                                   and "nodes" not in value):
        return InventoryFormat.MLX_HOSTFILE, src
    if isinstance(value, Mapping):
        if "nodes" not in value and "defaults" not in value and _looks_like_ansible_yaml(value):
            return InventoryFormat.ANSIBLE_YAML, src
        return InventoryFormat.YAML, src
    if isinstance(value, str) and _INI_HOST_LINE.fullmatch(first):
        return InventoryFormat.ANSIBLE_INI, None
    if value is None:
        raise ConfigError("inventory is empty: expected `nodes:` (or an MLX hostfile / Ansible inventory)", path=path)
    raise src.error((), f"inventory must be a mapping with `nodes:` (got {format_value(value)})")


def detect_inventory_format(text: str, path: str) -> InventoryFormat:
    """Which format `text` is in (see the module docstring). Raises ConfigError if it is none of them."""
    return _parse(text, path)[0]


def parse_inventory(text: str, path: str) -> Inventory:
    """Pure core of `load_inventory`: `path` only names the file in messages and `Node.source`."""
    fmt, src = _parse(text, path)
    readers: dict[InventoryFormat, Callable[[YamlSource], list[Node]]] = {
        InventoryFormat.YAML: _from_project_yaml,
        InventoryFormat.MLX_HOSTFILE: _from_hostfile,
        InventoryFormat.ANSIBLE_YAML: _from_ansible_yaml,
    }
    nodes = _from_ansible_ini(text, path) if src is None else readers[fmt](src)
    if not nodes:
        raise ConfigError("inventory defines no hosts", path=path)
    return Inventory(tuple(nodes), path)


def load_inventory(path: str | Path) -> Inventory:
    """Read the inventory at `path` in any supported format. Every problem is a ConfigError with `file:line`."""
    return parse_inventory(read_text(path, "inventory"), str(path))
