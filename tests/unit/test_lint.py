"""Playbook lint: playbook (+ the model's config.json) in, findings out, each rule at its boundaries.

The rules mirror how worker/train.py runs a job: it trains the last `num_layers` layers (all when unset), saves
every `save_every` steps and at the end, and evaluates every `steps_per_eval` steps and at the last step.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.config.playbook import parse_playbook
from coordinator.models import LintResult, Status
from coordinator.preflight.lint import lint_playbook
from tests.factsutil import MODEL_CONFIG

P, W, F, S = Status.PASS, Status.WARN, Status.FAIL, Status.SKIP
LAYERS = MODEL_CONFIG["num_hidden_layers"]  # 22


def lint(train: dict[str, Any] | None = None, config: dict[str, Any] | None = MODEL_CONFIG,
         cuda: dict[str, bool] | None = None, **top: Any) -> dict[str, LintResult]:
    value = {"name": "job", "model": "/m", "data": "/d", "train": train or {}, **top}
    results = lint_playbook(parse_playbook(value, path="playbook.yaml"), config, cuda)
    for r in results:
        assert r.summary.strip()
        if r.status in (W, F, Status.ERROR):
            assert r.remedy.strip(), r
    by_id = {r.id: r for r in results}
    assert len(by_id) == len(results), "one finding per rule"
    return by_id


def test_map_jobs_are_not_linted() -> None:
    pb = parse_playbook({"name": "m", "kind": "map", "model": "/m", "data": "/d"}, path="p.yaml")
    assert lint_playbook(pb, MODEL_CONFIG) == []


def test_rule_ids_are_stable() -> None:
    assert list(lint()) == ["num_layers", "save_every", "eval_cost"]
    assert list(lint({"grad_accumulation": 2})) == ["num_layers", "save_every", "learning_rate", "eval_cost"]


# ------------------------------------------------------------------------------------------------- num_layers

NUM_LAYERS_CASES = [
    # method, num_layers, config -> status, in summary, in remedy
    ("full", None, MODEL_CONFIG, P, f"training all {LAYERS} layers (mlx-lm alone would train only 16)", ""),
    ("full", -1, MODEL_CONFIG, P, f"training all {LAYERS} layers", ""),
    ("full", LAYERS, MODEL_CONFIG, P, f"training all {LAYERS} layers", ""),
    ("full", 16, MODEL_CONFIG, F, f"num_layers 16 but the model has {LAYERS} layers", f"num_layers: {LAYERS}"),
    ("full", LAYERS - 1, MODEL_CONFIG, F, f"num_layers {LAYERS - 1} but the model has {LAYERS}", f"num_layers: {LAYERS}"),
    ("full", LAYERS + 1, MODEL_CONFIG, F, f"the model has {LAYERS} layers", f"num_layers: {LAYERS}"),
    ("full", None, {**MODEL_CONFIG, "num_hidden_layers": 16}, P, "training all 16 layers", ""),
    ("lora", 8, MODEL_CONFIG, P, f"lora on the last 8 of {LAYERS} layers", ""),
    ("dora", 16, MODEL_CONFIG, P, f"dora on the last 16 of {LAYERS} layers", ""),
    ("lora", None, MODEL_CONFIG, P, f"training all {LAYERS} layers", ""),
    # layer counts under other names
    ("full", 12, {"n_layer": 12, "n_embd": 768}, P, "training all 12 layers", ""),
    ("full", 16, {"text_config": {"num_hidden_layers": 34}}, F, "the model has 34 layers", "num_layers: 34"),
    ("full", 16, None, S, "layer count unknown", ""),
    ("full", 16, {"model_type": "mystery"}, S, "layer count unknown", ""),
]


@pytest.mark.parametrize(("method", "num_layers", "config", "status", "summary", "remedy"), NUM_LAYERS_CASES)
def test_num_layers(method: str, num_layers: int | None, config: dict[str, Any] | None, status: Status, summary: str,
                    remedy: str) -> None:
    r = lint({"method": method, "num_layers": num_layers}, config)["num_layers"]
    assert r.status is status, r
    assert summary in r.summary
    assert remedy in r.remedy


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_num_layers_beyond_the_model_fails_for_adapters_too(method: str) -> None:
    # worker/train.py apply_method: `if not 1 <= count <= total: raise ValueError(...)` at the start of the run
    r = lint({"method": method, "num_layers": LAYERS + 1})["num_layers"]
    assert r.status is F, r


# ------------------------------------------------------------------------------------------------- save_every

SAVE_EVERY_CASES = [
    # iters, save_every, status, limit = max(1, min(1000, iters // 20))
    (1000, 50, P, 50),
    (1000, 51, W, 50),
    (1000, 100, W, 50),  # mlx-lm's defaults (iters 1000, save_every 100) warn
    (19_999, 999, P, 999),
    (19_999, 1000, W, 999),
    (20_000, 1000, P, 1000),
    (100_000, 1000, P, 1000),
    (100_000, 1001, W, 1000),
    (10, 1, P, 1),  # iters/20 < 1: every step is the best there is
    (10, 2, W, 1),
    (40, 2, P, 2),
    (40, 3, W, 2),
]


@pytest.mark.parametrize(("iters", "save_every", "status", "limit"), SAVE_EVERY_CASES)
def test_save_every(iters: int, save_every: int, status: Status, limit: int) -> None:
    r = lint({"iters": iters, "save_every": save_every, "steps_per_eval": iters})["save_every"]
    assert r.status is status, r
    if status is W:
        assert f"save_every {save_every} > min(1000, iters/20) = {limit}" in r.summary
        assert f"lose up to {save_every} steps" in r.summary
        assert r.remedy == f"set `save_every: {limit}` or lower"
    else:
        assert f"every {save_every} steps" in r.summary


# ------------------------------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize(("batch", "accum", "present"), [(4, 1, False), (4, 2, True), (8, 16, True)])
def test_learning_rate_hint_with_grad_accumulation(batch: int, accum: int, present: bool) -> None:
    results = lint({"batch_size": batch, "grad_accumulation": accum, "learning_rate": "2e-5"})
    assert ("learning_rate" in results) is present
    if present:
        r = results["learning_rate"]
        assert r.status is P  # a hint, not a finding
        assert f"effective batch {batch * accum} ({batch} x {accum} accumulation) at lr 2e-05" in r.summary
        assert "scale the lr" in r.summary


# ------------------------------------------------------------------------------------------------- eval cost

EVAL_CASES = [
    # iters, steps_per_eval, val_batches, grad_accumulation -> status, in summary
    (1000, 200, 25, 1, P, "5 evals x 25 batches (12.5% of training)"),  # the defaults
    (1000, 125, 25, 1, P, "8 evals x 25 batches (20.0% of training)"),  # exactly 20%: fine
    (1000, 125, 26, 1, W, "8 evals x 26 val batches = 208 batches, 21% of training"),
    (1000, 100, 25, 1, W, "10 evals x 25 val batches = 250 batches, 25% of training"),
    (1000, 100, 25, 2, P, "10 evals x 25 batches (12.5% of training)"),  # accumulation makes steps dearer
    (1000, 1000, 25, 1, P, "1 evals x 25 batches"),
    (100, 200, 25, 1, W, "steps_per_eval 200 > iters 100"),
    (100, 101, 1, 1, W, "steps_per_eval 101 > iters 100"),
]


@pytest.mark.parametrize(("iters", "steps", "val", "accum", "status", "summary"), EVAL_CASES)
def test_eval_cost(iters: int, steps: int, val: int, accum: int, status: Status, summary: str) -> None:
    r = lint({"iters": iters, "steps_per_eval": steps, "val_batches": val, "grad_accumulation": accum,
              "save_every": 1})["eval_cost"]
    assert r.status is status, r
    assert summary in r.summary
    if status is W and steps > iters:
        assert r.remedy == f"set `steps_per_eval` <= {iters}"
    elif status is W:
        assert "raise steps_per_eval or lower val_batches" in r.remedy


def test_eval_cost_counts_the_final_eval() -> None:
    # worker/train.py evaluates when `step % steps_per_eval == 0 or last`: at 300, 600, 900 and 1000 here,
    # 4 x 60 = 240 val batches for 1000 training batches (24%); the lint counts 1000 // 300 = 3 (18%).
    r = lint({"iters": 1000, "steps_per_eval": 300, "val_batches": 60, "save_every": 50})["eval_cost"]
    assert r.status is W, r
    assert "4 evals" in r.summary


@pytest.mark.parametrize(("backend", "cuda", "expect"), [
    # ring between NVIDIA GPUs: a suggestion to use nccl
    ("ring", {"g1": True, "g2": True}, (W, "every node (2) has an NVIDIA GPU but backend ring", "`backend: nccl`")),
    ("auto", {"g1": True, "g2": True}, (P, "auto resolves to nccl", "")),
    ("nccl", {"g1": True, "g2": True}, (P, "nccl on 2 NVIDIA node(s)", "")),
    # nccl where a node has no NVIDIA GPU: rejected, naming the node
    ("nccl", {"g1": True, "mac": False}, (F, "backend nccl but mac has no NVIDIA GPU", "`backend: ring`")),
    ("nccl", {"a": False, "b": False}, (F, "backend nccl but a, b have no NVIDIA GPU", "`backend: ring`")),
])
def test_backend_against_the_fleets_gpus(backend: str, cuda: dict[str, bool], expect: tuple[Status, str, str]) -> None:
    status, summary, remedy = expect
    finding = lint(backend=backend, cuda=cuda)["backend"]
    assert finding.status is status and summary in finding.summary and remedy in finding.remedy


@pytest.mark.parametrize(("backend", "cuda"), [
    ("ring", {"g1": True}),  # one node: no collectives to speed up
    ("ring", {"g1": True, "mac": False}),  # a mixed fleet cannot use nccl
    ("ring", {"a": False, "b": False}),
    ("jaccl", {"a": False, "b": False}),
    ("nccl", None),  # no facts (lint without a fleet): nothing to say
])
def test_no_backend_finding_without_a_reason(backend: str, cuda: dict[str, bool] | None) -> None:
    assert "backend" not in lint(backend=backend, cuda=cuda)
