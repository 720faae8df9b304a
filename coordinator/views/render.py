"""Human-readable views (rich) and JSON views of reports and facts. No decisions are made here."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from coordinator.facts.model import NodeFacts
from coordinator.models import STATUS_SEVERITY, PreflightReport, Status
from coordinator.planning.strategy import StrategyChoice
from coordinator.preflight.checks import sort_for_display

# rich is imported by the text renderers only: `--json` output (and its callers' start-up) does without it.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

STYLE = {
    Status.FAIL: "bold red",
    Status.ERROR: "bold magenta",
    Status.WARN: "yellow",
    Status.PASS: "green",
    Status.SKIP: "dim",
}


def status_text(status: Status) -> Text:
    from rich.text import Text

    return Text(str(status).upper(), style=STYLE[status])


def render_preflight(report: PreflightReport, console: Console, *, strict: bool = False) -> None:
    from rich.table import Table

    # Nodes with failures first, so the thing to fix is at the top.
    ordered = sorted(report.nodes, key=lambda item: -max(STATUS_SEVERITY[c.status] for c in item[1]))
    for name, checks in ordered:
        table = Table(title=f"[bold]{name}[/bold]", title_justify="left", show_lines=False, expand=False)
        table.add_column("check", style="bold")
        table.add_column("status")
        table.add_column("summary", overflow="fold")
        table.add_column("remedy", overflow="fold", style="cyan")
        for c in sort_for_display(checks):
            table.add_row(c.id, status_text(c.status), c.summary,
                          c.remedy if c.status in (Status.FAIL, Status.ERROR, Status.WARN) else "")
        console.print(table)
    if report.lint:
        table = Table(title="[bold]playbook lint[/bold]", title_justify="left")
        table.add_column("lint", style="bold")
        table.add_column("status")
        table.add_column("summary", overflow="fold")
        table.add_column("remedy", overflow="fold", style="cyan")
        for lint in sorted(report.lint, key=lambda r: -STATUS_SEVERITY[r.status]):
            table.add_row(lint.id, status_text(lint.status), lint.summary, lint.remedy)
        console.print(table)
    counts = report.counts()
    verdict = "[bold green]READY[/bold green]" if report.ok(strict=strict) else "[bold red]NOT READY[/bold red]"
    console.print(f"{verdict}  " + "  ".join(f"{k}: {v}" for k, v in counts.items()))


def render_strategy(choice: StrategyChoice, console: Console) -> None:
    """The chosen plan as a table (node, layers, memory need / budget, predicted stage time, bubble, predicted
    tokens/s), then one line per plan weighed: why it won, fits or does not."""
    from rich.table import Table

    header, *rows = choice.table()
    table = Table(title=f"strategy {choice.requested}: {choice.chosen.label}", title_justify="left")
    for col in header:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in choice.reasons():
        console.print(line, markup=False, highlight=False)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def facts_to_json(facts: NodeFacts, *, raw: bool = False) -> dict[str, Any]:
    data = _jsonable(facts)
    data["errors"] = [e.to_json() for e in facts.errors]
    if not raw:
        data.pop("raw", None)
        data.pop("raw_rc", None)
    return data  # type: ignore[no-any-return]


def render_facts(facts: NodeFacts, console: Console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"[bold]{facts.node}[/bold]", title_justify="left", show_header=False)
    table.add_column("fact", style="bold")
    table.add_column("value", overflow="fold")
    if facts.os:
        build = f" ({facts.os.build})" if facts.os.build else ""
        table.add_row("os", f"{facts.os.name} {facts.os.version}{build}, {facts.os.arch}, kernel {facts.os.kernel}")
    if facts.hardware:
        h = facts.hardware
        mem = f"{h.memory_bytes / 1024**3:.0f} GiB" if h.memory_bytes else "?"
        levels = " + ".join(f"{lvl.cores} {lvl.name}" for lvl in h.cpu_levels)
        table.add_row("hardware", f"{h.chip or '?'} {h.model_id or ''} {h.model_name or ''}; {mem}; "
                      f"{h.cpu_total or '?'} CPU{f' ({levels})' if levels else ''}; GPU cores {h.gpu_cores or '?'}")
    if facts.thunderbolt is not None:
        links = [f"rcpt {p.receptacle}: {p.speed_gbps:g} Gb/s -> {p.peer_name} {p.peer_model or ''}".strip()
                 for p in facts.thunderbolt if p.connected and p.speed_gbps]
        table.add_row("thunderbolt", "; ".join(links) or f"{len(facts.thunderbolt)} port(s), none linked to a Mac")
    if facts.rdma is not None:
        devs = ", ".join(f"{d.name}={d.port_state or '?'}" for d in facts.rdma.devices) or "no devices"
        table.add_row("rdma", f"{facts.rdma.ctl_status or 'n/a'}; {devs}")
    if facts.memory:
        m = facts.memory
        table.add_row("memory", f"total {(m.total_bytes or 0) / 1024**3:.1f} GiB, free {m.free_percent or '?'}%, "
                      f"pressure {m.pressure_level or '?'}")
    if facts.power:
        p = facts.power
        table.add_row("power", f"sleep {p.sleep_minutes} min, battery {p.on_battery} {p.battery_percent or ''}")
    if facts.disk:
        table.add_row("disk", f"{facts.disk.available_bytes / 1024**3:.1f} GiB free on {facts.disk.mount}")
    if facts.software:
        s = facts.software
        table.add_row("software", f"{s.python}: python {s.python_version}, mlx {s.mlx_version}, mlx-lm {s.mlx_lm_version}")
    for dh in facts.hashes or ():
        state = f"{len(dh.files)} files" if dh.exists else "missing"
        table.add_row("files", f"{dh.path}: {state} ({dh.cached_files} from cache)")
    for r in facts.reach or ():
        table.add_row("reach", f"{r.peer} {r.ip}: {'ok' if r.ok else r.error} "
                      f"{'' if r.rtt_ms is None else f'{r.rtt_ms:.2f} ms'}")
    for e in facts.errors:
        table.add_row(Text("error", style="bold red"), f"{e.source}: {e.message}")
    console.print(table)


def dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False, default=str)
