"""Per-rank JSONL event log and the heartbeat thread.

Contract (read by the coordinator over SSH via `worker.follow`): `<run_dir>/events/rank<R>.jsonl`, one writer
per file (this process), append-only, one JSON object per line, flushed after every line. Every event carries
`{"t": unix_time, "run_id": str, "rank": int, "event": kind}` plus the fields listed in `EventKind`.
Non-finite floats are written as null (JSON has no NaN). Stdlib only, Python 3.9+.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, TextIO, Union


class _StrEnum(str, Enum):
    """`enum.StrEnum` for Python 3.9: members are their values as strings (==, hash, json, str() and format)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


class EventKind(_StrEnum):
    """Event kinds and their fields (beyond t, run_id, rank, event)."""

    STARTED = "started"  # world_size, node, batch_size, global_batch, method, num_layers (resolved count),
    #                      trainable_params, total_params, trainable_pct (percent), trainable (text: "trainable
    #                      0.54% (a/b parameters)"), resumed_from (step or null), data_position, iters, pid, host,
    #                      checkpoint_writer (bool), checkpoint_dir, train_rows, valid_rows, packing (bool),
    #                      packing_reason (text: why the run packs rows into sequences, or why not);
    #                      a pipeline rank adds strategy ("pipeline"), stage, stages, first_layer, last_layer
    #                      (exclusive), model_layers, micro_batches, schedule, digest_peers (the ranks whose
    #                      digests must equal its own: itself only, a stage has no replica); rank 0 of a run
    #                      with `token_census` adds step_tokens_median (its steps' median real tokens),
    #                      census_tokens (each counted step's real tokens, all ranks) and census_new_shape (the
    #                      indices into census_tokens of the steps on which a rank meets a new batch shape)
    STEP = "step"  # step, loss (global mean per token), tokens (this rank), total_tokens (all ranks), tok_s (this
    #                rank, per second of step wall time), step_time_s, peak_memory (bytes), grad_norm, lr,
    #                data_position (global rows consumed), epoch; and this rank's own values before the
    #                all_sum: local_loss (its loss sum / its tokens; null when not finite), local_loss_finite
    #                (bool), local_grad_norm (L2 norm of its gradient of the loss sum / its tokens), compute_s
    #                (wall time from the step's start until it enters the gradient all_sum: forward/backward
    #                of every micro-batch plus any chaos/debug slowdown, never time blocked in the collective),
    #                compute_tok_s (tokens / compute_s), new_shape (bool: the step's batch shape is new to this
    #                rank's process, which traced and compiled it: a one-time cost the run's rate leaves out).
    #                A `lie` chaos rank reports step+1000 and 10x tokens, tok_s, compute_tok_s.
    #                When the global loss is not finite every rank still emits its step event (so the
    #                rank whose local_loss_finite is false can be named), then an error event.
    #                A pipeline stage adds busy_s (what it computes alone: its forwards, backwards and update, any
    #                chaos/debug slowdown), wait_s (blocked on its neighbours and the closing all_sum) and,
    #                when a value at its boundary was not finite, nonfinite: "produced" (the step's first
    #                non-finite value there was one it computed from finite inputs: activations, gradients, its
    #                loss) or "received" (a neighbour sent it), with nonfinite_at (which, in words).
    DIGEST = "digest"  # step, params_sha256 (all parameters, frozen ones too), optimizer_sha256 (optimizer
    #                    state), digest_s (the seconds hashing took: outside every step's step_time_s); every
    #                    `consistency_every` steps and at the last step, after the update. Identical on honest
    #                    data-parallel replicas (SHA256 of the arrays' sums: see worker.chaos.replica_digest)
    EVAL = "eval"  # step, val_loss, val_tokens, eval_time_s
    CHECKPOINT = "checkpoint"  # step, path, sha256 (of manifest.sha256; a sharded checkpoint, fsdp or pipeline:
    #                            of the whole checkpoint's manifest, the same on every rank), writer (rank that wrote
    #                            this node's copy)
    CHECKPOINT_INVALID = "checkpoint_invalid"  # step, path, reason (skipped while looking for a resume point)
    WARNING = "warning"  # code, message
    HEARTBEAT = "heartbeat"  # step, phase, pid; a pipeline stage inside a step adds where its compute thread is
    #                          (`Progress`): action (recv_act | forward | send_act | recv_grad | backward |
    #                          send_grad | update | all_sum), peer (the stage a transfer waits on, else null),
    #                          action_index (actions begun in this step: it moves only when the compute thread does)
    FINISHED = "finished"  # step, checkpoint (path), loss
    ERROR = "error"  # message, traceback, step, phase, exit_code; fenced (true) when the rank stopped itself;
    #                  fault ("job") when every rank fails together because of the job, not of its node


class MapEventKind(_StrEnum):
    """A map worker's events (worker.mapper prints them as {"src": "event", ...}; the coordinator copies them
    into the run's events.jsonl with their `node`). Fields beyond t and event:"""

    STARTED = "started"  # pid, rows (of this work item), ranges ([[start, end], ...])
    PROGRESS = "progress"  # done, rows, rows_per_s
    HEARTBEAT = "heartbeat"  # done, pid
    FINISHED = "finished"  # done, seconds
    ERROR = "error"  # message, traceback


class Phase(_StrEnum):
    LOAD = "load"  # distributed init, model/data loading, resume
    STEP = "step"  # forward/backward, gradient all_sum, optimizer update
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    DIGEST = "digest"  # hashing parameters and optimizer state for a digest event
    SYNC = "sync"  # waiting for every rank at a barrier (after writing a checkpoint)
    IDLE = "idle"  # between phases, and after the end


# --- the typed contract: one record per event kind, and its one parser ------------------------------------------
#
# Coercion rule (the one rule every reader of events uses, through `parse_event`):
#   - null, or a field that is absent, reads as None (the writer writes non-finite floats as null);
#   - an int field takes a JSON integer, or a finite float with no fractional part (3.0 reads as 3: the same
#     number, as a writer that did arithmetic may spell it); a bool is never a number;
#   - a float field takes any JSON number (a non-finite one, which only a non-conforming writer can produce,
#     reads as None, as the writer would have written it);
#   - str and bool fields take exactly that JSON type;
#   - anything else (3.5 for a step, "3", a list) reads as None, and `Event.invalid` keeps it (field -> the value
#     as written, for a reader that shows it): a bad field never costs the rest of the event (an `error` event
#     with a bad step must still fail the rank).
# A line that is not a JSON object, or whose `event` is missing or not a known kind, is an `EventError`.


def coerce_int(value: Any) -> int | None:
    """An int under the coercion rule above, else None (for the coordinator's readers of its own records)."""
    return _as_int(value)[0]


def coerce_float(value: Any) -> float | None:
    """A float under the coercion rule above, else None."""
    return _as_float(value)[0]


def _as_int(value: Any) -> tuple[int | None, bool]:
    """(the value, whether it was valid) under the coercion rule above."""
    if value is None:
        return None, True
    if isinstance(value, bool):
        return None, False
    if isinstance(value, int):
        return value, True
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value), True
    return None, False


def _as_float(value: Any) -> tuple[float | None, bool]:
    if value is None:
        return None, True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, False
    return (float(value), True) if math.isfinite(value) else (None, True)


def _as_str(value: Any) -> tuple[str | None, bool]:
    if value is None:
        return None, True
    return (value, True) if isinstance(value, str) else (None, False)


def _as_bool(value: Any) -> tuple[bool | None, bool]:
    if value is None:
        return None, True
    return (value, True) if isinstance(value, bool) else (None, False)


def _as_ranges(value: Any) -> tuple[list[list[int]] | None, bool]:
    """[[start, end], ...] of ints (under the int rule)."""
    if value is None:
        return None, True
    if not isinstance(value, list):
        return None, False
    out: list[list[int]] = []
    for item in value:
        pair = [_as_int(x) for x in item] if isinstance(item, list) and len(item) == 2 else []
        if len(pair) != 2 or not all(ok and x is not None for x, ok in pair):
            return None, False
        out.append([x for x, _ in pair])  # type: ignore[misc]
    return out, True


def _as_ints(value: Any) -> tuple[list[int] | None, bool]:
    """[int, ...] (under the int rule)."""
    if value is None:
        return None, True
    items = [_as_int(x) for x in value] if isinstance(value, list) else []
    if not isinstance(value, list) or not all(ok and x is not None for x, ok in items):
        return None, False
    return [x for x, _ in items if x is not None], True


# Annotation (a string under `from __future__ import annotations`) -> its coercer.
_COERCE = {"int | None": _as_int, "float | None": _as_float, "str | None": _as_str, "bool | None": _as_bool,
           "list[list[int]] | None": _as_ranges, "list[int] | None": _as_ints}
_BASE = ("t", "run_id", "rank")  # every event; `event` is the kind itself


@dataclass(frozen=True)
class Event:
    """What every event carries. Subclasses add their kind's fields, all optional: readers see a partial
    event (an older worker, a chaos rank) as None fields, never as a missing key."""

    KIND: ClassVar[EventKind | MapEventKind]

    t: float | None = None  # the worker's unix time
    run_id: str | None = None
    rank: int | None = None
    # Not on the wire: the fields that were present with a value of the wrong type (read as None; see above:
    # name -> the value as written), and any fields this version does not know (kept, so a record passes through).
    invalid: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> EventKind | MapEventKind:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        """The wire form (`EventLog.emit` writes the same shape): t, run_id, rank, event, then the fields."""
        out: dict[str, Any] = {"t": self.t, "run_id": self.run_id, "rank": self.rank, "event": str(self.KIND)}
        for f in fields(self):
            if f.name not in _BASE and f.name not in ("invalid", "extra"):
                out[f.name] = getattr(self, f.name)
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return _clean(out)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class StartedEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.STARTED
    world_size: int | None = None
    node: str | None = None
    batch_size: int | None = None
    global_batch: int | None = None
    method: str | None = None
    num_layers: int | None = None
    trainable_params: int | None = None
    total_params: int | None = None
    trainable_pct: float | None = None
    trainable: str | None = None
    resumed_from: int | None = None
    data_position: int | None = None
    iters: int | None = None
    pid: int | None = None
    host: str | None = None
    checkpoint_writer: bool | None = None
    checkpoint_dir: str | None = None
    train_rows: int | None = None
    valid_rows: int | None = None
    packing: bool | None = None
    packing_reason: str | None = None
    strategy: str | None = None  # "pipeline"; absent (None) for data parallel
    stage: int | None = None
    stages: int | None = None
    first_layer: int | None = None
    last_layer: int | None = None
    model_layers: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    digest_peers: list[int] | None = None
    step_tokens_median: float | None = None  # rank 0 of a run with `token_census`: its steps' median real tokens
    census_tokens: list[int] | None = None  # and each counted step's real tokens (worker.objectives.StepCensus)
    census_new_shape: list[int] | None = None  # and which of those steps meet a new batch shape on some rank


@dataclass(frozen=True)
class StepEvent(Event):
    """DPO runs add their objective's statistics (pairs, total_pairs, ...): kept in `extra`."""

    KIND: ClassVar[EventKind] = EventKind.STEP
    step: int | None = None
    loss: float | None = None
    tokens: int | None = None
    total_tokens: int | None = None
    tok_s: float | None = None
    step_time_s: float | None = None
    peak_memory: int | None = None
    grad_norm: float | None = None
    lr: float | None = None
    data_position: int | None = None
    epoch: int | None = None
    local_loss: float | None = None
    local_loss_finite: bool | None = None
    local_grad_norm: float | None = None
    compute_s: float | None = None
    compute_tok_s: float | None = None
    new_shape: bool | None = None  # None: a worker from before the field (its steps all count)
    # A pipeline stage's step (`Pipeline.step_fields`): its own computation (forwards, backwards, the update) and
    # its time blocked on its neighbours (activation/gradient transfers, the step's closing all_sum); None for dp.
    busy_s: float | None = None
    wait_s: float | None = None
    nonfinite: str | None = None
    nonfinite_at: str | None = None


@dataclass(frozen=True)
class DigestEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.DIGEST
    step: int | None = None
    params_sha256: str | None = None
    optimizer_sha256: str | None = None
    digest_s: float | None = None


@dataclass(frozen=True)
class EvalEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.EVAL
    step: int | None = None
    val_loss: float | None = None
    val_tokens: int | None = None
    eval_time_s: float | None = None


@dataclass(frozen=True)
class CheckpointEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT
    step: int | None = None
    path: str | None = None
    sha256: str | None = None
    writer: int | None = None


@dataclass(frozen=True)
class CheckpointInvalidEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT_INVALID
    step: int | None = None
    path: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class WarningEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.WARNING
    code: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class HeartbeatEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.HEARTBEAT
    step: int | None = None
    phase: str | None = None
    pid: int | None = None
    action: str | None = None
    peer: int | None = None
    action_index: int | None = None


@dataclass(frozen=True)
class FinishedEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.FINISHED
    step: int | None = None
    checkpoint: str | None = None
    loss: float | None = None


@dataclass(frozen=True)
class ErrorEvent(Event):
    KIND: ClassVar[EventKind] = EventKind.ERROR
    message: str | None = None
    traceback: str | None = None
    step: int | None = None
    phase: str | None = None
    exit_code: int | None = None
    fenced: bool | None = None
    fault: str | None = None  # "job": every rank fails together because of the job, not of its node


AnyEvent = Union[StartedEvent, StepEvent, DigestEvent, EvalEvent, CheckpointEvent, CheckpointInvalidEvent,
                 WarningEvent, HeartbeatEvent, FinishedEvent, ErrorEvent]
EVENT_TYPES: dict[EventKind, type[Event]] = {cls.KIND: cls for cls in (
    StartedEvent, StepEvent, DigestEvent, EvalEvent, CheckpointEvent, CheckpointInvalidEvent, WarningEvent,
    HeartbeatEvent, FinishedEvent, ErrorEvent)}


@dataclass(frozen=True)
class MapStartedEvent(Event):
    KIND: ClassVar[MapEventKind] = MapEventKind.STARTED
    pid: int | None = None
    rows: int | None = None
    ranges: list[list[int]] | None = None


@dataclass(frozen=True)
class MapProgressEvent(Event):
    KIND: ClassVar[MapEventKind] = MapEventKind.PROGRESS
    done: int | None = None
    rows: int | None = None
    rows_per_s: float | None = None


@dataclass(frozen=True)
class MapHeartbeatEvent(Event):
    KIND: ClassVar[MapEventKind] = MapEventKind.HEARTBEAT
    done: int | None = None
    pid: int | None = None


@dataclass(frozen=True)
class MapFinishedEvent(Event):
    KIND: ClassVar[MapEventKind] = MapEventKind.FINISHED
    done: int | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class MapErrorEvent(Event):
    KIND: ClassVar[MapEventKind] = MapEventKind.ERROR
    message: str | None = None
    traceback: str | None = None


AnyMapEvent = Union[MapStartedEvent, MapProgressEvent, MapHeartbeatEvent, MapFinishedEvent, MapErrorEvent]
MAP_EVENT_TYPES: dict[MapEventKind, type[Event]] = {cls.KIND: cls for cls in (
    MapStartedEvent, MapProgressEvent, MapHeartbeatEvent, MapFinishedEvent, MapErrorEvent)}


@dataclass(frozen=True)
class EventError:
    """A line that is not an event: `reason` says why; `kind` is its `event` value when it had a string one."""

    reason: str
    kind: str | None = None


def parse_event(value: str | bytes | Mapping[str, Any]) -> AnyEvent | EventError:
    """One events.jsonl line (or its decoded JSON object) -> its typed event, under the coercion rule above.
    Keys other than the kind's fields (the coordinator's `node` and `attempt` on its copy, DPO statistics) are
    kept in `extra`. Never raises."""
    return _parse(value, EVENT_TYPES)  # type: ignore[arg-type,return-value]


def parse_map_event(value: str | bytes | Mapping[str, Any]) -> AnyMapEvent | EventError:
    """A map worker's event (`MapEventKind`), under the same rule as `parse_event`. Never raises."""
    return _parse(value, MAP_EVENT_TYPES)  # type: ignore[arg-type,return-value]


def _parse(value: str | bytes | Mapping[str, Any], types: Mapping[str, type[Event]]) -> Event | EventError:
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:
            return EventError(f"not JSON: {exc}")
    if not isinstance(value, Mapping):
        return EventError("not a JSON object")
    kind = value.get("event")
    if not isinstance(kind, str):
        return EventError("no event kind (the `event` key is missing or not a string)")
    cls = types.get(kind)
    if cls is None:
        return EventError(f"unknown event kind {kind!r}", kind)
    args: dict[str, Any] = {}
    invalid: dict[str, Any] = {}
    known = {"event"}
    for f in fields(cls):
        if f.name in ("invalid", "extra"):
            continue
        known.add(f.name)
        coerced, ok = _COERCE[str(f.type)](value.get(f.name))
        args[f.name] = coerced
        if not ok:
            invalid[f.name] = value.get(f.name)
    extra = {str(k): v for k, v in value.items() if k not in known}
    return cls(**args, invalid=invalid, extra=extra)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def events_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "events" / f"rank{rank}.jsonl"


_LAST_WORDS = frozenset({EventKind.FINISHED.value, EventKind.ERROR.value})


class EventLog:
    """Thread-safe appender of one rank's events (the heartbeat thread and the main thread share it).

    A rank's last word (`finished` or `error`) stays its last line: a heartbeat after it is dropped (the heartbeat
    thread runs until the process stops it, after that word), and after `close()` every event is."""

    def __init__(self, path: Path, run_id: str, rank: int) -> None:
        self.path = path
        self.run_id = run_id
        self.rank = rank
        self._lock = threading.Lock()
        self._said_last_word = False
        path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered text append: each write of a full line reaches the file at once (O_APPEND).
        self._fh: TextIO | None = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def emit(self, event: EventKind | str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time(), "run_id": self.run_id, "rank": self.rank, "event": str(event)}
        record.update(_clean(fields))
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            if self._fh is not None and not (self._said_last_word and record["event"] == EventKind.HEARTBEAT):
                self._fh.write(line)
                self._fh.flush()
            self._said_last_word = self._said_last_word or record["event"] in _LAST_WORDS
        return record

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()
                os.fsync(self._fh.fileno())
                self._fh.close()
                self._fh = None


FENCE_EXIT_CODE = 75  # a rank that fenced itself (EX_TEMPFAIL: the run can resume from its checkpoints)
# Phases that wait on the other ranks: a step's collective, the barrier after a checkpoint. (Eval waits too, but
# its length is not measured in step times; loading has no yardstick yet.)
FENCED_PHASES = frozenset({"step", "sync"})


class RecentSteps:
    """A rank's last step times, and the window they give: `factor` x their median, at least `min_s`. One rule
    for the coordinator's stall (coordinator/run/monitor.py) and the rank's own fence (`Fence`, 3x the stall)."""

    KEPT = 20

    def __init__(self) -> None:
        self.times: list[float] = []  # newest last

    def add(self, seconds: float) -> None:
        if seconds > 0:
            self.times = [*self.times[-(self.KEPT - 1):], seconds]

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def window(self, factor: float, min_s: float) -> float | None:
        """None before the first step (loading and the first, compiling step have no yardstick)."""
        median = self.median()
        return None if median is None else max(min_s, factor * median)


class Fence:
    """When a rank stops itself: it has been inside the same step, in a phase that waits on the other ranks
    (FENCED_PHASES), for `factor` x its median step time and at least `min_s` seconds of its OWN running time,
    so a stalled ring's ranks do not spin in the collective forever once no coordinator can stop them (a
    partitioned node, a lost coordinator). The coordinator calls a stall at a third of this window, so on a node
    it can reach it always acts first.

    Running time: each heartbeat tick adds the time since the previous one, capped at two intervals, so a
    process that was stopped (SIGSTOP) or a Mac that slept does not fence itself the moment it runs again.
    No clock of its own: the heartbeat thread feeds it ticks and asks whether it is due."""

    def __init__(self, factor: float, min_s: float, interval: float) -> None:
        self.factor = factor
        self.min_s = min_s
        self.cap = 2 * interval
        self.steps = RecentSteps()
        self.stalled_s = 0.0
        self._seen: tuple[int, str] | None = None

    def add_step_time(self, seconds: float) -> None:
        self.steps.add(seconds)

    def window(self) -> float | None:
        return self.steps.window(self.factor, self.min_s)

    def tick(self, elapsed: float, step: int, phase: str) -> float | None:
        """Account one heartbeat tick; the window when the rank must stop now, else None."""
        if (step, phase) != self._seen:
            self._seen = (step, phase)
            self.stalled_s = 0.0
            return None
        if phase not in FENCED_PHASES:
            return None
        self.stalled_s += min(max(elapsed, 0.0), self.cap)
        window = self.window()
        return window if window is not None and self.stalled_s > window else None


TRANSFERS = frozenset({"recv_act", "send_act", "recv_grad", "send_grad"})  # a pipeline action that waits on `peer`
COLLECTIVE = "all_sum"  # waits on every stage


class Progress:
    """Where a pipeline stage's compute thread is inside a step, for its heartbeats: the action it began last (an
    action of its schedule, `update` after it, `all_sum` for the step's collective), the stage that action waits
    on (a transfer's neighbour), and how many actions it began in this step.

    Written by the compute thread only, at each action it begins; read by the heartbeat thread (one tuple, replaced
    whole: a reader never sees half of an update). The heartbeat thread keeps beating whatever the compute thread
    does, so it is the index, which only the compute thread moves, that tells a stage that stopped producing (the
    same action for ever, not a transfer) from one that waits on a neighbour (a transfer: its peer is the one to
    look at)."""

    def __init__(self) -> None:
        self._now: tuple[str | None, int | None, int] = (None, None, 0)

    def reset(self) -> None:
        """A new step: no action begun yet."""
        self._now = (None, None, 0)

    def begin(self, action: str, peer: int | None = None) -> None:
        self._now = (action, peer, self._now[2] + 1)

    def fields(self) -> dict[str, Any]:
        action, peer, index = self._now
        return {} if action is None else {"action": action, "peer": peer, "action_index": index}


class Heartbeat:
    """Background thread emitting `heartbeat` every `interval` seconds with the main thread's step and phase.

    It never touches MLX (not thread-safe): it only reads two attributes the main thread sets. MLX releases the
    GIL while it evaluates (including blocking collectives), so heartbeats keep coming during a long step or a
    stalled all_sum; a missing heartbeat therefore means the process itself is stopped or gone. With a `fence`
    it also ends the process (an `error` event, exit FENCE_EXIT_CODE) when the fence is due."""

    MAX_INTERVAL = 2.0

    def __init__(self, log: EventLog, interval: float, *, fence: tuple[float, float] | None = None,
                 exit_fn: Any = os._exit) -> None:
        self.log = log
        self.interval = min(max(interval, 0.05), self.MAX_INTERVAL)
        self.step = 0
        self.phase = Phase.LOAD
        self.fence = Fence(fence[0], fence[1], self.interval) if fence is not None else None
        self.progress: Progress | None = None  # a pipeline stage's (its strategy's), reported while in a step
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def set(self, *, step: int | None = None, phase: Phase | None = None, step_time: float | None = None) -> None:
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
        if step_time is not None and self.fence is not None:
            self.fence.add_step_time(step_time)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval + 1.0)

    def _beat(self) -> None:
        # A full disk must not kill the thread: the main thread hits the same error on its next event and
        # fails loudly; until then keep trying.
        with contextlib.suppress(OSError):
            where = self.progress.fields() if self.progress is not None and self.phase == Phase.STEP else {}
            self.log.emit(EventKind.HEARTBEAT, step=self.step, phase=str(self.phase), pid=os.getpid(), **where)

    def _check_fence(self, elapsed: float) -> None:
        if self.fence is None:
            return
        window = self.fence.tick(elapsed, self.step, str(self.phase))
        if window is None:
            return
        with contextlib.suppress(OSError):
            self.log.emit(EventKind.ERROR, message=(
                f"fenced: step {self.step} has not ended after {self.fence.stalled_s:.0f} s of running time (window "
                f"{window:.0f} s): the ring is stalled and nothing stopped this rank"), traceback="", step=self.step,
                phase=str(self.phase), exit_code=FENCE_EXIT_CODE, fenced=True)
            self.log.close()
        self._exit(FENCE_EXIT_CODE)

    def _run(self) -> None:
        self._beat()
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            self._beat()
            self._check_fence(now - last)
            last = now
