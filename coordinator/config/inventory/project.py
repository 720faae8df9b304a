"""The project's own YAML inventory: `defaults:` merged into every entry of `nodes:` (`InventorySpec`)."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError, field_validator

from coordinator.config.inventory.fields import Host, IpAddress, LabelKey, LabelValue, PathString, Port, Strict, User, one_or_many
from coordinator.config.yamlsrc import (
    EnvName,
    EnvValue,
    Name,
    YamlSource,
    config_error_from_validation,
)
from coordinator.models import LOCAL_HOST, Connection, Node


class NodeSettings(Strict):
    """Keys that `defaults:` may set for every node and each node may override. None = not set."""

    connection: Connection | None = None
    user: User | None = None
    port: Port | None = None
    python: PathString | None = None
    workdir: PathString | None = None
    identity: PathString | None = None
    known_hosts: PathString | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    # NVIDIA GPUs to use, one rank each (default: every GPU nvidia-smi lists, with the nccl backend).
    gpus: Annotated[int, Field(ge=1)] | None = None


class DefaultsSpec(NodeSettings):
    """`defaults:`: merged into every node (a node's `env` is merged key by key over these)."""


class NodeSpec(NodeSettings):
    """One entry of `nodes:` as written."""

    name: Name
    host: Host | None = None  # required unless connection is local
    ips: Annotated[tuple[IpAddress, ...], BeforeValidator(one_or_many)] = ()
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)


class InventorySpec(Strict):
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
    for key in ("user", "port", "python", "workdir", "identity", "known_hosts", "gpus"):
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


def with_written_strings(src: YamlSource) -> Any:
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


def from_project_yaml(src: YamlSource) -> list[Node]:
    try:
        spec = InventorySpec.model_validate(with_written_strings(src))
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
