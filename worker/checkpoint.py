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
one. Older checkpoints are pruned (the new one plus the `keep` - 1 newest older ones kept) only after the new one
is in place and `latest` names it; pruning never deletes the checkpoint just written nor anything newer.
Readers never trust names alone: `verify_checkpoint` re-hashes every file against the manifest.

A checkpoint found invalid on resume is never deleted: `set_aside_invalid` renames it to
`step-N.invalid-<code>` (e.g. `step-000020.invalid-sha256-mismatch`), a name that discovery, pruning and the
newest-checkpoint search never match again, so the operator can still inspect or repair it.

`python -m worker.checkpoint scan ROOT` and `... set-aside ROOT step-N:CODE ...` do the same for the
coordinator, which checks a resume before any rank starts (see `coordinator.run.resume`); each prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
INVALID_INFIX = ".invalid-"
_CODE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")

FileWriter = Callable[[Path], None]


class CheckpointError(Exception):
    """A checkpoint could not be written or read."""


class CheckpointInvalid(CheckpointError):
    """A checkpoint directory failed verification (missing/extra/truncated/corrupt file, bad manifest).

    `code` names the kind of damage in a few words fit for a directory name (`sha256-mismatch`, ...)."""

    def __init__(self, message: str, code: str = "invalid") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    manifest_sha256: str


@dataclass(frozen=True)
class Verdict:
    """One checkpoint dir as verified: valid (with its manifest's SHA256) or invalid (with why)."""

    step: int
    path: Path
    manifest_sha256: str | None  # None when invalid
    reason: str = ""
    code: str = ""

    @property
    def valid(self) -> bool:
        return self.manifest_sha256 is not None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "valid": self.valid, "sha256": self.manifest_sha256,
                "reason": self.reason, "code": self.code}


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
            raise CheckpointInvalid(f"manifest line {lineno} is malformed: {line[:100]!r}", "bad-manifest")
        if m.group(2) in out:
            raise CheckpointInvalid(f"manifest names {m.group(2)} twice", "bad-manifest")
        out[m.group(2)] = m.group(1)
    if not out:
        raise CheckpointInvalid("manifest is empty", "bad-manifest")
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
        raise CheckpointInvalid("manifest.sha256 missing", "no-manifest") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointInvalid(f"manifest.sha256 unreadable: {exc}", "bad-manifest") from None
    entries = parse_manifest(text)
    for name in REQUIRED_FILES:
        if name not in entries:
            raise CheckpointInvalid(f"{name} not in manifest", "bad-manifest")
    present = {p.name for p in path.iterdir() if p.is_file() and not p.is_symlink()} - {MANIFEST}
    if extra := sorted(present - set(entries)):
        raise CheckpointInvalid(f"files not in manifest: {', '.join(extra)}", "unlisted-file")
    for name, expected in sorted(entries.items()):
        file = path / name
        if not file.is_file() or file.is_symlink():
            raise CheckpointInvalid(f"{name} missing", "missing-file")
        actual = sha256_file(file)
        if actual != expected:
            raise CheckpointInvalid(f"{name}: sha256 {actual[:12]}... != manifest {expected[:12]}... "
                                    f"(truncated or corrupt, {file.stat().st_size} bytes)", "sha256-mismatch")
    alias = path / ADAPTER_ALIAS
    if (alias.exists() or alias.is_symlink()) and not (alias.is_symlink() and os.readlink(alias) == WEIGHTS):
        raise CheckpointInvalid(f"{ADAPTER_ALIAS} is not a symlink to {WEIGHTS}", "bad-alias")
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointInvalid(f"state.json does not parse: {exc}", "bad-state") from None
    if not isinstance(state, dict):
        raise CheckpointInvalid("state.json is not a JSON object", "bad-state")
    step = parse_step_dir(path.name)
    if step is not None and state.get("step") != step:
        raise CheckpointInvalid(f"state.json step {state.get('step')} != directory step {step}", "step-mismatch")
    return sha256_file(manifest_path)


# --- discovery ---------------------------------------------------------------------------------------------------


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Final-named checkpoint dirs under `root`, newest step first (unverified; tmp dirs never listed)."""
    if not root.is_dir():
        return []
    try:
        children = list(root.iterdir())
    except FileNotFoundError:  # removed since: a second rank on this node pruned the same emptied copy dir
        return []
    found = []
    for child in children:
        step = parse_step_dir(child.name)
        if step is not None and child.is_dir() and not child.is_symlink():
            found.append((step, child))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def check_checkpoint(step: int, path: Path) -> Verdict:
    """`verify_checkpoint` as a value: an unreadable directory is an invalid checkpoint, never an exception."""
    try:
        return Verdict(step, path, verify_checkpoint(path))
    except CheckpointInvalid as exc:
        return Verdict(step, path, None, str(exc), exc.code)
    except OSError as exc:
        return Verdict(step, path, None, f"unreadable: {exc}", "unreadable")


def scan_checkpoints(root: Path, max_step: int | None = None) -> list[Verdict]:
    """Verify the checkpoints under `root` (at most `max_step`) newest first, up to and including the first
    valid one: every invalid checkpoint newer than the newest valid one, then that one (if there is one).
    Older checkpoints are not read: resume never goes further back than the newest valid one."""
    out = []
    for step, path in list_checkpoints(root):
        if max_step is not None and step > max_step:
            continue
        verdict = check_checkpoint(step, path)
        out.append(verdict)
        if verdict.valid:
            break
    return out


def find_valid_checkpoint(root: Path, on_invalid: Callable[[int, Path, str], None] | None = None,
                          max_step: int | None = None) -> Checkpoint | None:
    """Newest checkpoint under `root` (at most `max_step`) that verifies; each one skipped on the way is
    reported through `on_invalid(step, path, reason)`. None when there is no valid checkpoint."""
    for verdict in scan_checkpoints(root, max_step):
        if verdict.manifest_sha256 is not None:
            return Checkpoint(verdict.step, verdict.path, verdict.manifest_sha256)
        if on_invalid is not None:
            on_invalid(verdict.step, verdict.path, verdict.reason)
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


def compute_prune(checkpoints: Sequence[tuple[int, Path]], keep: int, newest: int) -> list[Path]:
    """Which checkpoint dirs pruning deletes: of those OLDER than `newest` (the checkpoint just written), all but
    the `keep` - 1 newest. `newest` itself is never deleted, nor is anything newer than it: a newer dir is not
    this timeline's (an invalid one that resume did not set aside, or one a deliberate restart left), and
    counting it towards `keep` is how a new checkpoint used to be deleted right after it was written."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    older = sorted(((s, p) for s, p in checkpoints if s < newest), key=lambda sp: sp[0], reverse=True)
    return [p for _, p in older[keep - 1:]]


def prune_checkpoints(root: Path, keep: int, newest: int) -> list[Path]:
    """Delete the checkpoints `compute_prune` names under `root` (only final `step-N` dirs are ever seen: tmp,
    set-aside and invalid dirs are not); return what was deleted. Refuses (CheckpointError, nothing deleted)
    when `newest` is not a checkpoint dir under `root`: then nothing proves a newer valid state exists."""
    present = list_checkpoints(root)
    if not any(s == newest for s, _ in present):
        raise CheckpointError(f"not pruning {root}: its newest checkpoint {step_dir_name(newest)} is not there")
    doomed = compute_prune(present, keep, newest)
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        fsync_dir(root)
    return doomed


def invalid_name(step: int, code: str, taken: Iterable[str] = ()) -> str:
    """`step-000020.invalid-sha256-mismatch`, or with `-2`, `-3`... when that name is taken (a second invalid
    copy of the same step, set aside by a later resume)."""
    if not _CODE_RE.match(code):
        code = "invalid"
    base = f"{step_dir_name(step)}{INVALID_INFIX}{code}"
    used = set(taken)
    name, n = base, 1
    while name in used:
        n += 1
        name = f"{base}-{n}"
    return name


def set_aside_invalid(root: Path, step: int, code: str) -> Path:
    """Rename the invalid checkpoint `step-N` to `step-N.invalid-<code>` (never deleted: the operator may want
    to inspect or repair it) and drop `latest` if it named it; return the new path. Discovery, pruning and the
    newest-checkpoint search never see the new name."""
    path = root / step_dir_name(step)
    if not path.is_dir() or path.is_symlink():
        raise CheckpointError(f"{path} is not a checkpoint dir")
    dest = root / invalid_name(step, code, (p.name for p in root.iterdir()))
    os.rename(path, dest)
    latest = read_latest(root)
    if latest is not None and latest.name == path.name:
        (root / LATEST).unlink(missing_ok=True)
    fsync_dir(root)
    return dest


def write_checkpoint(root: Path, step: int, files: Mapping[str, FileWriter], *, keep: int,
                     alias_adapters: bool = True) -> Checkpoint:
    """Write one checkpoint atomically and return it (with the manifest's SHA256).

    `files` maps a file name to a function that writes that file at the given path (it need not fsync). Any
    exception from a writer (or the filesystem) propagates after the temporary dir is removed on a best-effort
    basis; the previous checkpoints and `latest` are untouched. A pre-existing `step-N` (which resume should
    have set aside already) is replaced only once the new one is complete, and kept as
    `step-N.invalid-superseded`: nothing that may hold training state is deleted except by pruning."""
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
        os.rename(aside, root / invalid_name(step, "superseded", (p.name for p in root.iterdir())))
        fsync_dir(root)
    prune_checkpoints(root, keep, step)
    return Checkpoint(step, final, manifest_sha)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# --- the coordinator's view (python -m worker.checkpoint) --------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`scan ROOT`: {"root", "checkpoints": [Verdict.to_json()...]} (see `scan_checkpoints`; nothing changes).
    `set-aside ROOT step-N:CODE...`: {"moved": {"step-N": new path}}, under the writer lock (a live writer
    makes it fail with exit 1). One JSON object on stdout; errors on stderr, exit 1."""
    parser = argparse.ArgumentParser(prog="worker.checkpoint", description="list and set aside checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    scan = sub.add_parser("scan")
    scan.add_argument("root")
    aside = sub.add_parser("set-aside")
    aside.add_argument("root")
    aside.add_argument("dirs", nargs="+", metavar="step-N:CODE")
    args = parser.parse_args(argv)
    root = Path(os.path.expanduser(args.root))
    try:
        if args.command == "scan":
            out: dict[str, Any] = {"root": str(root), "checkpoints": [v.to_json() for v in scan_checkpoints(root)]}
        else:
            moved = {}
            with writer_lock(root):
                for item in args.dirs:
                    name, _, code = item.partition(":")
                    step = parse_step_dir(name)
                    if step is None:
                        raise CheckpointError(f"not a checkpoint dir name: {name!r}")
                    moved[name] = str(set_aside_invalid(root, step, code))
            out = {"root": str(root), "moved": moved}
    except (CheckpointError, OSError) as exc:
        print(f"worker.checkpoint: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
