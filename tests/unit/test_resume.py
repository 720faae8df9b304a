"""coordinator.run.resume: the resume decision from every node's checkpoint scan (pure: scans in, decision out)."""

from __future__ import annotations

import json

import pytest

from coordinator.run.resume import CheckpointVerdict, ResumeRefused, ScanFailed, decide_resume, parse_scan


def ok(node: str, step: int) -> CheckpointVerdict:
    return CheckpointVerdict(node, step, f"/w/runs/r/{node}/checkpoints/step-{step:06d}", True)


def bad(node: str, step: int, reason: str = "weights.safetensors: sha256 ab... != manifest cd...") -> CheckpointVerdict:
    return CheckpointVerdict(node, step, f"/w/runs/r/{node}/checkpoints/step-{step:06d}", False, reason,
                             "sha256-mismatch")


def test_resumes_from_the_newest_valid_step_any_node_has_and_sets_every_invalid_one_aside() -> None:
    scans = {"a": (bad("a", 30), ok("a", 20)), "b": (bad("b", 30), bad("b", 20), ok("b", 10))}
    decision = decide_resume(scans, restart_from_scratch=False)
    assert decision.step == 20 and decision.checkpoint == ok("a", 20)
    assert {(v.node, v.step) for v in decision.set_aside} == {("a", 30), ("b", 30), ("b", 20)}
    assert decision.describe().startswith("resumed from step 20 (checkpoint a:/w/runs/r/a/checkpoints/step-000020)")
    assert decision.to_json()["step"] == 20 and not decision.to_json()["from_scratch"]


def test_ties_go_to_the_first_node() -> None:
    decision = decide_resume({"a": (ok("a", 20),), "b": (ok("b", 20),)}, restart_from_scratch=False)
    assert decision.checkpoint is not None and decision.checkpoint.node == "a"


def test_no_checkpoint_anywhere_starts_at_step_zero() -> None:
    decision = decide_resume({"a": (), "b": ()}, restart_from_scratch=False)
    assert (decision.step, decision.checkpoint, decision.set_aside) == (None, None, ())
    assert "step 0" in decision.describe() and decision.to_json()["step"] == 0


def test_only_invalid_checkpoints_refuse_naming_each_one_and_why() -> None:
    scans = {"a": (bad("a", 6), bad("a", 4, "manifest.sha256 missing")), "b": (bad("b", 6),)}
    with pytest.raises(ResumeRefused) as info:
        decide_resume(scans, restart_from_scratch=False, run_id="r")
    text = str(info.value)
    assert info.value.exit_code == 1
    for v in (*scans["a"], *scans["b"]):
        assert f"{v.node}: {v.path}: {v.reason}" in text
    assert "--restart-from-scratch" in text and "--resume r" in text


def test_a_node_that_could_not_be_listed_is_no_proof_of_nothing() -> None:
    with pytest.raises(ResumeRefused, match="b: could not list checkpoints: timed out"):
        decide_resume({"a": (), "b": ScanFailed("b", "timed out")}, restart_from_scratch=False)
    # ... but a valid checkpoint elsewhere is enough (the ranks agree on the newest any of them has)
    assert decide_resume({"a": (ok("a", 4),), "b": ScanFailed("b", "x")}, restart_from_scratch=False).step == 4


def test_restart_from_scratch_sets_the_invalid_ones_aside_and_starts_at_zero() -> None:
    decision = decide_resume({"a": (bad("a", 6), bad("a", 4)), "b": ()}, restart_from_scratch=True)
    assert decision.step is None and decision.from_scratch and len(decision.set_aside) == 2
    assert "restarted from scratch" in decision.describe()
    # the flag changes nothing when there is something valid to resume from
    assert decide_resume({"a": (bad("a", 6), ok("a", 4))}, restart_from_scratch=True).step == 4


def test_parse_scan_reads_the_worker_output_and_names_garbage() -> None:
    line = json.dumps({"root": "/w", "checkpoints": [
        {"step": 6, "path": "/w/step-000006", "valid": False, "sha256": None, "reason": "x", "code": "bad-state"},
        {"step": 4, "path": "/w/step-000004", "valid": True, "sha256": "ab", "reason": "", "code": ""}]})
    scan = parse_scan("a", "noise\n" + line + "\n")
    assert scan == (CheckpointVerdict("a", 6, "/w/step-000006", False, "x", "bad-state"),
                    CheckpointVerdict("a", 4, "/w/step-000004", True))
    assert scan[0].dir_name == "step-000006"
    for garbage in ("", "not json", json.dumps({"root": "/w"}), json.dumps({"checkpoints": [{"step": "x"}]})):
        failed = parse_scan("a", garbage)
        assert isinstance(failed, ScanFailed) and failed.node == "a"
