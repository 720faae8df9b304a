"""The HTML report of a map run, from a run directory written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.run.rundir import RunFileFormatError
from coordinator.views.report import read_run_files
from coordinator.views.report_map import build_map_report, render_map_page, write_report

T0 = 1_790_000_000.0


def make_run(root: Path) -> Path:
    run = root / "score-1"
    run.mkdir(parents=True)
    summary = {"run_id": "score-1", "kind": "map", "state": "succeeded", "rows": 30, "rows_done": 30,
               "split": {"a": 0.6, "b": 0.4}, "finish_spread": 0.05,
               "nodes": [{"name": "a", "state": "finished", "rows": 22, "rows_done": 22, "ranges": [[0, 18], [24, 28]],
                          "examples_per_s_calibrated": 6.0, "rows_per_s": 5.5, "finished_after_s": 4.1},
                         {"name": "b", "state": "failed", "rows": 12, "rows_done": 8, "ranges": [[18, 30]],
                          "examples_per_s_calibrated": 4.0, "rows_per_s": 3.9, "finished_after_s": None}],
               "incidents": [{"kind": "crash", "node": "b", "action": "quarantine", "detected_after_s": 0.4,
                              "evidence": {"message": "<boom>"}}],
               "reassignments": [{"from": "b", "rows": 4, "to": {"a": [[24, 28]]}}]}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "map.json").write_text(json.dumps({"rows": 30, "task": {"task": "score"}, "split": summary["split"]}))
    (run / "manifest.json").write_text(json.dumps({"output": str(run / "output.jsonl"), "rows": 30, "sha256": "ab" * 32,
                                                   "rows_by_node": {"a": 22, "b": 8}}))
    events = [{"node": "a", "src": "event", "event": "started", "t": T0},
              {"node": "b", "src": "event", "event": "started", "t": T0},
              {"node": "a", "src": "event", "event": "progress", "t": T0 + 2, "done": 10},
              {"node": "b", "src": "event", "event": "progress", "t": T0 + 2, "done": 8},
              {"node": "a", "src": "event", "event": "progress", "t": T0 + 3, "done": 18},
              {"node": "a", "src": "event", "event": "started", "t": T0 + 3.2},  # the re-assigned rows
              {"node": "a", "src": "event", "event": "finished", "t": T0 + 4.1, "done": 4},
              {"event": "incident", "kind": "crash", "node": "b"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_map_report_shows_shards_progress_incidents_and_output(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    report = build_map_report(read_run_files(tmp_path, "score-1"), run)
    assert report.progress["a"] == [(T0, 0), (T0 + 2, 10), (T0 + 3, 18), (T0 + 3.2, 18), (T0 + 4.1, 22)]
    assert report.problems == [] and report.task == "score"
    page = render_map_page(report, generated_at=T0)
    for text in ("Map run score-1", "30 / 30", "5.0%", "[0, 18), [24, 28)", "60.0%", "crash", "&lt;boom&gt;",
                 "Re-assigned rows", "{&quot;a&quot;: [[24, 28]]}", "ab" * 32, "data:image/png;base64,"):
        assert text in page, text
    assert "<boom>" not in page  # every value from the run dir is escaped
    path = write_report(tmp_path, "score-1")
    assert path == run / "report" / "index.html" and "Map run score-1" in path.read_text()


def test_a_manifest_of_a_newer_format_is_an_error_naming_both_versions(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "manifest.json").write_text(json.dumps({"format": 99, "rows": 30}))
    with pytest.raises(RunFileFormatError, match="format 99, newer"):
        build_map_report(read_run_files(tmp_path, "score-1"), run)


def test_an_unreadable_manifest_is_named_among_the_problems(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "manifest.json").write_text("{half")
    report = build_map_report(read_run_files(tmp_path, "score-1"), run)
    assert report.manifest is None and report.problems == ["manifest.json is unreadable"]
