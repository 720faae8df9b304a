"""worker.kernelcache: a process loads only whole kernel files, and the shared cache only ever gains whole ones.

The kernels are real: a subprocess compiles a fused function with MLX's CPU backend into a temp dir of the test's
own (TMPDIR), so the files, their names and the way MLX finds them are MLX's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.kernelcache import is_complete, publish

REPO = Path(__file__).resolve().parents[2]

COMPILE = """
import sys
sys.path.insert(0, {repo!r})
if sys.argv[1] == "isolate":
    from worker import kernelcache
    kernelcache.isolate()
import mlx.core as mx

def f(x, y):
    return mx.exp(x * y + 0.25) - mx.sin(x) * 0.5 + mx.tanh(y - x)

x = mx.arange(64, dtype=mx.float32).reshape(8, 8) / 64
print(mx.compile(f)(x, x + 1).sum().item())
"""


def compile_kernel(tmp: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    for key in ("TMP", "TEMP", "TEMPDIR"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-c", COMPILE.format(repo=str(REPO)), mode], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def libraries(root: Path) -> list[Path]:
    return sorted(root.rglob("lib*.so"))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, str]:
    """(a shared cache holding one real compiled kernel, that kernel's bytes, what the function printed)."""
    tmp = tmp_path_factory.mktemp("k")
    done = compile_kernel(tmp, "plain")
    assert done.returncode == 0, done.stderr
    [lib] = libraries(tmp / "mlx")
    return tmp, lib.read_bytes(), done.stdout


def test_a_library_is_complete_only_whole(kernel: tuple[Path, bytes, str], tmp_path: Path) -> None:
    _, data, _ = kernel
    path = tmp_path / "libk.so"
    path.write_bytes(data)
    assert is_complete(path)
    for cut in range(0, len(data), max(1, len(data) // 200)):
        path.write_bytes(data[:cut])
        assert not is_complete(path), cut
    source = tmp_path / "k.cpp"
    source.write_text("// any other file counts as whole")
    assert is_complete(source)


def test_a_truncated_kernel_in_the_cache_is_recompiled_and_replaced(kernel: tuple[Path, bytes, str],
                                                                    tmp_path: Path) -> None:
    """A compile killed mid-write leaves a short file: MLX alone dies loading it (SIGBUS or a load error) on every
    run; an isolated process compiles its own, and at exit puts the whole file in its place."""
    _, data, printed = kernel
    shared = tmp_path / "mlx"
    src_shared = kernel[0] / "mlx"
    [lib] = libraries(src_shared)
    poisoned = shared / lib.relative_to(src_shared)
    poisoned.parent.mkdir(parents=True)
    poisoned.write_bytes(data[: len(data) // 3])

    plain = compile_kernel(tmp_path, "plain")
    assert plain.returncode != 0  # what a rank met before: the short file is loaded as it is
    isolated = compile_kernel(tmp_path, "isolate")
    assert isolated.returncode == 0, isolated.stderr
    assert isolated.stdout == printed
    assert poisoned.read_bytes() == data or is_complete(poisoned)
    assert not any((tmp_path / f"mlxc-kernels-{os.geteuid()}").iterdir()), "the private dir was not removed"
    assert compile_kernel(tmp_path, "plain").returncode == 0  # healed for every process, ours or not


def test_a_warm_cache_is_used_as_it_is(kernel: tuple[Path, bytes, str]) -> None:
    """Seeded by hard links: nothing recompiled, nothing republished, the shared file is the same file."""
    tmp, _, printed = kernel
    [lib] = libraries(tmp / "mlx")
    before = lib.stat()
    again = compile_kernel(tmp, "isolate")
    assert again.returncode == 0, again.stderr
    assert again.stdout == printed
    after = lib.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert libraries(tmp / "mlx") == [lib]


def dir_of_a_gone_pid(tmp: Path, tag: str, library: str, data: bytes) -> Path:
    """A private kernel dir named for a PID that no process has any more, holding one compiled library."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    path = tmp / f"mlxc-kernels-{os.geteuid()}" / f"{int(gone.stdout)}-{tag}"
    (path / "mlx" / "v" / "cpu").mkdir(parents=True)
    (path / "mlx" / "v" / "cpu" / library).write_bytes(data)
    return path


def test_a_dead_process_dir_is_published_and_removed(kernel: tuple[Path, bytes, str], tmp_path: Path) -> None:
    """A rank killed by SIGKILL runs no exit handler: the next isolated process on the machine finishes its job."""
    _, data, _ = kernel
    dead = dir_of_a_gone_pid(tmp_path, "dead", "libwhole.so", data)
    (dead / "mlx" / "v" / "cpu" / "libshort.so").write_bytes(data[:100])  # killed mid-compile: never shared
    done = compile_kernel(tmp_path, "isolate")
    assert done.returncode == 0, done.stderr
    assert not dead.exists()
    assert (tmp_path / "mlx" / "v" / "cpu" / "libwhole.so").read_bytes() == data
    assert not (tmp_path / "mlx" / "v" / "cpu" / "libshort.so").exists()


HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_dir_whose_process_holds_its_lock_is_kept_whatever_its_pid(kernel: tuple[Path, bytes, str],
                                                                   tmp_path: Path) -> None:
    """A process in another PID namespace sharing /tmp (a container) has a PID that names no process here, or
    another one: its dir is kept while it holds `.alive`, and published and removed once it is gone."""
    _, data, _ = kernel
    theirs = dir_of_a_gone_pid(tmp_path, "container", "libtheirs.so", data)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(theirs / ".alive")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        done = compile_kernel(tmp_path, "isolate")
        assert done.returncode == 0, done.stderr
        assert (theirs / "mlx" / "v" / "cpu" / "libtheirs.so").read_bytes() == data  # kept: its process lives
    finally:
        holder.communicate("", timeout=30)
    done = compile_kernel(tmp_path, "isolate")
    assert done.returncode == 0, done.stderr
    assert not theirs.exists()
    assert (tmp_path / "mlx" / "v" / "cpu" / "libtheirs.so").read_bytes() == data


def test_publish_never_replaces_a_whole_file_and_leaves_no_temp_files(kernel: tuple[Path, bytes, str],
                                                                     tmp_path: Path) -> None:
    _, data, _ = kernel
    mine, shared = tmp_path / "mine", tmp_path / "shared"
    (mine / "cpu").mkdir(parents=True)
    (shared / "cpu").mkdir(parents=True)
    for name in ("libnew.so", "libthere.so", "libshort.so"):
        (mine / "cpu" / name).write_bytes(data)
    there = shared / "cpu" / "libthere.so"
    there.write_bytes(data)
    inode = there.stat().st_ino
    (shared / "cpu" / "libshort.so").write_bytes(data[:500])
    assert publish(mine, shared) == 2
    assert there.stat().st_ino == inode
    assert sorted(p.name for p in (shared / "cpu").iterdir()) == ["libnew.so", "libshort.so", "libthere.so"]
    assert (shared / "cpu" / "libshort.so").read_bytes() == data


def test_a_symlink_in_place_of_the_private_root_is_never_followed(kernel: tuple[Path, bytes, str],
                                                                  tmp_path: Path) -> None:
    """/tmp is every user's: a link planted at the root's name leaves MLX on its own cache, nothing written there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"mlxc-kernels-{os.geteuid()}").symlink_to(elsewhere, target_is_directory=True)
    done = compile_kernel(tmp_path, "isolate")
    assert done.returncode == 0, done.stderr
    assert done.stdout == kernel[2]
    assert not any(elsewhere.iterdir())
    assert libraries(tmp_path / "mlx")  # compiled where MLX would have put it without us
