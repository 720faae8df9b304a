"""An MLX hostfile (JSON) as an inventory, list or dict form (see the package docstring)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError

from coordinator.config.inventory.fields import IpAddress, Strict, check_host, check_user, one_or_many
from coordinator.config.yamlsrc import (
    KeyPath,
    YamlSource,
    check_env_name,
    config_error_from_validation,
    format_value,
)
from coordinator.models import LOCAL_HOST, Connection, Node


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


class HostfileHost(Strict):
    """One host of an MLX hostfile (mlx `Host`: ssh, ips, rdma)."""

    ssh: Annotated[str, BeforeValidator(_check_ssh_target)]
    ips: Annotated[tuple[IpAddress, ...], BeforeValidator(one_or_many)] = ()
    rdma: list[Any] = Field(default_factory=list)  # accepted, not kept: the coordinator derives RDMA devices


class HostfileSpec(Strict):
    """An MLX hostfile in dict form (the list form is `hosts` alone)."""

    backend: str = ""  # accepted, not kept: the playbook chooses the backend
    envs: list[Annotated[str, BeforeValidator(_check_env_assignment)]] = Field(default_factory=list)
    hosts: Annotated[list[HostfileHost], Field(min_length=1)]


def sanitise_name(raw: str) -> str:
    """A node name from a host: characters outside [A-Za-z0-9_.-] become '-', leading '-'/'.' are dropped."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).lstrip("-.")
    return name or "node"


def from_hostfile(src: YamlSource) -> list[Node]:
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
