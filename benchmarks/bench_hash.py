"""Benchmark the node probe's file hashing (worker/probe.py) against `sha256sum`.

Creates test files in a temp dir (default: one 2 GiB file and 8 x 256 MiB files), reads them all once so
that EVERY run below is page-cache-warm (dropping the page cache needs root and is not assumed), then
measures, as the median of --runs runs (runs of the compared tools are interleaved so drift hits both):

  1. one big file:  `sha256sum BIG` vs the probe hashing it (jobs=1); ratio = probe throughput / sha256sum's
  2. 8 files:       `sha256sum F1..F8` (one process, sequential) vs probe jobs=1 vs probe jobs=0 (parallel)
  3. re-verify:     probe with an empty hash cache (cold) vs the same dir again with the cache filled (warm),
                    in-process and as the coordinator runs it (`python -c BOOTSTRAP KEY ARGS`, source on
                    stdin, its compiled code cached in a HOME of the benchmark's own)

Prints a Markdown table and the exact command that produced it; writes nothing but its temp files.
    .venv/bin/python benchmarks/bench_hash.py [--big-mib 2048] [--small-mib 256] [--small-count 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shlex
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.facts.probe import python_args, worker_source  # noqa: E402 - after the path fix (any cwd)
from worker import probe  # noqa: E402 - after the path fix, so the script runs from any cwd

MIB = 1024 * 1024
GIB = 1024 * MIB


def make_file(path: Path, size: int) -> None:
    # Random content (so no filesystem can dedupe/compress it), generated once per 16 MiB block and varied
    # per block: urandom for several GiB would dominate the set-up time.
    block = bytearray(os.urandom(16 * MIB))
    with open(path, "wb") as fh:
        written = 0
        i = 0
        while written < size:
            block[:8] = i.to_bytes(8, "little")
            n = min(len(block), size - written)
            fh.write(memoryview(block)[:n])
            written += n
            i += 1


def preread(paths: list[Path]) -> None:
    buf = bytearray(8 * MIB)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def cpu_seconds() -> float:
    # This process (all threads) plus waited-for children (sha256sum, the probe script): CPU time is what a
    # loaded machine cannot distort much, unlike wall time.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call."""
    cpu, started = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - started, cpu_seconds() - cpu


def run_sha256sum(cmd: list[str], paths: list[Path]) -> dict[str, str]:
    out = subprocess.run([*cmd, *map(str, paths)], check=True, capture_output=True, text=True).stdout
    return {line.split(maxsplit=1)[1].lstrip("*"): line.split()[0] for line in out.splitlines()}


def probe_hash(path: Path, jobs: int, cache: Path | None = None) -> dict[str, str]:
    [entry] = probe.hash_dirs([str(path)], str(cache) if cache else None, jobs=jobs)
    assert entry["error"] is None, entry["error"]
    return {str(path / f["path"]): f["sha256"] for f in entry["files"]}


def script_run(path: Path, cache: Path) -> None:
    args = '{"hash_dirs": ["%s"], "cache": "%s"}' % (path, cache)  # noqa: UP031 - plain paths, no quoting needed
    source = worker_source()
    env = {**os.environ, "HOME": str(cache.parent)}  # the compiled-probe cache too stays in the temp dir
    subprocess.run([sys.executable, *python_args(source), args], input=source, check=True, capture_output=True,
                   text=True, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mib", type=int, default=2048, help="size of the single big file (MiB)")
    ap.add_argument("--small-mib", type=int, default=256, help="size of each of the small files (MiB)")
    ap.add_argument("--small-count", type=int, default=8, help="number of small files")
    ap.add_argument("--runs", type=int, default=3, help="runs per measurement; the median is reported")
    ap.add_argument("--dir", default=None, help="where to create the temp dir (default: the system temp dir)")
    ap.add_argument("--sha256sum", default=None, help="reference command (default: sha256sum, else shasum -a 256)")
    opts = ap.parse_args()
    if opts.sha256sum:
        ref = shlex.split(opts.sha256sum)
    elif shutil.which("sha256sum"):
        ref = ["sha256sum"]
    else:
        ref = ["shasum", "-a", "256"]  # macOS before sha256sum shipped
    command = " ".join(
        [shlex.quote(os.path.relpath(sys.executable)) if sys.executable.startswith(str(ROOT)) else sys.executable,
         "benchmarks/bench_hash.py", f"--big-mib {opts.big_mib}", f"--small-mib {opts.small_mib}",
         f"--small-count {opts.small_count}", f"--runs {opts.runs}"]
        + ([f"--sha256sum {shlex.quote(opts.sha256sum)}"] if opts.sha256sum else [])
    )
    jobs = probe.default_jobs()
    load_start = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    with tempfile.TemporaryDirectory(prefix="bench-hash-", dir=opts.dir) as tmp:
        base = Path(tmp)
        big_dir, small_dir, cache_dir = base / "big", base / "small", base / "cache"
        for d in (big_dir, small_dir, cache_dir):
            d.mkdir()
        big = big_dir / "big.bin"
        smalls = [small_dir / f"part{i:02d}.bin" for i in range(opts.small_count)]
        print(f"creating {opts.big_mib} MiB + {opts.small_count} x {opts.small_mib} MiB in {base} ...", file=sys.stderr)
        make_file(big, opts.big_mib * MIB)
        for p in smalls:
            make_file(p, opts.small_mib * MIB)
        preread([big, *smalls])

        # Correctness first: the probe must agree with the reference tool byte for byte.
        assert probe_hash(big_dir, 1) == run_sha256sum(ref, [big])
        assert probe_hash(small_dir, 0) == run_sha256sum(ref, smalls)

        t: dict[str, list[tuple[float, float]]] = {k: [] for k in ("ref_big", "probe_big", "ref_small", "probe_j1", "probe_jn",
                                                     "cold", "warm", "script_warm")}
        for run in range(opts.runs):
            print(f"run {run + 1}/{opts.runs}", file=sys.stderr)
            t["ref_big"].append(timed(lambda: run_sha256sum(ref, [big])))
            t["probe_big"].append(timed(lambda: probe_hash(big_dir, 1)))
            t["ref_small"].append(timed(lambda: run_sha256sum(ref, smalls)))
            t["probe_j1"].append(timed(lambda: probe_hash(small_dir, 1)))
            t["probe_jn"].append(timed(lambda: probe_hash(small_dir, 0)))
            cache = cache_dir / f"run{run}.json"  # a fresh, empty hash cache: every file is read
            t["cold"].append(timed(lambda c=cache: probe_hash(base, 0, c)))  # type: ignore[misc]
            t["warm"].append(timed(lambda c=cache: probe_hash(base, 0, c)))  # type: ignore[misc]
            t["script_warm"].append(timed(lambda c=cache: script_run(base, c)))  # type: ignore[misc]

    load_end = os.getloadavg()[0]
    med = {k: statistics.median(w for w, _ in v) for k, v in t.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in t.items()}
    big_gib = opts.big_mib / 1024
    small_gib = opts.small_mib * opts.small_count / 1024
    all_gib = big_gib + small_gib
    ref_name = " ".join(ref)

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"

    def row(case: str, what: str, key: str, gib: float, ratio: str, rate: bool = True) -> str:
        # No throughput for cache hits: nothing is read, GiB/s would be a meaningless big number.
        wall_rate = f"{gib / med[key]:.2f}" if rate else "-"
        cpu_rate = f"{gib / cpu[key]:.2f}" if rate and cpu[key] > 0 else "-"
        return f"| {case} | {what} | {ms(med[key])} | {wall_rate} | {ms(cpu[key])} | {cpu_rate} | {ratio} |"

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, {ssl.OPENSSL_VERSION}; "
        f"{subprocess.run([ref[0], '--version'], capture_output=True, text=True).stdout.splitlines()[0:1] or ref}",
        f"All runs page-cache-warm (files read once before timing); medians of {opts.runs} runs; "
        f"1-min load average {load_start:.2f} at start, {load_end:.2f} at end; "
        f"probe jobs=0 means {jobs} threads here.",
        "",
        "| case | tool | wall ms | GiB/s (wall) | CPU ms | GiB per CPU-s | ratio (of wall medians) |",
        "|---|---|---:|---:|---:|---:|---|",
        row(f"1 file, {opts.big_mib} MiB", f"`{ref_name}`", "ref_big", big_gib, "1.00 (reference)"),
        row(f"1 file, {opts.big_mib} MiB", "probe, jobs=1", "probe_big", big_gib,
            f"{med['ref_big'] / med['probe_big']:.2f}x sha256sum throughput (goal >= 0.95); "
            f"by CPU time {cpu['ref_big'] / cpu['probe_big']:.2f}x"),
        row(f"{opts.small_count} x {opts.small_mib} MiB", f"`{ref_name}` (sequential)", "ref_small", small_gib,
            "1.00 (reference)"),
        row(f"{opts.small_count} x {opts.small_mib} MiB", "probe, jobs=1", "probe_j1", small_gib,
            f"{med['ref_small'] / med['probe_j1']:.2f}x sha256sum"),
        row(f"{opts.small_count} x {opts.small_mib} MiB", f"probe, jobs=0 ({jobs} threads)", "probe_jn", small_gib,
            f"{med['probe_j1'] / med['probe_jn']:.2f}x speed-up over jobs=1; "
            f"{med['ref_small'] / med['probe_jn']:.2f}x sha256sum"),
        row(f"all {1 + opts.small_count} files, {all_gib:.2f} GiB", "probe, cold hash cache", "cold", all_gib,
            "1.00 (reference)"),
        row(f"all {1 + opts.small_count} files, {all_gib:.2f} GiB", "probe, warm hash cache (in-process)", "warm",
            all_gib, f"{med['cold'] / med['warm']:.0f}x faster than cold (goal >= 50x)", rate=False),
        row(f"all {1 + opts.small_count} files, {all_gib:.2f} GiB",
            "probe, warm, whole script (`python -c BOOTSTRAP KEY ARGS`)", "script_warm", all_gib,
            f"{med['cold'] / med['script_warm']:.0f}x faster than cold (mostly interpreter start-up)", rate=False),
        "",
        f"Command: `{command}`",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
