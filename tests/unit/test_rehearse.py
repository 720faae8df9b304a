"""The rehearsal: the run's first steps timed before it where ranks share a machine (coordinator/run/rehearse.py).

Pure: which nodes share a machine, the plan a rehearsal predicts, its record and the end-of-run words. Real: a
4-step rehearsal of two `connection: local` ranks over a loopback ring (about 15 s on 2 cores), which must measure
the run's rate and leave nothing behind, and one whose ranks cannot load the model, which must say so.
"""

from __future__ import annotations

import asyncio
import glob
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from coordinator.config.inventory import load_inventory
from coordinator.config.playbook import load_playbook
from coordinator.fleet.transport import Fleet
from coordinator.models import Connection, Node
from coordinator.planning.colocate import compute_bench_groups, describe_shared
from coordinator.planning.plan import (
    CurvePoint,
    NodeCalibration,
    PlanError,
    Rehearsal,
    SplitMode,
    compute_plan,
    describe_prediction,
    describe_step,
    with_rehearsal,
)
from coordinator.run.calibrate import plan_step_json
from coordinator.run.job import hostfile_for
from coordinator.run.rehearse import REHEARSAL_STEPS, rehearsal_playbook, rehearsal_steps, rehearse
from coordinator.run.supervision import Supervision
from coordinator.views.jsonout import PlanStepOut
from worker.runconfig import Layout
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "playbooks" / "data" / "smoke"


def _cal(node: str, rate: float) -> NodeCalibration:
    return NodeCalibration(node, tuple(CurvePoint(b, rate, 2**20) for b in (1, 2, 4)), 1.0, None, seq_len=64)


def test_only_planned_nodes_that_share_a_machine_are_named() -> None:
    nodes = [Node(name="a", host="127.0.0.1", connection=Connection.LOCAL),
             Node(name="b", host="127.0.0.1", connection=Connection.LOCAL),
             Node(name="c", host="10.0.0.3"), Node(name="d", host="10.0.0.4"), Node(name="e", host="10.0.0.4")]
    groups = compute_bench_groups(nodes, {})
    assert describe_shared(groups, ["a", "b", "c"]) == "a, b share this machine"
    assert describe_shared(groups, ["a", "c", "d", "e"]) == "d, e share 10.0.0.4"
    assert describe_shared(groups, ["a", "b", "d", "e"]) == "a, b share this machine; d, e share 10.0.0.4"
    assert describe_shared(groups, ["a", "c", "d"]) is None  # each planned node alone on its machine


def test_a_rehearsed_plan_predicts_the_rehearsals_rate_and_keeps_the_calibrated_parts() -> None:
    plan = compute_plan([_cal("a", 2000.0), _cal("b", 2000.0)], 4, seq_len=64)
    rehearsal = Rehearsal(8, 1500.0, 2500.0, "a, b share this machine")
    rehearsed = with_rehearsal(plan, rehearsal)
    assert rehearsed.batch == plan.batch and rehearsed.per_node_step_s == plan.per_node_step_s
    assert rehearsed.predicted_tokens_per_s == 1500.0 and rehearsed.compute_tokens_per_s == 2500.0
    assert rehearsed.predicted_step_s == pytest.approx(4 * 64 / 1500.0)
    assert rehearsed.compute_step_s == pytest.approx(4 * 64 / 2500.0)
    step = plan_step_json(rehearsed)
    assert step["rehearsal"] == {"steps": 8, "tokens_per_s": 1500.0, "compute_tokens_per_s": 2500.0,
                                 "shared": "a, b share this machine", "timed_tokens_per_s": None,
                                 "step_tokens": None}
    PlanStepOut.model_validate(step)
    assert plan_step_json(plan)["rehearsal"] is None
    assert "timed by a rehearsal of 8 steps of the run (a, b share this machine" in describe_step(rehearsed)
    assert f"calibrated apart it was {1000 * plan.predicted_step_s:.1f} ms" in describe_step(rehearsed)
    assert with_rehearsal(plan, None) is plan
    pipeline = compute_plan([_cal("a", 2000.0)], 4, seq_len=64)
    pipeline = type(pipeline)(**{**pipeline.__dict__, "mode": SplitMode.PIPELINE})
    assert with_rehearsal(pipeline, rehearsal) is pipeline
    with pytest.raises(PlanError):
        Rehearsal(8, 0.0, None, "x")


def test_the_end_of_run_line_holds_the_run_to_its_rehearsal() -> None:
    within = describe_prediction(1400.0, 1500.0, steps=30, ranks=2, rehearsed=8)
    assert within.endswith("(-7%): within 15% of the rehearsal (8 steps of the run timed before it: its ranks share "
                           "a machine)")
    slower = describe_prediction(1000.0, 1500.0, steps=30, ranks=2, rehearsed=8)
    assert "slower than the rehearsal" in slower and "other work during the run, or its launches differ" in slower
    faster = describe_prediction(2000.0, 1500.0, steps=30, ranks=2, rehearsed=8)
    assert "faster than the rehearsal" in faster and "other work while rehearsing, or its launches differ" in faster
    assert "calibration" in describe_prediction(1400.0, 1500.0, steps=30, ranks=2)


def test_which_runs_rehearse_and_with_what() -> None:
    assert rehearsal_steps(REHEARSAL_STEPS) is None and rehearsal_steps(30) == REHEARSAL_STEPS == 16
    pb = load_playbook(REPO / "playbooks" / "smoke.yaml")
    cut = rehearsal_playbook(pb, 4)
    assert cut.train.iters == 4 and cut.train.steps_per_eval == 5  # no eval inside the rehearsal
    assert cut.train.save_every == pb.train.save_every and cut.train.batch_size == pb.train.batch_size
    assert pb.train.iters == 30  # the run's playbook is not touched


def _local_run(tmp: Path, model: str) -> tuple[Path, Path]:
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"connection": "local"}, "nodes": [
        {"name": "local-a", "workdir": str(tmp / "a")}, {"name": "local-b", "workdir": str(tmp / "b")}]}))
    pb = tmp / f"pb-{model}.yaml"
    pb.write_text(yaml.safe_dump({
        "name": "rehearse", "kind": "train", "model": str(tmp / model), "data": str(tmp / "data"), "backend": "ring",
        "train": {"method": "lora", "iters": 40, "batch_size": 4, "learning_rate": 1e-3, "max_seq_length": 64,
                  "save_every": 2, "steps_per_eval": 10, "val_batches": 1},
        "heartbeat_timeout": 30}, sort_keys=False))
    return inv, pb


def test_a_rehearsal_times_the_runs_steps_over_a_real_ring_and_leaves_nothing_behind(tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "model", DATA, layers=2, hidden=32, seed=0)
    shutil.copytree(DATA, tmp_path / "data")
    inv_path, pb_path = _local_run(tmp_path, "model")
    _, broken_path = _local_run(tmp_path, "no-model")
    inv, pb, broken = load_inventory(inv_path), load_playbook(pb_path), load_playbook(broken_path)
    plan = compute_plan([_cal("local-a", 2000.0), _cal("local-b", 2000.0)], 4, seq_len=64)
    temps = set(glob.glob(f"{tempfile.gettempdir()}/mlxc-rehearsal-*"))
    said: list[str] = []

    async def go(playbook: object, run_id: str) -> Rehearsal | str:
        async with Fleet(inv.nodes) as fleet:
            assert playbook is pb or playbook is broken
            return await rehearse(fleet, playbook, list(inv.nodes), plan, hostfile_for(inv, pb, {}), {},
                                  run_id=run_id, layout=Layout(kind="dp"), sup=Supervision(),
                                  shared="local-a, local-b share this machine", steps=4, progress=said.append)

    result = asyncio.run(go(pb, "t-rehearse"))
    assert isinstance(result, Rehearsal), (result, said)
    assert result.steps == 4 and result.tokens_per_s > 0 and result.shared == "local-a, local-b share this machine"
    assert result.compute_tokens_per_s is not None and result.compute_tokens_per_s > 0
    # rank 0 counted the tokens of the run's 40 steps (token_census) and the rate was moved to them
    assert result.step_tokens is not None and result.step_tokens[1] > 0, result
    assert result.timed_tokens_per_s is not None and result.timed_tokens_per_s > 0
    assert said and said[0].startswith("rehearsing 4 steps of the run: local-a, local-b share this machine")
    # Its checkpoints (save_every 2) and events lived in dirs of its own: gone, with its local temp dir.
    for node in ("a", "b"):
        assert not (tmp_path / node / "runs" / "t-rehearse-rehearsal").exists()
    assert set(glob.glob(f"{tempfile.gettempdir()}/mlxc-rehearsal-*")) == temps
    failed = asyncio.run(go(broken, "t-broken"))
    assert isinstance(failed, str) and failed.startswith("the rehearsal did not finish"), failed
    for node in ("a", "b"):
        assert not (tmp_path / node / "runs" / "t-broken-rehearsal").exists()
    # A node it cannot prepare (its workdir lies under a file): said, never raised at the run.
    (tmp_path / "blocker").write_text("a file, not a dir")
    stuck = [replace(inv.nodes[0]), replace(inv.nodes[1], workdir=str(tmp_path / "blocker" / "b"))]

    async def unprepared() -> Rehearsal | str:
        async with Fleet(stuck) as fleet:
            return await rehearse(fleet, pb, stuck, plan, hostfile_for(inv, pb, {}), {}, run_id="t-stuck",
                                  layout=Layout(kind="dp"), sup=Supervision(), shared="x", steps=4,
                                  progress=said.append)

    cannot = asyncio.run(unprepared())
    assert isinstance(cannot, str) and cannot.startswith("the rehearsal could not start"), cannot
    assert set(glob.glob(f"{tempfile.gettempdir()}/mlxc-rehearsal-*")) == temps


def test_a_rehearsals_rate_leaves_its_compiling_first_steps_out() -> None:
    from coordinator.run.monitor import Monitor, PlannedRank

    mon = Monitor.create([PlannedRank(0, "a", 4), PlannedRank(1, "b", 4)], 16, now=0.0)
    # 16 steps: the first three trace the graphs (slow), the rest run at ~1,000 real tokens/s.
    mon.step_totals.update({s: (100.0 if s <= 3 else 1000.0 + s) for s in range(1, 17)})
    mon.step_rates.update({s: {0: 50.0, 1: 50.0} if s <= 3 else {0: 700.0, 1: 700.0 + s} for s in range(1, 17)})
    assert mon.run_tokens_per_s() == 1008.5  # the run's own statistic: every step
    assert mon.run_tokens_per_s(after=3) == 1010.0 and mon.run_compute_tokens_per_s(after=3) == 1410.0
    assert mon.run_tokens_per_s(after=16) is None


def test_a_rehearsals_rate_is_moved_to_the_tokens_of_the_runs_steps() -> None:
    """planning/steptime via read_rehearsal: the steps it timed carried more tokens than the run's will; a step's
    time is mostly fixed cost here, so the run's rate is predicted lower by about the tokens' ratio."""
    from coordinator.run.monitor import Monitor, PlannedRank, RunState
    from coordinator.run.rehearse import read_rehearsal

    mon = Monitor.create([PlannedRank(0, "a", 4), PlannedRank(1, "b", 4)], 16, now=0.0)
    # (tokens, seconds): 0.04 s fixed + 10 us a token; the first three steps compile (slow), left out
    work = {s: (300.0 + 10 * (s % 5), (2.0 if s <= 3 else 0.04 + 1e-5 * (300.0 + 10 * (s % 5)))) for s in range(1, 17)}
    mon.step_work.update(work)
    mon.step_totals.update({s: t / w for s, (t, w) in work.items()})
    mon.step_rates.update({s: {0: t / w, 1: t / w} for s, (t, w) in work.items()})
    mon.run_step_tokens = 200.0
    mon.outcome = lambda: RunState.SUCCEEDED  # type: ignore[method-assign]
    got = read_rehearsal(mon, steps=16, shared="a, b share this machine")
    assert isinstance(got, Rehearsal), got
    timed = got.timed_tokens_per_s
    assert timed == mon.run_tokens_per_s(after=3)
    assert got.step_tokens == (320.0, 200.0)
    assert got.tokens_per_s == pytest.approx(200.0 / (0.04 + 2e-3), rel=1e-6)  # the fit's rate at 200 tokens
    assert got.compute_tokens_per_s == pytest.approx(2 * timed * got.tokens_per_s / timed, rel=1e-6)
    assert "the run's carry 200: " in got.describe_tokens()
    mon.run_step_tokens = None  # not counted (DPO): the rehearsal's own rate
    plain = read_rehearsal(mon, steps=16, shared="x")
    assert isinstance(plain, Rehearsal) and plain.tokens_per_s == timed and plain.step_tokens is None


def test_a_rehearsal_reads_the_runs_census_and_its_own_compiling_steps_from_the_events() -> None:
    """Rank 0's `started` event carries the run's census (each step's tokens, the steps that meet a new batch
    shape) and each step event its `new_shape`: the monitor keeps both, and the rehearsal's prediction models the
    run's compiling steps (planning/steptime.py) instead of moving the rate by the median tokens alone."""
    from coordinator.planning.steptime import Census
    from coordinator.run.monitor import Monitor, Observation, PlannedRank, RunState
    from coordinator.run.rehearse import read_rehearsal

    def ev(node: str, rank: int, at: float, **data: object) -> Observation:
        return Observation("event", node, at, rank, {"rank": rank, **data})

    mon = Monitor.create([PlannedRank(0, "a", 4), PlannedRank(1, "b", 4)], 16, now=0.0)
    run_tokens = [300, 150, 160, 170, 140, 310, 150, 165, 155, 145, 320, 150] * 3
    mon.observe(ev("a", 0, 0.1, event="started", pid=10, step_tokens_median=157.5, census_tokens=run_tokens,
                   census_new_shape=[0, 5, 10, 17, 29]))
    mon.observe(ev("b", 1, 0.1, event="started", pid=11))
    assert mon.run_census == Census(tuple(float(t) for t in run_tokens), frozenset({0, 5, 10, 17, 29}))
    for step in range(1, 17):  # the run's first 16 steps: 0.05 s, 0.15 s where one rank met a new shape
        tokens = run_tokens[step - 1]
        compiled = step - 1 in {0, 5, 10}
        for rank, node in ((0, "a"), (1, "b")):
            mon.observe(ev(node, rank, float(step), event="step", step=step, loss=1.0, tok_s=1.0, total_tokens=tokens,
                           step_time_s=0.15 if compiled else 0.05, new_shape=compiled and rank == 1))
    assert mon.compiling_steps == {1, 6, 11}
    mon.outcome = lambda: RunState.SUCCEEDED  # type: ignore[method-assign]
    got = read_rehearsal(mon, steps=16, shared="a, b share this machine")
    assert isinstance(got, Rehearsal), got
    # steps 4-16 timed: fixed cost 0.05 s, compiles +0.10 s; the run's 36 steps, five of them compiling
    modelled = sorted(t / (0.05 + (0.10 if i in {0, 5, 10, 17, 29} else 0.0)) for i, t in enumerate(run_tokens))
    assert got.tokens_per_s == pytest.approx((modelled[17] + modelled[18]) / 2, rel=1e-6)
