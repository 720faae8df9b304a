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

Checkpoints: sharded, in the pipeline's stage-shard format (`worker.parallel.pipeline.shards`): rank r writes
`checkpoints/stage-<r>/step-N/` holding the WHOLE parameters and optimizer state (dp's names) of an even share of
the blocks, [r*L/N, (r+1)*L/N), rank 0 also what is outside the blocks; its state.json carries the manifest of the
whole checkpoint (every rank's blocks and digests). Writing: every rank joins each sharded array's all_gather and
keeps only its share, so a checkpoint's peak is ~1/N of the model's state plus one array. Resume: the newest step
complete on every rank (`evaluate_steps`); each rank reads every parameter from the shard holding its block and
cuts its own rows: onto the same number of ranks or another one (a `resharded` warning), checked against the
manifest's digests; a missing shard refuses, naming its stage and blocks. Being a pipeline checkpoint, the
coordinator's resume (copying the shards a node lacks) and `coordinator export` (merging them into a model mlx_lm
loads) read it unchanged, and a pipeline may resume from it. An fsdp run does not read dp's whole-state
checkpoints (older fsdp runs wrote those): it refuses, naming them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as _nn
from mlx.utils import tree_map_with_path, tree_unflatten

from worker.chaos import arrays_sha256, replica_digest
from worker.checkpoint import (
    STATE,
    checkpoints_dir,
    list_checkpoints,
)
from worker.comm import scalar
from worker.errors import ResumeRefused, TrainingError
from worker.events import EventKind
from worker.exchange import Exchange
from worker.memory import StepMemory
from worker.objectives import Micro
from worker.parallel.base import ResumeState, mismatch
from worker.parallel.dp import REPLICA_RTOL, DataParallel
from worker.parallel.pipeline.layout import layer_of
from worker.parallel.pipeline.shards import (
    MANIFEST_KEY,
    StepVerdict,
    build_manifest,
    plan_recut,
    read_shard_names,
    shard_dir,
    whole_sha256,
)
from worker.parallel.shardresume import load_verified, newest_common_step
from worker.step import _LOSS_KEY, ALL_REDUCE_BYTES, Local, StepResult, TrainStep, all_sum_arrays, flatten

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
    _saved: tuple[dict[str, mx.array], dict[str, mx.array]] | None = None  # this checkpoint's arrays, for its manifest

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
            # Never fused (worker.exchange): fsdp's own exchange (ShardedStep.apply) follows the evaluated compute,
            # whose gathers and reduce-scatters already wait for the peers.
            self._step = ShardedStep(self.model, self.optimizer, self.objective.loss, all_sum=self.comm.all_sum,
                                     world_size=self.comm.size, stats=bool(self.objective.stats), compiled=False,
                                     memory=StepMemory(self.config.memory_headroom, self.config.clear_cache),
                                     exchange=Exchange(pipelined=False, bucket_bytes=ALL_REDUCE_BYTES))
        return self._step.run(build, after_local=after_local, before_apply=before_apply)

    # -- consistency ---------------------------------------------------------------------------------------------

    def digests(self) -> dict[str, str]:
        """One hash over every rank's shard hashes (module docstring): equal on honest ranks."""
        mine = {"params": replica_digest(flatten(self.model.parameters())),
                "optimizer": replica_digest(flatten(self.optimizer.state))}
        out = {}
        for key, name in (("params", "params_sha256"), ("optimizer", "optimizer_sha256")):
            rows = self.comm.gather_ints(list(bytes.fromhex(mine[key])))
            out[name] = hashlib.sha256(bytes(b for row in rows for b in row)).hexdigest()
        return out

    # -- checkpoints: sharded, in the pipeline's stage-shard format --------------------------------------------------

    def ckpt_range(self) -> tuple[int, int]:
        """The blocks [first, last) whose whole state this rank's checkpoint shard holds: an even cut of the
        model's blocks over the ranks (rank 0 also holds what is outside the blocks)."""
        layers, world = self._model_layers(), self.comm.size
        return self.rank * layers // world, (self.rank + 1) * layers // world

    def _model_layers(self) -> int:
        return len(getattr(getattr(self.model, "model", self.model), "layers", []))

    def _keeps(self, name: str) -> bool:
        first, last = self.ckpt_range()
        layer = layer_of(name)
        if layer is None:  # embeddings, final norm, head, the optimizer's step and learning rate
            return self.rank == 0 or name in ("step", "learning_rate")
        return first <= layer < last

    @property
    def checkpoint_root(self) -> Path:
        return shard_dir(checkpoints_dir(self.config.run_dir), self.rank)

    @property
    def is_writer(self) -> bool:
        return True  # every rank writes its own shard

    def writer(self) -> int:
        return self.rank

    def _gather_mine(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """The whole arrays of this rank's checkpoint range, dp's names. Every rank joins every sharded array's
        all_gather (same sorted order on every rank: the collectives pair up) and keeps only its own: at most one
        array beyond its range is whole at a time, so a checkpoint's peak is ~1/N of the model's state."""
        out: dict[str, mx.array] = {}
        for name in sorted(arrays):
            full, arr = full_name(name), arrays[name]
            if is_sharded(name) and self.comm.size > 1 and arr.ndim > 0:
                whole = mx.distributed.all_gather(arr, group=self.comm.group)
                if self._keeps(full):
                    mx.eval(whole)
                    out[full] = whole
                else:
                    mx.eval(whole)  # the peers wait for it; dropped at once
                    del whole
            elif self._keeps(full):
                out[full] = arr
        return out

    def checkpoint_arrays(self) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        weights = self._gather_mine(self.trainable())
        opt_state = self._gather_mine(flatten(self.optimizer.state))
        self._saved = (weights, opt_state)
        return weights, opt_state

    def checkpoint_sha256(self, path: Path) -> str:
        return whole_sha256(path)  # each rank's shard differs; the whole checkpoint's manifest is the same

    def state_fields(self) -> dict[str, Any]:
        """The shard's place and the whole checkpoint's manifest (every rank's range and digests, gathered): the
        pipeline's format (`worker.parallel.pipeline.shards`), so resume, the coordinator's shard copies and
        `coordinator export` read an fsdp checkpoint as they read a pipeline's."""
        weights, opt_state = self._saved if self._saved is not None else self.checkpoint_arrays()
        self._saved = None
        first, last = self.ckpt_range()
        mine = bytes.fromhex(arrays_sha256(weights)) + bytes.fromhex(arrays_sha256(opt_state))
        rows = self.comm.gather_ints([first, last, *mine])
        layers = self._model_layers()
        manifest = build_manifest(0, 0, layers, [(r[0], r[1], bytes(r[2:34]).hex(), bytes(r[34:66]).hex())
                                                 for r in rows])
        return {"stage": {"index": self.rank, "stages": self.comm.size, "first_layer": first, "last_layer": last,
                          "model_layers": layers},
                MANIFEST_KEY: manifest.to_json(), "fsdp": {"world_size": self.comm.size}}

    def restore(self) -> ResumeState | None:
        """The newest step whose sharded checkpoint is complete on every rank (`evaluate_steps`), each rank cutting
        its rows of every parameter out of whichever shards hold them: the same world size or another one."""
        cfg = self.config
        root = self.checkpoint_root
        everything = checkpoints_dir(cfg.run_dir)
        if not cfg.resume:
            mine = len(list_checkpoints(root)) + len(list_checkpoints(everything))
            existing = [r for r, (n,) in enumerate(self.comm.gather_ints([mine])) if n]
            if existing:
                raise TrainingError(f"ranks {existing} already have checkpoints under their run dir ({everything} "
                                    "here): set resume, or use a new run id")
            return None
        whole = len(list_checkpoints(everything))  # dp's layout: fsdp before sharded checkpoints, or a dp run
        verdict = newest_common_step(self, root, everything, shard_of="rank that wrote it", holders="ranks",
                                     others=whole, others_note=f"{whole} whole (dp-layout) checkpoints here, which "
                                     "fsdp does not read: resume them with strategy dp")
        return self._restore_from(verdict) if verdict is not None else None

    def _restore_from(self, verdict: StepVerdict) -> ResumeState:
        cfg = self.config
        manifest = verdict.manifest
        assert manifest is not None
        if manifest.model_layers != self._model_layers():
            raise ResumeRefused(f"the step-{verdict.step} checkpoint is of a model with {manifest.model_layers} "
                                f"layers, this one has {self._model_layers()}")
        local_w, local_o = self.trainable(), flatten(self.optimizer.state)
        want_w = {full_name(k): k for k in local_w}
        want_o = {full_name(k): k for k in local_o}
        sources = [(s.entry, *read_shard_names(s.path)) for s in verdict.shards]
        stages = len(manifest.stages)
        what = f"resuming fsdp rank {self.rank} of {self.comm.size} from step {verdict.step}"
        w_plan = plan_recut(want_w, is_first=True, is_last=True, stages=stages,
                            sources=[(e, names) for e, names, _ in sources], what=what)
        o_plan = plan_recut(want_o, is_first=True, is_last=True, stages=stages,
                            sources=[(e, names) for e, _, names in sources], what=what)
        weights: list[tuple[str, mx.array]] = []
        opt_state: dict[str, mx.array] = {}
        for i in sorted(set(w_plan.values()) | set(o_plan.values())):
            w_all, o_all = load_verified(verdict.shards[i])
            for full, j in w_plan.items():
                if j == i:
                    local = want_w[full]
                    weights.append((local, self._slice(local, w_all[full], local_w[local])))
            for full, j in o_plan.items():
                if j == i:
                    local = want_o[full]
                    opt_state[local] = self._slice(local, o_all[full], local_o[local])
            mx.eval([a for _, a in weights], list(opt_state.values()))
            del w_all, o_all
        got_w = dict(weights)
        if problem := mismatch(got_w, local_w, "weights") or mismatch(opt_state, local_o, "optimizer state"):
            raise TrainingError(f"{what}: the checkpoint does not fit this model: {problem}")
        self.model.load_weights(weights, strict=False)
        self.optimizer.state = tree_map_with_path(lambda path, _: opt_state[path], self.optimizer.state)
        self.optimizer.learning_rate = cfg.learning_rate  # the config's wins, as in dp
        mx.eval(self.model.parameters(), self.optimizer.state)
        mine = verdict.shards[min(self.rank, len(verdict.shards) - 1)].path
        state = json.loads((mine / STATE).read_text(encoding="utf-8"))
        if state.get("config_digest") != cfg.digest():
            self.log.emit(EventKind.WARNING, code="config_changed",
                          message="the checkpoint was written under other training settings (config digest "
                                  "differs); continuing with the current ones")
        if stages != self.comm.size:
            self.log.emit(EventKind.WARNING, code="resharded",
                          message=f"resumed onto {self.comm.size} ranks from a checkpoint written by {stages}: "
                                  "every parameter re-cut by rows")
        return ResumeState(step=verdict.step, data_position=manifest.data_position, checkpoint=mine, state=state)

    def _slice(self, name: str, whole: mx.array, local: mx.array) -> mx.array:
        """This rank's rows of a whole checkpointed array (a replicated one is taken whole)."""
        if not is_sharded(name) or tuple(whole.shape) == tuple(local.shape):
            return whole
        rows = local.shape[0]
        if whole.shape[0] != rows * self.comm.size or tuple(whole.shape[1:]) != tuple(local.shape[1:]):
            raise TrainingError(f"checkpoint: {full_name(name)} has shape {tuple(whole.shape)}, which is not "
                                f"{self.comm.size} x this rank's shard {tuple(local.shape)}")
        return whole[self.rank * rows:(self.rank + 1) * rows]
