"""Does a rank process take the same step slower or faster than calibration's bench process? (issue 25)

On one H100 calibration's bench took M full's batch-8 step in 0.150 s and the run's rank, minutes later on the same
machine, in 0.117-0.133 s (docs/benchmarks-history.md, session 6). This times the kinds of process below on the
same steps, one after the other, `--rounds` times, each in its own process:

- `rank`: `python -m worker.train --config C` started directly (no coordinator, no mlx.launch), C a one-rank run
  config of `--steps` iterations at `--batch` rows, no evaluation, checkpoint at the end; its step times are its
  step events' `step_time_s`.
- `bench`: the bench's trainer (`worker.bench._Trainer`, the run's own `TrainStep`) on the same rows in the run's
  order (stream position 0, batch, 2 x batch, ...), as calibration builds it.
- `bench+eval`, `bench+dist`, `bench+kc`, `bench+hist` (any of them joined by `+`; `bench+` is the first three):
  the same with what the rank does and the bench did not before its first step: the model's parameters and the
  optimizer state evaluated (`eval`; the bench does it since 360603f), `mx.distributed.init()` called (`dist`),
  MLX's kernel cache isolated (`kc`, `worker.kernelcache.isolate`); or with calibration's sweep before it (`hist`:
  `--hist-steps` steps at each batch 1, 2, 4, ... below `--batch`), or in calibration's order until session 10
  (`rr`: the batch shapes in turn, smallest first, each on its own batches; since then calibration times the run's
  order).
- `calib`: `python -m worker.bench` itself with the arguments calibration gives it (`--max-batch` the batch, a
  `--time-budget` of `--calib-budget`, 10 s by default); its point at `--batch`: each timed shape's median step time.

Any kind may end in `@CPUS`: its process (and every thread it starts) runs on those CPUs only, to tell the host
thread's placement from the rest. CPUS is a list (`0-7,16`), `gpu` (the CPUs local to the GPU, its PCI device's
`local_cpulist`) or `far` (every other CPU; none on a machine of one NUMA node, and then the kind is refused).

Prints one JSON line per process: its kind, round, its start and end (`time.time()`, to line it up with a GPU
clock log), for `rank` its digests' seconds (`digest_s`), the median of its steps after the first, for the bench kinds
each batch shape's median step (size in input positions: median, steps; each shape's first step left out), and
every step time (calib: the shapes' times).

    PYTHONPATH=. python3 benchmarks/probe_rank_vs_bench.py --model DIR --data DIR [--method full] [--batch 8]
        [--steps 20] [--rounds 2] [--kinds rank,bench,calib]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RANK_LIKE = ("eval", "dist", "kc")
OTHER = ("hist", "rr")


def parse_cpus(text: str) -> set[int]:
    """`0-3,8` -> {0, 1, 2, 3, 8}. Pure."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_cpus() -> set[int]:
    """The CPUs local to GPU 0: its PCI device's `local_cpulist` (nvidia-smi names the device)."""
    bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout.strip().lower()
    # nvidia-smi says 00000000:1B:00.0, sysfs names it 0000:1b:00.0
    return parse_cpus(Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text())


def placement(kind: str) -> tuple[str, set[int] | None]:
    """`rank@gpu` -> ("rank", the GPU's CPUs); `bench+` -> ("bench+", None)."""
    base, _, where = kind.partition("@")
    if not where:
        return base, None
    allowed = os.sched_getaffinity(0)
    if where == "gpu":
        cpus = gpu_cpus() & allowed
    elif where == "far":
        cpus = allowed - gpu_cpus()
    else:
        cpus = parse_cpus(where) & allowed
    if not cpus:
        raise SystemExit(f"kind {kind!r}: no CPU of this machine is {where!r} (allowed: {sorted(allowed)})")
    return base, cpus


def pinned(cpus: set[int] | None) -> Any:
    """A preexec_fn for subprocess: the child and all it starts run on `cpus` (None: as the parent)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def variants(kind: str) -> set[str]:
    """`bench+eval+kc` -> {"eval", "kc"}; `bench+` -> all of RANK_LIKE; `bench` -> none."""
    if kind == "bench+":
        return set(RANK_LIKE)
    parts = kind.split("+")
    if parts[0] != "bench" or not set(parts[1:]) <= set(RANK_LIKE + OTHER):
        raise SystemExit(f"unknown kind {kind!r}: rank, calib, bench, bench+ or bench+" + "+".join(RANK_LIKE + OTHER))
    return set(parts[1:])


def bench_argv(a: argparse.Namespace, batch: int, steps: int | None = None) -> list[str]:
    """worker.bench's arguments for this probe's run of `steps` (--steps) iterations, as
    coordinator.run.calibrate.build_bench_argv gives them."""
    return ["--model", a.model, "--seq-len", str(a.seq_len), "--method", a.method, "--num-layers", "-1",
            "--data", a.data, "--packing", "auto", "--global-batch", str(a.batch), "--steps", str(steps or a.steps),
            "--seed", "0", "--world-size", "1", "--optimizer", "adam", "--learning-rate", "1e-05",
            "--memory-headroom", a.headroom, "--max-batch", str(batch)]


def round_robin(labelled: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(shape size, position) pairs reordered as calibration timed them until session 10: the shapes in turn,
    smallest first, each on its own positions in turn; as many as given. Pure."""
    own: dict[int, list[int]] = {}
    for size, position in labelled:
        own.setdefault(size, []).append(position)
    sizes = sorted(own)
    ordered: list[tuple[int, int]] = []
    for k in range(len(labelled)):
        size = sizes[k % len(sizes)]  # the shapes in turn
        positions = own[size]
        ordered.append((size, positions[(k // len(sizes)) % len(positions)]))  # each on its own positions in turn
    return ordered


def bench_steps(a: argparse.Namespace, like_rank: set[str]) -> list[tuple[int, float]]:
    """Time `steps` steps of the bench's trainer on the run's rows in the run's order (in this process), or with
    `rr` in calibration's old order (`round_robin`); each step's (shape size, seconds)."""
    import mlx.core as mx

    from worker import bench

    if "kc" in like_rank:
        from worker import kernelcache

        kernelcache.isolate()
    if "dist" in like_rank:
        mx.distributed.init()
    trainer = bench._Trainer(bench._parse_args(bench_argv(a, a.batch)))
    if "eval" in like_rank:
        mx.eval(trainer.model.parameters(), trainer.optimizer.state)
    if "hist" in like_rank:
        smaller = 1
        while smaller < a.batch:
            for k in range(a.hist_steps):
                trainer.step(smaller, k * smaller)
            smaller *= 2
    labelled = [(bench.shape_size(trainer.slice_of(a.batch, k * a.batch)[0]), k * a.batch) for k in range(a.steps)]
    if "rr" in like_rank:
        labelled = round_robin(labelled)
    return [(size, trainer.step(a.batch, position)[0]) for size, position in labelled]


def rank_steps(a: argparse.Namespace, cpus: set[int] | None = None) -> tuple[list[float], list[float]]:
    """Run `worker.train` on a one-rank config of this probe's run; its step events' times, and its digest events'
    seconds (every 50 steps and the last: outside the steps' times)."""
    with tempfile.TemporaryDirectory(prefix="probe-rank-") as tmp:
        run_dir = Path(tmp) / "run"
        config = {"run_id": "probe", "model": a.model, "data": a.data, "method": a.method, "iters": a.steps,
                  "learning_rate": 1e-5, "optimizer": "adam", "max_seq_length": a.seq_len,
                  "memory_headroom": None if a.headroom == "none" else float(a.headroom), "num_layers": None,
                  "save_every": 0, "steps_per_eval": 0, "seed": 0, "run_dir": str(run_dir),
                  "ranks": [{"rank": 0, "node": "probe", "batch_size": a.batch}]}
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
        env["PYTHONPATH"] = str(REPO)
        proc = subprocess.run([sys.executable, "-m", "worker.train", "--config", str(path)], env=env,
                              capture_output=True, text=True, check=False, preexec_fn=pinned(cpus))
        if proc.returncode != 0:
            raise RuntimeError(f"worker.train exited {proc.returncode}: {proc.stderr[-2000:]}")
        events = [event for path in sorted(run_dir.glob("events/rank*.jsonl"))
                  for event in map(json.loads, path.read_text().splitlines())]
        return ([float(e["step_time_s"]) for e in events if e.get("event") == "step"],
                [float(e["digest_s"]) for e in events if e.get("event") == "digest" and "digest_s" in e])


def calib_point(a: argparse.Namespace, cpus: set[int] | None = None) -> dict[str, Any]:
    """worker.bench as calibration runs it; its point at --batch."""
    argv = [sys.executable, "-m", "worker.bench", *bench_argv(a, a.batch, a.calib_steps or a.steps),
            "--time-budget", str(a.calib_budget),
            "--one-time-budget", "600"]
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          check=False, preexec_fn=pinned(cpus))
    if proc.returncode != 0:
        raise RuntimeError(f"worker.bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return next(p for p in result["curve"] if p["batch"] == a.batch)


def report(kind: str, round_: int, span: tuple[float, float], times: list[float],
           sizes: list[int] | None = None, digests: list[float] | None = None) -> None:
    """One JSON line: the process's span, the median of the steps after the first, and with `sizes` each shape's
    (size: median of its steps after each shape's first, steps)."""
    rest = times[1:] or times
    line: dict[str, Any] = {"kind": kind, "round": round_, "t0": round(span[0], 2), "t1": round(span[1], 2),
                            "median_s": round(statistics.median(rest), 4)}
    if sizes is not None:
        by: dict[int, list[float]] = {}
        seen: set[int] = set()
        for size, t in zip(sizes, times, strict=True):
            if size in seen:
                by.setdefault(size, []).append(t)
            seen.add(size)
        line["shapes"] = {size: [round(statistics.median(ts), 4), len(ts)] for size, ts in sorted(by.items())}
    if digests is not None:
        line["digest_s"] = [round(t, 4) for t in digests]
    line["times"] = [round(t, 4) for t in times]
    print(json.dumps(line), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--method", default="full")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--headroom", default="0.1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hist-steps", type=int, default=10)
    p.add_argument("--calib-steps", type=int, help="the run length calib is told (default --steps): calibration "
                   "samples a run of at most 64 steps whole, a longer one by its stride")
    p.add_argument("--calib-budget", type=float, default=10.0, help="calib's --time-budget (the playbook's: 60)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", default="rank,bench,calib")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: one bench process of that kind
    a = p.parse_args()
    a.model, a.data = os.path.expanduser(a.model), os.path.expanduser(a.data)
    if a.one:
        print(json.dumps(bench_steps(a, variants(a.one))), flush=True)
        return 0
    kinds = a.kinds.split(",")
    places = {kind: placement(kind) for kind in kinds}
    for base, _ in places.values():
        if base not in ("rank", "calib"):
            variants(base)
    for round_ in range(1, a.rounds + 1):
        for kind in kinds:
            base, cpus = places[kind]
            t0 = time.time()
            if base == "rank":
                times, digests = rank_steps(a, cpus)
                report(kind, round_, (t0, time.time()), times, digests=digests)
            elif base == "calib":
                point = calib_point(a, cpus)
                print(json.dumps({"kind": kind, "round": round_, "t0": round(t0, 2), "t1": round(time.time(), 2),
                                  "shape_times": point["shape_times"], "step_time_s": point["step_time_s"],
                                  "steps": point["steps"]}), flush=True)
            else:
                # Each bench in its own process: nothing of the one before it (buffers, compiled graphs) is shared.
                proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", base],
                                      env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                                      check=False, preexec_fn=pinned(cpus))
                if proc.returncode != 0:
                    raise RuntimeError(f"{kind} exited {proc.returncode}: {proc.stderr[-2000:]}")
                stepped = json.loads(proc.stdout.strip().splitlines()[-1])
                report(kind, round_, (t0, time.time()), [t for _, t in stepped], [size for size, _ in stepped])
    return 0


if __name__ == "__main__":
    sys.exit(main())
