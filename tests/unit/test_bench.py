"""worker.bench: the sweep's decisions (pure, table-driven) and real runs on a tiny random llama model; plus
coordinator.run.calibrate end to end over a LocalTransport (ship, run, parse, cache)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.fleet.transport import Fleet
from coordinator.models import Connection, Node
from coordinator.planning.plan import NodeCalibration, compute_plan
from coordinator.run.calibrate import BenchSpec, NodeFingerprint, calibrate
from worker.bench import (
    MEASURE,
    ONE_TIME,
    STOP_REASONS,
    Budget,
    Point,
    _measure,
    _State,
    advise_no_point,
    decide_stop,
    disturbed,
    look_again,
    next_batch,
    predict_peak_memory,
    predict_point_cost,
    shape_seconds,
    sweep,
)

REPO = Path(__file__).resolve().parents[2]
SLACK_S = 2.0  # what the bench may report beyond its budget: writing the JSON after the watchdog fired
KEYS = {"curve", "best_batch", "best_tokens_per_s", "matmul_gflops", "device", "memory_limit", "stopped_because",
        "seconds"}
POINT_KEYS = {"batch", "tokens_per_s", "peak_memory", "step_time_s"}


def pt(batch: int, rate: float, peak: int = 0, step: float | None = None, warmup: float | None = None) -> Point:
    step_time = step if step is not None else batch * 100 / rate
    return Point(batch, rate, peak, step_time, 3, warmup if warmup is not None else step_time)


# --- pure decisions ----------------------------------------------------------------------------------------------

def test_next_batch_doubles_then_lands_on_max() -> None:
    assert [next_batch(b, 48) for b in (1, 2, 16, 32)] == [2, 4, 32, 48]


def test_predict_peak_memory() -> None:
    assert predict_peak_memory([pt(1, 10, peak=100)], 4) == 400  # one point: proportional (over-estimates)
    assert predict_peak_memory([pt(1, 10, peak=100), pt(2, 10, peak=150)], 4) == 250  # 100 + 50/row
    assert predict_peak_memory([pt(1, 10, peak=100), pt(2, 10, peak=90)], 4) == 90  # noise: never shrinks


def test_predict_point_cost() -> None:
    # step 0.1 s at batch 2 -> 0.2 s at batch 4; 3 timed steps. The warm-up (compile) is not measuring time: a
    # cold kernel cache's compile must not shrink the curve that the same budget measures on a warm machine.
    assert predict_point_cost(pt(2, 10, step=0.1, warmup=0.6), 4) == pytest.approx(0.2 * 3)
    assert predict_point_cost(pt(2, 10, step=0.1, warmup=60.0), 4) == pytest.approx(0.2 * 3)


def test_budget_keeps_two_clocks_apart() -> None:
    now = [100.0]
    budget = Budget(one_time_s=50, measure_s=10, clock=lambda: now[0])
    now[0] += 30  # imports, load, a compiling first step
    assert budget.used(ONE_TIME) == 30 and budget.used(MEASURE) == 0
    budget.enter(MEASURE)
    now[0] += 4
    assert budget.used(MEASURE) == 4 and budget.left(MEASURE) == 6 and budget.overrun() is None
    budget.enter(ONE_TIME)
    now[0] += 15  # the next shape compiles: measuring time stands still
    assert (budget.used(ONE_TIME), budget.used(MEASURE)) == (45, 4)
    budget.enter(MEASURE)
    now[0] += 6
    assert budget.overrun() == MEASURE
    budget.enter(ONE_TIME)
    assert budget.overrun() is None  # only the running clock can run out
    now[0] += 5
    assert budget.overrun() == ONE_TIME


def test_advice_names_the_allowance_and_a_value_to_set() -> None:
    cold = advise_no_point(ONE_TIME, limit=600, phase="loading the model", step_s=None,
                           one_time={"import": 3.0, "load": 598.0})
    assert "calibration.one_time_budget of 600s" in cold and "loading the model" in cold
    assert "load 598.0s" in cold and "at least 1200" in cold
    slow = advise_no_point(MEASURE, limit=15, phase="measuring batch 1", step_s=9.0, one_time={})
    assert "calibration.time_budget of 15s" in slow and "about 9.0s" in slow
    assert "at least 40" in slow  # 4 steps of 9 s, rounded up to 10 s


STOP_CASES: list[tuple[str, list[Point], dict[str, Any], str | None]] = [
    ("keeps going", [pt(1, 100), pt(2, 180)], {}, None),
    ("throughput fell past the knee", [pt(1, 100), pt(2, 180), pt(4, 170), pt(8, 160)], {}, "throughput_fell"),
    ("one low point may be noise", [pt(1, 100), pt(2, 180), pt(4, 170)], {}, None),
    ("a recovery after a low point", [pt(1, 100), pt(2, 60), pt(4, 200)], {}, None),
    ("a low point at the max batch", [pt(1, 100), pt(2, 180), pt(4, 170)], {"max_batch": 4}, "throughput_fell"),
    ("within noise is not a fall", [pt(1, 100), pt(2, 180), pt(4, 176)], {}, None),
    ("fall wins over max batch", [pt(1, 100), pt(2, 50)], {"max_batch": 2}, "throughput_fell"),
    ("max batch measured", [pt(1, 100), pt(2, 180)], {"max_batch": 2}, "max_batch"),
    ("next batch over memory", [pt(1, 100, peak=600), pt(2, 180, peak=800)], {"memory_limit": 1100},
     "memory"),
    ("next batch fits memory", [pt(1, 100, peak=600), pt(2, 180, peak=800)], {"memory_limit": 1300}, None),
    ("next point too long", [pt(1, 100, step=1.0), pt(2, 180, step=1.1)], {"seconds_left": 5.0}, "time_budget"),
    ("next point fits", [pt(1, 100, step=1.0), pt(2, 180, step=1.1)], {"seconds_left": 9.0}, None),
    ("point cut short", [pt(1, 100)], {"truncated": True}, "time_budget"),
]


@pytest.mark.parametrize(("label", "curve", "overrides", "expected"), STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_decide_stop(label: str, curve: list[Point], overrides: dict[str, Any], expected: str | None) -> None:
    kwargs: dict[str, Any] = {"max_batch": 64, "memory_limit": 1e18, "seconds_left": 1e9, "truncated": False}
    kwargs.update(overrides)
    assert decide_stop(curve, **kwargs) == expected


def fake_measure(rates: dict[int, float], clock: list[float], deadline: float, *, step_s: float = 0.5
                 ) -> Callable[[int], tuple[Point | None, bool]]:
    """Each point costs 4 steps of `step_s` x batch on the fake measuring clock."""
    def measure(batch: int) -> tuple[Point | None, bool]:
        cost = 4 * step_s * batch
        if clock[0] + cost > deadline:
            return None, True
        clock[0] += cost
        return pt(batch, rates[batch], peak=batch * 10, step=step_s * batch), False
    return measure


@pytest.mark.parametrize(("label", "rates", "kwargs", "batches", "reason"), [
    ("knee", {1: 100, 2: 190, 4: 300, 8: 280, 16: 200}, {}, [1, 2, 4, 8, 16], "throughput_fell"),
    ("a noisy dip is measured past", {1: 100, 2: 70, 4: 300, 8: 280, 16: 200}, {}, [1, 2, 4, 8, 16],
     "throughput_fell"),
    ("max batch 6", {1: 100, 2: 190, 4: 300, 6: 350}, {"max_batch": 6}, [1, 2, 4, 6], "max_batch"),
    ("memory", {1: 100, 2: 190, 4: 300}, {"memory_limit": 50}, [1, 2, 4], "memory"),
    ("time", {1: 100, 2: 190, 4: 300, 8: 500, 16: 900}, {"deadline": 20.0}, [1, 2, 4], "time_budget"),
    ("nothing fits", {1: 100}, {"deadline": 1.0}, [], "time_budget"),
])
def test_sweep(label: str, rates: dict[int, float], kwargs: dict[str, Any], batches: list[int], reason: str) -> None:
    clock = [0.0]
    args: dict[str, Any] = {"max_batch": 64, "memory_limit": 1e18, "deadline": 1e9}
    args.update(kwargs)
    deadline = args.pop("deadline")
    curve, stopped = sweep(fake_measure(rates, clock, deadline), seconds_left=lambda: deadline - clock[0], **args)
    assert [p.batch for p in curve] == batches
    assert stopped == reason


@pytest.mark.parametrize(("label", "steps", "expected"), [
    ("a curve that rises", {1: 0.05, 2: 0.09, 4: 0.17}, []),
    # An H100's launch-bound LoRA steps (session 9): batch 1 1.4x batch 2's step, timing noise, not a disturbed point.
    ("a flat GPU curve", {1: 0.100, 2: 0.072, 4: 0.124, 8: 0.186}, []),
    # CI19's h2: its batch-1 point measured while the suite's other worker held its core.
    ("batch 1 three times batch 2", {1: 0.167, 2: 0.051, 4: 0.10}, [1]),
    ("against any larger batch", {1: 0.30, 2: 0.35, 4: 0.14, 8: 0.26}, [1, 2]),
    ("the largest is never judged", {1: 0.05, 2: 0.09, 4: 0.90}, []),
])
def test_disturbed(label: str, steps: dict[int, float], expected: list[int]) -> None:
    assert disturbed([pt(b, 100, step=s) for b, s in steps.items()]) == expected


def looks(seconds: list[float], again: dict[int, Point | None]) -> tuple[list[int], Callable[[int], tuple[Point | None, bool]]]:
    """A measure() for `look_again`: each call spends 1 s of `seconds` and returns `again[batch]`."""
    asked: list[int] = []

    def measure(batch: int) -> tuple[Point | None, bool]:
        asked.append(batch)
        seconds[0] -= 1.0
        return again[batch], False
    return asked, measure


def test_a_second_look_keeps_the_faster_point_and_the_first_looks_compile_time() -> None:
    curve = [pt(1, 100, step=0.167, warmup=9.0), pt(2, 100, step=0.051), pt(4, 100, step=0.10)]
    left, lines = [10.0], []
    asked, measure = looks(left, {1: pt(1, 100, step=0.030, warmup=0.03)})
    out = look_again(curve, measure, seconds_left=lambda: left[0], log=lines.append)
    assert asked == [1]
    assert [p.step_time_s for p in out] == [0.030, 0.051, 0.10]
    assert out[0].warmup_s == 9.0  # the compiling first step is the first look's
    assert "disturbed while measured" in lines[0] and "kept 0.0300" in lines[0]


def test_a_second_look_no_faster_keeps_the_first() -> None:
    curve = [pt(1, 100, step=0.167), pt(2, 100, step=0.051)]
    left = [10.0]
    _, measure = looks(left, {1: pt(1, 100, step=0.2)})
    assert look_again(curve, measure, seconds_left=lambda: left[0])[0].step_time_s == 0.167


@pytest.mark.parametrize(("label", "left", "again"), [
    ("no measuring time left", 0.1, None),
    ("the second look timed no step", 10.0, None),
    ("the second look was cut short", 10.0, Point(1, 100, 0, 0.03, 2, 0.03)),
])
def test_without_a_second_look_the_curve_stands(label: str, left: float, again: Point | None) -> None:
    curve = [pt(1, 100, step=0.167), pt(2, 100, step=0.051)]
    seconds, lines = [left], []
    asked, measure = looks(seconds, {1: again})
    assert look_again(curve, measure, seconds_left=lambda: seconds[0], log=lines.append) == curve
    assert asked == ([] if left < 1 else [1])
    assert ("raise calibration.time_budget" in lines[0]) == (left < 1)


def test_an_undisturbed_curve_is_not_measured_again() -> None:
    curve = [pt(1, 100, step=0.05), pt(2, 100, step=0.09)]
    asked, measure = looks([10.0], {})
    assert look_again(curve, measure, seconds_left=lambda: 10.0) == curve and asked == []


# --- real runs on a tiny model -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama (config.json + model.safetensors, no tokenizer: the bench needs none)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    path = tmp_path_factory.mktemp("tiny-llama")
    config: dict[str, Any] = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256,
        "tie_word_embeddings": True,
    }
    model = Model(ModelArgs(**config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_bench(*args: str, budget: float, one_time: float = 600) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "worker.bench", *args, "--time-budget", str(budget), "--one-time-budget", str(one_time)],
        capture_output=True, text=True, env=env, cwd=REPO,
        timeout=budget + one_time + 120,  # a hang guard only; the contract check is the bench's own `seconds`
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be ONE JSON line, got {proc.stdout!r}; stderr: {proc.stderr[-2000:]}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def check_contract(result: dict[str, Any], *, max_batch: int, budget: float) -> None:
    assert set(result) >= KEYS, result
    curve = result["curve"]
    assert curve and all(set(p) >= POINT_KEYS for p in curve)
    batches = [p["batch"] for p in curve]
    assert batches[0] == 1
    assert batches == [min(2**i, max_batch) for i in range(len(batches))]  # 1, 2, 4, ... then max_batch
    assert all(p["tokens_per_s"] > 0 and p["step_time_s"] > 0 and p["peak_memory"] > 0 for p in curve)
    for p in curve:
        assert p["tokens_per_s"] == pytest.approx(p["batch"] * result["seq_len"] / p["step_time_s"], rel=1e-3)
    best = max(curve, key=lambda p: p["tokens_per_s"])
    assert (result["best_batch"], result["best_tokens_per_s"]) == (best["batch"], best["tokens_per_s"])
    assert result["stopped_because"] in STOP_REASONS
    rates = [p["tokens_per_s"] for p in curve]

    def knee_after(i: int) -> bool:  # two low points in a row against the best up to point i
        return i >= 1 and all(rates[j] < 0.97 * max(rates[: i + 1]) for j in (i - 1, i))

    if result["stopped_because"] == "throughput_fell":
        assert knee_after(len(rates) - 1) or (batches[-1] == max_batch and rates[-1] < 0.97 * max(rates))
    assert not any(knee_after(i) for i in range(len(rates) - 1))  # it would have stopped earlier
    if result["stopped_because"] == "max_batch":
        assert batches[-1] == max_batch
    assert result["matmul_gflops"] > 0
    assert result["memory_limit"] > 0 and result["device"]["backend"] in ("cpu", "gpu")
    assert 0 < result["measure_s"] <= budget + SLACK_S  # the budget bounds the timed steps ...
    one_time = result["one_time_s"]
    assert set(one_time) >= {"import", "matmul", "load", "first_steps"}  # ... the one-time costs are apart
    assert sorted(int(b) for b in one_time["first_steps"]) == batches
    assert result["seconds"] >= result["measure_s"] + result["one_time_total_s"] - SLACK_S


def test_bench_times_the_runs_step_on_the_runs_batches(tmp_path: Path) -> None:
    """With --data the bench builds the run's batches (the smoke rows, packed as the run packs them) and reports
    real tokens: fewer per row than seq_len, and what the coordinator turns into the plan's rows x seq_len."""
    from coordinator.run.calibrate import calibration_from_bench
    from worker.tinymodel import build_tiny_model

    smoke = REPO / "playbooks" / "data" / "smoke"
    model = build_tiny_model(tmp_path / "model", smoke)
    code, result, stderr = run_bench("--model", str(model), "--seq-len", "128", "--method", "lora", "--num-layers",
                                     "-1", "--data", str(smoke), "--global-batch", "8", "--max-batch", "4", budget=30)
    assert code == 0, stderr
    assert result["packing"][0] is True and result["packing"][1].startswith("packed into sequences of")
    for p in result["curve"]:
        assert 0 < p["tokens_per_row"] < 128  # the smoke rows are short: real tokens, not padded positions
        assert p["sampled_steps"] >= 1 and 1 <= p["timed_shapes"] <= p["shapes"]
        # The evidence: one entry per timed shape and per sampled step, the steps' median rate is the point's.
        assert len(p["shape_times"]) == p["timed_shapes"] and len(p["sample"]) == p["sampled_steps"]
        assert all(t > 0 and n >= 1 for _, t, n in p["shape_times"])
        rates = [tokens / t for _, tokens, t in p["sample"]]
        assert p["tokens_per_s"] == pytest.approx(statistics.median(rates), rel=1e-3)
        # The point's rate is the run's median step rate, its step the mean: the two agree within the spread of
        # the steps' fill.
        assert p["tokens_per_s"] == pytest.approx(p["rows_per_s"] * p["tokens_per_row"], rel=0.5)
    cal = calibration_from_bench("n", result)
    assert 0 < cal.fill < 1 and cal.fill == pytest.approx(result["tokens_per_row"] / 128, abs=1e-3)
    assert cal.curve[0].tokens_per_s == pytest.approx(result["curve"][0]["tokens_per_s"] / cal.fill)
    assert "first steps" in stderr


def test_bench_lora_sweep(tiny_model: Path) -> None:
    code, result, stderr = run_bench("--model", str(tiny_model), "--seq-len", "32", "--method", "lora",
                                     "--num-layers", "-1", "--max-batch", "8", budget=60)
    # A generous budget: on a loaded 2-core CI box importing mlx-lm alone can take seconds.
    assert code == 0, stderr
    check_contract(result, max_batch=8, budget=60)
    assert (result["seq_len"], result["method"], result["num_layers"]) == (32, "lora", -1)
    assert "bench batch=1 tokens_per_s=" in stderr  # progress goes to stderr


def test_bench_full_with_grad_checkpoint_stops_on_memory(tiny_model: Path) -> None:
    # A memory budget of a few KiB: batch 1 already uses more, so the next batch is predicted over the limit.
    code, result, stderr = run_bench("--model", str(tiny_model), "--seq-len", "16", "--method", "full",
                                     "--num-layers", "1", "--grad-checkpoint", "--memory-fraction", "1e-7",
                                     budget=60)
    assert code == 0, stderr
    check_contract(result, max_batch=64, budget=60)
    assert result["stopped_because"] == "memory"
    assert [p["batch"] for p in result["curve"]] == [1]


def test_bench_one_time_budget_spent_before_any_point(tiny_model: Path) -> None:
    # Importing mlx-lm and loading the model take longer than this: the watchdog answers, within the allowance,
    # saying which allowance ran out, during what, and what to set.
    code, result, _ = run_bench("--model", str(tiny_model), "--seq-len", "32", "--method", "lora",
                                "--num-layers", "-1", budget=60, one_time=0.3)
    assert code == 1
    assert result["seconds"] <= 0.3 + SLACK_S
    assert "calibration.one_time_budget of 0.3s, spent while" in result["error"]
    assert "raise calibration.one_time_budget" in result["error"]


def test_bench_measuring_budget_is_not_spent_by_one_time_costs(tiny_model: Path) -> None:
    # 1 s of timed steps: importing mlx and compiling take longer than that on a cold machine, yet a point is
    # measured, because they are charged to the one-time allowance.
    code, result, stderr = run_bench("--model", str(tiny_model), "--seq-len", "16", "--method", "lora",
                                     "--num-layers", "-1", "--max-batch", "2", budget=1)
    assert code == 0, stderr
    assert result["curve"] and result["curve"][0]["batch"] == 1
    assert result["measure_s"] <= 1 + SLACK_S
    assert "first step" in stderr and "one-time" in stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "/nonexistent/model", "--seq-len", "32", "--method", "lora"], "no model at /nonexistent/model"),
    (["--model", "/x", "--seq-len", "32", "--method", "qlora"], "bad arguments"),
    (["--model", "/x", "--seq-len", "32", "--method", "lora", "--memory-fraction", "2"], "--memory-fraction"),
])
def test_bench_errors_are_json(args: list[str], message: str) -> None:
    code, result, _ = run_bench(*args, budget=10)
    assert code == 1
    assert message in result["error"]


def test_bench_too_many_layers_is_an_error(tiny_model: Path) -> None:
    code, result, _ = run_bench("--model", str(tiny_model), "--seq-len", "32", "--method", "lora", budget=10)
    assert code == 1
    assert result["error"] == "--num-layers 16 but the model only has 2 layers"


# --- coordinator.run.calibrate over a real LocalTransport ------------------------------------------------------------

def test_calibrate_runs_the_bench_and_caches(tiny_model: Path, tmp_path: Path) -> None:
    node = Node(name="local", host="localhost", connection=Connection.LOCAL, python=sys.executable,
                workdir=str(tmp_path / "work"))
    ghost = Node(name="ghost", host="localhost", connection=Connection.LOCAL, python="/nonexistent/python",
                 workdir=str(tmp_path / "work"))
    spec = BenchSpec(model=str(tiny_model), seq_len=32, method="lora", num_layers=-1, max_batch=4)
    fingerprint = NodeFingerprint(chip="test", model_id=None, memory_bytes=1, cpu_count=2, gpu_cores=None,
                                  os_version="linux", mlx_version="0.32.4")
    cache = tmp_path / "cache"
    lines: list[tuple[str, str]] = []

    async def go(nodes: list[Node], recalibrate: bool) -> dict[str, Any]:
        async with Fleet(nodes) as fleet:
            await fleet.connect_all()
            return await calibrate(fleet, spec, fingerprints={"local": fingerprint, "ghost": fingerprint},
                                   model_digest="tiny", recalibrate=recalibrate, cache_dir=cache, time_budget=60,
                                   progress=lambda n, line: lines.append((n, line)))

    first = asyncio.run(go([node, ghost], False))
    assert list(first) == ["local", "ghost"]
    calibration = first["local"]
    assert isinstance(calibration, NodeCalibration), calibration
    assert not calibration.cached and calibration.seq_len == 32
    assert not isinstance(first["ghost"], NodeCalibration)  # its failure is its result
    assert "ghost" in str(first["ghost"])
    assert any(n == "local" and line.startswith("bench batch=1") for n, line in lines)
    assert len(list(cache.glob("calibration-*.json"))) == 1

    again = asyncio.run(go([node], False))["local"]
    assert isinstance(again, NodeCalibration) and again.cached and again.curve == calibration.curve

    plan = compute_plan([calibration], 4, seq_len=32)
    assert plan.batch == {"local": 4}


@pytest.mark.parametrize(("times", "expected"), [
    ([0.5], 0.5), ([0.9, 0.5, 0.7], 0.7), ([0.9, 0.5, 0.7, 0.6], pytest.approx(0.65)), ([5, 1, 2, 3, 4], 3),
    (list(range(20, 0, -1)), 10.5),
])
def test_a_shapes_time_is_the_median_of_its_steps_as_the_run_is_held_to_its_median(times: list[float],
                                                                                    expected: float) -> None:
    assert shape_seconds(times) == expected


# --- the first step's heartbeat: a cold compile never looks hung --------------------------------------------------


def test_ticker_says_a_long_first_step_is_still_running_every_interval() -> None:
    from worker.bench import Ticker

    now = [100.0]
    lines: list[str] = []
    ticker = Ticker("bench batch=1 first step", lines.append, lambda: now[0], every=10.0)
    for t in (100.5, 105.0, 109.9):
        now[0] = t
        ticker.poll()
    assert lines == []  # nothing before the first interval
    now[0] = 110.0
    ticker.poll()
    ticker.poll()  # polled twice at one moment: one line
    assert lines == ["bench batch=1 first step: still running, 10s"]
    now[0] = 135.0  # the poller was late: one line now, the next a full interval later
    ticker.poll()
    now[0] = 144.0
    ticker.poll()
    now[0] = 145.0
    ticker.poll()
    assert lines[1:] == ["bench batch=1 first step: still running, 35s", "bench batch=1 first step: still running, 45s"]


def test_heartbeat_lines_come_while_the_first_step_runs() -> None:
    """`ticking` polls from a thread while the (scripted) compiling step blocks: the step moves the driven clock
    on 10 s at a time and waits for each heartbeat line before going on, so every line is emitted during the step,
    at least every interval of its time."""
    from worker.bench import Ticker, ticking

    now = [0.0]
    lines: list[str] = []
    arrived = threading.Condition()

    def log(line: str) -> None:
        with arrived:
            lines.append(line)
            arrived.notify_all()

    ticker = Ticker("bench batch=1 first step", log, lambda: now[0], every=10.0)

    def long_first_step() -> str:
        for beat in range(1, 4):
            with arrived:
                now[0] = 10.0 * beat  # ten more seconds of compiling (driven time)
                # A hang guard, not a timing claim: the line for this moment comes while the step still runs.
                assert arrived.wait_for(lambda: len(lines) == beat, timeout=60), lines  # noqa: B023
        return "stepped"

    assert ticking(ticker, long_first_step, poll_s=0.001) == "stepped"
    assert lines == [f"bench batch=1 first step: still running, {s}s" for s in (10, 20, 30)]


def test_first_step_announcement_names_the_cold_kernel_cache(tmp_path: Path) -> None:
    from worker.bench import describe_first_step
    from worker.kernelcache import shared_dir

    cache = shared_dir("0.32.4", {"TMPDIR": str(tmp_path)})
    assert cache == tmp_path / "mlx" / "0.32.4"
    cold = describe_first_step(1, cache, cold=True)
    assert "compiling MLX's kernels" in cold and str(cache) in cold and "one-time" in cold
    assert "one-time" in describe_first_step(4, cache, cold=False)


def test_nodes_of_one_machine_are_calibrated_together_in_lockstep(tiny_model: Path, tmp_path: Path) -> None:
    """The local demo's shape: two `connection: local` nodes. Their benches run in lockstep over the real
    LocalTransport (each waits on stdin, the coordinator releases both), both sweep the same batches, and being
    interchangeable they come back with one curve: the even split, every time. Computing on this Linux machine's
    CPU, each bench takes its own slice of the CPUs first, as their ranks will (`colocate.cpu_shares`)."""
    from dataclasses import replace

    from coordinator.facts.model import NodeFacts, OsInfo
    from coordinator.planning.colocate import compute_bench_groups

    nodes = [Node(name=n, host="127.0.0.1", connection=Connection.LOCAL, python=sys.executable,
                  workdir=str(tmp_path / n)) for n in ("a", "b")]
    spec = BenchSpec(model=str(tiny_model), seq_len=32, method="lora", num_layers=-1, max_batch=2)
    fingerprint = NodeFingerprint(chip="test", model_id=None, memory_bytes=1, cpu_count=2, gpu_cores=None,
                                  os_version="linux", mlx_version="0.32.4")
    lines: list[tuple[str, str]] = []

    async def go() -> dict[str, Any]:
        async with Fleet(nodes) as fleet:
            await fleet.connect_all()
            return await calibrate(fleet, spec, fingerprints={"a": fingerprint, "b": fingerprint}, model_digest="tiny",
                                   recalibrate=False, cache_dir=tmp_path / "cache", time_budget=10,
                                   progress=lambda n, line: lines.append((n, line)),
                                   groups=compute_bench_groups(nodes, facts))

    facts = {n.name: replace(NodeFacts(node=n.name), os=OsInfo(system="Linux", arch="x86_64", kernel="6", name="l",
                                                               version="1")) for n in nodes}

    result = asyncio.run(go())
    a, b = result["a"], result["b"]
    assert isinstance(a, NodeCalibration) and isinstance(b, NodeCalibration), result
    assert a.curve == b.curve and [p.batch for p in a.curve] == [1, 2]
    assert compute_plan([a, b], 4, seq_len=32).batch == {"a": 2, "b": 2}
    assert any(n == "a" and "together with b" in line and "on CPU slice 1 of 2" in line for n, line in lines)
    assert any(n == "b" and "on CPU slice 2 of 2" in line for n, line in lines)
    assert not any("lockstep" in line and line.startswith("bench lockstep") for _, line in lines)  # the gate's own
    records = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("calibration-*.json")]
    assert len(records) == 2
    pinned = {r["node"]: r["bench"].get("cpus") for r in records}
    if len(os.sched_getaffinity(0)) >= 2:  # each bench on its own CPUs, as the run's ranks
        assert pinned["a"] and pinned["b"] and not set(pinned["a"]) & set(pinned["b"])


def test_a_point_times_its_share_of_the_budget() -> None:
    from worker.bench import point_window, sweep_points

    assert [sweep_points(m) for m in (1, 2, 4, 16, 24, 64)] == [1, 2, 3, 5, 6, 7]
    # The time left shared over the points left and one share for a noisy point's second window.
    assert point_window(10.0, 10.0, 1, 4) == pytest.approx(10 / 4)  # 3 points to go: batch 1, 2, 4
    assert point_window(10.0, 6.0, 4, 4) == pytest.approx(6 / 2)  # the last point gets what the others left
    assert point_window(60.0, 60.0, 1, 64) == pytest.approx(60 / 8)
    assert point_window(60.0, 30.0, 16, 24) == pytest.approx(30 / 3)  # 16 and 24 left
    assert point_window(60.0, 60.0, 1, 4096) == pytest.approx(60 / 14)
    assert point_window(60.0, 1.0, 2, 64) == 3.0  # 5% of the budget at least
    assert point_window(2.0, 1.0, 1, 64) == 0.5


def test_the_bench_readies_its_optimizer_as_the_run_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration's trainer and the run's strategies start their steps from one set-up: the optimizer over the
    model's trainable parameters, state and parameters evaluated (`worker.modelsetup.ready_optimizer`). On an H100
    a bench that skipped the evaluation took every step 13% slower than the run's rank did."""
    from worker import bench, modelsetup
    from worker.parallel import dp
    from worker.tinymodel import build_tiny_model

    readied: list[Any] = []
    real = modelsetup.ready_optimizer

    def recording(model: Any, name: str, learning_rate: float) -> Any:
        readied.append(model)
        return real(model, name, learning_rate)

    monkeypatch.setattr(modelsetup, "ready_optimizer", recording)
    smoke = REPO / "playbooks" / "data" / "smoke"
    model = build_tiny_model(tmp_path / "model", smoke)
    trainer = bench._Trainer(bench._parse_args(["--model", str(model), "--seq-len", "64", "--method", "lora",
                                                "--num-layers", "-1", "--data", str(smoke), "--global-batch", "4",
                                                "--max-batch", "4"]))
    assert readied == [trainer.model]
    assert trainer.step(4, 0)[0] > 0
    assert dp.ready_optimizer is real  # the run's data-parallel strategy imports the same function


# --- one point against a scripted trainer ------------------------------------------------------------------------

class ScriptedTrainer:
    """What `_measure` asks of a trainer, with every slice one packed shape (as short rows fold into one row at
    batches 1 and 2) and a step that compiles (5 s) the first time this process meets a shape, 0.01 s after."""

    def __init__(self, clock: list[float], rows: int, global_batch: int, steps: int) -> None:
        self.clock, self.dataset, self.global_batch, self.horizon = clock, list(range(rows)), global_batch, steps
        self.world = 1
        self.mx = self  # the point asks mx for its cache and peak memory
        self.compiled: set[Any] = set()

    def clear_cache(self) -> None: ...
    def reset_peak_memory(self) -> None: ...
    def get_peak_memory(self) -> int: return 1 << 20

    def slice_of(self, rows: int, position: int) -> tuple[Any, int]:
        return ((1, 32),), 10 * rows

    def step(self, rows: int, position: int) -> tuple[float, int]:
        shape = self.slice_of(rows, position)[0]
        elapsed = 0.01 if shape in self.compiled else 5.0
        self.compiled.add(shape)
        self.clock[0] += elapsed
        return elapsed, 10 * rows


def test_a_shape_an_earlier_point_compiled_still_costs_the_runs_first_step() -> None:
    clock = [0.0]
    state = _State(started=0.0, curve=[], budget=Budget(one_time_s=100, measure_s=100, clock=lambda: clock[0]))
    trainer = ScriptedTrainer(clock, rows=8, global_batch=2, steps=2)  # a 2-step run: its first step compiles
    one, _ = _measure(trainer, 1, state, window=0.1)  # type: ignore[arg-type]
    two, _ = _measure(trainer, 2, state, window=0.1)  # type: ignore[arg-type]
    assert one is not None and two is not None
    # The run at either batch is a fresh process: its first step compiles, its second does not.
    assert [d for _, _, d in one.sample] == [5.0, 0.01]
    assert [d for _, _, d in two.sample] == [5.0, 0.01]
    assert two.warmup_s == 0.01  # what this process paid: the one-time accounting stays true
