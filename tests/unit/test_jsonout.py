"""docs/json.md is generated from coordinator/views/jsonout.py, and the models there refuse what a verb does not print.

The verbs' real outputs are validated where the integration tests run them (facts, preflight, calibrate, launch,
attach, status, nettest, quarantine list, sync, setup); here: the drift check, the records that print the
summaries (map runs included), and a renamed key failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.facts.model import NodeFacts, OsInfo
from coordinator.models import CheckResult, LintResult, PreflightReport, Status
from coordinator.run.launch import RunSummary
from coordinator.run.mapjob import MapSummary
from coordinator.run.monitor import Action, Incident, IncidentKind, RunState
from coordinator.views.jsonout import MapSummaryOut, RunSummaryOut, render_docs, validate_output
from coordinator.views.render import facts_to_json

DOCS = Path(__file__).resolve().parents[2] / "docs" / "json.md"


def test_docs_json_md_is_what_the_generator_writes() -> None:
    assert DOCS.read_text(encoding="utf-8") == render_docs(), \
        "docs/json.md is stale: regenerate it with `python -m coordinator.views.jsonout > docs/json.md`"


def _inc() -> Incident:
    return Incident(kind=IncidentKind.CRASH, node="lin", rank=1, step=3, detected_after_s=0.5, evidence={"x": 1},
                    action=Action.QUARANTINE, t=1.0)


def test_a_training_summary_validates_and_a_renamed_key_fails() -> None:
    summary = RunSummary(run_id="r1", state=RunState.FAILED, steps=3, iters=10, attempts=2, split={"mac": 1.0},
                         incidents=[_inc()], left_out=[{"node": "old", "reason": "quarantined"}],
                         recoveries=[{"attempt": 1, "culprits": ["lin"], "failed_step": 3, "nodes": ["mac"],
                                      "resumed_from": 2, "first_step_after_s": 4.5}],
                         nodes=[{"node": "mac", "rank": 0, "batch_size": 3, "state": "finished", "step": 3,
                                 "loss": 2.0, "tokens_per_s": 70.0, "verdict": "ok", "calibrated_tokens_per_s": None,
                                 "peak_memory_bytes": 1024, "checkpoint": None, "run_dir": "/w/mac"}])
    doc = json.loads(json.dumps(summary.to_json()))
    assert isinstance(validate_output("launch", doc), RunSummaryOut)
    doc["nodes"][0]["name"] = doc["nodes"][0].pop("node")  # the old vocabulary
    with pytest.raises(ValueError, match="name"):
        validate_output("launch", doc)


def test_a_recovery_validates_as_job_py_writes_it_and_refuses_its_internal_clock() -> None:
    base = {"attempt": 1, "culprits": ["lin"], "failed_step": 3, "nodes": ["mac"]}
    summary = RunSummary(run_id="r1", state=RunState.FAILED, steps=3, iters=10, attempts=2, split={"mac": 1.0},
                         nodes=[], recoveries=[base])  # a refused resume: neither resumed_from nor first_step_after_s
    doc = json.loads(json.dumps(summary.to_json()))
    validate_output("launch", doc)
    doc["recoveries"][0]["detected_at"] = 5.0  # the coordinator's monotonic clock stays out of summary.json
    with pytest.raises(ValueError, match="detected_at"):
        validate_output("launch", doc)


def test_a_map_summary_validates() -> None:
    summary = MapSummary(run_id="m1", state="succeeded", rows=30, rows_done=30, split={"a": 1.0}, finish_spread=0.2,
                         nodes=[{"node": "a", "state": "finished", "rows": 30, "rows_done": 30, "ranges": [[0, 30]],
                                 "examples_per_s_calibrated": 9.0, "rows_per_s": 8.5, "finished_after_s": 3.5,
                                 "error": None}],
                         reassignments=[{"from": "b", "rows": 4, "to": {"a": [[26, 30]]}}])
    doc = json.loads(json.dumps(summary.to_json()))
    assert isinstance(validate_output("launch", doc), MapSummaryOut)


def test_preflight_says_node_and_refuses_name() -> None:
    report = PreflightReport(nodes=(("mbp", (CheckResult("ssh", "mbp", Status.PASS, "ok"),)),),
                             lint=(LintResult("split", Status.WARN, "w"),))
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["nodes"][0]["node"] == "mbp"
    validate_output("preflight", doc)
    with pytest.raises(ValueError, match="PreflightOut"):
        validate_output("preflight", {**doc, "nodes": [{"name": "mbp", "checks": []}]})


def test_facts_refuse_a_key_no_fact_record_has() -> None:
    row = json.loads(json.dumps(facts_to_json(NodeFacts(node="a", os=OsInfo("Linux", "x86_64", "6.1", "Debian", "12")))))
    validate_output("facts", {"nodes": [row, {"node": "b", "unreachable": "refused"}]})
    with pytest.raises(ValueError, match=r"NodeFacts\.bogus"):
        validate_output("facts", {"nodes": [{**row, "bogus": 1}]})
