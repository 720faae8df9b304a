"""worker.bench's sample of the run's steps over the data and its prediction of the run's mean step and median
rate (pure, table-driven), and how the coordinator turns a point into the plan's rates."""

from __future__ import annotations

import random
import statistics

import pytest

from coordinator.planning.plan import compute_plan
from coordinator.run.calibrate import calibration_from_bench
from worker.bench import (
    MAX_SHAPES,
    MIN_SAMPLE_STEPS,
    SAMPLE_ROWS,
    SAMPLE_STEPS,
    SampledStep,
    Shape,
    choose_shapes,
    horizon_steps,
    next_slice,
    plan_sample,
    pooled_spread,
    predict_point,
    shape_time,
    spread_indices,
)
from worker.shapes import meets_new_shape
from worker.step import input_positions, pack_rows


def packed(seqs: int, width: int = 127) -> Shape:
    """A packed batch's shape: inputs, targets, scored, segments, all [seqs, width]."""
    return ((seqs, width),) * 4


def padded(rows: int, width: int) -> Shape:
    """An unpacked (mlx-lm padded) batch's shape: tokens [rows, width], lengths [rows, 2]."""
    return ((rows, width), (rows, 2))


@pytest.mark.parametrize(("total", "count", "expected"), [
    (16, 16, list(range(16))),
    (16, 40, list(range(16))),
    (16, 4, [2, 6, 10, 14]),  # the middle of each quarter: the whole epoch, not its start
    (1000, 3, [166, 500, 833]),
    (5, 1, [2]),
])
def test_spread_indices(total: int, count: int, expected: list[int]) -> None:
    assert spread_indices(total, count) == expected


def test_plan_sample_takes_the_runs_steps_over_the_whole_epoch() -> None:
    # 64 rows, global batch 4: the run's 16 steps, every one of them (the old bench read the first 6 batches).
    assert plan_sample(64, 4, 4, 1) == [(4 * j,) for j in range(16)]
    # A big data set: SAMPLE_STEPS steps spread over all of it, each at a step boundary of the run.
    steps = plan_sample(100_000, 8, 8, 1)
    assert len(steps) == SAMPLE_STEPS and all(p % 8 == 0 for (p,) in steps)
    assert steps[0][0] < 100_000 // SAMPLE_STEPS and steps[-1][0] > 100_000 - 2 * 100_000 // SAMPLE_STEPS
    # A point below an equal share takes the first rows of each of the run's steps.
    assert plan_sample(64, 8, 2, 1)[:3] == [(0,), (8,), (16,)]


def test_plan_sample_of_a_short_run_is_its_own_steps() -> None:
    # 256 rows, global batch 8 (32 steps an epoch), a run of 20 steps: exactly its 20 steps, not the epoch's 32
    # (an H100's 20-step run read none of the epoch's few 8-sequence steps that calibration timed).
    assert plan_sample(256, 8, 8, 1, horizon=20) == [(8 * j,) for j in range(20)]
    # Longer than the epoch, or 0: the epoch.
    assert plan_sample(256, 8, 8, 1, horizon=500) == plan_sample(256, 8, 8, 1) == [(8 * j,) for j in range(32)]
    # A point above an equal share strides over the same 160 rows the run reads.
    assert plan_sample(256, 8, 16, 1, horizon=20) == [(16 * j,) for j in range(10)]
    with pytest.raises(ValueError):
        plan_sample(256, 8, 8, 1, horizon=-1)


def test_a_sample_of_horizon_steps_steps_is_the_whole_run() -> None:
    assert horizon_steps(256, 8, 8, 1, horizon=20) == len(plan_sample(256, 8, 8, 1, horizon=20)) == 20
    assert horizon_steps(256, 8, 8, 1) == len(plan_sample(256, 8, 8, 1)) == 32
    # A big data set: the sample is a spread of the epoch's steps, not all of them.
    assert horizon_steps(100_000, 8, 8, 1) == 12_500 > len(plan_sample(100_000, 8, 8, 1))


def test_a_step_compiles_where_some_rank_meets_a_new_shape() -> None:
    steps = [SampledStep((packed(1), packed(2)), 1), SampledStep((packed(1), packed(2)), 1),
             SampledStep((packed(2), packed(2)), 1), SampledStep((packed(2), packed(1)), 1),
             SampledStep((packed(1), packed(1)), 1)]
    # Rank 0 meets packed(2) on the third step, rank 1 packed(1) on the fourth; each rank compiles its own.
    assert meets_new_shape(s.shapes for s in steps) == [True, False, True, True, False]
    assert meets_new_shape([]) == []


def test_a_whole_runs_compiling_steps_count_in_its_median_rate_not_in_its_mean_step() -> None:
    # 10 steps of 1,000 tokens: 0.1 s each, 0.2 s for the 4-sequence shape; the first step of each shape compiles
    # (1 s). Without them the median rate is 10,000; the run's own median counts the two slow steps.
    shapes = [packed(1)] * 6 + [packed(4)] * 4
    steps = [SampledStep((s,), 1000) for s in [packed(1), packed(4), *shapes[1:6], *shapes[7:]]]
    timed, first = {packed(1): 0.1, packed(4): 0.2}, {packed(1): 1.0, packed(4): 1.5}
    steady = predict_point(steps, timed, 8)
    whole = predict_point(steps, timed, 8, first=first)
    assert whole.mean_step_s == steady.mean_step_s == pytest.approx((6 * 0.1 + 4 * 0.2) / 10)
    rates = [1000 / 1.0, 1000 / 1.5, *[1000 / 0.1] * 5, *[1000 / 0.2] * 3]
    assert whole.median_tokens_per_s == pytest.approx(statistics.median(rates))
    assert whole.median_tokens_per_s < steady.median_tokens_per_s == pytest.approx(10_000)
    assert whole.durations[:2] == (1.0, 1.5) and steady.durations[:2] == (0.1, 0.2)
    # A shape the point did not time compiles for as long as its neighbours in positions say.
    assert predict_point([SampledStep((packed(2),), 1000)], timed, 8, first=first).durations == (
        pytest.approx(1.0 + 0.5 / 3),)


def test_plan_sample_gives_every_rank_its_slice_of_a_step() -> None:
    # 2 ranks of 2 rows of a global batch of 4: rank r's slice starts at j * 4 + r * 2 (worker.data.rank_slice).
    assert plan_sample(64, 4, 2, 2)[:2] == [(0, 2), (4, 6)]
    # A point's batch above an equal share: steps stride by batch x world, so slices never overlap.
    assert plan_sample(1000, 8, 8, 2)[:2] == [(0, 8), (16, 24)]


def test_plan_sample_is_bounded_in_rows_but_keeps_a_minimum_of_steps() -> None:
    big = plan_sample(1_000_000, 64, 64, 1)
    assert len(big) == SAMPLE_ROWS // 64 and len(big) * 64 <= SAMPLE_ROWS
    assert len(plan_sample(1_000_000, 4096, 4096, 1)) == MIN_SAMPLE_STEPS
    assert plan_sample(3, 8, 8, 1) == [(0,)]  # smaller than one step: the one step there is
    with pytest.raises(ValueError):
        plan_sample(0, 8, 8, 1)


def test_choose_shapes_keeps_all_when_few_smallest_first() -> None:
    counts = {packed(4): 1, packed(1): 9, packed(2): 6}
    assert choose_shapes(counts) == [packed(1), packed(2), packed(4)]


def test_choose_shapes_brackets_then_takes_the_most_frequent() -> None:
    # Unpacked variable rows: one shape per padded width. The extremes are always timed (so every other shape is
    # interpolated between two timed ones), then the most frequent.
    frequency = [1, 9, 30, 25, 12, 7, 5, 3, 2, 1, 1, 1, 1, 1, 1, 2]
    counts = {padded(8, 32 * k + 1): c for k, c in enumerate(frequency, start=1)}
    chosen = choose_shapes(counts, limit=5)
    assert chosen == [padded(8, 33), padded(8, 97), padded(8, 129), padded(8, 161), padded(8, 513)]
    assert len(choose_shapes(counts)) == MAX_SHAPES


def test_shape_time_interpolates_in_positions_between_timed_shapes() -> None:
    timed = {padded(8, 33): 1.0, padded(8, 129): 3.0, padded(8, 513): 20.0}
    assert shape_time(padded(8, 129), timed) == 3.0
    assert shape_time(padded(8, 81), timed) == pytest.approx(2.0)  # halfway between 33 and 129
    assert shape_time(padded(8, 321), timed) == pytest.approx(11.5)
    assert shape_time(padded(8, 17), {padded(8, 33): 1.0}) == pytest.approx(17 / 33)  # beyond: proportional


def test_predict_point_one_rank() -> None:
    # Packed steps of a variable data set: 1, 2 or 4 sequences, whatever the tokens in them.
    steps = [SampledStep((packed(1),), 100), SampledStep((packed(1),), 120), SampledStep((packed(2),), 160),
             SampledStep((packed(4),), 400)]
    timed = {packed(1): 0.1, packed(2): 0.2, packed(4): 0.4}
    p = predict_point(steps, timed, 4)
    assert p.mean_step_s == pytest.approx((0.1 + 0.1 + 0.2 + 0.4) / 4)
    assert p.median_tokens_per_s == pytest.approx(statistics.median([1000, 1200, 800, 1000]))
    assert p.tokens_per_row == pytest.approx(780 / 16)


def test_predict_point_waits_for_the_slowest_rank() -> None:
    # Two ranks: a step lasts as long as its slowest slice, and counts both slices' tokens.
    steps = [SampledStep((packed(1), packed(2)), 300), SampledStep((packed(1), packed(1)), 200)]
    p = predict_point(steps, {packed(1): 0.1, packed(2): 0.2}, 4)
    assert p.mean_step_s == pytest.approx(0.15)
    assert p.median_tokens_per_s == pytest.approx(statistics.median([1500, 2000]))
    with pytest.raises(ValueError):
        predict_point([], {packed(1): 0.1}, 4)


def test_the_old_first_quartile_over_batches_overstates_a_variable_sets_rate() -> None:
    """Why per shape: the old point took the first quartile of seconds per token over its batches. On packed
    variable rows a step's time follows its shape, not its tokens, so that picked the best-filled batches: here
    (a lognormal chat-like set, the run's packing, step time proportional to the packed sequences) it says more
    than the run's median step rate, by a margin the per-shape prediction does not have."""
    rng = random.Random(7)
    lengths = [min(128, max(8, round(rng.lognormvariate(3.3, 0.8)))) for _ in range(4096)]
    steps, per_token = [], []
    for j in range(0, len(lengths), 4):
        rows = [([1] * n, 0) for n in lengths[j:j + 4]]
        seqs = pack_rows(rows, 128, 127).inputs.shape[0]
        tokens = sum(lengths[j:j + 4])
        steps.append(SampledStep((packed(seqs),), tokens))
        per_token.append(0.01 * seqs / tokens)
    run_median = statistics.median(s.tokens / (0.01 * s.shapes[0][0][0]) for s in steps)
    old = 1.0 / sorted(per_token[:12])[(12 - 1) // 4]  # 12 steps over the first 6 batches, as the old point did
    new = predict_point(steps[:64], {packed(k): 0.01 * k for k in (1, 2, 4)}, 4).median_tokens_per_s
    assert old > 1.15 * run_median
    assert new == pytest.approx(run_median, rel=0.05)
    assert all(input_positions(n, 128) <= 127 for n in lengths)


def test_pooled_spread_is_noise_within_shapes_not_the_difference_between_them() -> None:
    assert pooled_spread({packed(1): [0.1, 0.1, 0.1], packed(4): [0.4, 0.4, 0.4]}) == 0.0
    assert pooled_spread({packed(1): [0.1, 0.2, 0.1, 0.3], packed(4): [0.4, 0.8, 0.4, 0.4]}) > 0.25


def bench_output(points: list[tuple[int, float, float]], tokens_per_row: float | None) -> dict[str, object]:
    """A bench result: (batch, tokens_per_s = this rank's share of the run's median step rate, mean step s)."""
    curve = [{"batch": b, "tokens_per_s": r, "rows_per_s": b / s, "tokens_per_row": 30.0 + b, "peak_memory": 1000 * b,
              "step_time_s": s, "steps": 4} for b, r, s in points]
    out: dict[str, object] = {"curve": curve, "seq_len": 128, "method": "lora", "memory_limit": 10**9,
                              "matmul_gflops": 1.0, "stopped_because": "max_batch"}
    if tokens_per_row is not None:
        out["tokens_per_row"] = tokens_per_row
    return out


def test_the_plan_predicts_each_points_median_rate_with_the_datas_fill() -> None:
    # The fill is the data's (the bench's sample of the run's first rows), not each point's handful of rows; at a
    # measured batch the plan then predicts exactly that point's rate, whatever the fill.
    cal = calibration_from_bench("n", bench_output([(1, 500.0, 0.06), (2, 900.0, 0.07), (4, 1500.0, 0.1)], 33.0))
    assert cal.fill == pytest.approx(33.0 / 128)
    for batch, rate in ((1, 500.0), (2, 900.0), (4, 1500.0)):
        plan = compute_plan([cal], batch, seq_len=128)
        assert plan.predicted_tokens_per_s == pytest.approx(rate)
    # Without the data's fill (an older bench): the points' mean.
    assert calibration_from_bench("n", bench_output([(1, 500.0, 0.06), (2, 900.0, 0.07)], None)).fill == \
        pytest.approx((31 + 32) / 2 / 128)


def test_the_cache_key_changes_when_the_data_does() -> None:
    """A curve is measured on the data's length distribution, so new rows at the same path are measured again:
    the launch keys calibration on the manifest of the model AND data dirs (`job.model_digest(facts, ("model",
    "data"))`), which the probe hashes on every launch, --skip-preflight included."""
    from coordinator.facts.model import DirHashes, FileHash, NodeFacts
    from coordinator.run.calibrate import BenchSpec, NodeFingerprint, compute_cache_key
    from coordinator.run.job import model_digest

    def facts(data_sha: str) -> dict[str, NodeFacts]:
        model = DirHashes("m", True, (FileHash("model.safetensors", 10, "a" * 64),))
        data = DirHashes("d", True, (FileHash("train.jsonl", 10, data_sha * 64),))
        return {"n": NodeFacts(node="n", hashes=(model, data))}

    spec = BenchSpec(model="m", seq_len=128, method="lora", data="d")
    fingerprint = NodeFingerprint("chip", "id", 1 << 30, 8, None, "os", "0.32.4")
    keys = {compute_cache_key("n", fingerprint, spec, model_digest(facts(sha), ("model", "data")))
            for sha in ("b", "c")}
    assert len(keys) == 2
    same = {compute_cache_key("n", fingerprint, spec, model_digest(facts("b"), ("model", "data"))) for _ in range(2)}
    assert len(same) == 1


@pytest.mark.parametrize("packing", [True, False])
def test_a_sample_of_steps_predicts_a_bimodal_sets_epoch(packing: bool) -> None:
    """Generalises beyond the lognormal set: a bimodal one (70% one-line rows, 30% half to full length), 512 steps
    of 8 rows, padded (a shape per padded width: 6 timed, the others interpolated) or packed. Step time: a fixed
    cost, one per position and an attention term quadratic in the width (so interpolation is not exact). The
    point's sample (`plan_sample`: 64 of the 512 steps) predicts the whole epoch's mean step and median rate."""
    from worker.data import build_batch

    rng = random.Random(11)
    n, batch, seq = 4096, 8, 512
    lengths = [rng.randint(8, 64) if rng.random() < 0.7 else rng.randint(256, 512) for _ in range(n)]

    def shape_of(j: int) -> tuple[Shape, int]:
        rows = [([1] * k, 0) for k in lengths[j:j + batch]]
        arrays = pack_rows(rows, seq, seq - 1).arrays() if packing else build_batch(rows, seq)
        return tuple(tuple(a.shape) for a in arrays), sum(min(k, seq) for k in lengths[j:j + batch])

    def seconds(shape: Shape) -> float:
        rows, width = shape[0]
        return 0.05 + 1e-5 * rows * width + 2e-8 * rows * width * width

    epoch = [shape_of(j) for j in range(0, n, batch)]
    sample = [SampledStep((epoch[p // batch][0],), epoch[p // batch][1]) for (p,) in plan_sample(n, batch, batch, 1)]
    counts: dict[Shape, int] = {}
    for step in sample:
        counts[step.shapes[0]] = counts.get(step.shapes[0], 0) + 1
    timed = {shape: seconds(shape) for shape in choose_shapes(counts)}
    predicted = predict_point(sample, timed, batch)
    run_median = statistics.median(tokens / seconds(shape) for shape, tokens in epoch)
    run_mean = statistics.fmean(seconds(shape) for shape, _ in epoch)
    assert len(sample) == 64 and (packing or len(counts) > len(timed))
    assert predicted.median_tokens_per_s == pytest.approx(run_median, rel=0.08)
    assert predicted.mean_step_s == pytest.approx(run_mean, rel=0.08)


def test_a_point_times_the_runs_slices_in_the_runs_order_then_tops_up_a_rare_shape() -> None:
    big, small = packed(4), packed(1)
    order = [(big, 0), (big, 8), (small, 16), (big, 24)]
    # While the window has room: the run's order, cycled; a frequent shape gets most of the steps.
    taken = [next_slice(order, k, {}, 2, room=True) for k in range(6)]
    assert taken == [(big, 0), (big, 8), (small, 16), (big, 24), (big, 0), (big, 8)]
    # The window spent: a shape timed fewer than `each` times gets its own slices in turn, the smallest first.
    assert next_slice(order, 6, {big: 5, small: 1}, 2, room=False) == (small, 16)
    assert next_slice(order, 6, {big: 1, small: 0}, 2, room=False) == (small, 16)
    assert next_slice(order, 6, {big: 1, small: 2}, 2, room=False) == (big, 8)  # its second slice
    assert next_slice(order, 6, {big: 2, small: 2}, 2, room=False) is None
    assert next_slice([], 0, {}, 2, room=True) is None
