"""planning/steptime.py: a rehearsal's rate moved to the tokens of the run's steps (pure), and the worker's count
of those tokens and the steps that meet a new batch shape from the data order (worker.objectives.step_census)."""

from __future__ import annotations

import pytest

from coordinator.planning.steptime import Census, fit_step_time, rate_over_run


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
    """step_census counts what the run's steps report as total_tokens: the same rows, the same cap."""
    import statistics

    from worker.objectives import CENSUS_STEPS, DpoObjective, SftObjective, step_census

    lengths = [5, 40, 17, 3, 64, 90, 12, 33, 8, 70, 21, 50, 6, 44]
    dataset = [([1] * n, 0) for n in lengths * 3]  # 42 rows: 10 steps of 4 an epoch
    objective = SftObjective(max_seq_length=48, packing=False)
    steps, rows, seed, whole = 9, 4, 3, [(0, 4)]
    counted = [objective.micro(dataset, k * rows, rows, seed, 0, rows).total_tokens for k in range(steps)]
    census = step_census(objective, dataset, steps, rows, 1, whole, seed)
    assert census is not None and list(census.tokens) == counted
    assert census.median_tokens() == statistics.median(counted)
    # a run longer than an epoch: the first epoch's steps (the same rows in another order each epoch)
    epoch = len(dataset) // rows
    first = [objective.micro(dataset, k * rows, rows, seed, 0, rows).total_tokens for k in range(epoch)]
    longer = step_census(objective, dataset, 50, rows, 1, whole, seed)
    assert longer is not None and list(longer.tokens) == first
    # past CENSUS_STEPS steps in an epoch, evenly sampled: still a count of real steps, each capped at the length
    big = dataset * (CENSUS_STEPS // 2)
    many = step_census(objective, big, 3 * CENSUS_STEPS, rows, 1, whole, seed)
    assert many is not None and len(many.tokens) == CENSUS_STEPS and 4 * 3 <= many.median_tokens() <= 4 * 48
    assert step_census(DpoObjective(None, 0.1, 48), dataset, steps, rows, 1, whole, seed) is None


@pytest.mark.parametrize("packing", [False, True])
def test_the_census_names_the_steps_on_which_a_rank_meets_a_new_batch_shape(packing: bool) -> None:
    """A slice's shape from the data order (`slice_shape`, no arrays) is the shape `micro` builds; a step is new
    where any rank meets a shape its process has not stepped on, as the worker's `new_shape` flags it."""
    from worker.objectives import SftObjective, step_census

    lengths = [5, 40, 17, 3, 64, 90, 12, 33, 8, 70, 21, 50, 6, 44, 120, 2]
    dataset = [([1] * n, 0) for n in lengths * 4]
    objective = SftObjective(max_seq_length=128, packing=packing, width=127 if packing else None)
    slices, rows, seed = [(0, 3), (3, 5)], 8, 1
    seen: list[set[tuple[int, ...]]] = [set(), set()]
    expected = []
    for k in range(8):
        fresh = False
        for rank, (offset, size) in enumerate(slices):
            built = tuple(objective.micro(dataset, k * rows, rows, seed, offset, size).inputs[0].shape)
            assert objective.slice_shape(dataset, k * rows, rows, seed, offset, size) == built
            fresh |= built not in seen[rank]
            seen[rank].add(built)
        if fresh:
            expected.append(k)
    census = step_census(objective, dataset, 8, rows, 1, slices, seed)
    assert census is not None and list(census.new_shape) == expected and expected[0] == 0 and len(expected) < 8


def test_steps_that_compile_a_new_shape_are_modelled_in_the_run_and_in_the_rehearsal() -> None:
    """A step that meets a new batch shape traces and compiles it: on variable-length rows those are the steps with
    the largest batches yet, so the run's median falls below the rate at its median tokens. Modelled on both
    sides with the rehearsal's own compiling steps' excess, the run is predicted at its modelled median."""
    fixed, compile_s = 0.05, 0.10
    timed_tokens = [150.0, 170.0, 300.0, 160.0, 190.0, 155.0, 175.0, 165.0]
    timed_new = [False, False, True, False, False, False, False, False]
    samples = [(t, fixed + (compile_s if c else 0.0)) for t, c in zip(timed_tokens, timed_new, strict=True)]
    timed = statistics_median([t / s for t, s in samples])  # the rehearsal's rate, its compiling step among them
    run = [100.0, 120.0, 250.0, 110.0, 260.0, 105.0, 270.0, 115.0, 140.0, 130.0]
    new = frozenset({2, 4, 6})  # its three largest steps meet new shapes
    got = rate_over_run(samples, 125.0, timed, census=Census(tuple(run), new), compiled=timed_new)
    modelled = sorted(t / (fixed + (compile_s if i in new else 0.0)) for i, t in enumerate(run))
    assert got == pytest.approx(statistics_median(modelled))
    assert got < rate_over_run(samples, 125.0, timed)  # the median tokens alone: the compiles not counted
    # The run's steps are the rehearsal's own: its own rate, whatever the model.
    same = rate_over_run(samples, None, timed, census=Census(tuple(timed_tokens), frozenset({2})), compiled=timed_new)
    assert same == pytest.approx(timed)


def statistics_median(values: list[float]) -> float:
    import statistics

    return float(statistics.median(values))
