"""Pipeline faults, values in and values out (issue 26 item 4): what memory is missing when the survivors of a
fault cannot hold the model (`planning.shortfall`); shards fetched from a stage's node that runs no rank any more
(`run.resume.decide_pipeline_resume`'s `receivers`)."""

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
    decision = decide_pipeline_resume(scans, restart_from_scratch=False, receivers=["a", "c"])
    assert decision.step == 4
    assert {c.dest for c in decision.copies} == {"a", "c"}
    assert ShardCopy("b", "/r/b/checkpoints/stage-1/step-000004", "a", "stage-1-from-b") in decision.copies
    assert ShardCopy("b", "/r/b/checkpoints/stage-1/step-000004", "c", "stage-1-from-b") in decision.copies


# --- the monitor's pipeline rules: scripted observations, values out -----------------------------------------

from coordinator.run.monitor import (  # noqa: E402
    FaultPolicy,
    IncidentKind,
    Monitor,
    Observation,
    PlannedRank,
    StageWait,
    evaluate_stage_hang,
    evaluate_stage_straggler,
)

NODES = ("a", "b", "c")


def ev(rank: int, at: float, **data: object) -> Observation:
    return Observation("event", NODES[rank], at, rank, {"rank": rank, **data})


def pipeline(predicted: tuple[float | None, ...] = (None, None, None), **policy: float) -> Monitor:
    """Three stages on a, b, c, started at 0.1, each past its first step (median 1 s) at t = 2."""
    plan = [PlannedRank(r, NODES[r], 6, None, predicted[r]) for r in range(3)]
    mon = Monitor.create(plan, iters=50, now=0.0, policy=FaultPolicy(heartbeat_timeout=6.0, **policy),
                         replica_groups=((0,), (1,), (2,)))
    for r in range(3):
        mon.observe(ev(r, 0.1, event="started", pid=10 + r))
        mon.observe(ev(r, 2.0, event="step", step=1, loss=2.0, step_time_s=1.0, compute_s=1.0))
    return mon


def beat(mon: Monitor, at: float, where: dict[int, tuple[str, int | None, int]], step: int = 2) -> list:
    found = []
    for rank, (action, peer, index) in where.items():
        found += mon.observe(ev(rank, at, event="heartbeat", step=step, phase="step", action=action, peer=peer,
                                action_index=index))
    return found


def test_the_stage_that_stopped_producing_is_hung_and_its_waiting_neighbours_are_not() -> None:
    # The middle stage is stuck in a forward (alive: its heartbeat thread beats on); stage 0 waits for its
    # gradient, stage 2 for its activations. Stall window: max(60 s, 10 x 1 s).
    mon = pipeline()
    where = {0: ("recv_grad", 1, 5), 1: ("forward", None, 4), 2: ("recv_act", 1, 1)}
    for t in range(3, 64):
        assert not beat(mon, float(t), where) + mon.check(float(t))
    [hang] = beat(mon, 65.0, where) + mon.check(65.0)
    assert (hang.kind, hang.node, hang.rank, str(hang.action)) == (IncidentKind.HANG, "b", 1, "quarantine")
    assert hang.evidence["waited_on_by"] == [0, 2] and hang.evidence["action"] == "forward"
    assert "stage 1 stopped producing: in forward" in hang.evidence["reason"]
    assert mon.culprits() == ["b"]
    waiting = {0: where[0], 2: where[2]}
    assert not beat(mon, 200.0, waiting) + mon.check(200.0)  # its neighbours go on waiting: never blamed


def test_a_stage_that_moves_is_not_hung_however_long_the_step() -> None:
    mon = pipeline()
    for t in range(3, 130):
        where = {0: ("recv_grad", 1, 5), 1: ("backward", None, 4 + t), 2: ("recv_act", 1, 1)}
        assert not beat(mon, float(t), where) + mon.check(float(t))


def test_stages_that_only_wait_on_each_other_blame_no_stage() -> None:
    # Two live stages each waiting on the other (a link that delivers nothing): no stage stopped producing; the
    # stall rule ends the attempt without a culprit.
    waits = [StageWait(0, "send_act", 1, 0.0), StageWait(1, "send_grad", 0, 0.0), StageWait(2, "all_sum", None, 0.0)]
    assert evaluate_stage_hang(waits, now=500.0, window=60.0) is None
    mon = pipeline()
    where = {0: ("send_act", 1, 5), 1: ("send_grad", 0, 4), 2: ("recv_act", 1, 1)}
    beat(mon, 3.0, where)
    found = beat(mon, 70.0, where) + mon.check(70.0)
    assert found and {i.kind for i in found} == {IncidentKind.STALL} and not mon.culprits()


def test_the_wait_chain_names_every_stage_that_waits_on_the_hung_one() -> None:
    waits = [StageWait(0, "recv_grad", 1, 0.0), StageWait(1, "recv_grad", 2, 0.0), StageWait(2, "update", None, 0.0),
             StageWait(3, "all_sum", None, 0.0), StageWait(4, "recv_act", 3, 50.0)]
    hang = evaluate_stage_hang(waits, now=100.0, window=60.0)
    assert hang is not None and (hang.rank, hang.action, hang.waiting) == (2, "update", (0, 1, 3, 4))
    assert evaluate_stage_hang(waits, now=59.0, window=60.0) is None


def test_a_stopped_stage_is_hung_with_the_stages_that_wait_on_it() -> None:
    mon = pipeline()
    beat(mon, 3.0, {0: ("recv_grad", 1, 5), 2: ("recv_act", 1, 1)})
    mon.observe(Observation("proc", "b", 3.0, 1, {"pid": 11, "state": "T"}))
    [hang] = mon.observe(Observation("proc", "b", 4.5, 1, {"pid": 11, "state": "T"}))
    assert (hang.kind, hang.rank, hang.evidence["waited_on_by"]) == (IncidentKind.HANG, 1, [0, 2])
    assert mon.culprits() == ["b"]


def test_a_nan_is_blamed_on_the_stage_that_produced_it_not_on_its_receivers() -> None:
    mon = pipeline()
    found = mon.observe(ev(0, 3.0, event="step", step=2, loss=None, local_loss=0.0, local_loss_finite=True,
                           nonfinite="produced", nonfinite_at="computed its activations of micro-batch 0"))
    for r in (1, 2):
        found += mon.observe(ev(r, 3.0, event="step", step=2, loss=None, local_loss=None, local_loss_finite=r != 2,
                                nonfinite="received", nonfinite_at="received the activations of micro-batch 0"))
    [nan] = found
    assert (nan.kind, nan.node, nan.rank) == (IncidentKind.NAN, "a", 0)
    assert "computed its activations of micro-batch 0" in nan.evidence["reason"]
    assert mon.culprits() == ["a"]


def test_the_bottleneck_stage_is_the_straggler_named_with_its_excess_over_the_prediction() -> None:
    assert evaluate_stage_straggler({0: 1.0, 1: 1.2, 2: 1.1}, {0: 1.0, 1: 1.0, 2: 1.0}, 0.5) is None
    # Every stage 1.5x its prediction: the prediction is off, no stage straggles.
    assert evaluate_stage_straggler({0: 1.5, 1: 3.0, 2: 1.5}, {0: 1.0, 1: 2.0, 2: 1.0}, 0.5) is None
    slow = evaluate_stage_straggler({0: 1.0, 1: 6.0, 2: 1.1}, {0: 1.0, 1: 2.0, 2: 1.0}, 0.5)
    assert slow is not None and slow.rank == 1 and slow.ratio == 3.0
    mon = pipeline(predicted=(1.0, 2.0, 1.0), straggler_window=3, straggler_min_s=2.0)
    found = []
    for step in range(2, 8):
        for r, secs in ((0, 1.0), (1, 6.0), (2, 1.1)):
            found += mon.observe(ev(r, 2.0 + step, event="step", step=step, loss=2.0, step_time_s=7.0,
                                    compute_s=7.0, busy_s=secs))
    [inc] = found
    assert (inc.kind, inc.node, inc.rank, str(inc.action)) == (IncidentKind.STRAGGLER, "b", 1, "warn")
    assert inc.evidence["exceeds_prediction_by"] == 2.0 and inc.evidence["predicted_stage_s"] == 2.0
    assert inc.evidence["reason"].startswith("stage 1 is the bottleneck: 6s of compute per step, 3.00x its predicted")


def test_a_relaunch_on_fewer_nodes_drops_a_pinned_split_and_says_so() -> None:
    from coordinator.config.playbook import parse_playbook
    from coordinator.run.job import QuietUI, replan_playbook

    said: list[str] = []

    class UI(QuietUI):
        def message(self, text: str) -> None:
            said.append(text)

    pb = parse_playbook({"name": "p", "model": "/m", "data": "/d", "train": {
        "method": "full", "strategy": "pipeline", "layer_split": [2, 2, 2], "batch_size": 6}}, path="pb.yaml")
    assert replan_playbook(pb, 3, UI()) is pb and not said
    again = replan_playbook(pb, 2, UI())
    assert again.train.layer_split is None and again.train.strategy == "pipeline" and pb.train.layer_split == (2, 2, 2)
    assert said == ["train.layer_split [2, 2, 2] pins 3 stages; 2 node(s) are left: the split over them is computed"]


def test_a_stage_names_the_first_non_finite_value_at_its_boundary_as_produced_or_received() -> None:
    import mlx.core as mx

    from worker.parallel.pipeline.strategy import Boundary

    ok, bad = mx.ones((2, 3)), mx.array([1.0, float("nan")])
    clean = Boundary()
    clean.inp(ok, "the activations of micro-batch 0 from stage 0")
    clean.out(ok, "its activations of micro-batch 0 (for stage 2)")
    assert clean.verdict() == {}
    # The NaN it made goes downstream and comes back as a gradient: still its own.
    made = Boundary()
    made.inp(ok, "the activations of micro-batch 0 from stage 0")
    made.out(bad, "its activations of micro-batch 0 (for stage 2)")
    made.inp(bad, "the gradient of micro-batch 0 from stage 2")
    assert made.verdict() == {"nonfinite": "produced",
                              "nonfinite_at": "computed its activations of micro-batch 0 (for stage 2)"}
    # A NaN it was sent is its neighbour's, whatever it computed from it.
    got = Boundary()
    got.inp(mx.array([float("inf")]), "the activations of micro-batch 1 from stage 0")
    got.out(bad, "its loss after micro-batch 1")
    assert got.verdict() == {"nonfinite": "received",
                             "nonfinite_at": "received the activations of micro-batch 1 from stage 0"}


def test_an_error_every_stage_shares_is_the_jobs() -> None:
    mon = pipeline()
    for r in range(3):
        mon.observe(ev(r, 3.0 + r / 10, event="error", message="KeyError: 'text'", traceback="tb"))
    mon.resolve()
    assert mon.job_error is not None and not mon.culprits()


def test_each_stage_shard_of_a_complete_checkpoint_is_copied_to_its_neighbours_node() -> None:
    from coordinator.run.replicas import StageShard, compute_replicas

    def shards(*steps: int | None, nodes: str = "abc") -> list[StageShard]:
        return [StageShard(r, nodes[r], step, None if step is None else f"/w/{nodes[r]}/stage-{r}/step-{step}")
                for r, step in enumerate(steps)]

    assert compute_replicas(shards(4, 4, None), done=0) is None  # stage 2 has not written step 4 yet
    assert compute_replicas(shards(6, 4, 4), done=0) is None  # one step, every stage
    assert compute_replicas(shards(4, 4, 4), done=4) is None  # done already
    assert compute_replicas(shards(4, 4, nodes="aa"), done=0) is None  # no second node
    step, copies = compute_replicas(shards(4, 4, 4), done=2)  # type: ignore[misc]
    assert step == 4 and copies == (ShardCopy("a", "/w/a/stage-0/step-4", "b", "stage-0-from-a"),
                                    ShardCopy("b", "/w/b/stage-1/step-4", "c", "stage-1-from-b"),
                                    ShardCopy("c", "/w/c/stage-2/step-4", "a", "stage-2-from-c"))
    # Two stages on one node: the copy goes to the next stage on ANOTHER node.
    _, copies = compute_replicas(shards(2, 2, 2, nodes="aab"), done=0)  # type: ignore[misc]
    assert [c.dest for c in copies] == ["b", "b", "a"]
    # A node lost for good: its stage's shard is still on the survivors (the resume scan finds the replica).
    scans = {"a": (shard("a", 4, 0), shard("a", 4, 2)), "c": (shard("c", 4, 2), shard("c", 4, 1))}
    assert decide_pipeline_resume(scans, restart_from_scratch=False).step == 4
