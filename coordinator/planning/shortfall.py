"""What memory is missing when a pipeline fits no split of the given nodes: per node, what its stage would need
and what it has. Pure.

A relaunch after a stage's node was lost re-plans over the survivors (`planning.strategy`); when the model no
longer fits them, "no split fits" is not enough for an operator who must decide what to bring back. Among the
contiguous splits (>= 1 block per stage, ring order), the one whose worst stage is least short of its budget
(ties: the least shortfall in all) is the nearest to fitting: its stages' needs against their budgets say which
node lacks how much. A dynamic program over (stage, first block), as `pipeline.compute_layer_split`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.planning.pipeline import PipelineJob, StageNode, compute_stage_memory
from coordinator.units import format_bytes


@dataclass(frozen=True)
class StageNeed:
    node: str
    first_layer: int
    last_layer: int  # exclusive
    need: int
    budget: int

    @property
    def short(self) -> int:
        return max(0, self.need - self.budget)

    def describe(self) -> str:
        have = f"has {format_bytes(self.budget)} usable"
        if not self.short:
            return f"{self.node} (blocks {self.first_layer}-{self.last_layer - 1}) needs ~{format_bytes(self.need)}, {have}"
        return (f"{self.node} (blocks {self.first_layer}-{self.last_layer - 1}) needs ~{format_bytes(self.need)}, "
                f"{have}: {format_bytes(self.short)} missing")


@dataclass(frozen=True)
class MemoryShortfall:
    """The nearest split to fitting and each of its stages' need against its budget."""

    stages: tuple[StageNeed, ...]
    layers: int

    @property
    def missing(self) -> int:
        return sum(s.short for s in self.stages)

    def describe(self) -> str:
        split = "/".join(str(s.last_layer - s.first_layer) for s in self.stages)
        need = sum(s.need for s in self.stages)
        have = sum(s.budget for s in self.stages)
        return (f"a pipeline over {', '.join(s.node for s in self.stages)} needs, at its nearest split ({split} of "
                f"{self.layers} blocks): " + "; ".join(s.describe() for s in self.stages)
                + f"; in all ~{format_bytes(need)} against {format_bytes(have)} usable")


def compute_memory_shortfall(job: PipelineJob, nodes: Sequence[StageNode]) -> MemoryShortfall:
    """The split of `job`'s blocks over `nodes` (ring order) nearest to fitting (module docstring). With more
    nodes than blocks only the first `layers` nodes take a stage (every stage needs a block)."""
    layers = job.shape.layers
    nodes = list(nodes)[:layers]
    p = len(nodes)
    if p == 0:
        return MemoryShortfall((), layers)

    def need(i: int, a: int, b: int) -> int:
        return compute_stage_memory(job, a, b, index=i, stages=p, fused_attention=nodes[i].fused_attention).total

    # best[i][a]: (worst shortfall, total shortfall) of stages i.. holding blocks [a, layers); nxt: stage i's end.
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * (layers + 1) for _ in range(p + 1)]
    nxt = [[-1] * (layers + 1) for _ in range(p + 1)]
    best[p][layers] = (0.0, 0.0)
    for i in range(p - 1, -1, -1):
        for a in range(i, layers - (p - 1 - i)):
            for b in range(a + 1, layers - (p - 1 - i) + 1):
                rest = best[i + 1][b]
                if rest == inf:
                    continue
                short = max(0, need(i, a, b) - nodes[i].budget)
                value = (max(float(short), rest[0]), short + rest[1])
                if value < best[i][a]:
                    best[i][a], nxt[i][a] = value, b
    stages, a = [], 0
    for i in range(p):
        b = nxt[i][a]
        stages.append(StageNeed(nodes[i].node, a, b, need(i, a, b), nodes[i].budget))
        a = b
    return MemoryShortfall(tuple(stages), layers)
