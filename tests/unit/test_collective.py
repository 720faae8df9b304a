"""The gradient exchange's cost in the plan (coordinator/planning/collective.py, plan.with_collective) and the
node side's pure parts (worker/collbench.py): values in, values out."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

from coordinator.errors import CoordinatorError
from coordinator.fleet.transport import Fleet
from coordinator.models import Connection, Node
from coordinator.planning.collective import (
    CollectiveCost,
    CollectiveError,
    CostSource,
    GradientSize,
    build_rank_starts,
    compute_collective_key,
    derive_collective,
    fit_ring,
    parse_collbench,
    parse_gradient_size,
    ports_needed,
    rescale_collective,
    ring_allreduce_s,
)
from coordinator.planning.hostfile import HostEntry, Hostfile
from coordinator.planning.plan import (
    CurvePoint,
    NodeCalibration,
    compute_plan,
    describe_prediction,
    describe_step,
    with_collective,
)
from coordinator.run.calibrate import NodeFingerprint
from coordinator.run.collective import measure_collective
from worker.collbench import parse_elements, plan_buckets, samples_for
from worker.exchange import bucket_bytes_for

MB = 1_000_000


# --- the ring model ---------------------------------------------------------------------------------------------


def test_ring_model_moves_2_n_minus_1_over_n_of_the_bytes_and_pays_2_n_minus_1_hops() -> None:
    # 3 ranks, 600 MB over a 100 MB/s link, 1 ms a hop: 2*2/3*600/100 = 8 s + 4 hops * 1 ms
    assert ring_allreduce_s(600 * MB, 3, 100 * MB, 0.001) == pytest.approx(8.004)
    # 2 ranks: each sends half its bytes twice (reduce-scatter then all-gather) = the bytes once
    assert ring_allreduce_s(100 * MB, 2, 100 * MB, 0.0) == pytest.approx(1.0)
    # the bandwidth term tends to 2x the bytes as the ring grows; the latency term grows linearly
    assert ring_allreduce_s(100 * MB, 1000, 100 * MB, 0.0) == pytest.approx(1.998)
    assert ring_allreduce_s(0, 8, 1.0, 0.5) == pytest.approx(7.0)
    assert ring_allreduce_s(10**9, 1, 1.0, 1.0) == 0.0  # one rank exchanges nothing


def test_ring_model_refuses_nonsense() -> None:
    for args in ((1, 2, 0.0, 0.0), (1, 2, -5.0, 0.0), (1, 2, math.inf, 0.0), (-1, 2, 1.0, 0.0), (1, 2, 1.0, -1.0),
                 (1, 0, 1.0, 0.0)):
        with pytest.raises(CollectiveError):
            ring_allreduce_s(*args)


def test_fit_inverts_the_model_from_two_sizes() -> None:
    big = ring_allreduce_s(552_196, 3, 25 * MB, 0.0004)
    small = ring_allreduce_s(4, 3, 25 * MB, 0.0004)
    bandwidth, latency = fit_ring(552_196, 3, big, small)
    assert bandwidth == pytest.approx(25 * MB, rel=1e-4) and latency == pytest.approx(0.0004, rel=1e-3)
    # all latency (a small gradient, or noise): no bandwidth to read
    assert fit_ring(64, 2, 0.004, 0.004) == (None, pytest.approx(0.002))
    with pytest.raises(CollectiveError):
        fit_ring(64, 1, 0.1, 0.01)


def test_derived_exchange_follows_the_model_and_says_so() -> None:
    grads = GradientSize((("float32", 138_048),))
    cost = derive_collective(grads, ["a", "b", "c"], "ring", 25 * MB, 0.0005)
    assert cost.source is CostSource.DERIVED and cost.ranks == 3 and cost.nbytes == 4 * 138_049
    assert cost.seconds == pytest.approx(4 / 3 * cost.nbytes / (25 * MB) + 4 * 0.0005)
    assert cost.model == (pytest.approx(25 * MB, rel=1e-6), pytest.approx(0.0005))


# --- what is exchanged --------------------------------------------------------------------------------------------


def test_gradient_size_counts_every_dtype_and_the_loss() -> None:
    grads = parse_gradient_size({"bfloat16": 1000, "float32": 10})
    assert grads is not None
    assert grads.exchanged() == {"bfloat16": 1000, "float32": 11}  # the loss rides in float32
    assert grads.nbytes == 2 * 1000 + 4 * 11
    assert grads.to_arg() == "bfloat16:1000,float32:11"
    only_bf16 = GradientSize((("bfloat16", 8),))
    assert only_bf16.to_arg() == "bfloat16:8,float32:1" and only_bf16.nbytes == 20
    for bad in (None, {}, {"complex64": 3}, {"float32": -1}, {"float32": 1.5}, ["float32", 3]):
        assert parse_gradient_size(bad) is None


def test_collbench_buckets_match_the_runs_all_sum_buckets() -> None:
    assert parse_elements("float32:10,bfloat16:4") == {"float32": 10, "bfloat16": 4}
    for bad in ("", "float32", "int4:3", "float32:x", "float32:0"):
        with pytest.raises(ValueError):
            parse_elements(bad)
    # the device's buckets (32 MiB on the CPU) counted at 4 bytes an element, dtypes in name order
    # (worker.step.all_sum_arrays)
    per = 32 * 1024**2 // 4
    assert plan_buckets({"float32": 2 * per + 5, "bfloat16": 3}, bucket_bytes_for(False)) == [
        ("bfloat16", 3), ("float32", per), ("float32", per), ("float32", 5)]
    assert plan_buckets({"bfloat16": per * 8 + 1}, bucket_bytes_for(True)) == [("bfloat16", per * 8), ("bfloat16", 1)]
    assert samples_for(0.01, 3.0, 20) == 20 and samples_for(0.5, 3.0, 20) == 6 and samples_for(9.0, 3.0, 20) == 3


def test_parse_collbench_reads_rank_zeros_answer() -> None:
    answer = {"seconds": 0.031, "small_seconds": 0.002, "bytes": 552196, "ranks": 3, "samples": 12}
    cost = parse_collbench(answer, nodes=["a", "b", "c"], backend="ring")
    assert (cost.seconds, cost.small_s, cost.nbytes, cost.samples, cost.nodes) == (0.031, 0.002, 552196, 12,
                                                                                  ("a", "b", "c"))
    assert cost.source is CostSource.MEASURED and not cost.cached
    assert "552196" not in cost.describe() and "over 3 ranks (ring): 31.0 ms measured" in cost.describe()
    assert cost.to_json()["bandwidth_bytes_per_s"] == pytest.approx(4 / 3 * 552196 / 0.029, rel=1e-3)
    with pytest.raises(CollectiveError, match="peer never joined"):
        parse_collbench({"error": "peer never joined"}, nodes=["a", "b"], backend="ring")
    with pytest.raises(CollectiveError, match="ran 2 ranks, the run has 3"):
        parse_collbench({**answer, "ranks": 2}, nodes=["a", "b", "c"], backend="ring")
    with pytest.raises(CollectiveError, match="'seconds'"):
        parse_collbench({**answer, "seconds": "fast"}, nodes=["a", "b", "c"], backend="ring")


# --- starting the ranks, caching ------------------------------------------------------------------------------------


def _hostfile(backend: str = "ring") -> Hostfile:
    rdma = (None, "rdma_en3"), ("rdma_en3", None)
    return Hostfile(backend, (HostEntry("a", ("10.0.0.1",), rdma[0] if backend.startswith("jaccl") else ()),
                              HostEntry("b", ("10.0.0.2", "10.0.1.2"), rdma[1] if backend.startswith("jaccl") else ())),
                    envs=("TOKENIZERS_PARALLELISM=false",))


def test_rank_starts_give_each_backend_what_mlx_launch_gives_it() -> None:
    ring = build_rank_starts(_hostfile(), 40000)
    assert [dict(s.env)["MLX_RANK"] for s in ring] == ["0", "1"]
    assert json.loads(dict(ring[0].files)["MLX_HOSTFILE"]) == [["10.0.0.1:40000"], ["10.0.0.2:40001", "10.0.1.2:40002"]]
    assert dict(ring[1].env)["TOKENIZERS_PARALLELISM"] == "false" and ports_needed(_hostfile()) == 3
    nccl = build_rank_starts(_hostfile("nccl"), 40000)
    assert {k: v for k, v in nccl[1].env if k != "TOKENIZERS_PARALLELISM"} == {
        "NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "40000", "MLX_WORLD_SIZE": "2", "MLX_RANK": "1"}
    jring = build_rank_starts(_hostfile("jaccl-ring"), 40000)
    assert dict(jring[0].env)["MLX_JACCL_COORDINATOR"] == "10.0.0.1:40000" and dict(jring[0].env)["MLX_JACCL_RING"] == "1"
    assert json.loads(dict(jring[1].files)["MLX_IBV_DEVICES"]) == [[None, "rdma_en3"], ["rdma_en3", None]]
    with pytest.raises(CollectiveError, match="mpi"):
        build_rank_starts(Hostfile("mpi", _hostfile().hosts), 40000)
    with pytest.raises(CollectiveError, match="IP"):
        build_rank_starts(Hostfile("ring", (HostEntry("a"), HostEntry("b"))), 40000)


def test_cache_key_changes_with_everything_the_exchange_depends_on() -> None:
    grads = GradientSize((("float32", 100),))
    prints = [{"chip": "x"}, {"chip": "y"}]
    key = compute_collective_key(_hostfile(), prints, grads, "w1")
    assert key is not None and key == compute_collective_key(_hostfile(), prints, grads, "w1")
    others = [
        compute_collective_key(_hostfile("nccl"), prints, grads, "w1"),  # backend
        compute_collective_key(Hostfile("ring", _hostfile().hosts[::-1], _hostfile().envs), prints, grads, "w1"),
        compute_collective_key(Hostfile("ring", (HostEntry("a", ("10.0.0.9",)), _hostfile().hosts[1]),
                                        _hostfile().envs), prints, grads, "w1"),  # another link
        compute_collective_key(_hostfile(), [{"chip": "x"}, {"chip": "z"}], grads, "w1"),  # other hardware
        compute_collective_key(_hostfile(), prints, GradientSize((("float32", 101),)), "w1"),  # bytes
        compute_collective_key(_hostfile(), prints, GradientSize((("bfloat16", 100),)), "w1"),  # dtype
        compute_collective_key(_hostfile(), prints, grads, "w2"),  # worker
        compute_collective_key(_hostfile(), prints, grads, "w1", [("MLX_X", "1")]),  # mlx env
    ]
    assert len({key, *others}) == len(others) + 1
    assert compute_collective_key(_hostfile(), prints, grads, "w1", [("HOME", "/x")]) == key  # not an MLX_ var
    assert compute_collective_key(_hostfile(), [{"chip": "x"}, None], grads, "w1") is None  # unknown: never cached


# --- the plan ---------------------------------------------------------------------------------------------------------


def _cal(node: str, rate: float) -> NodeCalibration:
    return NodeCalibration(node=node, curve=(CurvePoint(1, rate, 1), CurvePoint(8, rate, 1)), matmul_gflops=0.0,
                           memory_limit=None, seq_len=100)


def test_the_slowest_nodes_compute_plus_the_exchange_decides_the_step() -> None:
    plan = compute_plan([_cal("fast", 300.0), _cal("slow", 100.0)], 8, seq_len=100)
    assert plan.batch == {"fast": 6, "slow": 2} and plan.collective is None
    compute = max(plan.per_node_step_s.values())
    cost = CollectiveCost(0.25, 552196, 2, "ring", CostSource.MEASURED, small_s=0.01, nodes=("fast", "slow"))
    with_it = with_collective(plan, cost)
    assert with_it.batch == plan.batch and with_it.split == plan.split  # the exchange does not move the split
    assert with_it.predicted_step_s == pytest.approx(compute + 0.25)
    assert with_it.compute_step_s == pytest.approx(compute)
    assert with_it.predicted_tokens_per_s == pytest.approx(8 * 100 / (compute + 0.25))
    assert with_it.compute_tokens_per_s == pytest.approx(plan.predicted_tokens_per_s)
    assert with_it.collective_share == pytest.approx(0.25 / (compute + 0.25))
    assert with_it.node_tokens_per_s("slow") == plan.node_tokens_per_s("slow")  # each rank's compute is unchanged
    # replaced, never added twice; None or an uncalibrated plan: unchanged
    assert with_collective(with_it, cost).predicted_step_s == pytest.approx(compute + 0.25)
    assert with_collective(plan, None) is plan
    assert "+ 250.0 ms gradient all_sum" in describe_step(with_it) and "not measured" in describe_step(plan)


def test_end_of_run_line_holds_the_run_to_the_prediction_with_the_exchange() -> None:
    # prediction 1,500 tok/s with the exchange (2,000 without: the all_sum is 25% of the step)
    near = describe_prediction(1400, 1500, steps=30, ranks=2, compute=1950, predicted_compute=2000)
    assert "within 15%" in near and "the gradient all_sum, 25% of the predicted step, included" in near
    link = describe_prediction(900, 1500, steps=30, ranks=2, compute=1950, predicted_compute=2000)
    assert "-40%" in link and "1,950 real tokens/s (-2% of the 2,000 predicted for it), as calibrated" in link
    assert "the links were slower than when calibration timed the all_sum" in link and "--recalibrate" in link
    busy = describe_prediction(900, 1500, steps=30, ranks=2, compute=1100, predicted_compute=2000)
    assert "the machine was busier than while calibrating" in busy and "-45% of the 2,000 predicted" in busy
    # the cause is not measured: offered as likely, with the ranks sharing cores beside other work, never asserted
    assert "Likely: the machine was busier" in busy and "ranks sharing its cores" in busy
    # without a measured exchange the old words stay: the prediction leaves it out
    assert "which the prediction leaves out" in describe_prediction(900, 2000, steps=30, ranks=2)


# --- the measurement over real local ranks --------------------------------------------------------------------------


def test_measure_collective_times_the_exchange_between_real_ranks_and_caches_it(tmp_path: Path) -> None:
    """Two local nodes over a loopback ring: worker.collbench's ranks join, time the run's exchange, rank 0
    answers; the answer is cached under its key (read back as cached), `recalibrate` measures again, and a backend
    that cannot be started this way is a value, not an exception."""
    nodes = [Node(name=n, host="localhost", connection=Connection.LOCAL, python=sys.executable,
                  workdir=str(tmp_path / n)) for n in ("a", "b")]
    hostfile = Hostfile("ring", (HostEntry("127.0.0.1", ("127.0.0.1",)), HostEntry("127.0.0.1", ("127.0.0.1",))))
    fingerprint = NodeFingerprint(chip="test", model_id=None, memory_bytes=1, cpu_count=2, gpu_cores=None,
                                  os_version="linux", mlx_version="0.32.4")
    grads = GradientSize((("float32", 1000), ("bfloat16", 10)))
    said: list[str] = []

    async def go(backend: Hostfile, recalibrate: bool) -> CollectiveCost | CoordinatorError:
        async with Fleet(nodes) as fleet:
            await fleet.connect_all()
            return await measure_collective(fleet, nodes, backend, grads,
                                            fingerprints={"a": fingerprint, "b": fingerprint}, env={},
                                            cache_dir=tmp_path / "cache", recalibrate=recalibrate,
                                            progress=said.append, budget_s=0.2)

    first = asyncio.run(go(hostfile, False))
    assert isinstance(first, CollectiveCost), first
    assert (first.source, first.ranks, first.nbytes, first.nodes, first.cached) == (
        CostSource.MEASURED, 2, 4 * 1001 + 2 * 10, ("a", "b"), False)
    assert first.samples >= 3 and first.small_s is not None
    assert any("timing the gradient all_sum (4,024 bytes) between a, b over ring" in s for s in said)
    assert len(list((tmp_path / "cache").glob("collective-*.json"))) == 1
    again = asyncio.run(go(hostfile, False))
    assert isinstance(again, CollectiveCost) and again.cached and again.seconds == first.seconds
    fresh = asyncio.run(go(hostfile, True))
    assert isinstance(fresh, CollectiveCost) and not fresh.cached
    refused = asyncio.run(go(Hostfile("mpi", hostfile.hosts), False))
    assert isinstance(refused, CollectiveError) and "mpi" in str(refused)


def test_a_relaunch_derives_the_survivors_exchange_from_the_measured_one() -> None:
    """Recovery waits for no new measurement: the ring model read from the measured exchange of 3 ranks, applied
    to the 2 survivors (fewer hops, a larger share of the bytes per link... 2(N-1)/N: 4/3 -> 1)."""
    small = ring_allreduce_s(0, 3, 25 * MB, 0.001)
    measured = CollectiveCost(ring_allreduce_s(3 * MB, 3, 25 * MB, 0.001), 3 * MB, 3, "ring", CostSource.MEASURED,
                              small_s=small, nodes=("a", "b", "c"))
    two = rescale_collective(measured, ["a", "c"])
    assert two is not None and two.source is CostSource.DERIVED and two.nodes == ("a", "c")
    assert two.seconds == pytest.approx(ring_allreduce_s(3 * MB, 2, 25 * MB, 0.001), rel=1e-4)
    assert two.seconds < measured.seconds
    # latency-bound (no bandwidth to read): the measured time scales with the hops
    bound = CollectiveCost(0.06, 64, 4, "ring", CostSource.MEASURED, small_s=0.06)
    assert rescale_collective(bound, ["a", "b"]).seconds == pytest.approx(0.02)  # type: ignore[union-attr]
    assert rescale_collective(measured, ["a"]) is None
    assert rescale_collective(CollectiveCost(0.1, 64, 2, "ring", CostSource.MEASURED), ["a", "b"]) is None
