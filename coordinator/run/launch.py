"""`coordinator launch`: preflight -> calibration -> plan -> hostfile -> mlx.launch -> monitor -> teardown.

mlx.launch exits 0 whatever its ranks did and never times out, so the coordinator decides the outcome itself
from each node's event stream (read over that node's own SSH connection by `worker.follow`) and always tears
down in `finally`: the launcher's process group, every rank PID on every node, and our temp files there.

Pure builders (`coordinator/run/launchfiles.py`: `build_*`, run ids, rank plans) make every file and argv; the
`Launch` class here does the I/O."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coordinator.config.playbook import Playbook
from coordinator.errors import CoordinatorError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.facts.probe import shell_path
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, Transport, python_argv
from coordinator.models import LOCAL_HOST, Node
from coordinator.planning.colocate import compute_bench_groups, cpu_shares
from coordinator.planning.hostfile import Hostfile, build_hostfile
from coordinator.run.chaos import Chaos
from coordinator.run.launchfiles import (
    RankPlan,
    build_launcher_argv,
    build_rank_script,
    build_rank_teardown,
    build_run_config,
    build_ssh_config,
    build_ssh_wrapper,
    new_run_id,
    node_run_dir,
    plan_ranks,
    remote_tmp_dir,
)
from coordinator.run.logs import REDACTED, current_redactor
from coordinator.run.monitor import (
    JOB_ERROR,
    AfterLauncherExit,
    FaultPolicy,
    Incident,
    Monitor,
    Observation,
    ObservationKind,
    PlannedRank,
    RunState,
)
from coordinator.run.replay import judge_monitor
from coordinator.run.replicas import StageShard, compute_replicas, replicate
from coordinator.run.resume import ShardCopy
from coordinator.run.rundir import (
    EVENTS,
    HOSTFILE,
    LAUNCHER_ARGV,
    LAUNCHER_LOG,
    META,
    PLAN,
    PLAYBOOK,
    SSH_CONFIG,
    SUMMARY,
    MetaRank,
    PlanRecord,
    RunMeta,
    SummaryBase,
)
from coordinator.run.stages import RunLayout, build_run_layout, planned_busy_s
from worker.runconfig import Layout

TICK_S = 0.5


# A follower channel that closes on a node that still answers over SSH (the follower was killed, the channel
# dropped) is restarted where it stopped, at most this many times in a row; a channel that then lived
# FOLLOW_STABLE_S resets the count. Only a node the coordinator cannot reach over SSH is unreachable.
FOLLOW_RETRIES = 3


FOLLOW_STABLE_S = 30.0


class LaunchError(CoordinatorError):
    """The job could not be started (preflight failed, nothing to run, a node could not be prepared)."""


def spawn_launcher(argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start mlx.launch with output to `log_path`; returns (process, write end of its stdin). Close the write
    end once the launcher is gone.

    Its stdin is a pipe the caller holds open and never writes: mlx.launch's main loop select()s on stdin with a
    0.1 s timeout to forward input to the ranks, and /dev/null (always readable, at EOF) made that loop spin a
    whole core on the coordinator's machine for the entire run (often a machine that also trains). If the
    coordinator dies, the pipe closes and the loop spins again until the run ends (`coordinator attach` cannot
    reopen it). Its own session: Ctrl-C on the coordinator does not reach it directly, and if the coordinator
    dies the job keeps running."""
    idle_stdin, keep_open = os.pipe()
    try:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(list(argv), stdin=idle_stdin, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(env), start_new_session=True)
    except BaseException:
        os.close(keep_open)
        raise
    finally:
        os.close(idle_stdin)
    return proc, keep_open


def pick_port(count: int, *, lo: int = 20000, hi: int = 60000, tries: int = 50) -> int:
    """A random base port whose `count` successors are free here (concurrent jobs need distinct ports)."""
    import random

    for _ in range(tries):
        base = random.randrange(lo, hi - count)
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise LaunchError(f"no free run of {count} ports in {lo}..{hi}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOCAL_HOST, port))
        except OSError:
            return False
    return True


def write_private(path: Path, text: str, *, mode: int = 0o600) -> None:
    """Write a run-dir file atomically, `mode` from its creation on (never readable by others on the way)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fd, mode)  # a leftover tmp of a dead pid with the same number keeps its old mode otherwise
        fh.write(text)
    os.replace(tmp, path)


@dataclass(kw_only=True)
class RunSummary(SummaryBase):
    """A training run's summary.json: the common part (rundir.SummaryBase) and a training run's own."""

    state: RunState
    steps: int
    checkpoint: str | None = None
    tokens_per_s: float | None = None  # the run's: median over its steps of all ranks' tokens / step wall time
    attempts: int = 1
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    iters: int | None = None
    predicted_tokens_per_s: float | None = None  # calibration's prediction for the plan this run ran
    compute_tokens_per_s: float | None = None  # the same median without the all_sum (Monitor.run_compute_tokens_per_s)
    # The prediction without the gradient exchange, where the prediction holds a measured one (Plan.collective)
    predicted_compute_tokens_per_s: float | None = None
    # The steps of the rehearsal that made the prediction (ranks sharing a machine: run/rehearse.py); None: calibration
    rehearsed_steps: int | None = None
    resumed_from: dict[str, Any] | None = None  # the --resume decision (coordinator.run.resume.ResumeDecision)
    stages: dict[str, Any] | None = None  # the final attempt's stages and memory (coordinator.run.stages.StageView)
    strategy: str = "dp"  # the layout the ranks ran: dp | pipeline | fsdp

    def to_json(self) -> dict[str, Any]:
        return {**self.base_json(), "strategy": self.strategy, "steps": self.steps, "iters": self.iters,
                "checkpoint": self.checkpoint,
                "tokens_per_s": self.tokens_per_s, "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "compute_tokens_per_s": self.compute_tokens_per_s,
                "predicted_compute_tokens_per_s": self.predicted_compute_tokens_per_s,
                "rehearsed_steps": self.rehearsed_steps, "attempts": self.attempts,
                "recoveries": self.recoveries, "resumed_from": self.resumed_from, "stages": self.stages}


_WRITE_FILES = (
    "import json, os, sys\n"
    "spec = json.load(sys.stdin)\n"
    "dir_mode = int(sys.argv[1], 8) if len(sys.argv) > 1 else None\n"
    "for path, (content, mode) in spec.items():\n"
    "    path = os.path.expanduser(path)\n"
    "    os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "    if dir_mode is not None:\n"
    "        os.chmod(os.path.dirname(path), dir_mode)\n"
    "    tmp = '%s.tmp-%d-%s' % (path, os.getpid(), os.urandom(4).hex())  # writers may share a filesystem\n"
    "    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), 'w') as fh:\n"
    "        fh.write(content)\n"
    "        os.fchmod(fh.fileno(), int(mode, 8))\n"
    "    os.replace(tmp, path)\n"
    "print(json.dumps({p: os.path.realpath(os.path.expanduser(p)) for p in spec}))\n"
)


async def write_remote_files(transport: Transport, node: Node, files: Mapping[str, tuple[str, str]], *,
                             dir_mode: str | None = None) -> dict[str, str]:
    """Write {path: (content, octal mode)} on the node atomically (never readable by others on the way);
    `dir_mode` also sets each file's directory's mode. Returns the resolved absolute paths."""
    argv = python_argv(node.python, "-c", _WRITE_FILES, *([dir_mode] if dir_mode else []))
    result = await transport.run(argv, stdin=json.dumps(files), timeout=30)
    if not result.ok:
        raise TransportError(node.name, f"could not write run files: {result.stderr.strip()[-400:]}")
    resolved: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return resolved


async def write_private_files(transport: Transport, node: Node, worker_dir: str, path: str,
                              files: Mapping[str, tuple[str, str]]) -> None:
    """Create (or accept only if already private to the SSH user) the dir `path` on the node and write
    {name: (content, octal mode)} into it (`worker.privatedir`); TransportError naming why it was refused."""
    argv = ["env", f"PYTHONPATH={worker_dir}", *python_argv(node.python, "-m", "worker.privatedir")]
    result = await transport.run(argv, stdin=json.dumps({"dir": path, "files": files}), timeout=30)
    lines = result.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if result.ok and isinstance(answer, dict) and answer.get("dir") == path:
        return
    why = answer.get("error") if isinstance(answer, dict) else None
    raise TransportError(node.name, f"temp dir: {why or result.stderr.strip()[-400:] or f'exit {result.exit_status}'}")


ViewFn = Callable[[Monitor, float], None]


class Launch:
    """One run of mlx.launch under the coordinator's supervision."""

    def __init__(
        self,
        fleet: Fleet,
        playbook: Playbook,
        ranks: Sequence[RankPlan],
        hostfile: Hostfile,
        facts: Mapping[str, NodeFacts],
        *,
        run_id: str,
        run_dir: Path,
        resume: bool = False,
        view: ViewFn | None = None,
        chaos: Sequence[Chaos] = (),
        attempt: int = 0,
    ) -> None:
        self.fleet = fleet
        self.pb = playbook
        self.ranks = list(ranks)
        self.hostfile = hostfile
        self.facts = facts
        self.run_id = run_id
        self.run_dir = run_dir
        self.resume = resume
        self.view = view
        self.chaos = list(chaos)
        self.attempt = attempt
        self.inventory_path: str | None = None
        self.restart_from_scratch = False  # run.json's: ranks set invalid checkpoints aside instead of refusing
        self.left_out: list[dict[str, str]] = []  # inventory nodes the run started without ({node, reason})
        self.drill = False  # a --chaos run: its culprits are left out of this run only, never quarantined
        self.layout = Layout()  # how the ranks share the work (launchfiles.build_layout, job.resolve_strategy)
        self.token_census = 0  # a rehearsal's: the run's steps whose median tokens rank 0 reports (run.json)
        # ... and the plan's stages and memory per node, for meta.json and the views (write_local_files; attach:
        # meta.json's)
        self.run_layout: RunLayout | None = None
        self.launcher_pid: int | None = None  # an adopted launcher (attach): not our child
        self.current_monitor: Monitor | None = None
        self.predicted_tokens_per_s: float | None = None  # the plan's (write_local_files), for meta.json
        self.earlier_errors: dict[str, frozenset[str]] = {}  # from earlier attempts (Monitor.earlier_errors)
        # Polled every tick: a reason (a signal, `coordinator stop`) ends the attempt as `stopped`.
        self.should_stop: Callable[[], str | None] | None = None
        f = playbook.faults
        self.policy = FaultPolicy(heartbeat_timeout=playbook.heartbeat_timeout, straggler_fraction=f.straggler_fraction,
                                  straggler_window=f.straggler_window, straggler_min_s=f.straggler_min_s,
                                  outlier_steps=f.outlier_steps, stall_factor=f.stall_factor, stall_min_s=f.stall_min_s,
                                  first_step_s=f.first_step_s)
        self.nodes = list(dict.fromkeys(r.node.name for r in ranks))
        self.node_by_name = {r.node.name: r.node for r in ranks}
        self.remote_run_dirs: dict[str, str] = {}
        self.worker_dirs: dict[str, str] = {}
        self.remote_tmp = remote_tmp_dir(run_id, secrets.token_hex(8))  # this attempt's; see remote_tmp_dir
        self.launcher: subprocess.Popen[bytes] | None = None
        self._launcher_stdin: int | None = None  # write end of the launcher's idle stdin (see spawn_launcher)
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()
        # node -> rank -> event lines of that rank's file delivered to this process (a reopened follower, and the
        # reading of the record after a stop, go on from there)
        self.delivered: dict[str, dict[int, int]] = {
            n: {r.rank: 0 for r in ranks if r.node.name == n} for n in self.nodes}
        self.tasks: list[asyncio.Task[None]] = []
        self.replica_task: asyncio.Task[None] | None = None  # a pipeline shard's copy to a neighbour (run.replicas)
        self.replicated_step = 0
        self.closing = False  # teardown began: a follower channel that ends is not reopened
        self.events_file = run_dir / EVENTS

    def split(self) -> dict[str, float]:
        """Each node's share of the global batch in this attempt."""
        total = sum(r.batch_size for r in self.ranks)
        return {r.node.name: r.batch_size / total for r in self.ranks}

    # preparation ----------------------------------------------------------------------------------------------

    def _python_for(self, node: Node) -> str:
        f = self.facts.get(node.name)
        exe = f.software.python if f is not None and f.software is not None else None
        return exe if exe and exe.startswith("/") else node.python

    async def prepare(self) -> None:
        """Ship the worker, write each node's run.json, then ONE rank script covering every rank to every
        node: nodes that share a /tmp (local nodes, or an NFS-mounted one) then still find their own rank."""
        nodes = list({r.node.name: r.node for r in self.ranks}.values())
        shares = cpu_shares(compute_bench_groups(nodes, self.facts), [(r.rank, r.node.name) for r in self.ranks])
        config = build_run_config(self.pb, self.ranks, self.run_id, resume=self.resume, chaos=self.chaos,
                                  restart_from_scratch=self.restart_from_scratch, layout=self.layout,
                                  cpu_shares=shares, token_census=self.token_census)
        entries: list[tuple[int, str, str, str]] = []

        async def one(name: str) -> list[tuple[int, str, str, str]]:
            node = self.node_by_name[name]
            transport = self.fleet.transports[name]
            worker_dir = self.worker_dirs[name] = await ship_worker(transport, node)
            run_dir = node_run_dir(node, self.run_id)
            if self.resume:
                # The follower reads rank files from the start: archive the previous attempt's events so its
                # `finished` lines are not mistaken for this attempt's.
                rotate = (f"cd {shell_path(run_dir)}/events 2>/dev/null || exit 0; s=$(date +%s); "
                          'for f in rank*.jsonl; do [ -f "$f" ] && mv "$f" "$f.$s"; done; exit 0')
                await transport.run(["sh", "-c", rotate], timeout=30)
            # run.json holds the node's paths: 0600 in a 0700 dir, like everything the run writes there.
            written = await write_remote_files(transport, node, {
                f"{run_dir}/run.json": (json.dumps(replace(config, run_dir=Path(run_dir)).to_json(), indent=2), "600"),
                f"{run_dir}/events/.keep": ("", "600"),
            }, dir_mode="700")
            resolved = os.path.dirname(written[f"{run_dir}/run.json"])
            self.remote_run_dirs[name] = resolved
            return [(r.rank, resolved, self._python_for(node), worker_dir) for r in self.ranks if r.node.name == name]

        results = await asyncio.gather(*(one(n) for n in self.nodes), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise LaunchError("could not prepare nodes: " + "; ".join(str(e) for e in errors))
        for r in results:
            assert not isinstance(r, BaseException)
            entries += r
        # The job env travels only in this script (never mlx.launch's argv, which `ps` shows, nor the hostfile):
        # it may hold secrets. The script is 0700 in this attempt's private temp dir, deleted at teardown.
        job_env = self.pb.job_env()
        script = build_rank_script(self.run_id, sorted(entries),
                                   {r.rank: {**job_env, **r.node.env_dict} for r in self.ranks})
        results2 = await asyncio.gather(
            *(write_private_files(self.fleet.transports[n], self.node_by_name[n], self.worker_dirs[n],
                                  self.remote_tmp, {"rank": (script, "700")})
              for n in self.nodes), return_exceptions=True)
        errors = [r for r in results2 if isinstance(r, BaseException)]
        if errors:
            raise LaunchError("could not write rank scripts: " + "; ".join(str(e) for e in errors))

    def write_local_files(self, plan: PlanRecord) -> Path:
        """The run dir's files, 0600 (0700 for the ssh wrapper) in the 0700 run dir: they name hosts, users,
        keys and paths, and the hostfile carries the job's env."""
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.pb.path:
            text = str(current_redactor().value(Path(self.pb.path).read_text(encoding="utf-8")))
            # The copy must stay YAML that `status` and the dashboard can read: a bare `***` is an alias there.
            write_private(self.run_dir / PLAYBOOK, text.replace(REDACTED, "REDACTED"))
        write_private(self.run_dir / PLAN, json.dumps(plan.to_json(), indent=2) + "\n")
        self.predicted_tokens_per_s = plan.predicted_tokens_per_s or None
        self.run_layout = build_run_layout(self.layout, [(r.rank, r.node.name) for r in self.ranks], plan.strategy)
        hostfile = self.run_dir / HOSTFILE
        write_private(hostfile, json.dumps(self.hostfile.to_json(), indent=2) + "\n")
        ssh_config = self.run_dir / SSH_CONFIG
        write_private(ssh_config, build_ssh_config([r.node for r in self.ranks]))
        bindir = self.run_dir / "bin"
        bindir.mkdir(mode=0o700, exist_ok=True)
        real_ssh = _which("ssh") or "/usr/bin/ssh"
        write_private(bindir / "ssh", build_ssh_wrapper(ssh_config.resolve(), real_ssh), mode=0o700)
        for name in (EVENTS, LAUNCHER_LOG):  # appended to later: created 0600 now
            os.close(os.open(self.run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        return hostfile

    # running ------------------------------------------------------------------------------------------------

    def start_launcher(self, hostfile: Path) -> None:
        env = dict(os.environ)
        env["PATH"] = f"{(self.run_dir / 'bin').resolve()}{os.pathsep}{env.get('PATH', '')}"
        argv = build_launcher_argv(hostfile.resolve(), self.hostfile.backend, self.remote_tmp,
                                   pick_port(len(self.ranks) * 2), {})
        write_private(self.run_dir / LAUNCHER_ARGV, shlex.join(argv) + "\n")
        if self._launcher_stdin is not None:
            os.close(self._launcher_stdin)
        self.launcher, self._launcher_stdin = spawn_launcher(argv, self.run_dir / LAUNCHER_LOG, env)
        self.write_meta()

    def write_meta(self) -> None:
        """runs/<id>/meta.json: what `coordinator attach|stop RUN_ID` needs to find this attempt again."""
        meta = RunMeta(
            run_id=self.run_id, attempt=self.attempt, inventory=self.inventory_path, nodes=tuple(self.nodes),
            playbook=str(Path(self.pb.path).resolve()) if self.pb.path else None,
            ranks=tuple(MetaRank(r.rank, r.node.name, r.batch_size, r.calibrated_tokens_per_s) for r in self.ranks),
            remote_run_dirs=dict(self.remote_run_dirs), remote_tmp_dir=self.remote_tmp,
            launcher_pid=self.launcher.pid if self.launcher else None,
            coordinator_pid=os.getpid(), split={r.node.name: r.batch_size for r in self.ranks},
            left_out=tuple(self.left_out), drill=self.drill, restart_from_scratch=self.restart_from_scratch,
            faults=self.policy, iters=self.pb.train.iters, predicted_tokens_per_s=self.predicted_tokens_per_s,
            max_tokens_per_row=self.max_tokens_per_row(), layout=self.run_layout)
        write_private(self.run_dir / META, json.dumps(meta.to_json(), indent=2) + "\n")

    async def _follow(self, name: str) -> None:
        """Feed the monitor what `worker.follow` on the node reports, over the node's own connection. A channel
        that closes is reopened where it stopped (`--skip`: the events already read) while the node answers over
        SSH (reconnecting if the connection itself died), up to FOLLOW_RETRIES times in a row; a node that does
        not answer is `lost` (unreachable)."""
        node = self.node_by_name[name]
        ranks = [r.rank for r in self.ranks if r.node.name == name]
        seen = self.delivered[name]  # event lines of each rank's file received so far
        worker_dir = await ship_worker(self.fleet.transports[name], node)
        failures = 0
        while True:
            opened = time.monotonic()
            reason = await self._follow_once(name, worker_dir, ranks, seen)
            failures = 0 if time.monotonic() - opened >= FOLLOW_STABLE_S else failures + 1
            if failures > FOLLOW_RETRIES:
                reason = f"{reason} ({FOLLOW_RETRIES} restarts of the follower in a row failed)"
                break
            if self.closing:
                return  # torn down: its follower was stopped on purpose
            try:
                await self._reach(name)
            except TransportError as exc:
                reason = f"{reason}; {exc}"
                break
            self.record_supervisor("follower_restarted", node=name, reason=reason, retry=failures)
            await asyncio.sleep(0.2 * failures)
        await self.queue.put(Observation(ObservationKind.LOST, name, time.monotonic(), data={"reason": reason}))

    async def _reach(self, name: str) -> None:
        """TransportError unless the node answers over SSH: on its connection, else on a fresh one."""
        try:
            result = await self.fleet.transports[name].run(["true"], timeout=5)
            if result.ok:
                return
        except TransportError:
            pass
        await self.fleet.reconnect(name)

    async def _follow_once(self, name: str, worker_dir: str, ranks: Sequence[int], seen: dict[int, int]) -> str:
        """One follower channel, until it ends; returns why it ended."""
        node = self.node_by_name[name]
        skip = ",".join(f"{r}={n}" for r, n in seen.items() if n)
        argv = ["env", f"PYTHONPATH={worker_dir}",
                *python_argv(node.python, "-m", "worker.follow", "--run-dir", self.remote_run_dirs[name],
                             "--ranks", ",".join(str(r) for r in ranks), "--interval", str(TICK_S),
                             *(["--skip", skip] if skip else []))]
        reason = "channel closed"
        try:
            async for kind, line in self.fleet.transports[name].stream(argv, timeout=365 * 86400):
                if kind == "exit":
                    reason = f"follower exited ({line})"
                if kind != "stdout":
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                now = time.monotonic()
                src = msg.get("src")
                if src in ("event", "bad") and msg.get("rank") in seen:
                    seen[msg["rank"]] += 1
                if src == "event":
                    await self.queue.put(Observation(ObservationKind.EVENT, name, now, msg.get("rank"), msg.get("event") or {}))
                elif src == "proc":
                    await self.queue.put(Observation(ObservationKind.PROC, name, now, msg.get("rank"), msg))
                elif src == "tick":
                    await self.queue.put(Observation(ObservationKind.TICK, name, now))
        except TransportError as exc:
            reason = str(exc)
        return reason

    async def read_record(self, mon: Monitor, *, record: bool) -> None:
        """Read what the nodes' files hold now into `mon` (`worker.follow --once`): the rank events this process
        has not received (all of them when it never followed the attempt) and each node's newest complete
        checkpoint, so that a run whose following was cut short (a stop, a signal, a coordinator that is not the
        one that launched it) is recorded by what happened: its steps, and whether every rank had finished.
        Process states are not read: after a teardown every rank is gone, and that is no crash. `record`: append
        the events to events.jsonl (this process followed the attempt; else they are there already, or not ours
        to write). A node that cannot be read adds nothing. Call it after `teardown` (the followers stopped)."""
        async def one(name: str) -> list[Observation]:
            node = self.node_by_name[name]
            transport = self.fleet.transports[name]
            seen = self.delivered[name]
            skip = ",".join(f"{r}={n}" for r, n in seen.items() if n)
            try:
                worker_dir = self.worker_dirs.get(name) or await ship_worker(transport, node)
                argv = ["env", f"PYTHONPATH={worker_dir}",
                        *python_argv(node.python, "-m", "worker.follow", "--once", "--run-dir",
                                     self.remote_run_dirs.get(name) or node_run_dir(node, self.run_id),
                                     "--ranks", ",".join(str(r) for r in seen), *(["--skip", skip] if skip else []))]
                result = await transport.run(argv, timeout=60)
            except TransportError:
                return []
            found: list[Observation] = []
            now = time.monotonic()
            for line in result.stdout.splitlines():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(msg, dict):
                    continue
                if msg.get("src") in ("event", "bad") and msg.get("rank") in seen:
                    seen[msg["rank"]] += 1
                if msg.get("src") == "event" and isinstance(msg.get("event"), dict):
                    found.append(Observation(ObservationKind.EVENT, name, now, msg.get("rank"), msg["event"]))
                elif msg.get("src") == "checkpoints":
                    found.append(Observation(ObservationKind.CHECKPOINTS, name, now, data={"step": msg.get("step")}))
            return found

        # What the followers received but the monitor loop, which ended, never took: counted as delivered already.
        queued: list[Observation] = []
        while not self.queue.empty():
            obs = self.queue.get_nowait()
            if obs.kind == ObservationKind.EVENT:
                queued.append(obs)
        results = [queued, *await asyncio.gather(*(one(n) for n in self.nodes if n in self.fleet.connected))]
        with self.events_file.open("a", encoding="utf-8") as sink:
            for observations in results:
                for obs in observations:
                    if record and obs.kind == ObservationKind.EVENT:
                        line = current_redactor().value({"node": obs.node, "rank": obs.rank, **obs.data})
                        sink.write(json.dumps(line) + "\n")
                    for incident in mon.observe(obs):
                        self._record_incident(sink, incident)

    def record_supervisor(self, what: str, **data: Any) -> None:
        """A line in events.jsonl about the coordinator itself (a follower restarted, a stop, a detach)."""
        record = {"event": "supervisor", "what": what, "node": "coordinator", "attempt": self.attempt,
                  "t": time.time(), **data}
        with self.events_file.open("a", encoding="utf-8") as sink:
            sink.write(json.dumps(record) + "\n")

    def max_tokens_per_row(self) -> int:
        """The most tokens one row of a rank's batch can add to a step event's `tokens` (Monitor.create)."""
        train = self.pb.train
        return train.max_seq_length * train.grad_accumulation * train.rows_per_example

    def new_monitor(self) -> Monitor:
        # Each stage's planned busy seconds per step (the straggler rule's yardstick) from the recorded layout: the
        # one source the replay of every view reads too (coordinator.run.replay), and what `attach` restores.
        plan = [PlannedRank(r.rank, r.node.name, r.batch_size, r.calibrated_tokens_per_s,
                            planned_busy_s(self.run_layout, r.rank)) for r in self.ranks]
        pipeline = self.layout is not None and self.layout.kind == "pipeline"
        return Monitor.create(plan, self.pb.train.iters, now=time.monotonic(), policy=self.policy,
                              max_tokens_per_row=self.max_tokens_per_row(), earlier_errors=self.earlier_errors,
                              replica_groups=tuple((r.rank,) for r in self.ranks) if pipeline else None,
                              layout=self.run_layout)

    async def monitor(self) -> Monitor:
        """Watch until every rank finished, or a fatal incident has settled (its echoes collected)."""
        mon = self.current_monitor = self.new_monitor()
        self.tasks = [asyncio.create_task(self._follow(n)) for n in self.nodes]
        stop_checked_at = float("-inf")
        with self.events_file.open("a", encoding="utf-8") as sink:
            while True:
                try:
                    obs = await asyncio.wait_for(self.queue.get(), timeout=TICK_S)
                except TimeoutError:
                    obs = None
                now = time.monotonic()
                if self.should_stop is not None and now >= stop_checked_at + TICK_S:
                    # Once a tick, not per observation: the check may look for a file (a stop request).
                    stop_checked_at = now
                    reason = self.should_stop()
                    if reason is not None:
                        mon.stopped = True
                        self.record_supervisor("stop", reason=reason)
                        return mon
                if obs is not None:
                    if obs.kind == ObservationKind.EVENT:
                        # The attempt is the coordinator's word (last: never the rank's), so readers never infer
                        # it from the order of the nodes' interleaved lines.
                        record = current_redactor().value({"node": obs.node, "rank": obs.rank, **obs.data,
                                                           "attempt": self.attempt})
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                    for incident in mon.observe(obs):
                        self._record_incident(sink, incident)
                for incident in mon.check(now):
                    self._record_incident(sink, incident)
                self._replicate_shards(mon)
                if mon.launcher_exited_at is None and self._launcher_exited():
                    # An adopted launcher (attach) is not our child: its exit status is unknown (None).
                    mon.launcher_exited(self.launcher.returncode if self.launcher is not None else None, now)
                if self.view is not None:
                    self.view(mon, now)
                outcome = mon.outcome()
                if outcome is RunState.SUCCEEDED:
                    return mon
                if outcome is not None and mon.settled(now):
                    self._resolve(sink, mon)
                    return mon
                after = mon.after_launcher_exit(now)
                if after is AfterLauncherExit.FAILED:
                    # mlx.launch exited (it always exits 0) but not every rank finished and nothing else explains
                    # it: the exit itself is the failure.
                    incident = mon.launcher_failed(now, log_tail=_tail(self.run_dir / LAUNCHER_LOG))
                    self._record_incident(sink, incident)
                    return mon
                if after is AfterLauncherExit.RESOLVE:
                    # A fault known but never settled: resolve the verdict as it stands.
                    self._resolve(sink, mon)
                    return mon

    def _replicate_shards(self, mon: Monitor) -> None:
        """A pipeline's newest complete checkpoint: each stage's shard copied to its neighbour's node in the
        background (`run.replicas`), one checkpoint at a time, never once the attempt is failing."""
        if self.layout.kind != "pipeline" or mon.first_fatal_at is not None or \
                (self.replica_task is not None and not self.replica_task.done()):
            return
        shards = [StageShard(v.rank, v.node, v.checkpoint_step, v.checkpoint) for v in mon.ranks.values()]
        planned = compute_replicas(shards, done=self.replicated_step)
        if planned is None:
            return
        self.replicated_step, copies = planned
        self.replica_task = asyncio.create_task(self._replicate(self.replicated_step, copies))

    async def _replicate(self, step: int, copies: Sequence[ShardCopy]) -> None:
        try:
            await replicate(self.fleet, self.remote_run_dirs, copies)
        except CoordinatorError as exc:  # said, never the run's failure: the next checkpoint tries again
            self.record_supervisor("replica_failed", step=step, reason=str(exc))
            return
        self.record_supervisor("replicated", step=step, copies=[f"{c.source}:{c.path} -> {c.dest}" for c in copies])

    def _resolve(self, sink: Any, mon: Monitor) -> None:
        """Record the settled verdict: revised incidents (`revised: true`) and a new `job_error`, if any."""
        for incident in mon.resolve():
            self._record_incident(sink, incident, revised=incident.kind != JOB_ERROR)

    def _launcher_exited(self) -> bool:
        if self.launcher is not None:
            return self.launcher.poll() is not None
        if self.launcher_pid is not None:
            try:
                os.kill(self.launcher_pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False

    def _record_incident(self, sink: Any, incident: Incident, *, revised: bool = False) -> None:
        record = {"event": "incident", "attempt": self.attempt, **incident.to_json()}
        if revised:
            record["revised"] = True  # supersedes the earlier line of the same kind/node/rank
        sink.write(json.dumps(record) + "\n")
        sink.flush()

    def record_incident(self, incident: Incident) -> None:
        """An incident found outside the monitor loop (the connection check before a relaunch)."""
        with self.events_file.open("a", encoding="utf-8") as sink:
            self._record_incident(sink, incident)

    # teardown -------------------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Leave the attempt running for `coordinator attach`: stop reading it, stop nothing. The launcher's idle
        stdin closes with us (see spawn_launcher)."""
        for task in self.tasks:
            task.cancel()
        if self._launcher_stdin is not None:
            os.close(self._launcher_stdin)
            self._launcher_stdin = None
        self.record_supervisor("detached", launcher_pid=self.launcher.pid if self.launcher else self.launcher_pid)

    async def teardown(self, mon: Monitor | None) -> None:
        self.closing = True
        if self.replica_task is not None and not self.replica_task.done():
            self.replica_task.cancel()  # a replica cut short leaves no half shard (unpacked beside, then renamed)
            await asyncio.gather(self.replica_task, return_exceptions=True)
        # The followers end before the nodes' cleanup below kills their processes: else one restarted meanwhile
        # outlives the run. Cancelled again while they run: asyncio.wait_for (Python 3.11) loses a cancellation
        # that arrives as its awaited item does, which a follower with output waiting is likely to hit.
        pending = {t for t in self.tasks if not t.done()}
        for _ in range(20):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.25)
        if self.launcher is not None and self.launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.launcher.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self.launcher.wait, 3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.launcher.pid, signal.SIGKILL)
                await asyncio.to_thread(self.launcher.wait)
        if self._launcher_stdin is not None:
            os.close(self._launcher_stdin)
            self._launcher_stdin = None
        if self.launcher is None and self.launcher_pid is not None:
            # An adopted launcher (attach) is its own session leader: its pgid is its pid.
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.launcher_pid, sig)
                await asyncio.sleep(1)
        pids: dict[str, list[int]] = {}
        if mon is not None:
            for view in mon.ranks.values():
                if view.pid is not None:
                    pids.setdefault(view.node, []).append(view.pid)

        async def clean(name: str) -> None:
            node = self.node_by_name[name]
            transport = self.fleet.transports[name]
            run_dir = self.remote_run_dirs.get(name, node_run_dir(node, self.run_id))
            script = build_rank_teardown(run_dir, self.run_id, pids.get(name, []))
            with contextlib.suppress(TransportError):
                await transport.run(["sh", "-c", script], timeout=15)
            del node

        await asyncio.gather(*(clean(n) for n in self.nodes if n in self.fleet.connected), return_exceptions=True)


async def set_aside_checkpoints_after(fleet: Fleet, launch: Launch, nodes: Sequence[str], step: int) -> None:
    """Rename checkpoints newer than `step` to `set-aside-step-N` on `nodes` (kept for inspection, never
    deleted), so a relaunch resumes from the newest checkpoint all replicas agreed on."""
    async def one(name: str) -> None:
        root = f"{launch.remote_run_dirs.get(name) or node_run_dir(launch.node_by_name[name], launch.run_id)}/checkpoints"
        script = (f"cd {shell_path(root)} 2>/dev/null || exit 0; for d in step-*; do [ -d \"$d\" ] || continue; "
                  f'n=$(echo "${{d#step-}}" | sed "s/^0*//"); [ "${{n:-0}}" -gt {int(step)} ] && mv "$d" "set-aside-$d"; '
                  "done; rm -f latest; exit 0")
        with contextlib.suppress(TransportError):
            await fleet.transports[name].run(["sh", "-c", script], timeout=30)

    await asyncio.gather(*(one(n) for n in nodes if n in fleet.connected))


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def summarize(launch: Launch, mon: Monitor, split: Mapping[str, float], message: str = "", *,
              predicted_tokens_per_s: float | None = None,
              predicted_compute_tokens_per_s: float | None = None, rehearsed_steps: int | None = None) -> RunSummary:
    state = mon.outcome() or RunState.FAILED
    # Each node's predicted peak (a pipeline stage's need) from the launch's recorded layout: the one source the
    # stage view reads too, so the end-of-run memory line and every view hold the same plan.
    layout = launch.run_layout
    planned = ({r.node: r.need_bytes for r in layout.ranks if r.need_bytes is not None}
               if layout is not None and layout.pipeline else {})
    # Each rank's rate and verdict as every view shows them (coordinator.run.replay): the run has ended.
    judged = judge_monitor(mon, now=None, predicted=predicted_tokens_per_s)
    nodes = []
    for view in sorted(mon.ranks.values(), key=lambda v: v.rank):
        mine = judged.of(view.rank, view.node)
        nodes.append({"node": view.node, "rank": view.rank, "batch_size": view.batch_size, "state": str(view.state),
                      "step": view.step, "loss": view.loss,
                      "tokens_per_s": round(mine.tokens_per_s, 1) if mine and mine.tokens_per_s else None,
                      "verdict": str(mine.verdict) if mine else None,
                      "calibrated_tokens_per_s": view.calibrated_tokens_per_s, "peak_memory_bytes": view.peak_memory,
                      "planned_memory_bytes": planned.get(view.node),
                      "checkpoint": view.checkpoint, "run_dir": launch.remote_run_dirs.get(view.node)})
    ckpt = next((v.checkpoint for v in mon.ranks.values() if v.rank == 0 and v.checkpoint), None)
    run_rate = mon.run_tokens_per_s()
    compute_rate = mon.run_compute_tokens_per_s()
    return RunSummary(run_id=launch.run_id, state=state, steps=mon.proven_step(), nodes=nodes, split=dict(split),
                      incidents=list(mon.incidents), checkpoint=ckpt,
                      tokens_per_s=round(run_rate, 2) if run_rate is not None else None,
                      run_dir=str(launch.run_dir), message=message, iters=mon.iters,
                      predicted_tokens_per_s=(round(predicted_tokens_per_s, 2)
                                              if predicted_tokens_per_s else None),
                      compute_tokens_per_s=round(compute_rate, 2) if compute_rate is not None else None,
                      predicted_compute_tokens_per_s=(round(predicted_compute_tokens_per_s, 2)
                                                      if predicted_compute_tokens_per_s else None),
                      rehearsed_steps=rehearsed_steps, stages=judged.stages.to_json(),
                      strategy=launch.layout.kind)


def write_summary(run_dir: Path, summary: RunSummary) -> Path:
    path = run_dir / SUMMARY
    # Evidence can quote a traceback or an env: the active redactor blanks every secret the run knows of.
    write_private(path, json.dumps(current_redactor().value(summary.to_json()), indent=2) + "\n")
    return path


__all__ = ["Launch", "LaunchError", "RankPlan", "RunSummary", "build_hostfile", "new_run_id", "plan_ranks",
           "summarize", "write_summary"]
