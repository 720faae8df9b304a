"""The dashboard's cost after many run pages were asked for: issue 23 measured 33-38% of a core idle and
`/api/runs` at 0.5-0.9 s once 5,000 pages had been requested (every page kept and polled).

A temp run root gets `--pages` run dirs (a meta.json, an empty events.jsonl, no summary: each looks running); the
dashboard server runs in a separate process on 127.0.0.1 (what `coordinator dashboard` runs, minus the fleet
probe). This process asks for every run's page (`/api/run/ID`) one after the other, then connects one browser
stream and measures the server's CPU (user+system, /proc/PID/stat) over `--seconds` while nothing is written, then
the latency of `/api/runs` (5 requests).

    .venv/bin/python benchmarks/bench_dashboard_pages.py [--pages 5000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_dashboard import REPO, SERVE, cpu_seconds  # noqa: E402 - after the path fix

TOKEN = "bench"


def make_runs(root: Path, pages: int) -> None:
    for i in range(pages):
        run = root / f"r-{i:05d}"
        run.mkdir(parents=True)
        (run / "meta.json").write_text(json.dumps({"run_id": run.name, "nodes": ["n0"],
                                                   "ranks": [{"rank": 0, "node": "n0", "batch_size": 4}]}))
        (run / "events.jsonl").write_text("")


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sep = "&" if "?" in path else "?"
    writer.write(f"GET {path}{sep}token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data.partition(b"\r\n\r\n")[2]


async def measure(port: int, pid: int, pages: int, seconds: float) -> dict[str, float]:
    start = time.monotonic()
    for i in range(pages):
        await get(port, f"/api/run/r-{i:05d}")
    asked_s = time.monotonic() - start
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /api/stream?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    await asyncio.sleep(2)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    idle = 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    latencies, rows = [], 0
    for _ in range(5):
        t = time.monotonic()
        rows = len(json.loads(await get(port, "/api/runs"))["runs"])
        latencies.append(time.monotonic() - t)
    writer.close()
    return {"pages": pages, "asked_s": round(asked_s, 1), "idle_cpu_percent": round(idle, 2),
            "runs_ms_min": round(1000 * min(latencies)), "runs_ms_max": round(1000 * max(latencies)), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dash-pages-") as tmp:
        root = Path(tmp) / "runs"
        make_runs(root, args.pages)
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(root)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            got = asyncio.run(measure(port, proc.pid, args.pages, args.seconds))
        finally:
            proc.kill()
            proc.wait()
    print("| pages asked for | asked in (s) | idle CPU, one browser (% of a core) | /api/runs (ms) | rows |")
    print("|---|---|---|---|---|")
    print(f"| {got['pages']} | {got['asked_s']} | {got['idle_cpu_percent']} | {got['runs_ms_min']}-{got['runs_ms_max']} "
          f"| {got['rows']} |")
    print(f"\n`.venv/bin/python benchmarks/bench_dashboard_pages.py --pages {args.pages} --seconds {args.seconds:g}`")


if __name__ == "__main__":
    main()
