"""Pipeline-parallel plans: which node holds which contiguous range of transformer blocks, and how fast the
pipeline is predicted to run. Pure arithmetic (exo's placement style): shapes, budgets and timings in, a
`PipelinePlan` out, or `PlanError` with every stage's numbers.

Stages follow the ring order of the nodes given (mlx's ring `send`/`recv` work between direct neighbours only, and
ring has no sub-groups: stage i talks to stages i-1 and i+1, which must be ranks i-1 and i+1). The first stage
also holds the embedding, the last the final norm and the head (lm_head, or a copy of the tied embedding).

Memory of a stage (from `estimate`'s per-term model, so dp and pipeline needs are comparable):
- weights of its blocks in bf16 (+ the embedding on the first, the head and final norm on the last), and for the
  blocks it trains the grads and Adam state (full: 2 + 4 B/param; LoRA: fp32 adapters 4 + 4 + 8 B/param);
- activations: under 1F1B, stage i (0-based) of P starts at most P - i micro-batches before the first of them
  comes back as a gradient, so it holds up to min(P - i, M) micro-batches' activations of its trained blocks
  (the first stage the most, the last one); the last stage adds the logits of one micro-batch (its forward of a
  micro-batch is followed at once by that micro-batch's backward).

Memory measured (`LayerMemory`, from `worker.bench --blocks` at the job's micro-batch) replaces the activations
term: a stage needs its trained blocks x the measured block share, its frozen blocks' weights, its in-flight
inputs and its end (`measured_stage_bytes`; docs/pipeline.md#prediction).

Time: a stage's time per micro-batch (forward + backward) is its node's measured time per block x its blocks,
plus the embedding's on the first and the head's (norm, lm_head, loss) on the last: what the split balances. The
predicted step is the schedule played on a clock (`pipesim.simulate_step`) over each stage's forward, backward
and update (`stage_cost`) and each measured link between neighbours (latency, bandwidth, one micro-batch's
activation each way): with equal stages and free links (M + P - 1) x t, idle for the bubble (P - 1) / (M + P - 1).

The split (`compute_layer_split`) is exact: among the contiguous splits (>= 1 block per stage) that fit every
stage's budget, the one whose slowest stage is fastest, ties broken by the smallest sum of stage times (the fill).
It binary-searches the bottleneck over the finite set of possible stage times; for each bound a dynamic program
over (stage, blocks placed) finds the split of least total time whose stages all fit and stay under the bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from coordinator.planning.estimate import (
    GiB,
    MemoryEstimate,
    ModelShape,
    layers_activation_bytes,
    logit_bytes,
)
from coordinator.planning.pipesim import FREE_LINK, LinkCost, StageCost, simulate_step
from coordinator.planning.plan import NodeCalibration, Plan, PlanError, SplitMode, predicted_step_s

SCHEDULE = "1f1b"
# The step's batch, which every stage builds whole: token ids and targets (int32) and the scored mask (bool).
BATCH_BYTES_PER_TOKEN = 4 + 4 + 1
DEFAULT_MICRO_BATCHES = 8


class TimingSource(StrEnum):
    """Where a node's per-block time comes from: `blocks` (the bench ran K blocks alone: any node can be
    measured), `curve` (its whole-model calibration step divided by the blocks: only a node that holds the model,
    and an over-estimate that folds the embedding, head and optimizer into every block), `unknown` (no
    measurement: the split then only has to fit, and no rate is predicted)."""

    BLOCKS = "blocks"
    CURVE = "curve"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class LayerTiming:
    """One node's seconds per micro-batch of `micro_batch` rows, forward + backward: per transformer block, and
    once for the embedding (first stage) and for the final norm + head + loss (last stage)."""

    node: str
    micro_batch: int
    layer_s: float
    embed_s: float = 0.0
    head_s: float = 0.0
    source: TimingSource = TimingSource.BLOCKS
    # The last stage's per block: its forward and backward in one pass (the others recompute the forward inside
    # their backward, MLX keeping no tape between calls); None: `layer_s`.
    last_layer_s: float | None = None
    update_s: float = 0.0  # the optimizer update, per trained block, once per step
    memory: LayerMemory | None = None  # what the same bench measured of memory (None: the estimate's model)

    def __post_init__(self) -> None:
        for name, value in (("layer_s", self.layer_s), ("embed_s", self.embed_s), ("head_s", self.head_s),
                            ("last_layer_s", self.layer_s if self.last_layer_s is None else self.last_layer_s),
                            ("update_s", self.update_s)):
            if not (math.isfinite(value) and value >= 0):
                raise PlanError(f"{self.node}: {name} must be a non-negative number of seconds, got {value!r}")
        if self.micro_batch < 1:
            raise PlanError(f"{self.node}: a timing needs a micro-batch of >= 1 row, got {self.micro_batch}")

    def forward_backward(self) -> tuple[float, float]:
        """(forward, backward) seconds per block of a non-last stage: the bench's backward is the last stage's
        whole block (`last_layer_s`: the vjp, which recomputes the forward), the forward the rest of `layer_s`.
        A curve's share (no split measured) counts a backward as twice the forward."""
        if self.last_layer_s is None:
            return self.layer_s / 3, 2 * self.layer_s / 3
        return max(0.0, self.layer_s - self.last_layer_s), self.last_layer_s


@dataclass(frozen=True)
class LayerMemory:
    """What `worker.bench --blocks` measured of memory at `micro_batch` rows (bytes, MLX's count of its arrays, as
    a run's `peak_memory`), per trained block: what it holds throughout (weights, optimizer state), what a step's
    backward phase adds at its peak (working set, gradient sum, the input gradient sent) and what its update adds
    (scaled gradients, new parameters and moments beside the old); one micro-batch's activation; the embedding's
    weights (the first stage's) and the head's peak over a loss backward (the last stage's: weights, logits and
    their gradient)."""

    micro_batch: int
    block_bytes: int
    backward_bytes: int
    update_bytes: int
    input_bytes: int
    embed_bytes: int
    head_bytes: int


def timing_from_curve(cal: NodeCalibration, layers: int, micro_batch: int, seq_len: int) -> LayerTiming:
    """A node's per-block time from its whole-model curve: the predicted step time of one micro-batch shared over
    the blocks (embedding, head and optimizer folded in: an over-estimate, the same for every node measured so).
    Only for a node that could hold the model; `worker.bench --blocks` measures the others."""
    if layers < 1:
        raise PlanError(f"{cal.node}: a model of {layers} blocks")
    return LayerTiming(cal.node, micro_batch, predicted_step_s(cal, micro_batch, seq_len) / layers,
                       source=TimingSource.CURVE)


@dataclass(frozen=True)
class StageNode:
    """A node that may take a stage: its memory budget (bytes), whether its attention backward is fused (Metal,
    CUDA; False on the CPU backend: the scores are materialised) and its timing (None: unknown)."""

    node: str
    budget: int
    timing: LayerTiming | None = None
    fused_attention: bool = True


@dataclass(frozen=True)
class PipelineJob:
    """What is trained, as a pipeline sees it. `trained_from`: the first trained block (num_layers N trains the
    last N: layers - N; 0 for all); `train_embeddings`: the embedding and head train too (full on all layers)."""

    shape: ModelShape
    method: str  # full | lora | dora
    seq_len: int
    global_batch: int  # examples per optimizer step (the playbook's batch_size)
    micro_batches: int
    trained_from: int = 0
    grad_checkpoint: bool = False
    lora_rank: int = 8
    train_embeddings: bool = False
    with_reference: bool = False  # DPO's frozen reference: a second bf16 copy of the stage's weights
    fill: float = 1.0  # real tokens per row / seq_len
    rows_per_example: int = 1  # a DPO pair is two rows

    @property
    def kind(self) -> str:
        return "full" if self.method == "full" else "lora"

    @property
    def micro_batch_rows(self) -> int:
        """Rows of the largest micro-batch (the global batch in M near-equal parts: it sets the peak and pace)."""
        return -(-self.global_batch // self.micro_batches) * self.rows_per_example


def block_params(shape: ModelShape) -> int:
    """Parameters of one transformer block (attention, MLP, two norms), as `estimate.estimate_params` counts."""
    heads = shape.n_heads
    d = shape.head_dim or shape.hidden // heads
    kv = shape.kv_heads or heads
    return shape.hidden * heads * d * 2 + shape.hidden * kv * d * 2 + 3 * shape.hidden * shape.mlp + 2 * shape.hidden


def stage_block_params(shape: ModelShape) -> int:
    """Parameters of one block as a stage holds it: the config's arithmetic (`block_params`), or the model's
    counted parameters less the embedding, head and final norm, shared over the blocks, when that is more
    (biases, extra norms or experts the arithmetic does not know), so that the stages together never need less
    than a replica's weights."""
    rest = shape.params - 2 * shape.vocab * shape.hidden - shape.hidden
    return max(block_params(shape), rest // shape.layers)


def compute_stage_memory(job: PipelineJob, first: int, last: int, *, index: int, stages: int,
                         fused_attention: bool = True, measured: LayerMemory | None = None) -> MemoryEstimate:
    """The peak of stage `index` of `stages` holding blocks [first, last) (module docstring). With `measured` (the
    node's bench at this job's micro-batch) the activations term is what the measurement leaves beyond the
    weights, gradients and optimizer state of the model below (see `measured_stage_bytes`)."""
    est = _estimated_stage_memory(job, first, last, index=index, stages=stages, fused_attention=fused_attention)
    if measured is None or measured.micro_batch != job.micro_batch_rows:
        return est
    total = measured_stage_bytes(job, measured, first, last, index=index, stages=stages)
    fixed = est.weights + est.grads + est.optimizer + est.reference
    return MemoryEstimate(weights=est.weights, grads=est.grads, optimizer=est.optimizer,
                          activations=max(0, total - fixed), reference=est.reference)


def measured_stage_bytes(job: PipelineJob, measured: LayerMemory, first: int, last: int, *, index: int,
                         stages: int) -> int:
    """A stage's peak from its node's measurement: what it holds throughout (each trained block's measured bytes,
    each frozen block's weights in the checkpoint's dtype, the embedding on the first stage, the head's weights on
    the last, the step's batch) plus the larger of its two phases: the backward (each trained block's measured
    working set, the inputs of the micro-batches it holds in flight under 1F1B and the gradient it received, the
    head's logits on the last stage) and the update (each trained block's measured update)."""
    trained = max(0, last - max(first, job.trained_from))
    frozen = (last - first) - trained
    is_last = index == stages - 1
    head_weights = measured.embed_bytes  # the head is vocab x hidden, as the embedding (or it is the embedding)
    held = (trained * measured.block_bytes + frozen * job.shape.dtype_bytes * stage_block_params(job.shape)
            + (measured.embed_bytes if index == 0 else 0) + (head_weights if is_last else 0)
            + job.global_batch * job.rows_per_example * job.seq_len * BATCH_BYTES_PER_TOKEN)
    # In its backward a stage holds its pending inputs, and (but the last) the gradient it received.
    activations = (min(stages - index, job.micro_batches) + (0 if is_last else 1)) * measured.input_bytes
    backward = (trained * measured.backward_bytes + activations
                + (max(0, measured.head_bytes - head_weights) if is_last else 0))
    return held + max(backward, trained * measured.update_bytes)


def _estimated_stage_memory(job: PipelineJob, first: int, last: int, *, index: int, stages: int,
                            fused_attention: bool = True) -> MemoryEstimate:
    shape = job.shape
    blocks = last - first
    trained = max(0, last - max(first, job.trained_from))
    embed = shape.vocab * shape.hidden
    per_block = stage_block_params(shape)
    frozen_params = blocks * per_block + (embed if index == 0 else 0) + (
        embed + shape.hidden if index == stages - 1 else 0)
    b = shape.dtype_bytes  # the checkpoint's dtype: weights, grads and Adam's two moments are held in it
    if job.kind == "full":
        trainable = trained * per_block
        if job.train_embeddings:
            trainable += (embed if index == 0 else 0) + (embed + shape.hidden if index == stages - 1 else 0)
        weights, grads, optimizer = b * frozen_params, b * trainable, 2 * b * trainable
    else:
        adapters = shape.lora_params_per_layer(job.lora_rank) * trained
        weights, grads, optimizer = b * frozen_params + 4 * adapters, 4 * adapters, 8 * adapters
    in_flight = min(stages - index, job.micro_batches)
    rows = job.micro_batch_rows
    acts = in_flight * layers_activation_bytes(shape, job.kind, rows, job.seq_len, trained,
                                               grad_checkpoint=job.grad_checkpoint, fused_attention=fused_attention)
    if index == stages - 1:
        acts += logit_bytes(shape, job.kind, rows, job.seq_len)
    return MemoryEstimate(weights=weights, grads=grads, optimizer=optimizer, activations=int(acts),
                          reference=b * frozen_params if job.with_reference else 0)


def stage_time(timing: LayerTiming | None, blocks: int, *, index: int, stages: int) -> float:
    """Seconds per micro-batch of a stage of `blocks` blocks (1.0 per block when the timing is unknown: the
    split then balances blocks)."""
    if timing is None:
        return float(blocks)
    last = index == stages - 1
    per_block = timing.last_layer_s if last and timing.last_layer_s is not None else timing.layer_s
    return per_block * blocks + (timing.embed_s if index == 0 else 0.0) + (timing.head_s if last else 0.0)


def stage_cost(timing: LayerTiming, blocks: int, *, index: int, stages: int, trained: int) -> StageCost:
    """A stage's `pipesim.StageCost` from its node's timing: per micro-batch its forward action (the blocks, and
    the embedding on the first stage; nothing on the last, whose forward runs inside its backward) and its
    backward action (the vjp that recomputes the forward: the blocks, the embedding again on the first stage, the
    head on the last); once per step the update of its `trained` blocks."""
    forward, backward = timing.forward_backward()
    embed = timing.embed_s if index == 0 else 0.0
    update = timing.update_s * trained
    if index == stages - 1:  # `stage_time` of the last stage: its blocks in one pass, the head (and a lone
        return StageCost(0.0, stage_time(timing, blocks, index=index, stages=stages), update)  # stage's embedding)
    return StageCost(forward * blocks + embed, backward * blocks + embed, update)


def activation_bytes(job: PipelineJob, nodes: Sequence[StageNode]) -> int:
    """One micro-batch's activation between two stages (each way): measured where a node's bench has it, else
    rows x (seq_len - 1) positions x hidden in the checkpoint's dtype."""
    for n in nodes:
        mem = n.timing.memory if n.timing is not None else None
        if mem is not None and mem.micro_batch == job.micro_batch_rows:
            return mem.input_bytes
    return job.micro_batch_rows * max(1, job.seq_len - 1) * job.shape.hidden * job.shape.dtype_bytes


def _check_job(job: PipelineJob, nodes: Sequence[StageNode]) -> None:
    if not nodes:
        raise PlanError("a pipeline needs at least one node")
    names = [n.node for n in nodes]
    if len(set(names)) != len(names):
        raise PlanError(f"a node appears twice in the pipeline: {names}")
    if len(nodes) > job.shape.layers:
        raise PlanError(f"{len(nodes)} stages but the model has {job.shape.layers} blocks: every stage needs one")
    if job.micro_batches < 1:
        raise PlanError(f"micro_batches must be >= 1, got {job.micro_batches}")
    if job.micro_batches > job.global_batch:
        raise PlanError(f"{job.micro_batches} micro-batches but a global batch of {job.global_batch}: every "
                        "micro-batch needs an example (lower train.micro_batches or raise train.batch_size)")


def _fits_table(job: PipelineJob, nodes: Sequence[StageNode]) -> list[list[int]]:
    """most[i][a]: the largest block count stage i can hold starting at block a (memory grows with blocks)."""
    p, layers = len(nodes), job.shape.layers
    most = []
    for i, n in enumerate(nodes):
        row = []
        for a in range(layers):
            count = 0
            for b in range(a + 1, layers + 1):
                if compute_stage_memory(job, a, b, index=i, stages=p, fused_attention=n.fused_attention,
                                        measured=_measured(n)).total > n.budget:
                    break
                count = b - a
            row.append(count)
        most.append(row)
    return most


def _best_under(bound: float, times: list[list[float]], most: list[list[int]], layers: int) -> list[int] | None:
    """The least-total-time split whose stages fit and each take <= bound; its stage boundaries, or None."""
    p = len(times)
    inf = math.inf
    cost = [[inf] * (layers + 1) for _ in range(p + 1)]
    back = [[-1] * (layers + 1) for _ in range(p + 1)]
    cost[0][0] = 0.0
    for i in range(p):
        for a in range(layers):
            if cost[i][a] == inf:
                continue
            # Leave at least one block for each later stage.
            for n in range(1, min(most[i][a], layers - a - (p - 1 - i)) + 1):
                t = times[i][n]
                if t > bound:
                    break
                if cost[i][a] + t < cost[i + 1][a + n]:
                    cost[i + 1][a + n] = cost[i][a] + t
                    back[i + 1][a + n] = a
    if cost[p][layers] == inf:
        return None
    bounds = [layers]
    for i in range(p, 0, -1):
        bounds.append(back[i][bounds[-1]])
    return bounds[::-1]


@dataclass(frozen=True)
class StagePlan:
    node: str
    first_layer: int
    last_layer: int  # exclusive
    memory: MemoryEstimate
    budget: int
    stage_s: float  # per micro-batch, forward + backward
    in_flight: int  # micro-batches whose activations it holds at most
    # Predicted seconds of compute per step (its forwards, backwards and update; None: not timed): the rest of
    # the step it waits on its neighbours (the straggler rule compares a stage's measured time with this).
    busy_s: float | None = None

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer

    @property
    def need(self) -> int:
        return self.memory.total


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline over `stages` (ring order). `step_s` and `tokens_per_s` are None when a stage's timing is
    unknown. `pinned`: the user's `layer_split`, not the computed one."""

    stages: tuple[StagePlan, ...]
    micro_batches: int
    micro_batch_rows: int
    global_batch: int
    seq_len: int
    step_s: float | None
    tokens_per_s: float | None
    pinned: bool = False
    schedule: str = SCHEDULE
    activation_bytes: int = 0  # one micro-batch's activation between neighbours, each way
    link_s: tuple[float | None, ...] = ()  # per link (stage i to i+1): one transfer's seconds; None: not measured
    predicted_bubble: float | None = None  # the simulated step's idle share (None: not timed)

    @property
    def bubble(self) -> float:
        p = len(self.stages)
        return (p - 1) / (self.micro_batches + p - 1)

    @property
    def layer_split(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    def as_plan(self) -> Plan:
        """The launch's `Plan` of a pipeline: every rank gets the whole global batch (each stage computes every row
        of every micro-batch); no per-node rate (a stage's pace is the pipeline's)."""
        return Plan(split={s.node: 1.0 for s in self.stages}, batch={s.node: self.global_batch for s in self.stages},
                    global_batch=self.global_batch, mode=SplitMode.PIPELINE, seq_len=self.seq_len,
                    predicted_step_s=self.step_s or 0.0, predicted_tokens_per_s=self.tokens_per_s or 0.0)

    def layout(self) -> dict[str, object]:
        """The worker's `RunConfig.layout` (rank i = stage i)."""
        return {"kind": "pipeline", "micro_batches": self.micro_batches, "schedule": self.schedule,
                "stages": [{"rank": i, "first_layer": s.first_layer, "last_layer": s.last_layer}
                           for i, s in enumerate(self.stages)]}


LinkTable = Mapping[tuple[str, str], LinkCost]


def link_between(links: LinkTable, a: str, b: str) -> LinkCost | None:
    """The measured link between nodes `a` and `b` (either direction); None when it was not measured."""
    return links.get((a, b)) or links.get((b, a))


def _build(job: PipelineJob, nodes: Sequence[StageNode], bounds: Sequence[int], *, pinned: bool,
           links: LinkTable) -> PipelinePlan:
    p = len(nodes)
    timed = all(n.timing is not None for n in nodes)
    stages = []
    costs = []
    for i, n in enumerate(nodes):
        a, b = bounds[i], bounds[i + 1]
        trained = max(0, b - max(a, job.trained_from))
        cost = stage_cost(n.timing, b - a, index=i, stages=p, trained=trained) if n.timing is not None else None
        costs.append(cost)
        stages.append(StagePlan(n.node, a, b, compute_stage_memory(job, a, b, index=i, stages=p,
                                                                 fused_attention=n.fused_attention,
                                                                 measured=_measured(n)),
                                n.budget, stage_time(n.timing, b - a, index=i, stages=p),
                                min(p - i, job.micro_batches)))
    pairs = [link_between(links, nodes[i].node, nodes[i + 1].node) for i in range(p - 1)]
    nbytes = activation_bytes(job, nodes)
    if not timed:
        return PipelinePlan(tuple(stages), job.micro_batches, job.micro_batch_rows, job.global_batch, job.seq_len,
                            None, None, pinned=pinned, activation_bytes=nbytes,
                            link_s=tuple(None if c is None else c.transfer_s(nbytes) for c in pairs))
    sim = simulate_step([c for c in costs if c is not None], job.micro_batches,
                        links=[c if c is not None else FREE_LINK for c in pairs], activation_bytes=nbytes,
                        schedule=SCHEDULE)
    stages = [replace(st, busy_s=busy) for st, busy in zip(stages, sim.busy_s, strict=True)]
    rate = job.global_batch * job.seq_len * job.fill / sim.step_s if sim.step_s > 0 else None
    return PipelinePlan(tuple(stages), job.micro_batches, job.micro_batch_rows, job.global_batch, job.seq_len,
                        sim.step_s, rate, pinned=pinned, activation_bytes=nbytes,
                        link_s=tuple(None if c is None else t for c, t in zip(pairs, sim.transfer_s, strict=True)),
                        predicted_bubble=sim.bubble)


def _measured(n: StageNode) -> LayerMemory | None:
    return n.timing.memory if n.timing is not None else None


def _gb(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def compute_layer_split(job: PipelineJob, nodes: Sequence[StageNode], *, links: LinkTable | None = None) -> PipelinePlan:
    """The fastest split of the model's blocks over `nodes` (in this order) that fits every node (module
    docstring). Raises PlanError, naming each node's budget and the most blocks it can hold, when none fits."""
    _check_job(job, nodes)
    p, layers = len(nodes), job.shape.layers
    most = _fits_table(job, nodes)
    times = [[stage_time(n.timing, k, index=i, stages=p) for k in range(layers + 1)] for i, n in enumerate(nodes)]
    candidates = sorted({times[i][k] for i in range(p) for k in range(1, layers + 1)})
    if _best_under(math.inf, times, most, layers) is None:
        rows = "; ".join(
            f"{n.node} {_gb(n.budget)} holds at most {max(most[i])} block(s) as stage {i}"
            + (f" (one block there needs ~{_gb(compute_stage_memory(job, 0, 1, index=i, stages=p, fused_attention=n.fused_attention).total)})"  # noqa: E501
               if max(most[i]) == 0 else "")
            for i, n in enumerate(nodes))
        raise PlanError(f"no split of {layers} blocks over {p} stage(s) fits ({rows}); at {job.micro_batches} "
                        f"micro-batches of {job.micro_batch_rows} row(s) x {job.seq_len} tokens")
    # The least bound that admits a split (feasibility is monotone in the bound).
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _best_under(candidates[mid], times, most, layers) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = _best_under(candidates[lo], times, most, layers)
    assert bounds is not None  # the search ends on a feasible bound
    return _build(job, nodes, bounds, pinned=False, links=links or {})


def check_layer_split(job: PipelineJob, nodes: Sequence[StageNode], split: Sequence[int], *,
                      links: LinkTable | None = None) -> PipelinePlan:
    """The user's `layer_split` (blocks per node, ring order), validated: one positive count per node, summing to
    the model's blocks, each stage within its budget. PlanError with the numbers otherwise."""
    _check_job(job, nodes)
    layers = job.shape.layers
    if len(split) != len(nodes):
        raise PlanError(f"layer_split {list(split)} has {len(split)} entries for {len(nodes)} node(s) "
                        f"({', '.join(n.node for n in nodes)}): give one block count per node, in ring order")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in split):
        raise PlanError(f"layer_split {list(split)}: every stage needs a whole number >= 1 of blocks")
    if sum(split) != layers:
        raise PlanError(f"layer_split {list(split)} sums to {sum(split)} but the model has {layers} blocks")
    bounds = [0]
    for k in split:
        bounds.append(bounds[-1] + k)
    plan = _build(job, nodes, bounds, pinned=True, links=links or {})
    over = [f"{s.node} {s.layers} blocks need ~{_gb(s.need)} of {_gb(s.budget)}" for s in plan.stages
            if s.need > s.budget]
    if over:
        raise PlanError(f"layer_split {list(split)} does not fit: {'; '.join(over)}")
    return plan

