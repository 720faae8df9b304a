"""The control plane: one connection per node, reused for every command.

Two transports answer the same calls: `SshTransport` (asyncssh; host keys verified against known_hosts by
default) and `LocalTransport` (a subprocess on this machine, for `connection: local` nodes). Every command is
an argv list; the SSH transport quotes it with `shlex.join`, so no inventory or playbook value can inject shell.

Failure semantics: `connect`/`run` raise `TransportError` (or its `HostKeyError`); `Fleet` turns those into
per-node results so one dead node never aborts the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import asyncssh

from coordinator.errors import HostKeyError, TransportError
from coordinator.facts.probe import pythonpath_prepend

# The result records live in the pure `models` (the checks layer reads them without importing asyncssh); named
# here too (`as`: an explicit re-export) for callers that import them from the transport.
from coordinator.models import ConnectInfo as ConnectInfo
from coordinator.models import Connection, Node
from coordinator.models import RemoteResult as RemoteResult

DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_COMMAND_TIMEOUT = 60.0
CHUNK = 1 << 16  # bytes per read of a command's output
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
                     "aes128-ctr", "aes192-ctr", "aes256-ctr")
DEFAULT_CONCURRENCY = 64


@dataclass(frozen=True)
class RawProcess:
    """A remote (or local) process with binary pipes, for bulk data (`coordinator sync`'s SSH fallback).
    `stdin` has write/drain/write_eof, `stdout`/`stderr` read(n)/readline(); `wait()` gives the exit status
    (None when killed by a signal); `kill()` ends it."""

    stdin: Any
    stdout: Any
    stderr: Any
    wait: Callable[[], Awaitable[int | None]]
    kill: Callable[[], None]


class Transport(Protocol):
    node: Node

    async def connect(self) -> ConnectInfo: ...

    async def run(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT
    ) -> RemoteResult: ...

    def stream(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT,
        lines: bool = True,
    ) -> AsyncIterator[tuple[str, str]]: ...

    async def upload(self, files: Sequence[Path], remote_dir: str, *, timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
        """Copy local `files` into `remote_dir` (created if missing; `~/` is the login's home). Raises
        TransportError."""
        ...
    async def open_binary(self, argv: Sequence[str]) -> RawProcess: ...

    async def close(self) -> None: ...


def sftp_path(path: str) -> str:
    """A node path as SFTP names it: SFTP paths are relative to the login's home, so `~/x` is `x` and `~` is `.`."""
    if path in ("~", "~/"):
        return "."
    return path[2:] if path.startswith("~/") else path


def build_command(argv: Sequence[str]) -> str:
    """The one place a remote command string is made: every argument is shell-quoted."""
    if not argv:
        raise ValueError("empty argv")
    return shlex.join(argv)


def python_argv(python: str, *args: str) -> list[str]:
    """argv running the node's python. A `~/` path is expanded by the node's shell (quoting would keep it
    literal), through `sh -c 'exec "$HOME"/... "$@"'` so the other arguments stay quoted."""
    if python.startswith("~/"):
        return ["sh", "-c", 'exec "$HOME"/' + shlex.quote(python[2:]) + ' "$@"', "sh", *args]
    return [python, *args]


def build_worker_argv(python: str, worker_dir: str, env: Sequence[tuple[str, str]], *args: str) -> list[str]:
    """argv running `python *args` on a node as a rank runs: `env` exported (the job env overlaid with the node's
    inventory env, PYTHONPATH included), then the worker dir prepended to PYTHONPATH (`pythonpath_prepend`)."""
    return ["env", *(f"{k}={v}" for k, v in env), "sh", "-c", pythonpath_prepend('"$1"') + '; shift; exec "$@"',
            "sh", worker_dir, *python_argv(python, *args)]


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.expanduser(path)


def known_hosts_path(node: Node) -> str:
    return _expand(node.known_hosts) or os.path.expanduser("~/.ssh/known_hosts")


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int], asyncssh.SSHKnownHosts]] = {}


def _known_hosts(path: str) -> asyncssh.SSHKnownHosts | tuple[list[str], list[str], list[str]]:
    """The parsed known_hosts file, shared by every connection while the file is unchanged (asyncssh would parse
    it again for each: quadratic in the fleet size, since the file lists the fleet). A missing file means "no
    host is known" (not an error): verification then fails as "unknown key" and --accept-new-host-keys can create
    the file. A file we append to (a recorded key) has a new mtime/size and is read again."""
    try:
        st = os.stat(path)
    except OSError:
        return ([], [], [])
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _KNOWN_HOSTS.get(path)
    if cached is None or cached[0] != stamp:
        cached = (stamp, asyncssh.read_known_hosts(path))
        _KNOWN_HOSTS[path] = cached
    return cached[1]


def _known_host_entry(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def is_host_known(path: str, host: str, port: int) -> bool:
    """True when known_hosts has any key for host[:port] (so a verification failure means the key CHANGED)."""
    if not os.path.exists(path):
        return False
    try:
        known = asyncssh.read_known_hosts(path)
    except (OSError, ValueError, asyncssh.KeyImportError):
        return False
    # SSHKnownHosts.match(host, addr, port) -> (host_keys, ca_keys, revoked, ...).
    matches = known.match(host, host, port if port != 22 else None)
    return bool(matches[0] or matches[1])


def known_host_keys(path: str, host: str, port: int) -> frozenset[str]:
    """The keys known_hosts lists for host[:port], as ConnectInfo names them ("ssh-ed25519 SHA256:..."); empty
    when there are none or the file cannot be read."""
    try:
        known = asyncssh.read_known_hosts(path)
    except (OSError, ValueError, asyncssh.KeyImportError):
        return frozenset()
    keys = known.match(host, host, port if port != 22 else None)[0]
    return frozenset(f"{k.get_algorithm()} {k.get_fingerprint()}" for k in keys)


class SshTransport:
    """asyncssh connection to one node. `~/.ssh/config` and the agent are honoured by asyncssh's defaults."""

    def __init__(
        self,
        node: Node,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        accept_new_host_keys: bool = False,
    ) -> None:
        self.node = node
        self.connect_timeout = connect_timeout
        self.accept_new_host_keys = accept_new_host_keys
        self._conn: asyncssh.SSHClientConnection | None = None

    def _options(self) -> dict[str, object]:
        node = self.node
        opts: dict[str, object] = {
            "connect_timeout": self.connect_timeout,
            "known_hosts": _known_hosts(known_hosts_path(node)),
            # AES-GCM first: one C call per packet (and AES is in hardware on Apple Silicon and x86), where asyncssh's
            # chacha20-poly1305, its default first choice, builds cipher contexts per packet in Python.
            "encryption_algs": PREFERRED_CIPHERS,
            # Never block on an interactive prompt: the control plane is unattended.
            "password": None,
            "kbdint_auth": False,
            "keepalive_interval": 5,
            "keepalive_count_max": 3,
        }
        if node.user:
            opts["username"] = node.user
        if node.port:
            opts["port"] = node.port
        if node.identity:
            opts["client_keys"] = [_expand(node.identity)]
        return opts

    async def _open(self) -> asyncssh.SSHClientConnection:
        node = self.node
        try:
            return await asyncssh.connect(node.host, **self._options())
        except asyncssh.HostKeyNotVerifiable as exc:
            path = known_hosts_path(node)
            port = node.port or 22
            if is_host_known(path, node.host, port):
                raise HostKeyError(
                    node.name,
                    f"host key for {node.host} does NOT match {path} (changed key: possible man-in-the-middle or a "
                    f"reinstalled node): {exc.reason}",
                ) from exc
            if not self.accept_new_host_keys:
                raise HostKeyError(
                    node.name,
                    f"host key for {node.host} is unknown (not in {path}); verify it and rerun with "
                    "--accept-new-host-keys, or add it with ssh-keyscan",
                ) from exc
            raise _NeedsRecording() from exc
        except asyncssh.PermissionDenied as exc:
            raise TransportError(node.name, f"authentication failed for {node.ssh_target}: {exc.reason}", kind="auth") from exc
        except asyncssh.DisconnectError as exc:
            raise TransportError(node.name, f"ssh disconnected: {exc.reason}", kind="connect") from exc
        except TimeoutError as exc:
            raise TransportError(
                node.name, f"no SSH answer from {node.host} within {self.connect_timeout:g}s", kind="timeout"
            ) from exc
        except (OSError, asyncssh.Error, ValueError) as exc:
            raise TransportError(node.name, f"cannot connect to {node.host}: {exc}", kind="connect") from exc

    async def _record_host_key(self) -> str:
        node = self.node
        port = node.port or 22
        try:
            key = await asyncio.wait_for(
                asyncssh.get_server_host_key(node.host, port), timeout=self.connect_timeout
            )
        except (OSError, asyncssh.Error, TimeoutError) as exc:
            raise TransportError(node.name, f"cannot fetch host key of {node.host}: {exc}", kind="connect") from exc
        if key is None:
            raise HostKeyError(node.name, f"{node.host} presented no host key")
        path = Path(known_hosts_path(node))
        path.parent.mkdir(parents=True, exist_ok=True)
        line = f"{_known_host_entry(node.host, port)} {key.export_public_key('openssh').decode().strip()}\n"
        with path.open("a", encoding="utf-8") as fh:
            fh.write(line)
        return str(key.get_fingerprint())

    async def connect(self) -> ConnectInfo:
        if self._conn is not None:
            raise RuntimeError(f"{self.node.name}: already connected")
        started = time.perf_counter()
        recorded = False
        try:
            self._conn = await self._open()
        except _NeedsRecording:
            await self._record_host_key()
            recorded = True
            self._conn = await self._open()
        connect_s = time.perf_counter() - started
        key = self._conn.get_server_host_key()
        rtt_started = time.perf_counter()
        probe = await self.run(["true"], timeout=self.connect_timeout)
        rtt_ms = (time.perf_counter() - rtt_started) * 1000
        if not probe.ok:
            # Authenticated, but the account cannot run commands (a `nologin` shell, a forced command).
            await self.close()
            raise TransportError(self.node.name, f"logged in as {self.node.ssh_target} but `true` exited "
                                 f"{probe.exit_status}: {probe.stderr.strip()[:200]} (nologin shell or forced "
                                 "command?)", kind="auth")
        return ConnectInfo(
            node=self.node.name,
            connect_s=connect_s,
            rtt_ms=rtt_ms,
            host_key=f"{key.get_algorithm()} {key.get_fingerprint()}" if key else None,
            host_key_recorded=recorded,
        )

    def _require(self) -> asyncssh.SSHClientConnection:
        if self._conn is None:
            raise TransportError(self.node.name, "not connected")
        return self._conn

    async def run(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT
    ) -> RemoteResult:
        conn = self._require()
        started = time.perf_counter()
        try:
            process = await conn.create_process(build_command(argv))
            # Always close stdin: a remote command that reads it must never wait for input we will not send.
            if stdin:
                process.stdin.write(stdin)
            process.stdin.write_eof()
            proc = await process.wait(check=False, timeout=timeout)
        except asyncssh.TimeoutError as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` timed out after {timeout:g}s", kind="timeout") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` failed: {exc}") from exc
        return RemoteResult(
            node=self.node.name,
            argv=tuple(argv),
            exit_status=proc.exit_status if proc.exit_signal is None else None,
            stdout=_text(proc.stdout),
            stderr=_text(proc.stderr),
            elapsed_s=time.perf_counter() - started,
        )

    async def stream(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT,
        lines: bool = True,
    ) -> AsyncIterator[tuple[str, str]]:
        """Yield ("stdout"|"stderr", raw line with its newline) as they arrive, then ("exit", status). With
        `lines=False` an item holds every complete line that arrived together (bulk output: one yield per
        chunk, not per line)."""
        conn = self._require()
        proc: asyncssh.SSHClientProcess[str] | None = None
        try:
            # Not `async with`: leaving that block waits for the channel to close, i.e. for a hung remote
            # command to exit by itself. On timeout we signal it and close without waiting.
            proc = await conn.create_process(build_command(argv))
            if stdin:
                proc.stdin.write(stdin)
            proc.stdin.write_eof()
            async for item in _merge_lines(proc.stdout, proc.stderr, timeout, lines=lines):
                yield item
            await asyncio.wait_for(proc.wait(), timeout=timeout)
            yield ("exit", str(proc.exit_status))
        except TimeoutError as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` timed out after {timeout:g}s", kind="timeout") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` failed: {exc}") from exc
        finally:
            if proc is not None and proc.exit_status is None and proc.exit_signal is None:
                with contextlib.suppress(asyncssh.Error, OSError):
                    proc.kill()
                proc.close()

    async def upload(self, files: Sequence[Path], remote_dir: str, *, timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
        """Over SFTP on the open connection (no scp, no shell quoting of paths)."""
        conn = self._require()
        target = sftp_path(remote_dir)
        try:
            async with asyncio.timeout(timeout), conn.start_sftp_client() as sftp:
                await sftp.makedirs(target, exist_ok=True)
                await sftp.put([str(f) for f in files], target)
        except TimeoutError as exc:
            raise TransportError(self.node.name, f"upload to {remote_dir} timed out after {timeout:g}s",
                                 kind="timeout") from exc
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(self.node.name, f"upload to {remote_dir} failed: {exc}") from exc

    async def open_binary(self, argv: Sequence[str]) -> RawProcess:
        """Start argv with binary pipes. Raises TransportError."""
        conn = self._require()
        try:
            proc = await conn.create_process(build_command(argv), encoding=None)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` failed: {exc}") from exc

        async def wait() -> int | None:
            done = await proc.wait(check=False)
            return done.exit_status if done.exit_signal is None else None

        def kill() -> None:
            with contextlib.suppress(asyncssh.Error, OSError):
                proc.kill()
            proc.close()

        return RawProcess(proc.stdin, proc.stdout, proc.stderr, wait, kill)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(asyncssh.Error, OSError):
                await self._conn.wait_closed()
            self._conn = None


class _NeedsRecording(Exception):
    """Internal: the host key is unknown and the caller asked to record new keys."""


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


async def _merge_lines(out: Any, err: Any, timeout: float, *, lines: bool = True) -> AsyncIterator[tuple[str, str]]:
    """Interleave the lines of stdout and stderr (str from asyncssh, bytes from asyncio) as they arrive, until
    both end; TimeoutError past `timeout` seconds in all. A reader that fails (asyncssh raises ConnectionLost
    when the connection drops) ends the merge with its exception: a pump that died silently would leave the
    caller waiting forever for a stream whose node is gone.

    The readers are read in chunks and the complete lines of each chunk travel together: per-line reads and
    queue hand-offs cost more than the probe itself on a large fleet (a Mac's answer is ~1,000 lines). With
    `lines=False` they are also yielded together, as one string."""
    queue: asyncio.Queue[tuple[str, list[str]] | BaseException | None] = asyncio.Queue()

    async def pump(name: str, reader: Any) -> None:
        pending: str | bytes = ""
        try:
            while True:
                chunk = await reader.read(CHUNK)
                if not chunk:
                    break
                pending = pending + chunk if pending else chunk
                sep = b"\n" if isinstance(pending, bytes) else "\n"
                cut = pending.rfind(sep) + 1  # type: ignore[arg-type]
                if cut:
                    complete, pending = pending[:cut], pending[cut:]
                    await queue.put((name, [_text(x) for x in complete.splitlines(keepends=True)]))
        except (asyncssh.Error, OSError) as exc:
            await queue.put(exc)
            return
        if pending:
            await queue.put((name, [_text(pending)]))
        await queue.put(None)

    tasks = [asyncio.create_task(pump("stdout", out)), asyncio.create_task(pump("stderr", err))]
    done = 0
    deadline = time.monotonic() + timeout
    try:
        while done < 2:
            item = await asyncio.wait_for(queue.get(), timeout=max(0.0, deadline - time.monotonic()))
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                name, batch = item
                if lines:
                    for line in batch:
                        yield name, line
                else:
                    yield name, "".join(batch)
    finally:
        for task in tasks:
            task.cancel()


merge_lines = _merge_lines  # for callers that pump a `RawProcess` (`open_binary`) line by line


class LocalTransport:
    """Runs commands on this machine without SSH (`connection: local`)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def connect(self) -> ConnectInfo:
        started = time.perf_counter()
        await self.run(["true"], timeout=DEFAULT_CONNECT_TIMEOUT)
        return ConnectInfo(node=self.node.name, connect_s=0.0, rtt_ms=(time.perf_counter() - started) * 1000, host_key=None)

    async def _spawn(self, argv: Sequence[str], stdin: str | None) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, so a timeout kills the whole tree
            )
        except OSError as exc:
            raise TransportError(self.node.name, f"cannot run `{argv[0]}`: {exc}") from exc

    async def run(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT
    ) -> RemoteResult:
        started = time.perf_counter()
        proc = await self._spawn(argv, stdin)
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), timeout=timeout
            )
        except TimeoutError as exc:
            _kill_group(proc)
            await proc.wait()
            raise TransportError(self.node.name, f"`{argv[0]}` timed out after {timeout:g}s", kind="timeout") from exc
        rc = proc.returncode
        return RemoteResult(
            node=self.node.name,
            argv=tuple(argv),
            exit_status=rc if rc is not None and rc >= 0 else None,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            elapsed_s=time.perf_counter() - started,
        )

    async def stream(
        self, argv: Sequence[str], *, stdin: str | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT,
        lines: bool = True,
    ) -> AsyncIterator[tuple[str, str]]:
        proc = await self._spawn(argv, stdin)
        if stdin is not None and proc.stdin is not None:
            proc.stdin.write(stdin.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + timeout
        try:
            async for item in _merge_lines(proc.stdout, proc.stderr, timeout, lines=lines):
                yield item
            await asyncio.wait_for(proc.wait(), timeout=max(0.0, deadline - time.monotonic()))
            yield ("exit", str(proc.returncode))
        except TimeoutError as exc:
            raise TransportError(self.node.name, f"`{argv[0]}` timed out after {timeout:g}s", kind="timeout") from exc
        finally:
            if proc.returncode is None:
                _kill_group(proc)
                await proc.wait()

    async def upload(self, files: Sequence[Path], remote_dir: str, *, timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
        target = Path(os.path.expanduser(remote_dir))
        try:
            target.mkdir(parents=True, exist_ok=True)
            for f in files:
                await asyncio.to_thread(shutil.copyfile, f, target / Path(f).name)
        except OSError as exc:
            raise TransportError(self.node.name, f"copy to {remote_dir} failed: {exc}") from exc

    async def open_binary(self, argv: Sequence[str]) -> RawProcess:
        """Start argv with binary pipes (its own process group, killed as a whole). Raises TransportError."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise TransportError(self.node.name, f"cannot run `{argv[0]}`: {exc}") from exc

        async def wait() -> int | None:
            rc = await proc.wait()
            return rc if rc >= 0 else None

        return RawProcess(proc.stdin, proc.stdout, proc.stderr, wait, lambda: _kill_group(proc))

    async def close(self) -> None:
        return None


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def make_transport(
    node: Node, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, accept_new_host_keys: bool = False
) -> Transport:
    if node.connection is Connection.LOCAL:
        return LocalTransport(node)
    return SshTransport(node, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys)


T = TypeVar("T")


class Fleet:
    """Connections to many nodes with bounded concurrency. Per-node failures come back as values.

    Use as `async with Fleet(nodes) as fleet:`; every connection is closed on exit, whatever happened.
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        accept_new_host_keys: bool = False,
        concurrency: int = DEFAULT_CONCURRENCY,
        transport_factory: Callable[[Node], Transport] | None = None,
    ) -> None:
        factory = transport_factory or (
            lambda n: make_transport(n, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys)
        )
        self.nodes = list(nodes)
        self._factory = factory
        self.transports: dict[str, Transport] = {n.name: factory(n) for n in self.nodes}
        self.connected: dict[str, ConnectInfo] = {}
        self.failed: dict[str, TransportError] = {}
        self._sem = asyncio.Semaphore(concurrency)
        self._owner: Fleet | None = None  # set on a `for_ranks` view: the fleet whose connections it uses

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owner is not None:
            return  # a view's connections are its owner's to close
        await asyncio.gather(*(t.close() for t in self.transports.values()), return_exceptions=True)

    async def _bounded(self, coro: Awaitable[T]) -> T:
        async with self._sem:
            return await coro

    async def _connect_one(self, name: str) -> ConnectInfo | TransportError:
        try:
            info = await self._bounded(self.transports[name].connect())
        except TransportError as exc:
            self.failed[name] = exc
            return exc
        self.connected[name] = info
        return info

    async def connect_all(self) -> dict[str, ConnectInfo | TransportError]:
        results = await asyncio.gather(*(self._connect_one(n.name) for n in self.nodes))
        return {n.name: r for n, r in zip(self.nodes, results, strict=True)}

    async def connect_and_map(
        self, fn: Callable[[Node, Transport], Awaitable[T]]
    ) -> tuple[dict[str, ConnectInfo | TransportError], dict[str, T | TransportError]]:
        """`connect_all` then `map(fn)` in one pass: a node's `fn` starts as soon as THAT node is connected, so
        the fleet takes its slowest node's connect + fn, not the slowest connect plus the slowest fn (and
        the hosts work while the others are still shaking hands)."""

        async def one(node: Node) -> tuple[ConnectInfo | TransportError, T | TransportError | None]:
            info = await self._connect_one(node.name)
            if isinstance(info, TransportError):
                return info, None
            try:
                return info, await self._bounded(fn(node, self.transports[node.name]))
            except TransportError as exc:
                return info, exc

        results = await asyncio.gather(*(one(n) for n in self.nodes))
        connect = {n.name: c for n, (c, _) in zip(self.nodes, results, strict=True)}
        done = {n.name: r for n, (_, r) in zip(self.nodes, results, strict=True) if r is not None}
        return connect, done

    def node_by_name(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def for_ranks(self, nodes: Sequence[Node]) -> Fleet:
        """A fleet of `nodes` (rank nodes, one per GPU: `coordinator.planning.gpuranks`, or inventory nodes) over
        THIS fleet's connections: a rank node uses its machine's, shared (one connection per machine, as ever).
        The connections stay this fleet's: the view's `close` closes nothing, and its `reconnect` of a rank node
        replaces the connection for every rank of that machine."""
        view = Fleet.__new__(Fleet)
        view.nodes = list(nodes)
        view._factory = self._factory
        view._sem = self._sem
        view._owner = self
        view.transports = {}
        view.connected = {}
        view.failed = {}
        for node in nodes:
            machine = node.machine_name
            view.transports[node.name] = self.transports[machine]
            if machine in self.connected:
                view.connected[node.name] = self.connected[machine]
            if machine in self.failed:
                view.failed[node.name] = self.failed[machine]
        return view

    async def reconnect(self, name: str) -> ConnectInfo:
        """Replace a node's (dead) connection with a fresh one. Raises TransportError."""
        node = self.node_by_name(name)
        old = self.transports[name]
        await old.close()
        fresh = self._factory(node)
        info = await fresh.connect()
        # Every rank node sharing the old connection (one machine's GPUs) moves to the fresh one.
        for other in self.nodes:
            if other.machine_name == node.machine_name and self.transports.get(other.name) is old:
                self.transports[other.name] = fresh
                self.connected[other.name] = info
                self.failed.pop(other.name, None)
        self.transports[name] = fresh
        self.connected[name] = info
        self.failed.pop(name, None)
        if self._owner is not None and self._owner.transports.get(node.machine_name) is old:
            self._owner.transports[node.machine_name] = fresh
            self._owner.connected[node.machine_name] = info
        return info

    async def map(
        self, fn: Callable[[Node, Transport], Awaitable[T]], *, names: Sequence[str] | None = None
    ) -> dict[str, T | TransportError]:
        """Run `fn(node, transport)` on every connected node (or `names`), concurrently and bounded."""
        wanted = [n for n in self.nodes if (names is None or n.name in names) and n.name in self.connected]

        async def one(node: Node) -> T | TransportError:
            try:
                return await self._bounded(fn(node, self.transports[node.name]))
            except TransportError as exc:
                return exc

        results = await asyncio.gather(*(one(n) for n in wanted))
        return {n.name: r for n, r in zip(wanted, results, strict=True)}
