"""The training objectives (the step itself is `worker.step`): what a micro-batch is and what its loss is, for SFT
(mlx-lm's padding and loss mask, or packed sequences) and DPO (a frozen reference model). Shared by the run
(`worker.train`) and calibration (`worker.bench`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from worker.data import build_batch, rank_slice, sequence_logps, stream_rows
from worker.dpo import STATS as DPO_STATS
from worker.dpo import build_pair_batch, dpo_loss_sum
from worker.shapes import meets_new_shape
from worker.step import (
    pack_rows,
    packed_loss_sum,
    packed_plan,
    padded_width,
    sft_weight,
    token_loss_sum,
)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a step as every rank sees it: this rank's inputs, and the counts of the whole global
    micro-batch, known on every rank without a collective (the data order and the split are functions of the
    config). `tokens`/`total_tokens` None: counted on the device (DPO's completion tokens)."""

    inputs: tuple[mx.array, ...]
    weight: int
    total_weight: int
    tokens: int | None
    total_tokens: int | None
    consumed: int  # stream rows the global micro-batch used


def _items(dataset: Any, position: int, rows: int, seed: int) -> list[Any]:
    """The rows at stream positions [position, position + rows) in the run's order."""
    return [dataset[i] for i in stream_rows(position, rows, len(dataset), seed)]


class SftObjective:
    """Next-token cross-entropy; the weight unit is the scored target (mlx-lm's `default_loss`, combined
    exactly). A rank's rows are padded as mlx-lm pads them, or packed (`packing`, worker.step.pack_rows): the
    same rows, loss and gradient, without the padding."""

    stats: tuple[str, ...] = ()

    def __init__(self, max_seq_length: int, packing: bool, width: int | None = None) -> None:
        self.max_seq_length = max_seq_length
        self.packing = packing
        self.width = width  # the run's packed sequence width (decide_packing)
        self.loss: Callable[..., Any] = packed_loss_sum if packing else token_loss_sum

    def micro(self, dataset: Any, position: int, global_batch: int, seed: int, offset: int, size: int) -> Micro:
        length = self.max_seq_length
        items = _items(dataset, position, global_batch, seed)
        mine = rank_slice(items, offset, size)
        (weight, tokens), (total_weight, total_tokens) = sft_weight(mine, length), sft_weight(items, length)
        inputs = pack_rows(mine, length, self.width).arrays() if self.packing else build_batch(mine, length)
        return Micro(inputs, weight, total_weight, tokens, total_tokens, global_batch)

    def rows_tokens(self, dataset: Any, position: int, rows: int, seed: int) -> int | None:
        """The real tokens of the rows at stream positions [position, position + rows), as `micro` counts its
        `total_tokens`; no arrays built."""
        return sft_weight(_items(dataset, position, rows, seed), self.max_seq_length)[1]

    def slice_shape(self, dataset: Any, position: int, global_batch: int, seed: int, offset: int,
                    size: int) -> tuple[int, int]:
        """The (rows or sequences, positions) of the batch `micro` builds for this slice; no arrays built. A step
        on a shape its process has not met before traces and compiles it."""
        return self.batch_shape(rank_slice(_items(dataset, position, global_batch, seed), offset, size))

    def batch_shape(self, mine: Sequence[Any]) -> tuple[int, int]:
        """`slice_shape` of a slice's rows: packed, (sequences, width) as `pack_rows` plans them; padded, `build_batch`'s
        (rows, width)."""
        lengths = [len(t) for t, _ in mine] or [1]
        if self.packing:
            width, _, count = packed_plan(lengths, self.max_seq_length, self.width)
            return count, width
        return len(mine), padded_width(lengths, self.max_seq_length) + 1  # build_batch's tokens hold the last target

    def eval_sums(self, model: Any, dataset: Any, rows: Sequence[int]) -> tuple[mx.array, mx.array, mx.array | None]:
        loss_sum, weight, _ = token_loss_sum(model, *build_batch([dataset[i] for i in rows], self.max_seq_length))
        return loss_sum, weight, None


class DpoObjective:
    """DPO (worker.dpo) against a frozen reference model; the weight unit is the preference pair."""

    stats: tuple[str, ...] = DPO_STATS
    packing = False

    def __init__(self, reference: Any, beta: float, max_seq_length: int) -> None:
        self.reference = reference
        self.beta = beta
        self.max_seq_length = max_seq_length

        def loss(m: Any, batch: mx.array, lengths: mx.array, ref: mx.array) -> tuple[mx.array, ...]:
            return dpo_loss_sum(m, batch, lengths, ref, beta)

        self.loss: Callable[..., Any] = loss

    def _inputs(self, dataset: Any, rows: Sequence[int]) -> tuple[mx.array, mx.array, mx.array]:
        batch, lengths = build_pair_batch([dataset[i] for i in rows], self.max_seq_length)
        ref, _ = sequence_logps(self.reference, batch, lengths)
        return batch, lengths, mx.stop_gradient(ref)

    def rows_tokens(self, dataset: Any, position: int, rows: int, seed: int) -> int | None:
        """None: a DPO step reports its tokens after its collective, not from the data order."""
        return None

    def micro(self, dataset: Any, position: int, global_batch: int, seed: int, offset: int, size: int) -> Micro:
        rows = stream_rows(position, global_batch, len(dataset), seed)
        mine = rank_slice(rows, offset, size)
        return Micro(self._inputs(dataset, mine), len(mine), len(rows), None, None, global_batch)

    def eval_sums(self, model: Any, dataset: Any, rows: Sequence[int]) -> tuple[mx.array, mx.array, mx.array | None]:
        loss_sum, pairs, _, stats = dpo_loss_sum(model, *self._inputs(dataset, rows), self.beta)
        return loss_sum, pairs, stats


CENSUS_STEPS = 1024  # steps counted at most by `step_census` (evenly spaced past that)


@dataclass(frozen=True)
class StepCensus:
    """The run's steps from the data order, before the first one runs (a rehearsal's `token_census`): each
    counted step's real tokens (all ranks) and the indices of the steps on which some rank meets a batch shape
    new to its process (it traces and compiles it: a one-time cost that, on variable-length rows, falls on the
    steps with the largest batches yet). coordinator/planning/steptime.py predicts the run's rate over them."""

    tokens: tuple[int, ...]
    new_shape: tuple[int, ...]

    def median_tokens(self) -> float:
        return float(statistics.median(self.tokens))


def step_census(objective: Any, dataset: Any, steps: int, global_batch: int, accumulation: int,
                slices: Sequence[tuple[int, int]], seed: int) -> StepCensus | None:
    """The census of the data order's steps 1..`steps` (each `accumulation` micro-batches of `global_batch`
    stream rows, rank r's slice (offset, size) of each), or None where the objective counts no tokens (DPO).
    Past the first epoch only its steps are counted: every epoch is another order of the same rows, so the steps'
    tokens have the same spread, and one epoch's order is computed once. Past CENSUS_STEPS steps they are spread
    evenly, and a new shape is new among the counted steps (an approximation: a long run meets its shapes early,
    and its rate is not moved by a handful of them)."""
    per_step = global_batch * accumulation
    steps = min(steps, max(1, len(dataset) // max(1, per_step)))
    picks = range(steps) if steps <= CENSUS_STEPS else [k * steps // CENSUS_STEPS for k in range(CENSUS_STEPS)]
    shaped = hasattr(objective, "batch_shape")
    tokens: list[int] = []
    shapes: list[tuple[Any, ...]] = []  # each counted step's shape of every rank
    for k in picks:
        count = objective.rows_tokens(dataset, k * per_step, per_step, seed)
        if count is None:
            return None
        tokens.append(int(count))
        # Each micro-batch's rows read once; every rank's shape is its slice of them.
        micros = [_items(dataset, k * per_step + m * global_batch, global_batch, seed)
                  for m in range(accumulation)] if shaped else []
        shapes.append(tuple(tuple(objective.batch_shape(rank_slice(rows, offset, size)) for rows in micros)
                            for offset, size in slices))
    new = tuple(index for index, fresh in enumerate(meets_new_shape(shapes)) if fresh)
    return StepCensus(tuple(tokens), new) if tokens else None


def stats_fields(names: Sequence[str], sums: Sequence[float], weight: float, prefix: str = "") -> dict[str, float]:
    """The event fields of an objective's extra sums, as means per weight unit (`reward_correct` -> accuracy)."""
    out: dict[str, float] = {}
    for name, value in zip(names, sums):
        key = "reward_accuracy" if name == "reward_correct" else name
        out[prefix + key] = value / weight if weight else 0.0
    return out
