"""Calibrate the fleet: run `worker.bench` on every node in parallel and cache the curves here, coordinator side.

The I/O shell around `coordinator.planning.plan`. Per connected node: ship the worker package, run
`env [JOB_ENV + NODE_ENV...] sh -c 'PYTHONPATH=<worker dir>${PYTHONPATH:+:$PYTHONPATH} ...' <python> -m worker.bench`
(training's environment: `build_bench_argv`) over the node's own connection, stream its stderr for progress,
parse the one JSON object it prints, and store it under `cache_dir` keyed by `compute_cache_key` (node, hardware
fingerprint with the GPU model and count, mlx version and backends, model digest, every bench parameter that
changes the curve, the job's MLX_* env). A cached curve is reused unless `recalibrate`; a node whose hardware is
unknown is never cached (two different machines could then share a key).

Two allowances per node: `time_budget` bounds the timed steps only; `one_time_budget` bounds what a cold machine
pays once (importing mlx, loading the model, the first, compiling, step of each batch shape). They are reported
apart, so a first run on a machine whose MLX kernel cache is empty measures the same curve as a warm one.

Failure semantics: one node's failure (ship failed, bench error JSON, no JSON, non-zero exit, timeout after
`time_budget + one_time_budget + TIMEOUT_SLACK_S`) is that node's result: a `CoordinatorError` value in the
returned dict, never an exception that stops the other nodes. The bench bounds its own run with a watchdog, so a
remote bench does not outlive its budget even when the SSH channel is dropped on our timeout. A cache file that
cannot be read is a miss; one that cannot be written is reported through `progress` and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import CoordinatorError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.ship import ship_worker, worker_bundle
from coordinator.fleet.transport import Fleet, Transport, build_worker_argv, merge_lines
from coordinator.models import Node
from coordinator.planning.collective import parse_gradient_size
from coordinator.planning.colocate import Barrier, BenchGroup, MemberState, pool_curves
from coordinator.planning.pipeline import LayerMemory, LayerTiming, TimingSource
from coordinator.planning.plan import CurvePoint, NodeCalibration, Plan, PlanError, SplitMode
from coordinator.planning.strategy import StrategyChoice
from coordinator.run.rundir import RATE_UNITS, CurveRecord, PlanNode

# 3: the run's steps sampled over the data, a point's rate the run's median step rate; 2: the run's step on its
# first batches (rows_per_s, tokens_per_row); 1 timed random tokens
CACHE_SCHEMA = 3
# Runs of at most this many steps are sampled on their own steps (`sample_horizon`): past it a run's median step
# rate is within a few percent of its data's (the steps are a random draw of the epoch's).
HORIZON_STEPS = 1000
# Beyond the bench's own budget: SSH exec, python start-up and the output. The bench's watchdog ends it anyway.
TIMEOUT_SLACK_S = 30.0
DEFAULT_ONE_TIME_BUDGET = 600.0  # imports, model load, first compile of each shape: a cold GPU took 85 s for 10 steps
STDERR_TAIL_LINES = 20

Progress = Callable[[str, str], None]  # (node name, progress line without its newline)


class CalibrationError(CoordinatorError):
    """The bench on one node failed or printed something that is not a calibration. `evidence` is the tail of
    its stderr (or the offending output)."""

    def __init__(self, node: str, message: str, *, evidence: str = "") -> None:
        self.node = node
        self.evidence = evidence
        super().__init__(f"{node}: {message}")


@dataclass(frozen=True)
class NodeFingerprint:
    """What makes one node's curve valid: the hardware and software it was measured on. On a Linux node the GPU
    model and count come from nvidia-smi (a node whose GPU was swapped is measured again) and the mlx backend
    distributions from the probe (mlx-cpu and mlx-cuda-13 of one mlx version are different speeds)."""

    chip: str | None
    model_id: str | None
    memory_bytes: int | None
    cpu_count: int | None
    gpu_cores: int | None
    os_version: str | None
    mlx_version: str | None
    gpu_model: str | None = None  # "NVIDIA H100 80GB HBM3" (nvidia-smi); None without an NVIDIA GPU
    gpu_count: int = 0
    gpu_memory_bytes: int | None = None  # per GPU (the first's): the memory limit the bench fills
    mlx_backends: tuple[str, ...] = ()  # "mlx-cuda-13==0.32.4", sorted

    @property
    def known(self) -> bool:
        """Enough to tell a different machine apart: a chip or model id, and the memory size."""
        return bool((self.chip or self.model_id) and self.memory_bytes)


def fingerprint_from_facts(facts: NodeFacts) -> NodeFingerprint:
    """The fingerprint of a node from its gathered facts (missing sections leave None fields)."""
    hw, os_info, sw = facts.hardware, facts.os, facts.software
    os_version = None
    if os_info is not None:
        os_version = f"{os_info.name} {os_info.version}" + (f" ({os_info.build})" if os_info.build else "")
    cuda = facts.gpu.devices if facts.gpu is not None else ()
    names = sorted({d.name for d in cuda})
    backends = sw.mlx_backends if sw is not None and sw.mlx_backends else {}
    return NodeFingerprint(
        gpu_model=" + ".join(names) or None,
        gpu_count=len(cuda),
        gpu_memory_bytes=cuda[0].memory_total_bytes if cuda else None,
        mlx_backends=tuple(sorted(f"{d}=={v}" for d, v in backends.items())),
        chip=hw.chip if hw else None,
        model_id=hw.model_id if hw else None,
        memory_bytes=(hw.memory_bytes if hw else None) or (facts.memory.total_bytes if facts.memory else None),
        cpu_count=hw.cpu_total if hw else None,
        gpu_cores=hw.gpu_cores if hw else None,
        os_version=os_version,
        mlx_version=sw.mlx_version if sw else None,
    )


@dataclass(frozen=True)
class BenchSpec:
    """What to measure: the run's step on the run's batches (from the playbook: `model`, `data`, `train.*`).
    `model` and `data` are directories as the nodes see them; `data` "" times random tokens instead."""

    model: str
    seq_len: int
    method: str
    num_layers: int = 16
    grad_checkpoint: bool = False
    max_batch: int = 64
    memory_fraction: float = 0.8
    data: str = ""
    mask_prompt: bool = False
    packing: str = "auto"
    global_batch: int = 0
    # The run's steps whose rows the bench samples (`worker.bench --steps`, `sample_horizon`); 0: the first epoch.
    steps: int = 0
    seed: int = 0
    optimizer: str = "adam"
    learning_rate: float = 1e-5
    lora: tuple[int, float, float] = (8, 20.0, 0.0)  # rank, scale, dropout
    train_embeddings: bool = False
    clear_cache: bool = False
    memory_headroom: float | None = 0.1  # train.memory_headroom (worker/memory.py); None: unbounded
    world_size: int = 1  # the run's ranks: one takes the step as one compiled graph, several in two
    # Pipeline stages: > 0 times `blocks` transformer blocks alone (plus the embedding and the head) at
    # `micro_batch` rows (`worker.bench --blocks K --micro-batch MB`), so a node that cannot hold the whole model
    # is measured too. 0: the whole model's curve.
    blocks: int = 0
    micro_batch: int = 1
    # The job env every rank gets (`Playbook.job_env()`), sorted: the bench runs in training's environment.
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in ("lora", "dora", "full"):
            raise ValueError(f"unknown training method {self.method!r}: lora, dora or full")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")


# ----------------------------------------------------------------------------------------------------------------
# Pure parts.


def sample_horizon(iters: int, grad_accumulation: int = 1) -> int:
    """The steps (micro-batches of the global batch) whose rows calibration samples for a run of `iters` steps:
    all of them for a run of at most HORIZON_STEPS steps, whose median tokens/s is that of its own few steps (the
    bench times its actual batches); 0 (the whole first epoch) for a longer one, whose steps are drawn from the
    shuffled epoch so many times that the data's median is theirs. A short run's horizon is in the cache key (a
    run of another length is measured again); long runs share one curve."""
    return iters * grad_accumulation if iters <= HORIZON_STEPS else 0


def compute_cache_key(node: str, fingerprint: NodeFingerprint, spec: BenchSpec, model_digest: str,
                      worker_digest: str = "", *, together: Sequence[str] = (), pinned: bool = False) -> str:
    """Digest of everything that changes a node's curve, the worker code that takes the step included (a new
    step is measured again, never predicted from the old one's curve), and the nodes it was measured beside
    (`together`: the others of its machine; a curve measured alone is not one measured under their load; `pinned`:
    each on its own slice of the machine's CPUs, as their ranks will run, not left to the scheduler). The
    time budget is left out on purpose: it only decides how far a sweep got, not what its points mean
    (`--recalibrate` measures again)."""
    inputs = {
        "schema": CACHE_SCHEMA,
        "worker": worker_digest,
        "node": node,
        "fingerprint": asdict(fingerprint),
        "model_digest": model_digest,
        "seq_len": spec.seq_len,
        "method": spec.method,
        "num_layers": spec.num_layers,
        "grad_checkpoint": spec.grad_checkpoint,
        "max_batch": spec.max_batch,
        "memory_fraction": spec.memory_fraction,
        "batches": [spec.data, spec.mask_prompt, spec.packing, spec.global_batch, spec.seed],
        "step": [spec.optimizer, spec.learning_rate, list(spec.lora), spec.train_embeddings, spec.world_size > 1,
                 *([True] if spec.clear_cache else []),  # only when set: the keys of cached curves stay
                 {"memory_headroom": spec.memory_headroom}],
        # MLX_* variables change what mlx does (TF32, graphs, buffer sizes); others (logging, tokens) do not.
        "mlx_env": [[k, v] for k, v in spec.env if k.startswith("MLX_")],
        **({"blocks": [spec.blocks, spec.micro_batch]} if spec.blocks else {}),  # only when set: old keys stay
        **({"steps": spec.steps} if spec.data and spec.steps else {}),  # only a short run's: long runs share a curve
    }
    if together:  # only when set: the keys of nodes alone on their machine stay
        inputs["together"] = sorted(together)
    if pinned:
        inputs["pinned"] = True
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def build_bench_argv(node: Node, worker_dir: str, spec: BenchSpec, time_budget: float,
                     one_time_budget: float = DEFAULT_ONE_TIME_BUDGET, *, lockstep: bool = False,
                     cpu_share: tuple[int, int] | None = None) -> list[str]:
    """The remote command, in the environment a rank of the training gets (`launchfiles.build_rank_script`): the job env
    overlaid with the node's inventory env, and the worker dir prepended to the PYTHONPATH that leaves (the node's
    own when neither sets one), through the same `pythonpath_prepend`. `cpu_share`: the slice of its machine's CPUs
    the bench takes, as the node's rank will (`colocate.BenchGroup.member_shares`)."""
    env = sorted({**dict(spec.env), **node.env_dict}.items())
    return build_worker_argv(
        node.python, worker_dir, env, "-m", "worker.bench",
        "--model", spec.model,
        "--seq-len", str(spec.seq_len),
        "--method", spec.method,
        "--num-layers", str(spec.num_layers),
        *(["--grad-checkpoint"] if spec.grad_checkpoint else []),
        *(["--data", spec.data, "--packing", spec.packing, "--global-batch", str(spec.global_batch)]
          if spec.data else []),
        *(["--steps", str(spec.steps)] if spec.data and spec.steps else []),
        *(["--mask-prompt"] if spec.mask_prompt else []),
        "--seed", str(spec.seed),
        "--world-size", str(spec.world_size),
        "--optimizer", spec.optimizer,
        "--learning-rate", f"{spec.learning_rate:g}",
        "--lora-rank", str(spec.lora[0]), "--lora-scale", f"{spec.lora[1]:g}", "--lora-dropout", f"{spec.lora[2]:g}",
        *(["--train-embeddings"] if spec.train_embeddings else []),
        *(["--clear-cache"] if spec.clear_cache else []),
        "--memory-headroom", "none" if spec.memory_headroom is None else f"{spec.memory_headroom:g}",
        "--time-budget", f"{time_budget:g}",
        "--one-time-budget", f"{one_time_budget:g}",
        "--max-batch", str(spec.max_batch),
        "--memory-fraction", f"{spec.memory_fraction:g}",
        *(["--blocks", str(spec.blocks), "--micro-batch", str(spec.micro_batch)] if spec.blocks else []),
        *(["--lockstep"] if lockstep else []),
        *(["--cpu-share", f"{cpu_share[0]}/{cpu_share[1]}"] if cpu_share is not None else []),
    )


def parse_bench_stdout(node: str, stdout: str) -> dict[str, Any]:
    """The bench's JSON object: the last stdout line that is a JSON object (the bench keeps its stdout clean, but a
    site's shell profile may print). Raises CalibrationError when there is none."""
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not text.startswith("{"):
            continue
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise CalibrationError(node, "the bench printed no JSON result", evidence=stdout[-2000:])


def _number(node: str, obj: Mapping[str, Any], key: str, *, optional: bool = False) -> float | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CalibrationError(node, f"bench result field {key!r} is not a number: {value!r}")
    return float(value)


def calibration_from_bench(node: str, obj: Mapping[str, Any], *, cached: bool = False) -> NodeCalibration:
    """A `NodeCalibration` from the bench's JSON object. Raises CalibrationError on `{"error": ...}` or on any
    missing or malformed field (with the field named)."""
    if "error" in obj:
        raise CalibrationError(node, f"bench failed: {obj['error']}", evidence=json.dumps(obj)[:2000])
    raw_curve = obj.get("curve")
    if not isinstance(raw_curve, list) or not raw_curve:
        raise CalibrationError(node, f"bench result has no curve: {str(raw_curve)[:200]}")
    points = []
    seq_len = _number(node, obj, "seq_len", optional=True)
    data_per_row = _number(node, obj, "tokens_per_row", optional=True)
    raws: list[tuple[float, float, float, float | None]] = []
    for raw in raw_curve:
        if not isinstance(raw, dict):
            raise CalibrationError(node, f"bench curve point is not an object: {raw!r}")
        batch, rate, peak = (_number(node, raw, k) for k in ("batch", "tokens_per_s", "peak_memory"))
        assert batch is not None and rate is not None and peak is not None
        raws.append((batch, rate, peak, _number(node, raw, "tokens_per_row", optional=True)))
    # The plan splits rows of `seq_len`: its rates are rows x seq_len per second, and the data's fill (real tokens
    # per row / seq_len: the bench's sample of the run's first rows, else its points' mean) turns them back into
    # real tokens. A point's real rate is the run's median step rate at that batch, so its plan rate is that / fill.
    fills = [per_row / seq_len for _, _, _, per_row in raws if per_row and seq_len]
    fill = data_per_row / seq_len if data_per_row and seq_len else (sum(fills) / len(fills) if fills else 1.0)
    noisy: list[int] = []
    for (batch, rate, peak, per_row), raw in zip(raws, raw_curve, strict=True):
        if per_row and seq_len:
            rate = rate / fill
        if raw.get("noisy") is True:
            noisy.append(int(batch))
        points.append(CurvePoint(batch=int(batch), tokens_per_s=rate, peak_memory=int(peak)))
    device = obj.get("device")
    seconds = _number(node, obj, "seconds", optional=True)
    limit = _number(node, obj, "memory_limit", optional=True)
    matmul = _number(node, obj, "matmul_gflops", optional=True)
    one_time = _number(node, obj, "one_time_total_s", optional=True)
    measuring = _number(node, obj, "measure_s", optional=True)
    try:
        return NodeCalibration(
            node=node,
            curve=tuple(sorted(points, key=lambda p: p.batch)),
            matmul_gflops=matmul or 0.0,
            memory_limit=int(limit) if limit else None,
            seq_len=int(seq_len) if seq_len else None,
            method=str(obj["method"]) if obj.get("method") is not None else None,
            stopped_because=str(obj["stopped_because"]) if obj.get("stopped_because") is not None else None,
            seconds=seconds,
            one_time_s=one_time,
            measure_s=measuring,
            fill=fill,
            noisy=tuple(noisy),
            device=tuple(sorted(device.items())) if isinstance(device, dict) else (),
            cached=cached,
            gradients=parse_gradient_size(obj.get("gradients")),
        )
    except PlanError as exc:
        raise CalibrationError(node, f"bench result is not a usable curve: {exc}") from exc


def layer_timing_from_bench(node: str, obj: Mapping[str, Any]) -> LayerTiming:
    """A `LayerTiming` from `worker.bench --blocks K --micro-batch MB`'s JSON object, whose contract is
    `{"blocks": K, "micro_batch": MB, "block_s": s, "block_fused_s": s, "embed_s": s, "head_s": s,
    "update_s": s, "block_bytes": B, "backward_bytes": B, "update_bytes": B, "input_bytes": B, "embed_bytes": B,
    "head_bytes": B, ...}`: seconds per micro-batch, forward + backward (`block_s` per block of a stage that
    recomputes its forward in the backward, `block_fused_s` per block of the last stage), the update per block,
    and the memory `LayerMemory` holds (the last seven optional: an older worker's answer has none). Raises
    CalibrationError on `{"error": ...}` or a missing or malformed field (named)."""
    if "error" in obj:
        raise CalibrationError(node, f"bench failed: {obj['error']}", evidence=json.dumps(obj)[:2000])
    if not isinstance(obj.get("blocks"), int) or obj["blocks"] < 1:
        raise CalibrationError(node, f"the bench timed no blocks (blocks {obj.get('blocks')!r}): its worker has no "
                               "per-block mode (worker.bench --blocks)")
    block_s, embed_s, head_s, micro = (_number(node, obj, k) for k in ("block_s", "embed_s", "head_s", "micro_batch"))
    assert block_s is not None and embed_s is not None and head_s is not None and micro is not None
    fused = _number(node, obj, "block_fused_s", optional=True)
    update = _number(node, obj, "update_s", optional=True)
    # Memory (an older worker's answer has none: the planner's estimate then stands).
    sizes = [_number(node, obj, k, optional=True) for k in ("block_bytes", "backward_bytes", "update_bytes",
                                                              "input_bytes", "embed_bytes", "head_bytes")]
    known = [int(v) for v in sizes if v is not None]
    memory = LayerMemory(int(micro), *known) if len(known) == len(sizes) else None
    try:
        return LayerTiming(node, int(micro), block_s, embed_s, head_s, TimingSource.BLOCKS, last_layer_s=fused,
                           update_s=update or 0.0, memory=memory)
    except PlanError as exc:
        raise CalibrationError(node, f"bench result is not a usable timing: {exc}") from exc


def build_plan_nodes(
    plan: Plan, calibrations: Mapping[str, NodeCalibration] | Sequence[NodeCalibration]
) -> tuple[PlanNode, ...]:
    """Each planned node's `PlanNode` in the plan's (rank) order: `tokens_per_s` is its predicted rate at its
    planned batch (what its share is proportional to); `curve` is what was measured. Raises PlanError when a
    planned node has no calibration."""
    by_name = dict(calibrations) if isinstance(calibrations, Mapping) else {c.node: c for c in calibrations}
    missing = [n for n in plan.batch if n not in by_name]
    if missing:
        raise PlanError(f"no calibration for planned node(s): {', '.join(missing)}")
    return tuple(PlanNode(node=name, tokens_per_s=round(plan.node_tokens_per_s(name) or 0.0, 3), batch_size=batch,
                          share=plan.split[name],
                          curve=tuple(CurveRecord(p.batch, p.tokens_per_s, p.peak_memory) for p in by_name[name].curve))
                 for name, batch in plan.batch.items())


def plan_step_json(plan: Plan) -> dict[str, Any]:
    """The predicted step in parts (plan.json's and `calibrate --json`'s `step`): the slowest node's compute, the
    gradient exchange (null where none is in the prediction) and its share of the step."""
    return {"predicted_s": round(plan.predicted_step_s, 6), "compute_s": round(plan.compute_step_s, 6),
            "collective": plan.collective.to_json() if plan.collective is not None else None,
            "collective_share": round(plan.collective_share, 4),
            "rehearsal": plan.rehearsal.to_json() if plan.rehearsal is not None else None}


def calibration_to_json(
    plan: Plan, calibrations: Mapping[str, NodeCalibration] | Sequence[NodeCalibration],
    strategy: StrategyChoice | None = None,
) -> dict[str, Any]:
    """`calibrate --json`: `{"nodes": [PlanNode...], "split": {node: share}, "units"}` plus, where the strategy was
    weighed, `"strategy"` (docs/json.md); PlanError as `build_plan_nodes`."""
    rows = build_plan_nodes(plan, calibrations) if plan.mode != SplitMode.PIPELINE else ()  # stages: `strategy`
    return {"nodes": [n.to_json() for n in rows], "split": dict(plan.split),
            "predicted_tokens_per_s": round(plan.predicted_tokens_per_s, 3), "step": plan_step_json(plan),
            "units": {k: v for k, v in RATE_UNITS.items() if k != "predicted_tokens_per_s"},
            **({"strategy": strategy.to_json()} if strategy is not None else {})}


def describe_bench_time(obj: Mapping[str, Any]) -> str:
    """One line: how long measuring took and, apart, what the node paid once (import, load, first compiles)."""
    curve = obj.get("curve") or []
    parts = [f"measured {len(curve)} point(s) in {float(obj.get('measure_s') or 0):.1f}s of timed steps"]
    one_time = obj.get("one_time_s")
    total = obj.get("one_time_total_s")
    if isinstance(one_time, dict) and isinstance(total, int | float):
        firsts = one_time.get("first_steps") or {}
        first_s = sum(v for v in firsts.values() if isinstance(v, int | float)) if isinstance(firsts, dict) else 0.0
        details = [f"{k} {v:.1f}s" for k, v in one_time.items() if k != "first_steps" and isinstance(v, int | float)]
        details.append(f"first step of each batch shape {first_s:.1f}s")
        parts.append(f"one-time {total:.1f}s ({', '.join(details)})")
    parts.append(f"stopped: {obj.get('stopped_because')}")
    packing = obj.get("packing")
    if isinstance(packing, list) and len(packing) == 2:
        parts.append(str(packing[1]))
    noisy = [p.get("batch") for p in curve if isinstance(p, dict) and p.get("noisy") is True]
    if noisy:
        parts.append(f"NOISY at batch {', '.join(map(str, noisy))} (steps disagreed by more than 25% even when "
                     "measured again: the node was busy; the plan may be off)")
    return "; ".join(parts)


def describe_reuse(cal: NodeCalibration) -> str:
    """What a reused curve carries along: "" for a clean one; for one measured noisy, that fact and the flag that
    measures it again (said on every reuse: a busy moment must not become the plan's truth silently)."""
    if not cal.noisy:
        return ""
    return (f"; it was NOISY when measured (batch {', '.join(map(str, cal.noisy))}: the machine was busy), so the "
            "split may be off: measure again on a quiet machine with --recalibrate")


def build_cache_record(key: str, node: str, bench: Mapping[str, Any]) -> dict[str, Any]:
    return {"schema": CACHE_SCHEMA, "key": key, "node": node, "saved_at": time.time(), "bench": dict(bench)}


def cached_bench(key: str, text: str) -> dict[str, Any] | None:
    """The bench answer a cache record holds, or None when the record is unreadable, from another schema or key (a
    miss)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("schema") != CACHE_SCHEMA or record.get("key") != key:
        return None
    bench = record.get("bench")
    return bench if isinstance(bench, dict) else None


def parse_cache_record(node: str, key: str, text: str) -> NodeCalibration | None:
    """A cached calibration, or None (a miss: `cached_bench`, or a bench answer that no longer parses)."""
    if (bench := cached_bench(key, text)) is None:
        return None
    try:
        return calibration_from_bench(node, bench, cached=True)
    except CalibrationError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# I/O.


def _cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"calibration-{key}.json"


def _read_cache(cache_dir: Path, node: str, key: str) -> NodeCalibration | None:
    try:
        text = _cache_path(cache_dir, key).read_text(encoding="utf-8")
    except OSError:
        return None
    return parse_cache_record(node, key, text)


def _write_cache(cache_dir: Path, key: str, node: str, bench: Mapping[str, Any]) -> None:
    """Atomic (temp file + rename): a crash never leaves half a record for the next run to trust."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = _cache_path(cache_dir, key)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(build_cache_record(key, node, bench), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class GroupGate:
    """The I/O half of one group's lockstep (`coordinator.planning.colocate.Barrier`): it holds each member's bench
    stdin and writes `go` to the members the barrier releases; once every member is done it closes them all (the
    lingering benches then end). Writes to a bench that is gone are ignored: its end is its `finish`."""

    def __init__(self, members: Sequence[str]) -> None:
        self.barrier = Barrier(members)
        self.stdin: dict[str, Any] = {}

    def attach(self, member: str, stdin: Any) -> None:
        self.stdin[member] = stdin

    def wait(self, member: str) -> None:
        self._send(self.barrier.wait(member))

    def finish(self, member: str) -> None:
        if self.barrier.state[member] == MemberState.DONE:
            return
        self._send(self.barrier.finish(member))
        if self.barrier.all_done:
            for pipe in self.stdin.values():
                with contextlib.suppress(OSError, RuntimeError):
                    pipe.write_eof()

    def _send(self, members: Sequence[str]) -> None:
        for member in members:
            pipe = self.stdin.get(member)
            if pipe is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    pipe.write(b"go\n")


async def _lockstep_lines(transport: Transport, node: Node, argv: Sequence[str], gate: GroupGate,
                          timeout: float) -> AsyncIterator[tuple[str, str]]:
    """`transport.stream` for a bench in a group: stdin stays open for the gate; its lockstep lines drive the
    barrier, its result (or its end) finishes the member. Raises TransportError on timeout."""
    proc = await transport.open_binary(argv)
    gate.attach(node.name, proc.stdin)
    try:
        async for kind, line in merge_lines(proc.stdout, proc.stderr, timeout):
            if kind == "stderr" and line.startswith(("bench lockstep ready", "bench lockstep timed")):
                gate.wait(node.name)
            elif kind == "stdout" and line.lstrip().startswith("{"):
                gate.finish(node.name)
            yield kind, line
        gate.finish(node.name)
        yield "exit", str(await asyncio.wait_for(proc.wait(), timeout=timeout))
    except TimeoutError as exc:
        raise TransportError(node.name, f"the bench timed out after {timeout:g}s", kind="timeout") from exc
    finally:
        gate.finish(node.name)
        proc.kill()


async def run_bench(
    transport: Transport, node: Node, spec: BenchSpec, *, time_budget: float,
    one_time_budget: float = DEFAULT_ONE_TIME_BUDGET, progress: Progress | None = None,
    gate: GroupGate | None = None, cpu_share: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Ship the worker, run the bench on `node`, return its JSON object (not yet checked for `error`). With a
    `gate` the bench runs in lockstep with the other members of its group (`worker.bench --lockstep`), on its
    `cpu_share` of their machine's CPUs where they compute on them.

    Raises TransportError (ship failed, timeout) or CalibrationError (no JSON, or a non-zero exit without an
    error JSON explaining it)."""
    try:
        worker_dir = await ship_worker(transport, node)
    except BaseException:
        if gate is not None:
            gate.finish(node.name)
        raise
    argv = build_bench_argv(node, worker_dir, spec, time_budget, one_time_budget, lockstep=gate is not None,
                            cpu_share=cpu_share)
    stdout: list[str] = []
    stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    status = None
    timeout = time_budget + one_time_budget + TIMEOUT_SLACK_S
    lines = (transport.stream(argv, timeout=timeout) if gate is None
             else _lockstep_lines(transport, node, argv, gate, timeout))
    async for kind, line in lines:
        if kind == "stdout":
            stdout.append(line)
        elif kind == "stderr":
            text = line.rstrip("\r\n")
            stderr_tail.append(text)
            # Only the bench's own progress lines (its lockstep waits are the gate's business): library warnings
            # stay in the evidence tail.
            if progress is not None and text.startswith("bench ") and not text.startswith("bench lockstep"):
                progress(node.name, text)
        elif kind == "exit":
            status = line
    evidence = "\n".join(stderr_tail)
    try:
        obj = parse_bench_stdout(node.name, "".join(stdout))
    except CalibrationError as exc:
        raise CalibrationError(node.name, f"the bench exited with status {status} and printed no JSON result",
                               evidence=evidence or exc.evidence) from exc
    if status != "0" and "error" not in obj:
        raise CalibrationError(node.name, f"the bench exited with status {status}", evidence=evidence)
    if "error" in obj:
        raise CalibrationError(node.name, f"bench failed: {obj['error']}", evidence=evidence)
    return obj


async def calibrate(
    fleet: Fleet,
    spec: BenchSpec,
    *,
    fingerprints: Mapping[str, NodeFingerprint],
    model_digest: str,
    recalibrate: bool,
    cache_dir: Path,
    time_budget: float = 60.0,
    one_time_budget: float = DEFAULT_ONE_TIME_BUDGET,
    progress: Progress | None = None,
    names: Sequence[str] | None = None,
    groups: Sequence[BenchGroup] = (),
) -> dict[str, NodeCalibration | CoordinatorError]:
    """Calibrate every connected node of `fleet` in parallel (nodes that failed to connect keep their
    TransportError). Returns one entry per node, in fleet order: its `NodeCalibration` (`cached=True` when read
    from `cache_dir`) or the `CoordinatorError` that stopped it.

    `fingerprints[node]` is the hardware/software fingerprint the caller gathered (see `fingerprint_from_facts`);
    a node without one, or with an unknown one, is measured and not cached. `model_digest` identifies the model's
    weights. `time_budget` bounds each node's timed steps, `one_time_budget` its one-time costs (see the module
    docstring). `groups` (`coordinator.planning.colocate.compute_bench_groups`) name the nodes that share a machine:
    their benches run in lockstep, their curves are cached as measured together (the group is part of the key),
    a group is measured again as a whole when any member's curve is missing, and interchangeable members (one
    fingerprint, python and env) get one pooled curve (`pool_curves`). `names`: only these nodes (a pipeline's
    nodes that cannot hold the model are timed per block instead, `calibrate_layers`). Raises ValueError only for
    a non-positive budget.
    """
    for label, value in (("time_budget", time_budget), ("one_time_budget", one_time_budget)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{label} must be a positive number of seconds, got {value!r}")

    def say(node: str, message: str) -> None:
        if progress is not None:
            progress(node, message)

    group_of = {name: g for g in groups if g.together for name in g.nodes}
    keys: dict[str, str | None] = {}
    cached: dict[str, NodeCalibration] = {}
    asked = [n for n in fleet.nodes if names is None or n.name in names]
    for node in asked:
        fingerprint = fingerprints.get(node.name)
        group = group_of.get(node.name)
        together = tuple(n for n in group.nodes if n != node.name) if group is not None else ()
        keys[node.name] = (compute_cache_key(node.name, fingerprint, spec, model_digest, worker_bundle()[0],
                                             together=together, pinned=bool(group and group.on_cpu and together))
                           if fingerprint is not None and fingerprint.known else None)
        key = keys[node.name]
        if key is not None and not recalibrate:
            hit = _read_cache(cache_dir, node.name, key)
            if hit is not None:
                cached[node.name] = hit
    # A group's curves hold together or not at all: measured beside each other, one member's new curve next to
    # another's old one would compare two different loads.
    measure = {n.name for n in asked if n.name not in cached
               or (n.name in group_of and any(m not in cached for m in group_of[n.name].nodes))}
    gates: dict[str, GroupGate] = {}
    shares: dict[str, tuple[int, int]] = {}  # the CPU slices of the members measured together, as their ranks'
    for group in {id(g): g for g in group_of.values()}.values():
        members = [n for n in group.nodes if n in measure and n in fleet.connected]
        if len(members) > 1:
            gate = GroupGate(members)
            gates.update(dict.fromkeys(members, gate))
            shares.update(group.member_shares(members))

    async def one(node: Node, transport: Transport) -> NodeCalibration | CoordinatorError:
        key = keys[node.name]
        if node.name not in measure:
            hit = cached[node.name]
            say(node.name, f"calibration cached ({(key or '')[:12]})" + describe_reuse(hit))
            return hit
        gate = gates.get(node.name)
        share = shares.get(node.name)
        together = (f"; together with {', '.join(n for n in gate.barrier.state if n != node.name)} "
                    f"(they share {group_of[node.name].machine}), in lockstep"
                    + (f", on CPU slice {share[0] + 1} of {share[1]} as its rank will run" if share else "")
                    ) if gate is not None else ""
        say(node.name, f"calibrating ({spec.method}, seq_len {spec.seq_len}, {time_budget:g}s of timed steps; "
                       f"one-time costs up to {one_time_budget:g}s{together})")
        try:
            obj = await run_bench(transport, node, spec, time_budget=time_budget, one_time_budget=one_time_budget,
                                  progress=progress, gate=gate, cpu_share=shares.get(node.name))
            calibration = calibration_from_bench(node.name, obj)
        except CoordinatorError as exc:
            say(node.name, f"calibration failed: {exc}")
            return exc
        say(node.name, describe_bench_time(obj))
        if key is None:
            say(node.name, "not cached: the node's hardware fingerprint is unknown")
        else:
            try:
                _write_cache(cache_dir, key, node.name, obj)
            except OSError as exc:
                say(node.name, f"could not cache the calibration in {cache_dir}: {exc}")
        return calibration

    results: dict[str, NodeCalibration | CoordinatorError] = dict(await fleet.map(one, names=names))
    for group in {id(g): g for g in group_of.values()}.values():
        measured = [r for n in group.nodes if isinstance(r := results.get(n), NodeCalibration)]
        kinds = {n.name: (fingerprints.get(n.name), n.python, n.env) for n in fleet.nodes if n.name in group.nodes}
        for cal in pool_curves(measured, kinds):
            if cal is not results[cal.node]:
                results[cal.node] = cal
                say(cal.node, "one curve for the interchangeable nodes of " + group.machine + " (the mean of their "
                              "lockstep measurements: they run at one speed, the rest is who the scheduler favoured)")
    ordered: dict[str, NodeCalibration | CoordinatorError] = {}
    for node in fleet.nodes:
        if names is not None and node.name not in names:
            continue
        if node.name in results:
            ordered[node.name] = results[node.name]
        elif node.name in fleet.failed:
            ordered[node.name] = fleet.failed[node.name]
    return ordered



async def calibrate_layers(
    fleet: Fleet,
    spec: BenchSpec,
    names: Sequence[str],
    *,
    fingerprints: Mapping[str, NodeFingerprint],
    model_digest: str,
    recalibrate: bool,
    cache_dir: Path,
    time_budget: float = 60.0,
    one_time_budget: float = DEFAULT_ONE_TIME_BUDGET,
    progress: Progress | None = None,
) -> dict[str, LayerTiming | CoordinatorError]:
    """Time `spec.blocks` blocks alone on each of `names` (`worker.bench --blocks`), cached like `calibrate`
    (its key holds the block count and micro-batch). One node's failure is its value, as in `calibrate`."""
    if spec.blocks < 1:
        raise ValueError(f"calibrate_layers needs spec.blocks >= 1, got {spec.blocks}")

    async def one(node: Node, transport: Transport) -> LayerTiming | CoordinatorError:
        fingerprint = fingerprints.get(node.name)
        key = (compute_cache_key(node.name, fingerprint, spec, model_digest, worker_bundle()[0])
               if fingerprint is not None and fingerprint.known else None)
        if key is not None and not recalibrate:
            cached = _read_layer_cache(cache_dir, node.name, key)
            if cached is not None:
                if progress is not None:
                    progress(node.name, f"per-block timing cached ({key[:12]})")
                return cached
        try:
            obj = await run_bench(transport, node, spec, time_budget=time_budget, one_time_budget=one_time_budget,
                                  progress=progress)
            timing = layer_timing_from_bench(node.name, obj)
        except CoordinatorError as exc:
            return exc
        if key is not None:
            try:
                _write_cache(cache_dir, key, node.name, obj)
            except OSError as exc:
                if progress is not None:
                    progress(node.name, f"could not cache the timing in {cache_dir}: {exc}")
        return timing

    results = await fleet.map(one, names=names)
    return {n.name: (results[n.name] if n.name in results else fleet.failed.get(n.name)
                     or CalibrationError(n.name, "not connected"))
            for n in fleet.nodes if n.name in names}


def parse_layer_cache_record(node: str, key: str, text: str) -> LayerTiming | None:
    """A cached per-block timing, or None (a miss) as `parse_cache_record`."""
    if (bench := cached_bench(key, text)) is None:
        return None
    try:
        return layer_timing_from_bench(node, bench)
    except CalibrationError:
        return None


def _read_layer_cache(cache_dir: Path, node: str, key: str) -> LayerTiming | None:
    try:
        text = _cache_path(cache_dir, key).read_text(encoding="utf-8")
    except OSError:
        return None
    return parse_layer_cache_record(node, key, text)
