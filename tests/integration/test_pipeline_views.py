"""The views of a real pipeline run: two `connection: local` nodes (127.0.0.1 only), a tiny 4-layer model trained as
a 2-stage pipeline for a few steps. `status` (table and --json), `report` and the dashboard's run page, in a real
headless Chromium, show each rank's stage and layer range, its busy/wait shares, the measured bubble and its memory
against the plan, the same numbers as the run's summary.json (coordinator.run.stages, one source)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from coordinator.views.jsonout import validate_output
from coordinator.views.stagetable import pct
from tests.integration.conftest import RunCli
from tests.integration.test_dashboard import fetch, wait_url
from tests.integration.test_metrics import cli, free_port, stop, tail
from tests.testbed import REPO
from tests.webdriver import Browser, browser_problems

ITERS = 4


def write_files(tmp: Path) -> tuple[Path, Path]:
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"connection": "local"}, "nodes": [
        {"name": "local-a", "workdir": str(tmp / "a")}, {"name": "local-b", "workdir": str(tmp / "b")}]}))
    pb = tmp / "pb.yaml"
    pb.write_text(yaml.safe_dump({
        "name": "pipeview", "kind": "train", "model": str(tmp / "model"), "data": str(tmp / "data"),
        "backend": "ring",
        "assets": {"data_from": str(REPO / "playbooks" / "data" / "smoke"),
                   "tiny_model": {"layers": 4, "hidden": 32, "seed": 0}},
        "train": {"method": "full", "strategy": "pipeline", "iters": ITERS, "batch_size": 4, "micro_batches": 2,
                  "max_seq_length": 64, "learning_rate": 1e-3, "save_every": ITERS, "steps_per_eval": 100,
                  "val_batches": 1},
        # first_step_s: a first step that never ends fails the run (with its evidence) inside the CLI's timeout.
        "split": "equal", "heartbeat_timeout": 60, "faults": {"max_restarts": 0, "first_step_s": 300}},
        sort_keys=False))
    return inv, pb


def test_status_report_and_the_dashboard_show_a_pipelines_stages(run_cli: RunCli, tmp_path: Path) -> None:
    problems = browser_problems()
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    inv, pb = write_files(tmp_path)
    runs = tmp_path / "runs"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "300", "TERM": "dumb", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = run_cli("launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(runs), env=env, timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(proc.stdout)
    validate_output("launch", summary)
    stages = summary["stages"]
    # The run's record: a 2-stage pipeline over the 4 blocks, each rank measured (its busy and wait time per step).
    assert stages["kind"] == "pipeline" and stages["micro_batches"] == 2, stages
    assert [(r["node"], r["stage"], r["first_layer"], r["last_layer"]) for r in stages["ranks"]] == [
        ("local-a", 0, 0, 2), ("local-b", 1, 2, 4)]
    assert all(r["busy_s"] and r["wait_s"] is not None and 0 < r["busy_share"] <= 1 for r in stages["ranks"])
    assert stages["bubble"] is not None and stages["predicted_bubble"] == pytest.approx(1 / 3, abs=1e-4)
    assert all(r["peak_memory_bytes"] and r["budget_bytes"] and r["predicted_memory_bytes"] for r in stages["ranks"])
    run_id = summary["run_id"]
    meta = json.loads((runs / run_id / "meta.json").read_text())
    assert meta["layout"]["kind"] == "pipeline"  # what `attach` rebuilds the launch's layout from

    # status: each node's row names its stage and layers; --json carries the same stage rows.
    table = run_cli("status", "-i", str(inv), "--run-dir", str(runs), env=env, timeout=120)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "stage 0 (L0-1)" in table.stdout and "stage 1 (L2-3)" in table.stdout, table.stdout
    status = run_cli("status", "-i", str(inv), "--run-dir", str(runs), "--json", env=env, timeout=120)
    doc = json.loads(status.stdout)
    validate_output("status", doc)
    assert [n["run"]["stage"] for n in doc["nodes"]] == stages["ranks"]

    # report: a "Stages and memory" table with the layers, and the bubble against the plan's.
    out = tmp_path / "report.html"
    rep = run_cli("report", run_id, "--run-dir", str(runs), "-o", str(out), env=env, timeout=120)
    assert rep.returncode == 0, rep.stderr[-3000:]
    page = out.read_text()
    assert '<table id="stages"' in page and "Stages and memory" in page
    assert re.search(r"local-a</span></td>.*?<td>0-1</td>", page.split('id="stages"', 1)[1], re.S)
    # Every view words the bubble by one rule from the recorded value (stagetable.pct; app.js's pct is the same).
    assert f"bubble {pct(stages['bubble'])} (plan 33%)" in page

    # The dashboard's run page in a real browser: the stage columns, from the same stage view.
    port = free_port()
    proc_d = cli("dashboard", "-i", str(inv), "--run-dir", str(runs), "--port", str(port), env=env,
                 out=tmp_path / "dash.out", err=tmp_path / "dash.log")
    try:
        url = wait_url(tmp_path / "dash.log", proc_d, tmp_path / "dash.log")
        token = url.split("token=", 1)[1]
        base = f"http://127.0.0.1:{port}"
        _, view = fetch(f"{base}/api/run/{run_id}", token=token)
        assert view["stages"] == stages
        with Browser() as browser:
            browser.get(url)
            browser.get(f"{base}/run/{run_id}")
            rows = browser.wait_for("const r = [...document.querySelectorAll('#stages tr[data-stage-rank]')];"
                                    "return r.length === 2 && r.map(x => [...x.cells].map(c => c.innerText))",
                                    what="the stage rows")
            assert [row[:4] for row in rows] == [["0", "local-a", "0", "0-1"], ["1", "local-b", "1", "2-3"]], rows
            assert all(re.fullmatch(r"\d+% / \d+%", row[4]) for row in rows), rows
            head = browser.js("return document.querySelector('#stage-summary').innerText")
            assert head.startswith(f"pipeline of 2 stages, 2 micro-batches (1f1b): bubble {pct(stages['bubble'])} "
                                   "(plan 33%)"), head
            assert browser.js("return document.querySelector('#stages-section').style.display") == ""
        assert stop(proc_d, timeout=30) == 0, tail(tmp_path / "dash.log")
    finally:
        stop(proc_d)
