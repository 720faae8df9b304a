"""MLX's JSON hostfile, built from the inventory and the nodes' facts. Pure.

Contract (mlx/_distributed_utils/common.py `Hostfile`): `{"backend", "envs": ["K=V"], "hosts": [{"ssh", "ips",
"rdma"}]}`, rank = position. `ring` needs IPs (not hostnames). For jaccl / jaccl-ring, host i's `rdma[j]` is
the device on host i that reaches host j (null for itself, a list when several cables join a pair), derived
from the Thunderbolt topology facts. `nccl` (NVIDIA GPUs) needs rank 0's IP reachable by all; a node with several GPUs
has one entry per GPU (its rank nodes, `coordinator.planning.gpuranks`), all with the machine's `ssh` and IPs:
mlx.launch would give each `CUDA_VISIBLE_DEVICES=0`, the rank script sets the rank's own.

The `ssh` field is the node's *name*: mlx.launch runs the plain `ssh` on PATH, and the launch writes an
ssh_config whose `Host <name>` entries carry the inventory's user, port, identity and known_hosts (so the
launch uses exactly the credentials the preflight verified). Local nodes are the literal `127.0.0.1`, the
only host mlx.launch starts without ssh.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import ConfigError
from coordinator.facts.model import NodeFacts
from coordinator.facts.topology import compute_links, links_between, required_pairs
from coordinator.models import LOCAL_HOST, Connection, Node

BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")


@dataclass(frozen=True)
class HostEntry:
    ssh: str
    ips: tuple[str, ...] = ()
    rdma: tuple[str | list[str] | None, ...] = ()


@dataclass(frozen=True)
class Hostfile:
    backend: str
    hosts: tuple[HostEntry, ...]
    envs: tuple[str, ...] = field(default=())

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Hostfile:
        return cls(backend=str(data.get("backend", "")), envs=tuple(data.get("envs") or ()),
                   hosts=tuple(HostEntry(str(h["ssh"]), tuple(h.get("ips") or ()), tuple(h.get("rdma") or ()))
                               for h in data.get("hosts") or ()))

    def to_json(self) -> dict[str, Any]:
        hosts: list[dict[str, Any]] = []
        for h in self.hosts:
            entry: dict[str, Any] = {"ssh": h.ssh, "ips": list(h.ips)}
            if h.rdma:
                entry["rdma"] = list(h.rdma)
            hosts.append(entry)
        return {"backend": self.backend, "envs": list(self.envs), "hosts": hosts}


def ssh_name(node: Node) -> str:
    """The hostfile's `ssh`: the machine's ssh_config alias (a rank node's is its machine's), or 127.0.0.1."""
    return LOCAL_HOST if node.connection is Connection.LOCAL else node.machine_name


def has_cuda(facts: NodeFacts) -> bool:
    """The node has an NVIDIA GPU (nvidia-smi listed one): what `backend: nccl` needs."""
    return facts.gpu is not None and facts.gpu.cuda


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def resolve_backend(backend: str, facts: Mapping[str, NodeFacts], nodes: Sequence[Node]) -> str:
    """`auto`: nccl when every node has an NVIDIA GPU (as mlx.launch's own default on CUDA), jaccl when every pair
    of nodes has an active RDMA link, jaccl-ring when the ring neighbours do, else ring."""
    if backend != "auto":
        return backend
    if len(nodes) < 2 or any(n.name not in facts for n in nodes):
        return "ring"
    if all(has_cuda(facts[n.name]) for n in nodes):
        return "nccl"
    names = [n.name for n in nodes]
    for candidate in ("jaccl", "jaccl-ring"):
        if _rdma_matrix(names, facts, candidate, strict=False) is not None:
            return candidate
    return "ring"


def _rdma_matrix(
    names: list[str], facts: Mapping[str, NodeFacts], backend: str, *, strict: bool
) -> list[list[str | list[str] | None]] | None:
    links = compute_links({n: facts[n] for n in names if n in facts})
    needed = {frozenset(p) for p in required_pairs(names, backend)}
    matrix: list[list[str | list[str] | None]] = []
    for i, src in enumerate(names):
        row: list[str | list[str] | None] = []
        rdma = facts[src].rdma if src in facts else None
        active = {d.name for d in (rdma.devices if rdma is not None else ()) if d.port_state == "PORT_ACTIVE"}
        for j, dst in enumerate(names):
            if i == j:
                row.append(None)
                continue
            devices = [lk.rdma_device for lk in links_between(links, src, dst)
                       if lk.rdma_device and lk.rdma_device in active]
            uniq = sorted({d for d in devices if d})
            if not uniq and frozenset((src, dst)) in needed:
                if strict:
                    raise ConfigError(f"no active RDMA device on {src} reaches {dst}: run `coordinator preflight` "
                                      "(rdma and thunderbolt checks) for the fix")
                return None
            row.append(None if not uniq else uniq[0] if len(uniq) == 1 else list(uniq))
        matrix.append(row)
    return matrix


def build_hostfile(
    nodes: Sequence[Node],
    backend: str,
    facts: Mapping[str, NodeFacts] | None = None,
    *,
    envs: Sequence[str] = (),
) -> Hostfile:
    """The hostfile for `nodes` in rank order. Raises ConfigError when the backend's needs are not met."""
    facts = facts or {}
    if not nodes:
        raise ConfigError("no nodes to put in the hostfile")
    backend = resolve_backend(backend, facts, nodes)
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or auto")
    entries: list[HostEntry] = []
    for node in nodes:
        ips = tuple(node.ips) if node.ips else ((node.host,) if _is_ip(node.host) else ())
        if node.connection is Connection.LOCAL:
            ips = ips or (LOCAL_HOST,)
        if backend == "ring" and not ips:
            raise ConfigError(f"node {node.name}: the ring backend needs an IP address (`ips:` in the inventory), "
                              f"not the hostname {node.host!r}", path=node.source)
        entries.append(HostEntry(ssh=ssh_name(node), ips=ips))
    if backend in ("jaccl", "jaccl-ring"):
        names = [n.name for n in nodes]
        matrix = _rdma_matrix(names, facts, backend, strict=True)
        assert matrix is not None
        entries = [HostEntry(e.ssh, e.ips, tuple(row)) for e, row in zip(entries, matrix, strict=True)]
    if backend in ("nccl", "jaccl", "jaccl-ring") and not entries[0].ips:
        raise ConfigError(f"rank 0 ({nodes[0].name}) needs an IP reachable from all other ranks (`ips:`)")
    return Hostfile(backend=backend, hosts=tuple(entries), envs=tuple(envs))
