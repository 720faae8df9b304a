"""Hostfiles for ring / jaccl / jaccl-ring / nccl, each round-tripped through MLX's own Hostfile parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx._distributed_utils.common import Hostfile as MlxHostfile

from coordinator.errors import ConfigError
from coordinator.facts.linux import parse_nvidia_smi
from coordinator.facts.model import HardwarePort, NodeFacts, Rdma, RdmaDevice, ThunderboltPort
from coordinator.models import Connection, Node
from coordinator.planning.hostfile import build_hostfile, resolve_backend


def mac(name: str, own: list[tuple[str, str, str | None, float]], ports: dict[str, str],
        active: list[str]) -> NodeFacts:
    """own: (receptacle, own domain uuid, peer domain uuid, speed)."""
    tb = tuple(ThunderboltPort(bus=f"bus{r}", domain_uuid=d, receptacle=r, connected=p is not None,
                               speed_gbps=s if p else None, max_speed_gbps=None if p else 120.0,
                               peer_domain_uuid=p) for r, d, p, s in own)
    hp = tuple(HardwarePort(f"Thunderbolt {r}", dev) for r, dev in ports.items())
    rdma = Rdma("enabled", tuple(RdmaDevice(f"rdma_{dev}", "PORT_ACTIVE" if f"rdma_{dev}" in active else "PORT_DOWN")
                                 for dev in ports.values()))
    return NodeFacts(node=name, thunderbolt=tb, hardware_ports=hp, rdma=rdma)


def three_mesh() -> dict[str, NodeFacts]:
    # a-b over a.1/b.1, a-c over a.2/c.1, b-c over b.2/c.2
    return {
        "a": mac("a", [("1", "A1", "B1", 80), ("2", "A2", "C1", 80)], {"1": "en2", "2": "en3"}, ["rdma_en2", "rdma_en3"]),
        "b": mac("b", [("1", "B1", "A1", 80), ("2", "B2", "C2", 80)], {"1": "en4", "2": "en5"}, ["rdma_en4", "rdma_en5"]),
        "c": mac("c", [("1", "C1", "A2", 80), ("2", "C2", "B2", 80)], {"1": "en6", "2": "en7"}, ["rdma_en6", "rdma_en7"]),
    }


NODES = [Node(name=n, host=f"{n}.lan", ips=(f"10.0.0.{i + 1}",), user="mlx") for i, n in enumerate("abc")]


def roundtrip(hf, tmp_path: Path) -> MlxHostfile:
    path = tmp_path / "hostfile.json"
    path.write_text(json.dumps(hf.to_json()))
    return MlxHostfile.from_file(str(path))


def test_ring_hostfile_round_trips(tmp_path: Path) -> None:
    hf = build_hostfile(NODES, "ring", envs=["TOKENIZERS_PARALLELISM=false"])
    parsed = roundtrip(hf, tmp_path)
    assert parsed.backend == "ring"
    assert [h.ssh_hostname for h in parsed.hosts] == ["a", "b", "c"]
    assert [h.ips for h in parsed.hosts] == [["10.0.0.1"], ["10.0.0.2"], ["10.0.0.3"]]
    assert parsed.envs == ["TOKENIZERS_PARALLELISM=false"]


def test_ring_needs_ips_not_hostnames() -> None:
    with pytest.raises(ConfigError, match="needs an IP"):
        build_hostfile([Node(name="a", host="mac.local")], "ring")


def test_local_nodes_are_literal_loopback(tmp_path: Path) -> None:
    nodes = [Node(name=n, host="localhost", connection=Connection.LOCAL) for n in ("x", "y")]
    parsed = roundtrip(build_hostfile(nodes, "ring"), tmp_path)
    assert [h.ssh_hostname for h in parsed.hosts] == ["127.0.0.1", "127.0.0.1"]
    assert all(h.ips == ["127.0.0.1"] for h in parsed.hosts)


def test_jaccl_mesh_matrix_from_topology(tmp_path: Path) -> None:
    parsed = roundtrip(build_hostfile(NODES, "jaccl", three_mesh()), tmp_path)
    assert [h.rdma for h in parsed.hosts] == [
        [None, "rdma_en2", "rdma_en3"],
        ["rdma_en4", None, "rdma_en5"],
        ["rdma_en6", "rdma_en7", None],
    ]


def test_jaccl_missing_link_is_a_clear_error() -> None:
    facts = three_mesh()
    facts["c"] = mac("c", [("1", "C1", "A2", 80)], {"1": "en6"}, ["rdma_en6"])
    facts["b"] = mac("b", [("1", "B1", "A1", 80)], {"1": "en4"}, ["rdma_en4"])
    with pytest.raises(ConfigError, match=r"b reaches c|c reaches b"):
        build_hostfile(NODES, "jaccl", facts)
    # ... but a ring a-b-c-a also lacks b-c: jaccl-ring needs neighbours (a,b), (b,c), (c,a).
    with pytest.raises(ConfigError):
        build_hostfile(NODES, "jaccl-ring", facts)


def test_inactive_port_does_not_count() -> None:
    facts = three_mesh()
    facts["a"] = mac("a", [("1", "A1", "B1", 80), ("2", "A2", "C1", 80)], {"1": "en2", "2": "en3"}, ["rdma_en2"])
    with pytest.raises(ConfigError, match="a reaches c"):
        build_hostfile(NODES, "jaccl", facts)


def test_auto_resolves_by_topology() -> None:
    assert resolve_backend("auto", three_mesh(), NODES) == "jaccl"
    assert resolve_backend("auto", {}, NODES) == "ring"
    two = three_mesh()
    del two["c"]
    assert resolve_backend("auto", two, NODES[:2]) == "jaccl"


def test_nccl_round_trips(tmp_path: Path) -> None:
    parsed = roundtrip(build_hostfile(NODES[:2], "nccl"), tmp_path)
    assert parsed.backend == "nccl" and parsed.hosts[0].ips == ["10.0.0.1"]


def cuda_node(name: str) -> NodeFacts:
    return NodeFacts(node=name, gpu=parse_nvidia_smi(
        "0, NVIDIA H100 80GB HBM3, GPU-1, 81559, 0, 0, 580.159.04, 9.0\n"))


def test_nccl_hostfile_for_a_cuda_fleet_is_what_mlx_launch_accepts(tmp_path: Path) -> None:
    """The dict form with backend nccl, the job env, and rank 0's IP first (mlx.launch's launch_nccl refuses a
    rank 0 without IPs: `Rank 0 should have an IP reachable from all other ranks`)."""
    hf = build_hostfile(NODES, "nccl", {n.name: cuda_node(n.name) for n in NODES},
                        envs=["TOKENIZERS_PARALLELISM=false"])
    parsed = roundtrip(hf, tmp_path)
    assert parsed.backend == "nccl" and parsed.envs == ["TOKENIZERS_PARALLELISM=false"]
    assert [(h.ssh_hostname, h.ips) for h in parsed.hosts] == [("a", ["10.0.0.1"]), ("b", ["10.0.0.2"]),
                                                              ("c", ["10.0.0.3"])]
    assert all(h.rdma == [] for h in parsed.hosts)  # no RDMA matrix: NCCL finds its own transports
    local = build_hostfile([Node(name="gpu", host="localhost", connection=Connection.LOCAL)], "nccl")
    assert roundtrip(local, tmp_path).hosts[0].ips == ["127.0.0.1"]


def test_auto_picks_nccl_when_every_node_has_an_nvidia_gpu() -> None:
    gpus = {n.name: cuda_node(n.name) for n in NODES}
    assert resolve_backend("auto", gpus, NODES) == "nccl"
    assert resolve_backend("auto", {**gpus, "c": NodeFacts(node="c")}, NODES) == "ring"  # c has none
    assert resolve_backend("auto", {"a": gpus["a"]}, NODES[:1]) == "ring"  # one node
