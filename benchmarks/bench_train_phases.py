"""Peak memory of each phase of a training run: ours (worker.train's Trainer, in-process) vs mlx-lm's trainer.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_train_phases.py [--size small|tiny|S] [--shape long|short]
        [--method lora|full] [--dtype bfloat16|float32] [--iters 4] [--packing auto|on|off]
        [--memory-limit-mb N] [--clear-cache default|never|every-step] [--memory-headroom H|none]
        [--tools ours,mlx_lm] [--keep DIR]

Both tools train the same random-weight llama model on the same generated data (benchmarks/bench_train.py's
builders and settings: adam lr 1e-5, all layers, one validation batch, evaluation and saving at the last step;
mlx-lm also evaluates before step 1), each in its own process so that each has its own allocator counters. Around
every phase, `mx.reset_peak_memory()` before and `mx.get_peak_memory()` after: ours' load (the packing exactness
probe inside it shown on its own), the replica check, every step, digests, evaluate and save; mlx-lm's load,
every step (its report callback resets the counter, so a step's figure includes building its batch), evaluate
and its safetensors writes. Printed per phase: active memory before, the PEAK, active memory after (MiB), seconds.

`--memory-limit-mb N` sets `mx.set_memory_limit` in both: once active memory passes N, MLX's eval waits for
in-flight work before it schedules more, so buffers that wait only for their task's completion to be freed
(MLX frees an op's inputs when the task that used them completes, not when the op was scheduled) are released
before new ones are allocated; a limit below the step's working set therefore shows how much of a peak was that
deferred freeing rather than what the step needs. `--clear-cache`: `default` leaves each tool as it is (mlx-lm's
trainer calls `mx.clear_cache()` after every step: `mlx_lm lora` leaves TrainingArgs' clear_cache_threshold at 0
whatever --clear-cache-threshold says; ours never does), `never` and `every-step`
make both do the same (how far the host runs ahead of the device, and so how much is in flight, depends on
whether its allocations come from the cache). `--memory-headroom`: ours' `train.memory_headroom` (worker.memory:
a step's run-ahead bounded to this share of its working set; `none`: unbounded, ours before issue 25); default:
the playbook's default. docs/benchmarks-history.md (issues 15 and 25, peak memory) has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks import bench_train as bt  # noqa: E402

MIB = 1024**2
SIZES = {
    # S's shape at a CPU-sized scale: vocab 8,000 (logits still dominate), batch 4, max_seq_length 128.
    "small": bt.ModelSize("small", 256, 4, 8, 2, 704, 8000, 4, 128),
    "tiny": bt.SIZES["tiny"],
    "S": bt.SIZES["S"],
}


class Phases:
    """(name, active before, peak, active after, seconds) per measured call, in MiB."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, float, float]] = []

    def measure(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        before = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        out = fn(*args, **kwargs)
        self.rows.append((name, before / MIB, mx.get_peak_memory() / MIB, mx.get_active_memory() / MIB,
                          time.perf_counter() - tic))
        return out

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        real = getattr(owner, attr)

        def measured(*args: Any, **kwargs: Any) -> Any:
            return self.measure(name, real, *args, **kwargs)

        setattr(owner, attr, measured)


def prepare(root: Path, size: bt.ModelSize, shape: str, dtype: str, iters: int) -> tuple[Path, Path]:
    words = bt.make_words(size.vocab - bt.BASE_VOCAB)
    model = root / f"model-{size.name}-{dtype}"
    if not (model / "config.json").exists():
        vocab = root / f"vocab-{size.name}"
        vocab.mkdir(parents=True, exist_ok=True)
        bt.write_jsonl(vocab / "train.jsonl", words)
        bt.build_model_here({"out": str(model), "vocab_dir": str(vocab), "dtype": dtype, "max_words": len(words),
                             "max_positions": max(2048, size.seq_len), **bt.asdict(size)})
    return model, bt.build_data(root, size, shape, iters, words)


def run_ours(phases: Phases, root: Path, size: bt.ModelSize, model: Path, data: Path, method: str, iters: int,
             packing: str, clear_cache: str, headroom: str | None = None) -> str:
    import mlx.core as mx

    import worker.step as step_mod
    import worker.train as train_mod
    from worker.events import EventLog, Heartbeat, events_path
    from worker.runconfig import parse_run_config

    run_dir = root / f"run-{time.time_ns()}"
    config = parse_run_config({
        "run_id": "phases", "model": str(model), "data": str(data), "run_dir": str(run_dir), "iters": iters,
        "method": method, "optimizer": "adam", "learning_rate": 1e-5, "max_seq_length": size.seq_len,
        "save_every": iters, "steps_per_eval": iters, "val_batches": 1, "num_layers": -1, "seed": 0,
        "consistency_every": iters, "packing": packing,
        **({} if headroom is None else {"memory_headroom": None if headroom == "none" else float(headroom)}),
        "ranks": [{"rank": 0, "node": "local", "batch_size": size.batch}]})
    trainer_cls = train_mod.Trainer
    phases.wrap(trainer_cls, "load", "load (probe included)")
    phases.wrap(step_mod, "packing_is_exact", "  of which packing probe")
    phases.wrap(trainer_cls, "check_replicas", "check_replicas")
    real_step = trainer_cls.train_step

    def train_step(self: Any, step: int) -> Any:
        return phases.measure(f"step {step}", real_step, self, step)

    trainer_cls.train_step = train_step  # type: ignore[method-assign]
    if clear_cache == "every-step":
        real_run = step_mod.TrainStep.run

        def run_and_clear(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = real_run(self, *args, **kwargs)
            mx.clear_cache()  # where mlx-lm's trainer does it: after the step's eval, inside its timed span
            return out

        step_mod.TrainStep.run = run_and_clear  # type: ignore[method-assign]
    for attr in ("digests", "evaluate", "save"):
        phases.wrap(trainer_cls, attr, attr)
    log = EventLog(events_path(run_dir, 0), config.run_id, 0)
    trainer = trainer_cls(config, log, Heartbeat(log, 1.0), 0)
    try:
        trainer.run()
    finally:
        log.close()
    return trainer.packing[1]


def run_mlx_lm(phases: Phases, root: Path, size: bt.ModelSize, model: Path, data: Path, method: str,
               iters: int, clear_cache: str) -> str:
    import mlx.core as mx
    import mlx_lm_driver
    import numpy as np
    from mlx_lm import lora
    from mlx_lm.tuner import trainer
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import load

    argv = bt.mlx_lm_argv(model, data, size, method, iters, root / f"adapters-{time.time_ns()}")
    args = mlx_lm_driver.parse_mlx_lm_args(argv)
    if clear_cache == "never":
        # `mlx_lm lora` does not pass --clear-cache-threshold on to TrainingArgs (0.32.2): its trainer clears
        # the cache after every step whatever the flag says, so the helper it calls is replaced instead.
        trainer._clear_cache = lambda threshold: None
    np.random.seed(args.seed)
    loaded = phases.measure("load", load, args.model)
    train_set, valid_set, _ = load_dataset(args, loaded[1])
    phases.wrap(trainer, "evaluate", "evaluate")
    phases.wrap(mx, "save_safetensors", "save_safetensors")
    last = {"active": mx.get_active_memory()}

    class Callback:
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            it = int(info["iteration"])
            phases.rows.append((f"step {it}", last["active"] / MIB, mx.get_peak_memory() / MIB,
                                mx.get_active_memory() / MIB, 0.0))
            last["active"] = mx.get_active_memory()
            mx.reset_peak_memory()

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            return None

    mx.reset_peak_memory()
    lora.train_model(args, loaded[0], train_set, valid_set, Callback())
    return "mlx-lm's step 1 includes its evaluation before step 1"


def one(opts: argparse.Namespace) -> int:
    """Measure one tool in this process; print its rows as JSON on the last line of stdout."""
    import mlx.core as mx

    size = SIZES[opts.size]
    root = Path(opts.keep)
    model, data = prepare(root, size, opts.shape, opts.dtype, opts.iters)
    if opts.memory_limit_mb:
        mx.set_memory_limit(int(opts.memory_limit_mb * MIB))
    phases = Phases()
    mx.reset_peak_memory()
    if opts.one == "ours":
        note = run_ours(phases, root, size, model, data, opts.method, opts.iters, opts.packing, opts.clear_cache,
                        opts.memory_headroom)
    else:
        note = run_mlx_lm(phases, root, size, model, data, opts.method, opts.iters, opts.clear_cache)
    print(json.dumps({"note": note, "rows": phases.rows}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_train_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--shape", choices=bt.SHAPES, default="long")
    p.add_argument("--method", choices=bt.METHODS, default="lora")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--packing", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--memory-limit-mb", type=float, default=None)
    p.add_argument("--clear-cache", choices=("default", "never", "every-step"), default="default")
    p.add_argument("--memory-headroom", default=None, help="ours' train.memory_headroom (a number, or none)")
    p.add_argument("--tools", default="ours,mlx_lm", help="which tools to run, in this order")
    p.add_argument("--keep", type=str, default=None, help="work dir to keep (models are reused)")
    p.add_argument("--one", choices=("ours", "mlx_lm"), default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.iters < 1:
        p.error("--iters must be >= 1")
    if opts.one:
        return one(opts)
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        root = Path(opts.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        passed = ["--size", opts.size, "--shape", opts.shape, "--method", opts.method, "--dtype", opts.dtype,
                  "--iters", str(opts.iters), "--packing", opts.packing, "--clear-cache", opts.clear_cache]
        passed += ["--memory-limit-mb", str(opts.memory_limit_mb)] if opts.memory_limit_mb else []
        passed += ["--memory-headroom", opts.memory_headroom] if opts.memory_headroom is not None else []
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(root / "cache")}
        for tool in [t for t in opts.tools.split(",") if t]:
            cmd = [sys.executable, __file__, *passed, "--keep", str(root), "--one", tool]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{tool} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{tool} ({opts.size} {opts.shape} {opts.method} {opts.dtype}, memory limit "
                  f"{opts.memory_limit_mb or 'none'}, clear cache {opts.clear_cache}"
                  f"{'' if tool != 'ours' else ', memory headroom ' + str(opts.memory_headroom or 'default')}; "
                  f"{out['note']})")
            print(f"  {'phase':28s} {'active MiB':>10s} {'PEAK MiB':>9s} {'after MiB':>9s} {'s':>6s}")
            for name, before, peak, after, secs in out["rows"]:
                print(f"  {name:28s} {before:10.1f} {peak:9.1f} {after:9.1f} {secs:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
