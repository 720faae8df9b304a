"""Thunderbolt topology between job nodes, derived from each Mac's SPThunderboltDataType facts.

A link exists from node A to node B when one of A's Thunderbolt ports lists, as its connected peer, a bus
domain UUID that belongs to B (the same rule mlx.distributed_config uses). The port's receptacle maps to the
`enX` interface through `networksetup` ("Thunderbolt N" with N = receptacle id: NOT sequential, pitfall 4),
and `rdma_enX` is the RDMA device behind it. Pure functions only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.facts.model import NodeFacts, ThunderboltPort


@dataclass(frozen=True)
class Link:
    src: str  # node name
    dst: str  # peer node name
    port: ThunderboltPort
    interface: str | None  # enX on src behind the port; None when networksetup did not map it

    @property
    def speed_gbps(self) -> float | None:
        return self.port.speed_gbps

    @property
    def rdma_device(self) -> str | None:
        return f"rdma_{self.interface}" if self.interface else None


def own_domains(facts: NodeFacts) -> set[str]:
    return {p.domain_uuid for p in facts.thunderbolt or () if p.domain_uuid}


def interface_for_receptacle(facts: NodeFacts, receptacle: str | None) -> str | None:
    if receptacle is None:
        return None
    for hp in facts.hardware_ports or ():
        if hp.thunderbolt_receptacle == receptacle:
            return hp.device
    return None


def compute_links(facts: Mapping[str, NodeFacts]) -> list[Link]:
    """Every directed Thunderbolt link between the given nodes, in node order."""
    owner: dict[str, str] = {}
    for name, f in facts.items():
        for uuid in own_domains(f):
            owner[uuid] = name
    links: list[Link] = []
    for name, f in facts.items():
        for port in f.thunderbolt or ():
            peer = owner.get(port.peer_domain_uuid or "")
            if port.connected and peer is not None and peer != name:
                links.append(Link(name, peer, port, interface_for_receptacle(f, port.receptacle)))
    return links


def links_between(links: list[Link], src: str, dst: str) -> list[Link]:
    return [link for link in links if link.src == src and link.dst == dst]


def required_pairs(names: list[str], backend: str) -> list[tuple[str, str]]:
    """Pairs of nodes that must be joined directly: all pairs for a jaccl mesh, ring neighbours
    (in inventory order, which is rank order) for jaccl-ring."""
    if len(names) < 2:
        return []
    if backend == "jaccl-ring":
        pairs = {tuple(sorted((names[i], names[(i + 1) % len(names)]))) for i in range(len(names))}
        return sorted((a, b) for a, b in pairs)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]


# Up to this many nodes every node probes every other one (32 peers each): cheap, and it proves any rank order
# works, including the order left after a node is quarantined.
FULL_MESH_MAX_NODES = 33
RING_REACH_DISTANCE = 2  # above that, the ring neighbours at distance 1 and 2 on either side


def reach_peers(names: Sequence[str], backend: str) -> dict[str, list[str]]:
    """The peers each node's probe must reach on the data plane, in inventory (= rank) order.

    A ring rank only ever talks to its two neighbours, so for a large fleet probing every pair is N^2 work (a
    million probes and entries at 1,000 nodes) that proves nothing the job needs. Above FULL_MESH_MAX_NODES a
    node probes its ring neighbours at distance 1 and 2: distance 2 is the ring that forms when one node
    between them is dropped (elastic shrink). A `jaccl` mesh joins every pair directly, so it is always
    probed in full."""
    n = len(names)
    if n <= FULL_MESH_MAX_NODES or backend == "jaccl":
        return {name: [p for p in names if p != name] for name in names}
    out: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        near = [names[(i + d) % n] for d in range(-RING_REACH_DISTANCE, RING_REACH_DISTANCE + 1) if d != 0]
        out[name] = list(dict.fromkeys(p for p in near if p != name))
    return out
