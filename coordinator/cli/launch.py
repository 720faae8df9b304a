"""`coordinator launch`: preflight, calibrate, split, hostfile, mlx.launch, monitor, tear down (coordinator/run/job.py;
`kind: map` playbooks: coordinator/run/mapjob.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from coordinator.cli.common import (
    DEFAULT_INVENTORY,
    DEFAULT_PLAYBOOK,
    exit_for,
    handle_errors,
    job_options,
    load,
    message_note,
    print_incidents,
    with_live_view,
)
from coordinator.errors import ConfigError
from coordinator.models import DEFAULT_METRICS_HOST

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.config.playbook import Playbook
    from coordinator.models import Inventory
    from coordinator.run.job import JobOptions
    from coordinator.run.launch import RunSummary
    from coordinator.run.supervision import Supervision
    from coordinator.views.liveview import RichUI


@click.option("-i", "--inventory", default=DEFAULT_INVENTORY, show_default=True, help="The fleet.")
@click.argument("playbook", default=DEFAULT_PLAYBOOK, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print summary.json at the end (progress goes to stderr).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True,
              help="Where runs/<run-id>/ is written.")
@click.option("--skip-preflight", is_flag=True, help="Launch even if preflight fails (findings are still shown).")
@click.option("--fix", is_flag=True, help="Before preflight decides: `setup` the nodes whose software check fails, "
              "`sync` those whose model/data differ or are missing, preflight again (docs/setup.md).")
@click.option("--fix-source", metavar="NODE|DIR", help="With --fix: sync from this node, or from this local dir "
              "holding model/ and data/ [default: a node whose copy passes, else the playbook's paths here].")
@click.option("--recalibrate", is_flag=True, help="Measure every node again instead of using cached curves.")
@click.option("--resume", metavar="RUN_ID", help="Continue RUN_ID from its newest checkpoint that is consistent.")
@click.option("--restart-from-scratch", is_flag=True,
              help="With --resume: when no checkpoint is valid, set the invalid ones aside and start at step 0 "
                   "(without it such a resume refuses).")
@click.option("--limit", help="Comma-separated node names to run on.")
@click.option("--accept-new-host-keys", is_flag=True, help="Record unknown host keys (a changed key always fails).")
@click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300))
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve the run's Prometheus metrics on this port (0: any free port).")
@click.option("--metrics-host", default=DEFAULT_METRICS_HOST, show_default=True,
              help="Address the metrics endpoint binds (0.0.0.0 exposes it to the network).")
@click.option("--chaos", "chaos_specs", multiple=True, metavar="SPEC",
              help="Inject a fault for drills/tests, e.g. kill:rank=1,step=20 (docs/faults.md). Repeatable.")
@click.option("--allow-degraded", is_flag=True,
              help="Start even though quarantined nodes are left out (else: exit 1 unless faults.min_nodes is set).")
@click.option("--allow-shared", is_flag=True, help="Run on nodes another live run holds (warned) instead of refusing.")
@click.option("--detach-on-hangup", is_flag=True,
              help="On SIGHUP (a closed terminal) leave the run running for `coordinator attach` instead of stopping it.")
@click.option("--dashboard", "with_dashboard", is_flag=True, help="Serve the web dashboard beside the run.")
@click.option("--dashboard-host", default=DEFAULT_METRICS_HOST, show_default=True,
              help="Address the dashboard binds (every request needs the printed token).")
@click.option("--dashboard-port", default=8050, show_default=True, type=click.IntRange(0, 65535))
@click.option("--keep-dashboard", is_flag=True,
              help="With --dashboard: keep serving the page after the run ends, until Ctrl-C (make demo DASHBOARD=1).")
@handle_errors
def launch(inventory: str, playbook: str, as_json: bool, run_dir: Path, skip_preflight: bool, recalibrate: bool,
           resume: str | None, restart_from_scratch: bool, limit: str | None, accept_new_host_keys: bool,
           connect_timeout: float, metrics_port: int | None, metrics_host: str, chaos_specs: tuple[str, ...],
           allow_degraded: bool, allow_shared: bool, detach_on_hangup: bool, with_dashboard: bool,
           dashboard_host: str, dashboard_port: int, keep_dashboard: bool, fix: bool, fix_source: str | None) -> None:
    """Run PLAYBOOK (default playbooks/smoke.yaml) on the inventory: preflight, calibrate, split, write the
    hostfile, start mlx.launch, monitor every rank, tear down. Exits 0 only when training finished.
    A `kind: map` playbook runs each node's shard independently instead (coordinator/run/mapjob.py)."""
    import dataclasses

    from coordinator.planning.plan import describe_prediction
    from coordinator.preflight.fix import fix_options
    from coordinator.run.chaos import parse_chaos
    from coordinator.run.job import JobUI, run_job
    from coordinator.run.metrics import MetricsServer, MetricsUI
    from coordinator.run.replay import describe_memory
    from coordinator.run.supervision import Supervision
    from coordinator.views.liveview import RichUI, make_console
    from coordinator.views.render import dumps

    if keep_dashboard and not with_dashboard:
        raise ConfigError("--keep-dashboard keeps the page of --dashboard up after the run: add --dashboard")
    inv, pb = load(inventory, playbook, limit)
    assert pb is not None
    console = make_console(stderr=as_json)
    ui = RichUI(console)
    opts = job_options(run_dir, skip_preflight, recalibrate, resume, connect_timeout, accept_new_host_keys,
                        restart_from_scratch, allow_degraded, allow_shared)
    opts = dataclasses.replace(opts, fix=fix_options(fix, fix_source))
    sup = Supervision(detach_on_hangup=detach_on_hangup)
    if pb.kind == "map":
        if chaos_specs or metrics_port is not None or restart_from_scratch or detach_on_hangup:
            raise ConfigError("--chaos, --metrics-port, --restart-from-scratch and --detach-on-hangup are for "
                              "training jobs (kind: train)", path=pb.path)
        _launch_map(inv, pb, opts, ui, console, as_json, sup)
        return
    # With nccl (or auto) a node may run one rank per GPU: the world is known once its facts are in (job.check_chaos).
    world = None if pb.backend in ("nccl", "auto") else len(inv.nodes)
    chaos = [parse_chaos(spec, world_size=world, iters=pb.train.iters) for spec in chaos_specs]
    server = MetricsServer(metrics_port, metrics_host) if metrics_port is not None else None
    job_ui: JobUI = MetricsUI(ui, server) if server is not None else ui
    verdicts: dict[str, str] = {}  # each node's preflight, for the dashboard's fleet page
    if with_dashboard:
        from coordinator.views.dashboard.fleet import PreflightRecorder

        job_ui = PreflightRecorder(job_ui, verdicts)
    job = run_job(inv, pb, opts, job_ui, chaos=chaos, supervision=sup)
    said: list[RunSummary] = []  # the summary, once shown

    def show(summary: RunSummary) -> None:
        if said or as_json:
            return
        said.append(summary)
        style = "green" if summary.state == "succeeded" else "red"
        resumed = summary.resumed_from
        console.print(f"[{style}]{summary.state}[/{style}] run {summary.run_id}: {summary.steps}/{summary.iters} steps, "
                      f"{len(summary.incidents)} incident(s); summary {summary.run_dir}/summary.json"
                      + (f"; resumed from step {resumed['step']}" if resumed else "") + message_note(summary))
        pipeline = summary.strategy == "pipeline"
        throughput = describe_prediction(summary.tokens_per_s, summary.predicted_tokens_per_s, steps=summary.steps,
                                         ranks=len(summary.split), compute=summary.compute_tokens_per_s,
                                         predicted_compute=summary.predicted_compute_tokens_per_s,
                                         pipeline=pipeline, rehearsed=summary.rehearsed_steps)
        console.print(f"throughput: {throughput}", markup=False, highlight=False)
        memory = describe_memory(summary.nodes)
        if memory is not None:
            console.print(f"memory (peak vs plan): {memory}", markup=False, highlight=False)
        print_incidents(console, summary)

    if with_dashboard:  # served on the launch's own event loop; it ends with the job (or, kept, at Ctrl-C)
        from coordinator.views.dashboard.fleet import beside, linger_until_interrupted

        urls: list[str] = []

        def announce(url: str) -> None:
            urls.append(url)
            ui.message(f"dashboard: {url}")

        async def linger(summary: RunSummary) -> None:
            ui.close()  # the live view's last frame before the result lines
            show(summary)
            await linger_until_interrupted(sup, say=lambda text: console.print(text, style="bold", markup=False,
                                                                               highlight=False),
                                           url=urls[-1] if urls else "")

        job = beside(job, inv, run_dir, host=dashboard_host, port=dashboard_port, preflight=verdicts,
                     announce=announce, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                     linger=linger if keep_dashboard else None)
    try:
        summary = with_live_view(job, ui, console, sup)
    finally:
        if server is not None:
            server.close()
    if as_json:
        click.echo(dumps(summary.to_json()))
    show(summary)
    exit_for(summary, sup, console)


def _launch_map(inv: Inventory, pb: Playbook, opts: JobOptions, ui: RichUI, console: Console, as_json: bool,
                sup: Supervision) -> None:
    from coordinator.run.mapjob import run_map
    from coordinator.views.render import dumps

    summary = with_live_view(run_map(inv, pb, opts, ui), ui, console, sup)
    if as_json:
        click.echo(dumps(summary.to_json()))
    else:
        style = "green" if summary.state == "succeeded" else "red"
        console.print(f"[{style}]{summary.state}[/{style}] map run {summary.run_id}: {summary.rows_done}/{summary.rows} "
                      f"rows, {len(summary.incidents)} incident(s); output {summary.output}")
        for inc in summary.incidents:
            console.print(f"  [red]{inc.kind}[/red] node {inc.node}: {inc.action}; {str(inc.evidence)[:300]}")
    if sup.signum is not None:
        from coordinator.run.supervision import exit_code_for

        sys.exit(exit_code_for(sup.signum))
    sys.exit(0 if summary.state == "succeeded" else 1)


def register(main: click.Group) -> None:
    main.command("launch")(launch)
