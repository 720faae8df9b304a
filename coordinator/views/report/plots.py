"""`coordinator report`, the plots: a `Report` -> PNG bytes per plot. Pure; matplotlib's Agg canvas, no pyplot
global state, imported only when plots are drawn (only `coordinator report` pays for it)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.views.report.model import IncidentRow, Point, Report

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")


@dataclass(frozen=True)
class Plot:
    """One PNG and what it shows (the alt text and caption on the page)."""

    key: str
    title: str
    caption: str
    png: bytes


def palette_color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _xy(points: Sequence[Point], attr: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the points where `attr` was reported."""
    pairs = [(float(p.step), v) for p in points if isinstance(v := getattr(p, attr), float)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _incident_labels(incidents: Sequence[IncidentRow]) -> list[tuple[int, str]]:
    """One label per step ("straggler (a, b); crash (c)"): incidents at the same step must not overprint."""
    by_step: dict[int, dict[str, list[str]]] = {}
    for inc in incidents:
        if inc.step is not None:
            nodes = by_step.setdefault(inc.step, {}).setdefault(inc.kind, [])
            if inc.node not in nodes:
                nodes.append(inc.node)
    return [(step, "; ".join(f"{kind} ({', '.join(nodes)})" for kind, nodes in kinds.items()))
            for step, kinds in sorted(by_step.items())]


def render_plots(report: Report, *, dpi: int = 100) -> list[Plot]:
    """PNG plots for the report; none when there is nothing to plot (the page says so instead).

    matplotlib is imported here, not at module import: only `coordinator report` pays for it. `Figure` with its
    default Agg canvas keeps no global pyplot state and needs no display."""
    from matplotlib.figure import Figure

    plots: list[Plot] = []
    nodes = sorted({s.node for s in report.series})
    node_color = {n: palette_color(i) for i, n in enumerate(nodes)}
    multi = len(report.attempts) > 1
    styles = ("-", "--", ":", "-.")

    def png(fig: Figure) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
        return buf.getvalue()

    def style_axes(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
        ax.set_title(title, fontsize=12, loc="left")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, color="#dddddd", linewidth=0.8)
        ax.spines[["top", "right"]].set_visible(False)

    if report.has_steps:
        # Loss and eval loss by step; incidents as red vertical lines at their step.
        fig = Figure(figsize=(10, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for s in report.series:
            xs, ys = _xy(s.points, "loss")
            if xs:
                ax.plot(xs, ys, styles[s.attempt % len(styles)],
                        color=node_color[s.node], linewidth=1.6, alpha=0.85, label=f"train loss, {s.label(len(report.attempts))}")
        if report.evals:
            for a in sorted({e.attempt for e in report.evals}):
                ev = [e for e in report.evals if e.attempt == a]
                ax.plot([e.step for e in ev], [e.val_loss for e in ev], "o-", color="black", linewidth=1.4,
                        markersize=6, label="eval loss" + (f" (attempt {a + 1})" if multi else ""))
        for step, label in _incident_labels(report.incidents):
            ax.axvline(step, color="#d62728", linestyle="--", linewidth=1.2, alpha=0.8)
            ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                        fontsize=8, color="#d62728")
        style_axes(ax, "Loss", "step", "loss")
        ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
        plots.append(Plot("loss", "Loss and eval loss by step",
                          "Training loss per node (ranks all-reduce, so their lines overlap) and eval loss (black); "
                          "red dashed lines are incidents at the step they happened.", png(fig)))

        # Throughput per node against the calibrated rate.
        fig = Figure(figsize=(10, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for s in report.series:
            xs, ys = _xy(s.points, "tok_s")
            if xs:
                ax.plot(xs, ys, styles[s.attempt % len(styles)],
                        color=node_color[s.node], linewidth=1.5, label=f"real tokens/s, {s.label(len(report.attempts))}")
            xs, ys = _xy(s.points, "compute_tok_s")
            if xs:
                ax.plot(xs, ys, ":", color=node_color[s.node],
                        linewidth=1.2, label=f"compute real tokens/s, {s.label(len(report.attempts))}")
        for row in report.nodes:
            if row.calibrated_tokens_per_s is not None and row.name in node_color:
                ax.axhline(row.calibrated_tokens_per_s, color=node_color[row.name], linestyle=(0, (6, 3)),
                           linewidth=1.0, alpha=0.6)
                ax.annotate(f"calibrated {row.name}: {row.calibrated_tokens_per_s:,.0f}",
                            (1.0, row.calibrated_tokens_per_s), xycoords=("axes fraction", "data"), ha="right",
                            va="bottom", fontsize=8, color=node_color[row.name])
        ax.set_ylim(bottom=0)
        style_axes(ax, "Throughput", "step", "real tokens / s")
        ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
        plots.append(Plot("throughput", "Real tokens per second per node against its calibrated rate",
                          "Measured real tokens/s (padding excluded) per step (solid; compute-only dotted when "
                          "reported) and the rate calibration predicted for that node's batch (thin dashed line).",
                          png(fig)))

        # Timeline: steps over wall time, attempts shaded, checkpoints ticked, incidents marked.
        t0 = report.start_t or 0.0
        fig = Figure(figsize=(10, 3.8), layout="constrained")
        ax = fig.add_subplot()
        for attempt in report.attempts:
            if multi and attempt.start_t is not None:
                ax.axvline(attempt.start_t - t0, color="#555555", linewidth=1.0)
                ax.annotate(f" attempt {attempt.number + 1}", (attempt.start_t - t0, 0.02),
                            xycoords=("data", "axes fraction"), fontsize=8, color="#555555")
        for s in report.series:
            pts = [p for p in s.points if p.t is not None]
            if pts:
                ax.plot([p.t - t0 for p in pts if p.t is not None], [p.step for p in pts],
                        styles[s.attempt % len(styles)], color=node_color[s.node], linewidth=1.5,
                        label=s.label(len(report.attempts)))
        ck = [c for c in report.checkpoints if c.t is not None]
        if ck:
            ax.plot([c.t - t0 for c in ck if c.t is not None], [c.step for c in ck], "|", color="#444444",
                    markersize=9, label="checkpoint")
        placed: dict[tuple[float, int], list[IncidentRow]] = {}
        for inc in report.incidents:
            if inc.t_wall is not None:
                placed.setdefault((round(inc.t_wall - t0, 1), inc.step or 0), []).append(inc)
        for (x, y), group in placed.items():
            ax.plot([x], [y], "X", color="#d62728", markersize=11)
            ax.annotate("  " + _incident_labels(group)[0][1], (x, y), fontsize=8, color="#d62728", va="top")
        style_axes(ax, "Timeline", "seconds since the first event", "step")
        ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
        plots.append(Plot("timeline", "Progress timeline with checkpoints and incidents",
                          "Each node's step over wall time; ticks are checkpoints, red crosses incidents (placed "
                          "at the step they carry)" + ("; vertical lines start each attempt." if multi else "."),
                          png(fig)))

    rated = [r for r in report.nodes if r.calibrated_tokens_per_s is not None or r.tokens_per_s is not None]
    if rated:
        fig = Figure(figsize=(10, 0.8 + 0.7 * len(rated)), layout="constrained")
        ax = fig.add_subplot()
        ys = list(range(len(rated)))
        h = 0.38
        ax.barh([y - h / 2 for y in ys], [r.calibrated_tokens_per_s or 0 for r in rated], height=h,
                color="#bbbbbb", label="calibrated")
        ax.barh([y + h / 2 for y in ys], [r.tokens_per_s or 0 for r in rated], height=h,
                color=[node_color.get(r.name, palette_color(i)) for i, r in enumerate(rated)], label="measured")
        ax.set_yticks(ys, [f"{r.name} (rank {r.rank})" if r.rank is not None else r.name for r in rated])
        ax.invert_yaxis()
        style_axes(ax, "Calibrated vs measured real tokens/s", "real tokens / s", "")
        ax.legend(fontsize=8, loc="lower right")
        plots.append(Plot("rates", "Calibrated against measured throughput per node",
                          "Grey: the rate calibration predicted for the node's batch; colour: its rate, the median "
                          "real tokens/s of its last 20 steps (the same in every view).", png(fig)))
    return plots
