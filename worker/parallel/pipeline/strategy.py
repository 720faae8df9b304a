"""Pipeline parallel (`layout: {"kind": "pipeline", ...}`): rank r holds blocks [first_layer, last_layer) of the
model (`worker.parallel.pipeline.stage`), stage order is rank order, and activations and their gradients travel
between ring neighbours only (`mx.distributed.send`/`recv`, which the ring backend allows between ranks i and
i±1 and nowhere else).

A step: every stage builds the same global batch (the data order and the rows are functions of the config), cuts
it into `micro_batches` pipeline micro-batches per accumulation micro-batch, and runs its actions of the schedule
(`worker.parallel.pipeline.schedule`, 1F1B by default): receive the input, forward, send the output; receive the
output's gradient, backward (the vjp with it as cotangent), send the input's gradient. The last stage computes the
SFT loss SUM of each micro-batch and differentiates it directly. Each stage sums its parameter gradients over the
micro-batches, scales them by 1 / (scored targets of the global batch), as the data-parallel step does, and
updates its own parameters: the result is one process's step over the same rows (up to float summation order).
No collective runs per micro-batch; one all_sum per step carries the loss and the squared gradient norm for the
step event.

Checkpoints: every stage writes its own shard, `<run_dir>/checkpoints/stage-<rank>/step-NNNNNN/` (the
`worker.checkpoint` layout), with its trainable parameters and optimizer state under the MODEL's layer numbers
(`model.layers.<global>.`), and in state.json its stage and the manifest of the whole checkpoint (every stage's
layers and digests). Resume: at the newest step whose checkpoint is complete (a valid shard of every stage of its
manifest, `worker.parallel.pipeline.shards`), each rank reads its layers from whichever shards hold them: the same split,
or another one (the shards re-cut by layer)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import mlx.core as mx
from mlx.utils import tree_map, tree_map_with_path

from worker.chaos import arrays_sha256
from worker.checkpoint import (
    STATE,
    checkpoints_dir,
    list_checkpoints,
    read_json,
)
from worker.comm import scalar
from worker.data import build_batch, load_datasets
from worker.errors import ResumeRefused, TrainingError
from worker.events import EventKind
from worker.memory import StepMemory, batch_size_of
from worker.modelsetup import count_parameters, ready_optimizer
from worker.objectives import Micro, SftObjective
from worker.parallel.base import ResumeState, Strategy, mismatch
from worker.parallel.pipeline.layout import StageRange, to_global, to_local
from worker.parallel.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    build_schedule,
)
from worker.parallel.pipeline.shards import (
    MANIFEST_KEY,
    StepVerdict,
    build_manifest,
    plan_recut,
    prune_other_shards,
    read_shard_names,
    shard_dir,
    whole_sha256,
)
from worker.parallel.pipeline.stage import Chunk, Stage, chunks_of, load_stage
from worker.parallel.shardresume import load_verified, newest_common_step
from worker.step import PACK_MIN_SAVING, Local, StepResult, WeightMismatch, flatten, packing_saving, padded_width


class Pipeline(Strategy):
    """This rank's stage of a pipeline (see the module docstring)."""

    kind: ClassVar[str] = "pipeline"
    stage: Stage
    busy_s: float = 0.0  # the last step's own computation and wait (`step_fields`)
    wait_s: float = 0.0
    boundary: Boundary  # the last step's values at the stage's boundary (`step_fields`)
    memory: StepMemory  # the step's bound (`train.memory_headroom`) and `train.clear_cache` (worker.memory)

    # -- set-up ------------------------------------------------------------------------------------------------

    @property
    def where(self) -> StageRange:
        spec = self.config.layout.stage(self.rank)
        return StageRange(self.rank, self.config.world_size, spec.first_layer, spec.last_layer)

    def load(self) -> None:
        from mlx_lm.utils import load_config, load_tokenizer

        cfg = self.config
        model_dir = Path(cfg.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model dir {cfg.model} does not exist (nothing is downloaded by workers)")
        self.stage, self.num_layers = load_stage(model_dir, self.where, seed=cfg.seed, method=cfg.fine_tune_type,
                                                 num_layers=cfg.num_layers, lora=cfg.lora,
                                                 grad_checkpoint=cfg.grad_checkpoint)
        self.model = self.stage.model
        tokenizer = cast(Callable[..., Any], load_tokenizer)(
            model_dir, None, eos_token_ids=load_config(model_dir).get("eos_token_id"))
        self.train_set, self.valid_set = load_datasets(Path(cfg.data), tokenizer, mask_prompt=cfg.mask_prompt)
        self.model.train()
        self.packing = decide_pipeline_packing(cfg.packing, self.train_set, max_seq_length=cfg.max_seq_length,
                                               global_batch=cfg.global_batch, seed=cfg.seed)
        self.objective = SftObjective(cfg.max_seq_length, self.packing[0], self.packing[2])
        self.optimizer = ready_optimizer(self.model, cfg.optimizer, cfg.learning_rate)
        self.memory = StepMemory(cfg.memory_headroom, cfg.clear_cache)

    def check_start(self) -> None:
        """Every stage runs the same training settings over the same model depth, with the activations' width
        and dtype its neighbours expect (a mismatch would otherwise show as a hang or garbage in a recv)."""
        digest = bytes.fromhex(self.config.digest())[:8]
        mine = [self.stage.total_layers, self.stage.hidden, _DTYPE_CODES.index(self.stage.dtype), *digest]
        gathered = self.comm.gather_ints(mine)
        for r, theirs in enumerate(gathered):
            if theirs != gathered[0]:
                raise TrainingError(f"pipeline stage {r} disagrees with stage 0 on (model layers, hidden size, "
                                    f"activation dtype, config digest): {theirs[:3]} vs {gathered[0][:3]}"
                                    + (" and the training settings differ" if theirs[3:] != gathered[0][3:] else ""))

    def describe(self) -> tuple[int, int, str]:
        trainable, total = count_parameters(self.model)
        w, cfg = self.where, self.config
        what = "full training" if cfg.fine_tune_type == "full" else f"{cfg.fine_tune_type} adapters"
        extras = ", ".join(x for x, keep in (("embeddings", w.is_first), ("final norm and lm_head", w.is_last))
                           if keep)
        return trainable, total, (f"pipeline stage {w.index}/{w.stages}: layers [{w.first}, {w.last}) of "
                                  f"{self.stage.total_layers}{' with ' + extras if extras else ''}; {what} on "
                                  f"the last {self.num_layers} of the model's layers")

    def started_fields(self) -> dict[str, Any]:
        w, layout = self.where, self.config.layout
        return {"strategy": self.kind, "stage": w.index, "stages": w.stages, "first_layer": w.first,
                "last_layer": w.last, "model_layers": self.stage.total_layers,
                "micro_batches": layout.micro_batches, "schedule": layout.schedule,
                "digest_peers": list(self.digest_peers())}

    def checkpoint_sha256(self, path: Path) -> str:
        return whole_sha256(path)  # each rank's shard differs; the whole checkpoint's manifest is the same

    def state_fields(self) -> dict[str, Any]:
        """The stage, and the manifest of the whole checkpoint (`worker.parallel.pipeline.shards`): every stage's layers
        and digests, gathered from all stages (a collective: every stage writes its shard at the same step)."""
        w = self.where
        weights, opt_state = self.checkpoint_arrays()
        mine = bytes.fromhex(arrays_sha256(weights)) + bytes.fromhex(arrays_sha256(opt_state))
        rows = self.comm.gather_ints([w.first, w.last, *mine])
        manifest = build_manifest(0, 0, self.stage.total_layers,
                                  [(r[0], r[1], bytes(r[2:34]).hex(), bytes(r[34:66]).hex()) for r in rows])
        return {"stage": {"index": w.index, "stages": w.stages, "first_layer": w.first, "last_layer": w.last,
                          "model_layers": self.stage.total_layers},
                MANIFEST_KEY: manifest.to_json()}

    # -- steps ----------------------------------------------------------------------------------------------------

    def rows(self) -> tuple[int, int]:
        return 0, self.config.global_batch  # every stage computes every row

    def _chunks(self, micros: Sequence[Micro]) -> list[Chunk]:
        parts = self.config.layout.micro_batches
        return [c for m in micros for c in chunks_of(m.inputs, self.objective.packing, parts)]

    def _recv(self, chunk: Chunk, source: int) -> mx.array:
        x = mx.distributed.recv((chunk.rows, int(chunk.inputs.shape[1]), self.stage.hidden), self.stage.dtype,
                                source, group=self.comm.group, stream=mx.cpu)
        mx.eval(x)
        return x

    def _send(self, x: mx.array, dest: int) -> None:
        if x.dtype != self.stage.dtype:
            raise TrainingError(f"stage {self.rank} would send {x.dtype} activations, its neighbours expect "
                                f"{self.stage.dtype}")
        mx.eval(mx.distributed.send(x, dest, group=self.comm.group, stream=mx.cpu))

    def step(self, build: Callable[[], Sequence[Micro]], *, after_local: Callable[[Local], Local] | None = None,
             before_apply: Callable[[float], None] | None = None) -> StepResult:
        """One step of this stage, bounded as dp's (`worker.memory`): every action of the schedule is evaluated
        before the next, a send or recv among them, so a measuring step (nothing in flight) holds no collective
        back from its peer."""
        clock = time.perf_counter
        tic = clock()
        self.progress.reset()
        micros = list(build())
        self.memory.begin(batch_size_of([a for m in micros for a in m.inputs]))
        try:
            return self._step(micros, tic, after_local, before_apply)
        except BaseException:
            self.memory.release()  # a failed step must not leave every later eval waiting on each op
            raise

    def _step(self, micros: list[Micro], tic: float, after_local: Callable[[Local], Local] | None,
              before_apply: Callable[[float], None] | None) -> StepResult:
        clock = time.perf_counter
        chunks = self._chunks(micros)
        weight = mx.sum(mx.stack([c.weight for c in chunks]))
        tokens = mx.sum(mx.stack([c.tokens for c in chunks]))
        mx.eval(weight, tokens)
        total_weight = sum(m.total_weight for m in micros)
        if int(scalar(weight)) != total_weight:
            raise WeightMismatch(f"the loss scores {int(scalar(weight))} targets, the host counted {total_weight}")
        self.busy_s = self.wait_s = 0.0
        boundary = self.boundary = Boundary()
        grads, loss_sum = self._run_schedule(chunks, boundary)
        self.progress.begin("update")
        local = Local(grads, loss_sum, weight, tokens, None, _grad_sq(grads))
        if after_local is not None:
            local = after_local(local)
        boundary.out(local.grad_sq, "its parameter gradients")
        boundary.out(local.loss_sum, "its loss")
        mx.eval(local.grads, local.loss_sum, local.grad_sq, *boundary.flags)
        if before_apply is not None:
            slowed = clock()
            before_apply(tic)
            self.busy_s += clock() - slowed  # a slowed stage is busy, as a slower machine would be
        compute_s = clock() - tic
        inverse = mx.array(1.0 / max(total_weight, 1), mx.float32)
        # As the data-parallel step: in float32 and cast back, one rounding; then the local update.
        scaled = tree_map(lambda g: (g.astype(mx.float32) * inverse).astype(g.dtype), local.grads)
        stage_sq = _grad_sq(scaled)
        self.optimizer.update(self.model, scaled)
        updating = clock()
        mx.eval(self.model.parameters(), self.optimizer.state, stage_sq)
        summing = clock()
        self.busy_s += summing - updating
        # The one collective of the step, for the report: the loss (only the last stage has it) and the squared
        # norm of the whole model's gradient (each stage has its part). Evaluated apart from the update, so that
        # its time is the stage's wait for the slowest one (`step_fields`).
        own_loss = local.loss_sum * inverse  # this stage's share of the loss: 0 but on the last stage
        self.progress.begin("all_sum")
        summed = self.comm.all_sum(mx.stack([own_loss, stage_sq]))
        loss, norm = summed[0], mx.sqrt(summed[1])
        mx.eval(loss, norm, own_loss)
        self.wait_s += clock() - summing
        self.memory.end()
        elapsed = clock() - tic
        return StepResult(micros, local, own_loss, mx.sqrt(stage_sq), loss, norm, None, compute_s, elapsed)

    def step_fields(self) -> dict[str, Any]:
        """The step's split of this stage's time (the views' measured bubble, `coordinator.run.stages`; the
        straggler rule's measure): `busy_s`, its own computation (forwards, backwards, the update; a chaos
        slow-down too), and `wait_s`, blocked on its neighbours (receiving and sending activations and gradients,
        and the closing all_sum that waits for the slowest stage). The rest of `step_time_s` is building the
        batch. And, when a value at its boundary was not finite, whose it is (`Boundary.verdict`)."""
        return {"busy_s": self.busy_s, "wait_s": self.wait_s, **self.boundary.verdict()}

    def _run_schedule(self, chunks: Sequence[Chunk], boundary: Boundary) -> tuple[Any, mx.array]:
        """Run this stage's actions over `chunks`; (the gradient SUM of its parameters, its loss sum: 0 but on
        the last stage). Each action is announced to `progress`
        before it begins (its heartbeats say where it is: computing, or waiting on which neighbour); every value
        received and sent is noted in `boundary` (is it finite: checked once, at the end of the step)."""
        where = self.where
        prev, nxt = self.rank - 1, self.rank + 1
        inputs: dict[int, mx.array] = {}
        outputs: dict[int, mx.array] = {}
        received: dict[int, mx.array] = {}
        to_send: dict[int, mx.array] = {}
        grads: Any = None
        loss_sum = mx.array(0.0, mx.float32)
        clock = time.perf_counter
        peers = {RECV_ACT: prev, SEND_GRAD: prev, RECV_GRAD: nxt, SEND_ACT: nxt}
        for action in build_schedule(self.config.layout.schedule, where.index, where.stages, len(chunks)):
            m, chunk = action.micro, chunks[action.micro]
            self.progress.begin(action.kind, peers.get(action.kind))
            began = clock()
            if action.kind == RECV_ACT:
                inputs[m] = self._recv(chunk, prev)
                boundary.inp(inputs[m], f"the activations of micro-batch {m} from stage {prev}")
            elif action.kind == FORWARD:
                if where.is_first:
                    inputs[m] = chunk.inputs
                if not where.is_last:  # the last stage's forward runs inside its backward (one pass, no recompute)
                    outputs[m] = self.stage.forward(inputs[m], chunk)
                    mx.eval(outputs[m])
                    boundary.out(outputs[m], f"its activations of micro-batch {m} (for stage {nxt})")
            elif action.kind == SEND_ACT:
                self._send(outputs.pop(m), nxt)
            elif action.kind == RECV_GRAD:
                received[m] = self._recv(chunk, nxt)
                boundary.inp(received[m], f"the gradient of micro-batch {m} from stage {nxt}")
            elif action.kind == BACKWARD:
                if where.is_last:
                    loss, g, dx = self.stage.loss_backward(inputs.pop(m), chunk)
                    loss_sum = loss_sum + loss
                else:
                    g, dx = self.stage.backward(inputs.pop(m), chunk, received.pop(m))
                grads = g if grads is None else tree_map(lambda a, b: a + b, grads, g)
                mx.eval(grads, loss_sum, *([dx] if dx is not None else []))
                if dx is not None:
                    to_send[m] = dx
                    boundary.out(dx, f"its input gradient of micro-batch {m} (for stage {prev})")
                if where.is_last:
                    boundary.out(loss_sum, f"its loss after micro-batch {m}")
            elif action.kind == SEND_GRAD:
                self._send(to_send.pop(m), prev)
            # Every action is evaluated before the next (`_recv`, `_send`, the mx.eval above): its time is its own.
            if action.kind in (FORWARD, BACKWARD):
                self.busy_s += clock() - began
            else:
                self.wait_s += clock() - began
        return grads, loss_sum

    def eval_sums(self, global_rows: Sequence[int]) -> mx.array | None:
        """The validation loss of one global batch through the stages (forward only, micro-batch by micro-batch:
        each stage passes a micro-batch on and takes the next); the sums are on the last stage."""
        where = self.where
        rows = list(global_rows)
        if not rows:
            return None
        inputs = build_batch([self.valid_set[i] for i in rows], self.config.max_seq_length)
        sums = mx.zeros((2,), mx.float32)
        for chunk in chunks_of(inputs, False, self.config.layout.micro_batches):
            x = chunk.inputs if where.is_first else self._recv(chunk, self.rank - 1)
            if where.is_last:
                sums = sums + mx.stack([self.stage.loss(x, chunk), chunk.weight.astype(mx.float32)])
                mx.eval(sums)
            else:
                y = self.stage.forward(x, chunk)
                mx.eval(y)
                self._send(y, self.rank + 1)
        return sums if where.is_last else None

    # -- consistency -----------------------------------------------------------------------------------------------

    def digest_peers(self) -> tuple[int, ...]:
        return (self.rank,)  # every stage holds other layers: no replica to agree with

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return shard_dir(checkpoints_dir(self.config.run_dir), self.rank)

    @property
    def is_writer(self) -> bool:
        return True  # every stage writes its own shard

    def writer(self) -> int:
        return self.rank

    def checkpoint_done(self, step: int) -> None:
        """The checkpoint of `step` is complete (every stage passed the barrier after writing its shard): the
        shards of other stages on this node (a resume's copies, an earlier split's) that the run's retention rule
        now drops are deleted (`shards.prune_other_shards`); this stage's own were pruned as it wrote."""
        prune_other_shards(checkpoints_dir(self.config.run_dir), self.checkpoint_root, self.config.keep_checkpoints,
                           step)

    def checkpoint_arrays(self) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        first = self.where.first
        weights = to_global(self.trainable(), first)
        opt_state = to_global(flatten(self.optimizer.state), first)
        return ({k: v for k, v in weights.items() if isinstance(v, mx.array)},
                {k: v for k, v in opt_state.items() if isinstance(v, mx.array)})

    def restore(self) -> ResumeState | None:
        """The newest step whose checkpoint is complete (`worker.parallel.pipeline.shards`) for every rank, each rank
        cutting its own layers out of whichever shards hold them: the same split, or another one."""
        cfg = self.config
        root = self.checkpoint_root
        if not cfg.resume:
            existing = [r for r, (n,) in enumerate(self.comm.gather_ints([len(list_checkpoints(root))])) if n]
            if existing:
                raise TrainingError(f"stages {existing} already have checkpoints ({root} here): set resume, or "
                                    "use a new run id")
            return None
        verdict = newest_common_step(self, root, checkpoints_dir(cfg.run_dir), shard_of="stage", holders="stages")
        return self._restore_from(verdict) if verdict is not None else None

    def _restore_from(self, verdict: StepVerdict) -> ResumeState:
        """Load this rank's layers of a complete checkpoint, each source shard checked against the digest its
        manifest records (a shard altered after it was written is refused, naming it)."""
        cfg, w = self.config, self.where
        manifest = verdict.manifest
        assert manifest is not None
        if manifest.model_layers != self.stage.total_layers:
            raise ResumeRefused(f"the step-{verdict.step} checkpoint is of a model with {manifest.model_layers} "
                                f"layers, this one has {self.stage.total_layers}")
        sources = [(s.entry, *read_shard_names(s.path)) for s in verdict.shards]
        w_tmpl, o_tmpl = self.checkpoint_arrays()
        what = f"resuming stage {w.index} (layers [{w.first}, {w.last})) from step {verdict.step}"
        w_plan = plan_recut(w_tmpl, is_first=w.is_first, is_last=w.is_last, stages=len(manifest.stages),
                            sources=[(e, names) for e, names, _ in sources], what=what)
        o_plan = plan_recut(o_tmpl, is_first=w.is_first, is_last=w.is_last, stages=len(manifest.stages),
                            sources=[(e, names) for e, _, names in sources], what=what)
        weights: dict[str, mx.array] = {}
        opt_state: dict[str, mx.array] = {}
        for i in sorted(set(w_plan.values()) | set(o_plan.values())):
            w_all, o_all = load_verified(verdict.shards[i])
            weights.update({n: w_all[n] for n, j in w_plan.items() if j == i})
            opt_state.update({n: o_all[n] for n, j in o_plan.items() if j == i})
        if problem := mismatch(weights, w_tmpl, "weights") or mismatch(opt_state, o_tmpl, "optimizer state"):
            raise TrainingError(f"{what}: the checkpoint does not fit this stage: {problem}")
        first = w.first
        local_w, local_o = to_local(weights, first), to_local(opt_state, first)
        self.model.load_weights(list(local_w.items()), strict=False)
        self.optimizer.state = tree_map_with_path(lambda p, _: local_o[p], self.optimizer.state)
        self.optimizer.learning_rate = cfg.learning_rate  # the config's wins, as in dp
        mx.eval(self.model.parameters(), self.optimizer.state)
        mine = verdict.shards[min(w.index, len(verdict.shards) - 1)].path
        state = read_json(mine / STATE)
        if state.get("config_digest") != cfg.digest():
            self.log.emit(EventKind.WARNING, code="config_changed",
                          message="the checkpoint was written under other training settings (config digest "
                                  "differs); continuing with the current ones")
        if [(e.first, e.last) for e in manifest.stages] != [(s.first_layer, s.last_layer)
                                                            for s in cfg.layout.stages]:
            self.log.emit(EventKind.WARNING, code="resplit",
                          message=f"resumed onto another split: the step-{verdict.step} checkpoint's stages hold "
                                  f"{[[e.first, e.last] for e in manifest.stages]}, this run's stage {w.index} "
                                  f"holds [{w.first}, {w.last})")
        return ResumeState(step=verdict.step, data_position=manifest.data_position, checkpoint=mine, state=state)


_DTYPE_CODES = [mx.float32, mx.bfloat16, mx.float16]


class Boundary:
    """What crossed a stage's boundary in one step, in the order the stage saw it: values received (`inp`) and
    values it computed (`out`: activations and gradients it sends, its parameter gradients, its loss), each with
    a lazy "all finite" flag, evaluated once at the end of the step (no extra synchronisation per micro-batch).
    The step's first non-finite value says who made it: one this stage computed while everything it had received
    so far was finite (`produced`), or one a neighbour sent (`received`): the receiver of a NaN is not its
    source, and a NaN that comes back as a gradient does not blame the stage it came back to."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, str, mx.array]] = []  # (computed here, what, all finite)

    @property
    def flags(self) -> list[mx.array]:
        return [flag for _, _, flag in self.seen]

    def inp(self, x: mx.array, what: str) -> None:
        self.seen.append((False, what, mx.all(mx.isfinite(x))))

    def out(self, x: mx.array, what: str) -> None:
        self.seen.append((True, what, mx.all(mx.isfinite(x))))

    def verdict(self) -> dict[str, str]:
        """{} when every value was finite; else nonfinite (produced | received) and nonfinite_at (which)."""
        for here, what, flag in self.seen:
            if not bool(flag.item()):
                return {"nonfinite": "produced" if here else "received",
                        "nonfinite_at": ("computed " if here else "received ") + what}
        return {}


def _grad_sq(grads: Any) -> mx.array:
    return sum((mx.sum(mx.square(g.astype(mx.float32))) for g in flatten(grads).values()), mx.array(0.0, mx.float32))


def decide_pipeline_packing(setting: str, dataset: Any, *, max_seq_length: int, global_batch: int, seed: int,
                            sample: int = 1024) -> tuple[bool, str, int]:
    """`worker.step.decide_packing` for a stage, which cannot run the whole model to check that packing is exact:
    it need not, since a stage builds the block-diagonal mask itself and the families it computes
    (`stage.FAMILIES`) have rotary positions only, the case packing is exact for. `auto` packs when that saves at
    least PACK_MIN_SAVING of the computed positions; `on` always; `off` never."""
    from worker.data import stream_rows

    rows = [dataset[i] for i in stream_rows(0, min(len(dataset), sample), len(dataset), seed)]
    lengths = [len(t) for t, _ in rows]
    width = padded_width(lengths or [1], max_seq_length)
    if setting == "off":
        return False, "train.packing is off", width
    saving = packing_saving(lengths, max_seq_length, global_batch, width)
    if setting == "auto" and saving < PACK_MIN_SAVING:
        return False, f"packing would save {saving:.0%} of the computed positions (< {PACK_MIN_SAVING:.0%})", width
    return True, f"packed into sequences of {width} positions: saves {saving:.0%} of the computed positions", width
