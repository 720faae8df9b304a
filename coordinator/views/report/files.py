"""`coordinator report`, reading: a run directory's files (summary.json, plan.json, meta.json, events.jsonl) as
their decoded JSON values, each gap a line of `RunFiles.problems`. The only file I/O of a training run's report (the map report
reads map.json and manifest.json itself: coordinator/views/report_map.py). The values are read through the run
directory's contract (coordinator.run.rundir) by `model.build_report`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError
from coordinator.run.rundir import EVENTS, META, PLAN, SUMMARY, decode_event_lines, read_json_object_or_problem


class ReportError(ConfigError):
    """RUN_ID names no run directory (or one with none of summary.json, plan.json, events.jsonl)."""


@dataclass(frozen=True)
class RunFiles:
    """What a run directory holds, parsed but not interpreted. `None` = the file is missing or unreadable."""

    run_id: str
    summary: dict[str, Any] | None
    plan: dict[str, Any] | None
    events: tuple[dict[str, Any], ...]
    problems: tuple[str, ...] = ()  # files or lines that could not be read, for the report to show
    meta: dict[str, Any] | None = None  # meta.json: the ranks and thresholds the run is judged by


def _read_json_object(path: Path, problems: list[str]) -> dict[str, Any] | None:
    doc = read_json_object_or_problem(path)  # a newer format: an error naming both versions
    if isinstance(doc, str):
        problems.append(f"{path.name} {doc}")
        return None
    return doc


def parse_events(text: str) -> tuple[list[dict[str, Any]], int]:
    """events.jsonl -> (the JSON objects, number of lines that were not JSON objects): `rundir.decode_event_lines`."""
    return decode_event_lines(text.splitlines())


def read_run_files(run_root: Path, run_id: str) -> RunFiles:
    """Read `run_root/run_id/`. Raises `ReportError` when that is not a run directory; anything less (a missing
    or corrupt file, torn lines) is recorded in `RunFiles.problems`."""
    if not run_id or run_id in (".", "..") or "/" in run_id:
        raise ReportError(f"{run_id!r} is not a run id (a directory name under {run_root}/)")
    run_dir = run_root / run_id
    if not run_dir.is_dir():
        known = sorted(p.name for p in run_root.iterdir() if (p / EVENTS).exists() or
                       (p / SUMMARY).exists()) if run_root.is_dir() else []
        hint = f"; runs there: {', '.join(known[-5:])}" if known else ""
        raise ReportError(f"no run {run_id!r}: {run_dir} is not a directory{hint}")
    names = (SUMMARY, PLAN, EVENTS)
    if not any((run_dir / n).is_file() for n in names):
        raise ReportError(f"{run_dir} is not a run directory: it has none of {', '.join(names)}")
    problems: list[str] = []
    summary = _read_json_object(run_dir / SUMMARY, problems)
    plan = _read_json_object(run_dir / PLAN, problems)
    meta = _read_json_object(run_dir / META, problems) if (run_dir / META).exists() else None
    events: list[dict[str, Any]] = []
    events_path = run_dir / EVENTS
    if events_path.is_file():
        try:
            events, bad = parse_events(events_path.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            problems.append(f"events.jsonl is unreadable: {exc}")
            bad = 0
        if bad:
            problems.append(f"events.jsonl: {bad} line(s) are not JSON objects and were skipped")
    else:
        problems.append("events.jsonl is missing")
    return RunFiles(run_id, summary, plan, tuple(events), tuple(problems), meta)
