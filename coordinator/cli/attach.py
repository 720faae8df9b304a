"""`coordinator attach`: supervise a run again after the coordinator that launched it died (coordinator/run/control.py)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.cli.common import exit_for, handle_errors, message_note, print_incidents, run_supervised


@click.argument("run_id")
@click.option("-i", "--inventory", help="Default: the inventory the run was launched with.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--detach-on-hangup", is_flag=True, help="On SIGHUP leave the run running instead of stopping it.")
@handle_errors
def attach(run_id: str, inventory: str | None, run_dir: Path, as_json: bool, detach_on_hangup: bool) -> None:
    """Supervise RUN_ID again (after the coordinator that launched it died) until it ends, with the same fault
    response as `launch`. Refused (exit 2) while a live coordinator supervises it."""
    from coordinator.run import control
    from coordinator.run.supervision import Supervision
    from coordinator.views.liveview import RichUI, make_console
    from coordinator.views.render import dumps

    console = make_console(stderr=as_json)
    ui = RichUI(console)
    sup = Supervision(detach_on_hangup=detach_on_hangup)
    try:
        summary = run_supervised(control.attach(run_dir / run_id, inventory=inventory, ui=ui, supervision=sup), sup)
    except control.RunEnded as ended:
        # Nothing to supervise; its record stays as written (and is what --json prints).
        click.echo((run_dir / run_id / "summary.json").read_text(encoding="utf-8").rstrip() if as_json else str(ended))
        return
    finally:
        ui.close()
    if as_json:
        click.echo(dumps(summary.to_json()))
    else:
        console.print(f"{summary.state} run {summary.run_id}: {summary.steps} steps"
                      + message_note(summary))
        print_incidents(console, summary)
    exit_for(summary, sup, console)


def register(main: click.Group) -> None:
    main.command("attach")(attach)
