"""Every cache honours $XDG_CACHE_HOME: the coordinator's (calibration, setup's wheels) through one helper, the
nodes' (the probe's bytecode, the hash cache) by the same rule in the node's environment. `.ci/run` removes
`${XDG_CACHE_HOME:-$HOME/.cache}/mlx-coordinator`; before, the probe and hash caches stayed in ~/.cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.facts.probe import BOOTSTRAP
from coordinator.fleet.cachedir import cache_root
from coordinator.fleet.nodesetup import default_wheelhouse_root
from coordinator.run.job import default_cache_dir


def test_cache_root_follows_the_xdg_rule(tmp_path: Path) -> None:
    home = os.path.expanduser("~/.cache")
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "mlx-coordinator"
    assert cache_root({}) == Path(home) / "mlx-coordinator"
    assert cache_root({"XDG_CACHE_HOME": ""}) == Path(home) / "mlx-coordinator"
    assert cache_root({"XDG_CACHE_HOME": "relative/dir"}) == Path(home) / "mlx-coordinator"  # the spec: ignored


def test_coordinator_caches_live_under_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "mlx-coordinator" / "calibration"
    assert default_wheelhouse_root() == tmp_path / "mlx-coordinator" / "wheelhouse"


def test_node_caches_follow_the_nodes_xdg_cache_home(tmp_path: Path) -> None:
    """The probe's bootstrap and the hash cache, run as a node runs them, with the node's XDG_CACHE_HOME."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP, "k1", "{}"], input=b"print('probed')", env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == b"probed", proc.stderr
    assert [p.name.startswith("probe-k1-") for p in (tmp_path / "mlx-coordinator").iterdir()] == [True]
    out = subprocess.run([sys.executable, "-c", "from worker.probe import DEFAULT_CACHE; print(DEFAULT_CACHE)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(tmp_path / "mlx-coordinator" / "sha256.json"), out.stderr
