"""The live view of a run (rich): per rank node, step, loss, tok/s against its calibrated rate, memory, last
heartbeat, ETA. Also the text printed when stdout is not a terminal (CI logs, `| tee`, `nohup`): one plain line
when the run has advanced by a tenth of its steps or PLAIN_EVERY_S passed, a line every PLAIN_IDLE_S while it
stands still (the first, compiling, step says so: `first_step_note`), and always a last line with the true final
step and state when the view closes."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from coordinator.models import PreflightReport
from coordinator.planning.plan import PREDICTION_TOLERANCE, NodeCalibration, Plan, format_split, prediction_gap
from coordinator.planning.shards import MapRow
from coordinator.run.monitor import RATE_UNIT, Monitor, Verdict
from coordinator.run.replay import judge_monitor
from coordinator.units import format_bytes
from coordinator.views.render import render_preflight
from coordinator.views.stagetable import plain_stage_words, stage_columns, stage_row_cells, stage_summary

PLAIN_EVERY_S = 5.0
PLAIN_IDLE_S = 10.0  # a line even without progress (a compiling first step): a silent log looks like a hang
PLAIN_STEPS = 10  # ... and at least this many lines over a run, however fast its steps


PIPED_TABLE_WIDTH = 400  # piped tables are drawn this wide at most, so no cell is cut to fit 80 columns


def make_console(*, stderr: bool = False, wide_tables: bool = False) -> Console:
    """The console the verbs print to. Piped (not a terminal), lines are never wrapped at rich's default 80
    columns: a log line must stay one line for grep and for whoever reads the CI log. With `wide_tables` (status,
    monitor), a piped table is drawn at its natural width (up to PIPED_TABLE_WIDTH) rather than squeezed into 80
    columns with its cells cut (`Debi…`); an explicit COLUMNS still wins."""
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.soft_wrap = True
        if wide_tables and not os.environ.get("COLUMNS"):
            console.width = PIPED_TABLE_WIDTH
    return console


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class NodeBars:
    """Per-node byte progress bars on a terminal (hashing a model, copying files); nothing when piped or disabled.
    Call it with (node, bytes done, bytes total); use it as a context manager around the work."""

    def __init__(self, console: Console, enabled: bool, *, label: str = "{task.description}", eta: bool = False,
                 transient: bool = False) -> None:
        from rich import progress as rp

        self.enabled = enabled and console.is_terminal
        columns = [rp.TextColumn(label), rp.BarColumn(), rp.DownloadColumn(), rp.TransferSpeedColumn(),
                   *([rp.TimeRemainingColumn()] if eta else [])]
        self.progress = rp.Progress(*columns, console=console, transient=transient)
        self.tasks: dict[str, rp.TaskID] = {}

    def __call__(self, node: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if node not in self.tasks:
            self.tasks[node] = self.progress.add_task(node, total=total)
        self.progress.update(self.tasks[node], completed=done, total=total)

    def __enter__(self) -> NodeBars:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.progress.stop()

    def pause(self) -> None:
        """Stop drawing (before a prompt); `resume` starts again."""
        if self.enabled:
            self.progress.stop()

    def resume(self) -> None:
        if self.enabled:
            self.progress.start()


def first_step_note(mon: Monitor) -> str | None:
    """While the ranks take their first step (no step event yet, at least one in phase `step`): MLX compiles the
    step's kernels then, a one-time cost of a minute or more per node on a cold kernel cache that would otherwise
    look like a hang. None otherwise."""
    views = list(mon.ranks.values())
    if not views or any(v.tokens_per_s is not None for v in views) or not any(v.phase == "step" for v in views):
        return None
    return "first step: MLX compiles its kernels once (a minute or more per node on a cold kernel cache)"


_VERDICT_STYLE = {Verdict.OK: "green", Verdict.PENDING: "dim", Verdict.SLOW: "yellow"}


def build_table(mon: Monitor, now: float, left_out: Sequence[str] = (), predicted: float | None = None) -> Table:
    """The live table. Each rank's rate and verdict are the run's one judgement (coordinator.run.replay), the
    same numbers and words as status, the report, the dashboard and summary.json."""
    eta = mon.eta_s(now)
    judged = judge_monitor(mon, now=now if mon.outcome() is None else None, predicted=predicted)
    title = f"step {mon.step()}/{mon.iters}   ETA {_fmt_s(eta)}"
    note = first_step_note(mon)
    if note:
        title += f"   {note}"
    if judged.tokens_per_s is not None:
        title += f"   {judged.tokens_per_s:,.0f} {RATE_UNIT}" + (
            f" (predicted {judged.predicted_tokens_per_s:,.0f})" if judged.predicted_tokens_per_s else "")
    if left_out:  # a degraded run says so for as long as it runs, not only in the lines printed before it
        title += f"   [yellow]DEGRADED: {', '.join(left_out)} left out[/yellow]"
    stages = judged.stages
    summary = stage_summary(stages)
    if summary:
        title += f"\n{summary}"
    table = Table(title=title, title_justify="left")
    # With a memory plan, the memory column is the stage view's (peak / plan / budget) instead of the bare peak.
    memory = stages.pipeline or stages.has_memory_plan
    for col in ("rank", "node", "state", "verdict", "step", "loss", f"{RATE_UNIT} (calibrated)",
                *([] if memory else ["peak mem"]), "heartbeat", *stage_columns(stages)):
        table.add_column(col, justify="right" if col in ("rank", "step", "loss", "peak mem") else "left")
    for v in sorted(mon.ranks.values(), key=lambda r: r.rank):
        mine = judged.of(v.rank, v.node)
        tok_s = mine.tokens_per_s if mine is not None else None
        rate = "-" if tok_s is None else f"{tok_s:,.0f}"
        if v.calibrated_tokens_per_s:
            gap = prediction_gap(tok_s, v.calibrated_tokens_per_s)
            off = f", [yellow]{100 * gap:+.0f}%[/yellow]" if gap is not None and abs(gap) > PREDICTION_TOLERANCE else ""
            rate += f" ({v.calibrated_tokens_per_s:,.0f}{off})"
        verdict = mine.verdict if mine is not None else Verdict.PENDING
        mem = "-" if v.peak_memory is None else format_bytes(v.peak_memory)
        beat = "-" if v.last_event_at is None else f"{now - v.last_event_at:.1f}s ago"
        table.add_row(str(v.rank), v.node, str(v.state), f"[{_VERDICT_STYLE.get(verdict, 'red')}]{verdict}[/]",
                      str(v.step), "-" if v.loss is None else f"{v.loss:.4f}", rate, *([] if memory else [mem]), beat,
                      *stage_row_cells(stages, v.rank))
    for inc in mon.incidents[-5:]:
        table.caption = (table.caption or "") + f"\n[red]{inc.kind}[/red] on {inc.node} rank {inc.rank}: {inc.evidence}"
    return table


def build_map_table(rows: Sequence[MapRow], left_out: Sequence[str] = ()) -> Table:
    done, total = sum(r.done for r in rows), sum(r.rows for r in rows)
    etas = [r.eta_s for r in rows if r.eta_s is not None]
    title = f"rows {done}/{total}   ETA {_fmt_s(max(etas) if etas else None)}"
    if left_out:
        title += f"   [yellow]DEGRADED: {', '.join(left_out)} left out[/yellow]"
    table = Table(title=title, title_justify="left")
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
        self._plain_step = -1
        self._monitor: Monitor | None = None  # the latest one shown (a relaunch brings a new one)
        self._said_start = False
        self.left_out: list[str] = []  # inventory nodes the run started without (`degraded`)
        self.predicted: float | None = None  # the plan's prediction (`calibration`), real tokens/s

    def message(self, text: str) -> None:
        if self.live is None:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    def degraded(self, warning: str, nodes: Sequence[str]) -> None:
        self.left_out = list(nodes)
        self.console.print(warning, style="bold yellow", markup=False, highlight=False)

    def preflight(self, report: PreflightReport) -> None:
        if self.show_preflight and not report.ok():
            render_preflight(report, self.console)
        elif self.show_preflight:
            counts = report.counts()
            self.console.print(f"[green]preflight ok[/green]: {counts['pass']} pass, {counts['warn']} warn, "
                               f"{counts['skip']} skip")

    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None:
        self.predicted = plan.predicted_tokens_per_s or None
        cached = sum(1 for c in calibrations.values() if c.cached)
        self.console.print(f"split ({plan.mode}): [bold]{format_split(plan)}[/bold]  batch "
                           + ", ".join(f"{n}={b}" for n, b in plan.batch.items())
                           + (f"  predicted {plan.predicted_tokens_per_s:,.0f} {RATE_UNIT}" if calibrations else "")
                           + (f" (all_sum {100 * plan.collective_share:.0f}% of the step)" if plan.collective else "")
                           + (f"  ({cached} cached)" if cached else ""))

    def progress(self, mon: Monitor, now: float) -> None:
        if mon is not self._monitor:
            self._said_start = False
        self._monitor = mon
        first = min(mon.ranks.values(), key=lambda v: v.rank, default=None)
        if not self._said_start and first is not None and first.trainable is not None:
            # Once per attempt, before the progress: what is trained (the 16-of-36-layers trap) and how batches run.
            self._said_start = True
            self.console.print(f"rank {first.rank}: {first.trainable}" + (f"; {first.packing}" if first.packing else ""),
                               markup=False, highlight=False)
        if self.console.is_terminal:
            if self.live is None:
                self.live = Live(build_table(mon, now, self.left_out, self.predicted), console=self.console, refresh_per_second=4,
                                 transient=False)
                self.live.start()
            else:
                self.live.update(build_table(mon, now, self.left_out, self.predicted))
            return
        step = mon.step()
        advanced = step != self._plain_step
        every = max(1, mon.iters // PLAIN_STEPS)
        due = self._plain_step < 0 or now - self._last_plain >= PLAIN_IDLE_S \
            or (advanced and (step - self._plain_step >= every or now - self._last_plain >= PLAIN_EVERY_S))
        if due:
            self._print_plain(mon, now)

    def _print_plain(self, mon: Monitor, now: float, final: bool = False) -> None:
        self._last_plain, self._plain_step = now, mon.step()
        self.console.print(plain_progress_line(mon, now, final=final, left_out=self.left_out, predicted=self.predicted),
                           markup=False, highlight=False)

    def map_progress(self, rows: Sequence[MapRow], now: float) -> None:
        if self.console.is_terminal:
            if self.live is None:
                self.live = Live(build_map_table(rows, self.left_out), console=self.console, refresh_per_second=4,
                                 transient=False)
                self.live.start()
            else:
                self.live.update(build_map_table(rows, self.left_out))
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            self.console.print("  ".join(f"{r.node} {r.done}/{r.rows}" + (f" ({r.rows_per_s:.1f}/s)" if r.rows_per_s
                                                                           else "") + f" {r.state}" for r in rows),
                               markup=False, highlight=False)

    def close(self) -> None:
        """Stop the live view with the run's TRUE last state: the table redrawn once more, or, piped, a last
        plain line (the throttled lines may have missed the final steps)."""
        mon, self._monitor = self._monitor, None
        now = time.monotonic()
        if self.live is not None:
            if mon is not None:
                self.live.update(build_table(mon, now, self.left_out, self.predicted))
            self.live.stop()
            self.live = None
        elif mon is not None and not self.console.is_terminal:
            self._print_plain(mon, now, final=True)


def plain_progress_line(mon: Monitor, now: float, *, final: bool = False, left_out: Sequence[str] = (),
                        predicted: float | None = None) -> str:
    """`step 10/30  loss 5.4456  3,214 real tokens/s  ETA 0:14  [local-a 10 ok, local-b 10 ok]`; the final line
    says the run's outcome instead of an ETA; a degraded run ends with `DEGRADED (n2 left out)`. Plain text (no
    markup): it goes to logs.

    `step N` is the step every rank has reached; the loss is the global loss (the same on every rank) of the
    newest step any rank reported, and names that step when it is another (`loss@5 5.4500`): one step's loss is
    never shown as another's. The rate is the run's (`Monitor.run_tokens_per_s`), each rank's word its verdict,
    as every view shows them (coordinator.run.replay)."""
    step = mon.step()
    newest = max((v for v in mon.ranks.values() if v.loss is not None), key=lambda v: (v.step, -v.rank), default=None)
    if newest is None or newest.loss is None:
        loss = "loss -"
    else:
        loss = f"loss {newest.loss:.4f}" if newest.step == step else f"loss@{newest.step} {newest.loss:.4f}"
    judged = judge_monitor(mon, now=None if final else now, predicted=predicted)
    rate = judged.tokens_per_s
    parts = [f"step {step}/{mon.iters}", loss, f"- {RATE_UNIT}" if rate is None else f"{rate:,.0f} {RATE_UNIT}"]
    note = None if final else first_step_note(mon)
    if note:
        parts.append(note)
    if final:
        parts.append(str(mon.outcome() or ("stopped" if mon.stopped else "ended")))
    else:
        parts.append(f"ETA {_fmt_s(mon.eta_s(now))}")
    ranks = ", ".join(f"{j.node} {j.step} {j.verdict}" for j in judged.ranks)
    parts.append(f"[{ranks}]")
    stages = plain_stage_words(judged.stages)
    if stages:
        parts.append(stages)
    if left_out:
        parts.append(f"DEGRADED ({', '.join(left_out)} left out)")
    return "  ".join(parts)


