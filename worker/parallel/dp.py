"""Data parallel (`layout: {"kind": "dp"}`): every rank holds the whole model and takes its own rows of each
global batch; one compiled step (`worker.step.TrainStep`) sums the exactly weighted gradients over the ranks, so
every replica makes the same update and holds bit-identical weights (the `digest` events of all ranks agree).

Checkpoints: one full copy per node in `<run_dir>/checkpoints/step-NNNNNN/` (layout in `worker.checkpoint`),
written by the node's checkpoint writer: the lowest rank planned on that node name (several ranks on one machine
share the run dir, so only one writes; every node still holds a full copy, so losing a node loses no state).

Resume: each rank finds its node's newest checkpoint that verifies (reporting every skipped one as
`checkpoint_invalid`, and the node's writer sets each aside as `step-N.invalid-<code>`, never deleted); the ranks
agree on the newest step any of them has; when every rank holds byte-identical copies each loads its own,
otherwise the lowest rank holding it broadcasts weights, optimizer state and state.json to all. When checkpoints
exist but none is valid on any rank, every rank raises `ResumeRefused` unless `restart_from_scratch` is set. A
fresh run refuses a run dir that already has checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
from mlx.utils import tree_map_with_path

from worker.checkpoint import (
    Checkpoint,
    checkpoints_dir,
    list_checkpoints,
    scan_checkpoints,
    set_aside_invalid,
    step_dir_name,
)
from worker.comm import scalar
from worker.data import load_datasets, rank_slice
from worker.dpo import load_preference_datasets
from worker.errors import ResumeRefused, TrainingError
from worker.events import EventKind
from worker.memory import StepMemory
from worker.modelsetup import apply_method, ready_optimizer
from worker.objectives import DpoObjective, Micro, SftObjective
from worker.parallel.base import ResumeState, Strategy, mismatch, read_checkpoint
from worker.step import Local, StepResult, TrainStep, decide_packing, flatten

REPLICA_RTOL = 1e-5


class DataParallel(Strategy):
    """Every rank a full replica (see the module docstring)."""

    kind: ClassVar[str] = "dp"
    _step: TrainStep | None = None  # built at the first step: it captures the restored model and optimizer state

    # -- set-up ------------------------------------------------------------------------------------------------

    def load(self) -> None:
        from mlx_lm.utils import load, maybe_set_recommended_wired_limit

        cfg = self.config
        if not Path(cfg.model).is_dir():
            raise FileNotFoundError(f"model dir {cfg.model} does not exist (nothing is downloaded by workers)")
        maybe_set_recommended_wired_limit()
        loaded = load(cfg.model)
        self.model, tokenizer = loaded[0], loaded[1]
        # Adapters are initialised from mx.random: the same seed on every rank gives the same initial state.
        mx.random.seed(cfg.seed)
        self.num_layers = apply_method(self.model, cfg.fine_tune_type, cfg.num_layers, cfg.lora,
                                       train_embeddings=cfg.train_embeddings)
        if cfg.grad_checkpoint:
            from mlx_lm.tuner.trainer import grad_checkpoint

            grad_checkpoint(self.model.layers[0])  # type: ignore[no-untyped-call]
        if cfg.method == "dpo":
            reference_dir = cfg.dpo.reference or cfg.model
            if not Path(reference_dir).is_dir():
                raise FileNotFoundError(f"DPO reference model dir {reference_dir} does not exist")
            reference = load(reference_dir)[0]
            reference.freeze()
            reference.eval()
            self.objective = DpoObjective(reference, cfg.dpo.beta, cfg.max_seq_length)
            self.train_set, self.valid_set = load_preference_datasets(Path(cfg.data), tokenizer)
            self.packing = (False, "DPO pairs are not packed", 0)
        else:
            self.train_set, self.valid_set = load_datasets(Path(cfg.data), tokenizer, mask_prompt=cfg.mask_prompt)
            self.model.train()
            self.packing = decide_packing(cfg.packing, self.model, self.train_set, max_seq_length=cfg.max_seq_length,
                                          global_batch=cfg.global_batch, seed=cfg.seed)
            self.objective = SftObjective(cfg.max_seq_length, self.packing[0], self.packing[2])
        self.prepare_model()
        self.optimizer = ready_optimizer(self.model, cfg.optimizer, cfg.learning_rate)

    def prepare_model(self) -> None:
        """The model once set up, before the optimizer sees it (fsdp shards it here; dp keeps it whole)."""

    def check_start(self) -> None:
        """All ranks must start from the same trainable state (same files, same seed): compare cheap
        fingerprints (sum, sum of squares) so a divergent node fails now, not as a silently wrong model."""
        flat = self.trainable()
        s = sum((mx.sum(v.astype(mx.float32)) for v in flat.values()), mx.array(0.0))
        q = sum((mx.sum(mx.square(v.astype(mx.float32))) for v in flat.values()), mx.array(0.0))
        prints = self.comm.gather_floats([scalar(s), scalar(q)])
        for r, fp in enumerate(prints):
            for a, b in zip(fp, prints[0]):  # both [sum, sum of squares]: gather_floats keeps lengths
                if not math.isclose(a, b, rel_tol=REPLICA_RTOL, abs_tol=1e-6):
                    raise TrainingError(f"rank {r} starts from other weights than rank 0 (fingerprint {fp} vs "
                                        f"{prints[0]}): model files or code differ between nodes")

    # -- steps ----------------------------------------------------------------------------------------------------

    def rows(self) -> tuple[int, int]:
        return self.config.rank_offset(self.rank), self.config.rank_spec(self.rank).batch_size

    def step(self, build: Callable[[], Sequence[Micro]], *, after_local: Callable[[Local], Local] | None = None,
             before_apply: Callable[[float], None] | None = None) -> StepResult:
        if self._step is None:
            self._step = TrainStep(self.model, self.optimizer, self.objective.loss, all_sum=self.comm.all_sum,
                                   world_size=self.comm.size, stats=bool(self.objective.stats),
                                   memory=StepMemory(self.config.memory_headroom, self.config.clear_cache))
        return self._step.run(build, after_local=after_local, before_apply=before_apply)

    def eval_sums(self, global_rows: Sequence[int]) -> mx.array | None:
        offset, count = self.rows()
        rows = rank_slice(global_rows, offset, count)
        if not rows:  # a short last batch can leave this rank nothing; it still joins the trainer's all_sum
            return None
        ls, weight, stats = self.objective.eval_sums(self.model, self.valid_set, rows)
        parts = [ls.astype(mx.float32).reshape(1), weight.astype(mx.float32).reshape(1)]
        return mx.concatenate(parts + ([stats] if stats is not None else []))

    # -- consistency -----------------------------------------------------------------------------------------------

    def digest_peers(self) -> tuple[int, ...]:
        return tuple(range(self.comm.size))  # replicas: every rank

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return checkpoints_dir(self.config.run_dir)

    @property
    def is_writer(self) -> bool:
        return self.writer() == self.rank

    def writer(self) -> int:
        return self.config.checkpoint_writer(self.rank)

    def checkpoint_arrays(self) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        return self.trainable(), flatten(self.optimizer.state)

    def restore(self) -> ResumeState | None:
        cfg = self.config
        root = self.checkpoint_root
        if not cfg.resume:
            existing = [r for r, (n,) in enumerate(self.comm.gather_ints([len(list_checkpoints(root))])) if n]
            if existing:
                raise TrainingError(f"ranks {existing} already have checkpoints under their run dir "
                                    f"({root} here): set resume, or use a new run id")
            return None
        verdicts = scan_checkpoints(root)
        invalid = [v for v in verdicts if not v.valid]
        for v in invalid:
            self.on_invalid(v.step, v.path, v.reason)
        valid = [v for v in verdicts if v.valid]
        local = Checkpoint(valid[0].step, valid[0].path, valid[0].manifest_sha256 or "") if valid else None
        gathered = self.comm.gather_ints([local.step if local else -1, len(invalid)])
        steps = [s for s, _ in gathered]
        best = max(steps)
        if best < 0 and any(n for _, n in gathered) and not cfg.restart_from_scratch:
            # Every rank gets here together (same gathered values): none starts over checkpoints it cannot read.
            raise ResumeRefused(
                "no rank has a valid checkpoint to resume from, and these are invalid: "
                + ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(gathered) if n)
                + (f" (here: {'; '.join(f'{v.path}: {v.reason}' for v in invalid)})" if invalid else "")
                + ": refusing to start from step 0 over them (restart_from_scratch sets them aside and starts over)")
        # Every invalid checkpoint of this node is set aside, kept for inspection: it must not shadow, nor make
        # pruning delete, what this run writes next. (All of them are newer than this node's newest valid one,
        # so none is the checkpoint any rank is about to load.)
        if self.is_writer and invalid:
            moved = [str(set_aside_invalid(root, v.step, v.code)) for v in invalid]
            self.log.emit(EventKind.WARNING, code="set_aside_invalid",
                          message=f"invalid checkpoints set aside (kept, never resumed from): {moved}")
        if best < 0:
            self.log.emit(EventKind.WARNING, code="no_checkpoint",
                          message="resume requested but no rank has a valid checkpoint: starting at step 0"
                                  + (" (restart_from_scratch)" if any(n for _, n in gathered) else ""))
            return None
        digest = bytes.fromhex(local.manifest_sha256) if local and local.step == best else bytes(32)
        digests = self.comm.gather_ints(list(digest))
        holders = [r for r, s in enumerate(steps) if s == best]
        source = holders[0]
        everyone_same = len(holders) == self.comm.size and all(d == digests[source] for d in digests)
        payload = read_checkpoint(local.path) if local is not None and local.step == best else None
        if everyone_same:
            if payload is None:  # everyone_same implies this rank verified the agreed checkpoint
                raise TrainingError(f"internal: no local copy of step {best} although all ranks report one")
            weights, opt_state, state = payload
        else:
            weights, opt_state, state = self._broadcast_checkpoint(payload, source)
        self.apply_checkpoint(weights, opt_state)
        if state.get("config_digest") != cfg.digest():
            self.log.emit(EventKind.WARNING, code="config_changed",
                          message="the checkpoint was written under other training settings (config digest "
                                  "differs); continuing with the current ones")
        return ResumeState(step=int(state["step"]), data_position=int(state["data_position"]),
                           checkpoint=root / step_dir_name(best), state=state)

    def _broadcast_checkpoint(
        self, payload: tuple[dict[str, mx.array], dict[str, mx.array], dict[str, Any]] | None, source: int
    ) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, Any]]:
        # Templates (names/shapes/dtypes) come from this rank's own model and freshly initialised optimizer; the
        # source checks its checkpoint against the same templates first, and every rank learns the verdict
        # before any large transfer (a mismatch must not leave peers waiting in a collective).
        w_tmpl, o_tmpl = self.checkpoint_arrays()
        problem = ""
        if self.rank == source:
            problem = ("source has no checkpoint" if payload is None else
                       mismatch(payload[0], w_tmpl, "weights") or mismatch(payload[1], o_tmpl, "optimizer state"))
        verdicts = self.comm.gather_ints([1 if problem else 0])
        if any(v for (v,) in verdicts):
            raise TrainingError(f"checkpoint held by rank {source} does not fit this model"
                                + (f": {problem}" if problem else ""))
        mine = self.rank == source and payload is not None
        weights = self.comm.broadcast_arrays(payload[0] if mine and payload else w_tmpl, source)
        opt_state = self.comm.broadcast_arrays(payload[1] if mine and payload else o_tmpl, source)
        raw = json.dumps(payload[2], sort_keys=True).encode() if mine and payload else None
        state = json.loads(self.comm.broadcast_bytes(raw, source).decode())
        return weights, opt_state, state

    def apply_checkpoint(self, weights: dict[str, mx.array], opt_state: dict[str, mx.array]) -> None:
        """Load checkpointed weights and optimizer state (named as `checkpoint_arrays` names them)."""
        w_tmpl, o_tmpl = self.checkpoint_arrays()
        problem = mismatch(weights, w_tmpl, "weights") or mismatch(opt_state, o_tmpl, "optimizer state")
        if problem:
            raise TrainingError(f"checkpoint does not fit this model: {problem}")
        self.model.load_weights(list(weights.items()), strict=False)
        self.optimizer.state = tree_map_with_path(lambda path, _: opt_state[path], self.optimizer.state)
        # The config's learning rate wins over the saved one (a deliberate change on resume is honoured).
        self.optimizer.learning_rate = self.config.learning_rate
        mx.eval(self.model.parameters(), self.optimizer.state)

