"""`data_steps` (a rehearsal's run.json): step i reads the rows of the run's step k_i, no others, and trains on them
as the run would. Checked against a plain run of the same data by what each step reports of its rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_train_distributed import SMOKE, kinds, read_events, require_finished, run_direct, write_config
from worker.runconfig import ConfigError, parse_run_config
from worker.tinymodel import build_tiny_model


def step_rows(run: Path) -> list[tuple[int, int]]:
    """(real tokens, data position after the step) of each step, in order."""
    return [(e["tokens"], e["data_position"]) for e in kinds(read_events(run, 0), "step")]


def test_a_step_reads_the_rows_of_the_run_step_it_stands_for(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", SMOKE, layers=1)
    base = {"model": str(model), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1, "save_every": 0,
            "steps_per_eval": 0, "heartbeat_s": 0.5, "seed": 3, "method": "lora", "lora": {"rank": 2, "scale": 1.0},
            "ranks": [{"rank": 0, "node": "local", "batch_size": 2}]}
    runs = {}
    for name, extra in (("plain", {"iters": 6}), ("sampled", {"iters": 3, "data_steps": [5, 0, 2]})):
        run = tmp_path / name
        proc = run_direct(write_config(run / "run.json", **base, **extra, run_id=name, run_dir=str(run)))
        require_finished(run, [0], f"{proc.stderr}\nexit {proc.returncode}")
        runs[name] = step_rows(run)
    plain, sampled = runs["plain"], runs["sampled"]
    assert len({tokens for tokens, _ in plain}) > 1, "the data must tell steps apart for this test to mean anything"
    assert [tokens for tokens, _ in sampled] == [plain[5][0], plain[0][0], plain[2][0]]
    assert [position for _, position in sampled] == [plain[5][1], plain[0][1], plain[2][1]]


@pytest.mark.parametrize(("value", "message"), [
    ([1, 2], "fewer than iters"), ([0, -1, 2], "step numbers >= 0"), ("0,1,2", "a list"), ([0, True, 2], "numbers"),
])
def test_bad_data_steps_are_refused(value: object, message: str) -> None:
    raw = {"run_id": "r", "model": "m", "data": "d", "run_dir": "/x", "iters": 3, "data_steps": value,
           "ranks": [{"rank": 0, "node": "a", "batch_size": 1}]}
    with pytest.raises(ConfigError, match=message):
        parse_run_config(raw)


def test_data_steps_round_trip() -> None:
    raw = {"run_id": "r", "model": "m", "data": "d", "run_dir": "/x", "iters": 2, "data_steps": [4, 9],
           "ranks": [{"rank": 0, "node": "a", "batch_size": 1}]}
    config = parse_run_config(raw)
    assert config.data_steps == (4, 9)
    assert parse_run_config(config.to_json()) == config
