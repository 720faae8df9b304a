"""Pipeline training on the test bed (issue 24): the 1F1B schedule against one micro-batch per step, the computed
layer split against an equal one with a half-speed node, and each stage's peak memory against the plan.

Three SSH hosts of the test bed (tests/testbed.py: network namespaces, real sshd, the real `coordinator launch`,
mlx.launch's ring backend) are made into three "machines" with cgroup v1 (benchmarks/cgroups.py): each host's
sshd, and so every rank it starts, gets a CPU quota (`cpu.cfs_quota_us` per 100000 us: --quota-us, default 40% of
a core each, so three hosts fit in two cores with room to spare) and a high `cpu.shares`; in the "unequal" runs
the last host gets half of that quota. The job is a full fine-tune of a tiny llama built offline (hidden
--hidden, --layers blocks) on generated rows longer than max_seq_length (every row a full --seq-len-token row).

Runs (one each per round, --rounds):
  1. `schedule M`: equal hosts, `layer_split` pinned equal, `micro_batches` M (default 8);
  2. `schedule 1`: the same with one micro-batch per step (what mlx-train runs: one stage works at a time);
  3. `computed`: the slow last host, `strategy: pipeline` with the split computed from `worker.bench --blocks`;
  4. `equal`: the slow last host, `layer_split` pinned equal.
Steady-state tokens/s of a run: the median over steps after --warmup-steps of rank 0's `step` event
(total_tokens / step_time_s), read from the run's events.jsonl. The measured bubble: T1 / P is the time a step's
work would take with every stage busy all the time (one micro-batch per step keeps one stage busy at a time: T1),
so 1 - (T1 / P) / TM is the idle share of the step of M micro-batches (an estimate: it assumes a micro-batch of
B/M rows costs 1/M of one of B rows; tokens/s is inversely the step time, so it is 1 - rate_M / (P x rate_1)).
Peak memory: each node's `peak_memory_bytes` in summary.json against its stage's `need_bytes` in plan.json
(`strategy.rows`).

    sudo .venv/bin/python benchmarks/bench_pipeline.py [--rounds 1] [--micro-batches 8] [--quota-us 40000]
        [--layers 6] [--hidden 128] [--seq-len 128] [--batch 24] [--iters 8] [--warmup-steps 3]

Size (--mode size): the issue's size goal, "the largest model the 3-node capped bed fully fine-tunes is >= 2.5x
the largest that dp fits there". The three hosts get unequal cgroup v1 memory caps (--caps, MiB; what
tests/integration/test_pipeline_bed.py sets) and no CPU quota. Their budgets are read by the real probe (the cgroup
limit fact, `node_budget`), and the planner (`compute_strategy`, memory alone, as preflight) finds the most blocks of
a tiny llama of hidden --size-hidden that `strategy: dp` fits and the most a pipeline fits. Each is then proved by a
real short `coordinator launch` (--size-iters steps) at that size, and the dp size one block up is launched too and
must be refused. The figure is the ratio of the two sizes' parameter counts.

    sudo .venv/bin/python benchmarks/bench_pipeline.py --mode size [--caps 700,600,500] [--size-hidden 256]

Needs root (namespaces, sshd, cgroups) and the worker's pipeline strategy (worker/parallel/pipeline). The test bed,
the cgroups and the temp dir are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import yaml  # noqa: E402
from cgroups import HostCgroups, remove_stale  # noqa: E402

SMOKE = ROOT / "playbooks" / "data" / "smoke"


def log(msg: str) -> None:
    print(f"[bench_pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_data(dest: Path, rows: int, words: int) -> None:
    """Rows of `words` words from the smoke set's sentences: longer than max_seq_length, so every row is full."""
    base = " ".join(json.loads(line)["text"] for line in (SMOKE / "train.jsonl").read_text().splitlines()).split()
    dest.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", rows), ("valid.jsonl", 8)):
        with (dest / name).open("w") as fh:
            for i in range(n):
                start = (i * 37) % len(base)
                fh.write(json.dumps({"text": " ".join((base * 2)[start:start + words])}) + "\n")


def write_playbook(path: Path, args: argparse.Namespace, *, micro_batches: int, split: list[int] | None) -> Path:
    train: dict[str, Any] = {
        "method": "full", "strategy": "pipeline", "iters": args.iters, "batch_size": args.batch,
        "max_seq_length": args.seq_len, "micro_batches": micro_batches, "packing": "off", "save_every": 10_000,
        "steps_per_eval": 10_000, "val_batches": 1, "learning_rate": 1e-4}
    if split is not None:
        train["layer_split"] = split
    doc = {"name": path.stem, "kind": "train", "model": "/srv/model", "data": "/srv/data", "train": train,
           "calibration": {"time_budget": 120}, "faults": {"max_restarts": 0, "consistency_every": 0},
           "heartbeat_timeout": 60}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(inv: Path, pb: Path, tmp: Path, warmup: int, *, recalibrate: bool) -> dict[str, Any]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}
    proc = subprocess.run([sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json",
                           "--run-dir", str(tmp / "runs"), *(["--recalibrate"] if recalibrate else [])], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    try:
        summary: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"no summary (rc {proc.returncode}):\n{proc.stderr[-3000:]}") from None
    if summary.get("state") != "succeeded":
        raise SystemExit(f"run failed: {json.dumps(summary)[:3000]}\n{proc.stderr[-3000:]}")
    run_dir = tmp / "runs" / summary["run_id"]
    rates, walls = [], []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == "step" and ev.get("rank") == 0 and (ev.get("step") or 0) > warmup:
            total, wall = ev.get("total_tokens"), ev.get("step_time_s")
            if isinstance(total, int | float) and isinstance(wall, int | float) and wall > 0:
                rates.append(total / wall)
                walls.append(wall)
    plan = json.loads((run_dir / "plan.json").read_text())
    strategy = plan["strategy"]
    rows = {r["node"]: r for r in strategy["rows"]}
    peaks = {n["node"]: n.get("peak_memory_bytes") for n in summary["nodes"]}
    return {"tokens_per_s": statistics.median(rates) if rates else None, "steps": len(rates),
            "split": [r["last_layer"] - r["first_layer"] for r in strategy["rows"]],
            "predicted_tokens_per_s": strategy.get("predicted_tokens_per_s"),
            # The model's pieces beside the run's step, to see where a gap comes from.
            "step_s": statistics.median(walls) if walls else None, "predicted_step_s": strategy.get("predicted_step_s"),
            "predicted_busy_s": [r.get("predicted_busy_s") for r in strategy["rows"]], "link_s": strategy.get("link_s"),
            "memory": {n: {"peak": peaks.get(n), "plan": r["need_bytes"]} for n, r in rows.items()}}


def size_playbook(path: Path, args: argparse.Namespace, strategy: str) -> Path:
    """A full fine-tune with few rows per rank and short rows: the weights, grads and Adam state dominate the need."""
    train: dict[str, Any] = {
        "method": "full", "strategy": strategy, "iters": args.size_iters, "batch_size": args.size_batch,
        "max_seq_length": args.size_seq_len, "micro_batches": args.size_micro_batches, "packing": "off",
        "save_every": 10_000, "steps_per_eval": 10_000, "val_batches": 1, "learning_rate": 1e-4}
    # No calibration: the size is a matter of memory (the split by speed is the other runs' subject).
    doc = {"name": path.stem, "kind": "train", "model": "/srv/model", "data": "/srv/data", "train": train,
           "split": "equal", "faults": {"max_restarts": 0, "consistency_every": 0}, "heartbeat_timeout": 120}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def launch(inv: Path, pb: Path, tmp: Path, key: str) -> dict[str, Any]:
    """One `coordinator launch`: its exit code, end state, the plan it ran and its last output lines. Each launch
    has its own state dir: a node that crashed in one (a cap's OOM kill) is not quarantined for the next."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / f"state-{key}")}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json",
                           "--run-dir", str(tmp / "runs")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
                           "tail": (proc.stdout + proc.stderr)[-1500:]}
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        return out
    out["state"] = summary.get("state")
    out["message"] = summary.get("message")
    out["incidents"] = [str(i)[:300] for i in summary.get("incidents", [])][:3]
    out["steps"] = max((n.get("step") or 0 for n in summary.get("nodes", [])), default=0)
    out["peaks"] = {n["node"]: n.get("peak_memory_bytes") for n in summary.get("nodes", [])}
    plan_path = tmp / "runs" / str(summary.get("run_id")) / "plan.json"
    if plan_path.is_file():
        strategy = json.loads(plan_path.read_text()).get("strategy") or {}
        out["strategy"] = strategy.get("strategy") or strategy.get("name")
        out["split"] = [r["last_layer"] - r["first_layer"] for r in strategy.get("rows", [])]
    return out


def largest(requested: str, cfg: dict[str, Any], train: Any, budgets: dict[str, Any], most: int) -> int:
    """The most blocks (of `cfg`'s model) the planner fits with `requested`; 0 when not even one block fits."""
    from coordinator.planning.estimate import model_shape
    from coordinator.planning.strategy import StrategyError, compute_strategy

    def fits(layers: int) -> bool:
        shape = model_shape({**cfg, "num_hidden_layers": layers}, None)
        assert shape is not None
        try:
            compute_strategy(requested, shape, train, budgets, backend="ring")
        except StrategyError:
            return False
        return True

    # The need grows with the blocks: bisect for the last size that fits.
    lo, hi = 0, most + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def size_main(args: argparse.Namespace, command: str) -> int:
    import asyncio

    from coordinator.config.inventory import load_inventory
    from coordinator.config.playbook import load_playbook
    from coordinator.planning.estimate import model_shape
    from coordinator.planning.strategy import node_budget
    from coordinator.preflight.pipeline import collect
    from tests.testbed import TestBed, cleanup_stale
    from worker.tinymodel import build_tiny_model

    caps = [int(c) * 2**20 for c in args.caps.split(",")]
    cleanup_stale()
    remove_stale()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-size-"))
    load_start, started = os.getloadavg(), time.monotonic()
    result: dict[str, Any] = {"caps_mib": [c // 2**20 for c in caps], "hidden": args.size_hidden}
    try:
        write_data(tmp / "data", 120, args.size_seq_len * 2)
        with TestBed(tmp=tmp / "bed") as bed, HostCgroups(f"{bed.tag}-{os.getpid()}") as cg:
            hosts = bed.add_hosts(["a", "b", "c"][:len(caps)])
            inv = bed.write_inventory(tmp / "inv.yaml", hosts)

            def build(layers: int) -> dict[str, Any]:
                for host in hosts:
                    shutil.rmtree(host.srv / "model", ignore_errors=True)
                    build_tiny_model(host.srv / "model", tmp / "data", layers=layers, hidden=args.size_hidden,
                                     seed=0, max_positions=max(512, args.size_seq_len))
                    if not (host.srv / "data").exists():
                        shutil.copytree(tmp / "data", host.srv / "data")
                cfg: dict[str, Any] = json.loads((hosts[0].srv / "model" / "config.json").read_text())
                return cfg

            cfg = build(2)
            for host, cap in zip(hosts, caps, strict=True):
                assert host.pid is not None
                cg.place(host.name, host.pid, cpus=None, memory_bytes=cap)
            dp_pb = size_playbook(tmp / "size-dp.yaml", args, "dp")
            pipe_pb = size_playbook(tmp / "size-pipeline.yaml", args, "pipeline")
            # The budgets as launch sees them: the real probe over SSH (each rank inherits its sshd's cgroup).
            facts = asyncio.run(collect(load_inventory(str(inv)), None)).facts
            budgets = {h.name: node_budget(facts[h.name]) for h in hosts}
            assert all(b is not None for b in budgets.values()), budgets
            result["usable_mib"] = {n: round(b.usable / 2**20) for n, b in budgets.items() if b is not None}
            train = load_playbook(dp_pb).train
            dp_layers = largest("dp", cfg, train, budgets, args.size_max_layers)
            pipe_layers = largest("pipeline", cfg, load_playbook(pipe_pb).train, budgets, args.size_max_layers)
            if dp_layers == 0 or pipe_layers in (0, args.size_max_layers):
                raise SystemExit(f"size search out of range: dp {dp_layers}, pipeline {pipe_layers} blocks "
                                 f"(--size-max-layers {args.size_max_layers})")
            # --size-scale < 1 launches below the planner's largest (the planner's own sizes OOM'd: see
            # docs/benchmarks.md); dp one block above its largest is refused by the planner either way.
            scaled = (max(1, int(dp_layers * args.size_scale)), max(1, int(pipe_layers * args.size_scale)))
            result["planner_layers"] = {"dp": dp_layers, "pipeline": pipe_layers}
            for key, layers in (("dp", scaled[0]), ("pipeline", scaled[1]), ("dp_next", dp_layers + 1)):
                shape = model_shape({**cfg, "num_hidden_layers": layers}, None)
                assert shape is not None
                result[key] = {"layers": layers, "params": shape.params}
            log(f"planner: dp fits {dp_layers} blocks, a pipeline {pipe_layers} (usable {result['usable_mib']} MiB)")
            for key, pb in (("dp", dp_pb), ("dp_next", dp_pb), ("pipeline", pipe_pb)):
                build(result[key]["layers"])
                log(f"launch {key}: {result[key]['layers']} blocks")
                result[key]["launch"] = launch(inv, pb, tmp, key)
                log(json.dumps(result[key]["launch"])[:600])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(render_size(result, command, args, load_start, os.getloadavg(), time.monotonic() - started))
    ok = (result["dp"]["launch"].get("state") == "succeeded" and result["pipeline"]["launch"].get("state") ==
          "succeeded" and result["dp_next"]["launch"]["rc"] != 0)
    return 0 if ok else 1


def render_size(result: dict[str, Any], command: str, args: argparse.Namespace, load_start: tuple[float, ...],
                load_end: tuple[float, ...], total_s: float) -> str:
    lines = ["### Pipeline: the largest full fine-tune on three memory-capped hosts", "", f"Command: `sudo {command}`",
             "", f"Machine: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at "
             f"end; total {total_s:.0f} s. Caps {'/'.join(map(str, result['caps_mib']))} MiB (cgroup v1 "
             f"memory.limit_in_bytes on each host's sshd), probed usable "
             f"{'/'.join(str(v) for v in result['usable_mib'].values())} MiB. Tiny llama of hidden {args.size_hidden}, "
             f"full fine-tune, batch {args.size_batch} x {args.size_seq_len} tokens, {args.size_micro_batches} "
             f"micro-batches in the pipeline, {args.size_iters} steps.", "",
             "| run | blocks | parameters | launch | steps | plan | wall |", "|---|---|---|---|---|---|---|"]
    for key in ("dp", "dp_next", "pipeline"):
        r = result[key]
        la = r["launch"]
        state = la.get("state") or ("refused" if la["rc"] != 0 else "?")
        plan = la.get("strategy") or "-"
        if la.get("split"):
            plan += " " + "/".join(map(str, la["split"]))
        lines.append(f"| {key} | {r['layers']} | {r['params'] / 1e6:.2f} M | {state} (rc {la['rc']}) | "
                     f"{la.get('steps', 0)} | {plan} | {la['wall_s']:.0f} s |")
    ratio = result["pipeline"]["params"] / result["dp"]["params"]
    planned = result["planner_layers"]
    lines += ["", f"- Planner's largest: dp {planned['dp']} blocks, pipeline {planned['pipeline']} blocks; launched "
              f"at {args.size_scale:g} of them."]
    lines += ["", f"- Size: the largest pipeline / the largest dp = {ratio:.2f}x the parameters "
              f"({result['pipeline']['layers']} vs {result['dp']['layers']} blocks; goal >= 2.5x)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("speed", "size"), default="speed")
    ap.add_argument("--caps", default="700,600,500", help="size: each host's memory cap in MiB")
    ap.add_argument("--size-hidden", type=int, default=256)
    ap.add_argument("--size-batch", type=int, default=6)
    ap.add_argument("--size-seq-len", type=int, default=64)
    ap.add_argument("--size-micro-batches", type=int, default=3)
    ap.add_argument("--size-iters", type=int, default=3)
    ap.add_argument("--size-max-layers", type=int, default=400)
    ap.add_argument("--size-scale", type=float, default=1.0,
                    help="size: launch dp and the pipeline at this share of the planner's largest sizes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--quota-us", type=int, default=40_000)
    ap.add_argument("--shares", type=int, default=262144)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_pipeline.py", *sys.argv[1:]])
    if args.mode == "size":
        return size_main(args, command)
    from tests.testbed import TestBed, cleanup_stale
    from worker.tinymodel import build_tiny_model

    cleanup_stale()
    remove_stale()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    equal = [args.layers // 3 + (1 if i < args.layers % 3 else 0) for i in range(3)]
    results: dict[str, list[dict[str, Any]]] = {"schedule M": [], "schedule 1": [], "computed": [], "equal": []}
    load_start, started = os.getloadavg(), time.monotonic()
    try:
        write_data(tmp / "data", 240, args.seq_len * 2)
        with TestBed(tmp=tmp / "bed") as bed, HostCgroups(f"{bed.tag}-{os.getpid()}") as cg:
            hosts = bed.add_hosts(["a", "b", "slow"])
            for host in hosts:
                build_tiny_model(host.srv / "model", tmp / "data", layers=args.layers, hidden=args.hidden, seed=0,
                                 max_positions=max(2048, args.seq_len))
                shutil.copytree(tmp / "data", host.srv / "data")
                assert host.pid is not None
                cg.place(host.name, host.pid, cpus=None, quota_us=args.quota_us, shares=args.shares)
            inv = bed.write_inventory(tmp / "inv.yaml", hosts)
            pbs = {"schedule M": write_playbook(tmp / "sched-m.yaml", args, micro_batches=args.micro_batches,
                                                split=equal),
                   "schedule 1": write_playbook(tmp / "sched-1.yaml", args, micro_batches=1, split=equal),
                   "computed": write_playbook(tmp / "computed.yaml", args, micro_batches=args.micro_batches,
                                              split=None),
                   "equal": write_playbook(tmp / "equal.yaml", args, micro_batches=args.micro_batches, split=equal)}
            slow_quota = str(args.quota_us // 2)
            full_quota = str(args.quota_us)
            for r in range(args.rounds):
                for name in ("schedule M", "schedule 1", "computed", "equal"):
                    quota = slow_quota if name in ("computed", "equal") else full_quota
                    (cg.hosts["slow"].dirs["cpu"] / "cpu.cfs_quota_us").write_text(quota)
                    log(f"round {r + 1}/{args.rounds}: {name} (slow host quota {quota} us)")
                    # A quota is no hardware the calibration cache knows: the per-block timing is measured
                    # again whenever the slow host's quota changed (the computed split's run).
                    results[name].append(run(inv, pbs[name], tmp, args.warmup_steps, recalibrate=name == "computed"))
                    log(json.dumps(results[name][-1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print(render(results, command, args, load_start, os.getloadavg(), time.monotonic() - started))
    return 0


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs if r[key] is not None)


def render(results: dict[str, list[dict[str, Any]]], command: str, args: argparse.Namespace,
           load_start: tuple[float, ...], load_end: tuple[float, ...], total_s: float) -> str:
    m, p = args.micro_batches, 3
    sched_m, sched_1 = _median(results["schedule M"], "tokens_per_s"), _median(results["schedule 1"], "tokens_per_s")
    computed, equal = _median(results["computed"], "tokens_per_s"), _median(results["equal"], "tokens_per_s")
    bubble = 1 - sched_m / (p * sched_1) if sched_1 and sched_m else None
    lines = ["### Pipeline: schedule, split and memory on three capped hosts", "", f"Command: `sudo {command}`", "",
             f"Machine: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at "
             f"end; total {total_s:.0f} s. Hosts a, b, slow at cfs quota {args.quota_us} us / 100000 us each (slow "
             f"at half of it in the split runs). Full fine-tune of a tiny llama (hidden {args.hidden}, "
             f"{args.layers} blocks), batch {args.batch} x {args.seq_len} tokens, {args.rounds} round(s).", "",
             "| run | split | tokens/s (median of steady steps) | predicted tokens/s | actual / predicted |",
             "|---|---|---|---|---|"]
    for name, runs in results.items():
        for r in runs:
            pred = r["predicted_tokens_per_s"]
            ratio = f"{r['tokens_per_s'] / pred:.2f}" if pred and r["tokens_per_s"] else "-"
            lines.append(f"| {name} | {'/'.join(map(str, r['split']))} | {r['tokens_per_s'] or 0:,.0f} | "
                         f"{'-' if pred is None else f'{pred:,.0f}'} | {ratio} |")
    lines += ["", "| run | step (median) | predicted step | predicted busy per stage | link transfer |",
              "|---|---|---|---|---|"]
    for name, runs in results.items():
        for r in runs:
            busy = "/".join(f"{b:.2f}" for b in r.get("predicted_busy_s") or [] if b is not None) or "-"
            links = "/".join("-" if x is None else f"{1000 * x:.2f} ms" for x in r.get("link_s") or []) or "-"
            step, pred = r.get("step_s"), r.get("predicted_step_s")
            lines.append(f"| {name} | {'-' if step is None else f'{step:.2f} s'} | "
                         f"{'-' if pred is None else f'{pred:.2f} s'} | {busy} s | {links} |")
    lines += ["", f"- Schedule: {m} micro-batches / one per step = {sched_m / sched_1:.2f}x (goal >= 2.0x); measured "
              f"bubble ~{100 * (bubble or 0):.0f}% against (P-1)/(M+P-1) = {100 * (p - 1) / (m + p - 1):.0f}% "
              "(goal: within 5 points).",
              f"- Unequal nodes: computed split / equal split = {computed / equal:.2f}x (goal >= 1.25x).", "",
              "| run | node | peak memory | plan | peak / plan |", "|---|---|---|---|---|"]
    for name in ("schedule M", "schedule 1", "computed", "equal"):
        for node, mem in results[name][0]["memory"].items():
            if mem["peak"]:
                lines.append(f"| {name} | {node} | {mem['peak'] / 2**20:.0f} MiB | {mem['plan'] / 2**20:.0f} MiB | "
                             f"{mem['peak'] / mem['plan']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
