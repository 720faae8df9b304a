"""Node side of `coordinator sync`: manifests, and a pipelined chain relay that copies files between nodes.

Run by the coordinator over SSH (stdlib only, Python 3.9+, the shipped worker package on PYTHONPATH). Every
subcommand reads ONE JSON object on stdin (the token never appears on a command line, where `ps` would show it)
and prints JSON lines on stdout; progress goes to stderr as `progress <bytes>` lines.

    python -m worker.relay plan      stdin {"dirs": {"model": "/srv/model", ...}, "cache": path|null}
        -> {"manifest": {"model/a.bin": [size, sha256]}, "partials": {"model/a.bin": [size, sha256 expected]},
            "free": {"model": bytes}, "dev": {"model": st_dev}, "missing": ["data"], "errors": [...]}
    python -m worker.relay delete    stdin {"dirs": {...}, "paths": ["model/x"]}  -> {"deleted": [...], "errors"}
    python -m worker.relay serve --bind IP    stdin {"token", "dirs", "need": ["model/a.bin"], "timeout": s}
        prints {"port": N} once listening, then {"received": {...}, "errors": [...]} when done
    python -m worker.relay send      stdin {"token", "dirs", "files": [...], "chain": [[ip, port], ...]}
        -> {"sent": bytes, "errors": [...]}

Wire protocol (one TCP connection per hop, upstream -> downstream): line 1 is the per-sync token; line 2 a JSON
header {"chain": [[ip, port], ...] (the hops after the receiver), "files": [{"path", "size", "sha256",
"start"}]}; then, per file in order, its bytes [start, size) back to back. A receiver checks the token before
reading anything else (a wrong one: the connection is closed and the relay keeps waiting for the right one),
validates EVERY path of the header before writing a byte, connects to the next hop and forwards each chunk as
soon as it has written it, so N nodes take about the time of one copy.

Files it needs land in `<file>.partial` (its expected sha256 and the file's name in `<file>.partial.sha256`, so
a later run knows what a leftover prefix belongs to; a name too long for that gets a shortened, hashed partial
name: `partial_path`). A file this node cannot write fails alone: its bytes are still forwarded and the files
after it delivered.

Lifeline: with `"lifeline": true` in the spec, the coordinator keeps stdin open after the spec line and the
relay exits (status 3) the moment it closes, or at `"deadline"` seconds; `serve`/`send` then also print `pid N`
and an `alive` heartbeat line every second on stderr, so the coordinator can kill a hung relay.

A resumed file is truncated to `start`, the kept prefix is hashed from disk, and the rest appended; the file gets
its final name only once the whole file's SHA256 matches, and its digest goes into the probe's stat-keyed hash
cache so the verifying manifest does not read it again.

Paths: relative, "/"-separated, the first part a label of `dirs`, no empty/`.`/`..` parts, no NUL; every
existing dir component under the target dir must be a real directory (never a symlink), the `.partial` file is
opened with O_NOFOLLOW and renamed over the final name (replacing a symlink there, not writing through it), so
nothing is ever written outside the target dir. The source reads through symlinks.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import shutil
import socket
import stat
import sys
import threading
import time

from worker import probe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any

CHUNK = 1 << 20  # bytes per read/forward: the unit a resumed transfer may repeat
PARTIAL = ".partial"
PARTIAL_SHA = ".partial.sha256"
NAME_MAX = 255  # bytes in one file name (Linux and macOS): `<name>.partial.sha256` must fit too
HEARTBEAT = 1.0  # seconds between a serving/sending relay's `alive` lines (the coordinator stops a silent one)
LIFELINE_EXIT = 3  # exit status of a relay whose coordinator went away (its stdin closed) or whose deadline passed
_ERR_LOCK = threading.Lock()  # progress lines and the heartbeat share stderr
CONNECT_TIMEOUT = 5.0  # seconds to reach the next hop
DEFAULT_TIMEOUT = 60.0  # seconds a socket may stay silent (accept included) before the relay gives up
PROGRESS_INTERVAL = 0.25
MAX_HEADER = 64 * 1024 * 1024


class RelayError(Exception):
    """A refused path, a bad header or a broken connection; the message goes into the JSON answer."""


def is_partial_name(rel: str) -> bool:
    return rel.endswith(PARTIAL) or rel.endswith(PARTIAL_SHA)


def check_path(rel: Any, dirs: dict[str, str]) -> tuple[str, str]:
    """(label, relative path inside the label's dir) for a header path, or RelayError. Pure: the filesystem side
    (symlinks) is `safe_target`'s."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise RelayError(f"refused path {rel!r}: not a plain relative path")
    if rel.startswith("/"):
        raise RelayError(f"refused path {rel!r}: absolute")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise RelayError(f"refused path {rel!r}: empty, '.' or '..' component")
    if parts[0] not in dirs or len(parts) < 2:
        raise RelayError(f"refused path {rel!r}: not under one of {sorted(dirs)}")
    if is_partial_name(rel):
        raise RelayError(f"refused path {rel!r}: reserved suffix")
    return parts[0], "/".join(parts[1:])


def partial_path(path: str) -> str:
    """Where the file at `path` is received before its rename: `<path>.partial`, or, when that name (with the
    `.sha256` of its sidecar) would pass NAME_MAX, the name cut short plus a hash of it (`<start>~<hash16>.partial`),
    so a 250-character file name syncs like any other. The sidecar `<partial>.sha256` records the expected sha256
    and the real name (so `plan` maps a shortened partial back to its file)."""
    head, name = os.path.split(path)
    if len(name.encode()) + len(PARTIAL_SHA) <= NAME_MAX:
        return path + PARTIAL
    import hashlib

    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    short = name.encode()[: NAME_MAX - len(PARTIAL_SHA) - len(digest) - 1].decode(errors="ignore")
    return os.path.join(head, f"{short}~{digest}{PARTIAL}")


def _top(d: str) -> str:
    return os.path.abspath(os.path.expanduser(d))


def source_path(rel: str, dirs: dict[str, str]) -> str:
    """Where the source reads `rel`: through symlinks (a Hugging Face snapshot is links to blobs; reading is
    harmless, and the manifest followed them too)."""
    label, inner = check_path(rel, dirs)
    return os.path.join(_top(dirs[label]), inner)


def safe_target(rel: str, dirs: dict[str, str], *, create: bool) -> str:
    """The absolute path for `rel`, its parent dirs created (when `create`) as real directories. Raises
    RelayError when any existing dir component below the target dir is a symlink or not a directory. The final
    name may be a symlink: the rename of the verified `.partial` replaces the link itself, never its target."""
    label, inner = check_path(rel, dirs)
    top = _top(dirs[label])
    if create:
        os.makedirs(top, exist_ok=True)
    current = top
    for part in inner.split("/")[:-1]:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return os.path.join(top, inner)
            os.mkdir(current)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise RelayError(f"refused path {rel!r}: {current} is a symlink or not a directory")
    return os.path.join(top, inner)


# ------------------------------------------------------------------------------------------------ plan


def plan(spec: dict[str, Any]) -> dict[str, Any]:
    """Manifest (through the probe's stat-keyed hash cache), leftover partials, free space per dir."""
    dirs: dict[str, str] = spec["dirs"]
    cache = probe.HashCache(spec.get("cache", probe.DEFAULT_CACHE) or None)
    exclude = (cache.path, os.path.realpath(cache.path)) if cache.path else ()
    errors: list[str] = []
    manifest: dict[str, list[Any]] = {}
    partials: dict[str, list[Any]] = {}
    free: dict[str, int] = {}
    devs: dict[str, int] = {}
    missing: list[str] = []
    for label, d in dirs.items():
        top = _top(d)
        probe_dir = top
        while not os.path.exists(probe_dir) and probe_dir != os.path.dirname(probe_dir):
            probe_dir = os.path.dirname(probe_dir)
        usage = shutil.disk_usage(probe_dir)
        free[label] = usage.free
        devs[label] = os.stat(probe_dir).st_dev
        scan = probe.scan_dir(top, exclude)
        if not scan.exists:
            missing.append(label)
            continue
        errors.extend(f"{label}: {e}" for e in scan.errors)
        for f in scan.files:
            rel = f"{label}/{f.rel}"
            if f.rel.endswith(PARTIAL_SHA):
                # A sidecar whose partial is gone (a crash between the two unlinks): an empty partial, so the
                # coordinator deletes it (or reuses the name) like any leftover, and preflight sees no extra.
                partials.setdefault(_partial_key(rel[: -len(".sha256")], f.path[: -len(".sha256")]), [0, ""])
                continue
            if f.rel.endswith(PARTIAL):
                want = _sidecar(f.path)[0]
                key = _partial_key(rel, f.path)
                # A partial that is not a regular file of ours (a dir's files are listed as files, a symlink is
                # followed) is of no use: recorded so the coordinator removes it.
                partials[key] = [f.size, want if os.path.isfile(f.path) and not os.path.islink(f.path) else ""]
                continue
            sha = cache.get(f)
            if sha is None:
                try:
                    sha, st = probe.sha256_file(f.path)
                except (OSError, probe.FileChanged) as exc:
                    errors.append(f"cannot read {rel}: {exc}")
                    continue
                cache.put(f.real, st, sha)
            manifest[rel] = [f.size, sha]
        if scan.real is not None:
            cache.forget_missing(scan.real, {f.real for f in scan.files})
    with contextlib.suppress(OSError):
        cache.save()
    return {"manifest": manifest, "partials": partials, "free": free, "dev": devs, "missing": missing,
            "errors": errors}


def _sidecar(partial: str) -> tuple[str, str | None]:
    """(expected sha256, real file name or None) from `<partial>.sha256`; ("", None) when unreadable."""
    try:
        with open(partial + ".sha256", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return "", None
    return (lines[0].strip() if lines else ""), (lines[1] if len(lines) > 1 and lines[1] else None)


def _partial_key(rel: str, path: str) -> str:
    """The `<label>/<path>` a partial found at `rel` (on disk at `path`) belongs to: its sidecar's name when that
    name's partial_path is this very file (a shortened one), else its own name less `.partial`."""
    name = _sidecar(path)[1]
    if name is not None and "/" not in name and partial_path(os.path.join(os.path.dirname(path), name)) == path:
        return f"{rel.rsplit('/', 1)[0]}/{name}"
    return rel[: -len(PARTIAL)]


def delete(spec: dict[str, Any]) -> dict[str, Any]:
    """Remove the files named (extras; `<file>.partial` names a leftover partial and its .sha256). A path that
    fails validation is refused, not removed."""
    dirs: dict[str, str] = spec["dirs"]
    deleted: list[str] = []
    errors: list[str] = []
    for rel in spec.get("paths", []):
        is_partial = isinstance(rel, str) and rel.endswith(PARTIAL)
        try:
            target = safe_target(rel[: -len(PARTIAL)] if is_partial else rel, dirs, create=False)
        except RelayError as exc:
            errors.append(str(exc))
            continue
        for p in (partial_path(target), partial_path(target) + ".sha256") if is_partial else (target,):
            try:
                if is_partial and os.path.isdir(p) and not os.path.islink(p):
                    os.rmdir(p)  # a dir at our reserved name: its files were deleted as extras first
                    deleted.append(rel)
                    continue
                os.unlink(p)
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(f"cannot delete {rel}: {exc.strerror or exc}")
                continue
            deleted.append(rel)
    return {"deleted": sorted(set(deleted)), "errors": errors}


# ------------------------------------------------------------------------------------------------ wire


def _read_line(sock: socket.socket | Pipe, limit: int) -> bytes:
    buf = bytearray()
    while True:
        b = sock.recv(1)
        if not b:
            raise RelayError("connection closed before the header")
        if b == b"\n":
            return bytes(buf)
        buf += b
        if len(buf) > limit:
            raise RelayError("header line too long")


class Pipe:
    """A binary stdin or stdout with the few socket methods the relay uses: the SSH fallback (`serve --stdin`,
    `send --stdout`) runs the same protocol over the coordinator's SSH channels."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def recv(self, n: int) -> bytes:
        return self.fh.read1(n)  # type: ignore[no-any-return]

    def recv_into(self, view: memoryview) -> int:
        return self.fh.readinto1(view)  # type: ignore[no-any-return]

    def sendall(self, data: bytes | memoryview) -> None:
        self.fh.write(data)

    def close(self) -> None:
        self.fh.flush()


def _recv_into(sock: socket.socket | Pipe, view: memoryview) -> int:
    n = sock.recv_into(view)
    if n == 0:
        raise RelayError("upstream closed the connection mid-file")
    return n


class Meter:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.done = 0
        self.last = 0.0

    def add(self, n: int, final: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_INTERVAL:
            self.last = now
            with _ERR_LOCK:
                self.stream.write(f"progress {self.done}\n")
                self.stream.flush()


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _open_partial(path: str, start: int, sha: str) -> tuple[int, Any]:
    """(fd, hash seeded with the kept prefix) for `path`'s partial, truncated to `start` bytes."""
    import hashlib

    digest = hashlib.sha256()
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    partial = partial_path(path)
    for name in (partial, partial + ".sha256"):
        # Our reserved names: a symlink there is removed (the link, never its target), an emptied dir too (its
        # files were deleted as extras); anything else fails the open below, for this file only.
        if os.path.islink(name):
            os.unlink(name)
        elif os.path.isdir(name):
            os.rmdir(name)
    side = os.open(partial + ".sha256", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | nofollow, 0o644)
    with os.fdopen(side, "w", encoding="utf-8") as fh:
        fh.write(f"{sha}\n{os.path.basename(path)}\n")
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size < start:
            raise RelayError(f"{partial} has {size} bytes, the stream resumes at {start}")
        os.ftruncate(fd, start)
        done = 0
        while done < start:
            block = os.pread(fd, min(probe.CHUNK, start - done), done)
            if not block:
                raise RelayError(f"{partial} shrank while resuming")
            digest.update(block)
            done += len(block)
        os.lseek(fd, start, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd, digest


def _finish(path: str, fd: int, digest: Any, want: str, cache: Any) -> str | None:
    """Rename the partial to `path` when its digest is `want`; the error otherwise (the partial is removed: its
    bytes are wrong, resuming from them would never match)."""
    partial = partial_path(path)
    try:
        got = digest.hexdigest()
        if got != want:
            os.close(fd)
            for p in (partial, partial + ".sha256"):
                with contextlib.suppress(OSError):
                    os.unlink(p)
            return f"sha256 {got[:12]} != expected {want[:12]} (the source changed while being sent?)"
        os.fsync(fd)
        st = os.fstat(fd)
        os.close(fd)
        os.replace(partial, path)
        with contextlib.suppress(OSError):
            os.unlink(partial + ".sha256")
        cache.put(os.path.realpath(path), st, want)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def relay(up: socket.socket | Pipe | None, files: list[dict[str, Any]], chain: list[list[Any]], token: str,
          dirs: dict[str, str], need: set[str], source: bool, meter: Meter, timeout: float,
          pipe: Pipe | None = None) -> dict[str, Any]:
    """Stream `files` (from disk when `source`, else from `up`) to the next hop of `chain` (or to `pipe`), writing
    the ones in `need` locally. Returns {"bytes": moved, "files": [...done], "errors": [...], "downstream": error
    of the next hop or None}.

    Failure semantics: a broken upstream (or, on the source, an unreadable file or a broken first hop) ends the
    stream (RelayError / OSError). Anything else is per file or per hop and the stream goes on: a file this node
    cannot write (a refused path, a name its filesystem refuses, a full disk, a digest mismatch) is an error for
    that file while its bytes are still forwarded, so one bad file never stops the files after it; a next hop
    that fails is recorded in "downstream" and this node keeps receiving for itself."""
    targets: dict[str, str | None] = {}
    errors: list[str] = []
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("size"), int) or not isinstance(f.get("start"), int) \
                or not isinstance(f.get("sha256"), str) or not 0 <= f["start"] <= f["size"]:
            raise RelayError(f"bad file entry in header: {f!r}")
        if source:
            targets[f["path"]] = source_path(f["path"], dirs)
            continue
        check_path(f["path"], dirs)  # a malformed path refuses the whole header (it was checked on accept too)
        try:
            targets[f["path"]] = safe_target(f["path"], dirs, create=f["path"] in need)
        except (RelayError, OSError) as exc:
            targets[f["path"]] = None
            if f["path"] in need:
                errors.append(f"{f['path']}: {exc}")
    down: socket.socket | Pipe | None = pipe
    hop = ""
    downstream: str | None = None  # why the next hop failed (this node then goes on for itself)
    if chain:
        ip, port = chain[0]
        hop = f"{ip}:{port}"
        # A short connect timeout: an unreachable next hop must fail fast, so the coordinator falls back to SSH.
        # A receiver that cannot reach it still receives for itself (the coordinator serves the rest).
        try:
            down = socket.create_connection((ip, int(port)), timeout=min(timeout, CONNECT_TIMEOUT))
            down.settimeout(timeout)
            down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            if source:
                raise
            downstream = f"next hop {hop} unreachable: {exc.strerror or exc}"
    if down is not None:
        header = json.dumps({"chain": chain[1:], "files": files}, separators=(",", ":"))
        try:
            down.sendall(token.encode() + b"\n" + header.encode() + b"\n")
        except OSError as exc:
            if source or not isinstance(down, socket.socket):
                raise
            downstream = f"next hop {hop} failed: {exc.strerror or exc}"
            down.close()
            down = None
    cache = probe.HashCache(probe.DEFAULT_CACHE)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    done: list[str] = []
    moved = 0
    try:
        for f in files:
            rel, start, size = f["path"], f["start"], f["size"]
            path = targets[rel]
            fd = -1
            digest = None
            src = None
            if source:
                assert path is not None
                src = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in the finally below
                src.seek(start)
            elif rel in need and path is not None:
                try:
                    fd, digest = _open_partial(path, start, f["sha256"])
                except (RelayError, OSError) as exc:
                    errors.append(f"{rel}: {exc}")
            try:
                left = size - start
                while left:
                    want = min(CHUNK, left)
                    if src is not None:
                        n = src.readinto(view[:want]) or 0
                        if n == 0:
                            raise RelayError(f"{rel} shrank on the source while being sent")
                    else:
                        assert up is not None
                        n = _recv_into(up, view[:want])
                    chunk = view[:n]
                    if fd >= 0 and digest is not None:
                        try:
                            _write_all(fd, chunk)
                            digest.update(chunk)
                        except OSError as exc:  # a full disk, an I/O error: this file fails, the stream goes on
                            errors.append(f"{rel}: {exc.strerror or exc}")
                            os.close(fd)
                            fd = -1
                    if down is not None:
                        try:
                            down.sendall(chunk)
                        except OSError as exc:
                            if source or not isinstance(down, socket.socket):
                                raise
                            downstream = f"next hop {hop} failed: {exc.strerror or exc}"
                            down.close()
                            down = None
                    left -= n
                    moved += n
                    meter.add(n)
            finally:
                if src is not None:
                    src.close()
                if fd >= 0 and left:  # the stream broke mid-file: keep the partial (the next run resumes it)
                    os.close(fd)
                    fd = -1
            if fd >= 0:
                problem = _finish(path or "", fd, digest, f["sha256"], cache)
                if problem:
                    errors.append(f"{rel}: {problem}")
                else:
                    done.append(rel)
        meter.add(0, final=True)
        if isinstance(down, socket.socket):
            down.shutdown(socket.SHUT_WR)
            # Wait for the next hop to close: its last bytes are then on its disk, not in our socket buffer.
            with contextlib.suppress(OSError):
                while down.recv(1):
                    pass
    finally:
        if down is not None:
            down.close()
        with contextlib.suppress(OSError):
            cache.save()
    return {"bytes": moved, "files": done, "errors": errors, "downstream": downstream}


def _accept_header(conn: socket.socket | Pipe, token: str, dirs: dict[str, str], peer: str) -> dict[str, Any]:
    """The checked header of one upstream connection; RelayError (or ValueError, OSError) to refuse it."""
    line = _read_line(conn, 4096)
    if not hmac.compare_digest(line, token.encode()):
        raise RelayError(f"wrong token from {peer}")
    header = json.loads(_read_line(conn, MAX_HEADER))
    if not isinstance(header, dict) or not isinstance(header.get("files"), list) \
            or not isinstance(header.get("chain"), list):
        raise RelayError("bad header")
    for f in header["files"]:
        check_path(f.get("path") if isinstance(f, dict) else f, dirs)
    return header


def serve(bind: str | None, spec: dict[str, Any], out: IO[str], err: IO[str], stdin: Any = None) -> int:
    """Receive one stream: from the first upstream that connects to `bind` with the token, or (`bind` None) from
    `stdin`, the rest of the coordinator's SSH channel."""
    token: str = spec["token"]
    dirs: dict[str, str] = spec["dirs"]
    need = set(spec.get("need", []))
    timeout = float(spec.get("timeout", DEFAULT_TIMEOUT))
    refused: list[str] = []
    meter = Meter(err)
    conn: socket.socket | Pipe
    if bind is None:
        conn = Pipe(stdin)
        try:
            header = _accept_header(conn, token, dirs, "stdin")
        except (RelayError, ValueError, OSError) as exc:
            out.write(json.dumps({"error": f"refused: {exc}"}) + "\n")
            return 1
    else:
        listener = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind, int(spec.get("port", 0))))
        listener.listen(8)
        listener.settimeout(timeout)
        out.write(json.dumps({"port": listener.getsockname()[1]}) + "\n")
        out.flush()
        while True:
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                out.write(json.dumps({"error": f"no upstream connected within {timeout:g}s", "refused": refused})
                          + "\n")
                return 1
            sock.settimeout(timeout)
            try:
                header = _accept_header(sock, token, dirs, peer[0])
            except (RelayError, ValueError, OSError) as exc:
                # Refuse this connection, keep waiting for the real upstream (a stray or hostile client must not
                # make the sync fail, and gets nothing written).
                refused.append(str(exc))
                err.write(f"refused: {exc}\n")
                err.flush()
                sock.close()
                continue
            break
        listener.close()
        conn = sock
    try:
        result = relay(conn, header["files"], header["chain"], token, dirs, need, False, meter, timeout)
    except (RelayError, OSError) as exc:
        out.write(json.dumps({"error": str(exc), "refused": refused}) + "\n")
        return 1
    finally:
        conn.close()
    result["refused"] = refused
    out.write(json.dumps(result) + "\n")
    return 0 if not result["errors"] else 1


def send(spec: dict[str, Any], out: IO[str], err: IO[str], stdout: Any = None) -> int:
    """Stream the files from disk: to the chain's first hop, or (`stdout` given) into the coordinator's SSH
    channel, the answer then going to `err` as a `result {...}` line."""
    pipe = Pipe(stdout) if stdout is not None else None
    answer = err if pipe is not None else out
    try:
        result = relay(None, spec["files"], spec["chain"], spec["token"], spec["dirs"], set(), True, Meter(err),
                       float(spec.get("timeout", DEFAULT_TIMEOUT)), pipe)
    except (RelayError, OSError) as exc:
        answer.write(("result " if pipe else "") + json.dumps({"error": str(exc)}) + "\n")
        return 1
    finally:
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    answer.write(("result " if pipe else "") + json.dumps(result) + "\n")
    return 0 if not result["errors"] else 1


def _hold_lifeline(deadline: Any, *, heartbeat: bool) -> None:
    """Die with the coordinator: the coordinator keeps our stdin open (after the spec line) for as long as it
    wants us; when it closes (the coordinator exited or was killed, its SSH session dropped, or it gave up on us)
    we exit at once, whatever we are doing (a partial stays, and resumes next time). `deadline` (seconds) bounds
    us even should that fail. `heartbeat`: an `alive` line on stderr every HEARTBEAT s, so the coordinator can
    tell a hung relay (silent) from one that is merely waiting."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 65536):  # the raw fd: a daemon thread must not hold sys.stdin's buffer lock at exit
                pass
        os._exit(LIFELINE_EXIT)

    def expire() -> None:
        time.sleep(float(deadline))
        os._exit(LIFELINE_EXIT)

    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT)
            with _ERR_LOCK, contextlib.suppress(OSError, ValueError):
                sys.stderr.write("alive\n")
                sys.stderr.flush()

    if heartbeat:
        with _ERR_LOCK:
            sys.stderr.write(f"pid {os.getpid()}\n")  # so a hung relay can be killed by the coordinator
            sys.stderr.flush()
    threading.Thread(target=watch, daemon=True).start()
    if isinstance(deadline, (int, float)) and deadline > 0:
        threading.Thread(target=expire, daemon=True).start()
    if heartbeat:
        threading.Thread(target=beat, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.relay")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan")
    sub.add_parser("delete")
    p = sub.add_parser("send")
    p.add_argument("--stdout", action="store_true", help="stream into stdout (the SSH fallback)")
    s = sub.add_parser("serve")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--bind", help="listen on this (data-plane) IP")
    where.add_argument("--stdin", action="store_true", help="read the stream from stdin (the SSH fallback)")
    args = parser.parse_args(argv)
    try:
        # One line: the stream may follow it on the same stdin (serve --stdin).
        spec = json.loads(sys.stdin.buffer.readline())
        if not isinstance(spec, dict) or not isinstance(spec.get("dirs"), dict):
            raise ValueError("stdin must be a JSON object with 'dirs'")
    except ValueError as exc:
        print(json.dumps({"error": f"bad spec: {exc}"}))
        return 2
    if spec.get("lifeline"):
        _hold_lifeline(spec.get("deadline"), heartbeat=args.cmd in ("serve", "send"))
    if args.cmd == "plan":
        print(json.dumps(plan(spec)))
        return 0
    if args.cmd == "delete":
        print(json.dumps(delete(spec)))
        return 0
    if args.cmd == "send":
        return send(spec, sys.stdout, sys.stderr, sys.stdout.buffer if args.stdout else None)
    return serve(None if args.stdin else args.bind, spec, sys.stdout, sys.stderr, sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main())
