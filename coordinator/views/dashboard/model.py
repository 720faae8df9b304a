"""The dashboard's pure core: a run's files (events.jsonl records, meta.json, summary.json) folded into what the
run page shows.

The same sources as `coordinator status`/`monitor` (one truth, no second state store), read through the same
contracts: meta.json and summary.json as `coordinator.run.rundir`'s typed records, each events.jsonl line as its
`rundir.EventLine` (the rank's event under `worker.events.parse_event`, an incident as an `IncidentRecord`). Each
rank's rate and verdict and the run's prediction are not the dashboard's own: the fold feeds every line to the
run's `coordinator.run.replay.RunReplay` (the monitor's rules, the run's own thresholds from meta.json), as status,
the report and summary.json do. The fold is fed the records of events.jsonl in file order, in as many batches as
the tail delivers, and each batch returns the *delta* (new loss points, new incidents, ...) that the server pushes
to browsers. A finished run is replayed by feeding its whole file once.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.run.monitor import RATE_UNIT, FaultPolicy, Verdict
from coordinator.run.replay import RunJudgement, RunReplay, prediction_of
from coordinator.run.rundir import RunMeta, SummaryFile, parse_event_line
from worker.events import (
    CheckpointEvent,
    ErrorEvent,
    EvalEvent,
    EventError,
    FinishedEvent,
    HeartbeatEvent,
    StartedEvent,
    StepEvent,
)

RECENT_STEP_TIMES = 50  # a rank's step-time min/median/max are over its last steps
# An older run's meta.json has no thresholds: the playbook's default (the server reads the run's playbook).
DEFAULT_HEARTBEAT_TIMEOUT = FaultPolicy().heartbeat_timeout


@dataclass
class RankLive:
    """One rank as its events show it. Times are the workers' unix `t`."""

    rank: int
    node: str
    batch_size: int | None = None
    calibrated_tokens_per_s: float | None = None
    state: str = "pending"  # pending | running | finished | failed
    phase: str | None = None  # load | step | sync | checkpoint | eval | digest | idle (from heartbeats)
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    last_t: float | None = None  # its newest event of any kind (a heartbeat is one)
    last_step_t: float | None = None
    started_t: float | None = None
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEP_TIMES))


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class RunFold:
    """A run's events folded for the run page. `feed` returns the delta of one batch (see `empty_delta`)."""

    run_id: str
    ranks: dict[int, RankLive] = field(default_factory=dict)
    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, loss): the global loss, once per step
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # a relaunch: ranks started again at `step`
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # the writer's, one per step
    first_t: float | None = None
    iters: int | None = None  # from the ranks' `started` events
    bad_lines: int = 0
    _loss_steps: set[int] = field(default_factory=set)
    _val_steps: set[int] = field(default_factory=set)
    _ckpt_steps: set[int] = field(default_factory=set)
    _started: set[int] = field(default_factory=set)
    replay: RunReplay | None = None  # meta.json's attempt through the monitor's rules (rates, verdicts)
    fallback: FaultPolicy | None = None  # an older run's thresholds (its meta.json has none), from its playbook

    @classmethod
    def from_meta(cls, run_id: str, meta: RunMeta | None, *, fallback: FaultPolicy | None = None) -> RunFold:
        """A fold that knows the planned ranks (and their calibrated predictions) before any event."""
        fold = cls(run_id, replay=RunReplay(meta, fallback=fallback) if meta is not None else None, fallback=fallback)
        for r in meta.ranks if meta is not None else ():
            fold.ranks[r.rank] = RankLive(r.rank, r.node, r.batch_size, r.calibrated_tokens_per_s)
        return fold

    def rejudge(self, meta: RunMeta, records: Iterable[Mapping[str, Any]]) -> None:
        """A relaunch rewrote meta.json (another attempt, other ranks): the ranks are judged by its attempt from now
        on, the run's lines so far (`records`, from the start of events.jsonl) replayed for it, and the rank rows
        are its ranks (a node left out of the relaunch has no row). The curves stay."""
        self.replay = RunReplay(meta, fallback=self.fallback)
        self.replay.feed(records)
        kept = {r.rank: self.ranks.get(r.rank) for r in meta.ranks}
        self.ranks = {r.rank: view if view is not None and view.node == r.node
                      else RankLive(r.rank, r.node, r.batch_size, r.calibrated_tokens_per_s)
                      for r in meta.ranks for view in (kept[r.rank],)}

    def feed(self, records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        delta = empty_delta()
        for record in records:
            self._feed_one(record, delta)
        return delta

    def _feed_one(self, record: Mapping[str, Any], delta: dict[str, Any]) -> None:
        line = parse_event_line(record)
        if self.replay is not None:
            self.replay.feed_line(record, line)
        t = line.t  # any record's time, the coordinator's own included
        if t is not None and self.first_t is None:
            self.first_t = t
        if line.incident is not None:
            inc = line.incident
            note = {"kind": inc.kind or "unknown", "node": inc.node or "?", "rank": inc.rank, "step": inc.step,
                    "action": inc.action or "", "t": inc.t,
                    "summary": str(inc.evidence if inc.evidence is not None else "")[:200]}
            self.incidents.append(note)
            delta["incidents"].append(note)
            return
        # A rank's event as the coordinator copied it (its `node` added), under worker.events' contract; the
        # coordinator's other records (supervisor, reassigned, ...) are not about a rank's progress.
        event, node = line.event, line.node
        if isinstance(event, EventError) or event.rank is None or node is None:
            return
        rank, t = event.rank, event.t
        view = self.ranks.get(rank)
        if view is None or view.node != node:  # unplanned, or a relaunch moved the rank: the event's node wins
            view = self.ranks[rank] = RankLive(rank, node, view.batch_size if view else None,
                                               view.calibrated_tokens_per_s if view and view.node == node else None)
        if t is not None:
            view.last_t = t if view.last_t is None else max(view.last_t, t)
        if isinstance(event, HeartbeatEvent):
            view.phase = event.phase or view.phase
            if view.state == "pending":
                view.state = "running"
        elif isinstance(event, StartedEvent):
            resumed = event.resumed_from
            # A rank starting again (a relaunch), or starting from a checkpoint (a resume): marked once, by the
            # lowest rank, on the curves.
            if (rank in self._started or resumed) and rank == min(self.ranks):
                note = {"step": resumed or 0, "t": t, "rank": rank, "node": node}
                self.recoveries.append(note)
                delta["recoveries"].append(note)
            self._started.add(rank)
            self.iters = event.iters or self.iters
            view.state, view.step, view.started_t = "running", resumed or 0, t
            view.phase = "load"
        elif isinstance(event, StepEvent) and (step := event.step) is not None:
            view.state, view.phase = "running", "step"
            view.step = max(view.step, step)
            view.tokens_per_s = event.tok_s
            view.loss = event.loss
            view.last_step_t = t
            if event.step_time_s is not None:
                view.step_times.append(event.step_time_s)
            if view.loss is not None and step not in self._loss_steps:
                self._loss_steps.add(step)
                self.loss.append((step, view.loss))
                delta["loss"].append([step, _r(view.loss, 5)])
        elif isinstance(event, EvalEvent) and (step := event.step) is not None:
            val = event.val_loss
            if val is not None and step not in self._val_steps:
                self._val_steps.add(step)
                self.val_loss.append((step, val))
                delta["val_loss"].append([step, _r(val, 5)])
        elif isinstance(event, CheckpointEvent) and (step := event.step) is not None and step not in self._ckpt_steps:
            self._ckpt_steps.add(step)
            note = {"step": step, "path": event.path or "", "t": t}
            self.checkpoints.append(note)
            delta["checkpoints"].append(note)
        elif isinstance(event, FinishedEvent):
            view.state, view.phase = "finished", None
            view.step = max(view.step, event.step or 0)
        elif isinstance(event, ErrorEvent):
            view.state = "failed"

    @property
    def step(self) -> int:
        """The step every rank has reached."""
        return min((r.step for r in self.ranks.values()), default=0)


def empty_delta() -> dict[str, Any]:
    return {"loss": [], "val_loss": [], "incidents": [], "recoveries": [], "checkpoints": []}


def step_time_stats(times: Iterable[float]) -> dict[str, float] | None:
    """min/median/max of the step times given; None when there are none."""
    values = list(times)
    if not values:
        return None
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def judge(fold: RunFold, *, now: float, active: bool) -> RunJudgement | None:
    """The run's one judgement (coordinator.run.replay): `now` counts while it is active; None without meta.json."""
    return fold.replay.judge(now if active else None) if fold.replay is not None else None


def rank_row(rank: RankLive, judged: RunJudgement | None, *, now: float) -> dict[str, Any]:
    """One rank's row on the run page (ages are recomputed in the browser from `last_t` between pushes). Its
    rate (`tokens_per_s`, real tokens/s) and `verdict` are the run's judgement, the same as every view's."""
    mine = judged.of(rank.rank, rank.node) if judged is not None else None
    return {"rank": rank.rank, "node": rank.node, "state": rank.state, "phase": rank.phase, "step": rank.step,
            "loss": _r(rank.loss, 5), "tokens_per_s": _r(mine.tokens_per_s, 1) if mine is not None else None,
            "calibrated_tokens_per_s": _r(rank.calibrated_tokens_per_s, 1), "batch_size": rank.batch_size,
            "last_t": rank.last_t, "last_step_t": rank.last_step_t,
            "heartbeat_age_s": None if rank.last_t is None else _r(max(0.0, now - rank.last_t), 1),
            "step_age_s": None if rank.last_step_t is None else _r(max(0.0, now - rank.last_step_t), 1),
            "step_time_s": step_time_stats(rank.step_times),
            "verdict": str(mine.verdict) if mine is not None else str(Verdict.PENDING)}


def split_shares(fold: RunFold) -> dict[str, float]:
    """Each node's share of the global batch (batch sizes from meta.json)."""
    sizes = {r.node: r.batch_size for r in fold.ranks.values() if r.batch_size}
    total = sum(v for v in sizes.values() if v)
    return {n: round(v / total, 4) for n, v in sizes.items() if v} if total else {}


def eta_s(fold: RunFold, iters: int | None, now: float) -> float | None:
    """Seconds to the last step at the rate since the (latest) start; None before a step or without `iters`."""
    if iters is None:
        return None
    starts = [r.started_t for r in fold.ranks.values() if r.started_t is not None]
    done = fold.step
    base = fold.recoveries[-1]["step"] if fold.recoveries else 0
    if not starts or done <= base:
        return None
    rate = (done - base) / max(1e-9, now - min(starts))
    return max(0.0, (iters - done) / rate) if rate > 0 else None


def _left_out(meta: RunMeta | None, summary: SummaryFile | None) -> list[dict[str, str]]:
    """The inventory nodes the run started without, {node, reason}: the summary's word once it has one (older
    summaries have none), else meta.json's."""
    if summary is not None and summary.left_out is not None:
        return [{"node": n, "reason": why} for n, why in summary.left_out]
    return [dict(x) for x in meta.left_out] if meta is not None else []


def run_view(fold: RunFold, *, meta: RunMeta | None, summary: SummaryFile | None, iters: int | None,
             now: float, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, full: bool = True) -> dict[str, Any]:
    """The run page's document: the header, every rank's row and, with `full`, the whole curves and lists (the
    first load and a replay; pushes carry deltas instead)."""
    active = summary is None
    iters = iters or fold.iters or (summary.iters if summary is not None else None)
    state = (summary.state or "unknown") if summary is not None else "running"
    left_out = _left_out(meta, summary)
    judged = judge(fold, now=now, active=active)
    tok = judged.tokens_per_s if judged is not None and judged.tokens_per_s is not None else (
        summary.tokens_per_s if summary is not None else None)
    predicted = prediction_of(meta.predicted_tokens_per_s if meta is not None else None,
                              summary.predicted_tokens_per_s if summary is not None else None)
    if meta is not None and meta.faults is not None:
        heartbeat_timeout = meta.faults.heartbeat_timeout  # the run's own, over the playbook's copy
    doc: dict[str, Any] = {
        # An ended run's steps are its record's (summary.json: what the nodes prove), not the events that reached us.
        "run_id": fold.run_id, "active": active, "state": state, "iters": iters,
        "step": summary.steps if summary is not None and summary.steps is not None else fold.step,
        "tokens_per_s": _r(tok, 1), "predicted_tokens_per_s": _r(predicted, 1), "rate_unit": RATE_UNIT,
        "eta_s": _r(eta_s(fold, iters, now), 1) if active else None, "now": now,
        # A pipeline's ranks each compute every row: no share of the batch to show (its stages say who does what).
        "degraded": bool(left_out), "left_out": left_out,
        "split": {} if judged is not None and judged.stages.pipeline else split_shares(fold),
        "incident_count": len(fold.incidents), "heartbeat_timeout": heartbeat_timeout,
        "ranks": [rank_row(r, judged, now=now) for _, r in sorted(fold.ranks.items())],
        # Each rank's stage and layers, busy and wait shares, the bubble, the memory against the plan: the one
        # stage view (coordinator.run.stages), as status, the live view and the report show it.
        "stages": judged.stages.to_json() if judged is not None else None,
    }
    if full:
        doc.update({"loss": [[s, _r(v, 5)] for s, v in fold.loss], "val_loss": [[s, _r(v, 5)] for s, v in fold.val_loss],
                    "incidents": fold.incidents, "recoveries": fold.recoveries, "checkpoints": fold.checkpoints[-20:],
                    "message": (summary.message or "") if summary is not None else ""})
    return doc


def run_row(fold: RunFold, *, summary: SummaryFile | None, meta: RunMeta | None, iters: int | None,
            now: float) -> dict[str, Any]:
    """One row of the runs page."""
    view = run_view(fold, meta=meta, summary=summary, iters=iters, now=now, full=False)
    return {k: view[k] for k in ("run_id", "active", "state", "step", "iters", "tokens_per_s",
                                 "predicted_tokens_per_s", "incident_count", "degraded", "eta_s")} | {
        "nodes": sorted({r.node for r in fold.ranks.values()}), "started_t": fold.first_t}


__all__ = ["RankLive", "RunFold", "empty_delta", "eta_s", "judge", "rank_row", "run_row", "run_view", "split_shares",
           "step_time_stats"]
