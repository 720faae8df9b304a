"""`coordinator export RUN_ID`: the run's newest complete checkpoint as what `mlx_lm.load` takes, on this machine.

    gather (pipeline: every other node's stage shards, streamed node to node as tar through this machine, into
            `<assembler run dir>/export-gather/<node>/` on the assembler, the run's first node)
    -> assemble (on the assembler: `python -m worker.export`, which picks the newest step whose checkpoint is
                 complete across all shards, checks each shard against the manifest's digests, and writes a
                 model dir for `full` or an adapter dir for LoRA; a dp run's own full copy needs no gathering)
    -> download (the result, as tar, into `--out`; then the remote staging dirs are removed)

The base model is read on the assembler (the path the run trained from). `--out` must not exist: an export never
writes over another, and nothing is written to it until the whole result has arrived."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import tarfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet, Transport, python_argv
from coordinator.models import Node
from coordinator.run.rundir import read_meta, run_inventory

EXPORT_TIMEOUT_S = 3600.0  # a full fine-tune's weights are large
CHUNK = 1 << 20
# The stage shard dirs of a node's checkpoints (none for a dp run): tar of every `stage-*` dir, without the
# writer's lock, unfinished or set-aside checkpoints.
_TAR_SHARDS = ('cd "$1" 2>/dev/null || exec tar -cf - -T /dev/null; set -- stage-*; [ -d "$1" ] || exec tar -cf - -T '
               '/dev/null; exec tar -cf - --exclude=.lock --exclude="*.tmp-*" --exclude="*.old-*" '
               '--exclude="*.invalid-*" "$@"')
_UNTAR = 'mkdir -p "$1" && exec tar -C "$1" -xf -'
# Unpack the tar of one dir `$2` into `$1/$2`, in a temporary dir first: a copy cut short leaves nothing half done.
UNTAR_INTO = ('set -e; mkdir -p "$1"; t="$1/.incoming-$$"; rm -rf "$t"; mkdir "$t"; tar -C "$t" -xf -; '
              'rm -rf "$1/$2"; mv "$t/$2" "$1/$2"; rmdir "$t"')


class ExportFailed(CoordinatorError):
    """The run's checkpoints could not be gathered or assembled (the node's own words say why)."""


@dataclass(frozen=True)
class ExportResult:
    run_id: str
    out: str
    node: str  # where it was assembled
    kind: str  # sharded (a pipeline's or fsdp's shards) | whole (a dp run's checkpoint)
    step: int
    method: str
    files: tuple[str, ...]
    gathered_from: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "out": self.out, "node": self.node, "kind": self.kind, "step": self.step,
                "method": self.method, "files": list(self.files), "gathered_from": list(self.gathered_from)}

    def describe(self) -> str:
        what = "model dir (mlx_lm.load(DIR))" if self.method == "full" else \
            "adapter dir (mlx_lm.load(BASE_MODEL, adapter_path=DIR))"
        gathered = f", shards gathered from {', '.join(self.gathered_from)}" if self.gathered_from else ""
        return (f"exported run {self.run_id} step {self.step} ({self.kind}, {self.method}) to {self.out}: a "
                f"{what}; assembled on {self.node}{gathered}")


def parse_export_output(node: str, stdout: str) -> dict[str, Any]:
    """The last stdout line of `worker.export`: its JSON object; anything else raises ExportFailed."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
        raise ExportFailed(f"{node}: unreadable worker.export output: {stdout.strip()[-300:]!r}")
    return doc


async def relay_tar(src: Transport, src_argv: Sequence[str], dst: Transport, dst_argv: Sequence[str]) -> None:
    """Stream `src_argv`'s stdout into `dst_argv`'s stdin (a tar, node to node, through this machine)."""
    reader = await src.open_binary(src_argv)
    writer = await dst.open_binary(dst_argv)
    try:
        while chunk := await reader.stdout.read(CHUNK):
            writer.stdin.write(chunk)
            await writer.stdin.drain()
        writer.stdin.write_eof()
        rc_src, rc_dst = await reader.wait(), await writer.wait()
    except BaseException:
        reader.kill()
        writer.kill()
        raise
    if rc_src != 0 or rc_dst != 0:
        err = (await reader.stderr.read(4000) if rc_src else await writer.stderr.read(4000))
        side = src.node.name if rc_src else dst.node.name
        raise TransportError(side, f"copying checkpoints failed: {err.decode(errors='replace').strip()[-400:]}")


async def _download_dir(src: Transport, remote_parent: str, name: str, out: Path) -> None:
    """`<remote_parent>/<name>` into `out` (which must not exist), through a tar on the node's stdout."""
    reader = await src.open_binary(["tar", "-C", remote_parent, "-cf", "-", name])
    buf = io.BytesIO()
    while chunk := await reader.stdout.read(CHUNK):
        buf.write(chunk)
    if await reader.wait() != 0:
        err = await reader.stderr.read(4000)
        raise TransportError(src.node.name, f"reading the export failed: {err.decode(errors='replace')[-400:]}")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        buf.seek(0)
        with tarfile.open(fileobj=buf, mode="r:") as tar:
            tar.extractall(tmp, filter="data")
        os.rename(tmp / name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def export_run(run_dir: Path, *, out: Path | None = None, inventory: str | None = None,
                     connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> ExportResult:
    """Export the run recorded in `run_dir` (see the module docstring) into `out` (default `<run_dir>/export`).
    Raises ConfigError (exit 2) for a bad run or `out`, ExportFailed/TransportError when the nodes cannot."""
    meta = read_meta(run_dir)
    target = (out or run_dir / "export").resolve()
    if target.exists():
        raise ConfigError(f"{target} exists: an export never writes over another (pass --out NEW_DIR)")
    inv = run_inventory(meta, inventory)
    nodes = [n for n in inv.nodes if n.name in meta.remote_run_dirs]
    if not nodes:
        raise ConfigError(f"{run_dir}: the run records no node run dirs (was it launched?)")
    async with Fleet(nodes, connect_timeout=connect_timeout) as fleet:
        return await export_on(fleet, nodes, meta.remote_run_dirs, meta.run_id, target)


async def export_on(fleet: Fleet, nodes: Sequence[Node], dirs: Mapping[str, str], run_id: str,
                    target: Path) -> ExportResult:
    """The export over an open fleet: `nodes` (the first assembles) with their run dirs `dirs`, into `target`
    (which must not exist)."""
    if target.exists():
        raise ConfigError(f"{target} exists: an export never writes over another (pass --out NEW_DIR)")
    assembler, others = nodes[0], list(nodes[1:])
    token = uuid.uuid4().hex[:8]
    gather_root = f"{dirs[assembler.name]}/export-gather-{token}"
    staged = f"{dirs[assembler.name]}/export-out-{token}"
    asm = fleet.transports[assembler.name]
    try:
        await asyncio.gather(*(relay_tar(fleet.transports[n.name],
                                         ["sh", "-c", _TAR_SHARDS, "sh", f"{dirs[n.name]}/checkpoints"],
                                         asm, ["sh", "-c", _UNTAR, "sh", f"{gather_root}/{n.name}"])
                               for n in others))
        worker_dir = await ship_worker(asm, assembler)
        roots = [f"{dirs[assembler.name]}/checkpoints", *(f"{gather_root}/{n.name}" for n in others)]
        argv = ["env", f"PYTHONPATH={worker_dir}",
                *python_argv(assembler.python, "-m", "worker.export", *(a for r in roots
                                                                        for a in ("--checkpoints", r)),
                             "--out", f"{staged}/export")]
        result = await asm.run(argv, timeout=EXPORT_TIMEOUT_S)
        if not result.ok:
            raise ExportFailed(f"{assembler.name}: {result.stderr.strip()[-600:]}")
        doc = parse_export_output(assembler.name, result.stdout)
        await _download_dir(asm, staged, "export", target)
    finally:
        await asm.run(["rm", "-rf", gather_root, staged], timeout=600.0)
    gathered = tuple(n.name for n in others)
    return ExportResult(run_id, str(target), assembler.name, str(doc.get("kind", "")), int(doc["step"]),
                        str(doc.get("method", "")), tuple(sorted(p.name for p in target.iterdir())),
                        gathered if doc.get("kind") == "sharded" else ())
