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

A step on which some rank meets a batch shape new to its process traces and compiles it. On variable-length rows
those are the steps with the largest batches yet, so a short run's median falls below the rate at its median tokens
(by 20% on the bench's 30-step 2-rank variable cell). With the run's `Census` (each step's tokens and which meet a
new shape, counted by rank 0 from the data order) every step of the run and of the rehearsal is modelled: the fit
from the rehearsal's steps that compiled nothing, plus the median excess of its compiling ones on the run's
compiling steps, and the prediction is the rehearsal's rate moved by the ratio of the two modelled medians.

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


@dataclass(frozen=True)
class Census:
    """The run's steps as rank 0 counted them from the data order (worker.objectives.StepCensus): each step's real
    tokens, and the indices of the steps on which some rank meets a batch shape new to its process."""

    tokens: tuple[float, ...]
    new_shape: frozenset[int] = frozenset()


def compile_seconds(fit: StepTime, samples: Sequence[tuple[float, float]], compiled: Sequence[bool]) -> float:
    """What a step that traces and compiles a new batch shape costs beyond the fit: the median excess of the timed
    steps that did (0 where none did)."""
    excess = [max(0.0, s - (fit.fixed_s + fit.token_s * t)) for (t, s), c in zip(samples, compiled, strict=True)
              if c and t > 0]
    return float(statistics.median(excess)) if excess else 0.0


def median_rate(fit: StepTime, tokens: Sequence[float], compiled: Sequence[bool], compile_s: float) -> float:
    """The median over steps of tokens / (fit + compile_s where the step compiles): the run's statistic, modelled."""
    return float(statistics.median(t / (fit.fixed_s + fit.token_s * t + (compile_s if c else 0.0))
                                   for t, c in zip(tokens, compiled, strict=True) if t > 0))


def rate_over_run(samples: Sequence[tuple[float, float]], run_tokens: float | None, timed_rate: float, *,
                  census: Census | None = None, compiled: Sequence[bool] = ()) -> float:
    """The run's median tokens/s from its rehearsal: `samples` (tokens, seconds) of the rehearsal's timed steps,
    `compiled` whether each compiled a new batch shape (its rank's `new_shape`; empty: none did), `timed_rate` the
    rehearsal's own median rate. With the run's `census` every step of the run is modelled (the fit, plus the
    compile cost on the steps that meet a new shape: on variable-length rows those are the steps with the largest
    batches yet, whose slow steps pull the run's median below the rate at its median tokens) and the rehearsal's
    steps the same way;
    the prediction is the rehearsal's rate moved by the ratio of the two modelled medians. Without one,
    `run_tokens` (the median real tokens of the run's steps) moves it along the fit. The rehearsal's rate where
    there is nothing to fit or nothing to fit it to (None: not counted, e.g. DPO)."""
    flags = list(compiled) or [False] * len(samples)
    clean = [p for p, c in zip(samples, flags, strict=True) if not c]
    fit = fit_step_time(clean if len(clean) >= 3 else samples)
    timed_tokens = median_tokens(samples)
    if fit is None or timed_tokens is None:
        return timed_rate
    if census is not None and census.tokens:
        cost = compile_seconds(fit, samples, flags)
        run = median_rate(fit, census.tokens, [i in census.new_shape for i in range(len(census.tokens))], cost)
        timed = median_rate(fit, [t for t, _ in samples], flags, cost)
        return timed_rate * run / timed
    if run_tokens is None or run_tokens <= 0:
        return timed_rate
    return timed_rate * fit.rate(run_tokens) / fit.rate(timed_tokens)


__all__ = ["FLAT_SPREAD", "Census", "StepTime", "compile_seconds", "fit_step_time", "median_rate", "median_tokens",
           "rate_over_run"]
