"""`coordinator attach RUN_ID` and `coordinator stop RUN_ID`: act on a run another coordinator started.

The job does not depend on the coordinator process: mlx.launch runs in its own session and the ranks on the
nodes. `runs/<id>/meta.json` (written at each launch) names the attempt's nodes, ranks, node run dirs and the
launcher's PID; the nodes' event files hold everything else, so a new coordinator rebuilds the monitor's state
by replaying them.

One coordinator supervises a run (coordinator/run/supervision.py): `attach` refuses while the run's lock is held
by a live one, and `stop` then asks that one to stop instead of pulling the run from under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.playbook import Playbook, load_playbook
from coordinator.errors import ConfigError, CoordinatorError
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet
from coordinator.models import Inventory
from coordinator.run.job import Attempt, JobOptions, JobUI, QuietUI, run_log, supervise, supervised_run, watch
from coordinator.run.launch import Launch, RunSummary, ViewFn, summarize, write_summary
from coordinator.run.launchfiles import RankPlan
from coordinator.run.monitor import RunState
from coordinator.run.quarantine import QuarantineStore
from coordinator.run.rundir import (
    META,
    PLAN,
    PLAYBOOK,
    SUMMARY,
    RunMeta,
    SummaryFile,
    read_hostfile,
    read_json_object,
    read_meta,
    read_summary,
    run_inventory,
)
from coordinator.run.stages import recorded_layout
from coordinator.run.supervision import (
    LOCK_NAME,
    RunBusy,
    Supervision,
    clear_stop_request,
    holder_of,
    holding,
    request_stop,
)

STOP_WAIT_S = 120.0  # how long `coordinator stop` waits for a live coordinator to carry out its request


def _playbook(run_dir: Path, meta: RunMeta) -> Playbook:
    playbook_path = meta.playbook
    return load_playbook(playbook_path if playbook_path and Path(playbook_path).exists() else run_dir / PLAYBOOK)


def _adopt(fleet: Fleet, run_dir: Path, meta: RunMeta, inv: Inventory, pb: Playbook,
           view: ViewFn | None) -> Launch:
    by_name = {n.name: n for n in inv.nodes}
    if any(r.batch_size is None for r in meta.ranks):
        raise ConfigError(f"{run_dir / META}: a rank has no batch_size: the run cannot be adopted")
    ranks = [RankPlan(r.rank, by_name[r.node], r.batch_size or 0, r.calibrated_tokens_per_s) for r in meta.ranks]
    hostfile = read_hostfile(run_dir)
    launch = Launch(fleet, pb, ranks, hostfile, {}, run_id=meta.run_id, run_dir=run_dir, view=view,
                    attempt=meta.attempt)
    launch.remote_run_dirs = dict(meta.remote_run_dirs)
    launch.launcher_pid = meta.launcher_pid
    launch.inventory_path = meta.inventory
    launch.remote_tmp = meta.remote_tmp_dir or launch.remote_tmp
    # What every attempt of the run carries on, whoever supervises it (`job.supervise`).
    launch.left_out = [dict(x) for x in meta.left_out]
    launch.drill = meta.drill
    launch.restart_from_scratch = meta.restart_from_scratch
    launch.predicted_tokens_per_s = meta.predicted_tokens_per_s
    # How the ranks share the model, as the attempt was launched: the monitor's replica groups (a pipeline's stages
    # vote on no digest) and every view's stages are launch's.
    plan = read_json_object(run_dir / PLAN)
    strategy = plan.get("strategy") if plan is not None else None
    launch.run_layout = recorded_layout(meta.layout, [(r.rank, r.node) for r in meta.ranks],
                                        strategy if isinstance(strategy, Mapping) else None)
    if launch.run_layout is not None:
        launch.layout = launch.run_layout.worker_layout()
    return launch


class RunEnded(CoordinatorError):
    """The run has ended: its summary.json, written by the coordinator that saw it end, is its record and is not
    rewritten (a job error's message, cause, remedy and incidents included). Not a failure: exit 0."""

    exit_code = 0

    def __init__(self, run_id: str, summary: SummaryFile) -> None:
        self.summary = summary
        super().__init__(f"run {run_id} already ended: {summary.state or 'failed'} at step {summary.steps or 0}")


def ended_summary(run_dir: Path) -> SummaryFile | None:
    """The run's summary.json when it records how the run's current session ended: written after meta.json (which
    each attempt's start rewrites: a summary older than it is an earlier session's, before a `--resume`). None
    while the run has not ended, or its coordinator died before writing it. Read under the run's lock."""
    try:
        if (run_dir / SUMMARY).stat().st_mtime_ns < (run_dir / META).stat().st_mtime_ns:
            return None
    except FileNotFoundError:
        return None
    return read_summary(run_dir)


async def attach(run_dir: Path, *, inventory: str | None = None, ui: JobUI | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, supervision: Supervision | None = None,
                 allow_shared: bool = True) -> RunSummary:
    """Supervise a running job whose coordinator is gone, to its end, as `launch` would: the same monitor, the
    same fault response (quarantine, relaunch on the survivors), the same teardown and summary.json.
    RunBusy while a live coordinator holds the run's lock."""
    ui = ui or QuietUI()
    sup = supervision or Supervision()
    meta = read_meta(run_dir)
    run_id = meta.run_id
    inv = run_inventory(meta, inventory)
    pb = _playbook(run_dir, meta)
    with supervised_run(run_dir, run_id, inv.nodes, verb="attach", allow_shared=allow_shared, ui=ui):
        ended = ended_summary(run_dir)  # under the lock: the coordinator that saw the end has written it
        if ended is not None:
            raise RunEnded(run_id, ended)
        with run_log(run_dir, run_id, inv, pb, run_root=run_dir.parent):
            return await _supervise_adopted(run_dir, meta, inv, pb, ui, sup, connect_timeout)


async def _supervise_adopted(run_dir: Path, meta: RunMeta, inv: Inventory, pb: Playbook, ui: JobUI,
                             sup: Supervision, connect_timeout: float) -> RunSummary:
    """attach's supervision, the run's lock and log held: adopt the attempt, watch it, answer its end."""
    sup.run_dir = run_dir
    async with Fleet(inv.nodes, connect_timeout=connect_timeout) as fleet:
        await _connect_through_a_signal(fleet)
        launch = _adopt(fleet, run_dir, meta, inv, pb, ui.progress)
        launch.should_stop = sup.stop_reason
        monitor = await watch(launch, sup)
        adopted = Attempt(launch.attempt, list(launch.nodes), monitor, launch, None)
        opts = JobOptions(run_root=run_dir.parent, connect_timeout=connect_timeout)
        return await supervise(fleet, inv, pb, opts, ui, QuarantineStore(), meta.run_id, run_dir, adopted, {}, sup)


async def _connect_through_a_signal(fleet: Fleet) -> None:
    """Connect the fleet even when a signal comes meanwhile. The run is already running: a signal to `attach`
    asks it to stop the run (`watch` does, at once, as its monitor starts: `Supervision.stop_reason`), which
    needs the connections; the run must not be left as if nobody had been asked. A second signal is not a
    cancellation (cli.common.run_supervised)."""
    connecting = asyncio.ensure_future(fleet.connect_all())
    try:
        await asyncio.shield(connecting)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        await connecting


@dataclass(frozen=True)
class StopResult:
    """How the run ended, as its summary.json says (whoever wrote it: this process or the live coordinator)."""

    run_id: str
    state: str  # "stopped", or how it ended before the stop was carried out (`already_ended`)
    steps: int
    message: str

    @property
    def already_ended(self) -> bool:
        return self.state != "stopped"


async def stop(run_dir: Path, *, inventory: str | None = None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
               wait_s: float = STOP_WAIT_S) -> StopResult:
    """Stop a run cleanly. A live coordinator is asked to (`stop-request`; it tears down and writes the summary,
    `stopped`, nothing quarantined) and waited for; without one, this process takes the run's lock and stops
    the launcher's process group, every rank on every node and our temp files itself."""
    meta = read_meta(run_dir)
    run_id = meta.run_id
    if holder_of(run_dir / LOCK_NAME) is not None:
        return await _ask_to_stop(run_dir, run_id, wait_s)
    with holding(run_dir, "stop", run_id):
        # Under the lock: a coordinator that was just ending has written its summary and released it by now.
        ended = ended_summary(run_dir)
        if ended is not None:
            return StopResult(run_id, ended.state or "failed", ended.steps or 0, ended.message or "")
        inv = run_inventory(meta, inventory)
        async with Fleet(inv.nodes, connect_timeout=connect_timeout) as fleet:
            await fleet.connect_all()
            launch = _adopt(fleet, run_dir, meta, inv, _playbook(run_dir, meta), None)
            mon = launch.new_monitor()
            mon.stopped = True
            await launch.teardown(mon)
            # Nobody followed the run to here: its record is what the nodes' files hold (the steps its events
            # and checkpoints prove; every rank may even have finished before the stop).
            await launch.read_record(mon, record=False)
        state = mon.outcome() or RunState.STOPPED
        summary = summarize(launch, mon, launch.split(),
                            "stopped by `coordinator stop`" if state is RunState.STOPPED else "")
        summary.left_out = list(launch.left_out)
        write_summary(run_dir, summary)
        return StopResult(summary.run_id, str(summary.state), summary.steps, summary.message)


async def _ask_to_stop(run_dir: Path, run_id: str, wait_s: float) -> StopResult:
    """Leave a stop request for the live coordinator and wait until it has released the run (its summary is
    then written). The request stays if the wait runs out: that coordinator acts on it at its next tick."""
    holder = holder_of(run_dir / LOCK_NAME)
    request_stop(run_dir)
    deadline = time.monotonic() + wait_s
    while holder_of(run_dir / LOCK_NAME) is not None:
        if time.monotonic() > deadline:
            who = holder.describe() if holder else "its coordinator"
            raise CoordinatorError(f"run {run_id}: asked {who} to stop; it has not finished within {wait_s:g}s "
                                   "(the request stands: it is carried out once the attempt's monitor runs)")
        await asyncio.sleep(0.2)
    # The request was for that coordinator, which is gone (it may have ended the run before seeing it): no
    # request is left behind in the run dir, unless a new holder took the run meanwhile.
    with contextlib.suppress(RunBusy), holding(run_dir, "stop", run_id):
        clear_stop_request(run_dir)
    written = read_summary(run_dir)
    if written is None:
        raise CoordinatorError(f"run {run_id}: its coordinator ended without a summary.json")
    return StopResult(run_id, written.state or "failed", written.steps or 0, written.message or "")
