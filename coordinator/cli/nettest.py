"""`coordinator nettest`: pairwise latency and bandwidth between the nodes' data-plane IPs (the I/O:
coordinator/fleet/nettestrun.py; the judging: coordinator/fleet/nettest.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from coordinator.cli.common import run_async

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.fleet.nettest import NettestReport

# The measurement and the tables are imported when the verb runs: `nettest --help` must not pay for them.


def _gbps(bps: float) -> str:
    return f"{bps * 8 / 1e9:.2f}"


def render_nettest(report: NettestReport, console: Console, *, strict: bool = False) -> None:
    """A table of pairs, then the counts."""
    from rich.table import Table

    from coordinator.views.render import status_text

    table = Table(title=f"nettest: {len(report.pairs)} pair(s) in {report.seconds:.1f}s")
    for col, justify in (("pair", "left"), ("link", "left"), ("rtt ms", "right"), ("a→b Gb/s", "right"),
                         ("b→a Gb/s", "right"), ("status", "left"), ("summary", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in report.pairs:
        link = str(p.kind) + (f" {p.speed_gbps:g} Gb/s" if p.speed_gbps else "")
        m = p.measurement
        table.add_row(f"{p.a.node} ↔ {p.b.node}\n{p.a.ip} ↔ {p.b.ip}", link,
                      f"{m.rtt_ms:.3f}" if m else "-", _gbps(m.up_bps) if m else "-",
                      _gbps(m.down_bps) if m else "-", status_text(p.status), p.summary)
    if report.pairs:
        console.print(table)
    if report.gpus:
        gpus = Table(title="GPUs of a node: NCCL all-reduce")
        for col, justify in (("node", "left"), ("GPUs", "right"), ("bus GB/s", "right"), ("status", "left"),
                             ("summary", "left")):
            gpus.add_column(col, justify=justify)  # type: ignore[arg-type]
        for g in report.gpus:
            gpus.add_row(g.node, str(len(g.devices)), f"{g.busbw_bps / 1e9:.1f}" if g.busbw_bps else "-",
                         status_text(g.status), g.summary)
        console.print(gpus)
    counts = report.counts()
    verdict = "[green]ok[/green]" if report.ok(strict=strict) else "[red]FAILED[/red]"
    console.print(f"{verdict}: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail")


def register(main: click.Group) -> None:
    """Add `nettest` to the CLI."""
    from coordinator.cli.common import DEFAULT_INVENTORY, handle_errors

    @main.command()
    @click.option("-i", "--inventory", default=DEFAULT_INVENTORY, show_default=True, help="The fleet.")
    @click.option("--limit", help="Comma-separated node names to test (at least two).")
    @click.option("--seconds", default=2.0, show_default=True, type=click.FloatRange(0.1, 60),
                  help="Bulk transfer time per direction per pair (a pair takes ~2x this plus ~1 s).")
    @click.option("--pings", default=50, show_default=True, type=click.IntRange(1, 10000),
                  help="Round trips timed per pair (the median is reported).")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.option("--strict", is_flag=True, help="Warnings fail too.")
    @click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key fails).")
    @click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
    @handle_errors
    def nettest(inventory: str, limit: str | None, seconds: float, pings: int, as_json: bool, strict: bool,
                accept_new_host_keys: bool, connect_timeout: float) -> None:
        """Measure latency and bandwidth between every pair of nodes' data-plane IPs, one pair at a time, and
        judge each link against its kind (Thunderbolt, Ethernet, Wi-Fi); on a node with several NVIDIA GPUs, the
        NCCL all-reduce bus bandwidth between them."""
        from rich.console import Console

        from coordinator.cli.common import load
        from coordinator.fleet.nettestrun import run_nettest
        from coordinator.views.render import dumps

        inv, _ = load(inventory, None, limit)
        console = Console(stderr=as_json)

        def progress(a: str, b: str) -> None:
            if not as_json:
                console.print(f"[dim]measuring {a} ↔ {b} ...[/dim]")

        report = run_async(run_nettest(inv, seconds=seconds, pings=pings, connect_timeout=connect_timeout,
                                       accept_new_host_keys=accept_new_host_keys, progress=progress))
        if as_json:
            click.echo(dumps(report.to_json(strict=strict)))
        else:
            render_nettest(report, console, strict=strict)
        sys.exit(0 if report.ok(strict=strict) else 1)
