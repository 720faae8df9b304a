"""`coordinator report RUN_ID`: write a self-contained HTML report of a run (coordinator/views/report/ and
report_map.py build it)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.models import DEFAULT_RUN_DIR


def register(main: click.Group) -> None:
    """Add `report` to the `coordinator` group."""
    from coordinator.cli.common import handle_errors

    @main.command()
    @click.argument("run_id")
    @click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(DEFAULT_RUN_DIR),
                  show_default=True, help="The directory holding runs/<run-id>/.")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the HTML here (default: <run-dir>/<run-id>/report/index.html).")
    @handle_errors
    def report(run_id: str, run_dir: Path, output: Path | None) -> None:
        """Write an HTML report of RUN_ID (plots embedded, opens without a server): loss and eval curves,
        tok/s per rank against calibration, the split, incidents on the timeline, checkpoints."""
        from coordinator.views.report_map import write_report  # when it runs: `report --help` stays instant

        path = write_report(run_dir, run_id, output)
        click.echo(f"wrote {path}")
