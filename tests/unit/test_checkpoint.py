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
    compute_prune,
    find_valid_checkpoint,
    invalid_name,
    list_checkpoints,
    main,
    parse_manifest,
    parse_step_dir,
    prune_checkpoints,
    read_latest,
    remove_stale_temporaries,
    scan_checkpoints,
    set_aside_invalid,
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
    # rewriting the same step (after resuming from 10) replaces the corrupt dir with a complete one; the corrupt
    # one is kept under a name nothing resumes from
    again = write_checkpoint(root, 20, files_for(20, 2.0), keep=3)  # type: ignore[arg-type]
    assert verify_checkpoint(again.path) == again.manifest_sha256
    assert not [p for p in root.iterdir() if ".old-" in p.name]
    assert (root / "step-000020.invalid-superseded").is_dir()
    assert [s for s, _ in list_checkpoints(root)] == [20, 10]


@pytest.mark.parametrize(("damage", "code"), [("no_manifest", "no-manifest"), ("extra_file", "unlisted-file"),
                                              ("missing_file", "missing-file"), ("bad_state_step", "step-mismatch"),
                                              ("bad_alias", "bad-alias")])
def test_other_damage_is_detected(tmp_path: Path, damage: str, code: str) -> None:
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
    with pytest.raises(CheckpointInvalid) as info:
        verify_checkpoint(p)
    assert info.value.code == code


def test_writer_lock(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    with writer_lock(root), pytest.raises(CheckpointError, match="share a node name"), writer_lock(root):
        pass
    with writer_lock(root):  # released again
        pass


# --- pruning: the newest valid checkpoint is never deleted, whatever else the directory holds --------------------


P = Path("/c")


def ckpts(*steps: int) -> list[tuple[int, Path]]:
    return [(s, P / step_dir_name(s)) for s in steps]


@pytest.mark.parametrize(("present", "keep", "newest", "doomed"), [
    ((30, 20, 10), 2, 30, [10]),        # the ordinary case: the new one plus keep-1 older ones
    ((30, 20, 10), 1, 30, [20, 10]),
    ((30, 20, 10), 5, 30, []),
    ((30, 20, 10), 1, 10, []),          # 30 and 20 are newer than what was just written: not this timeline's
    ((40, 30, 12, 10, 4), 2, 12, [4]),  # ... and they do not count towards keep
    ((12,), 1, 12, []),
])
def test_compute_prune_keeps_the_newest_and_never_counts_newer_dirs(present: tuple[int, ...], keep: int,
                                                                   newest: int, doomed: list[int]) -> None:
    assert compute_prune(ckpts(*present), keep, newest) == [P / step_dir_name(s) for s in doomed]


def test_compute_prune_rejects_keep_below_one() -> None:
    with pytest.raises(ValueError, match="keep"):
        compute_prune(ckpts(10), 0, 10)


def test_a_new_checkpoint_survives_invalid_newer_dirs_and_ignores_set_aside_ones(tmp_path: Path) -> None:
    # What made a restarted run fail on every node: invalid step-30 and step-40 left in place, so keep=1 pruning
    # deleted each new checkpoint right after it was written.
    root = tmp_path / "checkpoints"
    for step in (30, 40):
        (root / step_dir_name(step)).mkdir(parents=True)
        (root / step_dir_name(step) / WEIGHTS).write_bytes(b"garbage")
    aside = root / "step-000002.invalid-sha256-mismatch"
    aside.mkdir()
    (root / "set-aside-step-000001").mkdir()
    (root / "notes").mkdir()
    for step in (2, 4):
        ckpt = write_checkpoint(root, step, files_for(step), keep=1)  # type: ignore[arg-type]
        assert verify_checkpoint(ckpt.path) == ckpt.manifest_sha256
    assert [s for s, _ in list_checkpoints(root)] == [40, 30, 4]  # step 2 pruned (older), 4 kept, 30/40 untouched
    assert aside.is_dir() and (root / "set-aside-step-000001").is_dir() and (root / "notes").is_dir()
    assert read_latest(root) == root / "step-000004"


def test_prune_refuses_when_the_newest_is_missing(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10, files_for(10), keep=5)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="step-000020 is not there"):
        prune_checkpoints(root, 1, 20)
    assert [s for s, _ in list_checkpoints(root)] == [10]


# --- resume: scanning and setting aside -------------------------------------------------------------------------


def corrupt(path: Path) -> None:
    weights = path / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:10])


def test_scan_reports_invalid_ones_down_to_the_newest_valid(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        write_checkpoint(root, step, files_for(step), keep=5)  # type: ignore[arg-type]
    corrupt(root / "step-000030")
    (root / "step-000020" / MANIFEST).unlink()
    verdicts = scan_checkpoints(root)
    assert [(v.step, v.valid, v.code) for v in verdicts] == [(30, False, "sha256-mismatch"),
                                                            (20, False, "no-manifest"), (10, True, "")]
    assert scan_checkpoints(tmp_path / "nowhere") == []


def test_set_aside_renames_never_deletes_and_hides_from_discovery(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        write_checkpoint(root, step, files_for(step), keep=5)  # type: ignore[arg-type]
    corrupt(root / "step-000020")
    moved = set_aside_invalid(root, 20, "sha256-mismatch")
    assert moved == root / "step-000020.invalid-sha256-mismatch" and (moved / WEIGHTS).exists()
    assert [s for s, _ in list_checkpoints(root)] == [10]
    assert not (root / "latest").exists()  # it named the dir set aside
    found = find_valid_checkpoint(root)
    assert found is not None and found.step == 10
    # a second invalid copy of the same step gets its own name; a code unfit for a name becomes "invalid"
    (root / "step-000020").mkdir()
    assert set_aside_invalid(root, 20, "sha256-mismatch").name == "step-000020.invalid-sha256-mismatch-2"
    assert invalid_name(5, "../x y") == "step-000005.invalid-invalid"
    with pytest.raises(CheckpointError):
        set_aside_invalid(root, 99, "x")


def test_command_line_scan_and_set_aside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 10, files_for(10), keep=5)  # type: ignore[arg-type]
    corrupt(root / "step-000010")
    assert main(["scan", str(root)]) == 0
    [item] = json.loads(capsys.readouterr().out)["checkpoints"]
    assert (item["step"], item["valid"], item["code"]) == (10, False, "sha256-mismatch") and item["sha256"] is None
    assert main(["set-aside", str(root), "step-000010:sha256-mismatch"]) == 0
    assert json.loads(capsys.readouterr().out)["moved"] == {"step-000010": str(root / "step-000010.invalid-sha256-mismatch")}
    with writer_lock(root):  # a live writer: nothing is moved
        (root / "step-000020").mkdir()
        assert main(["set-aside", str(root), "step-000020:x"]) == 1
    assert "lock held" in capsys.readouterr().err and (root / "step-000020").is_dir()
    assert main(["set-aside", str(root), "latest:x"]) == 1


def test_a_checkpoint_dir_removed_while_it_is_listed_lists_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A second pipeline rank on the node removes an emptied copy dir between this rank's check and its listing
    (a CI run's rank died of the FileNotFoundError)."""
    gone = tmp_path / "stage-1-from-n-b"
    real_is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda self: True if self == gone else real_is_dir(self))
    assert list_checkpoints(gone) == []

