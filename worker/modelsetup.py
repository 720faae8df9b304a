"""The model a run trains: the method applied (LoRA/DoRA adapters on the last `num_layers` layers, or full:
the transformer blocks, and embeddings/head only when asked), the trainable count, the optimizer and the adapter
config mlx-lm reads back. Shared by the run (`worker.train`) and calibration (`worker.bench`)."""

from __future__ import annotations

from typing import Any

from worker.runconfig import LoraSpec, RunConfig
from worker.step import (
    flatten,
)


def apply_method(model: Any, method: str, num_layers: int | None, lora: LoraSpec, *,
                 train_embeddings: bool = False) -> int:
    """Make the model trainable according to `method`; return the number of layers adapted/trained.

    num_layers None = all layers (never mlx-lm's CLI default of 16). full = the last N transformer blocks, as
    `mlx_lm lora --fine-tune-type full` trains them (embeddings, lm_head and the final norm stay frozen);
    `train_embeddings` (full + all layers only) trains every parameter. lora/dora: mlx-lm's
    linear_to_lora_layers on the last N blocks (base weights frozen)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    total = len(model.layers)
    count = total if num_layers is None else num_layers
    if not 1 <= count <= total:
        raise ValueError(f"num_layers={num_layers} but the model has {total} layers")
    if train_embeddings and (method != "full" or count != total):
        raise ValueError("train_embeddings needs method full on all layers (num_layers null or -1)")
    model.freeze()
    if method == "full":
        if train_embeddings:
            model.unfreeze()
        else:
            for layer in model.layers[total - count:]:
                layer.unfreeze()
    elif method in ("lora", "dora"):
        linear_to_lora_layers(model, count, lora.mlx_lm_parameters(), use_dora=method == "dora")
    else:
        raise ValueError(f"unknown method {method!r}")
    return count


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; total as mlx-lm counts it (quantized weights at full size)."""
    from mlx_lm.utils import get_total_parameters

    trainable = sum(int(v.size) for v in flatten(model.trainable_parameters()).values())
    return int(trainable), int(get_total_parameters(model))  # type: ignore[no-untyped-call]


def trainable_text(trainable: int, total: int, detail: str = "") -> str:
    text = f"trainable {100.0 * trainable / max(total, 1):.2f}% ({trainable:,}/{total:,} parameters)"
    return f"{text}: {detail}" if detail else text


def trainable_detail(model: Any, method: str, num_layers: int, train_embeddings: bool) -> str:
    """What is trained, in words: how many of the model's transformer layers, and the rest. The trap it guards
    against is mlx-lm's CLI training 16 of 36 layers silently."""
    total = len(model.layers)
    layers = f"{num_layers} of {total} transformer layers"
    if method == "full":
        rest = "embeddings, lm_head and final norm too" if train_embeddings else \
            "embeddings, lm_head and final norm frozen, as mlx-lm's full (train.train_embeddings trains them)"
        return f"{layers}, {rest}"
    return f"{method} adapters on {layers}"


def make_optimizer(name: str, learning_rate: float) -> Any:
    import mlx.optimizers as optim

    classes = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD}
    return classes[name](learning_rate=learning_rate)


def ready_optimizer(model: Any, name: str, learning_rate: float) -> Any:
    """The optimizer over `model`'s trainable parameters, with its state and the model's parameters evaluated
    before the first step: how every step that is timed or trained starts (the run's strategies and calibration's
    benches), so that calibration times the step the run takes.

    Why the evaluation matters beyond the first step: a step compiled and first run while the optimizer state was
    still lazy ran slower for as long as the process lived. On an H100 (M = 954M, full, batch 8 x 512, bf16) the
    bench's trainer without it took 0.151-0.156 s a step, with it 0.133-0.135 s, the run's rank 0.136-0.137 s
    (two rounds each, one lease: benchmarks/probe_rank_vs_bench.py, docs/benchmarks-history.md); calibration
    predicted that run 16% slow."""
    import mlx.core as mx

    optimizer = make_optimizer(name, learning_rate)
    optimizer.init(model.trainable_parameters())
    mx.eval(model.parameters(), optimizer.state)
    return optimizer


def adapter_config(config: RunConfig, num_layers: int) -> dict[str, Any]:
    """mlx-lm's adapter_config.json, so a checkpoint dir works as `load(model, adapter_path=dir)`."""
    out: dict[str, Any] = {"fine_tune_type": config.fine_tune_type, "num_layers": num_layers, "model": config.model}
    if config.fine_tune_type != "full":
        out["lora_parameters"] = config.lora.mlx_lm_parameters()
    return out
