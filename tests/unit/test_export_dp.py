"""`worker.export` of a data-parallel run: its full copy (the newest valid `checkpoints/step-N/`) as an mlx_lm
adapter dir (LoRA) or model dir (full), loaded by `mlx_lm.load` with the same logits as the checkpoint itself."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from tests.unit.test_train_distributed import SMOKE, require_finished, run_direct, write_config
from worker.checkpoint import WEIGHTS
from worker.comm import scalar
from worker.export import build_export
from worker.parallel.base import load_arrays
from worker.tinymodel import build_tiny_model

TOKENS = mx.array([[1, 5, 9, 13, 2, 7, 11, 3]])


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_dp_run_exports_its_full_copy(tmp_path: Path, method: str) -> None:
    from mlx_lm import load

    model = build_tiny_model(tmp_path / "model", SMOKE, layers=2)
    run = tmp_path / "run"
    cfg = write_config(run / "run.json", model=str(model), data=str(SMOKE), max_seq_length=64, val_batches=1,
                       iters=2, save_every=1, steps_per_eval=0, keep_checkpoints=2, heartbeat_s=0.5, run_id="r",
                       run_dir=str(run), method=method, learning_rate=0.05, optimizer="sgd",
                       ranks=[{"rank": 0, "node": "local", "batch_size": 2}], lora={"rank": 4, "scale": 2.0})
    proc = run_direct(cfg)
    require_finished(run, [0], f"{proc.stderr}\nexit {proc.returncode}")
    result = build_export([run / "checkpoints"], None, tmp_path / "out")
    assert result["kind"] == "whole" and result["step"] == 2 and result["method"] == method
    trained = load_arrays(run / "checkpoints" / "step-000002" / WEIGHTS)
    if method == "lora":
        got, _ = load(str(model), adapter_path=result["out"])
        want, _ = load(str(model), adapter_path=str(run / "checkpoints" / "step-000002"))
    else:
        got, _ = load(result["out"])
        want, _ = load(str(model))
        want.load_weights(list(trained.items()), strict=False)
    diff = scalar(mx.max(mx.abs(got(TOKENS) - want(TOKENS))))
    assert diff == 0.0, diff
    base, _ = load(str(model))
    assert scalar(mx.max(mx.abs(base(TOKENS) - want(TOKENS)))) > 1e-4  # training moved the model
