"""coordinator/preflight/fix.py: launch --fix's decisions, "findings in, actions out".

The reports come from the real checks on the recorded node profiles (tests/unit/test_checks.py's fleet
builders), so a change to a check's remedy that would change what --fix does shows up here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from coordinator.errors import ConfigError, TransportError
from coordinator.models import LintResult, PreflightReport, Status
from coordinator.planning.sync import NodeState, compute_plan
from coordinator.preflight.fix import (
    DirState,
    FixOptions,
    FixPlan,
    FixTool,
    SyncSource,
    check_sync_source_before_setup,
    choose_sync_source,
    compute_fix_plan,
    compute_sync_outcomes,
    describe_fix_plan,
    describe_left,
    fix_options,
    fixable_by,
    parse_dir_states,
    resolve_requested,
)
from tests.factsutil import DATA_FILES, MODEL_FILES, STUDIO, hashes_answer, sha
from tests.unit.test_checks import MBP_M, STUDIO_M, M, member, playbook, preflight

RING = {"backend": "ring"}
THIRD = member("third", STUDIO, "192.168.10.3")


def fleet3(**changes: M) -> tuple[M, ...]:
    """mbp, studio and a second studio (`third`) on ring: three nodes, so a majority exists."""
    members = {"mbp": MBP_M, "studio": STUDIO_M, "third": THIRD, **changes}
    return tuple(members.values())


def hashes(**kw: Any) -> dict[str, object]:
    return {"hashes": hashes_answer(**kw)}


def test_a_passing_fleet_needs_nothing() -> None:
    report, _ = preflight(fleet3(), playbook(**RING))
    plan = compute_fix_plan(report)
    assert plan == FixPlan()
    assert not plan.fixes_anything and describe_fix_plan(plan) == "nothing to fix"


def test_a_node_without_its_python_gets_setup_and_its_other_findings_wait_for_it() -> None:
    gone = MBP_M.but(worker_text="python interpreter not found: /Users/me/venvs/mlx/bin/python", worker_rc=127)
    report, results = preflight(fleet3(mbp=gone), playbook(**RING))
    assert results[("mbp", "software")].status is Status.FAIL
    plan = compute_fix_plan(report)
    assert plan.setup == ("mbp",) and plan.sync == () and plan.unfixable == ()
    # Its model (no hashes without a python) is judged again after setup, not synced blind.
    assert {f.check for f in plan.deferred} >= {"model"} and {f.node for f in plan.deferred} == {"mbp"}
    assert describe_fix_plan(plan).startswith("setup on mbp; judged again after setup: model on mbp")


@pytest.mark.parametrize("worker", [
    pytest.param({"mlx": None}, id="mlx-missing"),
    pytest.param({"mlx": "0.30.0"}, id="mlx-too-old"),
    pytest.param({"mlx_lm": None}, id="mlx-lm-missing"),
])
def test_software_findings_of_the_nodes_python_are_setups(worker: dict[str, object]) -> None:
    report, results = preflight(fleet3(studio=STUDIO_M.but(worker=worker)), playbook(**RING))
    assert results[("studio", "software")].status is Status.FAIL
    assert compute_fix_plan(report).setup == ("studio",)


def test_versions_that_differ_from_the_playbook_pins_are_a_setup_on_every_such_node() -> None:
    report, _ = preflight(fleet3(), playbook(**RING, software={"mlx": "0.32.4", "mlx_lm": "0.32.2"}))
    assert compute_fix_plan(report).setup == ("mbp", "studio", "third")


def test_nccl_without_an_nvidia_gpu_is_not_setups_to_fix() -> None:
    report, results = preflight(fleet3(), playbook(backend="nccl"))
    assert results[("mbp", "software")].status is Status.FAIL
    assert "coordinator setup" not in results[("mbp", "software")].remedy
    plan = compute_fix_plan(report)
    assert plan.setup == () and ("software", "mbp") in {(f.check, f.node) for f in plan.unfixable}


def test_missing_stale_and_extra_files_are_syncs() -> None:
    stale = {**MODEL_FILES, "config.json": sha("old config")}
    extra = {**DATA_FILES, "more.jsonl": sha("extra")}
    # Four nodes: mbp and fourth agree (the majority), studio has a stale file, third an extra one.
    members = fleet3(studio=STUDIO_M.but(worker=hashes(model=stale)), third=THIRD.but(worker=hashes(data=extra)),
                     fourth=member("fourth", STUDIO, "192.168.10.4"))
    report, results = preflight(members, playbook(**RING))
    assert results[("studio", "model")].status is Status.FAIL and results[("third", "model")].status is Status.FAIL
    plan = compute_fix_plan(report)
    assert plan.sync == ("studio", "third") and plan.setup == () and plan.unfixable == ()
    # The source: mbp, whose copy is the majority's, not this machine's.
    source = choose_sync_source(report, plan.sync, requested=None, local_dirs=[("model", "/m"), ("data", "/d")],
                                local_present=True)
    assert source == SyncSource("its copy passed preflight's model check", node="mbp")


def test_no_copy_anywhere_syncs_from_this_machine_or_says_how_to_name_a_source() -> None:
    nothing = hashes(missing=["/Users/me/models/llama-1b", "/Users/me/data/chat"])
    members = tuple(m.but(worker=nothing) for m in fleet3())
    report, results = preflight(members, playbook(**RING))
    assert "is missing" in results[("mbp", "model")].summary
    plan = compute_fix_plan(report)
    assert plan.sync == ("mbp", "studio", "third")
    local = [("model", "/Users/me/models/llama-1b"), ("data", "/Users/me/data/chat")]
    here = choose_sync_source(report, plan.sync, requested=None, local_dirs=local, local_present=True)
    assert here.node is None and here.dirs == tuple(local)
    assert here.describe() == ("model /Users/me/models/llama-1b, data /Users/me/data/chat on this machine "
                               "(the playbook's paths on this machine)")
    with pytest.raises(ConfigError) as err:
        choose_sync_source(report, plan.sync, requested=None, local_dirs=local, local_present=False)
    assert str(err.value) == ("--fix: no source for sync: no node has a copy that passes the model check, and this "
                              "machine lacks /Users/me/models/llama-1b, /Users/me/data/chat; name one with "
                              "--fix-source NODE or --fix-source DIR (holding model/, data/)")
    named = SyncSource("--fix-source", node="studio")
    assert choose_sync_source(report, plan.sync, requested=named, local_dirs=local, local_present=True) == named


LOCAL = [("model", "/Users/me/models/llama-1b"), ("data", "/Users/me/data/chat")]
GONE = "python interpreter not found: /Users/me/venvs/mlx/bin/python"
FILES = {"model": DirState.FILES, "data": DirState.FILES}


def before_setup(report: PreflightReport, plan: FixPlan, node_dirs: dict[str, dict[str, DirState] | None], *,
                 provided: tuple[str, ...] = (), requested: SyncSource | None = None, local: bool = False) -> None:
    check_sync_source_before_setup(report, plan, requested=requested, local_dirs=LOCAL, local_present=local,
                                   node_dirs=node_dirs, provided=provided)


def test_without_any_possible_source_fix_refuses_before_setup_changes_a_node() -> None:
    """Every node lacks its python (setup) and its model dir (seen with python3): sync will be needed after
    setup, and nothing can be its source. Refused now, not after setup installed everything."""
    members = tuple(m.but(worker_text=GONE, worker_rc=127) for m in fleet3())
    report, _ = preflight(members, playbook(**RING))
    plan = compute_fix_plan(report)
    assert plan.setup == ("mbp", "studio", "third") and plan.sync == ()
    bare = {"model": DirState.MISSING, "data": DirState.FILES}
    with pytest.raises(ConfigError) as err:
        before_setup(report, plan, {"mbp": bare, "studio": bare, "third": bare})
    assert str(err.value).startswith("--fix: no source for sync (checked before setup changed any node): no node "
                                     "has a copy that passes the model check, and this machine lacks ")
    # ... and what makes a source possible lets setup go on: a node that will have every dir (sync may then
    # not even be needed), a dir assets: fill, a node not seen (never refused on a guess), a named source, the
    # playbook's dirs on this machine.
    before_setup(report, plan, {"mbp": bare, "studio": FILES, "third": bare})
    before_setup(report, plan, {"mbp": bare, "studio": bare, "third": bare}, provided=("model",))
    before_setup(report, plan, {"mbp": bare, "studio": None, "third": bare})
    before_setup(report, plan, {"mbp": bare, "studio": bare, "third": bare}, requested=SyncSource("x", node="mbp"))
    before_setup(report, plan, {"mbp": bare, "studio": bare, "third": bare}, local=True)
    # assets: never fill an existing empty dir
    empty = {"model": DirState.EMPTY, "data": DirState.FILES}
    with pytest.raises(ConfigError):
        before_setup(report, plan, {"mbp": empty, "studio": empty, "third": empty}, provided=("model",))


def test_a_sync_planned_now_needs_a_source_before_setup_runs_elsewhere() -> None:
    """studio needs setup; mbp and third (with their python) have no model: they need sync whatever setup does,
    and studio, once set up, would be their only possible source."""
    nothing = hashes(missing=["/Users/me/models/llama-1b", "/Users/me/data/chat"])
    members = fleet3(mbp=MBP_M.but(worker=nothing), studio=STUDIO_M.but(worker_text=GONE, worker_rc=127),
                     third=THIRD.but(worker=nothing))
    report, _ = preflight(members, playbook(**RING))
    plan = compute_fix_plan(report)
    assert plan.setup == ("studio",) and plan.sync == ("mbp", "third")
    with pytest.raises(ConfigError, match="checked before setup changed any node"):
        before_setup(report, plan, {"studio": {"model": DirState.EMPTY, "data": DirState.FILES}})
    before_setup(report, plan, {"studio": FILES})


@pytest.mark.parametrize(("answer", "states"), [
    ({"model": "files", "data": "missing"}, {"model": DirState.FILES, "data": DirState.MISSING}),
    ({"model": "what"}, None), (None, None),
])
def test_parse_dir_states(answer: dict[str, str] | None, states: dict[str, DirState] | None) -> None:
    assert parse_dir_states(answer) == states


def test_copies_that_disagree_without_a_majority_need_a_named_source() -> None:
    other = {**MODEL_FILES, "config.json": sha("other config")}
    members = (MBP_M, STUDIO_M.but(worker=hashes(model=other)))
    report, results = preflight(members, playbook(**RING))
    assert "no majority" in results[("mbp", "model")].summary
    plan = compute_fix_plan(report)
    assert plan.sync == () and {(f.check, f.node) for f in plan.unfixable} == {("model", "mbp"), ("model", "studio")}
    assert compute_fix_plan(report, source_named=True).sync == ("mbp", "studio")


def test_files_every_node_has_alike_but_cannot_load_are_left_alone_even_with_a_source() -> None:
    bad = {"data": {"dir": "/Users/me/data/chat", "error": None, "files": [
        {"name": "train.jsonl", "required": True, "exists": True, "rows": 3, "bytes": 90, "checked_bytes": 90,
         "format": None, "error": "line 2: not JSON"}]}}
    members = tuple(m.but(worker=bad) for m in fleet3())
    report, results = preflight(members, playbook(**RING))
    assert results[("mbp", "model")].status is Status.FAIL and "not JSON" in results[("mbp", "model")].summary
    for named in (False, True):
        plan = compute_fix_plan(report, source_named=named)
        assert plan.sync == () and [f.check for f in plan.unfixable] == ["model"] * 3


def test_unreachable_nodes_and_lint_failures_are_reported_not_fixed() -> None:
    down = TransportError("third", "connection refused", kind="connect")
    report, _ = preflight(fleet3(), playbook(**RING), connect={"third": down},
                          lint=[LintResult("save_every", Status.FAIL, "save_every 0", "set it")])
    plan = compute_fix_plan(report)
    assert not plan.fixes_anything
    assert ("ssh", "third") in {(f.check, f.node) for f in plan.unfixable}
    assert ("lint:save_every", "playbook") in {(f.check, f.node) for f in plan.unfixable}
    json.dumps(plan.to_json())
    assert "cannot fix: " in describe_fix_plan(plan) and "ssh on third" in describe_left(plan)


def test_describe_left_names_what_the_tools_did_not_fix() -> None:
    assert describe_left(FixPlan(setup=("a",), sync=("b",))) == ("software on a (setup did not fix it), "
                                                                   "model on b (sync did not fix it)")
    assert FixPlan(setup=("a",), sync=("b",)).nodes(FixTool.SYNC) == ("b",)


def test_fixable_by_ignores_passes_and_warnings() -> None:
    # studio's python minor differs (a warning on every node's software check), third lacks mlx (a failure).
    members = fleet3(studio=STUDIO_M.but(worker={"version": "3.11.9"}), third=THIRD.but(worker={"mlx": None}))
    report, _ = preflight(members, playbook(**RING))
    verdicts = {(c.node, c.id): (c.status, fixable_by(c, source_named=True)) for _, cs in report.nodes for c in cs}
    assert verdicts[("mbp", "software")] == (Status.WARN, None)
    assert verdicts[("third", "software")] == (Status.FAIL, FixTool.SETUP)
    assert all(tool is None for status, tool in verdicts.values() if status is not Status.FAIL)


def test_requested_source_is_a_node_name_else_a_dir_with_one_subdir_per_synced_dir() -> None:
    assert resolve_requested("h2", ["h1", "h2"], ["model", "data"], {}, "h2") == SyncSource("--fix-source", node="h2")
    src = resolve_requested("/src/", ["h1"], ["model", "data"], {"model": True, "data": True}, "/src/")
    assert src.dirs == (("model", "/src/model"), ("data", "/src/data"))
    with pytest.raises(ConfigError, match=r"^--fix-source /src: not a node of the inventory, and not a dir holding "
                                          r"model/, data/ \(lacks data/\)$"):
        resolve_requested("/src", ["h1"], ["model", "data"], {"model": True}, "/src")


def test_fix_options() -> None:
    assert fix_options(False, None) is None
    assert fix_options(True, None) == FixOptions()
    assert fix_options(True, "h1") == FixOptions("h1")
    with pytest.raises(ConfigError, match=r"^--fix-source goes with --fix$"):
        fix_options(False, "h1")


A, B = "a" * 64, "b" * 64
SOURCE = {"model/w.bin": (2_000_000, A), "data/train.jsonl": (50, B)}


def state(node: str, manifest: dict[str, tuple[int, str]] | None = None) -> NodeState:
    return NodeState(node, manifest or {}, {}, {"model": 10**12, "data": 10**12}, {"model": 1, "data": 1})


def test_sync_outcomes_in_ansible_words() -> None:
    plan = compute_plan("src", SOURCE, [state("same", dict(SOURCE)), state("empty"), state("bad"), state("gone")])
    out = compute_sync_outcomes(plan, {"gone": "gone: relay did not start"}, {"same": [], "empty": [],
                                "bad": ["differs or missing: model/w.bin"]}, ["same", "empty", "bad", "gone", "x"])
    assert out == {
        "same": ("ok", "identical already"),
        "empty": ("changed", "copied 2 file(s) (2.0 MB), deleted 0, verified identical"),
        "bad": ("failed", "still differs: differs or missing: model/w.bin"),
        "gone": ("failed", "gone: relay did not start"),
        "x": ("failed", "no manifest from the node"),
    }


def test_sync_outcomes_fail_every_node_on_a_plan_problem() -> None:
    tiny = NodeState("small", {}, {}, {"model": 10, "data": 10}, {"model": 1, "data": 1})
    plan = compute_plan("src", SOURCE, [tiny])
    assert plan.problems
    out = compute_sync_outcomes(plan, {}, {}, ["small"])
    assert out["small"][0] == "failed" and "not enough free disk space" in out["small"][1]


def test_a_launch_refused_after_fix_names_what_fix_could_not_fix() -> None:
    from coordinator.run.job import PreflightFailed

    down = TransportError("third", "connection refused", kind="connect")
    report, _ = preflight(fleet3(), playbook(**RING), connect={"third": down})
    left = replace(compute_fix_plan(report), sync=("studio",))
    assert str(PreflightFailed(report, left)) == (
        "preflight failed on third: --fix could not fix ssh on third, model on studio (sync did not fix it); fix the "
        "findings above (or --skip-preflight)")
    assert str(PreflightFailed(report)) == "preflight failed on third: fix the findings above (or --skip-preflight)"
