"""`coordinator report`: run-directory values in, report model / HTML / PNGs out.

The events are lines recorded from real `coordinator launch` runs (the embedded smoke playbook on two local
ranks), shortened; the failure cases splice in the incident and error lines the monitor writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.run.rundir import parse_event_line
from coordinator.views.report import (
    ReportError,
    RunFiles,
    assign_attempts,
    build_page,
    build_report,
    parse_events,
    read_run_files,
    render_html,
    render_plots,
)

RUN = "smoke-20261123-085315-3900"
T0 = 1795422371.0


def step(node: str, rank: int, n: int, t: float, loss: float = 5.5, tok_s: float = 200.0, **extra: Any) -> dict[str, Any]:
    return {"node": node, "rank": rank, "t": T0 + t, "run_id": RUN, "event": "step", "step": n, "loss": loss,
            "tokens": 60, "total_tokens": 96, "tok_s": tok_s, "step_time_s": 0.22, "peak_memory": 3677012,
            "grad_norm": 6.2, "lr": 0.001, "data_position": 8 * n, "epoch": 0, **extra}


def started(node: str, rank: int, t: float, resumed_from: str | None = None) -> dict[str, Any]:
    return {"node": node, "rank": rank, "t": T0 + t, "run_id": RUN, "event": "started", "world_size": 2,
            "batch_size": 4, "global_batch": 8, "method": "lora", "iters": 30, "resumed_from": resumed_from}


def heartbeat(node: str, rank: int, t: float) -> dict[str, Any]:
    return {"node": node, "rank": rank, "t": T0 + t, "run_id": RUN, "event": "heartbeat", "step": 0, "phase": "load"}


def ckpt(node: str, rank: int, n: int, t: float, sha: str = "2cf7fe56") -> dict[str, Any]:
    return {"node": node, "rank": rank, "t": T0 + t, "run_id": RUN, "event": "checkpoint", "step": n,
            "path": f"/w/{node}/checkpoints/step-{n:06d}", "sha256": sha * 8, "writer": rank}


def evaluation(node: str, rank: int, n: int, t: float, val: float) -> dict[str, Any]:
    return {"node": node, "rank": rank, "t": T0 + t, "run_id": RUN, "event": "eval", "step": n, "val_loss": val}


def incident(kind: str, node: str, rank: int, n: int, attempt: int = 0, action: str = "warn") -> dict[str, Any]:
    return {"event": "incident", "attempt": attempt, "kind": kind, "node": node, "rank": rank, "step": n,
            "detected_after_s": 1.2, "evidence": {"compute_tokens_per_s": 89.7, "steps": 5}, "action": action,
            "t": 81234.5}  # a monotonic clock: never a wall time


SUMMARY: dict[str, Any] = {
    "run_id": RUN, "state": "succeeded", "steps": 2,
    "nodes": [{"name": "local-a", "rank": 0, "batch_size": 5, "state": "finished", "step": 2, "loss": 5.3,
               "tokens_per_s": 612.9, "calibrated_tokens_per_s": 6739.5, "peak_memory": 3758160,
               "checkpoint": "/w/local-a/checkpoints/step-000002", "run_dir": "/w/local-a"},
              {"name": "local-b", "rank": 1, "batch_size": 3, "state": "finished", "step": 2, "loss": 5.3,
               "tokens_per_s": 319.7, "calibrated_tokens_per_s": 5354.4, "peak_memory": 2485440,
               "checkpoint": "/w/local-b/checkpoints/step-000002", "run_dir": "/w/local-b"}],
    "split": {"local-a": 0.625, "local-b": 0.375}, "incidents": [], "checkpoint": "/w/local-a/checkpoints/step-000002",
    "tokens_per_s": 932.76, "run_dir": f"runs/{RUN}", "message": "", "attempts": 1, "recoveries": [], "quarantined": [],
}
PLAN: dict[str, Any] = {
    "nodes": [{"name": "local-a", "tokens_per_s": 6739.506, "batch_size": 5, "share": 0.625},
              {"name": "local-b", "tokens_per_s": 5354.398, "batch_size": 3, "share": 0.375}],
    "split": {"local-a": 0.625, "local-b": 0.375}, "batch": {"local-a": 5, "local-b": 3}, "global_batch": 8,
    "mode": "calibrated", "predicted_tokens_per_s": 10783.2, "backend": "ring", "attempt": 0,
}


def ok_events() -> list[dict[str, Any]]:
    return [heartbeat("local-b", 1, 0), heartbeat("local-a", 0, 0.1), started("local-b", 1, 1), started("local-a", 0, 1),
            step("local-b", 1, 1, 2, 5.73, 160.4), step("local-a", 0, 1, 2, 5.73, 275.1), ckpt("local-b", 1, 1, 2.1),
            ckpt("local-a", 0, 1, 2.1), step("local-a", 0, 2, 3, 5.6, 300.0), step("local-b", 1, 2, 3, 5.6, 180.0),
            incident("straggler", "local-b", 1, 2), incident("straggler", "local-a", 0, 2),
            evaluation("local-a", 0, 2, 3.5, 5.39), evaluation("local-b", 1, 2, 3.5, 5.39),
            ckpt("local-a", 0, 2, 3.6), ckpt("local-b", 1, 2, 3.6),
            {"node": "local-a", "rank": 0, "t": T0 + 4, "event": "finished", "step": 2, "loss": 5.6}]


def files(events: list[dict[str, Any]], summary: dict[str, Any] | None = SUMMARY,
          plan: dict[str, Any] | None = PLAN, problems: tuple[str, ...] = ()) -> RunFiles:
    return RunFiles(RUN, summary, plan, tuple(events), problems)


def write_run(root: Path, events: list[dict[str, Any]], summary: dict[str, Any] | None = SUMMARY) -> Path:
    run = root / RUN
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    (run / "plan.json").write_text(json.dumps(PLAN))
    return run


def test_parse_events_counts_torn_and_non_object_lines() -> None:
    text = json.dumps(step("a", 0, 1, 0)) + "\n\n[1, 2]\n" + '{"node": "a", "ev'
    events, bad = parse_events(text)
    assert [e["step"] for e in events] == [1]
    assert bad == 2


def test_attempts_split_at_a_started_after_progress_not_at_heartbeats() -> None:
    events = [parse_event_line(e) for e in (
        heartbeat("a", 0, 0), started("a", 0, 1), started("b", 1, 1), step("a", 0, 1, 2),
        incident("crash", "b", 1, 1, attempt=0, action="quarantine"),
        heartbeat("a", 0, 5), started("a", 0, 6, resumed_from="step-000001"), step("a", 0, 2, 7))]
    assert assign_attempts(events) == [0, 0, 0, 0, 0, 0, 1, 1]


def test_report_of_a_successful_run() -> None:
    r = build_report(files(ok_events()))
    assert (r.run_id, r.state, r.steps, r.iters) == (RUN, "succeeded", 2, 30)
    assert [(s.node, s.attempt, [p.step for p in s.points]) for s in r.series] == [
        ("local-a", 0, [1, 2]), ("local-b", 0, [1, 2])]
    assert [(e.step, e.val_loss) for e in r.evals] == [(2, 5.39)]  # both ranks report the same eval once
    assert [(c.step, c.consistent, sorted(c.sha256)) for c in r.checkpoints] == [
        (1, True, ["local-a", "local-b"]), (2, True, ["local-a", "local-b"])]
    a = r.nodes[0]
    # Its rate: the median of its steps' tok_s by the monitor's rule (this old summary wrote its last step's).
    assert (a.name, a.share, a.calibrated_tokens_per_s, a.tokens_per_s, a.verdict) == (
        "local-a", 0.625, 6739.5, 287.55, "ok")
    # Incidents are placed at the wall time of their step (their own `t` is a monotonic clock).
    assert [(i.kind, i.node, i.step, i.t_wall) for i in r.incidents] == [
        ("straggler", "local-b", 2, T0 + 3), ("straggler", "local-a", 2, T0 + 3)]
    assert r.start_t == T0 and r.end_t == T0 + 4


def test_page_shows_every_section_with_embedded_pngs() -> None:
    page = build_page(files(ok_events()), generated_at=T0)
    for text in ("Run smoke-20261123-085315-3900", "succeeded", "Loss", "Nodes and split", "62.5%", "Incidents",
                 "straggler", "Checkpoints", "every manifest identical", "6,740"):
        assert text in page, text
    assert page.count('src="data:image/png;base64,') == 4
    assert "http://" not in page and "https://" not in page  # nothing to fetch: opens offline


def test_plots_are_pngs() -> None:
    plots = render_plots(build_report(files(ok_events())), dpi=40)
    assert [p.key for p in plots] == ["loss", "throughput", "timeline", "rates"]
    assert all(p.png.startswith(b"\x89PNG\r\n\x1a\n") for p in plots)


def test_failed_run_without_steps_says_so() -> None:
    events = [heartbeat("local-a", 0, 0), started("local-a", 0, 1), started("local-b", 1, 1),
              {"node": "local-b", "rank": 1, "t": T0 + 2, "event": "error", "error": "RuntimeError: <boom> & co"},
              incident("error", "local-b", 1, 0, action="quarantine")]
    summary = {**SUMMARY, "state": "failed", "steps": 0, "message": "gave up after 1 attempt(s)",
               "nodes": [{**n, "state": "failed", "step": 0, "loss": None, "tokens_per_s": None}
                         for n in SUMMARY["nodes"]], "checkpoint": None}
    r = build_report(files(events, summary))
    assert not r.has_steps and r.state == "failed" and r.checkpoints == []
    plots = render_plots(r, dpi=40)
    assert [p.key for p in plots] == ["rates"]  # calibrated rates are still worth showing
    page = render_html(r, plots)
    assert "No step was recorded" in page and "failed before its first step" in page
    assert "gave up after 1 attempt(s)" in page and "No checkpoint was written" in page
    assert "RuntimeError: &lt;boom&gt; &amp; co" in page and "<boom>" not in page


def test_empty_run_renders_without_plots() -> None:
    r = build_report(files([], summary=None, plan=None, problems=("summary.json is missing", "plan.json is missing")))
    assert render_plots(r) == []
    page = render_html(r, [])
    assert "unknown: no summary.json" in page and "summary.json is missing" in page
    assert "No node reported anything" in page


def test_without_summary_nodes_come_from_the_last_attempt() -> None:
    r = build_report(files(ok_events(), summary=None))
    assert r.state.startswith("unknown") and r.steps == 2
    assert [(n.name, n.rank, n.batch_size, n.step, n.tokens_per_s) for n in r.nodes] == [
        ("local-a", 0, 5, 2, 287.55), ("local-b", 1, 3, 2, 170.2)]


def test_relaunch_after_a_crash() -> None:
    events = [started("local-a", 0, 0), started("local-b", 1, 0), step("local-a", 0, 1, 1), step("local-b", 1, 1, 1),
              ckpt("local-a", 0, 1, 1.1, "aaaa1111"), ckpt("local-b", 1, 1, 1.1, "bbbb2222"),
              incident("checkpoint_mismatch", "local-b", 1, 1, action="stop"),
              incident("crash", "local-b", 1, 1, action="quarantine"),
              started("local-a", 0, 10, resumed_from="step-000001"), step("local-a", 0, 2, 11),
              {"event": "incident", "attempt": 1, "kind": "straggler", "node": "local-a", "rank": 0, "step": 2,
               "detected_after_s": None, "evidence": "slow <b>", "action": "warn", "t": 5.0}]
    summary = {**SUMMARY, "attempts": 2, "quarantined": ["local-b"], "nodes": SUMMARY["nodes"][:1],
               "recoveries": [{"attempt": 1, "culprits": ["local-b"], "failed_step": 1, "nodes": ["local-a"],
                               "first_step_after_s": 3.2}]}
    r = build_report(files(events, summary))
    assert [(a.number, a.nodes, a.resumed_from, a.first_step) for a in r.attempts] == [
        (0, ("local-a", "local-b"), None, 1), (1, ("local-a",), "step-000001", 2)]
    assert [(i.attempt, i.kind, i.t_wall) for i in r.incidents] == [
        (0, "checkpoint_mismatch", T0 + 1), (0, "crash", T0 + 1), (1, "straggler", T0 + 11)]
    assert not r.checkpoints[0].consistent
    # local-b is not in the final summary (it was quarantined) but keeps its row.
    assert [(n.name, n.state, n.step) for n in r.nodes] == [
        ("local-a", "finished", 2), ("local-b", "quarantined after attempt 1", 1)]
    page = render_html(r, render_plots(r, dpi=40))
    assert "attempt 2" in " ".join(s.label(2) for s in r.series)
    for text in ("Attempts", "Relaunch 1 without local-b, on local-a, after step 1; first step 3.2s after the fault was detected",
                 "differing manifests", "Quarantined after this run",
                 "slow &lt;b&gt;"):
        assert text in page, text


def test_read_run_files_reports_bad_files_as_problems(tmp_path: Path) -> None:
    run = write_run(tmp_path, ok_events())
    (run / "summary.json").write_text("{not json")
    with (run / "events.jsonl").open("a") as f:
        f.write('{"torn": ')
    got = read_run_files(tmp_path, RUN)
    assert got.summary is None and got.plan is not None and len(got.events) == len(ok_events())
    assert any("summary.json is unreadable" in p for p in got.problems)
    assert any("1 line(s)" in p for p in got.problems)


@pytest.mark.parametrize("run_id", ["nope", "..", "a/b", ""])
def test_bad_run_ids_are_config_errors(tmp_path: Path, run_id: str) -> None:
    write_run(tmp_path, ok_events())
    with pytest.raises(ReportError) as exc:
        read_run_files(tmp_path, run_id)
    assert exc.value.exit_code == 2


def test_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="not a run directory"):
        read_run_files(tmp_path, "empty")


def test_cli_writes_the_report_and_exits_2_on_a_bad_run_id(tmp_path: Path) -> None:
    run = write_run(tmp_path, ok_events())
    runner = CliRunner()
    ok = runner.invoke(main, ["report", RUN, "--run-dir", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert (run / "report" / "index.html").read_text().startswith("<!DOCTYPE html>")
    out = tmp_path / "elsewhere" / "r.html"
    assert runner.invoke(main, ["report", RUN, "--run-dir", str(tmp_path), "-o", str(out)]).exit_code == 0
    assert out.is_file()
    bad = runner.invoke(main, ["report", "smoke-nope", "--run-dir", str(tmp_path)])
    assert bad.exit_code == 2
    assert "no run 'smoke-nope'" in bad.output and RUN in bad.output  # names the runs that do exist


DEMO = Path(__file__).parent.parent / "fixtures" / "rundirs" / "smoke-20261125-015050-658d"


def demo_events() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DEMO / "events.jsonl").read_text().splitlines()]


def interleaved(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The demo's lines as two followers can interleave them: local-a's `started` lands after local-b's
    `started, step 1, checkpoint 1` (events.jsonl is in arrival order across nodes)."""
    late = next(i for i, e in enumerate(events) if e.get("event") == "started" and e["node"] == "local-a")
    moved = events.pop(late)
    after = next(i for i, e in enumerate(events) if e.get("event") == "checkpoint" and e["node"] == "local-b")
    events.insert(after + 1, moved)
    return events


@pytest.mark.parametrize("with_summary", [True, False])
def test_interleaved_followers_make_no_phantom_attempt(with_summary: bool) -> None:
    """A clean run whose nodes' lines interleave is one attempt: no `attempt 2`, one checkpoint row per step."""
    doc = json.loads((DEMO / "summary.json").read_text())
    run = RunFiles(DEMO.name, doc if with_summary else None, json.loads((DEMO / "plan.json").read_text()),
                   tuple(interleaved(demo_events())))
    r = build_report(run)
    assert len(r.attempts) == 1
    assert len(r.checkpoints) == 30 and [c.step for c in r.checkpoints] == list(range(1, 31))
    assert all(c.consistent and sorted(c.sha256) == ["local-a", "local-b"] for c in r.checkpoints)
    assert [(s.node, s.attempt, len(s.points)) for s in r.series] == [("local-a", 0, 30), ("local-b", 0, 30)]
    page = render_html(r, [])
    assert "attempt 2" not in page and "31 checkpoint" not in page


def test_the_coordinators_attempt_on_each_line_wins_over_the_order() -> None:
    """Lines that carry the coordinator's `attempt` are in that attempt, whatever the order of `started`s."""
    lines = [{**e, "attempt": a} for e, a in (
        (started("a", 0, 0), 0), (step("a", 0, 1, 1), 0), (started("b", 1, 0.5), 0), (step("b", 1, 1, 1), 0),
        (started("a", 0, 5, resumed_from="step-000001"), 1), (step("a", 0, 2, 6), 1), (started("b", 1, 5), 1))]
    assert assign_attempts([parse_event_line(e) for e in lines]) == [0, 0, 0, 0, 1, 1, 1]
    # An older file (no `attempt` on rank lines): each rank's own starts, capped at summary.json's count.
    bare = [{k: v for k, v in e.items() if k != "attempt"} for e in lines]
    assert assign_attempts([parse_event_line(e) for e in bare]) == [0, 0, 0, 0, 1, 1, 1]
    assert assign_attempts([parse_event_line(e) for e in bare], attempts=1) == [0] * 7


def test_a_resumed_run_keeps_its_sessions_apart() -> None:
    """`launch --resume` appends a session whose attempts are numbered from 0 again: a rank started twice under one
    attempt number begins it. The report shows both sessions' attempts; the replay judges the newest session."""
    first = [started("local-a", 0, 0), started("local-b", 1, 0), step("local-a", 0, 1, 1, tok_s=100.0),
             step("local-b", 1, 1, 1, tok_s=100.0), ckpt("local-a", 0, 1, 1.1), ckpt("local-b", 1, 1, 1.1),
             step("local-a", 0, 2, 2, tok_s=100.0), step("local-b", 1, 2, 2, tok_s=100.0)]
    again = [started("local-b", 1, 50, resumed_from="step-000001"), step("local-b", 1, 2, 51, tok_s=300.0),
             started("local-a", 0, 50.5, resumed_from="step-000001"), step("local-a", 0, 2, 51, tok_s=300.0),
             ckpt("local-a", 0, 2, 51.1), ckpt("local-b", 1, 2, 51.1)]
    lines = [{**e, "attempt": 0} for e in first + again]
    summary = {**SUMMARY, "attempts": 1, "resumed_from": {"step": 1, "checkpoint": "step-000001", "node": "local-a",
                                                          "from_scratch": False, "set_aside": []}}
    r = build_report(files(lines, summary))
    assert [(s.node, s.attempt, [p.step for p in s.points]) for s in r.series] == [
        ("local-a", 0, [1, 2]), ("local-b", 0, [1, 2]), ("local-a", 1, [2]), ("local-b", 1, [2])]
    assert [(a.number, a.resumed_from) for a in r.attempts] == [(0, None), (1, "step-000001")]
    assert [(c.attempt, c.step) for c in r.checkpoints] == [(0, 1), (1, 2)]
    assert [(n.name, n.tokens_per_s) for n in r.nodes] == [("local-a", 300.0), ("local-b", 300.0)]  # the newest


def test_an_attach_rereading_the_ranks_files_is_no_new_attempt() -> None:
    """`coordinator attach` copies each rank's lines again from their start (the same `started`, the same `t`):
    still one attempt, each step once."""
    run = [started("local-a", 0, 0), started("local-b", 1, 0.2), step("local-a", 0, 1, 1), step("local-b", 1, 1, 1),
           step("local-a", 0, 2, 2), step("local-b", 1, 2, 2)]
    detach = {"event": "supervisor", "what": "detached", "node": "coordinator", "t": T0 + 2.5}
    reread = [*run, step("local-a", 0, 3, 3), step("local-b", 1, 3, 3)]
    lines = [{**e, "attempt": 0} for e in [*run, detach, *reread]]
    r = build_report(files(lines, {**SUMMARY, "steps": 3}))
    assert len(r.attempts) == 1
    assert [(s.node, s.attempt, [p.step for p in s.points]) for s in r.series] == [
        ("local-a", 0, [1, 2, 3]), ("local-b", 0, [1, 2, 3])]
