"""Faults made from outside on network-namespace hosts with the real mlx.launch ring backend: each must be
detected within its bound, attributed to the right node, and the run must finish on the survivors with the
right number of steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.run.rundir import read_event_docs
from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import Host, TestBed, provisioned_assets

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"
HEARTBEAT_TIMEOUT = 6.0
ITERS = 40
# Both ranks of a 2-rank run sleep 14x their compute time per step (chaos `slow`), for a run that only has to
# last while the test acts on it: unpaced, its tiny steps took both cores from the CLIs the test waits on. Both,
# not one: MLX's ring all_sum busy-waits, so a lone slowed rank's peer would spin a core instead. A --chaos run is
# a drill (its culprits are left out of that run only, never quarantined): not for a test about the quarantine.
PACE = ("--chaos", "slow:rank=0,factor=15", "--chaos", "slow:rank=1,factor=15")


def write_playbook(path: Path, *, iters: int = ITERS, **extra: object) -> Path:
    doc = {
        "name": "fault",
        "kind": "train",
        "model": "/srv/model",
        "data": "/srv/data",
        "assets": {"data_from": str(DATA), "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "lora", "iters": iters, "batch_size": 6, "learning_rate": 1e-3, "max_seq_length": 64,
                  "save_every": 2, "steps_per_eval": 100, "val_batches": 1},
        "split": "equal",
        "heartbeat_timeout": HEARTBEAT_TIMEOUT,
        "faults": {"consistency_every": 5, "max_restarts": 2, "min_nodes": 1},
    }
    doc.update(extra)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Job:
    """`coordinator launch` running in the background; the test watches its events and injects faults."""

    def __init__(self, tmp: Path, inv: Path, pb: Path, *extra: str) -> None:
        self.tmp = tmp
        self.runs = tmp / "runs"
        self.env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state"),
                    "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json", "--run-dir",
             str(self.runs), *extra], cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)

    def run_dir(self) -> Path:
        found = sorted(self.runs.glob("fault-*")) if self.runs.exists() else []
        return found[-1] if found else Path("/nonexistent")

    def events(self) -> list[dict]:
        # The coordinator appends to events.jsonl while we read: its last line may be half-written (torn).
        docs, _ = read_event_docs(self.run_dir() / "events.jsonl")
        return docs

    def wait_for(self, pred: Callable[[list[dict]], object], timeout: float = 180.0) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred(self.events())
            if value:
                return value
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"launch ended early (rc {self.proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
            time.sleep(0.1)
        pytest.fail("timed out waiting for the job")

    def rank_pid_at_step(self, rank: int, step: int) -> int:
        def ready(evs: list[dict]) -> int | None:
            pids = [e["pid"] for e in evs if e.get("event") == "started" and e.get("rank") == rank]
            steps = [e["step"] for e in evs if e.get("event") == "step" and e.get("rank") == rank]
            return pids[-1] if pids and steps and max(steps) >= step else None

        return int(self.wait_for(ready))  # type: ignore[call-overload]

    def finish(self, timeout: float = 300.0) -> tuple[int, dict]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            pytest.fail(f"launch did not finish:\n{err[-4000:]}")
        try:
            return self.proc.returncode, json.loads(out)
        except ValueError:
            pytest.fail(f"no JSON summary (rc {self.proc.returncode}):\n{out[-2000:]}\n{err[-5000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture()
def jobs() -> list[Job]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def setup(testbed: TestBed, tmp: Path, n: int = 3, *, assets: bool = True) -> tuple[list[Host], Path]:
    """n hosts and their inventory; with `assets`, write_playbook's data and tiny model already on every host
    (as an earlier launch leaves them: these tests are about faults, not about building the model)."""
    hosts = testbed.add_hosts(n)
    if assets:
        testbed.seed_assets(hosts, provisioned_assets(DATA, layers=2, hidden=32, seed=0))
    return hosts, testbed.write_inventory(tmp / "inv.yaml", hosts)


def culprit_incident(summary: dict, kind: str) -> dict:
    found = [i for i in summary["incidents"] if i["kind"] == kind and i["action"] == "quarantine"]
    assert found, f"no {kind} incident: {json.dumps(summary['incidents'], indent=1)[:3000]}"
    return found[0]


def assert_finished_on_survivors(summary: dict, culprit: str, iters: int = ITERS) -> None:
    assert summary["state"] == "succeeded", json.dumps(summary, indent=1)[:4000]
    assert summary["steps"] == iters
    assert summary["attempts"] == 2
    assert summary["quarantined"] == [culprit]
    assert culprit not in {node["node"] for node in summary["nodes"]}
    assert all(node["step"] == iters for node in summary["nodes"])
    [recovery] = summary["recoveries"]
    assert recovery["culprits"] == [culprit]
    assert recovery["first_step_after_s"] is not None
    validate_output("launch", summary)  # docs/json.md's schema, a relaunch's recovery included


def no_rank_left(run_id: str) -> None:
    ps = subprocess.run(["pgrep", "-af", f"runs/{run_id}/"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"processes of the run left: {ps.stdout}"


def test_kill_9_of_a_rank_is_a_crash_and_the_run_finishes_on_the_survivors(testbed: TestBed, tmp_path: Path,
                                                                           jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml"))
    jobs.append(job)
    pid = job.rank_pid_at_step(1, 5)
    os.kill(pid, signal.SIGKILL)
    rc, summary = job.finish()
    assert rc == 0
    crash = culprit_incident(summary, "crash")
    assert crash["node"] == hosts[1].name and crash["rank"] == 1
    assert crash["detected_after_s"] <= 2.0
    assert_finished_on_survivors(summary, hosts[1].name)
    # The peers' "lost peer" errors are echoes, not culprits.
    assert all(i["node"] == hosts[1].name for i in summary["incidents"] if i["action"] == "quarantine")
    no_rank_left(summary["run_id"])
    # Quarantined for a cooldown, scoped to this inventory's machine (with the host key seen).
    [entry] = json.loads((tmp_path / "state" / "mlx-coordinator" / "quarantine.json").read_text())["entries"]
    assert (entry["node"], entry["inventory"], entry["host"]) == (hosts[1].name, str(inv.resolve()), f"{hosts[1].ip}:22")
    assert entry["host_key"].startswith("ssh-") and entry["expires"] == entry["t"] + 24 * 3600


def test_sigstop_is_a_hang_detected_within_the_heartbeat_timeout(testbed: TestBed, tmp_path: Path,
                                                                jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml"))
    jobs.append(job)
    pid = job.rank_pid_at_step(2, 5)
    os.kill(pid, signal.SIGSTOP)
    rc, summary = job.finish()
    hang = culprit_incident(summary, "hang")
    assert hang["node"] == hosts[2].name and hang["rank"] == 2
    assert hang["detected_after_s"] <= HEARTBEAT_TIMEOUT + 1.0
    assert_finished_on_survivors(summary, hosts[2].name)
    assert rc == 0
    no_rank_left(summary["run_id"])


def test_link_down_is_an_unreachable_node_whose_leftover_rank_fences_itself(testbed: TestBed, tmp_path: Path,
                                                                             jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path)
    # A short stall window, so the partitioned node's rank (which nobody can stop) fences itself within the test:
    # 3 x max(stall_min_s, heartbeat_timeout + 1) = 21 s of its running time inside one step.
    faults = {"consistency_every": 5, "max_restarts": 2, "min_nodes": 1, "stall_min_s": 2}
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", faults=faults))
    jobs.append(job)
    job.rank_pid_at_step(2, 5)
    testbed.link_down(hosts[2])
    down_at = time.monotonic()
    rc, summary = job.finish()
    gone = culprit_incident(summary, "unreachable")
    assert gone["node"] == hosts[2].name
    assert gone["detected_after_s"] <= HEARTBEAT_TIMEOUT + 1.0
    assert not [i for i in summary["incidents"] if i["kind"] == "stall"]  # the silent node is found first
    assert_finished_on_survivors(summary, hosts[2].name)
    assert rc == 0
    # The coordinator cannot reach h3 to stop its rank: the rank stops itself (the fence), with an error event.
    run_id = summary["run_id"]
    pattern = f"worker.train --config .*runs/{run_id}/"
    deadline = time.monotonic() + 90.0
    while testbed.exec(hosts[2], ["pgrep", "-f", pattern]).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = testbed.exec(hosts[2], ["cat", f"/srv/work/runs/{run_id}/{hosts[2].name}/events/rank2.jsonl"]).stdout
    assert not testbed.exec(hosts[2], ["pgrep", "-af", pattern]).stdout.strip(), log[-3000:]
    assert time.monotonic() - down_at >= 21.0
    fenced = [e for e in map(json.loads, log.splitlines()) if e.get("event") == "error" and e.get("fenced")]
    assert fenced and fenced[0]["exit_code"] == 75 and fenced[0]["message"].startswith("fenced: step")


def test_sshd_killed_with_its_sessions_is_detected_and_survived(testbed: TestBed, tmp_path: Path,
                                                               jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml"))
    jobs.append(job)
    job.rank_pid_at_step(1, 5)
    testbed.stop_sshd(hosts[1], sessions=True)  # the host "crashes": sshd and everything it started die
    rc, summary = job.finish()
    culprits = {i["node"] for i in summary["incidents"] if i["action"] == "quarantine"}
    assert culprits == {hosts[1].name}
    first = next(i for i in summary["incidents"] if i["action"] == "quarantine")
    assert first["kind"] in ("unreachable", "crash") and first["detected_after_s"] <= HEARTBEAT_TIMEOUT + 1.0
    assert_finished_on_survivors(summary, hosts[1].name)
    assert rc == 0


def test_changed_model_file_fails_preflight_for_the_odd_node(testbed: TestBed, run_cli: RunCli,
                                                            tmp_path: Path) -> None:
    hosts, inv = setup(testbed, tmp_path)
    pb = write_playbook(tmp_path / "pb.yaml")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    testbed.exec(hosts[2], ["sh", "-c", "printf x >> /srv/model/config.json"], check=True)
    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert proc.returncode == 1
    assert "preflight failed" in proc.stderr and hosts[2].name in proc.stderr
    report = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", env=env)
    data = json.loads(report.stdout)
    verdicts = {n["node"]: next(c for c in n["checks"] if c["id"] == "model") for n in data["nodes"]}
    assert verdicts[hosts[2].name]["status"] == "fail" and "config.json" in verdicts[hosts[2].name]["summary"]
    assert all(verdicts[h.name]["status"] == "pass" for h in hosts[:2])


def test_truncated_checkpoint_is_skipped_and_the_resume_continues(testbed: TestBed, run_cli: RunCli,
                                                                 tmp_path: Path) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    first = run_cli("launch", "-i", str(inv), str(write_playbook(tmp_path / "pb.yaml", iters=6)), "--json",
                    "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = json.loads(first.stdout)["run_id"]
    ckpt = f"/srv/work/runs/{run_id}/{hosts[0].name}/checkpoints/step-000006/weights.safetensors"
    testbed.exec(hosts[0], ["truncate", "-s", "100", ckpt], check=True)
    resumed = run_cli("launch", "-i", str(inv), str(write_playbook(tmp_path / "pb.yaml", iters=10)), "--json",
                      "--run-dir", str(tmp_path / "runs"), "--resume", run_id, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 10
    evs = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    invalid = [e for e in evs if e.get("event") == "checkpoint_invalid"]
    assert invalid and invalid[0]["node"] == hosts[0].name and invalid[0]["step"] == 6
    starts = [e for e in evs if e.get("event") == "started"][-2:]
    assert {e["resumed_from"] for e in starts} == {6}  # the intact copy on the other node wins
    assert summary["resumed_from"]["step"] == 6 and summary["resumed_from"]["node"] == hosts[1].name
    validate_output("launch", summary)  # docs/json.md's schema, a resume's resumed_from included
    assert f"resumed from step 6 (checkpoint {hosts[1].name}:" in resumed.stderr
    # the truncated copy is kept, set aside, and never resumed from again
    listing = testbed.exec(hosts[0], ["ls", f"/srv/work/runs/{run_id}/{hosts[0].name}/checkpoints"], check=True)
    assert "step-000006.invalid-sha256-mismatch" in listing.stdout.split()
    # Both nodes end with identical, valid final checkpoints.
    manifests = {testbed.exec(h, ["cat", f"/srv/work/runs/{run_id}/{h.name}/checkpoints/step-000010/manifest.sha256"],
                              check=True).stdout for h in hosts}
    assert len(manifests) == 1


def test_resume_with_only_invalid_checkpoints_refuses_and_a_restart_from_scratch_sets_them_aside(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    pb = write_playbook(tmp_path / "pb.yaml", iters=4)  # checkpoints at steps 2 and 4 on both nodes

    def launch(*extra: str) -> subprocess.CompletedProcess[str]:
        return run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp_path / "runs"), *extra,
                       env=env, timeout=300)

    first = launch()
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = json.loads(first.stdout)["run_id"]
    root = {h.name: f"/srv/work/runs/{run_id}/{h.name}/checkpoints" for h in hosts}
    # Every checkpoint on every node damaged: truncated weights, and one manifest gone.
    for h in hosts:
        testbed.exec(h, ["truncate", "-s", "100", f"{root[h.name]}/step-000004/weights.safetensors"], check=True)
    testbed.exec(hosts[0], ["truncate", "-s", "100", f"{root[hosts[0].name]}/step-000002/weights.safetensors"],
                 check=True)
    testbed.exec(hosts[1], ["rm", f"{root[hosts[1].name]}/step-000002/manifest.sha256"], check=True)

    refused = launch("--resume", run_id)
    assert refused.returncode == 1, refused.stderr[-3000:]
    for h in hosts:
        for step in (2, 4):
            assert f"{h.name}: {root[h.name]}/step-{step:06d}: " in refused.stderr, refused.stderr[-3000:]
    assert "truncated or corrupt" in refused.stderr and "manifest.sha256 missing" in refused.stderr
    assert "--restart-from-scratch" in refused.stderr and "Traceback" not in refused.stderr
    for h in hosts:  # a refusal changes nothing on the nodes
        listing = testbed.exec(h, ["ls", root[h.name]], check=True).stdout.split()
        assert {"step-000002", "step-000004"} <= set(listing) and not [n for n in listing if ".invalid-" in n]

    again = launch("--resume", run_id, "--restart-from-scratch")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 4 and summary["quarantined"] == []
    assert summary["resumed_from"]["step"] == 0 and summary["resumed_from"]["from_scratch"]
    assert len(summary["resumed_from"]["set_aside"]) == 4
    validate_output("launch", summary)  # docs/json.md's schema, the set-aside checkpoints included
    assert "restarted from scratch at step 0" in again.stderr
    for h in hosts:
        listing = set(testbed.exec(h, ["ls", root[h.name]], check=True).stdout.split())
        code = "no-manifest" if h is hosts[1] else "sha256-mismatch"
        # The invalid ones moved aside (kept); the new checkpoints survived pruning (keep_checkpoints 2).
        assert {f"step-000002.invalid-{code}", "step-000004.invalid-sha256-mismatch"} <= listing, listing
        assert {"step-000002", "step-000004"} <= listing, listing
    manifests = {testbed.exec(h, ["cat", f"{root[h.name]}/step-000004/manifest.sha256"], check=True).stdout
                 for h in hosts}
    assert len(manifests) == 1
    evs = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    assert [e["resumed_from"] for e in evs if e.get("event") == "started"][-2:] == [None, None]
    assert len([e for e in evs if e.get("event") == "checkpoint_invalid"]) == 4


def test_coordinator_killed_then_attach_resumes_monitoring(testbed: TestBed, run_cli: RunCli, tmp_path: Path,
                                                          jobs: list[Job]) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=60))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    run_id = job.run_dir().name
    os.killpg(job.proc.pid, signal.SIGKILL)  # the coordinator (and only it: mlx.launch has its own session)
    job.proc.wait()
    steps_before = max(e["step"] for e in job.events() if e.get("event") == "step")
    proc = run_cli("attach", run_id, "--run-dir", str(tmp_path / "runs"), "--json",
                   env={"XDG_STATE_HOME": str(tmp_path / "state")}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    validate_output("launch", summary)  # attach prints the same summary as launch
    assert summary["state"] == "succeeded" and summary["steps"] == 60
    assert steps_before < 60
    no_rank_left(run_id)


def test_after_a_kill_9_of_the_coordinator_a_launch_refuses_its_orphans_and_stop_ends_them_with_their_steps(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path, jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    # Both ranks paced (PACE): the orphans only have to live through a refused launch and a stop.
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=400), *PACE)
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    run_id = job.run_dir().name
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    # The orphaned ranks are found: a new launch on the same nodes refuses, naming the run and what to do.
    other = run_cli("launch", "-i", str(inv), str(write_playbook(tmp_path / "short.yaml", iters=2)), "--json",
                    "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-3000:]
    assert run_id in other.stderr and f"coordinator attach {run_id}" in other.stderr
    assert f"coordinator stop {run_id}" in other.stderr and "Traceback" not in other.stderr
    docs, _ = read_event_docs(tmp_path / "runs" / run_id / "events.jsonl")  # job.run_dir() is the refused one's
    steps_before = max(e["step"] for e in docs if e.get("event") == "step")
    proc = run_cli("stop", run_id, "--run-dir", str(tmp_path / "runs"), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert summary["state"] == "stopped"
    # The steps are what the nodes prove (events, checkpoints), never 0 for a run that trained.
    assert summary["steps"] >= steps_before >= 3, summary
    assert f"stopped run {run_id} at step {summary['steps']}" in proc.stdout
    no_rank_left(run_id)
    for h in hosts:
        assert testbed.exec(h, ["sh", "-c", f"ls -d /tmp/mlxc-{run_id}-* 2>/dev/null || true"]).stdout.strip() == ""


@pytest.mark.parametrize(("spec", "kind", "victim"), [
    ("nan:rank=2,step=5", "nan", 2),
    ("diverge:rank=2,step=5", "inconsistent", 2),
    ("lie:rank=1,step=5", "implausible_progress", 1),
])
def test_chaos_byzantine_faults_are_attributed_and_survived(testbed: TestBed, run_cli: RunCli, tmp_path: Path,
                                                            spec: str, kind: str, victim: int) -> None:
    hosts, inv = setup(testbed, tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = run_cli("launch", "-i", str(inv), str(write_playbook(tmp_path / "pb.yaml")), "--json", "--run-dir",
                   str(tmp_path / "runs"), "--chaos", spec, env=env, timeout=400)
    summary = json.loads(proc.stdout)
    incident = culprit_incident(summary, kind)
    assert incident["node"] == hosts[victim].name and incident["rank"] == victim
    assert_finished_on_survivors(summary, hosts[victim].name)
    assert proc.returncode == 0
    if kind == "inconsistent":
        # Checkpoints after the last step every replica agreed on were set aside, not deleted.
        run_id = summary["run_id"]
        listing = testbed.exec(hosts[0], ["ls", f"/srv/work/runs/{run_id}/{hosts[0].name}/checkpoints"]).stdout
        assert "set-aside-step-" in listing


def test_chaos_slow_rank_is_a_straggler_warning_not_a_restart(testbed: TestBed, run_cli: RunCli,
                                                             tmp_path: Path) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    # The window is a step count here (straggler_min_s 0): how many seconds 30 tiny steps take depends on the
    # machine, and the default 5 s minimum is not what this test is about.
    faults = {"consistency_every": 5, "max_restarts": 2, "min_nodes": 1, "straggler_min_s": 0}
    # dp forced: under auto a calibrated plan on these two hosts (one machine's two cores) may rightly be "solo".
    train = {"method": "lora", "iters": 30, "batch_size": 6, "learning_rate": 1e-3, "max_seq_length": 64,
             "save_every": 2, "steps_per_eval": 100, "val_batches": 1, "strategy": "dp"}
    pb = write_playbook(tmp_path / "pb.yaml", split="calibrated", train=train,
                        calibration={"time_budget": 30, "max_batch": 8}, faults=faults)
    # A straggler is slow against its calibrated rate (relative to the fleet's), so a calibration disturbed by the
    # suite's other worker hides as much of the slowdown as it measured: once h2's batch-1 point came out 8.7x
    # below h1's (its batch 2 only 2.4x), the split gave h2 one row, and under an 8x slowdown h2 ran at 0.81 of
    # that calibrated rate, h1 at 0.80 of its own: no straggler. 20x stays below the fleet's 0.5 bound for a
    # calibration off by up to ~10x.
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp_path / "runs"),
                   "--chaos", "slow:rank=1,step=1,factor=20", env=env, timeout=400)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["state"] == "succeeded" and summary["attempts"] == 1 and summary["steps"] == 30
    stragglers = [i for i in summary["incidents"] if i["kind"] == "straggler"]
    assert [(i["node"], i["action"]) for i in stragglers] == [(hosts[1].name, "warn")]


def stalled_run(testbed: TestBed, run_cli: RunCli, tmp: Path, *, iters: int, chaos: tuple[str, ...],
                faults: dict[str, object]) -> list[dict[str, Any]]:
    """A 2-node run with `chaos` (stalls) and `faults`: it must be stopped by `stall` incidents (no culprit) and
    finish on the same two nodes in a second attempt. Returns the stall incidents."""
    hosts, inv = setup(testbed, tmp, 2)
    env = {"XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}
    pb = write_playbook(tmp / "pb.yaml", iters=iters, faults={"consistency_every": 5, "min_nodes": 1, **faults})
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(tmp / "runs"),
                   *(arg for one in chaos for arg in ("--chaos", one)), env=env, timeout=400)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stalls = [i for i in summary["incidents"] if i["kind"] == "stall"]
    assert stalls and {i["action"] for i in stalls} == {"stop"}, json.dumps(summary["incidents"], indent=1)[:3000]
    # No culprit: the same two nodes carry on from the last checkpoint (or the start) and finish.
    assert summary["state"] == "succeeded" and summary["attempts"] == 2 and summary["steps"] == iters
    assert summary["quarantined"] == [] and sorted(n["node"] for n in summary["nodes"]) == sorted(h.name for h in hosts)
    no_rank_left(summary["run_id"])
    return stalls


def test_chaos_stall_is_detected_and_the_run_relaunches_on_the_same_nodes(testbed: TestBed, run_cli: RunCli,
                                                                           tmp_path: Path) -> None:
    # A rank that stays alive and heartbeating but never ends step 6 (as every rank of a ring whose data-plane
    # link went down while SSH still works): no heartbeat is missed, so only the stall rule can see it.
    stalls = stalled_run(testbed, run_cli, tmp_path, iters=12, chaos=("stall:rank=1,step=6",),
                         faults={"max_restarts": 2, "stall_min_s": 4, "stall_factor": 10})
    assert {i["rank"] for i in stalls} <= {0, 1} and all(i["step"] == 5 for i in stalls)
    assert all(i["detected_after_s"] >= i["evidence"]["window_s"] >= 4 for i in stalls)


def test_a_first_step_that_never_ends_is_a_stall_after_first_step_s(testbed: TestBed, run_cli: RunCli,
                                                                    tmp_path: Path) -> None:
    # The same stall on step 1: no step has ended, so the stall window has nothing to measure by and only
    # faults.first_step_s bounds the attempt (before it, such a ring waited forever, heartbeats on time). Both
    # ranks stall (a ring that never forms: nobody reaches the all_sum), so neither spins a core in it for 40 s.
    stalls = stalled_run(testbed, run_cli, tmp_path, iters=3, chaos=("stall:rank=0,step=1", "stall:rank=1,step=1"),
                         faults={"max_restarts": 1, "first_step_s": 40})
    assert sorted(i["rank"] for i in stalls) == [0, 1]
    assert all(i["evidence"]["no_first_step_for_s"] > i["evidence"]["first_step_s"] == 40 for i in stalls)


def test_a_data_error_on_every_rank_is_a_job_error_and_preflight_names_it(testbed: TestBed, run_cli: RunCli,
                                                                          tmp_path: Path) -> None:
    """An undecodable line fails every rank the same way: launched anyway (--skip-preflight) the run stops as
    one job error with its remedy and quarantines nobody; preflight fails it (and a data dir without train.jsonl,
    and a model dir without weights) before launch, with file:line."""
    hosts, inv = setup(testbed, tmp_path, 2, assets=False)  # the model is built from this test's own data
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    rows = [f'{{"text": "row {i} of the data"}}\\n' for i in range(8)]  # printf's escapes: \n, \351 = 0xe9
    bad = "".join([*rows[:2], '{"text": "caf\\351"}\\n', *rows[2:]])  # line 3 is Latin-1, not UTF-8
    good = "".join(rows)
    pb = write_playbook(tmp_path / "pb.yaml", iters=4, data="/srv/bad",
                        assets={"tiny_model": {"layers": 2, "hidden": 32, "seed": 0}})
    for h in hosts:
        testbed.exec(h, ["sh", "-c", f"mkdir -p /srv/bad && printf '{good}' > /srv/bad/train.jsonl && "
                                     f"printf '{rows[0]}' > /srv/bad/valid.jsonl"], check=True)
    # The tiny model's vocabulary is built from the data: provision it from good rows (a fixed split: no bench).
    ready = run_cli("calibrate", "-i", str(inv), "-p", str(pb), "--json", env=env, timeout=300)
    assert ready.returncode == 0, ready.stderr[-3000:]
    validate_output("calibrate", json.loads(ready.stdout))  # docs/json.md's schema, unknown keys refused
    for h in hosts:
        testbed.exec(h, ["sh", "-c", f"printf '{bad}' > /srv/bad/train.jsonl"], check=True)
    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(tmp_path / "runs"), "--skip-preflight",
                   env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run] = list((tmp_path / "runs").iterdir())
    assert (run / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    written = (run / "summary.json").read_bytes()
    files = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    # `stop` on a run that ended says so and rewrites nothing: the job error's message, cause and remedy stay.
    stopped = run_cli("stop", run.name, "--run-dir", str(tmp_path / "runs"), env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stdout.strip().splitlines() == [f"run {run.name} already ended: failed at step 0"], stopped.stdout
    assert (run / "summary.json").read_bytes() == written
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == files
    summary = json.loads((run / "summary.json").read_text())
    [job] = [i for i in summary["incidents"] if i["kind"] == "job_error"]
    assert job["action"] == "stop" and job["evidence"]["code"] == "data_not_utf8", json.dumps(job, indent=1)
    assert job["evidence"]["message"].startswith("UnicodeDecodeError")
    assert summary["state"] == "failed" and summary["message"].startswith("job error")
    assert summary["quarantined"] == [] and not [i for i in summary["incidents"] if i["action"] == "quarantine"]
    state = tmp_path / "state" / "mlx-coordinator" / "quarantine.json"
    assert not state.exists() or json.loads(state.read_text()).get("entries", []) == []
    assert (proc.stdout + proc.stderr).count("can't decode byte") == 1, proc.stdout[-3000:]
    assert "remedy: fix or remove the line" in proc.stdout

    def model_check(expect: str) -> None:
        report = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", env=env)
        assert report.returncode == 1, report.stdout[-2000:] + report.stderr[-2000:]
        for node in json.loads(report.stdout)["nodes"]:
            [model] = [c for c in node["checks"] if c["id"] == "model"]
            assert model["status"] == "fail" and expect in model["summary"], model

    model_check("/srv/bad/train.jsonl line 3: not UTF-8 (byte 0xe9")
    for h in hosts:
        testbed.exec(h, ["rm", "/srv/bad/train.jsonl"], check=True)
    model_check("/srv/bad/train.jsonl is missing (the trainer needs it)")
    for h in hosts:
        testbed.exec(h, ["sh", "-c", f"printf '{good}' > /srv/bad/train.jsonl && mv /srv/model/model.safetensors "
                                     "/srv/model.safetensors.away"], check=True)
    model_check("model /srv/model: no *.safetensors weights")
    proc = run_cli("launch", "-i", str(inv), str(pb), "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert proc.returncode == 1 and "preflight failed" in proc.stderr, proc.stderr[-3000:]


def test_a_ring_that_cannot_connect_at_start_up_is_relaunched_without_quarantine(testbed: TestBed, tmp_path: Path,
                                                                                jobs: list[Job]) -> None:
    """Rank 0 frozen before it listens (a peer slow to start on a loaded machine): rank 1, which connects first
    in a ring of two, gives up with `[ring] Couldn't connect (error: 111)`. That names no fault of rank 1's node:
    the attempt is relaunched on the same nodes and nobody is quarantined."""
    hosts, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=6))
    jobs.append(job)
    run_dir = job.wait_for(lambda _: job.run_dir() if job.run_dir().exists() else None)
    rank0 = f"worker.train --config /srv/work/runs/{run_dir.name}/{hosts[0].name}/run.json"  # type: ignore[union-attr]
    deadline = time.monotonic() + 240
    # No rank runs before mlx.launch does, whose argv is written just before it starts: until then a look at a
    # file, not a pgrep on the node (tens of them a second through provisioning, preflight and calibration).
    while not (run_dir / "launcher.argv").exists():  # type: ignore[operator]
        assert time.monotonic() < deadline and job.proc.poll() is None, "mlx.launch never started"
        time.sleep(0.02)
    while not (pids := testbed.exec(hosts[0], ["pgrep", "-f", rank0]).stdout.split()):
        assert time.monotonic() < deadline and job.proc.poll() is None, "rank 0 never started"
        time.sleep(0.02)
    testbed.exec(hosts[0], ["kill", "-STOP", *pids], check=True)  # the first attempt's only: a relaunch runs free
    rc, summary = job.finish(timeout=400)
    refused = [i for i in summary["incidents"] if i["kind"] == "error" and "Couldn't connect" in
               i["evidence"].get("message", "")]
    assert refused and refused[0]["node"] == hosts[1].name, json.dumps(summary["incidents"], indent=1)[:4000]
    assert refused[0]["action"] == "stop" and refused[0]["evidence"]["explanation"]["code"] == "ring_connect"
    assert summary["quarantined"] == [] and not [i for i in summary["incidents"] if i["action"] == "quarantine"]
    state = tmp_path / "state" / "mlx-coordinator" / "quarantine.json"
    assert not state.exists() or json.loads(state.read_text())["entries"] == []
    assert summary["state"] == "succeeded" and summary["steps"] == 6 and summary["attempts"] == 2, summary["message"]
    assert sorted(n["node"] for n in summary["nodes"]) == sorted(h.name for h in hosts)
    assert rc == 0
    no_rank_left(summary["run_id"])
