"""The collectives a run uses (`Comm` over `mx.distributed`): all_sum, small gathers, a barrier, and broadcasts
of arrays and bytes from one rank (resume)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from worker.step import (
    all_sum_arrays,
)


def scalar(x: mx.array) -> float:
    """A real scalar array as a Python float (ints stay exact below 2**53)."""
    value = x.item()
    if isinstance(value, complex):
        raise TypeError("complex scalar")
    return float(value)


class Comm:
    """The group plus the few collectives we use, each on the stream its backend chooses (no `stream=`): the CPU
    for ring and jaccl, the GPU for nccl.

    Never `stream=mx.cpu` (mlx-lm's evaluate does that): on nccl the collective then runs in the CPU stream's
    worker thread, and NCCL's implementation asks that thread for the GPU's stream, which MLX keeps per thread:
    `There is no Stream(gpu, 1) in current thread` (issue 27; it killed `mlx_lm lora` on 2 GPUs at its first
    evaluation). Ring and jaccl answer `communication_stream()` with the CPU stream, as before."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = int(group.size())
        self.rank = int(group.rank())

    def all_sum(self, x: mx.array) -> mx.array:
        if self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group)

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        local = mx.array(np.asarray(values, dtype=np.int64).astype(np.int32))
        if self.size == 1:
            return [list(values)]
        out = np.asarray(mx.distributed.all_gather(local, group=self.group))
        return [[int(v) for v in row] for row in out.reshape(self.size, len(values))]

    def gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        local = mx.array(np.asarray(values, dtype=np.float32))
        if self.size == 1:
            return [list(values)]
        out = np.asarray(mx.distributed.all_gather(local, group=self.group))
        return [[float(v) for v in row] for row in out.reshape(self.size, len(values))]

    def barrier(self) -> None:
        mx.eval(self.all_sum(mx.array(1, mx.int32)))

    def broadcast_arrays(self, arrays: Mapping[str, mx.array], source: int) -> dict[str, mx.array]:
        """`source`'s arrays on every rank (others pass templates of the same names/shapes/dtypes): an all_sum
        where everyone but the source contributes zeros, which is exact.

        The source's arrays come from mx.load (lazy, other dict order) and the others' are zeros, so the graphs
        differ between ranks; each bucket's collective is therefore evaluated on its own, in sorted order, so
        that the ranks cannot pair different collectives."""
        mine = self.rank == source
        local = {k: v if mine else mx.zeros(v.shape, v.dtype) for k, v in arrays.items()}
        mx.eval(list(local.values()))

        def one_at_a_time(x: mx.array) -> mx.array:
            out = self.all_sum(x)
            mx.eval(out)
            return out

        return all_sum_arrays(local, one_at_a_time)

    def broadcast_bytes(self, data: bytes | None, source: int) -> bytes:
        mine = self.rank == source
        length = int(scalar(self.all_sum(mx.array(len(data) if mine and data else 0, mx.int32))))
        buf = np.frombuffer(data, dtype=np.uint8) if mine and data else np.zeros(length, np.uint8)
        out = self.all_sum(mx.array(buf.astype(np.int32)))
        return bytes(np.asarray(out).astype(np.uint8).tolist())
