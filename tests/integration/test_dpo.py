"""DPO over real SSH on network-namespace hosts with the real mlx.launch ring backend: 2 nodes, an uneven split of
the pairs, the loss falls, reward statistics arrive in the events, and a resumed run continues at its step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import RunCli
from tests.testbed import TestBed

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "dpo"


def write_playbook(path: Path, *, iters: int, fine_tune_type: str = "lora") -> Path:
    doc = {
        "name": "dpo-itest",
        "kind": "train",
        "model": "/srv/model",
        "data": "/srv/data",
        "backend": "ring",
        "assets": {"data_from": str(DATA), "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "dpo", "iters": iters, "batch_size": 6, "learning_rate": 5e-3, "max_seq_length": 64,
                  "save_every": 5, "steps_per_eval": 10, "val_batches": 2,
                  "dpo": {"beta": 0.5, "fine_tune_type": fine_tune_type}},
        "split": {"h1": 2 / 3, "h2": 1 / 3},  # 4 and 2 pairs: an uneven split, weighted exactly
        "heartbeat_timeout": 20,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(run_cli: RunCli, tmp: Path, inv: Path, pb: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp / "runs"), *extra,
                   env={"XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}, timeout=300)
    try:
        return proc, json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"no JSON summary (rc {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def test_two_node_dpo_lowers_the_loss_and_resumes(testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    proc, summary = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=20))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert summary["state"] == "succeeded" and summary["steps"] == 20
    assert [i for i in summary["incidents"] if i["action"] != "warn"] == []  # (a loaded test machine may warn)
    assert {n["node"]: n["batch_size"] for n in summary["nodes"]} == {"h1": 4, "h2": 2}
    run_id = summary["run_id"]
    evs = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    steps = [e for e in evs if e.get("event") == "step" and e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 21))
    assert all(e["total_pairs"] == 6 and 0.0 <= e["reward_accuracy"] <= 1.0 for e in steps)
    assert {e["pairs"] for e in evs if e.get("event") == "step" and e["rank"] == 1} == {2}
    # Both ranks report the same global loss (one all_sum), and it falls from log 2 (policy == reference).
    by_step = {}
    for e in evs:
        if e.get("event") == "step":
            by_step.setdefault(e["step"], set()).add(round(e["loss"], 6))
    assert all(len(v) == 1 for v in by_step.values())
    first, last = steps[0]["loss"], sum(e["loss"] for e in steps[-5:]) / 5
    assert first == pytest.approx(0.6931, abs=2e-3)
    assert last < 0.8 * first, [e["loss"] for e in steps]
    evals = [e for e in evs if e.get("event") == "eval" and e["rank"] == 0]
    assert evals and all("val_reward_accuracy" in e for e in evals)
    # Resume the finished run with more iters: it continues at step 21 with the same optimizer state.
    proc2, summary2 = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "pb2.yaml", iters=24),
                             "--resume", run_id, "--skip-preflight")
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    assert summary2["state"] == "succeeded" and summary2["steps"] == 24
    evs2 = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    started = [e for e in evs2 if e.get("event") == "started"]
    assert started[-1]["resumed_from"] == 20
    assert [e["step"] for e in evs2 if e.get("event") == "step" and e["rank"] == 0][-4:] == [21, 22, 23, 24]
