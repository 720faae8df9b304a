"""Separate-batches jobs (`kind: map`): what `coordinator launch` runs for a map playbook.

    connect -> provision -> probe + preflight -> count the input's rows -> calibrate examples/s per node (cached)
    -> contiguous shards proportional to the rates (coordinator.planning.shards) -> one `worker.mapper` per node over its
    own SSH channel -> results written here as they arrive -> on a failed node: incident, quarantine, its
    unreceived rows re-split among the others -> gather in input order -> output.jsonl + manifest.json

No mlx.launch and no collectives: every node works at its own pace. A node's results travel on its own channel
and are appended to `runs/<id>/parts/` the moment they arrive, so a node that dies loses nothing it reported, and
a rerun with `--resume RUN_ID` only runs the rows no part holds yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from coordinator.config.playbook import Playbook
from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, Transport, python_argv
from coordinator.models import Inventory, Node
from coordinator.planning.shards import (
    MapRow,
    Range,
    Spread,
    compute_shards,
    largest_remainder,
    missing_ranges,
    split_ranges,
    subtract,
)
from coordinator.run.calibrate import fingerprint_from_facts
from coordinator.run.job import (
    JobOptions,
    JobUI,
    QuietUI,
    facts_for_calibration,
    model_digest,
    quarantine_node,
    ready_fleet,
    requested_source,
    run_context,
    usable_inventory,
)
from coordinator.run.monitor import CULPRIT_KINDS, Action, Incident, IncidentKind
from coordinator.run.quarantine import LeftOut, QuarantineStore, inventory_key
from coordinator.run.rundir import (
    EVENTS,
    FORMAT,
    MANIFEST,
    MAP_PLAN,
    PLAYBOOK,
    SUMMARY,
    MapManifest,
    SummaryBase,
    parse_output_row,
)
from coordinator.units import format_share
from worker.events import MapErrorEvent, MapFinishedEvent, MapProgressEvent, parse_map_event

MAP_CACHE_SCHEMA = 1
TICK_S = 0.5
VIEW_EVERY_S = 0.5

_COUNT_ROWS = (
    "import os, sys\n"
    "n = 0\n"
    "with open(os.path.expanduser(sys.argv[1]), encoding='utf-8') as fh:\n"
    "    for line in fh:\n"
    "        n += bool(line.strip())\n"
    "print(n)\n"
)


class MapError(CoordinatorError):
    """A map job that cannot run or finish."""


# --- pure helpers ----------------------------------------------------------------------------------------------


def input_path(pb: Playbook) -> str:
    """The input JSONL as the nodes see it (inside the data dir)."""
    assert pb.map is not None and pb.data is not None
    return f"{pb.data.rstrip('/')}/{pb.map.input}"


def build_mapper_config(pb: Playbook, ranges: Sequence[Range], *, workdir: str, bench: float | None = None,
                        debug: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON `worker.mapper` reads on stdin."""
    m = pb.map
    assert m is not None
    return {
        "model": pb.model, "input": input_path(pb), "task": m.task, "field": m.field, "prompt_field": m.prompt_field,
        "batch_size": m.batch_size, "max_seq_length": m.max_seq_length, "generate": m.generate.model_dump(),
        "command": m.command.model_dump() if m.command else None, "ranges": [list(r) for r in ranges],
        "bench": bench, "heartbeat_s": 1.0, "workdir": workdir, "debug": dict(debug or {}),
    }


def map_cache_key(node: str, facts: NodeFacts, pb: Playbook, digest: str) -> str | None:
    """What makes a node's examples/s valid: its hardware and software, the model, and the task's settings."""
    fp = fingerprint_from_facts(facts)
    if not fp.known or pb.map is None:
        return None
    task = pb.map.model_dump(exclude={"output", "input"})
    inputs = {"schema": MAP_CACHE_SCHEMA, "node": node, "fingerprint": asdict(fp), "model": digest, "task": task}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def fixed_rates(names: Sequence[str], split: str | Mapping[str, float]) -> dict[str, float]:
    """Rates for a fixed split: equal shares, or the playbook's fractions (must name exactly the nodes)."""
    if split == "equal":
        return {n: 1.0 for n in names}
    assert isinstance(split, Mapping)
    if set(split) != set(names):
        raise ConfigError(f"split names {sorted(split)} but the nodes are {sorted(names)}")
    return {n: float(split[n]) for n in names}


def gather_output(parts: Sequence[Path], total: int) -> tuple[list[str], dict[int, str]]:
    """(output lines in input order, index -> the part it came from) from the part files; raises MapError when a
    row is missing. A truncated last line (a coordinator killed mid-write) is ignored; duplicates keep the first."""
    rows: dict[int, str] = {}
    origin: dict[int, str] = {}
    for part in parts:
        for line in part.read_text(encoding="utf-8").splitlines():
            row = parse_output_row(line)
            if row is not None and 0 <= row.index < total and row.index not in rows:
                rows[row.index] = row.canonical
                origin[row.index] = part.name
    missing = missing_ranges(total, rows)
    if missing:
        raise MapError(f"rows missing from the gathered output: {missing[:5]}")
    return [rows[i] for i in range(total)], {i: origin[i] for i in range(total)}


def received_indices(parts: Sequence[Path]) -> set[int]:
    done: set[int] = set()
    for part in parts:
        for line in part.read_text(encoding="utf-8").splitlines():
            row = parse_output_row(line)
            if row is not None:
                done.add(row.index)
    return done


# --- state -----------------------------------------------------------------------------------------------------


@dataclass
class NodeWork:
    """One node's share and what came back on its channel."""

    name: str
    rate: float
    queue: list[list[Range]] = field(default_factory=list)  # work items, run one after another
    assigned: list[Range] = field(default_factory=list)  # everything ever given to this node
    received: set[int] = field(default_factory=set)
    state: str = "pending"  # pending | running | finished | failed
    last_line_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    rows_per_s: float | None = None
    error: str | None = None

    def owns(self, index: int) -> bool:
        return any(a <= index < b for a, b in self.assigned)

    @property
    def rows(self) -> int:
        return sum(b - a for a, b in self.assigned)


@dataclass(kw_only=True)
class MapSummary(SummaryBase):
    """A map run's summary.json: the common part (rundir.SummaryBase; state succeeded | failed | stopped) and a
    map run's own."""

    rows: int
    rows_done: int
    output: str | None = None
    manifest: str | None = None
    finish_spread: float | None = None
    reassignments: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**self.base_json(), "kind": "map", "rows": self.rows, "rows_done": self.rows_done,
                "steps": self.rows_done, "output": self.output, "manifest": self.manifest,
                "finish_spread": self.finish_spread, "reassignments": self.reassignments}


# --- the I/O shell ---------------------------------------------------------------------------------------------


async def count_rows(fleet: Fleet, pb: Playbook, names: Sequence[str]) -> int:
    """Non-blank lines of the input, counted on the first node that answers (preflight proved them identical)."""
    problems = []
    for name in names:
        node = fleet.node_by_name(name)
        try:
            res = await fleet.transports[name].run(python_argv(node.python, "-c", _COUNT_ROWS, input_path(pb)),
                                                   timeout=120)
        except TransportError as exc:
            problems.append(str(exc))
            continue
        if res.ok and res.stdout.strip().isdigit():
            return int(res.stdout.strip())
        problems.append(f"{name}: {res.stderr.strip()[-300:] or res.stdout.strip()[-300:]}")
    raise MapError(f"could not read the input {input_path(pb)}: " + "; ".join(problems))


async def _mapper_argv(transport: Transport, node: Node) -> list[str]:
    worker_dir = await ship_worker(transport, node)
    return ["env", f"PYTHONPATH={worker_dir}", *python_argv(node.python, "-m", "worker.mapper")]


async def measure_rates(fleet: Fleet, pb: Playbook, names: Sequence[str], facts: Mapping[str, NodeFacts],
                        opts: JobOptions, ui: JobUI) -> dict[str, float]:
    """Examples/s of the task per node (bench over the input's first rows), cached like training calibration."""
    digest = model_digest(facts)
    cache = opts.cache_dir / "map"
    budget = min(pb.calibration.time_budget, 30.0)

    async def one(name: str) -> float:
        key = map_cache_key(name, facts[name], pb, digest) if name in facts else None
        path = cache / f"map-{key}.json" if key else None
        if path is not None and path.exists() and not opts.recalibrate:
            with contextlib.suppress(ValueError, OSError, KeyError):
                cached = float(json.loads(path.read_text(encoding="utf-8"))["examples_per_s"])
                ui.message(f"{name}: {cached:.2f} examples/s (cached)")
                return cached
        node = fleet.node_by_name(name)
        transport = fleet.transports[name]
        argv = await _mapper_argv(transport, node)
        config = json.dumps(build_mapper_config(pb, [], workdir=f"{node.workdir}/map-bench", bench=budget / 2))
        rate: float | None = None
        error = ""
        async for kind, line in transport.stream(argv, stdin=config, timeout=budget * 3 + 120):
            if kind != "stdout":
                continue
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("src") == "bench":
                    rate = float(msg["examples_per_s"])
                elif isinstance(event := parse_map_event(msg), MapErrorEvent):
                    error = str(event.message)
        if rate is None or not rate > 0:
            raise MapError(f"{name}: calibration of the {pb.map.task if pb.map else ''} task failed: {error or 'no result'}")
        ui.message(f"{name}: {rate:.2f} examples/s (measured)")
        if path is not None:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"node": name, "examples_per_s": rate, "key": key}) + "\n", encoding="utf-8")
            tmp.replace(path)
        return rate

    rates = await asyncio.gather(*(one(n) for n in names))
    return dict(zip(names, rates, strict=True))


async def calibrate_map(inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI) -> dict[str, Any]:
    """`coordinator calibrate` for a map playbook: each node's examples/s and the shards they give the input."""
    async with Fleet(inv.nodes, connect_timeout=opts.connect_timeout,
                     accept_new_host_keys=opts.accept_new_host_keys) as fleet:
        facts = await facts_for_calibration(fleet, pb, ui)
        names = [n.name for n in inv.nodes]
        total = await count_rows(fleet, pb, names)
        rates = await measure_rates(fleet, pb, names, facts, opts, ui)
    shards = compute_shards(total, rates, names)
    return {"rows": total, "nodes": [{"node": n, "examples_per_s": rates[n], "rows": shards[n][1] - shards[n][0],
                                      "shard": list(shards[n]), "share": (shards[n][1] - shards[n][0]) / total
                                      if total else 0.0} for n in names],
            "split": {n: (shards[n][1] - shards[n][0]) / total if total else 0.0 for n in names}}


class MapRun:
    """Runs the work items of every node, watches each node's channel, re-splits a failed node's rows."""

    def __init__(self, fleet: Fleet, pb: Playbook, run_dir: Path, work: dict[str, NodeWork], *, ui: JobUI,
                 store: QuarantineStore, run_id: str, debug: Mapping[str, Mapping[str, Any]] | None = None,
                 inventory: str | None = None) -> None:
        self.fleet, self.pb, self.run_dir, self.work, self.ui = fleet, pb, run_dir, work, ui
        self.store, self.run_id, self.inventory = store, run_id, inventory  # inventory: its real path (scope)
        self.debug = dict(debug or {})
        self.incidents: list[Incident] = []
        self.reassignments: list[dict[str, Any]] = []
        self.parts = run_dir / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self.events = (run_dir / EVENTS).open("a", encoding="utf-8")
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.started = time.monotonic()
        self.log = structlog.get_logger("coordinator.run.mapjob")

    def record(self, obj: dict[str, Any]) -> None:
        self.events.write(json.dumps(obj, default=str) + "\n")
        self.events.flush()

    def incident(self, inc: Incident) -> None:
        self.incidents.append(inc)
        self.record({"event": "incident", **inc.to_json()})

    async def _node(self, name: str) -> None:
        """Work items one after another; returns when the queue is empty; raises on a fault."""
        w = self.work[name]
        node = self.fleet.node_by_name(name)
        transport = self.fleet.transports[name]
        sink = (self.parts / f"{name}.jsonl").open("a", encoding="utf-8")
        try:
            while w.queue:
                ranges = w.queue[0]
                argv = await _mapper_argv(transport, node)
                config = build_mapper_config(self.pb, ranges, workdir=f"{node.workdir}/runs/{self.run_id}/{name}",
                                             debug=self.debug.get(name))
                w.state = "running"
                w.started_at = w.started_at or time.monotonic()
                w.last_line_at = time.monotonic()
                finished = False
                status = None
                async for kind, line in transport.stream(argv, stdin=json.dumps(config), timeout=365 * 86400):
                    w.last_line_at = time.monotonic()
                    if kind == "exit":
                        status = line
                        continue
                    if kind != "stdout":
                        continue
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if msg.get("src") == "result":
                        index = msg.get("index")
                        if not isinstance(index, int) or not w.owns(index):
                            self.incident(Incident(kind=IncidentKind.IMPLAUSIBLE_PROGRESS, node=name, rank=None, step=None,
                                                   detected_after_s=0.0,
                                                   evidence={"reason": f"result for row {index}, not assigned to it"},
                                                   action=Action.QUARANTINE, t=time.monotonic()))
                            raise MapError(f"{name} reported a row it was not given")
                        if index not in w.received:
                            w.received.add(index)
                            sink.write(line if line.endswith("\n") else line + "\n")
                            sink.flush()
                    elif msg.get("src") == "event":
                        self.record({"node": name, **msg})
                        event = parse_map_event(msg)  # worker.events' contract for a map worker's events
                        if isinstance(event, MapProgressEvent):
                            w.rows_per_s = event.rows_per_s
                        elif isinstance(event, MapFinishedEvent):
                            finished = True
                        elif isinstance(event, MapErrorEvent):
                            w.error = str(event.message)
                if not finished:
                    raise MapError(w.error or f"worker.mapper exited with status {status} before it finished")
                w.queue.pop(0)
            w.state = "finished"
            w.finished_at = time.monotonic()
        finally:
            sink.close()

    def _start(self, name: str) -> None:
        self.tasks[name] = asyncio.create_task(self._node(name))

    async def run(self) -> None:
        for name, w in self.work.items():
            if w.queue:
                self._start(name)
        last_view = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for name, task in list(self.tasks.items()):
                w = self.work[name]
                fault: Incident | None = None
                if task.done():
                    exc = task.exception()
                    if exc is None:
                        del self.tasks[name]
                        continue
                    kind = IncidentKind.UNREACHABLE if isinstance(exc, TransportError) else \
                        (IncidentKind.ERROR if w.error else IncidentKind.CRASH)
                    fault = Incident(kind=kind, node=name, rank=None, step=len(w.received),
                                     detected_after_s=max(0.0, now - w.last_line_at), evidence={"message": str(exc)[-1500:]},
                                     action=Action.QUARANTINE, t=now)
                elif w.state == "running" and now - w.last_line_at > self.pb.heartbeat_timeout:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, CoordinatorError, TransportError):
                        await task
                    fault = Incident(kind=IncidentKind.HANG, node=name, rank=None, step=len(w.received),
                                     detected_after_s=now - w.last_line_at,
                                     evidence={"silent_for_s": round(now - w.last_line_at, 3)},
                                     action=Action.QUARANTINE, t=now)
                if fault is not None:
                    del self.tasks[name]
                    self._failed(w, fault)
            if now - last_view >= VIEW_EVERY_S:
                last_view = now
                self.ui.map_progress(self.rows(now), now)
            if not self.tasks:
                self.ui.map_progress(self.rows(now), now)
                return

    def rows(self, now: float) -> list[MapRow]:
        return [MapRow(w.name, w.state, len(w.received), w.rows, w.rows_per_s, w.rate,
                       None if w.started_at is None else now - w.last_line_at) for w in self.work.values()]

    def _failed(self, w: NodeWork, fault: Incident) -> None:
        w.state = "failed"
        self.incident(fault)
        quarantine_node(self.store, self.fleet, w.name, f"{fault.kind} after {len(w.received)} rows",
                        inventory=self.inventory, run_id=self.run_id, incident=fault.to_json(),
                        quarantine_for=self.pb.faults.quarantine_for)
        self.ui.message(f"quarantined {w.name}: {fault.kind} ({fault.evidence})")
        remainder = subtract(sorted(w.assigned), w.received)
        w.queue.clear()
        alive = [n for n, x in self.work.items() if x.state in ("pending", "running", "finished")]
        faults = sum(1 for i in self.incidents if i.action is Action.QUARANTINE and i.kind in CULPRIT_KINDS)
        if not remainder:
            return
        if faults > self.pb.faults.max_restarts or len(alive) < max(1, self.pb.faults.min_nodes):
            self.ui.message(f"{sum(b - a for a, b in remainder)} rows of {w.name} left undone "
                            f"(faults.max_restarts {self.pb.faults.max_restarts}, min_nodes {self.pb.faults.min_nodes})")
            return
        given = split_ranges(remainder, {n: self.work[n].rate for n in alive}, alive)
        self.reassignments.append({"from": w.name, "rows": sum(b - a for a, b in remainder),
                                   "to": {n: [list(r) for r in rs] for n, rs in given.items()}})
        self.record({"event": "reassigned", **self.reassignments[-1]})
        self.ui.message(f"re-assigning {w.name}'s {sum(b - a for a, b in remainder)} unfinished rows to "
                        + ", ".join(f"{n} ({sum(b - a for a, b in rs)})" for n, rs in given.items()))
        for name, ranges in given.items():
            other = self.work[name]
            other.assigned.extend(ranges)
            other.queue.append(ranges)
            if name not in self.tasks:  # idle (finished its own share): start it again
                other.state = "running"
                self._start(name)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, CoordinatorError, TransportError):
                await task
        self.events.close()


async def run_map(inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI | None = None, *,
                  debug: Mapping[str, Mapping[str, Any]] | None = None) -> MapSummary:
    """Run a `kind: map` playbook to the end (or to a failure); always writes summary.json."""
    ui = ui or QuietUI()
    if pb.kind != "map" or pb.map is None:
        raise ConfigError(f"run_map runs kind: map playbooks (this one is {pb.kind})", path=pb.path)
    if opts.fix is not None:
        requested_source(inv, pb, opts.fix)  # a bad --fix-source is refused before anything is made or touched
    store = QuarantineStore()
    inv, left_out = usable_inventory(inv, pb, store, ui, opts)
    with run_context(inv, pb, opts, resume_marker=MAP_PLAN, ui=ui) as (run_id, run_dir):
        return await _run_map(inv, pb, opts, ui, store, run_id, run_dir, debug or {}, left_out)


async def _run_map(inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI, store: QuarantineStore, run_id: str,
                   run_dir: Path, debug: Mapping[str, Mapping[str, Any]], left_out: Sequence[LeftOut]) -> MapSummary:
    assert pb.map is not None
    async with Fleet(inv.nodes, connect_timeout=opts.connect_timeout,
                     accept_new_host_keys=opts.accept_new_host_keys) as fleet:
        state = await ready_fleet(fleet, inv, pb, opts, ui)
        names = [n.name for n in inv.nodes]
        total = await count_rows(fleet, pb, names)
        if pb.split == "calibrated":
            ui.message(f"calibrating the {pb.map.task} task (examples/s, cached per node, model and task)")
            rates = await measure_rates(fleet, pb, names, state.facts, opts, ui)
        else:
            rates = fixed_rates(names, pb.split)
        parts = sorted((run_dir / "parts").glob("*.jsonl")) if (run_dir / "parts").is_dir() else []
        done = received_indices(parts)
        todo = missing_ranges(total, done)
        if opts.resume:
            ui.message(f"resuming {run_id}: {len(done)} of {total} rows already gathered, {len(todo)} range(s) left")
            given = split_ranges(todo, rates, names)
        else:
            given = {n: [r] for n, r in compute_shards(total, rates, names).items() if r[1] > r[0]}
        work = {n: NodeWork(n, rates[n]) for n in names}
        for name, ranges in given.items():
            work[name].assigned = list(ranges)
            work[name].queue = [list(ranges)]
        counts = largest_remainder(total, [rates[n] for n in names]) if total else [0] * len(names)
        split = {n: (c / total if total else 0.0) for n, c in zip(names, counts, strict=True)}
        plan = {"format": FORMAT, "rows": total, "input": input_path(pb), "task": pb.map.model_dump(), "rates": rates,
                "split": split, "shards": {n: [list(r) for r in rs] for n, rs in given.items()},
                "resumed": bool(opts.resume)}
        (run_dir / MAP_PLAN).write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
        (run_dir / PLAYBOOK).write_text(Path(pb.path).read_text(encoding="utf-8") if pb.path else "",
                                               encoding="utf-8")
        ui.message("shards: " + ", ".join(f"{n} {sum(b - a for a, b in rs)} rows ({format_share(split[n])})"
                                          for n, rs in given.items()))
        runner = MapRun(fleet, pb, run_dir, work, ui=ui, store=store, run_id=run_id, debug=debug,
                        inventory=inventory_key(inv.path))
        stopped = False
        try:
            await runner.run()
        except (KeyboardInterrupt, asyncio.CancelledError):
            stopped = True
        finally:
            await runner.close()
        return _finish(pb, run_id, run_dir, total, work, runner, split, stopped, left_out)


def _finish(pb: Playbook, run_id: str, run_dir: Path, total: int, work: Mapping[str, NodeWork], runner: MapRun,
            split: dict[str, float], stopped: bool, left_out: Sequence[LeftOut] = ()) -> MapSummary:
    parts = sorted((run_dir / "parts").glob("*.jsonl"))
    received = received_indices(parts)
    nodes = [{"node": w.name, "state": w.state, "rows": w.rows, "rows_done": len(w.received),
              "ranges": [list(r) for r in w.assigned], "examples_per_s_calibrated": w.rate,
              "rows_per_s": w.rows_per_s,
              "finished_after_s": None if w.finished_at is None else round(w.finished_at - runner.started, 3),
              "error": w.error} for w in work.values()]
    finish = {w.name: w.finished_at - runner.started for w in work.values()
              if w.finished_at is not None and w.rows and w.state == "finished"}
    summary = MapSummary(run_id=run_id, state="stopped" if stopped else "failed", rows=total,
                         rows_done=len(received & set(range(total))), nodes=nodes, split=split,
                         incidents=runner.incidents, run_dir=str(run_dir), reassignments=runner.reassignments,
                         quarantined=sorted({i.node for i in runner.incidents if i.action is Action.QUARANTINE}),
                         left_out=[lo.to_json() for lo in left_out],
                         finish_spread=round(Spread(finish).spread, 4) if len(finish) > 1 else None)
    if not stopped and summary.rows_done == total:
        lines, origin = gather_output(parts, total)
        text = "".join(line + "\n" for line in lines)
        out = run_dir / "output.jsonl"
        tmp = out.with_name("output.jsonl.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
        digest = hashlib.sha256(text.encode()).hexdigest()
        by_part: dict[str, int] = {}
        for name in origin.values():
            by_part[name] = by_part.get(name, 0) + 1
        manifest = MapManifest(run_id=run_id, rows=total, output=str(out), sha256=digest, input=input_path(pb),
                               task=str(pb.map.task) if pb.map else None,
                               rows_by_node={k.removesuffix(".jsonl"): v for k, v in sorted(by_part.items())})
        (run_dir / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
        summary.output, summary.manifest, summary.state = str(out), str(run_dir / MANIFEST), "succeeded"
        if pb.map is not None and pb.map.output:
            dest = Path(pb.map.output)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, dest)
            summary.output = str(dest)
    elif not stopped:
        summary.message = f"{total - summary.rows_done} of {total} rows not done"
    (run_dir / SUMMARY).write_text(json.dumps(summary.to_json(), indent=2) + "\n", encoding="utf-8")
    return summary


__all__ = ["MapError", "MapSummary", "run_map"]
