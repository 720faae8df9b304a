"""A rank of `worker.train` on mlx's ring backend with `sum_scatter` emulated, for the fsdp tests on the CPU.

mlx 0.32.4's ring has no sum_scatter (`[ring] sum_scatter not supported`), which `nn.fully_shard`'s backward needs
(the reduce-scatter of the gradients); nccl and jaccl have one. The emulation gives the same values from the
collective ring has: all_sum, then this rank's contiguous 1/N of axis 0 (the exact layout of a reduce-scatter,
at N times its traffic). Used only by tests: a run on ring is refused before launch (planning.strategy)."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

COMMAND = "from tests.unit.fsdp_ring import main; main()"


def sum_scatter(x: mx.array, *, group: Any = None, stream: Any = None) -> mx.array:
    g = group if group is not None else mx.distributed.init()
    n, r = g.size(), g.rank()
    rows = x.shape[0] // n
    return mx.distributed.all_sum(x, group=g)[r * rows:(r + 1) * rows]


def main() -> None:
    mx.distributed.sum_scatter = sum_scatter  # fully_shard looks it up at call time
    from worker.train import main as train_main

    sys.exit(train_main(sys.argv[1:]))
