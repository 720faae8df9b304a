"""worker/probe.py: run as the coordinator runs it (`python - ARGS`, source on stdin) and function by function.

Only 127.0.0.1 is ever contacted. No wall-clock assertions.
"""

from __future__ import annotations

import ast
import errno
import glob
import hashlib
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.facts.probe import python_args
from worker import probe

SOURCE = Path(probe.__file__).read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def own_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probe keeps its caches under ~/.cache: each test gets its own home, never the runner's."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    return home


def run_script(args: dict[str, Any] | None, python: str = sys.executable, extra: list[str] | None = None,
               source: str = SOURCE, key_of: str | None = None) -> tuple[int, dict[str, Any], str]:
    # The way the coordinator runs it (coordinator.facts.probe.python_args: `-c BOOTSTRAP KEY`, the source on stdin).
    # `key_of`: pretend the source is this other text (the cache key of a different version).
    argv = [python, *python_args(key_of if key_of is not None else source)]
    argv += ([json.dumps(args)] if args is not None else []) + (extra or [])
    done = subprocess.run(argv, input=source, capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout + done.stderr  # exactly one JSON object, nothing else on stdout
    return done.returncode, json.loads(lines[0]), done.stderr


def cached_code(home: Path) -> list[Path]:
    return sorted((home / ".cache" / "mlx-coordinator").glob("probe-*.bin"))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def hashes_of(dirs: list[str], cache: Path | None, **kw: Any) -> list[dict[str, Any]]:
    return probe.hash_dirs(dirs, str(cache) if cache else None, stderr=io.StringIO(), **kw)


def manifest(entry: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in entry["files"]}


def safetensors(path: Path, shapes: dict[str, list[int]], metadata: dict[str, str] | None = None) -> Path:
    """A real (tiny) safetensors file: 8-byte LE header length, JSON header, zero-filled F32 data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    return write(path, struct.pack("<Q", len(raw)) + raw + bytes(offset))


# ---------------------------------------------------------------------------------------------- whole script


def test_script_from_stdin_answers_every_section(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write(model / "config.json", json.dumps({"model_type": "llama", "hidden_size": 8}).encode())
    safetensors(model / "model.safetensors", {"w": [4, 8], "b": [8]})
    write(model / "tokenizer.json", b"{}")
    write(tmp_path / "data" / "train.jsonl", b'{"text": "a"}\n{"text": "b"}\n')
    args = {"hash_dirs": [str(model)], "peers": [], "cache": str(tmp_path / "cache.json"),
            "model_dir": str(model), "jobs": 2, "progress": True, "timeout": 1.0,
            "data_check": {"dir": str(tmp_path / "data"), "format": "sft", "files": [["train.jsonl", True]]}}
    rc, out, _ = run_script(args)
    assert rc == 0
    assert set(out) == {"python", "packages", "mlx_backends", "errors", "hashes", "reach", "model", "data"}
    assert out["errors"] == []
    assert out["python"] == {"executable": sys.executable, "version": ".".join(map(str, sys.version_info[:3]))}
    assert out["model"] == {"config": {"model_type": "llama", "hidden_size": 8}, "params": 40, "error": None,
                            "weights": ["model.safetensors"], "tokenizer": ["tokenizer.json"]}
    [train] = out["data"]["files"]
    assert train == {"name": "train.jsonl", "required": True, "exists": True, "rows": 2, "bytes": 28,
                     "checked_bytes": 28, "format": "text", "error": None}
    [entry] = out["hashes"]
    assert entry["path"] == str(model) and entry["exists"] and entry["error"] is None
    assert manifest(entry) == {
        "config.json": sha((model / "config.json").read_bytes()),
        "model.safetensors": sha((model / "model.safetensors").read_bytes()),
        "tokenizer.json": sha(b"{}"),
    }
    assert out["reach"] == []


def test_the_compiled_probe_is_cached_per_source_and_interpreter(own_home: Path) -> None:
    rc, first, _ = run_script({})
    [path] = cached_code(own_home)
    assert rc == 0 and first["errors"] == []
    tag = f"{sys.implementation.cache_tag}-{sys.hexversion:x}"
    assert path.name == f"probe-{python_args(SOURCE)[2]}-{tag}.bin"
    # A second run executes the cached code, not what arrives on stdin: proven with a source of the same key
    # that would answer differently.
    other = SOURCE.replace('"errors": errors', '"errors": ["from stdin"] + errors', 1)
    assert other != SOURCE
    _, again, _ = run_script({}, source=other, key_of=SOURCE)
    assert again["errors"] == []
    # A new source (another coordinator version) has another key: compiled from stdin and cached beside.
    _, fresh, _ = run_script({}, source=other)
    assert fresh["errors"] == ["from stdin"]
    assert len(cached_code(own_home)) == 2


@pytest.mark.parametrize("garbage", [b"", b"not marshal data", b"\xe9\x00\x00\x00\x00"])  # the last: an int
def test_a_corrupt_cache_entry_is_recompiled(own_home: Path, garbage: bytes) -> None:
    run_script({})
    [path] = cached_code(own_home)
    path.write_bytes(garbage)
    rc, out, _ = run_script({"hash_dirs": []})
    assert rc == 0 and out["errors"] == [] and out["hashes"] == []
    assert path.read_bytes() != garbage  # rewritten
    run_script({})  # and used again


def test_an_unwritable_cache_only_means_compiling(own_home: Path) -> None:
    (own_home / ".cache").write_text("a file where the cache dir would be\n")
    for _ in range(2):
        rc, out, _ = run_script({})
        assert rc == 0 and out["errors"] == []
    assert (own_home / ".cache").read_text() == "a file where the cache dir would be\n"


def test_package_versions_come_from_the_venv_metadata() -> None:
    from importlib import metadata

    _, out, _ = run_script({})
    assert out["packages"] == {"mlx": metadata.version("mlx"), "mlx_lm": metadata.version("mlx-lm")}
    assert probe.package_versions() == out["packages"]
    # This Linux venv has mlx[cpu]: the backend distribution is reported next to mlx, at mlx's version.
    assert out["mlx_backends"] == {"mlx-cpu": metadata.version("mlx-cpu")}


def test_no_argument_means_defaults(tmp_path: Path) -> None:
    rc, out, _ = run_script(None)
    assert rc == 0
    assert out["hashes"] == [] and out["reach"] == [] and out["errors"] == []
    assert out["model"] == {"config": None, "params": None, "error": None} and "data" not in out


@pytest.mark.parametrize("argv", [["not json"], ["[1, 2]"], ["{}", "{}"]])
def test_unusable_argument_exits_2_with_a_json_answer(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-", *argv], input=SOURCE, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    out = json.loads(done.stdout)
    assert out["errors"] and "hashes" not in out
    assert "worker probe:" in done.stderr


def test_bad_argument_values_are_reported_not_fatal(tmp_path: Path) -> None:
    rc, out, _ = run_script({"jobs": True, "timeout": -1, "bogus": 1, "cache": None, "hash_dirs": [str(tmp_path)]})
    assert rc == 0
    text = " ".join(out["errors"])
    assert "'jobs'" in text and "'timeout'" in text and "bogus" in text
    assert out["hashes"][0]["exists"] is True


def test_source_is_stdlib_only_and_self_contained() -> None:
    # The node has mlx but none of our packages, and the source arrives on stdin: no package, no relative import.
    tree = ast.parse(SOURCE)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, "relative import"
            names.add(node.module.split(".")[0])
    assert names - {"__future__"} <= sys.stdlib_module_names, names - sys.stdlib_module_names
    assert "mlx" not in names


def _pythons_39() -> list[str]:
    """A working Python 3.9 (the oldest node python we support), if this machine has one."""
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))
    candidates += [p for p in (shutil.which("python3.9"),) if p]  # may be a pyenv shim that refuses to run
    for python in candidates:
        check = "import sys; sys.exit(sys.version_info[:2] != (3, 9))"
        if subprocess.run([python, "-c", check], capture_output=True, timeout=30).returncode == 0:
            return [python]
    return []


PYTHON_39 = _pythons_39()


@pytest.mark.skipif(not PYTHON_39, reason="no python3.9 on this machine")
def test_runs_on_python_39(tmp_path: Path) -> None:
    # Node pythons may be older than ours: the source must not use 3.10+ syntax or runtime typing.
    write(tmp_path / "d" / "a.bin", b"x" * 100)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    with srv:
        args = {"hash_dirs": [str(tmp_path / "d")], "cache": str(tmp_path / "c.json"), "model_dir": str(tmp_path),
                "peers": [{"name": "me", "ip": "127.0.0.1", "port": srv.getsockname()[1]}]}
        rc, out, _ = run_script(args, python=PYTHON_39[0])
    assert rc == 0, out
    assert out["python"]["version"].startswith("3.9.")
    assert manifest(out["hashes"][0]) == {"a.bin": sha(b"x" * 100)}
    assert out["reach"][0]["ok"] is True


# ---------------------------------------------------------------------------------------------- hashing


SIZES = [0, 1, 4095, 65537, probe.CHUNK - 1, probe.CHUNK, probe.CHUNK + 1, 2 * probe.CHUNK + 3]


@pytest.mark.parametrize("jobs", [1, 3, 0])
def test_hashes_equal_hashlib_for_many_sizes(tmp_path: Path, jobs: int) -> None:
    d = tmp_path / "d"
    expected = {}
    for i, size in enumerate(SIZES):
        data = os.urandom(size)
        write(d / f"f{i:02d}.bin", data)
        expected[f"f{i:02d}.bin"] = (size, sha(data))
    [entry] = hashes_of([str(d)], tmp_path / "cache.json", jobs=jobs)
    assert {f["path"]: (f["size"], f["sha256"]) for f in entry["files"]} == expected
    assert entry["hashed_bytes"] == sum(SIZES) and entry["cached_files"] == 0 and entry["error"] is None


def test_sha256_file_streams_big_files() -> None:
    path = Path(probe.__file__)
    digest, st = probe.sha256_file(str(path))
    assert digest == sha(path.read_bytes()) and st.st_size == path.stat().st_size


def test_nested_dirs_sorted_hidden_and_symlinks(tmp_path: Path) -> None:
    d = tmp_path / "d"
    outside = write(tmp_path / "outside.bin", b"outside")
    for rel in ["b/x.txt", "a/z.txt", "a/b/c.txt", "A.txt", ".hidden", "a/.git/HEAD", "a-b.txt",
                "__pycache__/mod.cpython-311.pyc", "a/__pycache__/m.pyc"]:  # bytecode: each node's own, never hashed
        write(d / rel, rel.encode())
    (d / "link.bin").symlink_to(outside)  # symlink to a file: followed
    (d / "linkdir").symlink_to(d / "b", target_is_directory=True)  # symlink to a dir: followed
    (d / "a" / "up").symlink_to(d, target_is_directory=True)  # loop: skipped, reported
    (d / "dangling").symlink_to(tmp_path / "nope")
    os.mkfifo(d / "fifo")  # not a regular file: ignored (reading it would block forever)
    [entry] = hashes_of([str(d)], tmp_path / "cache.json")
    paths = [f["path"] for f in entry["files"]]
    assert paths == sorted(paths)
    assert set(paths) == {"b/x.txt", "a/z.txt", "a/b/c.txt", "A.txt", ".hidden", "a/.git/HEAD", "a-b.txt",
                          "link.bin", "linkdir/x.txt"}
    assert manifest(entry)["link.bin"] == sha(b"outside")
    assert manifest(entry)["a/b/c.txt"] == sha(b"a/b/c.txt")
    assert "dangling symlink dangling" in entry["error"]
    assert "symlink loop skipped: a/up" in entry["error"]


def test_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "data" / "f", b"hi")
    [entry] = hashes_of(["~/data"], None)
    assert entry["path"] == "~/data" and manifest(entry) == {"f": sha(b"hi")}


def test_missing_dir_and_not_a_dir(tmp_path: Path) -> None:
    write(tmp_path / "file", b"x")
    missing, notdir = hashes_of([str(tmp_path / "nope"), str(tmp_path / "file")], tmp_path / "c.json")
    assert missing["exists"] is False and missing["files"] == [] and "no such directory" in missing["error"]
    assert notdir["exists"] is True and notdir["files"] == [] and "not a directory" in notdir["error"]


def test_unreadable_file_is_named_in_the_dir_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    write(d / "ok.bin", b"ok")
    write(d / "secret.bin", b"no")
    real = probe.sha256_file

    def deny(path: str, on_bytes: Any = None) -> Any:
        if path.endswith("secret.bin"):  # simulated: chmod 000 does not stop root, who runs CI
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, on_bytes)

    monkeypatch.setattr(probe, "sha256_file", deny)
    [entry] = hashes_of([str(d)], tmp_path / "c.json")
    assert manifest(entry) == {"ok.bin": sha(b"ok")}
    assert entry["error"] == "cannot read secret.bin: Permission denied"


def test_unreadable_file_for_real(tmp_path: Path) -> None:
    """A mode-000 file, read by a user who may not read it. Root reads anything, so as root the probe runs as
    `nobody` (setpriv, util-linux) with the system python, in a world-readable temp dir."""
    if os.geteuid() != 0:
        d = tmp_path / "d"
        write(d / "secret.bin", b"no").chmod(0)
        [entry] = hashes_of([str(d)], None)
        assert entry["files"] == [] and "secret.bin" in entry["error"]
        return
    base = Path(tempfile.mkdtemp(prefix="mlxc-probe-perm-"))
    try:
        base.chmod(0o755)
        d = base / "d"
        write(d / "ok.bin", b"ok")
        write(d / "secret.bin", b"no").chmod(0)
        d.chmod(0o755)
        (d / "ok.bin").chmod(0o644)
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-",
                json.dumps({"hash_dirs": [str(d)]})]
        done = subprocess.run(argv, input=SOURCE, capture_output=True, text=True, timeout=120, cwd=base)
        out = json.loads(done.stdout.splitlines()[0])
        [entry] = out["hashes"]
        assert manifest(entry) == {"ok.bin": sha(b"ok")}
        assert "secret.bin" in entry["error"] and "Permission denied" in entry["error"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_file_changing_while_read_is_an_error_not_a_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    write(d / "f", b"1234")

    def grow(n: int) -> None:
        with open(d / "f", "ab") as fh:
            fh.write(b"more")

    with pytest.raises(probe.FileChanged):
        probe.sha256_file(str(d / "f"), grow)


def test_progress_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    for i in range(3):
        write(d / f"f{i}", os.urandom(probe.CHUNK + i))
    monkeypatch.setattr(probe, "PROGRESS_MIN_BYTES", 0)
    err = io.StringIO()
    probe.hash_dirs([str(d)], None, progress=True, stderr=err)
    lines = [line.split() for line in err.getvalue().splitlines()]
    total = 3 * probe.CHUNK + 3
    assert lines and all(w[0] == "progress" and int(w[2]) == total for w in lines)
    assert lines[-1] == ["progress", str(total), str(total)]
    # Small jobs (the default threshold) and progress=False stay quiet.
    monkeypatch.setattr(probe, "PROGRESS_MIN_BYTES", 256 * 1024 * 1024)
    err = io.StringIO()
    probe.hash_dirs([str(d)], None, progress=True, stderr=err)
    assert err.getvalue() == ""


# ---------------------------------------------------------------------------------------------- cache


def test_unchanged_file_comes_from_the_cache_without_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    write(d / "sub" / "b", b"beta")
    cache = tmp_path / "cache" / "sha256.json"  # the cache dir is created on first write
    [first] = hashes_of([str(d)], cache)
    assert first["cached_files"] == 0 and first["hashed_bytes"] == 9

    def never(*_: Any) -> Any:
        raise AssertionError("a cached file was read")

    monkeypatch.setattr(probe, "sha256_file", never)
    [second] = hashes_of([str(d)], cache)
    assert second["files"] == first["files"]
    assert second["cached_files"] == 2 and second["hashed_bytes"] == 0


def test_same_size_and_mtime_trusts_the_cache_changed_mtime_rehashes(tmp_path: Path) -> None:
    d = tmp_path / "d"
    f = write(d / "w.bin", b"A" * 1000)
    cache = tmp_path / "c.json"
    [before] = hashes_of([str(d)], cache)
    assert manifest(before) == {"w.bin": sha(b"A" * 1000)}
    st = f.stat()
    with open(f, "r+b") as fh:  # same inode, same size, new content ...
        fh.write(b"B" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old mtime, to the nanosecond
    [trusted] = hashes_of([str(d)], cache)
    assert manifest(trusted) == {"w.bin": sha(b"A" * 1000)}  # the cache's (stale) answer proves no re-read
    assert trusted["cached_files"] == 1
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    [rehashed] = hashes_of([str(d)], cache)
    assert manifest(rehashed) == {"w.bin": sha(b"B" * 1000)}
    assert rehashed["cached_files"] == 0 and rehashed["hashed_bytes"] == 1000


def test_new_inode_with_same_size_and_mtime_rehashes(tmp_path: Path) -> None:
    # What `rsync -a` does: write a temp file, give it the source's mtime, rename it over the old one.
    d = tmp_path / "d"
    f = write(d / "w.bin", b"A" * 64)
    cache = tmp_path / "c.json"
    hashes_of([str(d)], cache)
    st = f.stat()
    tmp = write(d / "tmp", b"C" * 64)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, f)
    [again] = hashes_of([str(d)], cache)
    assert manifest(again) == {"w.bin": sha(b"C" * 64)}


def test_cache_file_format_and_atomic_write(tmp_path: Path) -> None:
    d = tmp_path / "d"
    f = write(d / "a", b"alpha")
    cache = tmp_path / "c.json"
    hashes_of([str(d)], cache)
    data = json.loads(cache.read_text())
    st = f.stat()
    assert data == {"version": 1, "files": {os.path.realpath(f): [5, st.st_mtime_ns, st.st_ino, sha(b"alpha")]}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "d"]  # no temp file left behind


@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe\x00", b"[1,2]", b'{"version": 99, "files": {}}',
                                     b"[" * 100000, b""])
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path, garbage: bytes) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    cache = write(tmp_path / "c.json", garbage)
    [entry] = hashes_of([str(d)], cache)
    assert manifest(entry) == {"a": sha(b"alpha")} and entry["cached_files"] == 0
    assert json.loads(cache.read_text())["version"] == 1
    [again] = hashes_of([str(d)], cache)
    assert again["cached_files"] == 1


def test_invalid_cache_entries_are_dropped_one_by_one(tmp_path: Path) -> None:
    d = tmp_path / "d"
    a = write(d / "a", b"alpha")
    b = write(d / "b", b"beta")
    cache = tmp_path / "c.json"
    hashes_of([str(d)], cache)
    data = json.loads(cache.read_text())
    data["files"][os.path.realpath(b)] = ["x", 1, 2, "short"]
    cache.write_text(json.dumps(data))
    [entry] = hashes_of([str(d)], cache)
    assert entry["cached_files"] == 1 and manifest(entry) == {"a": sha(b"alpha"), "b": sha(b"beta")}
    assert os.path.realpath(a) in json.loads(cache.read_text())["files"]


def test_corrupt_cache_through_the_script(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    cache = write(tmp_path / "c.json", b"\x00garbage")
    rc, out, err = run_script({"hash_dirs": [str(d)], "cache": str(cache)})
    assert rc == 0 and out["errors"] == []
    assert manifest(out["hashes"][0]) == {"a": sha(b"alpha")}
    assert "ignored" in err


def test_entries_of_deleted_files_are_dropped(tmp_path: Path) -> None:
    d = tmp_path / "d"
    keep = write(d / "keep", b"k")
    gone = write(d / "gone", b"g")
    other = write(tmp_path / "other" / "o", b"o")
    cache = tmp_path / "c.json"
    hashes_of([str(d)], cache)
    hashes_of([str(tmp_path / "other")], cache)  # a second dir: merged into the same cache file
    gone.unlink()
    hashes_of([str(d)], cache)
    keys = set(json.loads(cache.read_text())["files"])
    assert keys == {os.path.realpath(keep), os.path.realpath(other)}


def test_cache_file_inside_a_hashed_dir_is_not_hashed(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    write(d / "sha256.json.123.tmp", b"half-written by another probe")
    [entry] = hashes_of([str(d)], d / "sha256.json")
    [again] = hashes_of([str(d)], d / "sha256.json")
    assert (d / "sha256.json").exists()
    assert set(manifest(entry)) == set(manifest(again)) == {"a"}


def test_unwritable_cache_is_reported_not_fatal(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    blocker = write(tmp_path / "blocker", b"a file where the cache dir should be")
    errors: list[str] = []
    [entry] = probe.hash_dirs([str(d)], str(blocker / "c.json"), stderr=io.StringIO(), errors=errors)
    assert manifest(entry) == {"a": sha(b"alpha")}
    assert len(errors) == 1 and "cannot write hash cache" in errors[0]


def test_a_file_in_two_dirs_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    write(d / "a", b"alpha")
    reads: list[str] = []
    real = probe.sha256_file

    def counting(path: str, on_bytes: Any = None) -> Any:
        reads.append(path)
        return real(path, on_bytes)

    monkeypatch.setattr(probe, "sha256_file", counting)
    one, two = hashes_of([str(d), str(d)], None)
    assert len(reads) == 1 and one["files"] == two["files"]


# ---------------------------------------------------------------------------------------------- reach


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


def closed_port() -> int:
    # Bound but never listening: the kernel answers a SYN with RST (connection refused), and the port is ours.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TCP path: as if no ICMP echo came back (no ICMP socket here, or a firewall drops echoes)."""
    monkeypatch.setattr(probe, "icmp_echoes", lambda ips, wait=probe.ICMP_WAIT_S: {})


def test_reach_answers_by_icmp_when_the_peer_echoes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_connect", lambda family, address, timeout: pytest.fail("TCP used"))
    r = probe.reach_peer({"name": "h2", "ip": "127.0.0.1", "port": 22}, 2.0)
    assert (r["ok"], r["method"], r["error"]) == (True, "icmp", None) and r["rtt_ms"] >= 0


def test_icmp_echoes_go_out_together_and_each_reply_finds_its_address() -> None:
    # Every 127/8 address answers on loopback; each reply is matched to its address by its own payload.
    ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.2"]
    rtts = probe.icmp_echoes(ips)  # root here: a raw socket at worst
    assert sorted(rtts) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"] and all(v >= 0 for v in rtts.values())
    assert probe.icmp_echoes([]) == {}
    assert probe._checksum(b"\x08\x00\x00\x00\x12\x34\x00\x01") == 0xE5CA  # RFC 1071 by hand


def test_reach_peers_use_tcp_only_for_addresses_that_did_not_echo(monkeypatch: pytest.MonkeyPatch,
                                                                   listener: socket.socket) -> None:
    monkeypatch.setattr(probe, "icmp_echoes", lambda ips, wait=probe.ICMP_WAIT_S: {"127.0.0.1": 0.25})
    tried: list[Any] = []
    real = probe._connect

    def connect(family: int, address: Any, timeout: float) -> int | None:
        tried.append(address)
        return real(family, address, timeout)

    monkeypatch.setattr(probe, "_connect", connect)
    port = listener.getsockname()[1]
    out = probe.reach_peers([{"name": "a", "ip": "127.0.0.1", "port": port}, {"name": "b", "ip": "127.0.0.2", "port": port},
                             {"name": "c", "ip": "127.0.0.1", "port": port}], 2.0)
    assert [(r["peer"], r["method"], r["ok"]) for r in out] == [("a", "icmp", True), ("b", "tcp", True), ("c", "icmp", True)]
    assert [r["rtt_ms"] for r in out][::2] == [0.25, 0.25] and tried == [("127.0.0.2", port)]


@pytest.mark.usefixtures("tcp_only")
def test_reach_listening_port_is_ok(listener: socket.socket) -> None:
    r = probe.reach_peer({"name": "h2", "ip": "127.0.0.1", "port": listener.getsockname()[1]}, 2.0)
    assert r["peer"] == "h2" and r["ip"] == "127.0.0.1"
    assert r["ok"] is True and r["error"] is None
    assert isinstance(r["rtt_ms"], float) and r["rtt_ms"] >= 0


@pytest.mark.usefixtures("tcp_only")
def test_reach_refused_port_is_ok_the_ip_answered() -> None:
    r = probe.reach_peer({"name": "h3", "ip": "127.0.0.1", "port": closed_port()}, 2.0)
    assert r["ok"] is True and r["error"] is None and isinstance(r["rtt_ms"], float)


@pytest.mark.usefixtures("tcp_only")
def test_reach_timeout_on_a_full_accept_queue() -> None:
    # A real "no answer" without leaving 127.0.0.1: Linux drops SYNs for a listener whose accept queue is full.
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        r = probe.reach_peer({"name": "h4", "ip": "127.0.0.1", "port": port}, 0.3)
    finally:
        for c in fillers:
            c.close()
        srv.close()
    if r["ok"]:
        pytest.skip("this kernel accepted past the backlog; the simulated cases below still cover timeouts")
    assert r["rtt_ms"] is None and r["error"].startswith("timed out after 0.3 s")


@pytest.mark.usefixtures("tcp_only")
@pytest.mark.parametrize(
    ("rc", "expect"),
    [(None, "timed out after 2 s"), (errno.EHOSTUNREACH, "EHOSTUNREACH"), (errno.ENETUNREACH, "ENETUNREACH"),
     (errno.ETIMEDOUT, "ETIMEDOUT")],
)
def test_reach_failures_are_not_ok_with_the_reason(monkeypatch: pytest.MonkeyPatch, rc: int | None,
                                                   expect: str) -> None:
    monkeypatch.setattr(probe, "_connect", lambda family, address, timeout: rc)
    r = probe.reach_peer({"name": "h5", "ip": "127.0.0.1", "port": 22}, 2.0)
    assert r["ok"] is False and r["rtt_ms"] is None and expect in r["error"]
    assert r["peer"] == "h5" and r["ip"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("peer", "expect"),
    [({"name": "p", "ip": "127.0.0.1", "port": 70000}, "bad port"), ({"name": "p", "ip": "127.0.0.1", "port": "22"},
     "bad port"), ({"name": "p"}, "no ip"), ("junk", "bad peer spec")],
)
def test_reach_bad_peer_specs_are_reported(peer: Any, expect: str) -> None:
    r = probe.reach_peer(peer, 1.0)
    assert r["ok"] is False and expect in r["error"]


def test_addresses_skip_the_resolver_and_names_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kw: Any) -> Any:
        asked.append(host)
        return real(host, *args, **kw)

    monkeypatch.setattr(probe.socket, "getaddrinfo", getaddrinfo)
    for ip, target in [("10.0.0.7", (socket.AF_INET, ("10.0.0.7", 22))),
                       ("fd00::7", (socket.AF_INET6, ("fd00::7", 22, 0, 0)))]:
        entry, got = probe._target({"name": "p", "ip": ip})
        assert got == target and entry["error"] is None
    assert asked == []
    _, got = probe._target({"name": "p", "ip": "localhost", "port": 2222})
    assert asked == ["localhost"] and got is not None and got[1][1] == 2222  # (from /etc/hosts: no DNS traffic)


def test_reach_through_the_script_keeps_order(listener: socket.socket) -> None:
    peers = [{"name": "up", "ip": "127.0.0.1", "port": listener.getsockname()[1]},
             {"name": "refused", "ip": "127.0.0.1", "port": closed_port()},
             {"name": "bad", "ip": "127.0.0.1", "port": 0}]
    rc, out, _ = run_script({"peers": peers, "timeout": 2.0})
    assert rc == 0
    assert [(r["peer"], r["ok"]) for r in out["reach"]] == [("up", True), ("refused", True), ("bad", False)]
    assert set(out["reach"][0]) == {"peer", "ip", "ok", "rtt_ms", "error", "method"}


# ---------------------------------------------------------------------------------------------- model


def test_safetensors_params_skips_metadata(tmp_path: Path) -> None:
    path = safetensors(tmp_path / "m.safetensors", {"a": [2, 3], "b": [5], "scalar": [], "empty": [0, 7]},
                       metadata={"format": "pt"})
    assert probe.safetensors_params(str(path)) == 6 + 5 + 1 + 0


def test_sharded_model_sums_every_shard(tmp_path: Path) -> None:
    write(tmp_path / "config.json", b'{"num_hidden_layers": 2}')
    safetensors(tmp_path / "model-00001-of-00002.safetensors", {"x": [10, 10]})
    safetensors(tmp_path / "model-00002-of-00002.safetensors", {"y": [3, 3]})
    write(tmp_path / "model.safetensors.index.json", b'{"weight_map": {}}')
    write(tmp_path / "tokenizer.model", b"sp")
    assert probe.model_info(str(tmp_path)) == {
        "config": {"num_hidden_layers": 2}, "params": 109, "error": None, "tokenizer": ["tokenizer.model"],
        "weights": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]}


def test_model_without_weights_config_or_tokenizer(tmp_path: Path) -> None:
    info = probe.model_info(str(tmp_path))
    assert (info["config"], info["params"], info["weights"], info["tokenizer"]) == (None, None, [], [])
    assert info["error"] == ("no config.json; no *.safetensors weights; no tokenizer (tokenizer.json, "
                             "tokenizer.model, vocab.json, tiktoken.model, vocab.txt)")
    write(tmp_path / "config.json", b"[1]")
    assert probe.model_info(str(tmp_path))["error"].startswith("config.json is not a JSON object; ")
    assert "no such directory" in probe.model_info(str(tmp_path / "nope"))["error"]


# ---------------------------------------------------------------------------------------------- data files


def data_file(tmp_path: Path, content: bytes, fmt: str = "sft", limit: int = 1 << 20) -> dict[str, object]:
    return probe.check_data_file(str(write(tmp_path / "d" / "train.jsonl", content)), fmt, limit)


@pytest.mark.parametrize(("content", "fmt", "error"), [
    (b'{"text": "a"}\n{"text": "\xff\xfe"}\n', "sft", "line 2: not UTF-8 (byte 0xff at column 11)"),
    (b'{"text": "a"}\n{"text": "b"\n', "sft", "line 2: not JSON (Expecting ',' delimiter at column 13)"),
    (b'{"text": "a"}\n\n{"text": "b"}\n', "sft", "line 2: blank (mlx-lm parses every line as JSON)"),
    (b'{"txt": "a"}\n', "sft", 'line 1: unsupported format (has txt; needs "text", "messages", or "prompt" and '
                               '"completion")'),
    (b'{"text": "a"}\n{"messages": []}\n', "sft", 'line 2: "text" is missing or not a string'),
    (b'{"prompt": "p", "completion": "c"}\n{"prompt": "p"}\n', "sft",
     "line 2: 'completion' missing (the file's first row is prompt/completion)"),
    (b'{"messages": [{"role": "user", "content": "x"}]}\n{"messages": "x"}\n', "sft",
     'line 2: "messages" is missing or not a list of {"role", "content"} messages'),
    (b'[1, 2]\n', "sft", "line 1: unsupported format (has list; needs \"text\", \"messages\", or \"prompt\" and "
                         '"completion")'),
    (b"", "sft", "no rows (an empty file fails the loader)"),
    (b'{"prompt": "p", "chosen": "a"}\n', "dpo", 'line 1: a preference row needs "chosen" and "rejected"'),
    (b'{"chosen": "a", "rejected": "b"}\n', "dpo",
     'line 1: no "prompt" (only chat conversations sharing their first messages may leave it out)'),
])
def test_a_data_file_fails_on_its_first_unusable_line(tmp_path: Path, content: bytes, fmt: str, error: str) -> None:
    assert data_file(tmp_path, content, fmt)["error"] == error


def test_good_data_files_count_their_rows(tmp_path: Path) -> None:
    chat = b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n'
    assert data_file(tmp_path, chat * 3) == {"exists": True, "rows": 3, "bytes": 3 * len(chat),
                                              "checked_bytes": 3 * len(chat), "format": "chat", "error": None}
    # DPO's loader skips blank lines; chat conversations may leave out the prompt.
    dpo = b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n{"chosen": [], "rejected": []}\n'
    assert data_file(tmp_path, dpo, "dpo")["rows"] == 2 and data_file(tmp_path, dpo, "dpo")["error"] is None
    assert probe.check_data_file(str(tmp_path / "nope.jsonl"), "sft", 100)["exists"] is False


def test_a_big_data_file_is_parsed_up_to_the_limit(tmp_path: Path) -> None:
    row = b'{"text": "abc"}\n'  # 16 bytes
    out = data_file(tmp_path, row * 100 + b"not json\n", limit=16 * 10)
    assert (out["rows"], out["checked_bytes"], out["bytes"], out["error"]) == (10, 160, 1609, None)


def test_check_data_reports_each_asked_file(tmp_path: Path) -> None:
    write(tmp_path / "train.jsonl", b'{"text": "a"}\n')
    out = probe.check_data({"dir": str(tmp_path), "format": "sft",
                            "files": [["train.jsonl", True], ["valid.jsonl", False]]})
    assert out["error"] is None and [(f["name"], f["exists"], f["required"]) for f in out["files"]] == [
        ("train.jsonl", True, True), ("valid.jsonl", False, False)]
    assert probe.check_data({"dir": str(tmp_path / "nope"), "files": []})["error"].startswith("no such directory")
    assert "needs" in probe.check_data({"files": []})["error"]


def test_bad_safetensors_file_is_named(tmp_path: Path) -> None:
    write(tmp_path / "config.json", b"{}")
    safetensors(tmp_path / "good.safetensors", {"x": [2]})
    write(tmp_path / "lfs.safetensors", b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n")
    write(tmp_path / "short.safetensors", b"\x01")
    info = probe.model_info(str(tmp_path))
    assert info["config"] == {} and info["params"] is None
    assert "lfs.safetensors: header length" in info["error"] and "short.safetensors: too short" in info["error"]


def test_versions_come_from_dist_info_names_first_path_wins(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for d, names in ((first, ["MLX_LM-0.30.1.dist-info", "mlx_metal-0.32.4.dist-info", "mlx_cpu-0.32.4.dist-info"]),
                     (second, ["mlx-0.29.0-py3.11.egg-info", "mlx_lm-0.1.0.dist-info", "README.txt", "x.dist-info"])):
        d.mkdir()
        for n in names:
            (d / n).mkdir()
    found = probe.installed_from_paths([str(tmp_path / "missing"), str(first), str(second)], {"mlx", "mlx-lm"})
    # mlx-metal / mlx-cpu are other distributions; an egg-info's `-pyX.Y` tag is not part of the version.
    assert found == {"mlx-lm": "0.30.1", "mlx": "0.29.0"}


def test_backend_distributions_are_found_next_to_mlx(tmp_path: Path) -> None:
    site, later = tmp_path / "site", tmp_path / "later"
    for d, names in ((site, ["mlx-0.32.4.dist-info", "mlx_lm-0.32.2.dist-info", "mlx_cuda_13-0.32.4.dist-info"]),
                     (later, ["mlx_cpu-0.31.0.dist-info"])):
        d.mkdir()
        for n in names:
            (d / n).mkdir()
    wanted = {"mlx", "mlx-lm", *probe.BACKEND_DISTRIBUTIONS}
    found = probe.installed_from_paths([str(site), str(later)], wanted, enough={"mlx", "mlx-lm"})
    # The scan ends with the entry holding mlx and mlx-lm: a stray mlx-cpu further down sys.path is not theirs.
    assert probe.backend_versions(found) == {"mlx-cuda-13": "0.32.4"}
    everything = probe.installed_from_paths([str(site), str(later)], wanted)
    assert probe.backend_versions(everything) == {"mlx-cpu": "0.31.0", "mlx-cuda-13": "0.32.4"}


def test_in_threads_keeps_order_and_hands_back_errors() -> None:
    ticks: list[int] = []

    def square(x: int) -> int:
        if x == 3:
            raise OSError("boom")
        return x * x

    outcomes = probe.in_threads(square, list(range(6)), 4, tick=lambda: ticks.append(1), every=0.01)
    assert [o.value for o in outcomes] == [0, 1, 4, None, 16, 25]
    assert isinstance(outcomes[3].error, OSError) and all(o.error is None for i, o in enumerate(outcomes) if i != 3)
    assert probe.in_threads(square, [], 4) == []
