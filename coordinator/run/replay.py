"""One truth for every view: each rank's rate and verdict and the run's prediction, by the monitor's own rules.

The launch loop judges its live `Monitor` with `judge_monitor`. Every other view (status, monitor, the report,
the dashboard, summary.json) judges a run from its files: `RunReplay(meta)` is fed events.jsonl's lines in file
order (in as many batches as a tail delivers) and keeps a `Monitor` of meta.json's attempt, fed that attempt's
rank events exactly as the coordinator fed its own (the same observations in the same order, timed by the worker's
`t`), with the run's own thresholds (meta.json's `faults`); the incidents the coordinator recorded are its word on
the ranks (the replay's own are never shown). `RunReplay.judge(now)` is then what `judge_monitor` said live.

    rate        `monitor.rank_rate`: the median tok_s of the rank's last steps, in real tokens/s (RATE_UNIT)
    verdict     `monitor.rank_verdict`: ok | slow | stalled | hung | dead (pending before its start)
    run rate    `Monitor.run_tokens_per_s`: the median over the steps of all ranks' tokens / step wall time
    prediction  calibration's, for the plan the attempt ran (plan.json, copied into meta.json and summary.json)
    stages      `coordinator.run.stages.StageView`: each rank's stage and layers, its busy and wait shares of the
                step, the measured bubble, and its peak memory against the plan's need and its node's budget

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.run.monitor import (
    RATE_UNIT,
    FaultPolicy,
    Monitor,
    Observation,
    ObservationKind,
    PlannedRank,
    RankView,
    Verdict,
    rank_rate,
    rank_verdict,
)
from coordinator.run.rundir import AttemptCounter, EventLine, RunMeta, parse_event_line
from coordinator.run.stages import StageView, build_stage_view, planned_busy_s
from coordinator.units import format_bytes
from worker.events import EventError

NO_ITERS = 2**31  # an older meta.json has no `iters`: no step is implausible for being past the end


@dataclass(frozen=True)
class RankJudgement:
    """One rank as every view shows it. `tokens_per_s` is `rank_rate` (real tokens/s); `last_t` its newest
    event on the clock of the judge's `now`."""

    rank: int
    node: str
    state: str  # pending | running | finished | failed
    step: int
    loss: float | None
    tokens_per_s: float | None
    verdict: Verdict
    last_t: float | None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "state": self.state, "step": self.step,
                "tokens_per_s": _round(self.tokens_per_s, 1), "verdict": str(self.verdict)}


@dataclass(frozen=True)
class RunJudgement:
    """The run's ranks, its rate and calibration's prediction, all in RATE_UNIT; its stages and memory."""

    ranks: tuple[RankJudgement, ...]
    tokens_per_s: float | None
    predicted_tokens_per_s: float | None
    unit: str = RATE_UNIT
    stages: StageView = field(default_factory=StageView)

    def of(self, rank: int, node: str) -> RankJudgement | None:
        return next((r for r in self.ranks if r.rank == rank and r.node == node), None)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def prediction_of(*candidates: float | None) -> float | None:
    """Calibration's prediction from the first of the run's files that has it (meta.json, summary.json,
    plan.json all copy the plan's one number); None for an uncalibrated split (its plan says 0)."""
    return next((float(c) for c in candidates if c), None)


def judge_monitor(mon: Monitor, *, now: float | None, predicted: float | None,
                  incidents: Iterable[tuple[int | None, str, str]] | None = None) -> RunJudgement:
    """Judge `mon`'s ranks: `now` on the monitor's clock while the run is live, None once it ended;
    `incidents`: (rank, node, kind) of the attempt's incidents, by default the monitor's own."""
    seen = incidents if incidents is not None else ((i.rank, i.node, str(i.kind)) for i in mon.incidents)
    kinds: dict[tuple[int, str], list[str]] = {}
    for rank, node, kind in seen:
        if rank is not None:
            kinds.setdefault((rank, node), []).append(kind)
    ranks = tuple(_judge_rank(v, mon.policy, kinds.get((v.rank, v.node), ()), now)
                  for v in sorted(mon.ranks.values(), key=lambda r: r.rank))
    stages = build_stage_view(mon.layout, mon.stages, [(r.rank, r.node) for r in ranks])
    return RunJudgement(ranks, mon.run_tokens_per_s(), predicted or None, stages=stages)


def _judge_rank(view: RankView, policy: FaultPolicy, kinds: Iterable[str], now: float | None) -> RankJudgement:
    return RankJudgement(rank=view.rank, node=view.node, state=str(view.state), step=view.step, loss=view.loss,
                         tokens_per_s=rank_rate(view), verdict=rank_verdict(view, policy, list(kinds), now=now),
                         last_t=view.last_event_at)


class RunReplay:
    """meta.json's attempt of a run, replayed from events.jsonl through a `Monitor` (see the module docstring).
    Feed it every line in file order; lines of other attempts are skipped (`rundir.AttemptCounter` names each
    line's attempt from the coordinator's own records; meta.json's attempt is of the newest session)."""

    def __init__(self, meta: RunMeta, *, predicted: float | None = None, fallback: FaultPolicy | None = None) -> None:
        """`fallback`: the thresholds of a run whose meta.json predates them (`rundir.policy_from_playbook`)."""
        self.meta = meta
        self.attempt = meta.attempt
        self.policy = meta.faults or fallback or FaultPolicy()
        self.predicted = prediction_of(meta.predicted_tokens_per_s, predicted)
        self.monitor = self._new_monitor()
        self.counter = AttemptCounter()
        self.incidents: list[tuple[int | None, str, str]] = []  # (rank, node, kind) the coordinator recorded
        self._t = 0.0
        self._base = 0  # the first attempt of the session being judged (`launch --resume` starts another)
        self._rereads = 0  # the re-reads of the ranks' files (`coordinator attach`) seen

    def _new_monitor(self) -> Monitor:
        meta = self.meta
        sized = all(r.batch_size for r in meta.ranks)
        plan = [PlannedRank(r.rank, r.node, r.batch_size or 1, r.calibrated_tokens_per_s,
                            planned_busy_s(meta.layout, r.rank)) for r in meta.ranks]
        pipeline = meta.layout is not None and meta.layout.pipeline
        return Monitor.create(plan, meta.iters or NO_ITERS, now=0.0, policy=self.policy,
                              max_tokens_per_row=meta.max_tokens_per_row if sized else None,
                              replica_groups=tuple((r.rank,) for r in meta.ranks) if pipeline else None,
                              layout=meta.layout)

    def feed(self, records: Iterable[Mapping[str, Any]]) -> None:
        """events.jsonl lines (decoded JSON objects), in file order."""
        for record in records:
            self.feed_line(record, parse_event_line(record))

    def feed_line(self, record: Mapping[str, Any], line: EventLine) -> None:
        """One line, already read as an `EventLine` (for readers that fold it themselves too)."""
        attempt = self.counter.attempt_of(line)
        reread, self._rereads = self.counter.rereads != self._rereads, self.counter.rereads
        if self.counter.base != self._base:  # a resumed session began: meta.json's attempt is one of its own
            self._base, self.monitor, self.incidents = self.counter.base, self._new_monitor(), []
        if attempt != self._base + self.attempt:
            return
        if reread:  # an attach began reading this attempt's files again, into a fresh monitor
            self.monitor, self.incidents = self._new_monitor(), []
        if line.incident is not None:
            inc = line.incident
            self.incidents.append((inc.rank, inc.node or "?", inc.kind or "unknown"))
            return
        if isinstance(line.event, EventError) or line.rank is None or line.node is None:
            return  # the coordinator's own records: not a rank's progress
        self._t = line.t if line.t is not None else self._t
        data = {k: v for k, v in record.items() if k not in ("node", "attempt")}
        self.monitor.observe(Observation(ObservationKind.EVENT, line.node, self._t, line.rank, data))
        self.monitor.events.clear()  # the monitor's copy of every event: the file has them, a long run need not

    def judge(self, now: float | None) -> RunJudgement:
        """`now`: wall-clock time while the run is live (the workers' `t` is unix time), None once it ended."""
        return judge_monitor(self.monitor, now=now, predicted=self.predicted, incidents=self.incidents)


# A node's measured peak below this share of its plan says the plan over-reserves (the goal the plan is held to:
# within [0.8, 1.0] of the peak it predicts).
MEMORY_PLAN_FLOOR = 0.8


def describe_memory(nodes: Iterable[Mapping[str, Any]]) -> str | None:
    """Each node's measured peak against the plan's (summary.json's `peak_memory_bytes`, `planned_memory_bytes`):
    one line, naming every node over its plan or far under it; None when no node has both (a dp run)."""
    rows = [(str(n.get("node")), n.get("peak_memory_bytes"), n.get("planned_memory_bytes")) for n in nodes]
    pairs = [(node, int(peak), int(plan)) for node, peak, plan in rows
             if isinstance(peak, int) and isinstance(plan, int) and plan > 0 and peak > 0]
    if not pairs:
        return None
    text = "; ".join(f"{node} {format_bytes(peak)} of {format_bytes(plan)} planned ({peak / plan:.2f}x)"
                     for node, peak, plan in pairs)
    over = [node for node, peak, plan in pairs if peak > plan]
    under = [node for node, peak, plan in pairs if peak < MEMORY_PLAN_FLOOR * plan]
    if over:
        return (text + f": over the plan on {', '.join(over)}: its budget check under-reserved (the peak is MLX's "
                "arrays; the process's own runtime is kept out of every budget)")
    if under:
        return text + f": under {MEMORY_PLAN_FLOOR:.0%} of the plan on {', '.join(under)} (the plan over-reserves)"
    return text + ": within the plan"


__all__ = ["MEMORY_PLAN_FLOOR", "RankJudgement", "RunJudgement", "RunReplay", "describe_memory", "judge_monitor",
           "prediction_of"]
