"""Sizes and counts in human units that never round a real quantity to zero (`0.00 GB` for a 5 MB model, `0.00B
params` for 92,736 parameters, `0.00 GiB` peak memory for 3 MiB: each seen on the first screens of the demo).
Pure: numbers in, text out."""

from __future__ import annotations

import math

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """`512 B`, `3.3 MiB`, `65.4 GiB`: the largest binary unit the value reaches (so at least 1.0 of it, never a
    real size shown as zero), one decimal."""
    if n < 0:
        return "-" + format_bytes(-n)
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_BINARY) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.1f} {_BINARY[unit]}"


def format_count(n: float) -> str:
    """`92,736`, `1.20M`, `30.00B`, `954.0M`: a count (parameters, rows) exact below a million, else in M/B/T with
    two decimals below 100 of the unit and one above."""
    if abs(n) < 1e6:
        return f"{n:,.0f}"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if abs(n) >= scale:
            value = n / scale
            return (f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}") + suffix
    raise AssertionError("unreachable")


def format_share(value: float) -> str:
    """`6.3%`: a share (0-1) as a percentage with one decimal, a half rounded up, in integer arithmetic, the one
    rule of every view that shows it (a batch split, a node's shard of a map job). The dashboard's `share1`
    (static/app.js) computes the same `Math.floor(1000 * v + 0.5)` on the same JSON number. Before, Python's format
    rounded an exact tie to even and JavaScript's toFixed up: a node with 1 row of 16 read 6.2% in the terminal and
    the report and 6.3% on the dashboard."""
    tenths = math.floor(1000 * value + 0.5)
    return f"{tenths // 10}.{tenths % 10}%"
