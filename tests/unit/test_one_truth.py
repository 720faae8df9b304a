"""One verdict and one number per thing: a recorded run (tests/fixtures/rundirs/, `make demo`'s run dir) fed to every
view, which must agree on each rank's rate and verdict and on the run's prediction: summary.json as today's
coordinator writes it for that run, the report, `status --json`, the dashboard's run JSON, the live view and its
piped line, and the Prometheus records.

The coordinator's side is re-enacted from the recorded lines: a `Monitor` planned from meta.json fed the run's
observations in file order (what the launch loop fed it), summarized by `launch.summarize`."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from rich.console import Console

from coordinator.models import Inventory, Node
from coordinator.run.launch import Launch, summarize
from coordinator.run.metrics import run_status_from_monitor
from coordinator.run.monitor import FaultPolicy, Monitor, Observation, ObservationKind, PlannedRank
from coordinator.run.replay import RunReplay
from coordinator.run.rundir import parse_event_line, parse_meta
from coordinator.views.dashboard.server import open_run
from coordinator.views.jsonout import validate_output
from coordinator.views.liveview import build_table, plain_progress_line
from coordinator.views.report import build_report, read_run_files
from coordinator.views.status import build_report as build_status
from coordinator.views.statuswatch import RunWatcher

DEMO = Path(__file__).parent.parent / "fixtures" / "rundirs" / "smoke-20261125-015050-658d"
POLICY = FaultPolicy(heartbeat_timeout=10.0)


def lines() -> list[dict[str, Any]]:
    return [json.loads(x) for x in (DEMO / "events.jsonl").read_text().splitlines() if x.strip()]


def run_dir(tmp_path: Path, upto: int | None = None) -> Path:
    """A copy of the demo run, its meta.json as today's coordinator writes it (the run's thresholds, iters,
    prediction), cut after `upto` lines (then still running: no summary.json)."""
    run = tmp_path / "runs" / DEMO.name
    shutil.copytree(DEMO, run)
    meta = json.loads((run / "meta.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    meta |= {"faults": {"heartbeat_timeout": POLICY.heartbeat_timeout, "straggler_fraction": 0.5,
                        "straggler_window": 5, "straggler_min_s": 5.0, "outlier_steps": 3, "stall_factor": 10.0,
                        "stall_min_s": 60.0},
             "iters": 30, "predicted_tokens_per_s": plan["predicted_tokens_per_s"], "max_tokens_per_row": 128}
    (run / "meta.json").write_text(json.dumps(meta))
    if upto is not None:
        (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines()[:upto]))
        (run / "summary.json").unlink()
    return run


def live_monitor(run: Path, upto: int | None = None) -> Monitor:
    """The coordinator's monitor of the run: planned from meta.json, fed each rank line as it arrived."""
    meta = parse_meta(json.loads((run / "meta.json").read_text()))
    plan = [PlannedRank(r.rank, r.node, r.batch_size or 1, r.calibrated_tokens_per_s) for r in meta.ranks]
    mon = Monitor.create(plan, 30, now=0.0, policy=meta.faults, max_tokens_per_row=meta.max_tokens_per_row)
    for doc in lines()[:upto]:
        line = parse_event_line(doc)
        if line.incident is None and line.rank is not None and line.node is not None and line.t is not None:
            mon.observe(Observation(ObservationKind.EVENT, line.node, line.t, line.rank,
                                    {k: v for k, v in doc.items() if k != "node"}))
    return mon


def write_todays_summary(run: Path, mon: Monitor) -> dict[str, Any]:
    launch = cast(Launch, SimpleNamespace(run_id=DEMO.name, run_dir=run, remote_run_dirs={}, run_layout=None,
                                          layout=SimpleNamespace(kind="dp")))
    predicted = json.loads((run / "plan.json").read_text())["predicted_tokens_per_s"]
    doc = summarize(launch, mon, {"local-a": 0.5, "local-b": 0.5}, predicted_tokens_per_s=predicted).to_json()
    validate_output("launch", json.loads(json.dumps(doc, default=str)))
    (run / "summary.json").write_text(json.dumps(doc, default=str))
    return doc


def inventory() -> Inventory:
    return Inventory((Node("local-a", "127.0.0.1"), Node("local-b", "127.0.0.1")))


def test_every_view_of_a_finished_run_agrees(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    mon = live_monitor(run)
    summary = write_todays_summary(run, mon)
    truth = {n["node"]: (n["tokens_per_s"], n["verdict"]) for n in summary["nodes"]}
    predicted = round(summary["predicted_tokens_per_s"], 1)
    assert all(rate and rate > 0 and verdict == "ok" for rate, verdict in truth.values()), truth
    # The rate is the median of the rank's last steps, not its last step (what summary.json used to say).
    assert truth["local-a"][0] != round(mon.ranks[0].tokens_per_s or 0, 1)

    report = build_report(read_run_files(run.parent, run.name))
    assert {n.name: (round(n.tokens_per_s or 0, 1), n.verdict) for n in report.nodes} == truth
    assert round(report.predicted_tokens_per_s or 0, 1) == predicted
    assert len(report.attempts) == 1 and len(report.checkpoints) == 30

    runs = RunWatcher(run.parent).scan(now=2e9)
    status = build_status(inventory(), {}, {n: "not probed" for n in ("local-a", "local-b")}, runs, {}, []).to_json()
    validate_output("status", status)
    assert {n["node"]: (n["run"]["tokens_per_s"], n["run"]["verdict"]) for n in status["nodes"]} == truth
    assert {n["run"]["predicted_tokens_per_s"] for n in status["nodes"]} == {predicted}

    tracked = open_run(run)
    assert tracked is not None
    tracked.poll()
    page = tracked.view(2e9, full=True)  # the dashboard's run JSON, long after the run ended
    assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in page["ranks"]} == truth
    assert page["predicted_tokens_per_s"] == predicted
    assert page["tokens_per_s"] == round(summary["tokens_per_s"], 1)

    exported = run_status_from_monitor(DEMO.name, mon, 2e9, predicted=summary["predicted_tokens_per_s"]).to_json()
    assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in exported["ranks"]} == truth
    assert exported["predicted_tokens_per_s"] == predicted

    line = plain_progress_line(mon, 2e9, final=True, predicted=summary["predicted_tokens_per_s"])
    assert line.endswith("[local-a 30 ok, local-b 30 ok]") and f"{summary['tokens_per_s']:,.0f} real tokens/s" in line


@pytest.mark.parametrize("upto", [60, 150])
def test_every_view_of_a_live_run_agrees(tmp_path: Path, upto: int) -> None:
    """Mid-run (no summary.json yet), at one instant: status, the dashboard and the live view say the same."""
    run = run_dir(tmp_path, upto)
    mon = live_monitor(run, upto)
    now = max(x["t"] for x in lines()[:upto] if "t" in x) + 1.0
    exported = run_status_from_monitor(DEMO.name, mon, now).to_json()  # the live monitor, as the launch loop has it
    replay = RunReplay(parse_meta(json.loads((run / "meta.json").read_text())))
    replay.feed(lines()[:upto])
    truth = {j.node: (None if j.tokens_per_s is None else round(j.tokens_per_s, 1), str(j.verdict))
             for j in replay.judge(now).ranks}
    assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in exported["ranks"]} == truth
    assert all(v == "ok" for _, v in truth.values()) and all(r for r, _ in truth.values())

    runs = RunWatcher(run.parent).scan(now=now)
    status = build_status(inventory(), {}, {}, runs, {}, []).to_json()  # `status --json` prints active runs
    validate_output("status", status)
    [active] = status["runs"]
    assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in active["ranks"]} == truth
    predicted = round(json.loads((run / "plan.json").read_text())["predicted_tokens_per_s"], 1)
    assert active["predicted_tokens_per_s"] == predicted

    tracked = open_run(run)
    assert tracked is not None
    tracked.poll()
    page = tracked.view(now, full=True)
    assert {r["node"]: (r["tokens_per_s"], r["verdict"]) for r in page["ranks"]} == truth
    assert page["predicted_tokens_per_s"] == predicted == active["predicted_tokens_per_s"]
    assert page["tokens_per_s"] == active["tokens_per_s"]

    # The live view, at the same instant; then silent past the run's heartbeat timeout: every view says hung.
    out = io.StringIO()
    Console(file=out, width=200).print(build_table(mon, now, predicted=predicted))
    for j in replay.judge(now).ranks:
        row = next(x for x in out.getvalue().splitlines() if j.node in x)
        assert f"{j.tokens_per_s:,.0f} (" in row and f" {j.verdict} " in row
    later = now + POLICY.heartbeat_timeout + 1
    assert {r["verdict"] for r in run_status_from_monitor(DEMO.name, mon, later).to_json()["ranks"]} == {"hung"}
    assert {r["verdict"] for r in tracked.view(later, full=False)["ranks"]} == {"hung"}
    assert {r.verdict for r in RunWatcher(run.parent).scan(now=later)[0].ranks} == {"hung"}


def test_the_replay_judges_meta_jsons_attempt_of_the_newest_session() -> None:
    """`launch --resume` appends a session numbered from attempt 0 again: status and the dashboard judge it, not
    the session before (whose rank 1 died)."""
    meta = parse_meta({"run_id": "r", "attempt": 0, "ranks": [{"rank": 0, "node": "a"}, {"rank": 1, "node": "b"}]})

    def step(node: str, rank: int, n: int, t: float, tok_s: float) -> dict[str, Any]:
        return {"node": node, "rank": rank, "t": t, "event": "step", "step": n, "tok_s": tok_s, "attempt": 0}

    old = [{"node": n, "rank": r, "t": 0.0, "event": "started", "attempt": 0} for r, n in ((0, "a"), (1, "b"))]
    old += [step("a", 0, 1, 1.0, 100.0), step("b", 1, 1, 1.0, 100.0),
            {"event": "incident", "attempt": 0, "kind": "crash", "node": "b", "rank": 1, "step": 1, "t": 9.0}]
    new = [{"node": n, "rank": r, "t": 50.0, "event": "started", "attempt": 0, "resumed_from": 1}
           for r, n in ((0, "a"), (1, "b"))]
    new += [step("a", 0, 2, 51.0, 300.0), step("b", 1, 2, 51.0, 200.0)]
    replay = RunReplay(meta)
    replay.feed(old + new)
    assert [(j.node, j.tokens_per_s, str(j.verdict)) for j in replay.judge(52.0).ranks] == [
        ("a", 300.0, "ok"), ("b", 200.0, "ok")]
    before = RunReplay(meta)
    before.feed(old)
    assert [(j.node, str(j.verdict)) for j in before.judge(None).ranks] == [("a", "ok"), ("b", "dead")]


def test_an_attach_rereading_the_files_is_judged_as_the_attaching_monitor_did() -> None:
    """`coordinator attach` copies the ranks' lines again from their start into a fresh monitor: the replay starts
    over there too, so no step counts twice."""
    meta = parse_meta({"run_id": "r", "attempt": 0, "ranks": [{"rank": 0, "node": "a"}, {"rank": 1, "node": "b"}]})
    first = [{"node": n, "rank": r, "t": 0.0, "event": "started", "attempt": 0} for r, n in ((0, "a"), (1, "b"))]
    first += [{"node": n, "rank": r, "t": float(s), "event": "step", "step": s, "tok_s": 100.0 * (r + 1), "attempt": 0}
              for s in (1, 2, 3) for r, n in ((0, "a"), (1, "b"))]
    later = [{"node": n, "rank": r, "t": float(s), "event": "step", "step": s, "tok_s": 100.0 * (r + 1), "attempt": 0}
             for s in (4, 5) for r, n in ((0, "a"), (1, "b"))]
    replay = RunReplay(meta)
    replay.feed([*first, {"event": "supervisor", "what": "detached", "node": "coordinator", "attempt": 0, "t": 3.5},
                 *first, *later])
    assert [len(v.recent_tok_s) for v in replay.monitor.ranks.values()] == [5, 5]
    assert [(j.node, j.tokens_per_s, str(j.verdict)) for j in replay.judge(6.0).ranks] == [
        ("a", 100.0, "ok"), ("b", 200.0, "ok")]
