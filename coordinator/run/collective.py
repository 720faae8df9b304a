"""Time the run's gradient exchange between the nodes that will run it (calibration of a multi-rank dp run).

The I/O shell around `coordinator.planning.collective`: every rank of `worker.collbench` is started at once over
its node's own connection (the worker shipped as for the bench), in the environment a training rank gets (the
job env overlaid with the node's, `build_worker_argv`) plus what its backend reads (`build_rank_starts`: ring's
hostfile of ports, nccl's and jaccl's coordinator address); rank 0's one JSON line is the measurement. It is
cached in `cache_dir` under `compute_collective_key` (nodes and their hardware, backend, addresses, bytes, worker,
MLX_* env); `recalibrate` measures again.

Failure semantics: never raises for the fleet's sake. A rank that fails, a timeout, an answer that does not parse
or a backend that cannot be started this way is returned as a `CollectiveError` (the caller plans without the
exchange and says why); a cache that cannot be written is reported through `progress`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordinator.errors import CoordinatorError
from coordinator.fleet.ship import ship_worker, worker_bundle
from coordinator.fleet.transport import Fleet, Transport, build_worker_argv
from coordinator.models import Node
from coordinator.planning.collective import (
    CollectiveCost,
    CollectiveError,
    GradientSize,
    build_rank_starts,
    compute_collective_key,
    parse_collbench,
    ports_needed,
)
from coordinator.planning.hostfile import Hostfile
from coordinator.run.calibrate import NodeFingerprint, parse_bench_stdout
from coordinator.run.launch import pick_port

BUDGET_S = 3.0  # seconds of timed exchanges (a slow link's big exchange: at least 3 of them, whatever it takes)
START_S = 90.0  # python, mlx's import and the group's connect on a busy node (ring retries for ~31 s)
SLACK_S = 30.0

Progress = Callable[[str], None]


def _cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"collective-{key}.json"


def read_cached(cache_dir: Path, key: str, *, nodes: Sequence[str], backend: str) -> CollectiveCost | None:
    """A cached measurement, or None (a miss: absent, unreadable, another key, or no longer parsing)."""
    try:
        record = json.loads(_cache_path(cache_dir, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("answer"), dict):
        return None
    try:
        return parse_collbench(record["answer"], nodes=nodes, backend=backend, cached=True)
    except CollectiveError:
        return None


def _write_cache(cache_dir: Path, key: str, answer: Mapping[str, Any]) -> None:
    """Atomic (temp file + rename), as the calibration cache."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = _cache_path(cache_dir, key)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "saved_at": time.time(), "answer": dict(answer)}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


async def measure_collective(
    fleet: Fleet, nodes: Sequence[Node], hostfile: Hostfile, gradients: GradientSize, *,
    fingerprints: Mapping[str, NodeFingerprint], env: Mapping[str, str], cache_dir: Path, recalibrate: bool,
    progress: Progress | None = None, budget_s: float = BUDGET_S,
) -> CollectiveCost | CoordinatorError:
    """The exchange of `gradients` between `nodes` (rank order = `hostfile`'s), measured or read from the cache.
    `env` is the job env every rank gets. See the module docstring for the failure semantics."""
    names = [n.name for n in nodes]
    backend = hostfile.backend
    prints = [asdict(fp) if (fp := fingerprints.get(n)) is not None and fp.known else None for n in names]
    key = compute_collective_key(hostfile, prints, gradients, worker_bundle()[0], sorted(env.items()))
    if key is not None and not recalibrate:
        hit = read_cached(cache_dir, key, nodes=names, backend=backend)
        if hit is not None:
            return hit
    try:
        starts = build_rank_starts(hostfile, pick_port(ports_needed(hostfile)))
    except CoordinatorError as exc:
        return exc
    rank_of = {name: i for i, name in enumerate(names)}
    timeout = START_S + 10 * budget_s + SLACK_S

    async def one(node: Node, transport: Transport) -> str:
        start = starts[rank_of[node.name]]
        worker_dir = await ship_worker(transport, node)
        rank_env = sorted({**env, **node.env_dict, **dict(start.env)}.items())
        argv = build_worker_argv(node.python, worker_dir, rank_env, "-m", "worker.collbench", "--backend", backend,
                                 "--ranks", str(len(names)), "--elements", gradients.to_arg(),
                                 *(a for k, v in start.files for a in ("--file", f"{k}={v}")),
                                 "--budget", f"{budget_s:g}", "--timeout", f"{timeout - SLACK_S:g}")
        result = await transport.run(argv, timeout=timeout)
        if "{" not in result.stdout:  # died before its JSON line (an import error, a signal): its last words
            tail = [line for line in result.stderr.splitlines() if line.strip()]
            return json.dumps({"error": f"rank {rank_of[node.name]} on {node.name} exited {result.exit_status}: "
                                        + (tail[-1][:300] if tail else "no output")})
        return result.stdout

    if progress is not None:
        progress(f"timing the gradient all_sum ({gradients.nbytes:,} bytes) between {', '.join(names)} over "
                 f"{backend}")
    outs = await fleet.map(one, names=names)
    errors = [f"{n}: {r}" for n, r in outs.items() if not isinstance(r, str)]
    missing = [n for n in names if n not in outs]
    if missing:
        errors += [f"{n}: not connected" for n in missing]
    first = outs.get(names[0])
    if not isinstance(first, str):
        return CollectiveError("the all_sum measurement failed: " + "; ".join(errors))
    try:
        answer = parse_bench_stdout(names[0], first)
        cost = parse_collbench(answer, nodes=names, backend=backend)
    except CoordinatorError as exc:
        peers = [o for o in outs.values() if isinstance(o, str) and "error" in o]
        return CollectiveError(f"{exc}" + (f" ({peers[0].strip()[:300]})" if peers else ""))
    if key is not None:
        try:
            _write_cache(cache_dir, key, answer)
        except OSError as exc:
            if progress is not None:
                progress(f"could not cache the all_sum measurement in {cache_dir}: {exc}")
    return cost


__all__ = ["measure_collective", "read_cached"]
