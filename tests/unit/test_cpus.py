"""worker.cpus: a rank's slice of the CPUs it may use, taken by every thread it has; and run.json's cpu_shares."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpus import share_of
from worker.runconfig import ConfigError, parse_run_config

REPO = Path(__file__).resolve().parents[2]


def test_slices_are_equal_disjoint_and_in_order() -> None:
    assert share_of([3, 1, 2, 0], 0, 2) == (0, 1) and share_of([3, 1, 2, 0], 1, 2) == (2, 3)
    assert share_of([4, 5, 6], 1, 2) == (5,)  # the remainder goes to nobody: equal slices
    assert share_of([0, 1], 2, 3) is None  # fewer CPUs than slices: not pinned
    assert share_of([0, 1], 2, 2) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to take one")
def test_every_thread_of_the_process_is_pinned_those_started_before_included() -> None:
    """MLX starts threads before the rank takes its share: each of them, and the threads after, run on it."""
    code = (
        "import os, threading, time, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait); t.start()  # a thread from before\n"
        "from worker.cpus import take_share\n"
        "mine = take_share(1, 2)\n"
        "after = []\n"
        "u = threading.Thread(target=lambda: after.append(os.sched_getaffinity(0))); u.start(); u.join()\n"
        "seen = {int(x): os.sched_getaffinity(int(x)) for x in os.listdir('/proc/self/task')}\n"
        "ev.set(); t.join()\n"
        "print(sorted(mine), sorted({tuple(sorted(v)) for v in seen.values()}), sorted(after[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    allowed = sorted(os.sched_getaffinity(0))
    mine = list(share_of(allowed, 1, 2) or ())
    assert out.strip() == f"{mine} {[tuple(mine)]} {mine}"


@pytest.mark.parametrize(("value", "message"), [
    ({"2": [0, 2]}, "not a rank"), ({"0": [2, 2]}, "0 <= index < count"), ({"0": [0]}, "index, count"),
    ([0, 2], "must be an object"), ({"x": [0, 2]}, "not a rank"),
])
def test_bad_cpu_shares_are_refused(value: object, message: str) -> None:
    raw = {"run_id": "r", "model": "m", "data": "d", "run_dir": "/x", "cpu_shares": value,
           "ranks": [{"rank": 0, "node": "a", "batch_size": 1}, {"rank": 1, "node": "b", "batch_size": 1}]}
    with pytest.raises(ConfigError, match=message):
        parse_run_config(raw)


def test_cpu_shares_round_trip() -> None:
    raw = {"run_id": "r", "model": "m", "data": "d", "run_dir": "/x", "cpu_shares": {"0": [0, 2], "1": [1, 2]},
           "ranks": [{"rank": 0, "node": "a", "batch_size": 1}, {"rank": 1, "node": "b", "batch_size": 1}]}
    config = parse_run_config(raw)
    assert config.cpu_shares == {0: (0, 2), 1: (1, 2)}
    assert parse_run_config(config.to_json()) == config
