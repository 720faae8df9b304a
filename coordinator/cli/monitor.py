"""`coordinator monitor`: `coordinator status`, live, plus every active run's per-rank progress and incidents,
and optionally a Prometheus endpoint (`--metrics-port`).

Two clocks: the run directories (local files) are read every `--interval`; the nodes are probed over SSH in
the background, one probe at a time, and each frame shows the newest facts (a slow or hung node never delays
the run view). The SSH connections are opened once and reused; a node that dropped is dialled again on the next
probe. Ctrl-C stops cleanly (live view, connections and the metrics server closed) with exit 0.

The watch loop is coordinator/views/statuswatch.py (`watch`), the screen coordinator/views/statusview.py (`render_frame`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from coordinator.cli.common import run_async
from coordinator.cli.status import load_status_inventory
from coordinator.models import DEFAULT_METRICS_HOST, DEFAULT_RUN_DIR, DEFAULT_STATUS_PROBE_TIMEOUT

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.live import Live

# The verb's work is imported when it runs: `monitor --help` must not pay for asyncssh, rich and the views.


@click.option("-i", "--inventory", default="inventory/local.yaml", show_default=True, help="The fleet.")
@click.option("--limit", help="Comma-separated node names to show.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(DEFAULT_RUN_DIR),
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
    from rich.live import Live

    from coordinator.run.metrics import MetricsServer
    from coordinator.run.quarantine import QuarantineStore
    from coordinator.views.liveview import make_console
    from coordinator.views.statuswatch import watch

    inv = load_status_inventory(inventory, limit)
    console = make_console(wide_tables=True)
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
    """Add `coordinator monitor`."""
    from coordinator.cli.common import handle_errors

    main.command("monitor")(handle_errors(monitor))
