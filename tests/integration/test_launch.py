"""`coordinator launch` over real SSH on network-namespace hosts with the real mlx.launch ring backend."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
import yaml

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import Host, TestBed

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"


def write_playbook(path: Path, *, iters: int, name: str = "itest", batch: int = 4, split: object = "equal",
                   **train: object) -> Path:
    doc = {
        "name": name,
        "kind": "train",
        "model": "/srv/model",
        "data": "/srv/data",
        "backend": "ring",
        "assets": {"data_from": str(DATA), "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "lora", "iters": iters, "batch_size": batch, "learning_rate": 1e-3,
                  "max_seq_length": 64, "save_every": 2, "steps_per_eval": 4, "val_batches": 1, **train},
        "split": split,  # the test hosts share 2 cores: calibration is tested once, on 2 nodes
        "calibration": {"time_budget": 30, "max_batch": 8},
        "heartbeat_timeout": 20,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(run_cli: RunCli, tmp: Path, inv: Path, pb: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp / "runs"), *extra,
                   env={"XDG_CACHE_HOME": str(tmp / "cache")}, timeout=300)
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"no JSON summary (rc {proc.returncode})\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    validate_output("launch", summary)  # docs/json.md's schema, unknown keys refused
    return proc, summary


def events(tmp: Path, run_id: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / "runs" / run_id / "events.jsonl").read_text().splitlines()]


def manifest(bed: TestBed, host: Host, run_id: str, step: int) -> str:
    path = f"/srv/work/runs/{run_id}/{host.name}/checkpoints/step-{step:06d}/manifest.sha256"
    out = bed.exec(host, ["cat", path], check=True)
    return out.stdout


def no_leftovers(bed: TestBed, hosts: list[Host], run_id: str) -> None:
    for host in hosts:
        assert bed.exec(host, ["sh", "-c", f"ls -d /tmp/mlxc-{run_id}-* 2>/dev/null || true"]).stdout.strip() == ""
    ps = subprocess.run(["pgrep", "-f", f"runs/{run_id}/run.json"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"rank processes left: {ps.stdout}"


@pytest.mark.parametrize("n", [2, 3])
def test_launch_trains_on_every_node_and_checkpoints_everywhere(testbed: TestBed, run_cli: RunCli, tmp_path: Path,
                                                                n: int) -> None:
    hosts = testbed.add_hosts(n)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    # dp forced: this test is about every node training. Under `auto` the test hosts, which share two cores, may
    # rightly be planned "solo" on one of them (its calibrated rate beats dp on both by far at this tiny batch).
    pb = write_playbook(tmp_path / "pb.yaml", iters=6, batch=n + 2, split="calibrated" if n == 2 else "equal",
                        strategy="dp")
    proc, summary = launch(run_cli, tmp_path, inv, pb)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert summary["state"] == "succeeded" and summary["steps"] == 6
    assert summary["incidents"] == []
    assert sorted(summary["split"]) == sorted(h.name for h in hosts)
    assert sum(node["batch_size"] for node in summary["nodes"]) == n + 2
    assert all(node["state"] == "finished" and node["step"] == 6 for node in summary["nodes"])
    run_id = summary["run_id"]
    run_dir = tmp_path / "runs" / run_id
    for name in ("playbook.yaml", "plan.json", "hostfile.json", "launcher.log", "events.jsonl", "summary.json"):
        assert (run_dir / name).exists(), name
    hostfile = json.loads((run_dir / "hostfile.json").read_text())
    assert [h["ips"] for h in hostfile["hosts"]] == [[h.ip] for h in hosts]
    evs = events(tmp_path, run_id)
    by_rank: dict[int, set[str]] = {}
    planned = {node["rank"]: node["node"] for node in summary["nodes"]}
    for ev in evs:
        if "rank" in ev and ev.get("event") != "incident":
            assert ev["node"] == planned[ev["rank"]]  # an event's origin is its node's channel
            by_rank.setdefault(ev["rank"], set()).add(ev["event"])
    for rank in range(n):
        assert {"started", "step", "checkpoint", "eval", "finished", "heartbeat"} <= by_rank[rank]
    steps = [ev for ev in evs if ev.get("event") == "step" and ev["rank"] == 0]
    assert [ev["step"] for ev in steps] == list(range(1, 7))
    # Every node holds the same final checkpoint, byte for byte.
    manifests = {manifest(testbed, h, run_id, 6) for h in hosts}
    assert len(manifests) == 1 and "weights.safetensors" in manifests.pop()
    no_leftovers(testbed, hosts, run_id)


def test_resume_continues_at_the_right_step_with_the_optimizer_state(testbed: TestBed, run_cli: RunCli,
                                                                     tmp_path: Path) -> None:
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    # An uninterrupted 8-step run, then a 4-step run resumed to 8: same model, data, split (cached calibration).
    full_proc, full = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "full.yaml", iters=8, name="full"))
    assert full_proc.returncode == 0, full_proc.stderr[-3000:]
    first_proc, first = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "part.yaml", iters=4, name="part"))
    assert first_proc.returncode == 0 and first["steps"] == 4
    assert first["split"] == full["split"]
    resumed_proc, resumed = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "part.yaml", iters=8, name="part"),
                                   "--resume", first["run_id"])
    assert resumed_proc.returncode == 0, resumed_proc.stderr[-3000:]
    assert resumed["run_id"] == first["run_id"] and resumed["steps"] == 8
    started = [ev for ev in events(tmp_path, first["run_id"]) if ev.get("event") == "started"]
    assert {ev.get("resumed_from") for ev in started[-2:]} == {4}
    resumed_steps = [ev["step"] for ev in events(tmp_path, first["run_id"])
                     if ev.get("event") == "step" and ev["rank"] == 0]
    assert resumed_steps == [1, 2, 3, 4, 5, 6, 7, 8]

    def arrays(run_id: str, name: str) -> dict[str, mx.array]:
        local = tmp_path / f"{run_id}-{name}"
        path = f"/srv/work/runs/{run_id}/{hosts[0].name}/checkpoints/step-000008/{name}"
        data = testbed.exec(hosts[0], ["base64", "-w0", path], check=True).stdout
        import base64

        local.write_bytes(base64.b64decode(data))
        return dict(mx.load(str(local)))

    for name in ("weights.safetensors", "optimizer.safetensors"):
        a, b = arrays(full["run_id"], name), arrays(first["run_id"], name)
        assert a.keys() == b.keys()
        for key in a:
            assert mx.allclose(a[key], b[key], atol=1e-5, rtol=1e-4).item(), (name, key)
    no_leftovers(testbed, hosts, first["run_id"])
