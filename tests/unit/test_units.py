"""Human units that never round a real quantity to zero (the demo's first screens said `0.00B params` for 92,736
parameters, `7 files (0.00 GB)` and `peak mem 0.00 GiB`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.units import format_bytes, format_count, format_share
from coordinator.views import dashboard


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3_474_181, "3.3 MiB"),
    (5_300_000, "5.1 MiB"), (70.2 * 1024**3, "70.2 GiB"), (102.6 * 1024**3, "102.6 GiB"), (2 * 1024**4, "2.0 TiB"),
])
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (92_736, "92,736"), (999_999, "999,999"), (1_200_000, "1.20M"), (954_000_000, "954.0M"),
    (8e9, "8.00B"), (30e9, "30.00B"), (1.5e12, "1.50T"),
])
def test_format_count(n: float, text: str) -> None:
    assert format_count(n) == text


def test_nothing_real_rounds_to_zero() -> None:
    for n in (1, 100, 2000, 5 * 1024**2, 3 * 1024**3):
        assert not format_bytes(n).startswith("0")
    for n in (1, 92_736, 1_000_001):
        assert format_count(n) != "0"


@pytest.mark.parametrize(("share", "text"), [
    (1 / 16, "6.3%"), (5 / 16, "31.3%"), (0.5, "50.0%"), (1 / 3, "33.3%"), (2 / 3, "66.7%"), (0.0, "0.0%"),
    (1.0, "100.0%"), (0.0004, "0.0%"), (0.0005, "0.1%"), (0.655, "65.5%"), (0.345, "34.5%"),
])
def test_a_share_reads_alike_in_every_view(share: float, text: str) -> None:
    """A half tenth rounds up: Python's own format gave 6.2% for a node with 1 row of 16, JavaScript's 6.3%."""
    assert format_share(share) == text


def test_the_dashboard_words_a_share_by_the_same_expression() -> None:
    app = (Path(dashboard.__file__).parent / "static" / "app.js").read_text()
    assert "const share1 = (v) => { const t = Math.floor(1000 * v + 0.5); return `${Math.floor(t / 10)}.${t % 10}%`; };" in app
    assert ".toFixed(1) + \"%\"" not in app  # no share is worded another way there
