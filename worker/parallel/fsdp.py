"""Fully sharded data parallel (`layout: {"kind": "fsdp"}`): dp's rows, loss and exact gradient weighting, with
each rank holding only its 1/N of the parameters, gradients and optimizer state.

Sharding: mlx's `nn.fully_shard` wraps each transformer block's sub-modules (attention, MLP: `self_attn`, `mlp`,
whatever a block holds whose every parameter's first axis divides by N) and the embedding / lm_head. A wrapped
module keeps its 1/N slice (axis 0, rank r's contiguous part) and gathers the whole for its forward
(`all_gather`); the gather's vjp reduce-scatters the gradient (`sum_scatter / N`), so the backward hands each rank
the gradient of ITS slice, summed over the ranks. Norms and anything else not wrapped stay replicated: their
gradients are all_summed as dp's are. Needs a backend with sum_scatter (nccl; jaccl).

The step: the rank's local gradient of its loss SUM (as dp), then for sharded parameters x N (undo fully_shard's
/N) and for the others an all_sum, both scaled by 1 / the global weight: the same mean gradient dp applies, so the
losses equal dp's on the same seed within float tolerance. The grad norm is the whole gradient's (the shards'
squares all_summed).

Consistency: no two ranks hold the same shard, so replicas cannot be compared; the `digest` event carries one
hash over every rank's shard hashes (identical on honest ranks; a corrupted shard changes all of them, so the
monitor names no culprit, only stops). The start check compares the ranks' fingerprints of the WHOLE model, taken
before sharding.

Block by block: every transformer block is gradient-checkpointed (mlx-lm's `grad_checkpoint`, whatever
`train.grad_checkpoint` says), so a block's gathered weights and activations live only while it runs (forward,
then again in the backward); the step's peak is the sharded state + the blocks' inputs + one block's working set.

Checkpoints: the whole state, gathered (names and shapes as dp's: a run can resume as dp or on another number of
ranks, as a relaunch without a dead rank does); each rank slices its part back on restore. The gather makes a
checkpoint's peak the whole model's weights and optimizer state: what fsdp shards is the step's peak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as _nn
from mlx.utils import tree_map_with_path, tree_unflatten

from worker.chaos import arrays_sha256
from worker.comm import scalar
from worker.errors import TrainingError
from worker.memory import StepMemory
from worker.objectives import Micro
from worker.parallel.base import mismatch
from worker.parallel.dp import REPLICA_RTOL, DataParallel
from worker.step import _LOSS_KEY, Local, StepResult, TrainStep, all_sum_arrays, flatten

nn: Any = _nn  # mlx.nn has no type stubs that name Module / fully_shard
SHARDED = ".module."  # a FullyShardedModule holds its module as `.module`: every sharded parameter's path has it


def full_name(name: str) -> str:
    """A sharded parameter's (or its optimizer state's) name as dp and the checkpoint name it."""
    return name.replace(SHARDED, ".")


def is_sharded(name: str) -> bool:
    return SHARDED in name


def shardable(module: Any, world: int) -> bool:
    """Worth sharding and shardable: it holds a matrix (norms' vectors stay replicated: tiny, and each wrapped
    module costs a gather per call), every parameter's first axis divides by `world` (fully_shard's condition),
    and its parameters share one dtype (fully_shard gathers them concatenated: a quantized module's packed uint32
    weights next to its float scales would be promoted, i.e. corrupted; quantized modules stay replicated)."""
    params = flatten(module.parameters())
    return (any(a.ndim >= 2 for a in params.values())
            and all(a.ndim > 0 and a.shape[0] % world == 0 for a in params.values())
            and len({a.dtype for a in params.values()}) == 1)


def _trainable_share(module: Any) -> tuple[int, int]:
    """(trainable, all) parameter arrays of a module."""
    return len(flatten(module.trainable_parameters())), len(flatten(module.parameters()))


def _wrap_children(owner: Any, prefix: str, group: Any, wrapped: list[str]) -> None:
    """Wrap each child module of `owner` that is all trainable or all frozen (and shardable); descend into a child
    that mixes the two (a LoRA layer: a frozen base `linear` beside trainable `lora_a`/`lora_b`), so that a trainable
    adapter is never sharded with a frozen weight. Why: fully_shard's gather is ONE function of all the module's
    shards; with one trainable input its vjp runs for all of them, i.e. a full-size gradient of every frozen base
    matrix (a second matmul per linear, then a reduce-scatter) that the optimizer throws away. A frozen-only module's
    gather is outside the gradient's tape: its weights are gathered for the forward (and the checkpointed block's
    recomputation) and nothing flows back to them."""
    world = group.size()
    for name, child in list(owner.children().items()):
        if not isinstance(child, nn.Module):
            continue
        trainable, total = _trainable_share(child)
        if total == 0:
            continue
        if trainable in (0, total):
            if shardable(child, world):
                setattr(owner, name, nn.fully_shard(child, group=group))
                wrapped.append(f"{prefix}{name}")
        else:
            _wrap_children(child, f"{prefix}{name}.", group, wrapped)


def shard_model(model: Any, group: Any) -> list[str]:
    """Wrap the blocks' sub-modules (split into their frozen and trainable parts where a block mixes them: LoRA)
    and the embedding / lm_head in `nn.fully_shard`, in place; the wrapped paths."""
    world = group.size()
    wrapped: list[str] = []
    inner = getattr(model, "model", model)
    for i, layer in enumerate(getattr(inner, "layers", [])):
        _wrap_children(layer, f"layers.{i}.", group, wrapped)
    for owner, name in ((inner, "embed_tokens"), (model, "lm_head")):
        child = getattr(owner, name, None)
        if isinstance(child, nn.Module) and shardable(child, world) and _trainable_share(child)[0] in (
                0, _trainable_share(child)[1]):
            setattr(owner, name, nn.fully_shard(child, group=group))
            wrapped.append(name)
    return wrapped


class ShardedStep(TrainStep):
    """TrainStep with fsdp's combination of the ranks' gradients (see the module docstring)."""

    def apply(self, local: Local, total_weight: int) -> tuple[mx.array, mx.array]:
        inverse = mx.array(1.0 / max(total_weight, 1), mx.float32)
        world = float(self.world_size)
        flat = flatten(local.grads)
        sharded = {k: (g.astype(mx.float32) * (inverse * world)).astype(g.dtype)
                   for k, g in flat.items() if is_sharded(k)}
        rest = {k: (g.astype(mx.float32) * inverse).astype(g.dtype) for k, g in flat.items() if not is_sharded(k)}
        shard_sq = sum((mx.sum(mx.square(g.astype(mx.float32))) for g in sharded.values()), mx.array(0.0))
        rest[_LOSS_KEY] = (local.loss_sum * inverse).reshape(1)
        rest["__fsdp_shard_sq__"] = shard_sq.reshape(1)
        summed = all_sum_arrays(rest, self.all_sum)
        mx.eval(summed)
        loss = summed.pop(_LOSS_KEY).reshape(())
        total_sq = summed.pop("__fsdp_shard_sq__").reshape(())
        total_sq = total_sq + sum((mx.sum(mx.square(g.astype(mx.float32))) for g in summed.values()), mx.array(0.0))
        grads = tree_unflatten(list({**summed, **sharded}.items()))
        self.optimizer.update(self.model, grads)
        return loss, mx.sqrt(total_sq)


class FullyShardedDataParallel(DataParallel):
    """dp's rows and checkpoints' layout, with the model, gradients and optimizer state sharded (module docstring)."""

    kind: ClassVar[str] = "fsdp"
    collective_checkpoint: ClassVar[bool] = True
    _fingerprint: tuple[float, float] = (0.0, 0.0)
    _wrapped: tuple[str, ...] = ()
    _counts: tuple[int, int] = (0, 0)  # (trainable, total) parameters of the whole model, counted before sharding

    def prepare_model(self) -> None:
        """Fingerprint the whole model (for `check_start`), then shard it: before the optimizer exists, so its
        state is created 1/N-sized."""
        if self.config.fine_tune_type == "dora":
            raise TrainingError("fsdp trains full and lora fine-tunes, not dora: a DoRA layer reads its base weight "
                                "directly, so the weight cannot be gathered on demand")
        from worker.modelsetup import count_parameters

        self._counts = count_parameters(self.model)
        flat = flatten(self.model.trainable_parameters())
        s = sum((mx.sum(v.astype(mx.float32)) for v in flat.values()), mx.array(0.0))
        q = sum((mx.sum(mx.square(v.astype(mx.float32))) for v in flat.values()), mx.array(0.0))
        self._fingerprint = (scalar(s), scalar(q))
        self._wrapped = tuple(shard_model(self.model, self.comm.group))
        if not self._wrapped and self.comm.size > 1:
            raise TrainingError("fsdp: no module of this model can be sharded over "
                                f"{self.comm.size} ranks (every parameter's first axis must divide by it)")
        layers = getattr(getattr(self.model, "model", self.model), "layers", None)
        if layers and not self.config.grad_checkpoint:
            # Gather and release block by block: a checkpointed block keeps only its input; its gathered weights
            # and activations exist while it runs, in the forward and again in the backward. Without it MLX's lazy
            # graph holds every block's gathered weights and full-size gradients at once: on 2x H100 (M, full)
            # the step's peak was 0.96x dp's although the resident state was 0.5x (docs/benchmarks.md).
            from mlx_lm.tuner.trainer import grad_checkpoint

            grad_checkpoint(layers[0])  # type: ignore[no-untyped-call]
        mx.eval(self.model.parameters())
        mx.clear_cache()

    def describe(self) -> tuple[int, int, str]:
        """The whole model's counts (taken before sharding: a rank holds 1/N of the sharded parameters)."""
        _, _, detail = super().describe()
        return self._counts[0], self._counts[1], detail

    def started_fields(self) -> dict[str, Any]:
        return {"sharded_modules": len(self._wrapped)}

    def check_start(self) -> None:
        prints = self.comm.gather_floats(list(self._fingerprint))
        for r, fp in enumerate(prints):
            for a, b in zip(fp, prints[0]):
                if not abs(a - b) <= max(1e-6, REPLICA_RTOL * max(abs(a), abs(b))):
                    raise TrainingError(f"rank {r} starts from other weights than rank 0 (fingerprint {fp} vs "
                                        f"{prints[0]}): model files or code differ between nodes")

    def step(self, build: Callable[[], Sequence[Micro]], *, after_local: Callable[[Local], Local] | None = None,
             before_apply: Callable[[float], None] | None = None) -> StepResult:
        if self._step is None:
            # Not compiled: the gathers and reduce-scatters run inside the forward/backward, and a collective
            # inside a compiled graph is what deadlocked dp on ring (worker.step); nccl orders them on its stream.
            self._step = ShardedStep(self.model, self.optimizer, self.objective.loss, all_sum=self.comm.all_sum,
                                     world_size=self.comm.size, stats=bool(self.objective.stats), compiled=False,
                                     memory=StepMemory(self.config.memory_headroom, self.config.clear_cache))
        return self._step.run(build, after_local=after_local, before_apply=before_apply)

    # -- consistency ---------------------------------------------------------------------------------------------

    def digests(self) -> dict[str, str]:
        """One hash over every rank's shard hashes (module docstring): equal on honest ranks."""
        mine = {"params": arrays_sha256(flatten(self.model.parameters())),
                "optimizer": arrays_sha256(flatten(self.optimizer.state))}
        out = {}
        for key, name in (("params", "params_sha256"), ("optimizer", "optimizer_sha256")):
            rows = self.comm.gather_ints(list(bytes.fromhex(mine[key])))
            out[name] = hashlib.sha256(bytes(b for row in rows for b in row)).hexdigest()
        return out

    # -- checkpoints: the whole state, as dp's --------------------------------------------------------------------

    def _gather(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name in sorted(arrays):  # the same order on every rank: the collectives pair up
            arr = arrays[name]
            if is_sharded(name) and self.comm.size > 1 and arr.ndim > 0:
                whole = mx.distributed.all_gather(arr, group=self.comm.group)
                mx.eval(whole)
                out[full_name(name)] = whole
            else:
                out[full_name(name)] = arr
        return out

    def checkpoint_arrays(self) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        return self._gather(self.trainable()), self._gather(flatten(self.optimizer.state))

    def _slice(self, name: str, whole: mx.array, local: mx.array) -> mx.array:
        if not is_sharded(name) or tuple(whole.shape) == tuple(local.shape):
            return whole
        rows = local.shape[0]
        if whole.shape[0] != rows * self.comm.size or tuple(whole.shape[1:]) != tuple(local.shape[1:]):
            raise TrainingError(f"checkpoint: {full_name(name)} has shape {tuple(whole.shape)}, which is not "
                                f"{self.comm.size} x this rank's shard {tuple(local.shape)}")
        return whole[self.rank * rows:(self.rank + 1) * rows]

    def apply_checkpoint(self, weights: dict[str, mx.array], opt_state: dict[str, mx.array]) -> None:
        """Whole checkpointed arrays (dp's names) in; this rank's slices loaded."""
        local_w = self.trainable()
        local_o = flatten(self.optimizer.state)
        want = {full_name(k): v for k, v in local_w.items()}
        want_o = {full_name(k): v for k, v in local_o.items()}
        problem = (mismatch(weights, {k: weights.get(k, v) for k, v in want.items()}, "weights")
                   or mismatch(opt_state, {k: opt_state.get(k, v) for k, v in want_o.items()}, "optimizer state"))
        if problem:
            raise TrainingError(f"checkpoint does not fit this model: {problem}")
        self.model.load_weights([(k, self._slice(k, weights[full_name(k)], v)) for k, v in local_w.items()],
                                strict=False)
        self.optimizer.state = tree_map_with_path(
            lambda path, v: self._slice(path, opt_state[full_name(path)], v), self.optimizer.state)
        self.optimizer.learning_rate = self.config.learning_rate
        mx.eval(self.model.parameters(), self.optimizer.state)
