"""Atomic, self-verifying training checkpoints.

Layout (one copy per node, written by that node's checkpoint-writer rank, see `worker.train`):

    <run_dir>/checkpoints/
        .lock                      flock held by the writer for its whole life (a second writer fails loudly)
        latest                     "step-000020\\n": the newest complete checkpoint (atomically replaced)
        step-000010/
        step-000020/
            weights.safetensors    trainable parameters only (LoRA/DoRA: the adapters) -- mlx-lm names
            adapters.safetensors   -> weights.safetensors (relative symlink): with adapter_config.json the dir
                                   is an mlx-lm adapter path (`mlx_lm.utils.load(model, adapter_path=dir)`)
            adapter_config.json    fine_tune_type, num_layers, lora_parameters (mlx-lm's format)
            optimizer.safetensors  tree_flatten(optimizer.state): "step", "learning_rate", "<param>.m", ...
            state.json             step, data position, epoch, RNG, config digest, world plan (see worker.train)
            manifest.sha256        `sha256sum` format ("<hex>  <name>") over every other regular file, sorted

A checkpoint is written into `step-N.tmp-<pid>/`, every file fsynced, the manifest last, the directory fsynced,
then renamed to `step-N` and the parent fsynced: a crash at any point leaves either no `step-N` or a complete
one. Older checkpoints are pruned (newest `keep` kept) only after the new one is in place and `latest` names
it. Readers never trust names alone: `verify_checkpoint` re-hashes every file against the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from worker.tensorfile import sha256_file

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.sha256"
LATEST = "latest"
LOCK = ".lock"
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_ALIAS = "adapters.safetensors"
REQUIRED_FILES = (WEIGHTS, OPTIMIZER, STATE)

_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_RE = re.compile(r"^step-\d{6,}\.(tmp|old)-\d+$")

FileWriter = Callable[[Path], None]


class CheckpointError(Exception):
    """A checkpoint could not be written or read."""


class CheckpointInvalid(CheckpointError):
    """A checkpoint directory failed verification (missing/extra/truncated/corrupt file, bad manifest)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    manifest_sha256: str


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"negative step {step}")
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """Step of a final checkpoint dir name (`step-000020` -> 20); None for anything else (tmp dirs included)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


# --- durability helpers ----------------------------------------------------------------------------------------


def _fsync_fd(fd: int) -> None:
    # macOS fsync() does not flush the drive's cache; F_FULLFSYNC does (not all filesystems support it).
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes renames/creations inside `path` durable
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        _fsync_fd(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# --- manifest ----------------------------------------------------------------------------------------------------


def build_manifest(entries: Mapping[str, str]) -> str:
    """`sha256sum` format, sorted by name: `<64 hex>  <name>\\n` per file."""
    return "".join(f"{entries[name]}  {name}\n" for name in sorted(entries))


def parse_manifest(text: str) -> dict[str, str]:
    """Inverse of `build_manifest`; raises CheckpointInvalid on any malformed line or duplicate name."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64}) [ *]([^/\x00]+)", line)
        if not m:
            raise CheckpointInvalid(f"manifest line {lineno} is malformed: {line[:100]!r}")
        if m.group(2) in out:
            raise CheckpointInvalid(f"manifest names {m.group(2)} twice")
        out[m.group(2)] = m.group(1)
    if not out:
        raise CheckpointInvalid("manifest is empty")
    return out


def verify_checkpoint(path: Path) -> str:
    """Check a checkpoint dir against its manifest; return the manifest's own SHA256.

    Invalid when: the manifest is missing/malformed, a required file is not listed, a listed file is missing or
    its hash differs (truncation included), a regular file is not listed, the adapter alias is not the expected
    symlink, or state.json's step disagrees with the directory name."""
    manifest_path = path / MANIFEST
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointInvalid("manifest.sha256 missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointInvalid(f"manifest.sha256 unreadable: {exc}") from None
    entries = parse_manifest(text)
    for name in REQUIRED_FILES:
        if name not in entries:
            raise CheckpointInvalid(f"{name} not in manifest")
    present = {p.name for p in path.iterdir() if p.is_file() and not p.is_symlink()} - {MANIFEST}
    if extra := sorted(present - set(entries)):
        raise CheckpointInvalid(f"files not in manifest: {', '.join(extra)}")
    for name, expected in sorted(entries.items()):
        file = path / name
        if not file.is_file() or file.is_symlink():
            raise CheckpointInvalid(f"{name} missing")
        actual = sha256_file(file)
        if actual != expected:
            raise CheckpointInvalid(f"{name}: sha256 {actual[:12]}... != manifest {expected[:12]}... "
                                    f"(truncated or corrupt, {file.stat().st_size} bytes)")
    alias = path / ADAPTER_ALIAS
    if (alias.exists() or alias.is_symlink()) and not (alias.is_symlink() and os.readlink(alias) == WEIGHTS):
        raise CheckpointInvalid(f"{ADAPTER_ALIAS} is not a symlink to {WEIGHTS}")
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointInvalid(f"state.json does not parse: {exc}") from None
    step = parse_step_dir(path.name)
    if step is not None and state.get("step") != step:
        raise CheckpointInvalid(f"state.json step {state.get('step')} != directory step {step}")
    return sha256_file(manifest_path)


# --- discovery ---------------------------------------------------------------------------------------------------


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Final-named checkpoint dirs under `root`, newest step first (unverified; tmp dirs never listed)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step_dir(child.name)
        if step is not None and child.is_dir() and not child.is_symlink():
            found.append((step, child))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def find_valid_checkpoint(root: Path, on_invalid: Callable[[int, Path, str], None] | None = None,
                          max_step: int | None = None) -> Checkpoint | None:
    """Newest checkpoint under `root` (at most `max_step`) that verifies; each one skipped on the way is
    reported through `on_invalid(step, path, reason)`. None when there is no valid checkpoint."""
    for step, path in list_checkpoints(root):
        if max_step is not None and step > max_step:
            continue
        try:
            sha = verify_checkpoint(path)
        except CheckpointInvalid as exc:
            if on_invalid is not None:
                on_invalid(step, path, str(exc))
            continue
        return Checkpoint(step, path, sha)
    return None


def read_latest(root: Path) -> Path | None:
    """The dir the `latest` file names, if the file exists and names a final checkpoint dir (unverified)."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return root / name if parse_step_dir(name) is not None else None


# --- writing -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def writer_lock(root: Path) -> Iterator[IO[str]]:
    """Hold an exclusive flock on `<root>/.lock` for the duration (released by the kernel if we die).

    Raises CheckpointError at once when another live process holds it: two writers in one checkpoint dir (two
    ranks on one machine that the plan put on different node names) would race on every file."""
    root.mkdir(parents=True, exist_ok=True)
    fh = open(root / LOCK, "a+", encoding="utf-8")  # noqa: SIM115 -- held open for the whole block
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"another process writes checkpoints in {root} (lock held): ranks sharing a "
                                  "machine and run dir must share a node name") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        yield fh
    finally:
        fh.close()


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete `step-N.tmp-<pid>` / `step-N.old-<pid>` dirs left by a crashed writer. Only the single writer of
    `root` calls this (it holds the lock), so every temporary found is dead."""
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if _TMP_RE.match(child.name) and child.is_dir():
                shutil.rmtree(child)
                removed.append(child)
    return removed


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` (>= 1) final checkpoint dirs; return what was deleted."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    doomed = [path for _, path in list_checkpoints(root)[keep:]]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        fsync_dir(root)
    return doomed


def discard_newer(root: Path, step: int) -> list[Path]:
    """Delete final checkpoint dirs newer than `step` (used after resuming from `step`: they failed verification
    or belong to an abandoned timeline, and must not shadow what this run writes next)."""
    doomed = [path for s, path in list_checkpoints(root) if s > step]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        fsync_dir(root)
    return doomed


def write_checkpoint(root: Path, step: int, files: Mapping[str, FileWriter], *, keep: int,
                     alias_adapters: bool = True) -> Checkpoint:
    """Write one checkpoint atomically and return it (with the manifest's SHA256).

    `files` maps a file name to a function that writes that file at the given path (it need not fsync). Any
    exception from a writer (or the filesystem) propagates after the temporary dir is removed on a best-effort
    basis; the previous checkpoints and `latest` are untouched. A pre-existing `step-N` (e.g. a corrupt one that
    resume skipped) is replaced only once the new one is complete."""
    for name in REQUIRED_FILES:
        if name not in files:
            raise ValueError(f"checkpoint needs {name}")
    if MANIFEST in files or LATEST in files or any("/" in name for name in files):
        raise ValueError("invalid checkpoint file names")
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        hashes: dict[str, str] = {}
        for fname, writer in sorted(files.items()):
            path = tmp / fname
            writer(path)
            fsync_file(path)
            hashes[fname] = sha256_file(path)
        if alias_adapters:
            os.symlink(WEIGHTS, tmp / ADAPTER_ALIAS)
        manifest = tmp / MANIFEST
        with open(manifest, "w", encoding="utf-8") as fh:
            fh.write(build_manifest(hashes))
            fh.flush()
            _fsync_fd(fh.fileno())
        manifest_sha = sha256_file(manifest)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside: Path | None = None
    if final.exists():
        aside = root / f"{name}.old-{os.getpid()}"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(root)
    write_file_atomic(root / LATEST, f"{name}\n".encode())
    if aside is not None:
        shutil.rmtree(aside)
    prune_checkpoints(root, keep)
    return Checkpoint(step, final, manifest_sha)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
