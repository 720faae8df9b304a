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

Replica digest contract (`replica_digest`: what every `digest` event carries): SHA256 over the arrays in sorted
name order, each encoded as
    name (UTF-8) NUL dtype name NUL shape NUL word count n (8 bytes, little-endian) then its sum (4 bytes,
    little-endian).
An array's words u_0 .. u_{n-1} are its elements in row-major order, each read as an unsigned little-endian
integer of its own size (1, 2 or 4 bytes) widened to 32 bits; an 8-byte element is two words (low, high).
Its sum is  sum over j of fmix32(u_j XOR (j * GOLDEN + SEED))  modulo 2^32 (j modulo 2^32 too; fmix32 is
MurmurHash3's finaliser). Sums modulo 2^32 do not depend on the order of their terms, so the sums are computed
where the arrays live with the same value: by MLX on a GPU, where only the sums reach the host (reading
a model's state on the host took seconds a digest, and on CUDA's managed memory it also moved the state to the
host for the next step to move back), and by numpy on the host when MLX runs on the CPU. One differing word
always changes its array's sum (fmix32 is a bijection); any other difference escapes an array's sum with a chance
of about 2^-32, and drift reaches many arrays. It finds replicas that drifted, not a rank that lies: that one can
report anything.

Weights digest contract (`arrays_sha256`: checkpoint shards' manifests, whose files are read on the host anyway):
SHA256 over the arrays in sorted name order, each encoded as
    name (UTF-8) NUL dtype name ("float32", "bfloat16", ...) NUL shape ("3,4"; "" for a scalar) NUL
    byte length (8 bytes, little-endian) then the array's bytes in C (row-major) order.
Bit-identical arrays give identical digests of either kind on any machine with the same byte order.
"""

from __future__ import annotations

import hashlib
import os
import signal
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from worker.runconfig import ChaosSpec

LIE_STEP_OFFSET = 1000
LIE_FACTOR = 10
LIED_FIELDS = ("tokens", "tok_s", "compute_tok_s")
DIVERGE_SCALE = 1e-2
DIVERGE_SEED = 0x0D1CE
GOLDEN = 0x9E3779B1  # 2^32 / the golden ratio: spreads consecutive word indices over the 32 bits
SEED = 0x7F4A7C15
FMIX_MULS = (0x85EBCA6B, 0xC2B2AE35)  # MurmurHash3's finaliser constants
WORD_MASK = 0xFFFFFFFF
CHUNK_WORDS = 1 << 22  # words summed per pass by MLX: bounds its temporaries (a few x 16 MiB) whatever the size
HOST_CHUNK_WORDS = 1 << 18  # words summed per pass by numpy: 1 MiB buffers that stay in the CPU's cache


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


def replica_digest(arrays: Mapping[str, mx.array], *, on_device: bool | None = None) -> str:
    """The replica digest of `arrays` (module docstring): the same value wherever it is computed.

    `on_device` None sums with MLX when the default device is a GPU and with numpy on the host otherwise (MLX's
    CPU kernels were slower than numpy at this); True or False forces one (tests compare them)."""
    if on_device is None:
        on_device = mx.default_device().type == mx.DeviceType.gpu
    mx.eval(list(arrays.values()))
    names = sorted(arrays)
    sums = None
    if on_device:
        try:
            sums = _sums_mx([arrays[n] for n in names])
        except (RuntimeError, ValueError) as exc:  # an op this backend lacks: the host gives the same value
            warnings.warn(f"replica digest: summing on {mx.default_device()} failed ({exc}); summed on the host",
                          RuntimeWarning, stacklevel=2)
    if sums is None:
        sums = [_sum_np(_words_np(arrays[n])) for n in names]
    h = hashlib.sha256()
    for name, (n, total) in zip(names, sums, strict=True):
        arr = arrays[name]
        shape = ",".join(str(int(d)) for d in arr.shape)
        h.update(f"{name}\0{dtype_name(arr.dtype)}\0{shape}\0".encode())
        h.update(n.to_bytes(8, "little"))
        h.update(total.to_bytes(4, "little"))
    return h.hexdigest()


def _words_np(arr: mx.array) -> np.ndarray:
    """The array's words (module docstring), not yet widened, as a numpy view of its buffer: no copy unless it is
    a strided view."""
    if arr.size == 0:
        return np.zeros(0, np.uint32)
    view = memoryview(cast(Any, arr))
    if not view.c_contiguous:
        arr = mx.contiguous(arr)
        mx.eval(arr)
        view = memoryview(cast(Any, arr))
    return np.frombuffer(view.cast("B"), dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[arr.dtype.size])


def _sum_np(words: np.ndarray) -> tuple[int, int]:
    """(word count, sum) of one array's words, on the host; numpy's uint32 arithmetic wraps modulo 2^32. Chunks
    of HOST_CHUNK_WORDS into two buffers reused throughout: a cache-sized pass that allocates nothing was 4x
    faster than whole-array temporaries."""
    total = 0
    k0 = min(words.size, HOST_CHUNK_WORDS)
    # (start + i) * GOLDEN + SEED = (i * GOLDEN + SEED) + start * GOLDEN: one index array serves every chunk.
    base = np.arange(k0, dtype=np.uint32) * np.uint32(GOLDEN) + np.uint32(SEED)
    xs, ts = np.empty(k0, np.uint32), np.empty(k0, np.uint32)
    mul0, mul1 = np.uint32(FMIX_MULS[0]), np.uint32(FMIX_MULS[1])
    for start in range(0, words.size, HOST_CHUNK_WORDS):
        u = words[start:start + HOST_CHUNK_WORDS]
        x, t = xs[:u.size], ts[:u.size]
        np.add(base[:u.size], np.uint32((start * GOLDEN) & WORD_MASK), out=x)
        np.bitwise_xor(x, u, out=x, casting="unsafe")  # u widened to 32 bits (it may be 1 or 2 bytes a word)
        np.right_shift(x, 16, out=t)
        x ^= t
        x *= mul0
        np.right_shift(x, 13, out=t)
        x ^= t
        x *= mul1
        np.right_shift(x, 16, out=t)
        x ^= t
        total = (total + int(x.sum(dtype=np.uint32))) & WORD_MASK
    return int(words.size), total


def _words_mx(arr: mx.array) -> mx.array:
    """The array's words (module docstring) as a flat MLX array of unsigned integers of the element's size, not
    yet widened (each chunk is, so no whole-array copy is made); reshape follows the logical row-major order
    whatever the strides."""
    return mx.view(arr.reshape(-1), {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint32}[arr.dtype.size])


def _sums_mx(arrays: Sequence[mx.array]) -> list[tuple[int, int]]:
    """(word count, sum) of each array, computed by MLX on the default device; only the sums are read back.
    Evaluated every CHUNK_WORDS words, so the temporaries stay a few chunks whatever the model's size."""
    u32 = mx.uint32
    parts: list[list[mx.array]] = []  # per array: its chunks' sums
    counts: list[int] = []
    pending: list[mx.array] = []
    pending_words = 0
    for arr in arrays:
        words = _words_mx(arr) if arr.size else mx.zeros((0,), u32)
        n = int(words.size)  # elements, or twice that for 8-byte ones
        counts.append(n)
        chunks: list[mx.array] = []
        for start in range(0, n, CHUNK_WORDS):
            u = words[start:start + CHUNK_WORDS].astype(u32)
            x = mx.arange(0, int(u.size), dtype=u32) * mx.array(GOLDEN, u32)
            x = (x + mx.array((SEED + start * GOLDEN) & WORD_MASK, u32)) ^ u
            x = x ^ (x >> 16)
            x = x * mx.array(FMIX_MULS[0], u32)
            x = x ^ (x >> 13)
            x = x * mx.array(FMIX_MULS[1], u32)
            chunks.append(mx.sum(x ^ (x >> 16)))  # a uint32 sum: it wraps modulo 2^32, as the contract says
            pending.append(chunks[-1])
            pending_words += int(u.size)
            if pending_words >= CHUNK_WORDS:
                mx.eval(pending)
                pending, pending_words = [], 0
        parts.append(chunks)
    every = [c for chunks in parts for c in chunks]
    values = iter(cast(list[int], mx.stack(every).tolist()) if every else [])  # one read-back, 4 bytes a chunk
    return [(n, sum(next(values) for _ in chunks) & WORD_MASK) for n, chunks in zip(counts, parts, strict=True)]


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
