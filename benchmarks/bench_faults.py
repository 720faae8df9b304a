"""Fault detection and recovery of `coordinator launch` on network-namespace test hosts (tests/testbed.py).

One test bed of 3 SSH hosts (h1..h3, a network namespace and sshd each, the real mlx.launch ring backend, the
tiny 2-layer model) and the fault playbook of tests/integration/test_faults.py (split equal, iters 40,
consistency_every 5, save_every 2, heartbeat_timeout 6, max_restarts 2). Every run is the real CLI
`coordinator launch -i INV PB --json --run-dir DIR [--chaos SPEC]` in the background, with its own
XDG_STATE_HOME / XDG_CACHE_HOME (quarantine state never leaks between runs).

Measured:
  clean       runs without a fault: every incident of any kind is a false one (goal: zero)
  external    faults made from outside once the victim rank reported step 5: kill -9 of the rank's PID
              (kill9), SIGSTOP (sigstop), the host's link down (link), the host's sshd and all its sessions
              killed (sshd)
  chaos       `--chaos KIND:rank=R,step=5` for nan, diverge, lie, kill, hang (the worker injects it)

For every fault: the first culprit incident (kind, node: is the attribution right?), the coordinator's
`detected_after_s` (measured from the LAST SIGN OF LIFE of the culprit: its last event, or the node's last
tick, to the detection) and an outside measurement: wall time from the injection (this script's clock right
before kill / SIGSTOP / link down / sshd kill) to the incident line appearing in runs/<id>/events.jsonl (polled
every 50 ms). For chaos faults there is no outside injection instant: the reference is the `t` of the victim
rank's last event written before the incident (the worker's clock; same machine). Then the recovery:
`recoveries[].first_step_after_s` (detection to the relaunch's first step), attempts, and whether the run ended
`succeeded` with the full number of steps.

Runs go in rounds (every fault kind once, then a share of the clean runs), so a --budget cut still covers
every kind. A host broken by link/sshd is repaired after its run (every process in its namespace killed, sshd
restarted, link up). Raw results are kept in --json-out after every run; --report FILE renders them again.

    sudo .venv/bin/python benchmarks/bench_faults.py [--clean 10] [--reps 3] [--budget-min 25]
        [--kinds kill9,sigstop,link,sshd,chaos-nan,chaos-diverge,chaos-lie,chaos-kill,chaos-hang]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.test_faults import HEARTBEAT_TIMEOUT, ITERS, write_playbook  # noqa: E402
from tests.testbed import Host, TestBed, _kill_and_wait, _netns_pids  # noqa: E402

INJECT_STEP = 5
RUN_TIMEOUT = 300.0
POLL_S = 0.05

# kind -> (victim rank, expected incident kinds, chaos spec or None)
FAULTS: dict[str, tuple[int, tuple[str, ...], str | None]] = {
    "kill9": (1, ("crash",), None),
    "sigstop": (2, ("hang",), None),
    "link": (2, ("unreachable",), None),
    "sshd": (1, ("unreachable", "crash"), None),
    "chaos-nan": (2, ("nan",), f"nan:rank=2,step={INJECT_STEP}"),
    "chaos-diverge": (2, ("inconsistent",), f"diverge:rank=2,step={INJECT_STEP}"),
    "chaos-lie": (1, ("implausible_progress",), f"lie:rank=1,step={INJECT_STEP}"),
    "chaos-kill": (1, ("crash",), f"kill:rank=1,step={INJECT_STEP}"),
    "chaos-hang": (2, ("hang",), f"hang:rank=2,step={INJECT_STEP}"),
}
INJECTED = {
    "kill9": "`kill -9` of rank 1's PID",
    "sigstop": "`kill -STOP` of rank 2's PID",
    "link": "h3's link down (bridge port down, ARP kept)",
    "sshd": "h2's sshd and every process of the host killed",
    "chaos-nan": "`--chaos nan:rank=2,step=5`",
    "chaos-diverge": "`--chaos diverge:rank=2,step=5`",
    "chaos-lie": "`--chaos lie:rank=1,step=5`",
    "chaos-kill": "`--chaos kill:rank=1,step=5`",
    "chaos-hang": "`--chaos hang:rank=2,step=5`",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Result:
    fault: str  # clean | a FAULTS key
    rep: int
    run_id: str = ""
    rc: int | None = None
    state: str = ""
    steps: int | None = None
    attempts: int | None = None
    wall_s: float = 0.0
    incidents: list[dict[str, Any]] = field(default_factory=list)  # kind, node, rank, action, detected_after_s
    quarantined: list[str] = field(default_factory=list)
    first: dict[str, Any] | None = None  # the first culprit incident
    expected_node: str | None = None
    attribution_ok: bool | None = None
    outside_s: float | None = None  # injection (or the victim's last event) -> incident line in events.jsonl
    outside_ref: str = ""
    outside_any_s: float | None = None  # ... to the first stop/quarantine line, echoes included
    first_step_after_s: float | None = None
    leftover: str = ""  # processes of the run still alive after launch returned
    error: str = ""


class Events:
    """Incremental reader of runs/<id>/events.jsonl."""

    def __init__(self, runs: Path) -> None:
        self.runs = runs
        self.path: Path | None = None
        self.offset = 0
        self.buf = ""
        self.lines: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        if self.path is None:
            found = sorted(self.runs.glob("fault-*/events.jsonl")) if self.runs.exists() else []
            if not found:
                return []
            self.path = found[-1]
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        self.buf += chunk
        *complete, self.buf = self.buf.split("\n")
        new = []
        for line in complete:
            if line.strip():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.lines += new
        return new


class Run:
    def __init__(self, work: Path, inv: Path, chaos: str | None) -> None:
        self.work = work
        self.runs = work / "runs"
        pb = write_playbook(work / "pb.yaml")
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "XDG_STATE_HOME": str(work / "state"),
               "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
        self.argv = [sys.executable, "-m", "coordinator", "launch", "-i", str(inv), str(pb), "--json", "--run-dir",
                     str(self.runs), *(["--chaos", chaos] if chaos else [])]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.events = Events(self.runs)
        self.incident_seen_at: float | None = None  # time.time() when the first stop/quarantine line was read
        self.incident_line: dict[str, Any] | None = None
        self.culprit_seen_at: float | None = None  # ... the first quarantine line (the culprit, not an echo)
        self.last_victim_t: dict[int, float] = {}  # rank -> `t` of its last event before the incident

    def poll(self) -> None:
        for e in self.events.poll():
            if e.get("event") == "incident" and e.get("action") in ("stop", "quarantine"):
                if self.incident_seen_at is None:
                    self.incident_seen_at = time.time()
                    self.incident_line = e
                if e.get("action") == "quarantine" and self.culprit_seen_at is None:
                    self.culprit_seen_at = time.time()
            elif self.culprit_seen_at is None and isinstance(e.get("rank"), int) and isinstance(e.get("t"), float):
                self.last_victim_t[e["rank"]] = e["t"]

    def wait(self, pred: Callable[[], object], timeout: float = 180.0) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch ended early (rc {self.proc.returncode})")
            time.sleep(POLL_S)
        raise RuntimeError("timed out waiting for the job")

    def rank_pid_at_step(self, rank: int, step: int) -> int:
        def ready() -> int | None:
            evs = self.events.lines
            pids = [e["pid"] for e in evs if e.get("event") == "started" and e.get("rank") == rank]
            steps = [e["step"] for e in evs if e.get("event") == "step" and e.get("rank") == rank]
            return pids[-1] if pids and steps and max(steps) >= step else None

        return int(self.wait(ready))  # type: ignore[call-overload]

    def finish(self) -> tuple[int, dict[str, Any], float]:
        deadline = time.monotonic() + RUN_TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)
        if self.proc.poll() is None:
            self.kill()
            raise RuntimeError("launch did not finish in time")
        out, err = self.proc.communicate()
        wall = time.monotonic() - self.t0
        self.poll()
        try:
            return self.proc.returncode, json.loads(out), wall
        except ValueError:
            raise RuntimeError(f"no JSON summary (rc {self.proc.returncode}): {err[-1500:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def repair(bed: TestBed, host: Host) -> None:
    """Kill everything in the host's namespace (ranks left by an unreachable attempt, sshd), link up, sshd up."""
    bed.link_up(host)
    bed.stop_sshd(host, sessions=True)
    _kill_and_wait(_netns_pids([host.ns])[host.ns])
    bed.start_sshd(host)


def leftovers(run_id: str) -> str:
    if not run_id:
        return ""
    ps = subprocess.run(["pgrep", "-af", f"runs/{run_id}/"], capture_output=True, text=True)
    return ps.stdout.strip()


def one_run(bed: TestBed, hosts: list[Host], inv: Path, base: Path, fault: str, rep: int) -> Result:
    res = Result(fault, rep)
    work = base / f"{fault}-{rep}"
    work.mkdir(parents=True)
    victim, expected, chaos = FAULTS.get(fault, (None, (), None))
    host = hosts[victim] if victim is not None else None
    res.expected_node = host.name if host else None
    run = Run(work, inv, chaos)
    injected_at: float | None = None
    try:
        if fault in ("kill9", "sigstop", "link", "sshd"):
            assert host is not None and victim is not None
            pid = run.rank_pid_at_step(victim, INJECT_STEP)
            injected_at = time.time()
            if fault == "kill9":
                os.kill(pid, signal.SIGKILL)
            elif fault == "sigstop":
                os.kill(pid, signal.SIGSTOP)
            elif fault == "link":
                bed.link_down(host)
            else:
                bed.stop_sshd(host, sessions=True)
        rc, summary, wall = run.finish()
        res.rc, res.wall_s = rc, round(wall, 2)
        res.run_id = summary.get("run_id", "")
        res.state, res.steps, res.attempts = summary.get("state", ""), summary.get("steps"), summary.get("attempts")
        res.quarantined = list(summary.get("quarantined") or [])
        res.incidents = [{k: i.get(k) for k in ("kind", "node", "rank", "step", "action", "detected_after_s")}
                         | {"echo": bool((i.get("evidence") or {}).get("echo"))} for i in summary.get("incidents", [])]
        culprits = [i for i in res.incidents if i["action"] == "quarantine"]
        res.first = culprits[0] if culprits else (res.incidents[0] if res.incidents else None)
        if host is not None:
            res.attribution_ok = bool(culprits) and all(i["node"] == host.name for i in culprits) \
                and culprits[0]["kind"] in expected and res.quarantined == [host.name]
        recs = summary.get("recoveries") or []
        res.first_step_after_s = recs[0].get("first_step_after_s") if recs else None
        ref = injected_at if injected_at is not None else run.last_victim_t.get(victim) if victim is not None else None
        res.outside_ref = "injection" if injected_at is not None else "victim's last event"
        if ref is not None and run.culprit_seen_at is not None:
            res.outside_s = round(run.culprit_seen_at - ref, 3)
        if ref is not None and run.incident_seen_at is not None:
            res.outside_any_s = round(run.incident_seen_at - ref, 3)
        res.leftover = leftovers(res.run_id)
    except Exception as exc:  # noqa: BLE001 - a failed run is a result, reported as such
        res.error = str(exc)[:800]
        run.kill()
    finally:
        run.kill()
        if fault in ("link", "sshd") and host is not None:
            try:
                repair(bed, host)
            except Exception as exc:  # noqa: BLE001
                res.error += f" repair of {host.name} failed: {exc}"
                log(f"  repair of {host.name} failed: {exc}")
    return res


# ---------------------------------------------------------------------------------------------------- report

def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _med_max(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}"


def render(data: dict[str, Any]) -> str:
    results = [Result(**r) for r in data["results"]]
    out = [f"Command: `{data['command']}`", "",
           f"Machine: {data['machine']}; {data['started']}; total {data.get('total_s', 0):.0f} s.", ""]
    clean = [r for r in results if r.fault == "clean"]
    out += ["### Clean runs (false incidents)", "",
            "| run | state | steps | attempts | incidents (any kind) | wall s |", "|---|---|---|---|---|---|"]
    for r in clean:
        incs = ", ".join(f"{i['kind']}@{i['node']}" for i in r.incidents) or "0"
        out.append(f"| {r.rep} | {r.state or 'ERROR ' + r.error[:80]} | {r.steps} | {r.attempts} | {incs} | "
                   f"{r.wall_s:.1f} |")
    if clean:
        total = sum(len(r.incidents) for r in clean)
        walls = [r.wall_s for r in clean if not r.error]
        out += ["", f"{len(clean)} clean runs, {total} incidents in all; wall median "
                f"{statistics.median(walls) if walls else 0:.1f} s.", ""]
    faults = [k for k in FAULTS if any(r.fault == k for r in results)]
    out += ["### Detection and recovery per fault kind (median / max)", "",
            "| fault | injected | n | first culprit incident (node) | attribution right | `detected_after_s` "
            "| outside: injection -> culprit's incident line, s | outside: -> first fatal line (echoes too), s "
            "| `first_step_after_s` | finished 40/40 steps, attempts |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for k in faults:
        rs = [r for r in results if r.fault == k]
        firsts = sorted({f"{r.first['kind']} ({r.first['node']})" if r.first else "none" for r in rs})
        ok = sum(1 for r in rs if r.attribution_ok)
        fin = sum(1 for r in rs if r.state == "succeeded" and r.steps == ITERS)
        atts = sorted({str(r.attempts) for r in rs})
        refs = {r.outside_ref for r in rs if r.outside_ref}
        outside = _med_max([r.outside_s for r in rs if r.outside_s is not None])
        if refs == {"victim's last event"}:
            outside += " (from the victim's last event)"
        detected = [r.first["detected_after_s"] for r in rs if r.first and r.first.get("detected_after_s") is not None]
        out.append(f"| {k} | {INJECTED[k]} | {len(rs)} | {', '.join(firsts)} | {ok}/{len(rs)} | {_med_max(detected)} | "
                   f"{outside} | {_med_max([r.outside_any_s for r in rs if r.outside_any_s is not None])} | "
                   f"{_med_max([r.first_step_after_s for r in rs if r.first_step_after_s is not None])} | "
                   f"{fin}/{len(rs)}, attempts {'/'.join(atts)} |")
    out += ["", "### Every fault run", "",
            "| fault | rep | run id | state | steps | attempts | incidents (kind@node action detected_after_s) "
            "| outside s | first step after s | wall s | left-over processes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.fault == "clean":
            continue
        incs = "; ".join(f"{i['kind']}@{i['node']} r{i['rank']} {i['action']}{' (echo)' if i['echo'] else ''} "
                         f"{_fmt(i['detected_after_s'])}" for i in r.incidents)
        state = r.state or f"ERROR: {r.error[:120]}"
        out.append(f"| {r.fault} | {r.rep} | {r.run_id} | {state} | {r.steps} | {r.attempts} | {incs} | "
                   f"{_fmt(r.outside_s)} | {_fmt(r.first_step_after_s)} | {r.wall_s:.1f} | "
                   f"{(r.leftover.replace(chr(10), ' / ')[:160] or 'none')} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(FAULTS))
    ap.add_argument("--budget-min", type=float, default=25.0, help="start no new run after this many minutes")
    ap.add_argument("--json-out", type=Path, default=Path(tempfile.gettempdir()) / "bench_faults.json")
    ap.add_argument("--first-rep", type=int, default=1, help="number of the first repetition (to add runs later)")
    ap.add_argument("--report", type=Path, nargs="+", help="only render earlier --json-out files (merged)")
    args = ap.parse_args()
    if args.report:
        parts = [json.loads(p.read_text()) for p in args.report]
        merged = {**parts[0], "command": " &&\n  ".join(p["command"] for p in parts),
                  "total_s": sum(p.get("total_s", 0) for p in parts), "results": [r for p in parts for r in p["results"]]}
        print(render(merged))
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        ap.error(f"unknown kinds {unknown}")
    plan: list[tuple[str, int]] = []
    clean_left = args.clean
    for rep in range(args.first_rep, args.first_rep + args.reps):
        share = -(-clean_left // (args.first_rep + args.reps - rep))
        cleans = [("clean", args.clean - clean_left + i + 1) for i in range(share)]
        clean_left -= share
        faults = [(k, rep) for k in kinds]
        while faults or cleans:  # interleaved: a budget cut leaves both kinds of runs covered
            plan += [faults.pop(0)] if faults else []
            plan += [cleans.pop(0)] if cleans else []
    data: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_faults.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "started": time.strftime("%Y-%m-%d %H:%M"), "heartbeat_timeout": HEARTBEAT_TIMEOUT, "results": []}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp, TestBed(tmp=Path(tmp) / "testbed") as bed:
        base = Path(tmp)
        hosts = bed.add_hosts(3)
        inv = bed.write_inventory(base / "inv.yaml", hosts)
        log(f"test bed {bed.tag}: {', '.join(h.name + '=' + h.ip for h in hosts)}; {len(plan)} runs planned")
        for n, (fault, rep) in enumerate(plan, 1):
            elapsed = time.monotonic() - t0
            if elapsed > args.budget_min * 60:
                log(f"budget of {args.budget_min} min spent: {len(plan) - n + 1} runs not started")
                data["skipped"] = plan[n - 1:]
                break
            log(f"run {n}/{len(plan)}: {fault} #{rep} ({elapsed / 60:.1f} min so far)")
            res = one_run(bed, hosts, inv, base, fault, rep)
            first = f"{res.first['kind']}@{res.first['node']} det {res.first['detected_after_s']}" if res.first else "-"
            log(f"  -> {res.state or 'ERROR ' + res.error[:200]} steps {res.steps} attempts {res.attempts} "
                f"incidents {len(res.incidents)} first {first} outside {res.outside_s} "
                f"first_step_after {res.first_step_after_s} wall {res.wall_s}"
                + (f" LEFTOVER {res.leftover[:200]}" if res.leftover else ""))
            data["results"].append(asdict(res))
            data["total_s"] = time.monotonic() - t0
            args.json_out.write_text(json.dumps(data, indent=1))
    data["total_s"] = time.monotonic() - t0
    args.json_out.write_text(json.dumps(data, indent=1))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
