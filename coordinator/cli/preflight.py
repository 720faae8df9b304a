"""`coordinator preflight`: the 8-point checklist and the playbook lint (coordinator/preflight/pipeline.py)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

import click

from coordinator.cli.common import DEFAULT_PLAYBOOK, handle_errors, hash_progress, load, run_async, with_common

if TYPE_CHECKING:
    from rich.console import Console



@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True, help="The job to check against.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--strict", is_flag=True, help="Warnings fail too.")
@handle_errors
def preflight(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
              probe_timeout: float, playbook: str, as_json: bool, strict: bool) -> None:
    """Check that every node is ready for the playbook: ssh, os, rdma, thunderbolt, software, model, env,
    resources; plus a lint of the playbook."""
    from coordinator.preflight.pipeline import collect, evaluate
    from coordinator.views.render import dumps, render_preflight

    inv, pb = load(inventory, playbook, limit)
    console: Console | None = None
    if not as_json:  # JSON has no progress display: rich is not even imported
        from rich.console import Console

        console = Console()
    with hash_progress(console, True) if console is not None else contextlib.nullcontext() as progress:
        result = run_async(collect(inv, pb, connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                                   accept_new_host_keys=accept_new_host_keys, progress=progress))
    report = evaluate(inv, pb, result)
    if console is None:
        click.echo(dumps(report.to_json(strict=strict)))
    else:
        render_preflight(report, console, strict=strict)
    sys.exit(0 if report.ok(strict=strict) else 1)


def register(main: click.Group) -> None:
    main.command("preflight")(preflight)
