"""`coordinator status`: one row per node: reachability, OS, chip, memory and pressure, load, GPU, power, disk,
the run it takes part in (rank, step, tok/s, last heartbeat) and quarantine.

Pure core: `build_node_status` (facts + run state + quarantine -> a row), `RunEvents`/`build_run_status`
(events.jsonl lines + meta.json + summary.json -> a run); the load averages are parsed in the facts layer
(`coordinator.facts.build.node_load`: no node output is parsed here). Thin I/O shell: `RunWatcher`
(reads run dirs, incrementally), `probe_fleet` (SSH) and the click command. `coordinator monitor` reuses all of
it. An unreachable node is a row with its error, never an exception; only an invalid inventory exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console
from rich.table import Table

from coordinator.cli import run_async
from coordinator.errors import ConfigError, TransportError
from coordinator.facts.build import node_load
from coordinator.facts.macos import parse_vm_loadavg
from coordinator.facts.model import NodeFacts
from coordinator.gather import gather_facts
from coordinator.inventory import load_inventory
from coordinator.metrics import IncidentNote, NodeRun, NodeStatus, RankStatus, RunStatus
from coordinator.models import Inventory, Node
from coordinator.quarantine import Entry, QuarantineStore, inventory_key, matching_entry
from coordinator.render import dumps
from coordinator.rundir import (
    EVENTS,
    META,
    PLAYBOOK,
    SUMMARY,
    RunMeta,
    parse_incident_record,
    parse_meta,
    parse_summary,
    read_json_object,
)
from coordinator.transport import Fleet
from worker.events import ErrorEvent, EventError, FinishedEvent, StartedEvent, StepEvent, coerce_int, parse_event

DEFAULT_RUN_DIR = Path("runs")
DEFAULT_STATUS_PROBE_TIMEOUT = 60.0
RECENT_RUNS = 20  # run dirs looked at, newest first (by meta.json's mtime)
RECENT_INCIDENTS = 5
PRESSURE_NAMES = {1: "normal", 2: "warn", 4: "critical"}


# --- pure: facts -> row ----------------------------------------------------------------------------------------

def describe_os(facts: NodeFacts) -> str | None:
    os_ = facts.os
    if os_ is None:
        return None
    if os_.is_macos:
        return f"macOS {os_.version}" + (f" ({os_.build})" if os_.build else "")
    return os_.name or f"{os_.system} {os_.kernel}"


def describe_power(facts: NodeFacts) -> str | None:
    """'never sleeps', 'sleeps after 10 min', plus 'kept awake by caffeinate', 'on battery 80%', 'low power'."""
    p = facts.power
    if p is None:
        return None
    parts: list[str] = []
    if p.sleep_minutes is not None:
        parts.append("never sleeps" if p.sleep_minutes == 0 else f"sleeps after {p.sleep_minutes} min")
    if p.sleep_prevented_by:
        parts.append("kept awake by " + ", ".join(p.sleep_prevented_by))
    if p.on_battery:
        parts.append("on battery" + (f" {p.battery_percent}%" if p.battery_percent is not None else ""))
    elif p.on_battery is False:
        parts.append("on AC")
    if p.low_power:
        parts.append("low power mode")
    return ", ".join(parts) or None


def memory_used(facts: NodeFacts) -> int | None:
    """Total minus available; or, without an available figure, total x (1 - free%) from memory_pressure."""
    m = facts.memory
    if m is None or m.total_bytes is None:
        return None
    if m.available_bytes is not None:
        return max(0, m.total_bytes - m.available_bytes)
    if m.free_percent is not None:
        return int(m.total_bytes * (1 - m.free_percent / 100))
    return None


def build_node_status(node: Node, facts: NodeFacts | None, error: str | None, run: NodeRun | None,
                      quarantine: Entry | None) -> NodeStatus:
    """One status row. `facts` None -> an unreachable row carrying `error` (and still the run and quarantine,
    which come from the coordinator's own disk)."""
    quarantined, why = quarantine is not None, quarantine.reason if quarantine is not None else None
    if facts is None:
        return NodeStatus(node=node.name, host=node.host, reachable=False, error=error or "no facts", run=run,
                          quarantined=quarantined, quarantine_reason=why)
    load, load_problem = node_load(facts)
    hw, mem, disk = facts.hardware, facts.memory, facts.disk
    total = mem.total_bytes if mem is not None and mem.total_bytes is not None else (hw.memory_bytes if hw else None)
    level = mem.pressure_level if mem is not None else None
    problems = tuple(f"{e.source}: {e.message}" for e in facts.errors)
    return NodeStatus(
        node=node.name, host=node.host, reachable=True, error=None, os=describe_os(facts),
        chip=hw.chip if hw is not None else None, memory_total_bytes=total, memory_used_bytes=memory_used(facts),
        memory_pressure=PRESSURE_NAMES.get(level, f"level {level}") if level is not None else None,
        memory_pressure_level=level, load=load, cpu_count=hw.cpu_total if hw is not None else None,
        gpu_utilization_pct=facts.gpu.utilization_pct if facts.gpu is not None else None,
        power=describe_power(facts), disk_free_bytes=disk.available_bytes if disk is not None else None,
        disk_path=disk.path if disk is not None else None, run=run,
        fact_errors=problems + ((load_problem,) if load_problem else ()), quarantined=quarantined,
        quarantine_reason=why,
    )


def node_run(runs: Sequence[RunStatus], node: str) -> NodeRun | None:
    """The run to show on a node's row: its newest active run, else its newest run at all (`runs` newest first)."""
    mine = [r for r in runs if node in r.nodes]
    chosen = next((r for r in mine if r.active), mine[0] if mine else None)
    if chosen is None:
        return None
    rank = chosen.rank_of(node)
    return NodeRun(run_id=chosen.run_id, active=chosen.active, state=chosen.state,
                   rank=rank.rank if rank else None, step=rank.step if rank else None,
                   tokens_per_s=rank.tokens_per_s if rank else None,
                   last_heartbeat_age_s=rank.last_heartbeat_age_s if rank else None)


def build_rows(nodes: Sequence[Node], facts: Mapping[str, NodeFacts], errors: Mapping[str, str],
               runs: Sequence[RunStatus], quarantine: Mapping[str, Entry]) -> list[NodeStatus]:
    """Every node's row, in inventory order."""
    return [build_node_status(n, facts.get(n.name), errors.get(n.name), node_run(runs, n.name), quarantine.get(n.name))
            for n in nodes]


# --- pure: events -> run ---------------------------------------------------------------------------------------


@dataclass
class _RankSeen:
    node: str
    state: str = "pending"
    step: int = 0
    tokens_per_s: float | None = None
    loss: float | None = None
    last_t: float | None = None


@dataclass
class RunEvents:
    """A fold over a run's events.jsonl records (feed them in file order, in as many batches as you like).

    Ranks are keyed by (rank, node) as the coordinator recorded them: a relaunch that moves a rank to another
    node starts a fresh entry, and `build_run_status` keeps the ones meta.json plans."""

    ranks: dict[tuple[int, str], _RankSeen] = field(default_factory=dict)
    incident_counts: Counter[str] = field(default_factory=Counter)
    incidents: list[IncidentNote] = field(default_factory=list)
    bad_lines: int = 0

    def feed(self, record: Mapping[str, Any]) -> None:
        if record.get("event") == "incident":
            inc = parse_incident_record(record)
            name = inc.kind or "unknown"
            self.incident_counts[name] += 1
            self.incidents.append(IncidentNote(name, inc.node or "?", inc.rank, inc.step, inc.action or "",
                                               str(inc.evidence if inc.evidence is not None else "")[:200]))
            del self.incidents[:-RECENT_INCIDENTS]
            return
        # A rank's event as the coordinator copied it (its `node` added), read under worker.events' contract;
        # the coordinator's other records (supervisor, reassigned, ...) are not about a rank's progress.
        event, node = parse_event(record), record.get("node")
        if isinstance(event, EventError) or event.rank is None or not isinstance(node, str):
            return
        seen = self.ranks.setdefault((event.rank, node), _RankSeen(node))
        if event.t is not None:
            seen.last_t = event.t if seen.last_t is None else max(seen.last_t, event.t)
        if isinstance(event, StartedEvent):
            seen.state = "running"
            seen.step = event.resumed_from or 0
        elif isinstance(event, StepEvent):
            seen.state = "running"
            seen.step = max(seen.step, event.step or 0)
            seen.tokens_per_s = event.tok_s
            seen.loss = event.loss
        elif isinstance(event, FinishedEvent):
            seen.state = "finished"
            seen.step = max(seen.step, event.step or 0)
        elif isinstance(event, ErrorEvent):
            seen.state = "failed"

    def feed_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(record, dict):
                self.feed(record)
            else:
                self.bad_lines += 1


def build_run_status(run_id: str, meta: RunMeta | Mapping[str, Any], summary: Mapping[str, Any] | None,
                     events: RunEvents, now: float, *, iters: int | None = None) -> RunStatus:
    """A run from its meta.json (`RunMeta`, or its decoded JSON), summary.json (None while it runs) and folded
    events. `now` is wall-clock (events carry the worker's `t` in unix time). ConfigError for a meta.json no
    reader can use (coordinator.rundir.parse_meta)."""
    if not isinstance(meta, RunMeta):
        meta = parse_meta(meta, default_run_id=run_id)
    planned = [(r.rank, r.node) for r in meta.ranks]
    ranks = []
    for rank, node in sorted(planned):
        seen = events.ranks.get((rank, node))
        if seen is None:
            ranks.append(RankStatus(rank=rank, node=node, state="pending"))
            continue
        age = None if seen.last_t is None else max(0.0, now - seen.last_t)
        ranks.append(RankStatus(rank=rank, node=node, state=seen.state, step=seen.step,
                                tokens_per_s=seen.tokens_per_s, loss=seen.loss, last_heartbeat_age_s=age))
    nodes = meta.nodes
    done = parse_summary(summary) if summary is not None else None
    state = (done.state or "unknown") if done is not None else "running"
    return RunStatus(run_id=run_id, active=summary is None, state=state, ranks=tuple(ranks), iters=iters, nodes=nodes,
                     incident_counts=dict(events.incident_counts), incidents=tuple(events.incidents),
                     left_out=done.left_out if done is not None and done.left_out is not None
                     else tuple((x["node"], x["reason"]) for x in meta.left_out))


# The coordinator's own records (incidents, meta.json) are read under the events' one coercion rule too.
_int = coerce_int


# --- I/O: run directories --------------------------------------------------------------------------------------


def read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since byte `offset`, and the offset after the last complete line (a
    line being written is left for next time). A missing file is no lines."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return data[: end + 1].decode("utf-8", errors="replace").splitlines(), offset + end + 1


def _playbook_iters(run_dir: Path) -> int | None:
    try:
        doc = yaml.safe_load((run_dir / PLAYBOOK).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    train = doc.get("train") if isinstance(doc, dict) else None
    return _int(train.get("iters")) if isinstance(train, dict) else None


@dataclass
class _Tracked:
    events: RunEvents
    offset: int = 0
    iters: int | None = None


class RunWatcher:
    """Reads the newest run directories under `root` (those with a meta.json), following each events.jsonl
    incrementally across `scan()` calls. Unreadable files make a run `unknown`, never an exception."""

    def __init__(self, root: Path, *, limit: int = RECENT_RUNS) -> None:
        self.root = root
        self.limit = limit
        self._tracked: dict[str, _Tracked] = {}

    def _recent_dirs(self) -> list[Path]:
        found: list[tuple[float, Path]] = []
        try:
            children = list(self.root.iterdir())
        except OSError:
            return []
        for child in children:
            try:
                found.append(((child / META).stat().st_mtime, child))
            except OSError:
                continue
        return [p for _, p in sorted(found, key=lambda x: x[0], reverse=True)[: self.limit]]

    def scan(self, now: float | None = None) -> list[RunStatus]:
        """Every recent run, newest first."""
        now = time.time() if now is None else now
        runs: list[RunStatus] = []
        for run_dir in self._recent_dirs():
            try:
                doc = read_json_object(run_dir / META)
                meta = parse_meta(doc, name=str(run_dir / META), default_run_id=run_dir.name) if doc else None
                summary = read_json_object(run_dir / SUMMARY) if (run_dir / SUMMARY).exists() else None
            except ConfigError:  # a newer format, or a meta.json no reader can use: not this version's to show
                continue
            if meta is None:
                continue
            tracked = self._tracked.get(run_dir.name)
            if tracked is None:
                tracked = self._tracked[run_dir.name] = _Tracked(RunEvents(), iters=_playbook_iters(run_dir))
            lines, tracked.offset = read_new_lines(run_dir / EVENTS, tracked.offset)
            tracked.events.feed_lines(lines)
            runs.append(build_run_status(meta.run_id, meta, summary, tracked.events, now, iters=tracked.iters))
        return runs


def load_quarantine(store: QuarantineStore, inv: Inventory) -> tuple[dict[str, Entry], str | None]:
    """The active entries that leave out this inventory's nodes (by node name), and a note for the operator: ({},
    why) when the state file is unreadable or of the wrong shape (status still shows every node), or the old-format
    note."""
    try:
        state = store.read()
    except ConfigError as exc:
        return {}, exc.location_message()
    now, scope = time.time(), inventory_key(inv.path)
    found = {n.name: e for n in inv.nodes if (e := matching_entry(state.entries, scope, n, now)) is not None}
    return found, "; ".join(state.notes) or None


# --- I/O: the fleet --------------------------------------------------------------------------------------------


async def probe_fleet(fleet: Fleet, *, probe_timeout: float, reconnect: bool = False
                      ) -> tuple[dict[str, NodeFacts], dict[str, str]]:
    """Facts from every node that answers, and an error message for every other one. With `reconnect`, nodes
    whose connection failed (or broke) are dialled again first, concurrently."""
    if reconnect and fleet.failed:
        async def again(name: str) -> None:
            try:
                await fleet.reconnect(name)
            except TransportError as exc:
                fleet.failed[name] = exc

        await asyncio.gather(*(again(n) for n in list(fleet.failed)))
    gathered = await gather_facts(fleet, None, timeout=probe_timeout)
    facts: dict[str, NodeFacts] = {}
    errors: dict[str, str] = {}
    for node in fleet.nodes:
        got = gathered.get(node.name)
        if isinstance(got, NodeFacts):
            facts[node.name] = got
        elif isinstance(got, TransportError):
            errors[node.name] = str(got)
            fleet.connected.pop(node.name, None)  # dial again next time (monitor)
            fleet.failed[node.name] = got
        else:
            errors[node.name] = str(fleet.failed.get(node.name) or "not connected")
    return facts, errors


@dataclass(frozen=True)
class StatusReport:
    nodes: list[NodeStatus]
    runs: list[RunStatus]
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [n.to_json() for n in self.nodes], "runs": [r.to_json() for r in self.runs if r.active],
                "warnings": self.warnings}


def build_report(inv: Inventory, facts: Mapping[str, NodeFacts], errors: Mapping[str, str],
                 runs: Sequence[RunStatus], quarantine: Mapping[str, Entry], warnings: Sequence[str]) -> StatusReport:
    return StatusReport(build_rows(inv.nodes, facts, errors, runs, quarantine), list(runs), list(warnings))


async def collect_status(inv: Inventory, run_dir: Path, store: QuarantineStore, *, connect_timeout: float,
                         probe_timeout: float, accept_new_host_keys: bool = False) -> StatusReport:
    """One status snapshot of the fleet (over SSH) and of the runs under `run_dir` (local)."""
    async with Fleet(inv.nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        await fleet.connect_all()
        facts, errors = await probe_fleet(fleet, probe_timeout=probe_timeout)
    quarantine, problem = load_quarantine(store, inv)
    runs = RunWatcher(run_dir).scan()
    return build_report(inv, facts, errors, runs, quarantine, [problem] if problem else [])


# --- rendering -------------------------------------------------------------------------------------------------


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
    if run.tokens_per_s is not None:
        cell += f" {run.tokens_per_s:,.0f} tok/s"
    if run.active and run.last_heartbeat_age_s is not None:
        cell += f" beat {run.last_heartbeat_age_s:.0f}s ago"
    return cell


def _quarantine_cell(row: NodeStatus) -> str:
    return f"[red]yes[/red] ({row.quarantine_reason})" if row.quarantined else "no"


def render_run_table(run: RunStatus) -> Table:
    """An active run's per-rank progress and its newest incidents."""
    of = f"/{run.iters}" if run.iters else ""
    degraded = f"  [yellow]DEGRADED: {', '.join(n for n, _ in run.left_out)} left out[/yellow]" if run.left_out else ""
    table = Table(title=f"run {run.run_id} ({run.state}): step {run.step}{of}{degraded}", title_justify="left")
    for col in ("rank", "node", "state", "step", "loss", "tok/s", "heartbeat"):
        table.add_column(col)
    for r in run.ranks:
        table.add_row(str(r.rank), r.node, r.state, str(r.step), "-" if r.loss is None else f"{r.loss:.4f}",
                      "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                      "-" if r.last_heartbeat_age_s is None else f"{r.last_heartbeat_age_s:.1f}s ago")
    if run.incidents:
        table.caption = "\n".join(f"[red]{i.kind}[/red] on {i.node} rank {i.rank} step {i.step} ({i.action}): "
                                  f"{i.summary[:120]}" for i in run.incidents)
    return table


# --- the verb --------------------------------------------------------------------------------------------------


def load_status_inventory(inventory: str, limit: str | None) -> Inventory:
    inv = load_inventory(inventory)
    names = [n.strip() for n in limit.split(",") if n.strip()] if limit else None
    return inv.limit(names)


@click.option("-i", "--inventory", default="inventory/local.yaml", show_default=True, help="The fleet.")
@click.option("--limit", help="Comma-separated node names to show.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_RUN_DIR,
              show_default=True, help="Where runs/<run-id>/ are (the newest are read).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key always fails).")
@click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
@click.option("--probe-timeout", default=DEFAULT_STATUS_PROBE_TIMEOUT, show_default=True,
              type=click.FloatRange(1, 3600))
def status(inventory: str, limit: str | None, run_dir: Path, as_json: bool, accept_new_host_keys: bool,
           connect_timeout: float, probe_timeout: float) -> None:
    """Show every node: reachable, OS, chip, memory, load, GPU, power, disk, its run and quarantine.
    Unreachable nodes are rows with their error; exits 0 unless the inventory is invalid (2)."""
    inv = load_status_inventory(inventory, limit)
    report = run_async(collect_status(inv, run_dir, QuarantineStore(), connect_timeout=connect_timeout,
                                      probe_timeout=probe_timeout, accept_new_host_keys=accept_new_host_keys))
    if as_json:
        click.echo(dumps(report.to_json()))
        return
    console = Console()
    console.print(render_status_table(report.nodes))
    for run in report.runs:
        if run.active:
            console.print(render_run_table(run))
    for warning in report.warnings:
        console.print(f"[yellow]warning[/yellow]: {warning}")


def register(main: click.Group) -> None:
    """Add `coordinator status` (the CLI's error handling is imported here: cli.py imports this module)."""
    from coordinator.cli import handle_errors

    main.command("status")(handle_errors(status))


# node_load / parse_vm_loadavg live in the facts layer; named here too for callers that import them from status.
__all__ = ["RunEvents", "RunWatcher", "StatusReport", "build_node_status", "build_report", "build_rows",
           "build_run_status", "collect_status", "node_load", "node_run", "parse_vm_loadavg", "probe_fleet",
           "read_new_lines", "register", "render_run_table", "render_status_table"]
