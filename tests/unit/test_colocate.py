"""Which nodes share a machine (facts in, groups out) and the lockstep barrier of their benches (values in, values
out), plus the bench's own half of the lockstep over a real pipe."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest

from coordinator.facts.model import CudaDevice, Gpu, NodeFacts, OsInfo
from coordinator.models import Connection, Node
from coordinator.planning.colocate import (
    THIS_MACHINE,
    Barrier,
    BenchGroup,
    compute_bench_groups,
    cpu_shares,
    machine_of,
)
from worker.bench import Lockstep


def ssh(name: str, host: str) -> Node:
    return Node(name=name, host=host)


def local(name: str) -> Node:
    return Node(name=name, host="127.0.0.1", connection=Connection.LOCAL)


def gpus(name: str, *uuids: str) -> NodeFacts:
    devices = tuple(CudaDevice(index=i, name="NVIDIA H100 80GB HBM3", uuid=u, memory_total_bytes=80 << 30,
                               memory_used_bytes=0, utilization_pct=0.0, driver_version="580", compute_cap="9.0")
                    for i, u in enumerate(uuids))
    return NodeFacts(node=name, gpu=Gpu(utilization_pct=0.0, devices=devices))


@pytest.mark.parametrize(("node", "machine"), [
    (local("a"), THIS_MACHINE),
    (ssh("a", "127.0.0.1"), THIS_MACHINE),
    (ssh("a", "127.0.1.1"), THIS_MACHINE),
    (ssh("a", "localhost"), THIS_MACHINE),
    (ssh("a", "::1"), THIS_MACHINE),
    (ssh("a", "Studio.Local"), "studio.local"),
    (ssh("a", "10.0.0.2"), "10.0.0.2"),
])
def test_machine_of(node: Node, machine: str) -> None:
    assert machine_of(node) == machine


def test_the_local_demo_is_one_group() -> None:
    groups = compute_bench_groups([local("local-a"), local("local-b")], {})
    assert groups == (BenchGroup(("local-a", "local-b"), THIS_MACHINE),)  # facts unknown: not known to be CPUs
    assert groups[0].together


def test_entries_with_one_address_are_one_group_and_others_alone() -> None:
    nodes = [ssh("m1", "10.0.0.1"), ssh("m2a", "10.0.0.2"), ssh("m3", "10.0.0.3"), ssh("m2b", "10.0.0.2")]
    groups = compute_bench_groups(nodes, {})
    assert groups == (BenchGroup(("m1",), "10.0.0.1"), BenchGroup(("m2a", "m2b"), "10.0.0.2"),
                      BenchGroup(("m3",), "10.0.0.3"))
    assert [g.together for g in groups] == [False, True, False]


def test_a_shared_gpu_joins_entries_whose_addresses_differ() -> None:
    """One box named twice (its IP and its host name), each entry seeing the box's GPUs: their UUIDs are
    globally unique, so the entries are one machine; a box with other GPUs is not."""
    nodes = [ssh("box-gpu0", "10.0.0.5"), ssh("box-gpu1", "gpubox"), ssh("other", "10.0.0.6")]
    facts = {"box-gpu0": gpus("box-gpu0", "GPU-aaa", "GPU-bbb"), "box-gpu1": gpus("box-gpu1", "GPU-aaa", "GPU-bbb"),
             "other": gpus("other", "GPU-ccc")}
    groups = compute_bench_groups(nodes, facts)
    assert [g.nodes for g in groups] == [("box-gpu0", "box-gpu1"), ("other",)]


def test_groups_chain_through_shared_keys() -> None:
    """a shares an address with b, b a GPU with c: all three are one machine (a union, not pairs)."""
    nodes = [ssh("a", "10.0.0.1"), ssh("c", "10.0.0.9"), ssh("b", "10.0.0.1")]
    facts = {"b": gpus("b", "GPU-x"), "c": gpus("c", "GPU-x")}
    assert [g.nodes for g in compute_bench_groups(nodes, facts)] == [("a", "c", "b")]


def test_barrier_releases_everyone_once_nobody_is_running() -> None:
    b = Barrier(["a", "b", "c"])
    assert b.wait("a") == []
    assert b.wait("b") == []
    assert b.wait("c") == ["a", "b", "c"]  # the same point for all: timed together
    assert b.wait("b") == []  # b finished timing first: it waits (loading the machine) for the others
    assert b.finish("a") == []  # a's sweep stopped: nobody waits for it any more
    assert b.wait("c") == ["b", "c"]
    assert not b.all_done
    assert b.finish("b") == [] and b.wait("c") == ["c"]  # alone at last: released at once
    assert b.finish("c") == [] and b.all_done


def test_barrier_a_member_that_dies_releases_the_waiting() -> None:
    b = Barrier(["a", "b"])
    assert b.wait("a") == []
    assert b.finish("b") == ["a"]  # b's bench failed: a does not wait for it forever
    assert b.wait("a") == ["a"]
    with pytest.raises(KeyError):
        b.wait("stranger")


def test_bench_lockstep_waits_for_a_line_keeps_busy_and_ends_at_eof() -> None:
    read_fd, write_fd = os.pipe()
    logged: list[str] = []
    with os.fdopen(read_fd, "r") as reader, os.fdopen(write_fd, "w") as writer:
        gate = Lockstep(reader, logged.append)
        returned = threading.Event()

        def idle_wait() -> None:
            gate.wait("ready batch=1")
            returned.set()

        thread = threading.Thread(target=idle_wait)
        thread.start()
        assert not returned.wait(0.2)  # blocked: no line yet (a hang guard, not a timing claim)
        writer.write("go\n")
        writer.flush()
        thread.join(30)
        assert returned.is_set() and logged == ["bench lockstep ready batch=1"]

        steps: list[int] = []

        def busy() -> bool:  # one untimed step; at the third the coordinator's line arrives
            steps.append(1)
            if len(steps) == 3:
                writer.write("go\n")
                writer.flush()
                for _ in range(6000):  # until the reader thread has it queued (a hang guard, not a timing claim)
                    if gate.lines.qsize():
                        break
                    time.sleep(0.005)
            return True

        gate.wait("timed batch=1", busy)
        assert len(steps) == 3  # stepped until the line came, then returned
        assert not gate.ended
        count = len(steps)
        gate.wait("done", lambda: False)  # busy says stop: the wait ends without a line
        assert len(steps) == count
    # stdin at its end: every later wait returns at once
    r2, w2 = os.pipe()
    os.close(w2)
    with os.fdopen(r2, "r") as closed:
        ended = Lockstep(closed, logged.append)
        ended.wait("ready batch=2")
        assert ended.ended
        ended.wait("ready batch=4")  # no block, no log
        assert logged[-1] == "bench lockstep ready batch=2"


def test_a_reused_noisy_calibration_says_so_and_how_to_measure_again() -> None:
    from coordinator.planning.plan import CurvePoint, NodeCalibration
    from coordinator.run.calibrate import describe_reuse

    clean = NodeCalibration(node="a", curve=(CurvePoint(1, 100.0, 10), CurvePoint(2, 180.0, 12)), matmul_gflops=1.0,
                            memory_limit=None, cached=True)
    assert describe_reuse(clean) == ""
    noisy = NodeCalibration(node="a", curve=clean.curve, matmul_gflops=1.0, memory_limit=None, cached=True,
                            noisy=(1, 2))
    text = describe_reuse(noisy)
    assert "NOISY" in text and "batch 1, 2" in text and "--recalibrate" in text


def test_the_cache_key_names_the_nodes_measured_beside() -> None:
    from coordinator.run.calibrate import BenchSpec, NodeFingerprint, compute_cache_key

    fp = NodeFingerprint(chip="c", model_id=None, memory_bytes=1, cpu_count=2, gpu_cores=None, os_version="l",
                         mlx_version="0.32.4")
    spec = BenchSpec(model="m", seq_len=32, method="lora")
    alone = compute_cache_key("a", fp, spec, "d")
    assert compute_cache_key("a", fp, spec, "d", together=()) == alone  # keys of nodes alone are unchanged
    beside_b = compute_cache_key("a", fp, spec, "d", together=("b",))
    assert beside_b != alone
    assert compute_cache_key("a", fp, spec, "d", together=("c", "b")) == compute_cache_key(
        "a", fp, spec, "d", together=("b", "c")) != beside_b
    # measured each on its own slice of the CPUs is not measured left to the scheduler
    assert compute_cache_key("a", fp, spec, "d", together=("b",), pinned=True) != beside_b


def test_interchangeable_members_share_one_curve_the_mean_of_theirs() -> None:
    """Two identical nodes of one machine measured in lockstep on a busy machine: the scheduler favoured a at one
    batch and b at the next (the demo's recorded numbers). Pooled, they split evenly; a third kind is untouched."""
    from coordinator.planning.colocate import pool_curves
    from coordinator.planning.plan import CurvePoint, NodeCalibration, compute_plan

    def cal(node: str, *points: tuple[int, float, int], noisy: tuple[int, ...] = ()) -> NodeCalibration:
        return NodeCalibration(node=node, curve=tuple(CurvePoint(*p) for p in points), matmul_gflops=1.0,
                               memory_limit=None, seq_len=128, noisy=noisy)

    a = cal("a", (1, 1264.0, 100), (2, 2588.0, 110), (4, 322.0, 200), (8, 3355.0, 300), (16, 3353.0, 600), noisy=(1,))
    b = cal("b", (1, 142.0, 100), (2, 282.0, 120), (4, 2960.0, 200), (8, 648.0, 310), noisy=(4,))
    other = cal("gpu", (1, 9000.0, 100))
    before = compute_plan([a, b], 8, seq_len=128)
    assert before.batch != {"a": 4, "b": 4}  # the noise decides the split
    pa, pb, po = pool_curves([a, b, other], {"a": "cpu", "b": "cpu", "gpu": "other"})
    assert po is other
    assert pa.curve == pb.curve == (CurvePoint(1, 703.0, 100), CurvePoint(2, 1435.0, 120), CurvePoint(4, 1641.0, 200),
                                    CurvePoint(8, 2001.5, 310))  # batch 16: only a measured it
    assert pa.noisy == pb.noisy == (1, 4) and (pa.node, pb.node) == ("a", "b")
    assert compute_plan([pa, pb], 8, seq_len=128).batch == {"a": 4, "b": 4}
    assert pool_curves([a, b], {"a": "cpu", "b": "other cpu"}) == [a, b]  # different kinds: untouched


def on(system: str, name: str, *uuids: str) -> NodeFacts:
    facts = gpus(name, *uuids) if uuids else NodeFacts(node=name)
    return replace(facts, os=OsInfo(system=system, arch="x86_64", kernel="6", name=system, version="1"))


def test_ranks_that_share_a_cpu_machine_take_equal_slices_of_it() -> None:
    """The demo's two local ranks and two on one Linux address: a slice each, in rank order. Alone on a machine,
    on a GPU (CUDA or a Mac's Metal) or with unknown facts: left to the scheduler."""
    nodes = [local("a"), local("b"), ssh("c", "10.0.0.2"), ssh("d", "10.0.0.2"), ssh("e", "10.0.0.3")]
    facts = {n.name: on("Linux", n.name) for n in nodes}
    ranks = [(0, "a"), (1, "c"), (2, "b"), (3, "d"), (4, "e")]
    groups = compute_bench_groups(nodes, facts)
    assert cpu_shares(groups, ranks) == {0: (0, 2), 2: (1, 2), 1: (0, 2), 3: (1, 2)}
    assert cpu_shares(groups, [(0, "a"), (1, "e")]) == {}  # b is not in this run: a is alone
    macs = {**facts, "a": on("Darwin", "a"), "b": on("Darwin", "b")}
    assert cpu_shares(compute_bench_groups(nodes, macs), ranks) == {1: (0, 2), 3: (1, 2)}
    unknown = {k: v for k, v in facts.items() if k != "b"}
    assert cpu_shares(compute_bench_groups(nodes, unknown), ranks) == {1: (0, 2), 3: (1, 2)}
    box = [ssh("gpu0", "10.0.0.9"), ssh("gpu1", "10.0.0.9")]
    cuda = {"gpu0": on("Linux", "gpu0", "GPU-1"), "gpu1": on("Linux", "gpu1", "GPU-2")}
    assert cpu_shares(compute_bench_groups(box, cuda), [(0, "gpu0"), (1, "gpu1")]) == {}
    # Calibration's lockstep benches take the same slices: the members measured together, in the group's order.
    g = groups[0]
    assert g.nodes == ("a", "b") and g.on_cpu
    assert g.member_shares(["a", "b"]) == {"a": (0, 2), "b": (1, 2)} and g.member_shares(["b"]) == {}
    assert compute_bench_groups(nodes, macs)[0].member_shares(["a", "b"]) == {}
