"""One supervisor per run: the run lock, node locks, stop requests, and what a signal asks of the coordinator.

A run is supervised by at most one coordinator process. It holds `runs/<id>/lock` for its whole life: an
exclusive `flock` on the file, which records the holder's pid, host, verb and start time. The kernel releases
an flock when its holder dies however it dies (kill -9 included), so a lock whose flock can be taken is stale
by construction; its recorded holder (a dead pid on this host) is only read for messages. A second `launch
--resume`, an `attach` or a `stop` therefore sees at once whether a coordinator lives:

- `attach` and a second `--resume` refuse (`RunBusy`, exit 2), naming the holder;
- `stop` writes `runs/<id>/stop-request` for the live coordinator to carry out (state `stopped`, nothing
  quarantined), and waits for it to release the lock; with no live holder it takes the lock and stops the
  run's processes itself.

The nodes a live run uses are locked the same way in `$XDG_STATE_HOME/mlx-coordinator/nodes/<host>:<port>.lock`
(one coordinator machine's view: two coordinator machines sharing a fleet do not see each other's locks). A
launch on a node another live run holds refuses, or warns and goes on with `--allow-shared`.

`Supervision` is the running coordinator's side: which signal (or stop request) asked it to stop, and whether a
hangup detaches instead (`--detach-on-hangup`). The CLI installs the signal handlers and picks the exit code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.errors import CoordinatorError
from coordinator.models import Connection, Node
from coordinator.run.quarantine import state_dir

LOCK_NAME = "lock"
STOP_REQUEST_NAME = "stop-request"


class RunBusy(CoordinatorError):
    """The run (or a node) is supervised by a live coordinator: acting on it too would race that one."""

    exit_code = 2


@dataclass(frozen=True)
class Holder:
    """Who holds a lock (the file's content; informative, the flock is the truth)."""

    pid: int
    host: str
    verb: str
    run_id: str
    since: float

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "verb": self.verb, "run_id": self.run_id, "since": self.since}

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"`coordinator {self.verb}` (pid {self.pid} on {self.host}, since {since})"


def parse_holder(text: str) -> Holder | None:
    """The holder recorded in a lock file; None for an empty or foreign file (a lock being written)."""
    try:
        data = json.loads(text)
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("verb", "?")), str(data.get("run_id", "?")),
                      float(data.get("since", 0.0)))
    except (ValueError, KeyError, TypeError):
        return None


def this_holder(verb: str, run_id: str) -> Holder:
    return Holder(os.getpid(), socket.gethostname(), verb, run_id, time.time())


def node_lock_key(node: Node) -> str:
    """What two runs must not share: the machine behind the node (its SSH address and port; every local node
    is this machine)."""
    if node.connection is Connection.LOCAL:
        return "local"
    return f"{node.host.lower()}:{node.port or 22}"


def _file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:@-]", "_", key) + ".lock"


class FileLock:
    """An exclusive flock on `path`, held until `release` (or the process's death). Not inherited by children
    (Python opens files non-inheritable), so mlx.launch, which outlives a killed coordinator, never keeps it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, path: Path, holder: Holder) -> FileLock | Holder | None:
        """The lock, or the live holder (None when its file says nothing readable yet)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # like every run-dir file: it names a host
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
                os.close(fd)
                return parse_holder(text)
            except BaseException:
                os.close(fd)
                raise
            # The previous holder unlinks the file when it releases: a lock taken on an unlinked inode is no lock.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            data = (json.dumps(holder.to_json()) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return cls(path, fd)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def holder_of(path: Path) -> Holder | None:
    """The live holder of the lock at `path`, None when nobody holds it (no file, or a stale one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return parse_holder(os.pread(fd, 4096, 0).decode("utf-8", errors="replace")) or Holder(
                0, "?", "?", "?", 0.0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire_run(run_dir: Path, verb: str, run_id: str) -> FileLock:
    """The run's lock for this process, or RunBusy naming the live coordinator that has it."""
    got = FileLock.try_acquire(run_dir / LOCK_NAME, this_holder(verb, run_id))
    if isinstance(got, FileLock):
        return got
    who = got.describe() if got is not None else "another coordinator"
    raise RunBusy(f"run {run_id} is supervised by {who}: only one coordinator supervises a run "
                  f"(`coordinator stop {run_id}` stops it; if that process is gone, retry)")


@dataclass
class NodeLocks:
    """The node locks this run holds, and the nodes it shares with other live runs (`--allow-shared`)."""

    held: list[FileLock] = field(default_factory=list)
    shared: dict[str, Holder | None] = field(default_factory=dict)  # node name -> the other run's holder

    def release(self) -> None:
        for lock in self.held:
            lock.release()
        self.held = []


def acquire_nodes(nodes: Sequence[Node], verb: str, run_id: str, *, allow_shared: bool,
                  root: Path | None = None) -> NodeLocks:
    """Lock every node's machine for this run. A node held by another live run: RunBusy, or (allow_shared)
    recorded in `shared` and left unlocked."""
    root = root or state_dir() / "nodes"
    locks = NodeLocks()
    by_key: dict[str, list[str]] = {}
    for node in nodes:
        by_key.setdefault(node_lock_key(node), []).append(node.name)
    holder = this_holder(verb, run_id)
    for key, names in sorted(by_key.items()):
        got = FileLock.try_acquire(root / _file_name(key), holder)
        if isinstance(got, FileLock):
            locks.held.append(got)
        else:
            for name in names:
                locks.shared[name] = got
    if locks.shared and not allow_shared:
        locks.release()
        raise RunBusy("in use by another live run: " + "; ".join(
            f"{name} (run {h.run_id}, {h.describe()})" if h else name for name, h in locks.shared.items())
            + ": wait for it, `coordinator stop RUN_ID`, or --allow-shared to run beside it")
    return locks


@contextlib.contextmanager
def holding(run_dir: Path, verb: str, run_id: str) -> Iterator[FileLock]:
    lock = acquire_run(run_dir, verb, run_id)
    try:
        yield lock
    finally:
        lock.release()


# --- stop requests ------------------------------------------------------------------------------------------


def request_stop(run_dir: Path) -> Path:
    path = run_dir / STOP_REQUEST_NAME
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}) + "\n")
    tmp.replace(path)
    return path


def clear_stop_request(run_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (run_dir / STOP_REQUEST_NAME).unlink()


# --- the running coordinator's side -------------------------------------------------------------------------


SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def exit_code_for(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    return 128 + int(signum)


@dataclass
class Supervision:
    """Why the coordinator should stop supervising, set by signal handlers (`signum`) or found in the run dir
    (a stop request); `detach` when a hangup leaves the run running (`--detach-on-hangup`)."""

    detach_on_hangup: bool = False
    signum: int | None = None
    detach: bool = False
    run_dir: Path | None = None
    requested: bool = False  # `coordinator stop` asked

    def on_signal(self, signum: int) -> bool:
        """Record the first signal; True when it is the first (the caller then interrupts the job)."""
        if self.signum is not None:
            return False
        self.signum = signum
        self.detach = signum == signal.SIGHUP and self.detach_on_hangup
        return True

    def stop_reason(self) -> str | None:
        """None while nothing asks to stop; polled by the monitor loop every tick."""
        if self.signum is not None:
            return SIGNAL_NAMES.get(signal.Signals(self.signum), f"signal {self.signum}")
        if not self.requested and self.run_dir is not None and (self.run_dir / STOP_REQUEST_NAME).exists():
            self.requested = True
        return "stopped by `coordinator stop`" if self.requested else None

    def message(self) -> str:
        reason = self.stop_reason()
        if reason is None:
            return "interrupted"
        if self.detach:
            return f"detached on {reason}: the run goes on"
        return reason if self.requested and self.signum is None else f"interrupted by {reason}"


__all__ = ["FileLock", "Holder", "NodeLocks", "RunBusy", "Supervision", "acquire_nodes", "acquire_run",
           "clear_stop_request", "exit_code_for", "holder_of", "node_lock_key", "parse_holder", "request_stop"]
