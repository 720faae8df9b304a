"""Heterogeneous split and monitoring overhead, measured in one run on two test-bed hosts.

Two SSH hosts of the test bed (tests/testbed.py: network namespaces, real sshd, real `coordinator launch`, real
mlx.launch ring backend) are made into two "machines" of different speed with cgroup v1 (benchmarks/cgroups.py):
each host's sshd, and so every process it starts (SSH sessions, the bench, the ranks), is pinned to its own core
(`cpuset`: host `full` on cpu 0, host `half` on cpu 1, so they never contend) and `half` gets half of its core
(`cpu.cfs_quota_us` 50000 per 100000 us period). Both host groups get `cpu.shares` 262144 (--shares; each task of
the root group weighs 1024), so the other work on this shared machine barely takes CPU from them. Every local
process of ours (the CLI, mlx.launch and its ssh clients) runs in a third group, `coordinator`, on cpu 1 with
shares 8192 (--coord-cpus, --coord-shares): it gets what `half` leaves of that core, like a coordinator on a
machine of its own. The workload is compute-bound LoRA training of a tiny llama (playbook `assets.tiny_model`,
default hidden 128, 4 layers) on a generated dataset whose every row is longer than max_seq_length (so every row
is a full max_seq_length-token row, as in the calibration bench).

What runs, all through the coordinator's CLI (each a subprocess):
  1. `coordinator calibrate -i inv.yaml -p cal.yaml --json`: both hosts' curves (in parallel, each on its core)
     and the calibrated split of the global batch, cached for the launches (XDG_CACHE_HOME of the run); again
     with --recalibrate at the start of every later round, so the calibration's own noise is sampled too.
  2. --rounds rounds, each of (order alternating between rounds: odd rounds run the solos first, even rounds the
     2-host jobs first, so that the machine's drift over minutes does not favour one side in every round):
     - solo: `coordinator launch -i inv.yaml solo-<host>-b<B>.yaml --limit <host> --json`, a 1-rank job on one host
       alone, for B in {its batch in round 1's calibrated plan, its best batch on round 1's curve}: the same
       worker.train steps as the 2-host job (the calibration bench compiles its step and feeds random tokens, so
       it is not quite the same work); a host's solo throughput = the best of its batches' medians;
     - calibrated: the 2-host job with `split: calibrated`;
     - equal: the same with `split: equal`;
     - bare: the calibrated job again, started by the same CLI code with the monitor replaced by a plain wait for
       mlx.launch (`coordinator.run.job.Launch` swapped for `BareLaunch` below, in a subprocess: this script with
       --bare-launch). Same preflight, cached calibration, plan, hostfile, run.json, rank script, ssh wrapper and
       mlx.launch argv, but no `worker.follow` on the hosts, no event stream, no monitor loop, no live view.
  3. Steady-state tokens/s of a run, read from the ranks' own event files on the hosts (the same files for
     monitored and bare runs): for each step s after --warmup-steps, (sum over ranks of `tokens` of step s) / (the
     wall time between rank 0's `step` events s-1 and s); the run's value is the median over those steps. Eval and
     checkpoint happen only after the last step (steps_per_eval and save_every are beyond iters), so no interval
     contains them. A configuration's value is the median over its rounds.

Code under test: a `git archive` snapshot of --code (default HEAD), so edits made to the work tree while the
benchmark runs cannot change what is measured (--code worktree uses the work tree).

Workaround (reported as a bug): `coordinator.fleet.ship.ship_worker` sends the worker bundle on stdin, but the remote
extract script exits without reading it when the worker dir already exists; when the remote side is faster than the
client (here: the hosts have CPU priority over the coordinator), the channel closes under the client's write and
the command fails with "Channel not open for sending" (provisioning, prepare, or the follower, which then loses the
node's events and makes the job relaunch). The CLI therefore runs through this script (`--cli`), which patches the
extract script to read its stdin first (`ship_fix`); nothing else changes. --no-ship-fix runs `python -m
coordinator` itself; runs that still fail on that error are run again (at most twice) and counted in the report.

Reported (Markdown on stdout, --json FILE for the raw numbers): the cgroup placement as verified in
/proc/<pid>/cgroup (sshd and a rank), every round's calibration, solo throughputs, calibrated vs equal vs the sum of
solos against the goals (calibrated >= 90% of the sum and >= 1.25x equal), and the monitoring overhead (goal
<= 2%), plus per run: CPU time of each host's group and of the local group (cpuacct), CPU time per process kind
(sampled), and the machine's other CPU use ("background cores": /proc/stat busy time minus our groups').

    .venv/bin/python benchmarks/bench_split.py [--rounds 3] [--global-batch 12] [--seq-len 128] [--hidden 128]
        [--layers 4] [--steady-seconds 25] [--warmup-steps 3] [--quota-us 50000] [--shares 262144]
        [--coord-cpus 1] [--coord-shares 8192] [--time-budget 40] [--code HEAD|worktree] [--no-ship-fix]
        [--json results.json] [--keep DIR]

Needs root (network namespaces, sshd, cgroups) and cgroup v1 cpuset/cpu hierarchies under /sys/fs/cgroup. The
test bed, the cgroups and the temp dir are removed at the end, also on failure or Ctrl-C/SIGTERM; the calibration
cache and quarantine state live in the temp dir (XDG_CACHE_HOME, XDG_STATE_HOME), never in the user's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The coordinator/worker code under test: the repository, or (BENCH_SPLIT_CODE, set for the CLI subprocesses) a
# `git archive` snapshot of a commit, so that edits made to the work tree during the run cannot change it.
CODE = Path(os.environ.get("BENCH_SPLIT_CODE") or ROOT)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(ROOT / "benchmarks"))

import yaml  # noqa: E402
from cgroups import HostCgroups, remove_stale  # noqa: E402
from cliout import by_node, cli_json  # noqa: E402
from machine import cpu_model, dist_version  # noqa: E402

RUN_TIMEOUT = 900.0
THIS = str(Path(__file__).resolve())
HOSTS = (("full", "0", None), ("half", "1", "quota"))  # name, cpuset, quota (None: uncapped)
COORD = "coordinator"  # the local group of every CLI process (and the mlx.launch + ssh clients it starts)
TRANSIENT = "Channel not open for sending"


# --------------------------------------------------------------------------------------------------- bare mode


def ship_fix() -> None:
    """Work around the ship_worker race (see the docstring) in this process: the remote extract script reads its
    stdin (the worker bundle) before deciding anything, so the channel never closes under a writing client."""
    import coordinator.fleet.ship as ship

    first, rest = ship._EXTRACT.split("\n", 1)
    if rest.startswith("payload = sys.stdin.read()"):
        return  # fixed in coordinator/fleet/ship.py: the script reads its stdin first
    if "sys" not in first or "sys.stdin.read()" not in rest:
        raise RuntimeError("bench_split: coordinator.fleet.ship._EXTRACT changed; review ship_fix() (or use --no-ship-fix)")
    ship._EXTRACT = first + "\n_payload = sys.stdin.read()\n" + rest.replace("sys.stdin.read()", "_payload")


def cli_main(cli_args: list[str], *, fix: bool) -> None:
    """`coordinator CLI_ARGS`, the real CLI, in this process, with `ship_fix()` unless `fix` is false."""
    from coordinator.cli import main

    if fix:
        ship_fix()
    main(cli_args)


def bare_launch_main(cli_args: list[str]) -> None:
    """`coordinator launch CLI_ARGS` with the monitor replaced by a plain wait for mlx.launch (see the docstring).
    The summary it prints says `failed` (no monitor saw the ranks finish); the benchmark checks the event files."""
    import asyncio

    import coordinator.run.job
    from coordinator.cli import main
    from coordinator.run.launch import Launch
    from coordinator.run.monitor import Monitor

    class BareLaunch(Launch):
        async def monitor(self) -> Monitor:
            assert self.launcher is not None
            launcher = self.launcher
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(launcher.wait), timeout=RUN_TIMEOUT)
            mon = self.new_monitor()
            mon.stopped = True  # no outcome is known: run_job must neither relaunch nor quarantine
            return mon

    coordinator.run.job.Launch = BareLaunch  # type: ignore[misc]
    if os.environ.get("BENCH_SPLIT_SHIP_FIX") == "1":
        ship_fix()
    main(["launch", *cli_args])


# ------------------------------------------------------------------------------------------------- the workload


def write_dataset(path: Path, *, rows: int, valid_rows: int, words_per_row: int, seed: int = 0) -> None:
    """Text rows of `words_per_row` pseudo-words (600 distinct, each one token of the tiny model's vocabulary)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "du", "fa", "gi", "ho", "ju", "ze", "wa"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(3)) for _ in range(3000)})[:600]
    path.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", rows), ("valid", valid_rows)):
        lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(words_per_row))}) for _ in range(count)]
        (path / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def playbook(args: argparse.Namespace, data: Path, *, name: str, batch: int, iters: int, split: object) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "train",
        "model": "/srv/model",
        "data": "/srv/data",
        "backend": "ring",
        "assets": {"data_from": str(data), "tiny_model": {"layers": args.layers, "hidden": args.hidden, "seed": 0}},
        "train": {"method": "lora", "iters": iters, "batch_size": batch, "learning_rate": 1e-4,
                  "max_seq_length": args.seq_len, "save_every": 100000, "steps_per_eval": 100000, "val_batches": 1},
        "split": split,
        "calibration": {"time_budget": args.time_budget, "max_batch": args.global_batch},
        "heartbeat_timeout": 60,
    }


# ------------------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    kind: str  # solo | duo (a solo next to the other host's solo) | calibrated | equal | bare
    host: str | None  # solo only
    batch: int  # global batch
    round: int
    iters: int = 0
    run_id: str = ""
    ok: bool = False
    error: str = ""
    tokens_per_s: float | None = None  # steady state (median over steps)
    step_s: float | None = None  # median step interval
    steps_used: int = 0
    batches: dict[str, int] = field(default_factory=dict)  # node -> local batch
    wall_s: float = 0.0  # the CLI process
    cli_cpu_s: float = 0.0  # the CLI process (coordinator or bare runner), user+sys incl. its children
    coord_cpu_s: float = 0.0  # cpuacct of the local group: the CLI, mlx.launch and its ssh clients
    attempts: int = 1  # coordinator attempts inside the run (a relaunch makes the run unusable here)
    stderr_tail: str = ""
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # "group: what" -> CPU s (sampled, see _watch)
    host_cpu_s: dict[str, float] = field(default_factory=dict)  # cpuacct usage of each host's cgroup during the run
    throttled: dict[str, int] = field(default_factory=dict)  # nr_throttled periods during the run
    steady_s: float = 0.0  # wall time of the steady-state steps
    background_cores: float | None = None  # other CPU use on the machine during the run (cores busy on average)


def run_cli(argv: Sequence[str], *, env: dict[str, str], log: Path, timeout: float = RUN_TIMEOUT,
            preexec: Callable[[], None] | None = None) -> tuple[int, str, float, float]:
    """Run argv with stdout/stderr to files; (exit code, stdout, wall s, CPU s of it and its children)."""
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    started = time.monotonic()
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                start_new_session=True, preexec_fn=preexec)
    deadline = started + timeout
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shlex.join(argv)} ran over {timeout:g}s")
            time.sleep(0.05)
    except BaseException:
        # Timeout or Ctrl-C/SIGTERM: the CLI and what it started locally (its own session) go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        os.wait4(proc.pid, 0)
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    # wait4's rusage: the CLI process plus the descendants it waited for (mlx.launch and its ssh clients, the
    # local side of the job). The remote side is counted by the hosts' cgroups.
    return proc.returncode, out.read_text(errors="replace"), wall, usage.ru_utime + usage.ru_stime


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq, steal of /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def steady_state(events_by_rank: dict[int, list[dict[str, Any]]], warmup: int) -> tuple[float, float, int, float]:
    """(median tokens/s, median step interval s, steps used, their total wall s) from rank files; see docstring."""
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, evs in events_by_rank.items():
        for ev in evs:
            if ev.get("event") == "step":
                steps.setdefault(int(ev["step"]), {})[rank] = ev
    rates, intervals = [], []
    ranks = sorted(events_by_rank)
    for s in sorted(steps):
        if s <= warmup or s - 1 not in steps or 0 not in steps[s] or 0 not in steps[s - 1]:
            continue
        if any(r not in steps[s] for r in ranks):
            continue
        dt = float(steps[s][0]["t"]) - float(steps[s - 1][0]["t"])
        tokens = sum(int(steps[s][r]["tokens"]) for r in ranks)
        if dt > 0:
            rates.append(tokens / dt)
            intervals.append(dt)
    if not rates:
        raise RuntimeError("no steady-state step")
    return statistics.median(rates), statistics.median(intervals), len(rates), sum(intervals)


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.data = tmp / "data"
        self.run_root = tmp / "runs"
        self.env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb",
                    "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state"),
                    "BENCH_SPLIT_SHIP_FIX": "0" if args.no_ship_fix else "1"}
        self.code_desc = "the work tree"
        if args.code != "worktree":
            code = tmp / "code"
            code.mkdir()
            rev = subprocess.run(["git", "rev-parse", "--short", args.code], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip()
            archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
            self.env["BENCH_SPLIT_CODE"] = str(code)
            self.env["PYTHONPATH"] = str(code)  # `python -m coordinator` (--no-ship-fix) imports the snapshot too
            self.code_desc = f"commit {rev}"
        # The CLI runs through this script (`--cli`) to apply ship_fix(); --no-ship-fix: `python -m coordinator`.
        self.cli_prefix = [sys.executable, "-m", "coordinator"] if args.no_ship_fix else [sys.executable, THIS, "--cli", "--"]
        self.bed: Any = None
        self.cg: HostCgroups | None = None
        self.inv = tmp / "inv.yaml"
        self.runs: list[Run] = []
        self.transient: list[Run] = []  # runs lost to the ship_worker SSH race, run again
        self.placement: dict[str, dict[str, str]] = {}
        self.rank_placement: dict[str, dict[str, str]] = {}
        self.calibration: dict[str, Any] = {}  # round 1's: solo batches and iters come from it
        self.calibrations: list[dict[str, Any]] = []  # every round's
        self.commands: dict[str, str] = {}
        self.seq = 0
        self._lock = threading.Lock()  # launches may run concurrently (launch_duo)

    # -- helpers ---------------------------------------------------------------------------------------------

    def write_pb(self, name: str, **kw: Any) -> Path:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(playbook(self.args, self.data, name=name, **kw), sort_keys=False))
        return path

    def cg_stats(self) -> dict[str, dict[str, int]]:
        assert self.cg is not None
        return {h: self.cg.stats(h) for h in self.cg.hosts}

    def cli(self, argv: Sequence[str], log: Path) -> tuple[int, str, float, float]:
        """A local CLI process in the `coordinator` group (see --shares), everything it starts too."""
        assert self.cg is not None
        return run_cli(argv, env=self.env, log=log, preexec=self.cg.preexec(COORD))

    def host(self, name: str) -> Any:
        return self.bed.host(name)

    def _watch(self, stop: threading.Event, cpu: dict[tuple[str, int], tuple[str, float]]) -> None:
        """While a run goes on, every 0.5 s: each process of our groups' CPU time so far (`cpu`, by group and
        pid: what it is, user+sys seconds; a process's last < 0.5 s before it exits is missed), and once per host
        a worker.train process found in the host's groups (proof that the ranks inherit the sshd's groups)."""
        assert self.cg is not None
        tick = os.sysconf("SC_CLK_TCK")
        while True:
            for name in self.cg.hosts:
                for pid in self.cg.members(name):
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    cpu[(name, pid)] = (_what(cmd), (int(fields[11]) + int(fields[12])) / tick)
                    if name in dict((h, 0) for h, _, _ in HOSTS) and name not in self.rank_placement \
                            and "worker.train" in cmd:
                        with contextlib.suppress(Exception):
                            self.rank_placement[name] = {"pid": str(pid), **self.cg.verify(name, pid)}
            if stop.wait(0.5):
                return

    # -- the runs -----------------------------------------------------------------------------------------------

    def calibrate(self, round_: int) -> None:
        """`coordinator calibrate` (round 1) or `calibrate --recalibrate` (later rounds): measures both hosts and
        caches the curves, which that round's calibrated and bare launches then use."""
        pb = self.write_pb("cal", batch=self.args.global_batch, iters=10, split="calibrated")
        args = ["calibrate", "-i", str(self.inv), "-p", str(pb), "--json", *(["--recalibrate"] if round_ > 1 else [])]
        argv = [*self.cli_prefix, *args]
        self.commands.setdefault("calibrate" if round_ == 1 else "recalibrate",
                                 shlex.join(["coordinator", *[a.replace(str(self.tmp) + "/", "") for a in args]]))
        for _ in range(3):
            rc, out, wall, _ = self.cli(argv, self.tmp / f"calibrate{round_}")
            err = (self.tmp / f"calibrate{round_}.err").read_text(errors="replace")[-3000:]
            if rc == 0 or TRANSIENT not in err:
                break
            log(f"transient `{TRANSIENT}` in calibrate: again")
        if rc != 0:
            raise RuntimeError(f"calibrate exited {rc}: {err}")
        cal = cli_json("calibrate", out)
        cal["wall_s"] = round(wall, 1)
        cal["round"] = round_
        self.calibrations.append(cal)
        if round_ == 1:
            self.calibration = cal
        log(f"calibration round {round_}: "
            + "; ".join(f"{n['node']} batch {n['batch_size']}, curve "
                        + ", ".join(f"{p['batch']}: {p['tokens_per_s']:.0f}" for p in n["curve"]) for n in cal["nodes"])
            + f" ({wall:.0f}s)")

    def node_cal(self, name: str) -> dict[str, Any]:
        return by_node(self.calibration["nodes"])[name]

    def best_point(self, name: str) -> dict[str, Any]:
        curve = self.node_cal(name)["curve"]
        return max(curve, key=lambda p: (p["tokens_per_s"], -p["batch"]))

    def rate_at(self, name: str, batch: int) -> float:
        """Calibration-curve tokens/s at `batch` (nearest measured point at or below; plateau above)."""
        curve = sorted(self.node_cal(name)["curve"], key=lambda p: p["batch"])
        below = [p for p in curve if p["batch"] <= batch] or curve[:1]
        return float(below[-1]["tokens_per_s"])

    def iters_for(self, batches: dict[str, int]) -> int:
        step = max(b * self.args.seq_len / self.rate_at(n, b) for n, b in batches.items())
        steady = math.ceil(self.args.steady_seconds / step)
        return max(self.args.warmup_steps + 8, min(400, self.args.warmup_steps + 1 + steady))

    def launch(self, run: Run, pb: Path, *, limit: str | None = None, bare: bool = False) -> Run:
        with self._lock:
            self.seq += 1
            seq = self.seq
        run.iters = int(yaml.safe_load(pb.read_text())["train"]["iters"])
        cli_args = ["-i", str(self.inv), str(pb), "--json", "--run-dir", str(self.run_root)]
        if limit:
            cli_args += ["--limit", limit]
        if bare:
            argv = [sys.executable, THIS, "--bare-launch", "--", *cli_args]
            shown = ["benchmarks/bench_split.py", "--bare-launch", "--"]
        else:
            argv = [*self.cli_prefix, "launch", *cli_args]
            shown = ["coordinator", "launch"]
        key = f"{run.kind}" + (f" {run.host} b{run.batch}" if run.host else "")
        self.commands.setdefault(key, shlex.join([*shown, *[a.replace(str(self.tmp) + "/", "") for a in cli_args]]))
        before = self.cg_stats()
        busy_before = busy_cpu_s()
        stop = threading.Event()
        cpu: dict[tuple[str, int], tuple[str, float]] = {}
        watcher = threading.Thread(target=self._watch, args=(stop, cpu), daemon=True)
        watcher.start()
        try:
            rc, out, run.wall_s, run.cli_cpu_s = self.cli(argv, self.tmp / f"run{seq:03d}")
        except TimeoutError as exc:
            rc, out = -9, str(exc)
        finally:
            stop.set()
            watcher.join()
        for (group, _), (what, seconds) in cpu.items():
            name = f"{group}: {what}"
            run.cpu_by_process[name] = round(run.cpu_by_process.get(name, 0.0) + seconds, 2)
        after = self.cg_stats()
        busy = busy_cpu_s() - busy_before
        used = {h: (after[h].get("usage_ns", 0) - before[h].get("usage_ns", 0)) / 1e9 for h in after}
        for h, _, _ in HOSTS:
            run.host_cpu_s[h] = round(used[h], 2)
            run.throttled[h] = after[h]["nr_throttled"] - before[h]["nr_throttled"]
        run.coord_cpu_s = round(used[COORD], 2)
        run.stderr_tail = (self.tmp / f"run{seq:03d}.err").read_text(errors="replace")[-3000:]
        if run.wall_s > 0:
            run.background_cores = round(max(0.0, busy - sum(used.values())) / run.wall_s, 2)
        quarantine = self.tmp / "state" / "mlx-coordinator" / "quarantine.json"
        if quarantine.exists():  # a failed run must not leave its nodes out of the next ones
            log(f"clearing quarantine after {key} round {run.round}: {quarantine.read_text()[:300]}")
            quarantine.unlink()
        try:
            summary = cli_json("launch", out[out.index("{"):])  # --json prints summary.json (indented) last
            run.run_id = summary["run_id"]
        except (ValueError, KeyError):
            err = (self.tmp / f"run{seq:03d}.err").read_text(errors="replace")[-2000:]
            run.error = f"exit {rc}, no summary: {err}"
            log(f"{key} round {run.round}: FAILED {run.error}")
            self.runs.append(run)
            return run
        run.attempts = int(summary.get("attempts") or 1)
        if not bare and summary.get("state") != "succeeded":
            run.error = f"state {summary.get('state')}: {summary.get('incidents')}"
        elif run.attempts > 1:
            run.error = f"{run.attempts} attempts: {summary.get('incidents')}"
        hosts = [limit] if limit else [h for h, _, _ in HOSTS]
        events: dict[int, list[dict[str, Any]]] = {}
        for h in hosts:
            evdir = self.host(h).srv / "work" / "runs" / run.run_id / h / "events"
            for f in sorted(evdir.glob("rank*.jsonl")):
                events[int(f.stem[4:])] = read_events(f)
        for rank, evs in events.items():
            started = next((e for e in evs if e.get("event") == "started"), None)
            if started:
                run.batches[str(started.get("node"))] = int(started.get("batch_size", 0))
            if not any(e.get("event") == "finished" for e in evs):
                run.error = run.error or f"rank {rank} did not finish"
        if len(events) != len(hosts):
            run.error = run.error or f"event files of {len(events)} ranks, expected {len(hosts)}"
        if not run.error:
            try:
                run.tokens_per_s, run.step_s, run.steps_used, run.steady_s = steady_state(events, self.args.warmup_steps)
                run.ok = True
            except RuntimeError as exc:
                run.error = str(exc)
        shown_rate = f"{run.tokens_per_s:.1f} tok/s (step {run.step_s:.3f}s x{run.steps_used})" if run.ok else run.error
        log(f"{key} round {run.round}: {shown_rate}; batches {run.batches}; wall {run.wall_s:.0f}s; host CPU "
            f"{run.host_cpu_s}; local CPU {run.coord_cpu_s:.1f}s; background {run.background_cores} cores; "
            f"by process {dict(sorted(run.cpu_by_process.items(), key=lambda kv: -kv[1])[:8])}")
        self.runs.append(run)
        return run

    def launch_duo(self, combo: dict[str, tuple[int, Path]], round_: int) -> None:
        """Every host's solo job AT THE SAME TIME (one 1-rank `coordinator launch --limit HOST` each): a host's
        throughput while the other host is busy too, as it is in the 2-host job. On this test bed the two
        "machines" are two cores of one VM that share its caches and memory bandwidth (separate Macs share
        nothing), so a host alone runs faster than it can next to a busy neighbour: the plain solos' sum is an
        upper bound no 2-host job here can reach."""
        threads = [threading.Thread(target=self.launch_retrying, args=(lambda h=h, b=b: Run("duo", h, b, round_), pb),
                                    kwargs={"limit": h}) for h, (b, pb) in combo.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def launch_retrying(self, make: Callable[[], Run], pb: Path, **kw: Any) -> Run:
        """`launch`, again (up to 2 more times) when the run failed on the transient SSH race of ship_worker
        (see the docstring); such runs are kept apart in `self.transient`, not in the results."""
        for _ in range(3):
            run = self.launch(make(), pb, **kw)
            if run.ok or TRANSIENT not in run.error + run.stderr_tail:
                return run
            self.runs.remove(run)
            self.transient.append(run)
            log(f"transient `{TRANSIENT}`: {run.kind} {run.host or ''} round {run.round} runs again")
        return run

    def main(self) -> None:
        args = self.args
        from tests.testbed import TestBed, cleanup_stale

        cleanup_stale()
        remove_stale()
        write_dataset(self.data, rows=args.rows, valid_rows=16, words_per_row=args.seq_len + 64)
        with TestBed(tmp=self.tmp / "bed") as bed, HostCgroups(f"{bed.tag}-{os.getpid()}") as cg:
            self.bed, self.cg = bed, cg
            hosts = bed.add_hosts([h for h, _, _ in HOSTS])
            cg.create(COORD, cpus=args.coord_cpus or None, shares=args.coord_shares or None)
            for (name, cpus, quota), host in zip(HOSTS, hosts, strict=True):
                assert host.pid is not None
                cg.place(name, host.pid, cpus=cpus, quota_us=args.quota_us if quota else None,
                         shares=args.shares or None)
                self.placement[name] = {"pid": str(host.pid), **cg.verify(name)}
                log(f"{name}: sshd {host.pid} in {self.placement[name]}")
            bed.write_inventory(self.inv, hosts)
            self.calibrate(1)
            plan = {n: int(row["batch_size"]) for n, row in by_node(self.calibration["nodes"]).items()}
            equal = {h: b for h, b in zip(plan, _equal(args.global_batch, len(plan)), strict=True)}
            iters = self.iters_for(plan) if not args.iters else args.iters
            iters_equal = self.iters_for(equal) if not args.iters else args.iters
            pbs = {
                "calibrated": self.write_pb("split-cal", batch=args.global_batch, iters=iters, split="calibrated"),
                "equal": self.write_pb("split-equal", batch=args.global_batch, iters=iters_equal, split="equal"),
            }
            solo: list[tuple[str, int, Path]] = []
            for h in plan:
                for b in sorted({plan[h], int(self.best_point(h)["batch"])}):
                    it = self.iters_for({h: b}) if not args.iters else args.iters
                    solo.append((h, b, self.write_pb(f"solo-{h}-b{b}", batch=b, iters=it, split="equal")))
            duos: list[dict[str, tuple[int, Path]]] = []
            for pick in (plan, {h: int(self.best_point(h)["batch"]) for h in plan}):
                combo = {h: (b, next(p for hh, bb, p in solo if hh == h and bb == b)) for h, b in pick.items()}
                if combo not in duos:
                    duos.append(combo)
            for r in range(1, args.rounds + 1):
                if r > 1:
                    self.calibrate(r)
                # Odd rounds run the solos first, even rounds the 2-host jobs first (ABBA): the machine's speed
                # drifts over minutes, and a drift that favours the 2-host jobs in one round disfavours them in
                # the next, instead of biasing every round the same way.
                def singles(r: int = r) -> None:
                    for h, b, pb in solo if r % 2 else reversed(solo):
                        self.launch_retrying(lambda h=h, b=b, r=r: Run("solo", h, b, r), pb, limit=h)
                    for combo in duos if r % 2 else reversed(duos):
                        self.launch_duo(combo, r)

                def jobs(r: int = r) -> None:
                    for kind in ["calibrated", "equal", "bare"] if r % 2 else ["bare", "equal", "calibrated"]:
                        pb = pbs["calibrated" if kind == "bare" else kind]
                        self.launch_retrying(lambda kind=kind, r=r: Run(kind, None, args.global_batch, r), pb,
                                             bare=kind == "bare")

                for part in (singles, jobs) if r % 2 else (jobs, singles):
                    part()
            for name, _, _ in HOSTS:
                self.placement[name]["members_at_end"] = str(len(cg.members(name)))
        self.bed = None


def _what(cmd: str) -> str:
    """A short name for a process of our groups, from its command line."""
    for needle, name in (("mlx._distributed_utils.launch", "mlx.launch"), ("worker.train", "rank"),
                         ("worker.follow", "follower"), ("worker.bench", "bench"), ("--bare-launch", "CLI"), ("--cli", "CLI"),
                         ("-m coordinator", "CLI"), ("sshd", "sshd")):
        if needle in cmd:
            return name
    argv0 = cmd.split(" ", 1)[0]
    return "ssh" if argv0.endswith("ssh") else os.path.basename(argv0) or "?"


def calibration_rows(calibrations: list[dict[str, Any]]) -> list[str]:
    """The report's calibration table rows, one per round and host, from `calibrate --json` documents (read through
    its schema: `cli_json`) with the bench's `round` and `wall_s` added."""
    rows = []
    for c in calibrations:
        for n in c.get("nodes", []):
            curve = ", ".join(f"{p['batch']}: {p['tokens_per_s']:.0f}" for p in n["curve"])
            best = max(n["curve"], key=lambda p: p["tokens_per_s"])
            rows.append(f"| {c['round']} | {n['node']} | {curve} | {best['tokens_per_s']:.0f} at {best['batch']} | "
                        f"{n['batch_size']} | {100 * n['share']:.1f}% | {c.get('wall_s', '?')} |")
    return rows


def _equal(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- report


def _med(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _f(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def report(bench: Bench, args: argparse.Namespace, command: str) -> tuple[str, dict[str, Any]]:
    from monitor_cost import markdown as markdown_cost  # benchmarks/ is this script's dir, first on sys.path
    from monitor_cost import monitoring_cost

    runs = bench.runs
    lines: list[str] = []
    add = lines.append
    cal = bench.calibration
    add(f"Command: `{command}` (code under test: {bench.code_desc})  ")
    add(f"Machine: {os.cpu_count()} cores, {cpu_model('unknown CPU')}, mlx {dist_version('mlx', '?')} (CPU backend), Python "
        f"{sys.version.split()[0]}; load average at the end {os.getloadavg()[0]:.1f} (other work shares the cores).  ")
    add(f"Workload: LoRA (all layers) of a tiny llama, hidden {args.hidden}, {args.layers} layers, max_seq_length "
        f"{args.seq_len} (every row full length), global batch {args.global_batch}; first {args.warmup_steps} "
        f"steps excluded; {args.rounds} rounds, order alternating (odd rounds solos first, even rounds 2-host jobs first).")
    add("")
    add("Hosts (cgroup v1 placement of each host's sshd, read back from /proc/<pid>/cgroup; a rank found in the "
        "same groups during a run):")
    add("")
    add("| host | cpuset.cpus | cpu.cfs_quota_us / period | sshd cgroups | Cpus_allowed_list (sshd / rank) | "
        "rank pid in the host's groups |")
    add("|---|---|---|---|---|---|")
    for name, cpus, quota in HOSTS:
        p = bench.placement.get(name, {})
        rk = bench.rank_placement.get(name, {})
        groups = ", ".join(f"{c}:{p[c]}" for c in ("cpuset", "cpu", "cpuacct") if c in p)
        q = f"{args.quota_us} / 100000" if quota else "-1 / 100000"
        add(f"| {name} | {cpus} | {q} | `{groups}` | {p.get('cpus_allowed', '?')} / {rk.get('cpus_allowed', '?')} | "
            f"{'yes (pid ' + rk['pid'] + ')' if rk else 'not seen'} |")
    add("")
    add(f"Calibration: `{bench.commands.get('calibrate', '')}` in round 1, then `--recalibrate` at the start of "
        "every later round (the calibrated and bare runs of a round use that round's curves):")
    add("")
    add("| round | host | curve (batch: tokens/s) | best | planned batch | share | s |")
    add("|---|---|---|---|---|---|---|")
    for row in calibration_rows(bench.calibrations):
        add(row)
    add("")

    def kind_runs(kind: str, host: str | None = None, batch: int | None = None) -> list[Run]:
        return [r for r in runs if r.kind == kind and (host is None or r.host == host) and
                (batch is None or r.batch == batch)]

    def per_round(rs: list[Run]) -> str:
        return ", ".join(_f(r.tokens_per_s) if r.ok else "failed" for r in sorted(rs, key=lambda r: r.round))

    add("Solo throughput (1-rank `coordinator launch --limit HOST`, the same worker.train steps; steady-state "
        "tokens/s per round and median):")
    add("")

    def solo_table(kind: str) -> dict[str, float]:
        """The table of `kind` (solo | duo) runs per host and batch; returns each host's best median."""
        add("| host | batch | iters | per round | median | step s | background cores |")
        add("|---|---|---|---|---|---|---|")
        best: dict[str, float] = {}
        for name, _, _ in HOSTS:
            for b in sorted({r.batch for r in kind_runs(kind, name)}):
                rs = kind_runs(kind, name, b)
                med = _med([r.tokens_per_s for r in rs if r.ok])
                if med is not None:
                    best[name] = max(best.get(name, 0.0), med)
                add(f"| {name} | {b} | {_iters(rs)} | {per_round(rs)} | {_f(med)} | "
                    f"{_f(_med([r.step_s for r in rs if r.ok]), '.3f')} | {_bg(rs)} |")
        return best

    solo_best = solo_table("solo")
    solo_sum = sum(solo_best.values()) if len(solo_best) == len(HOSTS) else None
    add("")
    add(f"Sum of solos (each host's best batch): {' + '.join(f'{solo_best[h]:.1f}' for h in solo_best)} = "
        f"**{_f(solo_sum)} tokens/s**.")
    add("")
    add("Concurrent solos (both hosts' 1-rank jobs at the same time: each host next to a busy neighbour, as in "
        "the 2-host job; see `launch_duo`):")
    add("")
    duo_best = solo_table("duo")
    duo_sum = sum(duo_best.values()) if len(duo_best) == len(HOSTS) else None
    add("")
    add(f"Sum of concurrent solos (each host's best batch): "
        f"{' + '.join(f'{duo_best[h]:.1f}' for h in duo_best)} = **{_f(duo_sum)} tokens/s** "
        f"({_f(100 * duo_sum / solo_sum if duo_sum and solo_sum else None)}% of the plain solos' sum).")
    add("")
    add("Two hosts, one job (`coordinator launch`, 2 ranks over the ring backend):")
    add("")
    add("| split | local batches (full/half) | iters | per round (tokens/s) | median | step s | vs sum of solos | vs equal | "
        "background cores |")
    add("|---|---|---|---|---|---|---|---|---|")
    meds: dict[str, float | None] = {}
    for kind in ("calibrated", "equal"):
        meds[kind] = _med([r.tokens_per_s for r in kind_runs(kind) if r.ok])
    for kind in ("calibrated", "equal"):
        rs = sorted(kind_runs(kind), key=lambda r: r.round)
        shown = ", ".join(sorted({"/".join(str(r.batches.get(h, "?")) for h, _, _ in HOSTS) for r in rs if r.batches}))
        vs_sum = f"{100 * meds[kind] / solo_sum:.1f}%" if meds[kind] and solo_sum else "-"
        vs_eq = f"{meds[kind] / meds['equal']:.2f}x" if meds[kind] and meds["equal"] else "-"
        add(f"| {kind} | {shown} | {_iters(rs)} | {per_round(rs)} | {_f(meds[kind])} | "
            f"{_f(_med([r.step_s for r in rs if r.ok]), '.3f')} | {vs_sum} | {vs_eq} | {_bg(rs)} |")
    add("")
    c, e = meds["calibrated"], meds["equal"]
    goal1 = c is not None and solo_sum is not None and c >= 0.9 * solo_sum
    goal2 = c is not None and e is not None and c >= 1.25 * e
    paired: dict[str, list[float]] = {"solo": [], "duo": []}
    for r in range(1, args.rounds + 1):
        cr = next((x for x in kind_runs("calibrated") if x.round == r and x.ok), None)
        for kind in paired:
            best = {h: max((x.tokens_per_s or 0.0 for x in kind_runs(kind, h) if x.round == r and x.ok), default=0.0)
                    for h, _, _ in HOSTS}
            if cr is not None and cr.tokens_per_s and all(best.values()):
                paired[kind].append(100 * cr.tokens_per_s / sum(best.values()))
    add(f"Calibrated vs the same round's sums (paired, machine drift between rounds cancels): plain solos "
        f"{', '.join(f'{v:.1f}%' for v in paired['solo']) or '-'} (median {_f(_med(paired['solo']))}%); "
        f"concurrent solos {', '.join(f'{v:.1f}%' for v in paired['duo']) or '-'} (median {_f(_med(paired['duo']))}%). "
        f"Calibrated median vs the concurrent solos' sum: {_f(100 * c / duo_sum if c and duo_sum else None)}%.")
    add("")
    add(f"Goals: calibrated >= 90% of the sum of solos: **{'met' if goal1 else 'NOT met'}** "
        f"({_f(100 * c / solo_sum if c and solo_sum else None)}%); calibrated >= 1.25x equal: "
        f"**{'met' if goal2 else 'NOT met'}** ({_f(c / e if c and e else None, '.2f')}x).")
    add("")
    add("Monitoring overhead (the calibrated job, same plan and files; `bare` = the same CLI code with the monitor "
        "replaced by a plain wait for mlx.launch):")
    add("")
    add("| run | per round (tokens/s) | median | step s | CPU s per 100 steps: host full / half / local CLI | "
        "background cores |")
    add("|---|---|---|---|---|---|")
    for kind, label in (("calibrated", "coordinator (follow + monitor + live view)"), ("bare", "bare mlx.launch")):
        rs = kind_runs(kind)
        cpu = _cpu_per_100(rs)
        add(f"| {label} | {per_round(rs)} | {_f(_med([r.tokens_per_s for r in rs if r.ok]))} | "
            f"{_f(_med([r.step_s for r in rs if r.ok]), '.3f')} | {cpu} | {_bg(rs)} |")
    b = _med([r.tokens_per_s for r in kind_runs("bare") if r.ok])
    overhead = 100 * (b - c) / b if b and c else None
    paired_overhead = []
    for r in range(1, args.rounds + 1):
        cr = next((x for x in kind_runs("calibrated") if x.round == r and x.ok), None)
        br = next((x for x in kind_runs("bare") if x.round == r and x.ok), None)
        if cr and br and cr.tokens_per_s and br.tokens_per_s:
            paired_overhead.append(100 * (br.tokens_per_s - cr.tokens_per_s) / br.tokens_per_s)
    add("")
    add(f"Overhead (1 - coordinator/bare, medians): **{_f(overhead, '+.2f')}%** (goal <= 2%: "
        f"**{'met' if overhead is not None and overhead <= 2 else 'NOT met'}**); per round: "
        f"{', '.join(f'{p:+.2f}%' for p in paired_overhead) or '-'}.")
    add("")
    add("The monitoring's own CPU on the hosts (the follower and its sshd work, against the rank it shares a core "
        "with; `benchmarks/monitor_cost.py` on this run's JSON):")
    add("")
    add(markdown_cost(monitoring_cost([asdict(r) for r in runs])))
    failed = [r for r in runs if not r.ok]
    add(f"Runs: {len(runs)}, failed: {len(failed)}" + (": " + "; ".join(
        f"{r.kind} {r.host or ''} round {r.round}: {r.error[:200]}" for r in failed) if failed else "") +
        f"; run again after failing on `{TRANSIENT}` (the ship_worker race): {len(bench.transient)}" +
        (" (" + ", ".join(f"{r.kind} {r.host or ''} round {r.round}".replace("  ", " ") for r in bench.transient) + ")"
         if bench.transient else "") + ".")
    add("")
    add("Commands (paths relative to the benchmark's temp dir):")
    add("")
    for key, cmd in bench.commands.items():
        add(f"- {key}: `{cmd}`")
    raw = {"args": vars(args), "placement": bench.placement, "rank_placement": bench.rank_placement,
           "calibration": cal, "calibrations": bench.calibrations, "runs": [asdict(r) for r in runs],
           "transient": [asdict(r) for r in bench.transient], "solo_best": solo_best, "solo_sum": solo_sum,
           "medians": meds, "bare_median": b, "overhead_pct": overhead, "paired_overhead_pct": paired_overhead,
           "duo_best": duo_best, "duo_sum": duo_sum, "paired_vs_sums_pct": paired,
           "commands": bench.commands}
    return "\n".join(lines) + "\n", raw


def _bg(rs: list[Run]) -> str:
    """Median of the other work's average CPU use during the runs (cores; the machine has 2)."""
    return _f(_med([r.background_cores for r in rs if r.ok]), ".2f")


def _iters(rs: list[Run]) -> str:
    return ", ".join(sorted({str(r.iters) for r in rs})) or "-"


def _cpu_per_100(rs: list[Run]) -> str:
    """Median CPU seconds per 100 steps of each host's cgroup and of the CLI process, over whole runs (start-up,
    preflight and teardown included)."""
    vals: dict[str, list[float]] = {"full": [], "half": [], "cli": []}
    for r in rs:
        if r.ok and r.iters:
            for h in ("full", "half"):
                vals[h].append(100 * r.host_cpu_s.get(h, 0.0) / r.iters)
            vals["cli"].append(100 * r.coord_cpu_s / r.iters)
    return " / ".join(_f(_med(vals[k])) for k in ("full", "half", "cli"))


# ------------------------------------------------------------------------------------------------------- main


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP -> KeyboardInterrupt, so every `finally` (bed, cgroups, temp dir) runs."""

    def raise_(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=256, help="training rows in the generated dataset")
    p.add_argument("--steady-seconds", type=float, default=25.0, help="target steady-state seconds per run")
    p.add_argument("--iters", type=int, default=0, help="fixed iters for every run (default: from --steady-seconds)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--quota-us", type=int, default=50_000, help="CPU quota of host `half` per 100 ms period")
    p.add_argument("--shares", type=int, default=262144,
                   help="cpu.shares of each host's group (each task of the root group weighs 1024; 0: leave default)")
    p.add_argument("--code", default="HEAD",
                   help="git revision whose coordinator/worker code runs (a `git archive` snapshot), or `worktree`")
    p.add_argument("--no-ship-fix", action="store_true",
                   help="run the plain CLI, without the workaround for the ship_worker race (retries instead)")
    p.add_argument("--coord-cpus", default="1", help="cpuset of the local group (CLI, mlx.launch, ssh); '' = all")
    p.add_argument("--coord-shares", type=int, default=8192, help="cpu.shares of the local group (0: default)")
    p.add_argument("--time-budget", type=float, default=40.0, help="calibration time budget per node (s)")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--keep", type=Path, help="copy the temp dir (playbooks, logs, run dirs) here at the end")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli"]:
        rest = argv[1:]
        cli_main(rest[1:] if rest[:1] == ["--"] else rest, fix=os.environ.get("BENCH_SPLIT_SHIP_FIX") == "1")
        return 0
    if argv[:1] == ["--bare-launch"]:
        rest = argv[1:]
        bare_launch_main(rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_split.py", *argv])
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-split-"))
    bench = Bench(args, tmp)
    try:
        with _signals_raise():
            try:
                bench.main()
            finally:
                text, raw = report(bench, args, command)
                raw["seconds"] = round(time.monotonic() - started, 1)
                print(text)
                if args.json:
                    args.json.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    finally:
        if args.keep:
            import shutil

            shutil.copytree(tmp, args.keep, dirs_exist_ok=True, symlinks=True, ignore_dangling_symlinks=True)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
