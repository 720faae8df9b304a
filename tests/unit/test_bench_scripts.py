"""Every script in benchmarks/ still runs against today's CLI: each one starts (`--help`, which imports all it
needs), and each reader of the CLI's `--json` reads the documents the real writers produce, checked against the
published schemas (coordinator/views/jsonout.py). The split, map, preflight, scale and sync benchmarks once died
with `KeyError: 'name'` / `'transfer_seconds'` after minutes of measuring, because nothing ran their readers."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.models import CheckResult, PreflightReport, Status
from coordinator.planning.plan import CurvePoint, NodeCalibration, compute_plan
from coordinator.run.calibrate import calibration_to_json
from coordinator.run.mapjob import MapSummary

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import bench_map  # noqa: E402
import bench_preflight  # noqa: E402
import bench_scale  # noqa: E402
import bench_split  # noqa: E402
import bench_sync  # noqa: E402
import probe_rank_vs_bench  # noqa: E402
from cliout import by_node, cli_json  # noqa: E402

# Scripts that take arguments (the others are libraries of the benchmarks or a shell script; mlx_lm_driver.py is
# bench_train's driver around mlx-lm's trainer, run by its --ci test in test_bench_train.py).
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py")
                 if "argparse" in p.read_text() and p.name not in ("cliout.py", "mlx_lm_driver.py"))


def test_the_script_list_is_what_is_there() -> None:
    assert {"bench_split.py", "bench_map.py", "bench_preflight.py", "bench_scale.py", "bench_sync.py",
            "bench_train.py", "bench_hash.py", "bench_digest.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_starts(script: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def _calibrate_doc() -> dict[str, object]:
    cals = [NodeCalibration(node=n, curve=(CurvePoint(1, r, 10), CurvePoint(2, 1.8 * r, 12)), matmul_gflops=1.0,
                            memory_limit=None, seq_len=32) for n, r in (("full", 2000.0), ("half", 1000.0))]
    return calibration_to_json(compute_plan(cals, 6, seq_len=32), cals)


def test_split_reads_calibrate_json_through_its_schema() -> None:
    doc = cli_json("calibrate", json.dumps(_calibrate_doc()))
    assert sorted(by_node(doc["nodes"])) == ["full", "half"]
    rows = bench_split.calibration_rows([{**doc, "round": 1, "wall_s": 12.5}])
    assert [r.split(" | ")[1] for r in rows] == ["full", "half"]
    assert all(r.endswith("| 12.5 |") for r in rows)


def test_preflight_and_scale_read_preflight_json_through_its_schema() -> None:
    checks = tuple(CheckResult(id=c, node="", status=Status.PASS, summary="ok") for c in ("ssh", "model"))
    report = PreflightReport(nodes=tuple((n, tuple(CheckResult(c.id, n, c.status, c.summary) for c in checks))
                                         for n in ("h1", "h2")), lint=())
    text = json.dumps(report.to_json())
    assert bench_scale.verify(text, ["h1", "h2"]) == (2, "")
    assert bench_scale.verify(text, ["h1", "h3"]) == (1, "h3: missing from the report")
    tool = bench_preflight.Tool("coordinator", [], {}, REPO)
    tool.verify(1, text, "", ["h1", "h2"], "round 1")  # raises SystemExit if it cannot read the report
    with pytest.raises(SystemExit, match="nodes not fully probed"):
        tool.verify(1, text, "", ["h1", "h2", "h3"], "round 1")


def test_sync_reads_sync_json_through_its_schema() -> None:
    from coordinator.fleet.syncrun import SyncReport

    report = SyncReport(plan=None, checked_only=False, sent_bytes=5_000_000, seconds=3.5, transfer_seconds=2.25)
    doc = cli_json("sync", json.dumps(report.to_json()))
    assert bench_sync.sync_row(3.5, 1.75, doc) == ("coordinator sync (relay chain)", "3.50",
                                                   "2.00x one copy; sent 5.0 MB once; transfer 2.25 s")


def test_map_reads_launch_json_through_its_schema() -> None:
    def summary(spread_full: float, spread_half: float) -> dict[str, object]:
        nodes = [{"node": n, "state": "finished", "rows": rows, "rows_done": rows, "ranges": [[0, rows]], "error": None,
                  "examples_per_s_calibrated": rate, "rows_per_s": rate, "finished_after_s": after}
                 for n, rows, rate, after in (("full", 60, 20.0, spread_full), ("half", 30, 10.0, spread_half))]
        written = MapSummary(run_id="m", state="succeeded", rows=90, rows_done=90, split={"full": 2 / 3, "half": 1 / 3},
                             nodes=nodes)
        return cli_json("launch", json.dumps(written.to_json()))

    results = {"calibrated": [summary(3.0, 3.2)], "equal": [summary(2.0, 6.0)]}
    args = argparse.Namespace(quota_us=50000, rows=90)
    text = bench_map.render(results, "python benchmarks/bench_map.py", args, (0.5,), (0.6,), 10.0)
    assert "| calibrated | 1 | 60 / 30 | 20 / 10 | 3.0 / 3.2 |" in text
    assert "equal / calibrated = 1.88x" in text


def test_a_renamed_key_is_a_one_line_error_naming_it() -> None:
    doc = _calibrate_doc()
    nodes = doc["nodes"]
    assert isinstance(nodes, list)
    nodes[0] = {("name" if k == "node" else k): v for k, v in nodes[0].items()}
    with pytest.raises(ValueError, match="name"):
        cli_json("calibrate", json.dumps(doc))


@pytest.mark.parametrize("argv", [
    ["bench_hash.py", "--big-mib", "1", "--small-mib", "1", "--small-count", "2", "--runs", "1"],
    ["bench_dashboard.py", "--ranks", "2", "--seconds", "2", "--step-s", "0.5"],
    ["bench_digest.py", "--sizes", "tiny", "--rounds", "1", "--steps", "2"],
], ids=["hash", "dashboard", "digest"])
def test_the_benchmarks_without_a_test_bed_run_ci_sized(argv: list[str], tmp_path: Path) -> None:
    """The benchmarks that need no root, namespaces or GPU, run for real at the smallest size: they finish and
    print their report (no figures judged: they depend on the machine)."""
    extra = ["--dir", str(tmp_path)] if argv[0] == "bench_hash.py" else []
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / argv[0]), *argv[1:], *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if argv[0] == "bench_hash.py":
        assert "| probe, warm hash cache" in proc.stdout
    elif argv[0] == "bench_digest.py":  # it also checks that both ways of summing agree
        assert proc.stdout.count("tiny ") == 2 and "sums-device" in proc.stdout and "after" in proc.stdout
    else:
        doc = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
        assert doc["steps_written"] == 4 and "steps_seen" in doc and "latency_median_s" in doc


def test_the_probes_old_order_takes_the_shapes_in_turn_each_on_its_own_positions() -> None:
    """probe_rank_vs_bench's `rr` kind: calibration's order until session 10, as many steps as given."""
    steps = [(4, 0), (4, 8), (2, 16), (4, 24), (1, 32), (4, 40)]
    assert probe_rank_vs_bench.round_robin(steps) == [(1, 32), (2, 16), (4, 0), (1, 32), (2, 16), (4, 8)]
    assert probe_rank_vs_bench.round_robin([]) == []


def test_probe_cpu_lists_and_placements() -> None:
    """probe_rank_vs_bench's `@CPUS` suffix: sysfs's list syntax, and a kind pinned to no CPU of this machine is
    refused before any process starts."""
    assert probe_rank_vs_bench.parse_cpus("0-3,8\n") == {0, 1, 2, 3, 8}
    assert probe_rank_vs_bench.parse_cpus("5") == {5}
    assert probe_rank_vs_bench.placement("bench+") == ("bench+", None)
    mine = min(os.sched_getaffinity(0))
    assert probe_rank_vs_bench.placement(f"rank@{mine}") == ("rank", {mine})
    with pytest.raises(SystemExit, match="no CPU"):
        probe_rank_vs_bench.placement("rank@100000")
