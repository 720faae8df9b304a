"""What a replica-consistency digest costs: the old host SHA256 of every byte vs the replica digest's sums.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_digest.py [--sizes tiny,S,M] [--methods lora,full]
        [--dtype bfloat16|float32] [--rounds 3] [--steps 0] [--json OUT]

For each model size (benchmarks/bench_train.py's llama shapes, random weights built in memory) and method, the
tree a `digest` event covers: every parameter (frozen ones too) and Adam's state after one update. Timed, each
`--rounds` times, median printed:
  sha256        `worker.chaos.arrays_sha256` over both trees: what every digest event hashed before (the bytes
                read on the host; still the checkpoint shards' weights digest);
  sums-host     `worker.chaos.replica_digest(on_device=False)`: the digest's sums by numpy on the host;
  sums-device   `replica_digest(on_device=True)`: the sums by MLX on the default device (a GPU's kernels; on a CPU
                MLX's CPU kernels, which is why the default there is the host).
`--steps N` also trains N steps (batch and length of the size, random tokens) with each digest kind after every
step but the first, and prints the median step time after a digest against the median of steps with none: on
CUDA, where MLX allocates managed memory, a digest read on the host moves the state there and the next step pays
to move it back. Numbers go in docs/benchmarks.md with the commit and the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_train as bt
from worker.chaos import arrays_sha256, replica_digest
from worker.modelsetup import apply_method
from worker.runconfig import LoraSpec
from worker.step import flatten

DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}


def build(size: bt.ModelSize, method: str, dtype: Any) -> tuple[Any, optim.Optimizer]:
    """The size's llama model (random weights in `dtype`), made trainable by `method`, and Adam with its state
    initialised (every trainable's moments, as at any digest of a run; neither way of digesting reads the values
    to decide how much work to do, so zeros cost what trained moments cost, and no CPU step of M is waited for)."""
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=size.hidden, num_hidden_layers=size.layers,
                     intermediate_size=size.intermediate, num_attention_heads=size.heads,
                     num_key_value_heads=size.kv_heads, rms_norm_eps=1e-5, vocab_size=size.vocab,
                     tie_word_embeddings=True)
    model = Model(args)
    model.set_dtype(dtype)
    apply_method(model, method, None, LoraSpec())
    optimizer = optim.Adam(learning_rate=1e-5)
    optimizer.init(model.trainable_parameters())
    mx.eval(model.parameters(), optimizer.state)
    return model, optimizer


def tokens(size: bt.ModelSize, seed: int) -> mx.array:
    return mx.random.randint(0, size.vocab, (size.batch, min(size.seq_len, 512)), key=mx.random.key(seed))


def step(model: Any, optimizer: optim.Optimizer, size: bt.ModelSize, batch: mx.array) -> float:
    """One training step (next-token loss, Adam); its seconds, evaluated."""
    def loss(m: Any, x: mx.array) -> mx.array:
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:]).mean()

    tic = time.perf_counter()
    value, grads = nn.value_and_grad(model, loss)(model, batch)
    optimizer.update(model, grads)
    mx.eval(value, model.parameters(), optimizer.state)
    return time.perf_counter() - tic


def kinds() -> dict[str, Callable[[dict[str, mx.array]], str]]:
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return {"sha256": arrays_sha256,
            "sums-host": lambda t: replica_digest(t, on_device=False),
            "sums-device": lambda t: replica_digest(t, on_device=True),
            **({"default": replica_digest} if on_gpu else {})}


def measure(size: bt.ModelSize, method: str, dtype: str, rounds: int, steps: int) -> dict[str, Any]:
    model, optimizer = build(size, method, DTYPES[dtype])
    trees = [flatten(model.parameters()), flatten(optimizer.state)]
    nbytes = sum(int(a.nbytes) for t in trees for a in t.values())
    out: dict[str, Any] = {"size": size.name, "method": method, "dtype": dtype, "bytes": nbytes,
                           "device": str(mx.default_device()), "kinds": {}}
    values = {}
    for name, digest in kinds().items():
        times = []
        for _ in range(rounds):
            tic = time.perf_counter()
            values[name] = [digest(t) for t in trees]
            times.append(time.perf_counter() - tic)
        out["kinds"][name] = {"seconds": [round(t, 4) for t in times], "median_s": round(statistics.median(times), 4),
                              "gb_per_s": round(nbytes / statistics.median(times) / 1e9, 3)}
    if values["sums-host"] != values["sums-device"]:
        raise RuntimeError(f"{size.name} {method}: the host's and the device's sums disagree")
    if steps:
        for name, digest in kinds().items():
            plain: list[float] = []
            after: list[float] = []
            for i in range(steps):
                t = step(model, optimizer, size, tokens(size, i + 1))
                (plain if i % 2 == 0 else after).append(t)
                if i % 2 == 0:
                    for tree in (flatten(model.parameters()), flatten(optimizer.state)):
                        digest(tree)
            out["kinds"][name]["step_s"] = round(statistics.median(plain), 4)
            out["kinds"][name]["step_after_digest_s"] = round(statistics.median(after), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,S")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="training steps per kind (alternating: digest, none)")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args(argv)
    unknown = [n for n in opts.sizes.split(",") if n not in bt.SIZES] + \
        [m for m in opts.methods.split(",") if m not in ("lora", "full")]
    if unknown or opts.rounds < 1 or opts.steps < 0:
        ap.error(f"--sizes from {', '.join(bt.SIZES)}, --methods from lora, full, --rounds >= 1, --steps >= 0"
                 + (f" (not: {', '.join(unknown)})" if unknown else ""))
    rows = []
    for name in opts.sizes.split(","):
        for method in opts.methods.split(","):
            row = measure(bt.SIZES[name], method, opts.dtype, opts.rounds, opts.steps)
            rows.append(row)
            cells = "  ".join(f"{k} {v['median_s']:.3f}s ({v['gb_per_s']:.2f} GB/s)"
                              + (f" step {v['step_s']:.4f}s after {v['step_after_digest_s']:.4f}s"
                                 if "step_s" in v else "")
                              for k, v in row["kinds"].items())
            print(f"{name} {method} {opts.dtype} {row['bytes'] / 1e9:.2f} GB on {row['device']}: {cells}", flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
