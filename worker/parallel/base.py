"""The strategy interface: what the trainer (`worker.train`) asks of a way of sharing the work between ranks.

A strategy owns this rank's part of the model and its optimizer, and answers for
* load: this rank's model (all of it, or its stage), the method applied, the data, the objective, the optimizer;
* rows: which rows of each global batch this rank builds (`Micro`s, `worker.objectives`);
* step: one optimizer step over those rows (a `worker.step.StepResult`: the trainer's step event reads it);
* trainable: the parameters this rank owns and trains, named as its checkpoint shard stores them;
* digest_peers: the ranks whose `digest` events must equal this rank's (replicas agree; stages hold other layers);
* check_start: that this rank starts from what its peers expect (replica fingerprints, a stage's layer range);
* checkpoints: where this rank's shard lives, whether this rank writes it, its arrays, and restore (resume);
* eval_sums: this rank's part of the validation sums (the trainer all_sums them once).

The trainer keeps everything that does not depend on the strategy: the world, events and heartbeats, chaos, the
step loop, the data position, state.json. A strategy may import the flat worker modules, never `worker.train`."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx

from worker.chaos import replica_digest
from worker.checkpoint import MANIFEST, OPTIMIZER, STATE, WEIGHTS
from worker.comm import Comm
from worker.errors import TrainingError
from worker.events import EventKind, EventLog, Progress
from worker.objectives import Micro
from worker.runconfig import RunConfig
from worker.step import Local, StepResult, flatten
from worker.tensorfile import sha256_file

STATE_FORMAT = "mlx-coordinator-checkpoint/1"


@dataclass
class ResumeState:
    step: int
    data_position: int
    checkpoint: Path
    state: dict[str, Any]


def load_arrays(path: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(path))
    if not isinstance(loaded, dict):
        raise TypeError(f"{path} did not load as a dict of arrays")
    return loaded


def read_checkpoint(path: Path) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, Any]]:
    """(weights, optimizer state, state.json) of a checkpoint dir."""
    weights = load_arrays(path / WEIGHTS)
    opt_state = load_arrays(path / OPTIMIZER)
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    if state.get("format") != STATE_FORMAT:
        raise TrainingError(f"{path}: unknown checkpoint format {state.get('format')!r}")
    return weights, opt_state, state


def mismatch(got: Mapping[str, mx.array], want: Mapping[str, mx.array], what: str) -> str:
    """'' when `got` has exactly `want`'s names and shapes, else a short description of the difference."""
    if missing := sorted(set(want) - set(got)):
        return f"{what}: missing {missing[:5]}"
    if extra := sorted(set(got) - set(want)):
        return f"{what}: unexpected {extra[:5]}"
    for name, arr in want.items():
        if tuple(got[name].shape) != tuple(arr.shape):
            return f"{what}: {name} has shape {tuple(got[name].shape)}, expected {tuple(arr.shape)}"
    return ""


class Strategy(ABC):
    """One rank's share of a run. Built before the world exists (`comm` is attached by the trainer once
    `mx.distributed.init()` gave it); `load` comes next, then `restore` and `check_start`, then the steps."""

    kind: ClassVar[str]
    # Whether `checkpoint_arrays` is a collective (fsdp gathers its shards): then every rank calls it, not only the
    # checkpoint writers (ranks sharing a node's run dir have one writer).
    collective_checkpoint: ClassVar[bool] = False

    def __init__(self, config: RunConfig, log: EventLog) -> None:
        self.config = config
        self.log = log
        self.progress = Progress()  # where the compute thread is inside a step (the trainer's heartbeats report it)
        self.comm: Comm
        self.model: Any = None  # this rank's model: the whole model (dp) or its stage
        self.optimizer: Any = None
        self.num_layers = 0  # transformer layers adapted/trained (of the whole model)
        self.train_set: Any = None
        self.valid_set: Any = None
        self.objective: Any = None  # SftObjective | DpoObjective
        self.packing: tuple[bool, str, int] = (False, "", 0)  # (packed?, why, width)

    @property
    def rank(self) -> int:
        return self.comm.rank

    # -- set-up ------------------------------------------------------------------------------------------------

    @abstractmethod
    def load(self) -> None:
        """This rank's model with the method applied, the datasets, the objective, the packing decision and the
        optimizer (initialised, evaluated)."""

    @abstractmethod
    def check_start(self) -> None:
        """Raise TrainingError when this rank does not start from what its peers expect."""

    def describe(self) -> tuple[int, int, str]:
        """(trainable parameters, total parameters, what is trained in words) of this rank's model."""
        from worker.modelsetup import count_parameters, trainable_detail

        trainable, total = count_parameters(self.model)
        cfg = self.config
        return trainable, total, trainable_detail(self.model, cfg.fine_tune_type, self.num_layers,
                                                  cfg.train_embeddings)

    def started_fields(self) -> dict[str, Any]:
        """Fields this strategy adds to the `started` event (none for dp, whose event predates strategies)."""
        return {}

    def step_fields(self) -> dict[str, Any]:
        """Fields this strategy adds to the step event of the step it just took (none for dp)."""
        return {}

    def checkpoint_done(self, step: int) -> None:
        """Every rank's checkpoint of `step` is written (after the barrier that follows it): a strategy may tidy
        what that checkpoint made superfluous (dp: nothing; each node prunes its own copy as it writes it)."""
        return None

    def state_fields(self) -> dict[str, Any]:
        """Fields this strategy adds to its checkpoints' state.json (none for dp: its copies stay byte-identical
        to those written before strategies existed)."""
        return {}

    def checkpoint_sha256(self, path: Path) -> str:
        """What this rank's `checkpoint` event reports for the checkpoint at `path`, which the coordinator compares
        across the ranks that must agree (monitor: `checkpoint manifest`): its manifest's digest (dp's replicas
        write the same files). Strategies whose ranks each write their own shard report the whole checkpoint's."""
        return sha256_file(path / MANIFEST)

    # -- steps ----------------------------------------------------------------------------------------------------

    @abstractmethod
    def rows(self) -> tuple[int, int]:
        """(offset, count): the rows of each global batch this rank builds its micro-batches from."""

    @abstractmethod
    def step(self, build: Callable[[], Sequence[Micro]], *, after_local: Callable[[Local], Local] | None = None,
             before_apply: Callable[[float], None] | None = None) -> StepResult:
        """One optimizer step over the micro-batches `build()` returns; everything the next step needs is
        evaluated when it returns. `after_local`/`before_apply`: the chaos and debug hooks (see worker.step)."""

    @abstractmethod
    def eval_sums(self, global_rows: Sequence[int]) -> mx.array | None:
        """This rank's part of the validation sums of one global batch ([loss sum, weight, extras...], float32),
        or None when it has none; the trainer adds them up and all_sums them once per evaluation."""

    # -- consistency -----------------------------------------------------------------------------------------------

    def trainable(self) -> dict[str, mx.array]:
        """The parameters this rank owns and trains, named as its checkpoint stores them."""
        return flatten(self.model.trainable_parameters())

    def digests(self) -> dict[str, str]:
        """The `digest` event's hashes: every parameter this rank holds (trainable and frozen: a corrupted frozen
        weight must show too) and its optimizer state (`worker.chaos.replica_digest`, summed where they live)."""
        return {"params_sha256": replica_digest(flatten(self.model.parameters())),
                "optimizer_sha256": replica_digest(flatten(self.optimizer.state))}

    @abstractmethod
    def digest_peers(self) -> tuple[int, ...]:
        """The ranks (this one included) whose digests must be identical to this rank's."""

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @property
    @abstractmethod
    def checkpoint_root(self) -> Path:
        """The directory of this rank's checkpoints (`step-NNNNNN/` below it)."""

    @property
    @abstractmethod
    def is_writer(self) -> bool:
        """Whether this rank writes the checkpoints under `checkpoint_root` (ranks may share one)."""

    @abstractmethod
    def writer(self) -> int:
        """The rank that writes this rank's checkpoints (the `checkpoint` event's `writer`)."""

    @abstractmethod
    def checkpoint_arrays(self) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """(weights, optimizer state) of this rank's checkpoint: the arrays it must get back on restore."""

    @abstractmethod
    def restore(self) -> ResumeState | None:
        """Fresh start (None) or the agreed resume point, with this rank's model and optimizer restored."""

    def on_invalid(self, step: int, path: Path, reason: str) -> None:
        self.log.emit(EventKind.CHECKPOINT_INVALID, step=step, path=str(path), reason=reason)
