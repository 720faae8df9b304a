"""Map-job (`kind: map`) finish-time spread with calibrated vs equal shards under a throttled host, in one run.

Two SSH hosts of the test bed (tests/testbed.py: network namespaces, real sshd, the real `coordinator launch`) are
made into two "machines" with cgroup v1 (benchmarks/cgroups.py): host `full` pinned to cpu 0, host `half` pinned to
cpu 1 and capped at half of it (`cpu.cfs_quota_us` 50000 per 100000 us), both with a high `cpu.shares` so other
work on this shared machine takes little from them. The job scores every row of a generated JSONL file with a
tiny llama built offline (`task: score`), once with `split: calibrated` and once with `split: equal` per round,
the order alternating between rounds.

Reported per run, from summary.json: each host's rows and finish time (seconds from the start of the shard runs,
after calibration), the spread (latest - earliest) / latest, and the job's wall time from the first shard start
to the last finish (the makespan). Medians over the rounds, and the ratio of the makespans.

    sudo .venv/bin/python benchmarks/bench_map.py [--rounds 3] [--rows 9000] [--quota-us 50000]

Needs root (namespaces, sshd, cgroups). The test bed, the cgroups and the temp dir are removed at the end.
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
from cliout import by_node, cli_json  # noqa: E402

SMOKE = ROOT / "playbooks" / "data" / "smoke"


def log(msg: str) -> None:
    print(f"[bench_map {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_data(dest: Path, rows: int) -> None:
    base = [json.loads(line)["text"] for line in (SMOKE / "train.jsonl").read_text().splitlines()]
    dest.mkdir(parents=True, exist_ok=True)
    with (dest / "input.jsonl").open("w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"text": f"{base[i % len(base)]} {i}"}) + "\n")


def write_playbook(path: Path, data: Path, split: str, time_budget: float) -> Path:
    doc = {"name": f"bench-map-{split}", "kind": "map", "model": "/srv/model", "data": "/srv/data",
           "assets": {"data_from": str(data), "tiny_model": {"layers": 2, "hidden": 64, "seed": 0}},
           "map": {"input": "input.jsonl", "task": "score", "field": "text", "batch_size": 16, "max_seq_length": 64},
           "split": split, "calibration": {"time_budget": time_budget}, "heartbeat_timeout": 30}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(inv: Path, pb: Path, tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}
    proc = subprocess.run([sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json",
                           "--run-dir", str(tmp / "runs")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    try:
        summary: dict[str, Any] = cli_json("launch", proc.stdout)
    except ValueError:
        raise SystemExit(f"no summary (rc {proc.returncode}):\n{proc.stderr[-3000:]}") from None
    if summary.get("state") != "succeeded":
        raise SystemExit(f"run failed: {json.dumps(summary)[:3000]}")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=9000)
    ap.add_argument("--quota-us", type=int, default=50_000)
    ap.add_argument("--shares", type=int, default=262144)
    ap.add_argument("--time-budget", type=float, default=8.0)
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_map.py", *sys.argv[1:]])
    from tests.testbed import TestBed, cleanup_stale

    cleanup_stale()
    remove_stale()
    tmp = Path(tempfile.mkdtemp(prefix="bench-map-"))
    results: dict[str, list[dict[str, Any]]] = {"calibrated": [], "equal": []}
    load_start = os.getloadavg()
    started = time.monotonic()
    try:
        write_data(tmp / "data", args.rows)
        with TestBed(tmp=tmp / "bed") as bed, HostCgroups(f"{bed.tag}-{os.getpid()}") as cg:
            hosts = bed.add_hosts(["full", "half"])
            for host, cpus, quota in zip(hosts, ("0", "1"), (None, args.quota_us), strict=True):
                assert host.pid is not None
                cg.place(host.name, host.pid, cpus=cpus, quota_us=quota, shares=args.shares)
            inv = bed.write_inventory(tmp / "inv.yaml", hosts)
            pbs = {s: write_playbook(tmp / f"{s}.yaml", tmp / "data", s, args.time_budget) for s in results}
            for r in range(args.rounds):
                order = ["calibrated", "equal"] if r % 2 == 0 else ["equal", "calibrated"]
                for split in order:
                    log(f"round {r + 1}/{args.rounds}: {split}")
                    results[split].append(run(inv, pbs[split], tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_end = os.getloadavg()
    print(render(results, command, args, load_start, load_end, time.monotonic() - started))
    return 0


def render(results: dict[str, list[dict[str, Any]]], command: str, args: argparse.Namespace,
           load_start: tuple[float, ...], load_end: tuple[float, ...], total_s: float) -> str:
    lines = ["### Map jobs: finish-time spread, calibrated vs equal shards, one host throttled", "",
             f"Command: `sudo {command}`", "",
             f"Machine: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at "
             f"end; total {total_s:.0f} s. Hosts: `full` on cpu 0, `half` on cpu 1 with cfs quota "
             f"{args.quota_us} us / 100000 us. Task: score {args.rows} rows with a tiny llama (hidden 64, 2 layers).",
             "", "| split | round | rows full / half | calibrated ex/s full / half | finish s full / half | "
             "spread | makespan s |", "|---|---|---|---|---|---|---|"]
    med: dict[str, dict[str, float]] = {}
    for split, runs in results.items():
        spreads, spans = [], []
        for i, s in enumerate(runs, 1):
            nodes = by_node(s["nodes"])
            f, h = nodes["full"], nodes["half"]
            span = max(f["finished_after_s"], h["finished_after_s"])
            spread = (span - min(f["finished_after_s"], h["finished_after_s"])) / span
            spreads.append(spread)
            spans.append(span)
            rates = f"{f['examples_per_s_calibrated']:.0f} / {h['examples_per_s_calibrated']:.0f}" \
                if split == "calibrated" else "- (equal)"
            lines.append(f"| {split} | {i} | {f['rows']} / {h['rows']} | {rates} | {f['finished_after_s']:.1f} / "
                         f"{h['finished_after_s']:.1f} | {100 * spread:.1f}% | {span:.1f} |")
        med[split] = {"spread": statistics.median(spreads), "makespan": statistics.median(spans)}
    lines += ["", "| split | median spread | median makespan s |", "|---|---|---|"]
    for split, m in med.items():
        lines.append(f"| {split} | {100 * m['spread']:.1f}% | {m['makespan']:.1f} |")
    ratio = med["equal"]["makespan"] / med["calibrated"]["makespan"]
    lines += ["", f"- Calibrated shards: median spread {100 * med['calibrated']['spread']:.1f}% (goal: within 15%: "
              f"{'met' if med['calibrated']['spread'] <= 0.15 else 'NOT met'}); equal shards: "
              f"{100 * med['equal']['spread']:.1f}%.",
              f"- Makespan: equal / calibrated = {ratio:.2f}x (the throttled host holds up the equal split)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
