"""Pipeline parallelism, in three parts: `layout` (which tensors and layer numbers a stage holds: names, pure),
`stage` (a stage's piece of the model and its forward/backward), `schedule` (the order of a stage's actions over
the micro-batches: pure, 1F1B or GPipe), and the `strategy` that runs them for the trainer."""

from __future__ import annotations

from worker.parallel.pipeline.strategy import Pipeline

__all__ = ["Pipeline"]
