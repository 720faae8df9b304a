"""Sizes and counts in human units that never round a real quantity to zero (`0.00 GB` for a 5 MB model, `0.00B
params` for 92,736 parameters, `0.00 GiB` peak memory for 3 MiB: each seen on the first screens of the demo).
Pure: numbers in, text out."""

from __future__ import annotations

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
