"""The coordinator's resume decision for a pipeline run (`coordinator.run.resume.decide_pipeline_resume`): a
checkpoint counts when every stage of its manifest has a valid shard on SOME node; every node gets the shards it
lacks; otherwise a refusal naming what is missing. Values in, values out."""

from __future__ import annotations

import json

import pytest

from coordinator.run.resume import (
    ResumeRefused,
    ScanFailed,
    ShardCopy,
    ShardVerdict,
    decide_pipeline_resume,
    parse_shard_scan,
)


def shard(node: str, step: int, index: int, valid: bool = True, mid: str = "m1", stages: int = 2) -> ShardVerdict:
    return ShardVerdict(node, step, index, f"/r/{node}/checkpoints/stage-{index}/step-{step:06d}", valid,
                        "" if valid else "sha256 mismatch", stages, None, None, mid if valid else None)


def test_a_checkpoint_spread_over_the_nodes_counts_and_each_node_gets_what_it_lacks() -> None:
    scans = {"a": (shard("a", 4, 0), shard("a", 2, 0)), "b": (shard("b", 2, 1),), "c": ()}
    decision = decide_pipeline_resume(scans, restart_from_scratch=False)
    assert decision.step == 2  # step 4 lacks stage 1 everywhere
    assert [s.node for s in decision.shards] == ["a", "b"]
    assert decision.copies == (
        ShardCopy("b", "/r/b/checkpoints/stage-1/step-000002", "a", "stage-1-from-b"),
        ShardCopy("a", "/r/a/checkpoints/stage-0/step-000002", "b", "stage-0-from-a"),
        ShardCopy("a", "/r/a/checkpoints/stage-0/step-000002", "c", "stage-0-from-a"),
        ShardCopy("b", "/r/b/checkpoints/stage-1/step-000002", "c", "stage-1-from-b"))


def test_shards_of_different_attempts_do_not_complete_each_other() -> None:
    scans = {"a": (shard("a", 3, 0, mid="x"),), "b": (shard("b", 3, 1, mid="y"),)}
    with pytest.raises(ResumeRefused, match=r"step 3: its valid shards belong to different checkpoints"):
        decide_pipeline_resume(scans, restart_from_scratch=False, run_id="r")


def test_a_missing_stage_is_refused_by_name_unless_restarting_from_scratch() -> None:
    scans = {"a": (shard("a", 2, 0),), "b": (shard("b", 2, 1, valid=False),), "c": ScanFailed("c", "timed out")}
    with pytest.raises(ResumeRefused) as err:
        decide_pipeline_resume(scans, restart_from_scratch=False, run_id="r")
    text = str(err.value)
    assert "step 2: no valid shard of stage(s) [1] on any node (b:/r/b/checkpoints/stage-1/step-000002: sha256" \
           in text and "c: could not list shards: timed out" in text
    assert decide_pipeline_resume(scans, restart_from_scratch=True).from_scratch
    fresh = decide_pipeline_resume({"a": (), "b": ()}, restart_from_scratch=False)
    assert fresh.step is None and not fresh.copies and not fresh.from_scratch


def test_the_scan_output_parses_or_is_a_failure() -> None:
    doc = {"root": "/r", "shards": [{"step": 2, "index": 1, "path": "/p", "valid": True, "reason": "", "stages": 2,
                                     "first_layer": 2, "last_layer": 6, "manifest_id": "m"}]}
    [got] = parse_shard_scan("a", "noise\n" + json.dumps(doc))  # type: ignore[misc]
    assert got == ShardVerdict("a", 2, 1, "/p", True, "", 2, 2, 6, "m")
    assert isinstance(parse_shard_scan("a", "Traceback ..."), ScanFailed)


def test_a_shard_of_a_rank_node_is_copied_under_a_flat_name() -> None:
    """fsdp over the GPUs of one machine: rank nodes `box/gpu0`, `box/gpu1` each hold one shard; each gets the other's
    as a direct child of its checkpoints dir (a `/` in the name would nest it where no scan looks)."""
    scans = {"box/gpu0": (shard("box/gpu0", 4, 0),), "box/gpu1": (shard("box/gpu1", 4, 1),)}
    decision = decide_pipeline_resume(scans, restart_from_scratch=False)
    assert [c.dir_name for c in decision.copies] == ["stage-1-from-box-gpu1", "stage-0-from-box-gpu0"]


def test_a_left_out_gpus_shard_is_read_but_nothing_is_copied_to_it() -> None:
    """A relaunch on box/gpu0 after box/gpu1's rank died: gpu1's run dir (same machine) is a source only."""
    scans = {"box/gpu0": (shard("box/gpu0", 4, 0),), "box/gpu1": (shard("box/gpu1", 4, 1),)}
    decision = decide_pipeline_resume(scans, restart_from_scratch=False, receivers=["box/gpu0"])
    assert decision.step == 4 and [(c.source, c.dest) for c in decision.copies] == [("box/gpu1", "box/gpu0")]
