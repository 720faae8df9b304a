"""Data order, per-rank slices and batches.

Order: the training stream is the concatenation of per-epoch permutations of the training rows, epoch `e`
being `numpy.random.default_rng(seed + e).permutation(n)`. Stream position `p` is row `perm_{p // n}[p % n]`.
A step consumes `grad_accumulation` global batches of `B = sum(batch sizes)` consecutive stream rows; in each,
rank r takes rows [offset_r, offset_r + batch_size_r). The data position saved in checkpoints is the number of
stream rows consumed, which does not depend on the plan: a run resumed with another split or world continues
at the same row.

Batches follow mlx-lm's `iterate_batches`: each row is (tokens, prompt offset); rows are truncated to
`max_seq_length`, padded with 0 to `1 + 32 * ceil(max_len / 32)` (capped at `max_seq_length`); lengths are
`(offset, length)` pairs for the loss mask.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PAD_TO = 32  # mlx-lm's padding granule


class RowSource(Protocol):
    """What mlx-lm's CacheDataset offers: processed rows (tokens, offset) by index."""

    def __getitem__(self, idx: int) -> tuple[list[int], int]: ...

    def __len__(self) -> int: ...


@lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Row order of one epoch (cached: a step reads a few rows of the same one or two epochs)."""
    if n <= 0:
        raise ValueError("the training set is empty")
    perm = np.random.default_rng(seed + epoch).permutation(n).astype(np.int64)
    perm.flags.writeable = False  # shared through the cache
    return perm


def stream_rows(position: int, count: int, n: int, seed: int) -> list[int]:
    """Training-row indices at stream positions [position, position + count)."""
    return [int(epoch_permutation(n, seed, p // n)[p % n]) for p in range(position, position + count)]


T = TypeVar("T")


def rank_slice(global_rows: Sequence[T], offset: int, size: int) -> list[T]:
    """This rank's part of one global batch (may be shorter, or empty, for a short last eval batch)."""
    return list(global_rows[offset:offset + size])


def eval_batches(n_valid: int, global_batch: int, val_batches: int) -> list[list[int]]:
    """Validation rows as global batches, in file order: `val_batches` batches of `global_batch` rows, cycling
    through the set if it is smaller; -1 = every row once (the last batch may be short). Empty set: []."""
    if n_valid <= 0 or val_batches == 0:
        return []
    count = n_valid if val_batches < 0 else val_batches * global_batch
    rows = [i % n_valid for i in range(count)]
    return [rows[i:i + global_batch] for i in range(0, len(rows), global_batch)]


def build_batch(items: Sequence[tuple[Sequence[int], int]], max_seq_length: int) -> tuple[mx.array, mx.array]:
    """(tokens [b, T] int32, lengths [b, 2] as (offset, length)) exactly as mlx-lm's iterate_batches builds
    them. `items` must not be empty."""
    if not items:
        raise ValueError("empty batch")
    lengths = [len(tokens) for tokens, _ in items]
    width = min(1 + PAD_TO * ((max(lengths) + PAD_TO - 1) // PAD_TO), max_seq_length)
    arr = np.zeros((len(items), width), np.int32)
    spans = []
    for j, (tokens, offset) in enumerate(items):
        n = min(lengths[j], max_seq_length)
        arr[j, :n] = np.asarray(tokens[:n], dtype=np.int32)
        spans.append((offset, n))
    return mx.array(arr), mx.array(np.asarray(spans, dtype=np.int32))


def load_datasets(data_dir: Path, tokenizer: Any, *, mask_prompt: bool) -> tuple[Any, Any]:
    """(train, valid) as mlx-lm CacheDatasets from `data_dir/{train,valid}.jsonl` with mlx-lm's own format
    detection (text / chat / completions). train must exist and be non-empty; valid may be empty."""
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset

    if not data_dir.is_dir():
        raise FileNotFoundError(f"data dir {data_dir} does not exist (only local datasets are supported)")
    options = types.SimpleNamespace(mask_prompt=mask_prompt)
    train, valid, _ = load_local_dataset(data_dir, tokenizer, options)
    if len(train) == 0:
        raise ValueError(f"{data_dir}/train.jsonl is missing or empty")
    return CacheDataset(train), (CacheDataset(valid) if len(valid) else None)


def sequence_logps(model: Any, batch: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(per-row sum of the completion tokens' log-probs [b] float32, per-row token counts [b] int32): the tokens
    at indices offset .. length-1. (mlx-lm's SFT mask, `<= length`, also scores the padding after the last token;
    a sequence log-prob must not, or chosen and rejected of different lengths would differ by a pad term.)"""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs).astype(mx.float32)
    steps = mx.arange(1, targets.shape[1] + 1)  # target j is token j+1 of the row
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps < lengths[:, 1:])
    logp = -nn.losses.cross_entropy(logits, targets)
    return (logp * mask).sum(axis=1), mask.sum(axis=1).astype(mx.int32)
