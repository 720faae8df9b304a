"""DPO (worker.dpo + the trainer's objective): the loss against a hand computation, the data formats, and the
exact weighting of pairs across ranks. In-process, no distributed backend."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.trainutil import sgd_step, split_step
from worker.data import sequence_logps
from worker.dpo import (
    Pair,
    PreferenceDataError,
    build_pair_batch,
    dpo_loss_sum,
    dpo_terms,
    encode_pair,
    load_pairs,
)
from worker.modelsetup import apply_method
from worker.objectives import DpoObjective, stats_fields
from worker.runconfig import ConfigError, LoraSpec, parse_run_config
from worker.step import flatten
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
DPO_DATA = REPO / "playbooks" / "data" / "dpo"


def test_loss_matches_a_hand_computation() -> None:
    # Two pairs. Sequence log-probs: policy chosen/rejected, reference chosen/rejected.
    policy = mx.array([-4.0, -6.0, -7.0, -5.0])  # chosen: -4, -6; rejected: -7, -5
    reference = mx.array([-5.0, -5.5, -6.0, -5.5])
    beta = 0.5
    losses, stats = dpo_terms(policy, reference, beta)
    # pair 1: h = (-4 - -5) - (-7 - -6) = 1 + 1 = 2       -> loss = -log(sigmoid(0.5 * 2)) = log(1 + e^-1)
    # pair 2: h = (-6 - -5.5) - (-5 - -5.5) = -0.5 - 0.5 = -1 -> loss = log(1 + e^0.5)
    want = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))]
    assert losses.tolist() == pytest.approx(want, rel=1e-6)
    correct, margin, chosen, rejected = stats.tolist()
    assert correct == 1.0  # only pair 1 prefers the chosen answer
    assert margin == pytest.approx(0.5 * 2 + 0.5 * -1)
    assert chosen == pytest.approx(0.5 * 1 + 0.5 * -0.5)
    assert rejected == pytest.approx(0.5 * -1 + 0.5 * 0.5)
    fields = stats_fields(("reward_correct", "reward_margin", "chosen_reward", "rejected_reward"),
                          stats.tolist(), 2.0)
    assert fields["reward_accuracy"] == 0.5 and fields["reward_margin"] == pytest.approx(0.25)


def test_huge_margins_stay_finite() -> None:
    good, _ = dpo_terms(mx.array([0.0, -1000.0]), mx.array([-1000.0, 0.0]), 1.0)  # margin +2000
    bad, _ = dpo_terms(mx.array([-1000.0, 0.0]), mx.array([0.0, -1000.0]), 1.0)  # margin -2000
    assert good.tolist() == pytest.approx([0.0], abs=1e-6)
    assert bad.tolist() == pytest.approx([2000.0])


class WordTokenizer:
    """A tokenizer without a chat template: one id per character, eos 0."""

    eos_token_id = 0
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_plain_text_rows_mask_the_prompt_and_end_with_eos() -> None:
    pair = encode_pair({"prompt": "ab", "chosen": "c", "rejected": "dd"}, WordTokenizer())
    assert pair == Pair((97, 98, 99, 0), 2, (97, 98, 100, 100, 0), 2)


def test_chat_rows_need_a_chat_template_and_an_implicit_prompt_must_exist() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(PreferenceDataError, match="chat template"):
        encode_pair({"prompt": "q", "chosen": msgs[1:], "rejected": msgs[1:]}, WordTokenizer())
    with pytest.raises(PreferenceDataError, match="share a prompt"):
        encode_pair({"chosen": msgs[1:], "rejected": [{"role": "assistant", "content": "b"}]}, WordTokenizer())
    with pytest.raises(PreferenceDataError, match='"chosen" and "rejected"'):
        encode_pair({"prompt": "q", "chosen": "a"}, WordTokenizer())


def test_a_bad_row_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": 3}\n')
    with pytest.raises(PreferenceDataError, match=r"train\.jsonl:3: "):
        load_pairs(path, WordTokenizer())


def test_run_config_dpo_section() -> None:
    base: dict[str, Any] = {"run_id": "r", "model": "/m", "data": "/d", "run_dir": "/r",
                            "ranks": [{"rank": 0, "node": "a", "batch_size": 1}]}
    cfg = parse_run_config({**base, "method": "dpo", "dpo": {"beta": 0.2, "fine_tune_type": "full"}})
    assert (cfg.method, cfg.fine_tune_type, cfg.dpo.beta, cfg.dpo.reference) == ("dpo", "full", 0.2, None)
    other = parse_run_config({**base, "method": "dpo", "dpo": {"beta": 0.3}})
    assert cfg.digest() != other.digest()  # beta changes the math
    with pytest.raises(ConfigError, match="method is 'lora'"):
        parse_run_config({**base, "method": "lora", "dpo": {"beta": 0.2}})
    with pytest.raises(ConfigError, match="beta must be > 0"):
        parse_run_config({**base, "method": "dpo", "dpo": {"beta": 0}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-dpo"), DPO_DATA, layers=2, hidden=32)


def load_tiny(path: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import load

    loaded = load(str(path))
    return loaded[0], loaded[1]


def test_the_real_tokenizer_reads_every_row_of_the_shipped_data(tiny: Path) -> None:
    _, tokenizer = load_tiny(tiny)
    rows = [json.loads(line) for line in (DPO_DATA / "train.jsonl").read_text().splitlines()]
    pairs = load_pairs(DPO_DATA / "train.jsonl", tokenizer)
    assert len(pairs) == len(rows) and any(isinstance(r["prompt"], list) for r in rows)
    for p in pairs:
        assert 0 < p.chosen_offset < len(p.chosen) and p.chosen[:p.chosen_offset] == p.rejected[:p.rejected_offset]


def test_sequence_logps_sum_only_the_completion(tiny: Path) -> None:
    model, tokenizer = load_tiny(tiny)
    pair = load_pairs(DPO_DATA / "valid.jsonl", tokenizer)[0]
    batch, lengths = build_pair_batch([pair], 64)
    logps, counts = sequence_logps(model, batch, lengths)
    assert counts.tolist() == [len(pair.chosen) - pair.chosen_offset, len(pair.rejected) - pair.rejected_offset]
    # by hand: log-softmax of the logits at each completion position
    logits = model(batch[:, :-1]).astype(mx.float32)
    lsm = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    by_hand = sum(lsm[0, j - 1, int(pair.chosen[j])].item() for j in range(pair.chosen_offset, len(pair.chosen)))
    assert logps.tolist()[0] == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("fine_tune_type", ["lora", "full"])
def test_split_pairs_give_the_update_of_one_rank_with_all(tiny: Path, fine_tune_type: str) -> None:
    """A 3/1 split of 4 pairs through the compiled step (sums over pairs, scaled by 1/total pairs before the
    all_sum) makes the update of 4 pairs on one rank; the loss of the untrained policy against itself as reference
    is exactly log 2 per pair."""
    reference, tokenizer = load_tiny(tiny)
    reference.freeze()

    def policy() -> Any:
        model, _ = load_tiny(tiny)
        mx.random.seed(0)
        apply_method(model, fine_tune_type, None, LoraSpec())
        return model

    pairs = load_pairs(DPO_DATA / "train.jsonl", tokenizer)[:4]
    obj = DpoObjective(reference, 0.1, 64)
    model = policy()
    whole, loss_whole = sgd_step(model, obj.loss, obj._inputs(pairs, range(4)), lambda x: x, 1, 4)
    _, split, loss_split = split_step(policy, obj.loss, obj._inputs(pairs, [0, 1, 2]), obj._inputs(pairs, [3]), 4)
    assert loss_whole == pytest.approx(math.log(2), rel=1e-4)  # LoRA starts as a no-op: policy == reference
    assert loss_whole == pytest.approx(loss_split, rel=1e-6)
    worst = max(mx.max(mx.abs(whole[k] - split[k])).item() for k in whole)
    scale = max(mx.max(mx.abs(g)).item() for g in whole.values())
    assert scale > 0 and worst <= 1e-5 * scale
    assert set(whole) == set(flatten(model.trainable_parameters()))
    model = policy()
    loss_sum, n, _, _ = dpo_loss_sum(model, *build_pair_batch(pairs, 64), sequence_logps(reference,
                                     *build_pair_batch(pairs, 64))[0], 0.1)
    assert int(n.item()) == 4 and loss_sum.item() == pytest.approx(4 * math.log(2), rel=1e-4)
