"""worker.checkpoint: atomic writes, verification, discovery, pruning (in-process, no MLX training)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

from worker.checkpoint import (
    ADAPTER_ALIAS,
    ADAPTER_CONFIG,
    MANIFEST,
    OPTIMIZER,
    STATE,
    WEIGHTS,
    CheckpointError,
    CheckpointInvalid,
    build_manifest,
    discard_newer,
    find_valid_checkpoint,
    list_checkpoints,
    parse_manifest,
    parse_step_dir,
    read_latest,
    remove_stale_temporaries,
    step_dir_name,
    verify_checkpoint,
    write_checkpoint,
    writer_lock,
)
from worker.tensorfile import sha256_file, write_safetensors


def files_for(step: int, value: float = 1.0) -> dict[str, object]:
    weights = {"layers.0.lora_a": mx.full((4, 2), value), "layers.0.lora_b": mx.zeros((2, 4))}
    opt = {"step": mx.array(step, mx.uint64), "learning_rate": mx.array(1e-3), "layers.0.lora_a.m": mx.ones((4, 2))}
    state = json.dumps({"step": step, "data_position": 4 * step}).encode()
    return {
        WEIGHTS: lambda p: write_safetensors(p, weights),
        OPTIMIZER: lambda p: write_safetensors(p, opt),
        STATE: lambda p: p.write_bytes(state),
        ADAPTER_CONFIG: lambda p: p.write_text('{"fine_tune_type": "lora"}'),
    }


def test_names_and_manifest_round_trip() -> None:
    assert step_dir_name(20) == "step-000020"
    assert parse_step_dir("step-000020") == 20
    assert parse_step_dir("step-000020.tmp-123") is None
    assert parse_step_dir("latest") is None
    entries = {"b.json": "0" * 64, "a.safetensors": "f" * 64}
    text = build_manifest(entries)
    assert text.splitlines()[0].endswith("  a.safetensors")  # sorted, sha256sum format
    assert parse_manifest(text) == entries
    for bad in ["", "xyz  a\n", f"{'0' * 64}  a\n{'1' * 64}  a\n", f"{'0' * 64}  ../a\n".replace("..", "x/..")]:
        with pytest.raises(CheckpointInvalid):
            parse_manifest(bad)


def test_write_verify_latest_and_layout(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    ckpt = write_checkpoint(root, 10, files_for(10), keep=2)  # type: ignore[arg-type]
    assert ckpt.path == root / "step-000010"
    assert sorted(p.name for p in ckpt.path.iterdir()) == sorted(
        [WEIGHTS, OPTIMIZER, STATE, ADAPTER_CONFIG, MANIFEST, ADAPTER_ALIAS])
    assert os.readlink(ckpt.path / ADAPTER_ALIAS) == WEIGHTS
    assert verify_checkpoint(ckpt.path) == ckpt.manifest_sha256 == sha256_file(ckpt.path / MANIFEST)
    assert read_latest(root) == ckpt.path
    # the manifest is checkable with coreutils' format: "<sha>  <name>"
    for line in (ckpt.path / MANIFEST).read_text().splitlines():
        sha, name = line.split("  ")
        assert sha256_file(ckpt.path / name) == sha
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_keep_prunes_oldest_only_after_the_new_one_exists(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        write_checkpoint(root, step, files_for(step), keep=2)  # type: ignore[arg-type]
    assert [s for s, _ in list_checkpoints(root)] == [30, 20]
    assert read_latest(root) == root / "step-000030"


def test_crash_mid_write_leaves_previous_checkpoint_intact(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    good = write_checkpoint(root, 10, files_for(10), keep=1)  # type: ignore[arg-type]

    def boom(path: Path) -> None:
        path.write_bytes(b"half a tensor")
        raise OSError("disk full (simulated)")

    broken = files_for(20)
    broken[OPTIMIZER] = boom
    with pytest.raises(OSError, match="simulated"):
        write_checkpoint(root, 20, broken, keep=1)  # type: ignore[arg-type]
    assert not (root / "step-000020").exists()
    assert [s for s, _ in list_checkpoints(root)] == [10]  # keep=1 did not prune the only good one
    assert read_latest(root) == good.path
    found = find_valid_checkpoint(root)
    assert found is not None and found.step == 10 and found.manifest_sha256 == good.manifest_sha256


def test_killed_writer_leftovers_are_invisible_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10, files_for(10), keep=2)  # type: ignore[arg-type]
    # What a SIGKILL between "write files" and "rename" leaves behind: a complete-looking tmp dir.
    leftover = root / "step-000020.tmp-99999"
    leftover.mkdir()
    (leftover / WEIGHTS).write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(root)] == [10]
    found = find_valid_checkpoint(root)
    assert found is not None and found.step == 10
    assert remove_stale_temporaries(root) == [leftover]
    assert not leftover.exists()


def test_truncated_file_fails_verification_and_discovery_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10, files_for(10), keep=3)  # type: ignore[arg-type]
    newest = write_checkpoint(root, 20, files_for(20, 2.0), keep=3)  # type: ignore[arg-type]
    weights = newest.path / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointInvalid, match="truncated or corrupt"):
        verify_checkpoint(newest.path)
    skipped: list[tuple[int, str]] = []
    found = find_valid_checkpoint(root, lambda step, _path, reason: skipped.append((step, reason)))
    assert found is not None and found.step == 10
    assert [s for s, _ in skipped] == [20] and "weights.safetensors" in skipped[0][1]
    # rewriting the same step (after resuming from 10) replaces the corrupt dir with a complete one
    again = write_checkpoint(root, 20, files_for(20, 2.0), keep=3)  # type: ignore[arg-type]
    assert verify_checkpoint(again.path) == again.manifest_sha256
    assert not [p for p in root.iterdir() if ".old-" in p.name]


@pytest.mark.parametrize("damage", ["no_manifest", "extra_file", "missing_file", "bad_state_step", "bad_alias"])
def test_other_damage_is_detected(tmp_path: Path, damage: str) -> None:
    ckpt = write_checkpoint(tmp_path / "c", 10, files_for(10), keep=1)  # type: ignore[arg-type]
    p = ckpt.path
    if damage == "no_manifest":
        (p / MANIFEST).unlink()
    elif damage == "extra_file":
        (p / "stray.bin").write_bytes(b"x")
    elif damage == "missing_file":
        (p / OPTIMIZER).unlink()
    elif damage == "bad_state_step":
        # consistent manifest, but the state says another step than the directory name
        (p / STATE).write_text(json.dumps({"step": 11}))
        entries = parse_manifest((p / MANIFEST).read_text())
        entries[STATE] = sha256_file(p / STATE)
        (p / MANIFEST).write_text(build_manifest(entries))
    elif damage == "bad_alias":
        (p / ADAPTER_ALIAS).unlink()
        os.symlink(OPTIMIZER, p / ADAPTER_ALIAS)
    with pytest.raises(CheckpointInvalid):
        verify_checkpoint(p)


def test_discard_newer_and_writer_lock(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        write_checkpoint(root, step, files_for(step), keep=5)  # type: ignore[arg-type]
    assert [p.name for p in discard_newer(root, 20)] == ["step-000030"]
    with writer_lock(root), pytest.raises(CheckpointError, match="share a node name"), writer_lock(root):
        pass
    with writer_lock(root):  # released again
        pass
