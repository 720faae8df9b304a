"""Which training strategy a fleet runs: `dp` (every rank holds a full replica: on every node, on the nodes that
hold one, or one node solo), `pipeline` (each node a contiguous range of blocks: `planning.pipeline`) or `fsdp`
(mlx's `nn.fully_shard`: parameters, gradients and optimizer state split across the ranks). Pure: the model's
shape, the playbook's train section and each node's budget (and, after calibration, its curve and per-block time)
in; a decision out, or `StrategyError` with the numbers per node. docs/strategy.md says what is computed and what
was not measured.

Two entry points:
- `compute_strategy`: by memory alone (preflight's lint and resources check, launch's refusal): dp when a replica
  fits every node, else a pipeline (not over nccl), else dp on the nodes whose replica fits, else fsdp (refused
  before launch on a backend without sum_scatter), else a refusal.
- `compute_strategy_choice`: after calibration, every candidate weighed by predicted tokens/s, one line each.

Per rank, from `estimate.estimate_training_memory` (the same estimate the resources check uses):
- dp: weights + grads + Adam state + activations (+ DPO's reference copy), all whole.
- pipeline: a stage's share (`pipeline.compute_stage_memory`).
- fsdp: (weights + grads + Adam state) / world size (LoRA: the frozen base weights / world size, the adapters with
  their grads and Adam state whole), plus the largest unit gathered at once in bf16 (one
  transformer block, or the embedding when that is larger: `fully_shard` gathers a wrapped module's parameters for
  its forward), plus the activations (not sharded: each rank runs its own batch) and the reference, whole.

The worker runs all three (`worker.parallel.dp`, `worker.parallel.pipeline`, `worker.parallel.fsdp`). fsdp needs a
backend with `sum_scatter` (the reduce-scatter of the gradients in `fully_shard`'s backward): mlx 0.32.4's ring
raises `[ring] sum_scatter not supported`, mpi `[mpi] sum_scatter not yet implemented` (both strings are in
libmlx.so). nccl has a native reduce-scatter (run on 2x H100); jaccl has had one since mlx 0.32.1 (mlx PR#3901; not
run here). nccl has no send/recv: no pipeline over nccl, so on nccl `auto` chooses between dp and fsdp by memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from coordinator.config.playbook import TrainConfig
from coordinator.errors import CoordinatorError
from coordinator.facts.model import NodeFacts
from coordinator.planning.collective import (
    CollectiveCost,
    CollectiveError,
    CostSource,
    derive_collective,
    ring_allreduce_s,
)
from coordinator.planning.estimate import ModelShape, estimate_training_memory, usable_memory
from coordinator.planning.pipeline import (
    LayerTiming,
    LinkTable,
    PipelineJob,
    PipelinePlan,
    StageNode,
    block_params,
    check_layer_split,
    compute_layer_split,
    link_between,
)
from coordinator.planning.plan import NodeCalibration, Plan, PlanError, compute_plan, with_collective
from coordinator.units import format_bytes

Strategy = Literal["dp", "pipeline", "fsdp"]

# nccl: run on 2x H100 (docs/benchmarks.md). jaccl, jaccl-ring: sum_scatter since mlx 0.32.1 (mlx PR#3901), not run here.
SUM_SCATTER_BACKENDS = frozenset({"nccl", "jaccl", "jaccl-ring"})
# Backends without point-to-point send/recv: "Send has no CUDA implementation" (mlx 0.32.4's nccl).
NO_SEND_RECV_BACKENDS = frozenset({"nccl"})
MLX_VERSION = "0.32.4"


class StrategyError(CoordinatorError):
    """No strategy fits the fleet (or the forced one does not): the message names each node's numbers."""


@dataclass(frozen=True)
class NodeBudget:
    """What one node's training process can use, and whether its attention backward is fused (Metal, CUDA)."""

    usable: int
    fused_attention: bool = True


@dataclass(frozen=True)
class NodeNeed:
    node: str
    usable: int
    dp: int
    fsdp: int

    @property
    def fits_dp(self) -> bool:
        return self.dp <= self.usable

    @property
    def fits_fsdp(self) -> bool:
        return self.fsdp <= self.usable


@dataclass(frozen=True)
class StrategyDecision:
    requested: str  # auto | dp | pipeline | fsdp
    strategy: Strategy
    world_size: int
    needs: tuple[NodeNeed, ...]
    pipeline: PipelinePlan | None = None  # the memory-fitting split (balanced blocks: no timings before calibration)
    nodes: tuple[str, ...] = ()  # the nodes the plan trains on (all but those whose replica does not fit: dp on some)

    @property
    def left_out(self) -> tuple[NodeNeed, ...]:
        """Nodes the plan does not use (dp on the nodes that fit)."""
        return tuple(n for n in self.needs if self.nodes and n.node not in self.nodes)

    def describe(self) -> str:
        how = "chosen by auto" if self.requested == "auto" else "forced"
        if self.left_out:
            out = "; ".join(f"{n.node} ({_gb(n.usable)} usable, a replica needs ~{_gb(n.dp)})" for n in self.left_out)
            return f"dp ({how}) on {', '.join(self.nodes)}: the other nodes cannot hold a replica: {out}"
        if self.pipeline is not None:
            stages = ", ".join(f"{s.node} {s.layers} blocks ~{_gb(s.need)} of {_gb(s.budget)}"
                               for s in self.pipeline.stages)
            return f"pipeline ({how}): {stages} (the split is recomputed by speed after calibration)"
        smallest = min(self.needs, key=lambda n: n.usable)
        return (f"{self.strategy} ({how}): per node dp "
                f"~{_gb(smallest.dp)}, fsdp over {self.world_size} ~{_gb(smallest.fsdp)}; smallest node "
                f"{smallest.node} has {_gb(smallest.usable)} usable")


def _gb(n: int) -> str:
    """A memory size in words (`coordinator.units.format_bytes`): a tiny model's 986 KiB is not "0.0 GiB"."""
    return format_bytes(n)


def per_rank_need(shape: ModelShape, train: TrainConfig, *, world_size: int, budget: NodeBudget) -> tuple[int, int]:
    """(dp, fsdp) bytes one rank needs, at the batch per rank the resources check uses (the global batch split
    evenly)."""
    per_rank = max(1, -(-train.batch_size // max(1, world_size)))
    est = estimate_training_memory(
        shape, method=train.fine_tune_type, batch_per_rank=per_rank * train.rows_per_example,
        seq_len=train.max_seq_length, layers_trained=train.num_layers, grad_checkpoint=train.grad_checkpoint,
        with_reference=train.method == "dpo", fused_attention=budget.fused_attention, lora_rank=train.lora.rank)
    world = max(1, world_size)
    if train.fine_tune_type == "full":
        sharded = -(-(est.weights + est.grads + est.optimizer) // world)
    else:
        # LoRA: the frozen base weights are sharded; the adapters, their grads and Adam state stay whole on every
        # rank (worker.parallel.fsdp shards only modules that are all frozen or all trainable).
        base = shape.dtype_bytes * shape.params
        sharded = -(-base // world) + (est.weights - base) + est.grads + est.optimizer
    gathered = 2 * max(block_params(shape), shape.vocab * shape.hidden)
    return est.total, sharded + gathered + est.activations + est.reference


def compute_strategy(requested: str, shape: ModelShape, train: TrainConfig,
                     budgets: Mapping[str, NodeBudget], *, backend: str = "ring") -> StrategyDecision:
    """The strategy for a fleet of `budgets` (node -> usable memory, ring order), by memory alone (preflight: no
    calibration yet). `requested` auto picks, in this order: dp when a replica fits every node; a pipeline over
    the nodes when one fits (not on a backend without send/recv); dp on the nodes whose replica fits (some, or
    one solo; `nodes` names them); fsdp when a shard fits every node (full or LoRA: a LoRA run shards its frozen
    base weights; DoRA never: its layers read the base weight directly). dp, pipeline or fsdp forced must fit
    every node. StrategyError (with every node's numbers) otherwise. After calibration, `compute_strategy_choice`
    weighs the plans by speed."""
    if not budgets:
        raise StrategyError("no node memory known: the strategy cannot be planned")
    world = len(budgets)
    needs = tuple(NodeNeed(name, b.usable, *per_rank_need(shape, train, world_size=world, budget=b))
                  for name, b in budgets.items())
    dp_fits = all(n.fits_dp for n in needs)
    fsdp_fits = all(n.fits_fsdp for n in needs)
    shardable = train.fine_tune_type != "dora"
    pipeline: PipelinePlan | None = None
    pipeline_note = ""
    if requested == "pipeline" or (requested == "auto" and not dp_fits):
        nodes = [FleetNode(name, b) for name, b in budgets.items()]
        try:
            picked = compute_strategy_choice("pipeline", shape, train, nodes, backend=backend).chosen
            pipeline = picked.pipeline
        except StrategyError as exc:
            pipeline_note = str(exc).split(": ", 1)[-1]
    # A replica that fits a node alone fits it in any dp over fewer rows per rank: these nodes can train dp.
    alone = tuple(name for name, b in budgets.items()
                  if per_rank_need(shape, train, world_size=1, budget=b)[0] <= b.usable)
    used = tuple(budgets)
    if requested == "auto":
        chosen: Strategy | None
        if dp_fits:
            chosen = "dp"
        elif pipeline is not None:
            chosen = "pipeline"
        elif alone:
            chosen, used = "dp", alone
        else:
            chosen = "fsdp" if fsdp_fits and shardable else None
    elif requested == "pipeline":
        chosen = "pipeline" if pipeline is not None else None
    elif requested == "dp":
        chosen = "dp" if dp_fits else None
    else:
        chosen = "fsdp" if fsdp_fits else None
    if chosen is None:
        what = (f"{requested} does not fit" if requested != "auto" else "neither dp, a pipeline nor fsdp fits"
                if shardable else "neither dp nor a pipeline fits (dora: fsdp trains full or lora fine-tunes)")
        rows = "; ".join(f"{n.node}: {_gb(n.usable)} usable, dp needs ~{_gb(n.dp)}, fsdp over {world} needs "
                         f"~{_gb(n.fsdp)}" for n in needs)
        tail = f"; pipeline: {pipeline_note}" if pipeline_note else ""
        raise StrategyError(f"train.strategy {requested}: {what} ({rows}){tail}")
    return StrategyDecision(requested, chosen, world, needs, pipeline if chosen == "pipeline" else None, used)


def fsdp_refusal(backend: str) -> str | None:
    """Why an fsdp run cannot start on `backend` (the resolved one): the backend's missing `sum_scatter`; None where
    it has one (the worker runs fsdp: worker.parallel.fsdp)."""
    if backend not in SUM_SCATTER_BACKENDS:
        return (f"[{backend}] sum_scatter not supported (mlx {MLX_VERSION}): fsdp needs nccl (CUDA nodes) or jaccl")
    return None


def node_budget(facts: NodeFacts) -> NodeBudget | None:
    """The node's usable training memory, as the resources check reads it: an NVIDIA GPU's own memory, else the
    machine's (macOS: the GPU's default wired share; Linux: the cgroup memory limit where it is lower than RAM).
    None when the facts hold no memory size."""
    total = (facts.memory.total_bytes if facts.memory else None) or (
        facts.hardware.memory_bytes if facts.hardware else None)
    gpu = facts.gpu.devices[0] if facts.gpu is not None and facts.gpu.cuda and facts.gpu.devices else None
    is_mac = facts.os is not None and facts.os.is_macos
    if gpu is not None and gpu.memory_total_bytes:
        return NodeBudget(usable_memory(gpu.memory_total_bytes, is_macos=False), fused_attention=True)
    if total is None:
        return None
    # A rank inherits its SSH session's cgroup: a memory limit below RAM is what it can really use.
    limit = facts.cgroup_memory.limit_bytes if facts.cgroup_memory is not None else None
    if limit is not None and not is_mac:
        total = min(total, limit)
    return NodeBudget(usable_memory(total, is_macos=is_mac), fused_attention=is_mac)


# ----------------------------------------------------------------------------------------------------------------
# Weighing the plans: dp on every node, dp on the nodes that fit, one node solo, a pipeline over all or some nodes.


@dataclass(frozen=True)
class FleetNode:
    """One node as the planner sees it, in ring (inventory) order: its memory budget, its whole-model calibration
    curve in examples (None: not measured, e.g. it cannot hold the model) and its per-block timing (None: not
    measured)."""

    node: str
    budget: NodeBudget
    calibration: NodeCalibration | None = None
    timing: LayerTiming | None = None


@dataclass(frozen=True)
class PlanRow:
    """One node of a candidate: the blocks it holds ([first_layer, last_layer); a dp replica holds them all),
    its predicted memory need and budget, and its predicted time (a dp node's step, a stage's per micro-batch;
    None: not measured)."""

    node: str
    first_layer: int
    last_layer: int
    need: int
    budget: int
    time_s: float | None
    busy_s: float | None = None  # a pipeline stage's predicted compute per step (None: dp, or not timed)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "first_layer": self.first_layer, "last_layer": self.last_layer,
                "need_bytes": self.need, "budget_bytes": self.budget, "predicted_s": self.time_s,
                "predicted_busy_s": self.busy_s}


class CandidateKind(StrEnum):
    """The plans weighed, in the order `auto` prefers them where none is measured."""

    DP_ALL = "dp on every node"
    PIPELINE_ALL = "pipeline over every node"
    DP_SOME = "dp on the nodes that fit"
    PIPELINE_SOME = "pipeline over fewer nodes"
    SOLO = "solo"


KIND_ORDER = tuple(CandidateKind)
# How much faster (predicted) than dp on every node another plan must be for auto to choose it: calibration's own
# spread between two measurements of one machine is of this order (docs/calibration.md), and a plan that leaves
# nodes idle or cuts the model across them should not be picked on noise.
CHOICE_MARGIN = 0.10


@dataclass(frozen=True)
class Candidate:
    """One plan the planner weighed. `fits`: it fits memory (and, for dp, the calibrated split could be made);
    `tokens_per_s` None where no measurement predicts it; `note`: its numbers, or why it does not fit."""

    kind: CandidateKind
    label: str
    strategy: Strategy
    nodes: tuple[str, ...]
    fits: bool
    tokens_per_s: float | None
    note: str
    dp: Plan | None = None
    pipeline: PipelinePlan | None = None
    rows: tuple[PlanRow, ...] = ()

    def line(self, *, chosen: bool) -> str:
        rate = f"~{self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s is not None else "rate not measured"
        head = "chosen" if chosen else "fits" if self.fits else "does not fit"
        return f"{head}: {self.label}: " + (f"{rate}; {self.note}" if self.fits else self.note)


@dataclass(frozen=True)
class StrategyChoice:
    requested: str
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    why: str = ""  # why the chosen plan is not the one with the best predicted rate ("" when it is)

    def reasons(self) -> list[str]:
        """One line per candidate, the chosen one first (then why, when it is not the fastest predicted)."""
        rest = [c for c in self.candidates if c is not self.chosen]
        return [self.chosen.line(chosen=True), *(c.line(chosen=False) for c in rest), *([self.why] if self.why else [])]

    def table(self) -> list[tuple[str, ...]]:
        """The chosen plan as a table (header first): node, layers, memory need / budget, predicted stage time
        (a dp node's step), bubble, predicted tokens/s (the pipeline's on every stage; a dp node's own rate)."""
        c = self.chosen
        pipe = c.pipeline
        out: list[tuple[str, ...]] = [TABLE_HEADER]
        for row in c.rows:
            rate: float | None = c.tokens_per_s if pipe is not None else (
                c.dp.node_tokens_per_s(row.node) if c.dp is not None else None)
            out.append((row.node, f"{row.first_layer}-{row.last_layer - 1} ({row.last_layer - row.first_layer})",
                        f"{format_bytes(row.need)} / {format_bytes(row.budget)}",  # a tiny model's need is no 0.0 GiB
                        "-" if row.time_s is None else f"{row.time_s * 1000:,.1f} ms",
                        f"{pipe.bubble:.0%}" if pipe is not None else "-",
                        "-" if rate is None else f"{rate:,.0f}"))
        return out

    def to_json(self) -> dict[str, Any]:
        """plan.json's and `calibrate --json`'s `strategy` (docs/json.md)."""
        c, pipe = self.chosen, self.chosen.pipeline
        return {"requested": self.requested, "chosen": c.label, "strategy": c.strategy, "nodes": list(c.nodes),
                "predicted_tokens_per_s": c.tokens_per_s, "rows": [r.to_json() for r in c.rows],
                "micro_batches": pipe.micro_batches if pipe else None, "bubble": pipe.bubble if pipe else None,
                "predicted_step_s": pipe.step_s if pipe else None,
                "predicted_bubble": pipe.predicted_bubble if pipe else None,
                "activation_bytes": pipe.activation_bytes if pipe else None,
                "link_s": list(pipe.link_s) if pipe else None,
                "schedule": pipe.schedule if pipe else None, "layout": pipe.layout() if pipe else {"kind": "dp"},
                "candidates": [{"label": x.label, "strategy": x.strategy, "nodes": list(x.nodes), "fits": x.fits,
                                "predicted_tokens_per_s": x.tokens_per_s, "note": x.note} for x in self.candidates],
                "reasons": self.reasons()}


TABLE_HEADER = ("node", "layers", "memory need / budget", "predicted stage time", "bubble", "predicted tokens/s")


def format_table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Plain aligned text lines of a table (header first): what the launch prints through its message channel."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def pipeline_job(shape: ModelShape, train: TrainConfig, *, fill: float = 1.0) -> PipelineJob:
    """The playbook's training, as a pipeline sees it."""
    trained_from = shape.layers - min(train.num_layers, shape.layers) if train.num_layers else 0
    return PipelineJob(shape, train.fine_tune_type, seq_len=train.max_seq_length, global_batch=train.batch_size,
                       micro_batches=train.pipeline_micro_batches, trained_from=trained_from,
                       grad_checkpoint=train.grad_checkpoint, lora_rank=train.lora.rank,
                       train_embeddings=train.train_embeddings, with_reference=train.method == "dpo", fill=fill,
                       rows_per_example=train.rows_per_example)


def dp_exchange(nodes: Sequence[FleetNode], links: LinkTable, backend: str) -> CollectiveCost | None:
    """The gradient exchange a dp candidate over `nodes` (ring order) pays each step, derived by the ring model
    (`planning.collective.derive_collective`) from the links measured for the pipeline: its slowest link between
    ring neighbours and their largest latency. So a dp plan pays for what crosses the network as a pipeline pays
    for its activations, and `auto` weighs them alike (launch then measures the chosen dp's all_sum itself). A pair
    whose link was not measured (neighbours only in a smaller candidate's ring) counts free, as it does for a
    pipeline. None for one node, a bench that did not count the gradients, or no measured link in the ring."""
    gradients = next((n.calibration.gradients for n in nodes
                      if n.calibration is not None and n.calibration.gradients is not None), None)
    if len(nodes) < 2 or gradients is None:
        return None
    ring = [x for a, b in zip(nodes, [*nodes[1:], nodes[0]], strict=True)
            if (x := link_between(links, a.node, b.node)) is not None]
    if not ring:
        return None
    bandwidth = min(x.bytes_per_s for x in ring)
    latency = max(x.latency_s for x in ring)
    names = [n.node for n in nodes]
    try:
        if math.isinf(bandwidth):  # links that cost no measurable time per byte: the exchange is its latency
            hops = ring_allreduce_s(0, len(names), 1.0, latency)
            return CollectiveCost(hops, gradients.nbytes, len(names), backend, CostSource.DERIVED, small_s=hops,
                                  nodes=tuple(names))
        return derive_collective(gradients, names, backend, bandwidth, latency)
    except CollectiveError:
        return None


def _dp_candidate(kind: CandidateKind, label: str, shape: ModelShape, train: TrainConfig, nodes: Sequence[FleetNode],
                  split: str | Mapping[str, float], exchange: CollectiveCost | None = None) -> Candidate:
    names = tuple(n.node for n in nodes)
    needs = [(n, per_rank_need(shape, train, world_size=len(nodes), budget=n.budget)[0]) for n in nodes]
    over = [f"{n.node} needs ~{_gb(need)} of {_gb(n.budget.usable)}" for n, need in needs if need > n.budget.usable]
    if over:
        return Candidate(kind, label, "dp", names, False, None, "a replica per node: " + "; ".join(over))
    worst = max(needs, key=lambda x: x[1] / max(1, x[0].budget.usable))
    note = f"~{_gb(worst[1])} per node (most loaded: {worst[0].node}, {_gb(worst[0].budget.usable)})"
    cals = [n.calibration for n in nodes]
    if any(c is None for c in cals):
        return Candidate(kind, label, "dp", names, True, None, note,
                         rows=tuple(PlanRow(n.node, 0, shape.layers, need, n.budget.usable, None) for n, need in needs))
    try:
        plan = compute_plan([c for c in cals if c is not None], train.batch_size, split=split,
                            seq_len=train.max_seq_length)
    except PlanError as exc:
        return Candidate(kind, label, "dp", names, False, None, str(exc))
    batches = ", ".join(f"{n} {b}" for n, b in plan.batch.items())
    if exchange is not None and len(nodes) > 1:
        plan = with_collective(plan, exchange)
        batches += f"; all_sum ~{1000 * exchange.seconds:.1f} ms (ring model, measured links)"
    rows = tuple(PlanRow(n.node, 0, shape.layers, need, n.budget.usable, plan.per_node_step_s.get(n.node))
                 for n, need in needs)
    return Candidate(kind, label, "dp", names, True, plan.predicted_tokens_per_s, f"{note}; batch {batches}", dp=plan,
                     rows=rows)


def _pipeline_candidate(kind: CandidateKind, job: PipelineJob, nodes: Sequence[FleetNode],
                        layer_split: Sequence[int] | None, links: LinkTable) -> Candidate:
    names = tuple(n.node for n in nodes)
    label = f"pipeline over {', '.join(names)}"
    # Seconds for some nodes and none for others do not compare: then the split only balances blocks.
    timed = all(n.timing is not None for n in nodes)
    stage_nodes = [StageNode(n.node, n.budget.usable, n.timing if timed else None, n.budget.fused_attention)
                   for n in nodes]
    try:
        plan = (check_layer_split(job, stage_nodes, layer_split, links=links) if layer_split is not None
                else compute_layer_split(job, stage_nodes, links=links))
    except PlanError as exc:
        return Candidate(kind, label, "pipeline", names, False, None, str(exc))
    split = "/".join(str(k) for k in plan.layer_split)
    note = (f"blocks {split}{' (pinned)' if plan.pinned else ''}, {plan.micro_batches} micro-batches, bubble "
            f"{plan.bubble:.0%}")
    rows = tuple(PlanRow(st.node, st.first_layer, st.last_layer, st.need, st.budget, st.stage_s if timed else None,
                         st.busy_s) for st in plan.stages)
    return Candidate(kind, label, "pipeline", names, True, plan.tokens_per_s, note, pipeline=plan, rows=rows)


def _slowest_first(nodes: Sequence[FleetNode]) -> list[FleetNode]:
    """Which node a smaller pipeline leaves out first: the slowest per block (by its timing), else the smallest."""
    def key(n: FleetNode) -> tuple[float, float]:
        return (-(n.timing.layer_s if n.timing is not None else 0.0), n.budget.usable)
    return sorted(nodes, key=key)


def compute_strategy_choice(requested: str, shape: ModelShape, train: TrainConfig, nodes: Sequence[FleetNode], *,
                            backend: str, split: str | Mapping[str, float] = "calibrated",
                            links: LinkTable | None = None) -> StrategyChoice:
    """Weigh the plans that can train `train` on `nodes` (ring order) and pick one.

    Candidates: dp on every node; dp on the nodes whose replica fits (when that is some but not all, >= 2); the
    fastest node solo; a pipeline over every node (`train.layer_split` when pinned); pipelines over fewer nodes,
    leaving out the slowest per block one at a time. A dp candidate of several nodes pays its gradient exchange
    where the links were measured (`dp_exchange`), as a pipeline pays for its activations. `auto` takes the
    fitting candidate with the best predicted tokens/s (where none is measured: dp on every node, a pipeline over
    every node, dp on some, a smaller pipeline, solo, in that order); `dp` is dp on every node, `pipeline` the
    pipeline over every node. Raises StrategyError with every candidate's numbers when the requested one (or, for
    auto, any) does not fit."""
    if not nodes:
        raise StrategyError("no node memory known: the strategy cannot be planned")
    fills = [n.calibration.fill for n in nodes if n.calibration is not None]
    job = pipeline_job(shape, train, fill=sum(fills) / len(fills) if fills else 1.0)
    table = links or {}
    everyone = _dp_candidate(CandidateKind.DP_ALL, "dp on every node", shape, train, nodes, split,
                             dp_exchange(nodes, table, backend))
    candidates = [everyone]
    solo_fit = [n for n in nodes if per_rank_need(shape, train, world_size=1, budget=n.budget)[0] <= n.budget.usable]
    if requested == "auto" and 2 <= len(solo_fit) < len(nodes):
        candidates.append(_dp_candidate(CandidateKind.DP_SOME, f"dp on {', '.join(n.node for n in solo_fit)}", shape,
                                        train, solo_fit, "calibrated", dp_exchange(solo_fit, table, backend)))
    if requested == "auto" and len(nodes) > 1:
        solos = [_dp_candidate(CandidateKind.SOLO, f"solo on {n.node}", shape, train, [n], "calibrated")
                 for n in solo_fit]
        fitting = [c for c in solos if c.fits]
        if fitting or solos:
            candidates.append(max(fitting, key=lambda c: c.tokens_per_s or 0.0) if fitting else solos[0])
    pipelines: list[Candidate] = []
    if requested in ("auto", "pipeline"):
        unsupported = pipeline_unsupported(train)
        if backend in NO_SEND_RECV_BACKENDS or unsupported:
            pipelines.append(Candidate(CandidateKind.PIPELINE_ALL, "pipeline over every node", "pipeline",
                                       tuple(n.node for n in nodes), False, None,
                                       unsupported or pipeline_refusal(backend)))
        elif len(nodes) > 1 or requested == "pipeline":
            pipelines.append(_pipeline_candidate(CandidateKind.PIPELINE_ALL, job, nodes, train.layer_split, table))
            if train.layer_split is None and requested == "auto":
                left = list(nodes)
                for out in _slowest_first(nodes)[:-2]:
                    left = [n for n in left if n.node != out.node]
                    pipelines.append(_pipeline_candidate(CandidateKind.PIPELINE_SOME, job, left, None, table))
    # Of the smaller pipelines only the best is worth a line.
    smaller = [c for c in pipelines if c.kind is CandidateKind.PIPELINE_SOME]
    if smaller:
        best = max(smaller, key=lambda c: (c.fits, c.tokens_per_s or 0.0))
        pipelines = [c for c in pipelines if c.kind is CandidateKind.PIPELINE_ALL or c is best]
    candidates += pipelines
    wanted = {"dp": [everyone], "pipeline": pipelines[:1]}.get(requested, candidates)
    fitting = [c for c in wanted if c.fits]
    if not fitting:
        lines = "; ".join(c.line(chosen=False) for c in (candidates if requested == "auto" else wanted))
        budgets = ", ".join(f"{n.node} {_gb(n.budget.usable)}" for n in nodes)
        raise StrategyError(f"train.strategy {requested}: nothing fits (usable memory: {budgets}): {lines}")
    rated = [c for c in fitting if c.tokens_per_s is not None]
    # The best predicted rate; where none is measured, the preferred kind (ties: the earlier candidate).
    chosen = (max(rated, key=lambda c: c.tokens_per_s or 0.0) if rated
              else min(fitting, key=lambda c: KIND_ORDER.index(c.kind)))
    why = ""
    if everyone in rated and chosen is not everyone and \
            (chosen.tokens_per_s or 0.0) < (everyone.tokens_per_s or 0.0) * (1 + CHOICE_MARGIN):
        # Leaving nodes idle (or re-cutting the model) on a prediction inside calibration's own noise would make the
        # plan flip between runs: another plan must beat dp on every node clearly.
        why = (f"{chosen.label} predicts {chosen.tokens_per_s:,.0f} tokens/s, within {CHOICE_MARGIN:.0%} of dp on "
               f"every node ({everyone.tokens_per_s:,.0f}): not enough to leave the plan that uses every node")
        chosen = everyone
    return StrategyChoice(requested, chosen, tuple(candidates), why)


def pipeline_unsupported(train: TrainConfig) -> str:
    """Why the pipeline worker cannot train `train` ("" when it can): it splits neither DPO's reference model and
    pair loss nor trained embeddings (the first and last stages would both hold the tied matrix)."""
    if train.method == "dpo":
        return "a pipeline does not train DPO (its reference model and pair loss are not split over stages)"
    if train.train_embeddings:
        return "a pipeline does not train embeddings/lm_head (train_embeddings)"
    return ""


def pipeline_refusal(backend: str) -> str:
    """Why a pipeline cannot run on `backend`."""
    return (f"[{backend}] has no send/recv (mlx {MLX_VERSION}: \"Send has no CUDA implementation\"): a pipeline "
            "needs backend ring (or jaccl)")
