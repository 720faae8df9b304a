"""Helpers for tests of the training step (worker.step) in-process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from worker.comm import scalar
from worker.step import TrainStep, flatten


def sgd_step(model: Any, loss_fn: Callable[..., Any], inputs: Sequence[mx.array], all_sum: Callable[[mx.array], mx.array],
             world: int, total_weight: int, *, compiled: bool = True) -> tuple[dict[str, mx.array], float]:
    """One SGD(lr=1) step of the TrainStep on `inputs`: (the applied gradient, i.e. before - after, and the
    reported loss). `compiled=False` runs it eagerly (a recording all_sum then sees real values)."""
    import mlx.optimizers as optim

    opt = optim.SGD(learning_rate=1.0)
    opt.init(model.trainable_parameters())
    before = {k: mx.array(v) for k, v in flatten(model.trainable_parameters()).items()}
    step = TrainStep(model, opt, loss_fn, all_sum=all_sum, world_size=world, compiled=compiled)
    local = step.local([inputs])
    loss, _ = step.apply(local, total_weight)
    mx.eval(model.parameters(), loss)
    after = flatten(model.trainable_parameters())
    return {k: before[k] - after[k] for k in before}, scalar(loss)


def split_step(make_model: Callable[[], Any], loss_fn: Callable[..., Any], rank0: Sequence[mx.array],
               rank1: Sequence[mx.array], total_weight: int) -> tuple[Any, dict[str, mx.array], float]:
    """Rank 0's step of a 2-rank world, in-process: rank 1 runs eagerly and records what it sends to the
    all_sum; rank 0 (compiled) adds it to its own buckets, in the same order. Returns (rank 0's model, the
    applied gradient, the reported loss)."""
    buckets: list[mx.array] = []

    def record(x: mx.array) -> mx.array:
        mx.eval(x)
        buckets.append(x)
        return x

    sgd_step(make_model(), loss_fn, rank1, record, 2, total_weight, compiled=False)
    calls = iter(buckets)
    model = make_model()
    applied, loss = sgd_step(model, loss_fn, rank0, lambda x: x + next(calls), 2, total_weight)
    return model, applied, loss
