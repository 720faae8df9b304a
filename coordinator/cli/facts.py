"""`coordinator facts`: every node's facts, gathered in one SSH round trip (coordinator/preflight/pipeline.py `collect`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from coordinator.cli.common import handle_errors, hash_progress, load, run_async, with_common
from coordinator.errors import CoordinatorError


@with_common
@click.option("-p", "--playbook", help="Also hash the playbook's model/data dirs and read the model config.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--raw", is_flag=True, help="Include every command's raw output in the JSON.")
@click.option("--record", type=click.Path(file_okay=False, path_type=Path),
              help="Save each node's raw command outputs under DIR/<node>/ (replayable test fixtures).")
@handle_errors
def facts(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
          probe_timeout: float, playbook: str | None, as_json: bool, raw: bool, record: Path | None) -> None:
    """Gather and print every node's facts."""
    from rich.console import Console

    from coordinator.fleet.gather import record_facts
    from coordinator.preflight.pipeline import collect
    from coordinator.views.render import dumps, facts_to_json, render_facts

    inv, pb = load(inventory, playbook, limit)
    console = Console(stderr=as_json)
    with hash_progress(console, not as_json) as progress:
        result = run_async(collect(inv, pb, connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                                   accept_new_host_keys=accept_new_host_keys, progress=progress))
    out: list[dict[str, Any]] = []
    for node in inv.nodes:
        f = result.facts.get(node.name)
        if f is not None and record is not None:
            record_facts(f, record)
        if as_json:
            error = result.connect.get(node.name) if f is None else None
            error = error if isinstance(error, CoordinatorError) else result.probe_errors.get(node.name)
            out.append(facts_to_json(f, raw=raw) if f else {"node": node.name, "unreachable": str(error)})
        elif f is not None:
            render_facts(f, console)
        else:
            err = result.probe_errors.get(node.name) or result.connect.get(node.name)
            console.print(f"[bold red]{node.name}: {err}[/bold red]")
    if as_json:
        click.echo(dumps({"nodes": out}))
    if record is not None:
        console.print(f"recorded raw outputs under {record}/<node>/")
    if len(result.facts) < len(inv.nodes):
        sys.exit(1)


def register(main: click.Group) -> None:
    main.command("facts")(facts)
