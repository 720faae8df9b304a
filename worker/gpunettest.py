"""NCCL bus bandwidth between the GPUs of this node (`coordinator nettest` on a node with several NVIDIA GPUs).

    python -m worker.gpunettest --devices GPU-a,GPU-b [--mib 256] [--iters 20] [--timeout 120]

Starts one process per device (CUDA_VISIBLE_DEVICES = that device, MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP
127.0.0.1 and a free NCCL_PORT: what mlx.launch gives nccl ranks), each of which joins mlx's nccl group and
times `--iters` all_sums of a `--mib` MiB bfloat16 buffer after two warm-up ones. Prints ONE JSON line:

    {"devices": [...], "bytes": B, "iters": K, "seconds": S, "algbw_bytes_per_s": B*K/S,
     "busbw_bytes_per_s": algbw * 2(n-1)/n}

`busbw` is NCCL's own convention (nccl-tests): the bandwidth each link carries in a ring all-reduce, comparable
across GPU counts with the hardware's link speed. The slowest rank's time counts (all ranks end together).
Failure semantics: any error prints `{"error": "..."}` and exits 1; a rank that hangs is killed at --timeout.
NVLink multicast (NCCL_NVLS_ENABLE) is left as the environment sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bus_bandwidth(nbytes: int, iters: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/second of `iters` all-reduces of `nbytes` over `world` ranks in `seconds`."""
    algbw = nbytes * iters / seconds if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


def rank_main(mib: float, iters: int) -> dict[str, Any]:
    """One rank: join the nccl group, time the all_sums. Rank 0's dict is the answer."""
    import mlx.core as mx
    import numpy as np

    group = mx.distributed.init(backend="nccl", strict=True)
    n = int(mib * 2**20) // 2
    x = mx.ones((n,), dtype=mx.bfloat16)
    mx.eval(x)
    for _ in range(2):
        mx.eval(mx.distributed.all_sum(x, group=group))
    mx.synchronize()
    tic = time.perf_counter()
    y = x
    for _ in range(iters):
        y = mx.distributed.all_sum(x, group=group)
        mx.eval(y)
    mx.synchronize()
    seconds = time.perf_counter() - tic
    check = y[0].item()
    if check != group.size():
        raise RuntimeError(f"all_sum gave {check}, expected {group.size()}")
    # every rank's time: the slowest is the collective's
    times = mx.distributed.all_gather(mx.array([seconds], dtype=mx.float32), group=group)
    return {"rank": group.rank(), "seconds": float(np.asarray(times).max()), "bytes": n * 2}


def run(devices: list[str], mib: float, iters: int, timeout: float) -> dict[str, Any]:
    port = str(_free_port())
    procs = []
    for rank, device in enumerate(devices):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": device, "MLX_RANK": str(rank),
               "MLX_WORLD_SIZE": str(len(devices)), "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "worker.gpunettest", "--rank-of", str(len(devices)),
                                       "--mib", str(mib), "--iters", str(iters)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs: list[tuple[str, str, int]] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((out, err, p.returncode))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a rank did not finish within {timeout:g}s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (out, err, rc) in enumerate(outs):
        if rc != 0:
            lines = [ln for ln in (err or out).splitlines() if ln.strip()]
            raise RuntimeError(f"rank {rank} (device {devices[rank]}) exited {rc}: {lines[-1] if lines else ''}")
    first = json.loads(outs[0][0].strip().splitlines()[-1])
    algbw, busbw = bus_bandwidth(int(first["bytes"]), iters, float(first["seconds"]), len(devices))
    return {"devices": devices, "bytes": first["bytes"], "iters": iters, "seconds": first["seconds"],
            "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.gpunettest", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", help="comma-separated CUDA_VISIBLE_DEVICES values, one per rank (>= 2)")
    parser.add_argument("--mib", type=float, default=256.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)  # internal: run as one rank
    args = parser.parse_args(argv)
    try:
        if args.rank_of is not None:
            print(json.dumps(rank_main(args.mib, args.iters)), flush=True)
            return 0
        devices = [d for d in (args.devices or "").split(",") if d]
        if len(devices) < 2:
            raise ValueError("--devices needs at least two GPUs")
        print(json.dumps(run(devices, args.mib, args.iters, args.timeout)), flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 -- the process boundary: every failure is the JSON error line
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
