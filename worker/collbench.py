"""One rank of a timed gradient exchange: the all_sum a dp step makes, between the nodes that will run it
(calibration, `coordinator/run/collective.py`; the cost model: `coordinator/planning/collective.py`).

    python -m worker.collbench --backend ring --ranks N --elements float32:138049[,bfloat16:K]
        [--file MLX_HOSTFILE=<json>] [--budget 3] [--max-samples 20] [--timeout 120]

Every rank is started with the environment its backend reads (MLX_RANK and the backend's own variables, as
mlx.launch gives them); `--file NAME=CONTENT` writes CONTENT to a private temp file and exports NAME as its path
(ring's MLX_HOSTFILE, jaccl's MLX_IBV_DEVICES), removed at exit. The rank joins the group (`strict`: a group of
the wrong size is an error, never a silent size-1 world) and builds the run's buckets: per dtype, the elements cut
in buckets of the size the run's step uses on this device (`worker.exchange`; as `all_sum_arrays` concatenates
the gradients; the loss rides in the float32 elements). Then:

- a warm-up exchange (connections, first allocations), whose slowest time sets how many exchanges fit in
  `--budget` seconds (at least 3, at most `--max-samples`; every rank agrees on the count: it is the all_sum of
  the ranks' warm-up times);
- `small`: one-element all_sums back to back (the exchange's latency term);
- `samples` exchanges, each after a barrier, each timed from its start to the evaluation of every bucket.

Each rank's median is gathered; the slowest rank's is the answer (an exchange ends together on all ranks, the
medians differ by when each rank entered it). Rank 0 prints ONE JSON line:

    {"seconds": s, "small_seconds": s, "bytes": B, "ranks": N, "samples": K, "buckets": M, "backend": "ring"}

Failure semantics: any error prints `{"error": "..."}` and exits 1 (every rank); a rank still running after
`--timeout` seconds (a peer that never came: ring's accept has no timeout) prints the error and exits 1.
Compatibility: Python 3.9+; numpy and mlx only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from worker.exchange import bucket_bytes_for

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SMALL_SAMPLES = 9


def parse_elements(text: str) -> dict[str, int]:
    """`float32:138049,bfloat16:10` -> {dtype: elements}. Raises ValueError on a bad entry."""
    out: dict[str, int] = {}
    for part in (p for p in text.split(",") if p):
        dtype, _, count = part.partition(":")
        if dtype not in ITEMSIZE or not count.isdigit():
            raise ValueError(f"bad --elements entry {part!r}: dtype:count with dtype in {sorted(ITEMSIZE)}")
        out[dtype] = out.get(dtype, 0) + int(count)
    if not out or not any(out.values()):
        raise ValueError("--elements names no element")
    return out


def plan_buckets(elements: dict[str, int], bucket_bytes: int) -> list[tuple[str, int]]:
    """(dtype, elements) of each all_sum of one exchange, in the run's order (dtypes sorted by name): each dtype's
    elements cut in buckets of `bucket_bytes` counted at 4 bytes an element, as `worker.step.bucket_names` counts."""
    per_bucket = max(1, bucket_bytes // 4)
    out: list[tuple[str, int]] = []
    for dtype in sorted(elements):
        left = elements[dtype]
        while left > 0:
            out.append((dtype, min(per_bucket, left)))
            left -= per_bucket
    return out


def samples_for(warmup_s: float, budget_s: float, most: int) -> int:
    """How many exchanges to time: what fits in the budget at the warm-up's pace, 3 to `most`."""
    if warmup_s <= 0:
        return most
    return max(3, min(most, int(budget_s / warmup_s)))


def write_files(specs: list[str]) -> list[str]:
    """Each `NAME=CONTENT` written to a private temp file, NAME exported as its path; returns the paths."""
    paths = []
    for spec in specs:
        name, sep, content = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"bad --file {spec!r}: NAME=CONTENT")
        fd, path = tempfile.mkstemp(prefix=f"collbench-{name.lower()}-")
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.environ[name] = path
        paths.append(path)
    return paths


def _watchdog(timeout: float, done: threading.Event) -> None:
    if done.wait(timeout):
        return
    sys.stdout.write(json.dumps({"error": f"the exchange did not finish within {timeout:g}s (a peer that never "
                                          "joined, or a hung collective)"}) + "\n")
    sys.stdout.flush()
    os._exit(1)


def measure(backend: str, ranks: int, elements: dict[str, int], budget_s: float, most: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    group = mx.distributed.init(backend=backend, strict=True)
    size, rank = int(group.size()), int(group.rank())
    if size != ranks:
        raise RuntimeError(f"joined a group of {size} ranks, expected {ranks}")
    bucket_bytes = bucket_bytes_for(mx.default_device() == mx.gpu)
    buckets = [mx.ones((n,), dtype=getattr(mx, dtype)) for dtype, n in plan_buckets(elements, bucket_bytes)]
    one = mx.array(1.0, dtype=mx.float32)
    mx.eval(buckets, one)

    def small() -> float:
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(one, group=group))
        return time.perf_counter() - tic

    def exchange() -> float:
        small()  # the barrier: every rank starts the exchange within a hop of the others
        tic = time.perf_counter()
        out = [mx.distributed.all_sum(b, group=group) for b in buckets]
        mx.eval(out)
        elapsed = time.perf_counter() - tic
        if out[0][0].item() != size:  # ones summed over the ranks
            raise RuntimeError(f"the all_sum gave {out[0][0].item()}, expected {size}")
        return elapsed

    def slowest(value: float) -> float:
        mine = np.zeros(size, dtype=np.float32)
        mine[rank] = value
        return float(np.asarray(mx.distributed.all_sum(mx.array(mine), group=group)).max())

    warmup = slowest(exchange())
    count = samples_for(warmup, budget_s, most)
    smalls = [small() for _ in range(SMALL_SAMPLES)]
    times = [exchange() for _ in range(count)]
    nbytes = sum(ITEMSIZE[d] * n for d, n in elements.items())
    return {"seconds": slowest(statistics.median(times)), "small_seconds": slowest(statistics.median(smalls)),
            "bytes": nbytes, "ranks": size, "samples": count, "buckets": len(buckets), "backend": backend,
            "rank": rank, "warmup_seconds": warmup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.collbench", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--elements", required=True, help="dtype:count,... (the run's gradients and loss)")
    parser.add_argument("--file", action="append", default=[], help="NAME=CONTENT: a temp file exported as NAME")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timed exchanges (about)")
    parser.add_argument("--max-samples", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    done = threading.Event()
    threading.Thread(target=_watchdog, args=(args.timeout, done), daemon=True).start()
    paths: list[str] = []
    try:
        paths = write_files(args.file)
        result = measure(args.backend, args.ranks, parse_elements(args.elements), args.budget, args.max_samples)
        done.set()
        if result["rank"] == 0:
            print(json.dumps(result), flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 -- the process boundary: every failure is the JSON error line
        done.set()
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
