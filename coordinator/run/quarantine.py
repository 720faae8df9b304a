"""Quarantined nodes, persisted across runs: a node caught crashing, hanging or lying is left out of later
launches of the SAME fleet for a cooldown (`faults.quarantine_for`, default 24 h; 0 = until cleared), or until an
operator clears it (`coordinator quarantine list|clear NODE`).

An entry is scoped to one machine of one inventory, like a host blacklist with a cooldown: it is keyed by the
inventory file (its real path), the node's name and its SSH address (`host[:port]`), and records the host key
fingerprint the coordinator saw when it quarantined the node. Filtering happens before connecting (a quarantined
node is never contacted: it may be the one that hangs a connect), so the key is what the inventory says; a node
of another inventory that shares the name, or a name that now points at another address, is not left out; nor is
one whose address known_hosts now lists under other host keys only (`replaced`: another machine).

State lives in `$XDG_STATE_HOME/mlx-coordinator/quarantine.json` (default `~/.local/state/...`), written
atomically. Files of the old format (one global map keyed by the bare node name) are still read: their entries
apply to a node of that name in any inventory, as they did, but expire `DEFAULT_QUARANTINE_FOR` after they were
recorded, and a note says so; the next change rewrites the file in the current format.

Pure core: `parse_state`, `dump_state`, `matching_entry`, `compute_left_out`, `check_degraded`,
`format_left_out`. I/O shell: `QuarantineStore`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config.playbook import DEFAULT_QUARANTINE_FOR
from coordinator.errors import ConfigError
from coordinator.models import Inventory, Node

FORMAT_VERSION = 2


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mlx-coordinator"


def node_address(node: Node) -> str:
    """The SSH address a quarantine is scoped to: `host` or `host:port`."""
    return f"{node.host}:{node.port}" if node.port else node.host


def inventory_key(path: str | None) -> str | None:
    """An inventory's identity in the store: its real path (the same file by any relative path or symlink)."""
    return os.path.realpath(path) if path else None


@dataclass(frozen=True)
class Entry:
    """One quarantined node. `inventory` and `host` None: an entry of the old name-keyed format, which applies to
    a node of that name in any inventory. `expires` None: until cleared."""

    node: str
    reason: str
    run_id: str | None
    t: float
    incident: dict[str, Any] = field(default_factory=dict)
    inventory: str | None = None
    host: str | None = None
    host_key: str | None = None  # "ssh-ed25519 SHA256:...", when the coordinator knew it (None for local)
    expires: float | None = None

    @property
    def legacy(self) -> bool:
        return self.inventory is None

    def active(self, now: float) -> bool:
        return self.expires is None or now < self.expires

    def applies_to(self, inventory: str | None, node: Node) -> bool:
        """Whether this entry names `node` of the inventory at (real path) `inventory`."""
        if self.node != node.name:
            return False
        if self.legacy:
            return True
        return self.inventory == inventory and self.host == node_address(node)

    def identity(self) -> str:
        """How `quarantine list` names the machine."""
        if self.legacy:
            return f"{self.node} (any inventory: old-format entry)"
        return f"{self.node} {self.host} in {self.inventory}"

    def to_json(self, now: float) -> dict[str, Any]:
        return {"node": self.node, "inventory": self.inventory, "host": self.host, "host_key": self.host_key,
                "reason": self.reason, "run_id": self.run_id, "t": self.t, "age_s": round(max(0.0, now - self.t), 1),
                "expires": self.expires,
                "expires_in_s": None if self.expires is None else round(max(0.0, self.expires - now), 1),
                "legacy": self.legacy}


@dataclass(frozen=True)
class State:
    """The file's entries, and notes for the operator (an old-format file)."""

    entries: tuple[Entry, ...] = ()
    notes: tuple[str, ...] = ()

    def active(self, now: float) -> list[Entry]:
        return [e for e in self.entries if e.active(now)]


# --- pure: the file ------------------------------------------------------------------------------------------


def _shape_error(path: str, where: str, expected: str, got: Any) -> ConfigError:
    shown = json.dumps(got)[:60] if not isinstance(got, float) or math.isfinite(got) else str(got)
    return ConfigError(f"quarantine state has the wrong shape: {where} must be {expected}, got {shown} (fix the "
                       "file, or delete it to forget every quarantine)", path=path)


def _opt_str(value: Any, path: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _shape_error(path, where, "a string or null", value)


def _number(value: Any, path: str, where: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _shape_error(path, where, "a number" + (" or null" if optional else ""), value)
    return float(value)


def _incident(value: Any, path: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _shape_error(path, where, "an object", value)
    return value


def parse_state(text: str, path: str) -> State:
    """The store's JSON -> State. Every problem is a one-line `ConfigError` naming `path` (and the line, for
    invalid JSON): never a traceback, never a silently empty quarantine."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"quarantine state is not valid JSON ({exc.msg}): fix the file, or delete it to forget "
                          "every quarantine", path=path, line=exc.lineno) from None
    if not isinstance(data, dict):
        raise _shape_error(path, "the top level", "an object", data)
    if "entries" in data or "version" in data:
        return _parse_current(data, path)
    if "nodes" in data:
        return _parse_legacy(data, path)
    if not data:
        return State()
    raise _shape_error(path, "the top level", 'an object with "version" and "entries"', sorted(data))


def _parse_current(data: dict[str, Any], path: str) -> State:
    version = data.get("version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise ConfigError(f"quarantine state is version {version}, written by a newer coordinator (this one "
                              f"reads {FORMAT_VERSION}): upgrade, or delete the file", path=path)
        raise _shape_error(path, '"version"', str(FORMAT_VERSION), version)
    raw = data.get("entries")
    if not isinstance(raw, list):
        raise _shape_error(path, '"entries"', "a list", raw)
    entries = []
    for i, e in enumerate(raw):
        at = f"entries[{i}]"
        if not isinstance(e, dict):
            raise _shape_error(path, at, "an object", e)
        node = e.get("node")
        if not isinstance(node, str) or not node:
            raise _shape_error(path, f"{at}.node", "a node name", node)
        inventory, host = _opt_str(e.get("inventory"), path, f"{at}.inventory"), _opt_str(e.get("host"), path,
                                                                                            f"{at}.host")
        if (inventory is None) != (host is None):
            raise _shape_error(path, f"{at}.inventory and .host", "both set or both null", [inventory, host])
        t = _number(e.get("t"), path, f"{at}.t")
        assert t is not None
        entries.append(Entry(node=node, reason=_opt_str(e.get("reason"), path, f"{at}.reason") or "",
                             run_id=_opt_str(e.get("run_id"), path, f"{at}.run_id"), t=t,
                             incident=_incident(e.get("incident"), path, f"{at}.incident"), inventory=inventory,
                             host=host, host_key=_opt_str(e.get("host_key"), path, f"{at}.host_key"),
                             expires=_number(e.get("expires"), path, f"{at}.expires", optional=True)))
    return State(tuple(entries))


def _parse_legacy(data: dict[str, Any], path: str) -> State:
    """`{"nodes": {name: {reason, run_id, t, incident}}}`: keyed by the bare name, no scope, no expiry."""
    nodes = data["nodes"]
    if not isinstance(nodes, dict):
        raise _shape_error(path, '"nodes"', "an object of node name -> entry", nodes)
    entries = []
    for name, e in nodes.items():
        at = f"nodes[{json.dumps(name)}]"
        if not isinstance(e, dict):
            raise _shape_error(path, at, "an object", e)
        t = _number(e.get("t", 0), path, f"{at}.t")
        assert t is not None
        entries.append(Entry(node=name, reason=_opt_str(e.get("reason"), path, f"{at}.reason") or "",
                             run_id=_opt_str(e.get("run_id"), path, f"{at}.run_id"), t=t,
                             incident=_incident(e.get("incident"), path, f"{at}.incident"),
                             expires=t + DEFAULT_QUARANTINE_FOR))
    note = (f"{path}: old name-keyed format: its {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} leave "
            "out a node of that name in any inventory, and expire "
            f"{DEFAULT_QUARANTINE_FOR / 3600:g} h after they were recorded; the next change rewrites the file")
    return State(tuple(entries), (note,) if entries else ())


def dump_state(entries: Sequence[Entry]) -> str:
    doc = {"version": FORMAT_VERSION, "entries": [
        {"node": e.node, "inventory": e.inventory, "host": e.host, "host_key": e.host_key, "reason": e.reason,
         "run_id": e.run_id, "t": e.t, "expires": e.expires, "incident": e.incident} for e in entries]}
    return json.dumps(doc, indent=2) + "\n"


# --- pure: decisions -----------------------------------------------------------------------------------------


def new_entry(node: Node, inventory: str | None, reason: str, *, run_id: str | None, incident: Mapping[str, Any],
              host_key: str | None, now: float, quarantine_for: float) -> Entry:
    """An entry for `node` of the inventory at (real path) `inventory`. An inventory without a file (built in
    code) is keyed by the empty path. `quarantine_for` 0: until cleared."""
    return Entry(node=node.name, reason=reason, run_id=run_id, t=now, incident=dict(incident),
                 inventory=inventory or "", host=node_address(node), host_key=host_key,
                 expires=now + quarantine_for if quarantine_for > 0 else None)


def replaced(entry: Entry, known_keys: frozenset[str] | None) -> bool:
    """Whether the machine behind the entry's address is another one now: the entry recorded a host key, and
    known_hosts lists keys for the address but not that one (the operator accepted the new machine's key)."""
    return bool(entry.host_key and known_keys and entry.host_key not in known_keys)


def matching_entry(entries: Sequence[Entry], inventory: str | None, node: Node, now: float,
                   known_keys: frozenset[str] | None = None) -> Entry | None:
    """The active entry that leaves `node` out (a scoped entry wins over an old-format one), or None. With
    `known_keys` (what known_hosts lists for the node's address), an entry of a replaced machine does not."""
    found = [e for e in entries if e.active(now) and e.applies_to(inventory or "", node) and not replaced(e, known_keys)]
    return min(found, key=lambda e: e.legacy) if found else None


@dataclass(frozen=True)
class LeftOut:
    """An inventory node a launch runs without, and why."""

    node: str
    reason: str
    entry: Entry | None = None

    def to_json(self) -> dict[str, str]:
        return {"node": self.node, "reason": self.reason}


def describe_entry(entry: Entry, now: float) -> str:
    """`quarantined: crash at step 5 (run r1, 2h ago; expires in 22h)`."""
    until = "until cleared" if entry.expires is None else f"expires in {format_age(entry.expires - now)}"
    run = f"run {entry.run_id}, " if entry.run_id else ""
    return f"quarantined: {entry.reason or 'no reason recorded'} ({run}{format_age(now - entry.t)} ago; {until})"


def compute_left_out(inv: Inventory, inventory: str | None, entries: Sequence[Entry], now: float,
                     known_keys: Mapping[str, frozenset[str]] | None = None) -> list[LeftOut]:
    """The inventory's nodes that active quarantine entries leave out, in inventory order. `known_keys`: node
    name -> the host keys known_hosts lists for its address (see `replaced`); a node without one is matched on
    the key alone."""
    out = []
    for node in inv.nodes:
        entry = matching_entry(entries, inventory, node, now, (known_keys or {}).get(node.name))
        if entry is not None:
            out.append(LeftOut(node.name, describe_entry(entry, now), entry))
    return out


def check_degraded(named: int, usable: int, *, min_nodes: int, min_nodes_explicit: bool, allow_degraded: bool,
                   fresh: bool) -> str | None:
    """Why a launch on `usable` of the `named` nodes must not start, or None.

    Never below `faults.min_nodes` (nor 0). A FRESH launch (not `--resume`) must not start degraded by surprise:
    it needs `--allow-degraded`, or a `faults.min_nodes` written in the playbook (the operator said how few nodes
    are enough). A resumed run follows `min_nodes` only, as a relaunch after a fault does."""
    floor = max(1, min_nodes)
    if usable < floor:
        return (f"{usable} usable node(s) of {named} < faults.min_nodes {min_nodes}: bring the left-out nodes back "
                "(see above) or lower faults.min_nodes")
    if usable < named and fresh and not allow_degraded and not min_nodes_explicit:
        return (f"would start degraded on {usable} of {named} node(s) (left out: see above): bring them back, or pass "
                "--allow-degraded, or set faults.min_nodes in the playbook")
    return None


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def clear_command(node: str, inventory_arg: str | None) -> str:
    return f"coordinator quarantine clear {node}" + (f" -i {inventory_arg}" if inventory_arg else "")


def format_left_out(left_out: Sequence[LeftOut], named: int, inventory_arg: str | None) -> str:
    """The warning block printed before a launch on fewer nodes than the inventory names (empty: no block)."""
    if not left_out:
        return ""
    lines = [f"DEGRADED: {named - len(left_out)} of {named} node(s) of "
             f"{inventory_arg or 'the inventory'}; left out:"]
    for lo in left_out:
        lines.append(f"  {lo.node}: {lo.reason}")
        lines.append(f"    bring it back: {clear_command(lo.node, inventory_arg)}")
    return "\n".join(lines)


# --- I/O -----------------------------------------------------------------------------------------------------


class QuarantineStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "quarantine.json"

    def read(self) -> State:
        """The file's state; an absent file is empty. ConfigError (exit 2) when unreadable or of the wrong shape."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return State()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"quarantine state is unreadable ({reason}): fix or delete it",
                              path=str(self.path)) from None
        return parse_state(text, str(self.path))

    def _save(self, entries: Sequence[Entry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(dump_state(entries), encoding="utf-8")
        os.replace(tmp, self.path)

    def add(self, entry: Entry, *, now: float | None = None) -> Entry:
        """Record `entry`, replacing any entry for the same machine; expired entries are dropped on the way."""
        now = time.time() if now is None else now
        kept = [e for e in self.read().entries if e.active(now)
                and not (e.node == entry.node and e.inventory == entry.inventory and e.host == entry.host)]
        self._save([*kept, entry])
        return entry

    def clear(self, node: str, *, inventory: str | None = None) -> list[Entry]:
        """Remove the entries named `node` (of the inventory at real path `inventory` when given, and old-format
        ones, which apply to any inventory); returns them."""
        entries = self.read().entries
        gone = [e for e in entries if e.node == node and (inventory is None or e.legacy or e.inventory == inventory)]
        if gone:
            self._save([e for e in entries if e not in gone])
        return gone
