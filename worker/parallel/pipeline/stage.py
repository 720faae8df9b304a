"""One pipeline stage: its piece of the model, loaded alone, and the computations on it.

Loading (`load_stage`) never materialises the whole model: the model is built from its config with lazy arrays
(MLX evaluates nothing until asked), the stage's tensors are picked by name from the safetensors index (or the
files' headers) and only those files are opened (`mx.load` is lazy too: an unused tensor is never read); the
method (LoRA/DoRA adapters, or full) is applied to the WHOLE lazy skeleton after `mx.random.seed(seed)`, exactly as
a single process applies it, so this stage's adapters get the same initial values as that process's (their random
draws happen in layer order); then everything outside the stage is dropped before the first evaluation.

Computations: `forward` (the stage's blocks, after the embeddings on the first stage), `backward` (the vjp of
`forward` with the received output gradient as cotangent: parameter gradients and, but on the first stage, the
input gradient to send upstream) and `loss_backward` on the last stage (final norm, lm_head, the SFT loss SUM
with mlx-lm's mask, differentiated directly). MLX keeps no tape between calls, so a backward recomputes its
forward: a stage keeps only its pending inputs between the two (see `schedule`).

Model families: `FAMILIES`, whose forward is exactly embeddings -> blocks (one attention mask for all, rotary
positions) -> final norm -> lm_head or the tied embeddings, which is what a stage computes; others (scaled
embeddings, sliding windows, absolute positions, ...) are refused rather than computed wrongly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.losses import cross_entropy
from mlx.utils import tree_unflatten

from worker.errors import TrainingError
from worker.parallel.pipeline.layout import StageRange, wanted, weight_files
from worker.runconfig import LoraSpec
from worker.step import flatten

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3")  # mlx_lm.models.<module> of the model class
_DTYPES = {"F32": mx.float32, "BF16": mx.bfloat16, "F16": mx.float16}


@dataclass(frozen=True)
class Chunk:
    """One pipeline micro-batch, as every stage builds it from the same rows: input ids, targets, which targets
    are scored (mlx-lm's mask: bool unpacked, float packed, as `worker.step` builds them), the attention mask
    (None: causal; packed: block-diagonal causal), the scored-target and real-token counts."""

    inputs: mx.array
    targets: mx.array
    scored: mx.array
    attention: mx.array | None
    weight: mx.array
    tokens: mx.array

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` near-equal slices of n rows (the first n % parts one longer), empty ones left out."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        if size:
            out.append((at, at + size))
        at += size
    return out


def chunks_of(inputs: Sequence[mx.array], packed: bool, parts: int) -> list[Chunk]:
    """A `Micro`'s inputs (`worker.objectives`: (batch, lengths) unpacked, or (inputs, targets, scored,
    segments) packed) cut into up to `parts` pipeline micro-batches of whole rows (sequences when packed), with the
    same targets, masks and counts `worker.step.token_loss_sum` / `packed_loss_sum` compute."""
    out = []
    for a, b in split_rows(int(inputs[0].shape[0]), parts):
        if packed:
            ids, targets, scored, segments = (x[a:b] for x in inputs)
            same = segments[:, None, :, None] == segments[:, None, None, :]
            pos = mx.arange(ids.shape[1])
            attention = mx.logical_and(same, pos[:, None] >= pos[None, :])
            out.append(Chunk(ids, targets, scored, attention, scored.sum().astype(mx.int32),
                             (segments > 0).sum().astype(mx.int32)))
        else:
            batch, lengths = inputs[0][a:b], inputs[1][a:b]
            ids, targets = batch[:, :-1], batch[:, 1:]
            steps = mx.arange(1, targets.shape[1] + 1)
            mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
            out.append(Chunk(ids, targets, mask, None, mask.sum().astype(mx.int32),
                             lengths[:, 1].sum().astype(mx.int32)))
    return out


class Stage:
    """This rank's blocks [first, last) of the model (`StageRange`), in an mlx-lm model object trimmed to them:
    its parameters are named locally (`model.layers.0` is block `first`); `worker.parallel.pipeline.layout`
    renames them to the model's numbering for checkpoints."""

    def __init__(self, model: Any, where: StageRange, total_layers: int, hidden: int, dtype: Any) -> None:
        self.model = model
        self.where = where
        self.total_layers = total_layers  # of the whole model
        self.hidden = hidden  # width of the activations between stages
        self.dtype = dtype  # their dtype (the embeddings')
        self.tied = "lm_head" not in model

    # -- the computations -----------------------------------------------------------------------------------------

    def _blocks(self, x: mx.array, chunk: Chunk) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        inner = self.model.model
        h = inner.embed_tokens(x) if self.where.is_first else x
        mask = chunk.attention if chunk.attention is not None else create_attention_mask(h, None)
        for layer in inner.layers:
            h = layer(h, mask, cache=None)
        return h

    def _loss(self, h: mx.array, chunk: Chunk) -> mx.array:
        inner = self.model.model
        h = inner.norm(h)
        logits = inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)
        ce = cross_entropy(logits, chunk.targets) * chunk.scored
        return ce.astype(mx.float32).sum()

    def forward(self, x: mx.array, chunk: Chunk) -> mx.array:
        """The stage's output for input `x` (token ids on the first stage, else the previous stage's output)."""
        return self._blocks(x, chunk)

    def loss(self, x: mx.array, chunk: Chunk) -> mx.array:
        """The last stage's loss sum (float32) for input `x`, without gradients (evaluation)."""
        return self._loss(self._blocks(x, chunk), chunk)

    def _vjp(self, fn: Any, x: mx.array, cotangent: mx.array) -> tuple[mx.array, Any, mx.array | None]:
        flat = flatten(self.model.trainable_parameters())
        names = list(flat)
        wants_dx = not self.where.is_first

        def fun(*arrays: mx.array) -> list[mx.array]:
            self.model.update(tree_unflatten(list(zip(names, arrays[:len(names)]))))
            return [fn(arrays[len(names)] if wants_dx else x)]

        primals = [*flat.values(), *([x] if wants_dx else [])]
        (out,), cots = mx.vjp(fun, primals, [cotangent])
        grads = tree_unflatten(list(zip(names, cots[:len(names)])))
        return out, grads, (cots[len(names)] if wants_dx else None)

    def backward(self, x: mx.array, chunk: Chunk, dy: mx.array) -> tuple[Any, mx.array | None]:
        """(parameter gradients, input gradient or None on the first stage) of <forward(x), dy>: the vjp with the
        received gradient of the stage's output as cotangent. Recomputes the forward."""
        _, grads, dx = self._vjp(lambda h: self._blocks(h, chunk), x, dy)
        return grads, dx

    def loss_backward(self, x: mx.array, chunk: Chunk) -> tuple[mx.array, Any, mx.array | None]:
        """Last stage: (loss sum, parameter gradients, input gradient or None) of the SFT loss SUM of `chunk`."""
        return self._vjp(lambda h: self._loss(self._blocks(h, chunk), chunk), x, mx.array(1.0, mx.float32))


# --- loading ---------------------------------------------------------------------------------------------------------


def _refuse(model_dir: Path, why: str) -> TrainingError:
    return TrainingError(f"{model_dir}: cannot split this model into pipeline stages: {why}")


def load_stage(model_dir: Path, where: StageRange, *, seed: int, method: str, num_layers: int | None,
               lora: LoraSpec, grad_checkpoint: bool) -> tuple[Stage, int]:
    """This rank's stage with the method applied, its parameters evaluated (and nothing else of the model), and
    the number of the model's layers the method adapts/trains (as `worker.modelsetup.apply_method` counts)."""
    from mlx_lm.utils import _get_classes, load_config

    from worker.modelsetup import apply_method

    config = load_config(model_dir)
    if config.get("quantization") or config.get("quantization_config"):
        raise _refuse(model_dir, "quantized models are not split yet (their layers load through mlx-lm's "
                                 "quantize step); train a float model, or use layout dp")
    model_class, args_class = _get_classes(config=config)
    family = model_class.__module__.rsplit(".", 1)[-1]
    if family not in FAMILIES:
        raise _refuse(model_dir, f"model family {family!r} is not one a stage can compute (it can: "
                                 f"{', '.join(FAMILIES)}); use layout dp")
    model = model_class(args_class.from_dict(config))  # lazy: nothing is allocated until evaluated
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise _refuse(model_dir, f"model type {config.get('model_type')!r} is not laid out as "
                                 "model.{embed_tokens, layers, norm}")
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        raise _refuse(model_dir, "it has sliding-window attention layers")
    total = len(inner.layers)
    if where.last > total or (where.is_last and where.last != total):
        raise TrainingError(f"layout: stage {where.index} holds layers [{where.first}, {where.last}) but the model "
                            f"has {total} (the last stage must end at layer {total})")
    tied = "lm_head" not in model
    keep_embed = where.is_first or (where.is_last and tied)  # tied: the last stage's head is the embeddings
    outside = (["model.embed_tokens"] if keep_embed else []) + (["model.norm", "lm_head"] if where.is_last else [])
    files = weight_files(model_dir)
    names = [n for n in files if wanted(n, where, outside)]
    weights: dict[str, mx.array] = {}
    for path in sorted({files[n] for n in names}):
        loaded = mx.load(str(path))  # lazy: only the tensors evaluated below are read
        if not isinstance(loaded, dict):
            raise TypeError(f"{path} did not load as a dict of arrays")
        weights.update({n: loaded[n] for n in names if files[n] == path})
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    # The activations between stages: the model's width, in the dtype of this stage's own weights (the
    # embeddings' on a llama-like model; check_start makes sure every stage agrees).
    floats = [w.dtype for w in weights.values() if w.dtype in _DTYPES.values()]
    if not floats or "hidden_size" not in config:
        raise _refuse(model_dir, "no float weights or no hidden_size in config.json")
    dtype = max(set(floats), key=floats.count)
    kept = [n for n in flatten(model.parameters()) if wanted(n, where, outside)]
    if missing := sorted(n for n in kept if n not in weights):
        raise _refuse(model_dir, f"no weights for {missing[:5]} in the safetensors")
    model.load_weights(list(weights.items()), strict=False)
    model.eval()
    # The method on the whole (lazy) model: its random draws, and so this stage's adapters, are a single
    # process's. Layers outside the stage are dropped below, unevaluated.
    mx.random.seed(seed)
    count = apply_method(model, method, num_layers, lora)
    inner.layers = inner.layers[where.first:where.last]
    if not keep_embed:
        del inner["embed_tokens"]
    if not where.is_last:
        del inner["norm"]
        if not tied:
            del model["lm_head"]
    if grad_checkpoint and inner.layers:
        from mlx_lm.tuner.trainer import grad_checkpoint as checkpoint_layers

        checkpoint_layers(inner.layers[0])  # type: ignore[no-untyped-call]
    mx.eval(model.parameters())
    return Stage(model, where, total, int(config["hidden_size"]), dtype), count
