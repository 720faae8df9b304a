"""The run directory's contract (coordinator.run.rundir): meta.json round-trips through its typed record, files of
the previous format (no `format` key) still read, a newer format is refused with both versions named, and the
summary of train and map runs shares one base."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.errors import ConfigError
from coordinator.run.launch import RunSummary
from coordinator.run.mapjob import MapSummary
from coordinator.run.monitor import Action, Incident, IncidentKind, RunState
from coordinator.run.rundir import (
    FORMAT,
    META,
    SUMMARY,
    CurveRecord,
    EventLine,
    IncidentRecord,
    MapManifest,
    MapPlanFile,
    MetaRank,
    PlanFile,
    PlanNode,
    PlanRecord,
    ReassignmentRecord,
    RecoveryRecord,
    RunFileFormatError,
    RunMeta,
    SummaryBase,
    SummaryNode,
    check_format,
    decode_event_lines,
    load_meta,
    parse_event_line,
    parse_incident_record,
    parse_manifest,
    parse_map_plan,
    parse_meta,
    parse_plan,
    parse_summary,
    read_json_object,
    read_manifest,
    read_meta,
)
from coordinator.views.report import ReportError, read_run_files
from coordinator.views.statuswatch import RunWatcher
from worker.events import EventError, EventLog, MapProgressEvent, StartedEvent, StepEvent

META_RECORD = RunMeta(
    run_id="r1", attempt=1, inventory="/inv.yaml", nodes=("mac", "lin"), playbook="/pb.yaml",
    ranks=(MetaRank(0, "mac", 3, 300.0), MetaRank(1, "lin", 1, None)), remote_run_dirs={"mac": "~/runs/r1/mac"},
    remote_tmp_dir="/tmp/mlxc-r1-ab", launcher_pid=123, coordinator_pid=456, split={"mac": 3, "lin": 1},
    left_out=({"node": "old", "reason": "quarantined"},), drill=True, restart_from_scratch=True)
# meta.json as the coordinator wrote it before the `format` key (format 1).
OLD_META = {k: v for k, v in META_RECORD.to_json().items() if k != "format"}


def test_meta_round_trips_through_its_json() -> None:
    doc = json.loads(json.dumps(META_RECORD.to_json()))
    assert doc["format"] == FORMAT
    assert parse_meta(doc) == META_RECORD


def test_a_meta_json_of_the_previous_format_still_reads(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    (run / META).write_text(json.dumps(OLD_META))
    assert check_format(OLD_META, META) == 1
    assert read_meta(run) == META_RECORD


def test_a_newer_format_is_refused_naming_both_versions(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    (run / META).write_text(json.dumps({**OLD_META, "format": FORMAT + 1}))
    with pytest.raises(RunFileFormatError, match=f"format {FORMAT + 1}, newer than this coordinator reads \\(1-{FORMAT}\\)"):
        read_meta(run)
    with pytest.raises(RunFileFormatError, match="not a format number"):
        check_format({"format": "2"}, META)
    # status leaves such a run out rather than misreading it (or failing the whole table)
    assert RunWatcher(tmp_path).scan(now=0.0) == []


def test_report_of_a_newer_summary_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    (run / SUMMARY).write_text(json.dumps({"format": FORMAT + 1, "state": "succeeded"}))
    with pytest.raises(RunFileFormatError, match=f"summary.json is format {FORMAT + 1}"):
        read_run_files(tmp_path, "r1")
    result = CliRunner().invoke(main, ["report", "r1", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2 and f"format {FORMAT + 1}" in result.output and "Traceback" not in result.output


def test_an_old_summary_still_reads(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    (run / SUMMARY).write_text(json.dumps({"run_id": "r1", "state": "succeeded", "steps": 2}))
    assert read_json_object(run / SUMMARY) == {"run_id": "r1", "state": "succeeded", "steps": 2}
    assert read_run_files(tmp_path, "r1").summary == {"run_id": "r1", "state": "succeeded", "steps": 2}
    with pytest.raises(ReportError, match="no run 'r2'"):
        read_run_files(tmp_path, "r2")


def test_a_meta_rank_without_its_number_is_an_error_naming_the_file() -> None:
    with pytest.raises(ConfigError, match=r"meta.json: ranks\[1\]"):
        parse_meta({**OLD_META, "ranks": [{"rank": 0, "node": "mac"}, {"node": "lin"}]})


def test_train_and_map_summaries_share_one_base() -> None:
    inc = Incident(kind=IncidentKind.CRASH, node="lin", rank=1, step=3, detected_after_s=0.5, evidence={},
                   action=Action.QUARANTINE, t=1.0)
    common = {"run_id": "r1", "nodes": [{"name": "mac"}], "split": {"mac": 1.0}, "incidents": [inc],
              "run_dir": "runs/r1", "message": "m", "quarantined": ["lin"], "left_out": [{"node": "x", "reason": "y"}]}
    train = RunSummary(state=RunState.FAILED, steps=3, **common)  # type: ignore[arg-type]
    mapped = MapSummary(state="failed", rows=10, rows_done=4, **common)  # type: ignore[arg-type]
    base = SummaryBase(state="failed", **common).base_json()  # type: ignore[arg-type]
    assert base["format"] == FORMAT and base["degraded"] is True and base["incidents"][0]["kind"] == "crash"
    for summary in (train.to_json(), mapped.to_json()):
        assert {k: summary[k] for k in base} == base
    assert (train.to_json()["steps"], mapped.to_json()["kind"], mapped.to_json()["steps"]) == (3, "map", 4)


def test_an_incident_reads_back_as_written() -> None:
    inc = Incident(kind=IncidentKind.STALL, node="lin", rank=1, step=7, detected_after_s=61.25,
                   evidence={"phase": "step"}, action=Action.STOP, t=12.5)
    line = json.loads(json.dumps({"event": "incident", "attempt": 2, **inc.to_json()}))
    assert parse_incident_record(line) == IncidentRecord(kind="stall", node="lin", rank=1, step=7, action="stop",
                                                         detected_after_s=61.25, evidence={"phase": "step"}, t=12.5,
                                                         attempt=2)
    # the events' number rule: a step of 7.0 is 7, a step of "7" is none
    assert parse_incident_record({**line, "step": 7.0}).step == 7
    assert parse_incident_record({**line, "step": "7", "kind": 3}) == IncidentRecord(
        node="lin", rank=1, action="stop", detected_after_s=61.25, evidence={"phase": "step"}, t=12.5, attempt=2)


def _events_jsonl(*records: dict[str, Any]) -> str:
    """Lines as the coordinator appends them to events.jsonl (json.dumps per line, coordinator.run.launch)."""
    return "".join(json.dumps(r) + "\n" for r in records)


def test_every_kind_of_events_jsonl_line_reads_back_as_written(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "rank1.jsonl", "r1", 1)  # the worker's own writer
    step = log.emit("step", step=7, loss=2.5, tok_s=310.0)
    log.close()
    inc = Incident(kind=IncidentKind.STALL, node="lin", rank=1, step=7, detected_after_s=61.25,
                   evidence={"phase": "step"}, action=Action.STOP, t=12.5)
    text = _events_jsonl(
        {"node": "lin", "rank": 1, **step},  # a rank's event, the coordinator's copy (launch.monitor)
        {"event": "incident", "attempt": 2, **inc.to_json()},  # launch._record_incident
        {"event": "supervisor", "what": "stop", "node": "coordinator", "attempt": 2, "t": 1795422371.5,
         "reason": "SIGTERM"},  # launch.record_supervisor
        {"event": "checkpoint_invalid", "node": "lin", "step": 6, "path": "/w/ck", "reason": "torn", "code": "torn",
         "set_aside_by": "coordinator"})  # resume.check_resume
    docs, bad = decode_event_lines(text.splitlines())
    assert bad == 0
    rank_line, inc_line, sup_line, invalid_line = (parse_event_line(d) for d in docs)
    assert (rank_line.kind, rank_line.t, rank_line.node, rank_line.rank, rank_line.attempt, rank_line.incident) == (
        "step", step["t"], "lin", 1, None, None)
    assert isinstance(rank_line.event, StepEvent) and (rank_line.event.step, rank_line.event.loss) == (7, 2.5)
    assert rank_line.payload == {"step": 7, "loss": 2.5, "tok_s": 310.0}
    assert (inc_line.kind, inc_line.node, inc_line.rank, inc_line.attempt, inc_line.t) == ("incident", "lin", 1, 2, 12.5)
    assert inc_line.incident == parse_incident_record(docs[1]) and inc_line.incident.kind == "stall"
    assert isinstance(inc_line.event, EventError)  # the coordinator's record, not a rank's event
    assert (sup_line.kind, sup_line.node, sup_line.attempt, sup_line.t, sup_line.incident) == (
        "supervisor", "coordinator", 2, 1795422371.5, None)
    assert sup_line.payload == {"what": "stop", "attempt": 2, "reason": "SIGTERM"}
    assert isinstance(sup_line.event, EventError) and sup_line.event.kind == "supervisor"
    # A CheckpointInvalidEvent under the rank's contract (the coordinator writes it for the ranks).
    assert (invalid_line.kind, invalid_line.node, invalid_line.rank, invalid_line.t) == ("checkpoint_invalid", "lin", None, None)
    assert not isinstance(invalid_line.event, EventError) and invalid_line.event.kind == "checkpoint_invalid"


def test_a_map_runs_line_reads_its_event_as_a_map_workers() -> None:
    doc = {"node": "mac", "t": 5.0, "run_id": "m1", "rank": None, "event": "progress", "done": 40, "rows": 100}
    assert isinstance(parse_event_line(doc).event, EventError)  # no `progress` among a training rank's kinds
    line = parse_event_line(doc, map_run=True)
    assert isinstance(line.event, MapProgressEvent) and (line.event.done, line.node, line.t) == (40, "mac", 5.0)
    started = parse_event_line({**doc, "event": "started"}, map_run=False)
    assert isinstance(started.event, StartedEvent)  # the same word, read under the train contract when asked


def test_malformed_events_jsonl_lines_are_counted_or_read_as_none() -> None:
    good = json.dumps({"node": "a", "rank": 0, "t": 1.0, "event": "started"})
    docs, bad = decode_event_lines([good, "", "   ", "[1, 2]", "7", '{"node": "a", "ev'])
    assert len(docs) == 1 and bad == 3  # blank lines are not lines; a torn last line is one bad line
    # Mistyped envelope keys read as None under the events' number rule (a rank of 1.0 is 1), never raise.
    odd = parse_event_line({"node": 3, "rank": 1.0, "t": "noon", "attempt": "2", "event": 5})
    assert odd == EventLine(kind=None, t=None, node=None, rank=1, attempt=None, event=odd.event, payload={"attempt": "2"})
    assert isinstance(odd.event, EventError) and odd.incident is None
    assert parse_event_line({}).kind is None and parse_event_line({}).payload == {}


def test_a_run_summary_reads_back_through_its_typed_record() -> None:
    inc = Incident(kind=IncidentKind.CRASH, node="lin", rank=1, step=3, detected_after_s=0.5, evidence={},
                   action=Action.QUARANTINE, t=1.0)
    written = RunSummary(run_id="r1", state=RunState.FAILED, steps=3, iters=10, attempts=2, checkpoint="/c",
                         tokens_per_s=99.5, message="m", split={"mac": 0.75, "lin": 0.25}, incidents=[inc],
                         quarantined=["lin"], left_out=[{"node": "old", "reason": "quarantined"}],
                         recoveries=[{"attempt": 1, "culprits": ["lin"], "failed_step": 3, "nodes": ["mac"],
                                      "resumed_from": 2.0, "first_step_after_s": 4}],
                         nodes=[{"node": "mac", "rank": 0, "batch_size": 3, "state": "finished", "step": 3.0,
                                 "loss": 2, "tokens_per_s": 70.0, "calibrated_tokens_per_s": None,
                                 "peak_memory_bytes": 1024, "checkpoint": "/c", "run_dir": "/w/mac"}])
    read = parse_summary(json.loads(json.dumps(written.to_json())))
    assert (read.format, read.run_id, read.kind, read.state, read.steps, read.iters, read.attempts) == (
        FORMAT, "r1", "train", "failed", 3, 10, 2)
    assert (read.checkpoint, read.tokens_per_s, read.message, read.quarantined) == ("/c", 99.5, "m", ("lin",))
    assert read.split == {"mac": 0.75, "lin": 0.25} and read.left_out == (("old", "quarantined"),)
    assert read.recoveries == (RecoveryRecord(1, ("lin",), ("mac",), 3, 2, 4.0),)
    assert [i.kind for i in read.incidents or ()] == ["crash"]
    assert read.nodes == (SummaryNode(name="mac", rank=0, batch_size=3, state="finished", step=3, loss=2.0,
                                      tokens_per_s=70.0, peak_memory=1024, checkpoint="/c"),)
    # an old summary (no format, no left_out, no incidents) reads with its gaps as None
    old = parse_summary({"run_id": "r0", "state": "succeeded", "steps": 2, "split": "garbage"})
    assert (old.format, old.state, old.steps, old.split, old.left_out, old.incidents) == (1, "succeeded", 2, None, None,
                                                                                         None)


def test_plan_json_reads_back_through_its_typed_record() -> None:
    doc = {"format": FORMAT, "split": {"mac": 0.75, "lin": 0.25}, "batch": {"mac": 3, "lin": 1.0},
           "nodes": [{"node": "mac", "tokens_per_s": 300}, {"node": "lin", "tokens_per_s": None}], "global_batch": 4,
           "mode": "calibrated", "predicted_tokens_per_s": 390.5, "backend": "ring", "attempt": 0}
    plan = parse_plan(json.loads(json.dumps(doc)))
    assert plan == PlanFile(format=FORMAT, split={"mac": 0.75, "lin": 0.25}, batch={"mac": 3, "lin": 1},
                            node_tokens_per_s={"mac": 300.0, "lin": None}, global_batch=4, mode="calibrated",
                            backend="ring", predicted_tokens_per_s=390.5, attempt=0)
    old = parse_plan({k: v for k, v in doc.items() if k != "format"} | {"batch": "garbage", "split": None})
    assert (old.format, old.batch, old.split, old.global_batch) == (1, {}, None, 4)
    # format 2 named a node `name`
    two = parse_plan({**doc, "format": 2, "nodes": [{"name": "mac", "tokens_per_s": 300}]})
    assert two.node_tokens_per_s == {"mac": 300.0}
    with pytest.raises(RunFileFormatError, match=rf"plan\.json is format {FORMAT + 1}"):
        parse_plan({**doc, "format": FORMAT + 1})


def test_a_map_summary_reads_back_through_the_same_record() -> None:
    written = MapSummary(run_id="m1", state="failed", rows=30, rows_done=26, split={"a": 0.6, "b": 0.4},
                         finish_spread=0.12, output="/o", manifest="/m", message="4 of 30 rows not done",
                         reassignments=[{"from": "b", "rows": 4, "to": {"a": [[24, 28]]}}],
                         nodes=[{"name": "a", "state": "finished", "rows": 22, "rows_done": 22,
                                 "ranges": [[0, 18], [24, 28.0], [1]], "examples_per_s_calibrated": 3.0,
                                 "rows_per_s": 2.5, "finished_after_s": 8}])
    read = parse_summary(json.loads(json.dumps(written.to_json())))
    assert (read.kind, read.state, read.rows, read.rows_done, read.steps, read.finish_spread) == (
        "map", "failed", 30, 26, 26, 0.12)
    assert (read.output, read.manifest, read.reassignments) == ("/o", "/m", (ReassignmentRecord("b", 4,
                                                                                                {"a": ((24, 28),)}),))
    (node,) = read.nodes
    assert (node.name, node.rows, node.rows_done, node.ranges, node.examples_per_s_calibrated, node.rows_per_s,
            node.finished_after_s) == ("a", 22, 22, ((0, 18), (24, 28)), 3.0, 2.5, 8.0)


def test_map_json_reads_back_and_an_old_one_too() -> None:
    doc = {"format": FORMAT, "rows": 30, "input": "/d/train.jsonl", "task": {"task": "score", "field": "text"},
           "rates": {"a": 3.0}, "split": {"a": 0.6, "b": 0.4}, "shards": {"a": [[0, 18]]}, "resumed": False}
    assert parse_map_plan(json.loads(json.dumps(doc))) == MapPlanFile(rows=30, task="score", split={"a": 0.6, "b": 0.4})
    old = parse_map_plan({k: v for k, v in doc.items() if k != "format"} | {"task": None})
    assert (old.format, old.rows, old.task) == (1, 30, None)


def test_the_plan_record_reads_back_through_parse_plan() -> None:
    written = PlanRecord(nodes=(PlanNode("mac", 300.0, 3, 0.75, (CurveRecord(1, 120.0, 2048),)),),
                         split={"mac": 0.75, "lin": 0.25}, batch={"mac": 3, "lin": 1}, global_batch=4,
                         mode="calibrated", predicted_tokens_per_s=390.5, backend="ring", attempt=1)
    doc = json.loads(json.dumps(written.to_json()))
    assert doc["nodes"][0]["curve"] == [{"batch": 1, "tokens_per_s": 120.0, "peak_memory_bytes": 2048}]
    assert parse_plan(doc) == PlanFile(format=FORMAT, split={"mac": 0.75, "lin": 0.25}, batch={"mac": 3, "lin": 1},
                                       node_tokens_per_s={"mac": 300.0}, global_batch=4, mode="calibrated",
                                       backend="ring", predicted_tokens_per_s=390.5, attempt=1)


def test_a_format_2_summary_reads_under_its_older_key_names() -> None:
    read = parse_summary({"format": 2, "state": "succeeded", "nodes": [{"name": "mac", "peak_memory": 1024}]})
    assert read.format == 2
    assert (read.nodes[0].name, read.nodes[0].peak_memory) == ("mac", 1024)


def test_a_map_manifest_round_trips_and_an_old_one_reads() -> None:
    written = MapManifest(run_id="m", rows=30, output="/r/output.jsonl", sha256="ab" * 32, input="/d/in.jsonl",
                          task="score", rows_by_node={"a": 22, "b": 8})
    doc = json.loads(json.dumps(written.to_json()))
    assert doc["format"] == FORMAT and parse_manifest(doc) == written
    old = parse_manifest({"output": "/r/output.jsonl", "rows": 30, "rows_by_node": {"a": 22, "b": "x"}})
    assert (old.format, old.rows, old.sha256, dict(old.rows_by_node)) == (1, 30, None, {"a": 22})


def test_read_manifest_is_none_when_missing_and_refuses_a_newer_one(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT + 1, "rows": 3}))
    with pytest.raises(RunFileFormatError, match=f"format {FORMAT + 1}, newer"):
        read_manifest(tmp_path)


def test_load_meta_is_none_without_a_meta_and_typed_with_one(tmp_path: Path) -> None:
    assert load_meta(tmp_path) is None
    (tmp_path / META).write_text("{not json")
    assert load_meta(tmp_path) is None
    (tmp_path / META).write_text(json.dumps(RunMeta(run_id="x", ranks=(MetaRank(0, "a", 2),)).to_json()))
    meta = load_meta(tmp_path)
    assert meta is not None and meta.ranks == (MetaRank(0, "a", 2),)


def test_a_map_output_row_is_read_by_its_index_and_a_torn_line_is_none() -> None:
    from coordinator.run.rundir import OutputRow, parse_output_row

    assert parse_output_row('{"score": 0.5, "index": 3}') == OutputRow(3, '{"index": 3, "score": 0.5}')
    assert parse_output_row('{"index": 4, "text": "ab') is None  # a coordinator killed mid-write
    assert parse_output_row('[1, 2]') is None
    assert parse_output_row('{"index": true}') is None
    assert parse_output_row('{"index": "5"}') is None


def test_readers_of_events_jsonl_skip_a_torn_last_line(tmp_path: Path) -> None:
    """The coordinator appends to events.jsonl while others read it: a last line without its newline is being
    written (or was torn by a writer that died) and is left out, not counted as bad."""
    from coordinator.run.rundir import complete_lines, read_event_docs

    assert complete_lines('{"a": 1}\n{"b"') == ['{"a": 1}'] and complete_lines('{"a": 1}\n') == ['{"a": 1}']
    assert complete_lines("") == [] and complete_lines('{"a"') == []
    path = tmp_path / "events.jsonl"
    assert read_event_docs(path) == ([], 0)
    path.write_text('{"event": "step", "step": 1}\nnot json\n{"event": "step", "st')
    assert read_event_docs(path) == ([{"event": "step", "step": 1}], 1)
