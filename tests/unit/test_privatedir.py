"""worker.privatedir: the run's temp dir on a node is made 0700 and used only when it is private to the SSH user.

The decisions are tables (mode, owner in; problem out); the I/O half runs on real directories under tmp_path.
Another user's dir needs root to make: tests/integration/test_private_tmp.py does that on the test bed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from worker.privatedir import PrivateDirError, dir_problem, ensure_private_dir, parent_problem, write_private_files

ME, OTHER = 501, 777  # the pure checks take the euid: any values do
DIR, FILE, LINK = stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK


@pytest.mark.parametrize(("mode", "uid", "problem"), [
    (DIR | 0o700, ME, None),
    (DIR | 0o700, OTHER, f"owned by uid {OTHER}, not by this user (uid {ME})"),
    (DIR | 0o777, OTHER, f"owned by uid {OTHER}"),
    (DIR | 0o700, 0, "owned by uid 0"),  # root's dir is not ours either
    (DIR | 0o755, ME, "has mode 0755, not 0700"),
    (DIR | 0o1700, ME, "has mode 1700, not 0700"),
    (DIR | 0o600, ME, "has mode 0600, not 0700"),
    (LINK | 0o777, ME, "is a symbolic link"),
    (FILE | 0o700, ME, "exists and is not a directory"),
])
def test_dir_problem(mode: int, uid: int, problem: str | None) -> None:
    got = dir_problem(mode, uid, ME)
    assert (got is None) if problem is None else (got is not None and problem in got), got


@pytest.mark.parametrize(("mode", "uid", "problem"), [
    (DIR | 0o1777, 0, None),  # /tmp
    (DIR | 0o755, 0, None),
    (DIR | 0o700, ME, None),
    (DIR | 0o1777, ME, None),
    (DIR | 0o777, 0, "writable by others without the sticky bit"),
    (DIR | 0o775, ME, "writable by others without the sticky bit"),
    (DIR | 0o1777, OTHER, f"owned by uid {OTHER} (neither root nor this user)"),
    (DIR | 0o755, OTHER, f"owned by uid {OTHER}"),
])
def test_parent_problem(mode: int, uid: int, problem: str | None) -> None:
    got = parent_problem(mode, uid, ME)
    assert (got is None) if problem is None else (got is not None and problem in got), got


def test_a_new_dir_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_private_dir(str(tmp_path / "t"))
    finally:
        os.umask(old)
    st = os.lstat(tmp_path / "t")
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


def test_an_existing_private_dir_is_reused(tmp_path: Path) -> None:
    """Nodes of one run that share a /tmp (local nodes) make the same dir: the second one finds it and uses it."""
    path = tmp_path / "t"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    (path / "keep").write_text("x")
    write_private_files(str(path), {"rank": ["#!/bin/sh\n", "700"]})
    assert (path / "keep").read_text() == "x" and (path / "rank").read_text() == "#!/bin/sh\n"


@pytest.mark.parametrize("what", ["symlink", "mode 0755", "mode 0777", "file", "relative"])
def test_anything_else_at_the_path_is_refused_and_nothing_is_written(tmp_path: Path, what: str) -> None:
    path = tmp_path / "t"
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    target.chmod(0o700)
    if what == "symlink":
        path.symlink_to(target)  # even to a private dir of ours: the name must be the dir itself
    elif what == "file":
        path.write_text("")
    elif what == "relative":
        path = Path("relative-mlxc")
    else:
        path.mkdir()
        path.chmod(int(what.split()[1], 8))
    with pytest.raises(PrivateDirError) as err:
        write_private_files(str(path), {"rank": ["echo pwned\n", "700"]})
    assert str(path) in str(err.value)
    assert list(target.iterdir()) == []
    if what.startswith("mode"):
        assert list(path.iterdir()) == []
    assert not Path("relative-mlxc").exists()


def test_a_parent_others_can_write_to_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    """Whoever can write to the parent can rename our dir away and put theirs in its place."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(PrivateDirError, match="writable by others without the sticky bit"):
        ensure_private_dir(str(parent / "t"))
    assert not (parent / "t").exists()
    parent.chmod(0o1777)  # like /tmp
    ensure_private_dir(str(parent / "t"))


def test_files_get_their_mode_and_no_temporary_is_left(tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_private_files(str(path), {"rank": ["a\n", "700"], "env": ["b\n", "600"]})
    assert sorted(p.name for p in path.iterdir()) == ["env", "rank"]
    assert stat.S_IMODE((path / "rank").stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "env").stat().st_mode) == 0o600
    with pytest.raises(PrivateDirError, match="not a plain file name"):
        write_private_files(str(path), {"../x": ["", "600"]})


def test_the_module_answers_one_json_line(tmp_path: Path) -> None:
    """`python -m worker.privatedir`, as the coordinator runs it: {"dir"} and exit 0, or {"error"} and exit 3."""
    def run(spec: dict[str, object]) -> tuple[int, dict[str, str]]:
        out = subprocess.run([sys.executable, "-m", "worker.privatedir"], input=json.dumps(spec), text=True,
                             capture_output=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        assert out.stderr == "" and len(out.stdout.splitlines()) == 1, out
        return out.returncode, json.loads(out.stdout)

    good = str(tmp_path / "good")
    assert run({"dir": good, "files": {"rank": ["x", "700"]}}) == (0, {"dir": good})
    (tmp_path / "bad").symlink_to(tmp_path / "good")
    rc, answer = run({"dir": str(tmp_path / "bad"), "files": {"rank": ["y", "700"]}})
    assert rc == 3 and answer == {"error": f"{tmp_path / 'bad'} is a symbolic link: refusing to use it"}
    assert (tmp_path / "good" / "rank").read_text() == "x"


def test_it_runs_on_any_node_python() -> None:
    """Nodes run it with their own python: the standard library only, and Python 3.9 syntax."""
    import ast

    import worker.privatedir as module

    tree = ast.parse(Path(module.__file__).read_text(), feature_version=(3, 9))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= sys.stdlib_module_names, names - sys.stdlib_module_names
