"""A run's layout and memory as every view shows them: each rank's stage and layer range, its share of the step
time, the measured bubble, and each rank's peak memory against its node's budget and the plan's predicted need.

Pure: values in, values out. Two halves, and the one function that joins them:

* the plan, `RunLayout` (meta.json's `layout`, written at each attempt's launch by `build_run_layout`): how the
  attempt's ranks share the model (the worker's `Layout`: the kind, each rank's blocks [first, last), the
  micro-batches and schedule) and the plan's row for each rank's node (`planning.strategy.PlanRow`: memory budget,
  predicted need, predicted time), with the plan's bubble. `attach` rebuilds the worker's layout from it
  (`worker_layout`), so its monitor is launch's.
* the measurements, `StageFold`: the `Monitor` feeds it every rank event it accepts (`Monitor.stages`), live in
  the launch and replayed from events.jsonl by `coordinator.run.replay` for every other view. It keeps each rank's
  newest STAGE_STEPS steps' (step_time_s, busy_s, wait_s) and its highest `peak_memory`.
* `build_stage_view(layout, fold, ranks)` -> `StageView`, carried in `replay.RunJudgement.stages`:

    busy share    median of busy_s / step_time_s over the rank's newest steps: its own computation (a pipeline
                  stage's forwards, backwards and update: `worker.parallel.pipeline.strategy.Pipeline.step_fields`)
    wait share    median of wait_s / step_time_s: blocked on its neighbours (transfers, the step's closing
                  all_sum); the rest of a step is building the batch
    bubble        the mean wait share over the stages (each stage's idle share of the step, averaged): what the
                  plan's (P-1)/(M+P-1) predicts (`predicted_bubble`)
    bottleneck    the stage with the most busy time per step (the one that paces the others)
    busy vs plan  busy_s against the plan's predicted compute per step (its row's `predicted_busy_s`, else its
                  stage time per micro-batch x micro-batches; None while the plan has no measured stage time)
    memory        the rank's highest `peak_memory` against its node's plan row: `need_bytes` (the predicted peak)
                  and `budget_bytes`

A data-parallel run has no stages (no busy/wait fields in its step events): its view carries the memory columns
only, where the plan weighed them.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.events import AnyEvent, EventError, StartedEvent, StepEvent, coerce_float, coerce_int
from worker.runconfig import Layout, StageSpec

STAGE_STEPS = 20  # the newest steps a rank's shares are the median of (the monitor's rate window, RecentSteps.KEPT)


@dataclass(frozen=True)
class LayoutRank:
    """One rank of the attempt as planned: its stage and blocks (None for a data-parallel replica) and its node's
    plan row (None where the plan weighed nothing: a forced dp or fsdp, sizes unknown)."""

    rank: int
    node: str
    stage: int | None = None
    first_layer: int | None = None
    last_layer: int | None = None  # exclusive
    need_bytes: int | None = None  # the plan's predicted peak memory
    budget_bytes: int | None = None  # the node's usable memory
    predicted_s: float | None = None  # a stage's time per micro-batch (a dp node's step)
    predicted_busy_s: float | None = None  # a stage's predicted compute per step (the plan's, where it says)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "stage": self.stage, "first_layer": self.first_layer,
                "last_layer": self.last_layer, "need_bytes": self.need_bytes, "budget_bytes": self.budget_bytes,
                "predicted_s": self.predicted_s, "predicted_busy_s": self.predicted_busy_s}


# The digits a share (busy, wait, the bubble: 0-1) keeps in the record (summary.json, the dashboard's JSON). Every
# view that shows it as a percentage starts from that recorded value (`coordinator.views.stagetable.pct`).
SHARE_DIGITS = 4


@dataclass(frozen=True)
class RunLayout:
    """meta.json's `layout`: what an attempt runs (see the module docstring)."""

    kind: str = "dp"  # dp | pipeline | fsdp
    ranks: tuple[LayoutRank, ...] = ()
    micro_batches: int | None = None
    schedule: str | None = None
    predicted_bubble: float | None = None

    @property
    def pipeline(self) -> bool:
        return self.kind == "pipeline"

    def of(self, rank: int) -> LayoutRank | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def worker_layout(self) -> Layout:
        """The worker's `Layout` the attempt was launched with (run.json's `layout`)."""
        if not self.pipeline:
            return Layout(kind=self.kind)
        return Layout(kind="pipeline", micro_batches=self.micro_batches or 1, schedule=self.schedule or "1f1b",
                      stages=tuple(StageSpec(rank=r.rank, first_layer=r.first_layer or 0, last_layer=r.last_layer or 0)
                                   for r in sorted(self.ranks, key=lambda r: r.rank)))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "micro_batches": self.micro_batches, "schedule": self.schedule,
                "predicted_bubble": self.predicted_bubble, "ranks": [r.to_json() for r in self.ranks]}


def planned_busy_s(layout: RunLayout | None, rank: int) -> float | None:
    """A pipeline stage's planned busy seconds per step (the per-stage straggler rule's yardstick), None where
    the layout has none: the live monitor and the replay read it here, from the one recorded layout."""
    row = layout.of(rank) if layout is not None and layout.pipeline else None
    return row.predicted_busy_s if row is not None else None


def build_run_layout(layout: Layout, ranks: Sequence[tuple[int, str]],
                     strategy: Mapping[str, Any] | None) -> RunLayout:
    """The attempt's `RunLayout`: the worker's `layout`, the ranks (rank, node) and the plan's strategy
    (`StrategyChoice.to_json`, plan.json's `strategy`; None where nothing was weighed)."""
    rows: dict[str, Mapping[str, Any]] = {}
    if strategy is not None and isinstance(strategy.get("rows"), list):
        rows = {str(r.get("node")): r for r in strategy["rows"] if isinstance(r, Mapping)}
    pipeline = layout.kind == "pipeline"
    planned = []
    for rank, node in ranks:
        spec = next((s for s in layout.stages if s.rank == rank), None) if pipeline else None
        row = rows.get(node, {})
        planned.append(LayoutRank(rank=rank, node=node, stage=rank if spec is not None else None,
                                   first_layer=spec.first_layer if spec is not None else None,
                                   last_layer=spec.last_layer if spec is not None else None,
                                   need_bytes=coerce_int(row.get("need_bytes")),
                                   budget_bytes=coerce_int(row.get("budget_bytes")),
                                   predicted_s=coerce_float(row.get("predicted_s")),
                                   predicted_busy_s=coerce_float(row.get("predicted_busy_s"))))
    bubble = coerce_float(strategy.get("bubble")) if strategy is not None and pipeline else None
    return RunLayout(kind=layout.kind, ranks=tuple(planned), micro_batches=layout.micro_batches if pipeline else None,
                     schedule=layout.schedule if pipeline else None, predicted_bubble=bubble)


def parse_run_layout(value: Any) -> RunLayout | None:
    """meta.json's `layout` -> `RunLayout`; None when absent or no object (an older meta.json). Lenient: a field
    missing or mistyped is None, a rank without its number or node is left out."""
    if not isinstance(value, Mapping):
        return None
    kind = value.get("kind") if isinstance(value.get("kind"), str) else "dp"
    ranks = []
    listed = value.get("ranks")
    for r in listed if isinstance(listed, list) else ():
        if not isinstance(r, Mapping) or (rank := coerce_int(r.get("rank"))) is None or not isinstance(r.get("node"), str):
            continue
        ranks.append(LayoutRank(rank=rank, node=r["node"], stage=coerce_int(r.get("stage")),
                                 first_layer=coerce_int(r.get("first_layer")),
                                 last_layer=coerce_int(r.get("last_layer")),
                                 need_bytes=coerce_int(r.get("need_bytes")),
                                 budget_bytes=coerce_int(r.get("budget_bytes")),
                                 predicted_s=coerce_float(r.get("predicted_s")),
                                 predicted_busy_s=coerce_float(r.get("predicted_busy_s"))))
    schedule = value.get("schedule")
    return RunLayout(kind=str(kind), ranks=tuple(ranks), micro_batches=coerce_int(value.get("micro_batches")),
                     schedule=schedule if isinstance(schedule, str) else None,
                     predicted_bubble=coerce_float(value.get("predicted_bubble")))


def recorded_layout(layout: RunLayout | None, ranks: Sequence[tuple[int, str]],
                    strategy: Mapping[str, Any] | None) -> RunLayout | None:
    """The attempt's layout as its run directory records it: meta.json's (`layout`), else, for a meta.json written
    before it had one, rebuilt from plan.json's `strategy` (its `layout` is the worker's, its `rows` the plan's);
    None when neither says (a dp run: the worker's default)."""
    if layout is not None:
        return layout
    raw = strategy.get("layout") if strategy is not None else None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("kind"), str):
        return None
    stages = []
    listed = raw.get("stages")
    for s in listed if isinstance(listed, list) else []:
        if isinstance(s, Mapping) and None not in (rank := coerce_int(s.get("rank")),
                                                   first := coerce_int(s.get("first_layer")),
                                                   last := coerce_int(s.get("last_layer"))):
            stages.append(StageSpec(rank=rank or 0, first_layer=first or 0, last_layer=last or 0))
    worker = Layout(kind=raw["kind"], stages=tuple(stages), micro_batches=coerce_int(raw.get("micro_batches")) or 1,
                    schedule=raw["schedule"] if isinstance(raw.get("schedule"), str) else "1f1b")
    return build_run_layout(worker, ranks, strategy)


# --- measurements ---------------------------------------------------------------------------------------------------


@dataclass
class RankMeasured:
    """What one rank's events say: its stage as its `started` event gave it, its newest steps' times and its
    highest peak memory."""

    stage: int | None = None
    first_layer: int | None = None
    last_layer: int | None = None
    micro_batches: int | None = None
    # (step_time_s, busy_s, wait_s) of its newest steps; busy/wait None for a data-parallel step
    steps: deque[tuple[float, float | None, float | None]] = field(
        default_factory=lambda: deque(maxlen=STAGE_STEPS))
    peak_memory: int | None = None


@dataclass
class StageFold:
    """Every rank's measurements, fed the rank events of one attempt in order (`observe`)."""

    ranks: dict[int, RankMeasured] = field(default_factory=dict)

    def observe(self, rank: int, event: AnyEvent | EventError) -> None:
        if isinstance(event, StartedEvent):
            seen = self.ranks.setdefault(rank, RankMeasured())
            if event.strategy == "pipeline":
                seen.stage, seen.first_layer, seen.last_layer = event.stage, event.first_layer, event.last_layer
                seen.micro_batches = event.micro_batches
        elif isinstance(event, StepEvent):
            seen = self.ranks.setdefault(rank, RankMeasured())
            if event.peak_memory is not None:
                seen.peak_memory = max(seen.peak_memory or 0, event.peak_memory)
            if event.step_time_s is not None and event.step_time_s > 0:
                seen.steps.append((event.step_time_s, event.busy_s, event.wait_s))


# --- the view -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStage:
    """One rank's row of the stage view (see the module docstring for each number)."""

    rank: int
    node: str
    stage: int | None = None
    first_layer: int | None = None
    last_layer: int | None = None  # exclusive
    step_time_s: float | None = None
    busy_s: float | None = None
    wait_s: float | None = None
    busy_share: float | None = None
    wait_share: float | None = None
    predicted_busy_s: float | None = None
    peak_memory_bytes: int | None = None
    predicted_memory_bytes: int | None = None
    budget_bytes: int | None = None

    @property
    def layers(self) -> str | None:
        """`0-5` (inclusive, as the plan table writes it); None without a range."""
        if self.first_layer is None or self.last_layer is None:
            return None
        return f"{self.first_layer}-{self.last_layer - 1}"

    @property
    def over_budget(self) -> bool:
        return self.peak_memory_bytes is not None and self.budget_bytes is not None \
            and self.peak_memory_bytes > self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "stage": self.stage, "first_layer": self.first_layer,
                "last_layer": self.last_layer, "step_time_s": _round(self.step_time_s, 4),
                "busy_s": _round(self.busy_s, 4), "wait_s": _round(self.wait_s, 4),
                "busy_share": _round(self.busy_share, SHARE_DIGITS), "wait_share": _round(self.wait_share, SHARE_DIGITS),
                "predicted_busy_s": _round(self.predicted_busy_s, 4), "peak_memory_bytes": self.peak_memory_bytes,
                "predicted_memory_bytes": self.predicted_memory_bytes, "budget_bytes": self.budget_bytes}


@dataclass(frozen=True)
class StageView:
    """The run's layout, measured: one row per rank, and the pipeline's bubble and bottleneck."""

    kind: str = "dp"
    ranks: tuple[RankStage, ...] = ()
    micro_batches: int | None = None
    schedule: str | None = None
    bubble: float | None = None
    predicted_bubble: float | None = None
    bottleneck: int | None = None  # the rank whose stage paces the pipeline

    @property
    def pipeline(self) -> bool:
        return self.kind == "pipeline"

    @property
    def has_memory_plan(self) -> bool:
        return any(r.budget_bytes is not None for r in self.ranks)

    def of(self, rank: int) -> RankStage | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "micro_batches": self.micro_batches, "schedule": self.schedule,
                "bubble": _round(self.bubble, SHARE_DIGITS), "predicted_bubble": _round(self.predicted_bubble, SHARE_DIGITS),
                "bottleneck": self.bottleneck, "ranks": [r.to_json() for r in self.ranks]}


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def build_stage_view(layout: RunLayout | None, fold: StageFold, ranks: Sequence[tuple[int, str]]) -> StageView:
    """The view of `ranks` (rank, node: the attempt's, in rank order) from the attempt's plan (`layout`: None for
    a run recorded before layouts, whose stages then come from the ranks' `started` events) and measurements."""
    layout = layout or RunLayout()
    kind = layout.kind
    if layout.kind == "dp" and any(m.stage is not None for m in fold.ranks.values()):
        kind = "pipeline"  # an older meta.json: the ranks say they are stages
    micro = layout.micro_batches or next((m.micro_batches for m in fold.ranks.values() if m.micro_batches), None)
    rows = []
    for rank, node in ranks:
        plan = layout.of(rank)
        plan = plan if plan is not None and plan.node == node else None
        seen = fold.ranks.get(rank) or RankMeasured()
        steps = list(seen.steps)
        busy = _median(b for _, b, _ in steps)
        wait = _median(w for _, _, w in steps)
        # The plan's compute per step where it predicts one (the simulated schedule's), else its time per
        # micro-batch x the micro-batches.
        predicted_busy = None
        if plan is not None and kind == "pipeline":
            predicted_busy = plan.predicted_busy_s if plan.predicted_busy_s is not None else (
                plan.predicted_s * micro if plan.predicted_s is not None and micro else None)
        rows.append(RankStage(
            rank=rank, node=node,
            stage=plan.stage if plan is not None and plan.stage is not None else seen.stage,
            first_layer=plan.first_layer if plan is not None and plan.first_layer is not None else seen.first_layer,
            last_layer=plan.last_layer if plan is not None and plan.last_layer is not None else seen.last_layer,
            step_time_s=_median(t for t, _, _ in steps), busy_s=busy, wait_s=wait,
            busy_share=_median(b / t if b is not None else None for t, b, _ in steps),
            wait_share=_median(w / t if w is not None else None for t, _, w in steps),
            predicted_busy_s=predicted_busy, peak_memory_bytes=seen.peak_memory,
            predicted_memory_bytes=plan.need_bytes if plan is not None else None,
            budget_bytes=plan.budget_bytes if plan is not None else None))
    pipeline = kind == "pipeline"
    waits = [r.wait_share for r in rows if r.wait_share is not None]
    busiest = max((r for r in rows if r.busy_s is not None), key=lambda r: r.busy_s or 0.0, default=None)
    return StageView(kind=kind, ranks=tuple(rows), micro_batches=micro if pipeline else None,
                     schedule=layout.schedule if pipeline else None,
                     bubble=sum(waits) / len(waits) if pipeline and waits else None,
                     predicted_bubble=layout.predicted_bubble if pipeline else None,
                     bottleneck=busiest.rank if pipeline and busiest is not None and len(rows) > 1 else None)


__all__ = ["STAGE_STEPS", "LayoutRank", "RankMeasured", "RankStage", "RunLayout", "StageFold", "StageView",
           "build_run_layout", "build_stage_view", "parse_run_layout", "recorded_layout"]
