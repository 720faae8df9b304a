"""Memory and disk estimates for a training job. Pure arithmetic with its assumptions spelled out.

Full fine-tune in bf16 with Adam: 2 B weights + 2 B grads + 8 B Adam moments (fp32 m and v) per parameter,
plus activations. LoRA/DoRA: frozen bf16 weights plus small adapters and their optimizer state.
Activations follow the usual transformer rule of thumb (Korthikanti et al. 2022): about 34 * seq * batch *
hidden bytes per layer in 16-bit, without the attention-score term (MLX uses fused SDPA); with gradient
checkpointing only each layer's input (2 * seq * batch * hidden bytes) is kept plus one layer's working set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GiB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int


def _int(cfg: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        return _int(text, *keys)
    return None


def num_layers(cfg: Mapping[str, Any]) -> int | None:
    return _int(cfg, "num_hidden_layers", "n_layer", "num_layers")


def estimate_params(cfg: Mapping[str, Any]) -> int | None:
    """Parameter count of a llama-style decoder from its config.json (used when no weights can be read)."""
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    layers = num_layers(cfg)
    vocab = _int(cfg, "vocab_size")
    if hidden is None or layers is None or vocab is None:
        return None
    inter = _int(cfg, "intermediate_size", "ffn_dim") or 4 * hidden
    heads = _int(cfg, "num_attention_heads", "n_head") or 1
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or hidden // heads
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + layers * (attn + mlp + 2 * hidden) + hidden


def model_shape(cfg: Mapping[str, Any] | None, params: int | None) -> ModelShape | None:
    if cfg is None:
        return None
    p = params or estimate_params(cfg)
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    layers = num_layers(cfg)
    vocab = _int(cfg, "vocab_size")
    if p is None or hidden is None or layers is None or vocab is None:
        return None
    return ModelShape(p, hidden, layers, vocab)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int
    reference: int = 0  # a frozen reference model (DPO)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.reference


def trainable_fraction(method: str, layers_trained: int, total_layers: int) -> float:
    if method == "full":
        return layers_trained / total_layers
    # LoRA rank 8 on q/k/v/o/gate/up/down of the trained layers: well under 1% of those layers' weights.
    return 0.01 * layers_trained / total_layers


def estimate_training_memory(
    shape: ModelShape,
    *,
    method: str,
    batch_per_rank: int,
    seq_len: int,
    layers_trained: int | None = None,
    grad_checkpoint: bool = False,
    with_reference: bool = False,
) -> MemoryEstimate:
    trained = shape.layers if layers_trained is None or layers_trained < 0 else min(layers_trained, shape.layers)
    frac = trainable_fraction(method, trained, shape.layers)
    trainable = int(shape.params * frac)
    tokens = batch_per_rank * seq_len
    if grad_checkpoint:
        acts = 2 * tokens * shape.hidden * trained + 34 * tokens * shape.hidden
    else:
        acts = 34 * tokens * shape.hidden * trained
    acts += 2 * 4 * tokens * shape.vocab  # fp32 logits and their gradient
    return MemoryEstimate(
        weights=2 * shape.params,
        grads=2 * trainable,
        optimizer=8 * trainable,
        activations=acts,
        # DPO's frozen reference model is a second bf16 copy of the weights (LoRA included: the worker loads it).
        reference=2 * shape.params if with_reference else 0,
    )


def usable_memory(total_bytes: int, *, is_macos: bool) -> int:
    """What a training process can really use. On macOS the GPU may wire only part of unified memory by
    default (about 2/3 up to 36 GB, 3/4 above, unless `iogpu.wired_limit_mb` raises it)."""
    if is_macos:
        return int(total_bytes * (0.67 if total_bytes <= 36 * GiB else 0.75))
    return int(total_bytes * 0.9)


def checkpoint_bytes(shape: ModelShape, *, method: str, layers_trained: int | None = None) -> int:
    """One checkpoint: trainable weights in bf16 plus fp32 Adam state (what `--resume` needs)."""
    trained = shape.layers if layers_trained is None or layers_trained < 0 else min(layers_trained, shape.layers)
    trainable = int(shape.params * trainable_fraction(method, trained, shape.layers))
    return math.ceil(2 * trainable + 8 * trainable)
