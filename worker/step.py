"""The training step: ONE compiled program, used by the run (`worker.train`) and by calibration (`worker.bench`), so
that what calibration times is what the run executes.

    local(batch) ──compiled──► loss sum, weight, gradient of the loss SUM (in the parameters' dtype)
        [grad_accumulation: more micro-batches added inside the compiled graph]
        [the caller evaluates here: compute_s ends; chaos and the Byzantine checks read the local values]
    apply(grads, loss sum, 1/W) ──compiled──► scale by 1/W ─► all_sum over the ranks (buckets: worker.exchange)
        ──compiled──► grad norm, optimizer update (one rank: scale and update are one compiled graph)

Exact weighting without a count collective: every rank knows every rank's rows (the data order and the split are
functions of the config), so the global weight W (scored tokens for SFT, pairs for DPO) is computed on the host
from the rows' lengths (`sft_weight`). Each rank scales its gradient SUM by 1/W before the all_sum, so the sum over
ranks is sum_i(W_i * meangrad_i) / W: a 3/1 split makes the same update as one rank with the global batch. The
loss sum rides in the gradients' bucket (float32 models) or one more scalar collective (others). Gradients keep
the parameters' dtype, as mlx-lm keeps them: no float32 copy of the gradients, no second copy of the parameters.

Packing (`pack_rows`): a rank's rows of a step are packed into as few sequences as they fit in, each as wide as
the padded batch mlx-lm would build from the same rows (so attention is never wider than unpacked), instead of
one padded sequence per row. Attention is block-diagonal causal per row (through mlx-lm's cache hook
`make_mask`) and each row keeps exactly its unpacked inputs, targets and loss mask (mlx-lm's `default_loss`
convention, including its target after the last token), so the packed step computes the unpacked step's loss
and gradient on the same rows, up to float rounding: rotary position embeddings depend only on position
differences, which packing keeps within a row. Rows per step, the data order and the split are those of the
unpacked run; only the padding is gone. `packing_is_exact` checks this on the actual model before a run packs (a
model without the mask hook, or with absolute positions, is not packed).

Compatibility: Python 3.9+ (the nodes' python); numpy and mlx only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.losses import cross_entropy
from mlx.nn.utils import value_and_grad as nn_value_and_grad
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from worker.exchange import CPU_BUCKET_BYTES, Exchange, exchange_for
from worker.memory import StepMemory, batch_size_of

ALL_REDUCE_BYTES = CPU_BUCKET_BYTES  # gradient buckets per all_sum call by default (worker.exchange: by device)
PACK_MIN_SAVING = 0.10  # pack only when it saves at least this share of the computed positions
PACK_EXACT_RTOL = 2e-4  # packed vs unpacked loss on the real model, relative (float32 rounding of attention)

AllSum = Callable[[mx.array], mx.array]
_LOSS_KEY = " loss"  # a parameter name never starts with a space


def _number(x: mx.array) -> float:
    value = x.item()
    return float(value) if isinstance(value, (int, float)) else float("nan")


def flatten(tree: Any) -> dict[str, mx.array]:
    """`tree_flatten` into a name -> array dict (dotted names, as safetensors files and mlx-lm use)."""
    out: dict[str, mx.array] = {}
    tree_flatten(tree, destination=out)
    return out


# --- weights: what the loss is averaged over, counted on the host ----------------------------------------------


def input_positions(n_tokens: int, max_seq_length: int) -> int:
    """Input positions a row of `n_tokens` occupies: mlx-lm truncates to `max_seq_length` tokens and feeds all
    but the last token of the padded row, so a full row gives `max_seq_length - 1` and a shorter one `n_tokens`
    (its last token's target is the padding after it)."""
    return min(n_tokens, max_seq_length - 1)


def scored_targets(n_tokens: int, offset: int, max_seq_length: int) -> int:
    """Targets mlx-lm's `default_loss` mask scores for one row: positions j with offset <= j+1 <= length within
    the input width (`token_loss_sum`'s mask, counted without building it)."""
    return max(0, input_positions(n_tokens, max_seq_length) - max(offset - 1, 0))


def sft_weight(items: Sequence[tuple[Sequence[int], int]], max_seq_length: int) -> tuple[int, int]:
    """(scored targets, real tokens) of some rows: the SFT loss's weight and the tokens/s numerator (mlx-lm
    counts a row's length, capped at max_seq_length)."""
    weight = tokens = 0
    for row, offset in items:
        n = min(len(row), max_seq_length)
        weight += scored_targets(n, offset, max_seq_length)
        tokens += n
    return weight, tokens


# --- the SFT losses ----------------------------------------------------------------------------------------------


def token_loss_sum(model: Any, batch: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(sum of per-token cross-entropy, scored targets, real tokens) with mlx-lm's `default_loss` mask, which
    returns their quotient instead. Targets at positions `offset <= j+1 <= length` count (mlx-lm's convention)."""
    inputs = batch[:, :-1]
    targets = batch[:, 1:]
    logits = model(inputs)
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    ce = cross_entropy(logits, targets) * mask
    return ce.astype(mx.float32).sum(), mask.sum().astype(mx.int32), lengths[:, 1].sum().astype(mx.int32)


class PackCache:
    """mlx-lm's per-layer cache interface, used only for its hook: `create_attention_mask` asks the cache for the
    mask, so a packed batch gets block-diagonal causal attention without touching the model. No offset, nothing
    stored: keys and values pass through."""

    offset = 0

    def __init__(self, mask: mx.array) -> None:
        self.mask = mask

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is None:
            return self.mask
        pos = mx.arange(n)
        return mx.logical_and(self.mask, (pos[:, None] - pos[None, :]) < window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


def packed_loss_sum(model: Any, inputs: mx.array, targets: mx.array, scored: mx.array,
                    segments: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The SFT loss of a packed batch: (loss sum, scored targets, real tokens). `segments` [b, P] numbers each
    position's document (1, 2, ...; 0 = padding); a position attends to earlier positions of its own document."""
    same = segments[:, None, :, None] == segments[:, None, None, :]
    pos = mx.arange(inputs.shape[1])
    mask = mx.logical_and(same, pos[:, None] >= pos[None, :])
    caches = [PackCache(mask) for _ in range(len(model.layers))]
    logits = model(inputs, cache=caches)
    ce = cross_entropy(logits, targets) * scored
    return (ce.astype(mx.float32).sum(), scored.sum().astype(mx.int32),
            (segments > 0).sum().astype(mx.int32))


# --- packing (pure: lengths in, layout out) ----------------------------------------------------------------------


def plan_packing(lengths: Sequence[int], width: int, count: int) -> tuple[list[list[int]], int]:
    """First fit, in stream order: each row (of `lengths[k]` positions) goes into the first of at most `count`
    sequences of `width` positions with room for it; a row that fits none when all `count` are open ends the
    plan. Returns (row positions in `lengths` per sequence, rows placed). Deterministic: every rank plans the same."""
    if width < 1 or count < 1:
        raise ValueError(f"width and count must be positive, got {width}, {count}")
    seqs: list[list[int]] = []
    room: list[int] = []
    for k, size in enumerate(lengths):
        if size > width:
            raise ValueError(f"row of {size} positions does not fit a sequence of {width}")
        slot = next((i for i, free in enumerate(room) if free >= size), None)
        if slot is None:
            if len(seqs) == count:
                return seqs + [[] for _ in range(count - len(seqs))], k
            seqs.append([])
            room.append(width)
            slot = len(seqs) - 1
        seqs[slot].append(k)
        room[slot] -= size
    return seqs + [[] for _ in range(count - len(seqs))], len(lengths)


@dataclass(frozen=True)
class Packed:
    """A packed batch's arrays: inputs, targets, scored (0/1), segments, all [b, width]."""

    inputs: mx.array
    targets: mx.array
    scored: mx.array
    segments: mx.array

    def arrays(self) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        return self.inputs, self.targets, self.scored, self.segments


def build_packed(seqs: Sequence[Sequence[tuple[Sequence[int], int]]], max_seq_length: int,
                 width: int | None = None) -> Packed:
    """The arrays of packed sequences (each a list of (tokens, prompt offset) rows) of `width` positions
    (default max_seq_length - 1). Each row keeps exactly its unpacked inputs, targets and scored targets: inputs
    t[0..m-1], targets (t + [pad])[1..m] (the pad is what the unpacked row's last scored target reads), scored
    from offset-1 on."""
    width = max_seq_length - 1 if width is None else width
    shape = (len(seqs), width)
    inputs, targets = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    scored, segments = np.zeros(shape, np.float32), np.zeros(shape, np.int32)
    for b, seq in enumerate(seqs):
        at = 0
        for d, (row, offset) in enumerate(seq):
            tokens = list(row[:max_seq_length])
            m = input_positions(len(tokens), max_seq_length)
            padded = [*tokens, 0]
            inputs[b, at:at + m] = padded[:m]
            targets[b, at:at + m] = padded[1:m + 1]
            first = max(offset - 1, 0)
            if first < m:
                scored[b, at + first:at + m] = 1.0
            segments[b, at:at + m] = d + 1
            at += m
    return Packed(mx.array(inputs), mx.array(targets), mx.array(scored), mx.array(segments))


def padded_width(lengths: Sequence[int], max_seq_length: int) -> int:
    """Input positions of mlx-lm's padded batch of rows of these token lengths: 1 + 32k tokens, capped."""
    return min(1 + 32 * ((max(lengths) + 31) // 32), max_seq_length) - 1


def sequence_bucket(needed: int, rows: int) -> int:
    """How many sequences a packed batch is given: `needed` rounded up to rows, rows/2, rows/4, ... (rounded up),
    never more than `rows`. Each distinct batch shape is compiled once (on the CPU backend, by a C++ compiler:
    seconds each on a cold machine), so the count of sequences takes a few values only, not every one up to
    `rows`; the empty sequences this adds are at most as many as the ones it fills."""
    size = rows
    while size > 1 and -(-size // 2) >= needed:
        size = -(-size // 2)
    return max(size, needed)


def packed_plan(lengths: Sequence[int], max_seq_length: int, width: int | None = None
                ) -> tuple[int, list[list[int]], int]:
    """How `pack_rows` packs rows of these token lengths: (the sequence width, the rows (indices into `lengths`)
    of each filled sequence, the sequences the batch is given: `sequence_bucket`). The width is the run's (from
    `decide_packing`: one width for the whole run, so that a batch's shape takes a few values only), never
    narrower than these rows' padded batch. Host work only: the batch's shape is (sequences, width)."""
    width = max(width or 0, padded_width(lengths, max_seq_length))
    seqs, used = plan_packing([input_positions(n, max_seq_length) for n in lengths], width, len(lengths))
    if used != len(lengths):
        raise AssertionError(f"packed {used} of {len(lengths)} rows")
    filled = [seq for seq in seqs if seq]
    return width, filled, sequence_bucket(len(filled), len(lengths))


def pack_rows(items: Sequence[tuple[Sequence[int], int]], max_seq_length: int, width: int | None = None) -> Packed:
    """One rank's rows packed into as few sequences as they fit in (`packed_plan`), padded with empty sequences
    to `sequence_bucket`."""
    width, plan, count = packed_plan([len(t) for t, _ in items], max_seq_length, width)
    filled = [[items[k] for k in seq] for seq in plan]
    empty: list[list[tuple[Sequence[int], int]]] = [[] for _ in range(count - len(filled))]
    return build_packed(filled + empty, max_seq_length, width)


def packing_saving(lengths: Sequence[int], max_seq_length: int, batch: int, width: int | None = None) -> float:
    """Share of the computed positions packing (into sequences of `width`, default each batch's own padded
    width) saves over mlx-lm's padded batches, for rows in this order, `batch` per batch: what decides whether a
    run packs (pure; the same on every rank)."""
    padded = packed = 0
    for i in range(0, len(lengths), batch):
        chunk = lengths[i:i + batch]
        own = padded_width(chunk, max_seq_length)
        wide = max(width or 0, own)
        seqs, _ = plan_packing([input_positions(n, max_seq_length) for n in chunk], wide, len(chunk))
        padded += len(chunk) * own
        packed += sequence_bucket(sum(1 for seq in seqs if seq), len(chunk)) * wide
    return max(0.0, 1.0 - packed / padded) if padded else 0.0


def packing_is_exact(model: Any, items: Sequence[tuple[Sequence[int], int]], max_seq_length: int) -> str | None:
    """None when packing `items` (2+ short rows) into one sequence gives the unpacked loss on this model (and
    its gradient can be taken, gradient checkpointing included); else why not. Run on the real model before a
    run packs: a model whose attention ignores the cache's mask, or that adds absolute positions, fails here and
    trains unpacked. In eval mode: dropout would make the two losses differ for another reason."""
    from worker.data import build_batch

    training = bool(getattr(model, "training", True))
    model.eval()
    try:
        packed = build_packed([list(items)], max_seq_length)
        (loss_p, weight_p, _), grads = nn_value_and_grad(model, packed_loss_sum)(model, *packed.arrays())
        loss_u, weight_u, _ = token_loss_sum(model, *build_batch(list(items), max_seq_length))
        mx.eval(loss_p, weight_p, loss_u, weight_u, grads)
    except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
        return f"the model does not take a packed batch ({type(exc).__name__}: {exc})"
    finally:
        model.train(training)
    if _number(weight_p) != _number(weight_u):
        return f"packed batch scores {_number(weight_p):g} targets, unpacked {_number(weight_u):g}"
    a, b = _number(loss_p), _number(loss_u)
    if not abs(a - b) <= PACK_EXACT_RTOL * max(abs(b), 1e-6):
        return f"packed loss {a:.6g} != unpacked {b:.6g} (absolute positions, or a mask the model ignores)"
    return None


def decide_packing(setting: str, model: Any, dataset: Any, *, max_seq_length: int, global_batch: int,
                   seed: int, sample: int = 1024) -> tuple[bool, str, int]:
    """Whether a run packs, why, and the width of its sequences, from `train.packing` (`auto` | `on` | `off`), the
    data and the model. The same inputs give the same answer on every rank and in calibration. `auto` packs when
    it saves at least PACK_MIN_SAVING of the computed positions (short or variable rows) and is exact on this
    model; `on` packs whenever it is exact and raises ValueError when it is not. The width is the padded width of
    the longest sampled row: one width for the run, so packed batches take a few shapes only (each compiles)."""
    from worker.data import stream_rows

    rows = [dataset[i] for i in stream_rows(0, min(len(dataset), sample), len(dataset), seed)]
    width = padded_width([len(t) for t, _ in rows] or [1], max_seq_length)
    if setting == "off":
        return False, "train.packing is off", width
    sizes = [input_positions(len(tokens), max_seq_length) for tokens, _ in rows]
    saving = packing_saving([len(t) for t, _ in rows], max_seq_length, global_batch, width)
    if setting == "auto" and saving < PACK_MIN_SAVING:
        return False, f"packing would save {saving:.0%} of the computed positions (< {PACK_MIN_SAVING:.0%})", width
    pair: list[tuple[Sequence[int], int]] = []
    used = 0
    for (tokens, offset), size in sorted(zip(rows, sizes), key=lambda r: r[1]):
        if used + size > max_seq_length - 1 or len(pair) == 3:
            break
        pair.append((tokens, offset))
        used += size
    why = "no two rows fit in one sequence" if len(pair) < 2 else packing_is_exact(model, pair, max_seq_length)
    if why is not None:
        if setting == "on":
            raise ValueError(f"train.packing is on, but packing is not exact here: {why}")
        return False, f"not packed: {why}", width
    return True, f"packed into sequences of {width} positions: saves {saving:.0%} of the computed positions", width


# --- buckets for the all_sum ---------------------------------------------------------------------------------------


def bucket_names(sizes: Mapping[str, int], bucket_bytes: int, itemsize: int = 4) -> list[list[str]]:
    """Sorted names grouped into buckets of about `bucket_bytes` (a bucket closes once it reaches the size)."""
    buckets: list[list[str]] = []
    current: list[str] = []
    nbytes = 0
    for name in sorted(sizes):
        current.append(name)
        nbytes += sizes[name] * itemsize
        if nbytes >= bucket_bytes:
            buckets.append(current)
            current, nbytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def all_sum_arrays(arrays: Mapping[str, mx.array], all_sum: AllSum, bucket_bytes: int = ALL_REDUCE_BYTES,
                   dispatch: Callable[[mx.array], None] | None = None) -> dict[str, mx.array]:
    """`all_sum` every array, concatenating same-dtype arrays into buckets: few large collectives instead of
    one per parameter. Shapes and names are preserved. Every rank issues the same collectives in the same
    (rank-independent, sorted) order. `dispatch` (mx.async_eval) is given each summed bucket as it is built."""
    out: dict[str, mx.array] = {}
    by_dtype: dict[Any, dict[str, int]] = {}
    for name, arr in arrays.items():
        by_dtype.setdefault(arr.dtype, {})[name] = arr.size
    for _, sizes in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        for bucket in bucket_names(sizes, bucket_bytes):
            flat = mx.concatenate([arrays[n].reshape(-1) for n in bucket]) if len(bucket) > 1 \
                else arrays[bucket[0]].reshape(-1)
            summed = all_sum(flat)
            if dispatch is not None:
                dispatch(summed)
            bounds = np.cumsum([arrays[n].size for n in bucket])[:-1].tolist()
            parts = mx.split(summed, bounds) if bounds else [summed]
            if len(parts) != len(bucket):  # zip(strict=True) is 3.10+: the worker runs on 3.9 too
                raise AssertionError(f"split gave {len(parts)} parts for {len(bucket)} arrays")
            for name, part in zip(bucket, parts):
                out[name] = part.reshape(arrays[name].shape)
    return out


# --- the step ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Local:
    """One rank's sums over its micro-batches, before any collective: the gradient of the loss SUM (a tree in
    the parameters' dtype), the loss sum (float32), the weight (scored targets or pairs), real tokens, the
    objective's extra sums (or None), and the squared norm of the gradient sum (float32)."""

    grads: Any
    loss_sum: mx.array
    weight: mx.array
    tokens: mx.array
    stats: mx.array | None
    grad_sq: mx.array

    def arrays(self) -> list[mx.array]:
        return [*flatten(self.grads).values(), self.loss_sum, self.weight, self.tokens, self.grad_sq,
                *([self.stats] if self.stats is not None else [])]

    def local_stats(self) -> tuple[mx.array, mx.array]:
        """(loss sum / weight, ||gradient sum|| / weight): what this rank alone would report."""
        denom = mx.maximum(self.weight, 1).astype(mx.float32)
        return self.loss_sum / denom, mx.sqrt(self.grad_sq) / denom


class WeightMismatch(RuntimeError):
    """The loss scored another number of units than the host counted: the exact weighting would be wrong."""


def _check_weight(scored: mx.array, counted: int) -> None:
    """The global weight is counted on the host; a loss that scored another number would make the weighting
    inexact."""
    value = _number(scored)
    if value != counted:
        raise WeightMismatch(f"the loss scored {value:g} units, the host counted {counted}")


@dataclass(frozen=True)
class StepResult:
    """What one step did: its micro-batches, this rank's sums and own statistics, the combined loss and grad norm,
    the objective's combined extras (or None), and its compute and wall seconds (both from the batches' build)."""

    micros: list[Any]
    local: Local
    local_loss: mx.array
    local_norm: mx.array
    loss: mx.array
    norm: mx.array
    extras: mx.array | None
    compute_s: float
    elapsed: float


class TrainStep:
    """The compiled step over `model` and `optimizer` for a loss `loss_fn(model, *inputs) -> (loss_sum, weight,
    tokens[, stats])`, differentiated in its first output. `all_sum` reduces over the ranks (`world_size` of
    them; 1: no collective at all). `compiled=False` runs the same functions eagerly (debugging, tests).

    Built after the model, the optimizer state and any checkpoint are in place: the compiled functions capture
    the state trees (model, optimizer, random) as implicit inputs and outputs, as mlx-lm's trainer does.

    `memory` (worker.memory): the step's memory bound (`train.memory_headroom`) and `train.clear_cache`, applied
    around every step inside its time (calibration takes the same step, so it measures their cost); default: no
    bound, and `clear_cache` alone. `exchange` (worker.exchange): how several ranks exchange the gradients;
    default: what the device computing the step and the memory bound call for."""

    def __init__(self, model: Any, optimizer: Any, loss_fn: Callable[..., Any], *, all_sum: AllSum,
                 world_size: int, compiled: bool = True, stats: bool = False, clear_cache: bool = False,
                 memory: StepMemory | None = None, exchange: Exchange | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.memory = memory if memory is not None else StepMemory(headroom=None, clear_cache=clear_cache)
        self.exchange = exchange if exchange is not None else exchange_for(mx.default_device() == mx.gpu,
                                                                           self.memory.headroom is not None)
        self.world_size = world_size
        self.stats = stats  # the loss has extra sums (DPO): they need the general path
        self.all_sum = all_sum
        value_and_grad = nn_value_and_grad(model, loss_fn)
        state = [model.state, optimizer.state, mx.random.state]

        def split(out: Any) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            loss_sum, weight, tokens = out[0], out[1], out[2]
            stats = out[3] if len(out) > 3 else mx.zeros((0,), mx.float32)
            return loss_sum.astype(mx.float32), weight.astype(mx.int32), tokens.astype(mx.int32), stats

        def first(*inputs: mx.array) -> tuple[Any, ...]:
            out, grads = value_and_grad(model, *inputs)
            return (grads, *split(out))

        def more(prev: Any, *inputs: mx.array) -> tuple[Any, ...]:
            out, grads = value_and_grad(model, *inputs)
            return (tree_map(lambda a, b: a + b, prev, grads), *split(out))

        def grad_sq(grads: Any) -> mx.array:
            return sum((mx.sum(mx.square(g.astype(mx.float32))) for g in flatten(grads).values()),
                       mx.array(0.0, mx.float32))

        def scale(grads: Any, loss_sum: mx.array, inverse: mx.array) -> tuple[Any, mx.array]:
            # In float32 and cast back: one rounding, the same on every rank; no float32 copy survives.
            return tree_map(lambda g: (g.astype(mx.float32) * inverse).astype(g.dtype), grads), loss_sum * inverse

        def update(grads: Any, loss: mx.array) -> tuple[mx.array, mx.array]:
            norm = mx.sqrt(grad_sq(grads))
            self.optimizer.update(self.model, grads)
            return loss, norm

        def scale_and_update(grads: Any, loss_sum: mx.array, inverse: mx.array) -> tuple[mx.array, mx.array]:
            return update(*scale(grads, loss_sum, inverse))

        wrap = (lambda f: mx.compile(f, inputs=state, outputs=state)) if compiled else (lambda f: f)
        self._first, self._more = wrap(first), wrap(more)
        self._grad_sq = mx.compile(grad_sq) if compiled else grad_sq
        # One rank: scale and update in one compiled graph, as mlx-lm's step. Several: the all_sum runs between two
        # compiled graphs, evaluated on its own. With the collective inside the compiled graph, 2-rank ring runs
        # deadlocked intermittently on this CPU backend (mlx 0.32.4; upstream reports ring deadlocks, mlx#4475).
        self._scale = mx.compile(scale) if compiled else scale
        self._update = wrap(update)
        self._scale_and_update = wrap(scale_and_update)

        def whole(*inputs: mx.array) -> tuple[mx.array, ...]:
            # One rank, one micro-batch: the whole step in ONE compiled graph, as mlx-lm's trainer compiles it
            # (the update can start on each gradient as soon as it exists). The rank's own statistics are the
            # step's (no peer), and its weight is the global weight.
            out, grads = value_and_grad(model, *inputs)
            loss_sum, weight, tokens, _ = split(out)
            inverse = 1.0 / mx.maximum(weight, 1).astype(mx.float32)
            loss, norm = scale_and_update(grads, loss_sum, inverse)
            return loss, norm, loss_sum, weight, tokens

        self._whole = wrap(whole)

    def local(self, micro_batches: Sequence[Sequence[mx.array]],
              between: Callable[[Local], None] | None = None, *, lazy_last: bool = False) -> Local:
        """The rank's sums over its micro-batches (evaluated one at a time, like mlx-lm's accumulation: the
        activations of one micro-batch are freed before the next). `between(partial)` runs after each evaluated
        one. `lazy_last`: the last micro-batch is left lazy (the fused exchange dispatches it)."""
        acc: Local | None = None
        for index, inputs in enumerate(micro_batches):
            if acc is None:
                grads, loss_sum, weight, tokens, stats = self._first(*inputs)
            else:
                grads, loss_sum, weight, tokens, stats = self._more(acc.grads, *inputs)
                loss_sum, weight, tokens = acc.loss_sum + loss_sum, acc.weight + weight, acc.tokens + tokens
                stats = stats if acc.stats is None else acc.stats + stats
            acc = Local(grads, loss_sum, weight, tokens, stats if stats.size else None, mx.array(0.0))
            if lazy_last and index == len(micro_batches) - 1:
                break
            mx.eval(acc.grads, acc.loss_sum, acc.weight, acc.tokens, *([acc.stats] if acc.stats is not None else []))
            if between is not None:
                between(acc)
        if acc is None:
            raise ValueError("a step needs at least one micro-batch")
        return Local(acc.grads, acc.loss_sum, acc.weight, acc.tokens, acc.stats, self._grad_sq(acc.grads))

    def apply(self, local: Local, total_weight: int) -> tuple[mx.array, mx.array]:
        """Combine every rank's `local` (this rank passes its own) and update: (global mean loss, grad norm of
        the mean gradient), both float32 scalars, lazy. `total_weight`: the global weight of the step."""
        inverse = mx.array(1.0 / max(total_weight, 1), mx.float32)
        if self.world_size == 1:
            loss, norm = self._scale_and_update(local.grads, local.loss_sum, inverse)
            return loss, norm
        grads, loss = self._scale(local.grads, local.loss_sum, inverse)
        flat = flatten(grads)
        flat[_LOSS_KEY] = loss.reshape(1)
        pipelined = self.exchange.pipelined
        summed = all_sum_arrays(flat, self.all_sum, self.exchange.bucket_bytes,
                                dispatch=mx.async_eval if pipelined else None)
        if not pipelined and not self.exchange.fused:
            mx.eval(summed)
        loss = summed.pop(_LOSS_KEY).reshape(())
        loss, norm = self._update(tree_unflatten(list(summed.items())), loss)
        return loss, norm

    def run(self, build: Callable[[], Sequence[Any]], *, after_local: Callable[[Local], Local] | None = None,
            before_apply: Callable[[float], None] | None = None, clock: Callable[[], float] = time.perf_counter
            ) -> StepResult:
        """ONE optimizer step as the run takes it, and as calibration times it: build the micro-batches (host
        work: rows, padding or packing, counts; objects with `inputs`, `weight`, `total_weight`), the local sums,
        this rank's own statistics (evaluated: compute ends here), then the combination and the update, and
        `mx.eval` of everything the next step needs. `after_local` may replace the local sums (chaos `nan`);
        `before_apply(started)` runs just before compute_s is taken (chaos/debug slowdowns)."""
        tic = clock()
        micros = list(build())
        self.memory.begin(batch_size_of([a for m in micros for a in m.inputs]))
        try:
            return self._run(micros, tic, after_local, before_apply, clock)
        except BaseException:
            self.memory.release()  # a failed measuring step must not leave every later eval waiting on each op
            raise

    def _run(self, micros: list[Any], tic: float, after_local: Callable[[Local], Local] | None,
             before_apply: Callable[[float], None] | None, clock: Callable[[], float]) -> StepResult:
        if self.world_size == 1 and len(micros) == 1 and after_local is None and not self.stats:
            return self._run_whole(micros, tic, before_apply, clock)
        if self.world_size > 1 and self.exchange.fused and after_local is None:
            return self._run_fused(micros, tic, before_apply, clock)
        local = self.local([m.inputs for m in micros])
        weight = sum(m.weight for m in micros)
        _check_weight(local.weight, weight)
        if after_local is not None:
            local = after_local(local)
        local_loss, local_norm = local.local_stats()
        mx.eval(local_loss, local_norm, local.grad_sq)
        if before_apply is not None:
            before_apply(tic)
        compute_s = clock() - tic
        total_weight = sum(m.total_weight for m in micros)
        loss, norm = self.apply(local, total_weight)
        extras = None
        if local.stats is not None:
            # An objective with extras (DPO) sums its completion tokens and statistics in ONE more collective; for
            # SFT every count is known on the host.
            extras = self.all_sum(mx.concatenate([local.tokens.astype(mx.float32).reshape(1), local.stats]))
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, *([extras] if extras is not None else []))
        self.memory.end()
        return StepResult(micros, local, local_loss, local_norm, loss, norm, extras, compute_s, clock() - tic)

    def _run_fused(self, micros: list[Any], tic: float, before_apply: Callable[[float], None] | None,
                   clock: Callable[[], float]) -> StepResult:
        """`run` for several ranks with the fused exchange (worker.exchange): the rank's compute (its last
        micro-batch's backward and its own statistics) is dispatched, the exchange and the update are built behind
        it (pipelined: dispatched too), and only then does the host wait for the compute's arrays: compute_s is
        when they are complete. Unpipelined, the exchange is dispatched after that, with the update, in the step's
        last evaluation: one wait for the host between the backward and the update instead of three."""
        local = self.local([m.inputs for m in micros], lazy_last=True)
        local_loss, local_norm = local.local_stats()
        mx.async_eval(*local.arrays(), local_loss, local_norm)  # type: ignore[no-untyped-call]
        loss, norm = self.apply(local, sum(m.total_weight for m in micros))
        extras = None
        if local.stats is not None:
            extras = self.all_sum(mx.concatenate([local.tokens.astype(mx.float32).reshape(1), local.stats]))
        mx.eval(local_loss, local_norm, local.grad_sq)  # all scheduled: this waits for the compute alone
        _check_weight(local.weight, sum(m.weight for m in micros))
        if before_apply is not None:
            # Pipelined, this rank's exchange is queued already: a slowdown here holds its next step's back.
            before_apply(tic)
        compute_s = clock() - tic
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, *([extras] if extras is not None else []))
        self.memory.end()
        return StepResult(micros, local, local_loss, local_norm, loss, norm, extras, compute_s, clock() - tic)

    def _run_whole(self, micros: list[Any], tic: float, before_apply: Callable[[float], None] | None,
                   clock: Callable[[], float]) -> StepResult:
        """`run` for one rank and one micro-batch: one compiled graph, one evaluation."""
        loss, norm, loss_sum, weight, tokens = self._whole(*micros[0].inputs)
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm, weight, tokens)
        self.memory.end()
        _check_weight(weight, micros[0].weight)
        if before_apply is not None:
            before_apply(tic)
        elapsed = clock() - tic
        local = Local(None, loss_sum, weight, tokens, None, mx.square(norm * mx.maximum(weight, 1)))
        return StepResult(micros, local, loss, norm, loss, norm, None, elapsed, elapsed)

    @staticmethod
    def poison(local: Local) -> Local:
        """The same sums with NaN gradients and loss (chaos `nan`); counts unchanged."""
        from worker.chaos import poisoned

        return Local(tree_map(poisoned, local.grads), poisoned(local.loss_sum), local.weight, local.tokens,
                     local.stats, poisoned(local.grad_sq))
