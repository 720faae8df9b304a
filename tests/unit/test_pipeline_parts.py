"""The pipeline's parts without processes: the schedules (pure), the names a stage holds (pure), a stage's loading
(only its own tensors are read), and the stages chained in one process against the whole model (loss and every
gradient, LoRA and full, packed and not). The same over real ranks: tests/unit/test_pipeline_exact.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.utils import value_and_grad

from worker.comm import scalar
from worker.data import build_batch
from worker.errors import TrainingError
from worker.modelsetup import apply_method
from worker.parallel.pipeline.layout import StageRange, layer_of, renumber, to_global, to_local, wanted, weight_files
from worker.parallel.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_GRAD,
    SCHEDULES,
    SEND_ACT,
    Action,
    bubble,
    build_schedule,
    simulate,
)
from worker.parallel.pipeline.stage import chunks_of, load_stage, split_rows
from worker.runconfig import LoraSpec
from worker.step import flatten, pack_rows, packed_loss_sum, token_loss_sum
from worker.tensorfile import write_safetensors
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "playbooks" / "data" / "smoke"
SPLIT = ((0, 1), (1, 4), (4, 6))

# --- schedules -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_to_its_end_under_blocking_transfers(name: str) -> None:
    for stages in range(1, 6):
        for micro in range(1, 10):
            lists = [build_schedule(name, s, stages, micro) for s in range(stages)]
            sim = simulate(lists)
            assert sim.done, (stages, micro, sim.stuck)
            for actions in lists:  # every micro-batch forward and backward exactly once, forward first
                fwd = [a.micro for a in actions if a.kind == FORWARD]
                bwd = [a.micro for a in actions if a.kind == BACKWARD]
                assert sorted(fwd) == sorted(bwd) == list(range(micro))
                assert all(actions.index(Action(FORWARD, m)) < actions.index(Action(BACKWARD, m)) for m in fwd)


def test_1f1b_bounds_what_a_stage_holds_in_flight_and_gpipe_does_not() -> None:
    for stages in range(1, 6):
        for micro in range(1, 10):
            one_f = simulate([build_schedule("1f1b", s, stages, micro) for s in range(stages)])
            assert one_f.in_flight == tuple(min(stages - s, micro) for s in range(stages))
            gpipe = simulate([build_schedule("gpipe", s, stages, micro) for s in range(stages)])
            assert gpipe.in_flight == (micro,) * stages
    assert bubble(3, 8) == pytest.approx(2 / 10) and bubble(1, 4) == 0


def test_the_simulation_sees_a_deadlock() -> None:
    # Textbook 1F1B with the forward's send before the backward's receive: in the steady state both neighbours
    # wait to send on the same link.
    def naive(stage: int, stages: int, micro: int) -> list[Action]:
        out = build_schedule("1f1b", stage, stages, micro)
        for i in range(len(out) - 1):
            if out[i].kind == RECV_GRAD and out[i + 1].kind == SEND_ACT:
                out[i], out[i + 1] = out[i + 1], out[i]
        return out

    sim = simulate([naive(s, 3, 4) for s in range(3)])
    assert not sim.done and any(s is not None for s in sim.stuck)


def test_bad_schedule_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zb", 0, 2, 2)
    with pytest.raises(ValueError, match="stage 2 of 2"):
        build_schedule("1f1b", 2, 2, 2)


# --- names ---------------------------------------------------------------------------------------------------------


def test_layer_numbers_move_between_local_and_global_names() -> None:
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12 and layer_of("model.norm.weight") is None
    assert renumber("model.layers.0.self_attn.q_proj.lora_a", 4) == "model.layers.4.self_attn.q_proj.lora_a"
    assert renumber("lm_head.weight", 4) == "lm_head.weight"
    names = {"model.layers.0.a": 1, "model.layers.2.b": 2, "model.norm.weight": 3}
    assert to_global(names, 3) == {"model.layers.3.a": 1, "model.layers.5.b": 2, "model.norm.weight": 3}
    assert to_local(to_global(names, 3), 3) == names


def test_a_stage_wants_its_blocks_and_the_modules_it_keeps() -> None:
    middle = StageRange(1, 3, 1, 4)
    assert wanted("model.layers.1.mlp.w", middle, []) and wanted("model.layers.3.mlp.w", middle, [])
    assert not wanted("model.layers.4.mlp.w", middle, []) and not wanted("model.layers.0.mlp.w", middle, [])
    assert not wanted("model.embed_tokens.weight", middle, [])
    assert wanted("model.embed_tokens.weight", StageRange(0, 3, 0, 1), ["model.embed_tokens"])
    assert not wanted("model.embed_tokens_extra.weight", StageRange(0, 3, 0, 1), ["model.embed_tokens"])


def test_split_rows_gives_near_equal_non_empty_slices() -> None:
    assert split_rows(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_rows(2, 4) == [(0, 1), (1, 2)]
    assert split_rows(8, 1) == [(0, 8)]


# --- loading and the computations -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny6"), SMOKE, layers=6)


@pytest.fixture(scope="module")
def sharded(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model re-saved as one safetensors file per layer (and one for the rest) with an index, as big
    models come."""
    out = tmp_path_factory.mktemp("sharded")
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    loaded = mx.load(str(tiny / "model.safetensors"))
    assert isinstance(loaded, dict)
    files: dict[str, dict[str, mx.array]] = {}
    for name, arr in loaded.items():
        layer = layer_of(name)
        files.setdefault("model-rest.safetensors" if layer is None else f"model-{layer:02d}.safetensors", {})[name] = arr
    for file, arrays in files.items():
        write_safetensors(out / file, arrays)
    weight_map = {n: file for file, arrays in files.items() for n in arrays}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def test_a_stage_reads_only_its_own_files(sharded: Path) -> None:
    assert weight_files(sharded)["model.layers.2.mlp.up_proj.weight"] == sharded / "model-02.safetensors"
    # Every file the middle stage must not read is replaced by garbage: it loads all the same.
    for layer in (0, 4, 5):
        (sharded / f"model-{layer:02d}.safetensors").write_bytes(b"not a safetensors file")
    (sharded / "model-rest.safetensors").write_bytes(b"garbage")
    stage, count = load_stage(sharded, StageRange(1, 3, 1, 4), seed=0, method="full", num_layers=None,
                              lora=LoraSpec(), grad_checkpoint=False)
    assert count == 6 and stage.total_layers == 6 and len(stage.model.model.layers) == 3
    names = set(flatten(stage.model.parameters()))
    assert not any("embed_tokens" in n or n.startswith(("model.norm", "lm_head")) for n in names)
    assert {layer_of(n) for n in names} == {0, 1, 2}  # local numbering
    with pytest.raises((ValueError, RuntimeError, OSError)):
        load_stage(sharded, StageRange(0, 3, 0, 1), seed=0, method="full", num_layers=None, lora=LoraSpec(),
                   grad_checkpoint=False)


def test_a_split_that_misses_the_model_end_is_refused(tiny: Path) -> None:
    with pytest.raises(TrainingError, match="the last stage must end at layer 6"):
        load_stage(tiny, StageRange(1, 2, 3, 5), seed=0, method="lora", num_layers=None, lora=LoraSpec(),
                   grad_checkpoint=False)


def whole_model(tiny: Path, method: str) -> Any:
    from mlx_lm.utils import load

    model = load(str(tiny))[0]
    mx.random.seed(3)
    apply_method(model, method, None, LoraSpec(rank=4, scale=2.0))
    return model


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("packed", [False, True])
def test_chained_stages_give_the_whole_models_loss_and_gradients(tiny: Path, method: str, packed: bool) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer: Any = load_tokenizer(tiny)
    rows = [(tokenizer.encode(" ".join(["word"] * (3 + 5 * i))), 0) for i in range(4)]
    model = whole_model(tiny, method)
    if method == "lora":  # B starts at zero, which would leave every A gradient zero: give it values
        lora_b = {k: mx.full(v.shape, 0.01) for k, v in flatten(model.trainable_parameters()).items()
                  if k.endswith("lora_b")}
        model.load_weights(list(lora_b.items()), strict=False)
    inputs = pack_rows(rows, 64).arrays() if packed else build_batch(rows, 64)
    loss_fn = packed_loss_sum if packed else token_loss_sum
    (want_loss, _, _), want = value_and_grad(model, loss_fn)(model, *inputs)
    want = flatten(want)
    stages = [load_stage(tiny, StageRange(i, 3, a, b), seed=3, method=method, num_layers=None,
                         lora=LoraSpec(rank=4, scale=2.0), grad_checkpoint=False)[0] for i, (a, b) in enumerate(SPLIT)]
    if method == "lora":
        for stage, (a, _) in zip(stages, SPLIT, strict=True):
            mine = {k: v for k, v in to_local(lora_b, a).items()
                    if (layer := layer_of(k)) is not None and layer < len(stage.model.model.layers)}
            stage.model.load_weights(list(mine.items()), strict=False)
    got: dict[str, mx.array] = {}
    total = mx.array(0.0)
    for chunk in chunks_of(inputs, packed, 3):
        xs = [chunk.inputs]
        for stage in stages[:-1]:
            xs.append(stage.forward(xs[-1], chunk))
        loss, grads, dx = stages[-1].loss_backward(xs[-1], chunk)
        total = total + loss
        per_stage = {2: grads}
        for i in (1, 0):
            assert dx is not None
            per_stage[i], dx = stages[i].backward(xs[i], chunk, dx)
        assert dx is None  # the first stage has no input gradient (its input is token ids)
        for i, g in per_stage.items():
            for k, v in to_global(flatten(g), SPLIT[i][0]).items():
                got[k] = got[k] + v if k in got else v
    assert scalar(total) == pytest.approx(scalar(want_loss), rel=1e-6)
    assert sorted(got) == sorted(want)
    scale = max(scalar(mx.max(mx.abs(v))) for v in want.values())
    for k, v in want.items():
        assert scalar(mx.max(mx.abs(got[k] - v))) <= 1e-6 * scale, k
    if method == "lora":
        assert all(scalar(mx.max(mx.abs(v))) > 0 for k, v in want.items() if k.endswith("lora_a"))

