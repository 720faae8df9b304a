"""A step's time as a function of the real tokens it carries: what a rehearsal's rate becomes over the run's steps.

A rehearsal times the run's first steps (run/rehearse.py). On variable-length rows those steps carry another
number of tokens than the run's typical step: on the bench's variable set the first 16 steps of a 30-step run held
17% more real tokens a step than all 30, and where a step's time hardly depends on its tokens (a tiny model, whose
step is mostly fixed cost) the run's rate then fell 25% below the rehearsal's. So the rehearsal's steps are read as
(tokens, seconds) pairs and fitted with

    step_s(tokens) = a + b * tokens        (a: the fixed cost of a step, b: the cost of a token; both >= 0)

and the rate a step of M tokens has, M / (a + b * M), rises with M. So the median of the run's step rates (the
statistic the run reports, `Monitor.run_tokens_per_s`) is the rate at the median tokens of the run's steps, which
the worker counts from the data order before its first step (`token_census` in run.json). The prediction is the
rehearsal's own median rate moved by the fit from the rehearsal's median tokens to the run's:

    predicted = rehearsal rate * rate(M_run) / rate(M_rehearsal)

so a run whose steps carry what the rehearsal's carried is predicted at exactly the rehearsal's rate.

The fit is Theil-Sen (the median of the pairwise slopes, then the median intercept): one slow step, common on a
machine that ranks share, moves neither. Where the timed steps' tokens hardly differ (full-length rows) there is no
slope to read and none is needed: the run's steps carry the same tokens, and the rehearsal's rate is kept. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Timed steps whose tokens spread less than this (max/min - 1) give no slope: the rehearsal's own rate stands.
FLAT_SPREAD = 0.05


@dataclass(frozen=True)
class StepTime:
    """step_s = fixed_s + token_s * tokens (both >= 0)."""

    fixed_s: float
    token_s: float

    def rate(self, tokens: float) -> float:
        """Tokens per second of a step that carries `tokens`."""
        return tokens / (self.fixed_s + self.token_s * tokens)


def _usable(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(t, s) for t, s in samples if t > 0 and s > 0]


def median_tokens(samples: Sequence[tuple[float, float]]) -> float | None:
    """The median tokens of the usable (tokens, seconds) samples: the tokens the timed rate stands for."""
    points = _usable(samples)
    return float(statistics.median(t for t, _ in points)) if points else None


def fit_step_time(samples: Sequence[tuple[float, float]]) -> StepTime | None:
    """The Theil-Sen fit of (tokens, seconds) samples, clamped to a >= 0 and b >= 0; None where the tokens hardly
    differ (`FLAT_SPREAD`) or fewer than 3 samples have positive tokens and seconds."""
    points = _usable(samples)
    if len(points) < 3:
        return None
    tokens = [t for t, _ in points]
    if max(tokens) / min(tokens) - 1.0 < FLAT_SPREAD:
        return None
    slopes = [(s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(points) for t2, s2 in points[i + 1:] if t2 != t1]
    # b <= the smallest seconds per token: a line through the origin bounds it (a >= 0 beyond that)
    token_s = min(max(0.0, statistics.median(slopes)), statistics.median(s / t for t, s in points))
    fixed_s = max(0.0, statistics.median(s - token_s * t for t, s in points))
    if fixed_s == 0.0 and token_s == 0.0:
        return None
    return StepTime(fixed_s, token_s)


def rate_over_run(samples: Sequence[tuple[float, float]], run_tokens: float | None, timed_rate: float) -> float:
    """The run's median tokens/s from its rehearsal: `samples` (tokens, seconds) of the rehearsal's timed steps,
    `run_tokens` the median real tokens of the run's steps (None: not counted, e.g. DPO), `timed_rate` the
    rehearsal's own median rate. The rehearsal's rate where there is nothing to fit or nothing to fit it to."""
    fit = fit_step_time(samples)
    timed_tokens = median_tokens(samples)
    if fit is None or timed_tokens is None or run_tokens is None or run_tokens <= 0:
        return timed_rate
    return timed_rate * fit.rate(run_tokens) / fit.rate(timed_tokens)


__all__ = ["FLAT_SPREAD", "StepTime", "fit_step_time", "median_tokens", "rate_over_run"]
