"""MLX's compiled CPU kernels, shared between processes whole or not at all.

MLX's CPU backend compiles each fused kernel (`mx.compile`: the train step, mlx-lm's activations) with
`g++ ... -o $TMPDIR/mlx/<version>/cpu/lib<name>.so` and then loads whatever file of that name it finds there,
without a lock (mlx/backend/cpu/compiled.cpp). So a process can load a file that another one is still writing, and
a file cut short when its compiler was killed (a `stop`, a chaos drill, an OOM kill, a timeout in the middle of a
cold start) stays in the cache for good. Loading such a file is a SIGBUS: the rank dies at its first step with no
message, and so does every later rank that needs that kernel, on every run, until someone deletes the file.

So each worker process compiles into a directory of its own and shares only whole files:

- `isolate()` points this process's TMPDIR (which MLX reads at every compile) at
  `<tmp>/mlxc-kernels-<uid>/<pid>-<token>`, seeded with hard links to the shared cache's complete files: a warm
  cache stays warm, and nothing another process writes can change a file this one loads.
- At exit, what it compiled is published into the shared cache by link and rename (atomic: a reader sees the old
  file or the whole new one), and a truncated file found there is replaced. A process that dies without exiting
  (SIGKILL) leaves its directory; the next `isolate()` on the machine publishes its complete files and removes it.
  Whether its process lives is the lock it holds on `<dir>/.alive` (flock, released by the kernel when the process
  dies), not its PID: a process in another PID namespace sharing this /tmp (a container) has a PID that means
  nothing here, and a dead process's PID can be reused. Dirs of workers from before the lock fall back to the PID.

"Complete" is read from the file itself: an ELF or Mach-O library whose headers and segments all lie inside it.
Python's own `tempfile` keeps the real temp dir (pinned before TMPDIR changes); child processes inherit the private
one, which is removed when this process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import shutil
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
MACHO_MAGIC_64 = b"\xcf\xfa\xed\xfe"  # MH_MAGIC_64, little-endian (arm64 and x86_64 Macs)
LIBRARY_SUFFIXES = (".so", ".dylib")
# The kernels' sources: written by MLX just before it compiles them and never read back (the CPU backend looks for
# the library, the CUDA one for .ptx and .txt), so neither seeded nor shared: half the files each process links.
SOURCE_SUFFIXES = (".cpp", ".cu")
ALIVE = ".alive"  # the lock file a process holds for as long as it lives (module docstring)

Read = Callable[[int, int], bytes]  # (offset, length) -> the bytes there


@dataclass(frozen=True)
class KernelCache:
    """The shared cache MLX would use on its own (`<tmp>/mlx`) and this process's private temp dir (its TMPDIR;
    MLX writes under `<private>/mlx`)."""

    shared: Path
    private: Path

    @property
    def compiled(self) -> Path:
        return self.private / "mlx"


def system_tmp(env: dict[str, str] | os._Environ[str] | None = None) -> Path:
    """The temp dir MLX's C++ side uses: std::filesystem::temp_directory_path (libstdc++ and libc++ read TMPDIR,
    TMP, TEMP, TEMPDIR in this order, else /tmp)."""
    env = os.environ if env is None else env
    for key in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if env.get(key):
            return Path(env[key])
    return Path("/tmp")


def shared_dir(version: str, env: dict[str, str] | None = None) -> Path:
    """Where MLX keeps the CPU kernels of `version` for every process of this user: `<tmp>/mlx/<version>`."""
    return system_tmp(env) / "mlx" / version


def _within(size: int, *spans: tuple[int, int]) -> bool:
    return all(offset >= 0 and length >= 0 and offset + length <= size for offset, length in spans)


def _elf_complete(head: bytes, size: int, read: Read) -> bool:
    if len(head) < 52:
        return False
    wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
    if wide:
        if len(head) < 64:
            return False
        phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
    else:
        phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
    if not _within(size, (phoff, phentsize * phnum), (shoff, shentsize * shnum)):
        return False
    table = read(phoff, phentsize * phnum)
    for i in range(phnum):
        entry = table[i * phentsize:(i + 1) * phentsize]
        # p_offset and p_filesz: Elf64_Phdr at 8 and 32, Elf32_Phdr at 4 and 16
        (offset,), (filesz,) = ((struct.unpack_from(order + "Q", entry, 8), struct.unpack_from(order + "Q", entry, 32))
                                if wide else
                                (struct.unpack_from(order + "I", entry, 4), struct.unpack_from(order + "I", entry, 16)))
        if not _within(size, (offset, filesz)):
            return False
    return True


def _macho_complete(head: bytes, size: int, read: Read) -> bool:
    if len(head) < 32:
        return False
    ncmds, sizeofcmds = struct.unpack_from("<II", head, 16)
    if not _within(size, (32, sizeofcmds)):
        return False
    cmds, at = read(32, sizeofcmds), 0
    for _ in range(ncmds):
        if at + 8 > len(cmds):
            return False
        cmd, cmdsize = struct.unpack_from("<II", cmds, at)
        if cmdsize < 8:
            return False
        if cmd == 0x19 and at + 56 <= len(cmds):  # LC_SEGMENT_64: fileoff, filesize at +40
            fileoff, filesize = struct.unpack_from("<QQ", cmds, at + 40)
            if not _within(size, (fileoff, filesize)):
                return False
        at += cmdsize
    return True


def is_complete(path: Path) -> bool:
    """Whether `path` is a whole file MLX may load: an ELF or Mach-O library whose headers and segments lie inside
    the file. Other files (the kernels' C++ sources) count as whole; an empty or unreadable library does not."""
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(64)

            def read(offset: int, length: int) -> bytes:
                fh.seek(offset)
                return fh.read(length)

            if head.startswith(ELF_MAGIC):
                return _elf_complete(head, size, read)
            if head.startswith(MACHO_MAGIC_64):
                return _macho_complete(head, size, read)
    except (OSError, struct.error):
        return False
    return not path.name.endswith(LIBRARY_SUFFIXES)


def _files(root: Path) -> list[tuple[Path, Path]]:
    """(path, path relative to root) of every regular file under root but sources and our in-flight temp files."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if (name.startswith(".") and ".tmp-" in name) or name.endswith(SOURCE_SUFFIXES):
                continue
            path = Path(dirpath) / name
            with contextlib.suppress(OSError):
                if stat.S_ISREG(path.lstat().st_mode):
                    out.append((path, path.relative_to(root)))
    return out


def publish(compiled: Path, shared: Path) -> int:
    """Put the complete files under `compiled` into `shared` by link (or copy) and rename, never over a complete
    file already there (a truncated one is replaced). Returns how many were published; problems are skipped: the
    shared cache is a speed-up, never a reason to fail."""
    published = 0
    for path, rel in _files(compiled):
        target = shared / rel
        with contextlib.suppress(OSError):
            if target.exists() and (os.path.samefile(path, target) or is_complete(target)):
                continue
            if not is_complete(path):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                os.link(path, tmp)
            except OSError:  # another filesystem
                shutil.copyfile(path, tmp)
            try:
                os.replace(tmp, target)
                published += 1
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
    return published


def _seed(shared: Path, compiled: Path) -> None:
    for path, rel in _files(shared):
        if not is_complete(path):
            continue  # compiled afresh here, and replaced in the shared cache at exit
        dest = compiled / rel
        with contextlib.suppress(OSError):
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, dest)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_gone(entry: Path) -> bool:
    """Whether the process whose private dir `entry` is has died: its lock on `.alive` can be taken (then it is
    let go at once), or, with no lock file (a worker from before it, or one killed before it made it), its PID
    (the name's first field, after the dot of a dir not yet renamed) names no process."""
    try:
        fd = os.open(entry / ALIVE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        pid = entry.name.lstrip(".").split("-", 1)[0]
        return pid.isdigit() and not _alive(int(pid))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: its process lives, in whatever PID namespace
    finally:
        os.close(fd)
    return True


def _reap(root: Path, shared: Path) -> None:
    """Publish and remove the dirs of processes that died without exiting."""
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if entry.name.lstrip(".")[:1].isdigit() and _owner_gone(entry):
                publish(entry / "mlx", shared)
                shutil.rmtree(entry, ignore_errors=True)


def _own_dir(path: Path) -> bool:
    """`path` exists (made now if missing) as a real dir of this user, mode 0700 (set if looser: the dir is ours):
    /tmp is shared by every user, and another user's dir or a symlink there is never used."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)
    return True


def isolate() -> KernelCache | None:
    """Make this process compile MLX's CPU kernels in a private dir seeded from the shared cache, published back at
    exit (see the module docstring). Call it before the first compile. Returns None, changing nothing, where the
    private dir cannot be made safely (MLX then uses the shared cache directly, as it would without us)."""
    tmp = system_tmp()
    shared = tmp / "mlx"
    root = tmp / f"mlxc-kernels-{os.geteuid()}"
    try:
        if not _own_dir(root):
            return None
        _reap(root, shared)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Made under a dot name and renamed once its lock is held, so no reaper ever sees it unlocked.
        staging = root / f".{name}"
        staging.mkdir(mode=0o700)
        lock = os.open(staging / ALIVE, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # never closed: the kernel lets it go when this process dies
        private = root / name
        staging.rename(private)
        _seed(shared, private / "mlx")
    except OSError:
        return None
    cache = KernelCache(shared, private)
    tempfile.gettempdir()  # Python's temp dir stays the real one: only MLX (and child processes) move
    os.environ["TMPDIR"] = str(private)
    atexit.register(release, cache)
    return cache


def release(cache: KernelCache) -> None:
    """Publish what this process compiled and remove its private dir (at exit)."""
    publish(cache.compiled, cache.shared)
    shutil.rmtree(cache.private, ignore_errors=True)
