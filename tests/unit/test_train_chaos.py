"""Fault injection (run.json `chaos`), local step values and replica digests of worker.train.

In-process (fast): the config contract, the pure helpers of worker.chaos, the digest encoding, a heartbeat
during a long hash, and single-rank Trainer runs. End to end: real mlx.launch ring runs on 127.0.0.1 (the
helpers of test_train_distributed), each started once by a module fixture (about a minute on 2 cores):

    byz   3 ranks; rank 1 lies from step 2 and is slow (factor 10) from step 2; rank 2 diverges at step 3;
          digests every 2 steps. Everyone finishes.
    nan   2 ranks; rank 1's local loss is NaN at step 3.
    kill  2 ranks; rank 1 SIGKILLs itself at the start of step 3.
    hang  2 ranks; rank 1 SIGSTOPs itself at the start of step 3: observed live, then the group is killed.

Every launch's process group is killed when it is over and its mktemp files live in a private TMPDIR; the
module ends by checking that no worker.train of its own is left and that it left no /tmp/tmp.* behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.unit.test_train_distributed import (
    PYTHON,
    SMOKE,
    Launch,
    finish_launch,
    kinds,
    read_events,
    require_finished,
    start_launch,
    write_config,
)
from tests.unit.test_train_unit import EXAMPLE, load_tiny, run_in_process
from worker import chaos
from worker.chaos import (
    LIE_FACTOR,
    LIE_STEP_OFFSET,
    RankChaos,
    arrays_sha256,
    lie_about,
    perturb,
    replica_digest,
)
from worker.comm import scalar
from worker.events import EventLog, Heartbeat
from worker.follow import process_state
from worker.modelsetup import apply_method
from worker.runconfig import ChaosSpec, ConfigError, LoraSpec, parse_run_config
from worker.step import flatten
from worker.tinymodel import build_tiny_model
from worker.train import TrainingError

HEARTBEAT_S = 0.3
BASE: dict[str, Any] = {
    "data": str(SMOKE), "max_seq_length": 64, "val_batches": 2, "seed": 0, "heartbeat_s": HEARTBEAT_S,
    "method": "lora", "optimizer": "adam", "learning_rate": 5e-3, "save_every": 0, "steps_per_eval": 0,
    "lora": {"rank": 4, "scale": 20.0, "dropout": 0.0}, "consistency_every": 2,
}
SLOW_FACTOR = 10.0
# Generous: on a 2-core box shared with other work, starting 3 ranks (imports, ring, model) can take a minute.
LAUNCH_TIMEOUT = 300.0
ADAM: dict[str, Any] = {"optimizer": "adam", "learning_rate": 1e-3}  # in-process runs: run_in_process's SGD lr 0.5
#                                                                    is meant for one step only


# --- config contract ---------------------------------------------------------------------------------------------


def test_consistency_and_chaos_defaults_and_parsing() -> None:
    cfg = parse_run_config(EXAMPLE)
    assert cfg.consistency_every == 50 and cfg.chaos == ()
    cfg = parse_run_config({**EXAMPLE, "consistency_every": 0, "chaos": [
        {"kind": "slow", "rank": 1}, {"kind": "kill", "rank": 0, "step": 7, "factor": 1}]})
    assert cfg.consistency_every == 0
    assert cfg.chaos == (ChaosSpec("slow", 1, 1, 3.0), ChaosSpec("kill", 0, 7, 1.0))
    # neither changes the training math: a resume under them continues the same experiment
    assert cfg.digest() == parse_run_config(EXAMPLE).digest()


@pytest.mark.parametrize(("patch", "message"), [
    ({"consistency_every": -1}, "consistency_every must be >= 0"),
    ({"consistency_every": 2.5}, "consistency_every must be an integer"),
    ({"chaos": {"kind": "kill", "rank": 0}}, "chaos must be a list"),
    ({"chaos": ["kill"]}, r"chaos\[0\] must be an object"),
    ({"chaos": [{"kind": "explode", "rank": 0}]}, r"chaos\[0\]\.kind must be one of kill, hang, nan"),
    ({"chaos": [{"kind": "kill"}]}, r"chaos\[0\]\.rank must be an integer"),
    ({"chaos": [{"kind": "kill", "rank": 2}]}, r"chaos\[0\]\.rank 2 is not a rank of the plan \(0\.\.1\)"),
    ({"chaos": [{"kind": "kill", "rank": 0, "step": 0}]}, r"chaos\[0\]\.step must be >= 1"),
    ({"chaos": [{"kind": "slow", "rank": 0, "factor": 0.5}]}, r"chaos\[0\]\.factor must be >= 1"),
    ({"chaos": [{"kind": "slow", "rank": 0, "factor": "3"}]}, r"chaos\[0\]\.factor must be a number"),
    ({"chaos": [{"kind": "lie", "rank": 0, "when": 3}]}, r"chaos\[0\]: unknown keys \['when'\]"),
])
def test_bad_consistency_and_chaos_configs_are_rejected(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_config({**EXAMPLE, **patch})


# --- pure helpers --------------------------------------------------------------------------------------------------


def test_rank_chaos_acts_only_on_its_rank_and_from_its_step() -> None:
    specs = [ChaosSpec("kill", 1, 5), ChaosSpec("hang", 1, 5), ChaosSpec("hang", 1, 6), ChaosSpec("nan", 0, 2),
             ChaosSpec("diverge", 1, 3), ChaosSpec("lie", 1, 4), ChaosSpec("slow", 1, 2, 3.0),
             ChaosSpec("slow", 1, 4, 5.0)]
    mine, other = RankChaos.for_rank(specs, 1), RankChaos.for_rank(specs, 2)
    assert mine.signal_at(5) == signal.SIGKILL and mine.signal_at(6) == signal.SIGSTOP  # kill wins at 5
    assert mine.signal_at(4) is None and not mine.poisons(2) and RankChaos.for_rank(specs, 0).poisons(2)
    assert [s for s in range(1, 8) if mine.diverges(s)] == [3]
    assert [s for s in range(1, 8) if mine.lies(s)] == [4, 5, 6, 7]
    assert [mine.slow_factor(s) for s in range(1, 6)] == [1.0, 3.0, 3.0, 5.0, 5.0]
    assert other == RankChaos() and other.slow_factor(9) == 1.0 and other.signal_at(5) is None


def test_lie_inflates_only_the_progress_fields() -> None:
    record = {"step": 7, "tokens": 30, "tok_s": 12.5, "compute_tok_s": None, "loss": 1.5, "total_tokens": 50}
    lied = lie_about(record)
    assert lied == {"step": 7 + LIE_STEP_OFFSET, "tokens": 30 * LIE_FACTOR, "tok_s": 12.5 * LIE_FACTOR,
                    "compute_tok_s": None, "loss": 1.5, "total_tokens": 50}
    assert record["step"] == 7  # a copy


def test_digest_encoding_is_canonical() -> None:
    a = mx.array([1, 2], mx.int32)
    want = hashlib.sha256(b"a\0int32\x002\0" + (8).to_bytes(8, "little") + (1).to_bytes(4, "little")
                          + (2).to_bytes(4, "little")).hexdigest()
    assert arrays_sha256({"a": a}) == want  # pins the documented encoding
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    tree = {"x": x, "s": mx.array(2.0, mx.bfloat16), "e": mx.zeros((0, 4))}
    base = arrays_sha256(tree)
    assert arrays_sha256(dict(reversed(list(tree.items())))) == base  # insertion order does not matter
    assert arrays_sha256({**tree, "x": mx.contiguous(x.T).T}) == base  # a column-major copy hashes the same
    row = mx.array([0.0, 1.0, 2.0])
    assert arrays_sha256({"r": mx.broadcast_to(row, (2, 3))}) == arrays_sha256({"r": mx.array([[0.0, 1, 2]] * 2)})  # stride 0
    assert arrays_sha256({**tree, "x": x.reshape(3, 2)}) != base  # shape is part of it
    assert arrays_sha256({**tree, "x": x.view(mx.int32)}) != base  # so is dtype (same bytes)
    assert arrays_sha256({**tree, "y": tree.pop("x")}) != base  # and the name
    assert arrays_sha256({**tree, "x": x.at[1, 2].add(1e-6)}) != base  # one element, a tiny change


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_replica_digest_encoding_is_the_documented_one() -> None:
    """Written from the module docstring alone, in plain integers: pins the contract both sums must keep."""
    words = [1, 0xFFFFFFFE, 7]  # int32 [1, -2, 7]
    total = sum(_fmix32(u ^ ((j * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF)) for j, u in enumerate(words)) & 0xFFFFFFFF
    want = hashlib.sha256(b"a\0int32\x003\0" + (3).to_bytes(8, "little") + total.to_bytes(4, "little")).hexdigest()
    a = mx.array([1, -2, 7], mx.int32)
    assert replica_digest({"a": a}, on_device=False) == want
    assert replica_digest({"a": a}, on_device=True) == want
    # an 8-byte element is two words, low then high
    w = [7, 0, 0, 256]  # int64 [7, 2**40]
    total = sum(_fmix32(u ^ ((j * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF)) for j, u in enumerate(w)) & 0xFFFFFFFF
    want = hashlib.sha256(b"b\0int64\x002\0" + (4).to_bytes(8, "little") + total.to_bytes(4, "little")).hexdigest()
    assert replica_digest({"b": mx.array([7, 2**40], mx.int64)}, on_device=False) == want


@pytest.mark.parametrize("chunk", [5, 1 << 22])
def test_replica_digest_is_the_same_summed_by_mlx_or_by_numpy(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dtype a model or optimizer holds, strided and broadcast views, scalars and empty arrays, and arrays
    across chunk boundaries: the device's sums (MLX, here on the CPU) equal the host's (numpy)."""
    monkeypatch.setattr(chaos, "CHUNK_WORDS", chunk)
    monkeypatch.setattr(chaos, "HOST_CHUNK_WORDS", chunk)
    key = mx.random.key(3)
    tree = {
        "f32": mx.random.normal((37, 11), key=key), "bf16": mx.random.normal((101,), key=key).astype(mx.bfloat16),
        "f16": mx.random.normal((13,), key=key).astype(mx.float16), "i8": mx.array([1, -2, 3], mx.int8),
        "u8": mx.array([0, 255], mx.uint8), "bool": mx.array([True, False, True]),
        "i64": mx.array([7, -(2**40)], mx.int64), "u64": mx.array(5, mx.uint64), "u32": mx.array([2**32 - 1], mx.uint32),
        "scalar": mx.array(2.5), "empty": mx.zeros((0, 3)), "t": mx.random.normal((5, 7), key=key).T,
        "bcast": mx.broadcast_to(mx.array([1.0, 2.0]), (3, 2)),
    }
    assert replica_digest(tree, on_device=True) == replica_digest(tree, on_device=False) == replica_digest(tree)


def test_a_device_that_cannot_sum_falls_back_to_the_same_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = {"w": mx.arange(10, dtype=mx.float32)}
    want = replica_digest(tree, on_device=False)

    def unsupported(arrays: object) -> object:
        raise ValueError("[right_shift] not supported on this backend")

    monkeypatch.setattr(chaos, "_sums_mx", unsupported)
    with pytest.warns(RuntimeWarning, match="summed on the host"):
        assert replica_digest(tree, on_device=True) == want


def test_replica_digest_sees_what_a_replica_drift_changes() -> None:
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    tree = {"x": x, "s": mx.array(2.0, mx.bfloat16), "e": mx.zeros((0, 4))}
    for on_device in (False, True):
        def digest(t: dict[str, mx.array], on_device: bool = on_device) -> str:
            return replica_digest(t, on_device=on_device)

        base = digest(tree)
        assert digest(dict(reversed(list(tree.items())))) == base  # insertion order does not matter
        assert digest({**tree, "x": mx.contiguous(x.T).T}) == base  # nor the layout
        assert digest({**tree, "x": x.reshape(3, 2)}) != base  # shape is part of it
        assert digest({**tree, "x": x.view(mx.int32)}) != base  # so is dtype (same bytes)
        assert digest({("y" if k == "x" else k): v for k, v in tree.items()}) != base  # and the name
        assert digest({**tree, "x": x.at[1, 2].add(1e-6)}) != base  # one element, a tiny change
        assert digest({**tree, "x": -x}) != base  # sign bits only (a plain sum of odd multiples misses pairs)
        assert digest({**tree, "x": mx.array([[0.0, 1, 2], [3, 5, 4]])}) != base  # two elements swapped
        assert digest({**tree, "x": x.at[0, 1].add(1.0).at[0, 2].add(-1.0)}) != base  # changes summing to 0


def test_perturb_is_seeded_leaves_ints_and_the_global_rng_alone() -> None:
    params = {"w": mx.zeros((64, 64)), "b": mx.ones((64,), mx.bfloat16), "q": mx.zeros((8,), mx.uint32)}
    mx.random.seed(11)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(11)
    noisy = perturb(params)
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected)  # explicit keys: global state untouched
    again = perturb(params)
    assert all(mx.array_equal(noisy[k], again[k]) for k in params)
    std = math.sqrt(scalar(mx.mean(noisy["w"] ** 2)))
    assert 0.5e-2 < std < 2e-2 and noisy["b"].dtype == mx.bfloat16
    assert mx.array_equal(noisy["q"], params["q"])


def test_heartbeat_keeps_beating_while_a_big_state_is_hashed(tmp_path: Path) -> None:
    arrays = {f"w{i}": mx.full((4096, 4096), float(i)) for i in range(4)}  # 256 MiB, cheap to make
    mx.eval(list(arrays.values()))
    log = EventLog(tmp_path / "rank0.jsonl", "hb", 0)
    hb = Heartbeat(log, 0.05)
    hb.start()
    try:
        time.sleep(0.2)
        tic = time.time()
        arrays_sha256(arrays)
        toc = time.time()
    finally:
        hb.stop()
        log.close()
    beats = [e["t"] for e in map(json.loads, (tmp_path / "rank0.jsonl").read_text().splitlines())]
    during = [t for t in beats if tic <= t <= toc]
    # hashlib releases the GIL on large buffers: the beat thread gets at least a third of its beats in
    expected = (toc - tic) / 0.05
    assert len(during) >= max(1, int(expected / 3)), (len(during), round(toc - tic, 3))


# --- in-process Trainer runs (world of 1) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SMOKE)


def events_of(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return kinds(read_events(run_dir, 0), kind)


def test_local_values_and_digests_in_one_rank(tiny: Path, tmp_path: Path) -> None:
    adam = {**ADAM, "iters": 3, "consistency_every": 2}
    run_in_process(tiny, tmp_path / "a", **adam)
    run_in_process(tiny, tmp_path / "b", **adam)
    run_in_process(tiny, tmp_path / "d", **adam, chaos=[{"kind": "diverge", "rank": 0, "step": 2}])
    steps = events_of(tmp_path / "a", "step")
    for e in steps:  # one rank: its own values are the global ones
        assert e["local_loss"] == pytest.approx(e["loss"], rel=1e-6) and e["local_loss_finite"] is True
        assert e["local_grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4)
        assert 0 < e["compute_s"] <= e["step_time_s"] and e["compute_tok_s"] == pytest.approx(
            e["tokens"] / e["compute_s"])
    # The first step traces and compiles its batch shape: its event says so (the run's rate leaves it out).
    assert steps[0]["new_shape"] is True and all(isinstance(e["new_shape"], bool) for e in steps)
    a, b, d = (events_of(tmp_path / n, "digest") for n in "abd")
    assert [e["step"] for e in a] == [2, 3]  # every 2 steps and the last
    assert [(e["params_sha256"], e["optimizer_sha256"]) for e in a] == \
        [(e["params_sha256"], e["optimizer_sha256"]) for e in b]  # deterministic
    # diverge at 2 moves the weights after the update: the optimizer state of step 2 is still the same
    assert d[0]["params_sha256"] != a[0]["params_sha256"] and d[0]["optimizer_sha256"] == a[0]["optimizer_sha256"]
    assert len({e["params_sha256"] for e in a}) == 2
    # What each digest cost, which no step's time holds: the hashing's own seconds.
    assert all(isinstance(e["digest_s"], float) and e["digest_s"] > 0 for e in a + b + d)


def test_no_digests_when_consistency_is_off_and_lie_in_one_rank(tiny: Path, tmp_path: Path) -> None:
    run_in_process(tiny, tmp_path, **ADAM, iters=3, consistency_every=0, chaos=[{"kind": "lie", "rank": 0, "step": 2}])
    assert not events_of(tmp_path, "digest")
    steps = events_of(tmp_path, "step")
    assert [e["step"] for e in steps] == [1, 2 + LIE_STEP_OFFSET, 3 + LIE_STEP_OFFSET]
    assert steps[1]["tokens"] == LIE_FACTOR * steps[1]["total_tokens"]  # it alone holds all the tokens
    assert events_of(tmp_path, "finished")[0]["step"] == 3  # only step events lie


def test_nan_in_one_rank_reports_the_step_then_fails(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="loss is nan at step 2"):
        run_in_process(tiny, tmp_path, **ADAM, iters=3, chaos=[{"kind": "nan", "rank": 0, "step": 2}])
    steps = events_of(tmp_path, "step")
    assert [e["local_loss_finite"] for e in steps] == [True, False]
    assert steps[1]["local_loss"] is None and steps[1]["loss"] is None and steps[1]["local_grad_norm"] is None


def test_a_corrupted_frozen_weight_changes_the_params_digest(tiny: Path, tmp_path: Path) -> None:
    from worker.modelsetup import make_optimizer
    from worker.train import Trainer

    model, _ = load_tiny(tiny)
    apply_method(model, "lora", None, LoraSpec(rank=4))
    log = EventLog(tmp_path / "events.jsonl", "r", 0)
    log.close()
    trainer = Trainer(parse_run_config({**EXAMPLE, "run_dir": str(tmp_path)}), log, Heartbeat(log, 1.0), 0)
    trainer.model, trainer.optimizer = model, make_optimizer("adam", 1e-3)
    trainer.optimizer.init(model.trainable_parameters())
    before = trainer.digests()
    frozen = "model.layers.0.self_attn.q_proj.linear.weight"  # a LoRA base weight: frozen
    assert frozen in flatten(model.parameters()) and frozen not in flatten(model.trainable_parameters())
    w = flatten(model.parameters())[frozen]
    model.load_weights([(frozen, w.at[0, 0].add(1.0))], strict=False)
    after = trainer.digests()
    assert after["params_sha256"] != before["params_sha256"]
    assert after["optimizer_sha256"] == before["optimizer_sha256"]


# --- end to end over mlx.launch ----------------------------------------------------------------------------------


@dataclass
class Root:
    path: Path
    model: Path
    ports: list[tuple[int, int]]  # (starting port, ranks) of every launch, to recognise its hostfiles


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Root]:
    """The module's directory and model. Teardown: none of this module's ranks is left, and none of its
    mlx.launch mktemp files is in /tmp (they go to a private TMPDIR; a strayed one is removed and reported)."""
    before = set(Path("/tmp").glob("tmp.*"))
    path = tmp_path_factory.mktemp("chaos")
    r = Root(path, build_tiny_model(path / "model", SMOKE), [])
    yield r
    pattern = f"worker.train --config {path}/"
    left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False).stdout.split()
    strays = []
    for tmp in set(Path("/tmp").glob("tmp.*")) - before:
        with contextlib.suppress(OSError, ValueError):
            content = tmp.read_text().strip()
            if any(content == json.dumps([[f"127.0.0.1:{p + i}"] for i in range(n)]) for p, n in r.ports):
                strays.append(tmp)
                tmp.unlink()
    assert not left, f"worker.train processes left running: {left}"
    assert not strays, f"mlx.launch temporary files were left in /tmp: {strays}"


def start(root: Root, name: str, n: int, chaos: list[dict[str, Any]], iters: int = 8) -> tuple[Path, Launch]:
    run_dir = root.path / name
    cfg = write_config(run_dir / "run.json", **{**BASE, "iters": iters}, model=str(root.model), run_id=name,
                       run_dir=str(run_dir), chaos=chaos,
                       ranks=[{"rank": r, "node": "local", "batch_size": 2} for r in range(n)])
    run = start_launch(run_dir, [PYTHON, "-m", "worker.train", "--config", str(cfg)], n)
    root.ports.append((run.port, n))
    return run_dir, run


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = LAUNCH_TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            value = predicate()
            if value:
                return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def pid_of(run_dir: Path, rank: int) -> int:
    started = kinds(read_events(run_dir, rank), "started")
    return int(started[0]["pid"]) if started else 0


@dataclass
class Finished:
    run_dir: Path
    log: str

    def events(self, rank: int) -> list[dict[str, Any]]:
        return read_events(self.run_dir, rank)


@pytest.fixture(scope="module")
def byz(root: Root) -> Finished:
    run_dir, run = start(root, "byz", 3, iters=10, chaos=[
        {"kind": "lie", "rank": 1, "step": 2}, {"kind": "slow", "rank": 1, "step": 2, "factor": SLOW_FACTOR},
        {"kind": "diverge", "rank": 2, "step": 3}])
    return Finished(run_dir, finish_launch(run, LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def nan_run(root: Root) -> Finished:
    run_dir, run = start(root, "nan", 2, [{"kind": "nan", "rank": 1, "step": 3}])
    return Finished(run_dir, finish_launch(run, LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def kill_run(root: Root) -> Finished:
    run_dir, run = start(root, "kill", 2, [{"kind": "kill", "rank": 1, "step": 3}])
    return Finished(run_dir, finish_launch(run, LAUNCH_TIMEOUT))


@dataclass
class Hang:
    run_dir: Path
    pids: list[int]
    state_stopped: str | None  # rank 1, after it stopped itself
    beats_at_stop: list[int]  # heartbeat counts per rank when rank 1 was seen stopped ...
    beats_later: list[int]  # ... and 6 heartbeat intervals later
    last_beat_step: int  # rank 1's last heartbeat's step
    rank0_phase_later: str
    states_after_kill: list[str]


def beats(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return kinds(read_events(run_dir, rank), "heartbeat")


@pytest.fixture(scope="module")
def hang_run(root: Root) -> Hang:
    run_dir, run = start(root, "hang", 2, [{"kind": "hang", "rank": 1, "step": 3}])
    try:
        pids = [int(wait_for(f"rank {r} started", partial(pid_of, run_dir, r))) for r in (0, 1)]
        stopped = wait_for("rank 1 stopped", lambda: process_state(pids[1]) == "T")
        time.sleep(2 * HEARTBEAT_S)  # a beat written just before the stop has landed
        at_stop = [len(beats(run_dir, r)) for r in (0, 1)]
        time.sleep(6 * HEARTBEAT_S)
        later = [len(beats(run_dir, r)) for r in (0, 1)]
        state = process_state(pids[1]) if stopped else None
        last = beats(run_dir, 1)[-1]["step"]
        phase = beats(run_dir, 0)[-1]["phase"]
    finally:
        run.kill()  # SIGKILL reaches a stopped process; nothing of the group is left running
        finish_launch(run, timeout=10)
    # Killed ranks are gone, or zombies until whoever inherited them reaps them (that may be a container init).
    wait_for("the ranks to die", lambda: all(process_state(p) in (None, "Z") for p in pids), 30)
    after = [process_state(p) or "gone" for p in pids]
    return Hang(run_dir, pids, state, at_stop, later, last, phase, after)


def test_honest_replicas_report_identical_digests_and_a_diverged_one_differs(byz: Finished) -> None:
    for r in range(3):
        require_finished(byz.run_dir, [r], byz.log)
    digests = [{e["step"]: (e["params_sha256"], e["optimizer_sha256"]) for e in kinds(byz.events(r), "digest")}
               for r in range(3)]
    assert [sorted(d) for d in digests] == [[2, 4, 6, 8, 10]] * 3  # digest steps are never lied about
    assert digests[0][2] == digests[1][2] == digests[2][2]  # before rank 2 diverged at step 3
    for step in (4, 6, 8, 10):
        assert digests[0][step] == digests[1][step]  # rank 1 lies and is slow, but trains honestly
        assert digests[2][step][0] != digests[0][step][0], step  # rank 2's weights differ from step 3 on
    # the optimizer moments only see the (all_summed, identical) gradients: equal at the next digest
    assert digests[2][4][1] == digests[0][4][1]


def test_a_lying_rank_runs_ahead_in_its_reports_only(byz: Finished) -> None:
    honest, liar = kinds(byz.events(0), "step"), kinds(byz.events(1), "step")
    assert [e["step"] for e in honest] == list(range(1, 11))
    assert [e["step"] for e in liar] == [1] + [s + LIE_STEP_OFFSET for s in range(2, 11)]
    others = [kinds(byz.events(r), "step") for r in (0, 2)]
    for i, e in enumerate(liar):
        true_tokens = e["total_tokens"] - others[0][i]["tokens"] - others[1][i]["tokens"]
        assert e["tokens"] == (true_tokens if i == 0 else LIE_FACTOR * true_tokens)
        assert e["loss"] == honest[i]["loss"]  # it took part in every all_sum
    assert kinds(byz.events(1), "finished")[0]["step"] == 10


def test_a_slow_rank_is_a_real_straggler(byz: Finished) -> None:
    compute = {r: [e["compute_s"] for e in kinds(byz.events(r), "step")[1:]] for r in range(3)}
    ratio = statistics.median(compute[1]) / statistics.median(compute[0] + compute[2])
    # ~SLOW_FACTOR when the ranks compute alike; wide bounds because they do not here: 3 ranks share 2 cores, and
    # rank 1 computes alone while its peers wait in the all_sum, so its own (unslowed) compute can be 1/4 of theirs
    # (seen in CI: ratio 1.3 at factor 5). Without the slowdown the ratio is ~1.
    assert SLOW_FACTOR / 6 < ratio < SLOW_FACTOR * 4, (ratio, compute)
    # its peers waited for it in the collective: their step time covers its compute
    waits = [e["step_time_s"] for e in kinds(byz.events(0), "step")[1:]]
    assert statistics.median(waits) >= 0.8 * statistics.median(compute[1]), (waits, compute[1])


def test_a_nan_is_attributed_to_its_rank_before_everyone_errors(nan_run: Finished) -> None:
    for rank in (0, 1):
        events = nan_run.events(rank)
        steps = kinds(events, "step")
        assert [e["step"] for e in steps] == [1, 2, 3]
        bad = steps[-1]
        assert bad["loss"] is None and bad["local_loss_finite"] is (rank != 1)
        assert (bad["local_loss"] is None) is (rank == 1) and (bad["local_grad_norm"] is None) is (rank == 1)
        assert events[-1]["event"] == "error" and "loss is nan at step 3" in events[-1]["message"]
        assert events.index(bad) < len(events) - 1 and not kinds(events, "finished")
    d0, d1 = (kinds(nan_run.events(r), "digest") for r in (0, 1))
    assert [e["step"] for e in d0] == [2] and d0[0]["params_sha256"] == d1[0]["params_sha256"]


def test_a_killed_rank_dies_silently_and_its_peer_errors_soon(kill_run: Finished) -> None:
    killed, peer = kill_run.events(1), kill_run.events(0)
    assert "Node with rank 1 exited with code -9" in kill_run.log  # SIGKILL, as the launcher saw it
    assert not kinds(killed, "error") and not kinds(killed, "finished")
    assert [e["step"] for e in kinds(killed, "step")] == [1, 2]
    assert peer[-1]["event"] == "error" and peer[-1]["step"] == 3 and peer[-1]["exit_code"] in (1, 143)
    # "soon": within a few seconds of the killed rank's last sign of life
    assert peer[-1]["t"] - killed[-1]["t"] < 10.0, peer[-1]


def test_a_hung_rank_stops_beating_while_its_peer_waits(hang_run: Hang) -> None:
    h = hang_run
    assert h.state_stopped == "T"
    assert h.beats_later[1] == h.beats_at_stop[1]  # frozen, heartbeat thread too
    # It stopped right after setting step 3; the last beat (one a second) may predate it by all three steps when
    # the tiny model's steps are fast (it can still say step 0, the load), but never comes after it.
    assert 0 <= h.last_beat_step <= 3
    assert h.beats_later[0] >= h.beats_at_stop[0] + 3 and h.rank0_phase_later == "step"  # alive, in the all_sum
    assert [e["step"] for e in kinds(read_events(h.run_dir, 1), "step")] == [1, 2]
    assert all(s in ("gone", "Z") for s in h.states_after_kill), h.states_after_kill
