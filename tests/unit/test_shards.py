"""Map-job shard arithmetic: table tests (exact counts, contiguity, re-splitting a failed node's rows)."""

from __future__ import annotations

import pytest

from coordinator.planning.shards import (
    ShardError,
    Spread,
    compute_shards,
    largest_remainder,
    missing_ranges,
    split_ranges,
    subtract,
)


@pytest.mark.parametrize(("total", "weights", "want"), [
    (10, [1.0, 1.0], [5, 5]),
    (11, [1.0, 1.0], [6, 5]),  # the tie goes to the earlier node
    (200, [65.5, 34.5], [131, 69]),
    (7, [3.0, 1.0, 0.0], [5, 2, 0]),
    (0, [1.0, 2.0], [0, 0]),
    (3, [1.0, 1.0, 1.0, 1.0], [1, 1, 1, 0]),
])
def test_largest_remainder_is_exact(total: int, weights: list[float], want: list[int]) -> None:
    got = largest_remainder(total, weights)
    assert got == want and sum(got) == total


@pytest.mark.parametrize("weights", [[], [0.0, 0.0], [1.0, -1.0], [float("nan"), 1.0]])
def test_bad_weights_are_errors(weights: list[float]) -> None:
    with pytest.raises(ShardError):
        largest_remainder(5, weights)


def test_shards_are_contiguous_in_inventory_order_and_proportional() -> None:
    shards = compute_shards(1000, {"max": 655.0, "ultra": 345.0}, ["ultra", "max"])
    assert shards == {"ultra": (0, 345), "max": (345, 1000)}
    with pytest.raises(ShardError, match="no rate for b"):
        compute_shards(10, {"a": 1.0}, ["a", "b"])


@pytest.mark.parametrize(("ranges", "rates", "want"), [
    ([(40, 100)], {"a": 2.0, "b": 1.0}, {"a": [(40, 80)], "b": [(80, 100)]}),
    ([(0, 3), (10, 13)], {"a": 1.0, "b": 1.0}, {"a": [(0, 3)], "b": [(10, 13)]}),
    ([(0, 2), (10, 14)], {"a": 1.0, "b": 1.0}, {"a": [(0, 2), (10, 11)], "b": [(11, 14)]}),
    ([(5, 6)], {"a": 1.0, "b": 1.0}, {"a": [(5, 6)]}),
    ([], {"a": 1.0}, {}),
])
def test_split_ranges(ranges: list[tuple[int, int]], rates: dict[str, float],
                      want: dict[str, list[tuple[int, int]]]) -> None:
    got = split_ranges(ranges, rates, sorted(rates))
    assert got == want
    assert sorted(i for rs in got.values() for a, b in rs for i in range(a, b)) == \
        sorted(i for a, b in ranges for i in range(a, b))


def test_split_ranges_without_nodes_is_an_error() -> None:
    with pytest.raises(ShardError, match="no node left"):
        split_ranges([(0, 5)], {}, [])


def test_missing_and_subtract() -> None:
    assert missing_ranges(10, [0, 1, 2, 5, 9, 12]) == [(3, 5), (6, 9)]
    assert missing_ranges(3, []) == [(0, 3)]
    assert missing_ranges(3, [0, 1, 2]) == []
    assert subtract([(0, 5), (10, 12)], [1, 2, 10]) == [(0, 1), (3, 5), (11, 12)]


def test_spread() -> None:
    assert Spread({"a": 100.0, "b": 90.0}).spread == pytest.approx(0.1)
    assert Spread({}).spread == 0.0
