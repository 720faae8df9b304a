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
host `mlx.launch` starts without SSH; node defaults that nothing sets come from `coordinator.models.Node`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from coordinator.config.inventory.ansible import (
    INI_HEADER,
    INI_HOST_LINE,
    from_ansible_ini,
    from_ansible_yaml,
    looks_like_ansible_yaml,
)
from coordinator.config.inventory.mlxhostfile import from_hostfile
from coordinator.config.inventory.project import from_project_yaml
from coordinator.config.yamlsrc import (
    YamlSource,
    format_value,
    parse_yaml,
    read_text,
)
from coordinator.errors import ConfigError
from coordinator.models import Inventory, Node


class InventoryFormat(StrEnum):
    YAML = "yaml"
    MLX_HOSTFILE = "mlx-hostfile"
    ANSIBLE_YAML = "ansible-yaml"
    ANSIBLE_INI = "ansible-ini"


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
    if suffix in (".ini", ".cfg") or INI_HEADER.fullmatch(first):
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
            if INI_HOST_LINE.fullmatch(first):
                return InventoryFormat.ANSIBLE_INI, None
            raise
    value = src.value
    if isinstance(value, list) or (isinstance(value, Mapping) and isinstance(value.get("hosts"), list)
                                   and "nodes" not in value):
        return InventoryFormat.MLX_HOSTFILE, src
    if isinstance(value, Mapping):
        if "nodes" not in value and "defaults" not in value and looks_like_ansible_yaml(value):
            return InventoryFormat.ANSIBLE_YAML, src
        return InventoryFormat.YAML, src
    if isinstance(value, str) and INI_HOST_LINE.fullmatch(first):
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
        InventoryFormat.YAML: from_project_yaml,
        InventoryFormat.MLX_HOSTFILE: from_hostfile,
        InventoryFormat.ANSIBLE_YAML: from_ansible_yaml,
    }
    nodes = from_ansible_ini(text, path) if src is None else readers[fmt](src)
    if not nodes:
        raise ConfigError("inventory defines no hosts", path=path)
    return Inventory(tuple(nodes), path)


def load_inventory(path: str | Path) -> Inventory:
    """Read the inventory at `path` in any supported format. Every problem is a ConfigError with `file:line`."""
    return parse_inventory(read_text(path, "inventory"), str(path))
