"""Time the run's first steps before it starts, where ranks share a machine (the plan's `Rehearsal`).

Ranks on one machine (the demo's two local nodes, the GPUs of one box) slow each other in ways that nothing measured
apart sees: calibration times their compute side by side (lockstep) and the gradient all_sum alone, but in the run
a rank's all_sum waits on a neighbour still computing on the same cores, and one rank's host work between steps
(a checkpoint, an event) delays the other's next exchange. On a 2-core machine the demo ran 30-65% below a
prediction built from those parts. So for these ranks the step is measured as the run takes it: REHEARSAL_STEPS
steps of the run itself (its playbook, split, hostfile, data and checkpoint cadence; its eval left out, which no
step time counts), launched, monitored and torn down as an attempt is (`launch.Launch`), under a run id of its own
(`<run id>-rehearsal`). Its rate, the run's own statistic, becomes the prediction (`plan.with_rehearsal`), moved
from the tokens its steps carried to those the run's steps carry (rank 0 counts them from the data order:
`token_census`; planning/steptime.py): on variable-length rows the run's first steps are not its typical ones.

Nothing of it is kept: its local run dir is a temp dir, and on each node its own run dir (made by this launch, under
`<workdir>/runs/<run id>-rehearsal/<node>`) is removed afterwards.

Failure semantics: never raises for the run's sake. A rehearsal that fails (a rank crashes, hangs, cannot start)
returns its reason in words; the caller keeps calibration's prediction and says why, and the run itself then meets
(and answers) whatever the fault was. A stop (a signal, `coordinator stop`) ends it at once like an attempt.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from coordinator.config.playbook import Playbook
from coordinator.errors import CoordinatorError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.transport import Fleet
from coordinator.models import Node
from coordinator.planning.hostfile import Hostfile
from coordinator.planning.plan import Plan, PlanError, Rehearsal
from coordinator.planning.steptime import median_tokens, rate_over_run
from coordinator.run.launch import Launch
from coordinator.run.launchfiles import RankPlan
from coordinator.run.monitor import Monitor, RunState
from coordinator.run.rundir import PlanRecord
from coordinator.run.supervision import Supervision
from worker.runconfig import Layout

REHEARSAL_STEPS = 16
# Its first steps trace the step's graphs for each new batch shape (per process, whatever MLX's kernel cache holds):
# left out of its rate. 16 steps of the demo are ~1.5 s beside its ~5 s of start-up; with 8 and every step counted,
# five demo rehearsals on a quiet 2-core machine ranged -23% to +39% of their runs (their medians of 8 swing).
WARMUP_STEPS = 3
SUFFIX = "-rehearsal"

Progress = Callable[[str], None]


def rehearsal_steps(iters: int) -> int | None:
    """How many steps a run of `iters` rehearses: REHEARSAL_STEPS, or None for a run no longer than that (the
    rehearsal would be the run again; the end-of-run line holds it to calibration)."""
    return REHEARSAL_STEPS if iters > REHEARSAL_STEPS else None


def rehearsal_playbook(pb: Playbook, steps: int) -> Playbook:
    """The run's playbook cut to `steps` steps, its eval left out (no step time counts it)."""
    return pb.model_copy(update={"train": pb.train.model_copy(update={"iters": steps,
                                                                      "steps_per_eval": steps + 1})})


async def rehearse(fleet: Fleet, run_pb: Playbook, nodes: Sequence[Node], plan: Plan, hostfile: Hostfile,
                   facts: Mapping[str, NodeFacts], *, run_id: str, layout: Layout, sup: Supervision, shared: str,
                   steps: int, progress: Progress) -> Rehearsal | str:
    """`steps` steps of the run over `nodes` (rank order) with `plan`'s batches; the rehearsal, or why there is
    none (see the module docstring)."""
    pb = rehearsal_playbook(run_pb, steps)
    rid = f"{run_id}{SUFFIX}"
    ranks = [RankPlan(i, node, plan.batch[node.name], plan.node_tokens_per_s(node.name))
             for i, node in enumerate(nodes)]
    local = Path(tempfile.mkdtemp(prefix="mlxc-rehearsal-"))
    launch = Launch(fleet, pb, ranks, hostfile, facts, run_id=rid, run_dir=local / rid)
    launch.layout = layout
    launch.token_census = run_pb.train.iters  # the run's steps: their median tokens (planning/steptime.py)
    launch.should_stop = sup.stop_reason
    monitor: Monitor | None = None
    progress(f"rehearsing {steps} steps of the run: {shared}, and ranks side by side slow each other in ways "
             "calibration times apart (their compute, the all_sum, the work between steps); its rate is the prediction")
    try:
        record = PlanRecord(split=dict(plan.split), batch=dict(plan.batch), global_batch=plan.global_batch,
                            mode=str(plan.mode), predicted_tokens_per_s=plan.predicted_tokens_per_s,
                            backend=hostfile.backend, attempt=0)
        local_hostfile = launch.write_local_files(record)
        await launch.prepare()
        launch.start_launcher(local_hostfile)
        monitor = await launch.monitor()
    except (CoordinatorError, OSError) as exc:  # nodes it could not prepare, a launcher that did not start
        return f"the rehearsal could not start ({exc})"
    finally:
        await launch.teardown(monitor or launch.current_monitor)
        await _remove_node_dirs(fleet, launch, rid)
        shutil.rmtree(local, ignore_errors=True)
    return read_rehearsal(monitor, steps=steps, shared=shared)


def read_rehearsal(monitor: Monitor, *, steps: int, shared: str) -> Rehearsal | str:
    """The rehearsal an ended monitor measured, or why it measured none. Pure."""
    if monitor.stopped:
        return "stopped"
    outcome = monitor.outcome()
    if outcome is not RunState.SUCCEEDED:
        incident = next((i for i in monitor.incidents), None)
        what = f"{incident.kind} on {incident.node} at step {incident.step}" if incident is not None else str(outcome)
        return f"the rehearsal did not finish ({what})"
    warmup = WARMUP_STEPS if steps > 2 * WARMUP_STEPS else 0
    rate = monitor.run_tokens_per_s(after=warmup)
    if rate is None or rate <= 0:
        return "the rehearsal reported no step"
    timed_steps = [step for step in sorted(monitor.step_work) if step > warmup]
    samples = [monitor.step_work[step] for step in timed_steps]
    over_run = rate_over_run(samples, monitor.run_step_tokens, rate, census=monitor.run_census,
                             compiled=[step in monitor.compiling_steps for step in timed_steps])
    moved = over_run / rate
    compute = monitor.run_compute_tokens_per_s(after=warmup)
    timed_tokens = median_tokens(samples)
    step_tokens = None
    if monitor.run_step_tokens is not None and timed_tokens is not None:
        step_tokens = (timed_tokens, monitor.run_step_tokens)
    try:
        return Rehearsal(steps, over_run, compute * moved if compute is not None else None, shared,
                         timed_tokens_per_s=rate, step_tokens=step_tokens)
    except PlanError as exc:
        return str(exc)


async def _remove_node_dirs(fleet: Fleet, launch: Launch, rid: str) -> None:
    """Each node's rehearsal run dir (only a dir this launch made and named: `.../runs/<rid>/<node>`), then its
    parent when empty. Best effort: a node that cannot be reached keeps a few small files, nothing else."""
    async def one(name: str, path: str) -> None:
        if not path.endswith(f"/runs/{rid}/{name}"):
            return
        parent = path.rsplit("/", 1)[0]
        await fleet.transports[name].run(
            ["sh", "-c", f"rm -rf -- {shlex.quote(path)}; rmdir -- {shlex.quote(parent)} 2>/dev/null; exit 0"],
            timeout=60)

    await asyncio.gather(*(one(n, p) for n, p in launch.remote_run_dirs.items()), return_exceptions=True)


__all__ = ["REHEARSAL_STEPS", "read_rehearsal", "rehearsal_playbook", "rehearsal_steps", "rehearse"]
