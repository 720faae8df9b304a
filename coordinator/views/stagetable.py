"""The terminal's words for a run's stages and memory (`coordinator.run.stages.StageView`): the cells every
terminal view prints (the live view, its piped line, `status`, `monitor`), so that each shows the same numbers in
the same words. The report and the dashboard render the same `StageView` as HTML."""

from __future__ import annotations

import math

from coordinator.run.stages import SHARE_DIGITS, RankStage, StageView
from coordinator.units import format_bytes


def pct(value: float | None) -> str:
    """A share (0-1) as a whole percentage, the one rule of every view: from the value the record keeps
    (`SHARE_DIGITS`), a half rounded up. The dashboard's `pct` (static/app.js) computes the same
    `Math.floor(100 * v + 0.5)` on the same JSON value. Before, the terminal and the report formatted the unrounded
    share and the dashboard the recorded one, each with its language's own rounding: a bubble of 0.35496 (recorded
    0.355) read 35% in the report and 36% on the dashboard."""
    return "-" if value is None else f"{math.floor(100 * round(value, SHARE_DIGITS) + 0.5)}%"


def stage_cell(row: RankStage | None) -> str:
    """`1 (L2-3)`: the stage and its layers (inclusive, as the plan table writes them); `-` outside a pipeline."""
    if row is None or row.stage is None:
        return "-"
    return f"{row.stage}" + (f" (L{row.layers})" if row.layers else "")


def share_cell(row: RankStage | None) -> str:
    """`61% / 35%`: the rank's busy and wait shares of its step."""
    if row is None or (row.busy_share is None and row.wait_share is None):
        return "-"
    return f"{pct(row.busy_share)} / {pct(row.wait_share)}"


def busy_cell(row: RankStage | None) -> str:
    """`0.412 s (plan 0.380 s)`: the rank's busy seconds per step, and the plan's where it predicted them."""
    if row is None or row.busy_s is None:
        return "-"
    return f"{row.busy_s:.3f} s" + (f" (plan {row.predicted_busy_s:.3f} s)" if row.predicted_busy_s is not None else "")


def memory_cell(row: RankStage | None) -> str:
    """`412.0 MiB / plan 380.0 MiB / budget 630.0 MiB`: the measured peak, the plan's predicted peak and the node's
    budget, each where known; `OVER BUDGET` when the peak passed the budget."""
    if row is None:
        return "-"
    parts = [format_bytes(row.peak_memory_bytes) if row.peak_memory_bytes is not None else "-"]
    if row.predicted_memory_bytes is not None:
        parts.append(f"plan {format_bytes(row.predicted_memory_bytes)}")
    if row.budget_bytes is not None:
        parts.append(f"budget {format_bytes(row.budget_bytes)}")
    return " / ".join(parts) + (" OVER BUDGET" if row.over_budget else "")


def stage_summary(view: StageView) -> str | None:
    """`pipeline of 3 stages, 12 micro-batches (1f1b): bubble 34% (plan 15%), bottleneck stage 1 on b`; None for
    a run that is no pipeline."""
    if not view.pipeline:
        return None
    micro = f", {view.micro_batches} micro-batches" if view.micro_batches else ""
    sched = f" ({view.schedule})" if view.schedule else ""
    out = f"pipeline of {len(view.ranks)} stages{micro}{sched}: bubble {pct(view.bubble)}"
    if view.predicted_bubble is not None:
        out += f" (plan {pct(view.predicted_bubble)})"
    neck = view.of(view.bottleneck) if view.bottleneck is not None else None
    if neck is not None:
        out += f", bottleneck stage {neck.stage if neck.stage is not None else neck.rank} on {neck.node}"
    return out


def stage_columns(view: StageView) -> list[str]:
    """The columns a rank table adds for `view`: a pipeline's stage, shares and busy time, and the memory against
    the plan wherever the plan weighed it (none for a run with neither)."""
    return (["stage (layers)", "busy / wait of step", "busy per step"] if view.pipeline else []) + (
        ["peak memory / plan / budget"] if view.pipeline or view.has_memory_plan else [])


def stage_row_cells(view: StageView, rank: int) -> list[str]:
    """The cells of `stage_columns` for one rank (an over-budget peak in red)."""
    row = view.of(rank)
    memory = memory_cell(row)
    return ([stage_cell(row), share_cell(row), busy_cell(row)] if view.pipeline else []) + (
        [f"[red]{memory}[/red]" if row is not None and row.over_budget else memory]
        if view.pipeline or view.has_memory_plan else [])


def plain_stage_words(view: StageView) -> str | None:
    """The piped line's words for a pipeline: `bubble 34% (plan 15%) [s0 L0-1 busy 61%, s1 L2-3 busy 97%]`."""
    if not view.pipeline:
        return None
    plan = f" (plan {pct(view.predicted_bubble)})" if view.predicted_bubble is not None else ""
    stages = ", ".join(f"s{r.stage if r.stage is not None else '?'} L{r.layers or '?'} busy {pct(r.busy_share)}"
                       for r in view.ranks)
    return f"bubble {pct(view.bubble)}{plan} [{stages}]"


__all__ = ["busy_cell", "memory_cell", "pct", "plain_stage_words", "share_cell", "stage_cell", "stage_columns",
           "stage_row_cells", "stage_summary"]
