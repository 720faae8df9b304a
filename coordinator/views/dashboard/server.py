"""The dashboard's I/O shell: a small HTTP/1.1 + server-sent-events server on the coordinator's asyncio loop, and
the tail of the run directories that feeds it.

Why our own server and not Starlette/uvicorn or aiohttp: neither is installed with the coordinator, and the
dashboard needs four things only (static files, a few JSON documents, one SSE stream, one POST). A page of
asyncio streams code keeps the package dependency-free, starts in milliseconds and runs inside the loop that
`coordinator launch` already has, so `launch --dashboard` adds no thread and no process.

One truth: everything shown comes from the run directories (events.jsonl tailed incrementally by byte offset,
meta.json, summary.json, playbook.yaml), the fleet probe of `coordinator status`, and the quarantine file. No
state is stored anywhere else; a restarted dashboard shows the same thing.

What it watches is bounded, whatever the number of pages ever asked for: the newest RECENT_RUNS run dirs (the runs
page) and the runs a browser is viewing now (an open stream names its run) are kept and tailed; any other run asked
for is opened on demand and kept in an LRU of CACHED_RUNS, polled only when asked for again, and evicted beyond it.

Security: binds 127.0.0.1 by default. A token is made at start and printed in the URL; every request needs it, on
loopback too (any local user could otherwise read the runs and make the server open what it likes): `?token=`, the
`X-Dashboard-Token` header, or the cookie the server sets when the printed URL is opened (so the browser's own page
loads carry it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

from coordinator import models
from coordinator.errors import ConfigError
from coordinator.run.monitor import FaultPolicy
from coordinator.run.rundir import (
    EVENTS,
    META,
    PLAYBOOK,
    RunMeta,
    SummaryFile,
    decode_event_lines,
    load_meta,
    read_summary,
)
from coordinator.views.dashboard.model import DEFAULT_HEARTBEAT_TIMEOUT, RunFold, empty_delta, run_row, run_view

DEFAULT_HOST = models.DEFAULT_DASHBOARD_HOST
DEFAULT_PORT = models.DEFAULT_DASHBOARD_PORT
TICK_S = 0.25  # how often active runs' events.jsonl are looked at: an event shows within TICK_S + a push
LIST_EVERY_S = 2.0  # how often the run root is looked at for new runs (its mtime: one stat)
RELIST_EVERY_S = 30.0  # how often it is listed anyway (a resumed run's meta.json rewritten makes it recent again)
KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies from closing an idle stream
RECENT_RUNS = 30  # the runs page: the newest run dirs, kept and tailed
CACHED_RUNS = 16  # other runs asked for (an old run's page): kept least-recently-used, polled only when asked
MAX_REQUEST = 16 * 1024
STATIC = {  # name -> content type: only these files are served
    "index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8", "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
StopFn = Callable[[Path], Awaitable[object]]


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`: the addresses a dashboard may serve without a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_summary(run_dir: Path) -> SummaryFile | None:
    """summary.json, typed; None while the run is going (no summary yet) and for one this coordinator cannot
    read (a newer format): the page then shows the run from its events, as for a coordinator that died."""
    try:
        return read_summary(run_dir)
    except ConfigError:
        return None


def _playbook_train(run_dir: Path, meta: RunMeta) -> tuple[int | None, float]:
    """(train.iters, heartbeat_timeout) from the run's copy of its playbook, else from the playbook it was
    launched with (the copy's redacted `env` values can make it unreadable YAML). Defaults when neither reads;
    the ranks' `started` events carry `iters` too (`RunFold.iters`)."""
    doc: Any = None
    for path in (run_dir / PLAYBOOK, Path(meta.playbook or run_dir / PLAYBOOK)):
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            break
        except (OSError, yaml.YAMLError):
            continue
    doc = doc if isinstance(doc, dict) else {}
    train = doc.get("train")
    iters = train.get("iters") if isinstance(train, dict) else None
    timeout = doc.get("heartbeat_timeout")
    return (iters if isinstance(iters, int) and not isinstance(iters, bool) else None,
            float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            else DEFAULT_HEARTBEAT_TIMEOUT)


@dataclass
class TrackedRun:
    """A run directory being tailed: its fold and the byte offset of events.jsonl read so far."""

    path: Path
    fold: RunFold
    meta: RunMeta | None
    iters: int | None
    heartbeat_timeout: float
    summary: SummaryFile | None = None
    offset: int = 0
    size_seen: int = -1
    meta_mtime: float | None = None

    def _follow_meta(self) -> None:
        """A relaunch rewrites meta.json: judge the ranks by its attempt (RunFold.rejudge)."""
        try:
            mtime = (self.path / META).stat().st_mtime
        except OSError:
            return
        if self.meta_mtime is None or mtime == self.meta_mtime:
            self.meta_mtime = mtime
            return
        self.meta_mtime = mtime
        try:
            fresh = load_meta(self.path)
        except ConfigError:
            return
        if fresh is None or (self.meta is not None and (fresh.attempt, fresh.ranks) == (self.meta.attempt,
                                                                                        self.meta.ranks)):
            return
        self.meta = fresh
        try:
            with (self.path / EVENTS).open("rb") as fh:
                data = fh.read(self.offset)
        except OSError:
            data = b""
        self.fold.rejudge(fresh, decode_event_lines(data.decode("utf-8", errors="replace").splitlines())[0])

    def poll(self) -> dict[str, Any] | None:
        """Read what was appended since the last poll; the delta, or None when nothing changed. A line being
        written is left for the next poll; an unparseable line is counted and skipped."""
        self._follow_meta()
        changed = False
        if self.summary is None:
            self.summary = _read_summary(self.path)
            changed = self.summary is not None
        events = self.path / EVENTS
        try:
            size = events.stat().st_size
        except OSError:
            size = 0
        if size == self.size_seen and not changed:
            return None
        self.size_seen = size
        if size < self.offset:  # rewritten (never done by the coordinator): read again from the start
            self.offset, self.fold = 0, RunFold.from_meta(self.fold.run_id, self.meta, fallback=self.fold.fallback)
        records: list[dict[str, Any]] = []
        if size > self.offset:
            with events.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read(size - self.offset)
            end = data.rfind(b"\n")
            if end >= 0:
                self.offset += end + 1
                records, bad = decode_event_lines(data[: end + 1].decode("utf-8", errors="replace").splitlines())
                self.fold.bad_lines += bad
        if not records and not changed:
            return None
        return self.fold.feed(records) if records else empty_delta()

    def view(self, now: float, *, full: bool) -> dict[str, Any]:
        """The run page's document; `offset` says how much of events.jsonl it includes, so a browser that
        fetched it can drop pushed deltas it already has (`delta_from` below it)."""
        return run_view(self.fold, meta=self.meta, summary=self.summary, iters=self.iters, now=now,
                        heartbeat_timeout=self.heartbeat_timeout, full=full) | {"offset": self.offset}

    def row(self, now: float) -> dict[str, Any]:
        return run_row(self.fold, summary=self.summary, meta=self.meta, iters=self.iters, now=now)


def open_run(path: Path) -> TrackedRun | None:
    """A run directory (one with a readable meta.json) ready to tail; None otherwise (a meta.json of a newer
    format, or one without its ranks' numbers and nodes, included: the runs page lists what it can show)."""
    try:
        meta = load_meta(path)
    except ConfigError:
        return None
    if meta is None:
        return None
    iters, timeout = _playbook_train(path, meta)
    # An older meta.json has no thresholds: its playbook's heartbeat_timeout judges its silence.
    fold = RunFold.from_meta(meta.run_id, meta, fallback=FaultPolicy(heartbeat_timeout=timeout))
    return TrackedRun(path, fold, meta, iters, timeout)


FleetFn = Callable[[], Mapping[str, Any]]


def compute_evictions(order: list[str], keep: set[str], cap: int) -> list[str]:
    """The runs to forget: of those in `order` (least recently used first) that are not in `keep`, all but the
    `cap` most recently used."""
    others = [run_id for run_id in order if run_id not in keep]
    return others[: max(0, len(others) - cap)]


@dataclass
class DashboardState:
    """The run root tailed, and the subscribers (SSE streams) the deltas go to. `fleet` returns the fleet page's
    document (the probe runs elsewhere; see `coordinator.views.dashboard.fleet`).

    `runs` holds the newest RECENT_RUNS (`recent`), the runs an open stream views (`watchers`), and at most
    CACHED_RUNS others, least recently used first; `tick` polls the first two only."""

    run_root: Path
    fleet: FleetFn = field(default=lambda: {"nodes": [], "warnings": []})
    runs: OrderedDict[str, TrackedRun] = field(default_factory=OrderedDict)
    recent: list[str] = field(default_factory=list)
    watchers: Counter[str] = field(default_factory=Counter)
    subscribers: set[asyncio.Queue[str]] = field(default_factory=set)
    fleet_version: int = 0
    _listed_at: float = float("-inf")
    _relisted_at: float = float("-inf")
    _root_mtime: int = -1
    _unsettled: bool = False

    def list_runs(self, force: bool = False) -> None:
        """Pick up new run directories (the newest RECENT_RUNS with a meta.json); the ones that fell out of them
        join the LRU of the rest."""
        now = time.monotonic()
        if not force and now - self._listed_at < LIST_EVERY_S:
            return
        self._listed_at = now
        try:
            # A new run dir changes the root's mtime: a root of thousands of runs is not stat'ed every 2 s.
            mtime = self.run_root.stat().st_mtime_ns
            if (not force and mtime == self._root_mtime and not self._unsettled
                    and now - self._relisted_at < RELIST_EVERY_S):
                return
            self._root_mtime, self._relisted_at = mtime, now
            children = [c for c in self.run_root.iterdir() if c.is_dir()]
        except OSError:
            return
        dated: list[tuple[float, Path]] = []
        # A run dir is made before its meta.json is written: one seen without it (or with one not readable yet)
        # while young is looked at again at the next listing, not 30 s later.
        unsettled = False
        wall = time.time()
        for child in children:
            try:
                dated.append(((child / META).stat().st_mtime, child))
            except OSError:
                with contextlib.suppress(OSError):
                    unsettled = unsettled or wall - child.stat().st_mtime < RELIST_EVERY_S
        recent = []
        for written, child in sorted(dated, reverse=True)[:RECENT_RUNS]:
            if child.name not in self.runs and (run := open_run(child)) is not None:
                run.poll()  # read up to now: pushes carry what is appended from here on
                self.runs[child.name] = run
            if child.name in self.runs:
                recent.append(child.name)
            else:
                unsettled = unsettled or wall - written < RELIST_EVERY_S
        self.recent, self._unsettled = recent, unsettled
        self._evict()

    def _evict(self) -> None:
        for run_id in compute_evictions(list(self.runs), set(self.recent) | set(self.watchers), CACHED_RUNS):
            del self.runs[run_id]

    def run(self, run_id: str) -> TrackedRun | None:
        """A run by id (the directory name), read up to now; kept as the most recently used."""
        self.list_runs()
        run = self.runs.get(run_id)
        if run is None and "/" not in run_id and run_id not in ("", ".", ".."):
            run = open_run(self.run_root / run_id)
            if run is not None:
                self.runs[run_id] = run
        if run is not None:
            self.runs.move_to_end(run_id)
            self._evict()
            run.poll()
        return run

    def watch(self, run_id: str) -> None:
        """A stream views `run_id`: it is kept and tailed until `unwatch`."""
        if self.run(run_id) is not None:
            self.watchers[run_id] += 1

    def unwatch(self, run_id: str) -> None:
        if self.watchers[run_id] > 0:
            self.watchers[run_id] -= 1
        if self.watchers[run_id] <= 0:
            del self.watchers[run_id]
            self._evict()

    def watched(self) -> list[str]:
        """The runs `tick` polls: the newest ones and those a stream views (never the LRU of the rest)."""
        return [run_id for run_id in self.runs if run_id in self.watchers or run_id in self.recent]

    def runs_doc(self, now: float) -> dict[str, Any]:
        """The runs page: the newest RECENT_RUNS run dirs."""
        self.list_runs()
        rows = []
        for run_id in self.recent:
            run = self.runs[run_id]
            run.poll()
            rows.append(run.row(now))
        rows.sort(key=lambda r: r.get("started_t") or 0.0, reverse=True)
        return {"runs": rows, "now": now}

    def tick(self, now: float) -> list[str]:
        """One look at the files: the SSE messages to push (a `run` delta per changed run, then one `runs`)."""
        self.list_runs()
        messages: list[str] = []
        for run_id in self.watched():
            run = self.runs[run_id]
            if run.summary is not None and run.size_seen >= 0:
                continue  # finished and read: its files no longer change
            before = run.offset
            delta = run.poll()
            if delta is None:
                continue
            doc = {"run_id": run_id, "delta_from": before, "delta": delta, "view": run.view(now, full=False)}
            messages.append(sse("run", doc))
        if messages:
            messages.append(sse("runs", self.runs_doc(now)))
        return messages

    def publish(self, messages: list[str]) -> None:
        for queue in list(self.subscribers):
            for msg in messages:
                if queue.qsize() < 1000:  # a stalled browser loses updates, never the server's memory
                    queue.put_nowait(msg)


def sse(event: str, data: Mapping[str, Any]) -> str:
    """One server-sent event (JSON data on one line)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"


def cookies(req: Request) -> dict[str, str]:
    """The Cookie header's name=value pairs."""
    out = {}
    for part in req.headers.get("cookie", "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            out[name] = value
    return out


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The request line and headers (bodies are not read: the one POST carries none). None on a bad request."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    if len(head) > MAX_REQUEST:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    url = urlsplit(parts[1])
    return Request(parts[0].upper(), unquote(url.path), parse_qs(url.query), headers)


class DashboardServer:
    """Serves the dashboard at `url` until `close()`. Raises `ConfigError` when the address cannot be bound.

    `stop` is the stop path of `coordinator stop` (called with the run's directory); `token` None makes one."""

    def __init__(self, state: DashboardState, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 token: str | None = None, stop: StopFn | None = None) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(16)
        self.stop_fn = stop
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self.stopping: set[str] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/?token={quote(self.token)}"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_REQUEST)
        except OSError as exc:
            raise ConfigError(f"cannot serve the dashboard on {self.host}:{self.port}: {exc.strerror or exc}") from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        self.state.list_runs(force=True)
        self._ticker = asyncio.create_task(self._tick_forever())

    async def close(self) -> None:
        """Stop serving, end every stream. Idempotent."""
        server, self._server = self._server, None
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        if server is not None:
            server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> DashboardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def publish_fleet(self) -> None:
        """The fleet changed (a probe finished): push it (built only when someone watches)."""
        if self.state.subscribers:
            self.state.publish([sse("fleet", self.state.fleet())])

    async def _tick_forever(self) -> None:
        last_keepalive = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            if not self.state.subscribers:
                continue  # nobody watching: the files are read when someone asks
            messages = self.state.tick(time.time())
            if time.monotonic() - last_keepalive > KEEPALIVE_S:
                messages.append(": keepalive\n\n")
                last_keepalive = time.monotonic()
            if messages:
                self.state.publish(messages)

    @property
    def cookie(self) -> str:
        """The token's cookie name: one per port, as two dashboards of one host share its cookies."""
        return f"dashboard-token-{self.port}"

    def _authorized(self, req: Request, *, cookie: bool = True) -> bool:
        """The token given with the request. The cookie only where `cookie`: not for the stop action, which a
        page of another port of this host (the same site, to the browser) could otherwise post with it."""
        given = (req.headers.get("x-dashboard-token") or (req.query.get("token") or [""])[0]
                 or (cookies(req).get(self.cookie, "") if cookie else ""))
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        try:
            req = await read_request(reader)
            if req is None:
                await respond(writer, 400, {"error": "bad request"})
            else:
                await self._route(req, reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self._streams.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(self, req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._authorized(req):
            # Loopback too: any local user (or a web page that rebinds its DNS name to 127.0.0.1) could otherwise
            # read the fleet and the runs, and make the server open and keep whatever it names.
            await respond(writer, 403, {"error": "this dashboard needs its token: open the URL it printed"})
            return
        path, now = req.path, time.time()
        if req.method == "POST" and path.startswith("/api/run/") and path.endswith("/stop"):
            await self._stop(req, path[len("/api/run/"):-len("/stop")], writer)
        elif req.method != "GET":
            await respond(writer, 405, {"error": f"{req.method} not allowed"})
        elif path in ("/", "/runs") or path.startswith("/run/"):
            # The printed URL's token becomes a cookie, so that the page's own navigations (/runs, /run/ID, a
            # reload) carry it; HttpOnly and SameSite=Strict: no script and no other site sends or reads it.
            await respond_bytes(writer, 200, STATIC["index.html"], _static("index.html"),
                                headers={"Set-Cookie": f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"})
        elif path.startswith("/static/") and path[len("/static/"):] in STATIC:
            name = path[len("/static/"):]
            await respond_bytes(writer, 200, STATIC[name], _static(name), cache=True)
        elif path == "/api/fleet":
            await respond(writer, 200, {**self.state.fleet(), "now": now})
        elif path == "/api/runs":
            await respond(writer, 200, self.state.runs_doc(now))
        elif path.startswith("/api/run/"):
            run = self.state.run(path[len("/api/run/"):])
            if run is None:
                await respond(writer, 404, {"error": f"no run {path[len('/api/run/'):]!r} under {self.state.run_root}"})
            else:
                await respond(writer, 200, run.view(now, full=True))
        elif path == "/api/stream":
            await self._stream(reader, writer, (req.query.get("run") or [""])[0])
        else:
            await respond(writer, 404, {"error": f"no page {path}"})

    async def _stop(self, req: Request, run_id: str, writer: asyncio.StreamWriter) -> None:
        if not self._authorized(req, cookie=False):
            await respond(writer, 403, {"error": "stopping a run needs the dashboard's token"})
            return
        run = self.state.run(run_id)
        if run is None or self.stop_fn is None:
            await respond(writer, 404, {"error": f"no run {run_id!r} to stop"})
            return
        if run.summary is not None:
            await respond(writer, 409, {"error": f"run {run_id} already ended ({run.summary.state})"})
            return
        if run_id not in self.stopping:
            self.stopping.add(run_id)
            stopper = asyncio.create_task(self._stop_in_background(run))
            self._streams.add(stopper)
            stopper.add_done_callback(self._streams.discard)
        await respond(writer, 202, {"stopping": run_id})

    async def _stop_in_background(self, run: TrackedRun) -> None:
        """The stop takes seconds (SSH to every node); the browser sees it end as the run's summary appears."""
        assert self.stop_fn is not None
        try:
            await self.stop_fn(run.path)
        except Exception as exc:  # noqa: BLE001 - a failed stop is shown to the operator, never kills the server
            self.state.publish([sse("notice", {"run_id": run.fold.run_id, "error": f"stop failed: {exc}"})])
        finally:
            self.stopping.discard(run.fold.run_id)

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, run_id: str) -> None:
        """The live stream; `run_id` (`?run=`, the run page's) is kept and tailed while the stream is open. It
        ends when the browser closes it (seen at once, not at the next write: a page left keeps nothing)."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: keep-alive\r\nX-Accel-Buffering: no\r\n\r\n")
        queue: asyncio.Queue[str] = asyncio.Queue()
        self.state.subscribers.add(queue)
        if run_id:
            self.state.watch(run_id)
        closed = asyncio.ensure_future(reader.read(1))  # b"" at the browser's end (an SSE client sends nothing)
        try:
            writer.write(sse("hello", {"now": time.time()}).encode())
            await writer.drain()
            while True:
                got = asyncio.ensure_future(queue.get())
                await asyncio.wait((got, closed), return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return
                writer.write(got.result().encode())
                await writer.drain()
        finally:
            closed.cancel()
            self.state.subscribers.discard(queue)
            if run_id:
                self.state.unwatch(run_id)


def _static(name: str) -> bytes:
    return resources.files("coordinator.views.dashboard").joinpath("static", name).read_bytes()


async def respond_bytes(writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes, *,
                        cache: bool = False, headers: Mapping[str, str] | None = None) -> None:
    reason = {200: "OK", 202: "Accepted", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
              405: "Method Not Allowed", 409: "Conflict"}.get(status, "OK")
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Cache-Control: {'max-age=3600' if cache else 'no-store'}\r\n{extra}Connection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()


async def respond(writer: asyncio.StreamWriter, status: int, doc: Mapping[str, Any]) -> None:
    await respond_bytes(writer, status, "application/json", json.dumps(doc, default=str).encode())


__all__ = ["CACHED_RUNS", "DEFAULT_HOST", "DEFAULT_PORT", "RECENT_RUNS", "DashboardServer", "DashboardState",
           "TrackedRun", "compute_evictions", "is_loopback", "open_run", "read_request", "sse"]
