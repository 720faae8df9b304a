"""Resume never loses work: before any rank starts, the coordinator lists and verifies every node's checkpoints.

    scan (per node, over its own connection: `python -m worker.checkpoint scan`)
    -> decide_resume (pure: the step to resume from, what to set aside, or a refusal)
    -> set aside (per node: `python -m worker.checkpoint set-aside`, under the node's writer lock)

The ranks would pick the same step (each takes its node's newest valid checkpoint, and they agree on the newest
any of them has): the scan lets the coordinator say so before launching, and refuse when there is nothing valid
to resume from while invalid checkpoints exist. Refusing changes nothing on the nodes, so an operator can still
repair a checkpoint; `--restart-from-scratch` sets the invalid ones aside (`step-N.invalid-<code>`, never
deleted) and starts at step 0. The ranks check the same thing again (`worker.train.ResumeRefused`) in case a
checkpoint changed in between.

A pipeline run's checkpoints are stage shards (`checkpoints/stage-*/step-N/`, `worker.parallel.pipeline.shards`),
and so are an fsdp run's (each rank the whole state of its even share of the blocks: `worker.parallel.fsdp`),
and a step counts only when every stage of its manifest has a valid shard. They may be spread over the nodes (each
stage wrote its own), so the coordinator decides over the union (`decide_pipeline_resume`, the worker's rule) and
first copies every shard of the chosen checkpoint to every node that lacks it (`copy_shards`, as
`checkpoints/stage-<i>-from-<node>/`): then each rank, of the same split or another one, finds the layers of
its range on its own node. Invalid shards are left for the ranks to set aside (each its own).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import CoordinatorError, TransportError
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, python_argv
from coordinator.models import Node
from coordinator.run.logs import current_redactor

SCAN_TIMEOUT_S = 600.0  # verifying re-hashes the newest checkpoints: a full fine-tune's are large
_SHARD_SCAN = "import sys; from worker.parallel.pipeline.shards import main; sys.exit(main(sys.argv[1:]))"


class ResumeRefused(CoordinatorError):
    """Checkpoints exist but none is valid on any node: starting from step 0 over them would lose the run."""


@dataclass(frozen=True)
class CheckpointVerdict:
    """One checkpoint dir on one node, as its node verified it (`worker.checkpoint.Verdict`)."""

    node: str
    step: int
    path: str
    valid: bool
    reason: str = ""
    code: str = ""

    @property
    def dir_name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        return f"{self.node}:{self.path}" + ("" if self.valid else f": {self.reason}")


@dataclass(frozen=True)
class ScanFailed:
    """A node whose checkpoints could not be listed (the evidence says why)."""

    node: str
    reason: str


NodeScan = tuple[CheckpointVerdict, ...] | ScanFailed


@dataclass(frozen=True)
class ResumeDecision:
    """Where a resumed attempt starts: `step` None is step 0. `set_aside` are the invalid checkpoints to move
    out of the way first (every invalid one found: none may shadow, or make pruning delete, what comes next)."""

    step: int | None
    checkpoint: CheckpointVerdict | None
    set_aside: tuple[CheckpointVerdict, ...]
    from_scratch: bool = False  # --restart-from-scratch was needed (invalid checkpoints, nothing valid)
    gathered: tuple[str, ...] = ()  # pipeline: the stage shards copied between nodes first ("src:path -> dest")

    def describe(self) -> str:
        aside = f"; {len(self.set_aside)} invalid checkpoint(s) set aside" if self.set_aside else ""
        if self.gathered:
            aside += f"; {len(self.gathered)} stage shard(s) copied between nodes"
        if self.checkpoint is not None:
            return f"resumed from step {self.step} (checkpoint {self.checkpoint.node}:{self.checkpoint.path}){aside}"
        if self.from_scratch:
            return f"restarted from scratch at step 0 (--restart-from-scratch){aside}"
        return "resumed from step 0: no checkpoint on any node"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step or 0, "checkpoint": self.checkpoint.path if self.checkpoint else None,
                "node": self.checkpoint.node if self.checkpoint else None, "from_scratch": self.from_scratch,
                "set_aside": [{"node": v.node, "path": v.path, "reason": v.reason} for v in self.set_aside]}


def parse_scan(node: str, stdout: str) -> NodeScan:
    """The last stdout line of `worker.checkpoint scan`; anything else is a ScanFailed with the text."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
        items = doc["checkpoints"] if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise ValueError("no checkpoints list")
        return tuple(CheckpointVerdict(node, int(c["step"]), str(c["path"]), bool(c["valid"]),
                                       str(c.get("reason") or ""), str(c.get("code") or "")) for c in items)
    except (ValueError, KeyError, TypeError) as exc:
        return ScanFailed(node, f"unreadable scan output ({exc}): {stdout.strip()[-300:]!r}")


def decide_resume(scans: Mapping[str, NodeScan], *, restart_from_scratch: bool, run_id: str = "") -> ResumeDecision:
    """The newest valid checkpoint any node has (the one the ranks will agree on), or step 0 when no node has
    any checkpoint. Raises ResumeRefused, naming every invalid checkpoint and why, when checkpoints exist (or a
    node could not be listed) but none is valid, unless `restart_from_scratch`."""
    verdicts = [v for scan in scans.values() if not isinstance(scan, ScanFailed) for v in scan]
    failed = [scan for scan in scans.values() if isinstance(scan, ScanFailed)]
    invalid = tuple(sorted((v for v in verdicts if not v.valid), key=lambda v: (v.node, -v.step)))
    valid = [v for v in verdicts if v.valid]
    if valid:
        best = max(valid, key=lambda v: v.step)  # ties: the first node listed (the ranks broadcast from rank 0's)
        return ResumeDecision(best.step, best, invalid)
    if not invalid and not failed:
        return ResumeDecision(None, None, ())
    if restart_from_scratch:
        return ResumeDecision(None, None, invalid, from_scratch=True)
    lines = [f"  {v.node}: {v.path}: {v.reason}" for v in invalid]
    lines += [f"  {f.node}: could not list checkpoints: {f.reason}" for f in failed]
    raise ResumeRefused(
        f"--resume {run_id}: no valid checkpoint on any node, refusing to start over from step 0:\n"
        + "\n".join(lines)
        + "\nrepair them, or pass --restart-from-scratch to set them aside (kept, renamed step-N.invalid-<why>) "
          "and train from step 0")


# --- pipeline runs: stage shards, complete only together -------------------------------------------------------


@dataclass(frozen=True)
class ShardVerdict:
    """One stage shard on one node (`python -m worker.parallel.pipeline.shards scan`): its step, its stage in
    the checkpoint's manifest, and the manifest's id (shards with equal ids make one checkpoint)."""

    node: str
    step: int
    index: int
    path: str
    valid: bool
    reason: str = ""
    stages: int | None = None
    first_layer: int | None = None
    last_layer: int | None = None
    manifest_id: str | None = None


ShardScan = tuple[ShardVerdict, ...] | ScanFailed


@dataclass(frozen=True)
class ShardCopy:
    """Copy `source`'s shard dir `path` to `dest` (as `<dest run dir>/checkpoints/<dir_name>/step-N`)."""

    source: str
    path: str
    dest: str
    dir_name: str


@dataclass(frozen=True)
class PipelineResume:
    """Where a resumed pipeline starts (`step` None: step 0) and the shards to copy first, so that every node
    holds every stage shard of that checkpoint (a rank of a new split may need any layer)."""

    step: int | None
    shards: tuple[ShardVerdict, ...]
    copies: tuple[ShardCopy, ...]
    from_scratch: bool = False


def parse_shard_scan(node: str, stdout: str) -> ShardScan:
    """The last stdout line of `worker.parallel.pipeline.shards scan`; anything else is a ScanFailed."""
    lines = stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
        items = doc["shards"] if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise ValueError("no shards list")

        def opt(v: Any) -> int | None:
            return None if v is None else int(v)

        return tuple(ShardVerdict(node, int(c["step"]), int(c["index"]), str(c["path"]), bool(c["valid"]),
                                  str(c.get("reason") or ""), opt(c.get("stages")), opt(c.get("first_layer")),
                                  opt(c.get("last_layer")), c.get("manifest_id") or None) for c in items)
    except (ValueError, KeyError, TypeError) as exc:
        return ScanFailed(node, f"unreadable shard scan output ({exc}): {stdout.strip()[-300:]!r}")


def decide_pipeline_resume(scans: Mapping[str, ShardScan], *, restart_from_scratch: bool,
                           run_id: str = "", receivers: Sequence[str] | None = None) -> PipelineResume:
    """The newest checkpoint whose stages all have a valid shard on SOME node (the worker's rule,
    `worker.parallel.pipeline.shards.evaluate_steps`, over the union of the nodes), and the copies that put every
    one of its shards on every node (of `receivers` when given: the nodes that will train; the others are only
    sources, e.g. the run dir of a quarantined GPU on a surviving machine). None found while shards exist (or a
    node could not be listed): ResumeRefused
    naming, per step, the stages (and layers) without a valid copy, unless `restart_from_scratch`."""
    found = [v for scan in scans.values() if not isinstance(scan, ScanFailed) for v in scan]
    failed = [scan for scan in scans.values() if isinstance(scan, ScanFailed)]
    groups: dict[tuple[int, str], list[ShardVerdict]] = {}
    for v in found:
        if v.valid and v.manifest_id and v.stages:
            groups.setdefault((v.step, v.manifest_id), []).append(v)
    complete = [(key, members) for key, members in groups.items()
                if {m.index for m in members} == set(range(members[0].stages or 0))]
    if complete:
        (step, _), members = max(complete, key=lambda km: km[0][0])
        first: dict[int, ShardVerdict] = {}
        for m in members:
            first.setdefault(m.index, m)
        copies = []
        for node in (scans if receivers is None else receivers):
            held = {m.index for m in members if m.node == node}
            # A rank node's name (`box/gpu1`: fsdp and pipelines over GPUs) must not nest the copy a dir deeper,
            # where no shard scan looks.
            copies += [ShardCopy(first[i].node, first[i].path, node,
                                 f"stage-{i}-from-{first[i].node.replace('/', '-')}")
                       for i in sorted(first) if i not in held]
        return PipelineResume(step, tuple(first[i] for i in sorted(first)), tuple(copies))
    if not found and not failed:
        return PipelineResume(None, (), ())
    if restart_from_scratch:
        return PipelineResume(None, (), (), from_scratch=True)
    lines = []
    for step in sorted({v.step for v in found}, reverse=True):
        here = [v for v in found if v.step == step]
        stages = max((v.stages or 0 for v in here), default=0)
        have = {v.index for v in here if v.valid}
        missing = [i for i in range(stages) if i not in have] if stages else []
        bad = "; ".join(f"{v.node}:{v.path}: {v.reason}" for v in here if not v.valid)
        what = (f"no valid shard of stage(s) {missing} on any node" if missing or not stages else
                "its valid shards belong to different checkpoints (their manifests differ)")
        lines.append(f"  step {step}: {what}" + (f" ({bad})" if bad else ""))
    lines += [f"  {f.node}: could not list shards: {f.reason}" for f in failed]
    raise ResumeRefused(f"--resume {run_id}: no complete pipeline checkpoint (a valid shard of every stage) on the "
                        "nodes, refusing to start over from step 0:\n" + "\n".join(lines)
                        + "\nbring back the node holding them, or pass --restart-from-scratch to train from step 0")


async def scan_checkpoints(fleet: Fleet, nodes: Sequence[Node], run_dirs: Mapping[str, str]) -> dict[str, NodeScan]:
    """Every node's checkpoints under `<run dir>/checkpoints`, newest first down to its newest valid one."""
    async def one(node: Node) -> NodeScan:
        try:
            out = await _checkpoint_tool(fleet, node, "scan", f"{run_dirs[node.name]}/checkpoints")
        except TransportError as exc:
            return ScanFailed(node.name, str(exc))
        return parse_scan(node.name, out)

    results = await asyncio.gather(*(one(n) for n in nodes))
    return {n.name: r for n, r in zip(nodes, results, strict=True)}


async def scan_shards(fleet: Fleet, nodes: Sequence[Node], run_dirs: Mapping[str, str]) -> dict[str, ShardScan]:
    """Every node's pipeline stage shards under `<run dir>/checkpoints/stage-*` (none for a dp run)."""
    async def one(node: Node) -> ShardScan:
        transport = fleet.transports[node.name]
        try:
            worker_dir = await ship_worker(transport, node)
            # -c, not -m: the package imports the module first, and runpy would warn about running it again.
            argv = ["env", f"PYTHONPATH={worker_dir}", *python_argv(
                node.python, "-c", _SHARD_SCAN, "scan", f"{run_dirs[node.name]}/checkpoints")]
            result = await transport.run(argv, timeout=SCAN_TIMEOUT_S)
        except TransportError as exc:
            return ScanFailed(node.name, str(exc))
        if not result.ok:
            return ScanFailed(node.name, f"shard scan failed: {result.stderr.strip()[-400:]}")
        return parse_shard_scan(node.name, result.stdout)

    results = await asyncio.gather(*(one(n) for n in nodes))
    return {n.name: r for n, r in zip(nodes, results, strict=True)}


async def copy_shards(fleet: Fleet, run_dirs: Mapping[str, str], copies: Sequence[ShardCopy]) -> None:
    """Carry out the copies (tar streamed node to node through this machine, unpacked beside and then renamed
    into place: a copy cut short leaves no half shard). A failure raises ResumeRefused naming it."""
    from coordinator.run.export import UNTAR_INTO, relay_tar

    async def one(c: ShardCopy) -> None:
        parent, name = c.path.rstrip("/").rsplit("/", 1)
        await relay_tar(fleet.transports[c.source], ["tar", "-C", parent, "-cf", "-", name],
                        fleet.transports[c.dest],
                        ["sh", "-c", UNTAR_INTO, "sh", f"{run_dirs[c.dest]}/checkpoints/{c.dir_name}", name])

    results = await asyncio.gather(*(one(c) for c in copies), return_exceptions=True)
    if errors := [str(r) for r in results if isinstance(r, BaseException)]:
        raise ResumeRefused("could not copy the stage shards a resume needs: " + "; ".join(errors))


async def set_aside(fleet: Fleet, nodes: Sequence[Node], run_dirs: Mapping[str, str],
                    verdicts: Sequence[CheckpointVerdict]) -> None:
    """Rename the given invalid checkpoints to `step-N.invalid-<code>` on their nodes. A node where that fails
    (a writer still holds its lock, say) raises ResumeRefused naming it: nothing may start while an invalid
    checkpoint is in the way."""
    by_node: dict[str, list[CheckpointVerdict]] = {}
    for v in verdicts:
        by_node.setdefault(v.node, []).append(v)

    async def one(node: Node) -> None:
        mine = by_node.get(node.name)
        if mine:
            await _checkpoint_tool(fleet, node, "set-aside", f"{run_dirs[node.name]}/checkpoints",
                                   *(f"{v.dir_name}:{v.code}" for v in mine))

    results = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    if errors:
        raise ResumeRefused("could not set invalid checkpoints aside: " + "; ".join(errors))


async def _checkpoint_tool(fleet: Fleet, node: Node, *args: str) -> str:
    transport = fleet.transports[node.name]
    worker_dir = await ship_worker(transport, node)
    argv = ["env", f"PYTHONPATH={worker_dir}", *python_argv(node.python, "-m", "worker.checkpoint", *args)]
    result = await transport.run(argv, timeout=SCAN_TIMEOUT_S)
    if not result.ok:
        raise TransportError(node.name, f"worker.checkpoint {args[0]} failed: {result.stderr.strip()[-400:]}")
    return result.stdout


async def check_resume(fleet: Fleet, nodes: Sequence[Node], run_dirs: Mapping[str, str], *, run_id: str,
                       restart_from_scratch: bool, events_file: Path, sources: Sequence[Node] = ()) -> ResumeDecision:
    """Scan, decide (ResumeRefused propagates, with nothing changed on the nodes), set the invalid checkpoints
    aside, and record each one in the run's events.jsonl as a `checkpoint_invalid` line (the ranks, which would
    have reported them, no longer see them). `sources`: nodes left out of the next attempt whose stage shards may
    still be read (`run_dirs` names theirs too), never written to."""
    shard_scans = await scan_shards(fleet, [*nodes, *sources], run_dirs)
    if any(not isinstance(s, ScanFailed) and s for s in shard_scans.values()):  # a pipeline run's
        pipeline = decide_pipeline_resume({k: v for k, v in shard_scans.items()
                                           if not (isinstance(v, ScanFailed) and k in {n.name for n in sources})},
                                          restart_from_scratch=restart_from_scratch, run_id=run_id,
                                          receivers=[n.name for n in nodes])
        await copy_shards(fleet, run_dirs, pipeline.copies)
        head = pipeline.shards[0] if pipeline.shards else None
        return ResumeDecision(pipeline.step, None if head is None else CheckpointVerdict(
            head.node, head.step, head.path, True), (), from_scratch=pipeline.from_scratch,
            gathered=tuple(f"{c.source}:{c.path} -> {c.dest}" for c in pipeline.copies))
    scans = await scan_checkpoints(fleet, nodes, run_dirs)
    decision = decide_resume(scans, restart_from_scratch=restart_from_scratch, run_id=run_id)
    if decision.set_aside:
        await set_aside(fleet, nodes, run_dirs, decision.set_aside)
        with events_file.open("a", encoding="utf-8") as sink:
            for v in decision.set_aside:
                record = {"event": "checkpoint_invalid", "node": v.node, "step": v.step, "path": v.path,
                          "reason": v.reason, "code": v.code, "set_aside_by": "coordinator"}
                sink.write(json.dumps(current_redactor().value(record)) + "\n")
    return decision
