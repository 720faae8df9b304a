"""worker.mapper (the node side of map jobs) and the pure half of coordinator.run.mapjob, in-process or as a local
subprocess: rows by range, the score/generate/command tasks, the bench, results gathered in input order."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config.playbook import parse_playbook
from coordinator.run.mapjob import MapError, build_mapper_config, fixed_rates, gather_output, received_indices
from worker.mapper import MapError as WorkerMapError
from worker.mapper import read_rows
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "playbooks" / "data" / "smoke"

SLOW_MODULE = '''
import argparse, json, time
ap = argparse.ArgumentParser(); ap.add_argument("--input"); ap.add_argument("--output")
ap.add_argument("--fail-at", type=int, default=-1)
a = ap.parse_args()
with open(a.input) as fin, open(a.output, "w") as fout:
    for i, line in enumerate(fin):
        if i == a.fail_at:
            raise SystemExit("boom at %d" % i)
        fout.write(json.dumps({"chars": len(json.loads(line)["text"])}) + "\\n")
        fout.flush()
'''


def run_mapper(config: dict[str, Any]) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "worker.mapper"], input=json.dumps(config), capture_output=True,
                          text=True, cwd=REPO, timeout=300, check=False)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert all(line.get("src") in ("result", "event", "bench") for line in lines)
    return [line for line in lines if line.get("event") != "heartbeat"]


def test_rows_are_the_non_blank_lines_by_range(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"a": 0}\n\n{"a": 1}\n{"a": 2}\n   \n{"a": 3}\n')
    assert [(i, r["a"]) for i, r in read_rows(path, [(3, 4), (0, 2)])] == [(0, 0), (1, 1), (3, 3)]
    assert list(read_rows(path, [])) == []
    path.write_text('{"a": 0}\nnot json\n')
    with pytest.raises(WorkerMapError, match=r"in\.jsonl:2: not JSON"):
        list(read_rows(path, [(0, 2)]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-map"), SMOKE, layers=2, hidden=32)


def test_score_gives_each_row_its_log_likelihood(tiny: Path) -> None:
    out = run_mapper({"model": str(tiny), "input": str(SMOKE / "valid.jsonl"), "task": "score", "field": "text",
                      "ranges": [[2, 5], [7, 8]], "batch_size": 3})
    results = [o for o in out if o["src"] == "result"]
    assert [r["index"] for r in results] == [2, 3, 4, 7]
    for r in results:
        assert r["tokens"] > 0 and r["logprob"] < 0
        assert r["nll"] == pytest.approx(-r["logprob"] / r["tokens"])
        assert r["perplexity"] == pytest.approx(math.exp(r["nll"]))
    # the same row scores the same whatever batch it shares (padding does not leak into the score)
    alone = run_mapper({"model": str(tiny), "input": str(SMOKE / "valid.jsonl"), "task": "score", "field": "text",
                        "ranges": [[3, 4]], "batch_size": 1})
    assert [o["logprob"] for o in alone if o["src"] == "result"] == pytest.approx([results[1]["logprob"]], rel=1e-5)
    assert next(o["event"] for o in out if o["src"] == "event") == "started"
    assert out[-1]["event"] == "finished" and out[-1]["done"] == 4


def test_generate_is_reproducible_per_row(tiny: Path) -> None:
    cfg = {"model": str(tiny), "input": str(SMOKE / "valid.jsonl"), "task": "generate", "field": "text",
           "generate": {"max_tokens": 4, "temperature": 0.8, "top_p": 1.0, "seed": 3}}
    a = [o for o in run_mapper({**cfg, "ranges": [[0, 2]]}) if o["src"] == "result"]
    b = [o for o in run_mapper({**cfg, "ranges": [[1, 2]]}) if o["src"] == "result"]
    assert [r["index"] for r in a] == [0, 1] and all(r["completion_tokens"] == 4 for r in a)
    assert b[0]["completion"] == a[1]["completion"]  # row 1 is sampled with seed 3 + 1 on any node


def test_command_streams_results_and_reports_a_failing_module(tmp_path: Path) -> None:
    (tmp_path / "lenmod.py").write_text(SLOW_MODULE)
    (tmp_path / "input.jsonl").write_text((SMOKE / "valid.jsonl").read_text())
    base = {"model": "-", "input": str(tmp_path / "input.jsonl"), "task": "command", "field": "text",
            "command": {"module": "lenmod", "args": []}, "workdir": str(tmp_path / "work")}
    out = run_mapper({**base, "ranges": [[0, 3], [10, 12]]})
    results = [o for o in out if o["src"] == "result"]
    rows = [json.loads(line) for line in (tmp_path / "input.jsonl").read_text().splitlines()]
    assert [(r["index"], r["chars"]) for r in results] == [(i, len(rows[i]["text"])) for i in (0, 1, 2, 10, 11)]
    bad = run_mapper({**base, "ranges": [[0, 5]], "command": {"module": "lenmod", "args": ["--fail-at", "2"]}})
    assert [o["index"] for o in bad if o["src"] == "result"] == [0, 1]  # what was written before the failure
    assert bad[-1]["event"] == "error" and "boom at 2" in bad[-1]["message"]
    bench = run_mapper({**base, "bench": 0.5})
    assert bench[-1]["src"] == "bench" and bench[-1]["examples_per_s"] > 0


def test_gather_orders_rows_and_refuses_gaps(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"index": 2, "x": "c"}\n{"index": 0, "x": "a"}\n{"index": 3, "x": "d"}\n{"index": 1, "x')
    b.write_text('{"index": 1, "x": "b"}\n{"index": 0, "x": "dup"}\n')
    lines, origin = gather_output([a, b], 4)
    assert [json.loads(line)["x"] for line in lines] == ["a", "b", "c", "d"]
    assert origin == {0: "a.jsonl", 1: "b.jsonl", 2: "a.jsonl", 3: "a.jsonl"}
    assert received_indices([a, b]) == {0, 1, 2, 3}
    with pytest.raises(MapError, match=r"rows missing.*\(4, 6\)"):
        gather_output([a, b], 6)


def test_mapper_config_and_fixed_rates() -> None:
    pb = parse_playbook({"name": "m", "kind": "map", "model": "/m", "data": "/d/", "map": {
        "task": "command", "command": {"module": "pkg.mod", "args": ["-v"]}, "input": "x.jsonl"}}, path="p.yaml")
    cfg = build_mapper_config(pb, [(0, 5)], workdir="/w")
    assert cfg["input"] == "/d/x.jsonl" and cfg["ranges"] == [[0, 5]] and cfg["command"]["module"] == "pkg.mod"
    assert fixed_rates(["a", "b"], "equal") == {"a": 1.0, "b": 1.0}
    assert fixed_rates(["a", "b"], {"a": 0.7, "b": 0.3}) == {"a": 0.7, "b": 0.3}
