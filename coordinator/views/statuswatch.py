"""The I/O of `coordinator status` and `monitor`: reading run directories incrementally (`RunWatcher`), probing
the fleet over SSH (`probe_fleet`, `collect_status`) and monitor's two-clock loop (`watch`: run dirs every
`--interval`, one SSH probe at a time in the background). An unreachable node is a row with its error, never
an exception."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import RenderableType

from coordinator.errors import ConfigError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.gather import gather_facts
from coordinator.fleet.transport import Fleet
from coordinator.models import Inventory
from coordinator.run.metrics import MetricsServer, RunStatus
from coordinator.run.monitor import FaultPolicy
from coordinator.run.quarantine import Entry, QuarantineStore, inventory_key, matching_entry
from coordinator.run.rundir import (
    EVENTS,
    META,
    PLAYBOOK,
    SUMMARY,
    parse_meta,
    policy_from_playbook,
    read_json_object,
)
from coordinator.views.status import (
    DEFAULT_STATUS_PROBE_TIMEOUT,
    RECENT_RUNS,
    RunEvents,
    StatusReport,
    build_report,
    build_run_status,
)
from coordinator.views.statusview import render_frame
from worker.events import coerce_int


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


def _playbook(run_dir: Path) -> tuple[int | None, FaultPolicy | None]:
    """The run's copy of its playbook: (train.iters, its thresholds for a meta.json that predates them)."""
    try:
        doc = yaml.safe_load((run_dir / PLAYBOOK).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None, None
    train = doc.get("train") if isinstance(doc, dict) else None
    return coerce_int(train.get("iters")) if isinstance(train, dict) else None, policy_from_playbook(doc)


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
            if tracked is None or not tracked.events.judges(meta):  # new, or relaunched: read it (again) for meta
                iters, policy = _playbook(run_dir)
                tracked = self._tracked[run_dir.name] = _Tracked(RunEvents.for_meta(meta, fallback=policy),
                                                                 iters=iters)
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


async def collect_status(inv: Inventory, run_dir: Path, store: QuarantineStore, *, connect_timeout: float,
                         probe_timeout: float, accept_new_host_keys: bool = False) -> StatusReport:
    """One status snapshot of the fleet (over SSH) and of the runs under `run_dir` (local)."""
    async with Fleet(inv.nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        await fleet.connect_all()
        facts, errors = await probe_fleet(fleet, probe_timeout=probe_timeout)
    quarantine, problem = load_quarantine(store, inv)
    runs = RunWatcher(run_dir).scan()
    return build_report(inv, facts, errors, runs, quarantine, [problem] if problem else [])

FrameFn = Callable[[RenderableType], None]


STOP_GRACE_S = 5.0  # how long a probe in flight may still take after Ctrl-C


class _Prober:
    """The background SSH probe: at most one in flight; the newest completed result is kept."""

    def __init__(self, fleet: Fleet, probe_timeout: float) -> None:
        self.fleet = fleet
        self.probe_timeout = probe_timeout
        self.facts: dict[str, NodeFacts] = {}
        self.errors: dict[str, str] = {}
        self.done_at: float | None = None
        self._task: asyncio.Task[tuple[dict[str, NodeFacts], dict[str, str]]] | None = None

    def kick(self) -> None:
        """Start a probe unless one is running; take in the finished one's result."""
        if self._task is not None and self._task.done():
            self.facts, self.errors = self._task.result()
            self.done_at = time.time()
            self._task = None
        if self._task is None:
            self._task = asyncio.create_task(probe_fleet(self.fleet, probe_timeout=self.probe_timeout,
                                                         reconnect=True))

    async def first(self, stop: asyncio.Event) -> None:
        """Wait for the first probe (the first frame shows real rows, not placeholders), or for `stop`."""
        self.kick()
        assert self._task is not None
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({self._task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._task.done():
            self.kick()

    async def finish(self, grace: float) -> None:
        """Let a probe in flight end on its own for up to `grace` seconds (a cancelled probe can leave a
        half-closed subprocess or channel behind), then cancel it."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            await asyncio.wait({task}, timeout=grace)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def watch(inv: Inventory, run_dir: Path, store: QuarantineStore, *, interval: float, once: bool,
                show: FrameFn, server: MetricsServer | None = None, connect_timeout: float = 5.0,
                probe_timeout: float = DEFAULT_STATUS_PROBE_TIMEOUT, accept_new_host_keys: bool = False) -> None:
    """Refresh every `interval` seconds (forever, or one frame with `once`), feeding `show` and the server.
    SIGINT/SIGTERM end it cleanly: the loop stops, a probe in flight gets a short grace, connections close."""
    watcher = RunWatcher(run_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            continue
    async with Fleet(inv.nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        prober = _Prober(fleet, probe_timeout)
        try:
            connecting = asyncio.create_task(fleet.connect_all())
            waiting = asyncio.create_task(stop.wait())
            await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if stop.is_set():
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                return
            await prober.first(stop)
            while not stop.is_set():
                tick = time.monotonic()
                quarantine, problem = load_quarantine(store, inv)
                runs = watcher.scan()
                report = build_report(inv, prober.facts, prober.errors, runs, quarantine, [problem] if problem else [])
                if server is not None:
                    server.update_nodes(report.nodes)
                    server.update_runs(report.runs)
                show(render_frame(report, metrics_url=server.url if server else None, probed_at=prober.done_at,
                                  now=time.time()))
                if once:
                    return
                try:
                    await asyncio.wait_for(stop.wait(), timeout=max(0.05, interval - (time.monotonic() - tick)))
                except TimeoutError:
                    prober.kick()
        finally:
            await prober.finish(STOP_GRACE_S)
            for sig in handled:
                loop.remove_signal_handler(sig)
