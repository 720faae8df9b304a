"""Resuming from stage shards, for every strategy that writes them (pipeline, fsdp): which step every rank can resume
from, and a shard's arrays checked against the digests its checkpoint's manifest records.

The two strategies differ in how a rank cuts its part out of the shards (layers for a pipeline stage, rows of every
parameter for an fsdp rank); the agreement on the step and the digest check are the same, so they live here once.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from worker.chaos import arrays_sha256
from worker.checkpoint import OPTIMIZER, WEIGHTS, scan_checkpoints, set_aside_invalid
from worker.errors import ResumeRefused
from worker.events import EventKind
from worker.parallel.base import Strategy, load_arrays
from worker.parallel.pipeline.shards import Shard, StepVerdict, evaluate_steps, scan_shards

RESUME_CANDIDATES = 8  # newest complete steps per rank compared when the ranks agree on a resume step


def newest_common_step(strategy: Strategy, own: Path, everything: Path, *, shard_of: str, holders: str,
                       others: int = 0, others_note: str = "") -> StepVerdict | None:
    """The newest step whose checkpoint is complete (a valid shard of every `shard_of` that wrote it) on every rank,
    or None to start at step 0. Every rank must call it (a collective). `own`: this rank's shard directory (its
    invalid checkpoints are reported and set aside, never deleted); `everything`: the run's checkpoints directory.
    `others` counts checkpoints of another layout there (a refusal names them with `others_note`). With checkpoints
    but no common complete step, the resume is refused unless the config says `restart_from_scratch`."""
    cfg = strategy.config
    invalid = [v for v in scan_checkpoints(own) if not v.valid]
    for v in invalid:
        strategy.on_invalid(v.step, v.path, v.reason)
    steps = evaluate_steps(scan_shards(everything))
    complete = [v.step for v in steps if v.complete][:RESUME_CANDIDATES]
    gathered = strategy.comm.gather_ints([len(invalid) + len(steps) + others, *complete,
                                          *[-1] * (RESUME_CANDIDATES - len(complete))])
    common = set.intersection(*({s for s in row[1:] if s >= 0} for row in gathered))
    if invalid:
        moved = [str(set_aside_invalid(own, v.step, v.code)) for v in invalid]
        strategy.log.emit(EventKind.WARNING, code="set_aside_invalid",
                          message=f"invalid checkpoints set aside (kept, never resumed from): {moved}")
    if common:
        return next(v for v in steps if v.step == max(common))
    some = any(row[0] or any(s >= 0 for s in row[1:]) for row in gathered)
    if some and not cfg.restart_from_scratch:
        why = "; ".join(f"step {v.step}: {v.missing}" for v in steps if not v.complete)[:1500]
        raise ResumeRefused(
            f"no step has a complete checkpoint (a valid shard of every {shard_of}) on every rank (complete steps "
            "per rank: " + "; ".join(f"rank {r}: {[s for s in row[1:] if s >= 0]}" for r, row in enumerate(gathered))
            + (f"; here: {why}" if why else "") + (f"; {others_note}" if others and others_note else "")
            + "): refusing to start from step 0 over them (restart_from_scratch starts over)")
    strategy.log.emit(EventKind.WARNING, code="no_checkpoint",
                      message=f"resume requested but the {holders} hold no common complete checkpoint: starting at "
                              "step 0" + (" (restart_from_scratch)" if some else ""))
    return None


def load_verified(shard: Shard) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """A shard's weights and optimizer state, each checked against the digest the checkpoint's manifest records for
    it: a shard altered after it was written is refused, naming it."""
    weights, opt_state = load_arrays(shard.path / WEIGHTS), load_arrays(shard.path / OPTIMIZER)
    for label, arrays, want in (("weights", weights, shard.entry.weights_sha256),
                                ("optimizer state", opt_state, shard.entry.optimizer_sha256)):
        if (got := arrays_sha256(arrays)) != want:
            raise ResumeRefused(f"{shard.path}: its {label} digest {got[:12]}... differs from the checkpoint "
                                f"manifest's {want[:12]}...: the shard changed after it was written")
    return weights, opt_state
