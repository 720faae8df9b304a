"""The `coordinator` command line. The ONLY place that prints errors for users and chooses exit codes.

Exit codes: 0 ok, 1 a check failed / the job failed, 2 usage or configuration error (or a run another live
coordinator supervises), 128 + the signal that stopped a job: 130 SIGINT (Ctrl-C), 143 SIGTERM, 129 SIGHUP.
Each verb is a thin wrapper: find the behaviour behind it one hop away (preflight.py, gather.py, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import Callable, Coroutine
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from coordinator.errors import ConfigError, CoordinatorError
from coordinator.models import DEFAULT_METRICS_HOST

# Each verb imports what it needs when it runs: `coordinator preflight` must not pay for importing the launcher,
# the live view, map jobs and the Prometheus client (~0.4 s of a ~1 s start-up). Operator verbs in
# coordinator/verbs/ are imported only when named (LazyGroup below).
if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.job import JobOptions
    from coordinator.launch import RunSummary
    from coordinator.liveview import NodeBars, RichUI
    from coordinator.models import Inventory
    from coordinator.playbook import Playbook
    from coordinator.supervision import Supervision

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

DEFAULT_INVENTORY = "inventory/local.yaml"
DEFAULT_PLAYBOOK = "playbooks/smoke.yaml"


def entry() -> None:
    """The `coordinator` console script.

    A verb's start-up imports (asyncssh, pydantic, yaml: ~0.25 s, before the first node is contacted) allocate
    a few hundred thousand objects that live as long as the process, and the cyclic garbage collector would
    walk them again at every threshold: ~12% of the start-up. So it is off until `run_async` starts the verb's
    event loop, which freezes what exists by then out of the collector's sight and turns it back on. A verb that
    never starts a loop is short-lived. (Not in `main`: tests call that in-process, and must keep their GC.)"""
    gc.disable()
    main()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Every verb's event loop starts here (see `entry`)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
    return asyncio.run(coro)


def run_supervised(coro: Coroutine[Any, Any, T], sup: Supervision) -> T:
    """A job's event loop, with SIGINT, SIGTERM and SIGHUP recorded in `sup` and answered alike: the job is
    cancelled, and its own handlers stop the run (teardown, summary.json), or leave it running when a hangup
    detaches. A second SIGINT gives up on the teardown at once. The caller exits with `exit_code_for(signum)`."""
    import signal

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on(signum: int) -> None:
            if sup.on_signal(signum):
                task.cancel()
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt  # out of the loop: the operator insists

        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        for signum in handled:
            loop.add_signal_handler(signum, on, signum)
        try:
            return await coro
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    try:
        return run_async(guarded())
    except asyncio.CancelledError:
        # Cancelled before any attempt ran (preflight, calibration): nothing to tear down, no summary.
        if sup.signum is None:
            raise
        raise _Interrupted(sup.signum, "before the launch: nothing was left running") from None


class _Interrupted(CoordinatorError):
    def __init__(self, signum: int, detail: str) -> None:
        import signal

        from coordinator.supervision import exit_code_for

        self.exit_code = exit_code_for(signum)
        super().__init__(f"interrupted by {signal.Signals(signum).name} {detail}")


def _exit_for(summary: RunSummary, sup: Supervision, console: Console) -> None:
    """A run's exit code: 128 + the signal that stopped it, else 0 only when it succeeded."""
    from coordinator.supervision import exit_code_for

    if sup.signum is not None:
        if sup.detach:
            console.print(f"detached on SIGHUP: run {summary.run_id} goes on; supervise it again with "
                          f"`coordinator attach {summary.run_id} --run-dir {Path(summary.run_dir).parent}`")
        sys.exit(exit_code_for(sup.signum))
    sys.exit(0 if summary.state == "succeeded" else 1)


def _fail(message: str, code: int) -> None:
    click.echo(f"coordinator: error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: F) -> F:
    """Turn our errors into a one-line message and an exit code; never a traceback for expected failures."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            _fail(exc.location_message(), 2)
        except CoordinatorError as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        return None

    return wrapper  # type: ignore[return-value]


def _load(inventory: str, playbook: str | None, limit: str | None) -> tuple[Inventory, Playbook | None]:
    from coordinator.inventory import load_inventory
    from coordinator.playbook import load_playbook

    inv = load_inventory(inventory)
    names = [n.strip() for n in limit.split(",") if n.strip()] if limit else None
    inv = inv.limit(names)
    pb = load_playbook(playbook) if playbook else None
    return inv, pb


def _hash_progress(console: Console, enabled: bool) -> NodeBars:
    """Hashing progress for large models (the probe reports it on stderr)."""
    from coordinator.liveview import NodeBars

    return NodeBars(console, enabled, label="hashing {task.description}", transient=True)


common_options = [
    click.option("-i", "--inventory", default=DEFAULT_INVENTORY, show_default=True,
                 help="Inventory: our YAML, an MLX hostfile (JSON) or an Ansible inventory (YAML/INI)."),
    click.option("--limit", help="Comma-separated node names to act on."),
    click.option("--accept-new-host-keys", is_flag=True,
                 help="Record unknown host keys in known_hosts (a CHANGED key always fails)."),
    click.option("--connect-timeout", default=5.0, show_default=True, type=click.FloatRange(0.1, 300),
                 help="Seconds to wait for each node's SSH handshake."),
    click.option("--probe-timeout", default=600.0, show_default=True, type=click.FloatRange(1, 86400),
                 help="Seconds the probe (incl. first hashing of the model) may take per node."),
]


def with_common(fn: F) -> F:
    for option in reversed(common_options):
        fn = option(fn)
    return fn


class LazyGroup(click.Group):
    """The top-level group. Operator verbs live in coordinator/verbs/<name>.py, each adding the command `<name>`
    with its `register(main)`; a module is imported only when its verb is named (or help lists them all)."""

    @staticmethod
    def verb_modules() -> list[str]:
        import pkgutil

        from coordinator import verbs

        return sorted(m.name for m in pkgutil.iter_modules(verbs.__path__))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.verb_modules()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.verb_modules():
            import importlib

            importlib.import_module(f"coordinator.verbs.{cmd_name}").register(self)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-coordinator")
def main() -> None:
    """Cluster coordinator for distributed MLX training on Apple Silicon Macs."""


@main.command()
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

    from coordinator.gather import record_facts
    from coordinator.preflight import collect
    from coordinator.render import dumps, facts_to_json, render_facts

    inv, pb = _load(inventory, playbook, limit)
    console = Console(stderr=as_json)
    with _hash_progress(console, not as_json) as progress:
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


@main.command()
@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True, help="The job to check against.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--strict", is_flag=True, help="Warnings fail too.")
@handle_errors
def preflight(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
              probe_timeout: float, playbook: str, as_json: bool, strict: bool) -> None:
    """Check that every node is ready for the playbook: ssh, os, rdma, thunderbolt, software, model, env,
    resources; plus a lint of the playbook."""
    from coordinator.preflight import collect, evaluate
    from coordinator.render import dumps, render_preflight

    inv, pb = _load(inventory, playbook, limit)
    console: Console | None = None
    if not as_json:  # JSON has no progress display: rich is not even imported
        from rich.console import Console

        console = Console()
    with _hash_progress(console, True) if console is not None else contextlib.nullcontext() as progress:
        result = run_async(collect(inv, pb, connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                                   accept_new_host_keys=accept_new_host_keys, progress=progress))
    report = evaluate(inv, pb, result)
    if console is None:
        click.echo(dumps(report.to_json(strict=strict)))
    else:
        render_preflight(report, console, strict=strict)
    sys.exit(0 if report.ok(strict=strict) else 1)


def _job_options(run_dir: Path, skip_preflight: bool, recalibrate: bool, resume: str | None,
                 connect_timeout: float, accept_new_host_keys: bool, restart_from_scratch: bool = False,
                 allow_degraded: bool = False, allow_shared: bool = False) -> JobOptions:
    from coordinator.job import JobOptions

    if restart_from_scratch and resume is None:
        raise ConfigError("--restart-from-scratch applies to --resume RUN_ID only")
    return JobOptions(run_root=run_dir, skip_preflight=skip_preflight, recalibrate=recalibrate, resume=resume,
                      connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                      restart_from_scratch=restart_from_scratch, allow_degraded=allow_degraded,
                      allow_shared=allow_shared)


@main.command()
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
              help="Address the dashboard binds (any but loopback needs the printed token).")
@click.option("--dashboard-port", default=8050, show_default=True, type=click.IntRange(0, 65535))
@handle_errors
def launch(inventory: str, playbook: str, as_json: bool, run_dir: Path, skip_preflight: bool, recalibrate: bool,
           resume: str | None, restart_from_scratch: bool, limit: str | None, accept_new_host_keys: bool,
           connect_timeout: float, metrics_port: int | None, metrics_host: str, chaos_specs: tuple[str, ...],
           allow_degraded: bool, allow_shared: bool, detach_on_hangup: bool, with_dashboard: bool,
           dashboard_host: str, dashboard_port: int, fix: bool, fix_source: str | None) -> None:
    """Run PLAYBOOK (default playbooks/smoke.yaml) on the inventory: preflight, calibrate, split, write the
    hostfile, start mlx.launch, monitor every rank, tear down. Exits 0 only when training finished.
    A `kind: map` playbook runs each node's shard independently instead (coordinator/mapjob.py)."""
    import dataclasses

    from coordinator.chaos import parse_chaos
    from coordinator.fix import fix_options
    from coordinator.job import JobUI, run_job
    from coordinator.liveview import RichUI, make_console
    from coordinator.metrics import MetricsServer, MetricsUI
    from coordinator.plan import describe_prediction
    from coordinator.render import dumps
    from coordinator.supervision import Supervision

    inv, pb = _load(inventory, playbook, limit)
    assert pb is not None
    console = make_console(stderr=as_json)
    ui = RichUI(console)
    opts = _job_options(run_dir, skip_preflight, recalibrate, resume, connect_timeout, accept_new_host_keys,
                        restart_from_scratch, allow_degraded, allow_shared)
    opts = dataclasses.replace(opts, fix=fix_options(fix, fix_source))
    sup = Supervision(detach_on_hangup=detach_on_hangup)
    if pb.kind == "map":
        if chaos_specs or metrics_port is not None or restart_from_scratch or detach_on_hangup:
            raise ConfigError("--chaos, --metrics-port, --restart-from-scratch and --detach-on-hangup are for "
                              "training jobs (kind: train)", path=pb.path)
        _launch_map(inv, pb, opts, ui, console, as_json, sup)
        return
    chaos = [parse_chaos(spec, world_size=len(inv.nodes)) for spec in chaos_specs]
    server = MetricsServer(metrics_port, metrics_host) if metrics_port is not None else None
    job_ui: JobUI = MetricsUI(ui, server) if server is not None else ui
    verdicts: dict[str, str] = {}  # each node's preflight, for the dashboard's fleet page
    if with_dashboard:
        from coordinator.verbs.dashboard import PreflightRecorder

        job_ui = PreflightRecorder(job_ui, verdicts)
    job = run_job(inv, pb, opts, job_ui, chaos=chaos, supervision=sup)
    if with_dashboard:  # served on the launch's own event loop; it ends with the job
        from coordinator.verbs.dashboard import beside

        job = beside(job, inv, run_dir, host=dashboard_host, port=dashboard_port, preflight=verdicts,
                     announce=lambda url: ui.message(f"dashboard: {url}"), connect_timeout=connect_timeout,
                     accept_new_host_keys=accept_new_host_keys)
    try:
        summary = _with_live_view(job, ui, console, sup)
    finally:
        if server is not None:
            server.close()
    if as_json:
        click.echo(dumps(summary.to_json()))
    else:
        style = "green" if summary.state == "succeeded" else "red"
        resumed = summary.resumed_from
        console.print(f"[{style}]{summary.state}[/{style}] run {summary.run_id}: {summary.steps}/{summary.iters} steps, "
                      f"{len(summary.incidents)} incident(s); summary {summary.run_dir}/summary.json"
                      + (f"; resumed from step {resumed['step']}" if resumed else "") + _message_note(summary))
        console.print(f"throughput: {describe_prediction(summary.tokens_per_s, summary.predicted_tokens_per_s)}",
                      markup=False, highlight=False)
        _print_incidents(console, summary)
    _exit_for(summary, sup, console)


def _with_live_view(job: Coroutine[Any, Any, T], ui: RichUI, console: Console, sup: Supervision) -> T:
    """Run a job with its live view, which is closed (and a failed preflight shown) whatever happens."""
    from coordinator.job import PreflightFailed
    from coordinator.render import render_preflight

    try:
        return run_supervised(job, sup)
    except PreflightFailed as exc:
        ui.close()
        render_preflight(exc.report, console)
        raise
    finally:
        ui.close()


def _launch_map(inv: Inventory, pb: Playbook, opts: JobOptions, ui: RichUI, console: Console, as_json: bool,
                sup: Supervision) -> None:
    from coordinator.mapjob import run_map
    from coordinator.render import dumps

    summary = _with_live_view(run_map(inv, pb, opts, ui), ui, console, sup)
    if as_json:
        click.echo(dumps(summary.to_json()))
    else:
        style = "green" if summary.state == "succeeded" else "red"
        console.print(f"[{style}]{summary.state}[/{style}] map run {summary.run_id}: {summary.rows_done}/{summary.rows} "
                      f"rows, {len(summary.incidents)} incident(s); output {summary.output}")
        for inc in summary.incidents:
            console.print(f"  [red]{inc.kind}[/red] node {inc.node}: {inc.action}; {str(inc.evidence)[:300]}")
    if sup.signum is not None:
        from coordinator.supervision import exit_code_for

        sys.exit(exit_code_for(sup.signum))
    sys.exit(0 if summary.state == "succeeded" else 1)


def _message_note(summary: RunSummary) -> str:
    """Why the run ended (a stop, a signal, giving up), for the one-line result; a job error is left to
    `_print_incidents`, which prints it once with its cause and remedy."""
    from rich.markup import escape

    if not summary.message or any(i.kind == "job_error" for i in summary.incidents):
        return ""
    return escape(f" ({summary.message})")


def _print_incidents(console: Console, summary: RunSummary) -> None:
    from rich.markup import escape

    job_error = next((i for i in summary.incidents if i.kind == "job_error"), None)
    if job_error is not None:
        # Printed once, with its remedy; the ranks' own copies of the message are not repeated below.
        ev = job_error.evidence
        console.print(f"  [red]job error[/red] ({ev.get('reason')}) on {job_error.node}: {escape(str(ev.get('message')))}",
                      highlight=False)
        console.print(escape(f"    cause: {ev.get('cause')}\n    remedy: {ev.get('remedy')}"), highlight=False)
        console.print(f"    quarantined: {', '.join(summary.quarantined) or 'nobody'}", highlight=False)
    for inc in summary.incidents:
        if job_error is not None and (inc is job_error or inc.evidence.get("job_error")):
            continue
        after = "" if inc.detected_after_s is None else f" (detected after {inc.detected_after_s:.1f}s)"
        console.print(f"  [red]{inc.kind}[/red] node {inc.node} rank {inc.rank} step {inc.step}{after}: "
                      f"{inc.action}; {str(inc.evidence)[:300]}")
    for rec in summary.recoveries:
        console.print(f"  relaunch {rec['attempt']}: without {', '.join(rec['culprits']) or 'nobody'} on "
                      f"{', '.join(rec['nodes'])}; first step after {rec.get('first_step_after_s')}s")


@main.command()
@click.argument("run_id")
@click.option("-i", "--inventory", help="Default: the inventory the run was launched with.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--detach-on-hangup", is_flag=True, help="On SIGHUP leave the run running instead of stopping it.")
@handle_errors
def attach(run_id: str, inventory: str | None, run_dir: Path, as_json: bool, detach_on_hangup: bool) -> None:
    """Supervise RUN_ID again (after the coordinator that launched it died) until it ends, with the same fault
    response as `launch`. Refused (exit 2) while a live coordinator supervises it."""
    from coordinator import control
    from coordinator.liveview import RichUI, make_console
    from coordinator.render import dumps
    from coordinator.supervision import Supervision

    console = make_console(stderr=as_json)
    ui = RichUI(console)
    sup = Supervision(detach_on_hangup=detach_on_hangup)
    try:
        summary = run_supervised(control.attach(run_dir / run_id, inventory=inventory, ui=ui, supervision=sup), sup)
    finally:
        ui.close()
    if as_json:
        click.echo(dumps(summary.to_json()))
    else:
        console.print(f"{summary.state} run {summary.run_id}: {summary.steps} steps"
                      + _message_note(summary))
        _print_incidents(console, summary)
    _exit_for(summary, sup, console)


@main.command()
@click.argument("run_id")
@click.option("-i", "--inventory", help="Default: the inventory the run was launched with.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True)
@click.option("--wait", "wait_s", default=120.0, show_default=True, type=click.FloatRange(0, 86400),
              help="Seconds to wait for a live coordinator to carry out the stop.")
@handle_errors
def stop(run_id: str, inventory: str | None, run_dir: Path, wait_s: float) -> None:
    """Stop RUN_ID cleanly: launcher, every rank on every node, temp files; summary state `stopped`, nothing
    quarantined. A live coordinator of the run is asked to do it (and waited for); else this command does."""
    from coordinator import control

    summary = run_async(control.stop(run_dir / run_id, inventory=inventory, wait_s=wait_s))
    if summary.state != "stopped":
        raise CoordinatorError(f"run {summary.run_id} ended {summary.state} at step {summary.steps} before the "
                               f"stop request was carried out ({summary.message or 'no message'})")
    click.echo(f"stopped run {summary.run_id} at step {summary.steps}")


@main.group()
def quarantine() -> None:
    """Nodes left out of launches after a fault (persisted)."""


@quarantine.command("list")
@click.option("-i", "--inventory", help="Only the entries that apply to this inventory's nodes.")
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def quarantine_list(inventory: str | None, as_json: bool) -> None:
    """Show quarantined machines: identity (node, address, inventory), reason, age and expiry."""
    from coordinator.quarantine import QuarantineStore, format_age, inventory_key
    from coordinator.render import dumps

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
    from coordinator.quarantine import QuarantineStore, inventory_key

    gone = QuarantineStore().clear(node, inventory=inventory_key(inventory) if inventory else None)
    if not gone:
        where = f" in {inventory}" if inventory else ""
        raise ConfigError(f"{node} is not quarantined{where} (`coordinator quarantine list`)")
    for e in gone:
        click.echo(f"cleared {e.identity()}")


@main.command()
@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--recalibrate", is_flag=True, help="Measure again instead of using cached curves.")
@handle_errors
def calibrate(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
              probe_timeout: float, playbook: str, as_json: bool, recalibrate: bool) -> None:
    """Measure each node's training throughput and split the playbook's global batch by speed (for a `kind: map`
    playbook: each node's examples/s of the task and the input's shards)."""
    from rich.table import Table

    from coordinator.calibrate import calibration_to_json
    from coordinator.job import calibrate_fleet
    from coordinator.liveview import RichUI, make_console
    from coordinator.mapjob import calibrate_map
    from coordinator.plan import format_split
    from coordinator.render import dumps

    inv, pb = _load(inventory, playbook, limit)
    assert pb is not None
    console = make_console(stderr=as_json)
    opts = _job_options(Path("runs"), False, recalibrate, None, connect_timeout, accept_new_host_keys)
    if pb.split != "calibrated":
        pb = pb.model_copy(update={"split": "calibrated"})  # `calibrate` always measures and shows the calibrated split
    if pb.kind == "map":
        result = run_async(calibrate_map(inv, pb, opts, RichUI(console, show_preflight=False)))
        if as_json:
            click.echo(dumps(result))
            return
        table = Table(title=f"map calibration: {pb.map.task if pb.map else ''} on {pb.model}, {result['rows']} rows")
        for col in ("node", "examples/s", "shard", "rows", "share"):
            table.add_column(col)
        for row in result["nodes"]:
            table.add_row(row["node"], f"{row['examples_per_s']:,.2f}", f"[{row['shard'][0]}, {row['shard'][1]})",
                          str(row["rows"]), f"{100 * row['share']:.1f}%")
        console.print(table)
        return
    plan, cals = run_async(calibrate_fleet(inv, pb, opts, RichUI(console, show_preflight=False)))
    result = calibration_to_json(plan, [cals[n.name] for n in inv.nodes])
    if as_json:
        click.echo(dumps(result))
        return
    table = Table(title=f"calibration: {pb.model} at seq {pb.train.max_seq_length}, global batch {plan.global_batch}")
    for col in ("node", "best tok/s", "at batch", "planned batch", "share", "predicted tok/s", "cached"):
        table.add_column(col)
    for node in inv.nodes:
        cal = cals[node.name]
        table.add_row(node.name, f"{cal.best.tokens_per_s:,.0f}", str(cal.best.batch), str(plan.batch[node.name]),
                      f"{100 * plan.split[node.name]:.1f}%", f"{plan.node_tokens_per_s(node.name) or 0:,.0f}",
                      "yes" if cal.cached else "no")
    console.print(table)
    console.print(f"split: [bold]{format_split(plan)}[/bold]")


@main.command()
@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default stdout).")
@handle_errors
def hostfile(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
             probe_timeout: float, playbook: str, output: Path | None) -> None:
    """Write MLX's JSON hostfile for the playbook's backend (jaccl's rdma matrix from the Thunderbolt facts)."""
    from coordinator.job import hostfile_for
    from coordinator.preflight import collect
    from coordinator.render import dumps

    inv, pb = _load(inventory, playbook, limit)
    assert pb is not None
    needs_facts = pb.backend in ("jaccl", "jaccl-ring", "auto")
    facts = {}
    if needs_facts:
        result = run_async(collect(inv, None, connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                                   accept_new_host_keys=accept_new_host_keys))
        missing = [n.name for n in inv.nodes if n.name not in result.facts]
        if missing:
            raise CoordinatorError(f"no facts from {', '.join(missing)}: the {pb.backend} hostfile needs each "
                                   "node's Thunderbolt topology (run `coordinator preflight`)")
        facts = result.facts
    text = dumps(hostfile_for(inv, pb, facts).to_json()) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:  # a missing or unwritable directory is a usage error, not a traceback
            raise ConfigError(f"-o {output}: cannot write the hostfile ({exc.strerror})") from None
        click.echo(f"wrote {output}", err=True)


if __name__ == "__main__":
    entry()
