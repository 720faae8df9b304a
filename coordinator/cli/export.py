"""`coordinator export RUN_ID`: the run's newest complete checkpoint as an mlx_lm model or adapter dir
(coordinator/run/export.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from coordinator.cli.common import handle_errors, run_async


@click.argument("run_id")
@click.option("--out", type=click.Path(path_type=Path),
              help="Write it here (must not exist). Default: <run-dir>/<run-id>/export.")
@click.option("-i", "--inventory", help="Default: the inventory the run was launched with.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@handle_errors
def export(run_id: str, out: Path | None, inventory: str | None, run_dir: Path, as_json: bool) -> None:
    """Gather RUN_ID's newest complete checkpoint (a pipeline's stage shards from every node) into what mlx_lm
    loads: a model dir (safetensors + config + tokenizer) for full fine-tunes, an adapter dir
    (adapters.safetensors + adapter_config.json) for LoRA."""
    from coordinator.run.export import export_run

    result = run_async(export_run(run_dir / run_id, out=out, inventory=inventory))
    click.echo(json.dumps(result.to_json()) if as_json else result.describe())


def register(main: click.Group) -> None:
    main.command("export")(export)
