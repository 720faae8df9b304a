"""Which peers each node's probe must reach: the full mesh for small fleets and jaccl, ring neighbours beyond."""

from __future__ import annotations

import pytest

from coordinator.facts.topology import FULL_MESH_MAX_NODES, reach_peers


@pytest.mark.parametrize("backend", ["ring", "jaccl", "jaccl-ring", "auto"])
def test_a_small_fleet_probes_every_pair(backend: str) -> None:
    names = [f"n{i}" for i in range(FULL_MESH_MAX_NODES)]
    peers = reach_peers(names, backend)
    assert all(peers[n] == [p for p in names if p != n] for n in names)


def test_a_large_ring_fleet_probes_neighbours_at_distance_one_and_two_wrapping_around() -> None:
    names = [f"n{i}" for i in range(FULL_MESH_MAX_NODES + 1)]
    peers = reach_peers(names, "ring")
    last = names[-1]
    assert peers["n0"] == [names[-2], last, "n1", "n2"]
    assert peers[last] == [names[-3], names[-2], "n0", "n1"]
    # Symmetric: whoever probes a peer is probed back, so a broken link shows on both ends.
    assert all(a in peers[b] for a in names for b in peers[a])
    assert sum(len(p) for p in peers.values()) == 4 * len(names)  # O(n), not n^2


def test_a_large_jaccl_mesh_still_probes_every_pair() -> None:
    names = [f"n{i}" for i in range(FULL_MESH_MAX_NODES + 5)]
    assert all(len(p) == len(names) - 1 for p in reach_peers(names, "jaccl").values())


@pytest.mark.parametrize("n", [0, 1, 2])
def test_tiny_fleets(n: int) -> None:
    names = [f"n{i}" for i in range(n)]
    assert reach_peers(names, "ring") == {name: [p for p in names if p != name] for name in names}
