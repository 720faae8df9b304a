"""Separate-batches (`kind: map`) arithmetic: contiguous shards proportional to measured throughput, the
remainder of a failed node re-split among the others, and the gaps a resumed run still has to fill. Pure.

A shard is a half-open range [start, end) of input rows (row = non-blank line of the input JSONL, in file order).
Nodes get contiguous shards in inventory order, sized by the largest-remainder method so the counts are exact:
with rates r_i and N rows, node i gets floor(N r_i / sum r) rows plus one for the largest fractional parts.
Every node finishes its own shard at about the same time: N_i / r_i is the same for all i.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.errors import CoordinatorError

Range = tuple[int, int]


class ShardError(CoordinatorError, ValueError):
    """Rates or row counts that cannot be split."""


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Non-negative integers summing to `total`, proportional to `weights` (ties to the earlier weight)."""
    if total < 0:
        raise ShardError(f"cannot split {total} rows")
    if not weights or any(not (w >= 0) for w in weights) or sum(weights) <= 0:
        raise ShardError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    s = sum(weights)
    exact = [total * w / s for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def compute_shards(total: int, rates: Mapping[str, float], order: Sequence[str]) -> dict[str, Range]:
    """Contiguous [start, end) per node of `order`, sized proportionally to `rates` (exact counts)."""
    missing = [n for n in order if n not in rates]
    if missing:
        raise ShardError(f"no rate for {', '.join(missing)}")
    counts = largest_remainder(total, [rates[n] for n in order])
    shards: dict[str, Range] = {}
    start = 0
    for name, count in zip(order, counts, strict=True):
        shards[name] = (start, start + count)
        start += count
    return shards


def split_ranges(ranges: Sequence[Range], rates: Mapping[str, float], order: Sequence[str]) -> dict[str, list[Range]]:
    """Hand the rows of `ranges` (e.g. a failed node's unfinished rows) to the nodes of `order` in proportion to
    their rates, in order: each node takes the next run of rows (a list of ranges where the rows have gaps)."""
    rows = sum(max(0, b - a) for a, b in ranges)
    if rows and not order:
        raise ShardError("no node left to take the remaining rows")
    counts = largest_remainder(rows, [rates[n] for n in order]) if rows else [0] * len(order)
    pieces = [(a, b) for a, b in ranges if b > a]
    out: dict[str, list[Range]] = {}
    i, pos = 0, pieces[0][0] if pieces else 0
    for name, count in zip(order, counts, strict=True):
        taken: list[Range] = []
        while count > 0:
            b = pieces[i][1]
            end = min(b, pos + count)
            taken.append((pos, end))
            count -= end - pos
            pos = end
            if pos >= b and i + 1 < len(pieces):
                i += 1
                pos = pieces[i][0]
        if taken:
            out[name] = taken
    return out


def missing_ranges(total: int, done: Iterable[int]) -> list[Range]:
    """The rows of [0, total) not in `done`, as sorted maximal ranges."""
    have = sorted(set(i for i in done if 0 <= i < total))
    out: list[Range] = []
    start = 0
    for i in have:
        if i > start:
            out.append((start, i))
        start = i + 1
    if start < total:
        out.append((start, total))
    return out


def subtract(ranges: Sequence[Range], done: Iterable[int]) -> list[Range]:
    """The rows of `ranges` not in `done`, as ranges."""
    got = set(done)
    out: list[Range] = []
    for a, b in ranges:
        start: int | None = None
        for i in range(a, b):
            if i in got:
                if start is not None:
                    out.append((start, i))
                    start = None
            elif start is None:
                start = i
        if start is not None:
            out.append((start, b))
    return out


@dataclass(frozen=True)
class Spread:
    """How far apart the nodes finished: (latest - earliest) / latest of the per-node finish times."""

    finish_s: dict[str, float]

    @property
    def spread(self) -> float:
        if not self.finish_s:
            return 0.0
        last = max(self.finish_s.values())
        return (last - min(self.finish_s.values())) / last if last > 0 else 0.0


@dataclass(frozen=True)
class MapRow:
    """One node's line of a map job's live view."""

    node: str
    state: str  # pending | running | finished | failed
    done: int
    rows: int
    rows_per_s: float | None
    calibrated_per_s: float
    silent_s: float | None  # since the node's channel last said anything (None: not started)

    @property
    def eta_s(self) -> float | None:
        if self.state != "running" or not self.rows_per_s:
            return None
        return (self.rows - self.done) / self.rows_per_s
