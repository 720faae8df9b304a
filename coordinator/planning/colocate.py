"""Which nodes share a machine, and the barrier that measures them together. Pure: no I/O, no clock.

Calibration measures each node's speed to split the batch by it. Nodes on one machine (the local demo's two
`connection: local` nodes, two inventory entries with one address, the GPUs of one box) will train side by side,
sharing its cores, memory bandwidth and buses; measured one at a time, or out of phase (one compiling while the
other times its steps), each looks as fast as the machine alone, the split follows the noise of who happened to
run when (62.5/37.5 and 50/50 for two identical nodes in two cold calibrations) and the run is far slower than
predicted. So the benches of one group run in lockstep (`worker.bench --lockstep`): they time each batch size at
the same moment and keep loading the machine while the others still measure.

`compute_bench_groups` is facts in, groups out: a node's machine is named by its address (`connection: local`
and loopback addresses are this machine) and by the NVIDIA GPU UUIDs its facts list (globally unique: two
entries that see the same GPU are one box, whatever their addresses say). Nodes that share any of these are one
group. Extend it here (e.g. with a per-node GPU device) rather than in the I/O shell.

`Barrier` is the coordinator's half of the lockstep: members announce waits; once every member still measuring
waits, all are released together.

`pool_curves`: members of a group that are interchangeable (one machine, so one hardware fingerprint, and the same
python and environment) run at the same speed by symmetry; what their curves still disagree by is who the
scheduler favoured during a window (measured on a busy 2-core machine: 322 vs 2,960 tokens/s at one batch, the
other way round at the next). They get one curve, the mean rate at each batch all of them measured (the group's
throughput shared out), so two identical nodes split evenly, every time.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from coordinator.facts.model import NodeFacts
from coordinator.models import Connection, Node
from coordinator.planning.hostfile import has_cuda
from coordinator.planning.plan import CurvePoint, NodeCalibration

THIS_MACHINE = "this machine"


@dataclass(frozen=True)
class BenchGroup:
    """Nodes measured together (in inventory order); `machine` names what they share, for messages. `on_cpu`: every
    member computes on the machine's CPU (`computes_on_cpu`), so that members side by side each take an equal slice
    of its CPUs (`member_shares`), in their benches as in the run."""

    nodes: tuple[str, ...]
    machine: str
    on_cpu: bool = False

    @property
    def together(self) -> bool:
        return len(self.nodes) > 1

    def member_shares(self, present: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Node -> (index, count) of CPU slices for the members of `present` (those that will compute side by side:
        a run's nodes, or the benches measured together), in the group's order; {} unless the group computes on
        the CPU and two or more of its members are present."""
        members = [n for n in self.nodes if n in present]
        if not self.on_cpu or len(members) < 2:
            return {}
        return {node: (i, len(members)) for i, node in enumerate(members)}


def machine_of(node: Node) -> str:
    """The machine a node runs on, as far as its inventory entry says: this machine for `connection: local` and
    loopback addresses, else the address itself (lower case: host names are case-insensitive)."""
    if node.connection == Connection.LOCAL:
        return THIS_MACHINE
    host = node.host.strip().lower().strip("[]")
    if host == "localhost":
        return THIS_MACHINE
    try:
        if ipaddress.ip_address(host).is_loopback:
            return THIS_MACHINE
    except ValueError:
        pass
    return host


def _machine_keys(node: Node, facts: NodeFacts | None) -> list[str]:
    keys = [f"address:{machine_of(node)}"]
    if facts is not None and facts.gpu is not None:
        keys += [f"gpu:{d.uuid}" for d in facts.gpu.devices if d.uuid]
    return keys


def compute_bench_groups(nodes: Sequence[Node], facts: Mapping[str, NodeFacts]) -> tuple[BenchGroup, ...]:
    """Partition `nodes` into the groups whose benches run together: nodes sharing an address or a GPU (union of
    both relations). Groups come in the order of their first node, members in inventory order; a node alone on its
    machine is a group of one (measured as before: on its own)."""
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for key in _machine_keys(node, facts.get(node.name)):
            if key in owner:
                a, b = find(owner[key]), find(i)
                parent[max(a, b)] = min(a, b)
            else:
                owner[key] = i
    members: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        members.setdefault(find(i), []).append(i)
    return tuple(BenchGroup(tuple(nodes[i].name for i in idx), machine_of(nodes[idx[0]]),
                            on_cpu=all(computes_on_cpu(facts.get(nodes[i].name)) for i in idx))
                 for _, idx in sorted(members.items()))


class MemberState(StrEnum):
    RUNNING = "running"  # measuring or compiling: the others wait for it
    WAITING = "waiting"  # announced a wait (`ready` or `timed`): released with the others
    DONE = "done"  # printed its result or ended: nobody waits for it any more (it may still load the machine)


class Barrier:
    """The lockstep of one group. `wait(member)` and `finish(member)` return the members to release now (every
    waiting one, once no member is still running); `all_done` says when the group's lingering members can be told
    to stop (stdin closed). Members move in the same sequence of waits, so the ones released together are at the
    same point of their sweeps. Raises KeyError for a name outside the group."""

    def __init__(self, members: Sequence[str]) -> None:
        self.state = {m: MemberState.RUNNING for m in members}

    def wait(self, member: str) -> list[str]:
        if self.state[member] != MemberState.DONE:
            self.state[member] = MemberState.WAITING
        return self._release()

    def finish(self, member: str) -> list[str]:
        self.state[member] = MemberState.DONE
        return self._release()

    @property
    def all_done(self) -> bool:
        return all(s == MemberState.DONE for s in self.state.values())

    def _release(self) -> list[str]:
        if any(s == MemberState.RUNNING for s in self.state.values()):
            return []
        out = [m for m, s in self.state.items() if s == MemberState.WAITING]
        for m in out:
            self.state[m] = MemberState.RUNNING
        return out


def describe_shared(groups: Sequence[BenchGroup], planned: Sequence[str]) -> str | None:
    """The planned nodes that share a machine, in words (`local-a, local-b share this machine`), or None when every
    planned node has a machine of its own: where the run's step is rehearsed (`run/rehearse.py`)."""
    parts = []
    for group in groups:
        members = [n for n in group.nodes if n in planned]
        if len(members) > 1:
            parts.append(f"{', '.join(members)} share {group.machine}")
    return "; ".join(parts) or None


def computes_on_cpu(facts: NodeFacts | None) -> bool:
    """A Linux node without an NVIDIA GPU: MLX runs its ranks on the CPU. (A Mac's ranks run on its GPU through
    Metal; a node whose facts are unknown is left as it is.)"""
    return facts is not None and facts.os is not None and facts.os.system == "Linux" and not has_cuda(facts)


def cpu_shares(groups: Sequence[BenchGroup], ranks: Sequence[tuple[int, str]]) -> dict[int, tuple[int, int]]:
    """Rank -> (index, count) for the ranks that share a machine and compute on its CPU: each takes the index-th of
    `count` equal slices of the machine's CPUs (`worker.cpus`). Left to the scheduler, two such ranks meet on one
    core now and then: the demo ran 1.16x faster pinned, and steadier (docs/benchmarks.md). Calibration's lockstep
    benches take the same slices (`BenchGroup.member_shares`). `ranks`: (rank, node) of the run. Pure."""
    out: dict[int, tuple[int, int]] = {}
    for group in groups:
        members = sorted(rank for rank, node in ranks if node in group.nodes)
        if group.on_cpu and len(members) > 1:
            out.update({rank: (i, len(members)) for i, rank in enumerate(members)})
    return out


def pool_curves(calibrations: Sequence[NodeCalibration], kinds: Mapping[str, Hashable]) -> list[NodeCalibration]:
    """The calibrations of one group measured together, each member whose `kinds` value it shares with another
    given their pooled curve: at every batch all of them measured, the mean rate and the largest peak memory;
    `noisy` the union. Members alone of their kind (or with no batch in common) come back unchanged; order kept."""
    by_kind: dict[Hashable, list[NodeCalibration]] = {}
    for cal in calibrations:
        by_kind.setdefault(kinds[cal.node], []).append(cal)
    pooled: dict[str, NodeCalibration] = {}
    for same in by_kind.values():
        if len(same) < 2:
            continue
        common = sorted(set.intersection(*({p.batch for p in c.curve} for c in same)))
        if not common:
            continue
        points = []
        for batch in common:
            at = [next(p for p in c.curve if p.batch == batch) for c in same]
            points.append(CurvePoint(batch, sum(p.tokens_per_s for p in at) / len(at), max(p.peak_memory for p in at)))
        noisy = tuple(sorted({b for c in same for b in c.noisy}))
        fill = sum(c.fill for c in same) / len(same)
        for cal in same:
            pooled[cal.node] = replace(cal, curve=tuple(points), noisy=noisy, fill=fill)
    return [pooled.get(c.node, c) for c in calibrations]
