"""benchmarks/bench_train_phases.py run for real on the tiny model: every phase of each tool is measured and
reported, and the options reach both tools. No memory or time thresholds: the figures depend on the machine; which
phases are measured does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_train_phases.py"


def phases_of(tool: str, tmp_path: Path, *extra: str) -> list[list[object]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--iters", "2", "--keep", str(tmp_path),
                           "--one", tool, *extra], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows: list[list[object]] = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return rows


@pytest.mark.parametrize("tool", ["ours", "mlx_lm"])
def test_every_phase_is_measured(tool: str, tmp_path: Path) -> None:
    rows = phases_of(tool, tmp_path, "--clear-cache", "never", "--memory-limit-mb", "64")
    names = [str(r[0]) for r in rows]
    want = (["load (probe included)", "check_replicas", "step 1", "step 2", "digests", "evaluate", "save"]
            if tool == "ours" else ["load", "evaluate", "step 1", "step 2", "save_safetensors"])
    assert set(want) <= set(names)
    assert sorted(want, key=names.index) == want  # first measured in the order the run goes through them
    for _, before, peak, after, secs in rows:
        assert isinstance(peak, float) and isinstance(secs, float) and peak >= 0 and secs >= 0
        assert isinstance(before, float) and isinstance(after, float)
    steps = [r for r in rows if str(r[0]).startswith("step")]
    assert all(float(str(r[2])) > 0 for r in steps)  # a step allocates: its peak cannot be 0


def test_bad_arguments_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--iters", "0"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "--iters must be >= 1" in proc.stderr
