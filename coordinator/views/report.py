"""`coordinator report`: a run directory turned into one self-contained HTML page with PNG plots.

    read_run_files(run_dir)   the only file I/O: summary.json, plan.json, events.jsonl as parsed JSON values
    build_report(files)       pure: the JSON values -> a typed `Report` (series, tables, problems)
    render_plots(report)      pure: PNG bytes per plot (matplotlib's Agg canvas, no pyplot global state)
    render_html(report, pngs) pure: the page, plots embedded as base64 data URIs (readable without a server)

Everything in a run directory may be missing or partial (a coordinator killed mid-run writes no summary, a run
that failed before its first step has no step events, a relaunch appends a second attempt to events.jsonl):
each gap becomes a line of text in the report (`Report.problems` or a "nothing recorded" note), never an
exception. Only a RUN_ID that names no run directory at all is an error (`ReportError`, exit 2).

Attempts: events.jsonl is appended to by every attempt of a run. Incidents carry their attempt; other events
do not, so an attempt is taken to begin at a `started` event that follows any later-stage event (step, eval,
checkpoint, finished, error, incident) of the attempt before it. Incident `t` is the coordinator's monotonic
clock, so incidents are placed on the timeline by their attempt and step, at the wall time of that step.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError
from coordinator.run.rundir import (
    EVENTS,
    PLAN,
    SUMMARY,
    EventLine,
    RecoveryRecord,
    decode_event_lines,
    parse_event_line,
    parse_plan,
    parse_summary,
    read_json_object_or_problem,
)
from worker.events import (
    CheckpointEvent,
    ErrorEvent,
    EvalEvent,
    StartedEvent,
    StepEvent,
)

# Events after which a `started` event means a new attempt (heartbeats precede `started` during model load).
_LATE_EVENTS = frozenset({"step", "eval", "checkpoint", "finished", "error", "incident", "digest"})
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")


class ReportError(ConfigError):
    """RUN_ID names no run directory (or one with none of summary.json, plan.json, events.jsonl)."""


# --- reading ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFiles:
    """What a run directory holds, parsed but not interpreted. `None` = the file is missing or unreadable."""

    run_id: str
    summary: dict[str, Any] | None
    plan: dict[str, Any] | None
    events: tuple[dict[str, Any], ...]
    problems: tuple[str, ...] = ()  # files or lines that could not be read, for the report to show


def _read_json_object(path: Path, problems: list[str]) -> dict[str, Any] | None:
    doc = read_json_object_or_problem(path)  # a newer format: an error naming both versions
    if isinstance(doc, str):
        problems.append(f"{path.name} {doc}")
        return None
    return doc


def parse_events(text: str) -> tuple[list[dict[str, Any]], int]:
    """events.jsonl -> (the JSON objects, number of lines that were not JSON objects): `rundir.decode_event_lines`."""
    return decode_event_lines(text.splitlines())


def read_run_files(run_root: Path, run_id: str) -> RunFiles:
    """Read `run_root/run_id/`. Raises `ReportError` when that is not a run directory; anything less (a missing
    or corrupt file, torn lines) is recorded in `RunFiles.problems`."""
    if not run_id or run_id in (".", "..") or "/" in run_id:
        raise ReportError(f"{run_id!r} is not a run id (a directory name under {run_root}/)")
    run_dir = run_root / run_id
    if not run_dir.is_dir():
        known = sorted(p.name for p in run_root.iterdir() if (p / EVENTS).exists() or
                       (p / SUMMARY).exists()) if run_root.is_dir() else []
        hint = f"; runs there: {', '.join(known[-5:])}" if known else ""
        raise ReportError(f"no run {run_id!r}: {run_dir} is not a directory{hint}")
    names = (SUMMARY, PLAN, EVENTS)
    if not any((run_dir / n).is_file() for n in names):
        raise ReportError(f"{run_dir} is not a run directory: it has none of {', '.join(names)}")
    problems: list[str] = []
    summary = _read_json_object(run_dir / SUMMARY, problems)
    plan = _read_json_object(run_dir / PLAN, problems)
    events: list[dict[str, Any]] = []
    events_path = run_dir / EVENTS
    if events_path.is_file():
        try:
            events, bad = parse_events(events_path.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            problems.append(f"events.jsonl is unreadable: {exc}")
            bad = 0
        if bad:
            problems.append(f"events.jsonl: {bad} line(s) are not JSON objects and were skipped")
    else:
        problems.append("events.jsonl is missing")
    return RunFiles(run_id, summary, plan, tuple(events), tuple(problems))


# --- the report model ------------------------------------------------------------------------------------------


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
    tokens_per_s: float | None
    mean_tokens_per_s: float | None  # over every step this node reported (all attempts)
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
    tokens_per_s: float | None
    predicted_tokens_per_s: float | None
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

    @property
    def has_steps(self) -> bool:
        return any(s.points for s in self.series)


def assign_attempts(lines: Sequence[EventLine]) -> list[int]:
    """The attempt (0-based) each line belongs to; see the module docstring for the rule."""
    out: list[int] = []
    attempt = 0
    late = False
    for line in lines:
        kind, explicit = line.kind, line.attempt
        if kind == "incident" and explicit is not None:
            attempt = max(attempt, explicit)
        elif kind == "started" and late:
            attempt += 1
            late = False
        if kind in _LATE_EVENTS:
            late = True
        out.append(explicit if kind == "incident" and explicit is not None else attempt)
    return out


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


def build_report(files: RunFiles) -> Report:
    """Interpret a run directory's files. Pure; never raises on odd content (it becomes `problems`)."""
    summary = parse_summary(files.summary or {})
    plan = parse_plan(files.plan or {})
    problems = list(files.problems)
    # Each line read under the run directory's contract: the coordinator's keys, the rank's event, an incident.
    events = [parse_event_line(doc) for doc in files.events]
    attempts_of = assign_attempts(events)

    # steps, evals, checkpoints, attempts --------------------------------------------------------------------
    points: dict[tuple[int, str], list[Point]] = {}
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
            points.setdefault(key, []).append(Point(event.step, t, event.loss, event.tok_s, event.compute_tok_s))
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
    series = [Series(node, ranks.get((a, node)), a, tuple(sorted(pts, key=lambda p: p.step)))
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

    n_attempts = max([*attempts_of, 0]) + 1 if events else (summary.attempts or 1)
    attempts = []
    for a in range(n_attempts):
        steps_a = [p.step for s in series if s.attempt == a for p in s.points]
        attempts.append(AttemptRow(a, tuple(attempt_nodes.get(a, {})), attempt_start.get(a), resumed.get(a),
                                   min(steps_a) if steps_a else None, max(steps_a) if steps_a else None))

    # nodes: summary.json's rows (final attempt), else the last attempt's nodes from the events ------------------
    split = dict(summary.split if summary.split is not None else plan.split or {})
    plan_rates = plan.node_tokens_per_s

    def mean_tok(node: str) -> float | None:
        vals = [p.tok_s for s in series if s.node == node for p in s.points if p.tok_s is not None]
        return sum(vals) / len(vals) if vals else None

    nodes: list[NodeRow] = []
    if summary.nodes:
        for n in summary.nodes:
            name = n.name or "?"
            nodes.append(NodeRow(name, n.rank, n.batch_size, n.state or "?", n.step, n.loss, n.tokens_per_s,
                                 mean_tok(name), n.calibrated_tokens_per_s or plan_rates.get(name), split.get(name),
                                 n.peak_memory, n.checkpoint))
    else:
        last = n_attempts - 1
        for s in sorted((s for s in series if s.attempt == last), key=lambda s: (s.rank is None, s.rank or 0)):
            final = s.points[-1]
            batch = plan.batch.get(s.node)
            nodes.append(NodeRow(s.node, s.rank, batch, "unknown", final.step, final.loss, final.tok_s, mean_tok(s.node),
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
                                 final.tok_s, mean_tok(s.node), plan_rates.get(s.node), None, None, None))

    state = summary.state or ("unknown: no summary.json (the coordinator did not finish, or it is still "
                                       "running)" if files.summary is None else "unknown")
    steps = summary.steps
    if steps is None and series:
        steps = max(p.step for s in series for p in s.points)
    recoveries = list(summary.recoveries)
    return Report(
        run_id=summary.run_id or files.run_id, state=state, steps=steps, iters=iters,
        message=summary.message or "", tokens_per_s=summary.tokens_per_s,
        predicted_tokens_per_s=plan.predicted_tokens_per_s, checkpoint=summary.checkpoint,
        mode=plan.mode, backend=plan.backend, global_batch=plan.global_batch,
        quarantined=quarantined, recoveries=recoveries, nodes=nodes, split=split, series=series,
        evals=sorted(evals.values(), key=lambda e: (e.attempt, e.step)), incidents=incidents,
        checkpoints=sorted(ckpts.values(), key=lambda c: (c.attempt, c.step)), attempts=attempts, errors=errors,
        start_t=min(times) if times else None, end_t=max(times) if times else None, problems=problems)


# --- plots -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plot:
    """One PNG and what it shows (the alt text and caption on the page)."""

    key: str
    title: str
    caption: str
    png: bytes


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _xy(points: Sequence[Point], attr: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the points where `attr` was reported."""
    pairs = [(float(p.step), v) for p in points if isinstance(v := getattr(p, attr), float)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _incident_labels(incidents: Sequence[IncidentRow]) -> list[tuple[int, str]]:
    """One label per step ("straggler (a, b); crash (c)"): incidents at the same step must not overprint."""
    by_step: dict[int, dict[str, list[str]]] = {}
    for inc in incidents:
        if inc.step is not None:
            nodes = by_step.setdefault(inc.step, {}).setdefault(inc.kind, [])
            if inc.node not in nodes:
                nodes.append(inc.node)
    return [(step, "; ".join(f"{kind} ({', '.join(nodes)})" for kind, nodes in kinds.items()))
            for step, kinds in sorted(by_step.items())]


def render_plots(report: Report, *, dpi: int = 100) -> list[Plot]:
    """PNG plots for the report; none when there is nothing to plot (the page says so instead).

    matplotlib is imported here, not at module import: only `coordinator report` pays for it. `Figure` with its
    default Agg canvas keeps no global pyplot state and needs no display."""
    from matplotlib.figure import Figure

    plots: list[Plot] = []
    nodes = sorted({s.node for s in report.series})
    node_color = {n: _color(i) for i, n in enumerate(nodes)}
    multi = len(report.attempts) > 1
    styles = ("-", "--", ":", "-.")

    def png(fig: Figure) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
        return buf.getvalue()

    def style_axes(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
        ax.set_title(title, fontsize=12, loc="left")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, color="#dddddd", linewidth=0.8)
        ax.spines[["top", "right"]].set_visible(False)

    if report.has_steps:
        # Loss and eval loss by step; incidents as red vertical lines at their step.
        fig = Figure(figsize=(10, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for s in report.series:
            xs, ys = _xy(s.points, "loss")
            if xs:
                ax.plot(xs, ys, styles[s.attempt % len(styles)],
                        color=node_color[s.node], linewidth=1.6, alpha=0.85, label=f"train loss, {s.label(len(report.attempts))}")
        if report.evals:
            for a in sorted({e.attempt for e in report.evals}):
                ev = [e for e in report.evals if e.attempt == a]
                ax.plot([e.step for e in ev], [e.val_loss for e in ev], "o-", color="black", linewidth=1.4,
                        markersize=6, label="eval loss" + (f" (attempt {a + 1})" if multi else ""))
        for step, label in _incident_labels(report.incidents):
            ax.axvline(step, color="#d62728", linestyle="--", linewidth=1.2, alpha=0.8)
            ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                        fontsize=8, color="#d62728")
        style_axes(ax, "Loss", "step", "loss")
        ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
        plots.append(Plot("loss", "Loss and eval loss by step",
                          "Training loss per node (ranks all-reduce, so their lines overlap) and eval loss (black); "
                          "red dashed lines are incidents at the step they happened.", png(fig)))

        # Throughput per node against the calibrated rate.
        fig = Figure(figsize=(10, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for s in report.series:
            xs, ys = _xy(s.points, "tok_s")
            if xs:
                ax.plot(xs, ys, styles[s.attempt % len(styles)],
                        color=node_color[s.node], linewidth=1.5, label=f"tok/s, {s.label(len(report.attempts))}")
            xs, ys = _xy(s.points, "compute_tok_s")
            if xs:
                ax.plot(xs, ys, ":", color=node_color[s.node],
                        linewidth=1.2, label=f"compute tok/s, {s.label(len(report.attempts))}")
        for row in report.nodes:
            if row.calibrated_tokens_per_s is not None and row.name in node_color:
                ax.axhline(row.calibrated_tokens_per_s, color=node_color[row.name], linestyle=(0, (6, 3)),
                           linewidth=1.0, alpha=0.6)
                ax.annotate(f"calibrated {row.name}: {row.calibrated_tokens_per_s:,.0f}",
                            (1.0, row.calibrated_tokens_per_s), xycoords=("axes fraction", "data"), ha="right",
                            va="bottom", fontsize=8, color=node_color[row.name])
        ax.set_ylim(bottom=0)
        style_axes(ax, "Throughput", "step", "tokens / s")
        ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
        plots.append(Plot("throughput", "Tokens per second per node against its calibrated rate",
                          "Measured tokens/s per step (solid; compute-only dotted when reported) and the rate "
                          "calibration measured for that node (thin dashed line).", png(fig)))

        # Timeline: steps over wall time, attempts shaded, checkpoints ticked, incidents marked.
        t0 = report.start_t or 0.0
        fig = Figure(figsize=(10, 3.8), layout="constrained")
        ax = fig.add_subplot()
        for attempt in report.attempts:
            if multi and attempt.start_t is not None:
                ax.axvline(attempt.start_t - t0, color="#555555", linewidth=1.0)
                ax.annotate(f" attempt {attempt.number + 1}", (attempt.start_t - t0, 0.02),
                            xycoords=("data", "axes fraction"), fontsize=8, color="#555555")
        for s in report.series:
            pts = [p for p in s.points if p.t is not None]
            if pts:
                ax.plot([p.t - t0 for p in pts if p.t is not None], [p.step for p in pts],
                        styles[s.attempt % len(styles)], color=node_color[s.node], linewidth=1.5,
                        label=s.label(len(report.attempts)))
        ck = [c for c in report.checkpoints if c.t is not None]
        if ck:
            ax.plot([c.t - t0 for c in ck if c.t is not None], [c.step for c in ck], "|", color="#444444",
                    markersize=9, label="checkpoint")
        placed: dict[tuple[float, int], list[IncidentRow]] = {}
        for inc in report.incidents:
            if inc.t_wall is not None:
                placed.setdefault((round(inc.t_wall - t0, 1), inc.step or 0), []).append(inc)
        for (x, y), group in placed.items():
            ax.plot([x], [y], "X", color="#d62728", markersize=11)
            ax.annotate("  " + _incident_labels(group)[0][1], (x, y), fontsize=8, color="#d62728", va="top")
        style_axes(ax, "Timeline", "seconds since the first event", "step")
        ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
        plots.append(Plot("timeline", "Progress timeline with checkpoints and incidents",
                          "Each node's step over wall time; ticks are checkpoints, red crosses incidents (placed "
                          "at the step they carry)" + ("; vertical lines start each attempt." if multi else "."),
                          png(fig)))

    rated = [r for r in report.nodes if r.calibrated_tokens_per_s is not None or r.mean_tokens_per_s is not None]
    if rated:
        fig = Figure(figsize=(10, 0.8 + 0.7 * len(rated)), layout="constrained")
        ax = fig.add_subplot()
        ys = list(range(len(rated)))
        h = 0.38
        ax.barh([y - h / 2 for y in ys], [r.calibrated_tokens_per_s or 0 for r in rated], height=h,
                color="#bbbbbb", label="calibrated")
        ax.barh([y + h / 2 for y in ys], [r.mean_tokens_per_s or 0 for r in rated], height=h,
                color=[node_color.get(r.name, _color(i)) for i, r in enumerate(rated)], label="measured (mean)")
        ax.set_yticks(ys, [f"{r.name} (rank {r.rank})" if r.rank is not None else r.name for r in rated])
        ax.invert_yaxis()
        style_axes(ax, "Calibrated vs measured tok/s", "tokens / s", "")
        ax.legend(fontsize=8, loc="lower right")
        plots.append(Plot("rates", "Calibrated against measured throughput per node",
                          "Grey: the rate calibration predicted for the node's batch; colour: the mean tokens/s it "
                          "reported over the run.", png(fig)))
    return plots


# --- HTML ------------------------------------------------------------------------------------------------------

_CSS = """
body { font: 15px/1.45 -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; color: #1d1d1f;
       background: #f5f5f7; margin: 0; }
main { max-width: 1060px; margin: 0 auto; padding: 24px 28px 48px; background: #fff; }
h1 { font-size: 26px; margin: 0 0 4px; } h2 { font-size: 19px; margin: 30px 0 8px; border-bottom: 1px solid #e5e5e5;
     padding-bottom: 4px; }
.sub { color: #6e6e73; margin: 0 0 16px; }
.state { display: inline-block; padding: 2px 10px; border-radius: 12px; font-weight: 600; color: #fff; }
.state.succeeded { background: #248a3d; } .state.failed { background: #d70015; } .state.stopped { background: #b25000; }
.state.other { background: #6e6e73; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0; }
.card { border: 1px solid #e5e5e5; border-radius: 8px; padding: 8px 14px; min-width: 120px; }
.card b { display: block; font-size: 19px; } .card span { color: #6e6e73; font-size: 12px; }
table { border-collapse: collapse; width: 100%; margin: 8px 0; font-size: 13.5px; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid #eee; vertical-align: top; }
th { background: #fafafa; font-weight: 600; } td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { background: #e8eef8; border-radius: 3px; height: 12px; min-width: 120px; }
.bar > div { background: #1f77b4; height: 12px; border-radius: 3px; }
figure { margin: 14px 0; } figure img { width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #6e6e73; font-size: 13px; }
.note { background: #fff8e1; border-left: 4px solid #f5b400; padding: 8px 12px; margin: 10px 0; }
.bad { color: #d70015; font-weight: 600; } .nw { white-space: nowrap; } .ok { color: #248a3d; }
code, .mono { font-family: ui-monospace, Menlo, "DejaVu Sans Mono", monospace; font-size: 12.5px; word-break: break-all; }
details summary { cursor: pointer; color: #0066cc; margin: 6px 0; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | int | None, spec: str = ",.0f", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _mem(value: int | None) -> str:
    if value is None:
        return "–"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _when(t: float | None) -> str:
    return "–" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _footer(generated_at: float | None, sources: str) -> str:
    """The page's last line (closes the document): when it was generated and from which run files."""
    stamp = _when(generated_at if generated_at is not None else time.time())
    return (f'<p class="sub" style="margin-top:32px">Generated by <code>coordinator report</code> on {_e(stamp)} '
            f"from {sources}.</p></main></body></html>")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """Cells are HTML already (escape before)."""
    th = "".join(f'<th class="num">{h}</th>' if i in numeric else f"<th>{h}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: Report, plots: Sequence[Plot], *, generated_at: float | None = None) -> str:
    """The whole page. Every value from the run directory is HTML-escaped; plots are inline data URIs."""
    r = report
    state_class = r.state if r.state in ("succeeded", "failed", "stopped") else "other"
    duration = (r.end_t - r.start_t) if r.start_t is not None and r.end_t is not None else None
    out: list[str] = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Run report: {_e(r.run_id)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>Run {_e(r.run_id)}</h1>",
        f'<p class="sub"><span class="state {state_class}">{_e(r.state)}</span> &nbsp; started {_e(_when(r.start_t))}'
        + (f", last event {_e(_when(r.end_t))}" if r.end_t is not None else "") + "</p>",
    ]
    if r.message:
        out.append(f'<p class="note">{_e(r.message)}</p>')
    steps = "–" if r.steps is None else (f"{r.steps}" + (f" / {r.iters}" if r.iters else ""))
    cards = [("steps", steps), ("attempts", str(len(r.attempts))), ("incidents", str(len(r.incidents))),
             ("tok/s (final)", _fmt(r.tokens_per_s)), ("tok/s predicted", _fmt(r.predicted_tokens_per_s)),
             ("wall time", "–" if duration is None else f"{duration:,.1f} s"),
             ("nodes", str(len(r.nodes))), ("global batch", _fmt(r.global_batch, "d"))]
    out.append('<div class="cards">' + "".join(f"<div class=\"card\"><b>{_e(v)}</b><span>{_e(k)}</span></div>"
                                               for k, v in cards) + "</div>")
    if r.quarantined:
        out.append(f'<p class="note">Quarantined after this run: <b>{_e(", ".join(r.quarantined))}</b> '
                   "(<code>coordinator quarantine list</code>).</p>")
    for problem in r.problems:
        out.append(f'<p class="note">{_e(problem)}</p>')

    # plots
    out.append("<h2>Curves</h2>")
    if not r.has_steps:
        out.append('<p class="note">No step was recorded in events.jsonl: there are no loss or throughput curves '
                   "for this run" + (" (it failed before its first step)." if r.state == "failed" else ".") + "</p>")
    for p in plots:
        data = base64.b64encode(p.png).decode("ascii")
        out.append(f'<figure id="plot-{_e(p.key)}"><img alt="{_e(p.title)}" src="data:image/png;base64,{data}">'
                   f"<figcaption>{_e(p.caption)}</figcaption></figure>")

    # nodes and split
    out.append("<h2>Nodes and split</h2>")
    if r.nodes:
        rows = []
        for n in r.nodes:
            ratio = (n.mean_tokens_per_s / n.calibrated_tokens_per_s
                     if n.mean_tokens_per_s and n.calibrated_tokens_per_s else None)
            share = ("–" if n.share is None else
                     f'<div class="bar"><div style="width:{max(0.0, min(1.0, n.share)) * 100:.1f}%"></div></div>'
                     f"{n.share * 100:.1f}%")
            state = f'<span class="{"bad" if n.state == "failed" else ""}">{_e(n.state)}</span>'
            rows.append([f'<span class="nw">{_e(n.name)}</span>',
                         _fmt(n.rank, "d"), _fmt(n.batch_size, "d"), share, state, _fmt(n.step, "d"),
                         _fmt(n.loss, ".4f"), _fmt(n.tokens_per_s), _fmt(n.mean_tokens_per_s),
                         _fmt(n.calibrated_tokens_per_s), "–" if ratio is None else f"{ratio * 100:.0f}%",
                         _e(_mem(n.peak_memory))])
        out.append(_table(["node", "rank", "batch", "share of global batch", "state", "step", "loss",
                           "tok/s (last)", "tok/s (mean)", "calibrated tok/s", "measured / calibrated",
                           "peak memory"], rows, numeric=(1, 2, 5, 6, 7, 8, 9, 10, 11)))
    else:
        out.append("<p>No node reported anything (no summary.json rows and no step events).</p>")
    extra = [f"split mode <b>{_e(r.mode)}</b>" if r.mode else "", f"backend <b>{_e(r.backend)}</b>" if r.backend else ""]
    if any(extra):
        out.append("<p>" + ", ".join(x for x in extra if x) + ".</p>")
    split_only = [k for k in r.split if k not in {n.name for n in r.nodes}]
    if split_only:
        out.append("<p>Planned share of nodes not in the final attempt: "
                   + ", ".join(f"{_e(k)} {r.split[k] * 100:.1f}%" for k in split_only) + "</p>")

    # attempts and incidents
    out.append("<h2>Incidents</h2>")
    if r.incidents:
        rows = [[str(i.attempt + 1), f'<span class="bad">{_e(i.kind)}</span>',
                 f'<span class="nw">{_e(i.node)}</span>', _fmt(i.rank, "d"),
                 _fmt(i.step, "d"), _e(i.action), _fmt(i.detected_after_s, ".1f") + ("" if i.detected_after_s is None
                                                                                     else " s"),
                 f'<span class="mono">{_e(i.evidence)}</span>'] for i in r.incidents]
        out.append(_table(["attempt", "kind", "node", "rank", "step", "action", "detected after", "evidence"], rows,
                          numeric=(0, 3, 4, 6)))
    else:
        out.append('<p class="ok">No incident.</p>')
    if r.errors:
        out.append("<h3>Errors reported by ranks</h3>")
        out.append(_table(["attempt", "node", "rank", "message"],
                          [[str(e["attempt"] + 1), _e(e["node"]), _fmt(e["rank"], "d"),
                            f'<span class="mono">{_e(e["message"])}</span>'] for e in r.errors], numeric=(0, 2)))
    if len(r.attempts) > 1 or r.recoveries:
        out.append("<h2>Attempts</h2>")
        rows = [[str(a.number + 1), _e(", ".join(a.nodes) or "–"), _e(_when(a.start_t)),
                 _e(a.resumed_from or "–"), _fmt(a.first_step, "d"), _fmt(a.last_step, "d")] for a in r.attempts]
        out.append(_table(["attempt", "nodes", "started", "resumed from", "first step", "last step"], rows,
                          numeric=(0, 4, 5)))
        for rec in r.recoveries:
            out.append(f"<p>Relaunch {_e(rec.attempt)}: without {_e(', '.join(rec.culprits) or 'nobody')}"
                       f" on {_e(', '.join(rec.nodes))}, after step {_e(rec.failed_step)};"
                       f" first step {_e(rec.first_step_after_s)} s after detection.</p>")

    # checkpoints
    out.append("<h2>Checkpoints</h2>")
    if r.checkpoint:
        out.append(f"<p>Final checkpoint: <code>{_e(r.checkpoint)}</code></p>")
    if r.checkpoints:
        bad = [c for c in r.checkpoints if not c.consistent]
        out.append(f"<p>{len(r.checkpoints)} checkpoint(s) written" +
                   (f', <span class="bad">{len(bad)} with differing manifests across nodes</span>' if bad
                    else ', <span class="ok">every manifest identical across nodes</span>') + ".</p>")

        def ck_row(c: CheckpointRow) -> list[str]:
            shas = sorted(set(c.sha256.values()))
            agree = ('<span class="ok">identical</span>' if c.consistent else '<span class="bad">differ</span>')
            return [str(c.attempt + 1), str(c.step), _e(_when(c.t)), _e(", ".join(sorted(c.paths or c.sha256))),
                    agree, f'<span class="mono">{_e(", ".join(s[:12] for s in shas))}</span>']

        head = ["attempt", "step", "written", "nodes", "manifests", "sha256"]
        recent = r.checkpoints[-8:]
        out.append(_table(head, [ck_row(c) for c in recent], numeric=(0, 1)))
        if len(r.checkpoints) > len(recent):
            out.append(f"<details><summary>all {len(r.checkpoints)} checkpoints</summary>"
                       + _table(head, [ck_row(c) for c in r.checkpoints], numeric=(0, 1)) + "</details>")
    else:
        out.append("<p>No checkpoint was written.</p>")

    out.append(_footer(generated_at, "summary.json, plan.json and events.jsonl"))
    return "\n".join(out) + "\n"


def build_page(files: RunFiles, *, generated_at: float | None = None) -> str:
    """RunFiles -> the HTML page (model, plots, markup)."""
    report = build_report(files)
    return render_html(report, render_plots(report), generated_at=generated_at)


__all__ = ["Report", "ReportError", "RunFiles", "build_page", "build_report", "parse_events", "read_run_files",
           "render_html", "render_plots"]
