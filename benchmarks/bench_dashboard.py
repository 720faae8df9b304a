"""The dashboard's own CPU cost, idle and while a 64-rank run streams, and how long an event takes to reach a
browser.

A temp run dir gets a meta.json of 64 ranks on 64 nodes; the dashboard server (`DashboardServer` on its own
asyncio loop, in a separate process: what `coordinator dashboard` runs, minus the fleet's SSH probe, which is
`coordinator status`'s probe and is measured with it) serves it on 127.0.0.1. This process appends synthetic
events to events.jsonl as a 64-rank run writes them (each rank: a heartbeat every second, a step every
`--step-s`, an eval every 10 steps, a checkpoint by rank 0 every 10 steps) and reads the SSE stream as a browser
would. Phases, each `--seconds` long:

- idle: no browser connected, no events (the server reads nothing when nobody watches);
- watched: one browser connected, no events;
- streaming: one browser connected, 64 ranks writing.

CPU is the server process's user+system time over the phase (/proc/PID/stat) as a share of one core. Latency is
from a step line's write to the arrival of the pushed delta that carries it.

    .venv/bin/python benchmarks/bench_dashboard.py [--ranks 64] [--seconds 30] [--step-s 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVE = """
import asyncio, sys
from pathlib import Path
from coordinator.views.dashboard.server import DashboardServer, DashboardState
async def main():
    async with DashboardServer(DashboardState(Path(sys.argv[1])), port=0, token="bench") as s:
        print(s.port, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_run(root: Path, ranks: int) -> Path:
    run = root / "bench-run"
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"run_id": run.name, "nodes": [f"n{r:02d}" for r in range(ranks)],
                                               "ranks": [{"rank": r, "node": f"n{r:02d}", "batch_size": 4,
                                                          "calibrated_tokens_per_s": 1000.0} for r in range(ranks)]}))
    (run / "events.jsonl").write_text("")
    return run


class Browser:
    """An SSE reader: counts messages and records when each step first arrives in a pushed delta."""

    def __init__(self) -> None:
        self.messages = 0
        self.arrived: dict[int, float] = {}

    async def read(self, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /api/stream?token=bench HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        while True:
            line = await reader.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                self.messages += 1
                doc = json.loads(line[6:])
                for step, _ in doc.get("delta", {}).get("loss", []):
                    self.arrived.setdefault(step, time.monotonic())


async def stream(run: Path, ranks: int, seconds: float, step_s: float, written: dict[int, float]) -> int:
    """Append events as `ranks` ranks would for `seconds`; the number of lines written."""
    lines = 0
    start = time.monotonic()
    step, next_step, next_beat = 0, start, start
    with (run / "events.jsonl").open("a") as fh:
        for r in range(ranks):
            fh.write(json.dumps({"event": "started", "rank": r, "node": f"n{r:02d}", "t": time.time(), "iters": 10**6})
                     + "\n")
        while (now := time.monotonic()) - start < seconds:
            out: list[str] = []
            stepped = False
            if now >= next_beat:
                next_beat += 1.0
                out += [json.dumps({"event": "heartbeat", "rank": r, "node": f"n{r:02d}", "t": time.time(),
                                    "step": step, "phase": "step"}) for r in range(ranks)]
            if now >= next_step:
                next_step += step_s
                step += 1
                stepped = True
                out += [json.dumps({"event": "step", "rank": r, "node": f"n{r:02d}", "t": time.time(), "step": step,
                                    "loss": 5.0 - step / 1e4, "tok_s": 1000.0 + r, "step_time_s": step_s,
                                    "tokens": 512, "total_tokens": 512 * ranks}) for r in range(ranks)]
                if step % 10 == 0:
                    out += [json.dumps({"event": "eval", "rank": r, "node": f"n{r:02d}", "t": time.time(),
                                        "step": step, "val_loss": 5.0}) for r in range(ranks)]
                    out.append(json.dumps({"event": "checkpoint", "rank": 0, "node": "n00", "t": time.time(),
                                           "step": step, "path": f"/ckpt/step-{step:06d}"}))
            if out:
                fh.write("\n".join(out) + "\n")
                fh.flush()
                lines += len(out)
                if stepped:
                    written[step] = time.monotonic()
            await asyncio.sleep(0.01)
    return lines


async def bench(ranks: int, seconds: float, step_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-dash-") as tmp:
        run = make_run(Path(tmp), ranks)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(run.parent)], stdout=subprocess.PIPE, env=env)
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            results: dict[str, object] = {}

            async def phase(name: str, body: asyncio.Future[object] | None) -> None:
                c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                if body is None:
                    await asyncio.sleep(seconds)
                else:
                    await body
                results[f"{name}_cpu_pct"] = round(100 * (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0), 3)
                print(f"{name}: {results[f'{name}_cpu_pct']}% of one core", file=sys.stderr)

            await asyncio.sleep(1.0)  # start-up done
            await phase("idle", None)
            browser = Browser()
            reading = asyncio.create_task(browser.read(port))
            await asyncio.sleep(1.0)
            await phase("watched", None)
            written: dict[int, float] = {}
            lines_task = asyncio.ensure_future(stream(run, ranks, seconds, step_s, written))
            await phase("streaming", lines_task)
            await asyncio.sleep(1.0)
            reading.cancel()
            lat = [browser.arrived[s] - t for s, t in written.items() if s in browser.arrived]
            results.update({"ranks": ranks, "seconds": seconds, "step_s": step_s, "lines": lines_task.result(),
                            "lines_per_s": round(lines_task.result() / seconds), "pushes": browser.messages,
                            "steps_written": len(written), "steps_seen": len(lat),
                            "latency_median_s": round(statistics.median(lat), 3) if lat else None,
                            "latency_max_s": round(max(lat), 3) if lat else None})
            return results
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--step-s", type=float, default=0.5)
    args = ap.parse_args()
    r = asyncio.run(bench(args.ranks, args.seconds, args.step_s))
    print(f"| ranks | events/s | idle CPU | watched, idle CPU | streaming CPU | push latency median / max | pushes |\n"
          f"|---:|---:|---:|---:|---:|---:|---:|\n"
          f"| {r['ranks']} | {r['lines_per_s']} | {r['idle_cpu_pct']}% | {r['watched_cpu_pct']}% | "
          f"{r['streaming_cpu_pct']}% | {r['latency_median_s']} s / {r['latency_max_s']} s "
          f"({r['steps_seen']}/{r['steps_written']} steps) | {r['pushes']} |\n\n"
          f"`.venv/bin/python benchmarks/bench_dashboard.py --ranks {args.ranks} --seconds {args.seconds:g} "
          f"--step-s {args.step_s:g}`\n\n```json\n{json.dumps(r)}\n```")


if __name__ == "__main__":
    main()
