"""`train.strategy` through the real CLI on network-namespace hosts: a run that resolves to fsdp is refused by
preflight and, under `--skip-preflight`, by launch, before any rank starts (ring has no sum_scatter)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import yaml

from coordinator.planning.estimate import usable_memory
from coordinator.units import format_bytes
from tests.integration.conftest import RunCli
from tests.testbed import TestBed
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"
SIZE = r"[\d.]+ (?:B|KiB|MiB|GiB|TiB)"  # coordinator.units.format_bytes
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(text: str) -> float:
    """`3.3 MiB` -> bytes: the inverse of format_bytes, to compare two sizes a summary shows."""
    value, unit = text.split()
    return float(value) * _UNITS[unit]


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


def test_capped_nodes_refuse_dp_with_their_cgroup_numbers_and_fit_a_pipeline(testbed: TestBed, run_cli: RunCli,
                                                                               tmp_path: Path) -> None:
    """Three hosts whose sshd (and so every session and rank) sits in a cgroup v1 memory cap, all below what a dp
    replica of this full fine-tune needs: the probe reads each cap, dp is refused with every node's numbers
    against 0.9 x its cap, and auto resolves to a pipeline whose stages fit the unequal caps."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cgroups import HostCgroups

    hosts = testbed.add_hosts(3)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    # 24 rows of 1024 tokens: on the CPU backend (attention scores materialised) a dp rank of 8 rows needs ~470 MiB.
    caps = {hosts[0].name: 500 * 2**20, hosts[1].name: 420 * 2**20, hosts[2].name: 360 * 2**20}
    train = {"method": "full", "iters": 4, "batch_size": 24, "max_seq_length": 1024, "micro_batches": 8,
             "save_every": 2, "steps_per_eval": 100, "val_batches": 1}

    def playbook(strategy: str) -> Path:
        pb = tmp_path / f"pb-{strategy}.yaml"
        pb.write_text(yaml.safe_dump({
            "name": "capped", "kind": "train", "model": "/srv/model", "data": "/srv/data",
            "train": {**train, "strategy": strategy}, "split": "equal"}, sort_keys=False))
        return pb

    for host in hosts:  # the same six-block model and data on every host (deterministic)
        build_tiny_model(host.srv / "model", DATA, layers=6, hidden=64, seed=0)
        shutil.copytree(DATA, host.srv / "data")

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    with HostCgroups(f"{testbed.tag}-{os.getpid()}") as cg:
        for host in hosts:
            assert host.pid is not None
            cg.place(host.name, host.pid, cpus=None, memory_bytes=caps[host.name])
        facts = run_cli("facts", "-i", str(inv), "--json", env=env)
        assert facts.returncode == 0, facts.stderr[-2000:]
        limits = {n["node"]: n["cgroup_memory"]["limit_bytes"] for n in json.loads(facts.stdout)["nodes"]}
        assert limits == caps
        dp = run_cli("preflight", "-i", str(inv), "-p", str(playbook("dp")), "--json", env=env)
        auto = run_cli("preflight", "-i", str(inv), "-p", str(playbook("auto")), "--json", env=env)
    report = json.loads(dp.stdout)
    [strategy] = [r for r in report["lint"] if r["id"] == "strategy"]
    assert strategy["status"] == "fail", strategy
    assert strategy["summary"].startswith("train.strategy dp: dp does not fit ("), strategy
    for name, cap in caps.items():
        # Each node's usable memory comes from its cgroup cap (less the process's runtime), not the machine's RAM.
        usable = usable_memory(cap, is_macos=False)
        assert re.search(rf"{name}: {format_bytes(usable)} usable, dp needs ~{SIZE}", strategy["summary"])
    [chosen] = [r for r in json.loads(auto.stdout)["lint"] if r["id"] == "strategy"]
    assert chosen["summary"].startswith("pipeline (chosen by auto): "), chosen
    stages = re.findall(rf"(\S+) (\d+) blocks ~({SIZE}) of ({SIZE})", chosen["summary"])
    assert [s[0] for s in stages] == list(caps) and sum(int(s[1]) for s in stages) == 6
    assert all(parse_size(need) <= parse_size(budget) for _, _, need, budget in stages)


def test_auto_trains_solo_on_the_node_that_holds_the_model(testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    """Two hosts, one capped below a replica's need, and a job no pipeline runs (`train_embeddings`: the stages
    would each hold a copy of the tied embedding): preflight warns that the small host sits the run out (no
    failure), and launch weighs the plans and trains on the other alone ("solo"), its plan in plan.json."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cgroups import HostCgroups

    hosts = testbed.add_hosts(2)
    big, small = hosts
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    for host in hosts:
        build_tiny_model(host.srv / "model", DATA, layers=2, hidden=64, seed=0)
        shutil.copytree(DATA, host.srv / "data")
    pb = tmp_path / "pb.yaml"
    # 8 rows of 1024 tokens, full: a replica needs ~86 MiB per rank over two nodes (CPU attention scores), more
    # than the small host's 72 MiB (0.9 x its 80 MiB cap).
    pb.write_text(yaml.safe_dump({
        "name": "solo", "kind": "train", "model": "/srv/model", "data": "/srv/data",
        "train": {"method": "full", "iters": 2, "batch_size": 8, "max_seq_length": 1024, "save_every": 2,
                  "steps_per_eval": 100, "val_batches": 1, "train_embeddings": True},
        "split": "equal"}, sort_keys=False))  # no bench: unmeasured, the fitting plans go in their fixed order
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    runs = tmp_path / "runs"
    with HostCgroups(f"{testbed.tag}-{os.getpid()}") as cg:
        assert small.pid is not None
        cg.place(small.name, small.pid, cpus=None, memory_bytes=80 * 2**20)
        report = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", env=env)
        proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(runs), "--json", env=env, timeout=400)
    doc = json.loads(report.stdout)
    [strategy] = [r for r in doc["lint"] if r["id"] == "strategy"]
    assert strategy["status"] == "warn" and strategy["summary"].startswith(
        f"dp (chosen by auto) on {big.name}: the other nodes cannot hold a replica: {small.name} ("), strategy
    checks = {(n["node"], c["id"]): c for n in doc["nodes"] for c in n["checks"]}
    assert checks[(small.name, "resources")]["status"] == "warn"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"strategy auto: solo on {big.name}" in out
    assert re.search(r"node +layers +memory need / budget +predicted stage time +bubble +predicted tokens/s", out)
    summary = json.loads(proc.stdout)
    assert summary["state"] == "succeeded" and [n["node"] for n in summary["nodes"]] == [big.name]
    plan = json.loads((runs / summary["run_id"] / "plan.json").read_text())
    assert plan["strategy"]["chosen"] == f"solo on {big.name}" and plan["strategy"]["layout"] == {"kind": "dp"}
    assert any(c["label"] == "dp on every node" and not c["fits"] for c in plan["strategy"]["candidates"])
