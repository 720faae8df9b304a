"""Does a rank process take the same step slower or faster than calibration's bench process? (issue 25)

On one H100 calibration's bench took M full's batch-8 step in 0.150 s and the run's rank, minutes later on the same
machine, in 0.117-0.133 s (docs/benchmarks-history.md, session 6). This times both kinds of process on the same
steps, one after the other, `--rounds` times:

- `rank`: `python -m worker.train --config C` started directly (no coordinator, no mlx.launch), C being a kept
  run's own config (`--run-json`) with a fresh run dir, `--steps` iterations and no evaluation; its step times are
  its step events' `step_time_s`.
- `bench`: the bench's trainer (`worker.bench._Trainer`, the run's own `TrainStep`) on the same rows in the run's
  order (stream position 0, batch, 2 x batch, ...), as calibration builds it.
- `bench+`: the same with what the rank does and the bench does not before its first step: the model's parameters
  and the optimizer state evaluated (`+eval`), `mx.distributed.init()` called (`+dist`), MLX's kernel cache
  isolated (`worker.kernelcache.isolate`, `+kc`); `bench+eval`, `bench+dist+kc`, ...: some of them.

Prints one JSON line per process: its kind, round, the median of its steps after the first, and every step time.

    PYTHONPATH=. python3 benchmarks/probe_rank_vs_bench.py --run-json KEEP/node/runs/RUN/bench/run.json [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


RANK_LIKE = ("eval", "dist", "kc")


def variants(kind: str) -> set[str]:
    """`bench+eval+kc` -> {"eval", "kc"}; `bench+` -> all of RANK_LIKE; `bench` -> none."""
    if kind == "bench+":
        return set(RANK_LIKE)
    parts = kind.split("+")
    if parts[0] != "bench" or not set(parts[1:]) <= set(RANK_LIKE):
        raise SystemExit(f"unknown kind {kind!r}: rank, bench, bench+ or bench+" + "+".join(RANK_LIKE))
    return set(parts[1:])


def bench_steps(config: dict[str, Any], steps: int, like_rank: set[str]) -> list[float]:
    """Time `steps` steps of the bench's trainer on the run's rows in the run's order (in this process)."""
    import mlx.core as mx

    from worker import bench

    if "kc" in like_rank:
        from worker import kernelcache

        kernelcache.isolate()
    if "dist" in like_rank:
        mx.distributed.init()
    batch = config["ranks"][0]["batch_size"]
    headroom = config.get("memory_headroom")
    args = bench._parse_args([
        "--model", config["model"], "--seq-len", str(config["max_seq_length"]), "--method", config["method"],
        "--num-layers", str(config["num_layers"] if config.get("num_layers") is not None else -1),
        "--data", config["data"], "--global-batch", str(batch), "--max-batch", str(batch),
        "--memory-headroom", "none" if headroom is None else str(headroom)])
    trainer = bench._Trainer(args)
    if "eval" in like_rank:
        mx.eval(trainer.model.parameters(), trainer.optimizer.state)
    return [trainer.step(batch, k * batch)[0] for k in range(steps)]


def rank_steps(config: dict[str, Any], steps: int) -> list[float]:
    """Run `worker.train` on a copy of the kept run's config; its step events' times."""
    with tempfile.TemporaryDirectory(prefix="probe-rank-") as tmp:
        run_dir = Path(tmp) / "run"
        own = {**config, "run_dir": str(run_dir), "iters": steps, "save_every": 0, "steps_per_eval": 0,
               "resume": False, "chaos": [], "cpu_shares": {},
               "ranks": [{**config["ranks"][0], "rank": 0}]}  # one process: rank 0
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(own))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("MLX_RANK", None)
        env.pop("MLX_HOSTFILE", None)
        proc = subprocess.run([sys.executable, "-m", "worker.train", "--config", str(path)], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"worker.train exited {proc.returncode}: {proc.stderr[-2000:]}")
        times = []
        for events in sorted(run_dir.glob("events/rank*.jsonl")):
            for line in events.read_text().splitlines():
                event = json.loads(line)
                if event.get("event") == "step":
                    times.append(float(event["step_time_s"]))
        return times


def report(kind: str, round_: int, times: list[float]) -> None:
    rest = times[1:] or times
    print(json.dumps({"kind": kind, "round": round_, "median_s": round(statistics.median(rest), 4),
                      "times": [round(t, 4) for t in times]}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-json", type=Path, required=True, help="a kept run's rank config (RUN/<node>/run.json)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", default="rank,bench,bench+")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: one bench process of that kind
    a = p.parse_args()
    config = json.loads(a.run_json.read_text())
    config["model"], config["data"] = os.path.expanduser(config["model"]), os.path.expanduser(config["data"])
    if a.one:
        times = bench_steps(config, a.steps, variants(a.one))
        print(json.dumps(times), flush=True)
        return 0
    kinds = a.kinds.split(",")
    for kind in kinds:
        if kind != "rank":
            variants(kind)
    for round_ in range(1, a.rounds + 1):
        for kind in kinds:
            if kind == "rank":
                report(kind, round_, rank_steps(config, a.steps))
                continue
            # Each bench in its own process: nothing of the one before it (buffers, compiled graphs) is shared.
            proc = subprocess.run([sys.executable, __file__, "--run-json", str(a.run_json), "--steps", str(a.steps),
                                   "--one", kind], env={**os.environ, "PYTHONPATH": str(REPO)},
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{kind} exited {proc.returncode}: {proc.stderr[-2000:]}")
            report(kind, round_, json.loads(proc.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
