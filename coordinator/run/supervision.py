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

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.errors import CoordinatorError, TransportError
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, python_argv
from coordinator.models import Connection, Node
from coordinator.run.quarantine import state_dir
from coordinator.run.rundir import read_meta

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


# --- orphans: ranks on the nodes that no live coordinator supervises ------------------------------------------


@dataclass(frozen=True)
class LiveRank:
    """A training rank running on a node (`worker.ranks`)."""

    node: str
    pid: int
    run_id: str


@dataclass(frozen=True)
class OrphanRun:
    """A run with live ranks on the nodes and no live coordinator here: its coordinator was killed (its lock is
    free), or it was launched from another machine or run root (no run dir here)."""

    run_id: str
    nodes: tuple[str, ...]
    why: str


def find_orphans(ranks: Sequence[LiveRank], *, own_run_id: str, holders: Mapping[str, Holder | None],
                 known: Mapping[str, int | None]) -> list[OrphanRun]:
    """The runs of `ranks` that nobody supervises, in run id order. Pure.

    `holders`: run id -> the live holder of its lock in this run root (None: free or stale); `known`: run id ->
    the pid of the coordinator its meta.json names, for the runs with a run dir here (None: not recorded). A run
    held by a live coordinator is not an orphan (the node locks already refused, or `--allow-shared` warned);
    ranks of `own_run_id` always are (a `--resume` starts its own ranks, none can be running yet)."""
    by_run: dict[str, list[str]] = {}
    for rank in ranks:
        nodes = by_run.setdefault(rank.run_id, [])
        if rank.node not in nodes:
            nodes.append(rank.node)
    found = []
    for run_id, nodes in sorted(by_run.items()):
        if run_id != own_run_id and holders.get(run_id) is not None:
            continue
        if run_id in known:
            pid = known[run_id]
            why = (f"its coordinator{f' (pid {pid})' if pid else ''} is gone: the run's lock is free")
        else:
            why = "no coordinator here knows it: no run dir of that id (launched from another machine or --run-dir?)"
        found.append(OrphanRun(run_id, tuple(nodes), why))
    return found


def describe_orphans(orphans: Sequence[OrphanRun], run_root: Path) -> str:
    """The refusal (or, with --allow-shared, the warning): each run, its nodes, why it is an orphan, and the
    commands that supervise it again or stop it."""
    flag = f" --run-dir {run_root}" if str(run_root) != "runs" else ""
    return "; ".join(
        f"{', '.join(o.nodes)} run{'s' if len(o.nodes) == 1 else ''} ranks of run {o.run_id}, which no live "
        f"coordinator supervises ({o.why}): `coordinator attach {o.run_id}{flag}` supervises it again, "
        f"`coordinator stop {o.run_id}{flag}` stops it" for o in orphans)


def parse_live_ranks(node: str, stdout: str) -> list[LiveRank]:
    """`worker.ranks`' answer (its last stdout line) -> LiveRanks; an answer that is not one is no ranks."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return []
    items = doc.get("ranks") if isinstance(doc, dict) else None
    return [LiveRank(node, r["pid"], r["run_id"]) for r in items or []
            if isinstance(r, dict) and isinstance(r.get("pid"), int) and isinstance(r.get("run_id"), str)]


async def check_orphans(fleet: Fleet, nodes: Sequence[Node], *, run_id: str, run_root: Path,
                        allow_shared: bool) -> str | None:
    """Look on every connected node for live ranks of runs that no live coordinator supervises (the node locks
    die with their holder: after a `kill -9` of a coordinator they say nothing). RunBusy (exit 2) naming each
    run and the commands that supervise or stop it; with `allow_shared` that text is returned, to be shown as a
    warning, and the launch goes on beside them. None when there are none. A node that cannot be asked is
    checked by preflight, not here."""
    async def one(node: Node) -> list[LiveRank]:
        transport = fleet.transports[node.name]
        try:
            worker_dir = await ship_worker(transport, node)
            result = await transport.run(["env", f"PYTHONPATH={worker_dir}",
                                          *python_argv(node.python, "-m", "worker.ranks", "--workdir", node.workdir)],
                                         timeout=30)
        except TransportError:
            return []
        return parse_live_ranks(node.name, result.stdout) if result.ok else []

    found = [r for rs in await asyncio.gather(*(one(n) for n in nodes if n.name in fleet.connected)) for r in rs]
    run_ids = {r.run_id for r in found}
    holders = {rid: holder_of(run_root / rid / LOCK_NAME) for rid in run_ids}
    known: dict[str, int | None] = {}
    for rid in run_ids:
        with contextlib.suppress(CoordinatorError):  # no run dir of that id here, or an unreadable meta.json
            known[rid] = read_meta(run_root / rid).coordinator_pid
    orphans = find_orphans(found, own_run_id=run_id, holders=holders, known=known)
    if not orphans:
        return None
    text = describe_orphans(orphans, run_root)
    if allow_shared:
        return f"--allow-shared: running beside {text}"
    raise RunBusy(f"{text}; or --allow-shared to run beside it")


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


__all__ = ["FileLock", "Holder", "LiveRank", "NodeLocks", "OrphanRun", "RunBusy", "Supervision", "acquire_nodes",
           "acquire_run", "clear_stop_request", "describe_orphans", "exit_code_for", "find_orphans", "holder_of",
           "node_lock_key", "parse_holder", "request_stop"]
