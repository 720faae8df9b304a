"""`layout` in the run config (worker.runconfig): dp by default, a pipeline as typed stages; parse/to_json round
trip; every inconsistent pipeline refused with a one-line reason before any rank loads a model."""

from __future__ import annotations

from typing import Any

import pytest

from worker.runconfig import ConfigError, Layout, StageSpec, parse_run_config

BASE: dict[str, Any] = {
    "run_id": "r1", "model": "/srv/model", "data": "/srv/data", "method": "lora", "run_dir": "/tmp/run",
    "ranks": [{"rank": 0, "node": "a", "batch_size": 8}, {"rank": 1, "node": "b", "batch_size": 8},
              {"rank": 2, "node": "c", "batch_size": 8}],
}
PIPE: dict[str, Any] = {"kind": "pipeline", "micro_batches": 4, "schedule": "1f1b", "stages": [
    {"rank": 0, "first_layer": 0, "last_layer": 1}, {"rank": 1, "first_layer": 1, "last_layer": 4},
    {"rank": 2, "first_layer": 4, "last_layer": 6}]}


def test_a_config_without_layout_is_data_parallel_and_writes_none() -> None:
    cfg = parse_run_config(BASE)
    assert cfg.layout == Layout() and cfg.layout.kind == "dp" and cfg.global_batch == 24
    assert "layout" not in cfg.to_json()
    assert parse_run_config({**BASE, "layout": {"kind": "dp"}}) == cfg


def test_a_pipeline_layout_parses_into_typed_stages_and_round_trips() -> None:
    cfg = parse_run_config({**BASE, "layout": PIPE})
    assert cfg.layout.stages == (StageSpec(0, 0, 1), StageSpec(1, 1, 4), StageSpec(2, 4, 6))
    assert [s.layers for s in cfg.layout.stages] == [1, 3, 2]
    assert cfg.layout.micro_batches == 4 and cfg.layout.schedule == "1f1b"
    assert cfg.global_batch == 8  # every stage computes every row of the global batch
    assert cfg.to_json()["layout"] == PIPE
    assert parse_run_config(cfg.to_json()) == cfg
    # stages may be listed in any order; defaults: one micro-batch, 1f1b
    shuffled = {"kind": "pipeline", "stages": list(reversed(PIPE["stages"]))}
    assert parse_run_config({**BASE, "layout": shuffled}).layout == Layout("pipeline", cfg.layout.stages, 1, "1f1b")
    # the layout does not change the training math: same digest as dp
    assert cfg.digest() == parse_run_config(BASE).digest()


def stages(*ranges: tuple[int, int]) -> list[dict[str, int]]:
    return [{"rank": r, "first_layer": a, "last_layer": b} for r, (a, b) in enumerate(ranges)]


@pytest.mark.parametrize(("layout", "extra", "message"), [
    ({"kind": "tensor"}, {}, "layout.kind must be one of"),
    ({"kind": "dp", "stages": []}, {}, "unknown keys for kind dp"),
    ({**PIPE, "split": [1, 3, 2]}, {}, "layout: unknown keys"),
    ({**PIPE, "stages": stages((0, 1), (1, 4))}, {}, "one stage per rank"),
    ({**PIPE, "stages": stages((0, 1), (2, 4), (4, 6))}, {}, "contiguous in rank order"),
    ({**PIPE, "stages": stages((0, 1), (1, 1), (1, 6))}, {}, "non-empty"),
    ({**PIPE, "stages": stages((1, 2), (2, 4), (4, 6))}, {}, "expected it to start at 0"),
    ({**PIPE, "stages": [*stages((0, 1), (1, 4)), {"rank": 1, "first_layer": 4, "last_layer": 6}]}, {},
     "exactly once"),
    ({**PIPE, "stages": [{"rank": 0, "first": 0}, *stages((0, 1), (1, 6))[1:], PIPE["stages"][2]]}, {},
     r"stages\[0\] must be"),
    ({**PIPE, "micro_batches": 9}, {}, "exceeds the global batch of 8"),
    ({**PIPE, "micro_batches": 0}, {}, "layout.micro_batches must be >= 1"),
    ({**PIPE, "schedule": "zb"}, {}, "layout.schedule must be one of"),
    (PIPE, {"ranks": [{"rank": 0, "node": "a", "batch_size": 8}, {"rank": 1, "node": "b", "batch_size": 4},
                      {"rank": 2, "node": "c", "batch_size": 8}]}, "must be equal"),
    (PIPE, {"method": "dpo"}, "does not train DPO"),
    (PIPE, {"method": "full", "train_embeddings": True}, "does not train embeddings"),
    ("pipeline", {}, "layout must be an object"),
])
def test_an_inconsistent_layout_is_refused(layout: Any, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_config({**BASE, **extra, "layout": layout})
