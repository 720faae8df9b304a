"""`coordinator launch --fix` over real SSH: from nodes with only sshd and a system python (no venv, no model, no
data) to a training step, in one command. Setup creates each node's venv from the coordinator's wheelhouse
cache (~/.cache/mlx-coordinator/wheelhouse, as tests/integration/test_setup.py uses it), the playbook's assets
copy the data in once the nodes have a python, sync relays the model from a local dir down the chain of nodes,
preflight passes, the run trains."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import TestBed
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"
VENV = "/srv/venvs/mlx"
FIX_TIMEOUT = 900.0  # three fresh venvs installed side by side on a busy 2-core machine, then the run


def write_playbook(path: Path, *, iters: int, **extra: object) -> Path:
    doc = {
        "name": "fix", "kind": "train", "model": "/srv/model", "data": "/srv/data", "backend": "ring", **extra,
        "train": {"method": "lora", "iters": iters, "batch_size": 3, "learning_rate": 1e-3, "max_seq_length": 64,
                  "save_every": 100, "steps_per_eval": 100, "val_batches": 1},
        "split": "equal", "heartbeat_timeout": 30,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def make_source(root: Path) -> Path:
    """A local dir as `sync --source` reads it: model/ (the tiny model) and data/ (the smoke set)."""
    shutil.copytree(DATA, root / "data")
    build_tiny_model(root / "model", root / "data", layers=2, hidden=32, seed=0)
    return root


def test_launch_fix_takes_bare_nodes_to_a_training_step(testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    hosts = testbed.add_hosts(3)
    for h in hosts:
        assert not (h.srv / "venvs").exists() and not (h.srv / "model").exists() and not (h.srv / "data").exists()
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts, python=f"{VENV}/bin/python", workdir="/srv/work")
    # The data also comes from the playbook's `assets:` (the demo's way): a node without python cannot take it
    # before setup, so --fix provisions it after setup, and sync then finds it identical to the source's.
    pb = write_playbook(tmp_path / "pb.yaml", iters=2, assets={"data_from": str(DATA)})
    source = make_source(tmp_path / "source")

    # The coordinator's own cache ($XDG_CACHE_HOME left alone): the wheelhouse is downloaded once per machine, as
    # for test_setup.py; the split is equal, so nothing is calibrated or cached.
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp_path / "runs"), "--fix",
                   "--fix-source", str(source), timeout=FIX_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(proc.stdout)
    # What --fix did, per node and tool, is said on the terminal (stderr under --json; long lines wrap).
    said = " ".join(proc.stderr.split())
    model_files = len([p for p in (source / "model").rglob("*") if p.is_file()])
    for h in hosts:
        assert f"{h.name}: assets not provisioned yet" in said
        assert re.search(rf"--fix setup changed: {h.name}: [^|]*create venv {VENV}", said), proc.stderr[-4000:]
        assert f"{h.name}: data created" in said
        # Only the model travels: the data the assets wrote is already the source's, byte for byte.
        assert f"--fix sync changed: {h.name}: copied {model_files} file(s)" in said, proc.stderr[-4000:]
    assert "--fix: setup on h1, h2, h3" in said
    assert f"from model {source}/model, data {source}/data on this machine (--fix-source)" in said

    assert summary["state"] == "succeeded", summary.get("message")
    validate_output("launch", summary)  # docs/json.md's schema
    run_dir = tmp_path / "runs" / summary["run_id"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    first_step = {ev["rank"]: ev["step"] for ev in reversed(events) if ev.get("event") == "step"}
    assert sorted(first_step) == [0, 1, 2] and min(first_step.values()) >= 1, first_step
    assert {node["node"]: node["step"] for node in summary["nodes"]} == {h.name: 2 for h in hosts}
    for h in hosts:
        assert (h.srv / "venvs" / "mlx" / "bin" / "python").exists()
        assert (h.srv / "model" / "config.json").read_bytes() == (source / "model" / "config.json").read_bytes()


def test_launch_fix_without_a_source_names_the_flag(testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    """Nodes with their python (the repo's venv) but no model anywhere: --fix has nothing to sync from."""
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    pb = write_playbook(tmp_path / "pb.yaml", iters=1)
    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(tmp_path / "runs"), "--fix",
                   env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "--fix: sync on h1, h2" in proc.stdout
    assert proc.stderr.strip().endswith(
        "coordinator: error: --fix: no source for sync: no node has a copy that passes the model check, and this "
        "machine lacks /srv/model, /srv/data; name one with --fix-source NODE or --fix-source DIR (holding model/, "
        "data/)"), proc.stderr[-3000:]

    proc = run_cli("launch", "-i", str(inv), str(pb), "--fix-source", "h1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "coordinator: error: --fix-source goes with --fix"


def test_launch_fix_checks_its_sync_source_before_setup_changes_any_node(testbed: TestBed, run_cli: RunCli,
                                                                         tmp_path: Path) -> None:
    """Bare nodes (no venv: setup would install) and no model anywhere: --fix refuses before setup runs, and
    before anything is made at all for a --fix-source that names neither a node nor a dir."""
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts, python=f"{VENV}/bin/python", workdir="/srv/work")
    pb = write_playbook(tmp_path / "pb.yaml", iters=1)
    # pip may not reach an index: a setup that ran anyway would fail to download, not install for minutes.
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"}
    runs = tmp_path / "runs"

    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(runs), "--fix", "--fix-source",
                   str(tmp_path / "nowhere"), env=env)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.strip() == (f"coordinator: error: --fix-source {tmp_path}/nowhere: not a node of the inventory, "
                                   "and not a dir holding model/, data/ (lacks model/, data/)"), proc.stderr[-3000:]
    assert "connecting" not in proc.stdout and not runs.exists()

    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(runs), "--fix", env=env)
    assert proc.returncode == 2, proc.stderr[-4000:]
    said = " ".join(proc.stdout.split())
    assert "--fix: setup on h1, h2; judged again after setup: " in said, said[-3000:]
    assert proc.stderr.strip().endswith(
        "coordinator: error: --fix: no source for sync (checked before setup changed any node): no node has a copy "
        "that passes the model check, and this machine lacks /srv/model, /srv/data; name one with --fix-source NODE "
        "or --fix-source DIR (holding model/, data/)"), proc.stderr[-3000:]
    assert "--fix setup " not in said and "--fix: wheels for" not in said, said[-3000:]
    for h in hosts:
        assert not (h.srv / "venvs").exists() and not (h.srv / "work" / ".coordinator" / "wheelhouse").exists()
    assert not (tmp_path / "cache" / "mlx-coordinator").exists()
