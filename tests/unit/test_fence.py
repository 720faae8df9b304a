"""The node-side fence (worker.events.Fence / Heartbeat): a rank inside one step for too long of its own running
time stops itself; never before its first step, never outside the step phase, never for time it spent stopped."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.unit.test_train_chaos import EXAMPLE
from worker.events import FENCE_EXIT_CODE, EventLog, Fence, Heartbeat, Phase
from worker.runconfig import ConfigError, parse_run_config


def ticks(fence: Fence, n: int, *, every: float = 1.0, step: int = 7, phase: str = "step") -> list[float | None]:
    return [fence.tick(every, step, phase) for _ in range(n)]


def test_the_fence_is_due_after_the_window_of_running_time_in_one_step() -> None:
    fence = Fence(factor=10.0, min_s=5.0, interval=1.0)
    for dt in (1.0, 1.2, 0.8):
        fence.add_step_time(dt)
    assert fence.window() == 10.0  # 10 x the median 1.0 s (above the 5 s floor)
    # The first tick of a (step, phase) only starts its clock; then 10 s of ticks are within the window.
    assert ticks(fence, 11) == [None] * 11
    assert fence.tick(1.0, 7, "step") == 10.0
    assert fence.tick(1.0, 8, "step") is None and fence.stalled_s == 0.0  # progress resets it


def test_no_fence_before_the_first_step_or_outside_the_step_phase() -> None:
    fence = Fence(factor=10.0, min_s=5.0, interval=1.0)
    assert ticks(fence, 100, phase="step") == [None] * 100  # loading / first step: no yardstick yet
    fence.add_step_time(0.1)
    assert fence.window() == 5.0  # the floor
    for phase in ("load", "eval", "checkpoint", "digest", "idle"):
        assert ticks(fence, 100, phase=phase) == [None] * 100, phase


def test_the_barrier_after_a_checkpoint_is_fenced_like_a_step() -> None:
    fence = Fence(factor=10.0, min_s=5.0, interval=1.0)
    fence.add_step_time(0.1)
    assert ticks(fence, 7, phase="sync") == [None] * 6 + [5.0]


def test_time_spent_stopped_does_not_count() -> None:
    fence = Fence(factor=10.0, min_s=5.0, interval=1.0)
    fence.add_step_time(0.1)
    fence.tick(1.0, 3, "step")
    # A SIGSTOP of an hour, or a Mac asleep: the tick after it adds at most two intervals.
    assert fence.tick(3600.0, 3, "step") is None and fence.stalled_s == 2.0


def test_the_heartbeat_thread_emits_the_error_and_exits_when_fenced(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "rank1.jsonl", "fence", 1)
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    hb = Heartbeat(log, 0.05, fence=(10.0, 0.3), exit_fn=fake_exit)
    hb.set(step=1, phase=Phase.STEP)
    hb.set(step_time=0.01)
    hb.start()
    try:
        assert exited.wait(5.0)
    finally:
        hb.stop()
    events = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    [err] = [e for e in events if e["event"] == "error"]
    assert codes[0] == FENCE_EXIT_CODE and err["fenced"] is True and err["exit_code"] == FENCE_EXIT_CODE
    assert err["step"] == 1 and err["message"].startswith("fenced: step 1 has not ended")


def test_a_heartbeat_without_a_fence_never_exits(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "rank0.jsonl", "nofence", 0)
    hb = Heartbeat(log, 0.02, exit_fn=lambda code: pytest.fail(f"exited {code}"))
    hb.set(step=1, phase=Phase.STEP, step_time=0.001)
    hb.start()
    time.sleep(0.3)
    hb.stop()
    log.close()


def test_run_config_fence() -> None:
    assert parse_run_config(dict(EXAMPLE)).fence is None
    assert parse_run_config({**EXAMPLE, "fence": {"factor": 30, "min_s": 180}}).fence == (30.0, 180.0)
    for bad in ({"factor": 30}, {"factor": 0, "min_s": 1}, [30, 180], {"factor": 30, "min_s": 1, "x": 1}):
        with pytest.raises(ConfigError):
            parse_run_config({**EXAMPLE, "fence": bad})
