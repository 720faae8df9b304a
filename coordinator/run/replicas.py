"""A pipeline stage's newest checkpoint shard, kept on a second node while the run trains.

Each stage holds layers no other node has: when its node is lost for good (a pulled cable, a dead machine), so is
its shard, and no relaunch on the survivors could resume. So once a step's checkpoint is complete (every stage
reported its shard), the coordinator copies stage i's shard to the node of stage i+1 (the last stage's to the
first's), as `checkpoints/stage-<i>-from-<node>/step-N/`, the layout a resume's own copies use
(`run.resume.copy_shards`): the resume scan finds it there like any shard, checked against the checkpoint's
manifest. Only the newest replicated step is kept in such a dir (older ones are removed after the new one is in
place); the stage's own dir is never touched. A copy that fails is said (`events.jsonl`, a `supervisor` line),
never the run's failure: the next checkpoint tries again.

`compute_replicas` is pure (which copies, for which step); `replicate` carries them out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.errors import TransportError
from coordinator.fleet.transport import Fleet
from coordinator.run.resume import ShardCopy, copy_shards


@dataclass(frozen=True)
class StageShard:
    """A stage's newest checkpoint as its events report it: its rank (= stage), node, step and shard dir."""

    rank: int
    node: str
    step: int | None
    path: str | None


def compute_replicas(stages: Sequence[StageShard], *, done: int) -> tuple[int, tuple[ShardCopy, ...]] | None:
    """The copies that put each stage's shard of the newest step every stage has written on its ring neighbour's
    node, and that step; None when no step newer than `done` (the last one replicated) is complete, or when there
    is no second node (one stage, or every stage on one node)."""
    nodes = {s.node for s in stages}
    if len(stages) < 2 or len(nodes) < 2 or any(s.step is None or not s.path for s in stages):
        return None
    steps = {s.step for s in stages}
    if len(steps) != 1:
        return None  # the stages write the same step together: wait until each has reported it
    step = steps.pop()
    assert step is not None
    if step <= done:
        return None
    ordered = sorted(stages, key=lambda s: s.rank)
    copies = []
    for i, s in enumerate(ordered):
        dest = next(t for t in ordered[i + 1:] + ordered[:i] if t.node != s.node)  # the next stage on another node
        # A rank node's name (`box/gpu1`) must not nest the copy a dir deeper, where no shard scan looks.
        copies.append(ShardCopy(s.node, str(s.path), dest.node, f"stage-{s.rank}-from-{s.node.replace('/', '-')}"))
    return step, tuple(copies)


PRUNE = 'cd "$1" && for d in step-*; do [ "$d" = "$2" ] || rm -rf -- "$d"; done'


async def replicate(fleet: Fleet, run_dirs: Mapping[str, str], copies: Sequence[ShardCopy]) -> None:
    """Make `copies` (`copy_shards`: streamed through this machine, unpacked beside and renamed into place), then
    remove the older steps of each replica dir. Raises CoordinatorError (ResumeRefused, TransportError) naming
    what failed."""
    await copy_shards(fleet, run_dirs, copies)

    async def prune(c: ShardCopy) -> None:
        name = c.path.rstrip("/").rsplit("/", 1)[-1]
        result = await fleet.transports[c.dest].run(
            ["sh", "-c", PRUNE, "sh", f"{run_dirs[c.dest]}/checkpoints/{c.dir_name}", name], timeout=60)
        if not result.ok:
            raise TransportError(c.dest, f"could not prune {c.dir_name}: {result.stderr.strip()[-300:]}")

    await asyncio.gather(*(prune(c) for c in copies))
