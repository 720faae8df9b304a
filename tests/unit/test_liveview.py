"""The live view when piped (CI logs, `| tee`, `nohup`): throttled plain lines, and always a true last line; the
run's tokens/s next to calibration's prediction. Scripted monitors, a console writing to a string."""

from __future__ import annotations

import contextlib
import io

import pytest
from rich.console import Console

from coordinator.planning.plan import describe_prediction, prediction_gap
from coordinator.run.monitor import Monitor, Observation, PlannedRank
from coordinator.run.replay import describe_memory
from coordinator.views.liveview import RichUI, plain_progress_line


def ev(node: str, rank: int, at: float, **data: object) -> Observation:
    return Observation("event", node, at, rank, {"rank": rank, **data})


def piped() -> tuple[RichUI, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80, soft_wrap=True)
    assert not console.is_terminal
    return RichUI(console), out


def run_steps(ui: RichUI, mon: Monitor, steps: range, *, dt: float, t0: float = 1.0) -> float:
    t = t0
    for step in steps:
        for rank, node in ((0, "a"), (1, "b")):
            mon.observe(ev(node, rank, t, event="step", step=step, loss=5.0 - step / 100, tok_s=800.0,
                           total_tokens=1600, step_time_s=0.5))
        ui.progress(mon, t)
        t += dt
    return t


def started(iters: int) -> Monitor:
    mon = Monitor.create([PlannedRank(0, "a", 4, 1000.0), PlannedRank(1, "b", 4, 1000.0)], iters=iters, now=0.0)
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(ev(node, rank, 0.1, event="started", pid=10 + rank))
    return mon


def test_piped_fast_run_prints_a_tenth_of_its_steps_and_a_true_last_line() -> None:
    ui, out = piped()
    mon = started(30)
    t = run_steps(ui, mon, range(1, 31), dt=0.01)  # 30 steps in 0.3 s: the 5 s throttle alone would print one line
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(ev(node, rank, t, event="finished", step=30))
    ui.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:-1]] == [f"{s}/30" for s in (1, 4, 7, 10, 13, 16, 19, 22, 25, 28)]
    assert lines[-1].startswith("step 30/30  loss 4.7000  3,200 real tokens/s  succeeded")
    assert lines[-1].endswith("[a 30 ok, b 30 ok]")  # plain text: the brackets are not eaten as markup


def test_piped_slow_run_prints_every_few_seconds_and_while_it_stands_still() -> None:
    ui, out = piped()
    mon = started(1000)
    t = run_steps(ui, mon, range(1, 5), dt=6.0)  # a step every 6 s: a line for each
    assert len(out.getvalue().splitlines()) == 4
    ui.progress(mon, t + 2)  # no progress, 8 s after the last line: nothing yet
    assert len(out.getvalue().splitlines()) == 4
    ui.progress(mon, t + 5)  # 11 s of silence get a line: a quiet log must not look like a hang (15 s at most)
    assert len(out.getvalue().splitlines()) == 5


def test_piped_first_step_is_announced_and_repeated_while_it_compiles() -> None:
    """The ranks' first step compiles MLX's kernels (70-92 s per node on a cold cache on 2 cores): the plain line
    says so when it starts and again at least every 15 s, from the ranks' heartbeats alone."""
    ui, out = piped()
    mon = started(30)
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(ev(node, rank, 0.2, event="heartbeat", step=0, phase="load", pid=10 + rank))
    ui.progress(mon, 0.2)
    assert "compiles" not in out.getvalue()  # still loading: not yet the compile
    t = 1.0
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(ev(node, rank, t, event="heartbeat", step=1, phase="step", pid=10 + rank))
    for second in range(1, 91):  # 90 s of heartbeats, no step event
        for rank, node in ((0, "a"), (1, "b")):
            mon.observe(ev(node, rank, t + second, event="heartbeat", step=1, phase="step", pid=10 + rank))
        ui.progress(mon, t + second)
    lines = [line for line in out.getvalue().splitlines() if "MLX compiles its kernels once" in line]
    assert len(lines) >= 90 // 15
    run_steps(ui, mon, range(1, 3), dt=6.0, t0=t + 91)
    assert "compiles" not in out.getvalue().splitlines()[-1]  # a step ended: the note is gone


def test_last_line_says_a_failure() -> None:
    ui, out = piped()
    mon = started(30)
    run_steps(ui, mon, range(1, 4), dt=1.0)
    mon.observe(ev("b", 1, 9.0, event="error", message="boom"))
    ui.close()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("step 3/30") and "failed" in last and "ETA" not in last


def test_plain_line_before_any_step() -> None:
    mon = started(30)
    assert plain_progress_line(mon, 1.0) == "step 0/30  loss -  - real tokens/s  ETA -  [a 0 ok, b 0 ok]"


def test_plain_line_never_shows_one_steps_loss_as_anothers() -> None:
    """The steps line names the step every rank reached; a loss from a later step says which step it is."""
    mon = started(30)
    for step in range(1, 6):  # rank a runs ahead to step 5 (its events arrived first), rank b is at step 1
        mon.observe(ev("a", 0, float(step), event="step", step=step, loss=6.0 - step / 10, tok_s=800.0))
    mon.observe(ev("b", 1, 5.5, event="step", step=1, loss=5.9, tok_s=800.0))
    line = plain_progress_line(mon, 6.0)
    assert line.startswith("step 1/30  loss@5 5.5000  ") and line.endswith("[a 5 ok, b 1 ok]")
    for step in range(2, 6):
        mon.observe(ev("b", 1, 6.0 + step, event="step", step=step, loss=6.0 - step / 10, tok_s=800.0))
    assert plain_progress_line(mon, 12.0).startswith("step 5/30  loss 5.5000  ")


def test_run_rate_is_the_median_of_its_steps_not_the_last() -> None:
    mon = started(30)
    for step, wall in enumerate((5.0, 0.5, 0.5, 0.4, 2.0), start=1):  # a compiling first step, a slow last one
        for rank, node in ((0, "a"), (1, "b")):
            mon.observe(ev(node, rank, float(step), event="step", step=step, loss=1.0, tok_s=1.0,
                           total_tokens=1000, step_time_s=wall))
    assert mon.run_tokens_per_s() == 2000.0
    assert mon.last_tokens_per_s() == 500.0


def test_run_compute_rate_is_the_median_of_the_ranks_summed_compute_rates() -> None:
    """Each rank's tokens per second of compute (until it enters the all_sum), summed over the ranks of a step;
    the median over the steps every rank reported: what calibration predicts, without the collective."""
    mon = started(30)
    assert mon.run_compute_tokens_per_s() is None
    for step, (a, b) in enumerate(((100.0, 120.0), (1000.0, 900.0), (1100.0, 1000.0), (1200.0, 1050.0)), start=1):
        mon.observe(ev("a", 0, float(step), event="step", step=step, loss=1.0, tok_s=500.0, total_tokens=1000,
                       step_time_s=1.0, compute_tok_s=a))
        if step < 4:  # b's last step not reported yet: that step does not count
            mon.observe(ev("b", 1, float(step), event="step", step=step, loss=1.0, tok_s=500.0, total_tokens=1000,
                           step_time_s=1.0, compute_tok_s=b))
    assert mon.run_compute_tokens_per_s() == 1900.0  # median of 220, 1900, 2100


def test_prediction_is_said_plainly_when_far_off() -> None:
    assert prediction_gap(3214, 11039) is not None
    far = describe_prediction(3214, 11039)
    assert "3,214 real tokens/s" in far and "11,039 predicted" in far and "-71%" in far
    assert "slower than calibration predicted" in far and "--recalibrate" in far and "MORE THAN" not in far
    assert "all_sum" not in far  # one rank: no collective to leave out
    near = describe_prediction(10000, 11039)  # -9%: within 15%
    assert "-9%" in near and "within 15%" in near and "slower" not in near
    assert "no prediction" in describe_prediction(1000, None)
    assert describe_prediction(None, 5000) == "no step finished: no tokens/s"


def test_prediction_line_names_the_collective_and_spares_a_one_step_run() -> None:
    """The demo's end-of-run line: plain words, the all_sum the prediction leaves out named when there are ranks to
    sum over, what to do; a run stopped after one step is not held to the prediction."""
    two = describe_prediction(1200, 4250, steps=30, ranks=2)
    assert "-72%" in two and "all_sum between the 2 ranks" in two and "--recalibrate" in two
    assert two.upper() != two and "SLOWER" not in two
    faster = describe_prediction(6000, 4250, steps=30, ranks=2)
    assert "faster than calibration predicted" in faster and "--recalibrate" in faster
    one = describe_prediction(900, 4250, steps=1, ranks=2)
    assert "too few" in one and "slower" not in one and "%" not in one


def test_prediction_line_measures_why_from_the_compute_rate() -> None:
    """With the run's compute-only rate the line says what happened instead of guessing: the nodes ran as
    calibrated and the all_sum took the rest (the split holds), or the nodes themselves were slower (a busy
    machine: what to do)."""
    as_calibrated = describe_prediction(2000, 6000, steps=30, ranks=2, compute=5600)
    assert "measured why" in as_calibrated and "5,600 real tokens/s (-7% of the prediction)" in as_calibrated
    assert "the rest, 64% of each step, is the gradient all_sum between the 2 ranks" in as_calibrated
    assert "The split holds" in as_calibrated and "--recalibrate" not in as_calibrated
    busy = describe_prediction(2058, 6316, steps=30, ranks=2, compute=2300)  # the cold demo's shape, load 12-16
    assert "2,300 real tokens/s (-64% of the prediction)" in busy and "busier than while calibrating" in busy
    assert "11% of each step went to the gradient all_sum" in busy and "--recalibrate" in busy
    assert describe_prediction(5900, 6000, steps=30, ranks=2, compute=5950).endswith("within 15% of calibration")


def test_piped_tables_of_status_keep_full_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """`status | cat`: a table is drawn at its natural width, not squeezed into 80 columns (`Debi…`, `memo…`)."""
    from coordinator.run.metrics import NodeStatus
    from coordinator.views.liveview import make_console
    from coordinator.views.statusview import render_status_table

    monkeypatch.delenv("COLUMNS", raising=False)
    row = NodeStatus(node="studio-m3-ultra", host="10.0.0.7", reachable=True, os="Debian GNU/Linux 12 (bookworm)",
                     chip="Apple M3 Ultra", memory_total_bytes=512 * 1024**3, memory_used_bytes=100 * 1024**3,
                     memory_pressure="normal", load=(1.5, 1.0, 0.5), cpu_count=32, power="never sleeps, on AC",
                     disk_free_bytes=2 * 1024**4)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        console = make_console(wide_tables=True)
        assert not console.is_terminal
        console.print(render_status_table([row]))
    text = out.getvalue()
    assert "…" not in text
    for cell in ("Debian GNU/Linux 12 (bookworm)", "100.0G/512.0G normal", "never sleeps, on AC", "studio-m3-ultra"):
        assert cell in text, text


def test_a_pipelines_end_line_names_no_collective_and_its_memory_against_the_plan() -> None:
    slow = describe_prediction(200, 300, steps=8, ranks=3, compute=600, pipeline=True)
    assert "200 real tokens/s" in slow and "(-33%)" in slow and "all_sum" not in slow
    assert "docs/pipeline.md" in slow
    assert "within 15%" in describe_prediction(290, 300, steps=8, ranks=3, pipeline=True)
    mib = 2**20
    nodes = [{"node": "a", "peak_memory_bytes": 19 * mib, "planned_memory_bytes": 20 * mib},
             {"node": "b", "peak_memory_bytes": 21 * mib, "planned_memory_bytes": 20 * mib},
             {"node": "c", "peak_memory_bytes": 10 * mib, "planned_memory_bytes": 20 * mib}]
    line = describe_memory(nodes)
    assert line is not None
    assert line.startswith("a 19.0 MiB of 20.0 MiB planned (0.95x); b 21.0 MiB of 20.0 MiB planned (1.05x)")
    assert "over the plan on b" in line
    assert describe_memory(nodes[:1] + nodes[2:]).endswith("under 80% of the plan on c (the plan over-reserves)")
    assert describe_memory(nodes[:1]).endswith(": within the plan")
    assert describe_memory([{"node": "a", "peak_memory_bytes": 5, "planned_memory_bytes": None}]) is None  # dp
