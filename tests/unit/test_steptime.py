"""planning/steptime.py: a rehearsal's rate moved to the tokens of the run's steps (pure), and the worker's count
of those tokens from the data order (worker.objectives.median_step_tokens)."""

from __future__ import annotations

import pytest

from coordinator.planning.steptime import fit_step_time, rate_over_run


def _steps(fixed: float, per_token: float, tokens: list[float]) -> list[tuple[float, float]]:
    return [(t, fixed + per_token * t) for t in tokens]


def test_a_fixed_cost_step_moves_the_rate_with_the_tokens_and_a_per_token_one_does_not() -> None:
    tokens = [150.0, 170.0, 160.0, 190.0, 155.0, 175.0]
    fixed = _steps(0.05, 0.0, tokens)  # a tiny model: the step costs the same whatever it carries
    timed = 165.0 / 0.05
    assert rate_over_run(fixed, 120.0, timed) == pytest.approx(timed * 120.0 / 165.0)
    linear = _steps(0.0, 1e-4, tokens)  # all per-token cost: every step runs at the same rate
    assert rate_over_run(linear, 120.0, 10_000.0) == pytest.approx(10_000.0)
    both = _steps(0.02, 1e-4, tokens)
    fit = fit_step_time(both)
    assert fit is not None and fit.fixed_s == pytest.approx(0.02) and fit.token_s == pytest.approx(1e-4)
    timed_both = fit.rate(165.0)
    assert rate_over_run(both, 120.0, timed_both) == pytest.approx(fit.rate(120.0))
    assert rate_over_run(both, 165.0, timed_both) == pytest.approx(timed_both)  # the same tokens: the same rate


def test_nothing_to_fit_or_nothing_to_fit_it_to_keeps_the_rehearsals_rate() -> None:
    flat = _steps(0.05, 1e-4, [512.0, 512.0, 515.0, 511.0])  # full-length rows: no slope to read
    assert fit_step_time(flat) is None and rate_over_run(flat, 300.0, 7_000.0) == 7_000.0
    assert rate_over_run(_steps(0.05, 0.0, [100.0, 200.0]), 150.0, 3_000.0) == 3_000.0  # too few steps
    assert rate_over_run(_steps(0.05, 0.0, [100.0, 200.0, 300.0]), None, 3_000.0) == 3_000.0  # not counted (DPO)
    assert rate_over_run([(0.0, 0.1), (100.0, 0.0), (-5.0, 1.0)], 100.0, 3_000.0) == 3_000.0  # no usable sample


def test_one_slow_step_moves_neither_the_slope_nor_the_fixed_cost() -> None:
    steps = _steps(0.02, 1e-4, [100.0, 120.0, 140.0, 160.0, 180.0, 200.0, 220.0])
    steps[3] = (160.0, 0.5)  # a neighbour's checkpoint held this step back
    fit = fit_step_time(steps)
    assert fit is not None and fit.fixed_s == pytest.approx(0.02, rel=0.05) and fit.token_s == pytest.approx(1e-4, rel=0.05)


def test_a_fit_is_clamped_to_costs_that_cannot_be_negative() -> None:
    falling = [(100.0, 0.06), (150.0, 0.05), (200.0, 0.04), (250.0, 0.03)]  # noise: more tokens, less time
    fit = fit_step_time(falling)
    assert fit is not None and fit.token_s == 0.0 and fit.fixed_s > 0
    steep = [(100.0, 0.001), (200.0, 0.05), (300.0, 0.1), (400.0, 0.15)]  # would need a negative fixed cost
    fit = fit_step_time(steep)
    assert fit is not None and fit.fixed_s >= 0.0 and fit.token_s > 0


def test_the_worker_counts_the_tokens_each_step_of_the_run_will_carry(tmp_path) -> None:
    """median_step_tokens counts what the run's steps report as total_tokens: the same rows, the same cap."""
    import statistics

    from worker.objectives import CENSUS_STEPS, DpoObjective, SftObjective, median_step_tokens

    lengths = [5, 40, 17, 3, 64, 90, 12, 33, 8, 70, 21, 50, 6, 44]
    dataset = [([1] * n, 0) for n in lengths * 3]  # 42 rows: 10 steps of 4 an epoch
    objective = SftObjective(max_seq_length=48, packing=False)
    steps, rows, seed = 9, 4, 3
    counted = [objective.micro(dataset, k * rows, rows, seed, 0, rows).total_tokens for k in range(steps)]
    assert median_step_tokens(objective, dataset, steps, rows, seed) == statistics.median(counted)
    # a run longer than an epoch: the first epoch's steps (the same rows in another order each epoch)
    epoch = len(dataset) // rows
    first = [objective.micro(dataset, k * rows, rows, seed, 0, rows).total_tokens for k in range(epoch)]
    assert median_step_tokens(objective, dataset, 50, rows, seed) == statistics.median(first)
    # past CENSUS_STEPS steps in an epoch, evenly sampled: still a count of real steps, each capped at the length
    big = dataset * (CENSUS_STEPS // 2)
    many = median_step_tokens(objective, big, 3 * CENSUS_STEPS, rows, seed)
    assert many is not None and 4 * 3 <= many <= 4 * 48
    assert median_step_tokens(DpoObjective(None, 0.1, 48), dataset, steps, rows, seed) is None
