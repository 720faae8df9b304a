"""`coordinator sync`'s I/O: make the playbook's model and data dirs identical on every node (the verb:
coordinator/cli/sync.py; `launch --fix` calls `run_sync` too).

The I/O shell around `coordinator.planning.sync` (the pure plan). Steps:

1. connect to the source node (`--from`) and the targets, ship the worker package; `--source PATH` reads a local
   dir holding one subdir per synced label (`PATH/model`, `PATH/data`) through a local process instead;
2. `python -m worker.relay plan` everywhere: per-file SHA256 manifests through the probe's stat-keyed hash cache,
   leftover partials, free space; the source is `--from`/`--source`, else the manifest most nodes share;
3. `compute_plan`; `--check` stops here and prints it. A node short of disk space fails the sync here, before
   the first byte;
4. extras are deleted; every node that needs a file starts `worker.relay serve` bound to its data-plane IP
   (a per-sync random token on stdin), then the source's `worker.relay send` streams each file once down the
   chain, every node writing and forwarding as bytes arrive;
5. `plan` again on every target: each manifest must equal the source's.

Failure semantics: a node that cannot be reached is a failed node in the summary (the others are synced). A
plan with doubtful deletions is refused unless confirmed (`report.refusal`, exit 2; nothing changed). Every relay
holds a lifeline (its stdin) and dies with this process. A relay that aborts, or says nothing for STALL_TIMEOUT,
breaks the chain there: the relays after it are stopped within seconds and, with it, get the stream over SSH.
Exit 0 when every target verifies identical (errors it outlived are in `recovered`), 1 otherwise (or when the
plan has a problem such as disk space), 2 on a usage error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from coordinator.config.playbook import Playbook
from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.fleet.transport import Fleet, LocalTransport, RawProcess, Transport, python_argv
from coordinator.models import Connection, Inventory, Node
from coordinator.planning.sync import (
    NodeState,
    ParseError,
    SyncPlan,
    compute_plan,
    describe_refusal,
    parse_node_state,
    verify,
)

SETUP_TIMEOUT = 60.0


PLAN_TIMEOUT = 3600.0  # the first manifest of a big model hashes it (cached afterwards)


PORT_TIMEOUT = 30.0


RELAY_IDLE_TIMEOUT = 60.0  # a relay socket silent this long gives up (the node's process then exits by itself)


STALL_TIMEOUT = 10.0  # a relay that says nothing (its heartbeat is every HEARTBEAT s) this long is stopped


LIFELINE_MARGIN = 60.0  # a relay's own deadline is the coordinator's timeout plus this


BROKEN_CHAIN_GRACE = 2.0  # seconds the relays get to finish once the source's stream has failed


TRANSFER_TIMEOUT = 7 * 24 * 3600.0  # the whole transfer; stalls are bounded by RELAY_IDLE_TIMEOUT instead


Progress = Callable[[str, int, int], None]  # node, bytes done, bytes total


class SyncError(CoordinatorError):
    """The sync could not start (no source, no agreement) or its source failed."""


class SourceRefused(SyncError):
    """The source cannot be the truth: a synced dir is missing there (a usage error: exit 2)."""

    exit_code = 2


@dataclass
class SyncReport:
    plan: SyncPlan | None
    checked_only: bool
    node_errors: dict[str, str] = field(default_factory=dict)
    verified: dict[str, list[str]] = field(default_factory=dict)  # node -> remaining differences
    sent_bytes: int = 0
    seconds: float = 0.0
    transfer_seconds: float = 0.0
    refused: dict[str, list[str]] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)  # node -> why the relay chain failed it (then SSH)
    refusal: str | None = None  # doubtful deletions the user did not confirm: nothing was changed
    recovered: dict[str, str] = field(default_factory=dict)  # node -> an error its verified-identical end outlived

    @property
    def ok(self) -> bool:
        """The verdict is the verification's: every target identical to the source. An error on the way that
        the end outlived (a stray partial, a chain break healed by the fallback) is in `recovered`, not here."""
        if self.plan is None or self.node_errors or self.plan.problems or self.refusal:
            return False
        return self.checked_only or all(not v for v in self.verified.values())

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "check": self.checked_only, "plan": self.plan.to_json() if self.plan else None,
                "errors": self.node_errors, "verified": {n: not v for n, v in self.verified.items()},
                "differences": {n: v for n, v in self.verified.items() if v}, "sent_bytes": self.sent_bytes,
                "elapsed_s": round(self.seconds, 3), "transfer_s": round(self.transfer_seconds, 3),
                "refused": self.refused, "fallback": self.fallback, "refusal": self.refusal,
                "recovered": self.recovered}


@dataclass(frozen=True)
class _Side:
    node: Node
    transport: Transport
    worker_dir: str
    dirs: dict[str, str]


def _relay_argv(side: _Side, *args: str) -> list[str]:
    env = [f"{k}={v}" for k, v in side.node.env if k != "PYTHONPATH"]
    return ["env", *env, f"PYTHONPATH={side.worker_dir}", *python_argv(side.node.python, "-m", "worker.relay", *args)]


async def _call(side: _Side, args: list[str], spec: dict[str, Any], timeout: float) -> str:
    """Run `worker.relay ARGS` with `spec` on its stdin, which stays open: the relay's lifeline. The relay exits
    when it closes (this coordinator killed, the SSH session dropped, or the timeout below), so no remote
    planning keeps walking a node's disk for a coordinator that is gone. Raises TransportError."""
    proc = await side.transport.open_binary(_relay_argv(side, *args))
    try:
        proc.stdin.write(_spec_line(spec, timeout))
        out, err = await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.stderr.read()), timeout=timeout)
        status = await asyncio.wait_for(proc.wait(), timeout=timeout)
    except TimeoutError as exc:
        raise TransportError(side.node.name, f"worker.relay {args[0]} timed out after {timeout:g}s",
                             kind="timeout") from exc
    except (asyncssh.Error, OSError) as exc:
        raise TransportError(side.node.name, f"worker.relay {args[0]} failed: {exc}") from exc
    finally:
        proc.kill()  # closes the channel: the relay's stdin ends, and it exits if it has not yet
    text: str = out.decode(errors="replace")
    if status != 0:
        raise TransportError(side.node.name, f"worker.relay {args[0]} exited {status}: "
                             f"{(text + err.decode(errors='replace')).strip()[-400:]}")
    return text


async def _lines(reader: Any) -> AsyncIterator[bytes]:
    """The lines of a binary pipe as they arrive, however long (a relay's answer lists every file it received:
    a readline() would hit asyncio's 64 KiB line limit)."""
    line = bytearray()
    while chunk := await reader.read(1 << 16):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line += chunk[start:end + 1]
            yield bytes(line)
            line.clear()
            start = end + 1
        line += chunk[start:]
    if line:
        yield bytes(line)


def _spec_line(spec: dict[str, Any], deadline: float) -> bytes:
    """The relay's one line of stdin: `spec`, with the lifeline on (exit when stdin closes) and a deadline (the
    relay exits by itself after it, should even the lifeline fail)."""
    return json.dumps({**spec, "lifeline": True, "deadline": deadline + LIFELINE_MARGIN}).encode() + b"\n"


async def _plan_state(side: _Side) -> NodeState:
    return parse_node_state(side.node.name, await _call(side, ["plan"], {"dirs": side.dirs}, PLAN_TIMEOUT))


class _Stream:
    """A running `serve`/`send`: the port it listens on (serve), progress, and its final JSON answer."""

    def __init__(self, side: _Side, argv: list[str], spec: dict[str, Any], progress: Callable[[int], None], *,
                 listens: bool = True) -> None:
        self.listens = listens
        self.side = side
        self.port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.answer: dict[str, Any] | None = None
        self.stderr: list[str] = []
        self.heard = time.monotonic()  # when it last said something (progress, or its heartbeat)
        self.stalled = False
        self.pid: int | None = None  # the relay's, on its node
        self.task = asyncio.create_task(self._run(argv, spec, progress))

    async def _run(self, argv: list[str], spec: dict[str, Any], progress: Callable[[int], None]) -> None:
        name = self.side.node.name
        proc: RawProcess | None = None
        try:
            proc = await self.side.transport.open_binary(argv)
            proc.stdin.write(_spec_line(spec, TRANSFER_TIMEOUT))  # stdin stays open: the relay's lifeline

            async def errs(reader: Any) -> None:
                async for line in _lines(reader):
                    text = line.decode(errors="replace")
                    if text.startswith("progress "):
                        self.heard = time.monotonic()
                        progress(int(text.split()[1]))
                    elif text.startswith("alive"):
                        self.heard = time.monotonic()
                    elif text.startswith("pid "):
                        self.pid = int(text.split()[1])
                    else:
                        self.stderr.append(text.strip())

            async def outs(reader: Any) -> None:
                async for line in _lines(reader):
                    if not line.strip():
                        continue
                    doc = json.loads(line)
                    if "port" in doc and not self.port.done():
                        self.port.set_result(int(doc["port"]))
                    else:
                        self.answer = doc

            await asyncio.gather(errs(proc.stderr), outs(proc.stdout))
        except (TransportError, asyncssh.Error, OSError, ValueError) as exc:
            self.answer = {"error": str(exc)}
        finally:
            if self.stalled and self.pid is not None:
                # A hung relay (a stopped process, a node stuck in I/O) reads no lifeline: kill it by pid, so its
                # sockets close and its neighbours go on (a signal on the channel may reach only its shell).
                with contextlib.suppress(CoordinatorError):
                    await self.side.transport.run(["kill", "-KILL", str(self.pid)], timeout=SETUP_TIMEOUT)
            if proc is not None:
                proc.kill()  # the channel closes: a relay still running sees its lifeline end and exits
            if not self.port.done():
                self.port.set_exception(TransportError(
                    name, f"relay ended before listening: {(self.answer or {}).get('error', '')} "
                    f"{' | '.join(self.stderr[-3:])}"))
                if not self.listens:  # nobody awaits a sender's port
                    self.port.exception()

    @property
    def aborted(self) -> bool:
        """It ended without finishing its stream (not just with some files in error): the chain broke here."""
        return self.task.done() and (self.task.cancelled() or self.answer is None or "error" in self.answer)

    def error(self) -> str | None:
        doc = self.answer
        if doc is None and self.stalled:
            return f"stopped: silent for {STALL_TIMEOUT:g}s (hung?)"
        if doc is None and self.task.cancelled():
            return "stopped: the chain broke upstream"
        if doc is None:
            return f"relay gave no answer: {' | '.join(self.stderr[-3:])}"
        if doc.get("error"):
            return str(doc["error"])
        if doc.get("errors"):
            return "; ".join(doc["errors"])
        return None


async def run_sync(inventory: Inventory, pb: Playbook, *, source_node: Node | None, source_path: Path | None,
                   check: bool, connect_timeout: float = 5.0, accept_new_host_keys: bool = False,
                   progress: Progress | None = None, on_plan: Callable[[SyncPlan], None] | None = None,
                   source_dirs: Mapping[str, str] | None = None, delete_extras: bool = False,
                   confirm: Callable[[str], bool] | None = None) -> SyncReport:
    """Plan, copy and verify (see the module docstring). Per-node failures are in the report. `source_dirs`
    (label -> local dir) is a local source laid out otherwise than `source_path/<label>` (launch --fix: the
    playbook's own paths on this machine). A plan with doubtful deletions (coordinator/planning/sync.py) goes
    ahead only with `delete_extras` or when `confirm(question)` says yes; otherwise `report.refusal` says why and
    nothing is changed."""
    started = time.perf_counter()
    dirs = dict(pb.hashed_dirs())
    nodes = [n for n in inventory.nodes if source_node is None or n.name != source_node.name]
    fleet_nodes = nodes + ([source_node] if source_node is not None else [])
    report = SyncReport(None, check)
    from coordinator.fleet.ship import ship_worker

    async with Fleet(fleet_nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        async def ship(node: Node, transport: Transport) -> str:
            return await ship_worker(transport, node, timeout=SETUP_TIMEOUT)

        connected, shipped = await fleet.connect_and_map(ship)
        sides: dict[str, _Side] = {}
        for node in fleet_nodes:
            got = shipped.get(node.name, connected.get(node.name))
            if isinstance(got, str):
                sides[node.name] = _Side(node, fleet.transports[node.name], got, dirs)
            else:
                report.node_errors[node.name] = str(got)
        if source_path is not None or source_dirs is not None:
            import worker

            local_dirs = dict(source_dirs) if source_dirs is not None else {lb: str(Path(str(source_path)) / lb)
                                                                            for lb in dirs}
            local = Node(name=f"local:{source_path or ','.join(local_dirs.values())}", host="localhost",
                         connection=Connection.LOCAL, python=sys.executable)
            src_side: _Side | None = _Side(local, LocalTransport(local), str(Path(worker.__file__).resolve().parents[1]),
                                           local_dirs)
        elif source_node is not None:
            src_side = sides.get(source_node.name)
            if src_side is None:
                raise SyncError(f"source {report.node_errors.get(source_node.name, source_node.name)}")
        else:
            src_side = None

        targets = [sides[n.name] for n in nodes if n.name in sides]
        answers = await asyncio.gather(*(_plan_state(s) for s in [*targets, *([src_side] if src_side else [])]),
                                       return_exceptions=True)
        states: dict[str, NodeState] = {}
        for side, ans in zip([*targets, *([src_side] if src_side else [])], answers, strict=True):
            if isinstance(ans, NodeState):
                states[side.node.name] = ans
            elif isinstance(ans, (CoordinatorError, ParseError)):
                report.node_errors[side.node.name] = str(ans)
            else:
                raise ans
        if src_side is not None:
            src_state = states.pop(src_side.node.name, None)
            if src_state is None:
                raise SyncError(f"source: {report.node_errors.pop(src_side.node.name, 'no manifest')}")
            if src_state.missing:
                raise SourceRefused(f"source {src_side.node.name} lacks "
                                    f"{', '.join(src_side.dirs[lb] for lb in src_state.missing)} (no such directory)")
            if src_state.errors:
                raise SyncError(f"source {src_side.node.name}: {'; '.join(src_state.errors)}")
            source_name, manifest = src_side.node.name, src_state.manifest
        else:
            source_name, manifest = _majority(states)
            src_side = sides[source_name]
            states.pop(source_name)
        target_states = [states[s.node.name] for s in targets if s.node.name in states]
        plan = compute_plan(source_name, manifest, target_states)
        report.plan = plan
        if on_plan is not None:
            on_plan(plan)
        if plan.doubtful and not delete_extras:
            refusal = describe_refusal(plan, src_side.dirs)
            if check or plan.problems or confirm is None or \
                    not confirm(describe_refusal(plan, src_side.dirs, question=True)):
                report.refusal = refusal
        if check or plan.problems or report.refusal:
            report.seconds = time.perf_counter() - started
            return report

        # Extras (and useless partials) first: they also free space.
        deletions = [p for p in plan.nodes if p.delete]
        done = await asyncio.gather(*(_call(sides[p.node], ["delete"], {"dirs": dirs, "paths": list(p.delete)},
                                            SETUP_TIMEOUT) for p in deletions), return_exceptions=True)
        for p, out in zip(deletions, done, strict=True):
            if isinstance(out, BaseException):
                report.node_errors[p.node] = str(out)
            elif json.loads(out.strip().splitlines()[-1]).get("errors"):
                report.node_errors[p.node] = "; ".join(json.loads(out.strip().splitlines()[-1])["errors"])

        transfer_started = time.perf_counter()
        if plan.chain:
            await _transfer(plan, src_side, [sides[n] for n in plan.chain], report, progress)
            failed = [n for n in plan.chain if n in report.node_errors]
            if failed:
                # Fallback: the nodes the chain did not finish (unreachable data plane, a relay that could not
                # bind or connect) get the stream over the coordinator's own SSH connections.
                again = await asyncio.gather(*(_plan_state(sides[n]) for n in failed), return_exceptions=True)
                retry = [a for a in again if isinstance(a, NodeState)]
                fallback = compute_plan(source_name, manifest, retry)
                if fallback.chain:
                    report.fallback = {n: report.node_errors.pop(n) for n in fallback.chain}
                    report.node_errors.pop(src_side.node.name, None)
                    await _transfer_ssh(fallback, src_side, [sides[n] for n in fallback.chain], report, progress)
        report.transfer_seconds = time.perf_counter() - transfer_started

        final = await asyncio.gather(*(_plan_state(s) for s in targets if s.node.name in states),
                                     return_exceptions=True)
        for side, ans in zip([s for s in targets if s.node.name in states], final, strict=True):
            if isinstance(ans, NodeState):
                report.verified[side.node.name] = verify(manifest, ans)
            else:
                report.node_errors.setdefault(side.node.name, str(ans))
        # Errors the end outlived: a node that verified identical is synced whatever went wrong on the way, and
        # so is a source whose every target did.
        everyone = bool(report.verified) and all(not v for v in report.verified.values()) and \
            set(report.verified) == {s.node.name for s in targets if s.node.name in states}
        for name in list(report.node_errors):
            if report.verified.get(name) == [] or (name == src_side.node.name and everyone):
                report.recovered[name] = report.node_errors.pop(name)
    report.seconds = time.perf_counter() - started
    return report


def _majority(states: dict[str, NodeState]) -> tuple[str, dict[str, tuple[int, str]]]:
    from coordinator.models import majority

    digests = {n: json.dumps(sorted(s.manifest.items())) for n, s in states.items() if s.manifest and not s.missing}
    winner, _ = majority(digests)
    if winner is None:
        raise ConfigError("no majority copy of the model/data dirs among the nodes: name the good copy with "
                          "--from NODE or --source PATH")
    name = next(n for n, d in digests.items() if d == winner)
    return name, states[name].manifest


async def _transfer(plan: SyncPlan, src: _Side, chain: list[_Side], report: SyncReport,
                    progress: Progress | None) -> None:
    token = secrets.token_hex(16)
    total = plan.stream_bytes

    def meter(name: str) -> Callable[[int], None]:
        return lambda done: progress(name, done, total) if progress is not None else None

    need = {p.node: list(p.copy) for p in plan.nodes}
    servers = [_Stream(s, _relay_argv(s, "serve", "--bind", s.node.data_ip),
                       {"token": token, "dirs": s.dirs, "need": need[s.node.name], "timeout": RELAY_IDLE_TIMEOUT},
                       meter(s.node.name)) for s in chain]
    # The chain is the relays that listen (within PORT_TIMEOUT, or sooner stopped as silent by the watchdog);
    # the others are left to the fallback.
    early = asyncio.create_task(_watch_stalls(servers, None))
    try:
        await asyncio.wait([s.port for s in servers], timeout=PORT_TIMEOUT)
    finally:
        early.cancel()
    for server in [s for s in servers if not s.port.done() or s.port.exception() is not None]:
        server.task.cancel()
        why = (f"silent for {STALL_TIMEOUT:g}s (hung?)" if server.stalled
               else (server.port.exception() if server.port.done() else None) or
               f"not listening after {PORT_TIMEOUT:g}s")
        report.node_errors.setdefault(server.side.node.name, f"relay did not start: {why}")
    servers = [s for s in servers if s.port.done() and s.port.exception() is None]
    if not servers:
        return
    hops = [[s.side.node.data_ip, s.port.result()] for s in servers]
    sender = _Stream(src, _relay_argv(src, "send"),
                     {"token": token, "dirs": src.dirs, "files": [f.to_json() for f in plan.files], "chain": hops,
                      "timeout": RELAY_IDLE_TIMEOUT}, lambda _done: None, listens=False)
    # A relay that aborts breaks the chain there: the relays after it would wait for an upstream (or data) until
    # their idle timeout, so they get BROKEN_CHAIN_GRACE to finish on their own, then are stopped (the fallback
    # serves them). The ones before it go on: a relay whose next hop fails keeps receiving for itself.
    stoppers: list[asyncio.Task[None]] = []

    async def stop_after(group: list[_Stream]) -> None:
        running = [s.task for s in group if not s.task.done()]
        if running:
            _, pending = await asyncio.wait(running, timeout=BROKEN_CHAIN_GRACE)
            for task in pending:
                task.cancel()

    def on_end(i: int) -> Callable[[asyncio.Task[None]], None]:
        def ended(_task: asyncio.Task[None]) -> None:
            if servers[i].aborted:
                stoppers.append(asyncio.create_task(stop_after(servers[i + 1:])))
        return ended

    for i, server in enumerate(servers):
        server.task.add_done_callback(on_end(i))
    watchdog = asyncio.create_task(_watch_stalls(servers, sender))
    try:
        await asyncio.wait([sender.task])  # (cancelled by the watchdog when it hangs)
        # The source is done: every relay it reached has finished (each hop waits for the next to close), so the
        # ones still running were cut off.
        await stop_after(servers)
        await asyncio.gather(*(s.task for s in servers), return_exceptions=True)
        await asyncio.sleep(0)  # the done callbacks run
        await asyncio.gather(*stoppers, return_exceptions=True)
    finally:
        watchdog.cancel()
    if sender.answer and isinstance(sender.answer.get("bytes"), int):
        report.sent_bytes = sender.answer["bytes"]
    problem = sender.error()
    if problem:
        report.node_errors[src.node.name] = f"source: {problem}"
    for server in servers:
        problem = server.error()
        name = server.side.node.name
        if problem:
            report.node_errors[name] = problem
        if server.answer and server.answer.get("refused"):
            report.refused[name] = list(server.answer["refused"])


async def _watch_stalls(servers: list[_Stream], sender: _Stream | None) -> None:
    """Stop a relay that has said nothing (no progress, no heartbeat) for STALL_TIMEOUT: a hung process or node
    would otherwise hold the whole chain until the sockets' idle timeout. Its neighbours then see its sockets
    close and go on without it (the fallback serves it)."""
    while True:
        await asyncio.sleep(STALL_TIMEOUT / 4)
        now = time.monotonic()
        for stream in [*([sender] if sender is not None else []), *servers]:
            if not stream.task.done() and now - stream.heard > STALL_TIMEOUT:
                stream.stalled = True
                stream.task.cancel()


async def _transfer_ssh(plan: SyncPlan, src: _Side, targets: list[_Side], report: SyncReport,
                        progress: Progress | None) -> None:
    """The same stream, through the coordinator: the source's `send --stdout` is read over its SSH channel and
    written into every target's `serve --stdin` (the coordinator's link carries one copy per target)."""
    token = secrets.token_hex(16)
    total = plan.stream_bytes
    need = {p.node: list(p.copy) for p in plan.nodes}
    spec = {"token": token, "dirs": src.dirs, "files": [f.to_json() for f in plan.files], "chain": [],
            "timeout": RELAY_IDLE_TIMEOUT}
    source = await src.transport.open_binary(_relay_argv(src, "send", "--stdout"))
    source.stdin.write(json.dumps(spec).encode() + b"\n")
    source.stdin.write_eof()
    sinks: dict[str, RawProcess] = {}
    answers: dict[str, dict[str, Any]] = {}

    async def read_err(name: str, proc: RawProcess) -> None:
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace")
            if text.startswith("progress ") and progress is not None and name != src.node.name:
                progress(name, int(text.split()[1]), total)
            elif text.startswith("result "):
                answers[name] = json.loads(text[len("result "):])

    async def read_out(name: str, proc: RawProcess) -> None:
        out = (await proc.stdout.read()).decode(errors="replace").strip().splitlines()
        answers[name] = json.loads(out[-1]) if out else {"error": "no answer"}

    readers = [asyncio.create_task(read_err(src.node.name, source))]
    started = [source]
    for t in targets:
        try:
            proc = await t.transport.open_binary(_relay_argv(t, "serve", "--stdin"))
        except TransportError as exc:
            report.node_errors[t.node.name] = f"SSH fallback: {exc}"
            answers[t.node.name] = {}
            continue
        started.append(proc)
        proc.stdin.write(json.dumps({"token": token, "dirs": t.dirs, "need": need[t.node.name],
                                     "timeout": RELAY_IDLE_TIMEOUT}).encode() + b"\n")
        sinks[t.node.name] = proc
        readers += [asyncio.create_task(read_err(t.node.name, proc)), asyncio.create_task(read_out(t.node.name, proc))]

    def drop(name: str, why: str) -> None:
        # That node's relay died or hung: it is stopped (so its readers end) and the others go on.
        report.node_errors[name] = f"SSH fallback: {why}"
        answers.setdefault(name, {})
        sinks.pop(name).kill()

    async def feed(proc: RawProcess, data: bytes) -> None:
        proc.stdin.write(data)
        await asyncio.wait_for(proc.stdin.drain(), timeout=RELAY_IDLE_TIMEOUT)

    try:
        while True:
            try:
                chunk = await asyncio.wait_for(source.stdout.read(1 << 20), timeout=RELAY_IDLE_TIMEOUT)
            except TimeoutError:
                answers[src.node.name] = {"error": f"sent nothing for {RELAY_IDLE_TIMEOUT:g}s"}
                break
            if not chunk:
                break
            report.sent_bytes += len(chunk)
            names = list(sinks)
            fed = await asyncio.gather(*(feed(sinks[n], chunk) for n in names), return_exceptions=True)
            for name, outcome in zip(names, fed, strict=True):
                if isinstance(outcome, TimeoutError):
                    drop(name, f"took nothing for {RELAY_IDLE_TIMEOUT:g}s")
                elif isinstance(outcome, (OSError, asyncssh.Error)):
                    drop(name, str(outcome))
                elif isinstance(outcome, BaseException):
                    raise outcome
        for proc in sinks.values():
            proc.stdin.write_eof()
        # Each relay answers once its last file is renamed; bounded, so a hung one cannot hold the sync.
        _, pending = await asyncio.wait([asyncio.ensure_future(source.wait()), *readers,
                                         *(asyncio.ensure_future(p.wait()) for p in sinks.values())],
                                        timeout=RELAY_IDLE_TIMEOUT)
        for task in pending:
            task.cancel()
    finally:
        for proc in started:
            proc.kill()
    for name in [src.node.name, *(t.node.name for t in targets)]:
        doc = answers.get(name, {"error": "no answer"})
        problem = doc.get("error") or "; ".join(doc.get("errors") or [])
        if problem:
            report.node_errors.setdefault(name, f"source: {problem}" if name == src.node.name
                                          else f"SSH fallback: {problem}")
