"""Does a calibration point's step time depend on the points before it in the same process? (issue 25)

Loads the bench's trainer (`worker.bench._Trainer`, the run's own step) on a model and data set and times, per
step, `--batch` rows fresh, then after `--after` rows' steps, then `--batch` again: if the fresh steps are faster
than the ones after the smaller batch, the sweep's history slows its points. Prints one JSON line per phase.

    PYTHONPATH=. python3 benchmarks/probe_bench_history.py --model DIR --data DIR [--method full] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--method", default="full")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--after", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--headroom", default="0.1")
    a = p.parse_args()
    from worker import bench

    args = bench._parse_args(["--model", a.model, "--seq-len", "512", "--method", a.method, "--num-layers", "-1",
                              "--data", a.data, "--global-batch", str(a.batch), "--max-batch", str(a.batch),
                              "--memory-headroom", a.headroom])
    trainer = bench._Trainer(args)
    position = 0

    def phase(name: str, batch: int, steps: int) -> None:
        nonlocal position
        times = []
        for _ in range(steps):
            elapsed, _tokens = trainer.step(batch, position)
            position += batch
            times.append(round(elapsed, 4))
        print(json.dumps({"phase": name, "batch": batch, "median_s": statistics.median(times[1:] or times),
                          "times": times}), flush=True)

    phase("fresh", a.batch, a.steps)
    phase("smaller", a.after, a.steps)
    phase("again", a.batch, a.steps)
    phase("again-more", a.batch, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
