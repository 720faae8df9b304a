"""`coordinator status`: one row per node, and the runs under --run-dir (the rows: coordinator/views/status.py; reading
the runs and probing the fleet: coordinator/views/statuswatch.py; the tables: coordinator/views/statusview.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from coordinator.cli.common import run_async
from coordinator.models import DEFAULT_RUN_DIR, DEFAULT_STATUS_PROBE_TIMEOUT

if TYPE_CHECKING:
    from coordinator.models import Inventory

# The verb's work is imported when it runs: `status --help` must not pay for asyncssh, rich and the views.


def load_status_inventory(inventory: str, limit: str | None) -> Inventory:
    from coordinator.config.inventory import load_inventory
    from coordinator.models import parse_limit

    inv = load_inventory(inventory)
    return inv.limit(parse_limit(limit))


@click.option("-i", "--inventory", default="inventory/local.yaml", show_default=True, help="The fleet.")
@click.option("--limit", help="Comma-separated node names to show.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(DEFAULT_RUN_DIR),
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
    from coordinator.run.quarantine import QuarantineStore
    from coordinator.views.render import dumps
    from coordinator.views.statusview import render_run_table, render_status_table
    from coordinator.views.statuswatch import collect_status

    inv = load_status_inventory(inventory, limit)
    report = run_async(collect_status(inv, run_dir, QuarantineStore(), connect_timeout=connect_timeout,
                                      probe_timeout=probe_timeout, accept_new_host_keys=accept_new_host_keys))
    if as_json:
        click.echo(dumps(report.to_json()))
        return
    from coordinator.views.liveview import make_console

    console = make_console(wide_tables=True)
    console.print(render_status_table(report.nodes))
    for run in report.runs:
        if run.active:
            console.print(render_run_table(run))
    for warning in report.warnings:
        console.print(f"[yellow]warning[/yellow]: {warning}")


def register(main: click.Group) -> None:
    """Add `coordinator status`."""
    from coordinator.cli.common import handle_errors

    main.command("status")(handle_errors(status))

