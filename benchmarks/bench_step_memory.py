"""A step's peak memory and time with and without `train.memory_headroom`'s bound, steps interleaved in ONE process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_memory.py [--size small] [--method lora|full]
        [--pairs 8] [--headroom 0.1] [--keep DIR]

The model, data and settings of benchmarks/bench_train_phases.py (`small`: S's shape at CPU scale, bfloat16,
long rows, adam lr 1e-5, all layers). One worker.step.TrainStep with worker.memory.StepMemory: the first step
measures the working set W (nothing in flight) and sets MLX's memory limit to W x (1 + headroom); then steps
alternate in A B B A order between that limit (bounded) and MLX's own default (unbounded), so that a machine whose
load drifts over minutes (this one's does, by 2x) slows both alike. Printed: W, the limit, and for each mode the
median and fastest step time and the median and largest per-step peak (`mx.reset_peak_memory` before each step).
docs/benchmarks-history.md (issue 25) has the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_train_phases as phases  # noqa: E402

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_step_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(phases.SIZES), default="small")
    p.add_argument("--method", choices=("lora", "full"), default="lora")
    p.add_argument("--pairs", type=int, default=8, help="steps of each mode")
    p.add_argument("--headroom", type=float, default=0.1)
    p.add_argument("--keep", default=None, help="work dir to keep (the model is reused)")
    opts = p.parse_args(argv)
    if opts.pairs < 1 or opts.headroom < 0:
        p.error("--pairs >= 1 and --headroom >= 0 are required")
    with tempfile.TemporaryDirectory(prefix="bench-step-memory-") as tmp:
        root = Path(opts.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        return measure(root, opts)


def measure(root: Path, opts: argparse.Namespace) -> int:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.utils import load

    from worker.data import build_batch
    from worker.memory import StepMemory
    from worker.modelsetup import apply_method
    from worker.objectives import Micro
    from worker.runconfig import LoraSpec
    from worker.step import TrainStep, sft_weight, token_loss_sum

    size = phases.SIZES[opts.size]
    model_dir, data_dir = phases.prepare(root, size, "long", "bfloat16", 2 * opts.pairs + 1)
    loaded = load(str(model_dir))
    model, tok = loaded[0], loaded[1]
    apply_method(model, opts.method, None, LoraSpec(rank=8))
    opt = optim.Adam(learning_rate=1e-5)
    opt.init(model.trainable_parameters())
    mx.eval(model.parameters(), opt.state)
    texts = [json.loads(line)["text"] for line in (data_dir / "train.jsonl").read_text().splitlines()]
    rows = [([*tok.encode(t), tok.eos_token_id], 0) for t in texts]

    def micro(k: int) -> Micro:
        start = (size.batch * k) % (len(rows) - size.batch)
        chunk = rows[start:start + size.batch]
        weight, tokens = sft_weight(chunk, size.seq_len)
        return Micro(build_batch(chunk, size.seq_len), weight, weight, tokens, tokens, size.batch)

    memory = StepMemory(opts.headroom)
    step = TrainStep(model, opt, token_loss_sum, all_sum=lambda x: x, world_size=1, memory=memory)
    default = mx.get_memory_limit()
    step.run(lambda: [micro(0)])  # the measuring step (compiles too)
    print(f"{opts.size} {opts.method}: working set {memory.working_set / MIB:.1f} MiB, limit "
          f"{memory.limit / MIB:.1f} MiB (headroom {opts.headroom})", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"bounded": [], "unbounded": []}
    for k in range(1, 2 * opts.pairs + 1):
        mode = "bounded" if (k // 2) % 2 == 0 else "unbounded"  # A B B A ...
        mx.set_memory_limit(memory.limit if mode == "bounded" else default)
        mx.reset_peak_memory()
        tic = time.perf_counter()
        step.run(lambda k=k: [micro(k)])
        results[mode].append((time.perf_counter() - tic, mx.get_peak_memory() / MIB))
    memory.release()
    summary: dict[str, Any] = {}
    for mode, values in results.items():
        times, peaks = [t for t, _ in values], [m for _, m in values]
        summary[mode] = statistics.median(times)
        print(f"{opts.size} {opts.method} {mode}: median step {statistics.median(times):.3f} s (fastest "
              f"{min(times):.3f}), peak median {statistics.median(peaks):.1f} MiB, largest {max(peaks):.1f}; "
              f"{len(values)} steps")
    ratio = summary["bounded"] / summary["unbounded"]
    print(f"{opts.size} {opts.method} bounded / unbounded median step time {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
