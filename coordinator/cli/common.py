"""What the verbs of `coordinator/cli/` share: the event loop (`run_async`, `run_supervised`), error handling
and exit codes (`handle_errors`, `exit_for`), loading the inventory and playbook (`load`), the common SSH options,
a job's options and live view, and how a run's result is printed."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Coroutine
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from coordinator.errors import ConfigError, CoordinatorError

# Each verb imports what it needs when it runs: `coordinator preflight` must not pay for importing the launcher,
# the live view, map jobs and the Prometheus client (~0.4 s of a ~1 s start-up).
if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.config.playbook import Playbook
    from coordinator.models import Inventory
    from coordinator.run.job import JobOptions
    from coordinator.run.launch import RunSummary
    from coordinator.run.supervision import Supervision
    from coordinator.views.liveview import NodeBars, RichUI


F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


DEFAULT_INVENTORY = "inventory/local.yaml"
DEFAULT_PLAYBOOK = "playbooks/smoke.yaml"


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
        raise Interrupted(sup.signum, "before the launch: nothing was left running") from None


class Interrupted(CoordinatorError):
    def __init__(self, signum: int, detail: str) -> None:
        import signal

        from coordinator.run.supervision import exit_code_for

        self.exit_code = exit_code_for(signum)
        super().__init__(f"interrupted by {signal.Signals(signum).name} {detail}")


def exit_for(summary: RunSummary, sup: Supervision, console: Console) -> None:
    """A run's exit code: 128 + the signal that stopped it, else 0 only when it succeeded (also when a signal came
    after every rank had finished: the run was not stopped)."""
    from coordinator.run.supervision import exit_code_for

    if sup.signum is not None and summary.state != "succeeded":
        if sup.detach:
            console.print(f"detached on SIGHUP: run {summary.run_id} goes on; supervise it again with "
                          f"`coordinator attach {summary.run_id} --run-dir {Path(summary.run_dir).parent}`")
        sys.exit(exit_code_for(sup.signum))
    sys.exit(0 if summary.state == "succeeded" else 1)


def fail(message: str, code: int) -> None:
    click.echo(f"coordinator: error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: F) -> F:
    """Turn our errors into a one-line message and an exit code; never a traceback for expected failures."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            fail(exc.location_message(), 2)
        except CoordinatorError as exc:
            fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        return None

    return wrapper  # type: ignore[return-value]


def load(inventory: str, playbook: str | None, limit: str | None) -> tuple[Inventory, Playbook | None]:
    from coordinator.config.inventory import load_inventory
    from coordinator.config.playbook import load_playbook
    from coordinator.models import parse_limit

    inv = load_inventory(inventory)
    inv = inv.limit(parse_limit(limit))
    pb = load_playbook(playbook) if playbook else None
    return inv, pb


def hash_progress(console: Console, enabled: bool) -> NodeBars:
    """Hashing progress for large models (the probe reports it on stderr)."""
    from coordinator.views.liveview import NodeBars

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


def job_options(run_dir: Path, skip_preflight: bool, recalibrate: bool, resume: str | None,
                 connect_timeout: float, accept_new_host_keys: bool, restart_from_scratch: bool = False,
                 allow_degraded: bool = False, allow_shared: bool = False) -> JobOptions:
    from coordinator.run.job import JobOptions

    if restart_from_scratch and resume is None:
        raise ConfigError("--restart-from-scratch applies to --resume RUN_ID only")
    return JobOptions(run_root=run_dir, skip_preflight=skip_preflight, recalibrate=recalibrate, resume=resume,
                      connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                      restart_from_scratch=restart_from_scratch, allow_degraded=allow_degraded,
                      allow_shared=allow_shared)


def with_live_view(job: Coroutine[Any, Any, T], ui: RichUI, console: Console, sup: Supervision) -> T:
    """Run a job with its live view, which is closed (and a failed preflight shown) whatever happens."""
    from coordinator.run.job import PreflightFailed
    from coordinator.views.render import render_preflight

    try:
        return run_supervised(job, sup)
    except PreflightFailed as exc:
        ui.close()
        render_preflight(exc.report, console)
        raise
    finally:
        ui.close()


def message_note(summary: RunSummary) -> str:
    """Why the run ended (a stop, a signal, giving up), for the one-line result; a job error is left to
    `print_incidents`, which prints it once with its cause and remedy."""
    from rich.markup import escape

    if not summary.message or any(i.kind == "job_error" for i in summary.incidents):
        return ""
    return escape(f" ({summary.message})")


def print_incidents(console: Console, summary: RunSummary) -> None:
    from rich.markup import escape

    from coordinator.run.monitor import describe_incident, describe_recovery

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
        console.print(f"  [red]{inc.kind}[/red] {escape(describe_incident(inc).split(': ', 1)[-1])}{after}; "
                      f"action {inc.action} (node {inc.node}" + (f" rank {inc.rank}" if inc.rank is not None else "")
                      + ")", highlight=False)
    for rec in summary.recoveries:
        console.print(f"  {escape(describe_recovery(rec))}", highlight=False)

