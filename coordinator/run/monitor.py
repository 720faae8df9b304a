"""The run monitor's state machine: observations in, incidents and an outcome out. No I/O.

The launch loop feeds it what each node's own SSH channel reported (events from `worker.follow`, process
states, ticks, a lost channel, the launcher's exit) and the current time; `check(now)` finds silent
failures (no heartbeat, no channel). The origin of an observation is the channel it came on: a rank's
events are only accepted from the node that rank was planned on.

Worker states: PENDING -> RUNNING -> FINISHED, or -> FAILED from any state. A run SUCCEEDED when every rank
FINISHED; FAILED as soon as one rank FAILED or an incident says stop.

Job error or node fault: a rank's own error (not an echo of another fault) is compared with the other ranks' own
errors by signature (coordinator.run.signatures). The same error on every rank, or on ranks of several nodes, or
the same error as a culprit of an earlier attempt on another node (it followed the work), is the job's: a
`job_error` incident, action stop, and nobody is a culprit (`classify_errors`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from coordinator.planning.steptime import Census
from coordinator.run.signatures import error_signature, explain_error
from coordinator.run.stages import RunLayout, StageFold
from worker.events import (
    CheckpointEvent,
    DigestEvent,
    ErrorEvent,
    EvalEvent,
    EventError,
    FinishedEvent,
    HeartbeatEvent,
    RecentSteps,
    StartedEvent,
    StepEvent,
    parse_event,
)


class WorkerState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class RunState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class IncidentKind(StrEnum):
    """What went wrong. A StrEnum: the values are the stable words of events.jsonl, JSON and the docs
    (docs/faults.md), and comparisons with plain strings (records read back) keep working."""

    CRASH = "crash"  # a rank's process died without an error event
    ERROR = "error"  # a rank reported an error
    HANG = "hang"  # a rank silent on a live channel, or stopped (state T)
    UNREACHABLE = "unreachable"  # a node's channel lost or silent, or its connection refused before a relaunch
    STRAGGLER = "straggler"
    OUTLIER = "outlier"
    SPOOFED = "spoofed"  # an event about a rank not planned on the channel's node
    IMPLAUSIBLE_PROGRESS = "implausible_progress"
    NAN = "nan"
    INCONSISTENT = "inconsistent"  # replicas' parameter/optimizer digests disagree
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"
    STALL = "stall"
    LAUNCHER_EXIT = "launcher_exit"
    JOB_ERROR = "job_error"


class Action(StrEnum):
    """What an incident asks for: stop the attempt, only warn, or stop and quarantine its node."""

    STOP = "stop"
    WARN = "warn"
    QUARANTINE = "quarantine"


FATAL_ACTIONS = frozenset({Action.STOP, Action.QUARANTINE})


@dataclass(frozen=True, kw_only=True)
class Incident:
    kind: IncidentKind
    node: str
    rank: int | None
    step: int | None
    detected_after_s: float | None  # from the fault's evidence (last sign of life) to its detection
    evidence: dict[str, Any]
    action: Action
    t: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # str(): plain strings, so YAML dumpers and every JSON encoder write the words, never an enum's repr.
        return {"kind": str(self.kind), "node": self.node, "rank": self.rank, "step": self.step,
                "detected_after_s": None if self.detected_after_s is None else round(self.detected_after_s, 3),
                "evidence": self.evidence, "action": str(self.action), "t": self.t}


@dataclass
class RankView:
    rank: int
    node: str
    batch_size: int
    calibrated_tokens_per_s: float | None = None
    state: WorkerState = WorkerState.PENDING
    pid: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    peak_memory: int | None = None
    grad_norm: float | None = None
    val_loss: float | None = None
    last_event_at: float | None = None  # coordinator clock
    last_alive_at: float | None = None  # coordinator clock: the last process check that found it alive
    last_progress_at: float | None = None
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    started_at: float | None = None
    resumed_from: int | None = None
    error: str | None = None
    max_tokens_per_step: int | None = None  # batch_size * max_seq_length: more is a lie
    compute_tokens_per_s: float | None = None
    slow_steps: int = 0
    slow_since: float | None = None  # when the current run of slow steps began
    straggler_reported: bool = False
    outlier_steps: int = 0
    stopped_since: float | None = None  # first `proc` observation in state T (SIGSTOP)
    phase: str | None = None  # from its heartbeats: load | step | eval | checkpoint | sync | digest | idle
    trainable: str | None = None  # its `started` event's words: share of parameters, layers, what is frozen
    packing: str | None = None  # ... and whether its batches are packed, and why
    steps: RecentSteps = field(default_factory=RecentSteps)  # its last steps' step_time_s, for the stall window
    recent_tok_s: list[float] = field(default_factory=list)  # its last RATE_STEPS steps' tok_s (`rank_rate`)
    # A pipeline stage's compute thread, from its heartbeats (worker.events.Progress): the action it began last,
    # the stage that action waits on, and since when (coordinator clock) its (step, action index) has not moved.
    action: str | None = None
    peer: int | None = None
    action_at: tuple[int, int] | None = None
    action_since: float | None = None
    predicted_stage_s: float | None = None  # the plan's compute seconds per step of this stage (None: no plan)
    stage_times: list[float] = field(default_factory=list)  # its last steps' busy_s


class ObservationKind(StrEnum):
    """What a node's channel reported: a worker event, a process state, a tick (the channel is alive), the channel
    lost, or mlx.launch's exit (on the coordinator's own "channel")."""

    EVENT = "event"
    PROC = "proc"
    TICK = "tick"
    LOST = "lost"
    LAUNCHER_EXIT = "launcher_exit"
    # The newest complete checkpoint dir on the node (`data["step"]`, None: none), read from its disk when the
    # coordinator reads a run's record (`worker.follow --once`): steps the run proved, events or not.
    CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class Observation:
    """What a node's channel reported."""

    kind: ObservationKind
    node: str
    at: float
    rank: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultPolicy:
    """Thresholds (the playbook's `faults:` and `heartbeat_timeout`)."""

    heartbeat_timeout: float = 10.0
    straggler_fraction: float = 0.5
    straggler_window: int = 5
    # ... and for at least this long: a few slow steps of a tiny model are a second of a busy machine, not a
    # straggling node (measured: 1 warning in 10 clean 3-rank runs on a shared 2-core VM without it).
    straggler_min_s: float = 5.0
    outlier_steps: int = 3
    outlier_mads: float = 8.0  # robust z-score (|x - median| / (1.4826 MAD)) above which a value is an outlier
    outlier_rel: float = 0.5  # ... and at least this relative distance from the median (heterogeneous batches)
    stopped_grace_s: float = 1.0  # a process seen in state T (SIGSTOP) this long is hung
    ahead_steps: int = 2  # a synchronous rank cannot report more steps than its peers plus this
    # A rank inside a step that ends no step for stall_factor x its median step time (and at least
    # stall_min_s) is stalled: alive and heartbeating, but its collective never completes.
    stall_factor: float = 10.0
    stall_min_s: float = 60.0
    # A rank that has ended no step this long after the attempt started (loading, the ring's start, its first,
    # compiling step), while heartbeating, is stalled too: the stall window has no yardstick before a first step,
    # and without this bound a ring that never forms waited forever with every heartbeat on time.
    first_step_s: float = 3600.0


class Verdict(StrEnum):
    """A rank in one word, the same in every view (live view, piped lines, status, report, dashboard, --json):
    `rank_verdict` applies the monitor's own rules with the run's own thresholds."""

    PENDING = "pending"  # not started yet (loading)
    OK = "ok"
    SLOW = "slow"  # the straggler test holds: under faults.straggler_fraction of the fleet for its window of steps
    STALLED = "stalled"  # inside a step that ends no step for the stall window (faults.stall_factor / stall_min_s)
    HUNG = "hung"  # silent past heartbeat_timeout on a live channel, or stopped (SIGSTOP)
    DEAD = "dead"  # ended without finishing: crashed, failed with an error, its node unreachable


# A rank's rate (`rank_rate`): the median of its last steps' tok_s, so one slow or compiling step does not stand
# for the rank, and neither does the last step alone. The window of RecentSteps (the stall window's).
RATE_STEPS = RecentSteps.KEPT
RATE_UNIT = "real tokens/s"  # every rate a view shows of a run: tokens of the data, padding excluded
_DEAD_KINDS = frozenset({"crash", "error", "unreachable"})


def stall_window(view: RankView, policy: FaultPolicy) -> float | None:
    """Seconds without a finished step after which `view`'s rank is stalled; None before its first step (the
    first step compiles and may wait for slow peers to load). Never within the heartbeat timeout: a node that
    vanished stalls its peers too, and must first be found by its silence (the culprit), not as a stall."""
    window = view.steps.window(policy.stall_factor, policy.stall_min_s)
    return None if window is None else max(window, policy.heartbeat_timeout + 1.0)


def rank_rate(view: RankView) -> float | None:
    """The rank's rate in real tokens/s (RATE_UNIT): the median tok_s of its last RATE_STEPS steps; None before a
    step. What every view shows as the rank's tokens/s."""
    return statistics.median(view.recent_tok_s) if view.recent_tok_s else None


def rank_verdict(view: RankView, policy: FaultPolicy, incident_kinds: Collection[str], *,
                 now: float | None) -> Verdict:
    """The rank's `Verdict` by the monitor's rules. `incident_kinds`: the kinds of this attempt's incidents that
    name the rank (the monitor's word wins: a hang it found stays `hung`); `now`: the time on the clock of the
    view's times while the run is live, None once it has ended (no silence can grow then). The time checks are
    `Monitor.check`'s (heartbeat timeout, stall window); `slow` is the straggler test's state at the rank's latest
    step (`RankView.slow_steps`, `FaultPolicy.straggler_window`)."""
    kinds = {str(k) for k in incident_kinds}
    if IncidentKind.HANG in kinds:
        return Verdict.HUNG
    if IncidentKind.STALL in kinds:
        return Verdict.STALLED
    if kinds & _DEAD_KINDS or view.state is WorkerState.FAILED:
        return Verdict.DEAD
    if view.state is WorkerState.PENDING:
        return Verdict.PENDING
    if now is not None and view.state is WorkerState.RUNNING:
        last = view.last_event_at if view.last_event_at is not None else view.started_at
        if last is not None and now - last > policy.heartbeat_timeout:
            return Verdict.HUNG
        window = stall_window(view, policy)
        since = view.last_progress_at if view.last_progress_at is not None else view.started_at
        if view.phase == "step" and window is not None and since is not None and now - since > window:
            return Verdict.STALLED
    if view.slow_steps >= policy.straggler_window:
        return Verdict.SLOW
    return Verdict.OK


# Incident kinds that name a culprit node (quarantined); other stop incidents only end the attempt.
CULPRIT_KINDS = frozenset({IncidentKind.CRASH, IncidentKind.HANG, IncidentKind.UNREACHABLE, IncidentKind.NAN,
                           IncidentKind.IMPLAUSIBLE_PROGRESS, IncidentKind.INCONSISTENT,
                           IncidentKind.CHECKPOINT_MISMATCH, IncidentKind.ERROR})
SETTLE_S = 2.0  # after the first fatal incident, keep listening this long so the cause is told from its echoes
# After a rank's own error, wait up to this long for every other rank to report too (its own error, or an echo
# once mlx.launch kills it): a job error is the same error on every rank, and ranks fail a moment apart.
ERROR_GRACE_S = 5.0
STARTUP_CRASH = "<every rank died before its first step>"  # the signature of `Monitor.classify`'s start-up crash
JOB_ERROR = IncidentKind.JOB_ERROR
# After mlx.launch exited, wait this long for the ranks' last events (their `finished`) before its exit, with ranks
# unfinished and nothing else to explain it, is itself the failure.
FINISH_GRACE_S = 5.0


class AfterLauncherExit(StrEnum):
    """What mlx.launch's exit means now (`Monitor.after_launcher_exit`)."""

    WAIT = "wait"  # it still runs, or within the grace for the ranks' last events, or a fault still settles
    FAILED = "failed"  # nothing else explains it: the exit is the failure (`Monitor.launcher_failed`)
    RESOLVE = "resolve"  # a fault is known but never settled: resolve the verdict as it stands


@dataclass(frozen=True)
class PlannedRank:
    """One rank as the monitor needs it: where it runs (the node whose channel may speak for it), its batch and
    its calibrated rate (None: a fixed split)."""

    rank: int
    node: str
    batch_size: int
    calibrated_tokens_per_s: float | None = None
    predicted_stage_s: float | None = None  # a pipeline stage's planned compute seconds per step


@dataclass(frozen=True)
class RankError:
    """A rank's own first error: not an echo of another fault (a lost peer, mlx.launch's signals, a fence)."""

    rank: int
    node: str
    signature: str  # coordinator.run.signatures.error_signature of `message`
    message: str
    at: float
    traceback: str = ""


@dataclass(frozen=True)
class JobErrorVerdict:
    """Why a failure is the job's and not a node's."""

    signature: str
    message: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    reason: str
    earlier_nodes: tuple[str, ...] = ()  # where the same error was blamed on a node in an earlier attempt


def classify_errors(own: list[RankError], world: int, *, node_evidence: bool,
                    earlier: dict[str, frozenset[str]] | None = None) -> JobErrorVerdict | None:
    """Is this attempt's failure a job error? Pure.

    `own`: the ranks' own first errors; `world`: the number of ranks; `node_evidence`: another incident ties
    the failure to a node (a crash, hang, silence, NaN, a digest that disagrees...), which always wins;
    `earlier`: signature -> nodes an earlier attempt's own errors of that signature came from.

    A job error when every own error has one signature and either every rank reported it, or ranks on two or
    more nodes did (independent machines do not fail identically by chance), or an earlier attempt saw it on a
    different node (it followed the work). Otherwise None: the monitor's usual attribution applies."""
    if not own or node_evidence:
        return None
    signatures = {e.signature for e in own}
    if len(signatures) != 1:
        return None
    first = min(own, key=lambda e: e.at)
    ranks = tuple(sorted({e.rank for e in own}))
    nodes = tuple(sorted({e.node for e in own}))
    if len(ranks) >= world:
        return JobErrorVerdict(first.signature, first.message, ranks, nodes,
                               "every rank failed with the same error" if world > 1 else
                               "the only rank failed: no other node to compare with, nothing to quarantine")
    if len(nodes) >= 2:
        return JobErrorVerdict(first.signature, first.message, ranks, nodes,
                               f"ranks on {len(nodes)} nodes failed with the same error")
    before = sorted((earlier or {}).get(first.signature, frozenset()) - set(nodes))
    if before:
        return JobErrorVerdict(first.signature, first.message, ranks, nodes,
                               f"the same error followed the work from {', '.join(before)} to {', '.join(nodes)}",
                               tuple(before))
    return None


TRANSFERS = frozenset({"recv_act", "send_act", "recv_grad", "send_grad"})  # worker.events.TRANSFERS
COLLECTIVE = "all_sum"


@dataclass(frozen=True)
class StageWait:
    """A running pipeline stage's compute thread, from its heartbeats: the action it began last, the stage that
    action waits on (a transfer's neighbour; None for a computation or the step's collective) and since when
    (coordinator clock) it has not begun another."""

    rank: int
    action: str | None
    peer: int | None
    since: float | None


@dataclass(frozen=True)
class StageHang:
    """The stage that stopped producing: `action` begun `for_s` seconds ago and never left, while `waiting`
    (ranks) wait on it, directly or through a neighbour that waits on it."""

    rank: int
    action: str
    for_s: float
    window_s: float
    waiting: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        who = f"stages {', '.join(map(str, self.waiting))} wait on it" if self.waiting else "no stage waits on it yet"
        return {"action": self.action, "no_progress_for_s": round(self.for_s, 3), "window_s": round(self.window_s, 3),
                "waited_on_by": list(self.waiting),
                "reason": f"stage {self.rank} stopped producing: in {self.action} for {self.for_s:.0f}s (window "
                          f"{self.window_s:.0f}s); {who}"}


def evaluate_stage_hang(stages: Sequence[StageWait], *, now: float, window: float) -> StageHang | None:
    """Which pipeline stage is hung, from where each running stage's compute thread is. Pure.

    A stage in a transfer waits on its neighbour (`peer`); one in the step's collective waits on every stage:
    neither is hung, however long it waits. A stage whose compute thread has been inside a computation (a forward,
    a backward, the update) for more than `window` seconds stopped producing: it is the hung one, and the stages
    whose chain of waits leads to it are named as waiting. None when no stage qualifies: every stage waits (a
    transfer that never completes between two live stages: the link, not a stage, so no culprit here; the stall
    rule ends the attempt), or none has been stuck long enough. The longest stuck stage first when several are."""
    stuck = [s for s in stages if s.action is not None and s.action not in TRANSFERS and s.action != COLLECTIVE
             and s.since is not None and now - s.since > window]
    if not stuck:
        return None
    culprit = max(stuck, key=lambda s: (now - (s.since or now), -s.rank))
    by_rank = {s.rank: s for s in stages}

    def leads_to_culprit(s: StageWait) -> bool:
        # Follow the transfers' peers: a chain that ends at the culprit, or at a stage in the collective (which
        # waits on every stage), waits on it.
        seen = set()
        while s.action in TRANSFERS and s.peer in by_rank and s.rank not in seen:
            seen.add(s.rank)
            s = by_rank[s.peer]
        return s.rank == culprit.rank or s.action == COLLECTIVE

    waiting = tuple(sorted(s.rank for s in stages if s.rank != culprit.rank and leads_to_culprit(s)))
    return StageHang(culprit.rank, str(culprit.action), now - (culprit.since or now), window, waiting)


@dataclass(frozen=True)
class StageStraggler:
    """The bottleneck stage and how far it is off its yardstick (its predicted seconds, or its own first steps'),
    against the other stages' own ratios."""

    rank: int
    stage_s: float
    reference_s: float
    others_ratio: float

    @property
    def ratio(self) -> float:
        return self.stage_s / self.reference_s

    def to_json(self) -> dict[str, Any]:
        return {"busy_s": round(self.stage_s, 4), "predicted_stage_s": round(self.reference_s, 4),
                "exceeds_prediction_by": round(self.ratio - 1.0, 3),
                "relative_to_stages": round(self.ratio / self.others_ratio, 3),
                "reason": f"stage {self.rank} is the bottleneck: {self.stage_s:.3g}s of compute per step, "
                          f"{self.ratio:.2f}x its predicted {self.reference_s:.3g}s (the other stages run at "
                          f"{self.others_ratio:.2f}x theirs)"}


def evaluate_stage_straggler(stage_s: Mapping[int, float], reference_s: Mapping[int, float],
                             fraction: float) -> StageStraggler | None:
    """The pipeline's straggler at one step, if any. Pure. `stage_s`: each stage's measured compute seconds (its
    forwards and backwards, no transfer); `reference_s`: each one's yardstick (the plan's prediction). The
    bottleneck (the most seconds) straggles when its ratio to its yardstick exceeds the other stages' (their
    median when 3+, else the lowest) by more than 1 / `fraction`. Needs 2+ stages."""
    if len(stage_s) < 2 or set(stage_s) != set(reference_s):
        return None
    bottleneck = max(stage_s, key=lambda r: (stage_s[r], -r))
    ratios = {r: stage_s[r] / reference_s[r] for r in stage_s}
    others = sorted(x for r, x in ratios.items() if r != bottleneck)
    typical = statistics.median(others) if len(others) >= 3 else others[0]
    if typical <= 0 or ratios[bottleneck] * fraction <= typical:
        return None
    return StageStraggler(bottleneck, stage_s[bottleneck], reference_s[bottleneck], typical)


@dataclass
class Monitor:
    ranks: dict[int, RankView]
    iters: int
    heartbeat_timeout: float = 10.0
    started_at: float = 0.0
    policy: FaultPolicy = field(default_factory=FaultPolicy)
    step_locals: dict[int, dict[int, tuple[float | None, float | None, bool]]] = field(default_factory=dict)
    step_rates: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> compute tok/s
    # step -> the whole run's tokens/s at that step (all ranks' tokens / the step's wall time), from the first
    # rank to report it: what the run delivers, as opposed to what one rank computes.
    step_totals: dict[int, float] = field(default_factory=dict)
    # step -> (all ranks' real tokens, the step's wall seconds), as step_totals: a rehearsal's fit (planning/steptime)
    step_work: dict[int, tuple[float, float]] = field(default_factory=dict)
    run_step_tokens: float | None = None  # rank 0's `step_tokens_median` (a run with `token_census`: a rehearsal)
    run_census: Census | None = None  # and its census of the run's steps (planning/steptime.py)
    # Steps on which some rank traced and compiled a batch shape new to its process (its step event's `new_shape`):
    # a rehearsal fits its step time on the others and prices these apart (planning/steptime.py).
    compiling_steps: set[int] = field(default_factory=set)
    digests: dict[int, dict[int, tuple[str, str]]] = field(default_factory=dict)
    manifests: dict[int, dict[int, str]] = field(default_factory=dict)
    last_consistent_step: int | None = None
    first_step_at: dict[int, float] = field(default_factory=dict)  # rank -> time of its first step event
    first_fatal_at: float | None = None
    incidents: list[Incident] = field(default_factory=list)
    node_seen_at: dict[str, float] = field(default_factory=dict)
    stopped: bool = False
    launcher_rc: int | None = None  # mlx.launch's exit status; None before it exits, or unknown (adopted)
    launcher_exited_at: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    own_errors: dict[int, RankError] = field(default_factory=dict)  # rank -> its own first error
    # signature -> nodes that earlier attempts of this run blamed for an own error with it ("follows the work")
    earlier_errors: dict[str, frozenset[str]] = field(default_factory=dict)
    job_error: Incident | None = None
    checkpoint_dirs: dict[str, int] = field(default_factory=dict)  # node -> its newest complete checkpoint's step
    # Ranks that hold the same parameters and must agree on digests and checkpoints (the run's layout): None is
    # data parallel, every rank a replica; a pipeline's stages each hold their own blocks, one rank per group.
    replica_groups: tuple[tuple[int, ...], ...] | None = None
    # The attempt's plan of stages and memory, and what the ranks' events measured of it (coordinator.run.stages:
    # what every view shows of a pipeline's stages and the nodes' memory; no rule reads them).
    layout: RunLayout | None = None
    stages: StageFold = field(default_factory=StageFold)

    @classmethod
    def create(cls, plan: Sequence[PlannedRank], iters: int, *, now: float,
               heartbeat_timeout: float = 10.0, policy: FaultPolicy | None = None,
               max_tokens_per_row: int | None = None,
               earlier_errors: dict[str, frozenset[str]] | None = None,
               replica_groups: tuple[tuple[int, ...], ...] | None = None,
               layout: RunLayout | None = None) -> Monitor:
        """`max_tokens_per_row`: the most tokens one row of a rank's batch can add to a step event's `tokens`
        (max_seq_length x grad_accumulation, x2 for DPO's pairs); None: no plausibility bound.
        `earlier_errors`: signature -> nodes blamed for it by earlier attempts of the run (see `classify_errors`).
        `replica_groups`: which ranks must agree (None: all of them, data parallel). `layout`: the attempt's plan
        of stages and memory (`coordinator.run.stages`), for the views."""
        ranks = {p.rank: RankView(rank=p.rank, node=p.node, batch_size=p.batch_size,
                                  calibrated_tokens_per_s=p.calibrated_tokens_per_s,
                                  predicted_stage_s=p.predicted_stage_s,
                                  max_tokens_per_step=p.batch_size * max_tokens_per_row if max_tokens_per_row else None)
                 for p in plan}
        policy = policy or FaultPolicy(heartbeat_timeout=heartbeat_timeout)
        mon = cls(ranks=ranks, iters=iters, heartbeat_timeout=policy.heartbeat_timeout, started_at=now,
                  policy=policy, earlier_errors=dict(earlier_errors or {}), replica_groups=replica_groups,
                  layout=layout)
        for view in ranks.values():
            mon.node_seen_at[view.node] = now
        return mon

    # -- observations -----------------------------------------------------------------------------------------

    def observe(self, obs: Observation) -> list[Incident]:
        if obs.kind != ObservationKind.LOST:
            self.node_seen_at[obs.node] = obs.at
        if obs.kind == ObservationKind.EVENT:
            return self._event(obs)
        if obs.kind == ObservationKind.PROC:
            return self._proc(obs)
        if obs.kind == ObservationKind.LOST:
            return self._lost(obs)
        if obs.kind == ObservationKind.CHECKPOINTS:
            step = obs.data.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0 and obs.node in self.nodes():
                self.checkpoint_dirs[obs.node] = max(step, self.checkpoint_dirs.get(obs.node, 0))
            return []
        if obs.kind == ObservationKind.LAUNCHER_EXIT:
            rc = obs.data.get("rc")
            return self.launcher_exited(rc if isinstance(rc, int) else None, obs.at)
        return []

    def _add(self, incident: Incident) -> list[Incident]:
        if incident.action in FATAL_ACTIONS and self.first_fatal_at is None:
            self.first_fatal_at = incident.t
        self.incidents.append(incident)
        return [incident]

    def _event(self, obs: Observation) -> list[Incident]:
        rank = obs.rank
        raw = obs.data  # the wire record: kept verbatim in evidence and in `events`
        event = parse_event(raw)  # the typed reading every decision below uses (worker.events' coercion rule)
        step = getattr(event, "step", None)
        view = self.ranks.get(rank) if rank is not None else None
        if view is None or view.node != obs.node:
            # The channel's node does not own this rank: never trust what an event claims about its origin.
            return self._add(Incident(kind=IncidentKind.SPOOFED, node=obs.node, rank=rank, step=step,
                                      detected_after_s=0.0,
                                      evidence={"event": raw, "reason": "rank not planned on this node"},
                                      action=Action.WARN, t=obs.at))
        claimed = raw.get("rank")
        # A rank read under the event contract (1.0 is rank 1; "1" or 1.5 is no rank at all, so not this one).
        if claimed is not None and (claimed != rank if isinstance(event, EventError) else event.rank != rank):
            return self._add(Incident(kind=IncidentKind.SPOOFED, node=obs.node, rank=rank, step=step,
                                      detected_after_s=0.0,
                                      evidence={"event": raw, "reason": f"event claims rank {claimed}"},
                                      action=Action.WARN, t=obs.at))
        self.events.append({"node": obs.node, **raw})
        self.stages.observe(view.rank, event)
        view.last_event_at = obs.at  # any line from the rank's file is a sign of life, even one of an unknown kind
        if isinstance(event, StartedEvent):
            view.state = WorkerState.RUNNING
            view.pid = event.pid
            view.started_at = obs.at
            view.last_progress_at = obs.at
            view.resumed_from = event.resumed_from
            if view.resumed_from is not None:
                view.step = view.resumed_from
            view.trainable = event.trainable
            view.packing = event.packing_reason
            if event.step_tokens_median is not None:
                self.run_step_tokens = event.step_tokens_median
            if event.census_tokens:
                self.run_census = Census(tuple(float(t) for t in event.census_tokens),
                                         frozenset(event.census_new_shape or ()))
        elif isinstance(event, HeartbeatEvent):
            view.phase = event.phase
            view.action, view.peer = (event.action, event.peer) if event.phase == "step" else (None, None)
            at = (event.step or 0, event.action_index or 0)
            if view.action is not None and at != view.action_at:
                view.action_at, view.action_since = at, obs.at
        elif isinstance(event, StepEvent):
            return self._step(view, event, obs)
        elif isinstance(event, DigestEvent):
            return self._digest(view, event, obs)
        elif isinstance(event, EvalEvent):
            view.val_loss = event.val_loss
        elif isinstance(event, CheckpointEvent):
            view.checkpoint = str(event.path)
            view.checkpoint_step = event.step
            return self._checkpoint(view, event, obs)
        elif isinstance(event, FinishedEvent):
            view.state = WorkerState.FINISHED
            view.step = event.step or view.step
            if event.checkpoint:
                view.checkpoint = event.checkpoint
        elif isinstance(event, ErrorEvent):
            view.state = WorkerState.FAILED
            view.error = str(event.message)
            if self.stopped and is_echo(view.error):
                # Read after the run was stopped: the stop's own teardown (SIGTERM) or a peer lost to it.
                return []
            # An error after another fault, or about a lost peer, is an echo (peers lose the ring when a rank
            # dies, and may say so before the death itself is seen): not a culprit. A process that died without
            # an error event (crash), stopped (hang) or went silent (unreachable) is one, whatever the order.
            known = explain_error(view.error)
            # An error that names a peer's absence (its connect refused when the ring was formed) blames no node:
            # before the rank's first step it is a start-up race (`startup_race`: relaunched, nobody quarantined).
            peer = known is not None and known.blame == "peer"
            echo = self.first_fatal_at is not None or is_echo(view.error) or peer
            # `fault: job` (a resume with no valid checkpoint): every rank fails alike, no node is to blame.
            job = event.fault == "job"
            evidence: dict[str, Any] = {"message": view.error, "traceback": (event.traceback or "")[-2000:],
                                        "echo": echo}
            if job:
                evidence["fault"] = "job"
            elif not is_echo(view.error) and not event.fenced and not peer:
                # Its own error, whatever the order: kept for the job-error comparison (a later rank's own error
                # with the same signature is the same failure, not an echo of the first).
                sig = error_signature(view.error, {v.node for v in self.ranks.values()})
                self.own_errors.setdefault(view.rank, RankError(view.rank, obs.node, sig, view.error, obs.at,
                                                                evidence["traceback"]))
                evidence["signature"] = sig
            if known is not None:
                evidence["explanation"] = known.to_json()
            if peer and view.rank not in self.first_step_at:
                evidence["startup_race"] = True
            return self._add(Incident(kind=IncidentKind.ERROR, node=obs.node, rank=rank, step=view.step,
                                      detected_after_s=0.0, evidence=evidence,
                                      action=Action.STOP if echo or job else Action.QUARANTINE, t=obs.at))
        return []

    def _step(self, view: RankView, event: StepEvent, obs: Observation) -> list[Incident]:
        found: list[Incident] = []
        step = event.step or 0
        tokens = event.tokens
        peers = [v.step for v in self.ranks.values() if v.rank != view.rank]
        lies = []
        if step > self.iters:
            lies.append(f"step {step} > iters {self.iters}")
        if peers and step > max(peers) + self.policy.ahead_steps and step > view.step + self.policy.ahead_steps:
            lies.append(f"step {step} while its peers are at {max(peers)} (a synchronous job moves together)")
        if tokens is not None and view.max_tokens_per_step is not None and tokens > view.max_tokens_per_step:
            lies.append(f"{tokens} tokens in one step > the {view.max_tokens_per_step} its batch of "
                        f"{view.batch_size} can hold")
        if lies:
            if not any(i.kind == IncidentKind.IMPLAUSIBLE_PROGRESS and i.rank == view.rank for i in self.incidents):
                found += self._add(Incident(kind=IncidentKind.IMPLAUSIBLE_PROGRESS, node=obs.node, rank=view.rank,
                                            step=view.step, detected_after_s=0.0, evidence={"claims": lies, "event": obs.data},
                                            action=Action.QUARANTINE, t=obs.at))
            return found  # a lying report is never applied to the view
        if step > view.step:
            view.last_progress_at = obs.at
            step_time = event.step_time_s
            if step_time is not None:
                view.steps.add(step_time)
        self.first_step_at.setdefault(view.rank, obs.at)
        view.step = max(view.step, step)
        view.loss = event.loss
        view.tokens_per_s = event.tok_s
        if event.tok_s is not None and event.tok_s > 0:
            view.recent_tok_s = [*view.recent_tok_s[-(RATE_STEPS - 1):], event.tok_s]
        view.peak_memory = event.peak_memory
        view.grad_norm = event.grad_norm
        view.compute_tokens_per_s = event.compute_tok_s
        local_loss = event.local_loss
        finite = event.local_loss_finite
        # A pipeline stage says whose a non-finite value at its boundary is: one it received is its neighbour's
        # (the receiver is never blamed), one it computed from finite inputs is its own.
        if event.nonfinite == "produced" or (finite is False and event.nonfinite != "received"):
            evidence: dict[str, Any] = {"local_loss": obs.data.get("local_loss"), "loss": obs.data.get("loss")}
            if event.nonfinite is not None:
                evidence.update(reason=f"stage {view.rank} {event.nonfinite_at}: not finite, from finite inputs",
                                nonfinite_at=event.nonfinite_at)
            found += self._add(Incident(kind=IncidentKind.NAN, node=obs.node, rank=view.rank, step=step, detected_after_s=0.0,
                                        evidence=evidence, action=Action.QUARANTINE, t=obs.at))
            finite = False
        elif event.nonfinite == "received":
            finite = None  # not this stage's: its neighbour's report names the source
        self.step_locals.setdefault(step, {})[view.rank] = (local_loss, event.local_grad_norm, finite is not False)
        if view.compute_tokens_per_s is not None and view.compute_tokens_per_s > 0:
            self.step_rates.setdefault(step, {})[view.rank] = view.compute_tokens_per_s
        if event.new_shape:
            self.compiling_steps.add(step)
        total, wall = event.total_tokens, event.step_time_s
        if total is not None and total > 0 and wall is not None and wall > 0:
            self.step_totals.setdefault(step, total / wall)
            self.step_work.setdefault(step, (float(total), float(wall)))
        if event.busy_s is not None and event.busy_s > 0 and obs.at != self.first_step_at[view.rank]:
            view.stage_times = [*view.stage_times[-(RATE_STEPS - 1):], event.busy_s]
        found += self._stage_stragglers(step, obs) if self.replica_groups is not None else self._stragglers(step, obs)
        found += self._outliers(step, obs)
        return found

    def _stragglers(self, step: int, obs: Observation) -> list[Incident]:
        """A rank whose compute rate, relative to its calibrated rate, is below `straggler_fraction` of the
        fleet's (the median of 3+ ranks, the fastest of 2) for `straggler_window` steps and `straggler_min_s`
        seconds. Relative, because the
        bench's absolute rate (padded random batches) is not the training data's; in a calibrated split every
        rank should run at the same fraction of its calibrated rate."""
        rates = self.step_rates.get(step, {})
        if len(rates) < len(self.ranks) or len(self.ranks) < 2:
            return []
        calibrated = all(self.ranks[r].calibrated_tokens_per_s for r in rates)
        rel = self._relative(rates, {r: self.ranks[r].calibrated_tokens_per_s or 1.0 for r in rates})
        slow = {r for r, (value, ref) in rel.items() if value < self.policy.straggler_fraction * ref}
        if not calibrated:
            # No calibration (a fixed split): raw rates can only be compared across ranks of the same speed, and
            # an honest slower machine is no straggler. So a rank must also be slow against its own start (the
            # median of its first steps): slower than its peers AND slower than it was.
            baselines = {r: self._own_baseline(r) for r in rates}
            if any(b is None for b in baselines.values()):
                slow = set()
            else:
                own = self._relative(rates, {r: b or 1.0 for r, b in baselines.items()})
                slow &= {r for r, (value, ref) in own.items() if value < self.policy.straggler_fraction * ref}
        found: list[Incident] = []
        for rank, (value, ref) in rel.items():
            view = self.ranks[rank]
            view.slow_steps = view.slow_steps + 1 if rank in slow else 0
            view.slow_since = (view.slow_since or obs.at) if rank in slow else None
            if view.slow_steps >= self.policy.straggler_window and not view.straggler_reported \
                    and view.slow_since is not None and obs.at - view.slow_since >= self.policy.straggler_min_s:
                view.straggler_reported = True
                found += self._add(Incident(
                    kind=IncidentKind.STRAGGLER, node=view.node, rank=rank, step=step, detected_after_s=None,
                    evidence={"compute_tokens_per_s": round(rates[rank], 1),
                              "calibrated_tokens_per_s": view.calibrated_tokens_per_s,
                              "relative_to_fleet": round(value / ref, 3), "steps": view.slow_steps},
                    action=Action.WARN, t=obs.at))
        return found

    def _stage_stragglers(self, step: int, obs: Observation) -> list[Incident]:
        """A pipeline's straggler: the bottleneck stage (the most compute seconds per step: every other stage
        waits on it) when it runs slower against its own yardstick than the other stages do against theirs, by
        more than 1 / `straggler_fraction`, for `straggler_window` steps and `straggler_min_s` seconds. Its
        yardstick is the plan's prediction for it (`PlannedRank.predicted_stage_s`), else its own first steps'
        median (a fixed split): a uniformly wrong prediction makes no straggler, one stage far off it does.
        Reported once, as a warning that names the stage, its layers' node and how far it exceeds its prediction."""
        views = [v for v in self.ranks.values() if v.state is not WorkerState.FAILED]
        if len(views) < 2 or any(not v.stage_times for v in views):
            return []
        refs = {v.rank: v.predicted_stage_s or self._own_stage_baseline(v) for v in views}
        if any(r is None or r <= 0 for r in refs.values()):
            return []
        latest = {v.rank: v.stage_times[-1] for v in views}
        verdict = evaluate_stage_straggler(latest, {r: x for r, x in refs.items() if x is not None},
                                           self.policy.straggler_fraction)
        found: list[Incident] = []
        for v in views:
            slow = verdict is not None and verdict.rank == v.rank
            v.slow_steps = v.slow_steps + 1 if slow else 0
            v.slow_since = (v.slow_since or obs.at) if slow else None
            if slow and verdict is not None and v.slow_steps >= self.policy.straggler_window \
                    and not v.straggler_reported and v.slow_since is not None \
                    and obs.at - v.slow_since >= self.policy.straggler_min_s:
                v.straggler_reported = True
                evidence = {**verdict.to_json(), "steps": v.slow_steps,
                            "yardstick": "plan" if v.predicted_stage_s else "its own first steps"}
                found += self._add(Incident(kind=IncidentKind.STRAGGLER, node=v.node, rank=v.rank, step=step,
                                            detected_after_s=None, evidence=evidence, action=Action.WARN, t=obs.at))
        return found

    def _own_stage_baseline(self, view: RankView) -> float | None:
        """A stage without a prediction: the median of its first `straggler_window` measured steps."""
        window = self.policy.straggler_window
        return statistics.median(view.stage_times[:window]) if len(view.stage_times) > window else None

    @staticmethod
    def _relative(rates: dict[int, float], refs: dict[int, float]) -> dict[int, tuple[float, float]]:
        """rank -> (its rate / its reference, the fleet's value of that ratio: the median of 3+ ranks, the best
        of 2)."""
        rel = {r: rate / refs[r] for r, rate in rates.items()}
        values = sorted(rel.values())
        fleet = statistics.median(values) if len(values) >= 3 else values[-1]
        return {r: (v, fleet) for r, v in rel.items()}

    def _own_baseline(self, rank: int) -> float | None:
        """Without a calibration (a fixed split) a rank is compared with itself: the median of its compute rate
        over its first `straggler_window` steps after the first (which compiles). Comparing raw rates across
        ranks would call the slower machine of an honest heterogeneous fleet a straggler."""
        window = self.policy.straggler_window
        first = sorted(s for s, rates in self.step_rates.items() if rank in rates)
        if len(first) < window + 1:
            return None
        return statistics.median([self.step_rates[s][rank] for s in first[1:window + 1]])

    def _outliers(self, step: int, obs: Observation) -> list[Incident]:
        """Robust statistics over the ranks' LOCAL loss and grad norm at one step (median/MAD, needs 3+
        ranks): a rank far from the others for `outlier_steps` consecutive steps is flagged (a warning: the
        digests decide Byzantine replicas; honest heterogeneous batches stay within the relative floor)."""
        values = self.step_locals.get(step, {})
        if len(values) < len(self.ranks) or len(self.ranks) < 3 or self.replica_groups is not None:
            return []  # a pipeline's stages hold different blocks: their local values are not comparable
        flagged: set[int] = set()
        for idx in (0, 1):
            series: dict[int, float] = {}
            for r, v in values.items():
                x = v[idx]
                if isinstance(x, float):
                    series[r] = x
            flagged |= robust_outliers(series, self.policy.outlier_mads, self.policy.outlier_rel)
        found: list[Incident] = []
        for rank, view in self.ranks.items():
            view.outlier_steps = view.outlier_steps + 1 if rank in flagged else 0
            if view.outlier_steps == self.policy.outlier_steps:
                found += self._add(Incident(kind=IncidentKind.OUTLIER, node=view.node, rank=rank, step=step,
                                            detected_after_s=None, evidence={"local": {r: values[r][:2] for r in values}},
                                            action=Action.WARN, t=obs.at))
        return found

    def _digest(self, view: RankView, event: DigestEvent, obs: Observation) -> list[Incident]:
        step = event.step
        if step is None:
            return []
        table = self.digests.setdefault(step, {})
        table[view.rank] = (str(event.params_sha256), str(event.optimizer_sha256))
        live = [r for r, v in self.ranks.items() if v.state is not WorkerState.FAILED]
        if any(r not in table for r in live):
            return []
        return self._votes(IncidentKind.INCONSISTENT, step, {r: table[r] for r in live}, obs.at,
                           "params/optimizer digest")

    def _checkpoint(self, view: RankView, event: CheckpointEvent, obs: Observation) -> list[Incident]:
        step, sha = event.step, event.sha256
        if step is None or sha is None:
            return []
        table = self.manifests.setdefault(step, {})
        table[view.rank] = sha
        live = [r for r, v in self.ranks.items() if v.state is not WorkerState.FAILED]
        if any(r not in table for r in live):
            return []
        return self._votes(IncidentKind.CHECKPOINT_MISMATCH, step, {r: table[r] for r in live}, obs.at,
                           "checkpoint manifest")

    def _votes(self, kind: IncidentKind, step: int, values: dict[int, Any], at: float, what: str) -> list[Incident]:
        """One vote per replica group (`replica_groups`); a group of one rank has nothing to compare."""
        if not values:
            # Every rank failed before this step's last digest or manifest was read (a stop, Ctrl-C, a crash of
            # all): no live replica is left to vote, and no step is marked consistent on nobody's word.
            return []
        if self.replica_groups is None:
            return self._vote(kind, step, values, at, what)
        found: list[Incident] = []
        for group in self.replica_groups:
            members = {r: values[r] for r in group if r in values}
            if len(members) > 1:
                found += self._vote(kind, step, members, at, what)
        if kind == IncidentKind.INCONSISTENT and not found:
            self.last_consistent_step = max(self.last_consistent_step or 0, step)
        return found

    def _vote(self, kind: IncidentKind, step: int, values: dict[int, Any], at: float, what: str) -> list[Incident]:
        """Replicas must agree exactly. With a strict majority the odd ranks are culprits; without one (two
        ranks that disagree) every rank is suspect and the attempt stops without naming a culprit."""
        groups: dict[Any, list[int]] = {}
        for rank, value in values.items():
            groups.setdefault(value, []).append(rank)
        if len(groups) == 1:
            if kind == IncidentKind.INCONSISTENT:
                self.last_consistent_step = max(self.last_consistent_step or 0, step)
            return []
        ranked = sorted(groups.values(), key=len, reverse=True)
        evidence = {"step": step, "values": {str(r): v for r, v in values.items()}, "what": what}
        if len(ranked[0]) > len(ranked[1]):
            found: list[Incident] = []
            for group in ranked[1:]:
                for rank in group:
                    view = self.ranks[rank]
                    found += self._add(Incident(kind=kind, node=view.node, rank=rank, step=step, detected_after_s=0.0,
                                                evidence={**evidence, "majority": ranked[0]}, action=Action.QUARANTINE, t=at))
            return found
        suspects = sorted(self.ranks[r].node for r in values)
        return self._add(Incident(kind=kind, node=",".join(suspects), rank=None, step=step, detected_after_s=0.0,
                                  evidence={**evidence, "suspects": suspects, "note": "no majority: every replica is suspect"},
                                  action=Action.STOP, t=at))

    def _proc(self, obs: Observation) -> list[Incident]:
        view = self.ranks.get(obs.rank) if obs.rank is not None else None
        if view is None or view.node != obs.node:
            return []
        if obs.data.get("state") == "T" and view.state is WorkerState.RUNNING:
            # Stopped (SIGSTOP, a debugger, a frozen Mac's process): it cannot answer; its peers wait forever.
            view.stopped_since = view.stopped_since or obs.at
            if obs.at - view.stopped_since >= self.policy.stopped_grace_s:
                view.state = WorkerState.FAILED
                last = view.last_event_at or obs.at
                return self._add(Incident(kind=IncidentKind.HANG, node=obs.node, rank=obs.rank, step=view.step,
                                          detected_after_s=max(0.0, obs.at - last),
                                          evidence={"pid": obs.data.get("pid"), "state": "T (stopped)",
                                                    **self._waited_on(view.rank)},
                                          action=Action.QUARANTINE, t=obs.at))
            return []
        view.stopped_since = None
        if obs.data.get("alive", True):
            view.last_alive_at = obs.at
        elif view.state is WorkerState.RUNNING:
            view.state = WorkerState.FAILED
            # The death happened after the last check that found the process alive. Not after its last event:
            # a rank's last words are read in the same poll as the news of its death, so they arrive together
            # and the detection would read 0.0 s.
            last = view.last_alive_at or view.last_event_at or obs.at
            return self._add(Incident(kind=IncidentKind.CRASH, node=obs.node, rank=obs.rank, step=view.step,
                                      detected_after_s=max(0.0, obs.at - last),
                                      evidence={"pid": obs.data.get("pid"), "state": obs.data.get("state")},
                                      action=Action.QUARANTINE, t=obs.at))
        return []

    def _lost(self, obs: Observation) -> list[Incident]:
        failed: list[Incident] = []
        for view in self.ranks.values():
            if view.node == obs.node and view.state in (WorkerState.PENDING, WorkerState.RUNNING):
                view.state = WorkerState.FAILED
        if any(i.kind == IncidentKind.UNREACHABLE and i.node == obs.node for i in self.incidents):
            return failed  # already reported (the channel may close after the silence was detected)
        last = self.node_seen_at.get(obs.node, self.started_at)
        failed += self._add(Incident(kind=IncidentKind.UNREACHABLE, node=obs.node, rank=None,
                                     step=self.node_step(obs.node), detected_after_s=obs.at - last,
                                     evidence={"reason": obs.data.get("reason", "channel lost")},
                                     action=Action.QUARANTINE, t=obs.at))
        return failed

    # -- the launcher and the connection check: decisions the I/O loops ask for -------------------------------

    def launcher_exited(self, rc: int | None, at: float) -> list[Incident]:
        """mlx.launch exited at `at` with status `rc` (None: unknown, a launcher adopted by `attach`, not our
        child). No incident yet: it exits 0 whatever its ranks did, and their last events may still be on the
        way; `after_launcher_exit` says when the exit itself is the failure. Only the first exit counts."""
        if self.launcher_exited_at is None:
            self.launcher_exited_at = at
            self.launcher_rc = rc
        return []

    def after_launcher_exit(self, now: float) -> AfterLauncherExit:
        """What mlx.launch's exit means at `now`. WAIT while it runs or within FINISH_GRACE_S of its exit (late
        events); then FAILED when the run has no outcome (not every rank finished and nothing else explains it:
        record `launcher_failed`); RESOLVE when a fault is known but not yet settled (a node that vanished is found
        only by its silence) past the heartbeat timeout more; WAIT otherwise."""
        if self.launcher_exited_at is None or now - self.launcher_exited_at <= FINISH_GRACE_S:
            return AfterLauncherExit.WAIT
        if self.outcome() is None:
            return AfterLauncherExit.FAILED
        if now - self.launcher_exited_at > FINISH_GRACE_S + self.policy.heartbeat_timeout + 1.0:
            return AfterLauncherExit.RESOLVE
        return AfterLauncherExit.WAIT

    def launcher_failed(self, now: float, *, log_tail: str) -> Incident:
        """The `launcher_exit` incident (action stop, node `coordinator`) once `after_launcher_exit` said FAILED;
        `log_tail`: the end of launcher.log, its only evidence. Appended as it is: the attempt ends with it, there
        is nothing left to settle.

        When no rank of the attempt ever finished a step, the ranks could not start at all (NCCL refusing its
        communicator, a configuration every rank shares): the same launch would fail the same way, so it is the
        job's (`fault: job`, `job_fault`): no relaunch. Its `message` says so in words, with the launcher log's last
        error line; mlx.launch's status is shown as what it is (it exits 0 whatever its ranks did)."""
        since = self.launcher_exited_at if self.launcher_exited_at is not None else now
        unfinished = sum(1 for v in self.ranks.values() if v.state is not WorkerState.FINISHED)
        status = ("an unknown status" if self.launcher_rc is None else f"status {self.launcher_rc}"
                  + (" (it exits 0 whatever its ranks did)" if self.launcher_rc == 0 else ""))
        evidence: dict[str, Any] = {"rc": self.launcher_rc, "log_tail": log_tail}
        line = last_error_line(log_tail)
        if not self.first_step_at:
            evidence["fault"] = "job"
            evidence["message"] = (f"mlx.launch ended with {status} before any rank finished a step: the ranks "
                                   f"could not start" + (f" ({line})" if line else " (see launcher.log)"))
            known = explain_error(line)
            if known is not None:
                evidence["explanation"] = known.to_json()
        else:
            evidence["message"] = (f"mlx.launch ended with {status} while {unfinished} of {len(self.ranks)} rank(s) "
                                   "had not finished, and no rank reported why"
                                   + (f" (launcher.log: {line})" if line else ""))
        incident = Incident(kind=IncidentKind.LAUNCHER_EXIT, node="coordinator", rank=None, step=self.step(),
                            detected_after_s=now - since, evidence=evidence, action=Action.STOP, t=now)
        self.incidents.append(incident)
        return incident

    def unreachable_before_relaunch(self, node: str, reason: str, at: float) -> Incident:
        """`node` failed the connection check before a relaunch: found by the job loop, not by this attempt's
        channels, yet an incident of this attempt (`unreachable`, action quarantine, no detection delay: its
        last word is unknown), so its node is a culprit like any other."""
        incident = Incident(kind=IncidentKind.UNREACHABLE, node=node, rank=None, step=self.node_step(node),
                            detected_after_s=None,
                            evidence={"reason": reason, "found_by": "connection check before relaunch"},
                            action=Action.QUARANTINE, t=at)
        self.incidents.append(incident)
        return incident

    # -- time-based checks ------------------------------------------------------------------------------------

    def check(self, now: float) -> list[Incident]:
        """Silent failures. A node whose channel said nothing (not even a tick) for `heartbeat_timeout` is
        unreachable; checked first, so its ranks' silence is attributed to the node, not to a hang. A running
        rank on a live channel with no event (heartbeat or step) for `heartbeat_timeout` hangs."""
        found: list[Incident] = []
        for node in sorted({v.node for v in self.ranks.values() if v.state is WorkerState.RUNNING}):
            silent = now - self.node_seen_at.get(node, self.started_at)
            if silent > self.heartbeat_timeout:
                found += self._lost(Observation(ObservationKind.LOST, node, now, data={
                    "reason": f"no word from the node for {silent:.1f}s (asleep, link down or sshd gone)"}))
        for view in self.ranks.values():
            if view.state is not WorkerState.RUNNING:
                continue
            last = view.last_event_at or view.started_at or self.started_at
            if now - last > self.heartbeat_timeout:
                view.state = WorkerState.FAILED
                found += self._add(Incident(kind=IncidentKind.HANG, node=view.node, rank=view.rank, step=view.step,
                                            detected_after_s=now - last,
                                            evidence={"silent_for_s": round(now - last, 3),
                                                      "heartbeat_timeout": self.heartbeat_timeout,
                                                      **self._waited_on(view.rank)},
                                            action=Action.QUARANTINE, t=now))
        found += self._stage_hangs(now)
        found += self._stalls(now)
        return found

    def _waited_on(self, rank: int) -> dict[str, Any]:
        """Evidence for a pipeline stage found hung: the stages whose compute thread waits on it (their transfer's
        peer is this stage). Empty for data parallel."""
        waiting = sorted(v.rank for v in self.ranks.values()
                         if v.rank != rank and v.state is WorkerState.RUNNING and v.action in TRANSFERS and v.peer == rank)
        return {"waited_on_by": waiting} if waiting else {}

    def _stage_hangs(self, now: float) -> list[Incident]:
        """`evaluate_stage_hang` over the pipeline's running stages: the one that stopped producing is hung (a
        culprit); the stages that wait on it in a transfer are not. Before any fatal incident only (a stage that
        died or stopped is found by its own rules, and its waiting neighbours are then echoes)."""
        if self.first_fatal_at is not None or self.replica_groups is None:
            return []
        stages = [StageWait(v.rank, v.action, v.peer, v.action_since) for v in self.ranks.values()
                  if v.state is WorkerState.RUNNING and v.phase == "step" and v.action is not None]
        windows = [w for v in self.ranks.values() if (w := self.stall_window(v)) is not None]
        if not stages or not windows:
            return []
        verdict = evaluate_stage_hang(stages, now=now, window=max(windows))
        if verdict is None:
            return []
        view = self.ranks[verdict.rank]
        view.state = WorkerState.FAILED
        return self._add(Incident(kind=IncidentKind.HANG, node=view.node, rank=view.rank, step=view.step,
                                  detected_after_s=verdict.for_s, evidence=verdict.to_json(),
                                  action=Action.QUARANTINE, t=now))

    def stall_window(self, view: RankView) -> float | None:
        """Seconds without a finished step after which `view`'s rank is stalled; None before its first step (the
        first step compiles and may wait for slow peers to load). Never within the heartbeat timeout: a node that
        vanished stalls its peers too, and must first be found by its silence (the culprit), not as a stall."""
        return stall_window(view, self.policy)

    def _stalls(self, now: float) -> list[Incident]:
        """Ranks alive and heartbeating inside a step that never ends: what a data-plane link that went down
        while SSH still works looks like (every rank waits in the collective; mlx's ring retries its sockets for
        many minutes). No culprit can be named from here (any link of the ring may be the broken one), so the
        attempt stops and relaunches on the same nodes from the last checkpoint; the connection check before the
        relaunch still drops a node that became unreachable."""
        found: list[Incident] = []
        if self.first_fatal_at is not None:
            return found
        found += self._first_step_stalls(now)
        # A pipeline moves inside a step too: while any stage's compute thread begins actions, it is not stalled.
        moved = max((v.action_since for v in self.ranks.values()
                     if v.state is WorkerState.RUNNING and v.action_since is not None), default=0.0)
        for view in self.ranks.values():
            window = self.stall_window(view)
            if view.state is not WorkerState.RUNNING or view.phase != "step" or window is None:
                continue
            since = max(view.last_progress_at or view.started_at or self.started_at, moved)
            if now - since > window:
                found += self._add(Incident(
                    kind=IncidentKind.STALL, node=view.node, rank=view.rank, step=view.step,
                    detected_after_s=now - since,
                    evidence={"no_step_for_s": ms_above(now - since), "window_s": ms_below(window),
                              "median_step_s": round(view.steps.median() or 0.0, 3), "phase": view.phase},
                    action=Action.STOP, t=now))
        return found

    def _first_step_stalls(self, now: float) -> list[Incident]:
        """Ranks that ended no step `first_step_s` after the attempt started (`FaultPolicy.first_step_s`), pending
        or running, with their channel alive (a silent one is found by its silence first). Like a stall, no culprit:
        a ring that never forms waits on any of its links."""
        found: list[Incident] = []
        waited = now - self.started_at
        if waited <= self.policy.first_step_s:
            return found
        for view in self.ranks.values():
            if view.rank in self.first_step_at or view.state not in (WorkerState.PENDING, WorkerState.RUNNING):
                continue
            found += self._add(Incident(
                kind=IncidentKind.STALL, node=view.node, rank=view.rank, step=view.step, detected_after_s=waited,
                evidence={"no_first_step_for_s": ms_above(waited), "first_step_s": self.policy.first_step_s,
                          "state": str(view.state), "phase": view.phase},
                action=Action.STOP, t=now))
        return found

    # -- results ----------------------------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted({v.node for v in self.ranks.values()})

    def node_step(self, node: str) -> int:
        return max((v.step for v in self.ranks.values() if v.node == node), default=0)

    def _secondary(self, inc: Incident) -> bool:
        """A crash seen after another node's fault had begun: possibly collateral. When a node vanishes, mlx.launch
        kills the ranks on the OTHER nodes (its remote `kill $pid`), and such a rank can die before its error
        event is written; the dead process then looks like a crash of an innocent node, and it is seen long before
        the vanished node's silence reaches the heartbeat timeout. So a fault's onset counts, not its detection:
        a silent node's began at its last word (detection time minus `detected_after_s`)."""
        if inc.kind != IncidentKind.CRASH:
            return False
        return any(other is not inc and other.node != inc.node and other.action in FATAL_ACTIONS
                   and other.t - (other.detected_after_s or 0.0) < inc.t for other in self.incidents)

    def culprits(self) -> list[str]:
        """Nodes to quarantine: those named by a culprit incident (echoes excluded), in detection order. Secondary
        crashes count only when nothing else names a culprit (a crash whose echoes happened to arrive first) and
        no start-up race explains the failure (mlx.launch kills the other ranks once the one that could not
        connect exits)."""
        primary: list[str] = []
        secondary: list[str] = []
        for inc in self.incidents:
            if inc.action == Action.QUARANTINE and inc.kind in CULPRIT_KINDS:
                out = secondary if self._secondary(inc) else primary
                if inc.node not in out:
                    out.append(inc.node)
        if primary or self._race() is not None:
            return primary
        return secondary

    def _race(self) -> Incident | None:
        return next((i for i in self.incidents if i.evidence.get("startup_race")), None)

    def startup_race(self) -> Incident | None:
        """The error that ended this attempt when its ranks could not connect at start-up (a peer not listening
        yet), when nothing names a culprit: the attempt is relaunched on the same nodes, nobody quarantined
        (`job.supervise`, within STARTUP_RETRIES). None otherwise."""
        race = self._race()
        return race if race is not None and not self.culprits() and self.job_error is None else None

    def classify(self) -> JobErrorVerdict | None:
        """`classify_errors` over this attempt's observations: is the failure the job's?"""
        node_evidence = any(i.action == Action.QUARANTINE and i.kind in CULPRIT_KINDS and i.kind != IncidentKind.ERROR
                            and not self._secondary(i) for i in self.incidents)
        verdict = classify_errors(list(self.own_errors.values()), len(self.ranks), node_evidence=node_evidence,
                                  earlier=self.earlier_errors)
        if verdict is not None or self.own_errors or self.first_step_at or len(self.ranks) < 2:
            return verdict
        # Every rank died silently before any step: nothing ties it to a node (a peer of a node's fault would have
        # written an echo on its way out); an abort in mlx's or NCCL's set-up does this on every rank, and a
        # relaunch, or quarantining the whole fleet one node at a time, would only repeat it.
        crashed = [i for i in self.incidents if i.kind == IncidentKind.CRASH and i.rank is not None]
        if {i.rank for i in crashed} != set(self.ranks):
            return None
        return JobErrorVerdict(STARTUP_CRASH, "every rank's process died before its first step without reporting an "
                               "error (an abort in mlx's or NCCL's set-up, or a signal to every rank): launcher.log "
                               "holds the ranks' own output", tuple(sorted(self.ranks)),
                               tuple(sorted({i.node for i in crashed})), "every rank died while starting")

    def _judge_job_error(self) -> list[Incident]:
        """When the failure is the job's: every incident that would quarantine a node, and every rank's own copy of
        the error, is revised to `stop` with evidence `job_error: true`, and one `job_error` incident carries the
        message, its cause and remedy.
        Returns the revised incidents followed by the new one."""
        verdict = self.classify()
        if verdict is None or self.job_error is not None:
            return []
        revised: list[Incident] = []
        for idx, inc in enumerate(self.incidents):
            # Whatever would quarantine a node, and every rank's own copy of the error (marked, so that it is
            # shown once: with the job_error incident).
            if inc.action == Action.QUARANTINE or (inc.kind == IncidentKind.ERROR
                                                   and inc.evidence.get("signature") == verdict.signature):
                new = replace(inc, action=Action.STOP, evidence={**inc.evidence, "job_error": True})
                self.incidents[idx] = new
                revised.append(new)
        if self.own_errors:
            first = min(self.own_errors.values(), key=lambda e: e.at)
            message, traceback, first_at = first.message, first.traceback, first.at
            last = max(e.at for e in self.own_errors.values())
        else:  # every rank crashed at start (`classify`)
            times = [i.t for i in self.incidents if i.kind == IncidentKind.CRASH]
            message, traceback, first_at, last = verdict.message, "", min(times), max(times)
        known = explain_error(message)
        evidence: dict[str, Any] = {
            "message": message, "signature": verdict.signature, "reason": verdict.reason,
            "ranks": list(verdict.ranks), "nodes": list(verdict.nodes), "traceback": traceback,
            "cause": known.cause if known else "the same failure on every node: the playbook, model or data",
            "remedy": known.remedy if known else ("fix what the message names (the traceback is in this incident "
                                                  "and runs/<id>/events.jsonl), then relaunch; no node is at fault"),
        }
        if known is not None:
            evidence["code"] = known.code
        if verdict.earlier_nodes:
            evidence["earlier_nodes"] = list(verdict.earlier_nodes)
        self.job_error = Incident(kind=JOB_ERROR, node=",".join(verdict.nodes), rank=None, step=self.step(),
                                  detected_after_s=last - first_at, evidence=evidence, action=Action.STOP, t=last)
        self.incidents.append(self.job_error)
        return [*revised, self.job_error]

    def resolve(self) -> list[Incident]:
        """Once the verdict has settled: a job error is judged (`classify`: nobody is a culprit; the `job_error`
        incident is returned last, new, the others revised); otherwise secondary crashes on nodes that are not
        culprits become echoes (action `stop`, evidence says why). Returns the incidents the caller records."""
        judged = self._judge_job_error()
        if judged:
            return judged
        blamed = set(self.culprits())
        revised: list[Incident] = []
        for idx, inc in enumerate(self.incidents):
            if inc.action == Action.QUARANTINE and self._secondary(inc) and inc.node not in blamed:
                new = replace(inc, action=Action.STOP, evidence={**inc.evidence, "collateral_of": sorted(blamed),
                                                             "note": "died after the fault, without an error event"})
                self.incidents[idx] = new
                revised.append(new)
        return revised

    def culprit_incident(self, node: str) -> Incident | None:
        """The first incident that made `node` a culprit."""
        return next((i for i in self.incidents if i.node == node and i.action == Action.QUARANTINE
                     and i.kind in CULPRIT_KINDS), None)

    def settled(self, now: float) -> bool:
        """True once the verdict can stand: a culprit is named and SETTLE_S passed since the first fatal incident
        (its echoes have arrived); or, with only echoes so far (a node that vanished says nothing), once the
        heartbeat timeout has passed, so the silent node is found by `check`."""
        if self.first_fatal_at is None:
            return False
        waited = now - self.first_fatal_at
        if waited >= self.heartbeat_timeout + 1.0:
            return True
        blamed = set(self.culprits())
        # Every node not blamed must have spoken since the fault: a node that went silent at the same time may
        # be the real culprit (its silence becomes `unreachable` at the heartbeat timeout).
        heard = all(self.node_seen_at.get(n, 0.0) > self.first_fatal_at for n in self.nodes() if n not in blamed)
        explained = bool(blamed) or self.job_fault() is not None or self._race() is not None
        return explained and waited >= SETTLE_S and heard and self._errors_in(now)

    def job_fault(self) -> Incident | None:
        """The first error that every rank hit because of the job itself (`fault: job`), not because of a node, or
        a launch whose ranks never started (`launcher_failed`): relaunching cannot help, and nobody is quarantined
        for it."""
        return next((i for i in self.incidents if i.kind in (IncidentKind.ERROR, IncidentKind.LAUNCHER_EXIT)
                     and i.evidence.get("fault") == "job"), None)

    def _errors_in(self, now: float) -> bool:
        """After a rank's own error: every other rank has reported an error or ended (a job error is the same
        error on every rank, a moment apart), or ERROR_GRACE_S has passed since the first own error."""
        if not self.own_errors:
            return True
        first = min(e.at for e in self.own_errors.values())
        if now - first >= ERROR_GRACE_S:
            return True
        return all(v.state in (WorkerState.FAILED, WorkerState.FINISHED) for v in self.ranks.values())

    def outcome(self) -> RunState | None:
        """How the attempt ended (None: not yet). A stop (`stopped`: a signal, `coordinator stop`) that came
        when every rank had already finished, or after a job error was judged, changes nothing: the run
        succeeded, or failed with that error. What happened is recorded, not the order of the news."""
        fatal = any(i.action in FATAL_ACTIONS for i in self.incidents)
        finished = all(v.state is WorkerState.FINISHED for v in self.ranks.values())
        if self.stopped and self.job_error is None and not (finished and not fatal):
            return RunState.STOPPED
        if fatal or any(v.state is WorkerState.FAILED for v in self.ranks.values()):
            return RunState.FAILED
        if finished:
            return RunState.SUCCEEDED
        return None

    def step(self) -> int:
        """The step every rank has reached (the live view's): the slowest rank's."""
        return min((v.step for v in self.ranks.values()), default=0)

    def proven_step(self) -> int:
        """The run's record of its progress: the highest step that any rank's step event (or the step it
        resumed from), any checkpoint event or any node's complete checkpoint dir proves. A synchronous step is
        only reported once every rank joined its collective, so one rank's report speaks for the run; and a
        stop that interrupted the reading of events never makes a run that trained look as if it had not."""
        return max([v.step for v in self.ranks.values()]
                   + [v.checkpoint_step for v in self.ranks.values() if v.checkpoint_step is not None]
                   + list(self.checkpoint_dirs.values()), default=0)

    def run_tokens_per_s(self, *, after: int = 0) -> float | None:
        """The run's tokens/s: the median over its steps of all ranks' tokens per second of step wall time. A
        median, so the first steps' compiles (seconds on a cold machine) do not stand for the run, and neither
        does the last step alone. `after`: only the steps after this one (a short rehearsal leaves its first,
        compiling steps out: in 16 steps a median does not outweigh them as it does in a run)."""
        rates = [v for step, v in self.step_totals.items() if step > after]
        return statistics.median(rates) if rates else None

    def run_compute_tokens_per_s(self, *, after: int = 0) -> float | None:
        """The run's rate had no rank waited for the gradient all_sum: the median over steps (those every rank
        reported) of the sum of the ranks' tokens / compute seconds (the step until it enters the collective).
        What calibration predicts, which times each node's step alone; its gap to `run_tokens_per_s` is what the
        collective (and the waiting for the slowest rank) cost."""
        sums = [sum(rates.values()) for step, rates in self.step_rates.items()
                if len(rates) == len(self.ranks) and step > after]
        return statistics.median(sums) if sums else None

    def last_tokens_per_s(self) -> float | None:
        """The whole run's tokens/s at its latest reported step."""
        return self.step_totals[max(self.step_totals)] if self.step_totals else None

    def eta_s(self, now: float) -> float | None:
        done = self.step()
        running = [v for v in self.ranks.values() if v.started_at is not None]
        if not running or done <= 0:
            return None
        start = min(v.started_at for v in running if v.started_at is not None)
        base = min((v.resumed_from or 0) for v in running)
        rate = (done - base) / max(1e-9, now - start)
        return None if rate <= 0 else (self.iters - done) / rate


def ms_above(seconds: float) -> float:
    """A wait that passed a bound, in evidence: rounded UP to the millisecond, so that a wait just past the bound
    (40.0004 s past 40) never reads as the bound itself (40.0), which the strict rule did not fire on. Pure."""
    return math.ceil(seconds * 1000.0) / 1000.0


def ms_below(seconds: float) -> float:
    """A bound, in evidence beside an `ms_above` wait: rounded DOWN to the millisecond, so that the wait always
    reads as more than the bound it passed. Pure."""
    return math.floor(seconds * 1000.0) / 1000.0


# Errors a rank reports because of ANOTHER rank or of mlx.launch: the ring's lost-peer error, a reset socket,
# and the signals mlx.launch sends (SIGTERM, or SIGHUP when it closes a rank's ssh pty) to the survivors once
# one rank failed.
ECHO_MARKERS = ("connection to a peer was lost", "peer", "connection reset", "broken pipe", "recv", "send",
                "terminated by sighup", "terminated by sigterm", "terminated by sigpipe",
                # A non-finite GLOBAL loss fails every rank; the culprit is the rank whose LOCAL loss was not
                # finite (its `nan` incident), never the ranks that merely saw the sum.
                "training diverged")


_ERROR_LINE = re.compile(r"(?:\w+Error|\w+Exception|error|invalid usage)\b.*", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def last_error_line(log_tail: str) -> str:
    """The last line of a launcher log that reads as an error (`RuntimeError: [nccl] ... invalid usage`), without
    terminal escapes, at most 300 characters; "" when none does."""
    for raw in reversed(log_tail.splitlines()):
        line = _ANSI.sub("", raw).strip()
        if line and _ERROR_LINE.search(line) and not line.startswith(("File ", "Traceback")):
            return line[:300]
    return ""


def describe_incident(inc: Incident) -> str:
    """One line in words: kind, where, and what its evidence says (its `message`, else its `reason`, else the
    evidence itself, shortened)."""
    where = inc.node + (f" rank {inc.rank}" if inc.rank is not None else "")
    at = f" at step {inc.step}" if inc.step else ""
    ev = inc.evidence
    what = ev.get("message") or ev.get("reason") or str({k: v for k, v in ev.items() if k != "log_tail"})[:300]
    return f"{inc.kind} on {where}{at}: {what}"


def describe_recovery(rec: Mapping[str, Any]) -> str:
    """A relaunch in words (summary.json's `recoveries` entry): who was left out (or that nobody was at fault and
    the same nodes ran again), where it ran, and when its first step came (or that none came)."""
    culprits = list(rec.get("culprits") or ())
    nodes = ", ".join(rec.get("nodes") or ()) or "no node"
    why = f"without {', '.join(culprits)}" if culprits else "on the same nodes (no node was at fault)"
    after = rec.get("first_step_after_s")
    first = f"first step {after:.1f}s after the fault was detected" if isinstance(after, int | float) else \
        "no step completed after it"
    failed = rec.get("failed_step")
    return f"relaunch {rec.get('attempt')} {why}, on {nodes}, after step {failed if failed is not None else 0}; {first}"


def is_echo(message: str | None) -> bool:
    return bool(message) and any(m in message.lower() for m in ECHO_MARKERS)  # type: ignore[union-attr]


def robust_outliers(values: dict[int, float], mads: float, rel: float) -> set[int]:
    """Keys whose value is more than `mads` robust standard deviations (1.4826 x MAD) AND `rel` (relative)
    away from the median. Needs 3+ values; a zero MAD (most values equal) uses the relative test alone."""
    if len(values) < 3:
        return set()
    xs = sorted(values.values())
    median = statistics.median(xs)
    mad = statistics.median(sorted(abs(x - median) for x in xs)) * 1.4826
    out: set[int] = set()
    for key, x in values.items():
        dist = abs(x - median)
        if dist > rel * max(abs(median), 1e-12) and (mad == 0 or dist > mads * mad):
            out.add(key)
    return out
