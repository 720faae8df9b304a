"""`coordinator status`: one row per node: reachability, OS, chip, memory and pressure, load, GPU, power, disk,
the run it takes part in (rank, step, tok/s, last heartbeat) and quarantine.

The pure core of `coordinator status` and `monitor`: `build_node_status` (facts + run state + quarantine -> a
row), `RunEvents`/`build_run_status` (events.jsonl lines + meta.json + summary.json -> a run); the load averages
are parsed in the facts layer (`coordinator.facts.build.node_load`: no node output is parsed here). The I/O is in
coordinator/views/statuswatch.py (`RunWatcher`, `probe_fleet`, `collect_status`, monitor's `watch`), the tables in
coordinator/views/statusview.py. An unreachable node is a row with its error, never an exception; only an invalid
inventory exits non-zero."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator import models
from coordinator.facts.build import node_load
from coordinator.facts.model import NodeFacts
from coordinator.models import Inventory, Node
from coordinator.run.metrics import IncidentNote, NodeRun, NodeStatus, RankStatus, RunStatus
from coordinator.run.monitor import FaultPolicy
from coordinator.run.quarantine import Entry
from coordinator.run.replay import RunReplay, prediction_of
from coordinator.run.rundir import (
    EventLine,
    RunMeta,
    decode_event_lines,
    parse_event_line,
    parse_meta,
    parse_summary,
)
from worker.events import ErrorEvent, EventError, FinishedEvent, StartedEvent, StepEvent, coerce_int

DEFAULT_RUN_DIR = Path(models.DEFAULT_RUN_DIR)
DEFAULT_STATUS_PROBE_TIMEOUT = models.DEFAULT_STATUS_PROBE_TIMEOUT


RECENT_RUNS = 20  # run dirs looked at, newest first (by meta.json's mtime)


RECENT_INCIDENTS = 5


PRESSURE_NAMES = {1: "normal", 2: "warn", 4: "critical"}


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
                   last_heartbeat_age_s=rank.last_heartbeat_age_s if rank else None,
                   verdict=rank.verdict if rank else None, predicted_tokens_per_s=chosen.predicted_tokens_per_s,
                   stage=chosen.stages.of(rank.rank) if rank else None)


def build_rows(nodes: Sequence[Node], facts: Mapping[str, NodeFacts], errors: Mapping[str, str],
               runs: Sequence[RunStatus], quarantine: Mapping[str, Entry]) -> list[NodeStatus]:
    """Every node's row, in inventory order."""
    return [build_node_status(n, facts.get(n.name), errors.get(n.name), node_run(runs, n.name), quarantine.get(n.name))
            for n in nodes]


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
    # The run replayed through the monitor's rules for meta.json's attempt (coordinator.run.replay): every rank's
    # rate and verdict. Given meta.json up front (`for_meta`), the replay is fed as lines come; otherwise the lines
    # are kept until `replay(meta)` makes it.
    meta: RunMeta | None = None
    lines: list[tuple[Mapping[str, Any], EventLine]] = field(default_factory=list)
    _replay: RunReplay | None = None

    @classmethod
    def for_meta(cls, meta: RunMeta, *, fallback: FaultPolicy | None = None) -> RunEvents:
        """`fallback`: an older run's thresholds, from its playbook (`rundir.policy_from_playbook`)."""
        return cls(meta=meta, _replay=RunReplay(meta, fallback=fallback))

    def replay(self, meta: RunMeta) -> RunReplay:
        """The replay for `meta` (made from the kept lines when none was made yet). A reader whose meta.json names
        another attempt or other ranks (a relaunch) reads the run again into a fresh `RunEvents`."""
        if self._replay is None:
            self._replay = RunReplay(meta)
            for record, line in self.lines:
                self._replay.feed_line(record, line)
            self.lines.clear()
        return self._replay

    def judges(self, meta: RunMeta) -> bool:
        """Whether this fold's replay is of `meta`'s attempt, ranks and thresholds."""
        done = self._replay
        return done is None or (done.meta.attempt, done.meta.ranks, done.meta.faults) == (
            meta.attempt, meta.ranks, meta.faults)

    def feed(self, record: Mapping[str, Any]) -> None:
        """One decoded events.jsonl line, read under the run directory's contract (`rundir.parse_event_line`)."""
        line = parse_event_line(record)
        if self._replay is not None:
            self._replay.feed_line(record, line)
        else:
            self.lines.append((record, line))
        if line.incident is not None:
            inc = line.incident
            name = inc.kind or "unknown"
            self.incident_counts[name] += 1
            self.incidents.append(IncidentNote(name, inc.node or "?", inc.rank, inc.step, inc.action or "",
                                               str(inc.evidence if inc.evidence is not None else "")[:200]))
            del self.incidents[:-RECENT_INCIDENTS]
            return
        # A rank's event as the coordinator copied it (its `node` added), under worker.events' contract; the
        # coordinator's other records (supervisor, reassigned, ...) are not about a rank's progress.
        event, node = line.event, line.node
        if isinstance(event, EventError) or event.rank is None or node is None:
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
        records, bad = decode_event_lines(lines)
        self.bad_lines += bad
        for record in records:
            self.feed(record)


def build_run_status(run_id: str, meta: RunMeta | Mapping[str, Any], summary: Mapping[str, Any] | None,
                     events: RunEvents, now: float, *, iters: int | None = None) -> RunStatus:
    """A run from its meta.json (`RunMeta`, or its decoded JSON), summary.json (None while it runs) and folded
    events. `now` is wall-clock (events carry the worker's `t` in unix time). ConfigError for a meta.json no
    reader can use (coordinator.run.rundir.parse_meta)."""
    if not isinstance(meta, RunMeta):
        meta = parse_meta(meta, default_run_id=run_id)
    done = parse_summary(summary) if summary is not None else None
    # Rates and verdicts: the monitor's rules on the run's own thresholds (the same in every view).
    judged = events.replay(meta).judge(now if done is None else None)
    planned = [(r.rank, r.node) for r in meta.ranks]
    ranks = []
    for rank, node in sorted(planned):
        seen = events.ranks.get((rank, node))
        mine = judged.of(rank, node)
        if seen is None:
            ranks.append(RankStatus(rank=rank, node=node, state="pending",
                                    verdict=str(mine.verdict) if mine else "pending"))
            continue
        age = None if seen.last_t is None else max(0.0, now - seen.last_t)
        ranks.append(RankStatus(rank=rank, node=node, state=seen.state, step=seen.step,
                                tokens_per_s=mine.tokens_per_s if mine else None, loss=seen.loss,
                                last_heartbeat_age_s=age, verdict=str(mine.verdict) if mine else "pending"))
    nodes = meta.nodes
    state = (done.state or "unknown") if done is not None else "running"
    return RunStatus(run_id=run_id, active=summary is None, state=state, ranks=tuple(ranks), iters=iters, nodes=nodes,
                     incident_counts=dict(events.incident_counts), incidents=tuple(events.incidents),
                     left_out=done.left_out if done is not None and done.left_out is not None
                     else tuple((x["node"], x["reason"]) for x in meta.left_out),
                     tokens_per_s=judged.tokens_per_s,
                     predicted_tokens_per_s=prediction_of(meta.predicted_tokens_per_s,
                                                          done.predicted_tokens_per_s if done is not None else None),
                     recorded_steps=done.steps if done is not None else None, stages=judged.stages)


# The coordinator's own records (incidents, meta.json) are read under the events' one coercion rule too.
_int = coerce_int


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
