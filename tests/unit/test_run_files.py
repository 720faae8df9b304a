"""Run ids, the nodes' temp dirs and the run dir's files: what `launch` makes private, and what it refuses.

The temp dir's node-side checks are in tests/unit/test_privatedir.py; another user's dir in /tmp is tested on the
bed (tests/integration/test_private_tmp.py).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config.playbook import parse_playbook
from coordinator.config.yamlsrc import MAX_NAME_LENGTH
from coordinator.errors import ConfigError
from coordinator.fleet.transport import Fleet
from coordinator.models import Connection, Node
from coordinator.planning.hostfile import Hostfile
from coordinator.run.job import make_run_dir
from coordinator.run.launch import Launch, write_private
from coordinator.run.launchfiles import (
    MAX_RUN_ID_LENGTH,
    RankPlan,
    build_rank_teardown,
    build_tmp_cleanup,
    check_run_id,
    new_run_id,
    remote_tmp_dir,
)
from coordinator.run.rundir import PlanRecord

EMPTY_PLAN = PlanRecord(split={}, batch={}, global_batch=0, mode="equal", predicted_tokens_per_s=None,
                        backend="ring", attempt=1)


def test_the_longest_playbook_name_makes_a_run_id_and_temp_dir_that_fit_a_file_name() -> None:
    run_id = new_run_id("n" * MAX_NAME_LENGTH)
    assert len(run_id) <= MAX_RUN_ID_LENGTH
    assert check_run_id(run_id) == run_id
    assert len(os.path.basename(remote_tmp_dir(run_id, secrets.token_hex(8)))) <= 255


@pytest.mark.parametrize(("run_id", "message"), [
    ("../etc", "not a run id"),
    ("a/b", "not a run id"),
    ("..", "not a run id"),
    ("x y", "not a run id"),
    ("$(touch /tmp/pwned)", "not a run id"),
    ("", "not a run id"),
    ("r" * (MAX_RUN_ID_LENGTH + 1), f"a run id of {MAX_RUN_ID_LENGTH + 1} characters; at most {MAX_RUN_ID_LENGTH}"),
])
def test_a_run_id_from_the_user_is_checked(run_id: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_run_id(run_id, what="--resume")


def _launch(tmp_path: Path) -> Launch:
    node = Node("a", "127.0.0.1", Connection.LOCAL, workdir=str(tmp_path / "w"))
    pb = parse_playbook({"name": "t", "model": "/m", "data": "/d"}, path="pb.yaml").model_copy(update={"path": None})
    return Launch(Fleet([node]), pb, [RankPlan(0, node, 4)], Hostfile("ring", ()), {}, run_id="t-1",
                  run_dir=tmp_path / "runs" / "t-1")


def test_each_attempt_gets_its_own_unguessable_temp_dir(tmp_path: Path) -> None:
    """Same path on every node of an attempt (one Launch), a new random one for the next attempt."""
    first, second = _launch(tmp_path).remote_tmp, _launch(tmp_path).remote_tmp
    assert re.fullmatch(r"/tmp/mlxc-t-1-[0-9a-f]{16}", first) and first != second


def test_run_dir_files_are_private(tmp_path: Path) -> None:
    launch = _launch(tmp_path)
    old = os.umask(0)
    try:
        make_run_dir(launch.run_dir, tmp_path / "runs")
        launch.write_local_files(EMPTY_PLAN)
        launch.write_meta()
    finally:
        os.umask(old)
    assert stat.S_IMODE(launch.run_dir.stat().st_mode) == 0o700
    modes = {p.relative_to(launch.run_dir).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in launch.run_dir.rglob("*")}
    assert modes.pop("bin") == 0o700 and modes.pop("bin/ssh") == 0o700
    assert modes and set(modes.values()) == {0o600}, modes
    assert {"hostfile.json", "ssh_config", "plan.json", "meta.json", "events.jsonl", "launcher.log"} <= set(modes)


def test_write_private_replaces_atomically_and_keeps_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "meta.json"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_a_resumed_run_dir_is_tightened_and_one_that_cannot_be_made_is_a_usage_error(tmp_path: Path) -> None:
    old = tmp_path / "runs" / "r1"
    old.mkdir(parents=True)
    old.chmod(0o755)
    make_run_dir(old, tmp_path / "runs")
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create the run dir .*file/runs/r1 \(Not a directory\)"):
        make_run_dir(tmp_path / "file" / "runs" / "r1", tmp_path / "file" / "runs")


def test_teardown_signals_a_reported_pid_only_while_it_is_still_a_rank_of_the_run(tmp_path: Path) -> None:
    """A rank's PID from `started` may belong to a stranger by teardown time (PIDs are reused): the stranger lives,
    the run's own ranks end, whether the command line or only the reported PID finds them."""
    run_dir = tmp_path / "runs" / "r1" / "h1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    rank = subprocess.Popen([*sleeper, "--config", f"{run_dir}/run.json"])
    hidden = subprocess.Popen([*sleeper, f"{run_dir}/"])  # no run.json in its command line: found by PID alone
    stranger = subprocess.Popen([*sleeper, str(tmp_path / "runs" / "r2" / "h1")])  # holds a stale, reused PID
    try:
        out = subprocess.run(["sh", "-c", build_rank_teardown(str(run_dir), "r1", [rank.pid, hidden.pid, stranger.pid])],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert rank.wait(timeout=10) != 0 and hidden.wait(timeout=10) != 0
        assert stranger.poll() is None
    finally:
        for proc in (rank, hidden, stranger):
            proc.kill()
            proc.wait()


def test_teardown_removes_only_the_runs_own_temp_dirs() -> None:
    """Every attempt's dir of THIS run that is a real dir of ours; not a symlink that matches, not other runs."""
    run_id = f"unit-{secrets.token_hex(6)}"
    ours = [Path(remote_tmp_dir(run_id, secrets.token_hex(8))) for _ in range(2)]
    other_run = Path(remote_tmp_dir(run_id + "x", secrets.token_hex(8)))
    keep = Path(f"/tmp/keep-{run_id}")
    link = Path(f"/tmp/mlxc-{run_id}-link")
    try:
        for d in (*ours, other_run, keep):
            d.mkdir(mode=0o700)
            (d / "rank").write_text("x")
        link.symlink_to(keep)
        out = subprocess.run(["sh", "-c", build_tmp_cleanup(run_id)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert not any(d.exists() for d in ours)
        assert other_run.is_dir() and link.is_symlink() and (keep / "rank").exists()
    finally:
        for d in (*ours, other_run, keep):
            subprocess.run(["rm", "-rf", str(d)], check=False)
        link.unlink(missing_ok=True)


def test_the_run_dirs_playbook_copy_is_redacted_and_still_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret in the playbook's env is blanked in the run dir's copy, which `status` and the dashboard read back
    as YAML (a bare `***` would be an alias there)."""
    import yaml

    import coordinator.run.launch
    from coordinator.run.logs import Redactor

    source = tmp_path / "pb.yaml"
    source.write_text("name: t\nmodel: /m\ndata: /d\nenv:\n  HF_TOKEN: hf_secretvalue123\n  PLAIN: ok\n")
    launch = _launch(tmp_path)
    launch.pb = parse_playbook(yaml.safe_load(source.read_text()), path=str(source))
    make_run_dir(launch.run_dir, tmp_path / "runs")
    monkeypatch.setattr(coordinator.run.launch, "current_redactor", lambda: Redactor(("hf_secretvalue123",)))
    launch.write_local_files(EMPTY_PLAN)
    copy = (launch.run_dir / "playbook.yaml").read_text()
    assert "hf_secretvalue123" not in copy
    assert yaml.safe_load(copy)["env"] == {"HF_TOKEN": "REDACTED", "PLAIN": "ok"}
