"""Deliberate faults (run.json `chaos`) and the replica digest that exposes the silent ones.

Fault contract (each entry acts on its `rank` only; `worker.train` calls these helpers at fixed points):
    kill     at the start of step S, before any work: SIGKILL to itself. No error event, exit by signal 9; the
             peers lose the ring (or are stopped by the launcher) and end with an error event.
    hang     at the start of step S: SIGSTOP to itself. The whole process freezes (heartbeat thread too, state
             `T`); the peers block inside the step's gradient all_sum until someone kills or continues it.
    nan      at step S its local loss sum and every gradient it contributes become NaN before the all_sum, so
             its own step event has local_loss_finite false, the global loss is NaN on every rank, every rank
             emits its step event and then the usual non-finite-loss error.
    diverge  right after step S's optimizer update its trainable floating-point weights get
             `DIVERGE_SCALE` x standard normal noise from a fixed key: from then on its replica differs from
             the others (its `params_sha256` digests differ) while it keeps training normally.
    lie      from step S on its `step` events claim step + `LIE_STEP_OFFSET` and `LIE_FACTOR` x tokens, tok_s and
             compute_tok_s. Only those reports lie: it trains, joins every collective, and its other events
             (heartbeat, digest, eval, checkpoint, finished) stay truthful.
    slow     every step from S on it sleeps (factor - 1) x its own compute time just before the gradient
             all_sum: a real straggler (its compute_s is ~factor x, its peers wait in the collective).
    stall    at step S, just before the gradient all_sum, it waits forever while its heartbeat thread keeps
             beating: alive, heartbeating and making no progress, as every rank of a ring whose data-plane
             link went down while SSH still works (its peers spin in the collective).

Digest contract (`arrays_sha256`): SHA256 over the arrays in sorted name order, each encoded as
    name (UTF-8) NUL dtype name ("float32", "bfloat16", ...) NUL shape ("3,4"; "" for a scalar) NUL
    byte length (8 bytes, little-endian) then the array's bytes in C (row-major) order.
Bit-identical replicas give identical digests on any machine with the same byte order.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from worker.runconfig import ChaosSpec

LIE_STEP_OFFSET = 1000
LIE_FACTOR = 10
LIED_FIELDS = ("tokens", "tok_s", "compute_tok_s")
DIVERGE_SCALE = 1e-2
DIVERGE_SEED = 0x0D1CE


@dataclass(frozen=True)
class RankChaos:
    """The faults planned for one rank, queried by step. Empty (the normal case) answers no to everything."""

    specs: tuple[ChaosSpec, ...] = ()

    @classmethod
    def for_rank(cls, specs: Sequence[ChaosSpec], rank: int) -> RankChaos:
        return cls(tuple(s for s in specs if s.rank == rank))

    def _at(self, kind: str, step: int) -> bool:
        return any(s.kind == kind and s.step == step for s in self.specs)

    def _since(self, kind: str, step: int) -> list[ChaosSpec]:
        return [s for s in self.specs if s.kind == kind and s.step <= step]

    def signal_at(self, step: int) -> signal.Signals | None:
        """SIGKILL (kill) or SIGSTOP (hang) to send itself at the start of `step`, else None (kill wins)."""
        if self._at("kill", step):
            return signal.SIGKILL
        if self._at("hang", step):
            return signal.SIGSTOP
        return None

    def poisons(self, step: int) -> bool:
        """nan: this rank's local loss sum and gradients become NaN at `step`."""
        return self._at("nan", step)

    def diverges(self, step: int) -> bool:
        """diverge: perturb this rank's trainable weights after `step`'s update."""
        return self._at("diverge", step)

    def lies(self, step: int) -> bool:
        """lie: this rank's step event for `step` is inflated."""
        return bool(self._since("lie", step))

    def stalls(self, step: int) -> bool:
        """stall: this rank never finishes `step` (it waits before the all_sum, heartbeating)."""
        return self._at("stall", step)

    def slow_factor(self, step: int) -> float:
        """slow: how many times its compute time this rank spends before the all_sum at `step` (1.0 = none)."""
        return max((s.factor for s in self._since("slow", step)), default=1.0)


def signal_self(sig: signal.Signals) -> None:
    """Send `sig` to this very process (kill: no handler runs, nothing is flushed; hang: stops every thread)."""
    os.kill(os.getpid(), sig)


def lie_about(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a step event's fields with the progress inflated as a `lie` rank reports it."""
    out = dict(record)
    out["step"] = int(record["step"]) + LIE_STEP_OFFSET
    for key in LIED_FIELDS:
        value = out.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value * LIE_FACTOR
    return out


def poisoned(x: mx.array) -> mx.array:
    """`x` with every element NaN (same shape and floating dtype)."""
    return x + mx.array(float("nan"), x.dtype)


def perturb(params: Mapping[str, mx.array], seed: int = DIVERGE_SEED,
            scale: float = DIVERGE_SCALE) -> dict[str, mx.array]:
    """`params` plus `scale` x standard normal noise, one key per name (sorted) split from `seed`: explicit keys
    leave the global mx.random state (which the training step reseeds and relies on) untouched. Non-floating
    arrays (packed quantized weights) are returned unchanged."""
    names = sorted(params)
    keys = mx.random.split(mx.random.key(seed), max(len(names), 1))
    out: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        p = params[name]
        if mx.issubdtype(p.dtype, mx.floating):
            noise = mx.random.normal(p.shape, key=keys[i]) * scale
            out[name] = (p + noise).astype(p.dtype)
        else:
            out[name] = p
    return out


def dtype_name(dtype: Any) -> str:
    """'float32' for mx.float32 (mlx prints 'mlx.core.float32')."""
    return str(dtype).rsplit(".", 1)[-1]


def arrays_sha256(arrays: Mapping[str, mx.array]) -> str:
    """SHA256 hex digest of `arrays` in the canonical encoding of the module docstring.

    Everything is evaluated first. Each array is hashed straight from its buffer (no copy), or from a row-major
    copy when it is a strided view. hashlib releases the GIL while hashing more than 2 KiB and mx.eval releases
    it while it computes, so a heartbeat thread keeps beating while a large model is hashed."""
    mx.eval(list(arrays.values()))
    h = hashlib.sha256()
    for name in sorted(arrays):
        arr = arrays[name]
        view = memoryview(cast(Any, arr))  # mlx arrays export the buffer protocol; its stubs do not say so
        if not view.c_contiguous:  # a transposed/broadcast view: one row-major copy, made by mlx (GIL released)
            arr = mx.contiguous(arr)
            mx.eval(arr)
            view = memoryview(cast(Any, arr))
        shape = ",".join(str(int(d)) for d in arr.shape)
        h.update(f"{name}\0{dtype_name(arr.dtype)}\0{shape}\0".encode())
        h.update(int(view.nbytes).to_bytes(8, "little"))
        # A buffer Python still calls non-contiguous (not seen so far) is copied into C order rather than
        # rejected by hashlib.
        h.update(view if view.c_contiguous else view.tobytes())
    return h.hexdigest()
