"""benchmarks/bench_train.py: its pure parts (data shapes, medians, goals, ABBA order) on small tables, and its
CI-sized form run for real (`--ci`: tiny model, both shapes, both methods, `coordinator launch` on a local node
and mlx-lm's own trainer), checked against the JSON contract. No wall-clock or ratio thresholds: the figures
depend on the machine; the contract does not."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_train as bt  # noqa: E402


def test_model_sizes_have_the_issue_parameter_counts() -> None:
    assert round(bt.SIZES["S"].parameters() / 1e6) == 168
    assert round(bt.SIZES["M"].parameters() / 1e6) == 954
    assert bt.SIZES["S"].vocab == bt.SIZES["M"].vocab == 32000
    assert (bt.SIZES["S"].batch, bt.SIZES["S"].seq_len) == (8, 512)


def test_words_are_distinct_multi_letter_and_deterministic() -> None:
    words = bt.make_words(5000)
    assert len(set(words)) == 5000
    assert all(len(w) >= 3 and w.isalpha() and w.islower() for w in words)
    assert words == bt.make_words(5000)
    assert words != bt.make_words(5000, seed=1)


@pytest.mark.parametrize(("shape", "seq_len", "low", "high"), [
    ("long", 512, 480, 512), ("long", 128, 120, 128), ("short", 512, 16, 128), ("short", 128, 16, 32),
])
def test_row_lengths_stay_in_their_shape(shape: str, seq_len: int, low: int, high: int) -> None:
    lengths = bt.row_lengths(shape, 400, seq_len, seed=0)
    assert min(lengths) >= low and max(lengths) <= high
    assert max(lengths) - min(lengths) > (high - low) // 2  # spread, not one length


def test_variable_rows_are_chat_like_lognormal_and_deterministic() -> None:
    """Issue 25's data set: median ~110 tokens at max_seq_length 512, a long tail cut at max_seq_length (a few
    percent of rows), nothing below the minimum; scaled with max_seq_length; the same for the same seed."""
    lengths = bt.row_lengths("variable", 4000, 512, seed=1)
    assert 100 <= statistics.median(lengths) <= 120
    assert min(lengths) >= bt.VARIABLE_MIN and max(lengths) == 512
    assert 0.01 <= sum(n == 512 for n in lengths) / len(lengths) <= 0.06
    assert sum(n >= 256 for n in lengths) / len(lengths) >= 0.1  # the long tail
    assert lengths == bt.row_lengths("variable", 4000, 512, seed=1) != bt.row_lengths("variable", 4000, 512, seed=2)
    small = bt.row_lengths("variable", 4000, 128, seed=1)
    assert 24 <= statistics.median(small) <= 30 and max(small) == 128
    assert bt.mean_length("variable", 512) == pytest.approx(statistics.mean(lengths), rel=0.1)


def test_bimodal_rows_are_two_groups() -> None:
    """Issue 25's unseen set: 70% one-line rows (8 .. 1/8 of max_seq_length), the rest half to full length."""
    lengths = bt.row_lengths("bimodal", 4000, 512, seed=1)
    short = [n for n in lengths if n <= 64]
    assert len(short) / len(lengths) == pytest.approx(bt.BIMODAL_SHORT, abs=0.03)
    assert all(n >= 256 for n in lengths if n > 64) and min(lengths) >= bt.VARIABLE_MIN and max(lengths) <= 512
    assert bt.mean_length("bimodal", 512) == pytest.approx(statistics.mean(lengths), rel=0.05)


def test_unknown_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        bt.row_lengths("medium", 4, 128, seed=0)


def test_rows_use_every_word_and_have_length_minus_two_words() -> None:
    words = bt.make_words(50)
    texts = bt.make_rows(words, [12, 12, 12, 12, 12, 12], seed=0)
    assert [len(t.split()) for t in texts] == [10] * 6
    assert set(" ".join(texts).split()) == set(words)


def test_enough_train_rows_for_iters_and_vocabulary() -> None:
    s = bt.SIZES["S"]
    assert bt.train_rows_needed(s, "long", 40) == 320
    assert bt.train_rows_needed(s, "short", 40) * (16 + 128) / 2 >= s.vocab - bt.BASE_VOCAB


def test_steady_median_leaves_out_the_warmup() -> None:
    points = [(1, 10.0), (2, 50.0), (3, 100.0), (4, 110.0), (5, 90.0)]
    assert bt.steady_median(points, 2) == 100.0
    assert bt.steady_median(points, 0) == 90.0
    assert bt.steady_median(points, 5) is None


def test_wall_rates_use_the_interval_before_each_step() -> None:
    assert bt.wall_rates([(1, 100, 0.0), (2, 100, 0.5), (3, 300, 1.5)]) == [(2, 200.0), (3, 300.0)]


def test_mlx_lm_figures_convert_gb_and_count_step_tokens() -> None:
    out = {"reports": [{"iteration": i, "tokens_per_second": 1000.0 * i, "iterations_per_second": 2.0,
                        "peak_memory": 0.5 + i / 10, "wall_s": 0.5 * i} for i in (1, 2, 3, 4)],
           "trainable_params": 10, "total_params": 20}
    fig = bt.mlx_lm_figures(out, warmup=1)
    assert fig["tokens_per_s"] == 3000.0
    assert fig["peak_memory"] == 900_000_000
    assert fig["wall_tokens_per_s"] == 3000.0  # tokens 1500 per 0.5 s at step 3
    assert fig["trainable_params"] == 10


def test_ours_figures_from_rank0_events() -> None:
    events: list[dict[str, Any]] = [{"event": "started", "rank": 0, "trainable_params": 5, "total_params": 9}]
    events += [{"event": "step", "rank": 0, "step": s, "tokens": 400, "step_time_s": 0.1 * s, "t": 10.0 + s,
                "peak_memory": 1000 + s} for s in (1, 2, 3)]
    events.append({"event": "step", "rank": 1, "step": 3, "tokens": 1, "step_time_s": 1.0, "t": 99.0})
    fig = bt.ours_figures(events, warmup=1)
    assert fig["tokens_per_s"] == pytest.approx((2000.0 + 400 / 0.3) / 2)
    two = [{**e, "total_tokens": 1000} for e in events]  # rank 0 of a 2-rank run: the step's tokens are the total
    assert bt.ours_figures(two, warmup=1)["tokens_per_s"] == pytest.approx((5000.0 + 1000 / 0.3) / 2)
    assert fig["peak_memory"] == 1003
    assert fig["wall_tokens_per_s"] == pytest.approx(400.0)
    assert (fig["trainable_params"], fig["total_params"], fig["steps"]) == (5, 9, 3)


@pytest.mark.parametrize(("shape", "tok", "mem", "pred", "expected"), [
    ("long", 1.0, 1.05, 0.15, ("met", "met", "met")),
    ("long", 0.99, 1.06, -0.16, ("missed", "missed", "missed")),
    ("short", 1.29, 0.5, -0.15, ("missed", "met", "met")),
    ("short", 1.3, None, None, ("met", "unmeasured", "unmeasured")),
])
def test_goals(shape: str, tok: float, mem: float | None, pred: float | None, expected: tuple[str, ...]) -> None:
    goals = bt.evaluate_goals(shape, tok, mem, pred)
    assert (goals["tokens_per_s"], goals["peak_memory"], goals["prediction"]) == expected


def test_rounds_alternate_abba() -> None:
    assert [bt.round_order(r) for r in (1, 2, 3)] == [("ours", "mlx_lm"), ("mlx_lm", "ours"), ("ours", "mlx_lm")]
    assert bt.round_order(2, ranks=2) == ("ours",)  # a 2-rank cell: the prediction vs the run, ours alone


def test_cells_cross_every_setting_and_ci_keeps_one_two_rank_cell() -> None:
    full = bt.plan_cells(["tiny"], ["long", "variable"], ["lora", "full"], [1, 2])
    assert len(full) == 8 and {c[3] for c in full} == {1, 2}
    ci = bt.plan_cells(["tiny"], list(bt.CI_SHAPES), ["lora", "full"], [1, 2], ci=True)
    assert ci == [("tiny", "long", "lora", 1), ("tiny", "long", "full", 1), ("tiny", "variable", "lora", 1),
                  ("tiny", "variable", "lora", 2)]


def test_two_rank_inventory_has_one_local_node_per_rank(tmp_path: Path) -> None:
    import yaml

    one = yaml.safe_load(bt.write_inventory(tmp_path).read_text())
    two = yaml.safe_load(bt.write_inventory(tmp_path, 2).read_text())
    assert [n["name"] for n in one["nodes"]] == ["bench"]
    assert [n["name"] for n in two["nodes"]] == ["bench", "bench-1"]
    assert len({n["workdir"] for n in two["nodes"]}) == 2 and two["defaults"]["connection"] == "local"


def test_summarize_cell_takes_medians_over_rounds_and_skips_failed_runs() -> None:
    def ours(rnd: int, tok: float) -> dict[str, Any]:
        return {"tool": "ours", "round": rnd, "tokens_per_s": tok, "wall_tokens_per_s": tok, "peak_memory": 100,
                "summary_tokens_per_s": 200.0, "predicted_tokens_per_s": 180.0, "trainable_params": 7}

    def theirs(rnd: int, tok: float) -> dict[str, Any]:
        return {"tool": "mlx_lm", "round": rnd, "tokens_per_s": tok, "wall_tokens_per_s": tok, "peak_memory": 200,
                "trainable_params": 7}

    cell = {"shape": "short", "runs": [ours(1, 130.0), theirs(1, 100.0), theirs(2, 100.0), ours(2, 150.0),
                                       ours(3, 140.0), {"tool": "mlx_lm", "round": 3, "error": "boom"}]}
    s = bt.summarize_cell(cell)
    assert s["ours"]["tokens_per_s"] == 140.0 and s["mlx_lm"]["tokens_per_s"] == 100.0
    assert s["ratio"]["tokens_per_s"] == pytest.approx(1.4)
    assert s["ratio"]["paired_tokens_per_s"] == [pytest.approx(1.3), pytest.approx(1.5)]
    assert s["ratio"]["peak_memory"] == 0.5
    assert s["prediction_error"] == pytest.approx(-0.1)
    assert s["same_trainable"] is True
    assert s["goals"] == {"tokens_per_s": "met", "peak_memory": "met", "prediction": "met"}


def test_mlx_lm_trains_what_ours_trained() -> None:
    full = {"method": "full", "runs": []}
    assert bt.trainable_for(full) == "all"
    full["runs"] = [{"tool": "ours", "trainable_params": 8, "total_params": 10}]
    assert bt.trainable_for(full) == "mlx-lm"
    lora = {"method": "lora", "runs": [{"tool": "ours", "trainable_params": 1, "total_params": 10}]}
    assert bt.trainable_for(lora) == "mlx-lm"


def test_bad_arguments_exit_2() -> None:
    for argv in (["--sizes", "XL"], ["--iters", "4", "--warmup", "4"], ["--shapes", ""]):
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train.py"), *argv],
                              capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr


def test_ci_form_meets_the_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--ci", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["versions"]["mlx"] and results["versions"]["mlx_lm"] and results["commit"]
    cells = {(c["size"], c["shape"], c["method"], c["ranks"]) for c in results["cells"]}
    assert cells == set(bt.plan_cells(["tiny"], list(bt.CI_SHAPES), ["lora", "full"], [1, 2], ci=True))
    for cell in results["cells"]:
        tools = sorted(r["tool"] for r in cell["runs"])
        assert tools == (["mlx_lm", "ours"] if cell["ranks"] == 1 else ["ours"]), cell["runs"]
        for run in cell["runs"]:
            assert "error" not in run, run
            assert run["tokens_per_s"] > 0 and run["wall_tokens_per_s"] > 0 and run["peak_memory"] > 0, run
            assert run["steps"] == results["settings"]["iters"]
        ours = next(r for r in cell["runs"] if r["tool"] == "ours")
        assert ours["predicted_tokens_per_s"] > 0 and ours["summary_tokens_per_s"] > 0
        s = cell["summary"]
        assert s["prediction_error"] is not None
        if cell["ranks"] == 1:
            assert s["ratio"]["tokens_per_s"] > 0 and s["ratio"]["peak_memory"] > 0
            assert s["same_trainable"] is True
            assert set(s["goals"].values()) <= {"met", "missed"}
        else:  # the prediction holds or not; there is no mlx-lm run to compare with
            assert s["goals"]["prediction"] in {"met", "missed"} and s["goals"]["tokens_per_s"] == "unmeasured"
    # The Markdown report: one table row per cell.
    assert proc.stdout.count("| tiny |") == len(results["cells"])
