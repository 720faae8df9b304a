"""Memory and disk estimates for a training job. Pure arithmetic with its assumptions spelled out.

Measured, not rule-of-thumb: `benchmarks/bench_memory.py` runs real optimizer steps of random llama models
(bf16 weights, mlx-lm's LoRA, Adam) and compares `mx.get_peak_memory()` with this estimate (table and command in
docs/calibration.md). What the measurements show, per term:

- weights: 2 B/param (bf16); LoRA adapters (rank r on every linear of the trained blocks, as mlx-lm's
  `linear_to_lora_layers`) are float32: 4 B/adapter param.
- grads and Adam: in the trainable parameters' own dtype. Full (bf16): 2 B grads + 4 B Adam m and v. LoRA
  (fp32 adapters): 4 B grads + 8 B Adam.
- activations kept for the backward pass, per token and trained layer: about ACT_BYTES * (10 hidden + 5
  intermediate) bytes (the residual stream, norms, q/k/v, attention output, and the MLP's gate, up and product).
- attention scores: where MLX has no fused attention backward (the CPU backend) the scores and probabilities are
  materialised: SCORE_BYTES per batch * heads * seq^2 per layer. Metal and CUDA use the fused SDPA VJP.
- logits: batch * seq * vocab elements, LOGIT_BYTES each (the logits, the cross-entropy's float32 work and their
  gradient; for 128k-150k vocabularies the largest term).
- gradient checkpointing keeps only each trained layer's input (ACT_BYTES * hidden per token) plus one layer's
  working set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GiB = 1024**3


# Bytes per element, fitted (relative least squares) on the measured peaks of docs/calibration.md: LoRA's fp32
# adapter outputs promote what they touch to float32, so its layers keep twice a full fine-tune's bytes.
ACT_BYTES = {"lora": 2.0, "full": 1.0}
SCORE_BYTES = {"lora": 1.0, "full": 2.0}
LOGIT_BYTES = {"lora": 10.0, "full": 10.0}
LORA_RANK = 8


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int
    intermediate: int = 0  # MLP width; 0 = 4 * hidden
    heads: int = 0  # attention heads; 0 = hidden / 128
    kv_heads: int = 0  # key/value heads; 0 = heads
    head_dim: int = 0  # 0 = hidden / heads
    # Bytes per weight as the checkpoint stores them (config `torch_dtype`): the worker trains in that dtype, and
    # MLX's Adam keeps its two moments in the parameter's dtype. 2 (bf16 / fp16) unless the config says float32.
    dtype_bytes: int = 2

    @property
    def mlp(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    def lora_params_per_layer(self, rank: int = LORA_RANK) -> int:
        """Adapter parameters of one block: rank * (in + out) for q, k, v, o, gate, up and down."""
        h, heads = self.hidden, self.n_heads
        d = self.head_dim or h // heads
        q, kv = heads * d, (self.kv_heads or heads) * d
        return rank * ((h + q) * 2 + (h + kv) * 2 + (h + self.mlp) * 3)


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
    return ModelShape(p, hidden, layers, vocab, intermediate=_int(cfg, "intermediate_size", "ffn_dim") or 0,
                      heads=_int(cfg, "num_attention_heads", "n_head") or 0,
                      kv_heads=_int(cfg, "num_key_value_heads") or 0, head_dim=_int(cfg, "head_dim") or 0,
                      dtype_bytes=4 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") == "float32" else 2)


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
    """Share of the parameters that train in a full fine-tune of `layers_trained` blocks (LoRA: see
    `ModelShape.lora_params_per_layer`)."""
    if method == "full":
        return layers_trained / total_layers
    return 0.01 * layers_trained / total_layers


def layer_activation_bytes(shape: ModelShape, kind: str, rows: int, seq_len: int, *,
                           fused_attention: bool = True) -> float:
    """What one trained block keeps for its backward over `rows` rows of `seq_len` tokens (module docstring);
    `kind` "full" or "lora"."""
    per_layer = ACT_BYTES[kind] * rows * seq_len * (10 * shape.hidden + 5 * shape.mlp)
    if not fused_attention:
        per_layer += SCORE_BYTES[kind] * rows * shape.n_heads * seq_len * seq_len
    return per_layer


def layers_activation_bytes(shape: ModelShape, kind: str, rows: int, seq_len: int, trained: int, *,
                            grad_checkpoint: bool = False, fused_attention: bool = True) -> float:
    """The activations `trained` blocks keep over `rows` rows: every block's working set, or with gradient
    checkpointing each block's input plus one block's working set."""
    if trained <= 0:
        return 0.0
    per_layer = layer_activation_bytes(shape, kind, rows, seq_len, fused_attention=fused_attention)
    if grad_checkpoint:
        return ACT_BYTES[kind] * rows * seq_len * shape.hidden * trained + per_layer
    return per_layer * trained


def logit_bytes(shape: ModelShape, kind: str, rows: int, seq_len: int) -> float:
    """The logits, the loss's float32 work and their gradient over `rows` rows (the head's peak)."""
    return LOGIT_BYTES[kind] * rows * seq_len * shape.vocab


def estimate_training_memory(
    shape: ModelShape,
    *,
    method: str,
    batch_per_rank: int,
    seq_len: int,
    layers_trained: int | None = None,
    grad_checkpoint: bool = False,
    with_reference: bool = False,
    fused_attention: bool = True,
    lora_rank: int = LORA_RANK,
) -> MemoryEstimate:
    """The peak of one training step on one rank (module docstring). `fused_attention`: False on the CPU backend
    (no fused attention backward: the scores are materialised)."""
    kind = "full" if method == "full" else "lora"
    trained = shape.layers if layers_trained is None or layers_trained < 0 else min(layers_trained, shape.layers)
    if kind == "full":
        trainable = shape.params if trained == shape.layers else int(shape.params * trained / shape.layers)
        b = shape.dtype_bytes
        weights, grads, optimizer = b * shape.params, b * trainable, 2 * b * trainable
    else:
        adapters = shape.lora_params_per_layer(lora_rank) * trained
        weights, grads, optimizer = shape.dtype_bytes * shape.params + 4 * adapters, 4 * adapters, 8 * adapters
    acts = layers_activation_bytes(shape, kind, batch_per_rank, seq_len, trained, grad_checkpoint=grad_checkpoint,
                                   fused_attention=fused_attention) + logit_bytes(shape, kind, batch_per_rank, seq_len)
    return MemoryEstimate(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=int(acts),
        # DPO's frozen reference model is a second copy of the weights (LoRA included: the worker loads it).
        reference=shape.dtype_bytes * shape.params if with_reference else 0,
    )


RUNTIME_BYTES = 128 * 2**20


def usable_memory(total_bytes: int, *, is_macos: bool) -> int:
    """What a training process can really use. On macOS the GPU may wire only part of unified memory by
    default (about 2/3 up to 36 GB, 3/4 above, unless `iogpu.wired_limit_mb` raises it)."""
    if is_macos:
        return int(total_bytes * (0.67 if total_bytes <= 36 * GiB else 0.75))
    # The training process's own runtime (the interpreter, MLX, mlx_lm and the worker imported: ~80 MiB resident on
    # Linux x86, python 3.11, mlx 0.32; the tokenizer, data and allocator pools on top) is in none of the estimate's
    # terms: it binds only under a small limit (a cgroup cap below ~1.3 GiB), where 10% would not cover it.
    return max(0, min(int(total_bytes * 0.9), total_bytes - RUNTIME_BYTES))


def checkpoint_bytes(shape: ModelShape, *, method: str, layers_trained: int | None = None) -> int:
    """One checkpoint: trainable weights in bf16 plus fp32 Adam state (what `--resume` needs)."""
    trained = shape.layers if layers_trained is None or layers_trained < 0 else min(layers_trained, shape.layers)
    trainable = int(shape.params * trainable_fraction(method, trained, shape.layers))
    return math.ceil(2 * trainable + 8 * trainable)
