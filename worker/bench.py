"""Measure this node's real training throughput as a function of the local batch size.

Run by the coordinator on each node (the worker package is shipped alone: stdlib + mlx + mlx_lm only):
    python -m worker.bench --model DIR --seq-len N --method lora|dora|full [--num-layers K] [--grad-checkpoint]
                           [--data DIR [--mask-prompt] [--packing auto|on|off] [--global-batch B] [--steps N]
                            [--seed S]]
                           [--world-size N] [--optimizer adam] [--learning-rate LR] [--lora-rank R] [--lora-scale S]
                           [--lora-dropout D] [--train-embeddings]
                           [--time-budget 60] [--one-time-budget 600] [--max-batch 64] [--memory-fraction 0.8]
                           [--lockstep [--cpu-share I/N]] [--blocks K --micro-batch MB]

What is measured: THE RUN'S STEP on THE RUN'S BATCHES. The model is set up by `worker.modelsetup.apply_method` (the
run's own), the step is `worker.step.TrainStep.run` (what the run calls for every step: the batch's build on the
host, the compiled forward/backward, this rank's own statistics, scale, optimizer update, `mx.eval` of the new
parameters and optimizer state), and the batches are the run's: rows of the playbook's
dataset (`--data`) in the run's order (`worker.data.stream_rows` with the run's seed), padded or packed exactly as
the run pads or packs them (`worker.objectives.SftObjective`; packing decided by the same `decide_packing`). Without
`--data` (tests, a node without the dataset) rows of `seq_len` random tokens stand in.

For batch 1, 2, 4, 8, ... (and finally --max-batch itself), a point samples THE RUN'S STEPS OVER THE DATA
(`plan_sample`: the run's steps spread over its first epoch, or over its own steps when --steps is shorter, each
with the slice of every rank of --world-size),
groups their batches by shape (a step's time follows its batch's shape, not its real tokens), gives each timed shape
(`choose_shapes`) one warm-up step (it compiles: a one-time cost) and then timed steps on its own batches (at least
2 per shape, more while they are fast), and predicts (`predict_point`) the run's mean step time (each step as long
as its slowest rank's slice) and the rate the run reports: the median over steps of real tokens / step time (when
the sample is the whole run, its steps that meet a new shape last as long as that shape's compiling warm-up). A
shape's time is the median of its steps (the run's own statistic, its interference included). tokens/s = this rank's share of
that median; rows/s = batch / the mean step; peak memory from `mx.reset_peak_memory()` / `mx.get_peak_memory()`
around the point. A point whose steps spread by more than NOISY_SPREAD ((q3 - q1) / median of each step over its
shape's median) gets one more window of steps; if it is still that noisy it is reported with `noisy: true`.

The sweep stops at the first of: throughput below FALL_RATIO x the best so far at two points in a row (past the
knee: `throughput_fell`; one low point may be noise, so the next batch is measured too);
the next batch's peak memory, extrapolated linearly from the last two points, over `memory_fraction` of the
device's memory (`memory`); --max-batch measured (`max_batch`); the next point's predicted timed steps over the
measuring time left (`time_budget`); the one-time allowance spent (`one_time_budget`).

Two clocks, two allowances (`Budget`). A cold machine pays once for importing mlx, loading the model and, above all,
for JIT-compiling the kernels of each new batch shape on its first step (MLX caches them, on the CPU backend under
/tmp/mlx/<version>/: seconds per shape while that cache is empty, nothing once it is warm). Those one-time costs are
bounded by --one-time-budget and reported apart (`one_time_s`); --time-budget bounds the timed steps only, so the
same budget measures the same curve on a cold machine and on a warm one.

Lockstep (`--lockstep`, for nodes that share a machine: the coordinator runs their benches together, as their
ranks will run). Before the timed steps of each point the bench says `bench lockstep ready batch=B` on stderr and
waits for a line on stdin; after them it says `bench lockstep timed batch=B` and keeps taking untimed steps of
that batch until the next line, so a node that finished its window early still loads the machine while the others
time theirs; after its result it keeps taking untimed steps of its best batch until stdin ends (the whole group is
done). The coordinator answers each wait once every member of the group is waiting (`coordinator.planning.colocate`).
Waiting is charged to the one-time allowance; stdin at its end releases every wait at once. With `--cpu-share I/N`
(members that compute on the machine's CPU) the bench first takes the I-th of N equal slices of its CPUs, as the
run's rank will (`worker.cpus`; the result then names them: "cpus").

Output: ONE JSON object on stdout (progress lines go to stderr):
    {"curve": [{"batch", "tokens_per_s", "rows_per_s", "tokens_per_row", "peak_memory", "step_time_s", "steps",
                "spread", "noisy", "shapes", "timed_shapes", "sampled_steps",
                "shape_times": [[positions, median_s, steps]], "sample": [[stream_position, tokens, predicted_s]]}],
     "best_batch", "packing": [bool, why],
     "tokens_per_row" (the data's: the run's first FILL_ROWS rows),
     "best_tokens_per_s", "matmul_gflops", "matmul_dtype", "device": {...}, "memory_limit",
     "stopped_because": "throughput_fell|memory|max_batch|time_budget|one_time_budget", "seconds", "seq_len",
     "method", "num_layers", "grad_checkpoint", "mlx_version", "mlx_lm_version",
     "one_time_s": {"import", "matmul", "load", "first_steps": {batch: s}}, "one_time_total_s", "measure_s",
     "gradients": {dtype: elements}}  (the trainable gradients a dp step all_sums)
`seconds` counts from the start of `main` (imports of mlx and the model load included).

Per-block mode (`--blocks K --micro-batch MB`, for the pipeline planner): instead of the curve, K transformer
blocks loaded alone as a pipeline stage loads them (so a node that cannot hold the whole model is measured too),
timed at MB rows per micro-batch (`worker.parallel.pipeline.measure`); ONE JSON object
    {"blocks": K, "micro_batch": MB, "block_s", "block_fused_s", "embed_s", "head_s", "update_s", "peak_memory",
     "block_bytes", "backward_bytes", "update_bytes", "input_bytes", "embed_bytes", "head_bytes",
     "blocks_weight_bytes", "model_layers",
     "timed_layers", "seq_len", "method", "num_layers", "dtype", "hidden",
     "repeats", "matmul_gflops", "matmul_dtype", "device", "memory_limit", "mlx_version", "mlx_lm_version",
     "one_time_s", "seconds"}
seconds per micro-batch: `block_s` per block as a non-last stage runs it (forward, then the vjp that recomputes
it), `block_fused_s` as the last stage runs it, `embed_s` / `head_s` what the first / last stage adds,
`update_s` the optimizer update per block; bytes per block: `block_bytes` held throughout (weights, optimizer
state), `backward_bytes` / `update_bytes` what the backward / update phase adds at its peak; `input_bytes` one
micro-batch's activation, `embed_bytes` / `head_bytes` what the first / last stage adds.

Failure semantics: any error prints `{"error": "...", "seconds": ...}` and exits 1. A watchdog thread holds each
clock to its allowance: when one is spent while the main thread is still busy (a step, a load), the watchdog prints
the points measured so far (`stopped_because: time_budget` or `one_time_budget`, exit 0) or, when there are none,
an error that says which allowance ran out, during what, and what to set (exit 1), and ends the process. So the
bench never hangs and never outlives --time-budget + --one-time-budget by more than the output takes. A step that
fails to allocate after at least one point was measured ends the sweep with `memory` instead of an error.

Compatibility: Python 3.9+ (annotations only under `from __future__ import annotations`); mlx is imported lazily so
the pure decision functions import without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TextIO, cast

from worker import kernelcache
from worker.cpus import describe_share, take_share
from worker.runconfig import DEFAULT_HEADROOM
from worker.shapes import meets_new_shape

FALL_RATIO = 0.97  # a rate below this fraction of the best so far is past the knee, not noise
MIN_STEPS = 3  # timed steps per point, at least: the median of 3 survives one outlier
MAX_STEPS = 20
MATMUL_N = 1024
CANDIDATES = 6  # batches an untimed filler step cycles through (lockstep), from the run's order
# The point's sample of the run's steps (`plan_sample`): steps spread over the first epoch, as many as fit these
# bounds (building a step's batches is host work, paid once per point) and at least MIN_SAMPLE_STEPS.
SAMPLE_STEPS = 64
SAMPLE_ROWS = 4096
MIN_SAMPLE_STEPS = 8
MAX_SHAPES = 6  # distinct batch shapes timed per point (each compiles once); the others are interpolated
FILL_ROWS = 1024  # rows of the run's order whose mean real tokens is the data's fill (decide_packing samples as many)
NOISY_SPREAD = 0.25  # (q3 - q1) / median of a point's per-token step times above which it is measured again
IMPLAUSIBLE = 2.0  # a step of fewer rows this many times as long as one of more rows: a disturbed point (`disturbed`)
STOP_REASONS = ("throughput_fell", "memory", "max_batch", "time_budget", "one_time_budget")
ONE_TIME, MEASURE = "one_time", "measure"  # the two clocks of a `Budget`
WATCHDOG_POLL_S = 0.1
HEARTBEAT_S = 10.0  # a line at least this often while a one-time phase (a compiling first step) runs: never looks hung


@dataclass(frozen=True)
class Point:
    """One measured batch size. `warmup_s` is the first (compiling) step, kept to predict the next point."""

    batch: int
    tokens_per_s: float  # real (non-pad) tokens
    peak_memory: int
    step_time_s: float  # one step of `batch` rows
    steps: int
    warmup_s: float
    tokens_per_row: float = 0.0
    spread: float = 0.0
    noisy: bool = False
    shapes: int = 1  # distinct batch shapes among the sampled steps' slices
    timed_shapes: int = 1  # of which timed (the others interpolated: `shape_time`)
    sampled_steps: int = 0  # the run's steps sampled over the data (`plan_sample`)
    # The evidence behind the rate, so a run's steps can be held against it step by step: each timed shape's
    # (input positions, median seconds, timed steps), and each sampled step's (stream position, real tokens,
    # predicted seconds).
    shape_times: tuple[tuple[int, float, int], ...] = ()
    sample: tuple[tuple[int, int, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "rows_per_s": round(self.batch / self.step_time_s, 6),
            "tokens_per_row": round(self.tokens_per_row, 3),
            "peak_memory": self.peak_memory,
            "step_time_s": round(self.step_time_s, 6),
            "steps": self.steps,
            "spread": round(self.spread, 4),
            "noisy": self.noisy,
            "shapes": self.shapes,
            "timed_shapes": self.timed_shapes,
            "sampled_steps": self.sampled_steps,
            "shape_times": [[size, round(t, 6), n] for size, t, n in self.shape_times],
            "sample": [[position, tokens, round(t, 6)] for position, tokens, t in self.sample],
        }


class BenchError(Exception):
    """A failure the bench reports as `{"error": ...}` (bad arguments, unreadable model, ...)."""


class _OutOfMemory(Exception):
    """A step failed to allocate after at least one point was measured: the sweep ends there (`memory`)."""


def looks_like_oom(exc: BaseException) -> bool:
    """mlx reports allocation failures as RuntimeError with text like "[metal::malloc] Unable to allocate" or
    "Insufficient Memory"; MemoryError is Python's own."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("memory", "allocate", "malloc", "oom"))


# ----------------------------------------------------------------------------------------------------------------
# Pure decisions (no mlx, no clock): what the sweep does next.


def next_batch(batch: int, max_batch: int) -> int:
    """Doubling, but the last point is max_batch itself so a non-power-of-two cap is measured too."""
    return min(batch * 2, max_batch)


def sweep_points(max_batch: int) -> int:
    """How many points a sweep to `max_batch` measures at most (1, 2, 4, ... and max_batch itself)."""
    batch, points = 1, 1
    while batch < max_batch:
        batch, points = next_batch(batch, max_batch), points + 1
    return points


def point_window(time_budget: float, seconds_left: float, batch: int, max_batch: int) -> float:
    """Timed seconds for the point at `batch`: the measuring time left shared over the points the sweep can still
    reach from it, plus one share kept for a noisy point's second window; at least 5% of the budget and 0.5 s.
    Time a point leaves unused (it reached its step cap) goes to the points after it, the larger batches, whose
    steps are fewer per second.

    Why not less: a point's shape times are medians of its steps, and a step on a GPU swings by 20-30% from one to
    the next on variable rows (M LoRA on an H100: 0.06-0.19 s for one shape); the fixed half of the budget used
    before timed 5-7 steps a shape there, and two calibrations of one cell disagreed by 25% (0.130 vs 0.145 s).
    A 0.3 s window gave single points 25% off on a busy machine; the old `max(0.5 s, 5%)` timed 3 steps of a
    0.25 s step, whose median moved 10% between calibrations."""
    points_left = sweep_points(max_batch) - sweep_points(batch) + 1
    return max(0.5, 0.05 * time_budget, seconds_left / (points_left + 1))


Shape = tuple[tuple[int, ...], ...]  # the shapes of one batch's input arrays: what a compiled step is keyed on


@dataclass(frozen=True)
class SampledStep:
    """One step of the run as calibration samples it: the batch shape of each rank's slice (the step lasts as long
    as its slowest rank's) and the real tokens of all slices (what the run's step rate counts)."""

    shapes: tuple[Shape, ...]
    tokens: int
    position: int = 0  # rank 0's stream position: the run's step is position // global batch


@dataclass(frozen=True)
class StepPrediction:
    """What a point predicts of the run's steps at its batch (`predict_point`)."""

    mean_step_s: float  # the run's mean step time (each step: its slowest rank's slice)
    median_tokens_per_s: float  # median over steps of all ranks' real tokens / step time: what the run reports
    tokens_per_row: float  # mean real tokens per row of the sampled slices
    durations: tuple[float, ...] = ()  # each sampled step's predicted seconds, in the steps' order


def shape_size(shape: Shape) -> int:
    """Input positions of a batch (rows x width of its first array): what its step's compute grows with."""
    return math.prod(shape[0]) if shape and shape[0] else 0


def spread_indices(total: int, count: int) -> list[int]:
    """`count` of range(total), evenly spread (the middle of each of `count` equal parts); all when count >= total."""
    if count >= total:
        return list(range(total))
    return [(2 * k + 1) * total // (2 * count) for k in range(count)]


def plan_sample(rows: int, global_batch: int, batch: int, world: int, horizon: int = 0) -> list[tuple[int, ...]]:
    """The steps a point samples: for each, the stream position of every rank's slice of `batch` rows.

    The run's step j reads stream rows [j*G, (j+1)*G) and rank r its slice from j*G + r*batch (`worker.data`).
    Steps are spread over the rows the run reads in its first epoch: its first `horizon` steps' rows (`--steps`:
    a short run's median is that of its own steps, not of the data's), or the whole epoch (horizon 0, or a run
    longer than an epoch); rows // G steps of them, a stride of batch*world when a point's batch is above an equal
    share of G. At most SAMPLE_STEPS and SAMPLE_ROWS rows, at least MIN_SAMPLE_STEPS. Pure; the same on every
    node."""
    stride = max(global_batch, batch * world)
    steps = horizon_steps(rows, global_batch, batch, world, horizon)
    count = max(min(MIN_SAMPLE_STEPS, steps), min(SAMPLE_STEPS, steps, SAMPLE_ROWS // (batch * world)))
    return [tuple(j * stride + r * batch for r in range(world)) for j in spread_indices(steps, count)]


def horizon_steps(rows: int, global_batch: int, batch: int, world: int, horizon: int = 0) -> int:
    """How many steps `plan_sample` samples from: the run's first `horizon` steps, or its first epoch's. A sample
    of that many steps is every step of the run, in its order. Pure."""
    if rows < 1 or batch < 1 or world < 1 or horizon < 0:
        raise ValueError(f"rows, batch and world must be positive, got {rows}, {batch}, {world} (horizon {horizon})")
    stride = max(global_batch, batch * world)
    read = min(rows, horizon * global_batch) if horizon and global_batch else rows
    return max(1, read // stride)


def choose_shapes(counts: Mapping[Shape, int], limit: int = MAX_SHAPES) -> list[Shape]:
    """The shapes a point times, smallest first: all when at most `limit`; else the smallest and the largest (so
    every other shape lies between two timed ones) and then the most frequent. Pure."""
    if limit < 2:
        raise ValueError(f"limit must be >= 2, got {limit}")
    if len(counts) <= limit:
        return sorted(counts, key=lambda s: (shape_size(s), s))
    chosen = {min(counts, key=lambda s: (shape_size(s), s)), max(counts, key=lambda s: (shape_size(s), s))}
    for shape in sorted(counts, key=lambda s: (-counts[s], shape_size(s), s)):
        if len(chosen) >= limit:
            break
        chosen.add(shape)
    return sorted(chosen, key=lambda s: (shape_size(s), s))


def next_slice(order: Sequence[tuple[Shape, int]], taken: int, counts: Mapping[Shape, int], each: int,
               room: bool) -> tuple[Shape, int] | None:
    """The slice a point times next, as (shape, stream position). While the point's window has `room`: slice
    number `taken` of `order` (the sampled steps' slices of timed shapes in the run's order, cycled), so the steps
    switch shapes as often as the run's do. After it: a slice of the smallest shape still timed fewer than `each`
    times, on its own slices in turn; None when every shape has its minimum.

    Why the run's order and not shape after shape, as before: the steps go to the shapes as the run's do, so the
    shapes that make up the run's median get the most of them (packed rows at batch 8: the largest shape on most
    steps; shape after shape gave a shape met once in 40 steps as many as it), and each step follows the shape the
    run's would. Whether a shape switch itself costs was measured on an H100 (S full, variable rows,
    `benchmarks/probe_rank_vs_bench.py` kinds `bench` and `bench+rr`): no; the same steps' median moved more
    between two processes of one order (0.024 vs 0.036 s) than between the orders. Pure."""
    if room:
        return order[taken % len(order)] if order else None
    shapes = dict.fromkeys(shape for shape, _ in order)
    lacking = [shape for shape in shapes if counts.get(shape, 0) < each]
    if not lacking:
        return None
    shape = min(lacking, key=lambda s: (shape_size(s), s))
    own = [position for s, position in order if s == shape]
    return shape, own[counts.get(shape, 0) % len(own)]


def shape_time(shape: Shape, timed: Mapping[Shape, float]) -> float:
    """A step's time for `shape`: measured, or interpolated linearly in input positions between the nearest timed
    shapes below and above (beyond them: proportional to the nearest one's). `timed` must not be empty."""
    if shape in timed:
        return timed[shape]
    size = shape_size(shape)
    points = sorted((shape_size(s), t) for s, t in timed.items())
    below = [p for p in points if p[0] <= size]
    above = [p for p in points if p[0] >= size]
    if below and above:
        (x0, t0), (x1, t1) = below[-1], above[0]
        return t0 if x1 == x0 else t0 + (t1 - t0) * (size - x0) / (x1 - x0)
    x, t = below[-1] if below else above[0]
    return t * size / x if x > 0 else t


def predict_point(steps: Sequence[SampledStep], timed: Mapping[Shape, float], rows_per_step: int,
                  first: Mapping[Shape, float] | None = None) -> StepPrediction:
    """The run's steps at this point from the sampled steps and the timed shapes: each step lasts as long as its
    slowest slice (the ranks wait for each other in the gradient all_sum; the collective itself is not in here);
    the mean step time of the steady steps is the run's ETA, the median of the steps' real tokens / step time the
    rate the run reports (`Monitor.run_tokens_per_s`). `rows_per_step`: all slices' rows.

    `first` (when the sample is every step of the run, in its order): each shape's compiling first step; a step on
    which some rank meets a new shape (`worker.shapes.meets_new_shape`) lasts that long, as the run's does, and counts in the
    median rate as the run counts it: 2 of a 20-step run's steps on variable rows compile, and leaving them out
    predicted S and M LoRA 16-18% above the runs' medians on an H100. The mean step leaves them out (a one-time
    cost: the sweep's stop rules and rows/s are of the steady step). Pure."""
    if not steps or not timed:
        raise ValueError("no sampled step or no timed shape")
    steady = [max(shape_time(s, timed) for s in step.shapes) for step in steps]
    durations = list(steady)
    if first:
        for k, (step, compiles) in enumerate(zip(steps, meets_new_shape(s.shapes for s in steps))):
            if compiles:
                durations[k] = max(steady[k], max(shape_time(s, first) for s in step.shapes))
    rates = [step.tokens / d for step, d in zip(steps, durations)]
    return StepPrediction(
        mean_step_s=statistics.fmean(steady),
        median_tokens_per_s=statistics.median(rates),
        tokens_per_row=sum(step.tokens for step in steps) / (len(steps) * rows_per_step),
        durations=tuple(durations),
    )


def pooled_spread(times: Mapping[Shape, Sequence[float]]) -> float:
    """How much a point's steps disagree, shape by shape: the spread of each step's time over its shape's median,
    all shapes pooled (two shapes of one point differ by their work, which is not noise)."""
    ratios = [t / statistics.median(ts) for ts in times.values() if ts for t in ts if statistics.median(ts) > 0]
    return spread(ratios)


def predict_peak_memory(curve: list[Point], batch: int) -> float:
    """Peak memory at `batch`, extrapolated linearly from the last two points (weights and optimizer state are the
    intercept, activations the slope). With one point: proportional to the batch, which over-estimates (safe)."""
    last = curve[-1]
    if len(curve) == 1:
        return last.peak_memory * batch / last.batch
    prev = curve[-2]
    slope = max(0.0, (last.peak_memory - prev.peak_memory) / (last.batch - prev.batch))
    return last.peak_memory + slope * (batch - last.batch)


def predict_point_cost(last: Point, batch: int) -> float:
    """Measuring seconds the point at `batch` needs at least: MIN_STEPS timed steps. Its warm-up step (the
    compile of the new shape) is a one-time cost, charged to the other allowance. Step time scales with the rows
    (pessimistic before the knee, right after it)."""
    return last.step_time_s * batch / last.batch * MIN_STEPS


def decide_stop(
    curve: list[Point], *, max_batch: int, memory_limit: float, seconds_left: float, truncated: bool = False
) -> str | None:
    """Why the sweep stops after the last point of `curve`, or None to measure `next_batch`.

    `truncated`: the last point ran out of time before its planned steps (the budget is spent)."""
    last = curve[-1]
    best = max(p.tokens_per_s for p in curve)
    fell = last.tokens_per_s < FALL_RATIO * best
    # The knee is confirmed by two points in a row below the best: one low point is as likely a noisy
    # measurement (a busy moment, a throttled period) as the knee, and stopping on it once left the whole curve
    # beyond it unmeasured and the plan built on the outlier.
    if fell and len(curve) >= 2 and curve[-2].tokens_per_s < FALL_RATIO * best:
        return "throughput_fell"
    if truncated:
        return "time_budget"
    if last.batch >= max_batch:
        return "throughput_fell" if fell else "max_batch"
    upcoming = next_batch(last.batch, max_batch)
    if predict_peak_memory(curve, upcoming) > memory_limit:
        return "memory"
    if predict_point_cost(last, upcoming) > seconds_left:
        return "time_budget"
    return None


def sweep(
    measure: Callable[[int], tuple[Point | None, bool]],
    *,
    max_batch: int,
    memory_limit: float,
    seconds_left: Callable[[], float],
    on_point: Callable[[Point], None] = lambda p: None,
) -> tuple[list[Point], str]:
    """Measure batch 1, 2, 4, ... until `decide_stop` says why not. `measure(batch)` returns the point (None when
    not even one timed step fitted in the measuring time left) and whether it was cut short by that allowance;
    `seconds_left()` is the measuring time left. Returns the curve (possibly empty) and the stop reason."""
    curve: list[Point] = []
    batch = 1
    while True:
        point, truncated = measure(batch)
        if point is None:
            return curve, "time_budget"
        curve.append(point)
        on_point(point)
        reason = decide_stop(
            curve, max_batch=max_batch, memory_limit=memory_limit, seconds_left=seconds_left(),
            truncated=truncated,
        )
        if reason is not None:
            return curve, reason
        batch = next_batch(batch, max_batch)


def disturbed(curve: Sequence[Point]) -> list[int]:
    """The batches whose point is implausible against a larger batch of the same sweep: its step took more than
    IMPLAUSIBLE times as long as a step of more rows. A step of more rows does at least the work of a step of fewer;
    on variable rows a shape's kernels can make it somewhat shorter (up to 1.5x on an H100's launch-bound steps,
    docs/benchmarks-history.md, session 9), never half. Such a point was slowed for as long as it was measured, by
    something that shared the machine then (the suite's other worker held a test node's core through its whole
    batch-1 point: 3.3x the batch-2 step), so its steps agree with each other and it is not NOISY. The split pools it
    away (the planner's isotonic fit), but the point's own rate is what a rank trained at that batch is predicted
    and judged by: a straggler slowed 8x was not one against a batch-1 rate measured 8.7x below its twin node's."""
    out = []
    for i, point in enumerate(curve):
        larger = [q.step_time_s for q in curve[i + 1:] if q.batch > point.batch]
        if larger and point.step_time_s > IMPLAUSIBLE * min(larger):
            out.append(point.batch)
    return out


def look_again(
    curve: list[Point],
    measure: Callable[[int], tuple[Point | None, bool]],
    *,
    seconds_left: Callable[[], float],
    log: Callable[[str], None] = lambda line: None,
) -> list[Point]:
    """The curve after a second look at each `disturbed` point: that batch measured once more while the measuring
    time lasts, and the faster of its two points kept (interference only ever slows a step, so the faster is the
    closer to the node's speed; its first, compiling step's time stays the first look's). In a lockstep group the
    second look waits with the others as any point does: the barrier pairs waits in order and a member that has
    finished keeps loading the machine, so the point is timed beside the load the run will have."""
    out = list(curve)
    for batch in disturbed(curve):
        i = next(k for k, p in enumerate(out) if p.batch == batch)
        first = out[i]
        quickest = min(p.step_time_s for p in out[i + 1:] if p.batch > batch)
        what = (f"bench batch={batch} step_s={first.step_time_s:.4f} is more than {IMPLAUSIBLE:g}x the "
                f"{quickest:.4f}s of a larger batch's step: disturbed while measured")
        if seconds_left() < MIN_STEPS * quickest:
            log(f"{what}; no measuring time left for a second look (raise calibration.time_budget)")
            continue
        again, _ = measure(batch)
        if again is None or again.steps < MIN_STEPS:
            # A look cut short by the budget is a step or two: too few to stand for the batch in place of a point.
            log(f"{what}; its second look timed {again.steps if again else 0} step(s), too few to replace it")
            continue
        kept = replace(again, warmup_s=first.warmup_s) if again.step_time_s < first.step_time_s else first
        log(f"{what}; second look step_s={again.step_time_s:.4f}, kept {kept.step_time_s:.4f}")
        out[i] = kept
    return out


def build_result(
    curve: list[Point], stopped_because: str, *, memory_limit: int, matmul: tuple[float, str] | None,
    device: dict[str, Any], meta: dict[str, Any], seconds: float,
) -> dict[str, Any]:
    """The stdout JSON object (see the module docstring)."""
    best = max(curve, key=lambda p: (p.tokens_per_s, -p.batch))
    return {
        "curve": [p.to_json() for p in curve],
        "best_batch": best.batch,
        "best_tokens_per_s": round(best.tokens_per_s, 3),
        "matmul_gflops": round(matmul[0], 3) if matmul else None,
        "matmul_dtype": matmul[1] if matmul else None,
        "device": device,
        "memory_limit": memory_limit,
        "stopped_because": stopped_because,
        "seconds": round(seconds, 3),
        **meta,
    }


class Budget:
    """Two allowances on one clock: `one_time` (imports, the matmul probe, the model load and the first, compiling,
    step of each batch shape) and `measure` (the timed steps). Exactly one is running at a time; `enter` switches.
    Thread-safe: the watchdog reads it while the main thread works. The clock is injected (tests drive it)."""

    def __init__(self, *, one_time_s: float, measure_s: float, clock: Callable[[], float]) -> None:
        self.limits = {ONE_TIME: float(one_time_s), MEASURE: float(measure_s)}
        self.spent = {ONE_TIME: 0.0, MEASURE: 0.0}
        self.clock = clock
        self.running = ONE_TIME
        self.since = clock()
        self.lock = threading.Lock()

    def enter(self, kind: str) -> None:
        """Charge the time since the last switch to the running allowance, then run `kind`."""
        with self.lock:
            now = self.clock()
            self.spent[self.running] += now - self.since
            self.running, self.since = kind, now

    def used(self, kind: str) -> float:
        with self.lock:
            extra = self.clock() - self.since if kind == self.running else 0.0
            return self.spent[kind] + extra

    def left(self, kind: str) -> float:
        return self.limits[kind] - self.used(kind)

    def overrun(self) -> str | None:
        """The allowance that is spent (only the running one can run out), or None."""
        with self.lock:
            kind = self.running
        return kind if self.left(kind) <= 0 else None


def _round_up(seconds: float) -> int:
    """A value worth typing into a playbook: 10 s steps up to a minute, then whole minutes."""
    step = 10 if seconds <= 60 else 60
    return int(math.ceil(seconds / step) * step)


def advise_no_point(kind: str, *, limit: float, phase: str, step_s: float | None, one_time: dict[str, Any]) -> str:
    """Why no point was measured and what to set, in words a user acts on.

    `kind` is the allowance that ran out (`one_time` or `measure`), `phase` what the bench was doing, `step_s`
    the best guess of one training step of batch 1 (None when no step ran), `one_time` the one-time costs so far."""
    if kind == ONE_TIME:
        spent = ", ".join(f"{k} {v:.1f}s" for k, v in one_time.items() if isinstance(v, (int, float)))
        return (f"one-time costs (importing mlx, loading the model, compiling the first step of each batch shape) "
                f"took more than calibration.one_time_budget of {limit:g}s, spent while {phase}"
                + (f" (so far: {spent})" if spent else "")
                + f"; raise calibration.one_time_budget (to at least {_round_up(2 * limit)}) or warm the node's "
                  "MLX kernel cache with one run")
    need = ""
    if step_s is not None and step_s > 0:
        need = (f" (one step of batch 1 takes about {step_s:.1f}s here and a point needs {MIN_STEPS} timed steps)"
                f"; set calibration.time_budget to at least {_round_up(max(2 * limit, (MIN_STEPS + 1) * step_s))}")
    else:
        need = f"; set calibration.time_budget to at least {_round_up(2 * limit)}"
    return (f"calibration.time_budget of {limit:g}s (timed steps only) ran out while {phase}, before one point "
            f"of batch 1 was measured{need}, or a smaller train.max_seq_length")


def describe_first_step(batch: int, cache: Path, cold: bool) -> str:
    """The announcement of a batch's first (compiling) step: on a cold kernel cache, where the time goes and that it
    is paid once."""
    if cold:
        return (f"bench batch={batch} first step: compiling MLX's kernels (the cache {cache} is empty: a one-time "
                f"cost, a minute or more on a small CPU; later runs reuse it)")
    return f"bench batch={batch} first step: compiling this batch shape (one-time)"


class Ticker:
    """Says that a one-time phase is still running, every `every` seconds of `clock` (injected: tests drive it).
    `poll()` is called often (by `ticking`'s thread); it logs only when a line is due."""

    def __init__(self, what: str, log: Callable[[str], None], clock: Callable[[], float],
                 every: float = HEARTBEAT_S) -> None:
        self.what, self.log, self.clock, self.every = what, log, clock, every
        self.began = clock()
        self.due = self.began + every

    def poll(self) -> None:
        now = self.clock()
        if now >= self.due:
            self.log(f"{self.what}: still running, {now - self.began:.0f}s")
            self.due = now + self.every


def ticking(ticker: Ticker, fn: Callable[[], Any], poll_s: float = 1.0) -> Any:
    """`fn()` with `ticker` polled from a thread while it runs (mlx releases the GIL while it compiles and
    evaluates, so the thread does run). Returns what `fn` returns; its exceptions pass through."""
    with ticker_running(ticker, poll_s):
        return fn()


@contextlib.contextmanager
def ticker_running(ticker: Ticker, poll_s: float = 1.0) -> Iterator[Ticker]:
    """`ticker` polled from a thread for the duration of the block (see `ticking`)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(poll_s):
            ticker.poll()

    thread = threading.Thread(target=loop, name="bench-ticker", daemon=True)
    thread.start()
    try:
        yield ticker
    finally:
        done.set()
        thread.join()


class Lockstep:
    """The bench's half of the coordinator's barrier (see "Lockstep" in the module docstring): a thread reads
    stdin, `wait` announces a wait on stderr and returns at the next line; `busy`, when given, is called between
    looks (an untimed step that keeps the machine loaded) and ends the wait early by returning False. Once stdin
    has ended every wait returns at once: the coordinator released the group or is gone."""

    def __init__(self, stream: IO[str], log: Callable[[str], None]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False
        self.log = log
        threading.Thread(target=self._read, args=(stream,), name="bench-lockstep", daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self.lines.put(line)
        finally:
            self.lines.put(None)

    def wait(self, what: str, busy: Callable[[], bool] | None = None) -> None:
        if self.ended:
            return
        self.log(f"bench lockstep {what}")
        while True:
            if busy is None:
                item = self.lines.get()
            else:
                try:
                    item = self.lines.get_nowait()
                except queue.Empty:
                    if busy():
                        continue
                    return
            if item is None:
                self.ended = True
            return


# ----------------------------------------------------------------------------------------------------------------
# I/O: mlx, the clock, stdout.


class _Output:
    """Writes exactly one JSON object to the real stdout, whoever (main thread or watchdog) gets there first."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.done = False

    def emit(self, obj: dict[str, Any]) -> bool:
        with self.lock:
            if self.done:
                return False
            self.stream.write(json.dumps(obj) + "\n")
            self.stream.flush()
            self.done = True
            return True


@dataclass
class _State:
    """What the watchdog reads if it has to answer for the main thread."""

    started: float
    curve: list[Point]
    budget: Budget
    memory_limit: int = 0
    matmul: tuple[float, str] | None = None
    device: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    phase: str = "starting"
    one_time: dict[str, Any] = field(default_factory=dict)  # import, matmul, load (s); first_steps {batch: s}
    step_s: float | None = None  # the latest single-step time seen (the warm-up's until a timed step ran)
    lockstep: Lockstep | None = None  # --lockstep: the group's barrier
    kernel_cache: Path = Path()  # MLX's shared kernel cache (`kernelcache.shared_dir`)
    cold_kernels: bool = False  # it was empty when the bench started: the first step compiles everything
    linger: Callable[[], None] | None = None  # --lockstep: after the result, load the machine until released
    cpus: tuple[int, ...] | None = None  # --cpu-share: the CPUs this bench was pinned to (None: not pinned)
    # Each batch shape's first step in this process, whichever point met it first: what the run's fresh process
    # pays for it. A later point whose shape an earlier one compiled (packed rows: batches 1 and 2 fold into one
    # 32-position row) runs it warm, and predicting the run's first step from that warm step gave batch 2 of a
    # 2-step run 4.9x batch 1's tokens/s, where its twice the rows explain 2x (CI26).
    first_met: dict[Shape, float] = field(default_factory=dict)

    def extra(self) -> dict[str, Any]:
        """The one-time costs and measuring time, as the result reports them."""
        first = self.one_time.get("first_steps") or {}
        one_time = {k: round(v, 3) for k, v in self.one_time.items() if k != "first_steps"}
        one_time["first_steps"] = {str(b): round(v, 3) for b, v in first.items()}
        return {"one_time_s": one_time, "one_time_total_s": round(self.budget.used(ONE_TIME), 3),
                "measure_s": round(self.budget.used(MEASURE), 3), **({"cpus": list(self.cpus)} if self.cpus else {})}


def _log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _total_ram() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _device(mx: Any) -> tuple[dict[str, Any], int]:
    """A JSON subset of `mx.device_info()` and the device's memory in bytes (total RAM on the CPU backend,
    which reports no memory size)."""
    info = dict(mx.device_info())
    keep = ("architecture", "device_name", "memory_size", "max_recommended_working_set_size",
            "max_buffer_length", "total_memory")
    device: dict[str, Any] = {k: info[k] for k in keep if k in info and isinstance(info[k], (int, float, str))}
    device["backend"] = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    ram = _total_ram()
    if ram is not None:
        device["ram"] = ram
    memory = info.get("memory_size") or info.get("total_memory") or ram
    if not memory:
        raise BenchError("cannot tell this device's memory size (mx.device_info() and sysconf both silent)")
    return device, int(memory)


def _matmul_gflops(mx: Any, gpu: bool) -> tuple[float, str]:
    """GFLOP/s of an NxN matmul: bfloat16 on the GPU (what training runs in), float32 on the CPU backend (where
    bfloat16 is emulated and says nothing about the machine)."""
    dtype_name = "bfloat16" if gpu else "float32"
    dtype = getattr(mx, dtype_name)
    a = mx.random.normal((MATMUL_N, MATMUL_N)).astype(dtype)
    b = mx.random.normal((MATMUL_N, MATMUL_N)).astype(dtype)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    reps = 0
    started = time.perf_counter()
    while True:
        mx.eval(a @ b)
        reps += 1
        elapsed = time.perf_counter() - started
        if elapsed >= 0.2 or reps >= 100:
            break
    return 2.0 * MATMUL_N**3 * reps / elapsed / 1e9, dtype_name


def _vocab_size(config: dict[str, Any], model: Any) -> int:
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("vocab_size") if isinstance(cfg, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    args = getattr(model, "args", None)
    value = getattr(args, "vocab_size", None)
    if isinstance(value, int) and value > 0:
        return value
    raise BenchError("cannot find vocab_size in the model's config.json")


def model_path(model_dir: str) -> Path:
    """The model directory, `~` expanded. No download here: fetching weights inside a timed benchmark would eat
    the whole budget, so a missing model is an error (checked before mlx is even imported: fails fast)."""
    path = Path(os.path.expanduser(model_dir))
    if not (path / "config.json").is_file():
        raise BenchError(f"no model at {path} (config.json missing); the model must already be on this node")
    return path


class _Trainer:
    """The run's model setup, step and batches (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load, load_model, maybe_set_recommended_wired_limit

        from worker.data import load_datasets
        from worker.memory import StepMemory
        from worker.modelsetup import apply_method, ready_optimizer
        from worker.objectives import SftObjective
        from worker.runconfig import LoraSpec
        from worker.step import TrainStep, decide_packing

        if args.data:
            loaded = load(str(model_path(args.model)))
            model, tokenizer = loaded[0], loaded[1]
            data = Path(os.path.expanduser(args.data))
            dataset: Any = load_datasets(data, tokenizer, mask_prompt=args.mask_prompt)[0]
        else:
            model, config = load_model(model_path(args.model))
            vocab = _vocab_size(config, model)
            rng = random.Random(0)
            dataset = [([rng.randrange(vocab) for _ in range(args.seq_len)], 0) for _ in range(256)]
        layers = len(model.layers)
        if args.num_layers > layers:
            raise BenchError(f"--num-layers {args.num_layers} but the model only has {layers} layers")
        lora = LoraSpec(rank=args.lora_rank, scale=args.lora_scale, dropout=args.lora_dropout)
        mx.random.seed(args.seed)
        try:
            apply_method(model, args.method, None if args.num_layers == -1 else args.num_layers, lora,
                         train_embeddings=args.train_embeddings)
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
        if args.grad_checkpoint:
            from mlx_lm.tuner.trainer import grad_checkpoint

            # mlx-lm's own switch (it patches the layer class's __call__); untyped, hence the cast.
            cast(Callable[[Any], None], grad_checkpoint)(model.layers[0])
        model.train()
        maybe_set_recommended_wired_limit()
        self.packing = decide_packing(args.packing, model, dataset, max_seq_length=args.seq_len,
                                      global_batch=args.global_batch or args.max_batch, seed=args.seed)
        self.objective = SftObjective(args.seq_len, self.packing[0], self.packing[2])
        optimizer = ready_optimizer(model, args.optimizer, args.learning_rate)
        self.mx, self.model, self.optimizer = mx, model, optimizer
        self.dataset, self.seed = dataset, args.seed
        self.world = max(1, args.world_size)
        self.global_batch = args.global_batch
        self.horizon = args.steps
        # The data's fill: mean real tokens per row over the run's first FILL_ROWS rows (its order, as the run counts
        # them; a shorter run's own rows), steadier than any one point's sample.
        from worker.data import stream_rows
        from worker.step import sft_weight

        read = args.steps * args.global_batch if args.steps and args.global_batch else FILL_ROWS
        rows = [dataset[i] for i in stream_rows(0, min(len(dataset), FILL_ROWS, read), len(dataset), args.seed)]
        self.tokens_per_row = sft_weight(rows, args.seq_len)[1] / max(len(rows), 1)
        # The run's path for its world: one rank takes the whole step as one compiled graph, several take it in two
        # around the all_sum (timed here without the collective itself, which no single node can measure).
        self.step_fn = TrainStep(model, optimizer, self.objective.loss, all_sum=lambda x: x,
                                 world_size=args.world_size,
                                 memory=StepMemory(args.memory_headroom, args.clear_cache))

    def micro(self, rows: int, position: int) -> Any:
        """The batch of `rows` rows of the run's order from stream `position`, built as the run builds it."""
        return self.objective.micro(self.dataset, position, rows, self.seed, 0, rows)

    def slice_of(self, rows: int, position: int) -> tuple[Shape, int]:
        """(batch shape, real tokens) of the batch at `position`: host work only, nothing is evaluated."""
        micro = self.micro(rows, position)
        return tuple(tuple(a.shape) for a in micro.inputs), int(micro.tokens or 0)

    def step(self, rows: int, position: int) -> tuple[float, int]:
        """One optimizer step exactly as the run takes it (worker.step.TrainStep.run: the batch's build on the
        host included), on the batch of `rows` rows at stream `position`; returns (its wall time, real tokens)."""
        done = self.step_fn.run(lambda: [self.micro(rows, position)])
        return done.elapsed, sum(int(m.tokens or 0) for m in done.micros)


def shape_seconds(times: list[float]) -> float:
    """A shape's step time: the median of its timed steps. The run is held to the median of its own steps, which
    carry the same interference (timing noise on a busy machine only ever slows a step): the first quartile used
    before is the machine's speed undisturbed, not the run's, and on this 2-core VM it predicted one rank's run
    8-56% too fast (three or four steps a shape at batch 4: the fastest of them), as the pipeline's blocks bench
    found before it (worker.parallel.pipeline.measure)."""
    return statistics.median(times)


def spread(values: list[float]) -> float:
    """(q3 - q1) / median: how much a point's steps disagree (0 for fewer than 4)."""
    if len(values) < 4:
        return 0.0
    qs = statistics.quantiles(values, n=4)
    return (qs[2] - qs[0]) / qs[1] if qs[1] > 0 else 0.0


def _filler(trainer: _Trainer, batch: int, budget: Budget) -> Callable[[], bool]:
    """One untimed step of `batch` per call (cycling through its batches, all compiled already), while the one-time
    allowance lasts: the load this node puts on a shared machine while its neighbours measure."""
    count = [0]

    def step() -> bool:
        if budget.left(ONE_TIME) <= 0:
            return False
        trainer.step(batch, (count[0] % CANDIDATES) * batch)
        count[0] += 1
        return True

    return step


def _measure(trainer: _Trainer, batch: int, state: _State, window: float) -> tuple[Point | None, bool]:
    """One point: the run's steps at `batch`, sampled over the data (`plan_sample`: each step's slice for every rank
    of the run), grouped by batch shape. Each timed shape (`choose_shapes`) gets one warm-up step, smallest first
    (the one-time allowance: each compiles, and a larger one measures the step's working set again, as in the run),
    then timed steps on the measuring allowance, the sampled slices in the run's order (`next_slice`): at least
    MIN_STEPS (2 per shape with several), more until `window` seconds of timed steps; a noisy point
    (`pooled_spread`) gets one more window. A step expected to end past the measuring allowance is not started
    (the point is cut short: truncated); the first timed step always runs, since a compiling warm-up says nothing
    of a step's real length (the watchdog bounds it). At most MAX_STEPS steps per timed shape in all (a frequent shape
    takes most of them, as it does the run's steps). Each shape's time is the median of its steps (`shape_seconds`:
    the run's statistic); `predict_point` turns them into the run's mean step and median rate."""
    mx, budget = trainer.mx, state.budget
    budget.enter(ONE_TIME)
    # Each point starts as the run's process starts: nothing in MLX's buffer cache from another batch (or from the
    # matmul probe). Buffers cached for a smaller batch are the wrong sizes for this one; under the step's memory
    # bound (worker.memory) the allocator frees them as it goes, and on an H100 M full's batch-8 steps after the
    # smaller points took 0.130-0.139 s a step against 0.123-0.127 s in a fresh process (the run's rank: 0.123-0.125 s;
    # benchmarks/probe_rank_vs_bench.py `bench+hist`, docs/benchmarks-history.md).
    mx.clear_cache()
    mx.reset_peak_memory()
    steps: list[SampledStep] = []
    where: dict[Shape, list[int]] = {}
    sequence: list[tuple[Shape, int]] = []  # every sampled slice, in the run's order
    for positions in plan_sample(len(trainer.dataset), trainer.global_batch, batch, trainer.world, trainer.horizon):
        parts = [trainer.slice_of(batch, p) for p in positions]
        steps.append(SampledStep(tuple(shape for shape, _ in parts), sum(tokens for _, tokens in parts),
                                 positions[0]))
        for p, (shape, _) in zip(positions, parts):
            where.setdefault(shape, []).append(p)
            sequence.append((shape, p))
    counts = {shape: sum(step.shapes.count(shape) for step in steps) for shape in where}
    shapes = choose_shapes(counts)
    warmup = 0.0
    first: dict[Shape, float] = {}
    for shape in shapes:
        if not state.one_time.get("first_steps") and shape == shapes[0]:
            # The bench's first compile is the long one (everything the step needs); later shapes reuse most
            # kernels, and the ticker speaks for any that still take long.
            _log(describe_first_step(batch, state.kernel_cache, cold=state.cold_kernels))
        ticker = Ticker(f"bench batch={batch} first step", _log, time.monotonic)
        elapsed = ticking(ticker, lambda: trainer.step(batch, where[shape][0]))[0]  # noqa: B023 - called at once
        first[shape] = state.first_met.setdefault(shape, elapsed)
        warmup += elapsed
        state.cold_kernels = False  # the cache holds the step's kernels now: later shapes compile less
    # A batch's first steps compile its shapes; a second look (`look_again`) runs them warm: the first is kept.
    state.one_time.setdefault("first_steps", {}).setdefault(batch, warmup)
    if state.step_s is None:
        state.step_s = warmup / len(shapes)
    _log(f"bench batch={batch} first steps {warmup:.2f}s for {len(shapes)} of {len(where)} shape(s) in "
         f"{len(steps)} sampled step(s) (compile included: one-time)")
    if state.lockstep is not None:
        state.phase = f"waiting for the nodes sharing this machine (batch {batch})"
        state.lockstep.wait(f"ready batch={batch}")
        state.phase = f"measuring batch {batch}"
    budget.enter(MEASURE)
    timed: dict[Shape, list[float]] = {shape: [] for shape in shapes}
    times: list[float] = []
    truncated, extra = False, False
    each = MIN_STEPS if len(shapes) == 1 else 2
    limit, until = MAX_STEPS * len(shapes), window
    order = [(shape, p) for shape, p in sequence if shape in timed]
    taken = 0  # slices of `order` timed so far

    def following() -> tuple[Shape, int] | None:
        room = len(times) < limit and sum(times) < until
        return next_slice(order, taken, {shape: len(ts) for shape, ts in timed.items()}, each, room)

    while (chosen := following()) is not None:
        if times and budget.left(MEASURE) < statistics.median(times):
            truncated = True
            break
        shape, position = chosen
        elapsed, _ = trainer.step(batch, position)
        times.append(elapsed)
        timed[shape].append(elapsed)
        taken += 1
        if batch == 1:
            state.step_s = elapsed
        if following() is None and not extra and pooled_spread(timed) > NOISY_SPREAD:
            extra, limit, until = True, 2 * limit, sum(times) + window  # measure it once more
    budget.enter(ONE_TIME)
    if state.lockstep is not None:
        # Keep loading the machine with this batch until every member has timed it: the others' steps are timed
        # against the load they will train beside.
        state.phase = f"keeping batch {batch} running while the nodes sharing this machine time theirs"
        state.lockstep.wait(f"timed batch={batch}", busy=_filler(trainer, batch, budget))
    measured = {shape: shape_seconds(ts) for shape, ts in timed.items() if ts}
    if not measured:
        return None, True
    whole = trainer.horizon > 0 and len(steps) == horizon_steps(len(trainer.dataset), trainer.global_batch, batch,
                                                               trainer.world, trainer.horizon)
    predicted = predict_point(steps, measured, batch * trainer.world, first=first if whole else None)
    noise = pooled_spread(timed)
    point = Point(
        batch=batch,
        # This rank's share of the run's median step rate: the plan adds the ranks' rates up.
        tokens_per_s=predicted.median_tokens_per_s / trainer.world,
        peak_memory=int(mx.get_peak_memory()),
        step_time_s=predicted.mean_step_s,
        steps=len(times),
        warmup_s=warmup,
        tokens_per_row=predicted.tokens_per_row,
        spread=noise,
        noisy=noise > NOISY_SPREAD,
        shapes=len(where),
        timed_shapes=len(measured),
        sampled_steps=len(steps),
        shape_times=tuple((shape_size(s), measured[s], len(timed[s])) for s in sorted(measured, key=shape_size)),
        sample=tuple((step.position, step.tokens, d) for step, d in zip(steps, predicted.durations)),
    )
    return point, truncated


def _positive(value: float, flag: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise BenchError(f"{flag} must be a positive number of seconds, got {value}")


def _headroom(text: str) -> float | None:
    """--memory-headroom: a number >= 0, or `none` (no bound)."""
    if text == "none":
        return None
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be >= 0 or none, got {text}")
    return value


def _cpu_share(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not int(index) < int(count):
        raise argparse.ArgumentTypeError(f"expected INDEX/COUNT with 0 <= INDEX < COUNT, got {text!r}")
    return int(index), int(count)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="worker.bench", description="Measure training tokens/s per batch size.")
    parser.add_argument("--model", required=True, help="model directory on this node (config.json + safetensors)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--method", choices=("lora", "dora", "full"), required=True)
    parser.add_argument("--num-layers", type=int, default=16, help="layers to train, -1 = all (mlx-lm default 16)")
    parser.add_argument("--grad-checkpoint", action="store_true")
    parser.add_argument("--data", default="", help="the run's data dir (train.jsonl): batches as the run builds them")
    parser.add_argument("--mask-prompt", action="store_true")
    parser.add_argument("--packing", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--clear-cache", action="store_true", help="mx.clear_cache() after every step (train.clear_cache)")
    parser.add_argument("--memory-headroom", type=_headroom, default=DEFAULT_HEADROOM,
                        help="a step's run-ahead bound over its working set (train.memory_headroom; none: unbounded)")
    parser.add_argument("--global-batch", type=int, default=0, help="the run's global batch (packing decision)")
    parser.add_argument("--steps", type=int, default=0,
                        help="the run's steps (stream rows read: steps x global batch): a short run's sample is its "
                             "own steps; 0: the whole first epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1, help="ranks of the run: the step's path depends on it")
    parser.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-scale", type=float, default=20.0)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--train-embeddings", action="store_true")
    parser.add_argument("--time-budget", type=float, default=60.0, help="seconds of timed steps")
    parser.add_argument("--one-time-budget", type=float, default=600.0,
                        help="seconds for imports, the model load and the first (compiling) step of each shape")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--lockstep", action="store_true",
                        help="measure in step with the nodes sharing this machine (waits on stdin; see the docstring)")
    parser.add_argument("--cpu-share", type=_cpu_share, default=None, metavar="INDEX/COUNT",
                        help="take the INDEX-th of COUNT equal slices of this machine's CPUs, as the run's rank will "
                             "(worker.cpus; the coordinator passes it to the benches of nodes sharing a CPU machine)")
    parser.add_argument("--memory-fraction", type=float, default=0.8)
    parser.add_argument("--blocks", type=int, default=0,
                        help="time K transformer blocks alone, as a pipeline stage (0: the whole model's curve)")
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per pipeline micro-batch (--blocks)")
    args = parser.parse_args(argv)
    if args.blocks < 0:
        raise BenchError(f"--blocks must be >= 0 (0: the whole model's curve), got {args.blocks}")
    if args.micro_batch < 1:
        raise BenchError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if args.seq_len < 2:
        raise BenchError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.num_layers == 0 or args.num_layers < -1:
        raise BenchError(f"--num-layers must be -1 (all) or positive, got {args.num_layers}")
    _positive(args.time_budget, "--time-budget")
    _positive(args.one_time_budget, "--one-time-budget")
    if args.max_batch < 1:
        raise BenchError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.steps < 0:
        raise BenchError(f"--steps must be >= 0 (0: the whole first epoch), got {args.steps}")
    if not 0 < args.memory_fraction <= 1:
        raise BenchError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    return args


def _watchdog(state: _State, out: _Output, stop: threading.Event) -> None:
    """Polls the two allowances while the main thread works (mlx releases the GIL while it evaluates, so this
    thread does run). When one is spent: answer with what was measured and end the process."""
    while not stop.wait(WATCHDOG_POLL_S):
        kind = state.budget.overrun()
        if kind is None:
            continue
        seconds = time.monotonic() - state.started
        reason = "time_budget" if kind == MEASURE else "one_time_budget"
        if state.curve and state.device is not None and state.meta is not None:
            result = build_result(list(state.curve), reason, memory_limit=state.memory_limit, matmul=state.matmul,
                                  device=state.device, meta={**state.meta, **state.extra()}, seconds=seconds)
            code = 0
        else:
            message = advise_no_point(kind, limit=state.budget.limits[kind], phase=state.phase, step_s=state.step_s,
                                      one_time={k: v for k, v in state.one_time.items() if k != "first_steps"})
            result = {"error": message, "phase": state.phase, "seconds": round(seconds, 3), **state.extra()}
            code = 1
        if out.emit(result):
            _log(f"bench watchdog: {reason.replace('_', ' ')} of {state.budget.limits[kind]:g}s spent while "
                 f"{state.phase}")
            # os._exit: the main thread is inside an mlx call that cannot be interrupted; nothing is left to flush.
            os._exit(code)
        return


def _start(args: argparse.Namespace, state: _State) -> _Trainer | None:
    """The one-time start: import mlx, measure the matmul rate, load the model as the run sets it up. Returns the
    trainer (None with --blocks: the blocks are loaded by `_run_blocks`); fills `state` (device, memory limit,
    meta, one-time costs)."""
    state.phase = "importing mlx"
    mark = time.monotonic()
    env = dict(os.environ)  # before isolate() points TMPDIR at this process's own dir
    kernelcache.isolate()
    if args.cpu_share is not None:  # before mlx starts its threads: they inherit the slice
        state.cpus = take_share(*args.cpu_share)
        index, count = args.cpu_share
        _log("bench: " + describe_share(index, count, state.cpus))
    import mlx.core as mx
    import mlx_lm

    device, memory = _device(mx)
    state.one_time["import"] = time.monotonic() - mark
    # Looked at before anything runs: the matmul probe below already writes kernels there.
    state.kernel_cache = kernelcache.shared_dir(str(getattr(mx, "__version__", "")), env)
    state.cold_kernels = not any(state.kernel_cache.glob("*/*"))
    memory_limit = int(memory * args.memory_fraction)
    state.device, state.memory_limit = device, memory_limit
    state.meta = {
        "seq_len": args.seq_len, "method": args.method, "num_layers": args.num_layers,
        "grad_checkpoint": bool(args.grad_checkpoint), "mlx_version": getattr(mx, "__version__", None),
        "mlx_lm_version": getattr(mlx_lm, "__version__", None),
    }
    state.phase = "measuring the matmul rate"
    mark = time.monotonic()
    state.matmul = _matmul_gflops(mx, device["backend"] == "gpu")
    state.one_time["matmul"] = time.monotonic() - mark
    _log(f"bench matmul_gflops={state.matmul[0]:.1f} dtype={state.matmul[1]}")

    if args.blocks:
        return None
    state.phase = "loading the model"
    mark = time.monotonic()
    trainer = _Trainer(args)
    state.one_time["load"] = time.monotonic() - mark
    state.meta["packing"] = list(trainer.packing[:2])
    # What a dp step of several ranks all_sums (the gradients keep the parameters' dtypes): calibration times that
    # exchange between the nodes (coordinator/run/collective.py).
    state.meta["gradients"] = gradient_elements(trainer.model)
    state.meta["tokens_per_row"] = round(trainer.tokens_per_row, 3)
    _log(f"bench model loaded after {time.monotonic() - state.started:.1f}s; {trainer.packing[1]}")
    return trainer


def gradient_elements(model: Any) -> dict[str, int]:
    """The trainable parameters' elements by dtype name ({"float32": 16384}): the gradients a step exchanges."""
    from worker.step import flatten

    out: dict[str, int] = {}
    for p in flatten(model.trainable_parameters()).values():
        name = str(p.dtype).split(".")[-1]
        out[name] = out.get(name, 0) + int(p.size)
    return out


def _run(args: argparse.Namespace, state: _State) -> dict[str, Any]:
    budget = state.budget
    # The per-block mode times many calls per repetition (worker.parallel.pipeline.measure): its window is the
    # floor, as before.
    block_window = max(0.5, 0.05 * float(args.time_budget))

    model_path(args.model)
    # Importing mlx, the matmul probe and the model load take seconds, more on a busy machine (16 s measured with
    # load 14 on 2 cores): announced, and said again while they last.
    _log("bench starting: importing mlx, measuring a matmul, loading the model (one-time)")
    with ticker_running(Ticker("bench starting", _log, time.monotonic)):
        trainer = _start(args, state)
    if trainer is None:
        return _run_blocks(args, state, block_window)
    assert state.device is not None and state.meta is not None  # set by _start
    memory_limit, device, meta = state.memory_limit, state.device, state.meta

    def on_point(p: Point) -> None:
        state.curve.append(p)
        _log(f"bench batch={p.batch} tokens_per_s={p.tokens_per_s:.1f} step_s={p.step_time_s:.4f} "
             f"peak_memory={p.peak_memory} steps={p.steps} spread={p.spread:.2f}" + (" NOISY" if p.noisy else ""))

    def measure(batch: int) -> tuple[Point | None, bool]:
        state.phase = f"measuring batch {batch}"
        try:
            window = point_window(float(args.time_budget), budget.left(MEASURE), batch, args.max_batch)
            return _measure(trainer, batch, state, window)
        except (RuntimeError, MemoryError) as exc:
            # The memory prediction should have stopped us first; if it did not, what was measured still stands.
            if state.curve and looks_like_oom(exc):
                _log(f"bench batch={batch} failed to allocate: {exc}")
                raise _OutOfMemory(str(exc)) from exc
            raise

    failed_allocation = False
    try:
        curve, reason = sweep(measure, max_batch=args.max_batch, memory_limit=memory_limit,
                              seconds_left=lambda: budget.left(MEASURE), on_point=on_point)
    except _OutOfMemory:
        curve, reason, failed_allocation = list(state.curve), "memory", True
    if not curve:
        raise BenchError(advise_no_point(MEASURE, limit=budget.limits[MEASURE], phase=state.phase,
                                         step_s=state.step_s, one_time={}))
    if not failed_allocation:  # after a failed allocation the device's state is not the run's: no second look
        curve = look_again(curve, measure, seconds_left=lambda: budget.left(MEASURE), log=_log)
        state.curve[:] = curve
    _log(f"bench stopped_because={reason} measuring {budget.used(MEASURE):.1f}s, one-time "
         f"{budget.used(ONE_TIME):.1f}s")
    lockstep = state.lockstep
    if lockstep is not None:
        best = max(curve, key=lambda p: (p.tokens_per_s, -p.batch)).batch
        state.linger = lambda: lockstep.wait("done", busy=_filler(trainer, best, budget))
    return build_result(curve, reason, memory_limit=memory_limit, matmul=state.matmul, device=device,
                        meta={**meta, **state.extra()}, seconds=time.monotonic() - state.started)


def _run_blocks(args: argparse.Namespace, state: _State, window: float) -> dict[str, Any]:
    """The per-block answer (`--blocks`): see the module docstring."""
    import mlx.core as mx

    from worker.parallel.pipeline.measure import measure_blocks
    from worker.runconfig import LoraSpec

    state.phase = f"timing {args.blocks} blocks at micro-batch {args.micro_batch}"
    state.budget.enter(MEASURE)
    mark = time.monotonic()
    try:
        result = measure_blocks(
            model_path(args.model), blocks=args.blocks, micro_batch=args.micro_batch, seq_len=args.seq_len,
            method=args.method, num_layers=None if args.num_layers == -1 else args.num_layers,
            lora=LoraSpec(rank=args.lora_rank, scale=args.lora_scale, dropout=args.lora_dropout), seed=args.seed,
            grad_checkpoint=bool(args.grad_checkpoint), window=window, optimizer=args.optimizer,
            learning_rate=args.learning_rate)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    _log(f"bench blocks={args.blocks} micro_batch={args.micro_batch} block_s={result['block_s']:.5f} "
         f"head_s={result['head_s']:.5f} peak_memory={result['peak_memory']} in {time.monotonic() - mark:.1f}s")
    assert state.meta is not None and state.matmul is not None and state.device is not None
    return {**result, "matmul_gflops": round(state.matmul[0], 1), "matmul_dtype": state.matmul[1],
            "device": state.device, "memory_limit": state.memory_limit, "grad_checkpoint": bool(args.grad_checkpoint),
            "mlx_version": getattr(mx, "__version__", None), "mlx_lm_version": state.meta.get("mlx_lm_version"),
            **state.extra(), "seconds": round(time.monotonic() - state.started, 3)}


def main(argv: list[str] | None = None) -> int:
    """Run the bench; print one JSON object on stdout. Returns the exit status (0 ok, 1 error)."""
    started = time.monotonic()
    # Keep stdout for the one JSON object: anything else written to fd 1 (library prints, C++ warnings) goes to
    # stderr instead, so the coordinator never has to fish the result out of noise.
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    out = _Output(real_stdout)
    state: _State | None = None
    try:
        args = _parse_args(argv)
        budget = Budget(one_time_s=args.one_time_budget, measure_s=args.time_budget, clock=time.monotonic)
        budget.since = started  # python's own start-up until here is one-time too
        state = _State(started=started, curve=[], budget=budget,
                       lockstep=Lockstep(sys.stdin, _log) if args.lockstep else None)
        stop = threading.Event()
        watchdog = threading.Thread(target=_watchdog, args=(state, out, stop), name="bench-watchdog", daemon=True)
        watchdog.start()
        try:
            result = _run(args, state)
        finally:
            stop.set()
    except SystemExit as exc:  # argparse: its message (or --help) is already on stderr
        if exc.code == 0:
            return 0
        out.emit({"error": f"bad arguments (exit {exc.code})", "seconds": round(time.monotonic() - started, 3)})
        return 1
    except BenchError as exc:
        extra = state.extra() if state is not None else {}
        out.emit({"error": str(exc), "seconds": round(time.monotonic() - started, 3), **extra})
        return 1
    except Exception as exc:  # noqa: BLE001 - the contract is a JSON error for ANY failure (mlx raises plain
        # RuntimeError/ValueError from C++), never a bare traceback the coordinator would have to parse.
        _log(f"bench error: {type(exc).__name__}: {exc}")
        out.emit({"error": f"{type(exc).__name__}: {exc}", "phase": state.phase if state else "starting",
                  "seconds": round(time.monotonic() - started, 3)})
        return 1
    out.emit(result)
    if state.linger is not None:
        state.linger()
    return 0


if __name__ == "__main__":
    sys.exit(main())
