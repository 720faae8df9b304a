"""`coordinator status` and `coordinator monitor --once` over real SSH: a fake Mac, a Linux host, a host whose
sshd is stopped, plus a run directory and a quarantine entry on the coordinator's disk."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import TestBed

CONNECT_TIMEOUT = "20"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    """`mac` replays an M5 Max MacBook Pro, `lin` is a plain Linux host, `down` never starts sshd."""
    bed = TestBed(tmp=tmp_path_factory.mktemp("status") / "bed")
    try:
        bed.add_host("mac", mac_profile="m5max-mbp-tb5")
        bed.add_host("lin")
        bed.add_host("down", start_sshd=False)
        yield bed
    finally:
        bed.close()


def write_run(root: Path, run_id: str, ranks: list[tuple[int, str]], events: list[dict[str, Any]],
              summary: dict[str, Any] | None = None) -> Path:
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    meta = {"run_id": run_id, "nodes": [n for _, n in ranks], "ranks": [{"rank": r, "node": n, "batch_size": 2}
                                                                     for r, n in ranks]}
    (run_dir / "meta.json").write_text(json.dumps(meta))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def seed(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A running run on mac (rank 0) and lin (rank 1), an older finished one, and `lin` quarantined."""
    runs = tmp / "runs"
    now = time.time()
    write_run(runs, "old-run", [(0, "mac")], [{"t": now - 999, "node": "mac", "rank": 0, "event": "finished",
                                               "step": 3}], summary={"state": "succeeded"})
    time.sleep(0.05)  # distinct meta.json mtimes: the newest run wins
    write_run(runs, "live-run", [(0, "mac"), (1, "lin")], [
        # Resumed at step 5: a rank's first step past its peers' + 2 would be implausible to the monitor's rules,
        # which status replays (coordinator.run.replay).
        {"t": now - 5, "node": "mac", "rank": 0, "event": "started", "resumed_from": 5},
        {"t": now - 5, "node": "lin", "rank": 1, "event": "started", "resumed_from": 5},
        {"t": now - 3, "node": "mac", "rank": 0, "event": "step", "step": 6, "loss": 2.5, "tok_s": 1234.5},
        {"t": now - 3, "node": "lin", "rank": 1, "event": "step", "step": 6, "loss": 2.6, "tok_s": 1000.0},
        {"t": now - 2, "node": "mac", "rank": 0, "event": "step", "step": 7, "loss": 2.5, "tok_s": 1234.5},
        {"t": now - 2, "node": "lin", "rank": 1, "event": "step", "step": 7, "loss": 2.6, "tok_s": 1000.0},
        {"t": now - 1, "node": "lin", "rank": 1, "event": "heartbeat", "step": 7},
        {"event": "incident", "kind": "straggler", "node": "lin", "rank": 1, "step": 7, "action": "warn",
         "evidence": {"steps": 5}},
    ])
    state = tmp / "state"
    (state / "mlx-coordinator").mkdir(parents=True)
    (state / "mlx-coordinator" / "quarantine.json").write_text(json.dumps(
        {"nodes": {"lin": {"reason": "hang at step 3", "run_id": "older", "t": now, "incident": {}}}}))
    return runs, {"XDG_STATE_HOME": str(state)}


def test_status_json_rows_for_mac_linux_and_a_dead_host(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = bed.write_inventory(tmp_path / "inv.yaml", [bed.host(n) for n in ("mac", "lin", "down")])
    runs, env = seed(tmp_path)
    cp = run_cli("status", "-i", str(inv), "--json", "--run-dir", str(runs), "--connect-timeout", CONNECT_TIMEOUT,
                 env=env, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Traceback" not in cp.stderr
    doc = json.loads(cp.stdout)
    validate_output("status", doc)  # docs/json.md's schema, unknown keys refused
    rows = {r["node"]: r for r in doc["nodes"]}
    assert [r["node"] for r in doc["nodes"]] == ["mac", "lin", "down"]

    mac, lin, down = rows["mac"], rows["lin"], rows["down"]
    assert mac["reachable"] and mac["error"] is None
    assert mac["os"].startswith("macOS 26") and "Apple M5 Max" in mac["chip"]
    assert mac["memory"]["total_bytes"] > 0 and 0 <= mac["memory"]["used_bytes"] <= mac["memory"]["total_bytes"]
    assert mac["memory"]["pressure"] in ("normal", "warn", "critical")
    assert mac["gpu_utilization_pct"] is not None  # ioreg accelerator statistics
    assert mac["power"] and mac["disk"]["free_bytes"] > 0
    assert mac["load"] is None  # the recorded sysctl has no vm.loadavg: unknown, not 0
    assert mac["run"]["run_id"] == "live-run" and mac["run"]["active"] and mac["run"]["rank"] == 0
    assert mac["run"]["step"] == 7 and mac["run"]["tokens_per_s"] == 1234.5 and mac["run"]["verdict"] == "ok"
    assert 1 <= mac["run"]["last_heartbeat_age_s"] < 60
    assert mac["quarantine"] == {"quarantined": False, "reason": None}

    assert lin["reachable"] and lin["os"] and "Linux" in lin["os"]
    assert lin["load"] is not None and len(lin["load"]) == 3 and lin["cpu_count"] >= 1
    assert lin["memory"]["used_bytes"] > 0 and lin["memory"]["pressure"] is None
    assert lin["gpu_utilization_pct"] is None  # no nvidia-smi on the bed
    assert lin["run"]["rank"] == 1 and lin["run"]["step"] == 7
    assert lin["quarantine"] == {"quarantined": True, "reason": "hang at step 3"}

    assert down["reachable"] is False and down["error"]
    assert down["os"] is None and down["memory"]["total_bytes"] is None
    assert down["quarantine"]["quarantined"] is False

    [live] = doc["runs"]  # only active runs are listed
    assert live["run_id"] == "live-run" and live["step"] == 7
    assert live["incident_counts"] == {"straggler": 1}


def test_status_table_and_invalid_inventory(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = bed.write_inventory(tmp_path / "inv.yaml", [bed.host(n) for n in ("lin", "down")])
    runs, env = seed(tmp_path)
    # Piped, with no COLUMNS (a CI log, `| less`): full cells, never squeezed into 80 columns (`Debi…`).
    cp = run_cli("status", "-i", str(inv), "--run-dir", str(runs), "--connect-timeout", CONNECT_TIMEOUT,
                 env={**env, "COLUMNS": ""})
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "lin" in cp.stdout and "down" in cp.stdout and "live-run" in cp.stdout and "hang at step 3" in cp.stdout
    assert "…" not in cp.stdout, cp.stdout
    assert "live-run rank 1 step 7" in cp.stdout and "(hang at step 3)" in cp.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{name: x}]\n")
    cp = run_cli("status", "-i", str(bad), "--json")
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr


def test_monitor_once_renders_one_frame(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = bed.write_inventory(tmp_path / "inv.yaml", [bed.host(n) for n in ("mac", "lin", "down")])
    runs, env = seed(tmp_path)
    cp = run_cli("monitor", "-i", str(inv), "--run-dir", str(runs), "--once", "--connect-timeout", CONNECT_TIMEOUT,
                 env={**env, "COLUMNS": ""}, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = cp.stdout
    assert "…" not in out, out  # piped without COLUMNS: full cells
    for text in ("mac", "lin", "down", "Apple M5 Max", "run live-run (running): step 7", "straggler"):
        assert text in out, (text, out)
