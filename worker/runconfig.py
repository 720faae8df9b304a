"""The run config (`run.json`) that `python -m worker.train --config FILE` reads: parsing, validation, plan math.

The same file is given to every rank (the coordinator only fills `run_dir` per node). Keys (defaults in
parentheses; unknown keys are rejected so a typo cannot silently change a run):

    run_id            str, required
    model             str, required: a local model dir (`mlx_lm.utils.load`); nothing is downloaded
    data              str, required: a local dir with train.jsonl [valid.jsonl] (mlx-lm text/chat/completions)
    method            "lora" | "dora" | "full" | "dpo" ("lora")
    dpo               for method "dpo": {"beta": 0.1, "reference": null | model dir, "fine_tune_type": "lora" |
                      "dora" | "full"}: preference pairs, a frozen reference model (null: a second copy of
                      `model`), and which parameters train (see worker.dpo)
    iters             optimizer steps (1000)
    learning_rate     (1e-5)       optimizer   "adam" | "adamw" | "sgd" ("adam")
    max_seq_length    (2048)       grad_accumulation  micro-batches per optimizer step (1)
    grad_checkpoint   (false)      mask_prompt        (false; chat/completions only, as in mlx-lm)
    packing           "auto" | "on" | "off" ("auto"): a rank's SFT rows packed into as few sequences as they fit
                      in, block-diagonal attention per row (worker.step): the same rows, loss and gradient
                      without the padding; auto packs when that saves >= 10% of the computed positions and is
                      exact on the model
    clear_cache       (false)      mx.clear_cache() after every step (mlx-lm's trainer does): lower peak memory,
                      slower steps
    memory_headroom   (0.1)        a step holds at most its working set x (1 + this) (worker.memory: MLX's eval
                      waits for queued work above it); null: no bound
    train_embeddings  (false)      full on all layers only: also train embeddings, lm_head and the final norm
                      (mlx-lm's full trains the transformer layers only, and so do we by default)
    num_layers        null | -1 | N (null): the last N transformer layers are adapted (lora/dora) or trained
                      (full); null and -1 mean ALL layers (mlx-lm's CLI silently defaults to 16: we do not)
    lora              {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": null}
    save_every        checkpoint every N steps, 0 = only at the end (100)
    steps_per_eval    eval every N steps and at the end, 0 = never (200)
    val_batches       global batches per eval, -1 = the whole validation set (25)
    seed              (0)          keep_checkpoints   newest N kept per node (2)
    ranks             required: [{"rank": 0, "node": "a", "batch_size": 3}, ...], ranks 0..N-1 exactly once
    layout            how the ranks share the work ({"kind": "dp"}): `worker.parallel` runs it
                        {"kind": "dp"}  data parallel: every rank holds the whole model and takes its
                                        `batch_size` rows of each global batch (the sum of the batch sizes)
                        {"kind": "fsdp"}  as dp, with parameters, gradients and optimizer state sharded over
                                        the ranks (`nn.fully_shard`; needs a backend with sum_scatter: nccl)
                        {"kind": "pipeline", "stages": [{"rank": 0, "first_layer": 0, "last_layer": 5}, ...],
                         "micro_batches": 8, "schedule": "1f1b" | "gpipe"}
                                        pipeline parallel: rank r holds transformer blocks
                                        [first_layer, last_layer) (embeddings with the first stage, final norm
                                        and lm_head with the last); stage order is rank order, the ranges are
                                        contiguous and cover the model; every rank's `batch_size` is the global
                                        batch (all equal), split into `micro_batches` (<= the global batch).
                                        SFT only (method lora, dora or full; not dpo, not train_embeddings)
    cpu_shares        {"<rank>": [index, count], ...} ({}): ranks that share a machine and compute on its CPU, each
                      pinned to the index-th of `count` equal slices of the CPUs it may use (worker.cpus)
    token_census      (0)          N > 0: rank 0's `started` event reports `step_tokens_median`, the median real
                      tokens of the steps 1..N of the data order (the first epoch's at most; evenly sampled
                      past CENSUS_STEPS of them), each step's tokens (`census_tokens`) and the steps on which
                      some rank meets a new batch shape (`census_new_shape`): a rehearsal's run, so its rate can be
                      moved to the run's steps (worker.objectives.step_census, coordinator/planning/steptime.py)
    run_dir           this node's run dir ("~" expanded; "" = the directory holding the config file)
    resume            (false)      heartbeat_s        (1.0; clamped to <= 2.0)
    restart_from_scratch  (false): on resume, when checkpoints exist but none is valid on any rank, set them
                      aside and start at step 0 (without it every rank refuses: worker.train.ResumeRefused)
    consistency_every replica-consistency digests every N steps and at the last step, 0 = off (50): every rank
                      emits a `digest` event (digests of all its parameters and of its optimizer state, see
                      `worker.chaos.replica_digest`); honest data-parallel replicas give identical digests
    fence             {"factor": F, "min_s": S} or null (null): a rank that has been inside one step for F x its
                      median step time and at least S seconds of its own running time stops itself (an `error`
                      event with `fenced`, exit 75), so a stalled ring whose coordinator cannot reach it does not
                      spin forever (worker.events.Fence)
    chaos             deliberate faults for tests and drills ([]): a list of
                      {"kind": K, "rank": R, "step": S (1), "factor": F (3.0)}, each acting on rank R only:
                        kill     SIGKILL itself at the start of step S (an abrupt crash: no error event)
                        hang     SIGSTOP itself at the start of step S (heartbeats stop, peers block)
                        nan      its local loss sum and gradient become NaN at step S, before the all_sum
                        diverge  its trainable weights get seeded noise right after step S's update
                        lie      from step S on its `step` events claim step+1000 and 10x tokens/throughput
                        slow     from step S on it sleeps (F-1) x its compute time before the all_sum
                        stall    at step S it waits forever before the all_sum, heartbeating (peers spin)
                      rank must be a rank of the plan, step >= 1, factor >= 1 (used by slow only); the worker
                      applies whatever the file holds (a relaunch after the fault must leave chaos out)
    debug             test hooks, never set by the coordinator: {"crash_at_step": N} raises at the start of
                      step N (an error event, exit 1); {"slow_step": N, "slow_rank": R, "slow_seconds": S}
                      makes rank R (every rank when R is null) sleep S seconds in step N just before the
                      gradient all_sum (its peers block inside the collective)

Neither `consistency_every` nor `chaos`/`debug` is part of `RunConfig.digest()` (they do not change the math
of an honest run).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_HEADROOM = 0.10  # train.memory_headroom: the run-ahead a step may hold beyond its working set (worker.memory)

METHODS = ("lora", "dora", "full", "dpo")
FINE_TUNE_TYPES = ("lora", "dora", "full")
CHAOS_KINDS = ("kill", "hang", "nan", "diverge", "lie", "slow", "stall")
OPTIMIZERS = ("adam", "adamw", "sgd")
LAYOUT_KINDS = ("dp", "fsdp", "pipeline")
SCHEDULES = ("1f1b", "gpipe")
PACKING = ("auto", "on", "off")
MAX_HEARTBEAT_S = 2.0


class ConfigError(ValueError):
    """The run config is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class RankSpec:
    rank: int
    node: str
    batch_size: int


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: `rank` holds transformer blocks [first_layer, last_layer) (last_layer exclusive)."""

    rank: int
    first_layer: int
    last_layer: int

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True)
class Layout:
    """How the ranks share the work: `dp` (every rank a full replica) or `pipeline` (`stages`, one per rank in
    rank order; `micro_batches` per global batch; `schedule` 1f1b or gpipe). `worker.parallel` runs it."""

    kind: str = "dp"
    stages: tuple[StageSpec, ...] = ()
    micro_batches: int = 1
    schedule: str = "1f1b"

    def stage(self, rank: int) -> StageSpec:
        return self.stages[rank]

    def to_json(self) -> dict[str, Any]:
        if self.kind != "pipeline":
            return {"kind": self.kind}
        return {"kind": self.kind, "stages": [asdict(s) for s in self.stages], "micro_batches": self.micro_batches,
                "schedule": self.schedule}


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    keys: tuple[str, ...] | None = None

    def mlx_lm_parameters(self) -> dict[str, Any]:
        """The `lora_parameters` dict mlx-lm's linear_to_lora_layers and adapter_config.json use."""
        out: dict[str, Any] = {"rank": self.rank, "scale": self.scale, "dropout": self.dropout}
        if self.keys is not None:
            out["keys"] = list(self.keys)
        return out


@dataclass(frozen=True)
class DpoSpec:
    beta: float = 0.1
    reference: str | None = None  # None: the starting model
    fine_tune_type: str = "lora"


@dataclass(frozen=True)
class DebugSpec:
    crash_at_step: int | None = None
    slow_step: int | None = None
    slow_rank: int | None = None
    slow_seconds: float = 0.0


@dataclass(frozen=True)
class ChaosSpec:
    """One planned fault (see the module docstring); `worker.chaos` applies it."""

    kind: str
    rank: int
    step: int = 1
    factor: float = 3.0


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    model: str
    data: str
    ranks: tuple[RankSpec, ...]
    run_dir: Path
    layout: Layout = field(default_factory=Layout)
    method: str = "lora"
    iters: int = 1000
    learning_rate: float = 1e-5
    optimizer: str = "adam"
    max_seq_length: int = 2048
    grad_accumulation: int = 1
    grad_checkpoint: bool = False
    mask_prompt: bool = False
    packing: str = "auto"
    clear_cache: bool = False
    memory_headroom: float | None = DEFAULT_HEADROOM
    train_embeddings: bool = False
    num_layers: int | None = None
    lora: LoraSpec = field(default_factory=LoraSpec)
    dpo: DpoSpec = field(default_factory=DpoSpec)
    save_every: int = 100
    steps_per_eval: int = 200
    val_batches: int = 25
    seed: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    restart_from_scratch: bool = False
    heartbeat_s: float = 1.0
    consistency_every: int = 50
    fence: tuple[float, float] | None = None  # (factor, min_s)
    chaos: tuple[ChaosSpec, ...] = ()
    debug: DebugSpec = field(default_factory=DebugSpec)
    cpu_shares: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (index, count): worker.cpus
    token_census: int = 0  # the steps whose median real tokens rank 0 reports when it starts (a rehearsal's)

    # -- plan arithmetic ------------------------------------------------------------------------------------

    @property
    def fine_tune_type(self) -> str:
        """Which parameters train: `method`, or `dpo.fine_tune_type` for DPO."""
        return self.dpo.fine_tune_type if self.method == "dpo" else self.method

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def global_batch(self) -> int:
        """Rows per micro-batch over all ranks: the sum of the batch sizes (dp), or the batch size every stage
        shares (pipeline: each stage computes every row, through its own layers)."""
        if self.layout.kind == "pipeline":
            return self.ranks[0].batch_size
        return sum(r.batch_size for r in self.ranks)

    @property
    def rows_per_step(self) -> int:
        return self.global_batch * self.grad_accumulation

    def rank_spec(self, rank: int) -> RankSpec:
        return self.ranks[rank]

    def rank_offset(self, rank: int) -> int:
        """First row of `rank` inside each global batch: the sum of the earlier ranks' batch sizes."""
        return sum(r.batch_size for r in self.ranks[:rank])

    def checkpoint_writer(self, rank: int) -> int:
        """The rank that writes checkpoints on `rank`'s node: the lowest rank planned on the same node name.
        Ranks on one node share its run dir, so exactly one of them writes there."""
        node = self.ranks[rank].node
        return min(r.rank for r in self.ranks if r.node == node)

    def digest(self) -> str:
        """SHA256 over the settings that define the training math (not the plan, paths of output, schedule of
        saves/evals, iters, consistency digests, chaos or debug hooks): a resume under another digest continues
        a different experiment."""
        math = {
            "model": self.model, "data": self.data, "method": self.method, "learning_rate": self.learning_rate,
            "optimizer": self.optimizer, "max_seq_length": self.max_seq_length,
            "grad_accumulation": self.grad_accumulation, "mask_prompt": self.mask_prompt,
            "num_layers": self.num_layers, "lora": asdict(self.lora), "seed": self.seed,
        }
        # Written only when not the default, so the digest of runs from before these keys is unchanged.
        if self.packing != "auto":
            math["packing"] = self.packing
        if self.train_embeddings:
            math["train_embeddings"] = True
        if self.method == "dpo":
            math["dpo"] = asdict(self.dpo)
        return hashlib.sha256(json.dumps(math, sort_keys=True, default=list).encode()).hexdigest()

    def plan_json(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.ranks]

    def to_json(self) -> dict[str, Any]:
        """The run.json this config is read from: `parse_run_config(c.to_json())` gives `c` back (paths with
        "~" come back expanded: the node expands them). The coordinator builds a RunConfig and writes this, so
        writer and reader share one record. `dpo` only for DPO, `debug` only when set (the parser rejects a
        `dpo` section for other methods; the coordinator never sets debug hooks)."""
        out: dict[str, Any] = {
            "run_id": self.run_id, "model": self.model, "data": self.data, "method": self.method,
            "iters": self.iters, "learning_rate": self.learning_rate, "optimizer": self.optimizer,
            "max_seq_length": self.max_seq_length, "grad_accumulation": self.grad_accumulation,
            "grad_checkpoint": self.grad_checkpoint, "mask_prompt": self.mask_prompt, "packing": self.packing,
            "clear_cache": self.clear_cache, "memory_headroom": self.memory_headroom,
            "train_embeddings": self.train_embeddings, "num_layers": self.num_layers,
            "lora": self.lora.mlx_lm_parameters(), "save_every": self.save_every,
            "steps_per_eval": self.steps_per_eval, "val_batches": self.val_batches, "seed": self.seed,
            "keep_checkpoints": self.keep_checkpoints,
            "ranks": self.plan_json(), "run_dir": str(self.run_dir), "resume": self.resume,
            "restart_from_scratch": self.restart_from_scratch, "heartbeat_s": self.heartbeat_s,
            "consistency_every": self.consistency_every,
            "fence": None if self.fence is None else {"factor": self.fence[0], "min_s": self.fence[1]},
            "chaos": [asdict(c) for c in self.chaos],
        }
        if self.method == "dpo":
            out["dpo"] = asdict(self.dpo)
        if self.debug != DebugSpec():
            out["debug"] = asdict(self.debug)
        if self.layout != Layout():
            out["layout"] = self.layout.to_json()
        if self.cpu_shares:
            out["cpu_shares"] = {str(rank): list(share) for rank, share in sorted(self.cpu_shares.items())}
        if self.token_census:
            out["token_census"] = self.token_census
        return out


# --- parsing -----------------------------------------------------------------------------------------------------

_TOP_KEYS = {
    "run_id", "model", "data", "method", "iters", "learning_rate", "optimizer", "max_seq_length",
    "grad_accumulation", "grad_checkpoint", "mask_prompt", "packing", "clear_cache", "memory_headroom",
    "train_embeddings", "num_layers", "lora",
    "save_every", "steps_per_eval", "val_batches", "seed", "keep_checkpoints", "ranks", "run_dir", "resume",
    "restart_from_scratch", "heartbeat_s", "consistency_every", "chaos", "debug", "dpo", "fence", "layout",
    "cpu_shares", "token_census",
}
_CHAOS_KEYS = {"kind", "rank", "step", "factor"}


def _int(d: Mapping[str, Any], key: str, default: int | None, *, minimum: int | None = None) -> int:
    value = d.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    return value


def _float(d: Mapping[str, Any], key: str, default: float | None, *, positive: bool = False) -> float:
    value = d.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{key} must be > 0, got {value}")
    return float(value)


def _headroom(d: Mapping[str, Any]) -> float | None:
    if d.get("memory_headroom", DEFAULT_HEADROOM) is None:
        return None
    value = _float(d, "memory_headroom", DEFAULT_HEADROOM)
    if value < 0:
        raise ConfigError(f"memory_headroom must be >= 0 or null, got {value}")
    return value


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _str(d: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = d.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _choice(d: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = _str(d, key, default).lower()
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _parse_ranks(raw: Any) -> tuple[RankSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("ranks must be a non-empty list of {rank, node, batch_size}")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"ranks[{i}] must be an object")
        unknown = set(item) - {"rank", "node", "batch_size"}
        if unknown:
            raise ConfigError(f"ranks[{i}]: unknown keys {sorted(unknown)}")
        specs.append(RankSpec(rank=_int(item, "rank", None, minimum=0), node=_str(item, "node"),
                              batch_size=_int(item, "batch_size", None, minimum=1)))
    specs.sort(key=lambda r: r.rank)
    if [r.rank for r in specs] != list(range(len(specs))):
        raise ConfigError(f"ranks must number 0..{len(specs) - 1} exactly once, got {[r.rank for r in specs]}")
    return tuple(specs)


def _parse_layout(raw: Any, ranks: tuple[RankSpec, ...]) -> Layout:
    """`layout` ({"kind": "dp"} when absent). A pipeline names one stage per rank, in rank order, with contiguous
    layer ranges from layer 0 on (that they end at the model's last layer is checked against the model when a
    stage loads: the config alone does not know the model's depth)."""
    if raw is None:
        return Layout()
    if not isinstance(raw, dict):
        raise ConfigError("layout must be an object")
    try:
        kind = _choice(raw, "kind", "dp", LAYOUT_KINDS)
    except ConfigError as exc:
        raise ConfigError(f"layout.{exc}") from None
    if kind in ("dp", "fsdp"):
        if set(raw) - {"kind"}:
            raise ConfigError(f"layout: unknown keys for kind {kind} {sorted(set(raw) - {'kind'})}")
        return Layout(kind=kind)
    unknown = set(raw) - {"kind", "stages", "micro_batches", "schedule"}
    if unknown:
        raise ConfigError(f"layout: unknown keys {sorted(unknown)}")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or len(stages_raw) != len(ranks):
        raise ConfigError(f"layout.stages must list one stage per rank ({len(ranks)}), got {stages_raw!r}")
    stages = []
    for i, item in enumerate(stages_raw):
        if not isinstance(item, dict) or set(item) != {"rank", "first_layer", "last_layer"}:
            raise ConfigError(f"layout.stages[{i}] must be {{rank, first_layer, last_layer}}, got {item!r}")
        try:
            stage = StageSpec(rank=_int(item, "rank", None, minimum=0),
                              first_layer=_int(item, "first_layer", None, minimum=0),
                              last_layer=_int(item, "last_layer", None, minimum=1))
        except ConfigError as exc:
            raise ConfigError(f"layout.stages[{i}].{exc}") from None
        stages.append(stage)
    stages.sort(key=lambda s: s.rank)
    if [s.rank for s in stages] != list(range(len(ranks))):
        raise ConfigError(f"layout.stages must name ranks 0..{len(ranks) - 1} exactly once, "
                          f"got {[s.rank for s in stages]}")
    end = 0
    for s in stages:
        if s.first_layer != end or s.last_layer <= s.first_layer:
            raise ConfigError(f"layout.stages: rank {s.rank} holds layers [{s.first_layer}, {s.last_layer}), but "
                              f"stages must be non-empty and contiguous in rank order (expected it to start at {end})")
        end = s.last_layer
    batches = {r.batch_size for r in ranks}
    if len(batches) != 1:
        raise ConfigError(f"layout pipeline: every rank computes every row, so every batch_size is the global batch "
                          f"and must be equal, got {sorted(batches)}")
    try:
        micro = _int(raw, "micro_batches", 1, minimum=1)
        schedule = _choice(raw, "schedule", "1f1b", SCHEDULES)
    except ConfigError as exc:
        raise ConfigError(f"layout.{exc}") from None
    if micro > ranks[0].batch_size:
        raise ConfigError(f"layout.micro_batches {micro} exceeds the global batch of {ranks[0].batch_size} rows")
    return Layout(kind="pipeline", stages=tuple(stages), micro_batches=micro, schedule=schedule)


def _parse_lora(raw: Any) -> LoraSpec:
    if raw is None:
        return LoraSpec()
    if not isinstance(raw, dict):
        raise ConfigError("lora must be an object")
    unknown = set(raw) - {"rank", "scale", "dropout", "keys"}
    if unknown:
        hint = " (mlx-lm uses 'scale', not 'alpha')" if "alpha" in unknown else ""
        raise ConfigError(f"lora: unknown keys {sorted(unknown)}{hint}")
    dropout = _float(raw, "dropout", 0.0)
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {dropout}")
    keys = raw.get("keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise ConfigError("lora.keys must be null or a list of module paths")
    return LoraSpec(rank=_int(raw, "rank", 8, minimum=1), scale=_float(raw, "scale", 20.0), dropout=dropout,
                    keys=tuple(keys) if keys is not None else None)


def _parse_dpo(raw: Any, method: str) -> DpoSpec:
    if raw is None:
        return DpoSpec()
    if method != "dpo":
        raise ConfigError(f"dpo settings given but method is {method!r}")
    if not isinstance(raw, dict):
        raise ConfigError("dpo must be an object")
    unknown = set(raw) - {"beta", "reference", "fine_tune_type"}
    if unknown:
        raise ConfigError(f"dpo: unknown keys {sorted(unknown)}")
    reference = raw.get("reference")
    if reference is not None and (not isinstance(reference, str) or not reference):
        raise ConfigError("dpo.reference must be null or a model dir")
    return DpoSpec(beta=_float(raw, "beta", 0.1, positive=True),
                   reference=os.path.expanduser(reference) if reference else None,
                   fine_tune_type=_choice(raw, "fine_tune_type", "lora", FINE_TUNE_TYPES))


def _parse_debug(raw: Any) -> DebugSpec:
    if raw is None:
        return DebugSpec()
    if not isinstance(raw, dict):
        raise ConfigError("debug must be an object")
    unknown = set(raw) - {"crash_at_step", "slow_step", "slow_rank", "slow_seconds"}
    if unknown:
        raise ConfigError(f"debug: unknown keys {sorted(unknown)}")
    opt = {k: (_int(raw, k, None) if raw.get(k) is not None else None)
           for k in ("crash_at_step", "slow_step", "slow_rank")}
    return DebugSpec(crash_at_step=opt["crash_at_step"], slow_step=opt["slow_step"], slow_rank=opt["slow_rank"],
                     slow_seconds=_float(raw, "slow_seconds", 0.0))


def _parse_chaos(raw: Any, world_size: int) -> tuple[ChaosSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("chaos must be a list of {kind, rank, step, factor}")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"chaos[{i}] must be an object")
        unknown = set(item) - _CHAOS_KEYS
        if unknown:
            raise ConfigError(f"chaos[{i}]: unknown keys {sorted(unknown)}")
        kind = item.get("kind")
        if kind not in CHAOS_KINDS:
            raise ConfigError(f"chaos[{i}].kind must be one of {', '.join(CHAOS_KINDS)}, got {kind!r}")
        try:
            rank = _int(item, "rank", None, minimum=0)
            step = _int(item, "step", 1, minimum=1)
            factor = _float(item, "factor", 3.0)
        except ConfigError as exc:
            raise ConfigError(f"chaos[{i}].{exc}") from None
        if rank >= world_size:
            raise ConfigError(f"chaos[{i}].rank {rank} is not a rank of the plan (0..{world_size - 1})")
        if factor < 1.0:
            raise ConfigError(f"chaos[{i}].factor must be >= 1, got {factor}")
        specs.append(ChaosSpec(kind=kind, rank=rank, step=step, factor=factor))
    return tuple(specs)


def parse_run_config(raw: Any, config_path: Path | None = None) -> RunConfig:
    """Validate a decoded run.json into a RunConfig; raises ConfigError with the first problem found."""
    if not isinstance(raw, dict):
        raise ConfigError("the run config must be a JSON object")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    num_layers = raw.get("num_layers")
    if num_layers is not None:
        num_layers = _int(raw, "num_layers", None, minimum=-1)
        if num_layers == 0:
            raise ConfigError("num_layers must be null/-1 (all layers) or >= 1")
        if num_layers == -1:
            num_layers = None
    val_batches = _int(raw, "val_batches", 25, minimum=-1)
    run_dir_raw = raw.get("run_dir", "")
    if not isinstance(run_dir_raw, str):
        raise ConfigError("run_dir must be a string")
    if run_dir_raw:
        run_dir = Path(os.path.expanduser(run_dir_raw))
    elif config_path is not None:
        run_dir = config_path.resolve().parent
    else:
        raise ConfigError("run_dir is empty and there is no config file to take it from")
    ranks = _parse_ranks(raw.get("ranks"))
    method = _choice(raw, "method", "lora", METHODS)
    config = RunConfig(
        run_id=_str(raw, "run_id"),
        model=os.path.expanduser(_str(raw, "model")),
        data=os.path.expanduser(_str(raw, "data")),
        ranks=ranks,
        run_dir=run_dir,
        layout=_parse_layout(raw.get("layout"), ranks),
        method=method,
        dpo=_parse_dpo(raw.get("dpo"), method),
        iters=_int(raw, "iters", 1000, minimum=1),
        learning_rate=_float(raw, "learning_rate", 1e-5, positive=True),
        optimizer=_choice(raw, "optimizer", "adam", OPTIMIZERS),
        max_seq_length=_int(raw, "max_seq_length", 2048, minimum=2),
        grad_accumulation=_int(raw, "grad_accumulation", 1, minimum=1),
        grad_checkpoint=_bool(raw, "grad_checkpoint", False),
        mask_prompt=_bool(raw, "mask_prompt", False),
        packing=_choice(raw, "packing", "auto", PACKING),
        clear_cache=_bool(raw, "clear_cache", False),
        memory_headroom=_headroom(raw),
        train_embeddings=_bool(raw, "train_embeddings", False),
        num_layers=num_layers,
        lora=_parse_lora(raw.get("lora")),
        save_every=_int(raw, "save_every", 100, minimum=0),
        steps_per_eval=_int(raw, "steps_per_eval", 200, minimum=0),
        val_batches=val_batches,
        seed=_int(raw, "seed", 0),
        keep_checkpoints=_int(raw, "keep_checkpoints", 2, minimum=1),
        resume=_bool(raw, "resume", False),
        restart_from_scratch=_bool(raw, "restart_from_scratch", False),
        heartbeat_s=min(_float(raw, "heartbeat_s", 1.0, positive=True), MAX_HEARTBEAT_S),
        consistency_every=_int(raw, "consistency_every", 50, minimum=0),
        fence=_parse_fence(raw.get("fence")),
        chaos=_parse_chaos(raw.get("chaos"), len(ranks)),
        debug=_parse_debug(raw.get("debug")),
        cpu_shares=_parse_cpu_shares(raw.get("cpu_shares"), len(ranks)),
        token_census=_int(raw, "token_census", 0, minimum=0),
    )
    if config.train_embeddings and (config.fine_tune_type != "full" or config.num_layers not in (None, -1)):
        raise ConfigError("train_embeddings needs full fine-tuning of all layers (num_layers null or -1)")
    if config.layout.kind == "pipeline":
        # Refused here, before any rank loads a model: each is a feature the pipeline stages do not implement.
        if config.method == "dpo":
            raise ConfigError("layout pipeline does not train DPO (its reference model and pair loss are not "
                              "split over stages): use layout dp, or method lora/dora/full")
        if config.train_embeddings:
            raise ConfigError("layout pipeline does not train embeddings/lm_head (train_embeddings): the first and "
                              "last stages would both hold tied embeddings")
    return config


def _parse_cpu_shares(raw: Any, world: int) -> dict[int, tuple[int, int]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError('cpu_shares must be an object {"<rank>": [index, count]}')
    out: dict[int, tuple[int, int]] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < world):
            raise ConfigError(f"cpu_shares: {key!r} is not a rank of this run (0..{world - 1})")
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1])
        if not ok:
            raise ConfigError(f"cpu_shares[{key}] must be [index, count] with 0 <= index < count, got {value!r}")
        out[int(key)] = (value[0], value[1])
    return out


def _parse_fence(raw: Any) -> tuple[float, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"factor", "min_s"}:
        raise ConfigError('fence must be null or {"factor": F, "min_s": S}')
    factor = _float(raw, "factor", None, positive=True)
    min_s = _float(raw, "min_s", None, positive=True)
    return factor, min_s


def load_run_config(path: Path) -> RunConfig:
    """Read and validate a run.json; OSError / ConfigError on failure."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    return parse_run_config(raw, path)
