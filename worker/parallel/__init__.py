"""How the ranks of a run share the work (`RunConfig.layout`): one `Strategy` per rank, the trainer's only way to
the model. `dp`: every rank a full replica (`worker.parallel.dp`); `fsdp`: parameters, gradients and optimizer state sharded
over the ranks (`worker.parallel.fsdp`); `pipeline`: each rank a contiguous range of
layers (`worker.parallel.pipeline`). See `worker.parallel.base` for the interface."""

from __future__ import annotations

from worker.errors import TrainingError
from worker.events import EventLog
from worker.parallel.base import Strategy
from worker.runconfig import RunConfig


def make_strategy(config: RunConfig, log: EventLog) -> Strategy:
    """The strategy of `config.layout` for this rank."""
    kind = config.layout.kind
    if kind == "dp":
        from worker.parallel.dp import DataParallel

        return DataParallel(config, log)
    if kind == "pipeline":
        from worker.parallel.pipeline import Pipeline

        return Pipeline(config, log)
    if kind == "fsdp":
        from worker.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(config, log)
    raise TrainingError(f"layout kind {kind!r} is not implemented by this worker")


__all__ = ["Strategy", "make_strategy"]
