"""The monitoring's own CPU cost on the hosts, from bench_split.py's raw results (--json FILE).

The throughput comparison of monitored and bare runs in bench_split.py is limited by this machine's run-to-run
noise (bare runs alone vary by up to 12%), far coarser than a 2% goal. This reads the same runs' per-process
CPU samples instead: on a host, monitoring adds the follower (`worker.follow`, polling the rank's event file
and /proc every 0.5 s) and the sshd work of its channel (counted as all the host's non-rank CPU beyond the bare
run's). In a CPU-bound job, that CPU is what monitoring can take away from the rank on the same core, so
(follower + extra) / rank CPU bounds the slowdown it can cause there. The coordinator's own process (monitor
loop, live view) runs on the coordinator's machine and is reported apart.

    .venv/bin/python benchmarks/monitor_cost.py /tmp/bench-split.json [more.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

HOSTS = ("full", "half")


def _cpu(run: dict[str, Any], host: str, what: str) -> float:
    return float(run["cpu_by_process"].get(f"{host}: {what}", 0.0))


def _others(run: dict[str, Any], host: str) -> float:
    """CPU of everything on `host` but its rank and the follower (sshd, shells, the probe, `sleep`s...)."""
    return sum(float(v) for k, v in run["cpu_by_process"].items()
               if k.startswith(f"{host}: ") and k not in (f"{host}: rank", f"{host}: follower"))


def monitoring_cost(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round with both a monitored (`calibrated`) and a `bare` run of the same plan: per host, the
    follower's CPU, the host's other non-rank CPU (sshd, shells, ...) beyond the bare run's, the rank's CPU,
    and (follower + extra) / rank in %."""
    rows = []
    rounds = sorted({r["round"] for r in runs})
    for rnd in rounds:
        mon = next((r for r in runs if r["kind"] == "calibrated" and r["round"] == rnd and r["ok"]), None)
        bare = next((r for r in runs if r["kind"] == "bare" and r["round"] == rnd and r["ok"]), None)
        if mon is None or bare is None:
            continue
        for host in HOSTS:
            follower = _cpu(mon, host, "follower")
            sshd_extra = max(0.0, _others(mon, host) - _others(bare, host))
            rank = _cpu(mon, host, "rank")
            rows.append({"round": rnd, "host": host, "follower_s": follower, "sshd_extra_s": sshd_extra,
                         "rank_s": rank, "pct": 100 * (follower + sshd_extra) / rank if rank else None,
                         "local_cli_s": _cpu(mon, "coordinator", "CLI"),
                         "local_cli_bare_s": _cpu(bare, "coordinator", "CLI")})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| round | host | follower CPU s | other non-rank CPU s beyond bare | rank CPU s | monitoring / rank CPU |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        pct = "-" if r["pct"] is None else f"{r['pct']:.2f}%"
        lines.append(f"| {r['round']} | {r['host']} | {r['follower_s']:.2f} | {r['sshd_extra_s']:.2f} | "
                     f"{r['rank_s']:.2f} | {pct} |")
    pcts = [r["pct"] for r in rows if r["pct"] is not None]
    if pcts:
        lines.append("")
        lines.append(f"Median monitoring / rank CPU on a host: **{statistics.median(pcts):.2f}%**, max {max(pcts):.2f}% "
                     f"(goal <= 2%: **{'met' if max(pcts) <= 2 else 'NOT met'}** on every host and round).")
    cli = [(r["local_cli_s"], r["local_cli_bare_s"]) for r in rows if r["host"] == HOSTS[0]]
    if cli:
        lines.append(f"Coordinator process CPU (its own machine): monitored "
                     f"{statistics.median(c for c, _ in cli):.2f} s vs bare {statistics.median(b for _, b in cli):.2f} s "
                     "per run (medians).")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"monitor_cost: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"### {path}\n")
        print(markdown(monitoring_cost(raw["runs"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
