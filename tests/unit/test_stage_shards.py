"""A pipeline checkpoint as a whole (`worker.parallel.pipeline.shards`): the manifest, when a step counts, and the re-cut
of a checkpoint onto another split. Values in, values out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker.errors import ResumeRefused
from worker.parallel.pipeline.shards import (
    MANIFEST_KEY,
    Manifest,
    StageEntry,
    build_manifest,
    evaluate_steps,
    parse_manifest,
    parse_shard,
    plan_recut,
)

SPLIT_2 = [(0, 2, "a" * 64, "b" * 64), (2, 6, "c" * 64, "d" * 64)]


def state(step: int, index: int, stages: list[tuple[int, int, str, str]] = SPLIT_2, position: int = 8,
          layers: int = 6) -> dict[str, Any]:
    first, last = stages[index][:2]
    return {"step": step, "data_position": position,
            "stage": {"index": index, "stages": len(stages), "first_layer": first, "last_layer": last,
                      "model_layers": layers},
            MANIFEST_KEY: build_manifest(step, position, layers, stages).to_json()}


def shard(step: int, index: int, valid: bool = True, **kw: Any) -> Any:
    return parse_shard(Path(f"/ck/stage-{index}/step-{step:06d}"), step, state(step, index, **kw), valid,
                       "" if valid else "weights.safetensors: sha256 mismatch")


def test_the_manifest_round_trips_and_must_tile_the_model() -> None:
    m = build_manifest(3, 12, 6, SPLIT_2)
    assert parse_manifest(m.to_json(), 3, 12) == m
    assert m.stages[1] == StageEntry(1, 2, 6, "c" * 64, "d" * 64)
    with pytest.raises(ValueError, match="expected to start at 2"):
        build_manifest(3, 12, 6, [(0, 2, "", ""), (3, 6, "", "")])
    with pytest.raises(ValueError, match="model has 7"):
        build_manifest(3, 12, 7, SPLIT_2)
    with pytest.raises(ValueError, match="malformed"):
        parse_manifest({"stages": [{"index": 0}]}, 3, 12)


def test_a_step_counts_only_with_a_valid_shard_of_every_stage() -> None:
    verdicts = evaluate_steps([shard(2, 0), shard(2, 1), shard(3, 0), shard(3, 1, valid=False), shard(4, 0)])
    assert [(v.step, v.complete) for v in verdicts] == [(4, False), (3, False), (2, True)]
    assert "no valid shard of stage 1 (layers [2, 6))" in verdicts[0].missing
    assert "sha256 mismatch" in verdicts[1].missing
    assert [s.index for s in verdicts[2].shards] == [0, 1]
    assert verdicts[2].manifest == Manifest(2, 8, 6, tuple(StageEntry(i, *e) for i, e in enumerate(SPLIT_2)))


def test_shards_of_one_step_from_different_splits_or_positions_do_not_make_a_checkpoint() -> None:
    split_3 = [(0, 1, "e" * 64, "f" * 64), (1, 4, "g" * 64, "h" * 64), (4, 6, "i" * 64, "j" * 64)]
    mixed = [shard(5, 0), shard(5, 1, stages=split_3), shard(5, 2, stages=split_3)]
    [verdict] = evaluate_steps(mixed)
    assert not verdict.complete
    # ... but a copy of the missing stage from the same attempt completes it, whatever dir it was found in.
    [verdict] = evaluate_steps([*mixed, shard(5, 0, stages=split_3)])
    assert verdict.complete and verdict.manifest is not None and len(verdict.manifest.stages) == 3
    [verdict] = evaluate_steps([shard(5, 0), shard(5, 1, position=12)])
    assert not verdict.complete


def test_a_shard_whose_state_disagrees_with_its_manifest_is_invalid() -> None:
    doc = state(2, 1)
    doc["stage"]["first_layer"] = 1
    assert "its manifest says [2, 6)" in parse_shard(Path("/x"), 2, doc, True).reason
    assert "state.json is of step 2" in parse_shard(Path("/x"), 3, state(2, 1), True).reason
    old = state(2, 1)
    del old[MANIFEST_KEY]  # a shard written before manifests existed: never resumed from
    assert not parse_shard(Path("/x"), 2, old, True).valid


def names(layers: range, *outside: str) -> frozenset[str]:
    return frozenset([*(f"model.layers.{i}.mlp.weight" for i in layers), *outside])


OLD = [(StageEntry(0, 0, 2, "", ""), names(range(0, 2), "model.embed_tokens.weight", "step")),
       (StageEntry(1, 2, 6, "", ""), names(range(2, 6), "model.norm.weight", "lm_head.weight",
                                             "model.embed_tokens.weight", "step"))]


def test_a_new_split_takes_each_layer_from_the_shard_that_holds_it() -> None:
    # New 3-stage split [0, 1), [1, 4), [4, 6) over the old [0, 2), [2, 6) (tied embeddings: both old stages
    # hold a copy; the new first stage takes the old first's, the new last the old last's).
    first = plan_recut(names(range(0, 1), "model.embed_tokens.weight", "step"), is_first=True, is_last=False,
                       sources=OLD, stages=2, what="t")
    assert first == {"model.layers.0.mlp.weight": 0, "model.embed_tokens.weight": 0, "step": 0}
    middle = plan_recut(names(range(1, 4), "step"), is_first=False, is_last=False, sources=OLD, stages=2, what="t")
    assert middle == {"model.layers.1.mlp.weight": 0, "model.layers.2.mlp.weight": 1,
                      "model.layers.3.mlp.weight": 1, "step": 0}
    last = plan_recut(names(range(4, 6), "model.embed_tokens.weight", "lm_head.weight"), is_first=False,
                      is_last=True, sources=OLD, stages=2, what="t")
    assert set(last.values()) == {1}


def test_a_layer_without_a_valid_copy_is_refused_by_name() -> None:
    with pytest.raises(ResumeRefused, match=r"resuming stage 1: no valid shard holds layers \[2, 3\] "
                                            r"\(e.g. model.layers.2.mlp.weight\); the shards found hold stage 0"):
        plan_recut(names(range(1, 4)), is_first=False, is_last=False, sources=OLD[:1], stages=2,
                   what="resuming stage 1")


# --- pruning the shards of other stages (a resume's copies, an earlier split's) ----------------------------------


def test_other_shards_are_pruned_by_the_runs_rule_over_whole_steps(tmp_path: Path) -> None:
    from worker.parallel.pipeline.shards import compute_shard_prune, prune_other_shards

    a, b = tmp_path / "a", tmp_path / "b"
    shards = [(8, a / "8"), (6, a / "6"), (4, b / "4"), (4, a / "4"), (2, b / "2"), (9, b / "9")]
    # keep 2 after step 8 is complete: steps 8 and 6 stay whole, 4 and 2 go (every shard of theirs); 9 is newer
    assert compute_shard_prune(shards, 2, 8) == [b / "4", a / "4", b / "2"]
    assert compute_shard_prune(shards, 3, 8) == [b / "2"]  # step 4 is in the window: both its shards stay
    assert compute_shard_prune(shards, 1, 8) == [a / "6", b / "4", a / "4", b / "2"]
    with pytest.raises(ValueError):
        compute_shard_prune(shards, 0, 8)

    checkpoints = tmp_path / "checkpoints"
    own = checkpoints / "stage-0"
    for d in ("stage-0/step-000006", "stage-0/step-000008", "stage-1-from-n-b/step-000004",
              "stage-2/step-000002", "stage-2/step-000004", "stage-2/step-000004.invalid-sha256-mismatch"):
        (checkpoints / d).mkdir(parents=True)
    (checkpoints / "stage-2" / "latest").write_text("step-000004\n")
    assert prune_other_shards(checkpoints, own, 2, 9) == []  # its own shard of step 9 is not there: nothing
    assert prune_other_shards(checkpoints, own, 3, 8) == [checkpoints / "stage-2/step-000002"]
    assert (checkpoints / "stage-1-from-n-b/step-000004").is_dir()
    removed = prune_other_shards(checkpoints, own, 2, 8)
    assert sorted(removed) == [checkpoints / "stage-1-from-n-b/step-000004", checkpoints / "stage-2/step-000004"]
    # The emptied copy dir goes; the earlier split's dir keeps its set-aside shard and `latest`; its own is untouched.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["stage-0", "stage-2"]
    assert sorted(p.name for p in (checkpoints / "stage-2").iterdir()) == [
        "latest", "step-000004.invalid-sha256-mismatch"]
    assert sorted(p.name for p in own.iterdir()) == ["step-000006", "step-000008"]
