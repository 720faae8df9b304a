"""The Prometheus endpoint of `coordinator monitor --metrics-port`, scraped while a real job trains on two bed
hosts. Only 127.0.0.1 (the endpoint) and the bed's addresses are used."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.integration.test_launch import write_playbook
from tests.testbed import REPO, TestBed

SAMPLE = re.compile(r'^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` in the exposition text: (labels, value)."""
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            out.append((labels, float(m["value"])))
    return out


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body: bytes = resp.read()
            return body.decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def cli(*args: str, env: dict[str, str], out: Path, err: Path) -> subprocess.Popen[bytes]:
    """The real CLI in the background, in its own session (so a stuck one can be killed as a group)."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "coordinator", *args], cwd=REPO, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, timeout: float = 30.0) -> int | None:
    """Signal `proc` (our child) and wait; kill its process group if it does not exit. Returns its exit code
    after `sig`, or None when it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return None


def test_metrics_endpoint_shows_per_rank_progress_of_a_running_job(testbed: TestBed, tmp_path: Path) -> None:
    hosts = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    pb = write_playbook(tmp_path / "pb.yaml", iters=60, name="metrics", split="equal")
    runs = tmp_path / "runs"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_STATE_HOME": str(tmp_path / "state")}
    port = free_port()
    job = cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(runs), env=env,
              out=tmp_path / "launch.json", err=tmp_path / "launch.log")
    mon = cli("monitor", "-i", str(inv), "--run-dir", str(runs), "--metrics-port", str(port), "--interval", "1",
              "--connect-timeout", "20", env=env, out=tmp_path / "monitor.out", err=tmp_path / "monitor.log")
    text: str | None = None
    progress: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert mon.poll() is None, tail(tmp_path / "monitor.log")
            if job.poll() is not None:
                break
            text = scrape(port)
            if text:
                progress = {labels["rank"]: value for labels, value in samples(text, "mlxc_rank_step")}
                if len(progress) == 2 and all(v > 0 for v in progress.values()):
                    break
            time.sleep(1)
        assert len(progress) == 2 and all(v > 0 for v in progress.values()), (
            f"no per-rank progress in the metrics: {progress}\n--- last scrape\n{text}\n--- launch\n"
            f"{tail(tmp_path / 'launch.log')}\n--- monitor\n{tail(tmp_path / 'monitor.log')}")
        assert text is not None
        [(run_labels, _)] = samples(text, "mlxc_run_active")
        run_id = run_labels["run_id"]
        ranks = samples(text, "mlxc_rank_step")
        assert {(lab["run_id"], lab["rank"], lab["node"]) for lab, _ in ranks} == {
            (run_id, "0", hosts[0].name), (run_id, "1", hosts[1].name)}
        assert {lab["node"]: v for lab, v in samples(text, "mlxc_node_up")} == {h.name: 1.0 for h in hosts}
        assert {lab["node"]: v for lab, v in samples(text, "mlxc_node_quarantined")} == {h.name: 0.0 for h in hosts}
        assert all(v > 0 for _, v in samples(text, "mlxc_node_memory_used_bytes"))
        assert len(samples(text, "mlxc_rank_tokens_per_second")) == 2
        assert len(samples(text, "mlxc_rank_loss")) == 2
        assert all(0 <= v < 30 for _, v in samples(text, "mlxc_rank_last_heartbeat_age_seconds"))
        assert samples(text, "mlxc_run_step") and samples(text, "mlxc_run_step")[0][1] >= 0
        assert "# TYPE mlxc_run_incidents_total counter" in text or "# TYPE mlxc_run_incidents counter" in text

        # Ctrl-C stops the monitor cleanly: exit 0 and the port is released.
        assert stop(mon) == 0, tail(tmp_path / "monitor.log")
        assert scrape(port) is None
        # Let the job finish (it proves the monitor's probes did not disturb it).
        rc = job.wait(timeout=300)
        summary = json.loads((tmp_path / "launch.json").read_text())
        assert rc == 0 and summary["state"] == "succeeded" and summary["steps"] == 60, summary
    finally:
        stop(mon)
        stop(job, timeout=60)

