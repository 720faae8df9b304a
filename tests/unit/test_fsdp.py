"""fsdp (worker.parallel.fsdp) on the CPU: which modules are sharded and how (a stand-in group of 2: sharding needs
only its size and rank), the checkpoint's whole-state names and each rank's slice back, and a run through the
trainer (one rank: mlx's ring has no sum_scatter, so the 2-GPU run is in docs/benchmarks.md) whose losses and
weights equal dp's. The coordinator side (layout, strategy) is in test_strategy.py and test_launch_build.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from tests.unit.test_train_distributed import SMOKE, kinds, read_events, run_direct, weights, write_config
from worker.checkpoint import find_valid_checkpoint
from worker.parallel.fsdp import full_name, is_sharded, shard_model
from worker.runconfig import ConfigError, Layout, _parse_layout
from worker.step import flatten
from worker.tinymodel import build_tiny_model


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fsdp") / "model", SMOKE)


def test_every_block_and_the_embedding_are_sharded_and_each_rank_keeps_its_slice(tiny: Path) -> None:
    whole = flatten(load(str(tiny))[0].parameters())
    model = load(str(tiny))[0]
    wrapped = shard_model(model, _Group(2, 1))
    layers = len(model.model.layers)
    assert wrapped == [f"layers.{i}.{m}" for i in range(layers) for m in ("self_attn", "mlp")] + ["embed_tokens"]
    mine = flatten(model.parameters())
    sharded = [k for k in mine if is_sharded(k)]
    assert sharded and {full_name(k) for k in mine} == set(whole)  # the checkpoint's names are dp's
    for name in sharded:
        full = whole[full_name(name)]
        half = full.shape[0] // 2
        assert mx.array_equal(mine[name], full[half:]).item(), name  # rank 1: the second contiguous half
    assert all(mx.array_equal(mine[k], whole[k]).item() for k in mine if not is_sharded(k))  # norms: replicated
    # a world the first axes do not divide: nothing is wrapped (and the strategy refuses to start)
    assert shard_model(load(str(tiny))[0], _Group(7, 0)) == []


def test_the_layout_parses() -> None:
    assert _parse_layout({"kind": "fsdp"}, ()) == Layout(kind="fsdp")
    assert Layout(kind="fsdp").to_json() == {"kind": "fsdp"}
    with pytest.raises(ConfigError, match="unknown keys for kind fsdp"):
        _parse_layout({"kind": "fsdp", "stages": []}, ())


def test_an_fsdp_run_through_the_trainer_equals_dp(tiny: Path, tmp_path: Path) -> None:
    base: dict[str, Any] = {"model": str(tiny), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1,
                            "seed": 0, "keep_checkpoints": 1, "heartbeat_s": 0.5, "num_layers": None,
                            "method": "full", "optimizer": "adam", "learning_rate": 1e-3, "iters": 3,
                            "save_every": 3, "steps_per_eval": 3,
                            "ranks": [{"rank": 0, "node": "local", "batch_size": 4}]}
    runs = {}
    for kind in ("dp", "fsdp"):
        run_dir = tmp_path / kind
        done = run_direct(write_config(run_dir / "run.json", **base, run_id=kind, run_dir=str(run_dir),
                                       layout={"kind": kind}))
        assert done.returncode == 0, done.stderr[-2000:]
        runs[kind] = run_dir
    losses = {k: [e["loss"] for e in kinds(read_events(d, 0), "step")] for k, d in runs.items()}
    assert len(losses["dp"]) == 3 and losses["fsdp"] == pytest.approx(losses["dp"], rel=1e-6)
    evals = {k: [e["val_loss"] for e in kinds(read_events(d, 0), "eval")] for k, d in runs.items()}
    assert evals["fsdp"] == pytest.approx(evals["dp"], rel=1e-6)
    ckpts = {k: find_valid_checkpoint(d / "checkpoints") for k, d in runs.items()}
    assert all(c is not None for c in ckpts.values())
    w = {k: weights(c.path) for k, c in ckpts.items() if c is not None}
    assert w["fsdp"].keys() == w["dp"].keys()  # the checkpoint is dp's layout: resumable either way
    started = kinds(read_events(runs["fsdp"], 0), "started")[0]
    assert json.dumps(started).count("sharded_modules") == 1


def test_the_sharded_step_applies_dps_mean_gradient() -> None:
    """ShardedStep.apply on rank 1 of 2 (a stand-in group and all_sum: the peer contributes the same sums): a
    sharded parameter's gradient arrives as fully_shard's `sum over ranks / N` and is scaled back by N, a replicated
    one is all_summed; both then divided by the global weight. With SGD(lr=1) the update IS the applied gradient."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_unflatten

    from worker.parallel.fsdp import ShardedStep
    from worker.step import Local

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 4, bias=False)  # weight (4, 2): sharded over 2 ranks -> (2, 2)
            self.norm = nn.RMSNorm(2)  # replicated

    net = Net()
    net.proj = nn.fully_shard(net.proj, group=_Group(2, 1))
    before = flatten(net.parameters())
    assert sorted(before) == ["norm.weight", "proj.module.weight"] and before["proj.module.weight"].shape == (2, 2)
    opt = optim.SGD(learning_rate=1.0)
    opt.init(net.trainable_parameters())
    step = ShardedStep(net, opt, lambda *a: None, all_sum=lambda x: x * 2, world_size=2, compiled=False)
    shard_grad = mx.full((2, 2), 3.0)  # = (g_rank0 + g_rank1) / 2 over the ranks' loss sums
    norm_grad = mx.full((2,), 5.0)  # this rank's own gradient; the peer's is the same (all_sum doubles it)
    grads = tree_unflatten([("proj.module.weight", shard_grad), ("norm.weight", norm_grad)])
    local = Local(grads, mx.array(8.0), mx.array(4), mx.array(4), None, mx.array(0.0))
    loss, norm = step.apply(local, total_weight=10)
    after = flatten(net.parameters())
    applied = {k: before[k] - after[k] for k in before}
    assert mx.allclose(applied["proj.module.weight"], mx.full((2, 2), 3.0 * 2 / 10)).item()  # x N, / weight
    assert mx.allclose(applied["norm.weight"], mx.full((2,), 5.0 * 2 / 10)).item()  # all_summed, / weight
    assert loss.item() == pytest.approx(8.0 * 2 / 10)
    # the whole gradient's norm: the shard's squares all_summed (x2 here) plus the replicated part's
    assert norm.item() == pytest.approx((2 * 4 * 0.6**2 + 2 * 1.0**2) ** 0.5, rel=1e-5)
