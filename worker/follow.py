"""Follow a run's per-rank event files on THIS node and report rank process state.

Started by the coordinator over the node's own SSH connection (so every line's origin is that channel):
    python -m worker.follow --run-dir DIR --ranks 0,1 [--interval 0.5] [--skip 0=12,1=7]
Prints JSON lines on stdout, flushed:
    {"src": "event", "rank": R, "event": {...}}            each new line of <run-dir>/events/rank<R>.jsonl
    {"src": "proc", "rank": R, "pid": P, "alive": bool, "state": "R|S|T|Z|D|?"}   every interval, per known pid
    {"src": "tick", "t": unix_time}                         every interval (the channel is alive)
    {"src": "bad", "rank": R, "text": "..."}                an event line that is not JSON (reported, not dropped)
`--skip R=N` leaves out the first N event lines (and `bad` lines) of rank R's file: what a previous follower,
whose channel closed, already delivered. Their `started` pids are still read, so process states go on.
It never exits on its own; the coordinator closes the channel.

`--once` reads what the files hold now and exits: the event lines (after `--skip`), then
    {"src": "checkpoints", "step": N}                       the newest complete checkpoint dir (None: none)
and no process states. The coordinator reads a run's record this way when it did not (or could not) follow it
to the end: `coordinator stop` of a run nobody supervises, a stop or signal that interrupted the following.

A line without its newline is being written (or was torn by a writer that died): it is never read, whatever
the mode. Stdlib only, Python 3.9+.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from worker.events import StartedEvent, parse_event


def process_state(pid: int) -> str | None:
    """One-letter process state (R running, S sleeping, T stopped, Z zombie, D disk), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            # The command name is in parentheses and may contain spaces: the state follows the last ')'.
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except OSError:
        pass
    try:  # macOS: no /proc
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "?"
    text = out.stdout.strip()
    return text[0] if text else None


class Tail:
    """Incremental reader of one append-only JSONL file; only complete lines are returned."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        return [line for line in lines if line.strip()]


# worker.checkpoint's layout (not imported here: it loads mlx). A final-named dir is complete by construction
# (written under a temp name, renamed once its manifest is in place); the manifest is checked for all that.
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_MANIFEST = "manifest.sha256"


def newest_checkpoint_step(run_dir: str) -> int | None:
    """The highest step of a complete checkpoint dir under `<run_dir>/checkpoints` (not re-hashed: a step count,
    not a resume decision); None when there is none."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = [int(m.group(1)) for m in map(_STEP_DIR.match, names)
             if m and os.path.isfile(os.path.join(root, m.group(0), _MANIFEST))]
    return max(steps, default=None)


def parse_skip(text: str) -> dict[int, int]:
    """`0=12,1=7` -> {0: 12, 1: 7}."""
    out: dict[int, int] = {}
    for item in text.split(","):
        if item.strip():
            rank, _, count = item.partition("=")
            out[int(rank)] = int(count)
    return out


def read_events(tail: Tail, rank: int, skip: dict[int, int], pids: dict[int, int]) -> list[dict[str, Any]]:
    """The messages for the new lines of one rank's file. The first `skip[rank]` lines were delivered by an
    earlier follower: not sent again, but a `started` pid among them is still recorded in `pids`."""
    out: list[dict[str, Any]] = []
    for raw in tail.read():
        delivered = skip.get(rank, 0) > 0
        if delivered:
            skip[rank] -= 1
        try:
            event = json.loads(raw)
        except ValueError:
            if not delivered:
                out.append({"src": "bad", "rank": rank, "text": raw.decode("utf-8", "replace")[:500]})
            continue
        started = parse_event(event) if isinstance(event, dict) else None
        if isinstance(started, StartedEvent) and started.pid is not None:
            pids[rank] = started.pid
        if not delivered:
            out.append({"src": "event", "rank": rank, "event": event})
    return out


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker.follow")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--ranks", required=True, help="comma-separated ranks that run on this node")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--skip", default="", help="R=N,...: event lines of rank R already delivered")
    parser.add_argument("--once", action="store_true", help="report what the files hold now, then exit")
    args = parser.parse_args(argv)
    run_dir = os.path.expanduser(args.run_dir)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    tails = {r: Tail(os.path.join(run_dir, "events", f"rank{r}.jsonl")) for r in ranks}
    skip = parse_skip(args.skip)
    pids: dict[int, int] = {}

    def drain(rank: int) -> None:
        for msg in read_events(tails[rank], rank, skip, pids):
            emit(msg)

    if args.once:
        for rank in tails:
            drain(rank)
        emit({"src": "checkpoints", "step": newest_checkpoint_step(run_dir)})
        sys.stdout.flush()
        return 0
    while True:
        for rank in tails:
            drain(rank)
        for rank, pid in list(pids.items()):
            state = process_state(pid)
            alive = state not in (None, "Z")
            if not alive:
                # A rank that wrote its last event (an error) and died between our read and this check: read
                # again, so its last words always reach the coordinator before the news of its death.
                drain(rank)
            emit({"src": "proc", "rank": rank, "pid": pid, "alive": alive, "state": state or "gone"})
        emit({"src": "tick", "t": time.time()})
        sys.stdout.flush()
        time.sleep(args.interval)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
