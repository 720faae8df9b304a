"""`coordinator report RUN_ID` for a map run (`kind: map`): the shards, each node's rows and rate against its
calibration, progress over time, the finish-time spread, incidents and re-assignments, the output's manifest.

Pure but for reading the run dir and rendering the PNG: `build_map_report(run_dir, files)` -> `MapReport`,
`render_map_page(report)` -> HTML, with the training report's markup helpers (coordinator/views/report/page.py).
`write_report` writes either kind's page.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.run.rundir import (
    MANIFEST,
    MAP_PLAN,
    IncidentRecord,
    MapManifest,
    MapPlanFile,
    ReassignmentRecord,
    parse_event_line,
    parse_map_plan,
    parse_summary,
    read_json_object,
    read_manifest,
)
from coordinator.units import format_share
from coordinator.views.report.files import RunFiles, read_run_files
from coordinator.views.report.page import CSS, build_page, esc, fmt, footer, table, when
from coordinator.views.report.plots import palette_color
from worker.events import MapFinishedEvent, MapProgressEvent, MapStartedEvent


@dataclass(frozen=True)
class MapNodeRow:
    name: str
    state: str
    rows: int
    rows_done: int
    ranges: list[list[int]]
    calibrated: float | None
    measured: float | None
    finished_after_s: float | None


@dataclass
class MapReport:
    run_id: str
    state: str
    rows: int
    rows_done: int
    task: str | None
    nodes: list[MapNodeRow]
    split: dict[str, float]
    finish_spread: float | None
    incidents: list[IncidentRecord]
    reassignments: list[ReassignmentRecord]
    manifest: MapManifest | None
    progress: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # node -> (t, rows done)
    start_t: float | None = None
    end_t: float | None = None
    problems: list[str] = field(default_factory=list)


def build_map_report(files: RunFiles, run_dir: Path) -> MapReport:
    s = parse_summary(files.summary or {})
    problems = [p for p in files.problems if not p.startswith("plan.json")]  # map runs write map.json instead
    plan = MapPlanFile()
    doc = read_json_object(run_dir / MAP_PLAN)  # format-checked: a newer one is an error naming both versions
    if doc is None:
        problems.append("map.json is missing or unreadable")
    else:
        plan = parse_map_plan(doc, name=str(run_dir / MAP_PLAN))
    manifest = read_manifest(run_dir)  # format-checked like map.json
    if manifest is None and (run_dir / MANIFEST).is_file():
        problems.append("manifest.json is unreadable")
    nodes = [MapNodeRow(str(n.name), str(n.state), n.rows or 0, n.rows_done or 0, [list(r) for r in n.ranges],
                        n.examples_per_s_calibrated, n.rows_per_s, n.finished_after_s) for n in s.nodes]
    progress: dict[str, list[tuple[float, int]]] = {}
    offset: dict[str, int] = {}
    times = []
    for line in (parse_event_line(doc, map_run=True) for doc in files.events):
        t, node = line.t, line.node
        if t is not None:
            times.append(t)
        if t is None or node is None:
            continue
        # A map worker's event as the coordinator copied it (with its `node`), under worker.events' contract (the
        # coordinator's own records, incident and reassigned, are EventErrors here).
        event = line.event
        # A node's worker counts from 0 for each work item (its shard, then any rows re-assigned to it): the
        # curve adds the earlier items' rows.
        pts = progress.setdefault(node, [])
        if isinstance(event, MapStartedEvent):
            offset[node] = pts[-1][1] if pts else 0
            pts.append((t, offset[node]))
        elif isinstance(event, MapProgressEvent | MapFinishedEvent) and event.done is not None:
            pts.append((t, offset.get(node, 0) + event.done))
    return MapReport(
        run_id=files.run_id, state=s.state or "unknown", rows=s.rows or plan.rows or 0,
        rows_done=s.rows_done or 0, task=plan.task, nodes=nodes,
        split=dict(s.split or plan.split or {}), finish_spread=s.finish_spread,
        incidents=list(s.incidents or ()), reassignments=list(s.reassignments), manifest=manifest,
        progress=progress, start_t=min(times) if times else None, end_t=max(times) if times else None,
        problems=problems)


def _progress_png(report: MapReport, dpi: int = 100) -> bytes | None:
    if not any(report.progress.values()):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    t0 = min(t for pts in report.progress.values() for t, _ in pts)
    for i, (node, pts) in enumerate(sorted(report.progress.items())):
        pts.sort()
        ax.plot([t - t0 for t, _ in pts], [d for _, d in pts], color=palette_color(i), label=node, linewidth=1.8)
        assigned = next((n.rows for n in report.nodes if n.name == node), None)
        if assigned:
            ax.axhline(assigned, color=palette_color(i), linestyle=":", linewidth=1)
    ax.set_title("rows done per node (dotted: its share)")
    ax.set_xlabel("seconds since the first shard started")
    ax.set_ylabel("rows")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def render_map_page(report: MapReport, *, generated_at: float | None = None) -> str:
    r = report
    state_class = r.state if r.state in ("succeeded", "failed", "stopped") else "other"
    finished = [n.finished_after_s for n in r.nodes if n.finished_after_s is not None]
    cards = [("rows", f"{r.rows_done} / {r.rows}"), ("task", r.task or "–"), ("nodes", str(len(r.nodes))),
             ("incidents", str(len(r.incidents))),
             ("finish spread", "–" if r.finish_spread is None else format_share(r.finish_spread)),
             ("makespan", f"{max(finished):,.1f} s" if finished else "–")]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>Map run report: {esc(r.run_id)}</title><style>{CSS}</style></head><body><main>",
           f"<h1>Map run {esc(r.run_id)}</h1>",
           f'<p class="sub"><span class="state {state_class}">{esc(r.state)}</span> &nbsp; started {esc(when(r.start_t))}'
           + (f", last event {esc(when(r.end_t))}" if r.end_t is not None else "") + "</p>",
           '<div class="cards">' + "".join(f'<div class="card"><b>{esc(v)}</b><span>{esc(k)}</span></div>'
                                           for k, v in cards) + "</div>"]
    for problem in r.problems:
        out.append(f'<p class="note">{esc(problem)}</p>')
    out.append("<h2>Progress</h2>")
    png = _progress_png(r)
    if png is None:
        out.append('<p class="note">No progress was recorded in events.jsonl.</p>')
    else:
        out.append(f'<figure><img alt="rows done per node over time" src="data:image/png;base64,'
                   f'{base64.b64encode(png).decode()}"></figure>')
    out.append("<h2>Nodes and shards</h2>")
    rows = [[esc(n.name), esc(n.state), f"{n.rows_done} / {n.rows}",
             esc(", ".join(f"[{a}, {b})" for a, b in n.ranges) or "–"), format_share(r.split.get(n.name, 0.0)),
             fmt(n.calibrated, ",.1f"), fmt(n.measured, ",.1f"), fmt(n.finished_after_s, ",.1f")] for n in r.nodes]
    out.append(table(["node", "state", "rows", "ranges", "share", "calibrated ex/s", "measured rows/s", "finished (s)"],
                      rows, numeric=(4, 5, 6, 7)))
    out.append("<h2>Incidents</h2>")
    if r.incidents:
        out.append(table(["kind", "node", "action", "detected after (s)", "evidence"],
                          [[esc(i.kind), esc(i.node), esc(i.action), fmt(i.detected_after_s, ",.2f"),
                            esc(str(i.evidence)[:300])] for i in r.incidents], numeric=(3,)))
    else:
        out.append('<p class="ok">No incident.</p>')
    if r.reassignments:
        out.append("<h3>Re-assigned rows</h3>")
        out.append(table(["from", "rows", "to"],
                          [[esc(x.source), esc(x.rows), esc(json.dumps({n: [list(p) for p in rs] for n, rs in x.to.items()}))]
                           for x in r.reassignments], numeric=(1,)))
    out.append("<h2>Output</h2>")
    if r.manifest:
        m = r.manifest
        out.append(table(["output", "rows", "sha256", "rows by node"],
                          [[esc(m.output), esc(m.rows), f"<code>{esc(m.sha256)}</code>",
                            esc(json.dumps(dict(m.rows_by_node)))]], numeric=(1,)))
    else:
        out.append("<p>No output was gathered (the run did not finish every row).</p>")
    out.append(footer(generated_at, "summary.json, map.json, manifest.json and events.jsonl"))
    return "\n".join(out) + "\n"


def write_report(run_root: Path, run_id: str, output: Path | None = None) -> Path:
    """Build the report of `run_root/run_id` (a training run, or a map run: `coordinator.views.report_map`) and write it
    to `output` (default `runs/<id>/report/index.html`).
    Raises `ReportError` (exit 2) when RUN_ID is not a run directory."""
    files = read_run_files(run_root, run_id)
    if parse_summary(files.summary or {}).kind == "map" or (run_root / run_id / MAP_PLAN).is_file():
        page = render_map_page(build_map_report(files, run_root / run_id))
    else:
        page = build_page(files)
    path = output if output is not None else run_root / run_id / "report" / "index.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
