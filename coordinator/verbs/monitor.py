"""`coordinator monitor`: `coordinator status`, live, plus every active run's per-rank progress and incidents,
and optionally a Prometheus endpoint (`--metrics-port`).

Two clocks: the run directories (local files) are read every `--interval`; the nodes are probed over SSH in
the background, one probe at a time, and each frame shows the newest facts (a slow or hung node never delays
the run view). The SSH connections are opened once and reused; a node that dropped is dialled again on the next
probe. Ctrl-C stops cleanly (live view, connections and the metrics server closed) with exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from coordinator.cli import run_async
from coordinator.facts.model import NodeFacts
from coordinator.metrics import DEFAULT_METRICS_HOST, MetricsServer
from coordinator.models import Inventory
from coordinator.quarantine import QuarantineStore
from coordinator.transport import Fleet
from coordinator.verbs.status import (
    DEFAULT_RUN_DIR,
    DEFAULT_STATUS_PROBE_TIMEOUT,
    RunWatcher,
    StatusReport,
    build_report,
    load_quarantine,
    load_status_inventory,
    probe_fleet,
    render_run_table,
    render_status_table,
)

FrameFn = Callable[[RenderableType], None]
STOP_GRACE_S = 5.0  # how long a probe in flight may still take after Ctrl-C


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


@click.option("-i", "--inventory", default="inventory/local.yaml", show_default=True, help="The fleet.")
@click.option("--limit", help="Comma-separated node names to show.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_RUN_DIR,
              show_default=True, help="Where runs/<run-id>/ are (the newest are read).")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.2, 3600),
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Render one frame and exit.")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port (0: any free port).")
@click.option("--metrics-host", default=DEFAULT_METRICS_HOST, show_default=True,
              help="Address the metrics endpoint binds (0.0.0.0 exposes it to the network).")
@click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key always fails).")
@click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
@click.option("--probe-timeout", default=DEFAULT_STATUS_PROBE_TIMEOUT, show_default=True,
              type=click.FloatRange(1, 3600))
def monitor(inventory: str, limit: str | None, run_dir: Path, interval: float, once: bool, metrics_port: int | None,
            metrics_host: str, accept_new_host_keys: bool, connect_timeout: float, probe_timeout: float) -> None:
    """Watch the fleet and the active run live (Ctrl-C stops); optionally export Prometheus metrics."""
    inv = load_status_inventory(inventory, limit)
    console = Console()
    server = MetricsServer(metrics_port, metrics_host) if metrics_port is not None else None
    if server is not None:
        console.print(f"serving metrics on {server.url}", style="dim")
    live: Live | None = None

    def show(frame: RenderableType) -> None:
        nonlocal live
        if once or not console.is_terminal:
            console.print(frame)
        elif live is None:
            live = Live(frame, console=console, auto_refresh=False, transient=False)
            live.start(refresh=True)
        else:
            live.update(frame, refresh=True)

    try:
        run_async(watch(inv, run_dir, QuarantineStore(), interval=interval, once=once, show=show, server=server,
                        connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                        accept_new_host_keys=accept_new_host_keys))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a monitor ends (normally handled inside `watch`; this is before it starts)
    finally:
        if live is not None:
            live.stop()
        if server is not None:
            server.close()


def register(main: click.Group) -> None:
    """Add `coordinator monitor` (the CLI's error handling is imported here: cli.py imports this module)."""
    from coordinator.cli import handle_errors

    main.command("monitor")(handle_errors(monitor))


__all__ = ["register", "render_frame", "watch"]
