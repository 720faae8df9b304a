"""One command from bare nodes to training: `coordinator launch --fix` on test-bed hosts with only sshd and a system
python (no venv, no model, no data), to the run's first training step and to its end.

N hosts (tests/testbed.py: network namespaces with their own sshd and /srv on this machine). The inventory's
`python` is /srv/venvs/mlx/bin/python, which does not exist yet; /srv/model and /srv/data do not either. A local
dir holds the tiny model (worker.tinymodel, 2 layers, hidden 32) and the smoke data; then, timed from its start:

    coordinator launch -i INV PB --json --fix --fix-source SRC

  setup done      the run log's `fix_setup` record: venvs created, wheels pushed, mlx / mlx-lm installed
  sync done       `fix_sync`: model and data relayed down the chain of nodes and verified
  preflight ok    `fix_done`: the second preflight passed
  first step      the first `step` event in events.jsonl (any rank); "every rank": the last rank's first step
  end             the command's exit (--iters steps, teardown, summary.json)

The wheelhouse is the coordinator's cache (~/.cache/mlx-coordinator/wheelhouse, `$XDG_CACHE_HOME` honoured): the
table says whether it was warm; a cold one adds a one-time download from PyPI (~60 MB for linux x86_64).

    sudo .venv/bin/python benchmarks/bench_fix.py [--hosts 3] [--iters 10] [--runs 1]

Needs root (namespaces). Prints Markdown; cleans up every namespace and process it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_info  # noqa: E402
from tests.testbed import TestBed  # noqa: E402
from worker.tinymodel import build_tiny_model  # noqa: E402

DATA = ROOT / "playbooks" / "data" / "smoke"
VENV = "/srv/venvs/mlx"


def write_playbook(path: Path, iters: int, hosts: int) -> Path:
    import yaml

    doc = {"name": "fixbench", "kind": "train", "model": "/srv/model", "data": "/srv/data", "backend": "ring",
           "train": {"method": "lora", "iters": iters, "batch_size": hosts, "learning_rate": 1e-3,
                     "max_seq_length": 64, "save_every": 1000, "steps_per_eval": 1000, "val_batches": 1},
           "split": "equal", "heartbeat_timeout": 30}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def log_times(run_dir: Path) -> dict[str, float]:
    """Epoch seconds of the run log's fix_* records."""
    out: dict[str, float] = {}
    for line in (run_dir / "coordinator.log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if str(rec.get("event", "")).startswith("fix_") and "timestamp" in rec:
            out.setdefault(rec["event"], datetime.fromisoformat(rec["timestamp"]).timestamp())
    return out


def one_run(hosts: int, iters: int, work: Path) -> dict[str, float | str]:
    bed = TestBed(tmp=work / "bed")
    try:
        nodes = bed.add_hosts(hosts)
        inv = bed.write_inventory(work / "inv.yaml", nodes, python=f"{VENV}/bin/python", workdir="/srv/work")
        pb = write_playbook(work / "pb.yaml", iters, hosts)
        src = work / "source"
        shutil.copytree(DATA, src / "data")
        build_tiny_model(src / "model", src / "data", layers=2, hidden=32, seed=0)
        argv = [sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json", "--run-dir",
                str(work / "runs"), "--fix", "--fix-source", str(src)]
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
        start = time.time()
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
        end = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"launch --fix exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        summary = json.loads(proc.stdout)
        run_dir = work / "runs" / summary["run_id"]
        firsts: dict[int, float] = {}
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "step" and "rank" in ev:
                firsts.setdefault(ev["rank"], float(ev["t"]))
        if sorted(firsts) != list(range(hosts)):
            raise SystemExit(f"not every rank stepped: {sorted(firsts)}")
        marks = log_times(run_dir)
        return {"setup": marks["fix_setup"] - start, "sync": marks["fix_sync"] - start,
                "preflight": marks["fix_done"] - start, "first_step": min(firsts.values()) - start,
                "every_rank": max(firsts.values()) - start, "end": end - start,
                "steps": f"{summary['steps']}/{summary['iters']}", "state": summary["state"]}
    finally:
        bed.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "mlx-coordinator" / "wheelhouse"
    warm = any(cache.glob("*/*/.complete"))
    info = machine_info(["mlx", "mlx-lm", "asyncssh"], {"wheelhouse": f"{cache} ({'warm' if warm else 'cold'})"})
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-fix-") as tmp:
            results.append(one_run(args.hosts, args.iters, Path(tmp)))
    print(f"`{' '.join(['benchmarks/bench_fix.py', *sys.argv[1:]])}`: {args.hosts} bare hosts -> "
          f"`coordinator launch --fix`, {args.iters} steps\n")
    for key, value in info.items():
        print(f"- {key}: {value}")
    print("\n| run | setup done s | sync done s | preflight ok s | first step s | every rank stepped s | end s | "
          "steps |\n|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(results, 1):
        print(f"| {i} | {r['setup']:.2f} | {r['sync']:.2f} | {r['preflight']:.2f} | {r['first_step']:.2f} | "
              f"{r['every_rank']:.2f} | {r['end']:.2f} | {r['steps']} {r['state']} |")


if __name__ == "__main__":
    main()
