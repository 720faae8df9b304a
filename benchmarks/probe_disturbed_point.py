"""A calibration point disturbed for the whole time it is measured, and the bench's second look at it.

    .venv/bin/python benchmarks/probe_disturbed_point.py [--hogs 4] [--budget 30] [--core 1] [--quiet]

Runs `worker.bench` (LoRA, worker.tinymodel's random 2-layer llama, seq 128, batches 1..8) pinned to one core, and starts --hogs
busy processes on that core from batch 1's first step until its point is reported, so every timed step of batch 1
shares the core and the point's steps agree with each other (not NOISY). The second look (`worker.bench.look_again`)
runs with the core free. Prints the bench's point lines, its second-look line and the curve it returned
(batch, step seconds, timed steps). --quiet starts no hogs: the undisturbed curve to compare with. Linux only
(`taskset`); the hogs are killed whatever happens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.tinymodel import build_tiny_model  # noqa: E402 - after the path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hogs", type=int, default=4, help="busy processes on the bench's core during batch 1")
    p.add_argument("--budget", type=float, default=30.0, help="the bench's --time-budget (seconds of timed steps)")
    p.add_argument("--core", type=int, default=1, help="the core the bench and the hogs share")
    p.add_argument("--quiet", action="store_true", help="no hogs: the undisturbed curve")
    args = p.parse_args()
    pin = ["taskset", "-c", str(args.core)]
    hogs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="probe-disturbed-") as tmp:
        model = Path(tmp)
        build_tiny_model(model)  # a random 2-layer llama, hidden 64
        bench = subprocess.Popen(
            [*pin, sys.executable, "-m", "worker.bench", "--model", str(model), "--seq-len", "128", "--method",
             "lora", "--num-layers", "-1", "--max-batch", "8", "--time-budget", str(args.budget)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        disturbed_once = False
        try:
            assert bench.stderr is not None and bench.stdout is not None
            for line in bench.stderr:
                if "bench batch=1 first steps" in line and not args.quiet and not disturbed_once:
                    disturbed_once = True  # the second look's first steps say the same: it runs undisturbed
                    hogs = [subprocess.Popen([*pin, sys.executable, "-c", "while True: pass"])
                            for _ in range(args.hogs)]
                if "bench batch=1 tokens_per_s" in line:
                    for hog in hogs:
                        hog.kill()
                    hogs = []
                if line.startswith("bench batch=") and ("tokens_per_s" in line or "disturbed" in line):
                    print(line.strip(), flush=True)
            result = json.loads(bench.stdout.read())
        finally:
            for hog in hogs:
                hog.kill()
            bench.kill()
    print("curve (batch, step_s, steps):", [(c["batch"], c["step_time_s"], c["steps"]) for c in result["curve"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
