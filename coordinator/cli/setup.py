"""`coordinator setup`: bring every node's `python` to the pinned mlx / mlx-lm and ship the worker (nodesetup.py);
with `--network`, the macOS Thunderbolt point-to-point addresses (netsetup.py).

Prints one line per node, Ansible style (`ok`, `changed`, `failed`), or `--json`. Exits 1 when a node failed,
2 for a bad inventory / playbook / flag, else 0."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.cli.common import DEFAULT_INVENTORY, run_async

COLOURS = {"ok": "green", "changed": "yellow", "failed": "red"}


@click.option("-i", "--inventory", default=DEFAULT_INVENTORY, show_default=True, help="The fleet.")
@click.option("-p", "--playbook", help="Take the versions from its `software:` (default: the coordinator's own).")
@click.option("--limit", help="Comma-separated node names to set up.")
@click.option("--check", is_flag=True, help="Only say what would change (Ansible's check mode); changes nothing.")
@click.option("--network", is_flag=True,
              help="macOS Thunderbolt addresses instead of software: print the networksetup commands per node.")
@click.option("--apply", "apply_", is_flag=True, help="With --network: run the printed commands (sudo networksetup).")
@click.option("--wheelhouse", type=click.Path(file_okay=False, path_type=Path),
              help="The coordinator's wheel cache [default: $XDG_CACHE_HOME/mlx-coordinator/wheelhouse, "
                   "~/.cache/... without it].")
@click.option("--find-links", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Download from this local wheel directory only, not PyPI (an air-gapped coordinator).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key always fails).")
@click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
def setup(inventory: str, playbook: str | None, limit: str | None, check: bool, network: bool, apply_: bool,
          wheelhouse: Path | None, find_links: tuple[Path, ...], as_json: bool, accept_new_host_keys: bool,
          connect_timeout: float) -> None:
    """Install the pinned mlx / mlx-lm (and the worker) into every node's `python`, creating a missing venv:
    wheels are downloaded once per platform on this machine and installed on the nodes with --no-index.
    Idempotent: a second run reports `ok` per node. --network: macOS Thunderbolt addresses (see --apply)."""
    from rich.console import Console
    from rich.text import Text

    from coordinator.cli.common import load
    from coordinator.errors import ConfigError
    from coordinator.views.render import dumps

    inv, pb = load(inventory, playbook, limit)
    console = Console(stderr=as_json, highlight=False)
    if apply_ and not network:
        raise ConfigError("--apply goes with --network (software setup applies unless --check)")
    if network:
        from coordinator.fleet.netsetup import run_network_setup

        net = run_async(run_network_setup(inv.nodes, apply=apply_ and not check, connect_timeout=connect_timeout,
                                          accept_new_host_keys=accept_new_host_keys))
        if as_json:
            click.echo(dumps(net.to_json()))
        else:
            for line in net.lines():
                console.print(line, markup=False)
        if net.failed:
            from coordinator.fleet.nodesetup import SetupFailed

            raise SetupFailed("setup --network failed on " + ", ".join(net.failed_nodes()))
        return

    from coordinator.fleet.nodesetup import SetupFailed, pins_from, run_setup

    software = pb.software if pb is not None else None
    pins = pins_from(software.mlx if software else None, software.mlx_lm if software else None)
    console.print(f"pins: mlx {pins.mlx}, mlx-lm {pins.mlx_lm} ({pins.source})" + (" [check mode]" if check else ""),
                  markup=False)

    def downloading(name: str) -> None:
        console.print(f"wheels for {name}: from the cache, else downloaded now (once; hundreds of MB)", markup=False)

    report = run_async(run_setup(inv.nodes, pins, check=check, root=wheelhouse, find_links=find_links,
                                 connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                                 on_download=downloading, on_note=lambda note: console.print(note, markup=False)))
    if as_json:
        click.echo(dumps(report.to_json()))
    else:
        for n in report.nodes:
            what = "; ".join(n.actions) if n.actions else ""
            detail = " | ".join(x for x in (what, n.message) if x)
            console.print(Text.assemble((str(n.outcome), COLOURS[n.outcome]), f": [{n.node}] {detail}"))
        counts = report.counts()
        console.print(" ".join(f"{k}={v}" for k, v in counts.items()), markup=False)
    if report.failed:
        raise SetupFailed("setup failed on " + ", ".join(n.node for n in report.nodes if n.outcome == "failed"))


def register(main: click.Group) -> None:
    """Add `coordinator setup`."""
    from coordinator.cli.common import handle_errors

    main.command("setup")(handle_errors(setup))
