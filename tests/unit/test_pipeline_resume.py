"""A pipeline run resumes from its stage shards as if it had never stopped, onto the same split or another one
(the shards re-cut by layer), and refuses, naming the layers, when a stage's shards are gone.

Real ranks (`mlx.launch --backend ring` on 127.0.0.1, the real `worker.train`), a tiny 6-layer model, a FULL
fine-tune with Adam: every layer's weights and both Adam moments are in the shards, so a re-cut that dropped or
misplaced any of them would change step 3. The reference is the same pipeline run for 3 steps without stopping;
the interrupted one stops after step 2 (its checkpoint), and goes on to step 3 (a) on the same 2-stage split
(2 + 4 layers), (b) on a 3-stage split (1 + 3 + 2 layers). Float32; step 3 matches to float32 summation-order
differences (a layer's gradients are computed by another stage's graph)."""

from __future__ import annotations

import json
import shutil
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
    write_config,
)
from worker.checkpoint import MANIFEST, WEIGHTS, verify_checkpoint
from worker.checkpoint import build_manifest as build_file_manifest
from worker.comm import scalar
from worker.export import ExportError, build_export
from worker.parallel.base import load_arrays
from worker.parallel.pipeline.layout import StageRange, to_local
from worker.parallel.pipeline.stage import Chunk, load_stage
from worker.runconfig import LoraSpec
from worker.tensorfile import sha256_file
from worker.tinymodel import build_tiny_model

LAYERS = 6
RTOL = 1e-5


def stages(split: tuple[int, ...]) -> list[dict[str, int]]:
    out, at = [], 0
    for rank, n in enumerate(split):
        out.append({"rank": rank, "first_layer": at, "last_layer": at + n})
        at += n
    return out


def pipeline_run(run_dir: Path, base: dict[str, Any], split: tuple[int, ...], name: str, **extra: Any) -> str:
    n = len(split)
    cfg = write_config(run_dir / f"{name}.json", **base, **extra, run_dir=str(run_dir),
                       ranks=[{"rank": r, "node": "local", "batch_size": 4} for r in range(n)],
                       layout={"kind": "pipeline", "stages": stages(split), "micro_batches": 2})
    return launch(run_dir / name, [PYTHON, "-m", "worker.train", "--config", str(cfg)], n=n)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("piperesume")
    model = build_tiny_model(root / "model", SMOKE, layers=LAYERS)
    base = {"model": str(model), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1, "seed": 0,
            "keep_checkpoints": 3, "heartbeat_s": 0.5, "num_layers": None, "save_every": 1, "steps_per_eval": 0,
            "consistency_every": 0, "learning_rate": 1e-3, "method": "full", "optimizer": "adam",
            "packing": "off", "run_id": "r"}
    out = {name: root / name for name in ("ref", "same", "resplit", "lost", "lora")}
    out["model"] = model
    log = pipeline_run(out["lora"], {**base, "method": "lora", "learning_rate": 0.05, "lora": {"rank": 4, "scale": 2.0}},
                       (2, 4), "a", iters=1)
    require_finished(out["lora"], [0, 1], log)
    log = pipeline_run(out["ref"], base, (2, 4), "a", iters=3)
    require_finished(out["ref"], [0, 1], log)
    log = pipeline_run(out["same"], base, (2, 4), "a", iters=2)
    require_finished(out["same"], [0, 1], log)
    shutil.copytree(out["same"] / "checkpoints", root / "same-step2", symlinks=True)
    for name in ("resplit", "lost"):  # the step-2 checkpoint as the interrupted run left it
        shutil.copytree(out["same"] / "checkpoints", out[name] / "checkpoints", symlinks=True)
        shutil.copytree(out["same"] / "events", out[name] / "events")
    log = pipeline_run(out["same"], base, (2, 4), "b", iters=3, resume=True)
    require_finished(out["same"], [0, 1], log)
    log = pipeline_run(out["resplit"], base, (1, 3, 2), "b", iters=3, resume=True)
    require_finished(out["resplit"], [0, 1, 2], log)
    shutil.rmtree(out["lost"] / "checkpoints" / "stage-1")  # the node of stage 1 is gone, with its shards
    pipeline_run(out["lost"], base, (1, 3, 2), "b", iters=3, resume=True)
    out["tampered"] = root / "tampered"
    shutil.copytree(root / "same-step2", out["tampered"] / "checkpoints", symlinks=True)
    tamper(out["tampered"] / "checkpoints" / "stage-1" / "step-000002")
    pipeline_run(out["tampered"], base, (2, 4), "b", iters=3, resume=True)
    return out


def tamper(shard: Path) -> None:
    """Change one weight of a shard and write its manifest.sha256 again: every file verifies, but the weights are
    no longer those the whole checkpoint's manifest recorded (what a corrupting copy tool or a hand edit does)."""
    arrays = load_arrays(shard / WEIGHTS)
    name = sorted(arrays)[0]
    arrays[name] = arrays[name] + 1.0
    mx.save_safetensors(str(shard / WEIGHTS), arrays, metadata={"format": "mlx"})
    files = sorted(p.name for p in shard.iterdir() if p.is_file() and not p.is_symlink() and p.name != MANIFEST)
    (shard / MANIFEST).write_text(build_file_manifest({f: sha256_file(shard / f) for f in files}))
    assert verify_checkpoint(shard)


def test_a_shard_changed_after_it_was_written_is_refused_on_restore_and_export(runs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    for rank in range(2):  # rank 1 refuses; rank 0 (whose own shard is intact) cannot go on without it
        assert not [s for s in kinds(read_events(runs["tampered"], rank), "step") if s["step"] == 3]
    messages = [e["message"] for r in range(2) for e in kinds(read_events(runs["tampered"], r), "error")]
    assert any("stage-1/step-000002: its weights digest" in m and "differs from the checkpoint manifest's" in m
               for m in messages), messages
    with pytest.raises(ExportError, match="weights differ from the digest in the checkpoint's manifest"):
        build_export([runs["tampered"] / "checkpoints"], runs["model"], tmp_path / "x")


def merged(run_dir: Path, step: int, n: int) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for rank in range(n):
        loaded = mx.load(str(run_dir / "checkpoints" / f"stage-{rank}" / f"step-{step:06d}" / WEIGHTS))
        assert isinstance(loaded, dict) and not set(loaded) & set(out)
        out.update(loaded)
    return out


@pytest.mark.parametrize(("name", "n"), [("same", 2), ("resplit", 3)])
def test_a_resumed_pipeline_continues_the_uninterrupted_loss_curve(runs: dict[str, Path], name: str, n: int) -> None:
    want = kinds(read_events(runs["ref"], 0), "step")
    assert want[1]["loss"] != want[2]["loss"]
    for rank in range(n):
        events = read_events(runs[name], rank)
        started = kinds(events, "started")[-1]
        assert started["resumed_from"] == 2 and started["data_position"] == 8
        steps = {s["step"]: s for s in kinds(events, "step")}
        for step in ((1, 2, 3) if rank < 2 else (3,)):  # a third stage only ran the resumed step
            assert abs(steps[step]["loss"] - want[step - 1]["loss"]) <= RTOL * abs(want[step - 1]["loss"])
            assert abs(steps[step]["grad_norm"] - want[step - 1]["grad_norm"]) <= 1e-4 * want[step - 1]["grad_norm"]
    got, ref = merged(runs[name], 3, n), merged(runs["ref"], 3, 2)
    assert sorted(got) == sorted(ref)
    for key, arr in ref.items():
        assert scalar(mx.max(mx.abs(got[key] - arr))) <= 1e-6 + RTOL * scalar(mx.max(mx.abs(arr))), key


def test_a_resume_onto_another_split_says_so(runs: dict[str, Path]) -> None:
    warnings = [w for w in kinds(read_events(runs["resplit"], 1), "warning") if w["code"] == "resplit"]
    assert warnings and "[[0, 2], [2, 6]]" in warnings[-1]["message"] and "holds [1, 4)" in warnings[-1]["message"]


def test_a_resume_without_some_layers_refuses_naming_them(runs: dict[str, Path]) -> None:
    for rank in range(3):
        events = read_events(runs["lost"], rank)
        assert kinds(events, "started")[-1:] == [] or events[-1]["event"] == "error"
        error = kinds(events, "error")[-1]
        assert error["message"].startswith("ResumeRefused: no step has a complete checkpoint")
        assert "no valid shard of stage 1 (layers [2, 6))" in error["message"]
    assert not (runs["lost"] / "checkpoints" / "stage-2").exists() or not any(
        (runs["lost"] / "checkpoints" / "stage-2").glob("step-*"))


# --- export -------------------------------------------------------------------------------------------------------


def pipeline_logits(model: Path, run_dir: Path, step: int, split: tuple[int, ...], method: str,
                    tokens: mx.array) -> mx.array:
    """The logits of the pipeline's own stages (`Stage.forward`, then the last stage's norm and head), each
    stage loaded as a rank loads it and given its shard of `step`."""
    h = tokens
    n = len(split)
    for spec in stages(split):
        i, first, last = spec["rank"], spec["first_layer"], spec["last_layer"]
        stage, _ = load_stage(model, StageRange(i, n, first, last), seed=0, method=method, num_layers=None,
                              lora=LoraSpec(rank=4, scale=2.0), grad_checkpoint=False)
        shard = load_arrays(run_dir / "checkpoints" / f"stage-{i}" / f"step-{step:06d}" / WEIGHTS)
        stage.model.load_weights(list(to_local(shard, first).items()), strict=False)
        chunk = Chunk(tokens, tokens, tokens, None, mx.array(0), mx.array(0))
        h = stage.forward(h, chunk)
        if i == n - 1:
            inner = stage.model.model
            h = inner.norm(h)
            h = inner.embed_tokens.as_linear(h) if stage.tied else stage.model.lm_head(h)
    return h.astype(mx.float32)


TOKENS = mx.array([[1, 5, 9, 13, 2, 7, 11, 3], [4, 4, 8, 15, 16, 23, 42, 6]])
LOGIT_ATOL = 1e-4  # float32, one process either way: only the graph differs (chained stages vs the whole model)


def test_a_full_pipeline_exports_a_model_dir_mlx_lm_loads(runs: dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm import load

    out = tmp_path / "export"
    result = build_export([runs["resplit"] / "checkpoints"], None, out)
    assert result["step"] == 3 and result["kind"] == "sharded" and result["method"] == "full"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(result["files"])
    model, tokenizer = load(str(out))
    assert tokenizer.encode("hello") == load(str(runs["model"]))[1].encode("hello")
    got = model(TOKENS).astype(mx.float32)
    want = pipeline_logits(runs["model"], runs["resplit"], 3, (1, 3, 2), "full", TOKENS)
    base = load(str(runs["model"]))[0](TOKENS).astype(mx.float32)
    assert scalar(mx.max(mx.abs(got - want))) <= LOGIT_ATOL
    assert scalar(mx.max(mx.abs(base - want))) > 100 * LOGIT_ATOL  # the export holds the trained weights
    with pytest.raises(ExportError, match="exists"):
        build_export([runs["resplit"] / "checkpoints"], None, out)


def test_a_lora_pipeline_exports_an_adapter_dir_mlx_lm_loads(runs: dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm import load

    out = tmp_path / "adapters"
    result = build_export([runs["lora"] / "checkpoints"], runs["model"], out)
    assert result["files"] == ["adapter_config.json", "adapters.safetensors"] and result["step"] == 1
    model, _ = load(str(runs["model"]), adapter_path=str(out))
    got = model(TOKENS).astype(mx.float32)
    want = pipeline_logits(runs["model"], runs["lora"], 1, (2, 4), "lora", TOKENS)
    base = load(str(runs["model"]))[0](TOKENS).astype(mx.float32)
    assert scalar(mx.max(mx.abs(got - want))) <= LOGIT_ATOL
    assert scalar(mx.max(mx.abs(base - want))) > 100 * LOGIT_ATOL


def test_nothing_is_exported_without_a_complete_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"no complete sharded checkpoint .*no valid shard of stage 1"):
        build_export([runs["lost"] / "checkpoints"], runs["model"], tmp_path / "x")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("nodes", [("n-a", "n-b"), ("box/gpu0", "box/gpu1")])
def test_the_export_verb_gathers_the_stage_shards_from_every_node(runs: dict[str, Path], tmp_path: Path,
                                                                  nodes: tuple[str, str]) -> None:
    # Two `connection: local` nodes, each holding only its own stage's shards (as two machines would), and the
    # run's record as `coordinator launch` leaves it: `coordinator export` must gather stage 1's shards onto the
    # first node, assemble there and bring the result back. Also for the rank nodes of one machine with two GPUs
    # (`box/gpu<i>`, which the inventory names as `box`: on 2 H100s the export refused, "lacks the run's node(s)").
    import json
    import subprocess

    from mlx_lm import load

    from coordinator.run.rundir import META, RunMeta
    from coordinator.views.jsonout import validate_output

    node_dirs = {name: tmp_path / "nodes" / name / "runs" / "r" for name in nodes}
    for rank, name in enumerate(node_dirs):
        shutil.copytree(runs["same"] / "checkpoints" / f"stage-{rank}",
                        node_dirs[name] / "checkpoints" / f"stage-{rank}", symlinks=True)
    machines = sorted({name.split("/gpu")[0] for name in nodes})
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("defaults:\n  connection: local\nnodes:\n" + "".join(
        f"  - name: {name}\n    workdir: {tmp_path / 'nodes' / name}\n" for name in machines))
    record = tmp_path / "runs" / "r"
    record.mkdir(parents=True)
    meta = RunMeta(run_id="r", inventory=str(inventory), nodes=tuple(node_dirs),
                   remote_run_dirs={k: str(v) for k, v in node_dirs.items()})
    (record / META).write_text(json.dumps(meta.to_json()))
    argv = [PYTHON, "-m", "coordinator", "export", "r", "--run-dir", str(tmp_path / "runs"), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    validate_output("export", doc)
    assert doc["out"] == str((record / "export").resolve()) and doc["step"] == 3
    assert doc["kind"] == "sharded" and doc["gathered_from"] == [nodes[1]] and doc["node"] == nodes[0]
    model, _ = load(doc["out"])
    want = pipeline_logits(runs["model"], runs["same"], 3, (2, 4), "full", TOKENS)
    assert scalar(mx.max(mx.abs(model(TOKENS).astype(mx.float32) - want))) <= LOGIT_ATOL
    # The staging dirs on the assembler are gone; a second export into the same dir is refused (exit 2).
    assert sorted(p.name for p in node_dirs[nodes[0]].iterdir()) == ["checkpoints"]
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    # Without stage 1's node's shards there is no complete checkpoint: refused, naming the stage.
    shutil.rmtree(node_dirs[nodes[1]] / "checkpoints")
    lost = subprocess.run([*argv[:-1], "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=600,
                          check=False)
    assert lost.returncode != 0 and "no valid shard of stage 1 (layers [2, 6))" in lost.stderr
    assert not (tmp_path / "x").exists()


def test_a_resume_on_a_new_node_gathers_the_shards_and_continues_the_curve(runs: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    # The step-2 checkpoint of the 2-stage run, stage 0 on node n-a and stage 1 on n-b (as two machines left it);
    # the resume runs on n-c, which holds nothing, as a 3-stage split. The coordinator's resume check picks step
    # 2 (complete over the union of the nodes) and copies every shard to every node lacking it; then the ranks,
    # on n-c's run dir, re-cut them and take step 3 as the uninterrupted run does.
    import asyncio

    from coordinator.config.inventory import load_inventory
    from coordinator.fleet.transport import Fleet
    from coordinator.run.resume import check_resume
    from worker.parallel.pipeline.shards import evaluate_steps, scan_shards

    node_dirs = {name: tmp_path / "nodes" / name / "runs" / "r" for name in ("n-a", "n-b", "n-c")}
    for rank, name in enumerate(("n-a", "n-b")):
        src = runs["resplit"].parent / "same-step2" / f"stage-{rank}"
        shutil.copytree(src, node_dirs[name] / "checkpoints" / f"stage-{rank}", symlinks=True)
    node_dirs["n-c"].mkdir(parents=True)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("defaults:\n  connection: local\nnodes:\n" + "".join(
        f"  - name: {name}\n    workdir: {tmp_path / 'nodes' / name}\n" for name in node_dirs))
    nodes = load_inventory(str(inventory)).nodes

    async def check() -> Any:
        async with Fleet(nodes) as fleet:
            return await check_resume(fleet, nodes, {k: str(v) for k, v in node_dirs.items()}, run_id="r",
                                      restart_from_scratch=False, events_file=tmp_path / "events.jsonl")

    decision = asyncio.run(check())
    assert decision.step == 2 and len(decision.gathered) == 4 and "copied between nodes" in decision.describe()
    for name, path in node_dirs.items():
        [best, *_] = evaluate_steps(scan_shards(path / "checkpoints"))
        assert best.step == 2 and best.complete, name
    assert sorted(p.name for p in (node_dirs["n-c"] / "checkpoints").iterdir()) == ["stage-0-from-n-a",
                                                                                    "stage-1-from-n-b"]
    base = json.loads((runs["same"] / "a.json").read_text())
    base = {k: v for k, v in base.items() if k not in ("run_dir", "ranks", "layout", "iters")}
    log = pipeline_run(node_dirs["n-c"], base, (1, 3, 2), "b", iters=3, resume=True)
    require_finished(node_dirs["n-c"], [0, 1, 2], log)
    want = kinds(read_events(runs["ref"], 0), "step")[2]
    for rank in range(3):
        [step3] = kinds(read_events(node_dirs["n-c"], rank), "step")
        assert step3["step"] == 3 and abs(step3["loss"] - want["loss"]) <= RTOL * abs(want["loss"])
    # The copies are the run's checkpoint of step 2 on this node: kept while the run's rule (keep_checkpoints 3:
    # steps 3, 2, 1) keeps that step, pruned as soon as it drops it (steps 5, 4, 3), like the stages' own shards.
    checkpoints = node_dirs["n-c"] / "checkpoints"
    assert {p.name for p in checkpoints.iterdir()} >= {"stage-0-from-n-a", "stage-1-from-n-b"}
    log = pipeline_run(node_dirs["n-c"], base, (1, 3, 2), "c", iters=5, resume=True)
    require_finished(node_dirs["n-c"], [0, 1, 2], log)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["stage-0", "stage-1", "stage-2"]
    assert [(v.step, v.complete) for v in evaluate_steps(scan_shards(checkpoints))] == [
        (5, True), (4, True), (3, True)]
