"""The terminal views of `coordinator status` and `monitor`: the fleet table, a run's ranks and incidents, and
monitor's whole frame (rich renderables; no I/O)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from coordinator.run.metrics import NodeRun, NodeStatus, RunStatus
from coordinator.views.stagetable import stage_cell, stage_columns, stage_row_cells, stage_summary
from coordinator.views.status import StatusReport


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.1f}G"


def render_status_table(rows: Sequence[NodeStatus], title: str = "fleet") -> Table:
    """The fleet, one row per node; cells are combined so the table fits a normal terminal."""
    table = Table(title=title, title_justify="left")
    table.add_column("node", no_wrap=True)
    for col in ("os", "chip", "memory", "load", "gpu", "power", "disk free", "run", "quarantine"):
        table.add_column(col)
    for r in rows:
        run = _run_cell(r.run)
        if not r.reachable:
            table.add_row(f"[red]{r.node}[/red]", f"[red]unreachable: {r.error}[/red]", "", "", "", "", "", "", run,
                          _quarantine_cell(r))
            continue
        mem = "-" if r.memory_total_bytes is None else f"{_gib(r.memory_used_bytes)}/{_gib(r.memory_total_bytes)}"
        if r.memory_pressure:
            mem += f" {r.memory_pressure}" if r.memory_pressure == "normal" else f" [red]{r.memory_pressure}[/red]"
        load = "-" if r.load is None else f"{r.load[0]:.2f}" + (f"/{r.cpu_count}" if r.cpu_count else "")
        gpu = "-" if r.gpu_utilization_pct is None else f"{r.gpu_utilization_pct:.0f}%"
        table.add_row(f"[green]{r.node}[/green]", r.os or "-", r.chip or "-", mem, load, gpu, r.power or "-",
                      _gib(r.disk_free_bytes), run, _quarantine_cell(r))
    return table


def _run_cell(run: NodeRun | None) -> str:
    if run is None:
        return "-"
    cell = run.run_id + ("" if run.active else f" ({run.state})")
    if run.rank is not None:
        cell += f" rank {run.rank} step {run.step}"
    if run.stage is not None and run.stage.stage is not None:
        cell += f" stage {stage_cell(run.stage)}"
    if run.tokens_per_s is not None:
        cell += f" {run.tokens_per_s:,.0f} real tok/s"
    if run.verdict is not None and run.rank is not None:
        cell += f" {run.verdict}"
    if run.active and run.last_heartbeat_age_s is not None:
        cell += f" beat {run.last_heartbeat_age_s:.0f}s ago"
    return cell


def _quarantine_cell(row: NodeStatus) -> str:
    return f"[red]yes[/red] ({row.quarantine_reason})" if row.quarantined else "no"


def render_run_table(run: RunStatus) -> Table:
    """An active run's per-rank progress and its newest incidents."""
    of = f"/{run.iters}" if run.iters else ""
    degraded = f"  [yellow]DEGRADED: {', '.join(n for n, _ in run.left_out)} left out[/yellow]" if run.left_out else ""
    rate = "" if run.tokens_per_s is None else f", {run.tokens_per_s:,.0f} real tok/s" + (
        f" (predicted {run.predicted_tokens_per_s:,.0f})" if run.predicted_tokens_per_s else "")
    stages = run.stages
    summary = stage_summary(stages)
    table = Table(title=f"run {run.run_id} ({run.state}): step {run.step}{of}{rate}{degraded}"
                  + (f"\n{summary}" if summary else ""), title_justify="left")
    for col in ("rank", "node", "state", "verdict", "step", "loss", "real tok/s", "heartbeat", *stage_columns(stages)):
        table.add_column(col)
    for r in run.ranks:
        table.add_row(str(r.rank), r.node, r.state, r.verdict if r.verdict in ("ok", "pending") else f"[red]{r.verdict}[/red]",
                      str(r.step), "-" if r.loss is None else f"{r.loss:.4f}",
                      "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                      "-" if r.last_heartbeat_age_s is None else f"{r.last_heartbeat_age_s:.1f}s ago",
                      *stage_row_cells(stages, r.rank))
    if run.incidents:
        table.caption = "\n".join(f"[red]{i.kind}[/red] on {i.node} rank {i.rank} step {i.step} ({i.action}): "
                                  f"{i.summary[:120]}" for i in run.incidents)
    return table

def render_frame(report: StatusReport, *, metrics_url: str | None = None, probed_at: float | None = None,
                 now: float | None = None) -> RenderableType:
    """One screen: the fleet table, each active run's ranks and incidents, warnings, where metrics are."""
    age = "" if probed_at is None or now is None else f" (facts {max(0.0, now - probed_at):.0f}s old)"
    parts: list[RenderableType] = [render_status_table(report.nodes, title=f"fleet {time.strftime('%H:%M:%S')}{age}")]
    parts += [render_run_table(run) for run in report.runs if run.active]
    if not any(run.active for run in report.runs):
        parts.append(Text("no active run"))
    parts += [Text(f"warning: {w}", style="yellow") for w in report.warnings]
    if metrics_url:
        parts.append(Text(f"metrics: {metrics_url}", style="dim"))
    return Group(*parts)
