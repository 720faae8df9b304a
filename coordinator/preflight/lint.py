"""Lint of a playbook against known training traps. Pure: playbook (+ the model's config) in, findings out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.config.playbook import Playbook
from coordinator.models import LintResult, Status
from coordinator.planning.estimate import model_shape, num_layers
from coordinator.planning.strategy import (
    NO_SEND_RECV_BACKENDS,
    NodeBudget,
    StrategyError,
    compute_strategy,
    fsdp_refusal,
    pipeline_refusal,
)

MLX_LM_DEFAULT_LAYERS = 16


def lint_backend(pb: Playbook, cuda: Mapping[str, bool]) -> list[LintResult]:
    """The backend against the fleet's GPUs (`cuda`: node -> has an NVIDIA GPU, for the nodes whose facts are
    known). nccl needs NVIDIA GPUs everywhere; ring between NVIDIA GPUs sums every gradient over TCP through host
    memory, where nccl uses NVLink / InfiniBand / GPUDirect."""
    if not cuda:
        return []
    without = sorted(n for n, has in cuda.items() if not has)
    if pb.backend == "nccl" and without:
        return [LintResult("backend", Status.FAIL, f"backend nccl but {', '.join(without)} "
                           f"{'has' if len(without) == 1 else 'have'} no NVIDIA GPU (see the software check)",
                           "use `backend: ring` (or run on NVIDIA nodes only)")]
    if pb.backend == "nccl":
        return [LintResult("backend", Status.PASS, f"nccl on {len(cuda)} NVIDIA node(s)")]
    if pb.backend in ("ring", "auto") and len(cuda) >= 2 and not without:
        if pb.backend == "auto":
            return [LintResult("backend", Status.PASS, f"auto resolves to nccl: every node ({len(cuda)}) has an "
                               "NVIDIA GPU")]
        return [LintResult("backend", Status.WARN, f"every node ({len(cuda)}) has an NVIDIA GPU but backend ring "
                           "sums gradients over TCP through host memory",
                           "set `backend: nccl` (NCCL over NVLink / InfiniBand / Ethernet, GPU to GPU)")]
    return []


def lint_strategy(pb: Playbook, model_config: Mapping[str, Any] | None, budgets: Mapping[str, NodeBudget],
                  backend: str) -> list[LintResult]:
    """`train.strategy` against the fleet (`budgets`: node -> usable memory; `backend`: the resolved one). A
    strategy that resolves to fsdp fails where its backend has no sum_scatter; a pipeline fails on a backend without
    send/recv (nccl). auto says nothing where it stays dp or cannot choose (LoRA that fits, unknown size): the
    resources check reports that fit."""
    t = pb.train
    auto = t.strategy == "auto"
    if t.strategy == "pipeline" and backend in NO_SEND_RECV_BACKENDS:
        return [LintResult("strategy", Status.FAIL, pipeline_refusal(backend), _PIPELINE_REMEDY)]
    shape = model_shape(model_config, None) if model_config else None
    if shape is None or not budgets:
        if t.strategy == "fsdp" and (refusal := fsdp_refusal(backend)) is not None:
            return [LintResult("strategy", Status.FAIL, refusal, _FSDP_REMEDY)]
        return [] if auto else [LintResult("strategy", Status.SKIP,
                                           "model size or node memory unknown: strategy not planned")]
    try:
        decision = compute_strategy(t.strategy, shape, t, budgets, backend=backend)
    except StrategyError as exc:
        return [LintResult("strategy", Status.FAIL, str(exc), "use LoRA, grad_checkpoint: true, a smaller batch, "
                           "micro-batches or max_seq_length, or more / larger nodes")]
    if decision.strategy == "fsdp" and (refusal := fsdp_refusal(backend)) is not None:
        return [LintResult("strategy", Status.FAIL, f"{decision.describe()}; {refusal}", _FSDP_REMEDY)]
    if decision.left_out:
        return [LintResult("strategy", Status.WARN, decision.describe(),
                           "use LoRA, grad_checkpoint: true or a smaller batch to train on every node")]
    # auto's choice of a pipeline or fsdp is news (the run splits or shards): said; auto staying dp is the
    # resources check's to report.
    return [] if auto and decision.strategy == "dp" else [LintResult("strategy", Status.PASS, decision.describe())]


_PIPELINE_REMEDY = "use `backend: ring` (a pipeline's stages talk through send/recv)"
_FSDP_REMEDY = "fit a dp replica instead (LoRA, grad_checkpoint: true, a smaller batch or max_seq_length)"


def lint_playbook(pb: Playbook, model_config: Mapping[str, Any] | None,
                  cuda: Mapping[str, bool] | None = None, *, budgets: Mapping[str, NodeBudget] | None = None,
                  backend: str | None = None) -> list[LintResult]:
    """Training-trap findings for `pb`; `cuda` (node -> has an NVIDIA GPU) adds the backend finding, `budgets`
    (node -> usable memory) and `backend` (resolved) the strategy finding."""
    if pb.kind != "train":
        return []
    t = pb.train
    out: list[LintResult] = lint_backend(pb, cuda or {})
    if budgets is not None or t.strategy != "auto":
        out += lint_strategy(pb, model_config, budgets or {}, backend or pb.backend)
    layers = num_layers(model_config) if model_config else None
    requested = t.num_layers
    if layers is None:
        out.append(LintResult("num_layers", Status.SKIP, "model config.json not readable: layer count unknown"))
    elif requested is None or requested < 0 or requested == layers:
        note = " (mlx-lm alone would train only 16)" if t.fine_tune_type == "full" and layers > MLX_LM_DEFAULT_LAYERS else ""
        out.append(LintResult("num_layers", Status.PASS, f"training all {layers} layers{note}"))
    elif requested > layers:
        out.append(LintResult("num_layers", Status.FAIL,
                              f"num_layers {requested} but the model has {layers} layers: the run would fail",
                              f"set `num_layers: {layers}` or fewer (or remove it: all layers)"))
    elif t.fine_tune_type == "full":
        out.append(LintResult("num_layers", Status.FAIL,
                              f"full fine-tune with num_layers {requested} but the model has {layers} layers: only the "
                              f"last {requested} would train",
                              f"set `num_layers: {layers}` (or remove it: the coordinator trains all layers)"))
    else:
        out.append(LintResult("num_layers", Status.PASS, f"{t.method} on the last {requested} of {layers} layers"))
    limit = max(1, min(1000, t.iters // 20))
    if t.save_every > limit:
        out.append(LintResult("save_every", Status.WARN,
                              f"save_every {t.save_every} > min(1000, iters/20) = {limit}: a crash can lose up to "
                              f"{t.save_every} steps",
                              f"set `save_every: {limit}` or lower"))
    else:
        out.append(LintResult("save_every", Status.PASS, f"checkpoint every {t.save_every} steps"))
    if t.grad_accumulation > 1:
        eff = t.batch_size * t.grad_accumulation
        out.append(LintResult("learning_rate", Status.PASS,
                              f"effective batch {eff} ({t.batch_size} x {t.grad_accumulation} accumulation) at lr "
                              f"{t.learning_rate:g}; if you changed grad_accumulation from a tuned recipe, scale the lr "
                              "with the effective batch (linear for SGD, ~sqrt for Adam)"))
    # The worker evaluates every steps_per_eval steps AND at the last step.
    evals = t.iters // t.steps_per_eval + (1 if t.iters % t.steps_per_eval else 0) if t.steps_per_eval else 0
    eval_batches = evals * t.val_batches
    train_batches = t.iters * t.grad_accumulation
    if t.steps_per_eval > t.iters:
        out.append(LintResult("eval_cost", Status.WARN,
                              f"steps_per_eval {t.steps_per_eval} > iters {t.iters}: no validation during training",
                              f"set `steps_per_eval` <= {t.iters}"))
    elif eval_batches > 0.2 * train_batches:
        out.append(LintResult("eval_cost", Status.WARN,
                              f"{evals} evals x {t.val_batches} val batches = {eval_batches} batches, "
                              f"{100 * eval_batches / train_batches:.0f}% of training",
                              "raise steps_per_eval or lower val_batches"))
    else:
        out.append(LintResult("eval_cost", Status.PASS,
                              f"{evals} evals x {t.val_batches} batches ({100 * eval_batches / max(1, train_batches):.1f}%"
                              " of training)"))
    return out
