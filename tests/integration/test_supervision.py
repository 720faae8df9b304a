"""One supervisor per run, and what signals do (docs/faults.md, "One supervisor per run" and "Signals"): the
real CLI against a live coordinator on network-namespace hosts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.run.supervision import request_stop
from tests.integration.conftest import RunCli
from tests.integration.test_faults import (
    REPO,
    Job,
    assert_finished_on_survivors,
    culprit_incident,
    jobs,
    no_rank_left,
    setup,
    write_playbook,
)
from tests.testbed import TestBed

__all__ = ["jobs"]  # the fixture, shared with test_faults


def state_env(tmp: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}


def assert_nothing_quarantined(summary: dict, tmp: Path) -> None:
    assert summary["quarantined"] == [], json.dumps(summary["incidents"], indent=1)[:3000]
    assert not [i for i in summary["incidents"] if i["action"] == "quarantine"]
    store = tmp / "state" / "mlx-coordinator" / "quarantine.json"
    assert not store.exists() or json.loads(store.read_text())["entries"] == []


def test_stop_asks_the_live_coordinator_which_stops_the_run_and_quarantines_nothing(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path, jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=400))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    run_id = job.run_dir().name
    proc = run_cli("stop", run_id, "--run-dir", str(tmp_path / "runs"), env=state_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"stopped run {run_id}" in proc.stdout
    rc, summary = job.finish()
    assert rc == 1  # the launch did not finish its training
    assert summary["state"] == "stopped" and summary["attempts"] == 1
    assert "coordinator stop" in summary["message"]
    assert_nothing_quarantined(summary, tmp_path)
    assert json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())["state"] == "stopped"
    no_rank_left(run_id)
    for h in hosts:
        assert testbed.exec(h, ["sh", "-c", f"ls -d /tmp/mlxc-{run_id}-* 2>/dev/null || true"]).stdout.strip() == ""
    assert not (tmp_path / "runs" / run_id / "lock").exists()


def test_attach_while_the_coordinator_lives_is_refused_without_harm(testbed: TestBed, run_cli: RunCli,
                                                                     tmp_path: Path, jobs: list[Job]) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=30))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    run_id = job.run_dir().name
    proc = run_cli("attach", run_id, "--run-dir", str(tmp_path / "runs"), env=state_env(tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"pid {job.proc.pid}" in proc.stderr and "supervised by" in proc.stderr
    rc, summary = job.finish()
    assert rc == 0 and summary["state"] == "succeeded" and summary["steps"] == 30 and summary["attempts"] == 1
    assert_nothing_quarantined(summary, tmp_path)


def test_a_killed_follower_is_reconnected_and_the_run_finishes_with_nothing_quarantined(
        testbed: TestBed, tmp_path: Path, jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=30))
    jobs.append(job)
    job.rank_pid_at_step(1, 3)
    run_id = job.run_dir().name
    # Only h2's follower (the rank and the node are healthy): its command line names h2's run dir.
    killed = subprocess.run(["pkill", "-KILL", "-f", f"worker.follow --run-dir /srv/work/runs/{run_id}/{hosts[1].name}"],
                            capture_output=True, text=True)
    assert killed.returncode == 0, "no follower found to kill"
    rc, summary = job.finish()
    assert rc == 0 and summary["state"] == "succeeded", json.dumps(summary, indent=1)[:3000]
    assert summary["steps"] == 30 and summary["attempts"] == 1
    assert all(node["step"] == 30 for node in summary["nodes"])
    assert_nothing_quarantined(summary, tmp_path)
    restarts = [e for e in job.events() if e.get("event") == "supervisor" and e.get("what") == "follower_restarted"]
    assert [e["node"] for e in restarts] == [hosts[1].name]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_sigint_stops_the_run_writes_the_summary_and_exits_128_plus_the_signal(
        testbed: TestBed, tmp_path: Path, jobs: list[Job], signum: signal.Signals, code: int) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=400))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    # ... and the coordinator has heard rank 1 at step 2 too: each node's events arrive over its own follower, and
    # a step of this tiny model takes milliseconds, so rank 0's step 3 can be in before rank 1's first step is.
    job.rank_pid_at_step(1, 2)
    run_id = job.run_dir().name
    os.kill(job.proc.pid, signum)  # the coordinator alone, as systemd, `kill` or Ctrl-C would
    rc, summary = job.finish(timeout=120)
    assert rc == code
    assert summary["state"] == "stopped" and signum.name in summary["message"]
    assert_nothing_quarantined(summary, tmp_path)
    written = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert written["state"] == "stopped" and written["steps"] >= 2  # the slowest rank: one behind rank 0 at most
    no_rank_left(run_id)


def test_a_second_resume_of_a_supervised_run_and_a_launch_on_its_nodes_are_refused(
        testbed: TestBed, run_cli: RunCli, tmp_path: Path, jobs: list[Job]) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    env = state_env(tmp_path)
    first = run_cli("launch", "-i", str(inv), str(write_playbook(tmp_path / "pb.yaml", iters=2)), "--json",
                    "--run-dir", str(tmp_path / "runs"), env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = json.loads(first.stdout)["run_id"]
    longer = write_playbook(tmp_path / "longer.yaml", iters=400)
    job = Job(tmp_path, inv, longer, "--resume", run_id)
    jobs.append(job)
    job.rank_pid_at_step(0, 4)  # the resumed attempt is running
    again = run_cli("launch", "-i", str(inv), str(longer), "--json", "--run-dir", str(tmp_path / "runs"),
                    "--resume", run_id, env=env, timeout=60)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr and f"run {run_id} is supervised by" in again.stderr
    other = run_cli("launch", "-i", str(inv), str(longer), "--json", "--run-dir", str(tmp_path / "runs"),
                    env=env, timeout=60)
    assert other.returncode == 2, other.stderr[-3000:]
    assert "in use by another live run" in other.stderr and run_id in other.stderr
    os.kill(job.proc.pid, signal.SIGTERM)
    rc, summary = job.finish(timeout=120)
    assert rc == 143 and summary["state"] == "stopped"
    no_rank_left(run_id)


def test_after_attach_a_rank_crash_is_quarantined_and_relaunched_as_in_launch(testbed: TestBed, tmp_path: Path,
                                                                              jobs: list[Job]) -> None:
    hosts, inv = setup(testbed, tmp_path, 3)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml"))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    victim = job.rank_pid_at_step(1, 3)
    run_id = job.run_dir().name
    os.killpg(job.proc.pid, signal.SIGKILL)  # the coordinator dies; mlx.launch and the ranks go on
    job.proc.wait()
    # Rank 1 is held while attach starts, so the ring waits for it: the 40 steps of this tiny model once ended in
    # the ~8 s attach took to start on a loaded machine (CI20), and the kill then hit a rank that had finished.
    # attach watches no process state before it holds the run's lock, and the kill follows the lock at once, so
    # the stopped rank is never seen stopped (stopped_grace_s): what attach meets is a crash, as before.
    os.kill(victim, signal.SIGSTOP)
    # From here on the job's process is `attach` (Job's helpers watch whatever `proc` is).
    job.proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "attach", run_id, "--run-dir", str(job.runs), "--json"], cwd=REPO,
        env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lock = job.runs / run_id / "lock"
    job.wait_for(lambda _: lock.exists() and f'"pid": {job.proc.pid}' in lock.read_text())
    os.kill(victim, signal.SIGKILL)
    rc, summary = job.finish()
    crash = culprit_incident(summary, "crash")
    assert crash["node"] == hosts[1].name and crash["rank"] == 1
    assert_finished_on_survivors(summary, hosts[1].name)
    assert rc == 0
    # Quarantined as launch would: scoped to the run's inventory (which attach read from meta.json).
    [entry] = json.loads((tmp_path / "state" / "mlx-coordinator" / "quarantine.json").read_text())["entries"]
    assert (entry["node"], entry["inventory"]) == (hosts[1].name, str(inv.resolve()))
    no_rank_left(run_id)


def test_sighup_with_detach_on_hangup_leaves_the_run_to_attach(testbed: TestBed, run_cli: RunCli, tmp_path: Path,
                                                               jobs: list[Job]) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=40), "--detach-on-hangup")
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    run_id = job.run_dir().name
    os.kill(job.proc.pid, signal.SIGHUP)
    out, err = job.proc.communicate(timeout=60)
    assert job.proc.returncode == 129, err[-3000:]
    summary = json.loads(out)
    assert summary["state"] == "running" and f"coordinator attach {run_id}" in err
    assert not (tmp_path / "runs" / run_id / "summary.json").exists()
    assert not (tmp_path / "runs" / run_id / "lock").exists()
    assert any(e.get("what") == "detached" for e in job.events())
    proc = run_cli("attach", run_id, "--run-dir", str(tmp_path / "runs"), "--json", env=state_env(tmp_path),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attached = json.loads(proc.stdout)
    assert attached["state"] == "succeeded" and attached["steps"] == 40
    assert_nothing_quarantined(attached, tmp_path)
    no_rank_left(run_id)


def test_a_stop_racing_the_end_of_the_run_keeps_its_true_outcome(testbed: TestBed, tmp_path: Path,
                                                                  jobs: list[Job]) -> None:
    """The stop request is there when the coordinator looks, but every rank has already finished: the run
    succeeded (summary.json and the exit code), it was not stopped."""
    hosts, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=20))
    jobs.append(job)
    job.rank_pid_at_step(0, 2)
    run_dir = job.run_dir()
    os.kill(job.proc.pid, signal.SIGSTOP)  # the coordinator alone: mlx.launch and the ranks go on
    try:
        deadline = time.monotonic() + 120
        files = [(h, f"/srv/work/runs/{run_dir.name}/{h.name}/events/rank{r}.jsonl") for r, h in enumerate(hosts)]
        while not all('"event":"finished"' in testbed.exec(h, ["cat", f]).stdout for h, f in files):
            assert time.monotonic() < deadline, "the ranks did not finish"
            time.sleep(0.2)
        request_stop(run_dir)
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
    rc, summary = job.finish()
    assert summary["state"] == "succeeded" and summary["steps"] == 20, json.dumps(summary, indent=1)[:3000]
    assert rc == 0
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "succeeded"
    assert_nothing_quarantined(summary, tmp_path)
    no_rank_left(run_dir.name)


def test_sigterm_to_attach_records_the_steps_the_nodes_prove(testbed: TestBed, tmp_path: Path,
                                                              jobs: list[Job]) -> None:
    _, inv = setup(testbed, tmp_path, 2)
    job = Job(tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=400))
    jobs.append(job)
    job.rank_pid_at_step(0, 3)
    job.rank_pid_at_step(1, 3)
    run_id = job.run_dir().name
    os.killpg(job.proc.pid, signal.SIGKILL)  # the coordinator dies; mlx.launch and the ranks go on
    job.proc.wait()
    job.proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "attach", run_id, "--run-dir", str(job.runs), "--json"], cwd=REPO,
        env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lock = job.runs / run_id / "lock"
    job.wait_for(lambda _: lock.exists() and f'"pid": {job.proc.pid}' in lock.read_text())
    os.kill(job.proc.pid, signal.SIGTERM)  # before it has read the nodes' events again, most likely
    rc, summary = job.finish(timeout=120)
    assert rc == 143 and summary["state"] == "stopped", json.dumps(summary, indent=1)[:3000]
    written = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    proven = max(e["step"] for e in job.events() if e.get("event") == "step")
    assert written["steps"] >= proven >= 3, (written["steps"], proven)
    assert_nothing_quarantined(summary, tmp_path)
    no_rank_left(run_id)
