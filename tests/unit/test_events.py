"""The event contract (worker.events): every kind round-trips through its wire form, the one coercion rule for
numbers, and lines that are no event become an `EventError` (never an exception)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from worker.events import (
    EVENT_TYPES,
    MAP_EVENT_TYPES,
    CheckpointEvent,
    CheckpointInvalidEvent,
    DigestEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    EventError,
    EventKind,
    EventLog,
    FinishedEvent,
    HeartbeatEvent,
    MapErrorEvent,
    MapEventKind,
    MapFinishedEvent,
    MapHeartbeatEvent,
    MapProgressEvent,
    MapStartedEvent,
    StartedEvent,
    StepEvent,
    WarningEvent,
    coerce_float,
    coerce_int,
    parse_event,
    parse_map_event,
)

BASE = {"t": 1700000000.5, "run_id": "run-1", "rank": 1}
# One full event per kind, every field set to a value of its type (what the worker writes).
FULL: dict[EventKind, Event] = {
    EventKind.STARTED: StartedEvent(**BASE, world_size=2, node="mac", batch_size=4, global_batch=8, method="sft",
                                    num_layers=16, trainable_params=10, total_params=1000, trainable_pct=1.0,
                                    trainable="trainable 1.00% (10/1000 parameters)", resumed_from=20,
                                    data_position=80, iters=100, pid=4242, host="mac.local", checkpoint_writer=True,
                                    checkpoint_dir="/ckpt", train_rows=500, valid_rows=50, packing=False,
                                    packing_reason="rows are short", strategy="pipeline", stage=1, stages=3,
                                    first_layer=1, last_layer=4, model_layers=6, micro_batches=8, schedule="1f1b",
                                    digest_peers=[1], step_tokens_median=412.5, census_tokens=[400, 425],
                                    census_new_shape=[0]),
    EventKind.STEP: StepEvent(**BASE, step=3, loss=2.5, tokens=512, total_tokens=1024, tok_s=256.0, step_time_s=2.0,
                              peak_memory=1 << 30, grad_norm=0.7, lr=1e-5, data_position=12, epoch=0, local_loss=2.4,
                              local_loss_finite=True, local_grad_norm=0.6, compute_s=1.5, compute_tok_s=341.3, new_shape=False,
                              busy_s=1.2, wait_s=0.3, nonfinite="produced",
                              nonfinite_at="computed its activations of micro-batch 0 (for stage 2)",
                              extra={"pairs": 4, "total_pairs": 8}),
    EventKind.DIGEST: DigestEvent(**BASE, step=5, params_sha256="a" * 64, optimizer_sha256="b" * 64, digest_s=0.41),
    EventKind.EVAL: EvalEvent(**BASE, step=5, val_loss=2.1, val_tokens=900, eval_time_s=0.4),
    EventKind.CHECKPOINT: CheckpointEvent(**BASE, step=5, path="/ckpt/step-5", sha256="c" * 64, writer=0),
    EventKind.CHECKPOINT_INVALID: CheckpointInvalidEvent(**BASE, step=5, path="/ckpt/step-5", reason="torn manifest"),
    EventKind.WARNING: WarningEvent(**BASE, code="no_validation_set", message="valid.jsonl is missing"),
    EventKind.HEARTBEAT: HeartbeatEvent(**BASE, step=5, phase="step", pid=4242, action="recv_act", peer=0,
                                        action_index=7),
    EventKind.FINISHED: FinishedEvent(**BASE, step=100, checkpoint="/ckpt/step-100", loss=1.9),
    EventKind.ERROR: ErrorEvent(**BASE, message="RuntimeError: boom", traceback="Traceback ...", step=5,
                                phase="step", exit_code=75, fenced=True, fault="job"),
}


def test_every_event_kind_has_a_record_and_a_full_example() -> None:
    assert set(EVENT_TYPES) == set(EventKind) == set(FULL)
    for kind, event in FULL.items():
        assert event.kind is kind
        unset = [f.name for f in fields(event) if getattr(event, f.name) is None]
        assert unset == [], f"{kind}: example leaves {unset} unset"


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_event_kind_round_trips_through_its_json_line(kind: EventKind) -> None:
    event = FULL[kind]
    line = json.dumps(event.to_json(), allow_nan=False)
    assert parse_event(line) == event
    assert parse_event(json.loads(line)) == event


@pytest.mark.parametrize("kind", list(EventKind))
def test_what_the_event_log_writes_parses_to_the_record(kind: EventKind, tmp_path: Path) -> None:
    """The writer (EventLog.emit) and the contract agree: the record's fields, emitted, read back as the record."""
    event = FULL[kind]
    log = EventLog(tmp_path / "rank1.jsonl", "run-1", 1)
    wire = event.to_json()
    log.emit(kind, **{k: v for k, v in wire.items() if k not in ("t", "run_id", "rank", "event")})
    log.close()
    parsed = parse_event((tmp_path / "rank1.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert isinstance(parsed, type(event))
    assert parsed == type(event)(**{**{f.name: getattr(event, f.name) for f in fields(event)}, "t": parsed.t})


@pytest.mark.parametrize("last", [EventKind.FINISHED, EventKind.ERROR])
def test_a_ranks_last_word_stays_its_last_line(last: EventKind, tmp_path: Path) -> None:
    """The heartbeat thread beats until the process stops it, after `finished`/`error`: a beat that lands in
    between is dropped, so every reader finds the last word last (CI met a finished run ending in a heartbeat)."""
    log = EventLog(tmp_path / "rank0.jsonl", "run-1", 0)
    log.emit(EventKind.HEARTBEAT, step=1, phase="step", pid=1)
    log.emit(last, step=2)
    log.emit(EventKind.HEARTBEAT, step=2, phase="idle", pid=1)
    log.close()
    log.emit(EventKind.WARNING, code="late", message="after close")
    events = [json.loads(line)["event"] for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert events == ["heartbeat", str(last)]


@pytest.mark.parametrize(("value", "expected"), [
    (3, 3), (3.0, 3), (-2.0, -2), (None, None), (3.5, None), ("3", None), (True, None), (float("inf"), None), ([3], None),
])
def test_one_rule_for_integers(value: object, expected: int | None) -> None:
    assert coerce_int(value) == expected
    parsed = parse_event({"event": "step", "step": value})
    assert isinstance(parsed, StepEvent) and parsed.step == expected
    # A value that is present but not an int is named, so a reader can tell "absent" from "garbled".
    assert parsed.invalid == ({} if value is None or expected is not None else {"step": value})


@pytest.mark.parametrize(("value", "expected"), [
    (2, 2.0), (2.5, 2.5), (None, None), (float("nan"), None), ("2.5", None), (False, None),
])
def test_one_rule_for_floats(value: object, expected: float | None) -> None:
    assert coerce_float(value) == expected
    parsed = parse_event({"event": "step", "loss": value})
    assert isinstance(parsed, StepEvent) and parsed.loss == expected


def test_a_bad_field_costs_only_that_field() -> None:
    parsed = parse_event({"event": "error", "message": "boom", "step": "five", "fenced": "yes", "rank": 0})
    assert isinstance(parsed, ErrorEvent)
    assert (parsed.message, parsed.step, parsed.fenced, parsed.rank) == ("boom", None, None, 0)
    assert parsed.invalid == {"step": "five", "fenced": "yes"}


def test_a_partial_event_has_none_fields_and_unknown_keys_are_kept() -> None:
    parsed = parse_event({"event": "started", "node": "mac", "attempt": 2, "rank": 0})
    assert isinstance(parsed, StartedEvent)
    assert (parsed.node, parsed.pid, parsed.t, parsed.invalid, parsed.extra) == ("mac", None, None, {}, {"attempt": 2})


@pytest.mark.parametrize(("line", "reason", "kind"), [
    ("not json", "not JSON", None),
    ("[1, 2]", "not a JSON object", None),
    ('{"rank": 0}', "no event kind", None),
    ('{"event": 7}', "no event kind", None),
    ('{"event": "incident", "kind": "hang"}', "unknown event kind 'incident'", "incident"),
])
def test_a_line_that_is_no_event_is_an_event_error(line: str, reason: str, kind: str | None) -> None:
    parsed = parse_event(line)
    assert isinstance(parsed, EventError)
    assert parsed.reason.startswith(reason) and parsed.kind == kind


MAP_T = {"t": 1700000000.5}
MAP_FULL: dict[MapEventKind, Event] = {
    MapEventKind.STARTED: MapStartedEvent(**MAP_T, pid=77, rows=40, ranges=[[0, 30], [50, 60]]),
    MapEventKind.PROGRESS: MapProgressEvent(**MAP_T, done=10, rows=40, rows_per_s=2.5),
    MapEventKind.HEARTBEAT: MapHeartbeatEvent(**MAP_T, done=10, pid=77),
    MapEventKind.FINISHED: MapFinishedEvent(**MAP_T, done=40, seconds=16.0),
    MapEventKind.ERROR: MapErrorEvent(**MAP_T, message="ValueError: bad row", traceback="Traceback ..."),
}


@pytest.mark.parametrize("kind", list(MapEventKind))
def test_every_map_event_kind_round_trips(kind: MapEventKind) -> None:
    assert set(MAP_EVENT_TYPES) == set(MapEventKind) == set(MAP_FULL)
    event = MAP_FULL[kind]
    line = json.dumps(event.to_json(), allow_nan=False)
    assert parse_map_event(line) == event
    # As worker.mapper prints it and the coordinator copies it (its `src`, the channel's `node` kept as extra).
    printed = {"src": "event", "event": str(kind), **{k: v for k, v in event.to_json().items()
                                                      if k not in ("run_id", "rank", "event")}, "node": "lin"}
    parsed = parse_map_event(printed)
    assert isinstance(parsed, type(event)) and parsed.extra == {"src": "event", "node": "lin"}


def test_map_ranges_must_be_pairs_of_integers() -> None:
    ok = parse_map_event({"event": "started", "ranges": [[0, 3.0]]})
    assert isinstance(ok, MapStartedEvent) and ok.ranges == [[0, 3]]
    bad = parse_map_event({"event": "started", "ranges": [[0]]})
    assert isinstance(bad, MapStartedEvent) and bad.ranges is None and bad.invalid == {"ranges": [[0]]}
    assert isinstance(parse_map_event({"event": "step"}), EventError)
