"""The live view of a run (rich): per rank node, step, loss, tok/s against its calibrated rate, memory, last
heartbeat, ETA. Also the text printed when stdout is not a terminal (one line every few seconds)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from coordinator.models import PreflightReport
from coordinator.monitor import Monitor
from coordinator.plan import NodeCalibration, Plan, format_split
from coordinator.render import render_preflight
from coordinator.shards import MapRow

PLAIN_EVERY_S = 5.0


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def build_table(mon: Monitor, now: float) -> Table:
    eta = mon.eta_s(now)
    table = Table(title=f"step {mon.step()}/{mon.iters}   ETA {_fmt_s(eta)}", title_justify="left")
    for col in ("rank", "node", "state", "step", "loss", "tok/s (calibrated)", "peak mem", "heartbeat"):
        table.add_column(col, justify="right" if col in ("rank", "step", "loss", "peak mem") else "left")
    for v in sorted(mon.ranks.values(), key=lambda r: r.rank):
        rate = "-" if v.tokens_per_s is None else f"{v.tokens_per_s:,.0f}"
        if v.calibrated_tokens_per_s:
            rate += f" ({v.calibrated_tokens_per_s:,.0f})"
        mem = "-" if v.peak_memory is None else f"{v.peak_memory / 1024**3:.2f} GiB"
        beat = "-" if v.last_event_at is None else f"{now - v.last_event_at:.1f}s ago"
        table.add_row(str(v.rank), v.node, str(v.state), str(v.step), "-" if v.loss is None else f"{v.loss:.4f}",
                      rate, mem, beat)
    for inc in mon.incidents[-5:]:
        table.caption = (table.caption or "") + f"\n[red]{inc.kind}[/red] on {inc.node} rank {inc.rank}: {inc.evidence}"
    return table


def build_map_table(rows: Sequence[MapRow]) -> Table:
    done, total = sum(r.done for r in rows), sum(r.rows for r in rows)
    etas = [r.eta_s for r in rows if r.eta_s is not None]
    table = Table(title=f"rows {done}/{total}   ETA {_fmt_s(max(etas) if etas else None)}", title_justify="left")
    for col in ("node", "state", "rows", "rows/s (calibrated)", "ETA", "last word"):
        table.add_column(col, justify="right" if col in ("rows", "ETA") else "left")
    for r in rows:
        rate = "-" if r.rows_per_s is None else f"{r.rows_per_s:,.1f}"
        table.add_row(r.node, r.state, f"{r.done}/{r.rows}", f"{rate} ({r.calibrated_per_s:,.1f})", _fmt_s(r.eta_s),
                      "-" if r.silent_s is None else f"{r.silent_s:.1f}s ago")
    return table


class RichUI:
    """JobUI for a person at a terminal (or a log, when `console.is_terminal` is false)."""

    def __init__(self, console: Console, *, show_preflight: bool = True) -> None:
        self.console = console
        self.show_preflight = show_preflight
        self.live: Live | None = None
        self._last_plain = 0.0

    def message(self, text: str) -> None:
        if self.live is None:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    def preflight(self, report: PreflightReport) -> None:
        if self.show_preflight and not report.ok():
            render_preflight(report, self.console)
        elif self.show_preflight:
            counts = report.counts()
            self.console.print(f"[green]preflight ok[/green]: {counts['pass']} pass, {counts['warn']} warn, "
                               f"{counts['skip']} skip")

    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None:
        cached = sum(1 for c in calibrations.values() if c.cached)
        self.console.print(f"split ({plan.mode}): [bold]{format_split(plan)}[/bold]  batch "
                           + ", ".join(f"{n}={b}" for n, b in plan.batch.items())
                           + (f"  predicted {plan.predicted_tokens_per_s:,.0f} tok/s" if calibrations else "")
                           + (f"  ({cached} cached)" if cached else ""))

    def progress(self, mon: Monitor, now: float) -> None:
        if self.console.is_terminal:
            if self.live is None:
                self.live = Live(build_table(mon, now), console=self.console, refresh_per_second=4, transient=False)
                self.live.start()
            else:
                self.live.update(build_table(mon, now))
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            ranks = " ".join(f"{v.node}:{v.step}" for v in sorted(mon.ranks.values(), key=lambda r: r.rank))
            loss = next((v.loss for v in mon.ranks.values() if v.loss is not None), None)
            self.console.print(f"step {mon.step()}/{mon.iters} loss {loss if loss is None else round(loss, 4)} "
                               f"[{ranks}] ETA {_fmt_s(mon.eta_s(now))}")

    def map_progress(self, rows: Sequence[MapRow], now: float) -> None:
        if self.console.is_terminal:
            if self.live is None:
                self.live = Live(build_map_table(rows), console=self.console, refresh_per_second=4, transient=False)
                self.live.start()
            else:
                self.live.update(build_map_table(rows))
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            self.console.print("  ".join(f"{r.node} {r.done}/{r.rows}" + (f" ({r.rows_per_s:.1f}/s)" if r.rows_per_s
                                                                           else "") + f" {r.state}" for r in rows))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
