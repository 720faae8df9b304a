"""fsdp (worker.parallel.fsdp) on the CPU: which modules are sharded and how (a stand-in group of 2: sharding needs
only its size and rank), the checkpoint's whole-state names and each rank's slice back, a run through the trainer
on one rank, and runs over 2 real ring ranks sharing one node (mlx's ring has no sum_scatter: `fsdp_ring` emulates
it by all_sum) for full and LoRA fine-tunes, whose losses, validation loss and checkpointed weights equal one dp
process's. The 2-GPU runs are in docs/benchmarks.md. The coordinator side (layout, strategy) is in
test_strategy.py and test_launch_build.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from tests.unit.fsdp_ring import COMMAND
from tests.unit.test_train_distributed import (
    PYTHON,
    SMOKE,
    kinds,
    launch,
    read_events,
    require_finished,
    run_direct,
    weights,
    write_config,
)
from worker.export import build_export, gather_trained
from worker.modelsetup import apply_method
from worker.parallel.fsdp import full_name, is_sharded, shard_model
from worker.runconfig import ConfigError, Layout, LoraSpec, _parse_layout
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
    w = {k: gather_trained([d / "checkpoints"])[2] for k, d in runs.items()}
    assert w["fsdp"].keys() == w["dp"].keys()  # the shards hold dp's names, whole
    assert (runs["fsdp"] / "checkpoints" / "stage-0").is_dir()  # one rank: one shard, every block
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


def test_lora_shards_only_the_frozen_base_weights(tiny: Path) -> None:
    """A LoRA layer is not wrapped whole: only its frozen `linear` is sharded and the adapters stay whole (so no
    gradient of a frozen matrix is ever computed); a block without adapters (num_layers 1 of 2: block 0) is
    wrapped whole, as in a full fine-tune."""
    model = load(str(tiny))[0]
    apply_method(model, "lora", 1, LoraSpec(rank=4, scale=2.0, dropout=0.0))
    adapters = flatten(model.trainable_parameters())
    wrapped = shard_model(model, _Group(2, 0))
    linears = [f"self_attn.{k}_proj" for k in "qkvo"] + [f"mlp.{k}_proj" for k in ("gate", "down", "up")]
    assert wrapped == ["layers.0.self_attn", "layers.0.mlp", *(f"layers.1.{n}.linear" for n in linears),
                       "embed_tokens"]
    after = flatten(model.trainable_parameters())
    assert after.keys() == adapters.keys() and not any(is_sharded(k) for k in after)  # whole, dp's names
    assert all(after[k].shape == adapters[k].shape for k in after)
    frozen = [k for k in flatten(model.parameters()) if k not in after]
    assert all(is_sharded(k) or k.endswith("norm.weight") for k in frozen)


@pytest.fixture(scope="module")
def ring_runs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per method: (fsdp over 2 ring ranks of one node, 2 rows each; dp on one process, 4 rows), Adam, 3 steps,
    a checkpoint and an evaluation at step 3."""
    root = tmp_path_factory.mktemp("fsdp-ring")
    base: dict[str, Any] = {"model": str(tiny), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1,
                            "seed": 0, "keep_checkpoints": 1, "heartbeat_s": 0.5, "num_layers": None,
                            "optimizer": "adam", "learning_rate": 1e-3, "iters": 3, "save_every": 3,
                            "steps_per_eval": 3, "lora": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
    out: dict[str, tuple[Path, Path]] = {}
    for method in ("lora", "full"):
        ref = root / f"dp-{method}"
        proc = run_direct(write_config(ref / "run.json", **base, method=method, run_id=ref.name, run_dir=str(ref),
                                       ranks=[{"rank": 0, "node": "local", "batch_size": 4}]))
        require_finished(ref, [0], f"{proc.stderr}\nexit {proc.returncode}")
        run = root / f"fsdp-{method}"
        cfg = write_config(run / "run.json", **base, method=method, run_id=run.name, run_dir=str(run),
                           layout={"kind": "fsdp"}, ranks=[{"rank": r, "node": "local", "batch_size": 2}
                                                           for r in range(2)])
        log = launch(run, [PYTHON, "-c", COMMAND, "--config", str(cfg)])
        require_finished(run, [0, 1], log)
        out[method] = (run, ref)
    # Sharded checkpoints: 2 steps on 2 ranks (a shard each), then resumed to step 3 on 2 ranks, and re-sharded
    # onto 1 rank (its run dir a copy: the same shards), against the 3-step runs above.
    two = root / "fsdp-2steps"
    cfg = write_config(two / "run.json", **{**base, "iters": 2, "save_every": 2, "steps_per_eval": 2},
                       method="full", run_id=two.name, run_dir=str(two), layout={"kind": "fsdp"},
                       ranks=[{"rank": r, "node": "local", "batch_size": 2} for r in range(2)])
    require_finished(two, [0, 1], launch(two, [PYTHON, "-c", COMMAND, "--config", str(cfg)]))
    one = root / "fsdp-resharded"
    shutil.copytree(two, one, symlinks=True)
    cfg = write_config(two / "resume.json", **base, method="full", run_id=two.name, run_dir=str(two), resume=True,
                       layout={"kind": "fsdp"}, ranks=[{"rank": r, "node": "local", "batch_size": 2} for r in range(2)])
    require_finished(two, [0, 1], launch(two / "again", [PYTHON, "-c", COMMAND, "--config", str(cfg)]))
    cfg = write_config(one / "resume.json", **base, method="full", run_id=two.name, run_dir=str(one), resume=True,
                       layout={"kind": "fsdp"}, ranks=[{"rank": 0, "node": "local", "batch_size": 4}])
    proc = run_direct(cfg)
    require_finished(one, [0], f"{proc.stderr}\nexit {proc.returncode}")
    out["resumed"], out["resharded"] = (two, out["full"][1]), (one, out["full"][1])
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_fsdp_over_two_ranks_equals_dp(ring_runs: dict[str, tuple[Path, Path]], method: str) -> None:
    """Two ranks sharing one node (one checkpoint writer: the gather is a collective every rank joins) train the
    same steps as dp on one process: losses, validation loss and the checkpointed weights (dp's names, whole)."""
    run, ref = ring_runs[method]
    want = [e["loss"] for e in kinds(read_events(ref, 0), "step")]
    for rank in (0, 1):
        events = read_events(run, rank)
        assert [e["loss"] for e in kinds(events, "step")] == pytest.approx(want, rel=1e-5)
        assert [e["val_loss"] for e in kinds(events, "eval")] == pytest.approx(
            [e["val_loss"] for e in kinds(read_events(ref, 0), "eval")], rel=1e-5)
        started = kinds(events, "started")[0]
        assert started["sharded_modules"] > 0 and started["world_size"] == 2
        # the whole model's counts, not this rank's shard's
        assert started["total_params"] == kinds(read_events(ref, 0), "started")[0]["total_params"]
    # Each rank's checkpoint event names the whole checkpoint, the same on both: the coordinator votes on it as on
    # dp's replicas (each shard's own manifest.sha256 differs: reported, it read as a mismatch with no majority,
    # and every fsdp run on 2 GPUs stopped and relaunched at its first checkpoint).
    shas = [[e["sha256"] for e in kinds(read_events(run, rank), "checkpoint")] for rank in (0, 1)]
    assert shas[0] and shas[0] == shas[1]
    # Each rank saved its own shard (its blocks, whole, dp's names; rank 0 also what is outside the blocks);
    # merged, they are dp's checkpoint.
    for rank, layers in ((0, ["0"]), (1, ["1"])):
        names = weights(next((run / "checkpoints" / f"stage-{rank}").glob("step-*")))
        assert {n.split("layers.")[1].split(".")[0] for n in names if "layers." in n} == set(layers)
    step, _, got, _ = gather_trained([run / "checkpoints"])
    exp = gather_trained([ref / "checkpoints"])[2]
    assert step == 3 and got.keys() == exp.keys()
    for name in exp:
        assert got[name].shape == exp[name].shape, name
        assert mx.allclose(got[name], exp[name], rtol=1e-4, atol=1e-5).item(), name


@pytest.mark.parametrize("case", ["resumed", "resharded"])
def test_a_sharded_checkpoint_resumes_on_the_same_or_another_world_size(
        ring_runs: dict[str, tuple[Path, Path]], case: str) -> None:
    """2 steps on 2 ranks, then step 3 from their shards on 2 ranks again, or on 1 rank (every parameter re-cut
    by rows): the loss of step 3 and the weights after it are the uninterrupted 3-step dp run's."""
    run, ref = ring_runs[case]
    events = read_events(run, 0)
    starts = [i for i, e in enumerate(events) if e["event"] == "started"]
    assert len(starts) == 2 and events[starts[-1]]["resumed_from"]
    after = [e["loss"] for e in kinds(events[starts[-1]:], "step")]
    want = [e["loss"] for e in kinds(read_events(ref, 0), "step")]
    assert [e["step"] for e in kinds(events[starts[-1]:], "step")] == [3]
    assert after == pytest.approx(want[2:], rel=1e-5)
    first_end = next(i for i, e in enumerate(events) if e["event"] == "finished")
    warned = [e.get("code") for e in kinds(events[first_end:], "warning")]  # restore warns before `started`
    assert ("resharded" in warned) == (case == "resharded")
    got, exp = gather_trained([run / "checkpoints"])[2], gather_trained([ref / "checkpoints"])[2]
    assert got.keys() == exp.keys()
    assert all(mx.allclose(got[k], exp[k], rtol=1e-4, atol=1e-5).item() for k in exp)


def test_a_sharded_checkpoint_exports_a_model_mlx_lm_loads(ring_runs: dict[str, tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    run, _ = ring_runs["full"]
    done = build_export([run / "checkpoints"], None, tmp_path / "export")
    assert done["step"] == 3 and "model.safetensors" in done["files"]
    model = flatten(load(str(tmp_path / "export"))[0].parameters())
    trained = gather_trained([run / "checkpoints"])[2]
    assert all(mx.array_equal(model[k], v).item() for k, v in trained.items())


def test_resume_refuses_naming_the_missing_shard(ring_runs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Rank 1's shard gone: no complete checkpoint; a resume refuses before training, naming the stage and its
    blocks."""
    run, _ = ring_runs["resumed"]
    broken = tmp_path / "broken"
    shutil.copytree(run, broken, symlinks=True)
    shutil.rmtree(broken / "checkpoints" / "stage-1")
    cfg = json.loads((run / "resume.json").read_text())
    proc = run_direct(write_config(broken / "again.json", **{**cfg, "run_dir": str(broken),
                                                            "ranks": [{"rank": 0, "node": "local", "batch_size": 4}]}))
    assert proc.returncode == 1
    errors = kinds(read_events(broken, 0), "error")
    assert "no valid shard of stage 1 (layers [1, 2))" in errors[-1]["message"], errors[-1]["message"]
