"""`coordinator stop`: stop a run cleanly, through its live coordinator when there is one (coordinator/run/control.py)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.cli.common import handle_errors, run_async


@click.argument("run_id")
@click.option("-i", "--inventory", help="Default: the inventory the run was launched with.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True)
@click.option("--wait", "wait_s", default=120.0, show_default=True, type=click.FloatRange(0, 86400),
              help="Seconds to wait for a live coordinator to carry out the stop.")
@handle_errors
def stop(run_id: str, inventory: str | None, run_dir: Path, wait_s: float) -> None:
    """Stop RUN_ID cleanly: launcher, every rank on every node, temp files; summary state `stopped`, nothing
    quarantined. A live coordinator of the run is asked to do it (and waited for); else this command does. A run
    that already ended is left as it is (exit 0, one line with how it ended)."""
    from coordinator.run import control

    summary = run_async(control.stop(run_dir / run_id, inventory=inventory, wait_s=wait_s))
    if summary.already_ended:
        # Nothing to stop, nothing rewritten: what it ended as is its record.
        click.echo(f"run {summary.run_id} already ended: {summary.state} at step {summary.steps}")
        return
    click.echo(f"stopped run {summary.run_id} at step {summary.steps}")


def register(main: click.Group) -> None:
    main.command("stop")(stop)
