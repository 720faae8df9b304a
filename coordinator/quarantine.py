"""Quarantined nodes, persisted across runs: a node caught crashing, hanging or lying is left out of later
launches until an operator clears it (`coordinator quarantine list|clear NODE`).

State lives in `$XDG_STATE_HOME/mlx-coordinator/quarantine.json` (default `~/.local/state/...`), written
atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mlx-coordinator"


@dataclass(frozen=True)
class Entry:
    node: str
    reason: str
    run_id: str | None
    t: float
    incident: dict[str, Any]


class QuarantineStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "quarantine.json"

    def load(self) -> dict[str, Entry]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f"quarantine state is unreadable ({exc}): fix or delete it", path=str(self.path)) from exc
        return {name: Entry(name, e.get("reason", ""), e.get("run_id"), float(e.get("t", 0)), e.get("incident", {}))
                for name, e in (data.get("nodes") or {}).items()}

    def _save(self, entries: dict[str, Entry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"nodes": {e.node: {"reason": e.reason, "run_id": e.run_id, "t": e.t, "incident": e.incident}
                         for e in entries.values()}}
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def add(self, node: str, reason: str, *, run_id: str | None, incident: dict[str, Any]) -> Entry:
        entries = self.load()
        entry = Entry(node, reason, run_id, time.time(), incident)
        entries[node] = entry
        self._save(entries)
        return entry

    def clear(self, node: str) -> bool:
        entries = self.load()
        if node not in entries:
            return False
        del entries[node]
        self._save(entries)
        return True
