"""`coordinator report RUN_ID`: write a self-contained HTML report of a run (coordinator/report.py builds it)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.report import build_page, read_run_files
from coordinator.report_map import build_map_report, render_map_page
from coordinator.rundir import MAP_PLAN


def write_report(run_root: Path, run_id: str, output: Path | None = None) -> Path:
    """Build the report of `run_root/run_id` (a training run, or a map run: `coordinator.report_map`) and write it
    to `output` (default `runs/<id>/report/index.html`).
    Raises `ReportError` (exit 2) when RUN_ID is not a run directory."""
    files = read_run_files(run_root, run_id)
    if (files.summary or {}).get("kind") == "map" or (run_root / run_id / MAP_PLAN).is_file():
        page = render_map_page(build_map_report(files, run_root / run_id))
    else:
        page = build_page(files)
    path = output if output is not None else run_root / run_id / "report" / "index.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def register(main: click.Group) -> None:
    """Add `report` to the `coordinator` group."""
    from coordinator.cli import handle_errors

    @main.command()
    @click.argument("run_id")
    @click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
                  show_default=True, help="The directory holding runs/<run-id>/.")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write the HTML here (default: <run-dir>/<run-id>/report/index.html).")
    @handle_errors
    def report(run_id: str, run_dir: Path, output: Path | None) -> None:
        """Write an HTML report of RUN_ID (plots embedded, opens without a server): loss and eval curves,
        tok/s per rank against calibration, the split, incidents on the timeline, checkpoints."""
        path = write_report(run_dir, run_id, output)
        click.echo(f"wrote {path}")
