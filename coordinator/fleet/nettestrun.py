"""`coordinator nettest`'s I/O: pairwise latency and bandwidth between the nodes' data-plane IPs (the verb:
coordinator/cli/nettest.py).

The I/O shell around `coordinator.fleet.nettest` (which holds the pure judging). Steps:

1. connect to every node (one connection each, reused), ship the worker package and gather facts
   concurrently (the facts say which link each data IP rides on);
2. for each unordered pair (a, b), ONE AT A TIME (concurrent pairs would share links and CPUs and measure each
   other): start `python -m worker.nettest serve --bind <b's data IP>` on b over b's connection, read the port it
   picked, run `python -m worker.nettest client --to <b's IP> --port P` on a over a's connection, wait for the
   server to finish;
3. judge each pair against its link kind and print a table (or JSON).

Failure semantics: a node that cannot be reached or set up makes each of its pairs a `fail` with the reason;
a pair whose server or client fails is a `fail` too; the other pairs are still measured. Exit 0 when no pair
fails (`--strict`: no pair warns either), 1 otherwise, 2 on a usage error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.gather import gather_facts
from coordinator.fleet.nettest import (
    GpuBusResult,
    LinkEnd,
    Measurement,
    NettestReport,
    PairResult,
    ParseError,
    classify_endpoint,
    evaluate_gpu_bus,
    evaluate_pair,
    parse_client_output,
    plan_pairs,
)
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, Transport, python_argv
from coordinator.models import Inventory, Node
from coordinator.planning.gpuranks import compute_gpu_slots

GPU_TIMEOUT = 120.0  # the NCCL test's ranks: start, join the group (seconds on a cold machine), 22 all_sums
SERVE_ACCEPT_TIMEOUT = 20.0  # the server gives up when no client connected (or a socket stalls) this long


PORT_TIMEOUT = 30.0  # the server must print its port within this (python start-up over SSH)


CLIENT_CONNECT_TIMEOUT = 5.0


SETUP_TIMEOUT = 60.0  # shipping the worker / probing facts, per node


PairProgress = Callable[[str, str], None]


@dataclass(frozen=True)
class _Ready:
    node: Node
    transport: Transport
    worker_dir: str


def _worker_argv(node: Node, worker_dir: str, *args: str) -> list[str]:
    env = [f"{k}={v}" for k, v in node.env if k != "PYTHONPATH"]
    return ["env", *env, f"PYTHONPATH={worker_dir}", *python_argv(node.python, "-m", "worker.nettest", *args)]


async def _first_stdout(stream: AsyncIterator[tuple[str, str]], node: str) -> dict[str, object]:
    """The server's first stdout JSON line; stderr lines are kept for the error message."""
    err: list[str] = []
    async for kind, line in stream:
        if kind == "stdout" and line.strip():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                err.append(line.strip())
                continue
            if isinstance(doc, dict):
                return doc
        elif kind == "stderr":
            err.append(line.strip())
        elif kind == "exit":
            raise TransportError(node, f"nettest server exited {line} before listening: {' | '.join(err[-5:])}")
    raise TransportError(node, f"nettest server ended before listening: {' | '.join(err[-5:])}")


async def measure_pair(a: _Ready, b: _Ready, *, seconds: float, pings: int) -> Measurement:
    """Serve on b's data IP, measure from a. Raises TransportError or ParseError on any failure."""
    serve_argv = _worker_argv(b.node, b.worker_dir, "serve", "--bind", b.node.data_ip,
                              "--timeout", f"{SERVE_ACCEPT_TIMEOUT:g}")
    client_timeout = CLIENT_CONNECT_TIMEOUT + 2 * seconds + 60
    stream = b.transport.stream(serve_argv, timeout=PORT_TIMEOUT + client_timeout + SERVE_ACCEPT_TIMEOUT)
    try:
        doc = await asyncio.wait_for(_first_stdout(stream, b.node.name), timeout=PORT_TIMEOUT)
        if "error" in doc or not isinstance(doc.get("port"), int):
            raise TransportError(b.node.name, f"nettest server: {doc.get('error', doc)}")
        port = doc["port"]
        client_argv = _worker_argv(a.node, a.worker_dir, "client", "--to", b.node.data_ip, "--port", str(port),
                                   "--seconds", f"{seconds:g}", "--pings", str(pings),
                                   "--connect-timeout", f"{CLIENT_CONNECT_TIMEOUT:g}")
        result = await a.transport.run(client_argv, timeout=client_timeout)
        try:
            measurement = parse_client_output(result.stdout)
        except ParseError as exc:
            detail = result.stderr.strip()[-300:]
            raise ParseError(f"{a.node.name} -> {b.node.name}:{port}: {exc}" + (f" ({detail})" if detail else "")) \
                from exc
        # Let the server finish its session cleanly (it exits right after the client's `Q`).
        async for _ in stream:
            pass
        return measurement
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def run_nettest(inventory: Inventory, *, seconds: float, pings: int = 50, connect_timeout: float = 5.0,
                      accept_new_host_keys: bool = False, progress: PairProgress | None = None) -> NettestReport:
    """Measure every pair of `inventory`'s nodes, sequentially. Per-node and per-pair failures are results."""
    started = time.perf_counter()
    names = inventory.names()
    pairs = plan_pairs(names)
    node_errors: dict[str, str] = {}
    facts: dict[str, NodeFacts] = {}
    ready: dict[str, _Ready] = {}
    results: list[PairResult] = []
    async with Fleet(inventory.nodes, connect_timeout=connect_timeout,
                     accept_new_host_keys=accept_new_host_keys) as fleet:
        for name, outcome in (await fleet.connect_all()).items():
            if isinstance(outcome, TransportError):
                node_errors[name] = str(outcome)

        async def ship(node: Node, transport: Transport) -> str:
            return await ship_worker(transport, node, timeout=SETUP_TIMEOUT)

        shipped, gathered = await asyncio.gather(fleet.map(ship), gather_facts(fleet, None, timeout=SETUP_TIMEOUT))
        for node in inventory.nodes:
            got = gathered.get(node.name)
            if isinstance(got, NodeFacts):
                facts[node.name] = got
            where = shipped.get(node.name)
            if isinstance(where, str):
                ready[node.name] = _Ready(node, fleet.transports[node.name], where)
            elif isinstance(where, TransportError):
                node_errors[node.name] = str(where)

        ends = {n.name: classify_endpoint(n.name, n.data_ip, facts.get(n.name)) for n in inventory.nodes}
        for a, b in pairs:
            if progress is not None:
                progress(a, b)
            results.append(await _one_pair(ends[a], ends[b], ready, node_errors, seconds=seconds, pings=pings))
        # NCCL between the GPUs of each node that has several (one rank per GPU: planning.gpuranks).
        gpus: list[GpuBusResult] = []
        for node in inventory.nodes:
            try:
                slots = compute_gpu_slots(node, facts.get(node.name))
            except ConfigError as exc:
                gpus.append(evaluate_gpu_bus(node.name, (), None, str(exc)))
                continue
            if len(slots) < 2 or node.name not in ready:
                continue
            if progress is not None:
                progress(node.name, f"its {len(slots)} GPUs (NCCL)")
            devices = [s.device for s in slots]
            env = [f"{k}={v}" for k, v in node.env if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")]
            argv = ["env", *env, f"PYTHONPATH={ready[node.name].worker_dir}",
                    *python_argv(node.python, "-m", "worker.gpunettest", "--devices", ",".join(devices),
                                 "--timeout", f"{GPU_TIMEOUT:g}")]
            try:
                res = await ready[node.name].transport.run(argv, timeout=GPU_TIMEOUT + 30)
            except TransportError as exc:
                gpus.append(evaluate_gpu_bus(node.name, devices, None, str(exc)))
                continue
            gpus.append(evaluate_gpu_bus(node.name, devices, res.stdout,
                                         None if res.stdout.strip() else (res.stderr.strip()[-300:] or
                                                                          f"exit {res.exit_status}")))
    if not pairs and not gpus:
        raise ConfigError(f"nettest needs at least two nodes, or a node with several NVIDIA GPUs; "
                          f"{', '.join(names) or 'no node'} has neither")
    return NettestReport(tuple(results), time.perf_counter() - started, node_errors, tuple(gpus))


async def _one_pair(a: LinkEnd, b: LinkEnd, ready: dict[str, _Ready], node_errors: dict[str, str], *,
                    seconds: float, pings: int) -> PairResult:
    down = [node_errors.get(n, f"{n}: not set up") for n in (a.node, b.node) if n not in ready]
    if down:
        return evaluate_pair(a, b, None, "; ".join(down))
    try:
        measurement = await measure_pair(ready[a.node], ready[b.node], seconds=seconds, pings=pings)
    except (CoordinatorError, ParseError) as exc:
        return evaluate_pair(a, b, None, str(exc))
    except TimeoutError:
        return evaluate_pair(a, b, None, f"{b.node}: nettest server printed no port within {PORT_TIMEOUT:g}s")
    return evaluate_pair(a, b, measurement, None)



async def measure_links(fleet: Fleet, pairs: Sequence[tuple[Node, Node]], *, seconds: float = 0.5,
                        pings: int = 10) -> dict[tuple[str, str], Measurement | CoordinatorError]:
    """Measure each of `pairs` (a pipeline's neighbours) over `fleet`'s open connections, one pair at a time, as
    `run_nettest` measures a pair, in a short window (calibration's, not the verb's). A pair that cannot be
    measured is its error; the others are still measured."""
    ready: dict[str, _Ready | CoordinatorError] = {}
    for node in {n.name: n for pair in pairs for n in pair}.values():
        transport = fleet.transports.get(node.name)
        if transport is None:
            ready[node.name] = TransportError(node.name, "not connected")
            continue
        try:
            ready[node.name] = _Ready(node, transport, await ship_worker(transport, node, timeout=SETUP_TIMEOUT))
        except CoordinatorError as exc:
            ready[node.name] = exc
    out: dict[tuple[str, str], Measurement | CoordinatorError] = {}
    for a, b in pairs:
        ra, rb = ready[a.name], ready[b.name]
        key = (a.name, b.name)
        if isinstance(ra, CoordinatorError) or isinstance(rb, CoordinatorError):
            out[key] = ra if isinstance(ra, CoordinatorError) else rb  # type: ignore[assignment]
            continue
        try:
            out[key] = await measure_pair(ra, rb, seconds=seconds, pings=pings)
        except CoordinatorError as exc:
            out[key] = exc
        except (ParseError, TimeoutError) as exc:
            out[key] = TransportError(a.name, f"measuring the link to {b.name}: {exc or 'timed out'}")
    return out
