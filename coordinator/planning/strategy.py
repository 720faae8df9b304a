"""Which training strategy a fleet can run: `dp` (every rank holds a full replica) or `fsdp` (mlx's
`nn.fully_shard`: parameters, gradients and optimizer state split across the ranks). Pure: the model's shape, the
playbook's train section and each node's usable memory in, a `StrategyDecision` out (or `StrategyError` with the
numbers per node). docs/strategy.md says what is computed and what was not measured.

Per rank, from `estimate.estimate_training_memory` (the same estimate the resources check uses):
- dp: weights + grads + Adam state + activations (+ DPO's reference copy), all whole.
- fsdp: (weights + grads + Adam state) / world size, plus the largest unit gathered at once in bf16 (one
  transformer block, or the embedding when that is larger: `fully_shard` gathers a wrapped module's parameters for
  its forward), plus the activations (not sharded: each rank runs its own batch) and the reference, whole.

`auto` picks dp when it fits every node (so the smallest node), else fsdp when that fits every node, else refuses.

The worker runs both (`worker.parallel.dp`, `worker.parallel.fsdp`). fsdp needs a backend with `sum_scatter` (the
reduce-scatter of the gradients in `fully_shard`'s backward): mlx 0.32.4's ring raises `[ring] sum_scatter not
supported`, mpi `[mpi] sum_scatter not yet implemented` (both strings are in libmlx.so). nccl has a native
reduce-scatter (run on 2x H100); jaccl has had one since mlx 0.32.1 (mlx PR#3901; not run here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from coordinator.config.playbook import TrainConfig
from coordinator.errors import CoordinatorError
from coordinator.facts.model import NodeFacts
from coordinator.planning.estimate import GiB, ModelShape, estimate_training_memory, usable_memory

Strategy = Literal["dp", "fsdp"]

# nccl: run on 2x H100 (docs/benchmarks.md). jaccl, jaccl-ring: sum_scatter since mlx 0.32.1 (mlx PR#3901), not run here.
SUM_SCATTER_BACKENDS = frozenset({"nccl", "jaccl", "jaccl-ring"})
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
    requested: str  # auto | dp | fsdp
    strategy: Strategy
    world_size: int
    needs: tuple[NodeNeed, ...]

    def describe(self) -> str:
        smallest = min(self.needs, key=lambda n: n.usable)
        return (f"{self.strategy} ({'chosen by auto' if self.requested == 'auto' else 'forced'}): per node dp "
                f"~{_gb(smallest.dp)}, fsdp over {self.world_size} ~{_gb(smallest.fsdp)}; smallest node "
                f"{smallest.node} has {_gb(smallest.usable)} usable")


def _gb(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def block_params(shape: ModelShape) -> int:
    """Parameters of one transformer block (attention, MLP, two norms), as `estimate.estimate_params` counts."""
    heads = shape.n_heads
    d = shape.head_dim or shape.hidden // heads
    kv = shape.kv_heads or heads
    return shape.hidden * heads * d * 2 + shape.hidden * kv * d * 2 + 3 * shape.hidden * shape.mlp + 2 * shape.hidden


def per_rank_need(shape: ModelShape, train: TrainConfig, *, world_size: int, budget: NodeBudget) -> tuple[int, int]:
    """(dp, fsdp) bytes one rank needs, at the batch per rank the resources check uses (the global batch split
    evenly)."""
    per_rank = max(1, -(-train.batch_size // max(1, world_size)))
    est = estimate_training_memory(
        shape, method=train.fine_tune_type, batch_per_rank=per_rank * train.rows_per_example,
        seq_len=train.max_seq_length, layers_trained=train.num_layers, grad_checkpoint=train.grad_checkpoint,
        with_reference=train.method == "dpo", fused_attention=budget.fused_attention, lora_rank=train.lora.rank)
    sharded = -(-(est.weights + est.grads + est.optimizer) // max(1, world_size))
    gathered = 2 * max(block_params(shape), shape.vocab * shape.hidden)
    return est.total, sharded + gathered + est.activations + est.reference


def compute_strategy(requested: str, shape: ModelShape, train: TrainConfig,
                     budgets: Mapping[str, NodeBudget]) -> StrategyDecision:
    """The strategy for a fleet of `budgets` (node -> usable memory). `requested` auto picks dp when it fits
    every node, else fsdp when that fits every node; dp or fsdp forced must fit every node. StrategyError (with
    every node's numbers) otherwise. LoRA and DoRA always run dp (their frozen weights are not what fsdp saves)."""
    if not budgets:
        raise StrategyError("no node memory known: the strategy cannot be planned")
    world = len(budgets)
    needs = tuple(NodeNeed(name, b.usable, *per_rank_need(shape, train, world_size=world, budget=b))
                  for name, b in budgets.items())
    dp_fits = all(n.fits_dp for n in needs)
    fsdp_fits = all(n.fits_fsdp for n in needs)
    full = train.fine_tune_type == "full"
    if requested == "auto":
        chosen: Strategy | None = "dp" if dp_fits else "fsdp" if fsdp_fits and full else None
    elif requested == "dp":
        chosen = "dp" if dp_fits else None
    else:
        chosen = "fsdp" if fsdp_fits else None
    if chosen is None:
        what = (f"{requested} does not fit" if requested != "auto" else "neither dp nor fsdp fits" if full
                else f"dp does not fit ({train.fine_tune_type}: fsdp is for full fine-tunes)")
        rows = "; ".join(f"{n.node}: {_gb(n.usable)} usable, dp needs ~{_gb(n.dp)}, fsdp over {world} needs "
                         f"~{_gb(n.fsdp)}" for n in needs)
        raise StrategyError(f"train.strategy {requested}: {what} ({rows})")
    return StrategyDecision(requested, chosen, world, needs)


def fsdp_refusal(backend: str) -> str | None:
    """Why an fsdp run cannot start on `backend` (the resolved one): the backend's missing `sum_scatter`; None where
    it has one (the worker runs fsdp: worker.parallel.fsdp)."""
    if backend not in SUM_SCATTER_BACKENDS:
        return (f"[{backend}] sum_scatter not supported (mlx {MLX_VERSION}): fsdp needs nccl (CUDA nodes) or jaccl")
    return None


def node_budget(facts: NodeFacts) -> NodeBudget | None:
    """The node's usable training memory, as the resources check reads it: an NVIDIA GPU's own memory, else the
    machine's (macOS: the GPU's default wired share). None when the facts hold no memory size."""
    total = (facts.memory.total_bytes if facts.memory else None) or (
        facts.hardware.memory_bytes if facts.hardware else None)
    gpu = facts.gpu.devices[0] if facts.gpu is not None and facts.gpu.cuda and facts.gpu.devices else None
    is_mac = facts.os is not None and facts.os.is_macos
    if gpu is not None and gpu.memory_total_bytes:
        return NodeBudget(usable_memory(gpu.memory_total_bytes, is_macos=False), fused_attention=True)
    if total is None:
        return None
    return NodeBudget(usable_memory(total, is_macos=is_mac), fused_attention=is_mac)
