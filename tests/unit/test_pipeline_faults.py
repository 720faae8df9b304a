"""Pipeline faults, values in and values out (issue 26 item 4): what memory is missing when the survivors of a
fault cannot hold the model (`planning.shortfall`); shards fetched from a stage's node that runs no rank any more
(`run.resume.decide_pipeline_resume`'s `sources_only`)."""

from __future__ import annotations

import itertools
import random

from coordinator.planning.estimate import ModelShape
from coordinator.planning.pipeline import PipelineJob, StageNode, compute_layer_split, compute_stage_memory
from coordinator.planning.shortfall import compute_memory_shortfall
from coordinator.run.resume import ShardCopy, ShardVerdict, decide_pipeline_resume

SHAPE = ModelShape(params=1_000_000_000, hidden=2048, layers=12, vocab=32000, intermediate=8192, heads=16)
FULL = PipelineJob(SHAPE, "full", seq_len=512, global_batch=8, micro_batches=4)


def _brute_shortfall(job: PipelineJob, nodes: list[StageNode]) -> tuple[int, int]:
    p, layers = len(nodes), job.shape.layers
    best = None
    for cuts in itertools.combinations(range(1, layers), p - 1):
        bounds = (0, *cuts, layers)
        shorts = [max(0, compute_stage_memory(job, bounds[i], bounds[i + 1], index=i, stages=p).total - n.budget)
                  for i, n in enumerate(nodes)]
        key = (max(shorts), sum(shorts))
        best = key if best is None or key < best else best
    assert best is not None
    return best


def test_the_nearest_split_to_fitting_is_exact_on_random_fleets() -> None:
    rng = random.Random(26)
    per_block = compute_stage_memory(FULL, 0, 1, index=1, stages=3).total
    for _ in range(40):
        nodes = [StageNode(f"n{i}", int(per_block * rng.uniform(1, 8))) for i in range(rng.randint(1, 4))]
        got = compute_memory_shortfall(FULL, nodes)
        shorts = [s.short for s in got.stages]
        assert (max(shorts), sum(shorts)) == _brute_shortfall(FULL, nodes)
        assert [s.node for s in got.stages] == [n.node for n in nodes]
        assert got.stages[0].first_layer == 0 and got.stages[-1].last_layer == 12
        assert all(a.last_layer == b.first_layer for a, b in itertools.pairwise(got.stages))


def test_a_shortfall_names_each_node_with_what_it_needs_and_has() -> None:
    per_block = compute_stage_memory(FULL, 0, 1, index=1, stages=2).total
    got = compute_memory_shortfall(FULL, [StageNode("ultra", 5 * per_block), StageNode("max", 3 * per_block)])
    assert got.missing > 0
    text = got.describe()
    assert text.startswith("a pipeline over ultra, max needs, at its nearest split (")
    for s in got.stages:
        assert f"{s.node} (blocks {s.first_layer}-{s.last_layer - 1}) needs ~" in text
    assert "missing" in text and "usable" in text and "in all ~" in text


def test_a_fleet_that_fits_has_no_shortfall() -> None:
    nodes = [StageNode("a", 10**13), StageNode("b", 10**13)]
    assert compute_layer_split(FULL, nodes) is not None
    assert compute_memory_shortfall(FULL, nodes).missing == 0


def shard(node: str, step: int, index: int, stages: int = 3) -> ShardVerdict:
    return ShardVerdict(node, step, index, f"/r/{node}/checkpoints/stage-{index}/step-{step:06d}", True, "",
                        stages, None, None, "m1")


def test_a_left_out_stage_node_serves_its_shard_to_the_survivors_and_gets_nothing() -> None:
    # Stage 1's node b crashed (its machine still answers): its shard exists nowhere else.
    scans = {"a": (shard("a", 4, 0),), "c": (shard("c", 4, 2),), "b": (shard("b", 4, 1),)}
    decision = decide_pipeline_resume(scans, restart_from_scratch=False, sources_only={"b"})
    assert decision.step == 4
    assert {c.dest for c in decision.copies} == {"a", "c"}
    assert ShardCopy("b", "/r/b/checkpoints/stage-1/step-000004", "a", "stage-1-from-b") in decision.copies
    assert ShardCopy("b", "/r/b/checkpoints/stage-1/step-000004", "c", "stage-1-from-b") in decision.copies
