"""The pipeline's step model (`planning.pipesim`): hand-computed schedules on a clock."""

from __future__ import annotations

import math

import pytest

from coordinator.planning.pipesim import LinkCost, StageCost, simulate_step, stage_actions
from worker.parallel.pipeline.schedule import build_schedule


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_order_is_the_workers(schedule: str) -> None:
    for stages in range(1, 6):
        for micro in range(1, 10):
            for s in range(stages):
                worker = [(a.kind, a.micro) for a in build_schedule(schedule, s, stages, micro)]
                assert stage_actions(schedule, s, stages, micro) == worker, (schedule, s, stages, micro)


def test_one_stage_is_its_micro_batches_and_its_update() -> None:
    assert simulate_step([StageCost(0.0, 3.0, 0.5)], 3).step_s == pytest.approx(9.5)


def test_two_stages_by_hand() -> None:
    # Stage 0: F0 [0,1], F1 [1,2]; stage 1 (its forward runs in its backward): B0 [1,4], B1 [4,7];
    # stage 0 takes the gradients at 4 and 7: B0 [4,6], B1 [7,9].
    pred = simulate_step([StageCost(1.0, 2.0), StageCost(0.0, 3.0)], 2)
    assert pred.step_s == pytest.approx(9.0)
    assert pred.done_s == pytest.approx((9.0, 7.0))
    assert pred.busy_s == pytest.approx((6.0, 6.0))


def test_gpipe_by_hand() -> None:
    # GPipe's last stage receives every activation before its first backward: B0 [2,5], B1 [5,8]; stage 0
    # B0 [5,7], B1 [8,10].
    pred = simulate_step([StageCost(1.0, 2.0), StageCost(0.0, 3.0)], 2, schedule="gpipe")
    assert pred.done_s == pytest.approx((10.0, 8.0))


def test_latency_delays_both_directions() -> None:
    # F0 [0,1], arrives 1.5; B1 [1.5,4.5], arrives 5; B0 [5,7]; the step's all_sum: 2 messages of 0.5 s.
    pred = simulate_step([StageCost(1.0, 2.0), StageCost(0.0, 3.0)], 1, links=[LinkCost(0.5, math.inf)])
    assert pred.done_s == pytest.approx((7.0, 4.5))
    assert pred.collective_s == pytest.approx(1.0)
    assert pred.step_s == pytest.approx(8.0)


def test_bandwidth_occupies_the_sender() -> None:
    # 100 bytes at 100 B/s: F0 [0,1], send [1,2]; B1 [2,5], send [5,6]; B0 [6,8].
    pred = simulate_step([StageCost(1.0, 2.0), StageCost(0.0, 3.0)], 1, links=[LinkCost(0.0, 100.0)],
                         activation_bytes=100)
    assert pred.done_s == pytest.approx((8.0, 6.0))
    assert pred.transfer_s == pytest.approx((1.0,))


def test_equal_stages_take_the_textbook_time() -> None:
    # 1F1B: (M + P - 1) x (f + b), idle (P - 1) / (M + P - 1) of it.
    costs = [StageCost(1.0, 2.0), StageCost(1.0, 2.0), StageCost(0.0, 3.0)]
    pred = simulate_step(costs, 4)
    assert pred.step_s == pytest.approx(18.0)
    assert pred.bubble == pytest.approx(2 / 6)


def test_the_slowest_stage_paces_the_rest() -> None:
    # Stage 1 (6 s per micro-batch) ends B_k at 7 + 6k; stage 0's last backward follows B7: 49 + 2 = 51,
    # which is sum(stages) + (M - 1) x the slowest: 9 + 7 x 6.
    pred = simulate_step([StageCost(1.0, 2.0), StageCost(0.0, 6.0)], 8)
    assert pred.step_s == pytest.approx(51.0)


def test_updates_run_in_parallel_after_each_stage() -> None:
    # Stage 1 finishes at 7 and updates for 5 s (12); stage 0 at 9 plus 1 s: the step is 12.
    pred = simulate_step([StageCost(1.0, 2.0, 1.0), StageCost(0.0, 3.0, 5.0)], 2)
    assert pred.step_s == pytest.approx(12.0)


def test_malformed_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="2 stages need 1 link"):
        simulate_step([StageCost(1, 1), StageCost(0, 1)], 2, links=[])
    with pytest.raises(ValueError, match="non-negative"):
        StageCost(-1.0, 1.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate_step([StageCost(1, 1)], 1, schedule="zb")
