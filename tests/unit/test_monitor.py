"""The monitor's transitions, scripted observation by observation (no I/O, no clocks)."""

from __future__ import annotations

import json

import pytest

from coordinator.run.monitor import (
    FINISH_GRACE_S,
    RATE_STEPS,
    Action,
    AfterLauncherExit,
    FaultPolicy,
    IncidentKind,
    Monitor,
    Observation,
    ObservationKind,
    PlannedRank,
    RankError,
    RankView,
    RunState,
    Verdict,
    WorkerState,
    classify_errors,
    describe_incident,
    describe_recovery,
    last_error_line,
    ms_above,
    ms_below,
    rank_rate,
    rank_verdict,
)
from coordinator.run.signatures import error_signature

PLAN = [PlannedRank(0, "a", 3, 300.0), PlannedRank(1, "b", 1, 100.0)]


def ev(node: str, rank: int, at: float, **data) -> Observation:
    return Observation("event", node, at, rank, {"rank": rank, **data})


def three_started() -> Monitor:
    """Ranks 0, 1, 2 on nodes a, b, c (pids 10, 11, 12), all started at 0.1; heartbeat timeout 6 s."""
    mon = Monitor.create([PlannedRank(0, "a", 2), PlannedRank(1, "b", 2), PlannedRank(2, "c", 2)], iters=9, now=0.0,
                         heartbeat_timeout=6.0)
    for rank, node in ((0, "a"), (1, "b"), (2, "c")):
        mon.observe(ev(node, rank, 0.1, event="started", pid=rank + 10))
    return mon


def started(mon: Monitor, at: float = 0.1) -> None:
    mon.observe(ev("a", 0, at, event="started", pid=10))
    mon.observe(ev("b", 1, at, event="started", pid=11))


def test_success_when_every_rank_finishes() -> None:
    mon = Monitor.create(PLAN, iters=2, now=0.0)
    started(mon)
    for t, step in ((1.0, 1), (2.0, 2)):
        mon.observe(ev("a", 0, t, event="step", step=step, loss=2.0, tok_s=300.0))
        mon.observe(ev("b", 1, t, event="step", step=step, loss=2.0, tok_s=100.0))
    assert mon.outcome() is None
    mon.observe(ev("a", 0, 3.0, event="finished", step=2))
    assert mon.outcome() is None
    mon.observe(ev("b", 1, 3.0, event="finished", step=2))
    assert mon.outcome() is RunState.SUCCEEDED
    assert mon.step() == 2 and not mon.incidents


def test_error_event_fails_the_run_with_an_incident() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    [inc] = mon.observe(ev("b", 1, 1.0, event="error", message="boom", traceback="tb"))
    assert (inc.kind, inc.node, inc.rank, inc.action) == ("error", "b", 1, "quarantine")
    assert mon.culprits() == ["b"]
    assert mon.outcome() is RunState.FAILED


def test_a_job_fault_error_stops_the_run_without_a_culprit_and_settles() -> None:
    # Every rank refuses a resume with no valid checkpoint (worker.train.ResumeRefused): nobody is to blame.
    mon = Monitor.create(PLAN, iters=5, now=0.0, heartbeat_timeout=10.0)
    started(mon)
    [a] = mon.observe(ev("a", 0, 1.0, event="error", message="ResumeRefused: no rank has a valid", fault="job"))
    [b] = mon.observe(ev("b", 1, 1.1, event="error", message="ResumeRefused: no rank has a valid", fault="job"))
    assert (a.action, b.action) == ("stop", "stop") and a.evidence["fault"] == "job"
    assert mon.culprits() == [] and mon.job_fault() == a
    assert mon.outcome() is RunState.FAILED
    mon.observe(Observation("tick", "a", 1.5))
    mon.observe(Observation("tick", "b", 1.5))
    assert not mon.settled(2.0) and mon.settled(3.1)  # SETTLE_S after the first, both nodes heard since


def test_dead_process_is_a_crash_attributed_to_its_node() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(ev("a", 0, 1.0, event="heartbeat", step=0))
    [inc] = mon.observe(Observation("proc", "a", 1.5, 0, {"alive": False, "pid": 10, "state": "gone"}))
    assert (inc.kind, inc.node, inc.rank) == ("crash", "a", 0)
    assert inc.detected_after_s == 0.5


def test_a_crash_counts_from_the_last_check_that_found_it_alive() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(Observation("proc", "a", 1.0, 0, {"alive": True, "pid": 10, "state": "S"}))
    # Its last event and its death arrive in the same poll: the fault began after the check at 1.0.
    mon.observe(ev("a", 0, 1.5, event="heartbeat", step=0))
    [inc] = mon.observe(Observation("proc", "a", 1.5, 0, {"alive": False, "pid": 10, "state": "gone"}))
    assert inc.kind == "crash" and inc.detected_after_s == 0.5


def test_silent_rank_on_a_live_channel_is_a_hang() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0, heartbeat_timeout=10.0)
    started(mon)
    for t in range(1, 12):  # both channels tick; only rank 0 keeps sending heartbeats
        mon.observe(Observation("tick", "a", float(t)))
        mon.observe(Observation("tick", "b", float(t)))
        mon.observe(ev("a", 0, float(t), event="heartbeat"))
    assert mon.check(10.0) == []
    [inc] = mon.check(10.2)
    assert (inc.kind, inc.node, inc.rank) == ("hang", "b", 1)
    assert inc.detected_after_s > 10.0


def stalled_after(step_times: list[float], policy: FaultPolicy, *, phase: str = "step",
                  until: float = 200.0) -> tuple[Monitor, list[tuple[float, list[tuple[str, int | None]]]]]:
    """Two ranks take steps of `step_times` seconds, then keep heartbeating in `phase` (both channels ticking)
    without finishing another step until `until`; returns the monitor and every check() that found something."""
    mon = Monitor.create(PLAN, iters=1000, now=0.0, policy=policy)
    started(mon, at=0.0)
    t = 0.0
    for step, dt in enumerate(step_times, 1):
        t += dt
        for node, rank in (("a", 0), ("b", 1)):
            mon.observe(ev(node, rank, t, event="step", step=step, loss=2.0, tok_s=100.0, step_time_s=dt))
    last_step_at = t
    found = []
    while t < until:
        t = round(t + 0.5, 3)
        for node, rank in (("a", 0), ("b", 1)):
            mon.observe(Observation("tick", node, t))
            mon.observe(ev(node, rank, t, event="heartbeat", step=len(step_times), phase=phase))
        incidents = mon.check(t)
        if incidents:
            found.append((round(t - last_step_at, 3), [(i.kind, i.rank) for i in incidents]))
    return mon, found


def test_a_step_that_never_ends_while_every_rank_heartbeats_is_a_stall() -> None:
    policy = FaultPolicy(heartbeat_timeout=2.0, stall_factor=10.0, stall_min_s=5.0)
    mon, found = stalled_after([1.0, 1.2, 0.8, 1.0], policy)
    # Window max(5 s, 10 x median 1.0 s) = 10 s: both ranks stall at once, detected at the first check past it.
    assert found == [(10.5, [("stall", 0), ("stall", 1)])]
    inc = mon.incidents[0]
    assert inc.action == "stop" and mon.culprits() == []  # any link of the ring may be the broken one
    assert inc.evidence["window_s"] == 10.0 and inc.evidence["median_step_s"] == 1.0
    assert mon.outcome() is RunState.FAILED


def test_the_stall_window_has_a_floor_and_needs_a_first_step() -> None:
    policy = FaultPolicy(heartbeat_timeout=2.0, stall_factor=10.0, stall_min_s=30.0)
    _, found = stalled_after([0.5, 0.5], policy)
    assert [f[0] for f in found] == [30.5]  # 10 x 0.5 s would be 5 s: the floor holds
    # Never within the heartbeat timeout: a vanished node (which stalls its peers too) is found first.
    _, found = stalled_after([0.5, 0.5], FaultPolicy(heartbeat_timeout=20.0, stall_factor=10.0, stall_min_s=1.0))
    assert [f[0] for f in found] == [21.5]
    # Before the first step (compiling, waiting for slow peers to load) there is no window at all.
    _, found = stalled_after([], policy, until=400.0)
    assert found == []


def test_a_rank_that_ends_no_first_step_is_a_stall_after_first_step_s() -> None:
    """Heartbeating, pending (its ring never formed: no `started`) or running (its first collective never
    completes): neither has a stall window, so `first_step_s` after the attempt started bounds them."""
    policy = FaultPolicy(heartbeat_timeout=2.0, stall_min_s=5.0, first_step_s=120.0)
    mon = Monitor.create(PLAN, iters=10, now=0.0, policy=policy)
    mon.observe(ev("a", 0, 0.5, event="started", pid=10))  # rank 1 never says `started`
    found: list[tuple[float, list[tuple[str, int | None]]]] = []
    t = 0.5
    while t < 200.0:
        t += 0.5
        mon.observe(Observation("tick", "a", t))
        mon.observe(Observation("tick", "b", t))
        mon.observe(ev("a", 0, t, event="heartbeat", step=0, phase="step"))
        mon.observe(ev("b", 1, t, event="heartbeat", step=0, phase="load"))
        if incidents := mon.check(t):
            found.append((t, [(i.kind, i.rank) for i in incidents]))
    assert found == [(120.5, [("stall", 0), ("stall", 1)])]
    inc = mon.incidents[1]
    assert inc.action == "stop" and mon.culprits() == []  # any link of the ring may be the one
    assert inc.evidence["first_step_s"] == 120.0 and inc.evidence["phase"] == "load"
    assert inc.evidence["no_first_step_for_s"] == 120.5
    assert rank_verdict(mon.ranks[1], policy, {"stall"}, now=t) is Verdict.STALLED


def test_a_wait_just_past_its_bound_reads_as_more_than_the_bound() -> None:
    """The rules fire on a wait strictly past the bound; their evidence, rounded to the millisecond, must say so
    (a drill saw `no_first_step_for_s` 40.0 beside `first_step_s` 40: 40.0004 s rounded to the nearest)."""
    policy = FaultPolicy(heartbeat_timeout=2.0, stall_min_s=5.0, first_step_s=40.0)
    mon = Monitor.create(PLAN, iters=10, now=0.0, policy=policy)
    for node, rank in (("a", 0), ("b", 1)):
        mon.observe(ev(node, rank, 0.5, event="started", pid=10 + rank))
        mon.observe(Observation("tick", node, 40.0004))
        mon.observe(ev(node, rank, 40.0004, event="heartbeat", step=0, phase="step"))
    incidents = mon.check(40.0004)
    assert [i.kind for i in incidents] == ["stall", "stall"]
    assert all(i.evidence["no_first_step_for_s"] == 40.001 > i.evidence["first_step_s"] for i in incidents)
    assert ms_above(40.0) == 40.0 and ms_above(40.0000001) == 40.001
    assert ms_below(4.0009) == 4.0 and ms_below(4.0) == 4.0


def test_a_first_step_ends_the_first_step_bound() -> None:
    # A first step at 1 s, then none: the stall window (10 x 1 s, at least 5 s) decides, 10.5 s after that step,
    # not first_step_s (3 s after the start).
    _, found = stalled_after([1.0], FaultPolicy(heartbeat_timeout=2.0, stall_min_s=5.0, first_step_s=3.0))
    assert [f[0] for f in found] == [10.5]


def test_long_eval_or_checkpoint_phases_are_not_stalls() -> None:
    policy = FaultPolicy(heartbeat_timeout=2.0, stall_factor=10.0, stall_min_s=5.0)
    for phase in ("eval", "checkpoint", "digest", "idle"):
        _, found = stalled_after([1.0, 1.0], policy, phase=phase, until=100.0)
        assert found == [], phase


def test_silent_node_is_unreachable_not_hang() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0, heartbeat_timeout=10.0)
    started(mon)
    for t in range(1, 12):
        mon.observe(Observation("tick", "a", float(t)))
        mon.observe(ev("a", 0, float(t), event="heartbeat"))
    incidents = mon.check(11.0)
    assert [(i.kind, i.node) for i in incidents] == [("unreachable", "b")]
    assert mon.ranks[1].state is WorkerState.FAILED
    # The channel closing afterwards does not report it twice.
    assert mon.observe(Observation("lost", "b", 12.0, data={"reason": "closed"})) == []


def test_event_for_a_rank_from_the_wrong_node_is_spoofed() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    [inc] = mon.observe(ev("a", 1, 1.0, event="step", step=99))
    assert inc.kind == "spoofed" and inc.node == "a"
    assert mon.ranks[1].step == 0  # the claim was not applied
    [inc] = mon.observe(Observation("event", "b", 1.0, 1, {"rank": 0, "event": "step", "step": 5}))
    assert inc.kind == "spoofed"


def test_resumed_rank_starts_at_its_checkpoint_step() -> None:
    mon = Monitor.create(PLAN, iters=30, now=0.0)
    mon.observe(ev("a", 0, 0.1, event="started", pid=1, resumed_from=20))
    assert mon.ranks[0].step == 20


def test_verdict_waits_for_every_unblamed_node_to_speak_after_the_fault() -> None:
    mon = three_started()
    mon.observe(Observation("proc", "a", 1.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    assert mon.culprits() == ["a"]
    mon.observe(Observation("tick", "b", 1.5))
    assert not mon.settled(3.5)  # c has not spoken since the crash: it may be the real culprit
    mon.observe(Observation("tick", "c", 3.6))
    assert mon.settled(3.7)


def test_a_lying_rank_is_reported_once() -> None:
    mon = Monitor.create(PLAN, iters=50, now=0.0)
    started(mon)
    for t in range(1, 6):
        mon.observe(ev("a", 0, float(t), event="step", step=t))
        mon.observe(ev("b", 1, float(t), event="step", step=t + 1000))
    assert [(i.kind, i.node) for i in mon.incidents] == [("implausible_progress", "b")]
    assert mon.ranks[1].step == 0


def test_a_crash_after_the_fault_is_collateral_when_a_node_vanished() -> None:
    """A whole node dies: a peer reports the lost ring (echo), mlx.launch kills the rank on another node before it
    writes its error event (looks like a crash), and the dead node is found only by its silence."""
    mon = three_started()
    mon.observe(ev("c", 2, 1.0, event="error", message="RuntimeError: [ring] connection to a peer was lost"))
    mon.observe(Observation("proc", "a", 1.4, 0, {"alive": False, "pid": 10, "state": "Z"}))
    assert mon.culprits() == ["a"]  # nothing better yet
    for t in (2.0, 4.0, 6.0):
        mon.observe(Observation("tick", "a", t))
        mon.observe(Observation("tick", "c", t))
    assert not mon.settled(6.5)  # b has said nothing since the fault
    [gone] = mon.check(7.2)
    assert (gone.kind, gone.node) == ("unreachable", "b")
    assert mon.culprits() == ["b"]
    assert mon.settled(8.1)
    [revised] = mon.resolve()
    assert (revised.kind, revised.node, revised.action) == ("crash", "a", "stop")
    assert {i.node for i in mon.incidents if i.action == "quarantine"} == {"b"}
    assert mon.culprit_incident("b") is gone and mon.culprit_incident("a") is None


def test_a_crash_seen_after_its_own_echoes_is_still_the_culprit() -> None:
    mon = three_started()
    mon.observe(ev("c", 2, 1.0, event="error", message="RuntimeError: [ring] connection to a peer was lost"))
    mon.observe(Observation("proc", "b", 1.2, 1, {"alive": False, "pid": 11, "state": "gone"}))
    for t in (1.5, 2.0, 3.0):
        mon.observe(Observation("tick", "a", t))
        mon.observe(Observation("tick", "c", t))
    assert mon.settled(3.3)
    assert mon.resolve() == []
    assert mon.culprits() == ["b"]


def test_a_crash_seen_before_a_silent_node_is_found_is_collateral_of_it() -> None:
    """The vanished node's silence began before the crash was seen: it is the cause, found 6 s later."""
    mon = three_started()
    mon.observe(Observation("tick", "b", 1.0))  # b's last word
    mon.observe(ev("c", 2, 1.3, event="heartbeat"))
    [crash] = mon.observe(Observation("proc", "c", 1.4, 2, {"alive": False, "pid": 12, "state": "Z"}))
    assert crash.action == "quarantine" and mon.culprits() == ["c"]  # the best guess so far
    mon.observe(ev("a", 0, 1.5, event="error", message="terminated by SIGHUP"))
    for t in (2.0, 4.0, 6.0):
        mon.observe(Observation("tick", "a", t))
        mon.observe(Observation("tick", "c", t))
    assert not mon.settled(6.5)
    [gone] = mon.check(7.1)
    assert (gone.kind, gone.node) == ("unreachable", "b")
    assert mon.culprits() == ["b"] and mon.settled(7.2)
    assert [(i.kind, i.node) for i in mon.resolve()] == [("crash", "c")]
    assert {i.node for i in mon.incidents if i.action == "quarantine"} == {"b"}


def _steps(mon: Monitor, rates: dict[int, list[float]], start: int = 1) -> list:
    found = []
    nodes = {0: "a", 1: "b"}
    for k in range(len(rates[0])):
        step = start + k
        for rank in (0, 1):
            found += mon.observe(ev(nodes[rank], rank, float(step), event="step", step=step, tokens=10,
                                    compute_tok_s=rates[rank][k]))
    return [i for i in found if i.kind == "straggler"]


def test_a_rank_far_below_its_calibrated_rate_is_a_straggler() -> None:
    mon = Monitor.create(PLAN, iters=50, now=0.0)  # calibrated 300 and 100 tok/s
    started(mon)
    assert _steps(mon, {0: [300.0] * 8, 1: [100.0] * 8}) == []
    [inc] = _steps(mon, {0: [300.0] * 6, 1: [40.0] * 6}, start=9)
    assert (inc.node, inc.rank, inc.action) == ("b", 1, "warn")


def test_without_calibration_an_honest_slower_machine_is_no_straggler_but_a_slowdown_is() -> None:
    plan = [PlannedRank(0, "a", 3, None), PlannedRank(1, "b", 1, None)]  # a fixed split: no calibrated rates
    mon = Monitor.create(plan, iters=50, now=0.0)
    started(mon)
    assert _steps(mon, {0: [900.0] * 12, 1: [100.0] * 12}) == []  # 9x slower all along: its own normal
    [inc] = _steps(mon, {0: [900.0] * 6, 1: [30.0] * 6}, start=13)
    assert (inc.node, inc.rank) == ("b", 1)


def test_a_burst_of_slow_steps_shorter_than_the_minimum_time_is_no_straggler() -> None:
    mon = Monitor.create(PLAN, iters=50, now=0.0)
    started(mon)
    found = []
    for k in range(8):  # 8 slow steps within 1.6 s: a busy machine for a moment
        t = 1.0 + 0.2 * k
        mon.observe(ev("a", 0, t, event="step", step=k + 1, tokens=10, compute_tok_s=300.0))
        found += mon.observe(ev("b", 1, t, event="step", step=k + 1, tokens=10, compute_tok_s=30.0))
    assert [i for i in found if i.kind == "straggler"] == []
    assert mon.ranks[1].slow_steps == 8


def test_with_no_minimum_time_the_window_is_a_step_count() -> None:
    mon = Monitor.create(PLAN, iters=50, now=0.0, policy=FaultPolicy(heartbeat_timeout=10.0, straggler_min_s=0.0))
    started(mon)
    found = []
    for k in range(8):  # the same 1.6 s burst: with the minimum at 0, the fifth slow step is enough
        t = 1.0 + 0.2 * k
        mon.observe(ev("a", 0, t, event="step", step=k + 1, tokens=10, compute_tok_s=300.0))
        found += mon.observe(ev("b", 1, t, event="step", step=k + 1, tokens=10, compute_tok_s=30.0))
    [inc] = [i for i in found if i.kind == "straggler"]
    assert (inc.node, inc.step) == ("b", 5)


# --- job error or node fault --------------------------------------------------------------------------------------

UNDECODABLE = "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position {pos}: invalid start byte"
PEER_LOST = "RuntimeError: [ring] connection to a peer was lost"


def ticks(mon: Monitor, *times: float, nodes: tuple[str, ...] = ("a", "b", "c")) -> None:
    for t in times:
        for node in nodes:
            mon.observe(Observation("tick", node, t))


def test_the_same_error_on_every_rank_is_a_job_error_and_nobody_is_quarantined() -> None:
    mon = three_started()
    # Each rank's own error, a moment apart, with its own path and byte position: one signature.
    [first] = mon.observe(ev("a", 0, 1.0, event="error", message=UNDECODABLE.format(pos=7), traceback="tb0"))
    assert first.action == "quarantine" and first.evidence["explanation"]["code"] == "data_not_utf8"
    mon.observe(ev("b", 1, 1.3, event="error", message=UNDECODABLE.format(pos=7)))
    ticks(mon, 2.0, 3.0)
    assert not mon.settled(3.1)  # c is still running: its own error may be on the way
    mon.observe(ev("c", 2, 3.2, event="error", message=UNDECODABLE.format(pos=12)))
    ticks(mon, 3.3)
    assert mon.settled(3.4)
    judged = mon.resolve()
    assert [(i.kind, i.node, i.action) for i in judged] == [("error", "a", "stop"), ("error", "b", "stop"),
                                                             ("error", "c", "stop"), ("job_error", "a,b,c", "stop")]
    assert all(i.evidence["job_error"] for i in judged[:-1])
    job = mon.job_error
    assert job is judged[-1] and job.rank is None and job.node == "a,b,c"
    assert job.evidence["reason"] == "every rank failed with the same error"
    assert job.evidence["ranks"] == [0, 1, 2] and job.evidence["message"] == UNDECODABLE.format(pos=7)
    assert job.evidence["code"] == "data_not_utf8" and "preflight" in job.evidence["remedy"]
    assert job.evidence["traceback"] == "tb0"
    assert mon.culprits() == [] and mon.culprit_incident("a") is None
    assert not [i for i in mon.incidents if i.action == "quarantine"]
    assert mon.outcome() is RunState.FAILED
    assert mon.resolve() == []  # judged once


def test_a_rank_whose_error_came_first_and_whose_peers_only_echo_is_the_culprit() -> None:
    """One rank fails; mlx.launch kills the others (SIGTERM) and the ring loses its peer: echoes, not the same
    error. The evidence ties the failure to that rank's node."""
    mon = three_started()
    mon.observe(ev("b", 1, 1.0, event="error", message=UNDECODABLE.format(pos=7)))
    mon.observe(ev("a", 0, 1.2, event="error", message=PEER_LOST))
    mon.observe(ev("c", 2, 1.4, event="error", message="terminated by SIGTERM"))
    ticks(mon, 2.0, 3.1)
    assert mon.settled(3.2)
    assert mon.resolve() == []
    assert mon.job_error is None and mon.culprits() == ["b"]


def test_the_verdict_waits_a_short_grace_for_the_other_ranks_errors() -> None:
    mon = three_started()
    mon.observe(ev("a", 0, 1.0, event="error", message=UNDECODABLE.format(pos=7)))
    ticks(mon, 2.0, 3.5, 5.9)
    assert not mon.settled(5.9)  # b and c are still running, within ERROR_GRACE_S of the first error
    assert mon.settled(6.0)  # the grace is over: decide on what arrived
    assert mon.resolve() == [] and mon.culprits() == ["a"]


def test_different_own_errors_are_no_job_error() -> None:
    mon = three_started()
    mon.observe(ev("a", 0, 1.0, event="error", message=UNDECODABLE.format(pos=7)))
    mon.observe(ev("b", 1, 1.1, event="error", message="MemoryError: out of memory"))
    mon.observe(ev("c", 2, 1.2, event="error", message=PEER_LOST))
    ticks(mon, 2.0, 3.1)
    assert mon.settled(3.2) and mon.resolve() == []
    assert mon.job_error is None and mon.culprits() == ["a"]


def test_the_same_error_after_a_relaunch_on_another_node_followed_the_work() -> None:
    """Attempt 1 blamed a for this error (its peers were killed before they got to it); the relaunch on b and c
    fails the same way on b: the error is the job's."""
    sig = error_signature(UNDECODABLE.format(pos=7), {"a", "b", "c"})
    mon = Monitor.create([PlannedRank(0, "b", 3), PlannedRank(1, "c", 3)], iters=9, now=0.0, heartbeat_timeout=6.0,
                         earlier_errors={sig: frozenset({"a"})})
    for rank, node in ((0, "b"), (1, "c")):
        mon.observe(ev(node, rank, 0.1, event="started", pid=rank + 10))
    mon.observe(ev("b", 0, 1.0, event="error", message=UNDECODABLE.format(pos=9)))
    mon.observe(ev("c", 1, 1.1, event="error", message="terminated by SIGTERM"))
    ticks(mon, 2.0, 3.1, nodes=("b", "c"))
    assert mon.settled(3.2)
    *revised, job = mon.resolve()
    assert [(i.node, i.action) for i in revised] == [("b", "stop")]
    assert job.kind == "job_error" and job.evidence["earlier_nodes"] == ["a"]
    assert job.evidence["reason"] == "the same error followed the work from a to b"
    assert mon.culprits() == []


def test_the_same_error_again_on_the_same_node_stays_that_nodes() -> None:
    sig = error_signature(UNDECODABLE.format(pos=7), {"a", "b"})
    mon = Monitor.create(PLAN, iters=9, now=0.0, heartbeat_timeout=6.0, earlier_errors={sig: frozenset({"b"})})
    started(mon)
    mon.observe(ev("b", 1, 1.0, event="error", message=UNDECODABLE.format(pos=7)))
    mon.observe(ev("a", 0, 1.1, event="error", message=PEER_LOST))
    ticks(mon, 2.0, 3.1, nodes=("a", "b"))
    assert mon.settled(3.2) and mon.resolve() == [] and mon.culprits() == ["b"]


def test_node_evidence_wins_over_matching_errors() -> None:
    """A rank died without an error (a crash) before the others' errors: the crash names the node."""
    mon = three_started()
    mon.observe(Observation("proc", "c", 0.9, 2, {"alive": False, "pid": 12, "state": "gone"}))
    mon.observe(ev("a", 0, 1.0, event="error", message="ValueError: bad thing"))
    mon.observe(ev("b", 1, 1.1, event="error", message="ValueError: bad thing"))
    ticks(mon, 2.0, 3.1)
    assert mon.settled(3.2) and mon.resolve() == []
    assert mon.job_error is None and mon.culprits() == ["c"]


def test_a_fenced_rank_is_no_evidence_of_a_job_error() -> None:
    mon = Monitor.create([PlannedRank(0, "a", 1, None)], iters=9, now=0.0)
    mon.observe(ev("a", 0, 0.1, event="started", pid=10))
    mon.observe(ev("a", 0, 1.0, event="error", message="fenced: step 5 ran 90 s", fenced=True))
    assert mon.classify() is None and mon.culprits() == ["a"]


def test_the_only_rank_failing_is_a_job_error_not_a_quarantine_of_the_last_node() -> None:
    mon = Monitor.create([PlannedRank(0, "a", 4, None)], iters=9, now=0.0, heartbeat_timeout=6.0)
    mon.observe(ev("a", 0, 0.1, event="started", pid=10))
    mon.observe(ev("a", 0, 1.0, event="error", message="ValueError: /srv/data/train.jsonl is missing or empty"))
    ticks(mon, 3.1, nodes=("a",))
    assert mon.settled(3.2)
    *_, job = mon.resolve()
    assert job.kind == "job_error" and job.evidence["code"] == "data_missing" and mon.culprits() == []


def rank_error(rank: int, node: str, signature: str, at: float) -> RankError:
    return RankError(rank, node, signature, f"E: {signature}", at)


def test_classify_errors_table() -> None:
    same = [rank_error(0, "a", "S", 1.0), rank_error(1, "b", "S", 1.2)]
    assert classify_errors([], 2, node_evidence=False) is None
    assert classify_errors(same, 2, node_evidence=True) is None
    verdict = classify_errors(same, 3, node_evidence=False)  # two of three, on two nodes: still the job's
    assert verdict is not None and verdict.reason == "ranks on 2 nodes failed with the same error"
    assert classify_errors([*same, rank_error(2, "c", "T", 1.1)], 3, node_evidence=False) is None
    assert classify_errors(same[:1], 3, node_evidence=False) is None
    assert classify_errors(same[:1], 3, node_evidence=False, earlier={"S": frozenset({"a"})}) is None
    moved = classify_errors(same[1:], 3, node_evidence=False, earlier={"S": frozenset({"a"}), "T": frozenset({"c"})})
    assert moved is not None and moved.earlier_nodes == ("a",) and moved.nodes == ("b",)


# -- the launcher's exit and the connection check before a relaunch: decisions the I/O loops ask the monitor for --


def test_the_launchers_exit_with_ranks_unfinished_is_the_failure_once_the_grace_has_passed() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(ev("a", 0, 1.0, event="step", step=1, loss=2.0))
    assert mon.after_launcher_exit(2.0) is AfterLauncherExit.WAIT  # still running
    assert mon.launcher_exited(0, 2.0) == []
    assert mon.after_launcher_exit(2.0 + FINISH_GRACE_S) is AfterLauncherExit.WAIT  # late events may still come
    assert mon.outcome() is None and not mon.incidents
    assert mon.after_launcher_exit(2.5 + FINISH_GRACE_S) is AfterLauncherExit.FAILED
    inc = mon.launcher_failed(2.5 + FINISH_GRACE_S, log_tail="Traceback ...")
    assert mon.incidents == [inc] and mon.outcome() is RunState.FAILED and mon.culprits() == []
    # The line events.jsonl gets, word for word as before the enums: plain strings, not enum members.
    assert inc.to_json() == {"kind": "launcher_exit", "node": "coordinator", "rank": None, "step": 0,
                             "detected_after_s": round(FINISH_GRACE_S + 0.5, 3),
                             "evidence": {"rc": 0, "log_tail": "Traceback ...", "message":
                                          "mlx.launch ended with status 0 (it exits 0 whatever its ranks did) "
                                          "while 2 of 2 rank(s) had not finished, and no rank reported why"},
                             "action": "stop",
                             "t": 2.5 + FINISH_GRACE_S}
    assert type(inc.to_json()["kind"]) is str and type(inc.to_json()["action"]) is str
    assert json.dumps(inc.to_json()).startswith('{"kind": "launcher_exit", "node": "coordinator"')


NCCL_LOG = ("\x1b[31mworker.train rank 1\r\n  File \"x.py\", line 3\r\n"
            "RuntimeError: [nccl] NCCL error: invalid usage (run with NCCL_DEBUG=INFO for details)\r\n")


def test_a_launch_whose_ranks_never_took_a_step_is_the_jobs_no_relaunch_loop() -> None:
    """Issue 27: both ranks on one GPU, NCCL `invalid usage` on both, nothing stepped: the coordinator relaunched
    the same launch twice. A launch in which no rank finished a step is the job's: `job_fault`, in words."""
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.launcher_exited(0, 2.0)
    assert mon.after_launcher_exit(8.0) is AfterLauncherExit.FAILED
    inc = mon.launcher_failed(8.0, log_tail=NCCL_LOG)
    assert mon.job_fault() is inc and mon.culprits() == []
    assert inc.evidence["fault"] == "job" and inc.evidence["explanation"]["code"] == "nccl_setup"
    assert inc.evidence["message"] == (
        "mlx.launch ended with status 0 (it exits 0 whatever its ranks did) before any rank finished a step: the "
        "ranks could not start (RuntimeError: [nccl] NCCL error: invalid usage (run with NCCL_DEBUG=INFO for details))")
    assert describe_incident(inc).startswith("launcher_exit on coordinator: mlx.launch ended with status 0")
    # after a step the same exit is no job fault: a relaunch may help (a machine that died with its ranks' words)
    later = Monitor.create(PLAN, iters=5, now=0.0)
    started(later)
    later.observe(ev("a", 0, 1.0, event="step", step=1, loss=2.0))
    later.launcher_exited(0, 2.0)
    assert "fault" not in later.launcher_failed(8.0, log_tail="").evidence and later.job_fault() is None


def test_recovery_and_incident_lines_are_words() -> None:
    assert describe_recovery({"attempt": 1, "culprits": [], "nodes": ["gpu-box/gpu0", "gpu-box/gpu1"],
                              "failed_step": None, "first_step_after_s": None}) == (
        "relaunch 1 on the same nodes (no node was at fault), on gpu-box/gpu0, gpu-box/gpu1, after step 0; "
        "no step completed after it")
    assert describe_recovery({"attempt": 2, "culprits": ["gpu-box/gpu1"], "nodes": ["gpu-box/gpu0"],
                              "failed_step": 7, "first_step_after_s": 12.34}) == (
        "relaunch 2 without gpu-box/gpu1, on gpu-box/gpu0, after step 7; first step 12.3s after the fault was detected")
    for text in (describe_recovery({"attempt": 1}), describe_incident(Monitor.create(PLAN, 5, now=0.0)
                                                                      .launcher_failed(1.0, log_tail=""))):
        assert "None" not in text and "nobody" not in text
    assert last_error_line("ok\nValueError: bad\n  File \"x\"\n") == "ValueError: bad"
    assert last_error_line("all fine\n") == ""


def test_an_adopted_launchers_exit_status_is_unknown_and_only_its_first_exit_counts() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.launcher_exited(None, 1.0)
    mon.launcher_exited(3, 4.0)
    assert (mon.launcher_rc, mon.launcher_exited_at) == (None, 1.0)
    inc = mon.launcher_failed(7.0, log_tail="")
    assert inc.evidence["rc"] is None and inc.detected_after_s == 6.0


def test_a_launcher_exit_observation_is_the_same_decision() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    assert mon.observe(Observation(ObservationKind.LAUNCHER_EXIT, "coordinator", 2.0, data={"rc": 1})) == []
    assert (mon.launcher_rc, mon.launcher_exited_at) == (1, 2.0)
    assert mon.after_launcher_exit(2.1 + FINISH_GRACE_S) is AfterLauncherExit.FAILED


def test_after_the_launchers_exit_a_fault_not_yet_settled_is_resolved_after_the_heartbeat_timeout() -> None:
    """A known fault (a crash) whose verdict never settles (b says nothing more): mlx.launch's exit is no news,
    the fault is; the verdict is resolved as it stands once the heartbeat timeout has passed too."""
    mon = Monitor.create(PLAN, iters=5, now=0.0, heartbeat_timeout=10.0)
    started(mon)
    mon.observe(Observation(ObservationKind.PROC, "a", 1.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    mon.launcher_exited(0, 2.0)
    bound = 2.0 + FINISH_GRACE_S + 10.0 + 1.0
    assert mon.outcome() is RunState.FAILED
    assert mon.after_launcher_exit(2.0 + FINISH_GRACE_S + 0.1) is AfterLauncherExit.WAIT
    assert mon.after_launcher_exit(bound) is AfterLauncherExit.WAIT
    assert mon.after_launcher_exit(bound + 0.1) is AfterLauncherExit.RESOLVE
    assert [i.kind for i in mon.incidents] == [IncidentKind.CRASH]  # no launcher_exit incident: the crash explains it


def test_a_node_unreachable_before_the_relaunch_is_an_incident_of_the_attempt_and_a_culprit() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(ev("b", 1, 1.0, event="step", step=2, loss=2.0))
    [crash] = mon.observe(Observation(ObservationKind.PROC, "a", 1.5, 0, {"alive": False, "pid": 10, "state": "gone"}))
    inc = mon.unreachable_before_relaunch("b", "no SSH answer from b within 5s", 9.0)
    assert mon.incidents == [crash, inc]
    assert (inc.kind, inc.action) == (IncidentKind.UNREACHABLE, Action.QUARANTINE)
    assert mon.culprits() == ["a", "b"] and mon.culprit_incident("b") is inc
    assert inc.to_json() == {"kind": "unreachable", "node": "b", "rank": None, "step": 2, "detected_after_s": None,
                             "evidence": {"reason": "no SSH answer from b within 5s",
                                          "found_by": "connection check before relaunch"},
                             "action": "quarantine", "t": 9.0}


def test_kinds_and_actions_compare_as_their_words() -> None:
    """StrEnums: records read back from events.jsonl (plain strings) compare equal, and hash alike."""
    assert IncidentKind.JOB_ERROR == "job_error" and "quarantine" in {Action.QUARANTINE}
    assert ObservationKind("tick") is ObservationKind.TICK
    assert json.dumps({"kind": IncidentKind.NAN}) == '{"kind": "nan"}'


def test_a_step_written_as_a_float_counts_as_that_step() -> None:
    """worker.events' one coercion rule: 2.0 is step 2 (status reads it the same way); 1.5 is no step."""
    mon = Monitor.create(PLAN, iters=9, now=0.0)
    started(mon)
    mon.observe(ev("a", 0, 1.0, event="step", step=2.0, loss=2.0, tok_s=300.0))
    mon.observe(ev("b", 1, 1.0, event="step", step=1.5, loss=2.0, tok_s=100.0))
    assert (mon.ranks[0].step, mon.ranks[1].step) == (2, 0)
    mon.observe(ev("b", 1, 1.5, event="finished", step=9.0))
    assert mon.ranks[1].step == 9 and mon.ranks[1].state == WorkerState.FINISHED


def test_an_event_claiming_a_rank_as_a_float_is_that_rank_and_a_string_is_spoofed() -> None:
    mon = Monitor.create(PLAN, iters=9, now=0.0)
    assert mon.observe(Observation("event", "a", 0.1, 0, {"rank": 0.0, "event": "started", "pid": 10})) == []
    spoofed = mon.observe(Observation("event", "b", 0.1, 1, {"rank": "1", "event": "started", "pid": 11}))
    assert [i.kind for i in spoofed] == [IncidentKind.SPOOFED]


def test_a_pipelines_stages_never_vote_on_digests_or_checkpoints() -> None:
    """Each stage holds its own blocks: their digests and checkpoint manifests differ by design. With one rank per
    replica group nothing is compared (and every fully reported step counts as consistent); data parallel ranks
    that disagree the same way are a stop."""
    plan = [PlannedRank(0, "a", 6), PlannedRank(1, "b", 6), PlannedRank(2, "c", 6)]

    def run(groups: tuple[tuple[int, ...], ...] | None) -> Monitor:
        mon = Monitor.create(plan, iters=9, now=0.0, replica_groups=groups)
        for rank, node in ((0, "a"), (1, "b"), (2, "c")):
            mon.observe(ev(node, rank, 0.1, event="started", pid=rank + 10))
        for rank, node in ((0, "a"), (1, "b"), (2, "c")):
            mon.observe(ev(node, rank, 1.0, event="digest", step=2, params_sha256=f"p{rank}", optimizer_sha256=f"o{rank}"))
            mon.observe(ev(node, rank, 1.1, event="checkpoint", step=2, sha256=f"m{rank}", path="x"))
        return mon

    piped = run(((0,), (1,), (2,)))
    assert piped.incidents == [] and piped.last_consistent_step == 2
    dp = run(None)
    assert {i.kind for i in dp.incidents} == {IncidentKind.INCONSISTENT, IncidentKind.CHECKPOINT_MISMATCH}
    assert dp.last_consistent_step is None


def test_every_rank_dying_silently_before_its_first_step_is_a_job_error() -> None:
    """An abort in NCCL's set-up kills every rank without an error event: quarantining one node per relaunch would
    only repeat it. Nobody is a culprit; once a step happened, or a peer wrote an echo, it is a node's fault."""
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(Observation("proc", "a", 1.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    mon.observe(Observation("proc", "b", 1.1, 1, {"alive": False, "pid": 11, "state": "gone"}))
    ticks(mon, 1.2, 3.5, nodes=("a", "b"))
    assert mon.settled(3.5)
    judged = mon.resolve()
    assert judged[-1] is mon.job_error and mon.culprits() == []
    ev_ = mon.job_error.evidence
    assert ev_["reason"] == "every rank died while starting" and ev_["ranks"] == [0, 1]
    assert ev_["message"].startswith("every rank's process died before its first step")
    # a rank that stepped, or a peer that only echoed: the crash is the node's
    later = Monitor.create(PLAN, iters=5, now=0.0)
    started(later)
    later.observe(ev("b", 1, 0.5, event="error", message="RuntimeError: [ring] connection to a peer was lost"))
    later.observe(Observation("proc", "a", 1.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    assert later.classify() is None


# --- verdicts and rates: the one judgement every view shows ---------------------------------------------------------


def verdict_case(**view: object) -> RankView:
    rank = RankView(rank=0, node="a", batch_size=2, state=WorkerState.RUNNING, phase="step", last_event_at=100.0,
                    last_progress_at=100.0, started_at=50.0)
    for key, value in view.items():
        setattr(rank, key, value)
    for seconds in (0.5, 0.5, 0.6):
        rank.steps.add(seconds)
    return rank


@pytest.mark.parametrize(("view", "kinds", "now", "verdict"), [
    ({}, (), 105.0, Verdict.OK),
    ({}, (), 110.5, Verdict.HUNG),  # silent past heartbeat_timeout 10: what `check` calls a hang
    ({"last_event_at": 170.0}, (), 171.0, Verdict.STALLED),  # heartbeating in a step past the 60 s stall window
    ({"last_event_at": 170.0, "phase": "load"}, (), 171.0, Verdict.OK),
    ({"slow_steps": 5}, (), 101.0, Verdict.SLOW),  # the straggler test held for its window of steps
    ({"slow_steps": 4}, ("straggler",), 101.0, Verdict.OK),  # ... and no longer holds
    ({"state": WorkerState.PENDING, "last_event_at": None}, (), 101.0, Verdict.PENDING),
    ({"state": WorkerState.FAILED}, (), 101.0, Verdict.DEAD),
    ({}, ("crash",), 101.0, Verdict.DEAD),
    ({"state": WorkerState.FAILED}, ("hang",), 101.0, Verdict.HUNG),  # the monitor's word wins
    ({}, ("stall",), 101.0, Verdict.STALLED),
    ({"state": WorkerState.FINISHED}, (), 1e9, Verdict.OK),
    ({}, (), None, Verdict.OK),  # an ended run: no silence grows after its end
])
def test_rank_verdicts_are_the_monitors_rules(view: dict[str, object], kinds: tuple[str, ...], now: float | None,
                                              verdict: Verdict) -> None:
    policy = FaultPolicy(heartbeat_timeout=10.0, straggler_window=5, stall_factor=10.0, stall_min_s=60.0)
    assert rank_verdict(verdict_case(**view), policy, kinds, now=now) is verdict


def test_the_run_thresholds_decide_the_verdict() -> None:
    """The run's own `faults:`: a playbook with a 30 s heartbeat timeout is not hung after 20 s."""
    assert rank_verdict(verdict_case(), FaultPolicy(heartbeat_timeout=30.0), (), now=120.0) is Verdict.OK
    assert rank_verdict(verdict_case(), FaultPolicy(heartbeat_timeout=10.0), (), now=120.0) is Verdict.HUNG


def test_a_ranks_rate_is_the_median_of_its_last_steps() -> None:
    mon = Monitor.create(PLAN, iters=100, now=0.0)
    started(mon)
    assert rank_rate(mon.ranks[0]) is None
    for step, tok_s in enumerate([50.0, 300.0, 310.0, 290.0], start=1):  # the first step compiles
        mon.observe(ev("a", 0, step, event="step", step=step, tok_s=tok_s))
    assert rank_rate(mon.ranks[0]) == 295.0 and mon.ranks[0].tokens_per_s == 290.0
    for step in range(5, 5 + RATE_STEPS):
        mon.observe(ev("a", 0, step, event="step", step=step, tok_s=100.0))
    assert rank_rate(mon.ranks[0]) == 100.0  # only the last RATE_STEPS count


# --- the record: a stop racing the end, the steps a run proves -----------------------------------------------


def finished_both(mon: Monitor, at: float) -> None:
    mon.observe(ev("a", 0, at, event="finished", step=2))
    mon.observe(ev("b", 1, at, event="finished", step=2))


def test_a_stop_that_came_when_every_rank_had_finished_is_no_stop() -> None:
    mon = Monitor.create(PLAN, iters=2, now=0.0)
    started(mon)
    mon.stopped = True  # the request was seen first; the ranks' `finished` lines are read after it
    assert mon.outcome() is RunState.STOPPED
    mon.observe(ev("a", 0, 2.0, event="finished", step=2))
    assert mon.outcome() is RunState.STOPPED  # one rank still running: the stop stopped it
    mon.observe(ev("b", 1, 2.0, event="finished", step=2))
    assert mon.outcome() is RunState.SUCCEEDED


def test_a_stop_after_a_job_error_keeps_the_job_error() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(ev("a", 0, 1.0, event="error", message="UnicodeDecodeError: byte 0xe9 in position 3"))
    mon.observe(ev("b", 1, 1.1, event="error", message="UnicodeDecodeError: byte 0xe9 in position 3"))
    mon.resolve()
    assert mon.job_error is not None
    mon.stopped = True
    assert mon.outcome() is RunState.FAILED


def test_after_a_stop_the_teardowns_echoes_are_no_incidents_but_an_own_error_is() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.stopped = True
    assert mon.observe(ev("a", 0, 1.0, event="error", message="terminated by SIGTERM")) == []
    [inc] = mon.observe(ev("b", 1, 1.0, event="error", message="OSError: disk full"))
    assert inc.kind == "error" and mon.outcome() is RunState.STOPPED


def test_the_proven_step_is_the_highest_any_event_or_complete_checkpoint_shows() -> None:
    mon = Monitor.create(PLAN, iters=500, now=0.0)
    assert mon.proven_step() == 0
    mon.observe(ev("a", 0, 0.1, event="started", pid=10, resumed_from=100))
    mon.observe(ev("b", 1, 0.1, event="started", pid=11, resumed_from=100))
    assert mon.proven_step() == 100  # the checkpoint it resumed from
    for step in (101, 102):
        mon.observe(ev("a", 0, step - 100.0, event="step", step=step, loss=2.0))
    mon.observe(ev("b", 1, 1.0, event="step", step=101, loss=2.0))
    assert (mon.step(), mon.proven_step()) == (101, 102)  # rank 1's step 102 is not read yet
    mon.observe(Observation("checkpoints", "b", 2.0, data={"step": 174}))
    mon.observe(Observation("checkpoints", "a", 2.0, data={"step": None}))  # no checkpoint there
    mon.observe(Observation("checkpoints", "x", 2.0, data={"step": 900}))  # not a node of this run
    mon.observe(Observation("checkpoints", "b", 2.0, data={"step": True}))  # not a step
    assert mon.proven_step() == 174 and mon.checkpoint_dirs == {"b": 174}


# --- start-up races -------------------------------------------------------------------------------------------

REFUSED = "RuntimeError: [ring] Couldn't connect (error: 111)"


def test_a_ring_connect_refused_before_the_first_step_is_a_start_up_race_not_a_culprit() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0, heartbeat_timeout=10.0)
    [inc] = mon.observe(ev("b", 1, 15.0, event="error", message=REFUSED, phase="load"))
    assert (inc.kind, inc.node, inc.action) == ("error", "b", "stop")
    assert inc.evidence["startup_race"] and inc.evidence["explanation"]["code"] == "ring_connect"
    assert mon.own_errors == {}  # never compared as the job's either
    # mlx.launch then kills rank 0, which dies before its error event: collateral, not a culprit.
    mon.observe(ev("a", 0, 15.2, event="started", pid=10))
    mon.observe(Observation("proc", "a", 15.5, 0, {"alive": False, "pid": 10, "state": "gone"}))
    assert mon.culprits() == [] and mon.startup_race() == inc
    assert mon.outcome() is RunState.FAILED
    mon.observe(Observation("tick", "a", 16.0))
    mon.observe(Observation("tick", "b", 16.0))
    assert not mon.settled(16.5) and mon.settled(17.1)
    assert mon.resolve() and mon.job_error is None and mon.culprits() == []


def test_every_rank_refused_at_start_up_is_a_race_not_a_job_error() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    mon.observe(ev("a", 0, 15.0, event="error", message=REFUSED))
    mon.observe(ev("b", 1, 15.1, event="error", message=REFUSED.replace("111", "113")))
    assert mon.resolve() == [] and mon.job_error is None and mon.startup_race() is not None


def test_a_crash_before_the_refusal_is_the_culprit_and_no_race() -> None:
    # The peer that was not listening died first (its import crashed): that node is the culprit.
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    mon.observe(ev("a", 0, 1.0, event="started", pid=10))
    mon.observe(Observation("proc", "a", 2.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    mon.observe(ev("b", 1, 15.0, event="error", message=REFUSED))
    assert mon.culprits() == ["a"] and mon.startup_race() is None


def test_a_connect_error_after_the_first_step_blames_no_node_and_is_no_race() -> None:
    mon = Monitor.create(PLAN, iters=5, now=0.0)
    started(mon)
    mon.observe(ev("a", 0, 1.0, event="step", step=1, loss=2.0))
    mon.observe(ev("b", 1, 1.0, event="step", step=1, loss=2.0))
    [inc] = mon.observe(ev("b", 1, 2.0, event="error", message=REFUSED))
    assert inc.action == "stop" and "startup_race" not in inc.evidence and mon.startup_race() is None


def test_start_up_races_are_relaunched_beside_the_restart_budget_up_to_a_few() -> None:
    from coordinator.run.job import STARTUP_RETRIES, restarts_spent

    assert STARTUP_RETRIES == 2
    # max_restarts 0 (give up once spent >= 0): the first two races are still retried, the third ends the run.
    assert [restarts_spent(n, n + 1) >= 0 for n in range(3)] == [False, False, True]
    assert restarts_spent(2, 0) == 2 and restarts_spent(3, 1) == 2


def test_a_digest_or_manifest_read_after_every_rank_failed_compares_nothing() -> None:
    """A rank's last digest and checkpoint events can be read after every rank is FAILED (a `stop` or Ctrl-C ends
    them all while the reader is behind): no live replica is left to vote, so nothing is compared and nobody is
    blamed (this raised IndexError in `_vote` once, in test_supervision's SIGINT drill)."""
    mon = Monitor.create(PLAN, iters=9, now=0.0)
    started(mon)
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(ev(node, rank, 1.0, event="step", step=1, loss=2.0, tok_s=100.0))
    mon.observe(Observation("proc", "a", 2.0, 0, {"alive": False, "pid": 10, "state": "gone"}))
    mon.observe(Observation("proc", "b", 2.1, 1, {"alive": False, "pid": 11, "state": "gone"}))
    assert all(view.state is WorkerState.FAILED for view in mon.ranks.values())
    before = list(mon.incidents)
    assert mon.observe(ev("a", 0, 2.2, event="digest", step=1, params_sha256="p", optimizer_sha256="o")) == []
    assert mon.observe(ev("b", 1, 2.3, event="checkpoint", step=1, sha256="m", path="x")) == []
    assert mon.incidents == before and mon.last_consistent_step is None
