"""Several GPUs of one host (issue 27): what was measured on the lent 2x H100 machine, as one script.

    python3 benchmarks/bench_gpus.py stream  --out DIR   # the Stream(gpu, 1) trap: nccl all_sum on the CPU stream
    python3 benchmarks/bench_gpus.py fsdp    --out DIR --model DIR [--steps 3]   # dp vs nn.fully_shard, full FT
    python3 benchmarks/bench_gpus.py dpstep  --out DIR --model DIR --steps 8 --batch 8 --seq 512   # the exchange
    python3 benchmarks/bench_gpus.py launch  --out DIR --root DIR --what lora1,lora2,full2,kill [--iters 20]
    python3 benchmarks/bench_gpus.py drills  --out DIR --root DIR --what attach,invalid,quarantine

`stream` and `fsdp` start one process per GPU themselves (CUDA_VISIBLE_DEVICES = its GPU, MLX_RANK,
MLX_WORLD_SIZE, NCCL_HOST_IP 127.0.0.1, a free NCCL_PORT: what mlx.launch gives nccl ranks) and write
DIR/<mode>.json. `launch` runs `coordinator launch` on a one-node local inventory (backend nccl) on bench_train's M
model (953.8M parameters, batch 8 x 512, long rows, bf16): `lora1` with `gpus: 1`, `lora2` and `full2` on both GPUs
(one rank per GPU), `kill` a LoRA run on both GPUs whose rank 1 is killed at step 6 (`--chaos kill:rank=1,step=6`,
evaluation every 4 steps so rank 1 evaluates before it dies) and resumed by the coordinator. Each run's
summary.json and the ranks' step events give tokens/s (the run's total real tokens per step / the step's time,
median after 3 warm-up steps) and per-rank peak memory (the largest, and each step's); DIR/launch.json collects them.
`BENCH_HEADROOM=null` runs every launch with `train.memory_headroom: null` (no memory bound).
Cells ending in `w` (`lora2w`, `full2w`) are weak scaling: batch 8 per GPU (16 in all) against `lora1`/`full1`'s 8
on one GPU; the others keep the global batch at 8 (strong scaling). `lorafsdp2`: LoRA under fsdp on both GPUs.
`drills` (issue 27's runs on rank nodes; DIR/drills.json): `attach` a LoRA launch on both GPUs whose coordinator is
SIGKILLed after its 3rd step, `coordinator attach` of it, then `coordinator stop` while attach supervises;
`invalid` the old layout (two inventory nodes on one machine, both given GPU 0 by `env: CUDA_VISIBLE_DEVICES`):
NCCL's `invalid usage` must end the job as its error, no relaunch loop; `quarantine` the kill drill (rank 1 killed,
its rank node quarantined), `quarantine list`, a fresh launch (which must leave h100/gpu1 out), `quarantine clear`;
`fsdpckpt` fsdp's sharded checkpoints: a full fine-tune on both GPUs whose rank 1 is killed (re-cut 2 -> 1), the
export of the finished run loaded by mlx_lm, and `--resume` with more steps on both GPUs (re-cut 1 -> 2).
`dpstep` (issue 27's weak-scaling gap) times the worker's own dp step in variants of its gradient exchange
(`worker.exchange`) against one GPU alone.
NCCL_NVLS_ENABLE=0 is set for every process (the lent machine's rule: NVLink multicast stays off).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
os.environ["NCCL_NVLS_ENABLE"] = "0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of `proc`, killed when it outlives `timeout` seconds."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def spawn(mode: str, extra: list[str], world: int = 2, timeout: float = 400.0) -> list[dict[str, Any]]:
    """Run `mode` as `world` ranks, one GPU each; their last stdout JSON lines, by rank."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank), "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(world),
               "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": port, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, __file__, mode, "--as-rank", *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = finish(p, timeout)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        out.append(json.loads(lines[-1]) if lines else {"rc": p.returncode, "stderr": stderr[-1500:]})
    return out


# --- stream: the trap and its fix ------------------------------------------------------------------------------


def stream_rank() -> dict[str, Any]:
    import mlx.core as mx

    group = mx.distributed.init(backend=os.environ.get("BENCH_BACKEND", "nccl"), strict=os.environ.get("BENCH_BACKEND") is None)
    out: dict[str, Any] = {"rank": group.rank()}
    for label, kwargs in (("backend's stream (worker.comm now)", {}), ("stream=mx.cpu (mlx-lm's evaluate)",
                                                                     {"stream": mx.cpu})):
        try:
            y = mx.distributed.all_sum(mx.array([1.0, 2.0]), group=group, **kwargs)
            mx.eval(y)
            out[label] = f"ok {y.tolist()}"
        except Exception as exc:  # noqa: BLE001 -- recorded, that is the measurement
            out[label] = f"{type(exc).__name__}: {exc}"
    # the worker's own Comm on rank 1: what evaluation's loss sums use
    from worker.comm import Comm

    comm = Comm(group)
    out["worker.comm all_sum + gather_floats"] = [comm.all_sum(mx.array([float(group.rank())])).tolist(),
                                                  comm.gather_floats([0.5 + group.rank()])]
    return out


# --- fsdp: dp vs nn.fully_shard on a full fine-tune ------------------------------------------------------------


def fsdp_rank(model_dir: str, steps: int, batch: int, seq: int) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map, tree_map_with_path
    from mlx_lm.utils import load

    group = mx.distributed.init(backend=os.environ.get("BENCH_BACKEND", "nccl"), strict=os.environ.get("BENCH_BACKEND") is None)
    rank, world = group.rank(), group.size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokens = mx.random.randint(0, vocab, (batch * world, seq + 1), key=mx.random.key(0))
    mine = tokens[rank * batch:(rank + 1) * batch]

    def loss_fn(model: Any, x: mx.array) -> mx.array:
        logits = model(x[:, :-1])
        return nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:], reduction="sum")

    for strategy in ("dp", "fsdp", "dp+ckpt", "fsdp+ckpt"):
        if strategy == "dp+ckpt":  # from here on every block is gradient-checkpointed (a class patch: for good)
            from mlx_lm.tuner.trainer import grad_checkpoint

            grad_checkpoint(load(model_dir)[0].model.layers[0])
        mx.clear_cache()
        model, _ = load(model_dir)
        model.unfreeze()
        if strategy.startswith("fsdp"):  # the worker's own sharding (worker.parallel.fsdp)
            from worker.parallel.fsdp import shard_model

            result["wrapped"] = len(shard_model(model, group))
        mx.eval(model.parameters())
        params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        opt = optim.Adam(learning_rate=1e-5)
        opt.init(model.trainable_parameters())  # the state exists before the first step: every step counts it
        mx.eval(opt.state)
        count = mx.array(float(batch * seq * world))
        grad_fn = nn.value_and_grad(model, loss_fn)
        losses, peaks = [], []
        for _ in range(steps):
            mx.synchronize()
            mx.reset_peak_memory()  # the step's own peak: weights, optimizer state, gradients, activations
            loss, grads = grad_fn(model, mine)
            loss = mx.distributed.all_sum(loss, group=group) / count
            # dp: all_sum every gradient; fsdp: the sharded ones arrive reduced (sum_scatter / N) through the
            # gather's vjp, the replicated rest (norms) are all_summed.
            sharded = strategy.startswith("fsdp")
            grads = tree_map_with_path(
                lambda path, g, sharded=sharded: g if sharded and ".module." in path
                else mx.distributed.all_sum(g, group=group) / world, grads)
            grads = tree_map(lambda g: g * (1.0 / (batch * seq)), grads)  # world / global tokens
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
            losses.append(loss.item())
            peaks.append(mx.get_peak_memory())
            del grads, loss  # not alive through the next step
        result[strategy] = {"losses": losses, "peak_bytes": peaks, "active_bytes": mx.get_active_memory(),
                            "local_trainable_params": params}
        del model, opt
    return result


# --- dpstep: where a dp step of several ranks spends its time (the weak-scaling gap) ---------------------------


def dpstep_rank(model_dir: str, steps: int, batch: int, seq: int, what: str = "") -> dict[str, Any]:
    """The worker's own step (worker.step.TrainStep, full fine-tune, Adam) on `batch` rows per rank, timed as the
    run times it, in variants run one after another on the same model: `world1` (each rank alone: the one-GPU
    path, one compiled graph), `split-nocomm` (the several-rank path with an identity all_sum: what the path costs
    without communicating), then the several-rank path over NCCL (worker.exchange): buckets evaluated on their
    own (the CPU's way) of 32 and 256 MiB, 256 MiB ones dispatched as built, fused (no evaluation between the
    backward and the exchange) with evaluated or dispatched buckets, and the device's default; each with
    the run's memory bound (headroom 0.1). Median step seconds after 2 warm-up steps, compute_s (up to the
    collective) and the largest peak of a timed step. `what`: "LABEL,...[@HEADROOM,...]" to run fewer (`none`:
    no bound). (The commit before worker.exchange, d413f8b, also timed hand-built exchanges, `overlap-*`.)"""
    from types import SimpleNamespace

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.utils import load

    import worker.step as ws
    from worker.exchange import Exchange
    from worker.memory import StepMemory

    group = mx.distributed.init(backend=os.environ.get("BENCH_BACKEND", "nccl"), strict=os.environ.get("BENCH_BACKEND") is None)
    rank, world = group.rank(), group.size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    x = mx.random.randint(0, vocab, (batch, seq + 1), key=mx.random.key(rank))
    units = batch * seq

    def loss_fn(model: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        logits = model(x[:, :-1])
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:], reduction="sum")
        return ce, mx.array(units, mx.int32), mx.array(units, mx.int32)

    model, _ = load(model_dir)
    model.unfreeze()
    model.train()
    opt = optim.Adam(learning_rate=1e-6)
    opt.init(model.trainable_parameters())
    mx.eval(model.parameters(), opt.state)
    variants = [("world1", 1, None, None), ("split-nocomm", 2, "identity", Exchange(False, ws.ALL_REDUCE_BYTES)),
                ("evaluated-32MiB", 2, "nccl", Exchange(False, 32 * 1024**2)),
                ("evaluated-256MiB", 2, "nccl", Exchange(False, 256 * 1024**2)),
                ("pipelined-256MiB", 2, "nccl", Exchange(True, 256 * 1024**2)),
                ("fused-256MiB", 2, "nccl", Exchange(False, 256 * 1024**2, fused=True)),
                ("fused-pipelined-256MiB", 2, "nccl", Exchange(True, 256 * 1024**2, fused=True)),
                ("device-default", 2, "nccl", None)]
    labels, _, bounds = what.partition("@")
    if labels:
        variants = [v for v in variants if v[0] in labels.split(",")]
    headrooms = [None if h == "none" else float(h) for h in bounds.split(",")] if bounds else [0.1, None]
    for headroom in headrooms:
        for label, w, comm, exchange in variants:
            reduce = (lambda a: a) if comm == "identity" else (lambda a: mx.distributed.all_sum(a, group=group))
            step = ws.TrainStep(model, opt, loss_fn, all_sum=reduce, world_size=w,
                                memory=StepMemory(headroom, False), exchange=exchange)
            total = units * (world if w > 1 else 1)
            times, computes, peaks = [], [], []
            for i in range(steps + 2):
                if i >= 2:
                    mx.reset_peak_memory()  # after the measuring step (the first), which resets it itself
                done = step.run(lambda t=total: [SimpleNamespace(inputs=(x,), weight=units, total_weight=t)])
                if i >= 2:
                    times.append(done.elapsed)
                    computes.append(done.compute_s)
                    peaks.append(mx.get_peak_memory())
            step.memory.release()
            result[f"{label} headroom={headroom}"] = {
                "step_s": round(statistics.median(times), 5), "compute_s": round(statistics.median(computes), 5),
                "tok_per_s": round(units * (world if w > 1 else 1) / statistics.median(times)),
                "peak_gb": round(max(peaks) / 1e9, 2),
                "exchange": str(step.exchange)}
            del step
            mx.clear_cache()
            print(json.dumps(result), flush=True)
    return result


# --- launch: coordinator runs on the 2-GPU host ----------------------------------------------------------------


def events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / "events" / f"rank{rank}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def write_job(root: Path, name: str, model: Path, data: Path, method: str, iters: int, gpus: int | None,
              chaos: str | None, eval_every: int, split: str, strategy: str = "dp", batch: int = 8,
              nodes: str = "") -> tuple[Path, Path]:
    """The inventory (one local node `h100` with its GPUs, or `nodes` as written) and the playbook of one run."""
    inv = root / f"inv-{name}.yaml"
    inv.write_text("defaults:\n  connection: local\nnodes:\n" + (nodes or (
        f"  - name: h100\n    workdir: {json.dumps(str(root / 'node'))}\n" + (f"    gpus: {gpus}\n" if gpus else ""))))
    pb = root / f"pb-{name}.yaml"
    pb.write_text(f"name: gpus-{name}\nkind: train\nmodel: {json.dumps(str(model))}\ndata: {json.dumps(str(data))}\n"
                  f"backend: {os.environ.get('BENCH_BACKEND', 'nccl')}\nsplit: {split}\nenv:\n  NCCL_NVLS_ENABLE: '0'\ntrain:\n"
                  f"  method: {method}\n  strategy: {strategy}\n  iters: {iters}\n  batch_size: {batch}\n"
                  "  learning_rate: 1.0e-5\n  max_seq_length: 512\n  num_layers: -1\n  optimizer: adam\n  seed: 0\n"
                  + (f"  memory_headroom: {os.environ['BENCH_HEADROOM']}\n" if os.environ.get("BENCH_HEADROOM") else "")
                  + f"  save_every: {4 if chaos else iters}\n  steps_per_eval: {eval_every}\n  val_batches: 1\n"
                  "faults:\n  max_restarts: 2\n  min_nodes: 1\n"
                  "calibration:\n  time_budget: 8\n  max_batch: 8\n")
    return inv, pb


def coord_env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(root / "xdg-cache"),
            "XDG_STATE_HOME": str(root / "xdg-state"), "PYTHONUNBUFFERED": "1"}


def coordinator(root: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """One coordinator command: rc, seconds, stdout (parsed when JSON) and stderr's tail."""
    tic = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "coordinator", *args], env=coord_env(root), cwd=root,
                              capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = None, str(exc.stdout or ""), f"timed out after {timeout} s"
    out: dict[str, Any] = {"args": list(args), "rc": rc, "s": round(time.perf_counter() - tic, 1),
                           "stderr_tail": stderr[-2500:]}
    try:
        out["json"] = json.loads(stdout)
    except json.JSONDecodeError:
        out["stdout_tail"] = stdout[-2500:]
    return out


def launch_one(root: Path, name: str, model: Path, data: Path, method: str, iters: int, gpus: int | None,
               chaos: str | None, eval_every: int, split: str, strategy: str = "dp", batch: int = 8,
               nodes: str = "", timeout: float = 400) -> dict[str, Any]:
    inv, pb = write_job(root, name, model, data, method, iters, gpus, chaos, eval_every, split, strategy, batch, nodes)
    args = ["launch", "-i", str(inv), str(pb), "--json", "--run-dir", str(root / "runs"), "--skip-preflight"] + (
        ["--chaos", chaos] if chaos else [])
    ran = coordinator(root, *args, timeout=timeout)
    out: dict[str, Any] = {"name": name, "command": " ".join(args), "process_s": ran["s"], "rc": ran["rc"],
                           "stderr_tail": ran["stderr_tail"]}
    summary = ran.get("json")
    if not isinstance(summary, dict):
        out["stdout_tail"] = ran.get("stdout_tail")
        return out
    out["summary"] = {k: summary.get(k) for k in ("state", "steps", "tokens_per_s", "predicted_tokens_per_s",
                                                   "split", "attempts", "recoveries", "incidents", "message",
                                                   "quarantined", "resumed_from")}
    ranks = []
    for node in summary.get("nodes") or []:
        run_dir = Path(node["run_dir"])
        for rank in range(4):
            evs = events(run_dir, rank)
            if not evs:
                continue
            steps = [e for e in evs if e.get("event") == "step"]
            rates = [e["total_tokens"] / e["step_time_s"] for e in steps[3:] if e.get("step_time_s")]
            ranks.append({"node": node.get("node") or node.get("name"), "rank": rank,
                          "steps": len(steps), "evals": [e.get("val_loss") for e in evs if e.get("event") == "eval"],
                          "total_tok_per_s_median": statistics.median(rates) if rates else None,
                          "peak_memory": max((e.get("peak_memory") or 0 for e in steps), default=None),
                          "peaks": [e.get("peak_memory") for e in steps][:iters],
                          "losses": [e.get("loss") for e in steps][:iters],
                          "errors": [e.get("message") for e in evs if e.get("event") == "error"]})
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    out["ranks"] = ranks
    return out


def launch(args: argparse.Namespace) -> dict[str, Any]:
    import bench_train as bt

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    size = bt.SIZES[args.size]
    words = bt.make_words(size.vocab - bt.BASE_VOCAB, seed=0)
    env = bt.bench_env(root)
    model = bt.build_model(root, size, words, "bfloat16", env)
    data = bt.build_data(root, size, "long", max(args.iters, 40), words)
    results: dict[str, Any] = {"size": args.size, "iters": args.iters}
    # Calibrated where the split is the point (two GPUs measured each on its own device); `equal` elsewhere, which
    # skips a calibration per run (its cache is per rank node) inside the lease's minutes.
    plan = {"lora1": ("lora", 1, None, args.iters, "equal", "dp", 8),
            "lora2": ("lora", None, None, args.iters, "calibrated", "dp", 8),
            "lora2e": ("lora", None, None, args.iters, "equal", "dp", 8),
            "lora2w": ("lora", None, None, args.iters, "equal", "dp", 16),
            "lorafsdp2": ("lora", None, None, args.iters, "equal", "fsdp", 8),
            "full1": ("full", 1, None, args.iters, "equal", "dp", 8),
            "full2": ("full", None, None, args.iters, "equal", "dp", 8),
            "full2w": ("full", None, None, args.iters, "equal", "dp", 16),
            "fsdp2": ("full", None, None, args.iters, "equal", "fsdp", 8),
            "kill": ("lora", None, "kill:rank=1,step=6", 4, "equal", "dp", 8),
            "killfsdp": ("full", None, "kill:rank=1,step=6", 4, "equal", "fsdp", 8)}
    for name in filter(None, (args.what if args.what is not None else "lora1,lora2,full2,kill").split(",")):
        # "" builds the model and data only
        method, gpus, chaos, eval_every, split, strategy, batch = plan[name]
        bt.log(f"launch {name}")
        results[name] = launch_one(root, name, model, data, method, args.iters if not chaos else 12, gpus, chaos,
                                   eval_every, split, strategy, batch)
        write(Path(args.out) / "launch.json", results)
    return results


def build_inputs(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    import bench_train as bt

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    size = bt.SIZES[args.size]
    words = bt.make_words(size.vocab - bt.BASE_VOCAB, seed=0)
    env = bt.bench_env(root)
    return root, bt.build_model(root, size, words, "bfloat16", env), bt.build_data(root, size, "long", 40, words)


def step_count(root: Path) -> int:
    """Step events of rank 0 of any run under the node workdir (the attach drill runs one at a time)."""
    return max((sum(1 for x in p.read_text().splitlines() if '"event":"step"' in x.replace(" ", ""))
                for p in root.glob("node/**/events/rank0.jsonl")), default=0)


def live_ranks(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [ln.strip()[:160] for ln in ps if "worker.train" in ln and marker in ln]


def wait_for(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.5)
    return False


def drill_attach(root: Path, model: Path, data: Path) -> dict[str, Any]:
    """A 2-GPU LoRA launch, its coordinator SIGKILLed after step 3; `attach`; `stop` while attach supervises."""
    import signal

    shutil.rmtree(root / "node", ignore_errors=True)
    inv, pb = write_job(root, "attach", model, data, "lora", 400, None, None, 100, "equal")
    runs = root / "runs-attach"
    log = (root / "attach-launch.log").open("w")
    launch = subprocess.Popen([sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--run-dir",
                               str(runs), "--skip-preflight", "--json"], env=coord_env(root), cwd=root,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict[str, Any] = {}
    out["reached_step_3"] = wait_for(lambda: step_count(root) >= 3, 240)
    run_ids = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    out["run_ids"] = run_ids
    launch.send_signal(signal.SIGKILL)  # the coordinator alone: its ranks live on (they are not in its group)
    launch.wait()
    log.close()
    out["launch_log_tail"] = (root / "attach-launch.log").read_text()[-1500:]
    if not run_ids:
        return out
    run_id = run_ids[-1]
    time.sleep(2)
    out["ranks_alive_after_kill"] = live_ranks(run_id)
    at_kill = step_count(root)
    attach = subprocess.Popen([sys.executable, "-m", "coordinator", "attach", run_id, "--run-dir", str(runs),
                               "--json"], env=coord_env(root), cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    out["steps_at_kill"] = at_kill
    out["steps_grew_under_attach"] = wait_for(lambda: step_count(root) >= at_kill + 3, 120)
    out["stop"] = coordinator(root, "stop", run_id, "--run-dir", str(runs), timeout=180)
    stdout, stderr = finish(attach, 180)
    out["attach_rc"] = attach.returncode
    out["attach_stderr_tail"] = stderr[-2500:]
    try:
        summary = json.loads(stdout)
        out["attach_summary"] = {k: summary.get(k) for k in ("state", "steps", "attempts", "message", "incidents",
                                                               "quarantined")}
    except json.JSONDecodeError:
        out["attach_stdout_tail"] = stdout[-1500:]
    out["ranks_alive_after_stop"] = live_ranks(run_id)
    out["status"] = coordinator(root, "status", "-i", str(inv), "--json", timeout=60).get("rc")
    return out


def drill_real_quarantine(root: Path, model: Path, data: Path) -> dict[str, Any]:
    """A real fault (not --chaos, which persists no quarantine): rank 1's process SIGKILLed from outside at step 6
    of a 2-GPU LoRA launch; the run must relaunch on gpu0 and quarantine h100/gpu1; `quarantine list`; a fresh
    launch (must leave h100/gpu1 out); `quarantine clear h100/gpu1`; `quarantine list`."""
    import signal

    shutil.rmtree(root / "node", ignore_errors=True)
    inv, pb = write_job(root, "realq", model, data, "lora", 24, None, "x", 100, "equal")  # chaos "x": save every 4
    runs = root / "runs-realq"
    log_path = root / "realq-launch.log"
    with log_path.open("w") as log:
        launch = subprocess.Popen([sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--run-dir",
                                   str(runs), "--skip-preflight", "--json"], env=coord_env(root), cwd=root,
                                  stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        out: dict[str, Any] = {"reached_step_6": wait_for(lambda: step_count(root) >= 6, 240)}
        victims = [ln.split()[0] for ln in live_ranks("gpu1/run.json")]
        out["killed"] = victims
        for pid in victims:
            os.kill(int(pid), signal.SIGKILL)
        stdout, _ = finish(launch, 240)
    out["launch_rc"] = launch.returncode
    out["launch_log_tail"] = log_path.read_text()[-2500:]
    try:
        summary = json.loads(stdout)
        out["summary"] = {k: summary.get(k) for k in ("state", "steps", "attempts", "recoveries", "message",
                                                       "quarantined", "split")}
        out["incidents"] = [{k: i.get(k) for k in ("kind", "node", "rank", "step", "action")}
                            for i in summary.get("incidents") or []]
    except json.JSONDecodeError:
        out["stdout_tail"] = stdout[-1500:]
    out["list"] = coordinator(root, "quarantine", "list", "-i", str(inv), "--json", timeout=60)
    out["fresh"] = launch_one(root, "realq", model, data, "lora", 6, None, None, 6, "equal")  # the same inventory
    out["clear"] = coordinator(root, "quarantine", "clear", "h100/gpu1", "-i", str(inv), timeout=60)
    out["list_after_clear"] = coordinator(root, "quarantine", "list", "-i", str(inv), "--json", timeout=60)
    return out


def checkpoint_tree(run_dir: Path) -> dict[str, Any]:
    """{relative dir: MB} of every step dir of a run's checkpoints (fsdp: one `stage-<rank>` shard per rank)."""
    ck = run_dir / "checkpoints"
    return {str(d.relative_to(ck)): round(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 1e6, 1)
            for d in sorted(ck.glob("**/step-*")) if d.is_dir()} if ck.is_dir() else {}


def drill_fsdp_checkpoints(root: Path, model: Path, data: Path) -> dict[str, Any]:
    """fsdp's sharded checkpoints on the GPUs: a 2-GPU full fine-tune (saves every 4) whose rank 1 is killed at
    step 6 resumes on what is left (2 shards re-cut onto 1 rank); `coordinator export` of the finished run, loaded by
    mlx_lm; then `--resume` of that run with more steps on both GPUs (1 rank's shard re-cut onto 2)."""
    shutil.rmtree(root / "node", ignore_errors=True)
    runs = root / "runs-ckpt"
    inv, pb = write_job(root, "ckpt", model, data, "full", 12, None, "x", 100, "equal", "fsdp")
    base = ["-i", str(inv), "--run-dir", str(runs), "--json"]
    out: dict[str, Any] = {}
    first = coordinator(root, "launch", str(pb), *base, "--skip-preflight", "--chaos", "kill:rank=1,step=6",
                        timeout=300)
    summary = first.get("json") or {}
    out["killed"] = {k: summary.get(k) for k in ("state", "steps", "attempts", "recoveries", "incidents",
                                                  "resumed_from", "message", "split")}
    run_id = summary.get("run_id")
    node_dirs = [Path(n["run_dir"]) for n in summary.get("nodes") or []]
    out["tree_after_kill"] = {str(d): checkpoint_tree(d) for d in node_dirs}
    if not run_id:
        out["first"] = first
        return out
    exported = root / "export-ckpt"
    shutil.rmtree(exported, ignore_errors=True)
    out["export"] = coordinator(root, "export", run_id, *base, "--out", str(exported), timeout=300)
    probe = ("import sys, mlx.core as mx; from mlx_lm import load; m, t = load(sys.argv[1]); "
             "ids = mx.array([t.encode('the quick brown fox jumps')]); "
             "print(sorted(p.name for p in __import__('pathlib').Path(sys.argv[1]).iterdir()), "
             "m(ids).shape, float(m(ids).astype(mx.float32).abs().mean()))")
    loaded = subprocess.run([sys.executable, "-c", probe, str(exported)], capture_output=True, text=True,
                            timeout=180)
    out["mlx_lm_load"] = {"rc": loaded.returncode, "stdout": loaded.stdout[-800:], "stderr": loaded.stderr[-800:]}
    _, pb16 = write_job(root, "ckpt", model, data, "full", 16, None, "x", 100, "equal", "fsdp")
    again = coordinator(root, "launch", str(pb16), *base, "--skip-preflight", "--resume", run_id, timeout=300)
    summary = again.get("json") or {}
    out["resumed"] = {k: summary.get(k) for k in ("state", "steps", "attempts", "recoveries", "incidents",
                                                   "resumed_from", "message", "split")}
    out["resumed_stderr_tail"] = again.get("stderr_tail")
    out["tree_after_resume"] = {str(d): checkpoint_tree(d) for d in node_dirs}
    return out


def drills(args: argparse.Namespace) -> dict[str, Any]:
    root, model, data = build_inputs(args)
    results: dict[str, Any] = {}
    for name in filter(None, (args.what or "").split(",")):
        tic = time.perf_counter()
        if name == "attach":
            results[name] = drill_attach(root, model, data)
        elif name == "invalid":
            # The layout before one rank per GPU: two inventory nodes on one machine, both on GPU 0.
            nodes = "".join(f"  - name: {n}\n    workdir: {json.dumps(str(root / ('node-' + n)))}\n    gpus: 1\n"
                            "    env:\n      CUDA_VISIBLE_DEVICES: '0'\n" for n in ("a", "b"))
            results[name] = launch_one(root, "invalid", model, data, "lora", 6, None, None, 6, "equal", nodes=nodes,
                                       timeout=300)
        elif name == "realq":
            results[name] = drill_real_quarantine(root, model, data)
        elif name == "fsdpckpt":
            results[name] = drill_fsdp_checkpoints(root, model, data)
        elif name == "quarantine":
            q: dict[str, Any] = {"kill": launch_one(root, "kill", model, data, "lora", 12, None, "kill:rank=1,step=6", 4,
                                                    "equal")}
            inv = str(root / "inv-kill.yaml")
            q["list"] = coordinator(root, "quarantine", "list", "-i", inv, "--json", timeout=60)
            q["fresh"] = launch_one(root, "fresh", model, data, "lora", 6, None, None, 6, "equal")
            q["clear"] = coordinator(root, "quarantine", "clear", "h100/gpu1", "-i", inv, timeout=60)
            q["list_after_clear"] = coordinator(root, "quarantine", "list", "-i", inv, "--json", timeout=60)
            results[name] = q
        results[name]["drill_s"] = round(time.perf_counter() - tic, 1)
        write(Path(args.out) / "drills.json", results)
    return results


def write(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["stream", "fsdp", "dpstep", "launch", "drills"])
    p.add_argument("--as-rank", action="store_true")
    p.add_argument("--out", default="bench-gpus-out")
    p.add_argument("--model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="rows per rank (fsdp)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--root", default="/tmp/bench-gpus")
    p.add_argument("--what", default=None, help="launch: runs (lora1,lora2,full2,kill); drills: drills; dpstep: "
                   "variants[@headrooms]")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--size", default="M")
    args = p.parse_args()
    if args.as_rank:
        rank_fn = {"stream": lambda: stream_rank(),
                   "fsdp": lambda: fsdp_rank(args.model, args.steps, args.batch, args.seq),
                   "dpstep": lambda: dpstep_rank(args.model, args.steps, args.batch, args.seq,
                                                        args.what or "")}[args.mode]
        result = rank_fn()
        print(json.dumps(result), flush=True)
        return 0
    if args.mode == "launch":
        launch(args)
        return 0
    if args.mode == "drills":
        drills(args)
        return 0
    extra = [] if args.mode == "stream" else ["--model", args.model, "--steps", str(args.steps), "--batch",
                                              str(args.batch), "--seq", str(args.seq)]
    extra += ["--what", args.what] if args.mode == "dpstep" and args.what else []
    result = spawn(args.mode, extra)
    write(Path(args.out) / f"{args.mode}.json", result)
    print(json.dumps(result, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
