"""Pipeline parallel is exact: a pipeline over 2 and 3 real ranks (`mlx.launch --backend ring` on 127.0.0.1, the
real `worker.train`) with uneven layer splits takes the same steps as ONE process over the same rows, for LoRA and
full fine-tuning, with packing on and off.

Per case, two steps with a checkpoint after each, compared with a single-process data-parallel run of the same
config: the loss and the gradient norm of every step (every stage reports the global ones), the weights after
each step (the stages' shards merged by their global layer names against the single process's checkpoint), and
the validation loss. With SGD the weights after step 1 are w0 - lr * g: equal weights there are equal gradients;
step 2 then starts from the updated weights, so its loss checks the update too. SGD, not Adam: Adam's first
steps move every weight by about lr * sign(g), so a gradient entry within float noise of 0 may move either way in
two exact runs. Float32 throughout; tolerances are float32 summation-order differences (the pipeline sums its
micro-batches' gradients, the single process sums the rows in one graph).

Plus, without processes: the schedules are deadlock-free under blocking transfers and bound what is held in
flight; a stage reads only its own tensors; the stages chained in one process give the whole model's loss and
gradients."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.unit.test_train_distributed import (
    PYTHON,
    SMOKE,
    kinds,
    launch,
    read_events,
    require_finished,
    run_direct,
    write_config,
)
from worker.checkpoint import WEIGHTS
from worker.comm import scalar
from worker.tinymodel import build_tiny_model

LAYERS = 6
RTOL = 1e-5
ATOL = 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    packing: str
    split: tuple[int, ...]  # layers per stage
    micro_batches: int
    schedule: str = "1f1b"

    def stages(self) -> list[dict[str, int]]:
        out, at = [], 0
        for rank, n in enumerate(self.split):
            out.append({"rank": rank, "first_layer": at, "last_layer": at + n})
            at += n
        return out


CASES = (
    Case("lora-2-unpacked", "lora", "off", (2, 4), 2),
    Case("lora-3-packed", "lora", "on", (1, 3, 2), 4),
    Case("full-3-unpacked", "full", "off", (1, 3, 2), 3, schedule="gpipe"),
    Case("full-2-packed", "full", "on", (4, 2), 2),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per case: (pipeline run dir, single-process run dir). One reference per (method, packing)."""
    root = tmp_path_factory.mktemp("pipe")
    model = build_tiny_model(root / "model", SMOKE, layers=LAYERS)
    base = {"model": str(model), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1, "seed": 0,
            "keep_checkpoints": 3, "heartbeat_s": 0.5, "num_layers": None, "iters": 2, "save_every": 1,
            "steps_per_eval": 2, "consistency_every": 1, "learning_rate": 0.05, "lora": {"rank": 4, "scale": 2.0}}
    out: dict[str, tuple[Path, Path]] = {}
    refs: dict[tuple[str, str], Path] = {}
    for case in CASES:
        common = {**base, "method": case.method, "packing": case.packing, "optimizer": "sgd"}
        key = (case.method, case.packing)
        if key not in refs:
            ref = root / f"ref-{'-'.join(key)}"
            cfg = write_config(ref / "run.json", **common, run_id=ref.name, run_dir=str(ref),
                               ranks=[{"rank": 0, "node": "local", "batch_size": 4}])
            proc = run_direct(cfg)
            require_finished(ref, [0], f"{proc.stderr}\nexit {proc.returncode}")
            refs[key] = ref
        pipe = root / case.name
        n = len(case.split)
        cfg = write_config(pipe / "run.json", **common, run_id=case.name, run_dir=str(pipe),
                           ranks=[{"rank": r, "node": "local", "batch_size": 4} for r in range(n)],
                           layout={"kind": "pipeline", "stages": case.stages(), "micro_batches": case.micro_batches,
                                   "schedule": case.schedule})
        log = launch(pipe, [PYTHON, "-m", "worker.train", "--config", str(cfg)], n=n)
        require_finished(pipe, list(range(n)), log)
        out[case.name] = (pipe, refs[key])
    # Resume: the first case's pipeline goes on to step 3 from its step-2 shards, against one process's 3 steps.
    case = CASES[0]
    common = {**base, "method": case.method, "packing": case.packing, "optimizer": "sgd", "iters": 3}
    ref3 = root / "ref-3-steps"
    proc = run_direct(write_config(ref3 / "run.json", **common, run_id=ref3.name, run_dir=str(ref3),
                                   ranks=[{"rank": 0, "node": "local", "batch_size": 4}]))
    require_finished(ref3, [0], f"{proc.stderr}\nexit {proc.returncode}")
    pipe = out[case.name][0]
    cfg = write_config(pipe / "resume.json", **common, run_id=case.name, run_dir=str(pipe), resume=True,
                       ranks=[{"rank": r, "node": "local", "batch_size": 4} for r in range(len(case.split))],
                       layout={"kind": "pipeline", "stages": case.stages(), "micro_batches": case.micro_batches})
    log = launch(pipe / "resume", [PYTHON, "-m", "worker.train", "--config", str(cfg)], n=len(case.split))
    require_finished(pipe, list(range(len(case.split))), log)
    out["resumed"] = (pipe, ref3)
    return out


def merged_shards(run_dir: Path, stages: int, step: int) -> dict[str, mx.array]:
    merged: dict[str, mx.array] = {}
    for rank in range(stages):
        loaded = mx.load(str(run_dir / "checkpoints" / f"stage-{rank}" / f"step-{step:06d}" / WEIGHTS))
        assert isinstance(loaded, dict)
        assert not set(loaded) & set(merged), "two stages saved the same parameter"
        merged.update(loaded)
    return merged


def first_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of a rank's first run (a resumed run appends its own after them)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "started"]
    return events[:starts[1]] if len(starts) > 1 else events


def assert_close(a: float, b: float, rtol: float = RTOL) -> None:
    assert abs(a - b) <= rtol * max(abs(b), 1e-3), (a, b)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_pipeline_step_equals_one_process_over_the_same_rows(runs: dict[str, tuple[Path, Path]],
                                                               case: Case) -> None:
    pipe, ref = runs[case.name]
    n = len(case.split)
    want_steps = kinds(read_events(ref, 0), "step")
    for rank in range(n):
        events = first_attempt(read_events(pipe, rank))
        [started] = kinds(events, "started")
        stage = case.stages()[rank]
        assert (started["first_layer"], started["last_layer"]) == (stage["first_layer"], stage["last_layer"])
        assert started["strategy"] == "pipeline" and started["packing"] == (case.packing == "on")
        steps = kinds(events, "step")
        assert [s["step"] for s in steps] == [1, 2]
        for got, want in zip(steps, want_steps, strict=True):
            assert got["total_tokens"] == want["total_tokens"]
            assert_close(got["loss"], want["loss"])
            assert_close(got["grad_norm"], want["grad_norm"], 1e-4)
        assert_close(kinds(events, "eval")[0]["val_loss"], kinds(read_events(ref, 0), "eval")[0]["val_loss"])
        assert [d["step"] for d in kinds(events, "digest")] == [1, 2]
    # Step 2's loss differs from step 1's: the comparison above saw an update, not a model standing still.
    assert want_steps[0]["loss"] != want_steps[1]["loss"]
    for step in (1, 2):
        got = merged_shards(pipe, n, step)
        loaded = mx.load(str(ref / "checkpoints" / f"step-{step:06d}" / WEIGHTS))
        assert isinstance(loaded, dict)
        assert sorted(got) == sorted(loaded)
        for name, want in loaded.items():
            diff = scalar(mx.max(mx.abs(got[name] - want)))
            assert diff <= ATOL + RTOL * scalar(mx.max(mx.abs(want))), (step, name, diff)


def test_a_pipeline_resumes_from_its_stage_shards_as_if_never_stopped(runs: dict[str, tuple[Path, Path]]) -> None:
    pipe, ref = runs["resumed"]
    want = kinds(read_events(ref, 0), "step")[2]
    for rank in range(2):
        events = read_events(pipe, rank)
        started = kinds(events, "started")[-1]
        assert started["resumed_from"] == 2 and started["data_position"] == 8
        [step3] = [e for e in kinds(events, "step") if e["step"] == 3]
        assert_close(step3["loss"], want["loss"])
        assert_close(step3["grad_norm"], want["grad_norm"], 1e-4)
    got = merged_shards(pipe, 2, 3)
    loaded = mx.load(str(ref / "checkpoints" / "step-000003" / WEIGHTS))
    assert isinstance(loaded, dict) and sorted(got) == sorted(loaded)
    for name, arr in loaded.items():
        assert scalar(mx.max(mx.abs(got[name] - arr))) <= ATOL + RTOL * scalar(mx.max(mx.abs(arr))), name


def test_each_stage_saves_only_its_own_layers_under_global_names(runs: dict[str, tuple[Path, Path]]) -> None:
    pipe, _ = runs["full-3-unpacked"]
    ranges = [(0, 1), (1, 4), (4, 6)]
    for rank, (first, last) in enumerate(ranges):
        ckpt = pipe / "checkpoints" / f"stage-{rank}" / "step-000002"
        loaded = mx.load(str(ckpt / WEIGHTS))
        assert isinstance(loaded, dict)
        layers = {int(k.split(".")[2]) for k in loaded if k.startswith("model.layers.")}
        assert layers == set(range(first, last))
        state = json.loads((ckpt / "state.json").read_text())
        assert state["stage"] == {"index": rank, "stages": 3, "first_layer": first, "last_layer": last,
                                  "model_layers": LAYERS}

