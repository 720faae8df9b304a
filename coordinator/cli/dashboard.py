"""`coordinator dashboard`: the fleet, the runs and each run live in a browser (coordinator/views/dashboard/)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from coordinator.cli.common import run_async
from coordinator.cli.status import load_status_inventory
from coordinator.models import (
    DEFAULT_DASHBOARD_HOST,
    DEFAULT_DASHBOARD_PORT,
    DEFAULT_DASHBOARD_PROBE_INTERVAL,
    DEFAULT_RUN_DIR,
    DEFAULT_STATUS_PROBE_TIMEOUT,
)

# The server is imported when the verb runs: `dashboard --help` must not pay for asyncssh, rich and the views.


@click.option("-i", "--inventory", default="inventory/local.yaml", show_default=True, help="The fleet.")
@click.option("--limit", help="Comma-separated node names to show.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(DEFAULT_RUN_DIR),
              show_default=True, help="Where runs/<run-id>/ are.")
@click.option("--host", default=DEFAULT_DASHBOARD_HOST, show_default=True,
              help="Address to bind (every request needs the printed token, on loopback too).")
@click.option("--port", default=DEFAULT_DASHBOARD_PORT, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0: any free port).")
@click.option("--probe-interval", default=DEFAULT_DASHBOARD_PROBE_INTERVAL, show_default=True, type=click.FloatRange(1, 3600),
              help="Seconds between fleet probes (the run pages are pushed as events are written).")
@click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key always fails).")
@click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
@click.option("--probe-timeout", default=DEFAULT_STATUS_PROBE_TIMEOUT, show_default=True,
              type=click.FloatRange(1, 3600))
def dashboard(inventory: str, limit: str | None, run_dir: Path, host: str, port: int, probe_interval: float,
              accept_new_host_keys: bool, connect_timeout: float, probe_timeout: float) -> None:
    """Serve a live web dashboard: the fleet, the runs, each run's curves and ranks, a stop button (Ctrl-C ends)."""
    from coordinator.views.dashboard.fleet import serve_dashboard, warn_public

    inv = load_status_inventory(inventory, limit)
    warning = warn_public(host)
    if warning:
        click.echo(f"warning: {warning}", err=True)

    def announce(url: str) -> None:
        click.echo(f"dashboard: {url}", err=True)

    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve_dashboard(inv, run_dir, host=host, port=port, interval=probe_interval,
                                  probe_timeout=probe_timeout, connect_timeout=connect_timeout,
                                  accept_new_host_keys=accept_new_host_keys, announce=announce))


def register(main: click.Group) -> None:
    """Add `coordinator dashboard`."""
    from coordinator.cli.common import handle_errors

    main.command("dashboard")(handle_errors(dashboard))
