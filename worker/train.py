"""Per-rank training driver: `python -m worker.train --config RUN_CONFIG.json`, started on every rank by mlx.launch.

Contract
--------
* Config: see `worker.runconfig` (identical file on every rank; `run_dir` is this node's run dir).
* World: `mx.distributed.init()` must give exactly `len(ranks)` processes, and `MLX_RANK` (when set) must equal
  the group rank; anything else (init silently falling back to a singleton group included) is an error.
* Model/data through mlx-lm: `mlx_lm.utils.load`, `linear_to_lora_layers` (lora/dora) on the last `num_layers`
  layers (null/-1 = all), full = every parameter trainable (or only the last `num_layers` layers),
  `mlx_lm.tuner.datasets` formats, mlx-lm's batch padding and loss mask. The step loop is ours. What a
  micro-batch and its loss are: `worker.objectives`; the model set-up (LoRA, full, the trainable set, the
  optimizer): `worker.modelsetup`; the collectives: `worker.comm`; the step: `worker.step`.
* Exact weighted gradients: every rank sums the per-token cross-entropy over ITS tokens and takes the gradient of
  that sum; gradients, loss sums and token counts are `all_sum`med and the gradient divided by the total token
  count, i.e. sum_i(tokens_i * meangrad_i) / sum_i(tokens_i). A 3/1 split therefore makes the same update as one
  rank with the global batch of 4. `grad_accumulation` micro-batches are pooled the same way before the one
  all_sum of the step. Reported loss = global loss sum / global tokens (the same on every rank).
* RNG: `mx.random.seed(f(seed, step))` at the start of every step (and `seed` before the adapters are created),
  so the random state at any step is a function of (seed, step): resume needs no opaque RNG blob (MLX cannot
  set its key from Python anyway). The data order uses numpy Generators seeded by `seed + epoch` (stateless).
* Events: `<run_dir>/events/rank<R>.jsonl` (see `worker.events.EventKind` for the fields). Step events carry
  this rank's own pre-reduction values too (local_loss, local_loss_finite, local_grad_norm, compute_s,
  compute_tok_s), so a NaN or an outlier can be attributed to the rank that produced it.
* Consistency: every `consistency_every` steps and at the last step, after the update, every rank emits a
  `digest` event (`worker.chaos.replica_digest` of all its parameters, frozen ones included, and of its optimizer
  state, summed on the device that holds them); data-parallel replicas are bit-identical, so honest ranks report
  identical digests (`Strategy.digest_peers`: who must agree).
* Chaos (tests and drills): the `chaos` faults planned for this rank are applied at fixed points of the step
  (see `worker.chaos` for what each does and where).
* Layout (`config.layout`): how the ranks share the model is the run's strategy (`worker.parallel`): `dp` (every
  rank a full replica, `worker.parallel.dp`) or `pipeline` (each rank a range of layers). The trainer talks to it
  only: the model, the optimizer, the step, the replica/stage check, the digests, the checkpoint shard and its
  restore, the evaluation sums.
* Checkpoints: `<strategy.checkpoint_root>/step-NNNNNN/` (layout in `worker.checkpoint`), written by the ranks the
  strategy names (dp: one full copy per node, by the lowest rank on that node). All ranks wait for all writers
  (a barrier) before reporting the `checkpoint` event.
* Resume (`resume: true`): the strategy restores its shard (dp: see `worker.parallel.dp`); training continues at
  step+1 at the saved global data position. A fresh run (`resume: false`) refuses a run dir that already has
  checkpoints; checkpoints of which none is valid make every rank raise `ResumeRefused` (an error event with
  `fault: job`) unless `restart_from_scratch` is set.
* Exit: 0 only after `finished`; any exception -> `error` event (message, traceback) and exit 1; SIGTERM/SIGINT/
  SIGHUP -> `error` event and exit 128+signal, even while the main thread is blocked in a collective."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from worker import kernelcache
from worker.chaos import RankChaos, lie_about, perturb, signal_self
from worker.checkpoint import (
    ADAPTER_CONFIG,
    OPTIMIZER,
    STATE,
    WEIGHTS,
    Checkpoint,
    remove_stale_temporaries,
    step_dir_name,
    write_checkpoint,
    writer_lock,
)
from worker.comm import Comm, scalar
from worker.cpus import describe_share, take_share
from worker.data import eval_batches
from worker.errors import ResumeRefused, TrainingError
from worker.events import EventKind, EventLog, Heartbeat, Phase, events_path
from worker.memory import peak_memory
from worker.modelsetup import adapter_config, trainable_text
from worker.objectives import Micro, StepCensus, stats_fields, step_census
from worker.parallel import Strategy, make_strategy
from worker.parallel.base import STATE_FORMAT, ResumeState, load_arrays
from worker.runconfig import ConfigError, RunConfig, load_run_config
from worker.step import TrainStep, WeightMismatch
from worker.tensorfile import write_safetensors

# Re-exported: tests and tools import them from here.
__all__ = ["STATE_FORMAT", "ResumeRefused", "ResumeState", "Trainer", "TrainingError", "load_arrays", "main",
           "step_seed"]


def step_seed(seed: int, step: int) -> int:
    """The mx.random seed of `step`: a hash, so that neighbouring (seed, step) pairs give unrelated streams."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") >> 1


def census_fields(census: StepCensus | None) -> dict[str, Any]:
    """The `started` event's census fields (worker/events.py); none where the objective counts no tokens."""
    if census is None:
        return {}
    return {"step_tokens_median": census.median_tokens(), "census_tokens": list(census.tokens),
            "census_new_shape": list(census.new_shape)}


class Trainer:
    """One rank's run. `run()` returns normally only after `finished` was emitted; everything else raises.

    The model, its optimizer, the data and the checkpoint shard belong to the run's strategy (`worker.parallel`,
    from `config.layout`); the trainer keeps the world, the loop, events, chaos and state.json."""

    def __init__(self, config: RunConfig, log: EventLog, heartbeat: Heartbeat, env_rank: int) -> None:
        self.config = config
        self.log = log
        self.hb = heartbeat
        self.env_rank = env_rank
        self.strategy: Strategy = make_strategy(config, log)
        heartbeat.progress = self.strategy.progress
        self.comm: Comm
        self.position = 0
        self.last_loss: float | None = None
        # The batch shapes this process has stepped on: a step on a new one traces and compiles it (a one-time
        # cost of seconds on a cold machine) and says so in its event (`new_shape`): the run's rate leaves it out.
        self.seen_shapes: set[tuple[tuple[int, ...], ...]] = set()
        self.last_checkpoint: Path | None = None
        self.chaos = RankChaos()  # this rank's planned faults: set in init_distributed, once the rank is known

    # What the strategy holds, under the names the rest of the trainer (and its tests and benchmarks) use.
    @property
    def model(self) -> Any:
        return self.strategy.model

    @model.setter
    def model(self, value: Any) -> None:
        self.strategy.model = value

    @property
    def optimizer(self) -> Any:
        return self.strategy.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self.strategy.optimizer = value

    @property
    def train_set(self) -> Any:
        return self.strategy.train_set

    @property
    def valid_set(self) -> Any:
        return self.strategy.valid_set

    @property
    def objective(self) -> Any:
        return self.strategy.objective

    @property
    def packing(self) -> tuple[bool, str, int]:
        return self.strategy.packing

    @property
    def num_layers(self) -> int:
        return self.strategy.num_layers

    @property
    def root(self) -> Path:
        return self.strategy.checkpoint_root

    # -- setup ---------------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_writer(self) -> bool:
        return self.strategy.is_writer

    def init_distributed(self) -> None:
        group = mx.distributed.init()
        self.comm = Comm(group)
        want = self.config.world_size
        if self.comm.size != want:
            raise TrainingError(
                f"mx.distributed.init() gave a world of {self.comm.size}, the plan has {want} ranks "
                f"(MLX_RANK={os.environ.get('MLX_RANK')!r}, MLX_HOSTFILE={os.environ.get('MLX_HOSTFILE')!r}): "
                "refusing to train a different world")
        if "MLX_RANK" in os.environ and self.comm.rank != self.env_rank:
            raise TrainingError(f"group rank {self.comm.rank} != MLX_RANK {self.env_rank}")
        self.strategy.comm = self.comm
        self.chaos = RankChaos.for_rank(self.config.chaos, self.comm.rank)

    def load(self) -> None:
        self.strategy.load()

    def trainable_flat(self) -> dict[str, mx.array]:
        return self.strategy.trainable()

    # -- resume ------------------------------------------------------------------------------------------------

    def restore(self) -> ResumeState | None:
        """Fresh start (None) or the agreed resume point, with model and optimizer restored (by the strategy)."""
        return self.strategy.restore()

    def check_replicas(self) -> None:
        """Every rank starts from what its peers expect (data parallel: identical replicas)."""
        self.strategy.check_start()

    # -- steps -------------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns the TRUE fields of its step event (a lying rank inflates them later).

        Timeline: [chaos kill/hang] -> forward/backward of every micro-batch (compiled, worker.step) -> [chaos
        nan] -> local stats -> [chaos slow / debug slow sleep / chaos stall] -> compute_s ends -> scale by the
        global weight, gradient all_sum, update (compiled) -> [chaos diverge]."""
        cfg = self.config
        if cfg.debug.crash_at_step == step:
            raise RuntimeError(f"debug.crash_at_step={step}")
        sig = self.chaos.signal_at(step)
        if sig is not None:
            signal_self(sig)  # kill: never returns; hang: returns only if someone sends SIGCONT
        mx.random.seed(step_seed(cfg.seed, step))
        offset, count = self.strategy.rows()

        def build() -> list[Micro]:
            micros = []
            for _ in range(cfg.grad_accumulation):
                micro = self.objective.micro(self.train_set, self.position, cfg.global_batch, cfg.seed,
                                             offset, count)
                micros.append(micro)
                self.position += micro.consumed
            return micros

        def slow_down(tic: float) -> None:
            factor = self.chaos.slow_factor(step)
            if factor > 1.0:
                time.sleep((factor - 1.0) * (time.perf_counter() - tic))
            if cfg.debug.slow_step == step and cfg.debug.slow_rank in (None, self.rank):
                time.sleep(cfg.debug.slow_seconds)
            while self.chaos.stalls(step):  # until killed: sleep keeps signal handlers (teardown) working
                time.sleep(3600)

        # Everything until compute_s was this rank alone (a slowdown included, as a slower machine would be); from
        # there on the step waits for the slowest peer.
        try:
            done = self.strategy.step(build, after_local=TrainStep.poison if self.chaos.poisons(step) else None,
                                      before_apply=slow_down)
        except WeightMismatch as exc:
            raise TrainingError(str(exc)) from exc
        micros, local, extras, compute_s = done.micros, done.local, done.extras, done.compute_s
        weight, total_weight = sum(m.weight for m in micros), sum(m.total_weight for m in micros)
        loss_arr, norm_arr, local_loss, local_norm = done.loss, done.norm, done.local_loss, done.local_norm
        if self.chaos.diverges(step):
            self.model.load_weights(list(perturb(self.trainable_flat()).items()), strict=False)
            mx.eval(self.model.parameters())
        elapsed = done.elapsed
        shape = tuple(tuple(a.shape) for m in micros for a in m.inputs)
        new_shape = shape not in self.seen_shapes
        self.seen_shapes.add(shape)
        if extras is not None:
            my_tokens, total_tokens = int(scalar(local.tokens)), int(scalar(extras[0]))
        else:
            my_tokens = sum(m.tokens or 0 for m in micros)
            total_tokens = sum(m.total_tokens or 0 for m in micros)
        loss = scalar(loss_arr)
        self.last_loss = loss
        local_loss_value = scalar(local_loss)
        record: dict[str, Any] = {}
        if extras is not None:
            record.update({"pairs": weight, "total_pairs": total_weight,
                           **stats_fields(self.objective.stats, np.asarray(extras[1:]).tolist(), total_weight)})
        return {
            **record,
            "step": step, "loss": loss, "tokens": my_tokens, "total_tokens": total_tokens,
            "tok_s": my_tokens / elapsed if elapsed > 0 else None, "step_time_s": elapsed,
            "peak_memory": peak_memory(), "grad_norm": scalar(norm_arr),
            "lr": scalar(mx.array(self.optimizer.learning_rate)), "data_position": self.position,
            "epoch": self.position // len(self.train_set),
            "local_loss": local_loss_value, "local_loss_finite": math.isfinite(local_loss_value),
            "local_grad_norm": scalar(local_norm), "compute_s": compute_s, "new_shape": new_shape,
            "compute_tok_s": my_tokens / compute_s if compute_s > 0 else None,
            **self.strategy.step_fields(),
        }

    def digests(self) -> dict[str, str]:
        """The `digest` event's hashes of this rank's parameters and optimizer state (`Strategy.digests`)."""
        return self.strategy.digests()

    def evaluate(self) -> tuple[float | None, int, dict[str, float]]:
        """Validation loss over `val_batches` global batches, split like training and combined exactly:
        (mean loss per weight unit, weight units (tokens, or pairs for DPO), the objective's extras as `val_*`)."""
        cfg = self.config
        if self.valid_set is None:
            return None, 0, {}
        self.model.eval()
        sums = mx.zeros((2 + len(self.objective.stats),), mx.float32)  # loss sum, weight, extras
        for global_rows in eval_batches(len(self.valid_set), cfg.global_batch, cfg.val_batches):
            part = self.strategy.eval_sums(global_rows)
            if part is not None:  # a rank with no part of this batch still joins the all_sum below
                sums = sums + part
                mx.eval(sums)
        total = np.asarray(self.comm.all_sum(sums)).tolist()
        self.model.train()
        n = int(total[1])
        return ((total[0] / n if n else None), n,
                stats_fields(self.objective.stats, total[2:], total[1], prefix="val_"))

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_json(self, step: int) -> dict[str, Any]:
        """Everything but tensors needed to continue. Identical on every rank (no rank, host or time in it), so
        the copies on different nodes are byte-identical and resume can compare them by manifest hash."""
        cfg = self.config
        n = len(self.train_set)
        return {
            "format": STATE_FORMAT,
            "run_id": cfg.run_id,
            "step": step,
            "data_position": self.position,
            "epoch": self.position // n,
            "train_rows": n,
            "global_batch": cfg.global_batch,
            "grad_accumulation": cfg.grad_accumulation,
            "rng": {
                "mlx": f"mx.random.seed(step_seed({cfg.seed}, step)) at the start of each step",
                "mlx_key_next_step": [int(x) for x in np.asarray(mx.random.key(step_seed(cfg.seed, step + 1)))],
                "data_order": f"numpy.random.default_rng({cfg.seed} + epoch).permutation({n})",
                "python_random": None,
            },
            "seed": cfg.seed,
            "config_digest": cfg.digest(),
            "method": cfg.method,
            "num_layers": self.num_layers,
            "world": {"size": cfg.world_size, "ranks": cfg.plan_json()},
            "last_loss": self.last_loss,
            **self.strategy.state_fields(),
        }

    def save(self, step: int) -> Path:
        self.hb.set(phase=Phase.CHECKPOINT)
        path = self.root / step_dir_name(step)
        # fsdp gathers the whole state with collectives: every rank takes part, the writer alone writes.
        gathered = self.strategy.checkpoint_arrays() if self.is_writer or self.strategy.collective_checkpoint else None
        if self.is_writer and gathered is not None:
            weights, opt_state = gathered
            state = json.dumps(self.state_json(step), indent=2, sort_keys=True).encode() + b"\n"
            adapter = json.dumps(adapter_config(self.config, self.num_layers), indent=2, sort_keys=True).encode()
            files: dict[str, Callable[[Path], None]] = {
                WEIGHTS: lambda p: write_safetensors(p, weights, {"format": "mlx"}),
                OPTIMIZER: lambda p: write_safetensors(p, opt_state, {"format": "mlx"}),
                STATE: lambda p: _write_bytes(p, state),
                ADAPTER_CONFIG: lambda p: _write_bytes(p, adapter + b"\n"),
            }
            written: Checkpoint = write_checkpoint(self.root, step, files, keep=self.config.keep_checkpoints)
            path = written.path
        # Nobody reports (or moves on) before every node's copy is complete.
        self.hb.set(phase=Phase.SYNC)
        self.comm.barrier()
        self.strategy.checkpoint_done(step)
        self.log.emit(EventKind.CHECKPOINT, step=step, path=str(path), sha256=self.strategy.checkpoint_sha256(path),
                      writer=self.strategy.writer())
        self.last_checkpoint = path
        return path

    # -- main ------------------------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.config
        self.hb.set(phase=Phase.LOAD)
        self.init_distributed()
        self.load()
        lock: contextlib.AbstractContextManager[Any] = (
            writer_lock(self.root) if self.is_writer else contextlib.nullcontext())
        with lock:
            if self.is_writer and (stale := remove_stale_temporaries(self.root)):
                self.log.emit(EventKind.WARNING, code="stale_temporaries",
                              message=f"removed unfinished checkpoint dirs: {[str(p) for p in stale]}")
            resumed = self.restore()
            start = 0
            if resumed is not None:
                start = resumed.step
                self.position = resumed.data_position
                self.last_checkpoint = resumed.checkpoint
                self.last_loss = resumed.state.get("last_loss")
            self.check_replicas()
            self.hb.set(step=start)
            self._started(resumed)
            if cfg.steps_per_eval and self.valid_set is None:
                self.log.emit(EventKind.WARNING, code="no_validation_set",
                              message=f"{cfg.data}/valid.jsonl is missing or empty: no eval events")
            self._loop(start)
        self.hb.set(phase=Phase.IDLE)
        self.log.emit(EventKind.FINISHED, step=max(start, cfg.iters), checkpoint=str(self.last_checkpoint),
                      loss=self.last_loss)

    def _started(self, resumed: ResumeState | None) -> None:
        cfg = self.config
        trainable, total, detail = self.strategy.describe()
        spec = cfg.rank_spec(self.rank)
        print(f"worker.train rank {self.rank}/{self.comm.size} on {spec.node}: {trainable_text(trainable, total, detail)}, "
              f"resumed from {resumed.step if resumed else None}; {self.packing[1]}", file=sys.stderr, flush=True)
        self.log.emit(
            EventKind.STARTED, world_size=self.comm.size, node=spec.node, batch_size=spec.batch_size,
            global_batch=cfg.global_batch, method=cfg.method, num_layers=self.num_layers,
            trainable_params=trainable, total_params=total, trainable_pct=100.0 * trainable / max(total, 1),
            trainable=trainable_text(trainable, total, detail), resumed_from=resumed.step if resumed else None,
            data_position=self.position, iters=cfg.iters, pid=os.getpid(), host=socket.gethostname(),
            checkpoint_writer=self.is_writer, checkpoint_dir=str(self.root), train_rows=len(self.train_set),
            valid_rows=len(self.valid_set) if self.valid_set is not None else 0,
            packing=self.packing[0], packing_reason=self.packing[1], **self.strategy.started_fields(),
            **(census_fields(self.census()) if cfg.token_census and self.rank == 0 else {}),
        )

    def census(self) -> StepCensus | None:
        """The run's steps from the data order (`token_census` of them), every rank's slice: a rehearsal's."""
        cfg = self.config
        slices = [(cfg.rank_offset(r), cfg.rank_spec(r).batch_size) for r in range(self.comm.size)]
        return step_census(self.objective, self.train_set, cfg.token_census, cfg.global_batch, cfg.grad_accumulation,
                           slices, cfg.seed)

    def _loop(self, start: int) -> None:
        cfg = self.config
        self.model.train()
        for step in range(start + 1, cfg.iters + 1):
            self.hb.set(step=step, phase=Phase.STEP)
            record = self.train_step(step)
            self.hb.set(step_time=record["step_time_s"])
            # Emitted before the finiteness check: with a NaN loss every rank still reports its local values,
            # which name the rank the NaN came from.
            self.log.emit(EventKind.STEP, **(lie_about(record) if self.chaos.lies(step) else record))
            if not math.isfinite(record["loss"]):
                raise TrainingError(f"loss is {record['loss']} at step {step}: training diverged")
            last = step == cfg.iters
            if cfg.consistency_every and (step % cfg.consistency_every == 0 or last):
                self.hb.set(phase=Phase.DIGEST)
                tic = time.perf_counter()
                digests = self.digests()
                # Its seconds are outside every step's time: what the digests cost shows only here (and in the
                # wall clock), and on a fast GPU a 0.03 s step leaves little to hide them in.
                self.log.emit(EventKind.DIGEST, step=step, digest_s=time.perf_counter() - tic, **digests)
            if cfg.steps_per_eval and (step % cfg.steps_per_eval == 0 or last):
                self.hb.set(phase=Phase.EVAL)
                tic = time.perf_counter()
                val_loss, val_tokens, val_stats = self.evaluate()
                if val_tokens:
                    self.log.emit(EventKind.EVAL, step=step, val_loss=val_loss, val_tokens=val_tokens,
                                  eval_time_s=time.perf_counter() - tic, **val_stats)
            if last or (cfg.save_every and step % cfg.save_every == 0):
                self.save(step)
            self.hb.set(phase=Phase.IDLE)


def _write_bytes(path: Path, data: bytes) -> None:
    path.write_bytes(data)


class _SignalExit:
    """Turn SIGTERM/SIGINT/SIGHUP into an `error` event and exit 128+signal from a watcher thread.

    Python runs signal handlers on the main thread only when it returns to the interpreter, which never happens
    while it waits inside a collective whose peer is gone or stopped. The C-level handler still writes the
    signal number to the wakeup fd, so a thread blocked on that fd reacts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, log: EventLog, heartbeat: Heartbeat, finished: threading.Event) -> None:
        self.log = log
        self.hb = heartbeat
        self.finished = finished
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda _s, _f: None)  # handled by the watcher thread
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signal-exit", daemon=True).start()

    def _watch(self) -> None:
        while True:
            select.select([self._read_fd], [], [])
            data = os.read(self._read_fd, 64)
            for signum in data:
                if signum in {int(s) for s in self.SIGNALS}:
                    self._exit(signum)

    def _exit(self, signum: int) -> None:
        code = 0 if self.finished.is_set() else 128 + signum
        if not self.finished.is_set():
            self.log.emit(EventKind.ERROR, message=f"terminated by {signal.Signals(signum).name}",
                          traceback="", step=self.hb.step, phase=str(self.hb.phase), exit_code=code)
        self.log.close()
        os._exit(code)


def _early_error(config_path: Path, message: str) -> None:
    """A config that does not validate still gets an error event when its run_id/run_dir can be read."""
    print(f"worker.train: {message}", file=sys.stderr)
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        run_dir = Path(os.path.expanduser(raw.get("run_dir") or str(config_path.resolve().parent)))
        rank = int(os.environ.get("MLX_RANK", "0"))
        log = EventLog(events_path(run_dir, rank), str(raw.get("run_id", "")), rank)
    except (OSError, ValueError, AttributeError, TypeError):
        return
    log.emit(EventKind.ERROR, message=message, traceback="", step=0, phase=str(Phase.LOAD), exit_code=1)
    log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker.train", description="per-rank MLX training driver")
    parser.add_argument("--config", required=True, type=Path, help="run config JSON (see worker.runconfig)")
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args.config)
    except (OSError, ConfigError) as exc:
        _early_error(args.config, f"bad config {args.config}: {exc}")
        return 1
    # Workers never download: a model/tokenizer that is not on disk must fail, not fetch from the Hub on N nodes.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kernelcache.isolate()  # before the first compile: no rank loads a kernel file another process is writing
    env_rank = int(os.environ.get("MLX_RANK", "0"))
    share = config.cpu_shares.get(env_rank)
    if share is not None:
        print(f"worker.train rank {env_rank} (its ranks share this machine): "
              + describe_share(*share, take_share(*share)), file=sys.stderr)
    log = EventLog(events_path(config.run_dir, env_rank), config.run_id, env_rank)
    heartbeat = Heartbeat(log, config.heartbeat_s, fence=config.fence)
    finished = threading.Event()
    _SignalExit(log, heartbeat, finished)
    heartbeat.start()
    try:
        Trainer(config, log, heartbeat, env_rank).run()
        finished.set()
        return 0
    except BaseException as exc:  # noqa: BLE001 -- the process boundary: every failure (a library's SystemExit
        # included, which could carry code 0) becomes an error event and exit 1
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        # `fault: job` marks an error every rank hits together because of the job itself (ResumeRefused): the
        # coordinator stops the run instead of quarantining nodes.
        fault = {"fault": exc.fault} if isinstance(exc, ResumeRefused) else {}
        log.emit(EventKind.ERROR, message=f"{type(exc).__name__}: {exc}", traceback=tb, step=heartbeat.step,
                 phase=str(heartbeat.phase), exit_code=1, **fault)
        return 1
    finally:
        heartbeat.stop()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
