"""The main job, end to end: what `coordinator launch` (and `calibrate`/`hostfile`) run.

    connect -> provision assets -> probe (facts) -> preflight (fails stop the launch) -> calibration (cached)
    -> plan -> hostfile -> Launch (mlx.launch + monitor) -> teardown -> summary.json

The steps report to a `JobUI` (the CLI's live view, or nothing in tests); decisions stay in the pure modules
(checks, plan, hostfile, monitor).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from coordinator.config.playbook import Playbook
from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.assets import look_at_dirs, provided_labels, provision
from coordinator.fleet.cachedir import cache_root
from coordinator.fleet.gather import gather_facts
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet, known_host_keys, known_hosts_path
from coordinator.models import Inventory, Node, PreflightReport
from coordinator.planning.collective import CollectiveCost, rescale_collective
from coordinator.planning.colocate import compute_bench_groups, describe_shared
from coordinator.planning.estimate import ModelShape, model_shape
from coordinator.planning.gpuranks import build_rank_nodes, pool_identical_gpus, rank_facts
from coordinator.planning.hostfile import Hostfile, build_hostfile, resolve_backend
from coordinator.planning.pipeline import LayerTiming, StageNode, timing_from_curve
from coordinator.planning.pipesim import LinkCost
from coordinator.planning.plan import (
    NodeCalibration,
    Plan,
    PlanError,
    SplitMode,
    compute_plan,
    fixed_plan,
    per_example_calibration,
    with_collective,
    with_rehearsal,
)
from coordinator.planning.shards import MapRow
from coordinator.planning.shortfall import compute_memory_shortfall
from coordinator.planning.strategy import (
    NO_SEND_RECV_BACKENDS,
    FleetNode,
    NodeBudget,
    StrategyChoice,
    StrategyError,
    compute_strategy_choice,
    format_table,
    per_rank_need,
    pipeline_job,
    pipeline_unsupported,
)
from coordinator.preflight.checks.context import manifest_digest, node_manifest
from coordinator.preflight.fix import (
    FixOptions,
    FixPlan,
    SyncSource,
    check_sync_source_before_setup,
    choose_sync_source,
    compute_fix_plan,
    compute_sync_outcomes,
    describe_fix_plan,
    describe_left,
    parse_dir_states,
    resolve_requested,
)
from coordinator.preflight.pipeline import (
    FleetFacts,
    evaluate,
    fleet_budgets,
    model_config,
    probe_connected,
    resolve_strategy,
    strategy_refusal,
)
from coordinator.run.calibrate import (
    BenchSpec,
    build_plan_nodes,
    calibrate,
    calibrate_layers,
    fingerprint_from_facts,
    plan_step_json,
    sample_horizon,
)
from coordinator.run.chaos import Chaos, check_reachable
from coordinator.run.collective import measure_collective
from coordinator.run.launch import Launch, LaunchError, RunSummary, set_aside_checkpoints_after, summarize, write_summary
from coordinator.run.launchfiles import RankPlan, build_layout, check_run_id, new_run_id, node_run_dir
from coordinator.run.logs import collect_secrets, configure_logging, is_secret_name
from coordinator.run.monitor import FATAL_ACTIONS, Action, Incident, IncidentKind, Monitor, RunState
from coordinator.run.quarantine import (
    Entry,
    LeftOut,
    QuarantineStore,
    check_degraded,
    clear_command,
    compute_left_out,
    format_left_out,
    inventory_key,
    new_entry,
)
from coordinator.run.rehearse import rehearsal_steps, rehearse
from coordinator.run.resume import ResumeDecision, ResumeRefused, check_resume
from coordinator.run.rundir import EVENTS, PlanRecord
from coordinator.run.supervision import (
    NodeLocks,
    RunBusy,
    Supervision,
    acquire_nodes,
    acquire_run,
    check_orphans,
    clear_stop_request,
)
from worker.runconfig import Layout

# Relaunches after a start-up race (the ranks could not connect: a peer was not listening yet) that do not count
# against faults.max_restarts: a race is nobody's fault, and it may take a second try to lose it.
STARTUP_RETRIES = 2


def restarts_spent(attempt: int, races: int) -> int:
    """The relaunches after attempt number `attempt` (0-based) that count against faults.max_restarts, when `races`
    of the attempts so far ended in a start-up race: up to STARTUP_RETRIES of those are free."""
    return attempt - min(races, STARTUP_RETRIES)


# Blocks a per-block bench times (their mean is the node's time per block): enough to average, few enough for
# the smallest node.
BENCH_BLOCKS = 2


def default_cache_dir() -> Path:
    """Calibration cache on the coordinator's machine (under `cache_root`: $XDG_CACHE_HOME honoured)."""
    return cache_root() / "calibration"



class JobUI(Protocol):
    def message(self, text: str) -> None: ...
    def preflight(self, report: PreflightReport) -> None: ...
    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None: ...
    def progress(self, monitor: Monitor, now: float) -> None: ...
    def map_progress(self, rows: Sequence[MapRow], now: float) -> None: ...
    # A launch on fewer nodes than the inventory names: `warning` is the block naming each, why, and the command
    # that brings it back (shown before anything starts); `nodes` the left-out names (for the live view).
    def degraded(self, warning: str, nodes: Sequence[str]) -> None: ...


class QuietUI:
    def message(self, text: str) -> None:
        return None

    def preflight(self, report: PreflightReport) -> None:
        return None

    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None:
        return None

    def progress(self, monitor: Monitor, now: float) -> None:
        return None

    def map_progress(self, rows: Sequence[MapRow], now: float) -> None:
        return None

    def degraded(self, warning: str, nodes: Sequence[str]) -> None:
        return None


@dataclass(frozen=True)
class JobOptions:
    run_root: Path = Path("runs")
    skip_preflight: bool = False
    recalibrate: bool = False
    resume: str | None = None  # run id to continue from its newest consistent checkpoint
    restart_from_scratch: bool = False  # a resume with only invalid checkpoints sets them aside, starts at step 0
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    accept_new_host_keys: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    allow_degraded: bool = False  # a fresh launch may start without quarantined nodes (docs/faults.md)
    allow_shared: bool = False  # run on nodes another live run holds (warned), instead of refusing
    fix: FixOptions | None = None  # --fix: setup and sync what preflight finds they fix, then preflight again


class PreflightFailed(CoordinatorError):
    def __init__(self, report: PreflightReport, fix: FixPlan | None = None) -> None:
        self.report = report
        failing = sorted({name for name, checks in report.nodes for c in checks if c.status in ("fail", "error")})
        text = f"preflight failed on {', '.join(failing) or 'the playbook lint'}: "
        if fix is not None:
            # After --fix: what is left, named, so nobody reruns --fix hoping for another outcome.
            text += f"--fix could not fix {describe_left(fix) or 'the findings above'}; "
        super().__init__(text + "fix the findings above (or --skip-preflight)")


@dataclass
class FleetState:
    facts: dict[str, NodeFacts]
    report: PreflightReport


async def probe_and_check(fleet: Fleet, inv: Inventory, pb: Playbook) -> FleetState:
    """Probe the connected fleet and evaluate preflight: the pipeline of `coordinator preflight` (one
    `preflight.evaluate`), so a launch refuses exactly what the verb reports."""
    fleet_facts = await probe_connected(fleet, pb)
    return FleetState(fleet_facts.facts, evaluate(inv, pb, fleet_facts))


def model_digest(facts: Mapping[str, NodeFacts], dirs: tuple[str, ...] = ("model",)) -> str:
    """The manifest digest of the model dir, or of `dirs` (identical on every node once preflight passed)."""
    for f in facts.values():
        manifest, problems, _ = node_manifest(f, dirs)
        if manifest and not problems:
            return manifest_digest(manifest)
    return "unknown"


def bench_spec(pb: Playbook, world_size: int = 1) -> BenchSpec:
    """The run's step and batches, as calibration measures them. DPO pairs are timed as SFT rows of random tokens
    (its reference forward is not in the bench: docs/dpo.md)."""
    t = pb.train
    return BenchSpec(model=pb.model, seq_len=t.max_seq_length, method=t.fine_tune_type,
                     num_layers=t.num_layers if t.num_layers is not None else -1,
                     grad_checkpoint=t.grad_checkpoint, max_batch=pb.calibration.max_batch,
                     memory_fraction=pb.calibration.memory_fraction,
                     data=(pb.data or "") if t.method != "dpo" else "", packing=t.packing,
                     global_batch=t.batch_size * t.rows_per_example,
                     steps=sample_horizon(t.iters, t.grad_accumulation), seed=t.seed, optimizer=t.optimizer,
                     learning_rate=t.learning_rate, lora=(t.lora.rank, t.lora.scale, t.lora.dropout),
                     train_embeddings=t.train_embeddings, clear_cache=t.clear_cache, env=tuple(sorted(pb.job_env().items())),
                     world_size=world_size, memory_headroom=t.memory_headroom)


async def calibrate_and_plan(
    fleet: Fleet, inv: Inventory, pb: Playbook, facts: Mapping[str, NodeFacts], opts: JobOptions, ui: JobUI,
    *, last_exchange: CollectiveCost | None = None,
) -> tuple[Plan, dict[str, NodeCalibration], StrategyChoice | None]:
    """Measure (or read cached) curves and split the global batch by them. A fixed split (`equal`, explicit
    fractions) needs no measurement: it returns a plan without curves at once. With `train.strategy` auto or
    pipeline the plans are weighed (`planning.strategy.compute_strategy_choice`): the returned plan is the
    chosen dp's, over its nodes (all, some, or one solo); the choice is returned too (None where nothing was
    weighed). `last_exchange`: the last attempt's exchange, which a relaunch derives its own from (`with_exchange`)."""
    inputs = strategy_inputs(inv, pb, facts)
    if inputs is None:
        dp_plan, dp_cals = await _calibrate_dp(fleet, inv, pb, facts, opts, ui, last_exchange=last_exchange)
        return dp_plan, dp_cals, None
    shape, budgets, backend = inputs
    t = pb.train
    # Only a node that holds a replica can run the whole-model bench; the others are timed per block (the
    # worker's `bench --blocks`) when a pipeline is weighed.
    replica = [n for n in inv.nodes if per_rank_need(shape, t, world_size=1, budget=budgets[n.name])[0]
               <= budgets[n.name].usable]
    cals: dict[str, NodeCalibration] = {}
    if replica and pb.split == "calibrated":
        _, cals = await _calibrate_dp(fleet, Inventory(tuple(replica), inv.path), pb, facts, opts, ui, quiet=True)
    micro = -(-t.batch_size // t.pipeline_micro_batches)  # examples per micro-batch
    timings: dict[str, LayerTiming] = {n: timing_from_curve(c, shape.layers, micro, t.max_seq_length)
                                       for n, c in cals.items()}
    links: dict[tuple[str, str], LinkCost] = {}
    if (len(replica) < len(inv.nodes) or t.strategy == "pipeline") and len(inv.nodes) > 1 \
            and pb.split == "calibrated" and backend not in NO_SEND_RECV_BACKENDS:
        # A pipeline is weighed with a node that cannot run the whole model, or forced: every node is timed per
        # block, the same way (a curve's share per block folds the head and optimizer in: it would not compare),
        # and the links between ring neighbours are measured (the activations cross them).
        measured = await _time_blocks(fleet, inv, pb, facts, opts, ui, micro * t.rows_per_example, shape.layers)
        if len(measured) == len(inv.nodes) or len(timings) < len(inv.nodes):
            timings = measured
        else:  # a node's bench failed: every node's curve still times the blocks the same way
            ui.message("the pipeline is timed by the nodes' whole-model curves (a coarser stand-in)")
        links = await _time_links(fleet, inv, ui)
    fleet_nodes = [FleetNode(n.name, budgets[n.name], cals.get(n.name), timings.get(n.name)) for n in inv.nodes]
    choice = compute_strategy_choice(t.strategy, shape, t, fleet_nodes, backend=backend, split=pb.split,
                                     links=links)
    for line in [f"strategy {t.strategy}: {choice.chosen.label}", *format_table(choice.table()),
                 *choice.reasons()]:
        ui.message(line)
    chosen = choice.chosen
    if chosen.dp is not None:
        plan = chosen.dp
    elif chosen.strategy == "dp":  # a fixed split, or nothing measured: the plan as written, over its nodes
        plan = fixed_plan(list(chosen.nodes), t.batch_size, pb.split if pb.split != "calibrated" else "equal",
                          seq_len=t.max_seq_length)
    elif chosen.pipeline is not None:
        plan = chosen.pipeline.as_plan()
    else:
        raise LaunchError(f"strategy {t.strategy} chose {chosen.label}, which has neither a dp nor a pipeline plan")
    if chosen.dp is not None:
        plan = await with_exchange(fleet, list(inv.nodes), plan, cals, pb, facts, opts, ui, last_exchange)
    ui.calibration(plan, {n: c for n, c in cals.items() if n in plan.batch})
    return plan, cals, choice


async def _time_blocks(fleet: Fleet, inv: Inventory, pb: Playbook, facts: Mapping[str, NodeFacts], opts: JobOptions,
                       ui: JobUI, micro_batch: int, layers: int) -> dict[str, LayerTiming]:
    """Each node's time per block (`worker.bench --blocks`); a node whose bench fails is left untimed, said."""
    spec = replace(bench_spec(pb, len(inv.nodes)), blocks=min(BENCH_BLOCKS, layers), micro_batch=micro_batch)
    results = await calibrate_layers(
        fleet, spec, [n.name for n in inv.nodes], fingerprints={n: fingerprint_from_facts(f) for n, f in facts.items()},
        model_digest=model_digest(facts, ("model", "data")), recalibrate=opts.recalibrate, cache_dir=opts.cache_dir,
        time_budget=pb.calibration.time_budget, one_time_budget=pb.calibration.one_time_budget,
        progress=lambda node, line: ui.message(f"{node}: {line.strip()}"))
    out: dict[str, LayerTiming] = {}
    for name, result in results.items():
        if isinstance(result, LayerTiming):
            out[name] = result
        else:
            ui.message(f"{name}: not timed per block ({result}): the pipeline's split balances blocks by memory")
    return out


async def _time_links(fleet: Fleet, inv: Inventory, ui: JobUI) -> dict[tuple[str, str], LinkCost]:
    """The latency (half the median round trip) and bandwidth (the slower direction) between ring neighbours
    (`nettestrun.measure_links`); a pair that fails is left out (the prediction then counts that link free), said."""
    from coordinator.fleet.nettestrun import measure_links

    pairs = list(zip(inv.nodes, inv.nodes[1:], strict=False))
    out: dict[tuple[str, str], LinkCost] = {}
    for (a, b), got in (await measure_links(fleet, pairs)).items():
        if isinstance(got, CoordinatorError):
            ui.message(f"link {a} - {b} not measured ({got}): the pipeline's prediction counts it free")
            continue
        out[(a, b)] = LinkCost(got.rtt_ms / 2000, max(got.bottleneck_bps, 1.0))
        ui.message(f"link {a} - {b}: {got.rtt_ms:.2f} ms round trip, {got.bottleneck_bps / 1e6:,.0f} MB/s")
    return out


def strategy_inputs(inv: Inventory, pb: Playbook,
                    facts: Mapping[str, NodeFacts]) -> tuple[ModelShape, dict[str, NodeBudget], str] | None:
    """The model's shape, every node's budget and the resolved backend, when the strategy is to be weighed
    (`train.strategy` auto or pipeline, a training playbook, all of them known); None otherwise."""
    if pb.kind != "train" or pb.train.strategy not in ("auto", "pipeline"):
        return None
    shape = model_shape(model_config(facts), None)
    budgets = fleet_budgets(inv, FleetFacts({}, dict(facts), {}))
    backend = resolve_backend(pb.backend, facts, inv.nodes)
    if shape is None or not budgets or backend in NO_SEND_RECV_BACKENDS:
        # No pipeline without send/recv (nccl): auto is dp or fsdp there, by memory (preflight.resolve_strategy).
        return None
    return shape, budgets, backend


async def _calibrate_dp(
    fleet: Fleet, inv: Inventory, pb: Playbook, facts: Mapping[str, NodeFacts], opts: JobOptions, ui: JobUI,
    *, quiet: bool = False, last_exchange: CollectiveCost | None = None,
) -> tuple[Plan, dict[str, NodeCalibration]]:
    """The dp split over `inv`'s nodes: measured (cached) curves, or the fixed split without measuring.
    `quiet`: the caller reports the plan (it weighs strategies first)."""
    if pb.split != "calibrated":
        plan = fixed_plan([n.name for n in inv.nodes], pb.train.batch_size, pb.split, seq_len=pb.train.max_seq_length)
        if not quiet:
            ui.calibration(plan, {})
        return plan, {}
    results = await calibrate(
        fleet, bench_spec(pb, len(inv.nodes)), fingerprints={n: fingerprint_from_facts(f) for n, f in facts.items()},
        # The curve is measured on the run's batches: the data is part of what it is valid for.
        model_digest=model_digest(facts, ("model", "data")), recalibrate=opts.recalibrate, cache_dir=opts.cache_dir,
        time_budget=pb.calibration.time_budget, one_time_budget=pb.calibration.one_time_budget,
        progress=lambda node, line: ui.message(f"{node}: {line.strip()}"), names=[n.name for n in inv.nodes],
        # Nodes sharing a machine are measured together, as they will train (planning/colocate.py).
        groups=compute_bench_groups(inv.nodes, facts))
    errors = {n: r for n, r in results.items() if not isinstance(r, NodeCalibration)}
    if errors:
        raise LaunchError("calibration failed: " + "; ".join(f"{n}: {e}" for n, e in errors.items()))
    cals = {n: per_example_calibration(r, pb.train.rows_per_example)
            for n, r in results.items() if isinstance(r, NodeCalibration)}
    # Identical GPUs of one machine: one curve, an even split (calibrate's own pooling leaves them apart: each
    # rank node's env names its own device).
    pooled = pool_identical_gpus(cals, inv.nodes, facts)
    for name in (n for n in pooled if pooled[n] is not cals[n]):
        ui.message(f"{name}: one curve for the identical GPUs of its machine (the mean of their measurements)")
    cals = pooled
    ordered = [cals[n.name] for n in inv.nodes]
    plan = compute_plan(ordered, pb.train.batch_size, split=pb.split, seq_len=pb.train.max_seq_length)
    if not quiet:
        plan = await with_exchange(fleet, list(inv.nodes), plan, cals, pb, facts, opts, ui, last_exchange)
        ui.calibration(plan, cals)
    return plan, cals


async def with_exchange(fleet: Fleet, nodes: Sequence[Node], plan: Plan, cals: Mapping[str, NodeCalibration],
                        pb: Playbook, facts: Mapping[str, NodeFacts], opts: JobOptions, ui: JobUI,
                        measured: CollectiveCost | None = None) -> Plan:
    """`plan` with its gradient exchange measured between `nodes` (planning/collective.py): step = the slowest
    node's compute + the all_sum. Unchanged for one node or a plan without predicted step times; a measurement
    that cannot be made is said, and the plan keeps the compute alone. `measured`: an earlier attempt's exchange
    (a relaunch on the survivors): derived from it by the ring model instead of measured again, so that a
    recovery does not wait for a new measurement."""
    planned = [n for n in nodes if n.name in plan.batch]
    if len(planned) < 2 or not plan.per_node_step_s:
        return plan
    if measured is not None and (derived := rescale_collective(measured, [n.name for n in planned])) is not None:
        planned_with = with_collective(plan, derived)
        ui.message(f"gradient exchange: {derived.describe()}, from the last attempt's measured "
                   f"{1000 * measured.seconds:.1f} ms over {measured.ranks} ranks by the ring model; "
                   f"{100 * planned_with.collective_share:.0f}% of the predicted step")
        return planned_with
    gradients = next((c.gradients for n in planned if (c := cals.get(n.name)) is not None and c.gradients), None)
    if gradients is None:
        ui.message("the gradient all_sum is not in the prediction: the bench did not count the gradients (an older "
                   "worker)")
        return plan
    try:
        hostfile = hostfile_for(Inventory(tuple(planned)), pb, facts)
    except CoordinatorError as exc:
        ui.message(f"the gradient all_sum is not in the prediction: {exc}")
        return plan
    cost = await measure_collective(
        fleet, planned, hostfile, gradients, fingerprints={n: fingerprint_from_facts(f) for n, f in facts.items()},
        env=pb.job_env(), cache_dir=opts.cache_dir, recalibrate=opts.recalibrate, progress=ui.message)
    if isinstance(cost, CoordinatorError):
        ui.message(f"the gradient all_sum is not in the prediction (not measured: {exc_line(cost)})")
        return plan
    planned_with = with_collective(plan, cost)
    ui.message(f"gradient exchange: {cost.describe()}; {100 * planned_with.collective_share:.0f}% of the predicted "
               f"step ({1000 * planned_with.predicted_step_s:.1f} ms = {1000 * planned_with.compute_step_s:.1f} ms "
               f"compute + {1000 * cost.seconds:.1f} ms all_sum)")
    return planned_with


def exc_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


async def calibrate_fleet(inv: Inventory, pb: Playbook, opts: JobOptions,
                          ui: JobUI) -> tuple[Plan, dict[str, NodeCalibration], StrategyChoice | None]:
    """`coordinator calibrate`: connect, provision, probe (for fingerprints and the model digest), measure."""
    async with Fleet(inv.nodes, connect_timeout=opts.connect_timeout,
                     accept_new_host_keys=opts.accept_new_host_keys) as fleet:
        facts = await facts_for_calibration(fleet, pb, ui)
        inv, ranks_fleet, facts = per_gpu_ranks(inv, fleet, pb, facts, ui)
        return await calibrate_and_plan(ranks_fleet, inv, pb, facts, opts, ui)


def per_gpu_ranks(inv: Inventory, fleet: Fleet, pb: Playbook, facts: Mapping[str, NodeFacts], ui: JobUI, *,
                  select: Callable[[Inventory], Inventory] | None = None) -> tuple[Inventory, Fleet, dict[str, NodeFacts]]:
    """The job's ranks once the facts are in: a node with several NVIDIA GPUs becomes one rank node per GPU
    (`planning.gpuranks`), over the machine's one connection; facts get an entry per rank node; `select` may
    leave rank nodes out (quarantined GPUs). Unchanged otherwise."""
    ranks = build_rank_nodes(inv, pb.backend, facts)
    if ranks is inv:
        return inv, fleet, dict(facts)
    if select is not None:
        ranks = select(ranks)
    split = sorted({n.machine for n in ranks.nodes if n.machine is not None})
    ui.message("one rank per GPU: " + "; ".join(
        f"{m}: {', '.join(n.name for n in ranks.nodes if n.machine == m)}" for m in split))
    return ranks, fleet.for_ranks(ranks.nodes), rank_facts(facts, ranks.nodes)


def check_chaos(chaos: Sequence[Chaos], world_size: int) -> None:
    """--chaos names ranks; with one rank per GPU the world is known only once the facts are in."""
    for c in chaos:
        if c.rank >= world_size:
            raise ConfigError(f"--chaos: rank {c.rank} is not a rank of this job (0..{world_size - 1})")


async def facts_for_calibration(fleet: Fleet, pb: Playbook, ui: JobUI) -> dict[str, NodeFacts]:
    """Connect every node (all must answer), provision assets, probe: the facts a calibration keys its cache on."""
    await fleet.connect_all()
    if fleet.failed:
        raise LaunchError("unreachable: " + "; ".join(str(e) for e in fleet.failed.values()))
    await provision_assets(fleet, pb, ui)
    gathered = await gather_facts(fleet, pb)
    return {n: f for n, f in gathered.items() if isinstance(f, NodeFacts)}


async def provision_assets(fleet: Fleet, pb: Playbook, ui: JobUI, *, strict: bool = True) -> list[str]:
    """Fill missing model/data dirs from the playbook's `assets:`; LaunchError on a node's failure, unless not
    `strict` (launch --fix: a node without its python cannot build the tiny model before setup gives it one):
    then the failed nodes are returned, after a message each."""
    if pb.assets.tiny_model is None and pb.assets.data_from is None:
        return []
    ui.message("provisioning assets where missing")
    failed: list[str] = []
    for name, res in (await provision(fleet, pb)).items():
        if isinstance(res, TransportError):
            if strict:
                raise LaunchError(str(res))
            failed.append(name)
            ui.message(f"{name}: assets not provisioned yet ({res}); --fix tries again after setup")
            continue
        ui.message(f"{name}: " + ", ".join(f"{k} {v}" for k, v in res.items()))
    return failed


def hostfile_for(inv: Inventory, pb: Playbook, facts: Mapping[str, NodeFacts]) -> Hostfile:
    """The hostfile with the job's NON-secret env (secret values reach ranks only through the rank script)."""
    env = {k: v for k, v in pb.job_env().items() if not is_secret_name(k) and k not in pb.secret_env}
    return build_hostfile(inv.nodes, pb.backend, facts, envs=[f"{k}={v}" for k, v in sorted(env.items())])


@dataclass
class Attempt:
    """One mlx.launch of the run (the first, or a relaunch after a fault). `plan` is None for an attempt that
    `coordinator attach` adopted (its split is its ranks' batches)."""

    number: int
    nodes: list[str]
    monitor: Monitor
    launch: Launch
    plan: Plan | None


async def run_job(
    inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI | None = None, *, chaos: Sequence[Chaos] = (),
    supervision: Supervision | None = None,
) -> RunSummary:
    """Run the playbook until it succeeds, fails for good or is stopped; always tears down (unless a hangup
    detaches: `Supervision.detach`).

    On a fault the attempt is stopped, the culprit node quarantined (persisted), and the run relaunched on the
    remaining nodes from their newest consistent checkpoint with a recomputed plan and hostfile, within
    `faults.max_restarts` and down to `faults.min_nodes` nodes. The run lock and the nodes' locks are held
    throughout (RunBusy when another live coordinator has them).
    """
    ui = ui or QuietUI()
    sup = supervision or Supervision()
    if pb.kind != "train":
        raise ConfigError(f"`coordinator launch` runs kind: train playbooks (this one is {pb.kind})", path=pb.path)
    if opts.fix is not None:
        requested_source(inv, pb, opts.fix)  # a bad --fix-source is refused before anything is made or touched
    store = QuarantineStore()
    inv, left_out = usable_inventory(inv, pb, store, ui, opts)
    if left_out:  # fewer ranks than the command line counted: a drill's rank may be gone
        check_reachable(chaos, world_size=len(inv.nodes),
                        why=f" (quarantine leaves out {', '.join(lo.node for lo in left_out)})")
    with run_context(inv, pb, opts, resume_marker=None, ui=ui) as (run_id, run_dir):
        sup.run_dir = run_dir
        return await _run_job(inv, pb, opts, ui, chaos, store, run_id, run_dir, left_out, sup)


def usable_inventory(inv: Inventory, pb: Playbook, store: QuarantineStore, ui: JobUI,
                     opts: JobOptions) -> tuple[Inventory, list[LeftOut]]:
    """The inventory without the nodes this fleet's active quarantine entries leave out, and those (after a
    warning block naming each). LaunchError (exit 1) below `faults.min_nodes`, or when a fresh launch would start
    degraded without `--allow-degraded` or a written `faults.min_nodes` (`quarantine.check_degraded`)."""
    state = store.read()
    for note in state.notes:
        ui.message(note)
    now, scope = time.time(), inventory_key(inv.path)
    left_out = compute_left_out(inv, scope, state.entries, now)
    # The match is made without contacting a quarantined node; what known_hosts says about its address tells a
    # replaced machine (another host key, accepted by the operator) from the one that failed.
    by_name = {n.name: n for n in inv.nodes}
    known = {lo.node: known_host_keys(known_hosts_path(by_name[lo.node]), by_name[lo.node].host,
                                      by_name[lo.node].port or 22)
             for lo in left_out if lo.entry is not None and lo.entry.host_key}
    if known:
        kept = compute_left_out(inv, scope, state.entries, now, known)
        for lo in left_out:
            if lo not in kept and lo.entry is not None:
                ui.message(f"{lo.node}: not left out: its quarantine ({lo.entry.reason}) names host key "
                           f"{lo.entry.host_key}, which {known_hosts_path(by_name[lo.node])} no longer lists for "
                           f"{by_name[lo.node].host} (another machine now); "
                           f"`{clear_command(lo.node, inv.path)}` forgets the entry")
        left_out = kept
    if left_out:
        ui.degraded(format_left_out(left_out, len(inv.nodes), inv.path), [lo.node for lo in left_out])
    gone = {lo.node for lo in left_out}
    usable = Inventory(tuple(n for n in inv.nodes if n.name not in gone), inv.path)
    problem = check_degraded(len(inv.nodes), len(usable.nodes), min_nodes=pb.faults.min_nodes,
                             min_nodes_explicit="min_nodes" in pb.faults.model_fields_set,
                             allow_degraded=opts.allow_degraded, fresh=opts.resume is None)
    if problem is not None:
        raise LaunchError(problem)
    return usable, left_out


def quarantine_node(store: QuarantineStore, fleet: Fleet, name: str, reason: str, *, inventory: str | None,
                    run_id: str, incident: Mapping[str, Any], quarantine_for: float) -> Entry:
    """Persist `name`'s quarantine, scoped to this inventory's machine, with the host key the fleet saw."""
    info = fleet.connected.get(name)
    # The fleet's node, not its transport's: a rank node (`box/gpu1`) shares its machine's connection, whose node
    # is the machine; the entry must name the GPU, so that later launches leave out that GPU only.
    node = next((n for n in fleet.nodes if n.name == name), fleet.transports[name].node)
    return store.add(new_entry(node, inventory, reason, run_id=run_id, incident=incident,
                               host_key=info.host_key if info is not None else None, now=time.time(),
                               quarantine_for=quarantine_for))


@contextlib.contextmanager
def run_context(inv: Inventory, pb: Playbook, opts: JobOptions, *,
                resume_marker: str | None, ui: JobUI | None = None) -> Iterator[tuple[str, Path]]:
    """(run id, run dir) of a new run, or of `--resume RUN_ID` (whose dir must exist, and hold `resume_marker`
    when given), with the run's lock and its nodes' locks held (RunBusy when a live coordinator has them) and
    the run's structured log open, secrets redacted, for the duration of the block."""
    if opts.resume:
        check_run_id(opts.resume, what="--resume")
    run_id = opts.resume or new_run_id(pb.name)
    run_dir = opts.run_root / run_id
    if opts.resume and not (run_dir / (resume_marker or "")).exists():
        raise ConfigError(f"--resume {opts.resume}: no {pb.kind} run in {run_dir}")
    created = not run_dir.exists()
    make_run_dir(run_dir, opts.run_root)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(supervised_run(run_dir, run_id, inv.nodes, verb="launch",
                                               allow_shared=opts.allow_shared, ui=ui))
        except RunBusy:
            if created:
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # a refused new run leaves no empty run dir behind
            raise
        with run_log(run_dir, run_id, inv, pb, run_root=opts.run_root):
            yield run_id, run_dir


@contextlib.contextmanager
def run_log(run_dir: Path, run_id: str, inv: Inventory, pb: Playbook, *,
            run_root: Path | None = None) -> Iterator[None]:
    """The run's structured log (its file in the run dir, never the terminal), secrets redacted. ConfigError
    (exit 2) when the run dir takes no log."""
    secrets = [*collect_secrets(pb.job_env(), secret_env_names=pb.secret_env),
               *(s for n in inv.nodes for s in collect_secrets(n.env_dict, secret_env_names=pb.secret_env))]
    try:
        logs = configure_logging(run_dir, console=False, secrets=secrets, secret_env_names=pb.secret_env)
    except OSError as exc:
        raise ConfigError(f"--run-dir {run_root or run_dir.parent}: cannot write the run log in {run_dir} "
                          f"({exc.strerror})") from None
    structlog.contextvars.bind_contextvars(run_id=run_id)
    try:
        yield
    finally:
        structlog.contextvars.unbind_contextvars("run_id")
        logs.close()


@contextlib.contextmanager
def supervised_run(run_dir: Path, run_id: str, nodes: Sequence[Node], *, verb: str, allow_shared: bool,
                   ui: JobUI | None = None) -> Iterator[NodeLocks]:
    """Hold the run's lock, then its nodes' locks, for the block. A stop request left from an earlier holder
    is dropped: it was addressed to a coordinator that is gone."""
    lock = acquire_run(run_dir, verb, run_id)
    try:
        clear_stop_request(run_dir)
        nodes_locked = acquire_nodes(nodes, verb, run_id, allow_shared=allow_shared)
        try:
            if nodes_locked.shared and ui is not None:
                ui.message("warning: --allow-shared: sharing " + ", ".join(
                    f"{n} with run {h.run_id if h else '?'}" for n, h in nodes_locked.shared.items()))
            yield nodes_locked
        finally:
            nodes_locked.release()
    finally:
        clear_stop_request(run_dir)
        lock.release()


def make_run_dir(run_dir: Path, run_root: Path) -> None:
    """Create (or, on resume, reuse) `run_dir` 0700: its files name hosts, users, keys and paths and can quote
    the job's env. ConfigError (a usage error, exit 2) when it cannot be made or is not this user's."""
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = run_dir.stat().st_uid
        if owner == os.geteuid():
            run_dir.chmod(0o700)  # a run dir of an older version, resumed, is tightened too
    except OSError as exc:
        raise ConfigError(f"--run-dir {run_root}: cannot create the run dir {run_dir} ({exc.strerror})") from None
    if owner != os.geteuid():
        raise ConfigError(f"--run-dir {run_root}: the run dir {run_dir} belongs to uid {owner}, not to this user "
                          f"(uid {os.geteuid()}): refusing to write into it")


async def ready_fleet(fleet: Fleet, inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI) -> FleetState:
    """Connect, provision assets, probe and preflight; PreflightFailed unless `--skip-preflight`."""
    ui.message(f"connecting to {len(inv.nodes)} node(s)")
    await fleet.connect_all()
    if fleet.failed and opts.skip_preflight:
        raise LaunchError("unreachable: " + "; ".join(str(e) for e in fleet.failed.values()))
    await provision_assets(fleet, pb, ui, strict=opts.fix is None)
    ui.message("probing nodes and running preflight")
    state = await probe_and_check(fleet, inv, pb)
    left: FixPlan | None = None
    if opts.fix is not None and not state.report.ok():
        state, left = await fix_fleet(fleet, inv, pb, opts, opts.fix, ui, state)
    ui.preflight(state.report)
    if not state.report.ok() and not opts.skip_preflight:
        raise PreflightFailed(state.report, left)
    ranks = build_rank_nodes(inv, pb.backend, state.facts)  # the strategy is planned over the ranks (GPUs)
    refusal = strategy_refusal(ranks, pb, rank_facts(state.facts, ranks.nodes))  # never run an fsdp plan as dp
    if refusal is not None:
        raise LaunchError(refusal)
    return state


async def fix_fleet(fleet: Fleet, inv: Inventory, pb: Playbook, opts: JobOptions, fix: FixOptions, ui: JobUI,
                    state: FleetState) -> tuple[FleetState, FixPlan]:
    """launch --fix: `setup` on the nodes whose software finding it fixes (then the assets again, and preflight
    again), `sync` on the nodes whose model finding it fixes (then preflight again). The decisions are
    `fix.compute_fix_plan` on each round's report and `fix.choose_sync_source`; each tool's outcome is printed
    per node, Ansible style (ok / changed / failed). Returns the last preflight and the plan of what is left.
    Setup's and sync's own connections are opened beside the
    fleet's (they are the verbs' code, unchanged)."""
    log = structlog.get_logger("coordinator.run.job")
    source_named = fix.source is not None
    plan = compute_fix_plan(state.report, source_named=source_named)
    ui.message("--fix: " + describe_fix_plan(plan))
    log.info("fix_plan", **plan.to_json())
    if plan.setup and (plan.sync or any(f.check == "model" for f in plan.deferred)):
        await _check_source_before_setup(fleet, inv, pb, fix, state.report, plan)
    if plan.setup:
        await _fix_setup(inv, pb, opts, plan.setup, ui)
        if await provision_assets(fleet, pb, ui, strict=False):
            ui.message("--fix: assets still not provisioned on some nodes (see above)")
        ui.message("--fix: probing again after setup")
        state = await probe_and_check(fleet, inv, pb)
        plan = compute_fix_plan(state.report, source_named=source_named)
        if plan.sync:
            ui.message("--fix: " + describe_fix_plan(plan))
    if plan.sync:
        source = _fix_source(inv, pb, fix, state.report, plan.sync)
        await _fix_sync(inv, pb, opts, plan.sync, source, ui)
    if plan.fixes_anything:
        ui.message("--fix: running preflight again")
        state = await probe_and_check(fleet, inv, pb)
    # What is left: a tool's nodes here are nodes it ran on and did not fix (the tools run once per launch).
    left = compute_fix_plan(state.report, source_named=source_named)
    if plan.fixes_anything and not state.report.ok():  # else the plan's line above said it already
        ui.message(f"--fix could not fix: {describe_left(left) or 'the findings below'}")
    log.info("fix_done", ok=state.report.ok(), left=left.to_json())
    return state, left


def requested_source(inv: Inventory, pb: Playbook, fix: FixOptions) -> SyncSource | None:
    """`--fix-source` as a node or a dir on this machine; ConfigError (exit 2) for a dir that lacks a synced
    dir. Called before the launch connects (`ready_fleet`), and again when sync runs."""
    if fix.source is None:
        return None
    labels = [lb for lb, _ in pb.hashed_dirs()]
    base = Path(fix.source).expanduser()
    return resolve_requested(fix.source, inv.names(), labels, {lb: (base / lb).is_dir() for lb in labels}, str(base))


def _local_dirs(pb: Playbook) -> tuple[list[tuple[str, str]], bool]:
    """The playbook's synced dirs on this machine, and whether every one of them is here."""
    local = [(lb, str(Path(d).expanduser())) for lb, d in pb.hashed_dirs()]
    return local, all(Path(d).is_dir() for _, d in local)


def _fix_source(inv: Inventory, pb: Playbook, fix: FixOptions, report: PreflightReport,
                targets: Sequence[str]) -> SyncSource:
    """Look on this machine for what `choose_sync_source` needs: `--fix-source` as a dir, the playbook's paths."""
    local, present = _local_dirs(pb)
    return choose_sync_source(report, targets, requested=requested_source(inv, pb, fix), local_dirs=local,
                              local_present=present)


async def _check_source_before_setup(fleet: Fleet, inv: Inventory, pb: Playbook, fix: FixOptions,
                                     report: PreflightReport, plan: FixPlan) -> None:
    """ConfigError before setup changes any node when sync will need a source and none can exist
    (`fix.check_sync_source_before_setup`); the dirs of the nodes being set up are looked at with python3."""
    local, present = _local_dirs(pb)
    requested = requested_source(inv, pb, fix)
    seen: Mapping[str, Mapping[str, str] | None] = {}
    if requested is None and not present:
        seen = await look_at_dirs(fleet, [f.node for f in plan.deferred if f.check == "model"], dict(pb.hashed_dirs()))
    check_sync_source_before_setup(report, plan, requested=requested, local_dirs=local, local_present=present,
                                   node_dirs={n: parse_dir_states(d) for n, d in seen.items()},
                                   provided=provided_labels(pb))


async def _fix_setup(inv: Inventory, pb: Playbook, opts: JobOptions, names: Sequence[str], ui: JobUI) -> None:
    """`coordinator setup --limit names`, its outcome printed per node."""
    from coordinator.fleet.nodesetup import pins_from, run_setup

    software = pb.software
    pins = pins_from(software.mlx if software else None, software.mlx_lm if software else None)
    ui.message(f"--fix: setup on {', '.join(names)}: mlx {pins.mlx}, mlx-lm {pins.mlx_lm} ({pins.source})")
    nodes = [n for n in inv.nodes if n.name in names]
    report = await run_setup(nodes, pins, connect_timeout=opts.connect_timeout,
                             accept_new_host_keys=opts.accept_new_host_keys,
                             on_download=lambda name: ui.message(f"--fix: wheels for {name}: from the cache, else "
                                                                  "downloaded now (once; hundreds of MB)"),
                             on_note=lambda note: ui.message(f"--fix: {note}"))
    for n in report.nodes:
        detail = " | ".join(x for x in ("; ".join(n.actions), n.message) if x)
        ui.message(f"--fix setup {n.outcome}: {n.node}" + (f": {detail}" if detail else ""))
    structlog.get_logger("coordinator.run.job").info("fix_setup", **report.to_json())


async def _fix_sync(inv: Inventory, pb: Playbook, opts: JobOptions, names: Sequence[str], source: SyncSource,
                    ui: JobUI) -> None:
    """`coordinator sync --limit names` from `source`, its outcome printed per node."""
    from coordinator.fleet.syncrun import SyncError, run_sync

    ui.message(f"--fix: sync on {', '.join(names)} from {source.describe()}")
    by_name = {n.name: n for n in inv.nodes}
    targets = Inventory(tuple(by_name[n] for n in names if n != source.node), inv.path)
    try:
        report = await run_sync(targets, pb, source_node=by_name[source.node] if source.node else None,
                                source_path=None, source_dirs=dict(source.dirs) if source.dirs else None,
                                check=False, connect_timeout=opts.connect_timeout,
                                accept_new_host_keys=opts.accept_new_host_keys)
    except (SyncError, TransportError) as exc:
        for name in targets.names():
            ui.message(f"--fix sync failed: {name}: {exc}")
        return
    if report.refusal:  # doubtful deletions: --fix never confirms them for the user
        ui.message(f"--fix sync refused: {report.refusal}")
        return
    outcomes = compute_sync_outcomes(report.plan, report.node_errors, report.verified, targets.names())
    for name, (outcome, detail) in outcomes.items():
        ui.message(f"--fix sync {outcome}: {name}: {detail}")
    structlog.get_logger("coordinator.run.job").info("fix_sync", **report.to_json())


async def _run_job(inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI, chaos: Sequence[Chaos],
                   store: QuarantineStore, run_id: str, run_dir: Path, left_out: Sequence[LeftOut],
                   sup: Supervision) -> RunSummary:
    async with Fleet(inv.nodes, connect_timeout=opts.connect_timeout,
                     accept_new_host_keys=opts.accept_new_host_keys) as fleet:
        state = await ready_fleet(fleet, inv, pb, opts, ui)
        # Before anything runs on the nodes beside them (calibration included): ranks nobody supervises.
        if (shared := await check_orphans(fleet, inv.nodes, run_id=run_id, run_root=opts.run_root,
                                          allow_shared=opts.allow_shared)) is not None:
            ui.message(f"warning: {shared}")
        gpus_left: list[LeftOut] = []

        def usable_gpus(ranks: Inventory) -> Inventory:
            # A GPU quarantined after its rank failed (`box/gpu1`) stays out of later launches, as a node would.
            usable, left = usable_inventory(ranks, pb, store, ui, opts)
            gpus_left.extend(left)
            return usable

        inv, fleet, facts = per_gpu_ranks(inv, fleet, pb, state.facts, ui, select=usable_gpus)
        left_out = [*left_out, *gpus_left]
        state = FleetState(facts, state.report)
        check_chaos(chaos, len(inv.nodes))
        ui.message("calibrating (cached per node, model and sequence length)")
        plan, cals, choice = await calibrate_and_plan(fleet, inv, pb, state.facts, opts, ui)
        nodes = [n for n in inv.nodes if n.name in plan.batch]  # the strategy may train on some nodes, or one
        resumed: ResumeDecision | None = None
        if opts.resume is not None:
            # Before any rank starts: a resume with nothing valid to resume from refuses (ResumeRefused, exit 1).
            resumed = await _check_resume(fleet, nodes, run_id, run_dir, opts.restart_from_scratch, ui)
            check_reachable(chaos, after_step=resumed.step or 0)  # before any rank starts
        plan = await rehearsed(fleet, pb, nodes, plan, state.facts, run_id, sup, ui)
        left = [lo.to_json() for lo in left_out]
        first = await _run_attempt(fleet, pb, nodes, plan, cals, state.facts, run_id, run_dir, 0,
                                   resume=opts.resume is not None, chaos=chaos, ui=ui,
                                   inventory_path=str(Path(inv.path).resolve()) if inv.path else None, sup=sup,
                                   restart_from_scratch=opts.restart_from_scratch, left_out=left, drill=bool(chaos),
                                   strategy=choice)
        return await supervise(fleet, inv, pb, opts, ui, store, run_id, run_dir, first, dict(state.facts), sup,
                               resumed=resumed)


async def rehearsed(fleet: Fleet, pb: Playbook, nodes: Sequence[Node], plan: Plan, facts: Mapping[str, NodeFacts],
                    run_id: str, sup: Supervision, ui: JobUI) -> Plan:
    """`plan` predicted by a rehearsal of the run where its ranks share a machine (`run/rehearse.py`); else, or when
    the rehearsal fails (said), unchanged. A dp (or fsdp) plan of a calibrated split and a run long enough only."""
    steps = rehearsal_steps(pb.train.iters)
    if steps is None or len(nodes) < 2 or plan.mode == SplitMode.PIPELINE or not plan.per_node_step_s:
        return plan
    shared = describe_shared(compute_bench_groups(nodes, facts), [n.name for n in nodes])
    if shared is None:
        return plan
    sub = Inventory(tuple(nodes))
    result = await rehearse(fleet, pb, nodes, plan, hostfile_for(sub, pb, facts), facts, run_id=run_id,
                            layout=Layout(kind=resolve_strategy(sub, pb, facts)), sup=sup, shared=shared, steps=steps,
                            progress=ui.message)
    if isinstance(result, str):
        if sup.stop_reason() is None:  # a stop ends the run next, as during calibration: nothing to say here
            ui.message(f"no rehearsal: {result}; the prediction stays calibration's")
        return plan
    moved = result.describe_tokens()
    ui.message(f"rehearsal: {result.tokens_per_s:,.0f} real tokens/s over {steps} steps "
               f"({100 * (result.tokens_per_s / plan.predicted_tokens_per_s - 1):+.0f}% of the "
               f"{plan.predicted_tokens_per_s:,.0f} calibrated apart): the prediction" + (f" ({moved})" if moved else ""))
    return with_rehearsal(plan, result)


async def _check_resume(fleet: Fleet, nodes: Sequence[Node], run_id: str, run_dir: Path,
                        restart_from_scratch: bool, ui: JobUI, *, sources: Sequence[Node] = ()) -> ResumeDecision:
    """Where the next attempt resumes from, decided before any of its ranks starts (invalid checkpoints set
    aside); ResumeRefused when nothing valid is left and `--restart-from-scratch` was not given. Shard sources,
    read and never written to: `sources` (nodes left out of the next attempt that may still hold a pipeline stage's
    only shard: its rank crashed or hung, the machine answers), and the GPUs left out on a machine that still
    trains (`box/gpu1` beside `box/gpu0`: an fsdp or pipeline checkpoint's shard of a failed rank is still on that
    machine's disk)."""
    names = {n.name for n in nodes}
    machines = {n.machine for n in nodes if n.machine is not None}
    sources = [*sources, *(n for n in fleet.nodes if n.name not in names and n.machine is not None
                           and n.machine in machines and n not in sources)]
    decision = await check_resume(fleet, nodes, {n.name: node_run_dir(n, run_id) for n in [*nodes, *sources]},
                                  run_id=run_id, restart_from_scratch=restart_from_scratch,
                                  events_file=run_dir / EVENTS, sources=sources)
    ui.message(decision.describe())
    return decision


async def supervise(fleet: Fleet, inv: Inventory, pb: Playbook, opts: JobOptions, ui: JobUI,
                    store: QuarantineStore, run_id: str, run_dir: Path, first: Attempt,
                    facts: dict[str, NodeFacts], sup: Supervision, *,
                    resumed: ResumeDecision | None = None) -> RunSummary:
    """The fault response after an attempt ended: stop on a job error (nobody quarantined; nodes this run
    blamed for the same error released), else quarantine its culprits (a drill's only for this run) and
    relaunch on the survivors after a resume check (or give up), until the run succeeds, fails for good or is
    stopped; then summary.json. `launch` and `attach` share it, so an adopted attempt's fault is answered as a
    launched one's. `facts` may lack nodes (attach probes none): they are gathered before a relaunch needs them.
    `first.launch` carries what every attempt keeps: the left-out nodes, the drill flag, --restart-from-scratch."""
    log = structlog.get_logger("coordinator.run.job")
    attempts: list[Attempt] = [first]
    recoveries: list[dict[str, Any]] = []
    message = ""
    earlier_errors: dict[str, frozenset[str]] = dict(first.launch.earlier_errors)  # signature -> nodes (Monitor)
    blamed_for: dict[str, str] = {}  # node quarantined by this run for an own error -> that error's signature
    released: list[str] = []
    inventory_path = str(Path(inv.path).resolve()) if inv.path else None
    scope = inventory_key(inv.path)
    drill, left_out = first.launch.drill, first.launch.left_out
    restart_from_scratch = first.launch.restart_from_scratch
    nodes = [n for n in inv.nodes if n.name in first.nodes]
    races = 0  # attempts ended by a start-up race (Monitor.startup_race)
    while True:
        attempt = attempts[-1]
        number = attempt.number
        mon = attempt.monitor
        log.info("attempt_ended", attempt=number, nodes=attempt.nodes, outcome=str(mon.outcome()),
                 step=mon.step(), incidents=[i.to_json() for i in mon.incidents])
        if recoveries and recoveries[-1].get("first_step_at") is None:
            recoveries[-1]["first_step_after_s"] = _first_step_after(attempt, recoveries[-1])
        if mon.outcome() is RunState.SUCCEEDED:
            break  # a stop that came when every rank had finished changes nothing (Monitor.outcome)
        if mon.stopped and mon.job_error is None:
            message = sup.message()
            break
        if mon.job_error is not None:
            # Nobody is at fault: stop. Nodes this run quarantined for the same error, before it followed
            # the work to another node, are released.
            signature = mon.job_error.evidence.get("signature")
            released = [n for n, sig in blamed_for.items() if sig == signature]
            for name in released:
                store.clear(name, inventory=scope)
                log.warning("released", node=name, reason="the same error followed the work: a job error")
                for earlier in attempts[:-1]:
                    _clear_blame(earlier.monitor, name)
            message = job_error_message(mon.job_error, released)
            log.error("job_error", **{k: v for k, v in mon.job_error.evidence.items() if k != "traceback"})
            break
        for err in mon.own_errors.values():
            earlier_errors[err.signature] = earlier_errors.get(err.signature, frozenset()) | {err.node}
        if (fault := mon.job_fault()) is not None:
            message = f"job error (no node quarantined, no relaunch): {fault.evidence.get('message')}"
            break
        culprits = mon.culprits()
        previous = list(nodes)
        unreachable = {i.node for i in mon.incidents if i.kind == IncidentKind.UNREACHABLE}
        survivors = [n for n in nodes if n.name not in culprits]
        for name, why in (await _unreachable(fleet, survivors)).items():
            unreachable.add(name)
            # Found by the connection check, not by the monitor: still an incident of this attempt.
            incident = mon.unreachable_before_relaunch(name, why, time.monotonic())
            attempt.launch.record_incident(incident)
            culprits.append(name)
        for name in culprits:
            inc = mon.culprit_incident(name)
            assert inc is not None  # every culprit was named by one of its incidents
            if drill:
                # A drill's culprit is the fault it injected: left out of the rest of this run, never of
                # later ones (nothing would mark such an entry as a drill).
                log.warning("left_out_of_drill", node=name, kind=inc.kind, step=inc.step)
                ui.message(f"left {name} out of this drill run: {inc.kind} at step {inc.step} "
                           "(a --chaos drill persists no quarantine)")
                continue
            quarantine_node(store, fleet, name, f"{inc.kind} at step {inc.step}", inventory=scope,
                            run_id=run_id, incident=inc.to_json(), quarantine_for=pb.faults.quarantine_for)
            if inc.kind == IncidentKind.ERROR and isinstance(inc.evidence.get("signature"), str):
                blamed_for[name] = inc.evidence["signature"]
            log.warning("quarantined", node=name, kind=inc.kind, step=inc.step)
            ui.message(f"quarantined {name}: {inc.kind} at step {inc.step}")
        survivors = [n for n in survivors if n.name not in culprits]
        race = mon.startup_race() if not culprits else None
        if race is not None:
            races += 1
            log.warning("startup_race", node=race.node, rank=race.rank, message=race.evidence.get("message"))
            ui.message(f"start-up race on {race.node} (rank {race.rank}): {race.evidence.get('message')}: no node "
                       "is at fault, nobody quarantined")
        if sup.stop_reason() is not None:
            # Asked to stop while this attempt failed: no relaunch.
            mon.stopped = True
            message = sup.message()
            break
        if restarts_spent(number, races) >= pb.faults.max_restarts:
            message = f"gave up after {number + 1} attempt(s) (faults.max_restarts {pb.faults.max_restarts})"
            if race is not None:
                known = race.evidence.get("explanation") or {}
                message += (f"; the last could not form the ring at start-up ({race.evidence.get('message')}): "
                            f"{known.get('cause')}; remedy: {known.get('remedy')}")
            break
        if len(survivors) < max(1, pb.faults.min_nodes):
            message = f"{len(survivors)} node(s) left < faults.min_nodes {pb.faults.min_nodes}"
            break
        consistent = mon.last_consistent_step
        if any(i.kind in ("inconsistent", "checkpoint_mismatch") for i in mon.incidents):
            # Checkpoints after the last step all replicas agreed on may hold a Byzantine rank's influence.
            limit = consistent or 0
            await set_aside_checkpoints_after(fleet, attempt.launch, [n.name for n in survivors], limit)
            ui.message(f"set aside checkpoints after step {limit} (last consistent digest)")
        failed_at = min((i.t for i in mon.incidents if i.action in FATAL_ACTIONS), default=time.monotonic())
        recoveries.append({"attempt": number + 1, "culprits": culprits, "failed_step": mon.step(),
                           "detected_at": failed_at, "first_step_at": None,
                           "nodes": [n.name for n in survivors]})
        ui.message(f"relaunching on {', '.join(n.name for n in survivors)} "
                   f"(attempt {number + 2}/{pb.faults.max_restarts + 1})")
        nodes = survivors
        if any(n.name not in facts for n in nodes):
            gathered = await gather_facts(fleet, pb)
            facts.update({n: f for n, f in gathered.items() if isinstance(f, NodeFacts)})
        sub = Inventory(tuple(nodes), inv.path)
        # The survivors' exchange is derived from this attempt's measured one: recovery waits for no measurement.
        last = attempt.plan.collective if attempt.plan is not None else None
        try:
            plan, cals, choice = await calibrate_and_plan(fleet, sub, replan_playbook(pb, len(nodes), ui), facts,
                                                          opts, ui, last_exchange=last)
        except (StrategyError, PlanError) as exc:
            message = replan_refusal(exc, sub, pb, facts)
            break
        nodes = [n for n in nodes if n.name in plan.batch]
        # The relaunch resumes: from where, is decided before its ranks start (a refusal ends the run with it).
        # A pipeline stage's layers live only on its own node: a left-out node that still answers (its rank
        # crashed or hung, the machine is up) serves its shards to the survivors.
        sources = [n for n in previous if n.name in culprits and n.name not in unreachable]
        if sources:
            sources = [n for n in sources if n.name not in await _unreachable(fleet, sources)]
        try:
            decision = await _check_resume(fleet, nodes, run_id, run_dir, restart_from_scratch, ui, sources=sources)
        except ResumeRefused as exc:
            message = str(exc)
            break
        recoveries[-1]["resumed_from"] = decision.step or 0
        attempts.append(await _run_attempt(fleet, pb, nodes, plan, cals, facts, run_id, run_dir, number + 1,
                                           resume=True, chaos=(), ui=ui, inventory_path=inventory_path, sup=sup,
                                           earlier_errors=earlier_errors,
                                           restart_from_scratch=restart_from_scratch, left_out=left_out,
                                           drill=drill, strategy=choice))
    final = attempts[-1]
    split = final.plan.split if final.plan is not None else final.launch.split()
    predicted = final.plan.predicted_tokens_per_s if final.plan is not None else None
    # Where the prediction holds the gradient exchange, its compute part too: the end-of-run line holds the ranks'
    # own compute to it and the rest of each step to the exchange.
    compute = final.plan.compute_tokens_per_s if final.plan is not None and final.plan.collective is not None else None
    summary = summarize(final.launch, final.monitor, split, message, predicted_tokens_per_s=predicted or None,
                        predicted_compute_tokens_per_s=compute or None,
                        rehearsed_steps=(final.plan.rehearsal.steps if final.plan is not None
                                         and final.plan.rehearsal is not None else None))
    summary.incidents = [i for a in attempts for i in a.monitor.incidents]
    summary.attempts = final.number + 1
    summary.recoveries = [{k: v for k, v in r.items() if k not in ("detected_at", "first_step_at")} for r in recoveries]
    summary.resumed_from = resumed.to_json() if resumed is not None else None
    summary.quarantined = sorted(({n for a in attempts for n in a.monitor.culprits()}
                                  | {n for r in recoveries for n in r["culprits"]})  # pre-relaunch check too
                                 - set(released))
    summary.left_out = list(left_out)
    if sup.detach:
        # The run goes on without us: no summary.json (it is not over); `attach` writes it when it is.
        summary.state = RunState.RUNNING
        return summary
    write_summary(run_dir, summary)
    if summary.state is RunState.SUCCEEDED and final.launch.layout.kind == "pipeline":
        await _export_at_end(fleet, final.launch, run_dir, ui)
    return summary


def replan_playbook(pb: Playbook, nodes: int, ui: JobUI) -> Playbook:
    """The playbook a relaunch on `nodes` nodes plans with: a pinned `train.layer_split` names one block count per
    node of the fleet it was written for; once a node is lost it cannot apply, and the survivors' split is computed
    (said). Unchanged otherwise."""
    pin = pb.train.layer_split
    if pin is None or len(pin) == nodes:
        return pb
    ui.message(f"train.layer_split {list(pin)} pins {len(pin)} stages; {nodes} node(s) are left: the split over "
               "them is computed")
    return pb.model_copy(update={"train": pb.train.model_copy(update={"layer_split": None})})


def replan_refusal(exc: Exception, inv: Inventory, pb: Playbook, facts: Mapping[str, NodeFacts]) -> str:
    """Why a relaunch cannot train on the survivors `inv`: the planner's refusal and, for a pipeline, which memory
    is missing where (`planning.shortfall`: per node, what its stage needs and what it has)."""
    text = f"cannot relaunch on {', '.join(inv.names())}: {exc}"
    inputs = strategy_inputs(inv, pb, facts)
    if inputs is None or pb.train.strategy == "dp" or pipeline_unsupported(pb.train):
        return text
    shape, budgets, _ = inputs
    stage_nodes = [StageNode(n, b.usable, None, b.fused_attention) for n, b in budgets.items()]
    shortfall = compute_memory_shortfall(pipeline_job(shape, pb.train), stage_nodes)
    if not shortfall.missing:
        return text
    return (f"the model no longer fits the {len(inv.nodes)} node(s) left: {shortfall.describe()} (bring back a "
            "node, add one, or lower train.batch_size / max_seq_length; " + text + ")")


async def _export_at_end(fleet: Fleet, launch: Launch, run_dir: Path, ui: JobUI) -> None:
    """A pipeline's model lives in pieces on several nodes: put it together in `<run dir>/export` (what
    `coordinator export` writes). A failure is said, never the run's: the shards stay, the verb can retry."""
    from coordinator.run.export import export_on

    by_name = {n.name: n for n in fleet.nodes}
    nodes = [by_name[n] for n in launch.nodes if n in by_name and n in launch.remote_run_dirs]
    try:
        result = await export_on(fleet, nodes, launch.remote_run_dirs, launch.run_id, (run_dir / "export").resolve())
    except (CoordinatorError, OSError) as exc:
        ui.message(f"could not export the trained model at the end of the run ({exc}); the checkpoint shards are "
                   f"kept: `coordinator export {launch.run_id}` tries again")
        return
    ui.message(result.describe())


def _clear_blame(mon: Monitor, node: str) -> None:
    """An earlier attempt's error incidents on `node` were the job's after all: no longer a culprit's."""
    for idx, inc in enumerate(mon.incidents):
        if inc.node == node and inc.kind == IncidentKind.ERROR and inc.action == Action.QUARANTINE:
            mon.incidents[idx] = replace(inc, action=Action.STOP, evidence={**inc.evidence, "job_error": True})


def job_error_message(incident: Incident, released: Sequence[str] = ()) -> str:
    """The one message a job error ends the run with: what failed, why it is the job's, cause and remedy."""
    ev = incident.evidence
    text = (f"job error ({ev.get('reason')}): {ev.get('message')}; cause: {ev.get('cause')}; "
            f"remedy: {ev.get('remedy')}; ")
    if released:
        return text + f"released from quarantine: {', '.join(released)} (the error was the job's)"
    return text + "no node quarantined"


async def _unreachable(fleet: Fleet, nodes: Sequence[Node]) -> dict[str, str]:
    """Survivors whose connection died with the fault get one reconnect; those that still fail are out."""
    async def one(node: Node) -> str | None:
        try:
            await fleet.transports[node.name].run(["true"], timeout=5)
            return None
        except TransportError:
            pass
        try:
            await fleet.reconnect(node.name)
        except TransportError as exc:
            return str(exc)
        return None

    results = await asyncio.gather(*(one(n) for n in nodes))
    return {n.name: r for n, r in zip(nodes, results, strict=True) if r is not None}


def _first_step_after(attempt: Attempt, recovery: dict[str, Any]) -> float | None:
    """Seconds from the fault's detection to the relaunched attempt's first completed step."""
    firsts = [t for t in attempt.monitor.first_step_at.values() if t is not None]
    return round(min(firsts) - recovery["detected_at"], 3) if firsts else None


async def _run_attempt(
    fleet: Fleet, pb: Playbook, nodes: list[Node], plan: Plan, cals: Mapping[str, NodeCalibration],
    facts: Mapping[str, NodeFacts], run_id: str, run_dir: Path, number: int, *, resume: bool,
    chaos: Sequence[Chaos], ui: JobUI, inventory_path: str | None, sup: Supervision,
    earlier_errors: Mapping[str, frozenset[str]] | None = None, restart_from_scratch: bool = False,
    left_out: Sequence[dict[str, str]] = (), drill: bool = False, strategy: StrategyChoice | None = None,
) -> Attempt:
    sub = Inventory(tuple(nodes))
    ranks = [RankPlan(i, node, plan.batch[node.name], plan.node_tokens_per_s(node.name)) for i, node in enumerate(nodes)]
    hostfile = hostfile_for(sub, pb, facts)
    launch = Launch(fleet, pb, ranks, hostfile, facts, run_id=run_id, run_dir=run_dir, resume=resume,
                    view=ui.progress, chaos=chaos, attempt=number)
    launch.inventory_path = inventory_path
    launch.earlier_errors = dict(earlier_errors or {})
    launch.restart_from_scratch = restart_from_scratch
    launch.left_out = list(left_out)
    launch.drill = drill
    launch.should_stop = sup.stop_reason
    launch.layout = (build_layout(strategy.chosen.pipeline) if strategy is not None and strategy.chosen.pipeline
                     is not None else Layout(kind=resolve_strategy(sub, pb, facts)))
    # A pipeline splits blocks, not rows: its rows are the strategy's stages, not per-node batches.
    split_rows = bool(cals) and plan.mode != SplitMode.PIPELINE
    record = PlanRecord(nodes=build_plan_nodes(plan, [cals[n.name] for n in nodes]) if split_rows else (),
                        split=dict(plan.split), batch=dict(plan.batch), global_batch=plan.global_batch,
                        mode=str(plan.mode), predicted_tokens_per_s=plan.predicted_tokens_per_s,
                        backend=hostfile.backend, attempt=number,
                        strategy=strategy.to_json() if strategy is not None else None,
                        step=plan_step_json(plan) if split_rows else None)
    local_hostfile = launch.write_local_files(record)

    async def start() -> None:
        ui.message(f"run {run_id}: preparing nodes" + (f" (attempt {number + 1})" if number else ""))
        await launch.prepare()
        ui.message(f"run {run_id}: mlx.launch --backend {hostfile.backend} ({len(ranks)} ranks, "
                   f"{launch.layout.kind})")
        launch.start_launcher(local_hostfile)

    monitor = await watch(launch, sup, start)
    return Attempt(number, [n.name for n in nodes], monitor, launch, plan)


async def watch(launch: Launch, sup: Supervision, start: Callable[[], Awaitable[None]] | None = None) -> Monitor:
    """Start the attempt (`start`; None for an adopted one) and monitor it to its end; tear down always, except
    when a hangup detaches (`sup.detach`): then the ranks and mlx.launch are left running for `attach`.
    A signal or a stop request ends it with the monitor `stopped`."""
    monitor: Monitor | None = None
    try:
        if start is not None:
            await start()
        monitor = await launch.monitor()
    except (KeyboardInterrupt, asyncio.CancelledError):
        # The signal handlers (cli/common.py) cancel the job; the teardown below is the answer, so the cancellation
        # is consumed here (and the task's count of pending cancellations with it).
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        monitor = launch.current_monitor or launch.new_monitor()
        monitor.stopped = True
    finally:
        if sup.detach:
            launch.detach()
        else:
            await launch.teardown(monitor or launch.current_monitor)
    assert monitor is not None
    if monitor.stopped and not sup.detach:
        # The stop cut the following short: the record is what the nodes' files hold (every rank may have
        # finished already; the steps the events and checkpoints prove), not what had reached us by then.
        await launch.read_record(monitor, record=True)
    return monitor


__all__ = ["JobOptions", "PreflightFailed", "QuietUI", "RunState", "run_job"]
