"""coordinator.planning.plan (the split) and the pure parts of coordinator.run.calibrate (cache key, parsing, JSON)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
from dataclasses import replace
from typing import Any

import pytest

from coordinator.facts.probe import Section, pythonpath_prepend, shell_path
from coordinator.models import Node
from coordinator.planning.pipeline import LayerMemory, LayerTiming, TimingSource
from coordinator.planning.plan import (
    CurvePoint,
    NodeCalibration,
    Plan,
    PlanError,
    SplitMode,
    _NodeModel,
    compute_plan,
    format_split,
    isotonic,
    lift_dips,
)
from coordinator.run.calibrate import (
    HORIZON_STEPS,
    BenchSpec,
    CalibrationError,
    NodeFingerprint,
    build_bench_argv,
    build_cache_record,
    calibration_from_bench,
    calibration_to_json,
    compute_cache_key,
    fingerprint_from_facts,
    layer_timing_from_bench,
    parse_bench_stdout,
    parse_cache_record,
    parse_layer_cache_record,
    sample_horizon,
)
from coordinator.run.launchfiles import build_rank_script
from tests.factsutil import capture, facts_from, linux_sections, profile_sections, worker_answer

GB = 1024**3
L = 128  # seq_len used throughout


def cal(name: str, points: list[tuple[int, float, int]], *, limit: int | None = None,
        seq_len: int | None = L) -> NodeCalibration:
    return NodeCalibration(
        node=name,
        curve=tuple(CurvePoint(b, r, m) for b, r, m in points),
        matmul_gflops=1000.0,
        memory_limit=limit,
        seq_len=seq_len,
    )


def flat(name: str, rate: float, *, upto: int = 64, base: int = GB, per_row: int = GB // 8,
         limit: int | None = None) -> NodeCalibration:
    """A node whose rate does not depend on the batch (measured at 1, 2, 4, ... upto)."""
    batches = [2**i for i in range(upto.bit_length()) if 2**i <= upto]
    return cal(name, [(b, rate, base + per_row * b) for b in batches], limit=limit)


def brute_force_makespan(calibrations: list[NodeCalibration], global_batch: int) -> float:
    """The best achievable max step time, by trying every allocation (small cases only)."""
    best = float("inf")
    n = len(calibrations)
    for counts in itertools.product(range(1, global_batch + 1), repeat=n):
        if sum(counts) != global_batch:
            continue
        try:
            plan = compute_plan(calibrations, global_batch, split=dict(
                zip([c.node for c in calibrations], [k / global_batch for k in counts], strict=True)), seq_len=L)
        except PlanError:
            continue  # over a memory cap
        if list(plan.batch.values()) != list(counts):
            continue  # rounding of k/G back to k is exact here, but be strict
        best = min(best, plan.predicted_step_s)
    return best


# --- calibrated splits -------------------------------------------------------------------------------------------

CALIBRATED_CASES: list[tuple[str, list[NodeCalibration], int, dict[str, int]]] = [
    ("2:1 speed", [flat("fast", 2000), flat("slow", 1000)], 30, {"fast": 20, "slow": 10}),
    ("2:1 speed, odd batch", [flat("fast", 2000), flat("slow", 1000)], 31, {"fast": 21, "slow": 10}),
    ("3 nodes 3:2:1", [flat("a", 3000), flat("b", 2000), flat("c", 1000)], 12, {"a": 6, "b": 4, "c": 2}),
    # fast node capped at 4 rows by memory: 1 GiB + 1 GiB/row, limit 5 GiB.
    ("memory caps the fast node", [flat("fast", 4000, base=GB, per_row=GB, limit=5 * GB), flat("slow", 1000)], 12,
     {"fast": 4, "slow": 8}),
    ("one row each", [flat("fast", 5000), flat("slow", 10)], 2, {"fast": 1, "slow": 1}),
]


@pytest.mark.parametrize(("label", "cals", "global_batch", "expected"), CALIBRATED_CASES,
                         ids=[c[0] for c in CALIBRATED_CASES])
def test_calibrated_split(label: str, cals: list[NodeCalibration], global_batch: int, expected: dict[str, int]) -> None:
    plan = compute_plan(cals, global_batch, seq_len=L)
    assert plan.mode is SplitMode.CALIBRATED
    assert plan.batch == expected
    assert list(plan.batch) == [c.node for c in cals]  # rank order kept
    assert sum(plan.batch.values()) == global_batch
    assert plan.split == pytest.approx({n: b / global_batch for n, b in expected.items()})
    assert plan.predicted_step_s == max(plan.per_node_step_s.values())
    assert plan.predicted_tokens_per_s == pytest.approx(global_batch * L / plan.predicted_step_s)


def test_two_to_one_gives_two_thirds() -> None:
    plan = compute_plan([flat("m4max", 2000), flat("ultra", 1000)], 64, seq_len=L)
    assert plan.split["m4max"] == pytest.approx(2 / 3, abs=0.02)
    assert plan.split["ultra"] == pytest.approx(1 / 3, abs=0.02)
    # Equal step times, as nearly as integers allow: within one row's time of the slower node.
    times = plan.per_node_step_s
    assert abs(times["m4max"] - times["ultra"]) <= L / 1000


def test_node_peaking_at_batch_4() -> None:
    # Throughput peaks at 4 and falls at 8: beyond 8 the node keeps the fallen rate, not its best one.
    peaky = cal("peaky", [(1, 1000, GB), (2, 1800, GB), (4, 3000, GB), (8, 2000, GB)])
    steady = flat("steady", 1500)
    plan = compute_plan([peaky, steady], 40, seq_len=L)
    # Beyond batch 8 peaky runs at 2000 vs steady's 1500: rows 4:3.
    assert plan.batch == {"peaky": 23, "steady": 17}
    assert plan.per_node_step_s["peaky"] == pytest.approx(23 * L / 2000)
    # Small batches: both near batch 4 where peaky is at its best.
    small = compute_plan([peaky, steady], 8, seq_len=L)
    assert small.predicted_step_s == pytest.approx(brute_force_makespan([peaky, steady], 8))


@pytest.mark.parametrize(("rates", "expected"), [
    ([336, 428, 325, 452], [336, 428, 436, 452]),  # one disturbed point: on the line between 2 and 8
    ([900, 800, 700, 600], [900, 800, 700, 600]),  # a falling curve is no dip
    ([400, 300, 300, 450], [400, 300, 300, 450]),  # two low points in a row are kept
    ([400, 420, 300], [400, 420, 300]),  # a fall at the end is the knee
    ([500], [500]),
])
def test_lift_dips(rates: list[float], expected: list[float]) -> None:
    batches = [1, 2, 4, 8][: len(rates)]
    assert lift_dips(batches, rates) == pytest.approx(expected)


def test_a_noisy_dip_does_not_starve_a_node() -> None:
    # Measured on the split benchmark's test bed: `half`'s batch-4 point was 25% below both neighbours. Taken
    # literally it planned 9/3, a 1.26 s step for `full` against 0.89 s for `half`; on the lifted curve 8/4.
    full = cal("full", [(1, 838, GB), (2, 837, GB), (4, 870, GB), (8, 902, GB), (12, 937, GB)])
    half = cal("half", [(1, 336, GB), (2, 428, GB), (4, 325, GB), (8, 452, GB)])
    assert compute_plan([full, half], 12, seq_len=L).batch == {"full": 8, "half": 4}


def test_rising_curve_extrapolates_best_rate_only_up_to_the_memory_cap() -> None:
    # Measured up to 4 (still rising when the sweep stopped); memory allows 6 rows.
    rising = cal("rising", [(1, 1000, 2 * GB), (2, 1900, 3 * GB), (4, 3600, 5 * GB)], limit=7 * GB)
    other = flat("other", 500)
    plan = compute_plan([rising, other], 40, seq_len=L)
    assert plan.batch["rising"] == 6  # cap: 5 GiB + 2 * 1 GiB/row
    assert plan.per_node_step_s["rising"] == pytest.approx(6 * L / 3600)


def test_the_split_fits_step_times_that_never_fall_but_a_measured_batch_predicts_itself() -> None:
    # Noise: batch 2 measured four times batch 1's rate, so 2 rows "take less time" than 1. The split's monotone fit
    # pools the two, weighted by the rows each timed (step(2) == step(1), never less), so the greedy stays optimal;
    # the prediction of the batch the node runs is that batch's own measurement, not the pool.
    noisy = cal("noisy", [(1, 100, GB), (2, 400, GB)])
    model = _NodeModel(noisy, L)
    assert model.step_s(2) == pytest.approx((1 * L / 100 + 2 * 2 * L / 400) / 3) == model.step_s(1)
    plan = compute_plan([noisy, flat("other", 100)], 3, seq_len=L)
    assert plan.batch == {"noisy": 2, "other": 1}
    assert plan.per_node_step_s["noisy"] == pytest.approx(2 * L / 400)
    # Between measured batches the fit still speaks: batch 3 is extrapolated from the pooled curve.
    assert model.predicted_step_s(3) == model.step_s(3)


def test_a_large_batch_faster_than_a_small_one_is_predicted_as_measured() -> None:
    # An H100, S LoRA on packed variable-length rows (a23f61c): batch 8's steps pack into more sequences of a
    # shape the GPU runs faster than batch 4's (0.035 s vs 0.054 s), so its point is the fastest step of the
    # curve. Pooled with batch 4's the run was predicted 13-18% slow; its own point was within 0.3%.
    curve = cal("s", [(1, 8_147, GB), (2, 24_664, GB), (4, 39_726, GB), (8, 106_466, GB)])
    plan = compute_plan([curve], 8, seq_len=L)
    assert plan.predicted_tokens_per_s == pytest.approx(106_466 * plan.fill)
    assert plan.per_node_step_s["s"] == pytest.approx(8 * L / 106_466)


def test_one_slow_small_batch_point_does_not_set_the_large_batch_prediction() -> None:
    # The issue's case (S LoRA): batch 8 measured 240k tokens/s, a slow batch-2 point 40k. A running maximum of the
    # step times predicted batch 8 at the batch-2 step time (168k-like); batch 8's own point predicts it.
    curve = cal("s", [(1, 30_000, GB), (2, 40_000, GB), (4, 150_000, GB), (8, 240_000, GB)])
    plan = compute_plan([curve], 8, seq_len=L)
    assert plan.predicted_tokens_per_s == pytest.approx(240_000 * plan.fill)
    assert isotonic([3.0, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == [2.0, 2.0, 2.0, 4.0]
    assert isotonic([1.0, 2.0], [1.0, 5.0]) == [1.0, 2.0]


def test_interchangeable_nodes_on_a_flat_fit_get_an_even_split() -> None:
    # CI26's pooled curve of two ranks of one machine (seq_len 64): batch 1 timed slower than batch 2, so the
    # isotonic fit gives batches 1, 2 and 3 one step time. Ties went to the earlier node: 3 and 1 rows.
    pooled = [(1, 277.0, 665_954), (2, 1492.0, 657_585)]
    plan = compute_plan([cal("r0", pooled, seq_len=64), cal("r1", pooled, seq_len=64)], 4, seq_len=64)
    assert plan.batch == {"r0": 2, "r1": 2}
    # 3 and 1 rows predicted the step of the 1-row rank's measured batch-1 point (1,108 tokens/s), below one node
    # alone at batch 4 (1,492): `auto` then planned a single node (CI24). The even split predicts batch 2's point.
    solo = compute_plan([cal("r0", pooled, seq_len=64)], 4, seq_len=64)
    assert plan.predicted_tokens_per_s > 1.5 * solo.predicted_tokens_per_s
    three = [cal(n, [(1, 1000.0, GB), (2, 1000.0, GB), (4, 4000.0, GB)]) for n in "abc"]
    assert compute_plan(three, 9, seq_len=L).batch == {"a": 3, "b": 3, "c": 3}


def test_calibrated_is_optimal_and_never_worse_than_equal_on_random_curves() -> None:
    rng = random.Random(20240531)
    checked = compared = 0
    for _ in range(150):
        n = rng.randint(2, 3)
        cals = []
        for i in range(n):
            points = []
            rate = rng.uniform(200, 5000)
            peak = rng.randint(1, 4) * GB
            batch = 1
            for _ in range(rng.randint(1, 5)):
                points.append((batch, rate, peak))
                rate *= rng.uniform(0.8, 2.0)
                peak += rng.randint(0, 2) * GB
                batch *= 2
            limit = rng.choice([None, 64 * GB, points[-1][2] + rng.randint(0, 4) * GB])
            cals.append(cal(f"n{i}", points, limit=limit))
        global_batch = rng.randint(n, 10 if n == 3 else 16)
        try:
            plan = compute_plan(cals, global_batch, seq_len=L)
        except PlanError as exc:
            assert "does not fit" in str(exc) or "even one row" in str(exc)
            continue
        assert plan.predicted_step_s == pytest.approx(brute_force_makespan(cals, global_batch))
        checked += 1
        try:
            equal = compute_plan(cals, global_batch, split="equal", seq_len=L)
        except PlanError:
            continue  # the equal split does not fit in memory; the calibrated one did
        assert plan.predicted_step_s <= equal.predicted_step_s + 1e-12
        assert plan.predicted_tokens_per_s >= equal.predicted_tokens_per_s - 1e-9
        compared += 1
    # The seed exercises all three outcomes, mostly the interesting ones.
    assert checked >= 100 and compared >= 80, (checked, compared)


# --- equal and explicit splits -----------------------------------------------------------------------------------

THREE = [flat("a", 1000), flat("b", 1000), flat("c", 1000)]

FIXED_CASES: list[tuple[str, str | dict[str, float], int, dict[str, int]]] = [
    ("equal 7 over 3", "equal", 7, {"a": 3, "b": 2, "c": 2}),
    ("equal 8 over 3", "equal", 8, {"a": 3, "b": 3, "c": 2}),
    ("equal exact", "equal", 9, {"a": 3, "b": 3, "c": 3}),
    ("explicit 7 rows, largest remainder", {"a": 0.5, "b": 0.3, "c": 0.2}, 7, {"a": 4, "b": 2, "c": 1}),
    ("explicit remainder to the largest fraction", {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3 + 1e-7}, 10,
     {"a": 3, "b": 3, "c": 4}),
    ("explicit tie goes to the first node", {"a": 0.25, "b": 0.25, "c": 0.5}, 6, {"a": 2, "b": 1, "c": 3}),
]


@pytest.mark.parametrize(("label", "split", "global_batch", "expected"), FIXED_CASES, ids=[c[0] for c in FIXED_CASES])
def test_fixed_splits(label: str, split: str | dict[str, float], global_batch: int, expected: dict[str, int]) -> None:
    plan = compute_plan(THREE, global_batch, split=split, seq_len=L)
    assert plan.batch == expected
    assert plan.mode is (SplitMode.EQUAL if split == "equal" else SplitMode.EXPLICIT)


def test_equal_split_reports_the_slowest_rank() -> None:
    cals = [flat("fast", 2000), flat("slow", 1000)]
    equal = compute_plan(cals, 30, split="equal", seq_len=L)
    calibrated = compute_plan(cals, 30, seq_len=L)
    assert equal.batch == {"fast": 15, "slow": 15}
    assert equal.predicted_step_s == pytest.approx(15 * L / 1000)
    assert calibrated.predicted_tokens_per_s == pytest.approx(3000)
    assert equal.predicted_tokens_per_s == pytest.approx(2000)


# --- errors ------------------------------------------------------------------------------------------------------

ERROR_CASES: list[tuple[str, list[NodeCalibration], int, Any, str]] = [
    ("fewer rows than nodes", THREE, 2, "calibrated",
     "global batch 2 is smaller than the number of nodes (3: a, b, c)"),
    ("fewer rows than nodes, equal", THREE, 2, "equal", "every rank needs at least one row"),
    ("zero batch", THREE, 0, "calibrated", "global batch must be a positive integer, got 0"),
    ("unknown split", THREE, 6, "fastest", "unknown split 'fastest'"),
    ("fractions do not sum to 1", THREE, 6, {"a": 0.5, "b": 0.3, "c": 0.3}, "must sum to 1, got 1.1"),
    ("missing node", THREE, 6, {"a": 0.5, "b": 0.5}, "missing c"),
    ("unknown node", THREE, 6, {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}, "unknown d"),
    ("zero fraction", THREE, 6, {"a": 0.5, "b": 0.5, "c": 0.0}, "split fraction for c must be a positive number"),
    ("fraction rounds to zero rows", THREE, 10, {"a": 0.9, "b": 0.07, "c": 0.03}, "gives c 0 of 10 rows"),
    ("fleet memory too small", [flat("a", 1000, base=GB, per_row=GB, limit=4 * GB),
                                flat("b", 1000, base=GB, per_row=GB, limit=3 * GB)], 8, "calibrated",
     "global batch 8 does not fit in the fleet's memory at seq_len 128: at most 5 rows (a 3 rows"),
    ("one row over the limit", [flat("a", 1000, base=8 * GB, limit=4 * GB), flat("b", 1000)], 4, "calibrated",
     "a: even one row of 128 tokens needs ~8.1 GiB, over its memory limit of 4.0 GiB"),
    ("equal split over a memory cap", [flat("a", 1000, base=GB, per_row=GB, limit=3 * GB), flat("b", 1000)], 8,
     "equal", "equal split of global batch 8 at seq_len 128 exceeds memory: a 4 rows"),
    ("duplicate node", [flat("a", 1000), flat("a", 500)], 4, "calibrated", "node(s) calibrated twice: a"),
    ("no nodes", [], 4, "calibrated", "no calibrated node"),
    ("other seq_len", [cal("a", [(1, 1000, GB)], seq_len=2048), flat("b", 1000)], 4, "calibrated",
     "a: calibrated at seq_len 2048, but the plan is for seq_len 128"),
]


@pytest.mark.parametrize(("label", "cals", "global_batch", "split", "message"), ERROR_CASES,
                         ids=[c[0] for c in ERROR_CASES])
def test_bad_inputs_raise_plan_error(label: str, cals: list[NodeCalibration], global_batch: int, split: Any,
                                     message: str) -> None:
    with pytest.raises(PlanError) as info:
        compute_plan(cals, global_batch, split=split, seq_len=L)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("points", "message"), [
    ([], "has no measured point"),
    ([(2, 100.0, 1), (1, 100.0, 1)], "strictly increasing"),
    ([(1, 0.0, 1)], "non-positive rate"),
    ([(1, float("nan"), 1)], "non-positive rate"),
    ([(1, 10.0, -1)], "negative peak memory"),
])
def test_invalid_calibrations_are_rejected(points: list[tuple[int, float, int]], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        cal("x", points)


def test_format_split() -> None:
    plan = Plan(split={"m4max": 131 / 200, "ultra": 69 / 200}, batch={"m4max": 131, "ultra": 69}, global_batch=200,
                mode=SplitMode.CALIBRATED, seq_len=L, predicted_step_s=1.0, predicted_tokens_per_s=1.0)
    assert format_split(plan) == "m4max 65.5% / ultra 34.5%"


# --- coordinator.run.calibrate: pure parts ---------------------------------------------------------------------------

FP = NodeFingerprint(chip="Apple M4 Max", model_id="Mac16,5", memory_bytes=128 * GB, cpu_count=16, gpu_cores=40,
                     os_version="macOS 26.2 (25C56)", mlx_version="0.32.4")
SPEC = BenchSpec(model="~/models/qwen", seq_len=2048, method="lora", num_layers=16)


def test_cache_key_is_stable_and_covers_every_input() -> None:
    key = compute_cache_key("m4max", FP, SPEC, "sha256:abc")
    assert key == compute_cache_key("m4max", FP, SPEC, "sha256:abc")
    assert len(key) == 32 and all(c in "0123456789abcdef" for c in key)
    variants = [
        compute_cache_key("ultra", FP, SPEC, "sha256:abc"),
        compute_cache_key("m4max", FP, SPEC, "sha256:abd"),
        *(compute_cache_key("m4max", replace(FP, **{f: None}), SPEC, "sha256:abc")
          for f in ("chip", "model_id", "memory_bytes", "cpu_count", "gpu_cores", "os_version", "mlx_version")),
        *(compute_cache_key("m4max", replace(FP, **change), SPEC, "sha256:abc") for change in (
            {"gpu_model": "NVIDIA H100 80GB HBM3"}, {"gpu_count": 8}, {"gpu_memory_bytes": 81559 * 2**20},
            {"mlx_backends": ("mlx-cuda-13==0.32.4",)})),
        *(compute_cache_key("m4max", FP, replace(SPEC, **change), "sha256:abc") for change in (
            {"seq_len": 1024}, {"method": "dora"}, {"num_layers": -1}, {"grad_checkpoint": True},
            {"max_batch": 32}, {"memory_fraction": 0.7}, {"env": (("MLX_ENABLE_TF32", "0"),)},
            {"data": "~/data"}, {"packing": "off"}, {"global_batch": 16}, {"seed": 1}, {"optimizer": "sgd"},
            {"learning_rate": 1e-4}, {"lora": (16, 20.0, 0.0)}, {"train_embeddings": True}, {"world_size": 2},
            {"clear_cache": True}, {"memory_headroom": None}, {"memory_headroom": 0.2}, {"blocks": 2},
            {"blocks": 2, "micro_batch": 4}, {"data": "~/data", "steps": 20})),
        compute_cache_key("m4max", FP, SPEC, "sha256:abc", "another-worker"),  # a new step is measured again
    ]
    assert key not in variants
    assert len(set(variants)) == len(variants)
    # A short run's horizon keys its curve (its own steps were sampled); a long run's (0) leaves the key as it was.
    with_data = replace(SPEC, data="~/data")
    assert compute_cache_key("m4max", FP, replace(with_data, steps=0), "sha256:abc") != compute_cache_key(
        "m4max", FP, replace(with_data, steps=30), "sha256:abc")
    assert compute_cache_key("m4max", FP, replace(SPEC, steps=30), "sha256:abc") == key  # random rows: no horizon
    # The model's location is not part of it: the digest says which weights they are.
    assert compute_cache_key("m4max", FP, replace(SPEC, model="/other/path"), "sha256:abc") == key
    # Nor the env that does not change what mlx does (logging, tokenizers).
    assert compute_cache_key("m4max", FP, replace(SPEC, env=(("TOKENIZERS_PARALLELISM", "false"),)), "sha256:abc") == key


def test_cache_key_follows_the_gpu_in_the_facts() -> None:
    """A node whose GPU was swapped (model or count) is measured again: the fingerprint comes from nvidia-smi."""
    def fingerprint(smi: str, backends: dict[str, str]) -> NodeFingerprint:
        sections = {**linux_sections(), "nvidia_smi": Section("nvidia_smi", smi, 0)}
        return fingerprint_from_facts(facts_from("gpu1", profile_sections(sections, worker=worker_answer(
            backends=backends))))

    h100 = fingerprint(capture("nvidia_smi/h100-x1-driver-580.txt"), {"mlx-cuda-13": "0.32.1"})
    assert (h100.gpu_model, h100.gpu_count, h100.gpu_memory_bytes, h100.mlx_backends) == \
        ("NVIDIA H100 80GB HBM3", 1, 81559 * 2**20, ("mlx-cuda-13==0.32.1",))
    a100s = fingerprint(capture("nvidia_smi/constructed-a100-x2.txt"), {"mlx-cuda-13": "0.32.1"})
    assert (a100s.gpu_model, a100s.gpu_count) == ("NVIDIA A100-SXM4-80GB", 2)
    cpu_backend = fingerprint(capture("nvidia_smi/h100-x1-driver-580.txt"), {"mlx-cpu": "0.32.1"})
    keys = {compute_cache_key("gpu1", fp, SPEC, "sha256:abc") for fp in (h100, a100s, cpu_backend)}
    assert len(keys) == 3


def test_unknown_fingerprint_is_not_cacheable() -> None:
    assert FP.known
    assert not replace(FP, chip=None, model_id=None).known
    assert not replace(FP, memory_bytes=None).known


def test_build_bench_argv() -> None:
    node = Node(name="m4max", host="m4max.local", python="~/venv/bin/python", env=(("MLX_X", "1"),))
    spec = replace(SPEC, grad_checkpoint=True, env=(("MLX_X", "0"), ("TOKENIZERS_PARALLELISM", "false")))
    argv = build_bench_argv(node, "/Users/me/mlx-work/.coordinator/worker-0123", spec, 45.0, 300.0)
    # The job env overlaid with the node's (as in the rank script), then the worker dir first on PYTHONPATH.
    assert argv[:3] == ["env", "MLX_X=1", "TOKENIZERS_PARALLELISM=false"]
    assert argv[3:5] == ["sh", "-c"] and argv[6:8] == ["sh", "/Users/me/mlx-work/.coordinator/worker-0123"]
    assert argv[8:10] == ["sh", "-c"]  # `~/` python goes through the node's shell
    tail = argv[argv.index("-m"):]
    assert tail == ["-m", "worker.bench", "--model", "~/models/qwen", "--seq-len", "2048", "--method", "lora",
                    "--num-layers", "16", "--grad-checkpoint", "--seed", "0", "--world-size", "1", "--optimizer", "adam",
                    "--learning-rate", "1e-05", "--lora-rank", "8", "--lora-scale", "20", "--lora-dropout", "0",
                    "--memory-headroom", "0.1", "--time-budget", "45", "--one-time-budget", "300", "--max-batch", "64",
                    "--memory-fraction", "0.8"]
    assert "--clear-cache" not in argv and "--clear-cache" in build_bench_argv(node, "/w", replace(SPEC, clear_cache=True), 45.0)
    assert "--cpu-share" not in argv
    assert build_bench_argv(node, "/w", SPEC, 45.0, lockstep=True, cpu_share=(1, 2))[-3:] == ["--lockstep",
                                                                                             "--cpu-share", "1/2"]
    unbounded = build_bench_argv(node, "/w", replace(SPEC, memory_headroom=None), 45.0)
    assert unbounded[unbounded.index("--memory-headroom") + 1] == "none"
    assert "--blocks" not in argv
    blocks = build_bench_argv(node, "/w", replace(SPEC, blocks=2, micro_batch=3), 45.0)
    assert blocks[-4:] == ["--blocks", "2", "--micro-batch", "3"]
    with_data = build_bench_argv(node, "/w", replace(SPEC, data="~/data", packing="on", global_batch=12), 45.0)
    assert with_data[with_data.index("--data"):with_data.index("--data") + 6] == [
        "--data", "~/data", "--packing", "on", "--global-batch", "12"]
    assert "--steps" not in with_data  # a long run: the whole first epoch
    short = build_bench_argv(node, "/w", replace(SPEC, data="~/data", global_batch=12, steps=30), 45.0)
    assert short[short.index("--steps") + 1] == "30"
    assert "--steps" not in build_bench_argv(node, "/w", replace(SPEC, steps=30), 45.0)  # random rows: no order


def test_sample_horizon_is_a_short_runs_own_steps() -> None:
    assert sample_horizon(20) == 20
    assert sample_horizon(20, grad_accumulation=4) == 80  # the global batches its steps read
    assert sample_horizon(HORIZON_STEPS) == HORIZON_STEPS
    assert sample_horizon(HORIZON_STEPS + 1) == 0  # a long run: the data's own median


def _pythonpath(node_env: tuple[tuple[str, str], ...], own: str | None) -> str:
    """PYTHONPATH as a process started by `build_bench_argv` sees it (`sh` stands in for the node's python)."""
    node = Node(name="n", host="127.0.0.1", python="/bin/sh", env=node_env)
    argv = build_bench_argv(node, "/w d/worker-1", SPEC, 1.0)
    cut = argv.index("-m")  # what follows is for python; sh prints instead
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": own} if own else {})
    done = subprocess.run([*argv[:cut], "-c", 'printf %s "$PYTHONPATH"'], env=env, capture_output=True, text=True,
                          check=True)
    return done.stdout


def test_calibration_keeps_the_pythonpath_training_keeps() -> None:
    """The worker dir goes first and the node's PYTHONPATH (inventory env, else its own) stays after it, exactly as
    the rank script composes it (one helper, `pythonpath_prepend`): the bench imports what training imports."""
    assert _pythonpath((), None) == "/w d/worker-1"
    assert _pythonpath((), "/site/extra") == "/w d/worker-1:/site/extra"
    assert _pythonpath((("PYTHONPATH", "/inv/site"),), "/site/extra") == "/w d/worker-1:/inv/site"
    script = build_rank_script("r1", [(0, "/runs/r1/n", "/bin/python3", "/w d/worker-1")])
    assert f"  {pythonpath_prepend(shell_path('/w d/worker-1'))}\n" in script


BENCH_OK = {
    "curve": [{"batch": 1, "tokens_per_s": 900.0, "peak_memory": 2_000_000, "step_time_s": 0.1, "steps": 5},
              {"batch": 2, "tokens_per_s": 1500.0, "peak_memory": 3_000_000, "step_time_s": 0.12, "steps": 5}],
    "best_batch": 2, "best_tokens_per_s": 1500.0, "matmul_gflops": 5000.0, "matmul_dtype": "bfloat16",
    "device": {"architecture": "applegpu_g16s", "memory_size": 128 * GB, "backend": "gpu"},
    "memory_limit": 100 * GB, "stopped_because": "max_batch", "seconds": 12.5, "seq_len": 2048, "method": "lora",
    "num_layers": 16, "grad_checkpoint": False, "mlx_version": "0.32.4", "mlx_lm_version": "0.32.2",
}


def test_parse_bench_stdout_takes_the_last_json_object() -> None:
    noisy = "Last login: today\n{not json\n" + json.dumps(BENCH_OK) + "\n"
    assert parse_bench_stdout("n", noisy) == BENCH_OK
    with pytest.raises(CalibrationError, match="n: the bench printed no JSON result"):
        parse_bench_stdout("n", "Traceback (most recent call last):\n")


def test_calibration_from_bench() -> None:
    c = calibration_from_bench("m4max", BENCH_OK)
    assert c.curve == (CurvePoint(1, 900.0, 2_000_000), CurvePoint(2, 1500.0, 3_000_000))
    assert (c.memory_limit, c.seq_len, c.method, c.stopped_because) == (100 * GB, 2048, "lora", "max_batch")
    assert c.device_dict["backend"] == "gpu" and not c.cached


@pytest.mark.parametrize(("obj", "message"), [
    ({"error": "no model at /x", "seconds": 0.1}, "m: bench failed: no model at /x"),
    ({**BENCH_OK, "curve": []}, "bench result has no curve"),
    ({**BENCH_OK, "curve": [{"batch": 1, "tokens_per_s": "fast", "peak_memory": 1}]}, "'tokens_per_s' is not a number"),
    ({**BENCH_OK, "curve": [{"batch": 1, "tokens_per_s": -5.0, "peak_memory": 1}]}, "not a usable curve"),
])
def test_calibration_from_bench_errors(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        calibration_from_bench("m", obj)


def test_cache_record_round_trip_and_misses() -> None:
    text = json.dumps(build_cache_record("k1", "m4max", BENCH_OK))
    cached = parse_cache_record("m4max", "k1", text)
    assert cached is not None and cached.cached and cached.curve[1].tokens_per_s == 1500.0
    assert parse_cache_record("m4max", "k2", text) is None  # another key
    assert parse_cache_record("m4max", "k1", "{truncated") is None
    assert parse_cache_record("m4max", "k1", json.dumps({**json.loads(text), "schema": 0})) is None
    assert parse_cache_record("m4max", "k1", json.dumps({**json.loads(text), "bench": {"error": "x"}})) is None


def test_calibration_to_json_shape() -> None:
    fast = calibration_from_bench("m4max", BENCH_OK)
    slow = cal("ultra", [(1, 500.0, 10), (2, 750.0, 20)], seq_len=2048)
    plan = compute_plan([fast, slow], 5, seq_len=2048)
    out = calibration_to_json(plan, {"ultra": slow, "m4max": fast})
    assert out == {
        "nodes": [
            {"node": "m4max", "tokens_per_s": pytest.approx(plan.node_tokens_per_s("m4max")),
             "batch_size": plan.batch["m4max"], "share": plan.split["m4max"],
             "curve": [{"batch": 1, "tokens_per_s": 900.0, "peak_memory_bytes": 2_000_000},
                       {"batch": 2, "tokens_per_s": 1500.0, "peak_memory_bytes": 3_000_000}]},
            {"node": "ultra", "tokens_per_s": pytest.approx(plan.node_tokens_per_s("ultra")),
             "batch_size": plan.batch["ultra"], "share": plan.split["ultra"],
             "curve": [{"batch": 1, "tokens_per_s": 500.0, "peak_memory_bytes": 10},
                       {"batch": 2, "tokens_per_s": 750.0, "peak_memory_bytes": 20}]},
        ],
        "split": plan.split,
        # Two units, named: the plan's rates are real tokens/s, the bench's curve padded positions/s.
        "units": {"tokens_per_s": "real tokens/s", "curve.tokens_per_s": "padded positions/s"},
        # The predicted step in parts: no exchange measured here (the job adds it, planning/collective.py).
        "predicted_tokens_per_s": pytest.approx(plan.predicted_tokens_per_s),
        "step": {"predicted_s": pytest.approx(plan.predicted_step_s), "compute_s": pytest.approx(plan.predicted_step_s),
                 "collective": None, "collective_share": 0.0, "rehearsal": None},
    }
    assert list(out["nodes"][0]) == ["node", "tokens_per_s", "batch_size", "share", "curve"]
    json.dumps(out)  # serialisable
    with pytest.raises(PlanError, match="no calibration for planned node"):
        calibration_to_json(plan, [fast])


def test_dpo_pairs_are_planned_on_the_curve_in_pairs() -> None:
    from coordinator.planning.plan import CurvePoint, NodeCalibration, PlanError, per_example_calibration

    cal = NodeCalibration("a", (CurvePoint(1, 100.0, 10), CurvePoint(2, 180.0, 20), CurvePoint(4, 300.0, 40)), 1.0,
                          None, seq_len=64)
    pairs = per_example_calibration(cal, 2)
    assert [(p.batch, p.tokens_per_s, p.peak_memory) for p in pairs.curve] == [(1, 180.0, 20), (2, 300.0, 40)]
    assert per_example_calibration(cal, 1) is cal
    with pytest.raises(PlanError, match="cannot hold one example"):
        per_example_calibration(NodeCalibration("b", (CurvePoint(1, 5.0, 1),), 1.0, None), 2)


def test_per_block_timing_from_the_bench_and_its_cache() -> None:
    obj = {"blocks": 2, "micro_batch": 4, "block_s": 0.125, "embed_s": 0.01, "head_s": 0.2, "peak_memory": 2**30}
    assert layer_timing_from_bench("max", obj) == LayerTiming("max", 4, 0.125, 0.01, 0.2, TimingSource.BLOCKS)
    fused = layer_timing_from_bench("max", {**obj, "block_fused_s": 0.075})
    assert fused.last_layer_s == 0.075
    # The update and the memory the bench measured (an older worker's answer, above, has neither).
    sizes = {"update_s": 0.002, "block_bytes": 9 * 2**20, "backward_bytes": 5 * 2**20, "update_bytes": 3 * 2**20,
             "input_bytes": 2**18, "embed_bytes": 2**17, "head_bytes": 2**21}
    full = layer_timing_from_bench("max", {**obj, **sizes})
    assert full.update_s == 0.002
    assert full.memory == LayerMemory(4, 9 * 2**20, 5 * 2**20, 3 * 2**20, 2**18, 2**17, 2**21)
    assert layer_timing_from_bench("max", {**obj, "block_bytes": 1}).memory is None  # partial: not used
    with pytest.raises(CalibrationError, match="'input_bytes' is not a number"):
        layer_timing_from_bench("max", {**obj, **sizes, "input_bytes": "big"})
    with pytest.raises(CalibrationError, match="max: bench failed: out of memory"):
        layer_timing_from_bench("max", {"error": "out of memory"})
    # A worker without the per-block mode answers with a whole-model curve: said, not misread.
    with pytest.raises(CalibrationError, match=r"timed no blocks \(blocks None\): its worker has no per-block mode"):
        layer_timing_from_bench("max", {"curve": [{"batch": 1, "tokens_per_s": 10.0, "peak_memory": 1}]})
    with pytest.raises(CalibrationError, match="'block_s' is not a number"):
        layer_timing_from_bench("max", {**obj, "block_s": "fast"})
    with pytest.raises(CalibrationError, match="not a usable timing: max: layer_s must be a non-negative"):
        layer_timing_from_bench("max", {**obj, "block_s": -1.0})
    key = "k" * 32
    record = json.dumps(build_cache_record(key, "max", obj))
    assert parse_layer_cache_record("max", key, record) == layer_timing_from_bench("max", obj)
    assert parse_layer_cache_record("max", "other", record) is None  # another key: a miss
    assert parse_layer_cache_record("max", key, "{not json") is None
