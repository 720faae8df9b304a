"""worker.train end to end: real processes, real `mlx.launch` with the ring backend on 127.0.0.1.

One module-scoped fixture runs every job once (about 40 s on 2 cores); the tests then read their events and
checkpoints. mlx.launch exits 0 whatever its ranks did, so outcomes are always read from the event files.
Nothing is downloaded: the tiny model is built offline and HF_HUB_OFFLINE=1 is set for every rank.
mlx.launch's `mktemp` files (a pidfile and an MLX_HOSTFILE per rank, never all removed by the launcher) go to a
per-launch TMPDIR that is emptied afterwards, and every launch's process group is killed once it is over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from coordinator.run.launchfiles import MLX_LAUNCH
from worker.checkpoint import MANIFEST, WEIGHTS, find_valid_checkpoint, verify_checkpoint
from worker.comm import scalar
from worker.tinymodel import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "playbooks" / "data" / "smoke"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
# mlx.launch as the coordinator runs it (run.launchfiles.MLX_LAUNCH): its stock `main()` selects each rank's
# stdin pipe for writing, always writable, so its relay threads spin a whole core for as long as the ranks run,
# taken from the ranks themselves on a 2-core machine.
LAUNCH = [PYTHON, "-c", MLX_LAUNCH]
RUN_TIMEOUT = 600  # a hang guard only: cold CPU-JIT compiles of the step's kernels take long on a loaded machine

KNOWN_PHASES = {"load", "step", "eval", "checkpoint", "sync", "digest", "idle"}
REQUIRED_FIELDS: dict[str, set[str]] = {
    "started": {"world_size", "node", "batch_size", "trainable_params", "total_params", "trainable_pct",
                "trainable", "resumed_from", "pid", "method", "num_layers"},
    "step": {"step", "loss", "tokens", "total_tokens", "tok_s", "step_time_s", "peak_memory", "grad_norm", "lr",
             "local_loss", "local_loss_finite", "local_grad_norm", "compute_s", "compute_tok_s"},
    "digest": {"step", "params_sha256", "optimizer_sha256"},
    "eval": {"step", "val_loss"},
    "checkpoint": {"step", "path", "sha256"},
    "checkpoint_invalid": {"step", "path", "reason"},
    "warning": {"code", "message"},
    "heartbeat": {"step", "phase", "pid"},
    "finished": {"step", "checkpoint"},
    "error": {"message", "traceback"},
}


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / "events" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port p with p and p+1 free now (mlx.launch gives rank r port p+r). Concurrent test runs pick their own."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 65000 and port_free(port + 1):
            return port
    raise RuntimeError("no free port pair")


def free_port_range(n: int) -> int:
    """A port p with p..p+n-1 free now."""
    for _ in range(100):
        port = free_port_pair()
        if port + n < 65000 and all(port_free(port + i) for i in range(2, n)):
            return port
    raise RuntimeError(f"no {n} free ports")


def rank_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Launch:
    """A running mlx.launch: its own session (process group = proc.pid; local ranks are its children, exec'd
    from bash, so they share the group), its log and the TMPDIR its `mktemp` files go to."""

    proc: subprocess.Popen[bytes]
    log: Path
    tmpdir: Path
    port: int
    n: int

    def kill(self) -> None:
        """SIGKILL the whole group (launcher and ranks; a SIGSTOPped rank too) and reap the launcher."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_launch(workdir: Path, command: list[str], n: int = 2) -> Launch:
    """Start `command` on n local ranks through mlx.launch (ring) without waiting."""
    workdir.mkdir(parents=True, exist_ok=True)
    hostfile = workdir / "hostfile.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * n))
    tmpdir = workdir / "launch-tmp"
    tmpdir.mkdir(exist_ok=True)
    # MLX keeps the kernels its CPU backend JIT-compiles for the compiled step under $TMPDIR/mlx: share the
    # machine's cache, as a real node does, instead of compiling every kernel again (g++, seconds each) per launch.
    shared = Path(tempfile.gettempdir()) / "mlx"
    shared.mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (tmpdir / "mlx").symlink_to(shared, target_is_directory=True)
    port = free_port_pair() if n <= 2 else free_port_range(n)
    argv = [*LAUNCH, "--hostfile", str(hostfile), "--backend", "ring", "--starting-port", str(port),
            "--cwd", str(REPO), "--", *command]
    log = workdir / "launcher.log"
    with open(log, "wb") as out:
        # stdin stays an open, silent pipe: the launcher forwards stdin and would spin on an EOF'd one.
        # TMPDIR: the launch script's `mktemp` files land in our dir instead of /tmp.
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                env={**rank_env(), "TMPDIR": str(tmpdir)}, start_new_session=True)
    return Launch(proc, log, tmpdir, port, n)


def finish_launch(run: Launch, timeout: float = RUN_TIMEOUT) -> str:
    """Wait for the launcher (killing everything on timeout), then kill whatever is left of its group and
    remove its temporary files. Returns the launcher's output."""
    try:
        run.proc.wait(timeout=timeout)
    finally:
        run.kill()  # a rank the launcher left behind (it does not wait for stopped ones) dies with the group
        assert run.proc.stdin is not None
        run.proc.stdin.close()
        shutil.rmtree(run.tmpdir, ignore_errors=True)
    return run.log.read_text(errors="replace")


def launch(workdir: Path, command: list[str], n: int = 2) -> str:
    """Run `command` on n local ranks through mlx.launch (ring). Returns the launcher's output."""
    return finish_launch(start_launch(workdir, command, n))


def run_direct(config: Path) -> subprocess.CompletedProcess[str]:
    """One rank without a launcher (world of 1: MLX_HOSTFILE unset, init gives a singleton group)."""
    return subprocess.run([PYTHON, "-m", "worker.train", "--config", str(config)], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)


def write_config(path: Path, **overrides: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(overrides, indent=2))
    return path


def weights(ckpt: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(ckpt / WEIGHTS))
    assert isinstance(loaded, dict)
    return loaded


def max_abs_diff(a: dict[str, mx.array], b: dict[str, mx.array]) -> float:
    assert a.keys() == b.keys()
    return max(scalar(mx.abs(a[k] - b[k]).max()) for k in a)


@dataclass
class Runs:
    root: Path
    eq2: Path = field(init=False)
    eq1: Path = field(init=False)
    ref: Path = field(init=False)
    crash: Path = field(init=False)
    crash_rc: int = field(init=False)
    resumed: Path = field(init=False)
    moved_a: Path = field(init=False)
    moved_b: Path = field(init=False)
    sigterm: Path = field(init=False)
    sigterm_rc: int = field(init=False)
    launcher_logs: dict[str, str] = field(default_factory=dict)

    def all_event_files(self) -> Iterator[tuple[str, Path, int]]:
        for name in ("eq2", "eq1", "ref", "crash", "resumed", "moved_a", "moved_b", "sigterm"):
            run_dir: Path = getattr(self, name)
            for path in sorted((run_dir / "events").glob("rank*.jsonl")):
                yield name, run_dir, int(path.stem.removeprefix("rank"))


def require_finished(run_dir: Path, ranks: list[int], log: str = "") -> None:
    """The last attempt of each rank (a resumed run appends to the crashed attempt's file) ended `finished`."""
    for rank in ranks:
        events = read_events(run_dir, rank)
        starts = [i for i, e in enumerate(events) if e["event"] == "started"]
        errors = kinds(events[starts[-1] if starts else 0:], "error")
        assert not errors, f"{run_dir} rank {rank}: {errors[0]['message']}\n{errors[0]['traceback']}\n{log[-3000:]}"
        assert events and events[-1]["event"] == "finished", f"{run_dir} rank {rank} did not finish\n{log[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("train")
    model = build_tiny_model(root / "model", SMOKE)
    r = Runs(root)
    base = {"model": str(model), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 2, "seed": 0,
            "keep_checkpoints": 2, "heartbeat_s": 0.5, "num_layers": None, "grad_accumulation": 1}

    # 1. one optimizer step, SGD (its update is proportional to the gradient, so a wrong weighting shows; Adam's
    #    first step is ~lr * sign(g) and would hide it), full fine-tune: 3/1 over mlx.launch vs 4 on one rank.
    #    Rank 1 sleeps 3 s before the all_sum: rank 0 waits inside the collective and must keep beating.
    eq = {**base, "method": "full", "optimizer": "sgd", "learning_rate": 0.5, "iters": 1, "save_every": 0,
          "steps_per_eval": 0}
    r.eq2 = root / "eq2"
    cfg = write_config(r.eq2 / "run.json", **eq, run_id="eq2", run_dir=str(r.eq2),
                       ranks=[{"rank": 0, "node": "local", "batch_size": 3},
                              {"rank": 1, "node": "local", "batch_size": 1}],
                       debug={"slow_step": 1, "slow_rank": 1, "slow_seconds": 3.0})
    r.launcher_logs["eq2"] = launch(r.eq2, [PYTHON, "-m", "worker.train", "--config", str(cfg)])
    r.eq1 = root / "eq1"
    cfg = write_config(r.eq1 / "run.json", **eq, run_id="eq1", run_dir=str(r.eq1),
                       ranks=[{"rank": 0, "node": "local", "batch_size": 4}])
    run_direct(cfg)

    # 2. 30 LoRA/Adam steps uninterrupted; the same crashing at step 23 (after the step-20 checkpoint); a resume of
    #    a copy of the crashed run with the same plan; and a resume on a new plan: nodes a (3 rows, the crashed
    #    run's dir with its step-20 weights truncated) and b (1 row, an empty dir: a replacement node).
    lora = {**base, "method": "lora", "optimizer": "adam", "learning_rate": 5e-3, "iters": 30, "save_every": 10,
            "steps_per_eval": 10, "lora": {"rank": 4, "scale": 20.0, "dropout": 0.0}}
    one = [{"rank": 0, "node": "local", "batch_size": 4}]
    r.ref = root / "ref"
    run_direct(write_config(r.ref / "run.json", **lora, run_id="ref", run_dir=str(r.ref), ranks=one))
    r.crash = root / "crash"
    r.crash_rc = run_direct(write_config(r.crash / "run.json", **lora, run_id="crash", run_dir=str(r.crash),
                                         ranks=one, debug={"crash_at_step": 23})).returncode
    r.resumed = root / "resumed"
    shutil.copytree(r.crash, r.resumed, symlinks=True)
    run_direct(write_config(r.resumed / "run.json", **lora, run_id="crash", run_dir=str(r.resumed), ranks=one,
                            resume=True))
    r.moved_a, r.moved_b = root / "node-a", root / "node-b"
    shutil.copytree(r.crash, r.moved_a, symlinks=True)
    shutil.rmtree(r.moved_a / "events")
    step20 = r.moved_a / "checkpoints" / "step-000020" / WEIGHTS
    step20.write_bytes(step20.read_bytes()[:100])
    split = [{"rank": 0, "node": "a", "batch_size": 3}, {"rank": 1, "node": "b", "batch_size": 1}]
    for rank, run_dir in enumerate((r.moved_a, r.moved_b)):
        write_config(root / "moved" / f"rank{rank}.json", **lora, run_id="crash", run_dir=str(run_dir),
                     ranks=split, resume=True)
    # what the coordinator's rank script does: same command everywhere, each rank picks its node's config
    script = f"exec {PYTHON} -m worker.train --config {root}/moved/rank$MLX_RANK.json"
    r.launcher_logs["moved"] = launch(root / "moved", ["/bin/sh", "-c", script])

    # 3. SIGTERM while the main thread is busy in a step: error event and exit 128+15, never 0.
    r.sigterm = root / "sigterm"
    cfg = write_config(r.sigterm / "run.json", **lora, run_id="sigterm", run_dir=str(r.sigterm), ranks=one,
                       debug={"slow_step": 2, "slow_rank": 0, "slow_seconds": 120.0})
    proc = subprocess.Popen([PYTHON, "-m", "worker.train", "--config", str(cfg)], cwd=REPO, env=rank_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                if any(e["event"] == "heartbeat" and e["step"] == 2 for e in read_events(r.sigterm, 0)):
                    break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        r.sigterm_rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return r


# --- the tests -------------------------------------------------------------------------------------------------


def test_weighted_gradients_3_1_split_equals_one_rank_with_4(runs: Runs) -> None:
    require_finished(runs.eq2, [0, 1], runs.launcher_logs["eq2"])
    require_finished(runs.eq1, [0])
    started = [kinds(read_events(runs.eq2, r), "started")[0] for r in (0, 1)]
    assert [s["world_size"] for s in started] == [2, 2] and [s["batch_size"] for s in started] == [3, 1]
    steps = [kinds(read_events(runs.eq2, r), "step")[0] for r in (0, 1)]
    single = kinds(read_events(runs.eq1, 0), "step")[0]
    assert steps[0]["tokens"] + steps[1]["tokens"] == steps[0]["total_tokens"] == single["total_tokens"]
    assert steps[0]["tokens"] != 3 * steps[1]["tokens"]  # unequal tokens per row: the weighting is exercised
    assert steps[0]["loss"] == steps[1]["loss"] == pytest.approx(single["loss"], rel=1e-5)
    # each rank's own loss is its own tokens' mean; the token-weighted mean of the two is the global loss
    local = sum(s["local_loss"] * s["tokens"] for s in steps) / steps[0]["total_tokens"]
    assert local == pytest.approx(steps[0]["loss"], rel=1e-5) and all(s["local_loss_finite"] for s in steps)
    # rank 1's debug sleep (before the all_sum) is its own time; rank 0's wait for it in the all_sum is not
    assert steps[1]["compute_s"] >= 3.0 and steps[0]["compute_s"] < steps[1]["compute_s"]
    # honest data-parallel replicas: identical digests of the final step on both ranks
    digests = [kinds(read_events(runs.eq2, r), "digest") for r in (0, 1)]
    assert [[d["step"] for d in ds] for ds in digests] == [[1], [1]]
    assert digests[0][0]["params_sha256"] == digests[1][0]["params_sha256"]
    assert digests[0][0]["optimizer_sha256"] == digests[1][0]["optimizer_sha256"]
    two = weights(runs.eq2 / "checkpoints" / "step-000001")
    one = weights(runs.eq1 / "checkpoints" / "step-000001")
    # full trains the transformer blocks (as mlx-lm's full): the checkpoint holds those, all of them
    initial = {k: v for k, v in weights_of_model(runs.root / "model").items() if k.startswith("model.layers.")}
    assert max_abs_diff(two, one) < 1e-5
    assert max_abs_diff(one, initial) > 1e-3  # the step really moved the weights


def weights_of_model(model_dir: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(loaded, dict)
    return loaded


def test_heartbeats_continue_while_blocked_in_a_collective(runs: Runs) -> None:
    for rank in (0, 1):
        events = read_events(runs.eq2, rank)
        in_step = [e for e in kinds(events, "heartbeat") if e["step"] == 1 and e["phase"] == "step"]
        # rank 1 sleeps 3 s before the all_sum, rank 0 sits in the all_sum meanwhile; beats every 0.5 s
        assert len(in_step) >= 3, (rank, len(in_step))
        assert kinds(events, "heartbeat")[0]["phase"] == "load"


def test_every_event_line_parses_and_has_its_fields(runs: Runs) -> None:
    seen: set[str] = set()
    for name, run_dir, rank in runs.all_event_files():
        events = read_events(run_dir, rank)  # json.loads of every line
        assert events, (name, rank)
        for e in events:
            assert {"t", "run_id", "rank", "event"} <= set(e), (name, e)
            assert e["rank"] == rank and isinstance(e["t"], float)
            assert e["event"] in REQUIRED_FIELDS, (name, e["event"])
            missing = REQUIRED_FIELDS[e["event"]] - set(e)
            assert not missing, (name, e["event"], missing)
            if e["event"] == "heartbeat":
                assert e["phase"] in KNOWN_PHASES
            seen.add(e["event"])
    assert seen == set(REQUIRED_FIELDS)


def test_trainable_share_is_reported(runs: Runs) -> None:
    full = kinds(read_events(runs.eq1, 0), "started")[0]
    # null = all layers; full trains the transformer blocks as mlx-lm's full does, and says what stays frozen
    assert full["trainable_params"] < full["total_params"] and full["num_layers"] == 2
    assert "2 of 2 transformer layers" in full["trainable"] and "frozen, as mlx-lm's full" in full["trainable"]
    lora = kinds(read_events(runs.ref, 0), "started")[0]
    assert 0 < lora["trainable_pct"] < 100 and lora["trainable"].startswith(f"trainable {lora['trainable_pct']:.2f}%")
    assert lora["resumed_from"] is None


def test_crash_gives_error_event_and_nonzero_exit_and_keeps_checkpoints(runs: Runs) -> None:
    assert runs.crash_rc == 1
    events = read_events(runs.crash, 0)
    assert events[-1]["event"] == "error" and "crash_at_step=23" in events[-1]["message"]
    assert "Traceback" in events[-1]["traceback"] and events[-1]["step"] == 23
    assert not kinds(events, "finished")
    found = find_valid_checkpoint(runs.crash / "checkpoints")
    assert found is not None and found.step == 20
    assert (runs.crash / "checkpoints" / "latest").read_text().strip() == "step-000020"


def test_resume_after_interruption_matches_the_uninterrupted_run(runs: Runs) -> None:
    require_finished(runs.ref, [0])
    require_finished(runs.resumed, [0])
    events = read_events(runs.resumed, 0)
    started = kinds(events, "started")
    assert [s["resumed_from"] for s in started] == [None, 20]  # the crashed start, then the resume
    assert [s["step"] for s in kinds(events, "step")][-10:] == list(range(21, 31))
    ref = weights(runs.ref / "checkpoints" / "step-000030")
    assert max_abs_diff(weights(runs.resumed / "checkpoints" / "step-000030"), ref) < 1e-6
    ref_steps = {e["step"]: e["loss"] for e in kinds(read_events(runs.ref, 0), "step")}
    for e in kinds(events, "step")[-10:]:
        assert e["loss"] == pytest.approx(ref_steps[e["step"]], rel=1e-5)
    # keep_checkpoints=2 and the checkpoint dir works as an mlx-lm adapter path
    assert sorted(p.name for p in (runs.resumed / "checkpoints").glob("step-*")) == ["step-000020", "step-000030"]
    from mlx_lm.utils import load

    model, _ = load(str(runs.root / "model"), adapter_path=str(runs.resumed / "checkpoints" / "step-000030"))[:2]
    assert model is not None


def test_resume_on_a_new_plan_falls_back_past_a_truncated_checkpoint(runs: Runs) -> None:
    log = runs.launcher_logs["moved"]
    require_finished(runs.moved_a, [0], log)
    require_finished(runs.moved_b, [1], log)
    a, b = read_events(runs.moved_a, 0), read_events(runs.moved_b, 1)
    invalid = kinds(a, "checkpoint_invalid")
    assert [e["step"] for e in invalid] == [20] and "weights.safetensors" in invalid[0]["reason"]
    assert kinds(a, "started")[0]["resumed_from"] == kinds(b, "started")[0]["resumed_from"] == 10
    assert kinds(b, "started")[0]["checkpoint_writer"] is True  # node b writes its own copy
    # node b had nothing: it got the state from rank 0; both nodes now hold identical, verified checkpoints
    final_a = runs.moved_a / "checkpoints" / "step-000030"
    final_b = runs.moved_b / "checkpoints" / "step-000030"
    assert verify_checkpoint(final_a) == verify_checkpoint(final_b)
    assert (final_a / MANIFEST).read_bytes() == (final_b / MANIFEST).read_bytes()
    # step-20 was rewritten complete on node a
    assert verify_checkpoint(runs.moved_a / "checkpoints" / "step-000020")
    # Same state, same global data position as the 1-rank reference: the first steps after the resume see the
    # same rows and give the same loss. (Later steps drift apart: the 3/1 split sums in another order, and Adam
    # turns float noise in near-zero gradients into lr-sized steps; a fresh 1-rank vs 3/1 run drifts the same
    # way. Exact equality across a resume is checked with an unchanged plan above.)
    ref_loss = {e["step"]: e["loss"] for e in kinds(read_events(runs.ref, 0), "step")}
    for events in (a, b):
        steps = kinds(events, "step")
        assert [e["step"] for e in steps] == list(range(11, 31))
        for e in steps[:3]:
            assert e["loss"] == pytest.approx(ref_loss[e["step"]], rel=1e-5), e["step"]
    assert [e["loss"] for e in kinds(a, "step")] == [e["loss"] for e in kinds(b, "step")]


def test_sigterm_gives_error_event_and_exit_143(runs: Runs) -> None:
    assert runs.sigterm_rc == 128 + signal.SIGTERM
    events = read_events(runs.sigterm, 0)
    assert events[-1]["event"] == "error" and events[-1]["message"] == "terminated by SIGTERM"
    assert events[-1]["step"] == 2 and events[-1]["phase"] == "step"


def test_a_rank_resume_with_only_invalid_checkpoints_refuses_unless_restarting_from_scratch(tmp_path: Path) -> None:
    # The ranks' own check (the coordinator's runs first, coordinator.run.resume): a job fault, not a node's.
    model = build_tiny_model(tmp_path / "model", SMOKE)
    run_dir = tmp_path / "run"
    cfg = {"model": str(model), "data": str(SMOKE), "max_seq_length": 64, "val_batches": 1, "iters": 4,
           "save_every": 2, "steps_per_eval": 0, "keep_checkpoints": 1, "heartbeat_s": 0.5, "run_id": "r",
           "run_dir": str(run_dir), "ranks": [{"rank": 0, "node": "local", "batch_size": 2}],
           "lora": {"rank": 4, "scale": 20.0, "dropout": 0.0}}
    first = run_direct(write_config(tmp_path / "a.json", **cfg))
    assert first.returncode == 0, first.stderr[-3000:]
    root = run_dir / "checkpoints"
    (root / "step-000002").mkdir()  # keep_checkpoints 1 pruned it: an invalid (empty) one in its place
    (root / "step-000004" / MANIFEST).write_text("garbage\n")

    refused = run_direct(write_config(tmp_path / "b.json", **cfg, resume=True))
    assert refused.returncode == 1
    error = kinds(read_events(run_dir, 0), "error")[-1]
    assert error["fault"] == "job" and error["message"].startswith("ResumeRefused: no rank has a valid checkpoint")
    assert "step-000004: manifest line 1 is malformed" in error["message"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000002", "step-000004"]

    again = run_direct(write_config(tmp_path / "c.json", **cfg, resume=True, restart_from_scratch=True))
    assert again.returncode == 0, again.stderr[-3000:]
    events = read_events(run_dir, 0)
    assert kinds(events, "started")[-1]["resumed_from"] is None and events[-1]["event"] == "finished"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-000002.invalid-no-manifest", "step-000004", "step-000004.invalid-bad-manifest"]
    assert verify_checkpoint(root / "step-000004")
