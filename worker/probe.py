"""Node-side half of the preflight probe: python/package versions, file hashes, peer reachability, model facts.

The coordinator runs this file on every node as `PYTHON -c BOOTSTRAP KEY '<json-args>'` with THIS SOURCE on
stdin (coordinator/facts/probe.py; compiled once per node and version, then cached), using the node's configured
python (which has mlx and mlx-lm but none of our packages). Hence the module is self-contained and
stdlib-only, runs on Python 3.9+ (annotations are never evaluated at runtime), and never imports mlx
(importing it is slow; versions come from package metadata). It is also importable as
`worker.probe` for tests.

Input: at most one argv argument, a JSON object; every key is optional:
    {"hash_dirs": ["/srv/model", "~/data"],       dirs whose regular files are hashed (`~` = node user's home)
     "peers": [{"name": "h2", "ip": "10.1.2.3", "port": 22}],   reachability targets (ICMP echo, else TCP port, 22)
     "cache": "$XDG_CACHE_HOME/mlx-coordinator/sha256.json",    hash cache file (~/.cache/... without XDG_CACHE_HOME);
                                                                 null or "" disables it
     "model_dir": "/srv/model",                   dir with config.json and *.safetensors
     "jobs": 0,                                   hashing threads; 0 = min(8, cpu count)
     "progress": true,                            `progress <done> <total>` lines on stderr for big jobs
     "timeout": 2.0,                              per-peer TCP connect timeout, seconds
     "data_check": {"dir": "/srv/data", "format": "sft" | "dpo",      the trainer's data files, parsed row by
                    "files": [["train.jsonl", true], ["valid.jsonl", false]],   row as it will load them
                    "max_bytes": 268435456}}      ([name, required]); rows past max_bytes are not read

Output: exactly one JSON object (ASCII) on stdout; diagnostics and progress go to stderr:
    {"python": {"executable": str, "version": "3.11.7"},
     "packages": {"mlx": str | null, "mlx_lm": str | null},      distribution versions, null when not installed
     "mlx_backends": {"mlx-cuda-13": "0.32.4", ...},              installed mlx backend distributions (mlx-metal,
                                                                  mlx-cpu, mlx-cuda-12, mlx-cuda-13); absent when
                                                                  the package scan itself failed
     "errors": [str],                                             problems outside the sections below
     "hashes": [{"path": str (as given), "exists": bool,
                 "files": [{"path": "sub/f.json" (relative, "/"-separated, sorted), "size": int, "sha256": hex}],
                 "error": str | null,                             unreadable files / unlistable dirs, by name
                 "cached_files": int, "hashed_bytes": int}],      answered from the cache / bytes read now
     "reach": [{"peer": str, "ip": str, "ok": bool, "rtt_ms": float | null, "error": str | null,
                "method": "icmp" | "tcp" | null}],
     "model": {"config": object | null, "params": int | null, "error": str | null,
               "weights": [str], "tokenizer": [str]},                 *.safetensors and tokenizer files found
     "data": {"dir": str, "error": str | null,                         only with `data_check`
              "files": [{"name": str, "required": bool, "exists": bool, "rows": int, "bytes": int,
                         "checked_bytes": int, "format": str | null, "error": str | null ("line N: ...")}]}}
`hashes` is one entry per `hash_dirs` item, in order; it is absent only if hashing failed in an unexpected
way (the reason is in `errors`), so that a crash can never look like an empty, matching dir. Nothing raises
out of `run`; the exit status is 0 unless the arguments are unusable (then 2, still with a JSON answer).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import stat
import struct
import sys
import threading
import time

# Annotations only: `typing` costs ~5 ms to import, paid on every node of every preflight, so it is never
# imported when the probe runs (type checkers treat this name as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

def cache_root() -> str:
    """This node's cache root: $XDG_CACHE_HOME/mlx-coordinator (~/.cache/... when unset, empty or relative), as
    the coordinator's own (`coordinator.fleet.cachedir`)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.expanduser("~/.cache")
    return os.path.join(base, "mlx-coordinator")


DEFAULT_CACHE = os.path.join(cache_root(), "sha256.json")
DEFAULT_TIMEOUT = 2.0
# Large reads amortise the per-call overhead (syscall, GIL hand-off) to nothing; hashlib releases the GIL
# for updates this big, so several files hash truly in parallel. One buffer per thread, reused.
CHUNK = 8 * 1024 * 1024
MAX_JOBS = 8  # default cap: more threads than this only contend for the disk
MAX_EXPLICIT_JOBS = 64  # cap on an explicit `jobs`, so a typo cannot start thousands of threads
PROGRESS_MIN_BYTES = 256 * 1024 * 1024  # below this a job finishes in well under a second: no progress lines
PROGRESS_INTERVAL = 0.25  # seconds between progress lines (at most ~4 a second)
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit; a bigger length means "not safetensors"
CACHE_VERSION = 1
MAX_NAMED_ERRORS = 5  # a dir's `error` names this many problems, then counts the rest
KNOWN_ARGS = frozenset({"hash_dirs", "peers", "cache", "model_dir", "jobs", "progress", "timeout", "data_check"})
DATA_CHECK_MAX_BYTES = 256 * 1024 * 1024  # per file: JSON parsing runs at ~100-300 MB/s; a bigger file is sampled
# Any of these in the model dir lets transformers' AutoTokenizer (mlx-lm's load) build a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


class FileEntry:
    """A regular file found under a hashed dir; size/mtime/inode come from stat() following symlinks.
    (A plain class, not a NamedTuple: the probe never imports `typing`.)"""

    __slots__ = ("ino", "mtime_ns", "path", "real", "rel", "size")

    def __init__(self, rel: str, path: str, real: str, size: int, mtime_ns: int, ino: int) -> None:
        self.rel = rel  # relative to the dir, "/"-separated
        self.path = path  # the path to open (through any symlinks)
        self.real = real  # absolute real path: the cache key, and the identity used to hash a file only once
        self.size = size
        self.mtime_ns = mtime_ns
        self.ino = ino


class Scan:
    __slots__ = ("errors", "exists", "files", "path", "real")

    def __init__(self, path: str, exists: bool, real: str | None, files: list[FileEntry], errors: list[str]) -> None:
        self.path = path  # as given
        self.exists = exists
        self.real = real  # real path of the dir, when it exists
        self.files = files
        self.errors = errors


class FileChanged(Exception):
    """The file's size or mtime changed while it was being read: its digest describes no version of it."""


class Outcome:
    """What one call in a thread returned or raised."""

    __slots__ = ("error", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: Exception | None = None


def in_threads(fn: Callable[[Any], Any], items: list[Any], workers: int, *,
               tick: Callable[[], None] | None = None, every: float = PROGRESS_INTERVAL) -> list[Outcome]:
    """fn(item) for every item on up to `workers` threads, outcomes in the items' order; `tick` runs every
    `every` seconds while they work. A lean stand-in for concurrent.futures, whose import (with logging)
    costs ~12 ms: a tenth of the probe, paid on every node of every preflight."""
    outcomes = [Outcome() for _ in items]
    lock = threading.Lock()
    queue = iter(range(len(items)))

    def work() -> None:
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                outcomes[i].value = fn(items[i])
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as a future's result() would
                outcomes[i].error = exc

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(workers, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(every if tick is not None else None)
            if tick is not None:
                tick()
    return outcomes


class Background:
    """One call running in a daemon thread while the caller does something else."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.outcome = Outcome()

        def run() -> None:
            try:
                self.outcome.value = fn()
            except Exception as exc:  # noqa: BLE001 - re-raised by result()
                self.outcome.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join()
        if self.outcome.error is not None:
            raise self.outcome.error
        return self.outcome.value


# ----------------------------------------------------------------------------------------------------------
# hashing


_tls = threading.local()


def _buffer() -> memoryview:
    # Allocated once per thread: a fresh 8 MiB bytearray per file would cost more than hashing a small file.
    buf: memoryview | None = getattr(_tls, "buf", None)
    if buf is None:
        buf = memoryview(bytearray(CHUNK))
        _tls.buf = buf
    return buf


def sha256_file(path: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, os.stat_result]:
    """SHA256 hex digest of `path`, streamed in CHUNK reads, and the fstat of the file that was read.

    `on_bytes(n)` is called after each chunk. Raises OSError when the file cannot be read and FileChanged
    when its size or mtime moved during the read.
    """
    import hashlib  # here: ~3 ms to import (OpenSSL), and a node whose files the cache vouches for hashes nothing

    buf = _buffer()
    digest = hashlib.sha256()
    # Unbuffered: readinto() goes straight from the kernel into our buffer, no intermediate copy.
    with open(path, "rb", buffering=0) as fh:
        before = os.fstat(fh.fileno())
        advise = getattr(os, "posix_fadvise", None)  # Linux only; macOS reads ahead by default
        if advise is not None:
            with contextlib.suppress(OSError):
                advise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        # Read exactly the size stat() saw: a file that keeps growing (a log) must not be read forever.
        total = 0
        while total < before.st_size:
            n = fh.readinto(buf if before.st_size - total >= len(buf) else buf[: before.st_size - total])
            if not n:
                break  # shrank: caught below
            digest.update(buf[:n])
            total += n
            if on_bytes is not None:
                on_bytes(n)
        after = os.fstat(fh.fileno())
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or total != before.st_size:
        raise FileChanged(path)
    return digest.hexdigest(), before


def _skip(real: str, exclude: tuple[str, ...]) -> bool:
    # The cache file (and its in-flight temp files) may live inside a hashed dir; hashing it would make the
    # dir's manifest differ from node to node and change on every run.
    return any(real == ex or (real.startswith(ex + ".") and real.endswith(".tmp")) for ex in exclude)


def scan_dir(path: str, exclude: tuple[str, ...] = ()) -> Scan:
    """Every regular file under `path`, sorted by relative path.

    Symlinks are followed (to files and to dirs; a link back to an ancestor dir is skipped, not looped).
    Hidden files are included. Files whose real path is in `exclude` (and `<exclude>.*.tmp`) are left out, and so
    are `__pycache__` dirs: Python writes its bytecode there when a map task's module in the data dir is imported,
    stamped with the node's own source mtime and interpreter, so hashing it would make identical copies differ.
    FIFOs, sockets and devices are ignored. Dangling symlinks and unlistable dirs are reported in `errors`.
    """
    top = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(top):
        return Scan(path, False, None, [], [f"no such directory: {top}"])
    if not os.path.isdir(top):
        return Scan(path, True, None, [], [f"not a directory: {top}"])
    try:
        top_st = os.stat(top)
    except OSError as exc:  # removed or made unreadable since the checks above
        return Scan(path, False, None, [], [f"cannot stat {top}: {exc.strerror or exc}"])
    real_top = os.path.realpath(top)
    files: list[FileEntry] = []
    errors: list[str] = []
    # (relative dir, path to list, real path, (dev, ino) of every ancestor incl. itself)
    stack: list[tuple[str, str, str, frozenset[tuple[int, int]]]] = [
        ("", top, real_top, frozenset({(top_st.st_dev, top_st.st_ino)}))
    ]
    while stack:
        rel_dir, dir_path, real_dir, ancestors = stack.pop()
        try:
            with os.scandir(dir_path) as it:
                entries = list(it)
        except OSError as exc:
            errors.append(f"cannot list {rel_dir or '.'}: {exc.strerror or exc}")
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                is_link = entry.is_symlink()
                st = entry.stat()  # follows symlinks
            except FileNotFoundError:
                if os.path.islink(entry.path):
                    errors.append(f"dangling symlink {rel}")
                continue  # else: deleted while we listed; not a file of this dir any more
            except OSError as exc:
                errors.append(f"cannot stat {rel}: {exc.strerror or exc}")
                continue
            # Only symlinks need the (costly) realpath walk; below a real dir a plain entry's real path is known.
            real = os.path.realpath(entry.path) if is_link else os.path.join(real_dir, entry.name)
            if stat.S_ISDIR(st.st_mode):
                if entry.name == "__pycache__":
                    continue
                key = (st.st_dev, st.st_ino)
                if key in ancestors:
                    errors.append(f"symlink loop skipped: {rel}")
                    continue
                stack.append((rel, entry.path, real, ancestors | {key}))
            elif stat.S_ISREG(st.st_mode) and not _skip(real, exclude):
                files.append(FileEntry(rel, entry.path, real, st.st_size, st.st_mtime_ns, st.st_ino))
    files.sort(key=lambda f: f.rel)
    return Scan(path, True, real_top, files, errors)


class HashCache:
    """sha256 by absolute real path, valid while (size, mtime_ns, inode) are unchanged.

    On disk: {"version": 1, "files": {real_path: [size, mtime_ns, inode, sha256]}}. An unreadable or corrupt
    file is treated as empty (and rewritten by `save`); invalid entries are dropped one by one. The inode is
    part of the key because `rsync -a` and `cp -p` keep size and mtime but write a new file.
    """

    def __init__(self, path: str | None) -> None:
        self.path = os.path.abspath(os.path.expanduser(path)) if path else None
        self.entries: dict[str, tuple[int, int, int, str]] = {}
        self.updated: dict[str, tuple[int, int, int, str]] = {}
        self.dropped: set[str] = set()
        self.dirty = False
        self.note: str | None = None  # why the file on disk was not used, if it was not
        if self.path is not None:
            self.entries, self.note = self._read(self.path)
            self.dirty = self.note is not None and os.path.exists(self.path)

    @staticmethod
    def _read(path: str) -> tuple[dict[str, tuple[int, int, int, str]], str | None]:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return {}, None
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8; Recursion: deep nesting
            return {}, f"hash cache {path} ignored: {exc}"
        files = data.get("files") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
        if not isinstance(files, dict):
            return {}, f"hash cache {path} ignored: not a version {CACHE_VERSION} cache"
        entries: dict[str, tuple[int, int, int, str]] = {}
        bad = 0
        for key, value in files.items():
            if (
                isinstance(value, list)
                and len(value) == 4
                and all(type(v) is int for v in value[:3])
                and isinstance(value[3], str)
                and len(value[3]) == 64
            ):
                entries[key] = (value[0], value[1], value[2], value[3])
            else:
                bad += 1
        return entries, (f"hash cache {path}: {bad} invalid entries dropped" if bad else None)

    def get(self, f: FileEntry) -> str | None:
        hit = self.entries.get(f.real)
        if hit is not None and hit[:3] == (f.size, f.mtime_ns, f.ino):
            return hit[3]
        return None

    def put(self, real: str, st: os.stat_result, sha256: str) -> None:
        value = (st.st_size, st.st_mtime_ns, st.st_ino, sha256)
        if self.entries.get(real) != value:
            self.entries[real] = self.updated[real] = value
            self.dropped.discard(real)
            self.dirty = True

    def forget_missing(self, real_dir: str, seen: set[str]) -> None:
        """Drop entries under `real_dir` for files that no longer exist (not merely unseen: maybe unlistable)."""
        prefix = real_dir.rstrip("/") + "/"
        for key in [k for k in self.entries if k.startswith(prefix) and k not in seen]:
            if not os.path.isfile(key):
                del self.entries[key]
                self.updated.pop(key, None)
                self.dropped.add(key)
                self.dirty = True

    def save(self) -> None:
        """Write atomically (temp file in the same dir, fsync, rename) if anything changed.

        Our changes are merged into the file as it is NOW, so two probes running at once (different dirs)
        do not erase each other's work. Raises OSError when the file cannot be written.
        """
        if self.path is None or not self.dirty:
            return
        current, _ = self._read(self.path)
        for key in self.dropped:
            current.pop(key, None)
        current.update(self.updated)
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        import tempfile  # here: only a probe that hashed something new writes the cache

        fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(self.path) + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": CACHE_VERSION, "files": {k: list(v) for k, v in current.items()}}, fh,
                          separators=(",", ":"))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.entries = current
        self.updated.clear()
        self.dropped.clear()
        self.dirty = False


class Progress:
    """Thread-safe byte counter printing `progress <done> <total>` lines, at most one per PROGRESS_INTERVAL."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self._lock = threading.Lock()
        self._last_time = 0.0
        self._last_done = -1

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n

    def report(self, final: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if self.done == self._last_done or (not final and now - self._last_time < PROGRESS_INTERVAL):
            return
        self._last_time, self._last_done = now, self.done
        self.stream.write(f"progress {self.done} {self.total}\n")
        self.stream.flush()


def default_jobs() -> int:
    return max(1, min(MAX_JOBS, os.cpu_count() or 1))


def _name_errors(errors: list[str]) -> str | None:
    if not errors:
        return None
    shown = "; ".join(errors[:MAX_NAMED_ERRORS])
    return shown + (f" (+{len(errors) - MAX_NAMED_ERRORS} more)" if len(errors) > MAX_NAMED_ERRORS else "")


def hash_dirs(
    dirs: list[str],
    cache_path: str | None = DEFAULT_CACHE,
    jobs: int = 0,
    progress: bool = False,
    stderr: IO[str] | None = None,
    errors: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The `hashes` section: one entry per dir, in order (see the module docstring for the shape).

    Files the cache vouches for are not opened. The rest are hashed once each (a file reachable from two
    dirs, or twice through symlinks, is read once) by `jobs` threads, largest first so that one big file does
    not start last. Cache problems go to `errors` (if given) and never fail the hashing.
    """
    log = stderr if stderr is not None else sys.stderr
    cache = HashCache(cache_path)
    if cache.note:
        log.write(cache.note + "\n")
    exclude = (cache.path, os.path.realpath(cache.path)) if cache.path else ()
    scans = [scan_dir(d, exclude) for d in dirs]

    known: dict[str, str] = {}  # real path -> sha256, from the cache
    todo: dict[str, FileEntry] = {}  # real path -> a file to read
    for scan in scans:
        for f in scan.files:
            sha = cache.get(f)
            if sha is not None:
                known[f.real] = sha
            else:
                todo.setdefault(f.real, f)

    total = sum(f.size for f in todo.values())
    meter = Progress(total, log if progress and total > PROGRESS_MIN_BYTES else None)
    hashed: dict[str, tuple[str, int]] = {}  # real path -> (sha256, size actually read)
    failed: dict[str, str] = {}  # real path -> why not
    if todo:
        workers = min(min(jobs, MAX_EXPLICIT_JOBS) if jobs > 0 else default_jobs(), len(todo))
        order = sorted(todo.items(), key=lambda item: -item[1].size)
        outcomes = in_threads(lambda item: sha256_file(item[1].path, meter.add), order, workers, tick=meter.report)
        meter.report(final=True)
        for (real, _), outcome in zip(order, outcomes):
            if isinstance(outcome.error, FileChanged):
                failed[real] = "changed while being read"
            elif isinstance(outcome.error, OSError):
                failed[real] = outcome.error.strerror or str(outcome.error)
            elif outcome.error is not None:
                raise outcome.error
            else:
                sha, st = outcome.value
                hashed[real] = (sha, st.st_size)
                cache.put(real, st, sha)

    out: list[dict[str, Any]] = []
    for scan in scans:
        files: list[dict[str, Any]] = []
        problems = list(scan.errors)
        cached = hashed_bytes = 0
        for f in scan.files:
            if f.real in known:
                files.append({"path": f.rel, "size": f.size, "sha256": known[f.real]})
                cached += 1
            elif f.real in hashed:
                sha, size = hashed[f.real]
                files.append({"path": f.rel, "size": size, "sha256": sha})
                hashed_bytes += size
            else:
                problems.append(f"cannot read {f.rel}: {failed.get(f.real, 'not hashed')}")
        if scan.real is not None:
            cache.forget_missing(scan.real, {f.real for f in scan.files})
        out.append({"path": scan.path, "exists": scan.exists, "files": files, "error": _name_errors(problems),
                    "cached_files": cached, "hashed_bytes": hashed_bytes})
    try:
        cache.save()
    except OSError as exc:
        if errors is not None:
            errors.append(f"cannot write hash cache {cache.path}: {exc.strerror or exc}")
    return out


# ----------------------------------------------------------------------------------------------------------
# reachability


def _connect(family: int, address: Any, timeout: float) -> int | None:
    """errno of a non-blocking TCP connect (0 = connected), None when nothing came back within `timeout`.

    Done by hand (not socket.create_connection) so that "refused" is an errno, not an exception whose type
    differs between Python versions, and so a timeout is never confused with an error.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        rc = sock.connect_ex(address)
        if rc in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY, errno.EINTR):
            with selectors.DefaultSelector() as sel:
                sel.register(sock, selectors.EVENT_WRITE)
                if not sel.select(timeout):
                    return None
            rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return rc
    except OSError as exc:  # e.g. EHOSTUNREACH / ENETUNREACH raised at once by some kernels
        return exc.errno if exc.errno is not None else errno.EIO
    finally:
        sock.close()


ICMP_WAIT_S = 0.5  # a LAN answers an echo in well under a millisecond; no answer -> the TCP fallback decides


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = int(sum(struct.unpack(f"!{len(data) // 2}H", data)))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _icmp_socket() -> socket.socket | None:
    """Like ping(8): a datagram ICMP socket where the OS allows it (macOS; Linux within
    net.ipv4.ping_group_range), else a raw socket (root); None when neither is allowed."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):
        try:
            return socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP)
        except OSError:
            continue
    return None


def icmp_echoes(ips: list[str], wait: float = ICMP_WAIT_S) -> dict[str, float]:
    """Round-trip ms of one ICMP echo to each IPv4 address; an address missing from the answer did not reply
    within `wait` seconds (or this node has no ICMP socket).

    Why ICMP first: the peer's kernel answers it, whereas a TCP connect to port 22 makes the peer's sshd fork and
    exec a process, and every node probes every other (N^2 forks, which dominate preflight on a large fleet).
    All echoes leave together from ONE socket and the replies are read in one loop: a thread and a socket per
    peer cost ~1 ms of the node's CPU each, paid for every peer of every node. No answer proves nothing (macOS
    stealth mode drops echoes): the caller falls back to TCP. Each echo carries its own random payload, so a
    reply is matched to its address and concurrent probes never take each other's replies."""
    targets = list(dict.fromkeys(ips))
    sock = _icmp_socket() if targets else None
    if sock is None:
        return {}
    pending: dict[bytes, tuple[str, float]] = {}
    answers: dict[str, float] = {}
    try:
        for seq, ip in enumerate(targets, 1):
            token = os.urandom(12)
            ident = int.from_bytes(token[:2], "big")
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq & 0xFFFF)
            packet = struct.pack("!BBHHH", 8, 0, _checksum(header + token), ident, seq & 0xFFFF) + token
            try:
                pending[token] = (ip, time.perf_counter())
                sock.sendto(packet, (ip, 0))
            except OSError:  # unreachable at once, not permitted: the TCP fallback says why
                del pending[token]
        deadline = time.perf_counter() + wait
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                data, addr = sock.recvfrom(2048)
            except socket.timeout:
                break
            except OSError:  # an ICMP error for one echo; the others may still answer
                continue
            if data and data[0] >> 4 == 4:  # an IP header first (raw sockets; datagram sockets on macOS)
                data = data[(data[0] & 0x0F) * 4:]
            if len(data) < 8 + 12 or data[0] != 0:  # too short, or not an echo reply
                continue
            hit = pending.get(data[8:20])
            if hit is None or hit[0] != addr[0]:
                continue
            del pending[data[8:20]]
            answers[hit[0]] = (time.perf_counter() - hit[1]) * 1000
    finally:
        sock.close()
    return answers


def _target(peer: Any) -> tuple[dict[str, Any], Any]:
    """A peer spec -> (its `reach` entry, the (family, address) to probe), or (entry with the error, None)."""
    if not isinstance(peer, dict):
        return {"peer": str(peer), "ip": "", "ok": False, "rtt_ms": None, "error": "bad peer spec (not an object)"}, None
    name, ip, port = str(peer.get("name") or peer.get("ip") or "?"), str(peer.get("ip") or ""), peer.get("port", 22)
    out: dict[str, Any] = {"peer": name, "ip": ip, "ok": False, "rtt_ms": None, "error": None, "method": None}
    if port is None:
        port = 22
    if not ip:
        out["error"] = "no ip"
        return out, None
    if type(port) is not int or not 0 < port < 65536:
        out["error"] = f"bad port {port!r}"
        return out, None
    for family in (socket.AF_INET, socket.AF_INET6):
        # An address (the usual case) needs no resolver, and getaddrinfo would encode it with the IDNA codec
        # anyway, whose import costs ~5 ms of a probe. Names and scoped IPv6 addresses go through getaddrinfo.
        try:
            socket.inet_pton(family, ip)
        except OSError:
            continue
        return out, (family, (ip, port) if family == socket.AF_INET else (ip, port, 0, 0))
    try:
        infos = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        out["error"] = f"cannot resolve {ip}: {exc}"
        return out, None
    if not infos:
        out["error"] = f"cannot resolve {ip}"
        return out, None
    family, _, _, _, address = infos[0]
    return out, (family, address)


def _reach_tcp(out: dict[str, Any], family: int, address: Any, timeout: float) -> None:
    """Fill `out` from a TCP connection to the address: connected or refused both prove the address answers
    (refused is a RST from the peer's kernel); timeout, no route, unreachable: not ok, with the reason."""
    out["method"] = "tcp"
    started = time.perf_counter()
    rc = _connect(family, address, timeout)
    elapsed_ms = (time.perf_counter() - started) * 1000
    if rc is None:
        out["error"] = f"timed out after {timeout:g} s (no answer from {out['ip']}:{address[1]})"
    elif rc in (0, errno.ECONNREFUSED):
        out["ok"], out["rtt_ms"] = True, round(elapsed_ms, 3)
    else:
        out["error"] = f"{os.strerror(rc)} ({errno.errorcode.get(rc, rc)}) connecting to {out['ip']}:{address[1]}"


def reach_peers(peers: list[Any], timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
    """`reach` entries for `peers`, in order: does each peer's address answer THIS node?

    First one ICMP echo to every IPv4 address at once (`icmp_echoes`); an echo reply proves it at no cost to the
    peer. The peers that did not answer get a TCP connection to ip:port (`_reach_tcp`), in parallel, so the
    slowest is one timeout. Bad specs and unresolvable names are not ok, with the reason."""
    targets = [_target(p) for p in peers]
    echoes = icmp_echoes([str(t[1][1][0]) for t in targets if t[1] is not None and t[1][0] == socket.AF_INET],
                         min(ICMP_WAIT_S, timeout))
    tcp: list[tuple[dict[str, Any], int, Any]] = []
    for out, where in targets:
        if where is None:
            continue
        rtt = echoes.get(str(where[1][0])) if where[0] == socket.AF_INET else None
        if rtt is not None:
            out.update(ok=True, rtt_ms=round(rtt, 3), method="icmp")
        else:
            tcp.append((out, where[0], where[1]))
    for outcome in in_threads(lambda t: _reach_tcp(t[0], t[1], t[2], timeout), tcp, min(32, len(tcp))) if tcp else []:
        if outcome.error is not None:
            raise outcome.error
    return [out for out, _ in targets]


def reach_peer(peer: Any, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """One `reach` entry (see `reach_peers`)."""
    return reach_peers([peer], timeout)[0]


# ----------------------------------------------------------------------------------------------------------
# model


def safetensors_params(path: str) -> int:
    """Sum of element counts of the tensors in a .safetensors file, read from its header only.

    Layout: 8-byte little-endian header length, then that many bytes of JSON {name: {dtype, shape,
    data_offsets}} plus an optional "__metadata__". For quantized weights the counts are of the packed
    tensors (what is stored), not of the original parameters. Raises ValueError/OSError on a bad file.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError("too short to be a safetensors file")
        length = int.from_bytes(head, "little")
        size = os.fstat(fh.fileno()).st_size
        if length > MAX_SAFETENSORS_HEADER or length > size - 8:
            raise ValueError(f"header length {length} is impossible (not a safetensors file? a git-lfs pointer?)")
        header = json.loads(fh.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r} has no valid shape")
        count = 1
        for d in shape:
            count *= d
        total += count
    return total


def model_info(model_dir: str) -> dict[str, Any]:
    """The `model` section: config.json (a JSON object, else error) and the parameter count summed over
    every *.safetensors file directly in the dir (sharded or not; the index file is not needed).
    `params` is null when there are no weights or any of them cannot be read (the error says which)."""
    out: dict[str, Any] = {"config": None, "params": None, "error": None}
    problems: list[str] = []
    top = os.path.abspath(os.path.expanduser(model_dir))
    if not os.path.isdir(top):
        out["error"] = f"no such directory: {top}"
        return out
    config_path = os.path.join(top, "config.json")
    if os.path.exists(config_path):
        try:
            with open(config_path, encoding="utf-8") as fh:
                config = json.load(fh)
            if isinstance(config, dict):
                out["config"] = config
            else:
                problems.append("config.json is not a JSON object")
        except (OSError, ValueError) as exc:
            problems.append(f"cannot read config.json: {exc}")
    else:
        problems.append("no config.json")
    try:
        weights = sorted(n for n in os.listdir(top) if n.endswith(".safetensors"))
    except OSError as exc:
        problems.append(f"cannot list {top}: {exc.strerror or exc}")
        weights = []
    total = 0
    bad = False
    for name in weights:
        try:
            total += safetensors_params(os.path.join(top, name))
        except (OSError, ValueError) as exc:
            problems.append(f"{name}: {exc}")
            bad = True
    if weights and not bad:
        out["params"] = total
    if not weights and not any(p.startswith("cannot list") for p in problems):
        problems.append("no *.safetensors weights")
    out["weights"] = weights
    out["tokenizer"] = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(top, n))]
    if not out["tokenizer"]:
        problems.append(f"no tokenizer ({', '.join(TOKENIZER_FILES)})")
    out["error"] = "; ".join(problems) or None
    return out


# ----------------------------------------------------------------------------------------------------------
# data


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def sft_format(row: Any) -> str | None:
    """mlx-lm's format detection (`create_dataset`, on the first row): completions | chat | text, else None."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row and "completion" in row:
        return "completions"
    if "messages" in row:
        return "chat"
    if "text" in row:
        return "text"
    return None


def row_problem(row: Any, fmt: str) -> str | None:
    """Why one parsed row cannot be used in a file of format `fmt` (sft formats, or "dpo"); None when it can."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    if fmt == "text":
        return None if isinstance(row.get("text"), str) else '"text" is missing or not a string'
    if fmt == "chat":
        return None if _is_messages(row.get("messages")) else \
            '"messages" is missing or not a list of {"role", "content"} messages'
    if fmt == "completions":
        missing = [k for k in ("prompt", "completion") if k not in row]
        return f"{' and '.join(repr(k) for k in missing)} missing (the file's first row is prompt/completion)" \
            if missing else None
    # dpo (worker/dpo.py encode_pair)
    if "chosen" not in row or "rejected" not in row:
        return 'a preference row needs "chosen" and "rejected"'
    if "prompt" not in row and not (_is_messages(row["chosen"]) and _is_messages(row["rejected"])):
        return 'no "prompt" (only chat conversations sharing their first messages may leave it out)'
    return None


def check_data_file(path: str, fmt: str, max_bytes: int) -> dict[str, Any]:
    """Parse `path` row by row the way the trainer will (UTF-8, one JSON object per line, the format's keys):
    {"exists", "rows", "bytes", "checked_bytes", "format", "error"}. `fmt`: "sft" (format detected from the
    first row, as mlx-lm does; a blank line fails mlx-lm's loader) or "dpo" (blank lines skipped). Stops at
    the first problem, or after `max_bytes` (then checked_bytes < bytes)."""
    out: dict[str, Any] = {"exists": False, "rows": 0, "bytes": 0, "checked_bytes": 0, "format": None, "error": None}
    if not os.path.exists(path):
        return out
    out["exists"] = True
    detected = "dpo" if fmt == "dpo" else None
    rows = 0
    checked = 0
    try:
        with open(path, "rb") as fh:
            out["bytes"] = os.fstat(fh.fileno()).st_size
            for lineno, raw in enumerate(fh, 1):
                if checked >= max_bytes:
                    break
                checked += len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    out["error"] = f"line {lineno}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                    break
                if not line.strip():
                    if fmt == "dpo":
                        continue
                    out["error"] = f"line {lineno}: blank (mlx-lm parses every line as JSON)"
                    break
                try:
                    row = json.loads(line.rstrip("\r\n"))
                except ValueError as exc:
                    where = f" at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
                    out["error"] = f"line {lineno}: not JSON ({getattr(exc, 'msg', exc)}{where})"
                    break
                if detected is None:
                    detected = sft_format(row)
                    if detected is None:
                        keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                        out["error"] = (f"line {lineno}: unsupported format (has {keys or 'no keys'}; needs "
                                        '"text", "messages", or "prompt" and "completion")')
                        break
                problem = row_problem(row, detected)
                if problem is not None:
                    out["error"] = f"line {lineno}: {problem}"
                    break
                rows += 1
    except OSError as exc:
        out["error"] = f"cannot read: {exc.strerror or exc}"
    out.update(rows=rows, checked_bytes=min(checked, out["bytes"]), format=detected)
    if out["error"] is None and rows == 0 and checked >= out["bytes"]:
        out["error"] = "no rows (an empty file fails the loader)"
    return out


def check_data(spec: Any) -> dict[str, Any]:
    """The `data` section for a `data_check` argument (see the module docstring)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("dir"), str):
        return {"dir": None, "files": [], "error": "data_check needs {\"dir\": str, ...}"}
    top = os.path.abspath(os.path.expanduser(spec["dir"]))
    out: dict[str, Any] = {"dir": spec["dir"], "files": [], "error": None}
    if not os.path.isdir(top):
        out["error"] = f"no such directory: {top}"
        return out
    fmt = "dpo" if spec.get("format") == "dpo" else "sft"
    limit = spec.get("max_bytes")
    limit = limit if type(limit) is int and limit > 0 else DATA_CHECK_MAX_BYTES
    for item in spec.get("files") or []:
        name, required = (item[0], bool(item[1])) if isinstance(item, list) and len(item) == 2 else (str(item), True)
        entry = check_data_file(os.path.join(top, str(name)), fmt, limit)
        out["files"].append({"name": str(name), "required": required, **entry})
    return out


# ----------------------------------------------------------------------------------------------------------
# versions and driver


def python_info() -> dict[str, Any]:
    return {"executable": sys.executable, "version": ".".join(str(v) for v in sys.version_info[:3])}


WANTED_DISTRIBUTIONS = (("mlx", "mlx"), ("mlx_lm", "mlx-lm"))  # (answer key, distribution name)
# mlx's compute backend is a separate distribution of the same version (mlx 0.32): mlx-metal on macOS (plain `mlx`
# pulls it), on Linux mlx-cpu (`mlx[cpu]`) or mlx-cuda-12 / mlx-cuda-13 (`mlx[cuda12]`, `mlx[cuda13]`). Without
# one, `import mlx.core` fails (libmlx.so missing), so the coordinator must know which are installed; their
# dist-info names say it without importing mlx.
BACKEND_DISTRIBUTIONS = ("mlx-metal", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")


def _normalise(name: str) -> str:
    """PEP 503 name normalisation: `MLX_lm`, `mlx.lm` and `mlx-lm` are one distribution."""
    out: list[str] = []
    dash = False
    for ch in name.lower():
        if ch in "-_.":
            dash = True
            continue
        if dash and out:
            out.append("-")
        dash = False
        out.append(ch)
    return "".join(out)


def installed_from_paths(paths: list[str], wanted: set[str], enough: set[str] | None = None) -> dict[str, str]:
    """{normalised name: version} of the `wanted` distributions, from the `<name>-<version>.dist-info` (and
    `<name>-<version>[-pyX.Y].egg-info`) entries of `paths`, first match wins as for imports. The installer
    writes the version into the entry's name, so no METADATA file is read and importlib.metadata (~50 ms to
    import, a third of the probe) is needed only for what this scan cannot see (zips, custom finders).
    The scan stops after the first path entry by which all of `enough` (default: `wanted`) were found."""
    enough = wanted if enough is None else enough
    found: dict[str, str] = {}
    for entry in paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.rpartition(".")
            if not dot or suffix not in ("dist-info", "egg-info"):
                continue
            parts = stem.split("-")
            if suffix == "egg-info" and len(parts) > 2 and parts[-1].startswith("py"):
                parts = parts[:-1]
            if len(parts) < 2:
                continue
            dist = _normalise("-".join(parts[:-1]))
            if dist in wanted and dist not in found:
                found[dist] = parts[-1]
        if enough.issubset(found):
            break
    return found


def scan_distributions() -> dict[str, str]:
    """The dist-info scan of sys.path for mlx, mlx-lm and mlx's backend distributions (one pass). It ends with
    the entry that holds mlx and mlx-lm: their backends are installed next to them."""
    core = {_normalise(dist) for _, dist in WANTED_DISTRIBUTIONS}
    return installed_from_paths(list(sys.path), core | set(BACKEND_DISTRIBUTIONS), enough=core)


def backend_versions(found: dict[str, str]) -> dict[str, str]:
    """{distribution: version} of the installed mlx backends (the `mlx_backends` answer), from the scan alone:
    importlib.metadata would cost ~50 ms on every probe to ask about packages that are usually absent."""
    return {dist: found[dist] for dist in BACKEND_DISTRIBUTIONS if dist in found}


def package_versions(found: dict[str, str] | None = None) -> dict[str, str | None]:
    """Installed versions of the mlx and mlx-lm distributions (null when absent), from their dist-info entries
    on sys.path; importlib.metadata decides only those the scan did not find."""
    found = scan_distributions() if found is None else found
    out: dict[str, str | None] = {}
    for key, dist in WANTED_DISTRIBUTIONS:
        version = found.get(_normalise(dist))
        if version is None:
            from importlib import metadata

            with contextlib.suppress(metadata.PackageNotFoundError):
                version = metadata.version(dist)
        out[key] = version
    return out


def _arg(args: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any, errors: list[str]) -> Any:
    value = args.get(key, default)
    # bool is an int subclass: `"jobs": true` is a mistake, not one job.
    if value is default or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return value
    errors.append(f"argument {key!r} must be {'/'.join(k.__name__ for k in kinds)}, not {type(value).__name__}")
    return default


def run(args: dict[str, Any], stderr: IO[str] | None = None) -> dict[str, Any]:
    """The whole probe for parsed arguments; never raises. Peers are probed while files are hashed."""
    errors: list[str] = []
    out: dict[str, Any] = {"python": python_info(), "packages": {"mlx": None, "mlx_lm": None}, "errors": errors}
    unknown = sorted(set(args) - KNOWN_ARGS)
    if unknown:
        errors.append(f"unknown arguments ignored: {', '.join(unknown)}")
    dirs = _arg(args, "hash_dirs", (list,), [], errors)
    peers = _arg(args, "peers", (list,), [], errors)
    cache = _arg(args, "cache", (str, type(None)), DEFAULT_CACHE, errors)
    model_dir = _arg(args, "model_dir", (str, type(None)), None, errors)
    jobs = _arg(args, "jobs", (int,), 0, errors)
    progress = _arg(args, "progress", (bool,), False, errors)
    timeout = _arg(args, "timeout", (int, float), DEFAULT_TIMEOUT, errors)
    data_check = _arg(args, "data_check", (dict, type(None)), None, errors)
    if timeout <= 0:
        errors.append(f"argument 'timeout' must be > 0, not {timeout}")
        timeout = DEFAULT_TIMEOUT
    if not all(isinstance(d, str) for d in dirs):
        errors.append("argument 'hash_dirs' must be a list of strings")
        dirs = [str(d) for d in dirs]

    # Reachability waits on the network (up to `timeout`), hashing on the disk: overlap them.
    reach = Background(lambda: reach_peers(peers, float(timeout)))
    try:
        found = scan_distributions()
        out["packages"] = package_versions(found)
        out["mlx_backends"] = backend_versions(found)
    except Exception as exc:  # noqa: BLE001 - a broken metadata dir must not cost us the rest of the answer
        errors.append(f"package versions: {type(exc).__name__}: {exc}")
    try:
        out["model"] = model_info(model_dir) if model_dir else {"config": None, "params": None, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the probe goes on
        out["model"] = {"config": None, "params": None, "error": f"{type(exc).__name__}: {exc}"}
    if data_check is not None:
        try:
            out["data"] = check_data(data_check)
        except Exception as exc:  # noqa: BLE001 - reported as the section's error, the rest goes on
            out["data"] = {"dir": None, "files": [], "error": f"{type(exc).__name__}: {exc}"}
    try:
        out["hashes"] = hash_dirs(dirs, cache or None, jobs, progress, stderr, errors)
    except Exception as exc:  # noqa: BLE001 - no `hashes` key: the coordinator must not see "no files"
        errors.append(f"hashing failed: {type(exc).__name__}: {exc}")
    try:
        out["reach"] = reach.result()
    except Exception as exc:  # noqa: BLE001 - reported, like every other failure
        errors.append(f"reachability failed: {type(exc).__name__}: {exc}")
        out["reach"] = []
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse the one JSON argument, print the answer as one JSON line on stdout."""
    argv = sys.argv[1:] if argv is None else argv
    args: Any = {}
    problem = None
    if len(argv) > 1:
        problem = f"expected at most one argument (a JSON object), got {len(argv)}"
    elif argv:
        try:
            args = json.loads(argv[0])
        except ValueError as exc:
            problem = f"argument is not JSON: {exc}"
        else:
            if not isinstance(args, dict):
                problem = f"argument is not a JSON object but {type(args).__name__}"
    if problem is not None:
        sys.stderr.write(f"worker probe: {problem}\n")
        answer: dict[str, Any] = {"python": python_info(), "packages": {"mlx": None, "mlx_lm": None},
                                  "errors": [problem]}
        code = 2
    else:
        code = 0
        try:
            answer = run(args)
        except Exception as exc:  # noqa: BLE001 - `run` should not raise; if it does, still answer in JSON
            answer = {"python": python_info(), "packages": {"mlx": None, "mlx_lm": None},
                      "errors": [f"probe failed: {type(exc).__name__}: {exc}"]}
    sys.stdout.write(json.dumps(answer, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    status = main()
    # The answer is out and flushed. A probe is a one-shot process on every node of every preflight: the
    # interpreter's teardown (module cleanup, a last garbage collection) would cost ~5 ms of its ~40 and
    # changes nothing. (Also, no thread left behind, e.g. a TCP probe past its timeout, can hold the exit.)
    sys.stderr.flush()
    os._exit(status)
