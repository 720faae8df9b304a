"""Direct Preference Optimization (Rafailov et al. 2023): data, sequence log-probs and the loss. No I/O but reading
the dataset files; the step loop, the exact cross-rank weighting and checkpoints are `worker.train`'s.

Loss, per preference pair (x, y_w, y_l), with pi the policy and ref the frozen reference model:

    h      = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
    loss   = -log sigmoid(beta * h) = softplus(-beta * h)
    reward_w = beta * (log pi(y_w|x) - log ref(y_w|x)), reward_l likewise; accuracy = [reward_w > reward_l],
    margin = reward_w - reward_l

log pi(y|x) is the SUM of the completion tokens' log-probabilities (the prompt's tokens do not count). The unit of
weighting is the pair: `dpo_loss_sum` returns the sum over pairs, and `worker.train` divides the all-summed
gradient by the total number of pairs, so any split of the global batch gives the update of one rank holding it.

Data rows (`train.jsonl`, `valid.jsonl` in the data dir), one of:
  {"prompt": "text", "chosen": "text", "rejected": "text"}         plain text: prompt + completion, tokenized whole
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   chat: the tokenizer's chat template
  {"chosen": [messages], "rejected": [messages]}                    chat with an implicit prompt: the messages the
                                                                    two conversations share
(`chosen`/`rejected` may also be a single assistant message as a string when `prompt` is a list of messages.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker.data import build_batch, sequence_logps

STATS = ("reward_correct", "reward_margin", "chosen_reward", "rejected_reward")  # sums over pairs, in this order


class PreferenceDataError(ValueError):
    """A preference row that cannot be used (file:line in the message)."""


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids; `offset` = number of prompt tokens (the loss starts after them)."""

    chosen: tuple[int, ...]
    chosen_offset: int
    rejected: tuple[int, ...]
    rejected_offset: int


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _template(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise PreferenceDataError("chat-format preference rows need a tokenizer with a chat template")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return [int(t) for t in ids]


def _with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [*ids, int(eos)] if isinstance(eos, int) and (not ids or ids[-1] != eos) else ids


def _implicit_prompt(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> int:
    """How many leading messages the two conversations share (they must differ after that)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def encode_pair(row: Any, tokenizer: Any) -> Pair:
    """Token ids of one row (formats in the module docstring). Raises PreferenceDataError."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise PreferenceDataError('a preference row needs "chosen" and "rejected" (and "prompt" unless both are '
                                  "chat conversations sharing their prompt)")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        p = [int(t) for t in tokenizer.encode(prompt)]
        c = _with_eos(tokenizer, [int(t) for t in tokenizer.encode(prompt + chosen)])
        r = _with_eos(tokenizer, [int(t) for t in tokenizer.encode(prompt + rejected)])
        return Pair(tuple(c), len(p), tuple(r), len(p))
    if prompt is None and _is_messages(chosen) and _is_messages(rejected):
        shared = _implicit_prompt(chosen, rejected)
        if shared == 0 or shared == len(chosen) or shared == len(rejected):
            raise PreferenceDataError("chosen and rejected conversations must share a prompt and then differ")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    prompt_m = _as_messages(prompt, "user")
    chosen_m = _as_messages(chosen, "assistant")
    rejected_m = _as_messages(rejected, "assistant")
    p = _template(tokenizer, prompt_m, generation_prompt=True)
    c = _template(tokenizer, [*prompt_m, *chosen_m], generation_prompt=False)
    r = _template(tokenizer, [*prompt_m, *rejected_m], generation_prompt=False)
    return Pair(tuple(c), len(p), tuple(r), len(p))


def _as_messages(value: Any, role: str) -> list[dict[str, Any]]:
    """Chat messages as given, or a lone string as one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not _is_messages(value):
        raise PreferenceDataError("prompt/chosen/rejected must all be strings, or chat messages "
                                  '([{"role": ..., "content": ...}])')
    return list(value)


def load_pairs(path: Path, tokenizer: Any) -> list[Pair]:
    """Every row of a JSONL file as a Pair; a missing file is an empty list. Errors name file:line."""
    if not path.exists():
        return []
    pairs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                pairs.append(encode_pair(json.loads(line), tokenizer))
            except (ValueError, PreferenceDataError) as exc:
                raise PreferenceDataError(f"{path}:{lineno}: {exc}") from None
    return pairs


def load_preference_datasets(data_dir: Path, tokenizer: Any) -> tuple[list[Pair], list[Pair] | None]:
    """(train, valid or None) from `data_dir/{train,valid}.jsonl`; train must not be empty."""
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data dir {data_dir} does not exist (only local datasets are supported)")
    train = load_pairs(data_dir / "train.jsonl", tokenizer)
    if not train:
        raise PreferenceDataError(f"{data_dir}/train.jsonl is missing or empty")
    valid = load_pairs(data_dir / "valid.jsonl", tokenizer)
    return train, (valid or None)


def build_pair_batch(pairs: Sequence[Pair], max_seq_length: int) -> tuple[mx.array, mx.array]:
    """One batch of 2n rows: the n chosen sequences, then the n rejected ones (mlx-lm's padding and lengths)."""
    items = [(p.chosen, p.chosen_offset) for p in pairs] + [(p.rejected, p.rejected_offset) for p in pairs]
    return build_batch(items, max_seq_length)


def dpo_terms(policy_logps: mx.array, reference_logps: mx.array, beta: float) -> tuple[mx.array, mx.array]:
    """Per-pair losses [n] and the STATS sums [4] from 2n sequence log-probs (chosen first, then rejected)."""
    n = policy_logps.shape[0] // 2
    chosen_rewards = beta * (policy_logps[:n] - reference_logps[:n])
    rejected_rewards = beta * (policy_logps[n:] - reference_logps[n:])
    margins = chosen_rewards - rejected_rewards
    losses = mx.logaddexp(mx.zeros_like(margins), -margins)  # -log(sigmoid(m)), stable for large |m|
    stats = mx.stack([(margins > 0).astype(mx.float32).sum(), margins.sum(), chosen_rewards.sum(),
                      rejected_rewards.sum()])
    return losses, mx.stop_gradient(stats)


def dpo_loss_sum(model: Any, batch: mx.array, lengths: mx.array, reference_logps: mx.array,
                 beta: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(sum of the pairs' DPO losses, number of pairs, completion tokens, STATS sums): the function whose first
    output `worker.train` differentiates."""
    logps, counts = sequence_logps(model, batch, lengths)
    losses, stats = dpo_terms(logps, mx.stop_gradient(reference_logps), beta)
    return losses.sum(), mx.array(losses.shape[0], mx.int32), counts.sum(), stats
