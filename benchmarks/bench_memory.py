"""Measured training-step memory peaks against `coordinator.planning.estimate.estimate_training_memory`.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py [--quick] [--json]

Builds small random llama models (mlx_lm.models.llama, bf16 weights, as real checkpoints ship), makes them
trainable as worker.train does (full: every parameter when all layers train; lora: mlx-lm's
`linear_to_lora_layers` on the last N blocks, rank 8), and runs real optimizer steps (cross-entropy over every
position, `nn.value_and_grad`, Adam, evaluated) at several batch sizes and sequence lengths, eager and compiled
(`mx.compile` with model and optimizer state as implicit inputs/outputs, as mlx-lm's trainer and worker.bench do).
For each: `mx.get_peak_memory()` over model creation and two steps (Adam's state exists from the first update
on), next to the estimate for the same shape. The estimate must lie within 25% of the measured eager peak
(`ok`). CPU backend; seconds per configuration. docs/calibration.md has the table this prints.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from coordinator.planning.estimate import estimate_training_memory, model_shape

TOLERANCE = 0.25
STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str
    method: str
    batch: int
    seq_len: int
    grad_checkpoint: bool = False


MODELS: dict[str, dict[str, Any]] = {
    # Narrow models keep a CPU step to about a second; memory terms scale with tokens x width, so the terms'
    # proportions are those of real models when the widths keep theirs (vocab/hidden, intermediate/hidden).
    # A wide vocabulary on a narrow model: the logits dominate (as in 1-3B models with 128k-150k vocabularies).
    "v4096-h64-l2": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4096},
    # More and wider layers with a small vocabulary: the per-layer activations dominate.
    "v256-h128-l4": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
}


def config(name: str) -> dict[str, Any]:
    return {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            **MODELS[name]}


def cases(quick: bool) -> list[Case]:
    out = []
    for model in MODELS:
        for method in ("lora", "full"):
            for seq_len in (128, 512):
                for batch in ((1, 8) if quick else (1, 4, 8)):
                    out.append(Case(model, method, batch, seq_len))
        out.append(Case(model, "full", 8, 512, grad_checkpoint=True))
        out.append(Case(model, "lora", 8, 512, grad_checkpoint=True))
    return out


def build(case: Case) -> tuple[nn.Module, Any]:
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = llama.Model(llama.ModelArgs.from_dict(config(case.model)))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    model.freeze()
    if case.method == "full":
        model.unfreeze()  # all layers train: every parameter, as worker.modelsetup.apply_method
    else:
        linear_to_lora_layers(model, len(model.layers), {"rank": 8, "dropout": 0.0, "scale": 20.0})
    if case.grad_checkpoint:
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(model.layers[0])  # type: ignore[no-untyped-call]
    model.train()
    return model, optim.Adam(learning_rate=1e-5)


def measure(case: Case, compiled: bool) -> tuple[int, int]:
    """(peak bytes, parameter count) of STEPS optimizer steps from a fresh model."""
    gc.collect()  # the previous case's model and closures (reference cycles) must not count in this peak
    mx.clear_cache()
    mx.reset_peak_memory()
    model, optimizer = build(case)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))

    def loss_fn(m: Any, tokens: mx.array) -> mx.array:
        logits = m(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).astype(mx.float32).sum()

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(tokens: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, tokens)
        optimizer.update(model, grads)
        return loss

    state = [model.state, optimizer.state]
    run = mx.compile(step, inputs=state, outputs=state) if compiled else step
    vocab = int(MODELS[case.model]["vocab_size"])
    for _ in range(STEPS):
        tokens = mx.random.randint(0, vocab, (case.batch, case.seq_len + 1))
        loss = run(tokens)
        mx.eval(state, loss)
    peak = int(mx.get_peak_memory())
    return peak, int(params)


def estimate(case: Case, params: int) -> int:
    shape = model_shape(config(case.model), params)
    assert shape is not None
    # The CPU backend has no fused attention backward: the scores are materialised (fused_attention=False).
    return estimate_training_memory(shape, method=case.method, batch_per_rank=case.batch, seq_len=case.seq_len,
                                    grad_checkpoint=case.grad_checkpoint, fused_attention=False).total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 only")
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    parser.add_argument("--replay", metavar="JSONL",
                        help="no measuring: recompute the estimate column for the peaks a --json run recorded")
    parser.add_argument("--compiled", action="store_true",
                        help="also measure the compiled step (mlx-lm's trainer, worker.bench): about twice the time")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    rows = []
    if not args.json:
        print("| model | method | batch | seq | ckpt | measured eager MiB | measured compiled MiB | estimate MiB "
              "| estimate / eager |")
        print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    started = time.perf_counter()
    recorded: list[dict[str, Any]] = []
    if args.replay:
        with open(args.replay, encoding="utf-8") as fh:
            recorded = [json.loads(line) for line in fh if line.strip()]
    todo = [Case(r["model"], r["method"], r["batch"], r["seq_len"], r["grad_checkpoint"]) for r in recorded] \
        if recorded else cases(args.quick)
    for i, case in enumerate(todo):
        if recorded:
            eager, params, compiled = recorded[i]["eager"], recorded[i]["params"], recorded[i].get("compiled")
        else:
            eager, params = measure(case, compiled=False)
            compiled = measure(case, compiled=True)[0] if args.compiled else None
        est = estimate(case, params)
        ratio = est / eager
        worst = max(worst, abs(ratio - 1))
        row = {**case.__dict__, "params": params, "eager": eager, "compiled": compiled, "estimate": est,
               "ratio": round(ratio, 3), "ok": abs(ratio - 1) <= TOLERANCE}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"| {case.model} | {case.method} | {case.batch} | {case.seq_len} | "
                  f"{'yes' if case.grad_checkpoint else 'no'} | {eager / 2**20:.1f} | "
                  f"{'-' if compiled is None else f'{compiled / 2**20:.1f}'} | "
                  f"{est / 2**20:.1f} | {ratio:.2f} |", flush=True)
    print(f"# mlx {mx.__version__}, {len(rows)} cases in {time.perf_counter() - started:.0f} s; worst estimate "
          f"error {100 * worst:.0f}% (tolerance {100 * TOLERANCE:.0f}%)", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
