"""worker.train internals in-process: loss convention, exact gradient combination, method setup, data order,
config contract, event log, tiny model. Fast: no subprocesses, no distributed backend."""

from __future__ import annotations

import hashlib
import json
import math
import types
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.utils import value_and_grad

from tests.trainutil import sgd_step, split_step
from worker.comm import scalar
from worker.data import build_batch, eval_batches, rank_slice, stream_rows
from worker.events import EventKind, EventLog, Heartbeat
from worker.modelsetup import apply_method, count_parameters, trainable_text
from worker.runconfig import ConfigError, LoraSpec, parse_run_config
from worker.step import (
    all_sum_arrays,
    build_packed,
    decide_packing,
    flatten,
    pack_rows,
    packed_loss_sum,
    packing_is_exact,
    packing_saving,
    plan_packing,
    sequence_bucket,
    sft_weight,
    token_loss_sum,
)
from worker.tinymodel import build_tiny_model
from worker.train import main, step_seed

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "playbooks" / "data" / "smoke"

EXAMPLE = {
    "run_id": "r1", "model": "/srv/model", "data": "/srv/data", "method": "lora", "iters": 30,
    "learning_rate": 1e-4, "optimizer": "adam", "max_seq_length": 128, "grad_accumulation": 1,
    "grad_checkpoint": False, "num_layers": None, "lora": {"rank": 8, "scale": 20.0, "dropout": 0.0},
    "save_every": 10, "steps_per_eval": 10, "val_batches": 2, "seed": 0, "keep_checkpoints": 2,
    "ranks": [{"rank": 0, "node": "a", "batch_size": 3}, {"rank": 1, "node": "b", "batch_size": 1}],
    "run_dir": "~/mlx-work/runs/r1", "resume": False, "heartbeat_s": 1.0,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SMOKE)


def load_tiny(path: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import load

    loaded = load(str(path))
    return loaded[0], loaded[1]


def rows_of(tokenizer: Any, n: int) -> list[tuple[list[int], int]]:
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    train, _, _ = load_local_dataset(SMOKE, tokenizer, types.SimpleNamespace(mask_prompt=False))
    ds = CacheDataset(train)
    return [ds[i] for i in range(n)]


# --- tiny model -----------------------------------------------------------------------------------------------


def test_tiny_model_is_byte_deterministic_and_loads_offline(tiny: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = build_tiny_model(tmp_path / "again", SMOKE)
    names = sorted(p.name for p in tiny.iterdir())
    assert names == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:
        assert hashlib.sha256((tiny / name).read_bytes()).digest() == \
            hashlib.sha256((again / name).read_bytes()).digest(), name
    other_seed = build_tiny_model(tmp_path / "seed1", SMOKE, seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    ids = tok.encode("two plus three is five.")
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "two plus three is five."
    assert tok.unk_token_id not in tok.encode("Unseen WORDS still encode, as ASCII pieces!")
    model, wrapper = load_tiny(tiny)
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "llama" and len(model.layers) == config["num_hidden_layers"] == 2
    assert wrapper.eos_token_id == config["eos_token_id"]
    chat = wrapper.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       return_dict=False)
    assert len(chat) > 4
    assert model(mx.array([ids])).shape == (1, len(ids), config["vocab_size"])


# --- loss and exact combination ----------------------------------------------------------------------------------


def test_token_loss_sum_is_mlx_lm_default_loss_times_tokens(tiny: Path) -> None:
    from mlx_lm.tuner.trainer import default_loss

    model, tok = load_tiny(tiny)
    rows = rows_of(tok, 4)
    batch, lengths = build_batch(rows, 64)
    loss_sum, ntoks, real = token_loss_sum(model, batch, lengths)
    mean, ntoks_ref = default_loss(model, batch, lengths)  # type: ignore[no-untyped-call]
    assert int(scalar(ntoks)) == int(scalar(ntoks_ref)) > 0
    assert math.isclose(scalar(loss_sum) / scalar(ntoks), scalar(mean), rel_tol=1e-6)
    # The host counts the same weight without building the mask (what makes the weighting collective-free).
    assert sft_weight(rows, 64) == (int(scalar(ntoks)), int(scalar(real)))
    for width in (16, 23):  # truncated rows and a prompt offset too
        cut = [(t, 3) for t, _ in rows]
        _, n, r = token_loss_sum(model, *build_batch(cut, width))
        assert sft_weight(cut, width) == (int(scalar(n)), int(scalar(r)))


def test_weighted_combination_equals_one_rank_with_the_global_batch(tiny: Path) -> None:
    """A 3/1 split through the compiled step, each rank scaling its gradient SUM by 1/(global weight) before the
    all_sum, makes the update of one rank with the 4-row batch (mlx-lm's default_loss gradient)."""
    from mlx_lm.tuner.trainer import default_loss

    def full_model() -> Any:
        model, _ = load_tiny(tiny)
        apply_method(model, "full", None, LoraSpec())
        return model

    model, tok = load_tiny(tiny)
    apply_method(model, "full", None, LoraSpec())
    rows = rows_of(tok, 4)
    (ref_loss, _), ref_grads = value_and_grad(model, default_loss)(model, *build_batch(rows, 64))
    ref = flatten(ref_grads)
    total = sft_weight(rows, 64)[0]
    assert sft_weight(rows[:3], 64)[0] != 3 * sft_weight(rows[3:], 64)[0]  # unequal counts: weighting matters
    _, applied, loss = split_step(full_model, token_loss_sum, build_batch(rows[:3], 64), build_batch(rows[3:], 64),
                                  total)
    assert math.isclose(loss, scalar(ref_loss), rel_tol=1e-5)
    for name, g in ref.items():
        assert mx.allclose(applied[name], g, atol=1e-6, rtol=1e-3), name
    # negative control: the plain average of the two ranks' mean gradients (mlx-lm's average_gradients) is not it
    m0, m1 = (flatten(value_and_grad(model, default_loss)(model, *build_batch(part, 64))[1])
              for part in (rows[:3], rows[3:]))
    assert any(not mx.allclose((m0[k] + m1[k]) / 2, ref[k], atol=1e-6, rtol=1e-3) for k in ref)


def test_all_sum_buckets_preserve_names_and_shapes() -> None:
    arrays = {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3), "b": mx.ones((5,)), "c": mx.array(7.0),
              "d": mx.arange(4, dtype=mx.int32)}
    calls: list[int] = []

    def fake_all_sum(x: mx.array) -> mx.array:  # two identical ranks
        calls.append(x.size)
        return x * 2

    out = all_sum_arrays(arrays, fake_all_sum, bucket_bytes=16)
    assert len(calls) >= 3  # small buckets force several collectives
    for name, arr in arrays.items():
        assert out[name].shape == arr.shape and out[name].dtype == arr.dtype
        assert mx.array_equal(out[name], arr * 2), name


def test_a_step_reduces_in_one_collective_with_the_loss_riding_along(tiny: Path) -> None:
    model, tok = load_tiny(tiny)
    apply_method(model, "lora", None, LoraSpec(rank=4))
    rows = rows_of(tok, 2)
    calls: list[int] = []

    def two_ranks(x: mx.array) -> mx.array:
        calls.append(x.size)
        return x * 2

    trainable = sum(v.size for v in flatten(model.trainable_parameters()).values())
    _, loss = sgd_step(model, token_loss_sum, build_batch(rows, 64), two_ranks, 2, 2 * sft_weight(rows, 64)[0])
    assert calls == [trainable + 1]  # float32 gradients and the loss: ONE all_sum, no count collective
    assert math.isfinite(loss)


def test_a_step_without_weight_gives_zero_gradient_not_nan(tiny: Path) -> None:
    model, tok = load_tiny(tiny)
    apply_method(model, "lora", None, LoraSpec(rank=4))
    rows = [(t, 10_000) for t, _ in rows_of(tok, 2)]  # a prompt offset past the row: nothing is scored
    applied, loss = sgd_step(model, token_loss_sum, build_batch(rows, 64), lambda x: x, 1, sft_weight(rows, 64)[0])
    assert loss == 0.0 and all(float(mx.abs(g).max().item()) == 0.0 for g in applied.values())


# --- packing ---------------------------------------------------------------------------------------------------


def test_plan_packing_fills_in_stream_order() -> None:
    assert plan_packing([5, 4, 3, 7, 2, 9], 10, 3) == ([[0, 1], [2, 3], [4]], 5)  # 9 opens a 4th: not taken
    assert plan_packing([10, 10], 10, 3) == ([[0], [1], []], 2)
    assert plan_packing([3, 3, 3, 3], 10, 1) == ([[0, 1, 2]], 3)
    with pytest.raises(ValueError, match="does not fit"):
        plan_packing([11], 10, 1)


def test_packing_saving_comes_from_variable_lengths_in_a_batch() -> None:
    # Rows of very different lengths: the unpacked batch pads all 8 to the longest (127 positions).
    assert packing_saving([16, 120, 30, 20, 100, 18, 25, 40] * 4, 512, 8) == 0.5  # 3 sequences, bucketed to 4
    assert packing_saving([20, 25, 30, 22] * 8, 512, 4) == 0.0  # similar lengths: nothing to save
    assert packing_saving([512] * 16, 512, 4) == 0.0


def test_sequence_bucket_takes_few_values() -> None:
    assert [sequence_bucket(k, 8) for k in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [sequence_bucket(k, 3) for k in range(1, 4)] == [1, 2, 3]
    assert [sequence_bucket(k, 6) for k in range(1, 7)] == [1, 2, 3, 6, 6, 6]


def test_pack_rows_keeps_the_padded_width_and_every_row(tiny: Path) -> None:
    _, tok = load_tiny(tiny)
    rows = rows_of(tok, 8)
    packed = pack_rows(rows, 128)
    width = build_batch(rows, 128)[0].shape[1] - 1
    assert packed.inputs.shape[1] == width and packed.inputs.shape[0] < len(rows)
    assert int(packed.segments.max().item()) >= 2 and int((packed.segments > 0).sum().item()) == sft_weight(rows, 128)[1]


@pytest.mark.parametrize("offset", [0, 4])
def test_packed_loss_equals_unpacked_loss_on_the_same_rows(tiny: Path, offset: int) -> None:
    """Exactness of packing: the same rows' loss sum, weight and tokens, packed into one sequence with
    block-diagonal attention, equal the unpacked batch's (float tolerance), and so does the update."""
    model, tok = load_tiny(tiny)
    rows = [(t, offset) for t, _ in rows_of(tok, 6)]
    length = 128
    seqs, used = plan_packing([min(len(t), length - 1) for t, _ in rows], length - 1, 2)
    assert used == 6 and sum(len(s) > 1 for s in seqs) >= 1  # several rows share a sequence
    packed = build_packed([[rows[k] for k in seq] for seq in seqs], length)
    p_sum, p_w, p_tok = packed_loss_sum(model, *packed.arrays())
    u_sum, u_w, u_tok = token_loss_sum(model, *build_batch(rows, length))
    assert (int(scalar(p_w)), int(scalar(p_tok))) == (int(scalar(u_w)), int(scalar(u_tok))) == sft_weight(rows, length)
    assert math.isclose(scalar(p_sum), scalar(u_sum), rel_tol=1e-5)
    assert packing_is_exact(model, rows[:3], length) is None
    # ... and the gradient: one SGD step each way from the same weights.
    packed_model, _ = load_tiny(tiny)
    apply_method(packed_model, "lora", None, LoraSpec(rank=4))
    apply_method(model, "lora", None, LoraSpec(rank=4))
    mx.eval(model.parameters())
    packed_model.update(model.parameters())
    weight = sft_weight(rows, length)[0]
    g_packed, l_packed = sgd_step(packed_model, packed_loss_sum, pack_rows(rows, length).arrays(), lambda x: x, 1,
                                  weight)
    g_plain, l_plain = sgd_step(model, token_loss_sum, build_batch(rows, length), lambda x: x, 1, weight)
    assert math.isclose(l_packed, l_plain, rel_tol=1e-5)
    for name, g in g_plain.items():
        assert mx.allclose(g_packed[name], g, atol=1e-6, rtol=1e-3), name


def test_packing_is_refused_for_a_model_that_ignores_the_mask(tiny: Path) -> None:
    model, tok = load_tiny(tiny)
    rows = rows_of(tok, 3)

    class NoHook:  # attention that never asks the cache for a mask: packed documents would see each other
        def __init__(self, inner: Any) -> None:
            self.inner, self.layers, self.training = inner, inner.layers, True

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            return self.inner(inputs)

        def eval(self) -> None: ...

        def train(self, mode: bool = True) -> None: ...

        def trainable_parameters(self) -> Any:
            return self.inner.trainable_parameters()

        def update(self, params: Any) -> None:
            self.inner.update(params)

        def parameters(self) -> Any:
            return self.inner.parameters()

    why = packing_is_exact(NoHook(model), rows, 128)
    assert why is not None and ("!=" in why or "does not take" in why)


def test_decide_packing_follows_the_setting_and_the_data(tiny: Path) -> None:
    model, tok = load_tiny(tiny)
    dataset = rows_of(tok, 40)  # the demo's rows: 5 to 30-odd tokens, in batches of 4
    off = decide_packing("off", model, dataset, max_seq_length=128, global_batch=4, seed=0)
    assert off[:2] == (False, "train.packing is off")
    packs, why, width = decide_packing("auto", model, dataset, max_seq_length=128, global_batch=4, seed=0)
    longest = max(len(t) for t, _ in dataset)
    assert packs and why.startswith(f"packed into sequences of {width} positions: saves")
    assert width == min(1 + 32 * -(-longest // 32), 128) - 1  # the longest sampled row's padded width
    full = [(list(range(1, 130)), 0)] * 8  # every row as long as the batch: nothing to save
    packs, why, _ = decide_packing("auto", model, full, max_seq_length=128, global_batch=4, seed=0)
    assert not packs and "< 10%" in why


def test_packed_batches_of_a_run_take_one_width() -> None:
    short = [([1] * n, 0) for n in (5, 9)]
    assert pack_rows(short, 512).inputs.shape[1] == 32  # its own padded width by default
    assert pack_rows(short, 512, 127).inputs.shape[1] == 127  # the run's width
    long = [([1] * 200, 0), ([1] * 5, 0)]
    assert pack_rows(long, 512, 127).inputs.shape[1] == 224  # never narrower than the rows need


# --- method setup ------------------------------------------------------------------------------------------------


def test_num_layers_default_is_all_layers_and_share_is_reported(tiny: Path) -> None:
    model, _ = load_tiny(tiny)
    assert apply_method(model, "full", None, LoraSpec()) == 2  # all layers, not mlx-lm's 16-layer default
    trainable, total = count_parameters(model)
    names = flatten(model.trainable_parameters())
    # full trains what `mlx_lm lora --fine-tune-type full` trains: the transformer blocks, not the embeddings,
    # lm_head or final norm.
    assert trainable < total and names and all(n.startswith("model.layers.") for n in names)
    assert trainable_text(trainable, total).startswith("trainable ")

    model, _ = load_tiny(tiny)
    apply_method(model, "full", None, LoraSpec(), train_embeddings=True)
    trainable, total = count_parameters(model)
    assert trainable == total  # the explicit option: every parameter
    assert trainable_text(trainable, total).startswith("trainable 100.00% (")
    with pytest.raises(ValueError, match="train_embeddings"):
        apply_method(load_tiny(tiny)[0], "full", 1, LoraSpec(), train_embeddings=True)

    model, _ = load_tiny(tiny)
    apply_method(model, "full", 1, LoraSpec())
    names = flatten(model.trainable_parameters())
    assert names and all(n.startswith("model.layers.1.") for n in names)

    model, _ = load_tiny(tiny)
    assert apply_method(model, "lora", None, LoraSpec(rank=4)) == 2
    names = flatten(model.trainable_parameters())
    assert {n.split(".")[2] for n in names} == {"0", "1"}  # both layers adapted
    assert all(n.rsplit(".", 1)[1] in ("lora_a", "lora_b") for n in names)
    trainable, total = count_parameters(model)
    assert 0 < trainable < total
    assert trainable_text(trainable, total) == f"trainable {100 * trainable / total:.2f}% ({trainable:,}/{total:,} parameters)"

    model, _ = load_tiny(tiny)
    apply_method(model, "dora", 1, LoraSpec(rank=4))
    assert any(n.endswith(".m") for n in flatten(model.trainable_parameters()))

    model, _ = load_tiny(tiny)
    with pytest.raises(ValueError, match="has 2 layers"):
        apply_method(model, "lora", 3, LoraSpec())


# --- data order ------------------------------------------------------------------------------------------------


def test_stream_order_is_per_epoch_permutation_and_plan_independent() -> None:
    n, seed = 10, 7
    epoch0 = stream_rows(0, n, n, seed)
    assert sorted(epoch0) == list(range(n)) and epoch0 != list(range(n))
    assert stream_rows(n, n, n, seed) != epoch0 and sorted(stream_rows(n, n, n, seed)) == list(range(n))
    assert stream_rows(3, 9, n, seed) == (epoch0 + stream_rows(n, n, n, seed))[3:12]  # crosses the epoch edge
    # a 3/1 split covers the global batch exactly, in order
    global_rows = stream_rows(4, 4, n, seed)
    assert rank_slice(global_rows, 0, 3) + rank_slice(global_rows, 3, 1) == global_rows
    # resuming at position p with another global batch continues the same stream
    assert stream_rows(0, 8, n, seed)[4:] == stream_rows(4, 2, n, seed) + stream_rows(6, 2, n, seed)


def test_eval_batches_and_padding() -> None:
    assert eval_batches(5, 4, 2) == [[0, 1, 2, 3], [4, 0, 1, 2]]  # cycles through a small set
    assert eval_batches(5, 4, -1) == [[0, 1, 2, 3], [4]]  # every row once, short last batch
    assert eval_batches(0, 4, 2) == [] and eval_batches(5, 4, 0) == []
    batch, lengths = build_batch([([1, 2, 3], 0), ([4] * 40, 2)], 2048)
    assert batch.shape == (2, 65)  # 1 + 32 * ceil(40 / 32), as mlx-lm
    assert lengths.tolist() == [[0, 3], [2, 40]]
    batch, lengths = build_batch([([5] * 100, 0)], 64)
    assert batch.shape == (1, 64) and lengths.tolist() == [[0, 64]]  # truncated to max_seq_length


def test_step_seed_is_stable_and_distinct() -> None:
    assert step_seed(0, 1) == step_seed(0, 1)
    assert len({step_seed(s, k) for s in range(3) for k in range(50)}) == 150
    assert 0 <= step_seed(123, 456) < 2**63


# --- config contract ---------------------------------------------------------------------------------------------


def test_example_config_parses(tmp_path: Path) -> None:
    cfg = parse_run_config(EXAMPLE)
    assert cfg.world_size == 2 and cfg.global_batch == 4 and cfg.rows_per_step == 4
    assert [cfg.rank_offset(r) for r in range(2)] == [0, 3]
    assert cfg.num_layers is None and cfg.run_dir == Path("~/mlx-work/runs/r1").expanduser()
    assert [cfg.checkpoint_writer(r) for r in range(2)] == [0, 1]
    assert parse_run_config({**EXAMPLE, "num_layers": -1}).num_layers is None
    same_node = parse_run_config({**EXAMPLE, "ranks": [{"rank": 1, "node": "a", "batch_size": 1},
                                                       {"rank": 0, "node": "a", "batch_size": 3}]})
    assert [cfg.rank for cfg in same_node.ranks] == [0, 1] and same_node.checkpoint_writer(1) == 0
    # the plan and output paths are not part of the training math
    assert same_node.digest() == cfg.digest() != parse_run_config({**EXAMPLE, "learning_rate": 2e-4}).digest()
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**EXAMPLE, "run_dir": ""}))
    from worker.runconfig import load_run_config

    assert load_run_config(path).run_dir == tmp_path.resolve()


@pytest.mark.parametrize(("patch", "message"), [
    ({"learning-rate": 1e-4}, "unknown config keys"),
    ({"method": "qlora"}, "method must be one of"),
    ({"num_layers": 0}, "num_layers"),
    ({"iters": 0}, "iters must be >= 1"),
    ({"grad_checkpoint": "yes"}, "grad_checkpoint must be true or false"),
    ({"lora": {"rank": 8, "alpha": 16, "dropout": 0.0}}, "not 'alpha'"),
    ({"ranks": [{"rank": 0, "node": "a", "batch_size": 3}, {"rank": 2, "node": "b", "batch_size": 1}]},
     "exactly once"),
    ({"ranks": [{"rank": 0, "node": "a", "batch_size": 0}]}, "batch_size must be >= 1"),
    ({"ranks": []}, "non-empty"),
])
def test_bad_configs_are_rejected(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_config({**EXAMPLE, **patch})


def test_bad_config_exits_1_with_an_error_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RANK", "1")
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**EXAMPLE, "run_dir": str(tmp_path), "optimizer": "lion"}))
    assert main(["--config", str(path)]) == 1
    events = [json.loads(line) for line in (tmp_path / "events" / "rank1.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["error"]
    assert "optimizer must be one of" in events[0]["message"] and events[0]["rank"] == 1


# --- events ------------------------------------------------------------------------------------------------------


def test_event_log_lines_are_json_with_the_common_fields(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events" / "rank3.jsonl", "run-x", 3)
    log.emit(EventKind.STEP, step=1, loss=float("nan"), grad_norm=float("inf"), path=tmp_path)
    hb = Heartbeat(log, interval=30.0)
    assert hb.interval == Heartbeat.MAX_INTERVAL  # never rarer than every 2 s
    hb.start()  # the first beat is immediate
    hb.stop()
    log.close()
    log.emit(EventKind.STEP, step=2)  # after close: dropped, not an exception
    lines = (tmp_path / "events" / "rank3.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["event"] for e in events] == ["step", "heartbeat"]
    for e in events:
        assert {"t", "run_id", "rank", "event"} <= set(e) and e["run_id"] == "run-x" and e["rank"] == 3
    assert events[0]["loss"] is None and events[0]["grad_norm"] is None and events[0]["path"] == str(tmp_path)
    assert events[1]["phase"] == "load" and isinstance(events[1]["pid"], int)


# --- the step loop in-process (world of 1) ---------------------------------------------------------------------


def run_in_process(tiny: Path, run_dir: Path, **overrides: Any) -> dict[str, mx.array]:
    """One Trainer.run() in this process (mx.distributed.init() gives a singleton group); final weights."""
    from worker.events import events_path
    from worker.train import Trainer, load_arrays

    raw = {**EXAMPLE, "model": str(tiny), "data": str(SMOKE), "run_dir": str(run_dir), "iters": 1,
           "method": "full", "optimizer": "sgd", "learning_rate": 0.5, "max_seq_length": 64, "save_every": 0,
           "steps_per_eval": 0, "ranks": [{"rank": 0, "node": "local", "batch_size": 4}], **overrides}
    config = parse_run_config(raw)
    log = EventLog(events_path(run_dir, 0), config.run_id, 0)
    try:
        Trainer(config, log, Heartbeat(log, 1.0), 0).run()
    finally:
        log.close()
    return load_arrays(run_dir / "checkpoints" / f"step-{config.iters:06d}" / "weights.safetensors")


def test_grad_accumulation_and_checkpointing_pool_tokens_like_one_big_batch(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.models.llama import TransformerBlock

    # grad_checkpoint patches the layer class for the process: undo it when the test ends
    monkeypatch.setattr(TransformerBlock, "__call__", TransformerBlock.__call__)
    one_batch = run_in_process(tiny, tmp_path / "b4")
    accumulated = run_in_process(tiny, tmp_path / "b2x2", grad_accumulation=2,
                                 ranks=[{"rank": 0, "node": "local", "batch_size": 2}])
    checkpointed = run_in_process(tiny, tmp_path / "b2x2ck", grad_accumulation=2, grad_checkpoint=True,
                                  ranks=[{"rank": 0, "node": "local", "batch_size": 2}])
    for name, w in one_batch.items():
        assert mx.allclose(accumulated[name], w, atol=1e-6), name
        assert mx.allclose(checkpointed[name], w, atol=1e-6), name
    steps = [json.loads(line) for line in (tmp_path / "b2x2" / "events" / "rank0.jsonl").read_text().splitlines()]
    step = next(e for e in steps if e["event"] == "step")
    assert step["data_position"] == 4 and step["tokens"] == step["total_tokens"]


def test_a_world_smaller_than_the_plan_is_an_error(tiny: Path, tmp_path: Path) -> None:
    """Without a launcher, init() silently gives a world of 1: a 2-rank plan must refuse to start."""
    with pytest.raises(RuntimeError, match="gave a world of 1, the plan has 2 ranks"):
        run_in_process(tiny, tmp_path, ranks=EXAMPLE["ranks"])


def test_one_rank_takes_the_whole_step_in_one_graph_with_the_same_update(tiny: Path) -> None:
    """TrainStep.run on one rank and one micro-batch compiles the whole step as one graph (as mlx-lm does); its
    loss, grad norm and update equal the general path's (local sums, then scale and update)."""
    import mlx.optimizers as optim

    from worker.objectives import Micro
    from worker.step import TrainStep

    _, tok = load_tiny(tiny)
    rows = rows_of(tok, 4)
    weight, tokens = sft_weight(rows, 64)
    micro = Micro(build_batch(rows, 64), weight, weight, tokens, tokens, 4)
    results = []
    for general in (False, True):
        model, _ = load_tiny(tiny)
        mx.random.seed(0)  # the same adapters' initial weights both ways
        apply_method(model, "lora", None, LoraSpec(rank=4))
        opt = optim.Adam(learning_rate=1e-2)
        opt.init(model.trainable_parameters())
        step = TrainStep(model, opt, token_loss_sum, all_sum=lambda x: x, world_size=1)
        done = step.run(lambda: [micro], after_local=(lambda local: local) if general else None)
        results.append((scalar(done.loss), scalar(done.norm), scalar(done.local_loss), scalar(done.local_norm),
                        flatten(model.trainable_parameters())))
    (l1, n1, ll1, ln1, p1), (l2, n2, ll2, ln2, p2) = results
    assert math.isclose(l1, l2, rel_tol=1e-5) and math.isclose(n1, n2, rel_tol=1e-4)
    assert math.isclose(ll1, l1, rel_tol=1e-6) and math.isclose(ln1, n1, rel_tol=1e-4)  # one rank: its own = global
    assert math.isclose(ll2, l2, rel_tol=1e-5) and math.isclose(ln2, n2, rel_tol=1e-4)
    for name, value in p1.items():
        assert mx.allclose(value, p2[name], atol=1e-6, rtol=1e-4), name


def test_a_pipelined_or_fused_exchange_makes_the_same_update_as_an_evaluated_one(tiny: Path) -> None:
    """worker.exchange: on a GPU without a memory bound the summed buckets are dispatched as they are built
    (mx.async_eval) and the update follows in the step's last evaluation; else they are evaluated on their own
    first; fused, the backward is not evaluated before the exchange is queued. Same buckets, same update, bit for
    bit (two identical ranks: the all_sum doubles), and every bucket dispatched once."""
    import mlx.optimizers as optim

    import worker.step as step_mod
    from worker.exchange import Exchange, exchange_for
    from worker.objectives import Micro
    from worker.step import TrainStep

    # dispatched only on a GPU with no memory bound (under one, the limit makes MLX wait: worker.exchange)
    assert [exchange_for(gpu, bounded).pipelined for gpu in (True, False) for bounded in (False, True)] == [
        True, False, False, False]
    gpu, cpu = exchange_for(True, True).bucket_bytes, exchange_for(False, False).bucket_bytes
    assert gpu > cpu == step_mod.ALL_REDUCE_BYTES
    assert [exchange_for(gpu, bounded).fused for gpu in (True, False) for bounded in (False, True)] == [
        True, True, False, False]  # never on the CPU backend: its collectives stay out of lazy graphs
    _, tok = load_tiny(tiny)
    rows = rows_of(tok, 4)
    weight, tokens = sft_weight(rows, 64)
    micro = Micro(build_batch(rows, 64), weight, 2 * weight, tokens, 2 * tokens, 4)
    real_async = step_mod.mx.async_eval
    results = []
    for exchange in (Exchange(False, 4096), Exchange(True, 4096), Exchange(False, 4096, fused=True),
                     Exchange(True, 4096, fused=True)):
        model, _ = load_tiny(tiny)
        mx.random.seed(0)
        apply_method(model, "lora", None, LoraSpec(rank=4))
        opt = optim.Adam(learning_rate=1e-2)
        opt.init(model.trainable_parameters())
        reduced: list[mx.array] = []
        dispatched: list[int] = []

        def all_sum(x: mx.array, reduced: list[mx.array] = reduced) -> mx.array:
            reduced.append(x * 2)
            return reduced[-1]

        step_mod.mx.async_eval = lambda *a, seen=dispatched: (seen.append(len(a)), real_async(*a))[1]
        try:
            step = TrainStep(model, opt, token_loss_sum, all_sum=all_sum, world_size=2, exchange=exchange)
            done = step.run(lambda: [micro])
        finally:
            step_mod.mx.async_eval = real_async
        assert len(reduced) >= 3  # small buckets: several collectives
        # fused: the rank's compute is dispatched once, before the exchange is built
        assert len(dispatched) == (len(reduced) if exchange.pipelined else 0) + exchange.fused
        assert 0 < done.compute_s <= done.elapsed
        results.append((scalar(done.loss), scalar(done.norm), flatten(model.trainable_parameters())))
    (l1, n1, p1), *others = results
    for l2, n2, p2 in others:
        assert l1 == l2 and n1 == n2
        for name, value in p1.items():
            assert mx.array_equal(value, p2[name]), name


def test_train_step_clear_cache_gives_the_cache_back_after_each_step(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train.clear_cache`: mx.clear_cache() after the step's evaluation, on both paths of TrainStep.run; the
    step's result is the same."""
    import mlx.optimizers as optim

    import worker.step as step_mod
    from worker.objectives import Micro
    from worker.step import TrainStep

    _, tok = load_tiny(tiny)
    rows = rows_of(tok, 4)
    weight, tokens = sft_weight(rows, 64)
    micro = Micro(build_batch(rows, 64), weight, weight, tokens, tokens, 4)
    cleared: list[int] = []
    real = step_mod.mx.clear_cache
    monkeypatch.setattr(step_mod.mx, "clear_cache", lambda: (cleared.append(1), real())[1])
    losses = []
    for clear, general in ((False, False), (True, False), (True, True)):
        model, _ = load_tiny(tiny)
        mx.random.seed(0)
        apply_method(model, "lora", None, LoraSpec(rank=4))
        opt = optim.Adam(learning_rate=1e-2)
        opt.init(model.trainable_parameters())
        before = len(cleared)
        step = TrainStep(model, opt, token_loss_sum, all_sum=lambda x: x, world_size=1, clear_cache=clear)
        done = step.run(lambda: [micro], after_local=(lambda local: local) if general else None)
        assert len(cleared) - before == (1 if clear else 0)
        losses.append(scalar(done.loss))
    assert losses[0] == losses[1] and math.isclose(losses[0], losses[2], rel_tol=1e-5)


def test_step_memory_limit_is_the_working_set_plus_headroom() -> None:
    from worker.memory import batch_size_of, compute_limit

    assert compute_limit(1000, 0.1) == 1100 and compute_limit(1000, 0.0) == 1000
    assert batch_size_of([mx.zeros((4, 64)), mx.zeros((4, 2))]) == 264 and batch_size_of([]) == 0


def test_step_memory_bounds_steps_by_the_working_set_measured_per_larger_shape(tiny: Path) -> None:
    """`train.memory_headroom`: the first step (and the first of every larger batch shape) runs with nothing in
    flight and sets MLX's memory limit to its peak x (1 + headroom); a smaller shape measures nothing; the steps'
    results equal the unbounded ones; the process peak keeps the peaks from before the measuring steps' resets;
    `release` gives MLX its limit back; no headroom (null) sets nothing."""
    import mlx.optimizers as optim

    from worker.memory import StepMemory, batch_size_of, compute_limit, peak_memory
    from worker.objectives import Micro
    from worker.step import TrainStep

    _, tok = load_tiny(tiny)
    default_limit = mx.get_memory_limit()

    def micro(n: int, width: int) -> Micro:
        rows = rows_of(tok, n)
        weight, tokens = sft_weight(rows, width)
        return Micro(build_batch(rows, width), weight, weight, tokens, tokens, n)

    small, large = micro(2, 32), micro(4, 64)
    sizes = {id(small): batch_size_of(small.inputs), id(large): batch_size_of(large.inputs)}
    assert sizes[id(small)] < sizes[id(large)]
    losses: dict[float | None, list[float]] = {}
    for headroom in (None, 0.25):
        model, _ = load_tiny(tiny)
        mx.random.seed(0)
        apply_method(model, "lora", None, LoraSpec(rank=4))
        opt = optim.Adam(learning_rate=1e-2)
        opt.init(model.trainable_parameters())
        memory = StepMemory(headroom)
        step = TrainStep(model, opt, token_loss_sum, all_sum=lambda x: x, world_size=1, memory=memory)
        measured = []
        for batch in (small, small, large, small, large):
            before = peak_memory()
            losses.setdefault(headroom, []).append(scalar(step.run(lambda b=batch: [b]).loss))
            assert peak_memory() >= before  # the resets made here never lower the process's peak
            measured.append(memory.measured_size)
            if headroom is not None:
                assert memory.limit == compute_limit(memory.working_set, headroom) == mx.get_memory_limit()
        if headroom is None:
            assert measured == [0] * 5 and mx.get_memory_limit() == default_limit
        else:
            s, g = sizes[id(small)], sizes[id(large)]
            assert measured == [s, s, g, g, g]  # once for the small shape, once more for the larger one
            assert 0 < memory.working_set <= peak_memory()
            memory.release()
            assert mx.get_memory_limit() == default_limit
    for a, b in zip(losses[None], losses[0.25], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5)
    # A step that fails while it measures gives MLX its limit back (else every later eval would wait on each op).
    memory = StepMemory(0.1)
    failing = TrainStep(model, opt, token_loss_sum, all_sum=lambda x: x, world_size=1, memory=memory)

    def boom(local: Any) -> Any:
        assert mx.get_memory_limit() == 1  # measuring: nothing in flight
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing.run(lambda: [large], after_local=boom)
    assert mx.get_memory_limit() == default_limit
