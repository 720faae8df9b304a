"""Quarantine scoped to a machine, and degraded launches that say so, over real SSH on network-namespace hosts:
a `--chaos` drill leaves its culprit out of its own run only; another inventory's node of the same name is never
left out; a launch that would start without a quarantined node fails loudly unless allowed, and its summary
records what it ran without."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from coordinator.models import Node
from coordinator.run.quarantine import QuarantineStore, inventory_key, new_entry
from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.integration.test_faults import DATA, write_playbook
from tests.testbed import SSH_PORT, TestBed, provisioned_assets

# No `min_nodes` written: a fresh launch must not start degraded by surprise.
FAULTS = {"consistency_every": 5, "max_restarts": 2}


def env_for(tmp: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}


def state_file(tmp: Path) -> Path:
    return tmp / "state" / "mlx-coordinator" / "quarantine.json"


def test_a_chaos_drill_quarantines_nothing_beyond_its_run_and_another_inventorys_node_is_not_left_out(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    hosts = testbed.add_hosts(3)
    testbed.seed_assets(hosts, provisioned_assets(DATA))  # the tiny model, as a first launch leaves it
    inv_a = testbed.write_inventory(tmp_path / "a.yaml", hosts[:2])
    env = env_for(tmp_path)
    drill = run_cli("launch", "-i", str(inv_a), str(write_playbook(tmp_path / "drill.yaml", iters=6,
                                                                   faults={**FAULTS, "min_nodes": 1})),
                    "--json", "--run-dir", str(tmp_path / "runs"), "--chaos", "kill:rank=1,step=3", env=env,
                    timeout=400)
    assert drill.returncode == 0, drill.stderr[-3000:]
    summary = json.loads(drill.stdout)
    # Inside the drill run the culprit is still left out of the relaunch...
    assert summary["state"] == "succeeded" and summary["attempts"] == 2 and summary["steps"] == 6
    assert summary["quarantined"] == [hosts[1].name]
    assert [n["node"] for n in summary["nodes"]] == [hosts[0].name]
    assert "persists no quarantine" in drill.stderr
    # ...but nothing persists.
    assert not state_file(tmp_path).exists() or json.loads(state_file(tmp_path).read_text())["entries"] == []
    listed = run_cli("quarantine", "list", env=env)
    assert (listed.returncode, listed.stdout) == (0, "no node is quarantined\n")

    # Inventory B has a node of the same name (on another machine). A real quarantine of A's node (recorded as
    # a fault would) leaves out neither B's node nor anything else of B's.
    store = QuarantineStore(state_file(tmp_path))
    node_a = Node(hosts[1].name, hosts[1].ip, port=SSH_PORT)
    store.add(new_entry(node_a, inventory_key(str(inv_a)), "crash at step 3", run_id="earlier", incident={},
                        host_key=None, now=time.time(), quarantine_for=3600))
    inv_b = tmp_path / "b.yaml"
    doc = yaml.safe_load(inv_a.read_text())
    doc["nodes"] = [{"name": hosts[0].name, "host": hosts[0].ip, "ips": [hosts[0].ip]},
                    {"name": hosts[1].name, "host": hosts[2].ip, "ips": [hosts[2].ip]}]
    inv_b.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = run_cli("launch", "-i", str(inv_b), str(write_playbook(tmp_path / "pb.yaml", iters=2, faults=FAULTS)),
                  "--json", "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["state"] == "succeeded"
    assert sorted(n["node"] for n in summary["nodes"]) == sorted([hosts[0].name, hosts[1].name])
    assert summary["degraded"] is False and summary["left_out"] == []
    assert "left out" not in run.stderr and "DEGRADED" not in run.stderr


def test_a_degraded_launch_fails_loudly_unless_allowed_and_its_summary_says_so(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    hosts = testbed.add_hosts(2)
    testbed.seed_assets(hosts, provisioned_assets(DATA))  # the tiny model, as a first launch leaves it
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    env = env_for(tmp_path)
    store = QuarantineStore(state_file(tmp_path))
    now = time.time()
    culprit = Node(hosts[1].name, hosts[1].ip, port=SSH_PORT)
    store.add(new_entry(culprit, inventory_key(str(inv)), "crash at step 5", run_id="fault-1", incident={},
                      host_key=None, now=now, quarantine_for=3600))
    # Another fleet's quarantined node of the same name says nothing here.
    store.add(new_entry(Node(hosts[0].name, "10.255.0.9", port=SSH_PORT), "/elsewhere/inv.yaml", "hang at step 2",
                        run_id="other", incident={}, host_key=None, now=now, quarantine_for=0))
    pb = write_playbook(tmp_path / "pb.yaml", iters=2, faults=FAULTS)

    refused = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(tmp_path / "runs"), env=env, timeout=120)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    out = refused.stdout + refused.stderr
    assert "Traceback" not in out
    assert f"DEGRADED: 1 of 2 node(s) of {inv}; left out:" in out
    assert f"{hosts[1].name}: quarantined: crash at step 5 (run fault-1," in out
    assert f"bring it back: coordinator quarantine clear {hosts[1].name} -i {inv}" in out
    assert "would start degraded on 1 of 2 node(s)" in refused.stderr and "--allow-degraded" in refused.stderr
    assert "hang at step 2" not in out and "left out: \n" not in out
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())  # nothing was started

    allowed = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp_path / "runs"),
                      "--allow-degraded", env=env, timeout=300)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert f"DEGRADED: 1 of 2 node(s) of {inv}; left out:" in allowed.stderr
    summary = json.loads(allowed.stdout)
    assert summary["state"] == "succeeded" and [n["node"] for n in summary["nodes"]] == [hosts[0].name]
    assert summary["degraded"] is True
    [left] = summary["left_out"]
    assert left["node"] == hosts[1].name and left["reason"].startswith("quarantined: crash at step 5 (run fault-1,")
    on_disk = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert on_disk["degraded"] is True and on_disk["left_out"] == summary["left_out"]
    meta = json.loads((Path(summary["run_dir"]) / "meta.json").read_text())
    assert meta["left_out"] == summary["left_out"]

    # Cleared, the node takes part again and nothing is degraded.
    cleared = run_cli("quarantine", "clear", hosts[1].name, "-i", str(inv), env=env)
    assert cleared.returncode == 0 and cleared.stdout.startswith(f"cleared {hosts[1].name} {hosts[1].ip}:{SSH_PORT}")
    listed = run_cli("quarantine", "list", "--json", env=env)
    validate_output("quarantine list", json.loads(listed.stdout))  # docs/json.md's schema
    assert [e["inventory"] for e in json.loads(listed.stdout)["entries"]] == ["/elsewhere/inv.yaml"]
