"""The worker's errors that end a run (`worker.train` turns them into an `error` event and exit 1)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A condition that makes continuing pointless or wrong (bad world, diverged loss, replicas differ...)."""


class ResumeRefused(TrainingError):
    """Resume found checkpoints but none valid on any rank: starting from step 0 over them would lose the run.

    A fault of the job, not of a node (every rank raises it together): its error event says `fault: job`, so
    the coordinator stops the run without quarantining anyone."""

    fault = "job"
