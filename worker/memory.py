"""How much memory a training step may hold: its working set plus a bounded run-ahead (`train.memory_headroom`).

Why a step's peak is above what it needs: MLX evaluates a graph by scheduling its ops ahead of the device (on
CUDA up to 10 command buffers in flight, each of up to 100 ops / 1,000 MB on an H100) and frees an op's inputs
only when the task that used them completes. The further the host runs ahead, the more buffers are held by work
that has been scheduled but has not finished: the measured peak (`mx.get_peak_memory`, active memory) rises above
the step's working set, by up to 30-70% on an H100 (docs/benchmarks-history.md, "clear_cache"). mlx-lm's trainer
is lower only because it empties MLX's buffer cache after every step (`mx.clear_cache`): every allocation of the
next step is a fresh device allocation, the host is slower, and less is in flight; that costs 10-25% of the
speed.

What this does instead: it measures the step's working set W once, by running one step with nothing in flight
(a memory limit of one byte: `eval` waits for every op's task before it schedules the next, mlx/transforms.cpp),
and then sets MLX's memory limit to W x (1 + headroom). Above that limit `eval` waits for one task to finish
before it schedules more, so the run-ahead is bounded by the headroom while the device keeps the rest of its
queue; below it nothing changes. On CUDA the same limit also bounds the buffer cache (an allocation that misses
the cache first gives back cached buffers beyond the limit), so what the process holds is bounded too. W is
measured again whenever a step's inputs are larger (more elements) than any measured before, on that step (a
larger batch shape has a larger working set; a smaller one fits under the bound); with variable-length rows that
is a handful of steps in a run (each new maximum of a random order), each of which also compiles its new shape.

Measuring a step's own peak resets MLX's peak counter: `peak_memory()` is the process's peak with the peaks before
every reset kept (what `mx.get_peak_memory()` would say without them); step events report it.

The measurement step is slower (every op waits for the device); calibration's first step at each batch is its
compiling warm-up, which is the measuring step there too, so the measured rate is that of bounded steps.

`clear_cache` (`train.clear_cache`) still empties the buffer cache after every step, as mlx-lm does.

Who calls it: `worker.step.TrainStep.run` (the dp and fsdp steps and calibration's) and the pipeline's step
(`worker.parallel.pipeline.strategy.Pipeline.step`), whose schedule evaluates every action, each send and recv
among them, before the next: a measuring step holds no collective back from its peer.

Compatibility: Python 3.9+ (the nodes' python); mlx only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from worker.runconfig import DEFAULT_HEADROOM

_NOTHING_IN_FLIGHT = 1  # bytes: a memory limit every op exceeds, so eval waits for each op's task
_earlier_peak = 0  # the process's peak before the last reset made here


def peak_memory() -> int:
    """The process's peak active memory (bytes) since it started or since the caller's own
    `mx.reset_peak_memory()`, the resets made here not counted."""
    return max(_earlier_peak, int(mx.get_peak_memory()))


def _reset_peak() -> None:
    global _earlier_peak
    _earlier_peak = peak_memory()
    mx.reset_peak_memory()


def compute_limit(working_set: int, headroom: float) -> int:
    """MLX's memory limit for a step whose working set is `working_set` bytes: (1 + headroom) of it."""
    return int(working_set * (1.0 + headroom))


def batch_size_of(inputs: Sequence[Any]) -> int:
    """Elements of a step's input arrays (every micro-batch's): what makes one batch shape larger than another."""
    return sum(int(getattr(a, "size", 0)) for a in inputs)


@dataclass
class StepMemory:
    """The memory policy of one rank's steps: `begin(size)` before a step's evaluation (size: `batch_size_of` its
    inputs), `end()` after it. `headroom` None: no bound (MLX's own scheduling). State: the largest input size
    measured, the working set measured for it, the limit set (0 before any)."""

    headroom: float | None = DEFAULT_HEADROOM
    clear_cache: bool = False
    measured_size: int = 0
    working_set: int = 0
    limit: int = 0
    _measuring: bool = False
    _previous_limit: int = 0  # MLX's limit before the first measuring step: `release` puts it back

    def begin(self, size: int) -> None:
        if self.headroom is None or size <= self.measured_size:
            return
        # A larger shape than any measured: this step runs with nothing in flight; its peak is its working set.
        if not self._previous_limit:
            self._previous_limit = mx.get_memory_limit()
        self._measuring = True
        self.measured_size = size
        _reset_peak()
        mx.set_memory_limit(_NOTHING_IN_FLIGHT)

    def end(self) -> None:
        if self._measuring:
            self._measuring = False
            self.working_set = max(self.working_set, int(mx.get_peak_memory()))
            self.limit = compute_limit(self.working_set, self.headroom or 0.0)
            mx.set_memory_limit(self.limit)
        if self.clear_cache:
            mx.clear_cache()

    def release(self) -> None:
        """Give MLX the limit it had before the first measuring step back (after training, or when the step raised
        while measuring)."""
        self._measuring = False
        if self._previous_limit:
            mx.set_memory_limit(self._previous_limit)
