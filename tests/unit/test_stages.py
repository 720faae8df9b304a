"""The stage view of a pipeline run (coordinator.run.stages): each rank's stage and layers, its busy and wait shares
of the step, the measured bubble and the memory against the plan, computed once and shown alike by every view
(status, monitor, the live table and its piped line, the report, the dashboard, summary.json); and `attach`
restoring the launch's layout from the run's record."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from rich.console import Console

from coordinator.models import Connection, Inventory, Node
from coordinator.run.launch import Launch, summarize
from coordinator.run.metrics import run_status_from_monitor
from coordinator.run.monitor import Monitor, Observation, ObservationKind, PlannedRank
from coordinator.run.replay import RunReplay
from coordinator.run.rundir import MetaRank, PlanRecord, RunMeta, parse_event_line, parse_meta
from coordinator.run.stages import (
    RunLayout,
    StageFold,
    StageView,
    build_run_layout,
    build_stage_view,
    parse_run_layout,
    recorded_layout,
)
from coordinator.views import dashboard
from coordinator.views.dashboard.server import open_run
from coordinator.views.jsonout import validate_output
from coordinator.views.liveview import build_table, plain_progress_line
from coordinator.views.report import build_page, build_report, read_run_files
from coordinator.views.stagetable import pct, stage_summary
from coordinator.views.status import build_report as build_status
from coordinator.views.statusview import render_run_table, render_status_table
from coordinator.views.statuswatch import RunWatcher
from worker.events import parse_event
from worker.runconfig import Layout, StageSpec

MiB = 2**20
NODES = ("a", "b", "c")
LAYOUT = Layout(kind="pipeline", micro_batches=6, schedule="1f1b",
                stages=(StageSpec(0, 0, 2), StageSpec(1, 2, 4), StageSpec(2, 4, 6)))
# plan.json's `strategy` as planning.strategy.StrategyChoice.to_json writes it (the fields the view reads)
STRATEGY: dict[str, Any] = {
    "strategy": "pipeline", "bubble": 2 / 8, "micro_batches": 6, "schedule": "1f1b", "layout": LAYOUT.to_json(),
    "rows": [{"node": n, "first_layer": 2 * i, "last_layer": 2 * i + 2, "need_bytes": 350 * MiB,
              "budget_bytes": 400 * MiB, "predicted_s": 0.1} for i, n in enumerate(NODES)]}
# Per rank: (busy_s, wait_s, peak_memory) of every step of 1.0 s: the middle stage is the bottleneck and passes
# its node's budget.
MEASURED = {0: (0.5, 0.45, 300 * MiB), 1: (0.9, 0.05, 500 * MiB), 2: (0.6, 0.35, 200 * MiB)}
STEPS = 5


def run_layout() -> RunLayout:
    return build_run_layout(LAYOUT, list(enumerate(NODES)), STRATEGY)


def lines() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rank, node in enumerate(NODES):
        spec = LAYOUT.stage(rank)
        out.append({"node": node, "rank": rank, "t": 100.0, "event": "started", "attempt": 0, "iters": STEPS,
                    "strategy": "pipeline", "stage": rank, "stages": 3, "first_layer": spec.first_layer,
                    "last_layer": spec.last_layer, "model_layers": 6, "micro_batches": 6, "schedule": "1f1b"})
    for step in range(1, STEPS + 1):
        for rank, node in enumerate(NODES):
            busy, wait, peak = MEASURED[rank]
            out.append({"node": node, "rank": rank, "t": 100.0 + step, "event": "step", "attempt": 0, "step": step,
                        "loss": 5.0 - step / 10, "tokens": 1000, "total_tokens": 1000, "tok_s": 1000.0,
                        "step_time_s": 1.0, "busy_s": busy, "wait_s": wait, "peak_memory": peak,
                        "compute_s": busy + wait})
    for rank, node in enumerate(NODES):  # every stage writes its own shard: their manifests differ by design
        out.append({"node": node, "rank": rank, "t": 100.0 + STEPS, "event": "checkpoint", "attempt": 0,
                    "step": STEPS, "path": f"/w/checkpoints/stage-{rank}/step-{STEPS:06d}", "sha256": str(rank) * 64})
    return out


def meta(layout: RunLayout | None = None) -> RunMeta:
    return RunMeta(run_id="pipe-1", inventory=None, nodes=NODES, iters=STEPS,
                   ranks=tuple(MetaRank(r, n, 36) for r, n in enumerate(NODES)), layout=layout or run_layout())


def live_monitor(layout: RunLayout | None) -> Monitor:
    plan = [PlannedRank(r, n, 36) for r, n in enumerate(NODES)]
    mon = Monitor.create(plan, STEPS, now=0.0, replica_groups=((0,), (1,), (2,)), layout=layout)
    for doc in lines():
        line = parse_event_line(doc)
        assert line.rank is not None and line.node is not None and line.t is not None
        mon.observe(Observation(ObservationKind.EVENT, line.node, line.t, line.rank,
                                {k: v for k, v in doc.items() if k not in ("node", "attempt")}))
    return mon


# --- the pure model -------------------------------------------------------------------------------------------


def test_the_layout_of_an_attempt_round_trips_through_meta_json_and_gives_back_the_workers() -> None:
    layout = run_layout()
    assert [(r.rank, r.node, r.stage, r.first_layer, r.last_layer) for r in layout.ranks] == [
        (0, "a", 0, 0, 2), (1, "b", 1, 2, 4), (2, "c", 2, 4, 6)]
    assert {(r.need_bytes, r.budget_bytes, r.predicted_s) for r in layout.ranks} == {(350 * MiB, 400 * MiB, 0.1)}
    assert layout.predicted_bubble == 0.25 and layout.micro_batches == 6
    assert parse_run_layout(json.loads(json.dumps(layout.to_json()))) == layout
    assert layout.worker_layout() == LAYOUT
    assert parse_meta(json.loads(json.dumps(meta().to_json()))).layout == layout
    # An older meta.json has none; a dp run's layout has no stages, only its nodes' memory rows.
    assert parse_run_layout(None) is None and parse_meta({"run_id": "x"}).layout is None
    dp = build_run_layout(Layout(), [(0, "a")], {"rows": [STRATEGY["rows"][0]], "bubble": None})
    assert (dp.kind, dp.ranks[0].stage, dp.ranks[0].budget_bytes, dp.worker_layout()) == ("dp", None, 400 * MiB,
                                                                                        Layout())


def test_a_layout_is_rebuilt_from_plan_json_for_a_meta_json_without_one() -> None:
    assert recorded_layout(None, list(enumerate(NODES)), STRATEGY) == run_layout()
    assert recorded_layout(run_layout(), [], None) == run_layout()  # meta.json's wins
    assert recorded_layout(None, [(0, "a")], None) is None


def test_the_view_measures_shares_bubble_bottleneck_and_memory_against_the_plan() -> None:
    fold = StageFold()
    for doc in lines():
        fold.observe(doc["rank"], parse_event(doc))
    view = build_stage_view(run_layout(), fold, list(enumerate(NODES)))
    assert view.pipeline and view.micro_batches == 6 and view.schedule == "1f1b"
    assert [(r.stage, r.layers, r.busy_share, r.wait_share) for r in view.ranks] == [
        (0, "0-1", 0.5, 0.45), (1, "2-3", 0.9, 0.05), (2, "4-5", 0.6, 0.35)]
    assert view.bubble is not None and abs(view.bubble - (0.45 + 0.05 + 0.35) / 3) < 1e-12
    assert view.predicted_bubble == 0.25 and view.bottleneck == 1
    assert {r.predicted_busy_s for r in view.ranks} == {0.1 * 6}
    # The plan's own compute per step wins where it says one (the simulated schedule's).
    rows = [{**r, "predicted_busy_s": 0.75} for r in STRATEGY["rows"]]
    planned = build_run_layout(LAYOUT, list(enumerate(NODES)), {**STRATEGY, "rows": rows})
    assert parse_run_layout(planned.to_json()) == planned
    assert {r.predicted_busy_s for r in build_stage_view(planned, fold, list(enumerate(NODES))).ranks} == {0.75}
    assert [(r.peak_memory_bytes, r.over_budget) for r in view.ranks] == [
        (300 * MiB, False), (500 * MiB, True), (200 * MiB, False)]
    # The shares are medians of the newest steps: one slow step does not move them.
    fold.observe(1, parse_event({"event": "step", "rank": 1, "step": 6, "step_time_s": 10.0, "busy_s": 1.0,
                                 "wait_s": 9.0}))
    assert build_stage_view(run_layout(), fold, list(enumerate(NODES))).of(1).busy_share == 0.9  # type: ignore[union-attr]


def test_without_a_recorded_layout_the_stages_come_from_the_ranks_started_events() -> None:
    fold = StageFold()
    for doc in lines():
        fold.observe(doc["rank"], parse_event(doc))
    view = build_stage_view(None, fold, list(enumerate(NODES)))
    assert view.pipeline and [r.layers for r in view.ranks] == ["0-1", "2-3", "4-5"]
    assert view.predicted_bubble is None and not view.has_memory_plan and view.micro_batches == 6


def test_a_data_parallel_run_has_no_stages() -> None:
    fold = StageFold()
    fold.observe(0, parse_event({"event": "started", "rank": 0}))
    fold.observe(0, parse_event({"event": "step", "rank": 0, "step": 1, "step_time_s": 1.0, "peak_memory": 5}))
    view = build_stage_view(None, fold, [(0, "a")])
    assert not view.pipeline and view.bubble is None and view.bottleneck is None
    assert view.ranks[0].stage is None and view.ranks[0].peak_memory_bytes == 5


# --- every view shows the same numbers ------------------------------------------------------------------------


def write_run(tmp_path: Path, *, ended: bool) -> tuple[Path, dict[str, Any] | None]:
    run = tmp_path / "runs" / "pipe-1"
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps(meta().to_json()))
    (run / "plan.json").write_text(json.dumps(PlanRecord(split={}, batch={n: 36 for n in NODES}, global_batch=36,
                                                         mode="pipeline", predicted_tokens_per_s=None,
                                                         backend="ring", attempt=0, strategy=STRATEGY).to_json()))
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines()))
    if not ended:
        return run, None
    mon = live_monitor(run_layout())
    layout = run_layout()  # the launch's recorded layout: summarize reads the plan's memory from it
    launch = cast(Launch, SimpleNamespace(run_id="pipe-1", run_dir=run, remote_run_dirs={}, run_layout=layout,
                                          layout=layout.worker_layout()))
    summary = json.loads(json.dumps(summarize(launch, mon, {}).to_json(), default=str))
    validate_output("launch", summary)
    (run / "summary.json").write_text(json.dumps(summary))
    return run, summary


def test_a_share_on_a_half_percent_reads_alike_in_every_view() -> None:
    """A CI run's bubble of 0.35496 (recorded 0.355) read 35% in the report (its unrounded share, Python's
    rounding) and 36% on the dashboard (the recorded one, JavaScript's). One rule now, from the recorded value, a half
    up; app.js's `pct` is the same expression, checked here against its source."""
    assert [pct(v) for v in (0.35496, 0.355, 0.345, 0.3449, 0.0, 1.0, None)] == \
        ["36%", "36%", "35%", "34%", "0%", "100%", "-"]
    assert stage_summary(StageView(kind="pipeline", ranks=(), bubble=0.35496, predicted_bubble=1 / 3)) == \
        "pipeline of 0 stages: bubble 36% (plan 33%)"
    app = (Path(dashboard.__file__).parent / "static" / "app.js").read_text()
    assert 'const pct = (v) => v == null ? "-" : `${Math.floor(100 * v + 0.5)}%`;' in app


def test_every_view_shows_the_same_stages(tmp_path: Path) -> None:
    run, summary = write_run(tmp_path, ended=True)
    assert summary is not None
    truth = summary["stages"]
    assert [r["stage"] for r in truth["ranks"]] == [0, 1, 2] and truth["bottleneck"] == 1
    # the end-of-run memory line's plan (summary nodes) is the stage view's, from the one recorded layout
    assert {n["node"]: n["planned_memory_bytes"] for n in summary["nodes"]} == \
        {r["node"]: r["predicted_memory_bytes"] for r in truth["ranks"]}
    replay = RunReplay(meta())
    replay.feed(lines())
    assert replay.judge(None).stages.to_json() == truth  # the files, replayed

    report = build_report(read_run_files(run.parent, run.name))
    assert report.stages.to_json() == truth
    page = build_page(read_run_files(run.parent, run.name))
    assert '<table id="stages"' in page and "Pipeline of 3 stages, 6 micro-batches (1f1b): bubble 28% (plan 25%), " \
        "bottleneck stage 1 on b" in page
    assert "500.0 MiB / plan 350.0 MiB / budget 400.0 MiB OVER BUDGET" in page
    assert "one shard per stage" in page and "differing manifests" not in page
    # Every stage computes every row: no batch share, no per-node calibrated rate (blocks were measured).
    assert "<h2>Nodes and stages</h2>" in page and "share of global batch" not in page
    assert "calibrated real tokens/s" not in page

    runs = RunWatcher(run.parent).scan(now=2e9)
    status = build_status(Inventory(tuple(Node(n, "127.0.0.1") for n in NODES)), {}, {n: "x" for n in NODES},
                          runs, {}, [])
    validate_output("status", status.to_json())
    assert [n["run"]["stage"] for n in status.to_json()["nodes"]] == truth["ranks"]
    out = io.StringIO()
    Console(file=out, width=250).print(render_status_table(status.nodes))
    assert "stage 0 (L0-1)" in out.getvalue() and "stage 2 (L4-5)" in out.getvalue()

    tracked = open_run(run)
    assert tracked is not None
    tracked.poll()
    page_doc = tracked.view(2e9, full=True)  # the dashboard's run JSON
    assert page_doc["stages"] == truth and page_doc["split"] == {}  # every stage computes every row


def test_a_live_pipeline_run_is_shown_alike_by_status_monitor_and_the_live_view(tmp_path: Path) -> None:
    run, _ = write_run(tmp_path, ended=False)
    mon = live_monitor(run_layout())  # the launch loop's own
    now = 100.0 + STEPS + 0.5
    live = run_status_from_monitor("pipe-1", mon, now)
    [watched] = RunWatcher(run.parent).scan(now=now)
    assert watched.active and watched.stages == live.stages
    validate_output("status", build_status(Inventory(()), {}, {}, [watched], {}, []).to_json())
    table = io.StringIO()
    Console(file=table, width=300).print(render_run_table(watched))
    text = table.getvalue()
    assert "bubble 28% (plan 25%), bottleneck stage 1 on b" in text
    for row, cells in (("a", ("0 (L0-1)", "50% / 45%", "0.500 s (plan 0.600 s)")),
                       ("b", ("1 (L2-3)", "90% / 5%", "500.0 MiB / plan 350.0 MiB / budget 400.0 MiB OVER BUDGET"))):
        line = next(x for x in text.splitlines() if x.startswith("│") and f"│ {row} " in x)
        assert all(c in line for c in cells), line
    shown = io.StringIO()
    Console(file=shown, width=300).print(build_table(mon, now))
    assert "bubble 28% (plan 25%)" in shown.getvalue() and "1 (L2-3)" in shown.getvalue()
    line = plain_progress_line(mon, now)
    assert line.endswith("bubble 28% (plan 25%) [s0 L0-1 busy 50%, s1 L2-3 busy 90%, s2 L4-5 busy 60%]"), line


# --- attach -----------------------------------------------------------------------------------------------------


def test_attach_restores_the_launchs_pipeline_layout_from_the_run_record(tmp_path: Path) -> None:
    """attach's monitor and views are launch's: the stages' replica groups (no digest vote across stages) and the
    stage view. Before, attach rebuilt a data-parallel layout."""
    from coordinator.config.playbook import parse_playbook
    from coordinator.fleet.transport import Fleet
    from coordinator.planning.hostfile import Hostfile
    from coordinator.run.control import _adopt, read_meta
    from coordinator.run.launchfiles import RankPlan

    nodes = [Node(n, "127.0.0.1", Connection.LOCAL, workdir=str(tmp_path / n)) for n in NODES]
    pb = parse_playbook({"name": "t", "model": "/m", "data": "/d"}, path="pb.yaml").model_copy(update={"path": None})
    run_dir = tmp_path / "runs" / "t-1"
    launched = Launch(Fleet(nodes), pb, [RankPlan(i, n, 36) for i, n in enumerate(nodes)], Hostfile("ring", ()), {},
                      run_id="t-1", run_dir=run_dir)
    launched.layout = LAYOUT
    launched.write_local_files(PlanRecord(split={}, batch={}, global_batch=36, mode="pipeline",
                                          predicted_tokens_per_s=None, backend="ring", attempt=0, strategy=STRATEGY))
    launched.write_meta()
    inv = Inventory(tuple(nodes))
    adopted = _adopt(Fleet(nodes), run_dir, read_meta(run_dir), inv, pb, None)
    assert adopted.layout == LAYOUT and adopted.run_layout == launched.run_layout == run_layout()
    mon = adopted.new_monitor()
    assert mon.replica_groups == launched.new_monitor().replica_groups == ((0,), (1,), (2,))
    assert mon.layout == run_layout()
    # A meta.json written before layouts were recorded: plan.json's strategy says it.
    doc = json.loads((run_dir / "meta.json").read_text())
    doc.pop("layout")
    (run_dir / "meta.json").write_text(json.dumps(doc))
    older = _adopt(Fleet(nodes), run_dir, read_meta(run_dir), inv, pb, None)
    assert older.layout == LAYOUT and older.run_layout == run_layout()


def test_the_live_monitor_and_the_replay_judge_a_stage_by_the_same_planned_busy_time(tmp_path: Path) -> None:
    """One rule, one yardstick: the per-stage straggler rule holds each stage's busy seconds to the plan's, read from
    the one recorded layout by the launch's monitor (and attach's) and by the replay behind status and the report.
    Before, the replay had no planned time and judged each stage by its own first steps: no verdict there."""
    from dataclasses import replace

    from coordinator.config.playbook import parse_playbook
    from coordinator.fleet.transport import Fleet
    from coordinator.planning.hostfile import Hostfile
    from coordinator.run.launchfiles import RankPlan
    from coordinator.run.monitor import FaultPolicy, IncidentKind
    from coordinator.run.stages import planned_busy_s

    rows = [{**row, "predicted_busy_s": busy} for row, busy in zip(STRATEGY["rows"], (0.5, 0.3, 0.6), strict=True)]
    strategy = {**STRATEGY, "rows": rows}
    layout = build_run_layout(LAYOUT, list(enumerate(NODES)), strategy)
    assert [planned_busy_s(layout, r) for r in range(3)] == [0.5, 0.3, 0.6]
    assert planned_busy_s(None, 0) is None and planned_busy_s(replace(layout, kind="dp"), 0) is None
    policy = FaultPolicy(straggler_window=3, straggler_min_s=0.1)
    nodes = [Node(n, "127.0.0.1", Connection.LOCAL, workdir=str(tmp_path / n)) for n in NODES]
    pb = parse_playbook({"name": "t", "model": "/m", "data": "/d"}, path="pb.yaml").model_copy(update={"path": None})
    launched = Launch(Fleet(nodes), pb, [RankPlan(i, n, 36) for i, n in enumerate(nodes)], Hostfile("ring", ()), {},
                      run_id="t-1", run_dir=tmp_path / "runs" / "t-1")
    launched.layout, launched.run_layout, launched.policy = LAYOUT, layout, policy
    live = launched.new_monitor()
    for doc in lines():
        line = parse_event_line(doc)
        assert line.rank is not None and line.node is not None and line.t is not None
        live.observe(Observation(ObservationKind.EVENT, line.node, line.t, line.rank,
                                 {k: v for k, v in doc.items() if k not in ("node", "attempt")}))
    replay = RunReplay(replace(meta(layout), faults=policy))
    replay.feed(lines())

    def verdicts(mon: Monitor) -> list[tuple[str, int | None, Any]]:
        return [(str(i.kind), i.rank, i.evidence.get("yardstick")) for i in mon.incidents
                if i.kind == IncidentKind.STRAGGLER]

    assert verdicts(live) == verdicts(replay.monitor) == [(str(IncidentKind.STRAGGLER), 1, "plan")]


def test_the_prometheus_stage_metrics_are_the_stage_views_numbers(tmp_path: Path) -> None:
    from collections.abc import Iterator

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector

    from coordinator.run.metrics import build_metric_families

    mon = live_monitor(run_layout())
    live = run_status_from_monitor("pipe-1", mon, 100.0 + STEPS + 0.5)

    class Fixed(Collector):
        def collect(self) -> Iterator[Metric]:
            return iter(build_metric_families([], [live]))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    got: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            got.setdefault(s.name, {})[s.labels.get("stage", "run")] = s.value
    view = live.stages
    assert got["mlxc_run_bottleneck_stage"] == {"run": 1.0} and view.bottleneck == 1
    assert got["mlxc_run_bubble_ratio"]["run"] == pytest.approx(view.bubble)
    assert got["mlxc_run_predicted_bubble_ratio"]["run"] == pytest.approx(0.25)
    for st in view.ranks:
        assert got["mlxc_stage_busy_share"][str(st.stage)] == pytest.approx(st.busy_share)
        assert got["mlxc_stage_wait_share"][str(st.stage)] == pytest.approx(st.wait_share)
        assert got["mlxc_stage_peak_memory_bytes"][str(st.stage)] == st.peak_memory_bytes
        assert got["mlxc_stage_predicted_memory_bytes"][str(st.stage)] == st.predicted_memory_bytes
    assert got["mlxc_stage_busy_share"] == {"0": 0.5, "1": 0.9, "2": 0.6}
    # A data-parallel run has no stage metrics.
    dp = run_status_from_monitor("dp-1", Monitor.create([PlannedRank(0, "a", 4)], 5, now=0.0), 1.0)
    assert not [f for f in build_metric_families([], [dp]) if f.name.startswith("mlxc_stage") and f.samples]
