"""The dashboard's fleet side: the fleet probe and the server's lifetime, for `coordinator dashboard` and
`coordinator launch --dashboard` (the verb: coordinator/cli/dashboard.py; the page and its HTTP server: model.py,
server.py).

The fleet page is `coordinator status`'s rows (the same SSH probe, repeated every `--probe-interval` seconds on
connections opened once) plus each node's last preflight verdict when the dashboard runs beside a launch
(`coordinator launch --dashboard`, which records the launch's preflight). Runs come from the run directories
only. Ctrl-C stops cleanly with exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator import models
from coordinator.facts.model import NodeFacts
from coordinator.models import Inventory, PreflightReport
from coordinator.views.dashboard.server import DashboardServer, DashboardState

if TYPE_CHECKING:
    from coordinator.planning.plan import NodeCalibration, Plan
    from coordinator.planning.shards import MapRow
    from coordinator.run.job import JobUI
    from coordinator.run.monitor import Monitor
from coordinator.fleet.transport import Fleet
from coordinator.run.quarantine import QuarantineStore
from coordinator.views.status import DEFAULT_STATUS_PROBE_TIMEOUT, build_report
from coordinator.views.statuswatch import RunWatcher, load_quarantine, probe_fleet

if TYPE_CHECKING:
    from coordinator.planning.plan import NodeCalibration, Plan
    from coordinator.planning.shards import MapRow
    from coordinator.run.job import JobUI
    from coordinator.run.monitor import Monitor
    from coordinator.run.supervision import Supervision


DEFAULT_PROBE_INTERVAL = models.DEFAULT_DASHBOARD_PROBE_INTERVAL


T = TypeVar("T")


def preflight_verdicts(report: PreflightReport) -> dict[str, str]:
    """Each node's preflight in a word: fail (a check failed or errored), warn, or pass."""
    verdicts: dict[str, str] = {}
    for name, checks in report.nodes:
        statuses = {str(c.status) for c in checks}
        verdicts[name] = "fail" if statuses & {"fail", "error"} else "warn" if "warn" in statuses else "pass"
    return verdicts


class FleetView:
    """The fleet page's document, rebuilt from the newest probe, the run dirs and the quarantine file."""

    def __init__(self, inv: Inventory, run_root: Path, store: QuarantineStore,
                 preflight: dict[str, str] | None = None) -> None:
        self.inv = inv
        self.store = store
        self.watcher = RunWatcher(run_root)
        self.facts: dict[str, NodeFacts] = {}
        self.errors: dict[str, str] = {n.name: "not probed yet" for n in inv.nodes}
        self.probed_at: float | None = None
        self.preflight = preflight if preflight is not None else {}  # shared with a PreflightRecorder

    def __call__(self) -> dict[str, Any]:
        quarantine, problem = load_quarantine(self.store, self.inv)
        report = build_report(self.inv, self.facts, self.errors, self.watcher.scan(), quarantine,
                              [problem] if problem else [])
        nodes = [n.to_json() | {"preflight": self.preflight.get(n.node)} for n in report.nodes]
        return {"nodes": nodes, "warnings": report.warnings, "probed_at": self.probed_at}


async def probe_forever(view: FleetView, fleet: Fleet, *, interval: float, probe_timeout: float,
                        changed: Callable[[], None]) -> None:
    """Probe the fleet every `interval` seconds (one probe at a time) and tell `changed` after each."""
    await fleet.connect_all()
    while True:
        view.facts, view.errors = await probe_fleet(fleet, probe_timeout=probe_timeout, reconnect=True)
        view.probed_at = time.time()
        changed()
        await asyncio.sleep(interval)


async def serve_dashboard(inv: Inventory, run_root: Path, *, host: str, port: int, interval: float,
                          probe_timeout: float, connect_timeout: float, accept_new_host_keys: bool,
                          announce: Callable[[str], None], until: asyncio.Event | None = None,
                          preflight: dict[str, str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, or, beside a launch, until `until` is set (the launch owns the signals then).
    `preflight` is read live: a `PreflightRecorder` fills it as the launch's preflight ends."""
    from coordinator.run import control

    view = FleetView(inv, run_root, QuarantineStore(), preflight)
    state = DashboardState(run_root, fleet=view)
    stop = until or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM) if until is None else ():
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    async with Fleet(inv.nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        server = DashboardServer(state, host=host, port=port, stop=lambda run_dir: control.stop(run_dir))
        await server.start()
        announce(server.url)
        prober = asyncio.create_task(probe_forever(view, fleet, interval=interval, probe_timeout=probe_timeout,
                                                   changed=server.publish_fleet))
        try:
            await stop.wait()
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            await server.close()
            for sig in handled:
                loop.remove_signal_handler(sig)


class PreflightRecorder:
    """A `JobUI` that forwards every call to `inner` and keeps each node's preflight verdict for the fleet page."""

    def __init__(self, inner: JobUI, verdicts: dict[str, str]) -> None:
        self.inner = inner
        self.verdicts = verdicts

    def message(self, text: str) -> None:
        self.inner.message(text)

    def preflight(self, report: PreflightReport) -> None:
        self.verdicts.update(preflight_verdicts(report))
        self.inner.preflight(report)

    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None:
        self.inner.calibration(plan, calibrations)

    def progress(self, monitor: Monitor, now: float) -> None:
        self.inner.progress(monitor, now)

    def map_progress(self, rows: Sequence[MapRow], now: float) -> None:
        self.inner.map_progress(rows, now)

    def degraded(self, warning: str, nodes: Sequence[str]) -> None:
        self.inner.degraded(warning, nodes)


async def beside(job: Coroutine[Any, Any, T], inv: Inventory, run_root: Path, *, host: str, port: int,
                 announce: Callable[[str], None], preflight: dict[str, str], connect_timeout: float,
                 accept_new_host_keys: bool, linger: Callable[[T], Awaitable[None]] | None = None) -> T:
    """Run `job` (a launch) with the dashboard served on the same loop; the dashboard ends with the job, or, with
    `linger`, once `linger(result)` returns (`linger_until_interrupted`: at Ctrl-C)."""
    done, up = asyncio.Event(), asyncio.Event()

    def started(url: str) -> None:
        up.set()
        announce(url)

    served = asyncio.create_task(serve_dashboard(
        inv, run_root, host=host, port=port, interval=DEFAULT_PROBE_INTERVAL, probe_timeout=DEFAULT_STATUS_PROBE_TIMEOUT,
        connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys, announce=started, until=done,
        preflight=preflight))
    waiting = asyncio.create_task(up.wait())
    await asyncio.wait({served, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if served.done():  # it could not bind: the launch does not start (ConfigError, exit 2)
        job.close()
        served.result()
    try:
        result = await job
        if linger is not None:
            await linger(result)
        return result
    finally:
        done.set()
        await asyncio.gather(served, return_exceptions=True)


async def linger_until_interrupted(sup: Supervision, *, say: Callable[[str], None], url: str) -> None:
    """After the run: keep the dashboard up until Ctrl-C (or SIGTERM/SIGHUP), saying so. The signal ends the
    lingering, not the run (which has ended): it is cleared from `sup`, so the exit code stays the run's."""
    say(f"the run has ended; the dashboard stays up at {url} until Ctrl-C")
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        if sup.signum is None:  # cancelled by something other than our signal handler: not ours to swallow
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        sup.signum, sup.detach = None, False
        say("dashboard stopped")


def warn_public(host: str) -> str | None:
    from coordinator.views.dashboard.server import is_loopback

    return None if is_loopback(host) else (f"the dashboard is reachable from the network on {host}: every page "
                                           "needs the token in the URL below")
