"""`coordinator sync`: make the playbook's model and data dirs identical on every node (the I/O:
coordinator/fleet/syncrun.py; the plan: coordinator/planning/sync.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from coordinator.errors import ConfigError

if TYPE_CHECKING:
    from coordinator.planning.sync import SyncPlan
    from coordinator.views.liveview import NodeBars

# The transfer and the bars are imported when the verb runs: `sync --help` must not pay for asyncssh and rich.


def _size(n: int) -> str:
    if n >= 10**8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 10**5 else f"{n / 1e3:.1f} kB" if n >= 1000 else f"{n} B"


def render_plan(plan: SyncPlan, echo: Callable[[str], None]) -> None:
    total = sum(s for s, _ in plan.manifest.values())
    echo(f"source {plan.source}: {len(plan.manifest)} files, {_size(total)}")
    for p in plan.nodes:
        if p.in_sync:
            echo(f"  {p.node}: in sync")
            continue
        resumed = sum(p.kept.values())
        echo(f"  {p.node}: copy {len(p.copy)} files ({_size(p.write_bytes)}"
             + (f", {_size(resumed)} resumed" if resumed else "")
             + f"), delete {len(p.delete)} files ({_size(p.delete_bytes)})")
        for path in p.copy[:10]:
            echo(f"      copy   {path} ({_size(plan.manifest[path][0])})")
        for path in p.delete[:10]:
            echo(f"      delete {path}")
        hidden = max(0, len(p.copy) - 10) + max(0, len(p.delete) - 10)
        if hidden:
            echo(f"      ... {hidden} more")
        if p.disk_problem:
            echo(f"      PROBLEM: {p.disk_problem}")
    for d in plan.doubtful:
        echo(f"  DOUBTFUL: {d.node}: deletes {d.files} of its {d.held_files} files in {d.label} "
             f"({_size(d.bytes)} of {_size(d.held_bytes)}); the source has {d.source_files} there")
    if plan.chain:
        echo(f"stream: {_size(plan.stream_bytes)} once, relayed {plan.source} -> " + " -> ".join(plan.chain))


def register(main: click.Group) -> None:
    """Add `sync` to the CLI."""
    from coordinator.cli.common import DEFAULT_INVENTORY, handle_errors

    @main.command()
    @click.option("-i", "--inventory", default=DEFAULT_INVENTORY, show_default=True, help="The fleet.")
    @click.option("-p", "--playbook", required=True, help="Whose model/data dirs to sync.")
    @click.option("--from", "from_node", help="The node whose copy is right (default: the copy most nodes share).")
    @click.option("--source", "source_path", type=click.Path(file_okay=False, path_type=Path),
                  help="A local dir holding the right copy, one subdir per synced dir (model/, data/).")
    @click.option("--check", is_flag=True, help="Print the plan (files and bytes per node); change nothing.")
    @click.option("--limit", help="Comma-separated node names to sync (the --from node need not be among them).")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
    @click.option("--delete-extras", is_flag=True,
                  help="Delete what the source lacks even when that is most of a node's copy (or the source's dir "
                       "is empty); without it such a sync asks at a terminal and is refused otherwise.")
    @click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key fails).")
    @click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
    @handle_errors
    def sync(inventory: str, playbook: str, from_node: str | None, source_path: Path | None, check: bool,
             limit: str | None, as_json: bool, delete_extras: bool, accept_new_host_keys: bool,
             connect_timeout: float) -> None:
        """Make the playbook's model and data dirs byte-identical on every node: plan from SHA256 manifests,
        relay only the differing files once down a chain of nodes (pipelined, resumable), delete extras, then
        verify every node's manifest equals the source's."""
        from coordinator.cli.common import load, run_async
        from coordinator.models import parse_limit

        if from_node and source_path:
            raise ConfigError("give --from NODE or --source PATH, not both")
        inv, pb = load(inventory, playbook, None)
        assert pb is not None
        src = None
        if from_node:
            found = [n for n in inv.nodes if n.name == from_node]
            if not found:
                raise ConfigError(f"--from names unknown node {from_node}; known: {', '.join(inv.names())}")
            src = found[0]
        if source_path is not None:
            missing = [lb for lb, _ in pb.hashed_dirs() if not (source_path / lb).is_dir()]
            if missing:
                raise ConfigError(f"--source {source_path} lacks {', '.join(missing)}/ (one subdir per synced dir)")
        from coordinator.fleet.syncrun import run_sync

        targets = inv.limit(parse_limit(limit))
        echo = (lambda s: click.echo(s, err=True)) if as_json else click.echo
        ui = _bars(enabled=not as_json and not check)

        def confirm(question: str) -> bool:
            # Only a person at a terminal can say yes; piped or scripted runs need --delete-extras.
            if not sys.stdin.isatty():
                return False
            ui.pause()
            try:
                return click.confirm(question, default=False, err=True)
            finally:
                ui.resume()

        with ui:
            report = run_async(run_sync(targets, pb, source_node=src, source_path=source_path, check=check,
                                        connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                                        progress=ui, on_plan=lambda plan: render_plan(plan, echo),
                                        delete_extras=delete_extras, confirm=confirm))
        if as_json:
            click.echo(json.dumps(report.to_json(), indent=2))
        if report.refusal:
            raise ConfigError(report.refusal)
        if not as_json:
            for name, err in sorted(report.node_errors.items()):
                click.echo(f"FAILED {name}: {err}")
            for name, err in sorted(report.recovered.items()):
                click.echo(f"{name}: recovered from: {err}")
            for name, diffs in sorted(report.verified.items()):
                click.echo(f"{'identical' if not diffs else 'DIFFERS'} {name}"
                           + (f": {'; '.join(diffs[:5])}" if diffs else ""))
            if report.plan is not None and report.plan.problems and not check:
                click.echo("nothing copied: " + "; ".join(report.plan.problems))
            if check:
                click.echo("--check: nothing changed")
            elif report.plan is not None and not report.plan.problems:
                rate = report.sent_bytes / report.transfer_seconds / 1e6 if report.transfer_seconds else 0.0
                sent = (f"sent {_size(report.sent_bytes)} in {report.transfer_seconds:.1f}s ({rate:.1f} MB/s)"
                        if report.sent_bytes else "nothing to send")
                click.echo(f"{sent}; total {report.seconds:.1f}s")
                for name, why in sorted(report.fallback.items()):
                    click.echo(f"{name}: sent over SSH (the relay chain failed it: {why})")
        sys.exit(0 if report.ok else 1)


def _bars(enabled: bool) -> NodeBars:
    """Per-node progress bars (bytes, MB/s, ETA) on a terminal; nothing otherwise."""
    from rich.console import Console

    from coordinator.views.liveview import NodeBars

    return NodeBars(Console(stderr=True), enabled, eta=True)
