"""worker.comm's collectives run on the stream their backend chooses: never `stream=mx.cpu`, which on nccl runs the
collective in the CPU stream's thread and dies with `There is no Stream(gpu, 1) in current thread` (issue 27).
The GPU run itself (evaluation on rank 1 of 2 over nccl) is in docs/benchmarks.md; this is its code path on the CPU."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from worker.comm import Comm


class _Group:
    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 1


def test_every_collective_lets_the_backend_pick_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def all_sum(x: mx.array, **kw: Any) -> mx.array:
        calls.append(("all_sum", kw))
        return x * 2

    def all_gather(x: mx.array, **kw: Any) -> mx.array:
        calls.append(("all_gather", kw))
        return mx.concatenate([x, x])

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    monkeypatch.setattr(mx.distributed, "all_gather", all_gather)
    comm = Comm(_Group())
    # evaluation's loss sums (rank 1 here), the resume agreement, a broadcast: every path of the worker
    assert comm.all_sum(mx.array([1.0, 2.0])).tolist() == [2.0, 4.0]
    assert comm.gather_ints([3]) == [[3], [3]]
    assert comm.gather_floats([0.5]) == [[0.5], [0.5]]
    comm.barrier()
    comm.broadcast_bytes(None, source=0)
    assert {name for name, _ in calls} == {"all_sum", "all_gather"}
    assert all("stream" not in kw for _, kw in calls), calls
