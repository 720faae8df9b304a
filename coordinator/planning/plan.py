"""Split a global batch over the ranks of a mixed fleet. Pure arithmetic: no I/O.

mlx-lm gives every rank an equal shard, so on a mixed fleet (an M4 Max next to an M3 Ultra) the fast rank waits
for the slow one at every gradient all-reduce. Here every node gets an integer number of rows (its local batch)
so that all ranks finish their step at nearly the same time, using the throughput curve `worker.bench` measured on
that node, and never more rows than its memory allows.

Model of a node (from its measured curve of (batch, tokens/s, peak memory) points):
- an interior dip (one point below both of its neighbours) is measurement noise and is raised to the line between
  them (`lift_dips`: timing noise on a busy machine only ever slows a step);
- tokens/s at batch b: linear interpolation between measured batches; below the smallest measured batch the step
  time of that batch (a step never gets cheaper than the smallest one measured); beyond the largest measured batch
  a plateau: the best measured rate, unless the curve ends in a measured fall (the last point below
  `PLATEAU_RATIO` x best), in which case the last measured rate (the fall is evidence, the best rate is not).
- step time at the measured batches t_i = b_i * seq_len / tokens_per_s(b_i), fitted by a monotone (isotonic,
  least-squares weighted by the rows each point timed) non-decreasing curve: a step with more rows cannot really be
  faster than one with fewer, so a violation is noise, and the fit pools it with its neighbours instead of letting
  one slow small-batch point raise every larger batch (a running maximum did: a noisy batch-2 point predicted 168k
  tokens/s where batch 8 measured 240k). Between measured batches the fitted times are interpolated linearly;
  below the first, its step time; beyond the last, the plateau rate (never below the last fitted time). Monotone
  step times are what make the greedy split below optimal.
- peak memory at batch b: linear interpolation between measured points, linear extrapolation of the last two
  beyond them (the proportional rule through the origin when only one point was measured, which over-estimates:
  safe), and the smallest measured peak below the first point. A node's cap is the largest batch whose predicted
  peak stays within its `memory_limit`.

Failure semantics: every impossible request (fewer rows than nodes, a batch the fleet's memory cannot hold, an
explicit split that does not name exactly the nodes, a curve that makes no sense) raises `PlanError` with the
numbers in the message. Nothing is silently clamped.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from coordinator.errors import CoordinatorError
from coordinator.planning.collective import CollectiveCost, GradientSize
from coordinator.planning.shards import largest_remainder
from coordinator.units import format_bytes, format_share

# Same knee criterion as worker.bench: a rate below this fraction of the best is a real fall, not noise.
PLATEAU_RATIO = 0.97
# Tolerance on the sum of an explicit split's fractions.
FRACTION_TOLERANCE = 1e-6


class PlanError(CoordinatorError, ValueError):
    """The requested split cannot be made (bad input or not enough memory); the message names the numbers."""


class SplitMode(StrEnum):
    CALIBRATED = "calibrated"
    EQUAL = "equal"
    EXPLICIT = "explicit"
    PIPELINE = "pipeline"  # every stage computes every row (planning.pipeline): no split of the batch


@dataclass(frozen=True)
class CurvePoint:
    """One measured point: `batch` rows of the calibration's seq_len ran at `tokens_per_s`, peaking at
    `peak_memory` bytes (weights, optimizer state and activations: the whole process)."""

    batch: int
    tokens_per_s: float
    peak_memory: int


@dataclass(frozen=True)
class NodeCalibration:
    """What `worker.bench` measured on one node. Valid by construction: a non-empty curve with strictly
    increasing positive batches and positive finite rates (else `PlanError`).

    `memory_limit` is the byte budget for a training process on that node (None: unknown, no cap).
    `seq_len` is the sequence length the curve was measured at (None: unknown, not checked).
    """

    node: str
    curve: tuple[CurvePoint, ...]
    matmul_gflops: float
    memory_limit: int | None
    seq_len: int | None = None
    method: str | None = None
    stopped_because: str | None = None
    seconds: float | None = None
    device: tuple[tuple[str, Any], ...] = ()
    cached: bool = False
    one_time_s: float | None = None  # import, model load, first (compiling) step of each shape: paid once
    measure_s: float | None = None  # the timed steps
    fill: float = 1.0  # real tokens per row / seq_len on the data measured (the curve's rates are rows x seq_len)
    noisy: tuple[int, ...] = ()  # batches whose steps disagreed by more than the bench's NOISY_SPREAD
    gradients: GradientSize | None = None  # what a dp step of several ranks all_sums (None: an older bench)

    def __post_init__(self) -> None:
        if not self.curve:
            raise PlanError(f"{self.node}: the calibration has no measured point")
        previous = 0
        for point in self.curve:
            if point.batch <= previous:
                raise PlanError(
                    f"{self.node}: curve batches must be positive and strictly increasing, got "
                    f"{[p.batch for p in self.curve]}"
                )
            previous = point.batch
            if not (math.isfinite(point.tokens_per_s) and point.tokens_per_s > 0):
                raise PlanError(f"{self.node}: batch {point.batch} has a non-positive rate {point.tokens_per_s!r}")
            if point.peak_memory < 0:
                raise PlanError(f"{self.node}: batch {point.batch} has a negative peak memory {point.peak_memory}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise PlanError(f"{self.node}: memory limit must be positive, got {self.memory_limit}")

    @property
    def best(self) -> CurvePoint:
        """The measured point with the highest rate (the smallest batch among equals)."""
        return max(self.curve, key=lambda p: (p.tokens_per_s, -p.batch))

    @property
    def device_dict(self) -> dict[str, Any]:
        return dict(self.device)


@dataclass(frozen=True)
class Rehearsal:
    """A few steps of the run itself, timed before it starts (`run/rehearse.py`), for ranks that share a machine.

    They slow each other in ways that no measurement made apart sees: their compute side by side on shared cores
    and memory bandwidth, the all_sum among ranks that are still computing, and the host work between steps (one
    rank's checkpoint write delays the other's next all_sum). Calibration times the compute in lockstep and the
    all_sum alone; the rehearsal times the step as the run takes it, so for these ranks it is the prediction.
    `tokens_per_s` is the run's own statistic (`Monitor.run_tokens_per_s`: the median over steps of all ranks'
    real tokens / step time) moved to the run's tokens a step (planning/steptime.py), `compute_tokens_per_s` its
    compute part (`Monitor.run_compute_tokens_per_s`, moved alike). `timed_tokens_per_s`: the rehearsal's own rate
    before that; `step_tokens`: (the rehearsal's median real tokens a step, the run's), where both were counted."""

    steps: int
    tokens_per_s: float
    compute_tokens_per_s: float | None
    shared: str  # what shares a machine, in words (`colocate.describe_shared`): "local-a, local-b share this machine"
    timed_tokens_per_s: float | None = None
    step_tokens: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or not (math.isfinite(self.tokens_per_s) and self.tokens_per_s > 0):
            raise PlanError(f"a rehearsal needs >= 1 step and a positive rate, got {self.steps}, {self.tokens_per_s}")

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens_per_s": round(self.tokens_per_s, 2),
                "compute_tokens_per_s": (round(self.compute_tokens_per_s, 2) if self.compute_tokens_per_s is not None
                                         else None),
                "shared": self.shared,
                "timed_tokens_per_s": (round(self.timed_tokens_per_s, 2) if self.timed_tokens_per_s is not None
                                       else None),
                "step_tokens": list(self.step_tokens) if self.step_tokens is not None else None}

    def describe_tokens(self) -> str:
        """How the rehearsal's rate was moved to the run's tokens, in words ("" where it was not, or by < 1%)."""
        if self.step_tokens is None or self.timed_tokens_per_s is None or \
                abs(self.tokens_per_s / self.timed_tokens_per_s - 1.0) < 0.01:
            return ""
        timed, run = self.step_tokens
        return (f"its steps carried a median {timed:,.0f} real tokens and the run's carry {run:,.0f}: "
                f"{self.timed_tokens_per_s:,.0f} tokens/s timed, {self.tokens_per_s:,.0f} over the run's steps")


@dataclass(frozen=True)
class Plan:
    """Rows per node for one optimizer step. `batch` and `split` keep the calibrations' (rank) order.

    `split[node]` = batch[node] / global_batch. `per_node_step_s` is each node's predicted step time at its
    batch (its compute, the update included); `predicted_step_s` their maximum (the step time of the synchronous
    job) plus, with `collective`, the gradient exchange that follows it (`with_collective`,
    planning/collective.py), and `predicted_tokens_per_s` = global_batch * seq_len * fill / predicted_step_s.
    """

    split: dict[str, float]
    batch: dict[str, int]
    global_batch: int
    mode: SplitMode
    seq_len: int
    predicted_step_s: float
    predicted_tokens_per_s: float
    per_node_step_s: dict[str, float] = field(default_factory=dict)
    fill: float = 1.0  # real tokens per row / seq_len: rates in real tokens = rows x seq_len x fill
    collective: CollectiveCost | None = None  # the gradient all_sum in predicted_step_s (None: left out)
    rehearsal: Rehearsal | None = None  # the run's steps timed before it (`with_rehearsal`): then the prediction

    @property
    def compute_step_s(self) -> float:
        """The predicted step without the exchange: the slowest node's compute (calibration's, or the rehearsal's
        compute part)."""
        if self.rehearsal is not None and self.rehearsal.compute_tokens_per_s:
            return self.global_batch * self.seq_len * self.fill / self.rehearsal.compute_tokens_per_s
        return self.predicted_step_s - (self.collective.seconds if self.collective is not None else 0.0)

    @property
    def compute_tokens_per_s(self) -> float:
        """The prediction without the exchange (what the ranks' own compute should run at); 0 when uncalibrated."""
        if self.rehearsal is not None and self.rehearsal.compute_tokens_per_s:
            return self.rehearsal.compute_tokens_per_s
        step = self.compute_step_s
        return self.global_batch * self.seq_len * self.fill / step if step > 0 else 0.0

    @property
    def collective_share(self) -> float:
        """The exchange's share of the predicted step (0 without one)."""
        if self.collective is None or self.predicted_step_s <= 0:
            return 0.0
        return self.collective.seconds / self.predicted_step_s

    def node_tokens_per_s(self, node: str) -> float | None:
        """The rate (real tokens/s) `node` is predicted to run at with its batch (what its share is proportional
        to); None for an uncalibrated plan."""
        if node not in self.per_node_step_s:
            return None
        return self.batch[node] * self.seq_len * self.fill / self.per_node_step_s[node]


# A run's tokens/s further than this from calibration's prediction is said plainly (the run's summary, the live
# view): every decision built on calibration (the split, "slower than calibrated", the ETA) rests on it.
PREDICTION_TOLERANCE = 0.15  # the goal calibration is held to (issue: within +-15% of the run)


def prediction_gap(actual: float | None, predicted: float | None) -> float | None:
    """(actual - predicted) / predicted: -0.6 is a run 60% slower than predicted. None when either is unknown."""
    if actual is None or not predicted or predicted <= 0 or not math.isfinite(actual):
        return None
    return (actual - predicted) / predicted


# A run of fewer steps says nothing about its rate: its first steps compile (one-time), and the median of two steps
# is one of them.
PREDICTION_MIN_STEPS = 3


def describe_prediction(actual: float | None, predicted: float | None, *, steps: int | None = None,
                        ranks: int = 1, compute: float | None = None,
                        predicted_compute: float | None = None, pipeline: bool = False,
                        rehearsed: int | None = None) -> str:
    """The run's tokens/s next to the prediction, in words. A gap over PREDICTION_TOLERANCE says which way, why and
    what to do, in plain words; a run of fewer than PREDICTION_MIN_STEPS `steps` is not held to the prediction at
    all. `compute` (the run's rate without the gradient all_sum, `Monitor.run_compute_tokens_per_s`) turns the why
    into a measurement. `predicted_compute` is the prediction without the exchange, given when the prediction
    holds a measured exchange (`Plan.collective`): the run's compute is then held to it and the rest of each step
    to the exchange's predicted share. Without it (one rank, or an exchange not measured) the prediction is the
    compute alone, and with `ranks` > 1 it leaves the collective out: said. `rehearsed`: the steps of the rehearsal
    whose rate is the prediction (`Rehearsal`), which then is what the run is held to."""
    if actual is None:
        return "no step finished: no tokens/s"
    text = f"{actual:,.0f} real tokens/s (median of the run's steps)"
    gap = prediction_gap(actual, predicted)
    if gap is None or predicted is None:
        return text + ", no prediction (uncalibrated split)"
    if steps is not None and steps < PREDICTION_MIN_STEPS:
        return (text + f"; {steps} step(s) are too few to hold against the {predicted:,.0f} real tokens/s predicted (the "
                "first steps compile)")
    text += f" vs {predicted:,.0f} predicted ({100 * gap:+.0f}%)"
    tolerance = f"{100 * PREDICTION_TOLERANCE:.0f}%"
    if rehearsed:
        source = f"the rehearsal ({rehearsed} steps of the run timed before it: its ranks share a machine)"
        if abs(gap) <= PREDICTION_TOLERANCE:
            return text + f": within {tolerance} of {source}"
        # Either cause is possible and nothing here tells them apart: on a quiet 2-core machine the same 30-step
        # demo ran 1.2-1.5x apart from one launch to the next (docs/benchmarks.md), so other work is not asserted.
        if gap > 0:
            return (text + f": faster than {source}, by more than {tolerance}: either the machine had other work while "
                    "rehearsing, or its launches differ this much on their own (short steps on shared cores: "
                    "docs/calibration.md)")
        return (text + f": slower than {source}, by more than {tolerance}: either the machine had other work during "
                "the run, or its launches differ this much on their own (short steps on shared cores: "
                "docs/calibration.md). Run on a quiet machine")
    included = ranks > 1 and predicted_compute is not None and predicted_compute > predicted
    exchange = (f"the gradient all_sum, {100 * (1 - predicted / predicted_compute):.0f}% of the predicted step"
                if included and predicted_compute else "")
    if abs(gap) <= PREDICTION_TOLERANCE:
        return text + f": within {tolerance} of calibration" + (f" ({exchange}, included)" if included else "")
    if gap > 0:
        return (text + f": faster than calibration predicted, by more than {tolerance}: the machine was busier while "
                "calibrating than now; run again with --recalibrate for a split that fits (docs/calibration.md)")
    if pipeline:
        # A pipeline's prediction is the schedule simulated on each stage's measured compute and each link's
        # measured transfer (docs/pipeline.md#prediction): no collective left out, no replica to compare with.
        return (text + f": slower than calibration predicted, by more than {tolerance}. Likely: the machine was "
                "busier than while calibrating (other work on it), or a stage runs slower than its blocks did alone. "
                "Run on a quiet machine, or --recalibrate while it is as busy as it will be (docs/pipeline.md)")
    if included and predicted_compute is not None:
        why = f"slower than calibration predicted ({exchange}, included)"
        compute_gap = prediction_gap(compute, predicted_compute)
        if compute is None or compute_gap is None or compute <= actual:
            return (text + f": {why}. Likely: the machine or the links were busier than while calibrating. Run on a "
                    "quiet fleet, or --recalibrate while it is as busy as it will be (docs/calibration.md)")
        rest = f"{100 * (1 - actual / compute):.0f}% of each step"
        measured = (f"the ranks' own compute ran at {compute:,.0f} real tokens/s ({100 * compute_gap:+.0f}% of the "
                    f"{predicted_compute:,.0f} predicted for it)")
        if compute_gap >= -PREDICTION_TOLERANCE:
            return (text + f": {why}, and measured why: {measured}, as calibrated; the rest, {rest}, went to the "
                    "exchange and the ranks waiting for each other: the links were slower than when calibration timed "
                    "the all_sum (other traffic), ranks sharing a machine's cores waited for each other, or one rank "
                    "stalled. --recalibrate times it again "
                    "(docs/calibration.md)")
        # Measured: the compute's gap and the exchange's share. Not measured: why; so the causes are offered as
        # likely ones, never asserted (ranks sharing one machine's cores slow each other even with no other work).
        return (text + f": {why}. Measured: {measured}, and the exchange and the waiting took {rest}. Likely: the "
                "machine was busier than while calibrating (other work on it), or ranks sharing its cores slowed each "
                "other (calibration times the compute and the all_sum apart, not side by side). Run on a quiet "
                "machine, or --recalibrate while it is as busy as it will be (docs/calibration.md)")
    collective = f"the gradient all_sum between the {ranks} ranks, which the prediction leaves out (its exchange " \
                 "was not measured)"
    compute_gap = prediction_gap(compute, predicted)
    if ranks > 1 and compute is not None and compute_gap is not None and compute > actual:
        rest = f"{100 * (1 - actual / compute):.0f}% of each step"
        measured = f"the ranks' own compute ran at {compute:,.0f} real tokens/s ({100 * compute_gap:+.0f}% of the prediction)"
        if compute_gap >= -PREDICTION_TOLERANCE:
            return (text + f": slower than calibration predicted, and measured why: {measured}, as calibrated; the "
                    f"rest, {rest}, is {collective}, and the ranks waiting for each other. The split holds; only the "
                    "ETA is longer than predicted (docs/calibration.md)")
        return (text + f": slower than calibration predicted. Measured: {measured}: the machine was busier than "
                f"while calibrating (other work on it); and {rest} went to {collective}. Run on a quiet machine, or "
                "--recalibrate while it is as busy as it will be (docs/calibration.md)")
    causes = ["the machine was busier than while calibrating (other work on it)"]
    if ranks > 1:
        causes.insert(0, collective)
    return (text + f": slower than calibration predicted, by more than {tolerance}. Likely: " + "; or ".join(causes)
            + ". Run on a quiet machine, or --recalibrate while it is as busy as it will be (docs/calibration.md)")


def lift_dips(batches: Sequence[int], rates: Sequence[float]) -> list[float]:
    """Rates with every interior dip (a point below both of its measured neighbours) raised to the line between
    those neighbours. Timing noise on a busy machine is one-sided: interference only ever slows a step, so one
    point below both neighbours is a disturbed measurement, not the node's speed at that batch (planning on it
    once gave a node a batch its neighbours said was too small). Two low points in a row, and a fall at the END
    of the curve (the knee, with no right-hand neighbour to contradict it), are kept."""
    out = list(rates)
    for i in range(1, len(rates) - 1):
        if rates[i] < rates[i - 1] and rates[i] < rates[i + 1]:
            t = (batches[i] - batches[i - 1]) / (batches[i + 1] - batches[i - 1])
            out[i] = rates[i - 1] + t * (rates[i + 1] - rates[i - 1])
    return out


def isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent violators): each
    run of values that falls is replaced by its weighted mean."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [b[0] for b in blocks for _ in range(int(b[2]))]


class _NodeModel:
    """Step time and memory predictions of one node for batches 1..limit (precomputed: batches are small)."""

    def __init__(self, cal: NodeCalibration, seq_len: int) -> None:
        self.cal = cal
        self.seq_len = seq_len
        self.batches = [p.batch for p in cal.curve]
        self.rates = lift_dips(self.batches, [p.tokens_per_s for p in cal.curve])
        best = max(self.rates)
        self.plateau = best if self.rates[-1] >= PLATEAU_RATIO * best else self.rates[-1]
        self.raw = [b * seq_len / r for b, r in zip(self.batches, self.rates, strict=True)]
        self.fitted = isotonic(self.raw, [float(b) for b in self.batches])

    def rate(self, batch: int) -> float:
        batches, rates = self.batches, self.rates
        if batch <= batches[0]:
            # Same step time as the smallest measured batch: rate proportional to the rows.
            return rates[0] * batch / batches[0]
        if batch >= batches[-1]:
            return rates[-1] if batch == batches[-1] else self.plateau
        for i in range(len(batches) - 1):
            if batches[i] <= batch <= batches[i + 1]:
                t = (batch - batches[i]) / (batches[i + 1] - batches[i])
                return rates[i] + t * (rates[i + 1] - rates[i])
        raise AssertionError("unreachable: batch inside the curve's range")

    def predicted_step_s(self, batch: int) -> float:
        """The step the plan predicts for `batch` rows: the point measured at that batch where there is one, else
        the fit (`step_s`). The fit serves the split, whose greedy needs step times that never fall; a measured
        point is the run's own batch on the run's steps, and on variable-length rows a larger batch's step can
        truly be shorter (fewer packed sequences a row, or a GPU's faster kernels for its shape). Pooling it with
        a smaller batch's point predicted an H100's S LoRA run 13-18% slow (docs/benchmarks-history.md)."""
        if batch in self.batches:
            return self.raw[self.batches.index(batch)]
        return self.step_s(batch)

    def step_s(self, batch: int) -> float:
        """Non-decreasing step time: the isotonic fit at the measured batches, interpolated between them."""
        batches, fitted = self.batches, self.fitted
        if batch <= batches[0]:
            return fitted[0]
        if batch >= batches[-1]:
            return max(fitted[-1], batch * self.seq_len / self.plateau)
        for i in range(len(batches) - 1):
            if batches[i] <= batch <= batches[i + 1]:
                t = (batch - batches[i]) / (batches[i + 1] - batches[i])
                return fitted[i] + t * (fitted[i + 1] - fitted[i])
        raise AssertionError("unreachable: batch inside the curve's range")

    def peak_memory(self, batch: int) -> float:
        curve = self.cal.curve
        if batch <= curve[0].batch:
            return float(curve[0].peak_memory)
        if len(curve) == 1:
            # One point cannot separate weights from activations: scale all of it (over-estimates, so safe).
            return curve[0].peak_memory * batch / curve[0].batch
        for lo, hi in itertools.pairwise(curve):
            if batch <= hi.batch:
                t = (batch - lo.batch) / (hi.batch - lo.batch)
                return lo.peak_memory + t * (hi.peak_memory - lo.peak_memory)
        lo, hi = curve[-2], curve[-1]
        slope = max(0.0, (hi.peak_memory - lo.peak_memory) / (hi.batch - lo.batch))
        return hi.peak_memory + slope * (batch - hi.batch)

    def cap(self, upto: int) -> int:
        """Largest batch in [0, upto] whose predicted peak memory, and that of every smaller batch, fits."""
        limit = self.cal.memory_limit
        if limit is None:
            return upto
        for b in range(1, upto + 1):
            if self.peak_memory(b) > limit:
                return b - 1
        return upto


def _gib(n: float) -> str:
    return format_bytes(n)


def _check_inputs(calibrations: Sequence[NodeCalibration], global_batch: int, seq_len: int) -> None:
    if not calibrations:
        raise PlanError("no calibrated node to split the batch over")
    names = [c.node for c in calibrations]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PlanError(f"node(s) calibrated twice: {', '.join(duplicates)}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be a positive integer, got {global_batch!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise PlanError(f"seq_len must be a positive integer, got {seq_len!r}")
    if global_batch < len(names):
        raise PlanError(
            f"global batch {global_batch} is smaller than the number of nodes ({len(names)}: {', '.join(names)}): "
            f"every rank needs at least one row; use a batch of at least {len(names)} or fewer nodes"
        )
    for cal in calibrations:
        if cal.seq_len is not None and cal.seq_len != seq_len:
            raise PlanError(
                f"{cal.node}: calibrated at seq_len {cal.seq_len}, but the plan is for seq_len {seq_len}; "
                "recalibrate at the training sequence length (step time is not linear in it)"
            )


def _greedy(models: Sequence[_NodeModel], caps: Sequence[int], global_batch: int) -> list[int]:
    """Minimise the largest step time: one row each, then every further row to the node whose step time after
    taking it is smallest (ties: the node with fewer rows, then the earlier one), among nodes below their memory
    cap. The tie on rows matters where the fit is flat: a launch-bound step measured as fast at batch 2 as at 1
    fits one step time for both, and "earlier node first" gave two interchangeable ranks of one machine 3 and 1 of
    4 rows (CI26) where 2 and 2 predict the same makespan; a rank with fewer rows is also the one whose prediction
    leans least on the fit's extrapolation.

    Optimal for non-decreasing step times: the rows beyond the first form, per node, a sorted list of step times
    s_i(2) <= s_i(3) <= ...; any allocation with >= 1 row each uses a prefix of every list, so its makespan is at
    least max(max_i s_i(1), the (G - n)-th smallest of all those values). The greedy takes exactly the G - n
    smallest values (the heap always offers the smallest remaining head) and so reaches that bound.
    """
    counts = [1] * len(models)
    heap = [(m.step_s(2), 2, i) for i, m in enumerate(models) if caps[i] >= 2]
    heapq.heapify(heap)
    for _ in range(global_batch - len(models)):
        # Feasibility (sum of caps >= global batch) was checked, so the heap cannot run dry here.
        _, _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (models[i].step_s(counts[i] + 1), counts[i] + 1, i))
    return counts


def _explicit_fractions(names: Sequence[str], split: Mapping[str, float]) -> list[float]:
    missing = [n for n in names if n not in split]
    unknown = sorted(k for k in split if k not in names)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(unknown)}")
        raise PlanError(f"an explicit split must give a fraction for exactly the nodes ({', '.join(names)}): "
                        + "; ".join(parts))
    fractions = []
    for name in names:
        value = split[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise PlanError(f"split fraction for {name} must be a positive number, got {value!r}")
        fractions.append(float(value))
    total = sum(fractions)
    if abs(total - 1.0) > FRACTION_TOLERANCE:
        given = ", ".join(f"{n}={split[n]}" for n in names)
        raise PlanError(f"split fractions must sum to 1, got {total:.6g} ({given})")
    return fractions


def predicted_step_s(cal: NodeCalibration, batch: int, seq_len: int) -> float:
    """The step time the node's curve predicts for `batch` rows of `seq_len` tokens (the model above)."""
    return _NodeModel(cal, seq_len).predicted_step_s(batch)


def per_example_calibration(cal: NodeCalibration, rows_per_example: int) -> NodeCalibration:
    """The curve in examples of `rows_per_example` rows (a DPO pair is 2): a point of b rows, b a multiple, is
    b // rows examples at the same token rate and peak memory. Splits by it keep each node's measured speed and
    memory cap; the example is the unit the plan then hands out. Raises PlanError when no point is a multiple."""
    if rows_per_example == 1:
        return cal
    points = tuple(CurvePoint(p.batch // rows_per_example, p.tokens_per_s, p.peak_memory)
                   for p in cal.curve if p.batch % rows_per_example == 0)
    if not points:
        raise PlanError(f"{cal.node}: calibrated only at batches {[p.batch for p in cal.curve]}, none a multiple of "
                        f"the {rows_per_example} rows one example needs: it cannot hold one example")
    return replace(cal, curve=points)


def compute_plan(
    calibrations: Sequence[NodeCalibration],
    global_batch: int,
    *,
    split: str | Mapping[str, float] = SplitMode.CALIBRATED,
    seq_len: int,
) -> Plan:
    """Rows per node for a synchronous step of `global_batch` rows of `seq_len` tokens.

    `split`: "calibrated" (equal predicted step times, see `_greedy`), "equal" (largest-remainder equal shares)
    or `{node: fraction}` (fractions for exactly the calibrated nodes, summing to 1 +- 1e-6, largest-remainder
    rounding). Every node gets >= 1 row and no node more rows than its memory cap, in every mode.

    Raises `PlanError`: fewer rows than nodes, a batch over the fleet's memory caps, a fixed split that puts a node
    over its cap or at zero rows, malformed fractions, duplicate nodes, or a seq_len other than the calibrated one.
    """
    _check_inputs(calibrations, global_batch, seq_len)
    names = [c.node for c in calibrations]
    models = [_NodeModel(c, seq_len) for c in calibrations]
    caps = [m.cap(global_batch) for m in models]

    for cal, model, cap in zip(calibrations, models, caps, strict=True):
        if cap < 1:
            limit = cal.memory_limit or 0
            raise PlanError(
                f"{cal.node}: even one row of {seq_len} tokens needs ~{_gib(model.peak_memory(1))}, over its "
                f"memory limit of {_gib(limit)}; shorten the sequence, use gradient checkpointing or LoRA, "
                "or leave the node out"
            )

    if isinstance(split, str) and split == SplitMode.CALIBRATED:
        if sum(caps) < global_batch:
            detail = ", ".join(
                f"{cal.node} {cap} rows (~{_gib(model.peak_memory(cap))} of {_gib(cal.memory_limit or 0)})"
                for cal, model, cap in zip(calibrations, models, caps, strict=True)
            )
            raise PlanError(
                f"global batch {global_batch} does not fit in the fleet's memory at seq_len {seq_len}: at most "
                f"{sum(caps)} rows ({detail}); lower the batch size or use gradient accumulation"
            )
        counts = _greedy(models, caps, global_batch)
        mode = SplitMode.CALIBRATED
    else:
        if isinstance(split, str):
            if split != SplitMode.EQUAL:
                raise PlanError(f"unknown split {split!r}: use calibrated, equal or {{node: fraction}}")
            fractions = [1.0 / len(names)] * len(names)
            mode = SplitMode.EQUAL
        else:
            fractions = _explicit_fractions(names, split)
            mode = SplitMode.EXPLICIT
        counts = largest_remainder(global_batch, fractions)
        for name, count, fraction in zip(names, counts, fractions, strict=True):
            if count < 1:
                raise PlanError(
                    f"{mode} split gives {name} 0 of {global_batch} rows (fraction {fraction:.4g}): raise its "
                    "fraction or the global batch"
                )
        over = [
            f"{cal.node} {count} rows (~{_gib(model.peak_memory(count))}, limit {_gib(cal.memory_limit or 0)}, "
            f"cap {cap})"
            for cal, model, cap, count in zip(calibrations, models, caps, counts, strict=True)
            if count > cap
        ]
        if over:
            raise PlanError(
                f"{mode} split of global batch {global_batch} at seq_len {seq_len} exceeds memory: {'; '.join(over)}"
            )

    per_node = {name: model.predicted_step_s(count) for name, model, count in zip(names, models, counts, strict=True)}
    step = max(per_node.values())
    # The nodes measured the same rows (the run's order, the same data), so their fills agree up to the batches
    # each timed; the mean is the data's.
    fill = sum(c.fill for c in calibrations) / len(calibrations)
    return Plan(
        split={name: count / global_batch for name, count in zip(names, counts, strict=True)},
        batch=dict(zip(names, counts, strict=True)),
        global_batch=global_batch,
        mode=mode,
        seq_len=seq_len,
        predicted_step_s=step,
        predicted_tokens_per_s=global_batch * seq_len * fill / step,
        fill=fill,
        per_node_step_s=per_node,
    )


def with_collective(plan: Plan, cost: CollectiveCost | None) -> Plan:
    """`plan` with the gradient exchange after the slowest node's compute: step = max_i compute_i + exchange.
    The split stays (the exchange is the same for every node); the prediction drops. A plan without predicted
    step times (a fixed split, a pipeline's stages) or a `cost` of None comes back unchanged; a plan that already
    holds an exchange has it replaced, never added twice."""
    if cost is None or not plan.per_node_step_s or plan.mode == SplitMode.PIPELINE:
        return plan
    step = max(plan.per_node_step_s.values()) + cost.seconds
    return replace(plan, collective=cost, predicted_step_s=step,
                   predicted_tokens_per_s=plan.global_batch * plan.seq_len * plan.fill / step)


def with_rehearsal(plan: Plan, rehearsal: Rehearsal | None) -> Plan:
    """`plan` predicted by its rehearsal: the run's rate over the rehearsed steps, the split unchanged (calibration's
    curves made it; the rehearsal only times it). The calibrated parts stay in `per_node_step_s` and `collective`
    for the plan table. None, or a pipeline, comes back unchanged."""
    if rehearsal is None or plan.mode == SplitMode.PIPELINE:
        return plan
    return replace(plan, rehearsal=rehearsal, predicted_tokens_per_s=rehearsal.tokens_per_s,
                   predicted_step_s=plan.global_batch * plan.seq_len * plan.fill / rehearsal.tokens_per_s)


def fixed_plan(names: Sequence[str], global_batch: int, split: str | Mapping[str, float], *, seq_len: int) -> Plan:
    """An `equal` or explicit `{node: fraction}` split without calibration curves (no memory caps, no predicted
    rates): what a playbook with a fixed split runs, so it never waits for a benchmark."""
    if len(set(names)) != len(names) or not names:
        raise PlanError(f"need distinct nodes, got {list(names)}")
    if global_batch < len(names):
        raise PlanError(f"global batch {global_batch} is smaller than the {len(names)} nodes: every rank needs a row")
    if isinstance(split, str):
        if split != SplitMode.EQUAL:
            raise PlanError(f"a fixed plan needs split `equal` or {{node: fraction}}, not {split!r}")
        fractions, mode = [1.0 / len(names)] * len(names), SplitMode.EQUAL
    else:
        fractions, mode = _explicit_fractions(names, split), SplitMode.EXPLICIT
    counts = largest_remainder(global_batch, fractions)
    for name, count, fraction in zip(names, counts, fractions, strict=True):
        if count < 1:
            raise PlanError(f"{mode} split gives {name} 0 of {global_batch} rows (fraction {fraction:.4g}): raise "
                            "its fraction or the global batch")
    return Plan(split={n: c / global_batch for n, c in zip(names, counts, strict=True)},
                batch=dict(zip(names, counts, strict=True)), global_batch=global_batch, mode=mode, seq_len=seq_len,
                predicted_step_s=0.0, predicted_tokens_per_s=0.0)


def describe_step(plan: Plan) -> str:
    """The predicted step in its parts: `predicted step 412.0 ms = 380.1 ms compute (slowest node) + 31.9 ms
    gradient all_sum (8%)`, or the compute alone with why the exchange is not in it."""
    if plan.predicted_step_s <= 0:
        return "no predicted step (uncalibrated split)"
    if plan.rehearsal is not None:
        calibrated = max(plan.per_node_step_s.values(), default=0.0) + (
            plan.collective.seconds if plan.collective is not None else 0.0)
        moved = plan.rehearsal.describe_tokens()
        return (f"predicted step {1000 * plan.predicted_step_s:.1f} ms, timed by a rehearsal of {plan.rehearsal.steps} "
                f"steps of the run ({plan.rehearsal.shared}: side by side, they slow each other); calibrated apart "
                f"it was {1000 * calibrated:.1f} ms" + (f"; {moved}" if moved else ""))
    if plan.collective is None:
        alone = "one rank: no exchange" if len(plan.batch) < 2 else "the gradient all_sum not measured, left out"
        return f"predicted step {1000 * plan.predicted_step_s:.1f} ms of compute ({alone})"
    return (f"predicted step {1000 * plan.predicted_step_s:.1f} ms = {1000 * plan.compute_step_s:.1f} ms compute "
            f"(slowest node) + {1000 * plan.collective.seconds:.1f} ms gradient all_sum "
            f"({100 * plan.collective_share:.0f}%)")


def format_split(plan: Plan) -> str:
    """`m4max 65.5% / ultra 34.5%` in rank order."""
    return " / ".join(f"{name} {format_share(share)}" for name, share in plan.split.items())
