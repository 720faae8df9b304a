"""`train.strategy` through the real CLI on network-namespace hosts: a run that resolves to fsdp is refused by
preflight and, under `--skip-preflight`, by launch, before any rank starts (the worker runs dp only)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.integration.conftest import RunCli
from tests.testbed import TestBed

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"
RING_REASON = "[ring] sum_scatter not supported (mlx 0.32.4): fsdp needs nccl (CUDA nodes) or jaccl"


def test_fsdp_is_refused_by_preflight_and_by_launch_before_any_rank_starts(testbed: TestBed, run_cli: RunCli,
                                                                           tmp_path: Path) -> None:
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    pb = tmp_path / "pb.yaml"
    pb.write_text(yaml.safe_dump({
        "name": "fsdp", "kind": "train", "model": "/srv/model", "data": "/srv/data",
        "assets": {"data_from": str(DATA), "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "full", "strategy": "fsdp", "iters": 4, "batch_size": 4, "max_seq_length": 64,
                  "save_every": 2, "steps_per_eval": 100, "val_batches": 1},
        "split": "equal"}, sort_keys=False))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    report = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", env=env)
    assert report.returncode == 1, report.stdout[-2000:] + report.stderr[-2000:]
    [strategy] = [r for r in json.loads(report.stdout)["lint"] if r["id"] == "strategy"]
    assert strategy["status"] == "fail" and strategy["summary"].endswith(RING_REASON), strategy
    runs = tmp_path / "runs"
    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(runs), "--skip-preflight", env=env,
                   timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert f"train.strategy fsdp resolves to fsdp: {RING_REASON}" in out, out[-3000:]
    assert "Traceback" not in out
    events = [json.loads(line) for run in runs.iterdir() if (run / "events.jsonl").exists()
              for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    assert not [e for e in events if e.get("event") in ("started", "step")], events
