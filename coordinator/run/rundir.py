"""The coordinator's run directory, `runs/<run-id>/`: its file names, the format of the JSON files it writes
there, and their typed records (`RunMeta` for meta.json, `SummaryBase` for the summary.json of train and map
runs alike, `IncidentRecord` for an incident read back, `EventLine` for a line of events.jsonl). Pure but for
the `read_*`/`load_*` functions.

Format: summary.json, meta.json, plan.json, map.json and manifest.json carry `"format": FORMAT`. A file without it was written
before the key existed (format 1) and reads as before, as does a format 2 file under its older key names; a file
of a newer format than this coordinator knows is refused with a message naming both versions (`RunFileFormatError`,
exit 2), never misread.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config.inventory import load_inventory
from coordinator.errors import ConfigError
from coordinator.models import Inventory
from coordinator.planning.gpuranks import rank_node_from_name
from coordinator.planning.hostfile import Hostfile
from coordinator.run.monitor import FaultPolicy, Incident
from coordinator.run.stages import RunLayout, parse_run_layout
from worker.events import AnyEvent, AnyMapEvent, EventError, coerce_float, coerce_int, parse_event, parse_map_event

# --- layout ----------------------------------------------------------------------------------------------------

SUMMARY = "summary.json"  # the run's outcome (train: launch.RunSummary; map: mapjob.MapSummary)
META = "meta.json"  # the current attempt, for attach/stop/status (RunMeta)
PLAN = "plan.json"  # the training plan: split, batches, calibrated rates (job.py)
EVENTS = "events.jsonl"  # every rank event (with its node) and every coordinator record, all attempts
MAP_PLAN = "map.json"  # a map run's plan (its shards)
MANIFEST = "manifest.json"  # a map run's output manifest
PLAYBOOK = "playbook.yaml"  # the playbook as launched (secrets redacted)
HOSTFILE = "hostfile.json"
LAUNCHER_LOG = "launcher.log"
LAUNCHER_ARGV = "launcher.argv"
SSH_CONFIG = "ssh_config"

# Of summary.json, meta.json, plan.json, map.json, manifest.json. 1: written before the `format` key; 2: the same keys with
# `format`; 3: the one JSON vocabulary (a node is `node`, never `name`; `peak_memory_bytes`).
# The readers here take every one of them (a 1 or 2 file's old keys included).
FORMAT = 3


class RunFileFormatError(ConfigError):
    """A run file of a format this coordinator does not read (newer, or not a format number)."""


def check_format(doc: Mapping[str, Any], name: str) -> int:
    """The format of a decoded run file (`name` for the message): 1 without the key; raises
    `RunFileFormatError` for a newer or malformed one."""
    raw = doc.get("format", 1)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise RunFileFormatError(f"{name}: format {raw!r} is not a format number (this coordinator reads 1-{FORMAT})")
    if raw > FORMAT:
        raise RunFileFormatError(f"{name} is format {raw}, newer than this coordinator reads (1-{FORMAT}): "
                                 "upgrade mlx-coordinator to read this run")
    return raw


def read_json_object_or_problem(path: Path) -> dict[str, Any] | str:
    """A run file's JSON object, format-checked; or, when it is missing, unreadable or not an object, why, in words
    that follow the file's name ("is missing", "is unreadable: <error>", "is not a JSON object"); raises
    `RunFileFormatError` when it is of a format this coordinator does not read."""
    if not path.is_file():
        return "is missing"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"is unreadable: {exc}"
    if not isinstance(value, dict):
        return "is not a JSON object"
    check_format(value, str(path))
    return value


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A run file's JSON object, format-checked; None when it is missing, unreadable or not an object (callers
    say so in their own words); `RunFileFormatError` when it is of a format this coordinator does not read."""
    doc = read_json_object_or_problem(path)
    return None if isinstance(doc, str) else doc


# --- meta.json ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetaRank:
    rank: int
    node: str
    batch_size: int | None = None  # None: a hand-written or partial meta.json (status shows it all the same)
    calibrated_tokens_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "batch_size": self.batch_size,
                "calibrated_tokens_per_s": self.calibrated_tokens_per_s}


@dataclass(frozen=True, kw_only=True)
class RunMeta:
    """meta.json: what `coordinator attach|stop|status` needs to find the current attempt again."""

    run_id: str
    attempt: int = 0
    inventory: str | None = None
    nodes: tuple[str, ...] = ()
    playbook: str | None = None
    ranks: tuple[MetaRank, ...] = ()
    remote_run_dirs: Mapping[str, str] = field(default_factory=dict)
    remote_tmp_dir: str | None = None
    launcher_pid: int | None = None
    coordinator_pid: int | None = None
    split: Mapping[str, int] = field(default_factory=dict)
    left_out: tuple[Mapping[str, str], ...] = ()  # {node, reason}
    drill: bool = False
    restart_from_scratch: bool = False
    # The run's own yardsticks, so that every view judges it as its monitor did (`coordinator.run.replay`): its
    # thresholds (the playbook's `faults:` and `heartbeat_timeout`), its steps, calibration's prediction (real
    # tokens/s), and the most tokens one row of a batch can add to a step (the monitor's plausibility bound).
    # None in an older meta.json: readers use the defaults.
    faults: FaultPolicy | None = None
    iters: int | None = None
    predicted_tokens_per_s: float | None = None
    max_tokens_per_row: int | None = None
    # How the attempt's ranks share the model and the plan's memory per node (`coordinator.run.stages`): what
    # `attach` rebuilds the launch's layout from, and what the views show of the stages. None in an older one.
    layout: RunLayout | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "run_id": self.run_id, "attempt": self.attempt, "inventory": self.inventory,
                "nodes": list(self.nodes), "playbook": self.playbook, "ranks": [r.to_json() for r in self.ranks],
                "remote_run_dirs": dict(self.remote_run_dirs), "remote_tmp_dir": self.remote_tmp_dir,
                "launcher_pid": self.launcher_pid, "coordinator_pid": self.coordinator_pid,
                "split": dict(self.split), "left_out": [dict(x) for x in self.left_out], "drill": self.drill,
                "restart_from_scratch": self.restart_from_scratch,
                "faults": dataclasses.asdict(self.faults) if self.faults is not None else None,
                "iters": self.iters, "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "max_tokens_per_row": self.max_tokens_per_row,
                "layout": self.layout.to_json() if self.layout is not None else None}


def parse_faults(value: Any) -> FaultPolicy | None:
    """meta.json's `faults` -> the run's `FaultPolicy`; None when absent. A key missing or mistyped keeps the
    default (a reader can always judge), a key it does not know is ignored."""
    if not isinstance(value, Mapping):
        return None
    known = {f.name: f.type for f in dataclasses.fields(FaultPolicy)}
    args: dict[str, Any] = {}
    for key, kind in known.items():
        raw = value.get(key)
        number = coerce_int(raw) if kind == "int" else coerce_float(raw)
        if number is not None and number >= 0:
            args[key] = number
    return FaultPolicy(**args)


def policy_from_playbook(doc: Any) -> FaultPolicy | None:
    """An older run's thresholds (its meta.json has no `faults`), from its decoded playbook: `faults:` and
    `heartbeat_timeout`, each key missing or mistyped at its default; None when `doc` is no mapping."""
    if not isinstance(doc, Mapping):
        return None
    faults = doc.get("faults")
    return parse_faults({**(faults if isinstance(faults, Mapping) else {}),
                         "heartbeat_timeout": doc.get("heartbeat_timeout")})


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_meta(doc: Mapping[str, Any], *, name: str = META, default_run_id: str = "") -> RunMeta:
    """A decoded meta.json -> `RunMeta`. Lenient where a reader can do without (a rank without a batch size, a
    missing pid); `ConfigError` naming the file for what no reader can (a rank without its number or node) and
    `RunFileFormatError` for a newer format."""
    check_format(doc, name)
    ranks = []
    for i, r in enumerate(doc.get("ranks") or []):
        if not isinstance(r, Mapping) or _opt_int(r.get("rank")) is None or not isinstance(r.get("node"), str):
            raise ConfigError(f"{name}: ranks[{i}] must be an object with an integer rank and a node name")
        rate = r.get("calibrated_tokens_per_s")
        ranks.append(MetaRank(int(r["rank"]), str(r["node"]), _opt_int(r.get("batch_size")),
                              float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None))
    nodes_raw = doc.get("nodes")
    nodes = tuple(str(n) for n in nodes_raw) if isinstance(nodes_raw, list) \
        else tuple(dict.fromkeys(r.node for r in ranks))
    left_raw = doc.get("left_out")
    left_out = tuple({"node": str(x["node"]), "reason": str(x.get("reason", ""))}
                     for x in left_raw if isinstance(x, Mapping) and "node" in x) if isinstance(left_raw, list) else ()
    dirs, split = doc.get("remote_run_dirs"), doc.get("split")
    return RunMeta(
        run_id=str(doc.get("run_id") or default_run_id), attempt=_opt_int(doc.get("attempt")) or 0,
        inventory=doc["inventory"] if isinstance(doc.get("inventory"), str) else None, nodes=nodes,
        playbook=doc["playbook"] if isinstance(doc.get("playbook"), str) else None, ranks=tuple(ranks),
        remote_run_dirs={str(k): str(v) for k, v in dirs.items()} if isinstance(dirs, Mapping) else {},
        remote_tmp_dir=doc["remote_tmp_dir"] if isinstance(doc.get("remote_tmp_dir"), str) else None,
        launcher_pid=_opt_int(doc.get("launcher_pid")), coordinator_pid=_opt_int(doc.get("coordinator_pid")),
        split={str(k): v for k, v in split.items() if _opt_int(v) is not None} if isinstance(split, Mapping) else {},
        left_out=left_out, drill=bool(doc.get("drill")), restart_from_scratch=bool(doc.get("restart_from_scratch")),
        faults=parse_faults(doc.get("faults")), iters=coerce_int(doc.get("iters")),
        predicted_tokens_per_s=coerce_float(doc.get("predicted_tokens_per_s")) or None,
        max_tokens_per_row=coerce_int(doc.get("max_tokens_per_row")), layout=parse_run_layout(doc.get("layout")))


def run_inventory(meta: RunMeta, inventory: str | None) -> Inventory:
    """The run's nodes out of `inventory` (default: the one it was launched with), in meta.json's order: a node with
    several GPUs ran as its rank nodes (`machine/gpu<i>`). ConfigError naming what the inventory lacks."""
    path = inventory or meta.inventory
    if not path:
        raise ConfigError("the run does not record its inventory: pass -i INVENTORY")
    inv = load_inventory(path)
    by_name = {n.name: n for n in inv.nodes}
    nodes = [by_name.get(name) or rank_node_from_name(inv, name) for name in meta.nodes]
    missing = [name for name, node in zip(meta.nodes, nodes, strict=True) if node is None]
    if missing:
        raise ConfigError(f"the inventory {path} lacks the run's node(s) {', '.join(missing)}")
    return Inventory(tuple(n for n in nodes if n is not None), inv.path)


def read_meta(run_dir: Path) -> RunMeta:
    """runs/<id>/meta.json, for attach and stop: ConfigError (exit 2) when it is missing or unreadable."""
    path = run_dir / META
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no run at {run_dir} (missing {META}): see `ls {run_dir.parent}`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"unreadable run metadata: {exc}", path=str(path)) from None
    if not isinstance(doc, dict):
        raise ConfigError("unreadable run metadata: not a JSON object", path=str(path))
    return parse_meta(doc, name=str(path), default_run_id=run_dir.name)


def load_meta(run_dir: Path) -> RunMeta | None:
    """runs/<id>/meta.json for a reader that lists runs (the dashboard): None when it is missing, unreadable or
    not an object (not a run directory, or one being created); ConfigError (a `RunFileFormatError` included)
    when it is a meta.json no reader can use (a newer format, a rank without its number or node)."""
    path = run_dir / META
    doc = read_json_object(path)
    return None if doc is None else parse_meta(doc, name=str(path), default_run_id=run_dir.name)


# --- summary.json ------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SummaryBase:
    """What the summary.json of every run kind says (launch.RunSummary and mapjob.MapSummary add their own)."""

    run_id: str
    state: str
    nodes: list[dict[str, Any]]
    split: dict[str, float]
    incidents: list[Incident] = field(default_factory=list)
    run_dir: str = ""
    message: str = ""
    quarantined: list[str] = field(default_factory=list)
    left_out: list[dict[str, str]] = field(default_factory=list)  # inventory nodes it started without: {node, reason}

    def base_json(self) -> dict[str, Any]:
        # str(state): a RunState writes its word, never an enum's repr.
        return {"format": FORMAT, "run_id": self.run_id, "state": str(self.state), "nodes": self.nodes,
                "split": self.split, "incidents": [i.to_json() for i in self.incidents], "run_dir": self.run_dir,
                "message": self.message, "quarantined": self.quarantined, "degraded": bool(self.left_out),
                "left_out": self.left_out}



# --- incident records (events.jsonl's `incident` lines, summary.json's `incidents`) --------------------------------


@dataclass(frozen=True)
class IncidentRecord:
    """An incident as written by `monitor.Incident.to_json` (plus `attempt` on its events.jsonl line), read back
    under the events' number rule (worker.events). Absent or mistyped fields are None: each reader shows its
    own placeholder. `evidence` is whatever JSON value was written (an object, or text in older files)."""

    kind: str | None = None
    node: str | None = None
    rank: int | None = None
    step: int | None = None
    action: str | None = None
    detected_after_s: float | None = None
    evidence: Any = None
    t: float | None = None
    attempt: int | None = None


def parse_incident_record(doc: Mapping[str, Any]) -> IncidentRecord:
    def text(key: str) -> str | None:
        value = doc.get(key)
        return value if isinstance(value, str) else None

    return IncidentRecord(kind=text("kind"), node=text("node"), rank=coerce_int(doc.get("rank")),
                          step=coerce_int(doc.get("step")), action=text("action"),
                          detected_after_s=coerce_float(doc.get("detected_after_s")), evidence=doc.get("evidence"),
                          t=coerce_float(doc.get("t")), attempt=coerce_int(doc.get("attempt")))


# --- events.jsonl lines ------------------------------------------------------------------------------------------

# The keys every line of events.jsonl may carry around its content: the kind, the time, who (the coordinator adds
# `node` to its copy of a rank's event, whose own `rank` and `run_id` it keeps). `EventLine.payload` is the rest.
_ENVELOPE = ("node", "rank", "event", "t", "run_id")


@dataclass(frozen=True)
class EventLine:
    """One line of the coordinator's events.jsonl, read back. The coordinator writes four kinds of line there
    (coordinator.run.launch, mapjob, resume): a rank's event as it arrived, with the rank's node and the attempt
    added (`{"node", "rank", **event, "attempt"}`; an older coordinator's file has no `attempt` there); an
    `incident` (`{"event": "incident", "attempt", **Incident.to_json()}`, a map run's without `attempt`); its own
    records (`supervisor` with `node: "coordinator"`, `attempt` and `t`; `checkpoint_invalid`; a map run's
    `reassigned`). Every field is None where absent or mistyped, under the events' number rule (worker.events).

    `event` is the line read as a worker's event (`worker.events.parse_event`, or `parse_map_event` for a map
    run's file): an `EventError` for the coordinator's own records. `incident` is set on `incident` lines only.
    `payload` is the line's keys other than the envelope (node, rank, event, t, run_id) as written, in order:
    what a reader shows of a record it does not model."""

    kind: str | None  # the `event` key, whatever it names (a worker's event kind, `incident`, `supervisor`, ...)
    t: float | None  # a rank's event: the worker's unix time; an incident: the coordinator's monotonic clock
    node: str | None
    rank: int | None
    attempt: int | None  # the coordinator's word: on its records and its copy of a rank's event (older files: none)
    event: AnyEvent | AnyMapEvent | EventError
    incident: IncidentRecord | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)


def parse_event_line(doc: Mapping[str, Any], *, map_run: bool = False) -> EventLine:
    """A decoded events.jsonl line -> `EventLine` (`map_run`: read its event as a map worker's). Never fails."""
    kind, node = doc.get("event"), doc.get("node")
    kind = kind if isinstance(kind, str) else None
    return EventLine(kind=kind, t=coerce_float(doc.get("t")), node=node if isinstance(node, str) else None,
                     rank=coerce_int(doc.get("rank")), attempt=coerce_int(doc.get("attempt")),
                     event=parse_map_event(doc) if map_run else parse_event(doc),
                     incident=parse_incident_record(doc) if kind == "incident" else None,
                     payload={str(k): v for k, v in doc.items() if k not in _ENVELOPE})


class AttemptCounter:
    """Names the attempt (0-based) of each events.jsonl line fed to it in file order, from the coordinator's own
    records, never from the order of the ranks' lines (events.jsonl interleaves the nodes' followers: one rank's
    `started, step 1` can land before another rank's `started`).

    A line that carries `attempt` (the coordinator writes it on its copy of every rank event, on incidents and on
    its supervisor records) is in that attempt. `launch --resume RUN_ID` appends a new session to the same file and
    numbers its attempts from 0 again: a rank `started` again (another process: another `t`) under an attempt
    number it already started under begins a new session (every attempt starts each of its ranks exactly once),
    whose attempts follow the earlier ones (`base`: the first attempt of the newest session). The same `started`
    copied again (its `t` unchanged) is `coordinator attach` reading the ranks' files again from their start:
    no new attempt; `rereads` counts those re-reads (a reader that folds the lines starts over at each).

    A rank event of an older file, which has no `attempt`, is in the attempt of its rank's latest `started` so far
    (rank 0 is in every attempt); `attempts`, summary.json's count when the run was not resumed, caps those. Never
    fails."""

    def __init__(self, attempts: int | None = None) -> None:
        self.last = None if attempts is None else max(0, attempts - 1)
        self.base = 0
        self.top = -1  # the highest attempt named so far
        self.started: dict[int, dict[int, float | None]] = {}  # newest session: attempt -> rank -> its start's t
        self.reread: dict[int, set[int]] = {}  # attempt -> ranks whose `started` the latest re-read copied again
        self.rereads = 0
        self.starts: dict[int, int] = {}  # an older file's: rank -> its `started` lines so far

    def attempt_of(self, line: EventLine) -> int:
        rank = line.rank if line.rank is not None else 0
        if line.attempt is not None and line.attempt >= 0:
            if line.kind == "started":
                seen = self.started.setdefault(line.attempt, {})
                if rank in seen and seen[rank] == line.t:  # the same event again: a re-read (attach)
                    again = self.reread.setdefault(line.attempt, set())
                    if not again or rank in again:
                        again.clear()
                        self.rereads += 1
                    again.add(rank)
                elif rank in seen:  # another process under the same number: a resumed session
                    self.base, self.started, self.reread = self.top + 1, {line.attempt: {rank: line.t}}, {}
                else:
                    seen[rank] = line.t
            attempt = self.base + line.attempt
        else:
            if line.kind == "started":
                self.starts[rank] = self.starts.get(rank, 0) + 1
            attempt = max(0, self.starts.get(rank, 0) - 1)
            attempt = attempt if self.last is None else min(attempt, self.last)
        self.top = max(self.top, attempt)
        return attempt


def assign_attempts(lines: Sequence[EventLine], attempts: int | None = None) -> list[int]:
    """The attempt of each line (`AttemptCounter`)."""
    counter = AttemptCounter(attempts)
    return [counter.attempt_of(line) for line in lines]


def decode_event_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """events.jsonl's lines -> (their JSON objects, the number of lines that were not JSON objects). Blank lines
    are skipped; a torn last line (the coordinator was killed mid-write) is one bad line, not a failure."""
    docs: list[dict[str, Any]] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(value, dict):
            docs.append(value)
        else:
            bad += 1
    return docs, bad


def complete_lines(text: str) -> list[str]:
    """The complete lines of a growing JSON-lines file's text: a last line without its newline is being written
    (or was torn by a writer that died mid-line) and is left out, never read as a bad or a shorter record."""
    lines = text.split("\n")
    lines.pop()  # after the last newline: "" when the text ends with one, else the torn line
    return lines


def read_event_docs(path: Path) -> tuple[list[dict[str, Any]], int]:
    """events.jsonl's complete lines as JSON objects, and how many were not; a missing file is none. Safe on a
    file still being appended to (`complete_lines`)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    return decode_event_lines(complete_lines(text))


# --- summary.json read back ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SummaryNode:
    """One row of summary.json's `nodes` (a training run's rank, or a map run's node), every field optional."""

    name: str | None = None
    rank: int | None = None
    batch_size: int | None = None
    state: str | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None  # the rank's rate (coordinator.run.replay; an older summary: its last step's)
    verdict: str | None = None  # coordinator.run.monitor.Verdict (an older summary has none)
    calibrated_tokens_per_s: float | None = None
    peak_memory: int | None = None
    checkpoint: str | None = None
    # a map run's node
    rows: int | None = None
    rows_done: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()  # [start, end) row ranges; malformed pairs are left out
    examples_per_s_calibrated: float | None = None
    rows_per_s: float | None = None
    finished_after_s: float | None = None


def _ranges(value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        return ()
    pairs = [(coerce_int(x[0]), coerce_int(x[1])) for x in value if isinstance(x, list) and len(x) == 2]
    return tuple((a, b) for a, b in pairs if a is not None and b is not None)


@dataclass(frozen=True)
class RecoveryRecord:
    """One of summary.json's `recoveries` (a relaunch, job.py) read back; None or empty where absent or mistyped
    (`resumed_from` and `first_step_after_s` are absent when the run ended before the relaunch resumed/ended)."""

    attempt: int | None = None
    culprits: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    failed_step: int | None = None
    resumed_from: int | None = None
    first_step_after_s: float | None = None


@dataclass(frozen=True)
class ReassignmentRecord:
    """One of a map summary's `reassignments` read back: `rows` of node `source` (`from` on the wire) moved to
    the nodes of `to`, each with its [start, end) row ranges."""

    source: str | None = None
    rows: int | None = None
    to: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in value) if isinstance(value, list) else ()


def parse_recovery(doc: Mapping[str, Any]) -> RecoveryRecord:
    return RecoveryRecord(attempt=coerce_int(doc.get("attempt")), culprits=_names(doc.get("culprits")),
                          nodes=_names(doc.get("nodes")), failed_step=coerce_int(doc.get("failed_step")),
                          resumed_from=coerce_int(doc.get("resumed_from")),
                          first_step_after_s=coerce_float(doc.get("first_step_after_s")))


def parse_reassignment(doc: Mapping[str, Any]) -> ReassignmentRecord:
    source, to = doc.get("from"), doc.get("to")
    return ReassignmentRecord(source=source if isinstance(source, str) else None, rows=coerce_int(doc.get("rows")),
                              to={str(k): _ranges(v) for k, v in to.items()} if isinstance(to, Mapping) else {})


@dataclass(frozen=True)
class SummaryFile:
    """summary.json as read back by `report`, `status` and `stop`: what every run kind writes (SummaryBase) and
    a training run's own fields, None (or empty) where absent or mistyped, under the events' number rule."""

    format: int = FORMAT
    run_id: str | None = None
    kind: str = "train"
    state: str | None = None
    steps: int | None = None
    iters: int | None = None
    message: str | None = None
    checkpoint: str | None = None
    tokens_per_s: float | None = None
    predicted_tokens_per_s: float | None = None
    attempts: int | None = None  # of its session: a resumed run's count starts again at its resume
    resumed: bool = False  # `launch --resume`: events.jsonl holds the earlier sessions' lines too
    nodes: tuple[SummaryNode, ...] = ()
    split: Mapping[str, float] | None = None  # None: absent or not an object (readers fall back to plan.json's)
    incidents: tuple[IncidentRecord, ...] | None = None  # None: absent or not a list
    quarantined: tuple[str, ...] = ()
    recoveries: tuple[RecoveryRecord, ...] = ()
    left_out: tuple[tuple[str, str], ...] | None = None  # (node, reason); None: absent (older summaries)
    # a map run's (kind "map")
    rows: int | None = None
    rows_done: int | None = None
    finish_spread: float | None = None
    output: str | None = None
    manifest: str | None = None
    reassignments: tuple[ReassignmentRecord, ...] = ()


def parse_summary(doc: Mapping[str, Any], *, name: str = SUMMARY) -> SummaryFile:
    """A decoded summary.json -> `SummaryFile`; RunFileFormatError for a newer format. Never fails on content."""
    version = check_format(doc, name)

    def text(d: Mapping[str, Any], key: str) -> str | None:
        value = d.get(key)
        return value if isinstance(value, str) else None

    def rows(key: str) -> list[Mapping[str, Any]]:
        value = doc.get(key)
        return [x for x in value if isinstance(x, Mapping)] if isinstance(value, list) else []

    nodes = tuple(SummaryNode(
        name=text(n, "node") or text(n, "name"), rank=coerce_int(n.get("rank")), batch_size=coerce_int(n.get("batch_size")),
        state=text(n, "state"), step=coerce_int(n.get("step")), loss=coerce_float(n.get("loss")),
        tokens_per_s=coerce_float(n.get("tokens_per_s")), verdict=text(n, "verdict"),
        calibrated_tokens_per_s=coerce_float(n.get("calibrated_tokens_per_s")),
        peak_memory=coerce_int(n.get("peak_memory_bytes", n.get("peak_memory"))), checkpoint=text(n, "checkpoint"),
        rows=coerce_int(n.get("rows")), rows_done=coerce_int(n.get("rows_done")), ranges=_ranges(n.get("ranges")),
        examples_per_s_calibrated=coerce_float(n.get("examples_per_s_calibrated")),
        rows_per_s=coerce_float(n.get("rows_per_s")), finished_after_s=coerce_float(n.get("finished_after_s")))
        for n in rows("nodes"))
    split_raw = doc.get("split")
    split = {str(k): f for k, v in split_raw.items() if (f := coerce_float(v)) is not None} \
        if isinstance(split_raw, Mapping) else None
    quarantined = doc.get("quarantined")
    left_raw = doc.get("left_out")
    return SummaryFile(
        format=version, run_id=text(doc, "run_id"), kind=text(doc, "kind") or "train", state=text(doc, "state"),
        steps=coerce_int(doc.get("steps")), iters=coerce_int(doc.get("iters")), message=text(doc, "message"),
        checkpoint=text(doc, "checkpoint"), tokens_per_s=coerce_float(doc.get("tokens_per_s")),
        predicted_tokens_per_s=coerce_float(doc.get("predicted_tokens_per_s")),
        attempts=coerce_int(doc.get("attempts")), resumed=isinstance(doc.get("resumed_from"), Mapping),
        nodes=nodes, split=split,
        incidents=tuple(parse_incident_record(i) for i in rows("incidents"))
        if isinstance(doc.get("incidents"), list) else None,
        quarantined=tuple(str(q) for q in quarantined) if isinstance(quarantined, list) else (),
        recoveries=tuple(parse_recovery(r) for r in rows("recoveries")),
        left_out=tuple((str(x["node"]), str(x.get("reason", ""))) for x in left_raw
                       if isinstance(x, Mapping) and "node" in x) if isinstance(left_raw, list) else None,
        rows=coerce_int(doc.get("rows")), rows_done=coerce_int(doc.get("rows_done")),
        finish_spread=coerce_float(doc.get("finish_spread")), output=text(doc, "output"),
        manifest=text(doc, "manifest"), reassignments=tuple(parse_reassignment(x) for x in rows("reassignments")))


def read_summary(run_dir: Path) -> SummaryFile | None:
    """runs/<id>/summary.json, typed; None when it is missing or unreadable (the run has not ended, or its
    coordinator died first); `RunFileFormatError` for a newer format."""
    path = run_dir / SUMMARY
    doc = read_json_object(path)
    return None if doc is None else parse_summary(doc, name=str(path))


def read_hostfile(run_dir: Path) -> Hostfile:
    """runs/<id>/hostfile.json (the attempt's mlx hostfile), for adopting a run: ConfigError naming the file when
    it is missing or not a hostfile."""
    path = run_dir / HOSTFILE
    doc = read_json_object(path)
    if doc is None or not isinstance(doc.get("hosts"), list) \
            or not all(isinstance(h, Mapping) and isinstance(h.get("ssh"), str) for h in doc["hosts"]):
        raise ConfigError("missing or unreadable hostfile (a list of hosts, each with its ssh name)", path=str(path))
    return Hostfile.from_json(doc)


# --- plan.json --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveRecord:
    """One measured point of a node's calibration curve, as plan.json and `calibrate --json` write it."""

    batch: int
    tokens_per_s: float
    peak_memory_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "tokens_per_s": self.tokens_per_s, "peak_memory_bytes": self.peak_memory_bytes}


@dataclass(frozen=True)
class PlanNode:
    """One node of a calibrated plan: its predicted rate at its planned batch (what its share is proportional
    to), and the curve it was measured on (calibrate.build_plan_nodes)."""

    node: str
    tokens_per_s: float
    batch_size: int
    share: float
    curve: tuple[CurveRecord, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "tokens_per_s": self.tokens_per_s, "batch_size": self.batch_size,
                "share": self.share, "curve": [p.to_json() for p in self.curve]}


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    """plan.json as job.py writes it, one per attempt: the split, batches and, for a calibrated plan, each
    node's curve (`nodes` is empty for a plan that measured nothing)."""

    split: Mapping[str, float]
    batch: Mapping[str, int]
    global_batch: int
    mode: str
    predicted_tokens_per_s: float | None
    backend: str
    attempt: int
    nodes: tuple[PlanNode, ...] = ()
    # The strategy weighed (planning.strategy.StrategyChoice.to_json: the chosen plan's table and every
    # candidate's line); None where nothing was weighed (dp or fsdp forced, sizes unknown).
    strategy: Mapping[str, Any] | None = None
    # The predicted step and its gradient exchange (planning.collective.CollectiveCost.to_json), where measured
    step: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "nodes": [n.to_json() for n in self.nodes], "split": dict(self.split),
                **({"step": dict(self.step)} if self.step is not None else {}),
                "batch": dict(self.batch), "global_batch": self.global_batch, "mode": self.mode,
                "predicted_tokens_per_s": self.predicted_tokens_per_s, "backend": self.backend,
                "attempt": self.attempt, "units": dict(RATE_UNITS),
                **({"strategy": dict(self.strategy)} if self.strategy is not None else {})}


# The unit of each rate in plan.json and `calibrate --json`: a node's rate (and the plan's prediction) is real
# tokens/s, what training reports; the bench's curve counts every position of its rows, padding included.
RATE_UNITS = {"tokens_per_s": "real tokens/s", "predicted_tokens_per_s": "real tokens/s",
              "curve.tokens_per_s": "padded positions/s"}


# --- plan.json read back -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFile:
    """plan.json as `report` reads it back (job.py writes the plan with its calibration curves; the fields
    here are the ones a reader uses), None or empty where absent or mistyped."""

    format: int = FORMAT
    split: Mapping[str, float] | None = None
    batch: Mapping[str, int] = field(default_factory=dict)
    node_tokens_per_s: Mapping[str, float | None] = field(default_factory=dict)  # its `nodes` rows' calibrated rates
    global_batch: int | None = None
    mode: str | None = None
    backend: str | None = None
    predicted_tokens_per_s: float | None = None
    attempt: int | None = None


def parse_plan(doc: Mapping[str, Any], *, name: str = PLAN) -> PlanFile:
    """A decoded plan.json -> `PlanFile`; RunFileFormatError for a newer format. Never fails on content."""
    version = check_format(doc, name)
    split_raw, batch_raw, nodes_raw = doc.get("split"), doc.get("batch"), doc.get("nodes")
    return PlanFile(
        format=version,
        split={str(k): f for k, v in split_raw.items() if (f := coerce_float(v)) is not None}
        if isinstance(split_raw, Mapping) else None,
        batch={str(k): b for k, v in batch_raw.items() if (b := coerce_int(v)) is not None}
        if isinstance(batch_raw, Mapping) else {},
        node_tokens_per_s={str(n.get("node", n.get("name"))): coerce_float(n.get("tokens_per_s")) for n in nodes_raw
                           if isinstance(n, Mapping)} if isinstance(nodes_raw, list) else {},
        global_batch=coerce_int(doc.get("global_batch")),
        mode=doc["mode"] if isinstance(doc.get("mode"), str) else None,
        backend=doc["backend"] if isinstance(doc.get("backend"), str) else None,
        predicted_tokens_per_s=coerce_float(doc.get("predicted_tokens_per_s")), attempt=coerce_int(doc.get("attempt")))


@dataclass(frozen=True)
class MapPlanFile:
    """map.json (a map run's plan, mapjob.run_map) as the map report reads it back."""

    format: int = FORMAT
    rows: int | None = None
    task: str | None = None  # the playbook's map.task (score | generate | command)
    split: Mapping[str, float] | None = None


def parse_map_plan(doc: Mapping[str, Any], *, name: str = MAP_PLAN) -> MapPlanFile:
    """A decoded map.json -> `MapPlanFile`; RunFileFormatError for a newer format. Never fails on content."""
    version = check_format(doc, name)
    task, split_raw = doc.get("task"), doc.get("split")
    return MapPlanFile(
        format=version, rows=coerce_int(doc.get("rows")),
        task=task["task"] if isinstance(task, Mapping) and isinstance(task.get("task"), str) else None,
        split={str(k): f for k, v in split_raw.items() if (f := coerce_float(v)) is not None}
        if isinstance(split_raw, Mapping) else None)



# --- manifest.json (a map run's output) ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MapManifest:
    """manifest.json, written by mapjob when every row came back: the gathered output, its digest and how many
    rows each node produced. Read back (`parse_manifest`) with every field optional, None or empty where absent
    or mistyped."""

    run_id: str | None = None
    rows: int | None = None
    output: str | None = None
    sha256: str | None = None
    input: str | None = None
    task: str | None = None
    rows_by_node: Mapping[str, int] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "run_id": self.run_id, "rows": self.rows, "output": self.output,
                "sha256": self.sha256, "input": self.input, "task": self.task,
                "rows_by_node": dict(self.rows_by_node)}


def parse_manifest(doc: Mapping[str, Any], *, name: str = MANIFEST) -> MapManifest:
    """A decoded manifest.json -> `MapManifest`; RunFileFormatError for a newer format. Never fails on content."""
    version = check_format(doc, name)

    def text(key: str) -> str | None:
        value = doc.get(key)
        return value if isinstance(value, str) else None

    by_node = doc.get("rows_by_node")
    return MapManifest(
        format=version, run_id=text("run_id"), rows=coerce_int(doc.get("rows")), output=text("output"),
        sha256=text("sha256"), input=text("input"), task=text("task"),
        rows_by_node={str(k): n for k, v in by_node.items() if (n := coerce_int(v)) is not None}
        if isinstance(by_node, Mapping) else {})


def read_manifest(run_dir: Path) -> MapManifest | None:
    """runs/<id>/manifest.json, typed; None when it is missing or unreadable (the map report says which, as it
    knows whether the run finished); `RunFileFormatError` for a newer format."""
    path = run_dir / MANIFEST
    doc = read_json_object(path)
    return None if doc is None else parse_manifest(doc, name=str(path))


# --- a map run's output parts (runs/<id>/parts/<node>.jsonl) ------------------------------------------------------


@dataclass(frozen=True)
class OutputRow:
    """One row of a map run's output part: the task's own JSON object (any keys), placed by its `index`."""

    index: int
    canonical: str  # the object as the gathered output writes it (sorted keys)


def parse_output_row(line: str) -> OutputRow | None:
    """A part file's line as an OutputRow; None for a line that is not a JSON object with an integer `index` (a
    truncated last line, from a coordinator killed mid-write, is such a line)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    index = obj.get("index") if isinstance(obj, dict) else None
    if not isinstance(index, int) or isinstance(index, bool):
        return None
    return OutputRow(index, json.dumps(obj, sort_keys=True))
