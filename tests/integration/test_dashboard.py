"""The web dashboard against a real local run (two `connection: local` nodes, the smoke model): a real headless
Chromium loads every page while `coordinator launch --dashboard` trains, and sees the nodes, a loss curve with
points and an update pushed by the server; then `coordinator dashboard` replays the finished run from its files.
Only 127.0.0.1 is used. Set DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the docs' screenshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_metrics import cli, free_port, stop, tail
from tests.testbed import REPO
from tests.webdriver import Browser, browser_problems

ITERS = 240
# The tiny model steps in ~20 ms: each rank sleeps 14x its compute time per step (chaos `slow`) so that the run
# lasts about a minute, long enough to watch it live. Both ranks, not one: MLX's ring all_sum busy-waits, so a peer
# of a lone slowed rank spun a whole core for the run's minute (3.5 s of CPU per 5 s waited, measured), taken from
# the suite's other worker.
PACE = ("--chaos", "slow:rank=0,factor=15", "--chaos", "slow:rank=1,factor=15")


@dataclass
class LiveRun:
    tmp: Path
    inv: Path
    runs: Path
    port: int
    token: str
    proc: subprocess.Popen[bytes]
    env: dict[str, str]


def fetch(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
          token: str | None = None) -> tuple[int, Any]:
    """(status, the JSON answer); `token` as the X-Dashboard-Token header (every request needs it, loopback too)."""
    req = urllib.request.Request(url, method=method, headers={**({"X-Dashboard-Token": token} if token else {}),
                                                              **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_url(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> str:
    """The dashboard URL the CLI printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/\?token=\S+)", path.read_text(errors="replace")
                      if path.exists() else "")
        if m:
            return m[1]
        assert proc.poll() is None, tail(log)
        time.sleep(0.2)
    raise AssertionError(f"no dashboard URL printed\n{tail(log)}")


def write_run_files(tmp: Path, iters: int) -> tuple[Path, Path]:
    """A two-node local inventory and a paced smoke playbook under `tmp`."""
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"connection": "local"}, "nodes": [
        {"name": "local-a", "workdir": str(tmp / "a")}, {"name": "local-b", "workdir": str(tmp / "b")}]}))
    pb = tmp / "pb.yaml"
    pb.write_text(yaml.safe_dump({
        "name": "dash", "kind": "train", "model": str(tmp / "model"), "data": str(tmp / "data"), "backend": "ring",
        "assets": {"data_from": str(REPO / "playbooks" / "data" / "smoke"),
                   "tiny_model": {"layers": 2, "hidden": 32, "seed": 0}},
        "train": {"method": "lora", "iters": iters, "batch_size": 4, "learning_rate": 1e-3, "max_seq_length": 64,
                  "save_every": 40, "steps_per_eval": 10, "val_batches": 1},
        "split": "equal", "heartbeat_timeout": 30}, sort_keys=False))
    return inv, pb


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    problems = browser_problems()
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    tmp = tmp_path_factory.mktemp("dashboard")
    inv, pb = write_run_files(tmp, ITERS)
    runs = tmp / "runs"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "250", "TERM": "dumb", "XDG_CACHE_HOME": str(tmp / "cache"),
           "XDG_STATE_HOME": str(tmp / "state")}
    port = free_port()
    proc = cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(runs), "--dashboard", "--dashboard-port",
               str(port), "--keep-dashboard", *PACE, env=env, out=tmp / "launch.json",
               err=tmp / "launch.log")
    try:
        url = wait_url(tmp / "launch.log", proc, tmp / "launch.log")
        yield LiveRun(tmp, inv, runs, port, url.split("token=", 1)[1], proc, env)
    finally:
        stop(proc, timeout=60)


def finish(live_run: LiveRun) -> int | None:
    """The run ends and, with --keep-dashboard, its page stays up (said on screen) until Ctrl-C; then the launch
    exits with the run's code. Returns that code."""
    if live_run.proc.poll() is not None:
        return live_run.proc.returncode
    log = live_run.tmp / "launch.log"
    deadline = time.monotonic() + 600
    while "the dashboard stays up at http://127.0.0.1:" not in log.read_text(errors="replace"):
        assert live_run.proc.poll() is None, tail(log)
        assert time.monotonic() < deadline, f"the run did not end within 600 s\n{tail(log)}"
        time.sleep(0.5)
    [run_dir] = [p for p in live_run.runs.iterdir() if (p / "meta.json").exists()]
    assert (run_dir / "summary.json").exists()
    time.sleep(3)  # well after the run: the page is still served
    status, doc = fetch(f"http://127.0.0.1:{live_run.port}/api/run/{run_dir.name}", token=live_run.token)
    assert status == 200 and doc["state"] == "succeeded" and not doc["active"], doc
    assert live_run.proc.poll() is None
    rc = stop(live_run.proc, signal.SIGINT, timeout=60)
    assert "dashboard stopped" in log.read_text(errors="replace"), tail(log)
    return rc


def test_browser_sees_nodes_a_loss_curve_and_live_updates(live_run: LiveRun) -> None:
    base = f"http://127.0.0.1:{live_run.port}"
    log = live_run.tmp / "launch.log"
    run_id = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not run_id:  # a step written: the run page has a curve to draw
        assert live_run.proc.poll() is None, tail(log)
        # the dashboard is up before the job starts: it printed its URL
        _, doc = fetch(f"{base}/api/runs", token=live_run.token)
        run_id = next((r["run_id"] for r in doc["runs"] if r["active"] and r["step"] >= 2), "")
        time.sleep(0.5)
    assert run_id, f"no step within 300 s\n{tail(log)}"
    with Browser() as browser:
        browser.get(f"{base}/?token={live_run.token}")
        nodes = browser.wait_for("const r = [...document.querySelectorAll('#fleet-table tr[data-node]')];"
                                 "return r.length === 2 && r.every(x => x.innerText.includes('yes')) && "
                                 "r.map(x => x.dataset.node)", what="both nodes, reachable")
        assert sorted(nodes) == ["local-a", "local-b"]

        browser.get(f"{base}/runs")
        runs = browser.wait_for("return [...document.querySelectorAll('#runs-table tr[data-run]')]"
                                ".map(x => x.dataset.run)", what="the runs table")
        assert run_id in runs

        browser.get(f"{base}/run/{run_id}")
        points = browser.wait_for("return window.dash.lossPoints > 0 && document.querySelector('#chart canvas') "
                                  "&& window.dash.plot.data[1].filter(v => v != null).length", what="loss points")
        assert points >= 1
        assert browser.js("return window.dash.watching") == run_id  # its stream names the run: the server tails it
        ranks = browser.js("return [...document.querySelectorAll('#ranks tr[data-rank]')].map(r => r.innerText)")
        assert len(ranks) == 2 and all("local-" in r for r in ranks), ranks
        # An update arrives by push: the curve grows without a reload.
        before = browser.js("return [window.dash.updates, window.dash.lossPoints]")
        browser.wait_for(f"return window.dash.updates > {before[0]} && window.dash.lossPoints > {before[1]}",
                         what="a pushed update with new loss points")
        assert browser.js("return document.querySelector('#live').innerText") == "live"
        verdicts = browser.js("return [...document.querySelectorAll('#ranks tr[data-rank] td:nth-child(3)')]"
                              ".map(c => c.innerText)")
        assert all(v in ("ok", "slow") for v in verdicts), verdicts  # the monitor's words (pacing may be slow)
        if os.environ.get("DASHBOARD_SCREENSHOT"):  # for the docs: a longer curve, past an eval or two
            browser.wait_for("return window.dash.run.val_loss.length >= 3", what="three evals")
        shot = live_run.tmp / "dashboard.png"
        browser.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            shutil.copyfile(shot, REPO / os.environ["DASHBOARD_SCREENSHOT"])
    rc = finish(live_run)
    summary = json.loads((live_run.tmp / "launch.json").read_text())
    assert rc == 0 and summary["state"] == "succeeded", tail(log)


def test_a_finished_run_replays_from_its_files(live_run: LiveRun) -> None:
    assert finish(live_run) == 0  # run alone: let the run end first
    [run_dir] = [p for p in live_run.runs.iterdir() if (p / "meta.json").exists()]
    port = free_port()
    out, err = live_run.tmp / "dash.out", live_run.tmp / "dash.log"
    proc = cli("dashboard", "-i", str(live_run.inv), "--run-dir", str(live_run.runs), "--port", str(port),
               env=live_run.env, out=out, err=err)
    try:
        url = wait_url(err, proc, err)
        token = url.split("token=", 1)[1]
        base = f"http://127.0.0.1:{port}"
        # Loopback too: nothing without the token (any local user could read the runs, and grow what it keeps).
        assert fetch(f"{base}/api/run/{run_dir.name}")[0] == 403
        assert fetch(f"{base}/api/runs", token="wrong")[0] == 403
        status, doc = fetch(f"{base}/api/run/{run_dir.name}", token=token)
        assert status == 200, doc
        assert doc["state"] == "succeeded" and not doc["active"] and doc["step"] == ITERS and doc["iters"] == ITERS
        assert [p[0] for p in doc["loss"]] == list(range(1, ITERS + 1))
        assert [p[0] for p in doc["val_loss"]] == list(range(10, ITERS + 1, 10))
        assert {r["node"]: r["state"] for r in doc["ranks"]} == {"local-a": "finished", "local-b": "finished"}
        # One truth: the run JSON's per-rank rates and verdicts and its prediction are the summary's.
        summary = json.loads((live_run.tmp / "launch.json").read_text())
        assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in doc["ranks"]} == {
            n["node"]: (n["tokens_per_s"], n["verdict"]) for n in summary["nodes"]}
        assert all(r["verdict"] in ("ok", "slow") and r["tokens_per_s"] for r in doc["ranks"]), doc["ranks"]
        assert doc["predicted_tokens_per_s"] == pytest.approx(summary["predicted_tokens_per_s"], abs=0.06)
        assert doc["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], abs=0.06)
        assert all(r["step_time_s"]["min"] <= r["step_time_s"]["median"] <= r["step_time_s"]["max"]
                   for r in doc["ranks"])
        assert doc["checkpoints"] and doc["checkpoints"][-1]["step"] == ITERS
        assert doc["split"] == {"local-a": 0.5, "local-b": 0.5}
        assert {i["kind"] for i in doc["incidents"]} <= {"straggler"}  # the pacing may be reported, nothing else
        _, runs = fetch(f"{base}/api/runs", token=token)
        assert [(r["run_id"], r["state"]) for r in runs["runs"]] == [(run_dir.name, "succeeded")]
        status, fleet = fetch(f"{base}/api/fleet", token=token)
        assert status == 200 and [n["node"] for n in fleet["nodes"]] == ["local-a", "local-b"]
        assert fetch(f"{base}/api/run/nope", token=token)[0] == 404
        # stopping needs the token; a finished run cannot be stopped
        assert fetch(f"{base}/api/run/{run_dir.name}/stop", method="POST")[0] == 403
        assert fetch(f"{base}/api/run/{run_dir.name}/stop", method="POST",
                     headers={"X-Dashboard-Token": token})[0] == 409
        with urllib.request.urlopen(f"{base}/run/{run_dir.name}?token={token}", timeout=10) as resp:
            assert b"uPlot.iife.min.js" in resp.read()
            assert resp.headers["Set-Cookie"] == f"dashboard-token-{port}={token}; Path=/; HttpOnly; SameSite=Strict"
        assert stop(proc, signal.SIGINT) == 0, tail(err)
    finally:
        stop(proc)


def test_the_stop_button_stops_a_run_another_coordinator_launched(tmp_path: Path) -> None:
    problems = browser_problems()
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    inv, pb = write_run_files(tmp_path, 5000)
    runs = tmp_path / "runs"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "250", "TERM": "dumb", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_STATE_HOME": str(tmp_path / "state")}
    job = cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(runs), *PACE, env=env,
              out=tmp_path / "launch.json", err=tmp_path / "launch.log")
    port = free_port()
    dash = cli("dashboard", "-i", str(inv), "--run-dir", str(runs), "--port", str(port), env=env,
               out=tmp_path / "dash.out", err=tmp_path / "dash.log")
    try:
        url = wait_url(tmp_path / "dash.log", dash, tmp_path / "dash.log")
        base = f"http://127.0.0.1:{port}"
        run_id = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not run_id:
            assert job.poll() is None, tail(tmp_path / "launch.log")
            _, doc = fetch(f"{base}/api/runs", token=url.split("token=", 1)[1])
            run_id = next((r["run_id"] for r in doc["runs"] if r["active"] and r["step"] >= 2), "")
            time.sleep(0.5)
        assert run_id, tail(tmp_path / "launch.log")
        with Browser() as browser:
            browser.get(url)  # the token comes with the URL and is kept for the session's pages
            browser.get(f"{base}/run/{run_id}")
            browser.wait_for("return window.dash.run && document.querySelector('#stop')", what="the stop button")
            browser.click("#stop")
            browser.accept_alert()
            browser.wait_for("return document.querySelector('#run-state').innerText === 'stopped'",
                             what="the run shown stopped", timeout=120)
        summary = json.loads((runs / run_id / "summary.json").read_text())
        assert summary["state"] == "stopped" and summary["steps"] < 5000, summary
        # The launching coordinator ends too (what it then reports is `coordinator stop`'s business, tested there).
        job.wait(timeout=120)
    finally:
        stop(dash)
        stop(job, timeout=60)
