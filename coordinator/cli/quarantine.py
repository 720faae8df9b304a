"""`coordinator quarantine list|clear`: the machines left out of launches after a fault (coordinator/run/quarantine.py)."""

from __future__ import annotations

import time

import click

from coordinator.cli.common import handle_errors
from coordinator.errors import ConfigError


@click.group()
def quarantine() -> None:
    """Nodes left out of launches after a fault (persisted)."""


@quarantine.command("list")
@click.option("-i", "--inventory", help="Only the entries that apply to this inventory's nodes.")
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def quarantine_list(inventory: str | None, as_json: bool) -> None:
    """Show quarantined machines: identity (node, address, inventory), reason, age and expiry."""
    from coordinator.run.quarantine import QuarantineStore, format_age, inventory_key
    from coordinator.views.render import dumps

    now = time.time()
    state = QuarantineStore().read()
    for note in state.notes:
        click.echo(f"coordinator: note: {note}", err=True)
    entries = state.active(now)
    if inventory is not None:
        scope = inventory_key(inventory)
        entries = [e for e in entries if e.legacy or e.inventory == scope]
    if as_json:
        click.echo(dumps({"entries": [e.to_json(now) for e in entries]}))
        return
    if not entries:
        click.echo("no node is quarantined")
    for e in entries:
        until = "until cleared" if e.expires is None else f"expires in {format_age(e.expires - now)}"
        click.echo(f"{e.identity()}\t{e.reason}\trun {e.run_id}\t{format_age(now - e.t)} ago\t{until}"
                   + (f"\thost key {e.host_key}" if e.host_key else ""))


@quarantine.command("clear")
@click.argument("node")
@click.option("-i", "--inventory", help="Only NODE of this inventory (default: every machine named NODE).")
@handle_errors
def quarantine_clear(node: str, inventory: str | None) -> None:
    """Let NODE take part in launches again: by default every quarantined machine of that name, in any
    inventory; with -i only that inventory's (old-format entries, which apply to any inventory, go too)."""
    from coordinator.run.quarantine import QuarantineStore, inventory_key

    gone = QuarantineStore().clear(node, inventory=inventory_key(inventory) if inventory else None)
    if not gone:
        where = f" in {inventory}" if inventory else ""
        raise ConfigError(f"{node} is not quarantined{where} (`coordinator quarantine list`)")
    for e in gone:
        click.echo(f"cleared {e.identity()}")


def register(main: click.Group) -> None:
    main.add_command(quarantine)
