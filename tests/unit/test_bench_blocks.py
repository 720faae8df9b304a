"""`worker.bench --blocks K --micro-batch MB`: K blocks timed alone, as a pipeline stage loads them, so a node that
cannot hold the whole model is measured too. Real runs on a tiny model whose other blocks are unreadable; the
answer carries what the coordinator's planner parses (`calibrate.layer_timing_from_bench`: blocks, micro_batch,
block_s, embed_s, head_s, peak_memory). No time or memory thresholds: the figures depend on the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from worker.parallel.pipeline.layout import layer_of
from worker.tensorfile import write_safetensors
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


def bench(model: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "worker.bench", "--model", str(model), "--seq-len", "33",
                           "--num-layers", "-1", "--time-budget", "5", *extra], env=env, capture_output=True,
                          text=True, cwd=REPO, timeout=600, check=False)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def last_blocks_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-block model saved one file per block (plus one for the rest) with an index, where blocks 0..3 are
    garbage: only the last 2 blocks, the embeddings and the head can be read."""
    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny"), None, layers=6)
    out = tmp_path_factory.mktemp("sharded")
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    loaded = mx.load(str(tiny / "model.safetensors"))
    assert isinstance(loaded, dict)
    files: dict[str, dict[str, mx.array]] = {}
    for name, arr in loaded.items():
        layer = layer_of(name)
        files.setdefault("model-rest.safetensors" if layer is None else f"model-{layer}.safetensors", {})[name] = arr
    for file, arrays in files.items():
        write_safetensors(out / file, arrays)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: file for file, arrays in files.items() for n in arrays}}))
    for layer in range(4):
        (out / f"model-{layer}.safetensors").write_bytes(b"unreadable")
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_blocks_are_timed_alone_with_the_planners_fields(last_blocks_only: Path, method: str) -> None:
    code, out = bench(last_blocks_only, "--method", method, "--blocks", "2", "--micro-batch", "3")
    assert code == 0, out
    assert out["blocks"] == 2 and out["micro_batch"] == 3 and out["timed_layers"] == [4, 6]
    assert out["model_layers"] == 6 and out["num_layers"] == 6 and out["method"] == method
    for key in ("block_s", "block_fused_s", "embed_s", "head_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    # a non-last stage recomputes its forward inside its backward: its block costs more than the last stage's
    assert out["block_s"] > out["block_fused_s"]
    assert out["peak_memory"] >= out["blocks_weight_bytes"] > 0
    # What the planner's memory model takes (planning.pipeline.measured_stage_bytes): a block's held bytes (its
    # weights and optimizer state), its phases' additions, one micro-batch's activation (3 rows x 32 positions).
    assert out["update_s"] > 0
    assert 2 * out["block_bytes"] >= out["blocks_weight_bytes"] and out["backward_bytes"] > 0
    assert out["update_bytes"] > 0 and out["head_bytes"] > out["embed_bytes"] > 0
    assert out["input_bytes"] == 3 * 32 * out["hidden"] * 4  # float32 tiny model


def test_more_blocks_than_the_model_has_is_a_json_error(last_blocks_only: Path) -> None:
    code, out = bench(last_blocks_only, "--method", "lora", "--blocks", "7")
    assert code == 1 and "the model has 6 blocks" in out["error"]


def test_a_bad_micro_batch_is_a_json_error(last_blocks_only: Path) -> None:
    code, out = bench(last_blocks_only, "--method", "lora", "--blocks", "1", "--micro-batch", "0")
    assert code == 1 and "--micro-batch must be >= 1" in out["error"]
