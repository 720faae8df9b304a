"""`coordinator report`, the model: a run directory's files -> a typed `Report` (series, tables, problems). Pure;
never raises on odd content (it becomes `Report.problems`). Every value is read through the run directory's
contract: `rundir.parse_summary`, `parse_plan`, and `parse_event_line` for each line of events.jsonl.

Attempts: events.jsonl is appended to by every attempt of a run. Each line's attempt is the coordinator's own
record (`rundir.assign_attempts`: the `attempt` it writes on every line, summary.json's count of attempts), never
a guess from the order of the nodes' interleaved lines. Incident `t` is the coordinator's monotonic clock, so
incidents are placed on the timeline by their attempt and step, at the wall time of that step.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import ConfigError
from coordinator.run.monitor import RATE_STEPS
from coordinator.run.replay import RunJudgement, RunReplay, prediction_of
from coordinator.run.rundir import (
    AttemptCounter,
    EventLine,
    MetaRank,
    PlanFile,
    RecoveryRecord,
    RunMeta,
    SummaryFile,
    assign_attempts,
    parse_event_line,
    parse_meta,
    parse_plan,
    parse_summary,
)
from coordinator.run.stages import StageView
from coordinator.views.report.files import RunFiles
from worker.events import CheckpointEvent, ErrorEvent, EvalEvent, StartedEvent, StepEvent


@dataclass(frozen=True)
class Point:
    """One step of one rank: x = step, the values it reported, and its wall time."""

    step: int
    t: float | None
    loss: float | None = None
    tok_s: float | None = None
    compute_tok_s: float | None = None


@dataclass(frozen=True)
class Series:
    """The steps one node reported in one attempt (loss, tok/s, wall time)."""

    node: str
    rank: int | None
    attempt: int
    points: tuple[Point, ...]

    def label(self, attempts: int) -> str:
        return self.node if attempts <= 1 else f"{self.node} (attempt {self.attempt + 1})"


@dataclass(frozen=True)
class EvalPoint:
    attempt: int
    step: int
    val_loss: float
    t: float | None


@dataclass(frozen=True)
class NodeRow:
    """One rank of the final attempt (summary.json's `nodes`, or derived from events without a summary)."""

    name: str
    rank: int | None
    batch_size: int | None
    state: str
    step: int | None
    loss: float | None
    tokens_per_s: float | None  # its rate, real tokens/s: the run's one judgement (coordinator.run.replay)
    verdict: str | None  # coordinator.run.monitor.Verdict, the same word as every view's
    calibrated_tokens_per_s: float | None
    share: float | None
    peak_memory: int | None
    checkpoint: str | None


@dataclass(frozen=True)
class IncidentRow:
    attempt: int
    kind: str
    node: str
    rank: int | None
    step: int | None
    action: str
    detected_after_s: float | None
    evidence: str
    t_wall: float | None  # wall time placed by (attempt, step): the `t` in the event is a monotonic clock


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint step of one attempt: which nodes wrote it and whether their manifest hashes agree."""

    attempt: int
    step: int
    t: float | None
    sha256: dict[str, str]  # node -> manifest sha256
    paths: dict[str, str]

    @property
    def consistent(self) -> bool:
        return len(set(self.sha256.values())) <= 1


@dataclass(frozen=True)
class AttemptRow:
    number: int  # 0-based
    nodes: tuple[str, ...]
    start_t: float | None
    resumed_from: str | None
    first_step: int | None
    last_step: int | None


@dataclass
class Report:
    """Everything the page shows, already interpreted. Built by `build_report`, rendered by `render_*`."""

    run_id: str
    state: str
    steps: int | None
    iters: int | None
    message: str
    tokens_per_s: float | None  # the run's rate, real tokens/s (Monitor.run_tokens_per_s)
    predicted_tokens_per_s: float | None  # calibration's, real tokens/s
    checkpoint: str | None
    mode: str | None
    backend: str | None
    global_batch: int | None
    quarantined: list[str]
    recoveries: list[RecoveryRecord]
    nodes: list[NodeRow]
    split: dict[str, float]
    series: list[Series]
    evals: list[EvalPoint]
    incidents: list[IncidentRow]
    checkpoints: list[CheckpointRow]
    attempts: list[AttemptRow]
    errors: list[dict[str, Any]]  # `error` events: node, rank, message
    start_t: float | None
    end_t: float | None
    problems: list[str] = field(default_factory=list)
    # The final attempt's stages and memory against the plan (coordinator.run.stages), as every view shows them
    stages: StageView = field(default_factory=StageView)

    @property
    def has_steps(self) -> bool:
        return any(s.points for s in self.series)


def _evidence_text(value: Any, limit: int = 400) -> str:
    if isinstance(value, Mapping):
        parts = [f"{k}: {v}" for k, v in value.items() if k != "log_tail"]
        text = "; ".join(parts) or json.dumps(value)
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _wall_time_of(step: int | None, attempt: int, series: Sequence[Series], node: str,
                  fallback: float | None) -> float | None:
    """Wall time of `step` in `attempt`: that node's step event, else any node's, else the attempt's start."""
    candidates = [s for s in series if s.attempt == attempt]
    candidates.sort(key=lambda s: s.node != node)
    if step is not None:
        for s in candidates:
            best = [p.t for p in s.points if p.step <= step and p.t is not None]
            if best:
                return max(best)
    return fallback


def _series_rate(s: Series) -> float | None:
    """A rank's rate by the one rule (`monitor.rank_rate`: the median of its last RATE_STEPS steps' tok_s), for
    a rank no replay covers (an earlier attempt's)."""
    rates = [p.tok_s for p in s.points if p.tok_s is not None and p.tok_s > 0][-RATE_STEPS:]
    return statistics.median(rates) if rates else None


def _judge(files: RunFiles, summary: SummaryFile, plan: PlanFile, series: Sequence[Series], last: int,
           lines: Sequence[EventLine]) -> RunJudgement:
    """The final attempt replayed (coordinator.run.replay) as the run ended (no silence counts after it). Without
    meta.json (a run dir copied without it), its ranks come from summary.json's rows, else from the last
    attempt's series."""
    try:
        meta = parse_meta(files.meta, default_run_id=files.run_id) if files.meta is not None else None
    except ConfigError:
        meta = None
    if meta is None:
        if summary.nodes:
            ranks = tuple(MetaRank(n.rank, n.name, n.batch_size, n.calibrated_tokens_per_s)
                          for n in summary.nodes if n.rank is not None and n.name is not None)
        else:
            ranks = tuple(MetaRank(s.rank, s.node, plan.batch.get(s.node)) for s in series
                          if s.attempt == last and s.rank is not None)
        sessions = AttemptCounter(None if summary.resumed else summary.attempts)
        for line in lines:
            sessions.attempt_of(line)
        meta = RunMeta(run_id=files.run_id, attempt=last - sessions.base, ranks=ranks)  # meta.json's: the session's
    replay = RunReplay(meta, predicted=prediction_of(summary.predicted_tokens_per_s, plan.predicted_tokens_per_s))
    replay.counter = AttemptCounter(None if summary.resumed else summary.attempts)
    for doc, line in zip(files.events, lines, strict=True):
        replay.feed_line(doc, line)
    return replay.judge(None)


def build_report(files: RunFiles) -> Report:
    """Interpret a run directory's files. Pure; never raises on odd content (it becomes `problems`)."""
    summary = parse_summary(files.summary or {})
    plan = parse_plan(files.plan or {})
    problems = list(files.problems)
    # Each line read under the run directory's contract: the coordinator's keys, the rank's event, an incident.
    events = [parse_event_line(doc) for doc in files.events]
    # summary.json counts the attempts of its own session: of the whole file only when the run was not resumed.
    cap = None if summary.resumed else summary.attempts
    attempts_of = assign_attempts(events, cap)

    # steps, evals, checkpoints, attempts --------------------------------------------------------------------
    points: dict[tuple[int, str], dict[int, Point]] = {}
    ranks: dict[tuple[int, str], int | None] = {}
    evals: dict[tuple[int, int], EvalPoint] = {}
    ckpts: dict[tuple[int, int], CheckpointRow] = {}
    attempt_nodes: dict[int, dict[str, None]] = {}
    attempt_start: dict[int, float] = {}
    resumed: dict[int, str] = {}
    errors: list[dict[str, Any]] = []
    iters: int | None = None
    times: list[float] = []
    for line, attempt in zip(events, attempts_of, strict=True):
        node = line.node or "?"
        t = line.t
        if t is not None and line.kind != "incident":
            times.append(t)
            attempt_start[attempt] = min(attempt_start.get(attempt, t), t)
        # A rank's event, as the coordinator copied it (with its `node`), under worker.events' contract; the
        # coordinator's own records (incident, supervisor, ...) are EventErrors here and read below.
        event = line.event
        if isinstance(event, StartedEvent):
            attempt_nodes.setdefault(attempt, {})[node] = None
            iters = event.iters or iters
            # Shown as the rank wrote it (an older worker named the checkpoint rather than its step).
            resumed_from = event.resumed_from if event.resumed_from is not None else event.invalid.get("resumed_from")
            if resumed_from is not None:
                resumed[attempt] = str(resumed_from)
        elif isinstance(event, StepEvent) and event.step is not None:
            key = (attempt, node)
            attempt_nodes.setdefault(attempt, {})[node] = None
            ranks[key] = event.rank
            # Keyed by step: `coordinator attach` copies the ranks' lines again from their start.
            points.setdefault(key, {})[event.step] = Point(event.step, t, event.loss, event.tok_s, event.compute_tok_s)
        elif isinstance(event, EvalEvent) and event.step is not None:
            if event.val_loss is not None:
                evals.setdefault((attempt, event.step), EvalPoint(attempt, event.step, event.val_loss, t))
        elif isinstance(event, CheckpointEvent) and event.step is not None:
            row = ckpts.setdefault((attempt, event.step), CheckpointRow(attempt, event.step, t, {}, {}))
            if event.sha256:
                row.sha256[node] = event.sha256
            if event.path:
                row.paths[node] = event.path
        elif isinstance(event, ErrorEvent):
            errors.append({"node": node, "rank": event.rank, "attempt": attempt,
                           "message": _evidence_text(event.extra.get("error") or event.message or event.traceback
                                                     or line.payload)})
    series = [Series(node, ranks.get((a, node)), a, tuple(sorted(pts.values(), key=lambda p: p.step)))
              for (a, node), pts in sorted(points.items())]

    # incidents: summary.json has them all (every attempt) without the attempt; events.jsonl has the attempt.
    records = [(line.incident, a) for line, a in zip(events, attempts_of, strict=True) if line.incident is not None]
    if not records and summary.incidents is not None:
        records = [(i, 0) for i in summary.incidents]
    incidents = []
    for inc, attempt in records:
        inc_node = inc.node or "?"
        incidents.append(IncidentRow(
            attempt=attempt, kind=inc.kind or "?", node=inc_node, rank=inc.rank, step=inc.step,
            action=inc.action or "?", detected_after_s=inc.detected_after_s, evidence=_evidence_text(inc.evidence),
            t_wall=_wall_time_of(inc.step, attempt, series, inc_node, attempt_start.get(attempt))))

    n_attempts = max(attempts_of) + 1 if attempts_of else (summary.attempts or 1)
    attempts = []
    for a in range(n_attempts):
        steps_a = [p.step for s in series if s.attempt == a for p in s.points]
        attempts.append(AttemptRow(a, tuple(attempt_nodes.get(a, {})), attempt_start.get(a), resumed.get(a),
                                   min(steps_a) if steps_a else None, max(steps_a) if steps_a else None))

    # nodes: summary.json's rows (final attempt), else the last attempt's nodes from the events ------------------
    split = dict(summary.split if summary.split is not None else plan.split or {})
    plan_rates = plan.node_tokens_per_s
    last = n_attempts - 1
    # Each rank's rate and verdict: the final attempt replayed through the monitor's rules (coordinator.run.replay),
    # as status, the dashboard and summary.json give them.
    judged = _judge(files, summary, plan, series, last, events)

    def rate(name: str, rank: int | None, written: float | None) -> float | None:
        mine = judged.of(rank, name) if rank is not None else None
        return mine.tokens_per_s if mine is not None and mine.tokens_per_s is not None else written

    def verdict(name: str, rank: int | None, written: str | None) -> str | None:
        mine = judged.of(rank, name) if rank is not None else None
        return written or (str(mine.verdict) if mine is not None else None)

    nodes: list[NodeRow] = []
    if summary.nodes:
        for n in summary.nodes:
            name = n.name or "?"
            nodes.append(NodeRow(name, n.rank, n.batch_size, n.state or "?", n.step, n.loss,
                                 rate(name, n.rank, n.tokens_per_s), verdict(name, n.rank, n.verdict),
                                 n.calibrated_tokens_per_s or plan_rates.get(name), split.get(name),
                                 n.peak_memory, n.checkpoint))
    else:
        for s in sorted((s for s in series if s.attempt == last), key=lambda s: (s.rank is None, s.rank or 0)):
            final = s.points[-1]
            batch = plan.batch.get(s.node)
            nodes.append(NodeRow(s.node, s.rank, batch, "unknown", final.step, final.loss,
                                 rate(s.node, s.rank, _series_rate(s)), verdict(s.node, s.rank, None),
                                 plan_rates.get(s.node), split.get(s.node), None, None))

    # Nodes that took part only in earlier attempts (a culprit left out of the relaunch) keep a row.
    quarantined = list(summary.quarantined)
    final_names = {n.name for n in nodes}
    for s in reversed(series):
        if s.node not in final_names:
            final_names.add(s.node)
            final = s.points[-1]
            why = "quarantined" if s.node in quarantined else "left out"
            nodes.append(NodeRow(s.node, s.rank, None, f"{why} after attempt {s.attempt + 1}", final.step, final.loss,
                                 _series_rate(s), None, plan_rates.get(s.node), None, None, None))

    state = summary.state or ("unknown: no summary.json (the coordinator did not finish, or it is still "
                                       "running)" if files.summary is None else "unknown")
    steps = summary.steps
    if steps is None and series:
        steps = max(p.step for s in series for p in s.points)
    recoveries = list(summary.recoveries)
    return Report(
        run_id=summary.run_id or files.run_id, state=state, steps=steps, iters=iters,
        message=summary.message or "",
        tokens_per_s=summary.tokens_per_s if summary.tokens_per_s is not None else judged.tokens_per_s,
        predicted_tokens_per_s=judged.predicted_tokens_per_s, checkpoint=summary.checkpoint,
        mode=plan.mode, backend=plan.backend, global_batch=plan.global_batch,
        quarantined=quarantined, recoveries=recoveries, nodes=nodes, split=split, series=series,
        evals=sorted(evals.values(), key=lambda e: (e.attempt, e.step)), incidents=incidents,
        checkpoints=sorted(ckpts.values(), key=lambda c: (c.attempt, c.step)), attempts=attempts, errors=errors,
        stages=judged.stages,
        start_t=min(times) if times else None, end_t=max(times) if times else None, problems=problems)
