"""Two inventory entries with one address (one machine, two ranks) over real SSH: `coordinator calibrate` measures
them together, in lockstep (worker.bench --lockstep, its stdin held open by the coordinator over each node's own
asyncssh channel), and, being interchangeable, they get one curve and an even split."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import TestBed

REPO = Path(__file__).resolve().parents[2]


def test_two_entries_of_one_host_are_calibrated_together(testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    host = testbed.add_host("box")
    inv = testbed.write_inventory(tmp_path / "inv.yaml", [], extra_nodes=[
        {"name": name, "host": host.ip, "ips": [host.ip], "workdir": f"/srv/work/{name}"} for name in ("r0", "r1")])
    pb = tmp_path / "pb.yaml"
    pb.write_text(yaml.safe_dump({
        "name": "together", "kind": "train", "model": "/srv/model", "data": "/srv/data", "backend": "ring",
        "assets": {"data_from": str(REPO / "playbooks" / "data" / "smoke"),
                   "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "lora", "iters": 2, "batch_size": 4, "max_seq_length": 64},
        "calibration": {"time_budget": 8, "max_batch": 2},
    }, sort_keys=False))
    cp = run_cli("calibrate", "-i", str(inv), "-p", str(pb), "--json", env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
                 timeout=480)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-4000:]
    doc = json.loads(cp.stdout)
    validate_output("calibrate", doc)
    r0, r1 = doc["nodes"]
    assert (r0["node"], r1["node"]) == ("r0", "r1")
    assert r0["curve"] == r1["curve"] and [p["batch"] for p in r0["curve"]] == [1, 2]
    assert doc["split"] == {"r0": 0.5, "r1": 0.5}
    assert f"together with r1 (they share {host.ip}), in lockstep" in cp.stderr
    assert "bench lockstep" not in cp.stderr  # the gate's own lines are not progress
