"""The strategy planner (coordinator/planning/strategy.py), its lint finding and the launch refusal: model shape, train
section and node budgets in, a decision or a refusal with the numbers out."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from coordinator.config.playbook import Playbook, TrainConfig, parse_playbook
from coordinator.errors import ConfigError
from coordinator.facts.linux import parse_nvidia_smi
from coordinator.facts.model import CgroupMemory, Memory, NodeFacts
from coordinator.models import Inventory, LintResult, Node, Status
from coordinator.planning.estimate import GiB, ModelShape, estimate_training_memory, model_shape
from coordinator.planning.strategy import (
    NodeBudget,
    StrategyError,
    block_params,
    compute_strategy,
    fsdp_refusal,
    node_budget,
    per_rank_need,
)
from coordinator.preflight.lint import lint_playbook
from coordinator.preflight.pipeline import FleetFacts, fleet_budgets, resolve_strategy, strategy_refusal
from tests.factsutil import MODEL_CONFIG

SHAPE = ModelShape(params=1_000_000_000, hidden=2048, layers=16, vocab=32000, intermediate=8192, heads=16)
FULL = TrainConfig(method="full", batch_size=4, max_seq_length=512)
RING_REASON = "[ring] sum_scatter not supported (mlx 0.32.4): fsdp needs nccl (CUDA nodes) or jaccl"


def test_fsdp_need_is_the_sharded_state_plus_one_gathered_unit_plus_the_activations() -> None:
    # A block: q and o (2048 x 16 heads x 128) + k and v (same: no GQA) + gate, up, down (3 x 2048 x 8192) + norms.
    assert block_params(SHAPE) == 2 * 2048 * 2048 * 2 + 3 * 2048 * 8192 + 2 * 2048 == 67_112_960
    est = estimate_training_memory(SHAPE, method="full", batch_per_rank=2, seq_len=512)
    assert est.weights + est.grads + est.optimizer == 8_000_000_000  # 2 + 2 + 4 bytes per parameter
    dp, fsdp = per_rank_need(SHAPE, FULL, world_size=2, budget=NodeBudget(100 * GiB))
    assert dp == est.total
    # Half the state, plus one block gathered in bf16 (larger than the 32000 x 2048 embedding here).
    assert fsdp == 4_000_000_000 + 2 * 67_112_960 + est.activations
    # A vocabulary larger than a block: the embedding is the largest unit gathered at once.
    wide = ModelShape(params=1_000_000_000, hidden=2048, layers=16, vocab=128_000, intermediate=8192, heads=16)
    _, fsdp_wide = per_rank_need(wide, FULL, world_size=2, budget=NodeBudget(100 * GiB))
    acts = estimate_training_memory(wide, method="full", batch_per_rank=2, seq_len=512).activations
    assert fsdp_wide == 4_000_000_000 + 2 * 128_000 * 2048 + acts


def test_fsdp_need_shrinks_with_the_world_and_dp_does_not() -> None:
    big = TrainConfig(method="full", batch_size=8, max_seq_length=512)
    needs = [per_rank_need(SHAPE, big, world_size=n, budget=NodeBudget(GiB)) for n in (2, 4, 8)]
    assert needs[0][1] > needs[1][1] > needs[2][1]
    # dp's state is whole on every rank: only the activations (batch per rank) shrink.
    state = 8_000_000_000
    assert all(dp > state for dp, _ in needs)


def test_lora_fsdp_need_shards_the_base_weights_and_keeps_the_adapters_whole() -> None:
    lora = TrainConfig(method="lora", batch_size=4, max_seq_length=512)
    est = estimate_training_memory(SHAPE, method="lora", batch_per_rank=2, seq_len=512, lora_rank=lora.lora.rank)
    base = SHAPE.dtype_bytes * SHAPE.params
    adapters = est.weights - base + est.grads + est.optimizer
    assert 0 < adapters < base // 10  # rank 8 on every linear of a 1B model, with fp32 grads and Adam: 4.8%
    dp, fsdp = per_rank_need(SHAPE, lora, world_size=2, budget=NodeBudget(100 * GiB))
    assert dp == est.total
    assert fsdp == base // 2 + adapters + 2 * block_params(SHAPE) + est.activations


def _needs(train: TrainConfig, world: int) -> tuple[int, int]:
    return per_rank_need(SHAPE, train, world_size=world, budget=NodeBudget(GiB))


# budgets per node, relative to the needs: "dp" = exactly dp's need (fits), "fsdp" = exactly fsdp's (dp does not
# fit), "below" = one byte short of fsdp's, "tiny" = 256 MiB (not even a pipeline stage of the 1B model fits).
STRATEGY_CASES = [
    # requested, method, backend, node budgets -> chosen (None: StrategyError), in the error
    ("auto", "full", "ring", ("dp", "dp"), "dp", ""),
    ("auto", "full", "ring", ("dp", "fsdp"), "pipeline", ""),  # the smallest node cannot hold a replica
    ("auto", "full", "ring", ("dp", "below"), "pipeline", ""),
    ("auto", "full", "nccl", ("dp", "fsdp"), "fsdp", ""),  # nccl: no send/recv, no pipeline
    ("auto", "full", "nccl", ("fsdp", "fsdp", "fsdp"), "fsdp", ""),
    ("auto", "full", "nccl", ("dp", "below"), None, "neither dp, a pipeline nor fsdp fits"),
    ("auto", "full", "ring", ("tiny", "tiny"), None, "neither dp, a pipeline nor fsdp fits"),
    ("auto", "lora", "ring", ("dp", "dp"), "dp", ""),
    ("auto", "lora", "ring", ("dp", "fsdp"), "pipeline", ""),
    ("auto", "lora", "nccl", ("dp", "fsdp"), "fsdp", ""),  # LoRA shards its frozen base weights
    ("auto", "dora", "nccl", ("dp", "fsdp"), None, "neither dp nor a pipeline fits (dora: fsdp trains full or lora"),
    ("fsdp", "lora", "nccl", ("fsdp", "fsdp"), "fsdp", ""),
    ("dp", "full", "ring", ("dp", "dp"), "dp", ""),
    ("dp", "full", "ring", ("fsdp", "dp"), None, "train.strategy dp: dp does not fit"),
    ("pipeline", "full", "ring", ("dp", "dp"), "pipeline", ""),  # forced: even where dp would fit
    ("pipeline", "full", "ring", ("tiny", "dp"), None, "train.strategy pipeline: pipeline does not fit"),
    ("pipeline", "full", "nccl", ("dp", "dp"), None, "[nccl] has no send/recv"),
    ("fsdp", "full", "ring", ("dp", "dp"), "fsdp", ""),  # forced: even where dp would fit
    ("fsdp", "full", "ring", ("fsdp", "fsdp"), "fsdp", ""),
    ("fsdp", "full", "ring", ("fsdp", "below"), None, "train.strategy fsdp: fsdp does not fit"),
]


@pytest.mark.parametrize(("requested", "method", "backend", "sizes", "chosen", "error"), STRATEGY_CASES)
def test_compute_strategy(requested: str, method: str, backend: str, sizes: tuple[str, ...], chosen: str | None,
                          error: str) -> None:
    train = TrainConfig(method=method, batch_size=4, max_seq_length=512)  # type: ignore[arg-type]
    dp, fsdp = _needs(train, len(sizes))
    assert fsdp < dp  # "fsdp" must be short of dp's need
    size = {"dp": dp, "fsdp": fsdp, "below": fsdp - 1, "tiny": GiB // 4}
    budgets = {f"n{i}": NodeBudget(size[s]) for i, s in enumerate(sizes)}
    if chosen is None:
        with pytest.raises(StrategyError) as info:
            compute_strategy(requested, SHAPE, train, budgets, backend=backend)
        assert error in str(info.value)
        return
    decision = compute_strategy(requested, SHAPE, train, budgets, backend=backend)
    assert decision.strategy == chosen and decision.world_size == len(sizes)
    assert [n.node for n in decision.needs] == list(budgets)
    assert (decision.pipeline is not None) == (chosen == "pipeline")
    if decision.pipeline is not None:
        assert all(s.need <= s.budget for s in decision.pipeline.stages)
        assert sum(decision.pipeline.layer_split) == SHAPE.layers


def test_the_refusal_names_every_nodes_numbers() -> None:
    dp, fsdp = _needs(FULL, 2)
    with pytest.raises(StrategyError) as info:
        compute_strategy("auto", SHAPE, FULL, {"small": NodeBudget(fsdp - 1), "big": NodeBudget(dp)}, backend="nccl")
    text = str(info.value)
    for name, usable in (("small", fsdp - 1), ("big", dp)):
        assert f"{name}: {usable / GiB:.1f} GiB usable, dp needs ~{dp / GiB:.1f} GiB, fsdp over 2 needs " \
               f"~{fsdp / GiB:.1f} GiB" in text
    with pytest.raises(StrategyError, match="no node memory known"):
        compute_strategy("auto", SHAPE, FULL, {})


@pytest.mark.parametrize(("backend", "reason"), [
    ("ring", RING_REASON),
    ("mpi", "[mpi] sum_scatter not supported"),
    ("jaccl", None),  # sum_scatter since mlx 0.32.1
    ("jaccl-ring", None),
    ("nccl", None),  # the worker runs fsdp there (worker.parallel.fsdp)
])
def test_fsdp_refusal_by_backend(backend: str, reason: str | None) -> None:
    refusal = fsdp_refusal(backend)
    assert refusal is None if reason is None else reason in (refusal or "")


# ------------------------------------------------------------------------------------------------- playbook


def playbook(**train: Any) -> Playbook:
    return parse_playbook({"name": "job", "model": "/m", "data": "/d", "train": train}, path="playbook.yaml")


def test_playbook_strategy_key() -> None:
    assert playbook().train.strategy == "auto"
    assert playbook(method="full", strategy="fsdp").train.strategy == "fsdp"
    assert playbook(method="lora", strategy="dp").train.strategy == "dp"
    assert playbook(method="lora", strategy="fsdp").train.strategy == "fsdp"  # the frozen base weights sharded
    with pytest.raises(ConfigError, match="strategy fsdp trains full and lora fine-tunes, not dora"):
        playbook(method="dora", strategy="fsdp")
    with pytest.raises(ConfigError, match="strategy"):
        playbook(method="full", strategy="zero3")


def test_playbook_pipeline_keys() -> None:
    t = playbook(method="full", strategy="pipeline", layer_split=[20, 12], micro_batches=4, batch_size=8).train
    assert (t.strategy, t.layer_split, t.micro_batches, t.pipeline_micro_batches) == ("pipeline", (20, 12), 4, 4)
    assert playbook(batch_size=3).train.pipeline_micro_batches == 3  # min(8, batch_size)
    assert playbook(batch_size=32).train.pipeline_micro_batches == 8
    with pytest.raises(ConfigError, match="layer_split pins a pipeline's blocks per node: it needs strategy pipeline "
                                          r"\(this one is auto\)"):
        playbook(layer_split=[2, 2])
    with pytest.raises(ConfigError, match="micro_batches 16 exceeds batch_size 4"):
        playbook(micro_batches=16)
    with pytest.raises(ConfigError, match="layer_split"):
        playbook(strategy="pipeline", layer_split=[4, 0])
    # What the pipeline worker refuses is refused in the playbook already.
    with pytest.raises(ConfigError, match="strategy pipeline trains neither DPO nor embeddings"):
        playbook(method="dpo", strategy="pipeline")
    with pytest.raises(ConfigError, match="strategy pipeline trains neither DPO nor embeddings"):
        playbook(method="full", strategy="pipeline", train_embeddings=True)


def test_auto_never_weighs_a_pipeline_the_worker_refuses() -> None:
    from coordinator.planning.strategy import FleetNode, compute_strategy_choice

    dpo = playbook(method="dpo", dpo={"fine_tune_type": "full"}).train
    nodes = [FleetNode("a", NodeBudget(1000 * GiB)), FleetNode("b", NodeBudget(1000 * GiB))]
    choice = compute_strategy_choice("auto", SHAPE, dpo, nodes, backend="ring")
    assert choice.chosen.label == "dp on every node"
    [pipe] = [c for c in choice.candidates if c.strategy == "pipeline"]
    assert not pipe.fits and pipe.note.startswith("a pipeline does not train DPO")


# ------------------------------------------------------------------------------------------------- lint

CFG_SHAPE = model_shape(MODEL_CONFIG, None)


def strategy_lint(budget_of: str | int | None, backend: str = "ring", **train: Any) -> list[LintResult]:
    """The strategy finding for a two-node fleet whose nodes have `budget_of` usable: "dp" (dp fits), "fsdp"
    (only fsdp), "below" (neither), a byte count, or None (memory unknown)."""
    pb = playbook(**train)
    assert CFG_SHAPE is not None
    dp, fsdp = per_rank_need(CFG_SHAPE, pb.train, world_size=2, budget=NodeBudget(GiB))
    usable = {"dp": dp, "fsdp": fsdp, "below": fsdp - 1}.get(budget_of, budget_of) if isinstance(budget_of, str) \
        else budget_of
    budgets = {} if usable is None else {"a": NodeBudget(int(usable)), "b": NodeBudget(int(usable))}
    results = lint_playbook(pb, MODEL_CONFIG, budgets=budgets, backend=backend)
    found = [r for r in results if r.id == "strategy"]
    for r in found:
        assert r.summary.strip() and (r.status is not Status.FAIL or r.remedy.strip())
    return found


def test_lint_fsdp_on_ring_fails_with_the_sum_scatter_reason() -> None:
    [forced] = strategy_lint("dp", method="full", strategy="fsdp")
    assert forced.status is Status.FAIL and forced.summary.endswith(RING_REASON)
    [unknown] = strategy_lint(None, method="full", strategy="fsdp")  # no memory known: still refused
    assert unknown.status is Status.FAIL and unknown.summary == RING_REASON


def test_lint_fsdp_on_nccl_passes_and_says_it_shards() -> None:
    [r] = strategy_lint("fsdp", backend="nccl", method="full")
    assert r.status is Status.PASS and r.summary.startswith("fsdp (chosen by auto)")
    [unknown] = strategy_lint(None, backend="nccl", method="full", strategy="fsdp")  # nothing known: not planned
    assert unknown.status is Status.SKIP


def test_lint_dp_and_auto() -> None:
    assert strategy_lint("dp", method="full") == []  # auto stays dp: the resources check reports that fit
    assert strategy_lint("dp", method="lora") == []
    assert strategy_lint(None, method="full") == []
    [forced] = strategy_lint("dp", method="full", strategy="dp")
    assert forced.status is Status.PASS and forced.summary.startswith("dp (forced)")
    [short] = strategy_lint("fsdp", method="full", strategy="dp")
    assert short.status is Status.FAIL and "train.strategy dp: dp does not fit" in short.summary
    [neither] = strategy_lint(GiB // 4, method="full")
    assert neither.status is Status.FAIL and "neither dp, a pipeline nor fsdp fits" in neither.summary
    [pipe] = strategy_lint("fsdp", method="full")  # auto: no replica fits, a pipeline does (ring): said, it runs
    assert pipe.status is Status.PASS and pipe.summary.startswith("pipeline (chosen by auto): a ")
    [nccl] = strategy_lint(None, method="full", strategy="pipeline", backend="nccl")
    assert nccl.status is Status.FAIL and "[nccl] has no send/recv" in nccl.summary
    [skip] = strategy_lint(None, method="full", strategy="dp")
    assert skip.status is Status.SKIP


def test_lint_without_budgets_leaves_auto_alone() -> None:
    """The lint as test_lint calls it (no fleet): no strategy finding for the default."""
    assert [r.id for r in lint_playbook(playbook(method="full"), MODEL_CONFIG)] == ["num_layers", "save_every",
                                                                                    "eval_cost"]


# ------------------------------------------------------------------------------------------------- launch

NODES = (Node(name="a", host="10.0.0.1"), Node(name="b", host="10.0.0.2"))
INV = Inventory(NODES)


def gpu_node(name: str, mib: int) -> NodeFacts:
    return NodeFacts(node=name, model_config=dict(MODEL_CONFIG), gpu=parse_nvidia_smi(
        f"0, NVIDIA H100 80GB HBM3, GPU-1, {mib}, 0, 0, 580.159.04, 9.0\n"))


def test_node_budget_reads_gpu_memory_then_host_memory() -> None:
    assert node_budget(gpu_node("a", 81559)) == NodeBudget(int(81559 * 1024**2 * 0.9), fused_attention=True)
    host = NodeFacts(node="c", memory=Memory(total_bytes=64 * GiB))
    assert node_budget(host) == NodeBudget(int(64 * GiB * 0.9), fused_attention=False)
    assert node_budget(NodeFacts(node="d")) is None
    # Linux: a cgroup limit below RAM is the budget (a rank inherits its SSH session's cgroup); above RAM, RAM.
    capped = NodeFacts(node="e", memory=Memory(total_bytes=64 * GiB), cgroup_memory=CgroupMemory(8 * GiB, "v1", "/x"))
    assert node_budget(capped) == NodeBudget(int(8 * GiB * 0.9), fused_attention=False)
    loose = NodeFacts(node="f", memory=Memory(total_bytes=64 * GiB), cgroup_memory=CgroupMemory(128 * GiB, "v2", "/"))
    assert node_budget(loose) == NodeBudget(int(64 * GiB * 0.9), fused_attention=False)
    # An NVIDIA node trains in its GPU's memory, which the cgroup does not limit.
    gpu_capped = replace(gpu_node("g", 81559), cgroup_memory=CgroupMemory(8 * GiB, "v1", "/x"))
    assert node_budget(gpu_capped) == NodeBudget(int(81559 * 1024**2 * 0.9), fused_attention=True)
    facts = {"a": gpu_node("a", 81559)}  # b has no facts: no partial plan
    assert fleet_budgets(INV, FleetFacts({}, facts, {})) == {}


def test_launch_refuses_a_run_that_resolves_to_fsdp() -> None:
    roomy = {n.name: gpu_node(n.name, 81559) for n in NODES}
    assert strategy_refusal(INV, playbook(method="full"), roomy) is None  # auto: dp fits
    assert strategy_refusal(INV, playbook(method="full", strategy="dp"), roomy) is None
    forced = strategy_refusal(INV, playbook(method="full", strategy="fsdp"), roomy)
    # Both nodes have NVIDIA GPUs: backend ring as written (the default) stays ring.
    assert forced == f"train.strategy fsdp resolves to fsdp: {RING_REASON}"
    pb_auto = parse_playbook({"name": "job", "model": "/m", "data": "/d", "backend": "auto",
                              "train": {"method": "full", "strategy": "fsdp"}}, path="p.yaml")
    assert strategy_refusal(INV, pb_auto, roomy) is None  # nccl: the worker runs fsdp
    assert resolve_strategy(INV, pb_auto, roomy) == "fsdp"
    assert resolve_strategy(INV, playbook(method="full"), roomy) == "dp"
    # auto on GPUs too small for a replica but large enough for a shard: refused, not run as dp.
    assert CFG_SHAPE is not None
    dp, fsdp = per_rank_need(CFG_SHAPE, playbook(method="full").train, world_size=2, budget=NodeBudget(GiB))
    mib = (fsdp // 1024**2 + 1) * 10 // 9 + 1  # usable = 0.9 x the GPU's memory
    assert int(mib * 1024**2 * 0.9) < dp
    small = {n.name: gpu_node(n.name, mib) for n in NODES}
    # Over ring, a pipeline fits where a replica does not: the worker runs it (weighed after calibration).
    assert strategy_refusal(INV, playbook(method="full"), small) is None
    assert resolve_strategy(INV, playbook(method="full"), small) == "dp"  # not fsdp: the layout is the pipeline's
    nccl = parse_playbook({"name": "job", "model": "/m", "data": "/d", "backend": "nccl",
                           "train": {"method": "full"}}, path="p.yaml")
    assert strategy_refusal(INV, nccl, small) is None  # nccl: no pipeline, a shard fits: fsdp, which the worker runs
    assert resolve_strategy(INV, nccl, small) == "fsdp"
    # LoRA too: its frozen base weights are what a shard saves (GPUs too small for a LoRA replica).
    lora = playbook(method="lora").train
    dp_l, fsdp_l = per_rank_need(CFG_SHAPE, lora, world_size=2, budget=NodeBudget(GiB))
    mib_l = (fsdp_l // 1024**2 + 1) * 10 // 9 + 1
    assert int(mib_l * 1024**2 * 0.9) < dp_l
    nccl_lora = parse_playbook({"name": "job", "model": "/m", "data": "/d", "backend": "nccl",
                                "train": {"method": "lora"}}, path="p.yaml")
    small_l = {n.name: gpu_node(n.name, mib_l) for n in NODES}
    assert strategy_refusal(INV, nccl_lora, small_l) is None and resolve_strategy(INV, nccl_lora, small_l) == "fsdp"
    forced_nccl = parse_playbook({"name": "job", "model": "/m", "data": "/d", "backend": "nccl",
                                  "train": {"method": "full", "strategy": "pipeline"}}, path="p.yaml")
    assert strategy_refusal(INV, forced_nccl, roomy) == ("train.strategy pipeline: [nccl] has no send/recv (mlx "
                                                         '0.32.4: "Send has no CUDA implementation"): a pipeline needs '
                                                         "backend ring (or jaccl)")


def test_auto_by_memory_prefers_a_pipeline_over_every_node_else_dp_on_the_nodes_that_hold_a_replica() -> None:
    solo = per_rank_need(SHAPE, FULL, world_size=1, budget=NodeBudget(GiB))[0]
    budgets = {"ultra": NodeBudget(solo), "max": NodeBudget(solo // 3)}
    # Over ring a pipeline uses both nodes (calibration then weighs it against the Ultra solo by speed).
    piped = compute_strategy("auto", SHAPE, FULL, budgets)
    assert (piped.strategy, piped.nodes) == ("pipeline", ("ultra", "max"))
    # nccl has no send/recv: no pipeline; the node that holds a replica trains dp alone.
    decision = compute_strategy("auto", SHAPE, FULL, budgets, backend="nccl")
    assert (decision.strategy, decision.nodes) == ("dp", ("ultra",))
    assert [n.node for n in decision.left_out] == ["max"]
    assert decision.describe().startswith("dp (chosen by auto) on ultra: the other nodes cannot hold a replica: max (")
    # dp forced still needs every node.
    with pytest.raises(StrategyError, match=r"train\.strategy dp: dp does not fit"):
        compute_strategy("dp", SHAPE, FULL, budgets)
    # The lint says who sits the run out, as a warning.
    results = lint_playbook(playbook(method="full", batch_size=4, max_seq_length=512), MODEL_CONFIG,
                            budgets={"a": NodeBudget(10**12), "b": NodeBudget(GiB // 8)}, backend="nccl")
    [finding] = [r for r in results if r.id == "strategy"]
    assert finding.status is Status.WARN and "on a: the other nodes cannot hold a replica: b (" in finding.summary


def test_a_tiny_models_candidate_lines_never_show_its_memory_as_zero() -> None:
    """The demo's model needs a few MiB a node: the chosen line says so in MiB/KiB, not "~0.0 GiB" (seen in CI)."""
    from coordinator.planning.strategy import FleetNode, compute_strategy_choice

    tiny = ModelShape(params=200_000, hidden=64, layers=4, vocab=512, intermediate=128, heads=4)
    train = TrainConfig(method="lora", batch_size=8, max_seq_length=128)
    nodes = [FleetNode("a", NodeBudget(21 * GiB)), FleetNode("b", NodeBudget(21 * GiB))]
    choice = compute_strategy_choice("auto", tiny, train, nodes, backend="ring")
    lines = choice.reasons()
    assert lines and not any("0.0 GiB" in line for line in lines), lines
    assert any(re.search(r"~[\d.]+ (?:B|KiB|MiB) per node", line) for line in lines), lines
