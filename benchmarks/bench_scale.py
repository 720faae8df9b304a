"""The coordinator's own cost at scale: `coordinator preflight` of 1,000 simulated nodes over real SSH on loopback.

Every node is one asyncssh listener on 127.0.0.1 with its own port and host key (tests/sshserver.py's
SshTestServer with a ProfileResponder): it answers the coordinator's probe from a recorded fake-Mac profile
(tests/fixtures/profiles/<--profile>, plus an `env` section) and a canned worker answer (what worker/probe.py
prints for a small model+data dir, with a reachable `reach` entry for every peer the probe asked for). The listeners live in
--servers separate server processes (this script with --serve), so the coordinator, a separate process too,
is measured alone: its CPU time is its own process's user+sys (os.wait4), not the servers'.

The coordinator runs as users do: `coordinator preflight -i inv.yaml -p pb.yaml --json` (the real CLI, a
subprocess), with an inventory of --nodes nodes (n0001.., host 127.0.0.1, distinct ports) and a known_hosts
file holding every listener's key (strict checking). After one untimed warm-up run, --repeat timed runs;
each must report every node with its `ssh` check passed. Reported: wall seconds, coordinator CPU seconds
(user+sys), CPU ms per node, peak RSS, the servers' CPU in the same window, and the JSON report's size.

Extras (each also printed as Markdown):
  --stages     the coordinator's per-node work WITHOUT the network, in this process, timed in CPU seconds per
               stage for the same --nodes (deterministic and insensitive to other load): parse known_hosts
               (once; asyncssh does it on every connect), build every probe, parse every answer into facts,
               evaluate, render the JSON report
  --phases     the same work in this process through the API, timed per phase (load, connect_all,
               gather_facts, evaluate, JSON rendering): where the wall and CPU time go
  --py-spy N   one more CLI run under the py-spy sampling profiler (`py-spy` on PATH, next to this python, or
               $PY_SPY): CPU samples by activity, top N functions by own samples, coordinator functions by
               inclusive samples. Low overhead, so its proportions are the ones to trust
  --cprofile N one more CLI run under cProfile; top N functions by own time and by cumulative time (cProfile
               inflates small pure-Python calls several-fold: read it for call counts, not proportions)
The profiled runs pass `--connect-timeout 120` so that every node is processed even on a loaded machine (the
timed runs use the CLI's defaults).
  --fd-limit L one more CLI run with RLIMIT_NOFILE soft limit L (e.g. 256, macOS's default `ulimit -n`)

    .venv/bin/python benchmarks/bench_scale.py [--nodes 1000] [--servers 10] [--repeat 3]
        [--profile m5max-mbp-tb5] [--stages] [--phases] [--py-spy 25] [--cprofile 25] [--fd-limit 256]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pstats
import resource
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cliout import by_node, cli_json  # noqa: E402 - after the path fix
from benchmarks.machine import machine_info as shared_machine_info  # noqa: E402 - after the path fix

PROFILES_DIR = ROOT / "tests" / "fixtures" / "profiles"
BIN = Path(sys.executable).parent
RUN_TIMEOUT = 600.0
NODE_HOME = "/Users/bench"
MODEL_DIR = f"{NODE_HOME}/mlx-work/model"
DATA_DIR = f"{NODE_HOME}/mlx-work/data"
NODE_PYTHON = f"{NODE_HOME}/.venv/bin/python3"

PLAYBOOK = f"""\
# bench_scale: every simulated node answers the same model/data hashes (a canned worker answer)
name: bench-scale
kind: train
model: {MODEL_DIR}
data: {DATA_DIR}
backend: ring
train:
  method: lora
  iters: 10
  batch_size: 2
  max_seq_length: 128
"""

MAC_ENV = f"""\
HOME={NODE_HOME}
LOGNAME=bench
PATH=/usr/bin:/bin:/usr/sbin:/sbin
PWD={NODE_HOME}
SHELL=/bin/zsh
SHLVL=1
SSH_CLIENT=127.0.0.1 50000 22
SSH_CONNECTION=127.0.0.1 50000 127.0.0.1 22
TMPDIR=/var/folders/xx/abcdefgh/T/
USER=bench
_=/usr/bin/env
"""

MODEL_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ servers


def serve(args: argparse.Namespace) -> int:
    """Server mode: `--listeners` SSH listeners, one host key each; prints one JSON line {ports, known_hosts}
    and serves until stdin closes (the benchmark holds the other end: if it dies, so do we)."""
    import asyncssh

    from tests.sshserver import ProfileResponder, SshTestServer

    async def go() -> None:
        client_key = asyncssh.import_public_key(Path(args.client_pub).read_text())
        responder = ProfileResponder(Path(args.profile_dir), json.loads(Path(args.worker_json).read_text()),
                                     reach_all_ok=True)
        servers = [await SshTestServer(responder, client_key).start() for _ in range(args.listeners)]
        for s in servers:
            s.commands = _NoList()  # the commands are ~50 KB each at 1,000 nodes: keep none
        line = {"ports": [s.port for s in servers], "known_hosts": [s.known_hosts_line() for s in servers]}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for s in servers:
            await s.close()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(go())
    return 0


class _NoList(list):  # type: ignore[type-arg]
    def append(self, item: object) -> None:
        pass


@dataclass
class Servers:
    procs: list[subprocess.Popen[str]]
    ports: list[int]
    known_hosts: list[str]

    def cpu(self) -> float:
        import psutil

        total = 0.0
        for p in self.procs:
            t = psutil.Process(p.pid).cpu_times()
            total += t.user + t.system
        return total

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_servers(n_nodes: int, n_servers: int, work: Path, client_pub: Path, profile_dir: Path,
                  worker_json: Path) -> Servers:
    per = [n_nodes // n_servers + (1 if i < n_nodes % n_servers else 0) for i in range(n_servers)]
    servers = Servers([], [], [])
    try:
        for i, k in enumerate(p for p in per if p):
            argv = [sys.executable, str(Path(__file__).resolve()), "--serve", "--listeners", str(k),
                    "--client-pub", str(client_pub), "--profile-dir", str(profile_dir), "--worker-json", str(worker_json)]
            err = open(work / f"server-{i}.err", "w")  # noqa: SIM115 - the child keeps it; closed with the file object
            servers.procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                  text=True, cwd=ROOT))
        for i, p in enumerate(servers.procs):
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"server {i} exited: {(work / f'server-{i}.err').read_text()[-2000:]}")
            doc = json.loads(line)
            servers.ports += doc["ports"]
            servers.known_hosts += doc["known_hosts"]
    except BaseException:
        servers.close()
        raise
    return servers


# ---------------------------------------------------------------------------------------------- fixtures


def safetensors_bytes(kib: int) -> bytes:
    n = max(1, kib * 1024 // 4)
    header = json.dumps({"embed.weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes((i * 7 + 3) % 251 for i in range(4 * n))


def worker_answer(work: Path) -> dict[str, Any]:
    """What worker/probe.py answers for a small model+data dir, with the node-side paths of the playbook (the
    servers fill `reach` with the peers each probe asks for)."""
    from worker import probe

    model, data = work / "model", work / "data"
    model.mkdir()
    data.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2))
    (model / "model.safetensors").write_bytes(safetensors_bytes(256))
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    (data / "train.jsonl").write_text("".join(json.dumps({"text": f"sample {i}"}) + "\n" for i in range(200)))
    (data / "valid.jsonl").write_text("".join(json.dumps({"text": f"valid {i}"}) + "\n" for i in range(20)))
    answer = probe.run({"hash_dirs": [str(model), str(data)], "model_dir": str(model), "cache": None, "peers": []})
    answer["python"] = {"executable": NODE_PYTHON, "version": answer["python"]["version"]}
    for entry, path in zip(answer["hashes"], (MODEL_DIR, DATA_DIR), strict=True):
        entry["path"] = path
    answer["reach"] = []  # the servers answer every peer the probe asks for as reachable (reach_all_ok)
    if answer["errors"]:
        raise SystemExit(f"worker probe answer has errors: {answer['errors']}")
    return answer


def build_fixtures(work: Path, n_nodes: int, profile: str) -> tuple[list[str], Path, Path, Path, Path]:
    """(names, client key, client pub, profile copy, worker json)."""
    import asyncssh

    names = [f"n{i:04d}" for i in range(1, n_nodes + 1)]
    key = asyncssh.generate_private_key("ssh-ed25519")
    client_key, client_pub = work / "id_ed25519", work / "id_ed25519.pub"
    key.write_private_key(str(client_key))
    key.write_public_key(str(client_pub))
    client_key.chmod(0o600)
    src = PROFILES_DIR / profile
    if not src.is_dir():
        raise SystemExit(f"no profile {src}")
    prof = work / "profile"
    shutil.copytree(src, prof)
    (prof / "env.out").write_text(MAC_ENV)
    fixtures = work / "fixtures"
    fixtures.mkdir()
    worker_json = work / "worker.json"
    worker_json.write_text(json.dumps(worker_answer(fixtures)))
    return names, client_key, client_pub, prof, worker_json


def write_inventory(path: Path, names: Sequence[str], ports: Sequence[int], client_key: Path, known_hosts: Path) -> None:
    import yaml

    doc = {
        "defaults": {"user": "bench", "python": NODE_PYTHON, "workdir": f"{NODE_HOME}/mlx-work",
                     "identity": str(client_key), "known_hosts": str(known_hosts)},
        "nodes": [{"name": n, "host": "127.0.0.1", "port": p} for n, p in zip(names, ports, strict=True)],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


# ------------------------------------------------------------------------------------------------- runs


@dataclass
class Sample:
    wall: float
    cpu: float
    maxrss_mib: float
    servers_cpu: float
    out_bytes: int
    rc: int
    reached: int = 0  # nodes fully probed (see verify)
    problem: str = ""  # why the others did not (one example)


def run_cli(argv: list[str], work: Path, tag: str, servers: Servers, names: Sequence[str] | None,
            fd_limit: int | None = None) -> Sample:
    """Run argv, wait for it with os.wait4 (its own rusage), check the report covers `names`."""
    out, err = work / f"{tag}.out", work / f"{tag}.err"

    def limit() -> None:
        if fd_limit is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))

    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}
    with open(out, "wb") as fo, open(err, "wb") as fe:
        s0 = servers.cpu()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env, cwd=work,
                                preexec_fn=limit if fd_limit is not None else None)
        timer = threading.Timer(RUN_TIMEOUT, proc.kill)
        timer.daemon = True
        timer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted (SIGTERM, ^C): never leave the coordinator running
            proc.kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        servers_cpu = servers.cpu() - s0
    text = out.read_text(errors="replace")
    sample = Sample(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, servers_cpu, len(text.encode()),
                    proc.returncode)
    if names is not None:
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{tag}: exit {proc.returncode}: {err.read_text(errors='replace')[-2000:]}")
        sample.reached, sample.problem = verify(text, names)
        if sample.problem:
            print(f"{tag}: {len(names) - sample.reached} of {len(names)} nodes not reached: {sample.problem}",
                  file=sys.stderr)
    return sample


def verify(stdout: str, names: Sequence[str]) -> tuple[int, str]:
    """(nodes of `names` fully probed, an example of why another was not). Fully probed: its `ssh` check passed
    and none of its checks is an `error` (a node whose probe did not answer has every fact-based check in error:
    counting it would time a preflight that skipped most of the work)."""
    text = "\n".join(ln for ln in stdout.splitlines() if not ln.startswith("py-spy> "))  # py-spy talks on stdout
    try:
        report = cli_json("preflight", text)
    except ValueError as exc:
        raise SystemExit(f"the coordinator printed no readable JSON report: {exc}") from None
    checks = {n: row["checks"] for n, row in by_node(report["nodes"]).items()}

    def why_not(name: str) -> str | None:
        if name not in checks:
            return "missing from the report"
        ssh = next((c for c in checks[name] if c["id"] == "ssh"), {})
        if ssh.get("status") != "pass":
            return f"ssh: {ssh.get('summary', '?')}"
        error = next((c for c in checks[name] if c["status"] == "error"), None)
        return f"{error['id']}: {error['summary']}" if error is not None else None

    bad = [(n, why) for n in names if (why := why_not(n)) is not None]
    return len(names) - len(bad), (f"{bad[0][0]}: {bad[0][1][:300]}" if bad else "")


def summary_of(stdout_path: Path) -> str:
    try:
        report = json.loads(stdout_path.read_text())
    except ValueError:
        return "?"
    return ", ".join(f"{k} {v}" for k, v in report.get("summary", {}).items())


def stages(inv_path: Path, pb_path: Path, known: Path, prof: Path, worker_json: Path) -> list[tuple[str, float, str]]:
    """(stage, CPU s of this process, note): the coordinator's non-network work for every node, measured alone."""
    import asyncssh

    from coordinator.config.inventory import load_inventory
    from coordinator.config.playbook import load_playbook
    from coordinator.facts.build import build_node_facts
    from coordinator.facts.probe import build_probe, parse_probe_output, worker_source
    from coordinator.fleet.gather import probe_peers, worker_args
    from coordinator.models import ConnectInfo
    from coordinator.preflight.pipeline import FleetFacts, evaluate
    from coordinator.views.render import dumps
    from tests.sshserver import ProfileResponder

    rows: list[tuple[str, float, str]] = []

    def timed(name: str, fn: Any, note: Any = "") -> Any:
        t = time.process_time()
        value = fn()
        rows.append((name, time.process_time() - t, note(value) if callable(note) else note))
        return value

    inv, pb = timed("load inventory + playbook", lambda: (load_inventory(str(inv_path)), load_playbook(str(pb_path))))
    nodes = inv.nodes
    n = len(nodes)
    kh_lines = len(known.read_text().splitlines())
    one = timed("parse known_hosts once (asyncssh.read_known_hosts)", lambda: asyncssh.read_known_hosts(str(known)))
    per = rows[-1][1]
    rows[-1] = (rows[-1][0], per, f"{kh_lines} lines; asyncssh re-reads it on every connect: x{n} = {per * n:.1f} s")
    del one
    source = worker_source()

    def build_all() -> list[Any]:
        peers = probe_peers(nodes, pb)
        return [build_probe(python=nd.python, workdir=nd.workdir, worker_args=worker_args(peers[nd.name], pb),
                            source=source) for nd in nodes]

    probes = timed("build every probe (gather.probe_peers + worker_args + probe.build_probe)", build_all,
                   lambda ps: f"{sum(len(p.argv[2]) for p in ps) / 1e6:.1f} MB of commands; largest `sh -c` "
                              f"argument {max(len(p.argv[2]) for p in ps) / 1024:.0f} KiB")
    responder = ProfileResponder(prof, json.loads(worker_json.read_text()), reach_all_ok=True)

    async def answers() -> list[str]:
        return [(await responder(shlex.join(p.argv), ""))[0] for p in probes]

    outs = asyncio.run(answers())  # the servers' side: not timed
    facts = timed("parse every answer + build facts (parse_probe_output + build_node_facts)",
                  lambda: {nd.name: build_node_facts(nd.name, parse_probe_output(o, p.nonce), workdir=nd.workdir)
                           for nd, o, p in zip(nodes, outs, probes, strict=True)},
                  f"{sum(len(o) for o in outs) / 1e6:.1f} MB of answers")
    connect: dict[str, Any] = {nd.name: ConnectInfo(nd.name, 0.05, 0.5, "ssh-ed25519 SHA256:bench") for nd in nodes}
    report = timed("evaluate (checks + lint)", lambda: evaluate(inv, pb, FleetFacts(connect, facts, {})))
    doc = timed("report.to_json", lambda: report.to_json(strict=False))
    timed("render.dumps (json.dumps indent=2, as --json prints)", lambda: dumps(doc), lambda t: f"{len(t) / 1e6:.1f} MB")
    timed("for comparison: json.dumps without indent", lambda: json.dumps(doc, default=str),
          lambda t: f"{len(t) / 1e6:.1f} MB")
    return rows


async def phases(inv_path: Path, pb_path: Path) -> list[tuple[str, float, float]]:
    """(phase, wall s, CPU s of this process) for the steps `coordinator preflight --json` takes."""
    from coordinator.config.inventory import load_inventory
    from coordinator.config.playbook import load_playbook
    from coordinator.fleet.gather import gather_facts
    from coordinator.fleet.transport import Fleet
    from coordinator.preflight.pipeline import FleetFacts, evaluate
    from coordinator.views.render import dumps

    rows: list[tuple[str, float, float]] = []
    clock = [time.perf_counter(), time.process_time()]

    def mark(name: str) -> None:
        now = [time.perf_counter(), time.process_time()]
        rows.append((name, now[0] - clock[0], now[1] - clock[1]))
        clock[:] = [time.perf_counter(), time.process_time()]

    inv = load_inventory(str(inv_path))
    pb = load_playbook(str(pb_path))
    mark("load inventory + playbook")
    async with Fleet(inv.nodes, concurrency=64) as fleet:
        connect = await fleet.connect_all()
        mark("Fleet.connect_all (TCP, SSH handshake, auth, `true` round trip)")
        gathered = await gather_facts(fleet, pb)
        mark("gather_facts (probe: command + 31 KB stdin out, answer in, parse, build facts)")
    mark("Fleet.close")
    from coordinator.errors import TransportError
    from coordinator.facts.model import NodeFacts

    facts = {n: f for n, f in gathered.items() if isinstance(f, NodeFacts)}
    errors = {n: f for n, f in gathered.items() if isinstance(f, TransportError)}
    report = evaluate(inv, pb, FleetFacts(connect=connect, facts=facts, probe_errors=errors))
    mark("evaluate (checks + lint)")
    text = dumps(report.to_json(strict=False))
    mark(f"report.to_json + dumps ({len(text) / 1e6:.1f} MB)")
    if len(facts) != len(inv.nodes):
        rows.append((f"(only {len(facts)}/{len(inv.nodes)} nodes answered)", 0.0, 0.0))
    return rows


def py_spy() -> str:
    for candidate in (os.environ.get("PY_SPY"), shutil.which("py-spy"), shutil.which("py-spy", path=str(BIN))):
        if candidate:
            return candidate
    raise SystemExit("--py-spy needs py-spy: pip install py-spy (or set PY_SPY=/path/to/py-spy)")


# (activity, test on one stack's frames "func (file:line)"): the first that matches claims the sample
ACTIVITIES: tuple[tuple[str, Any], ...] = (
    ("start-up: imports", lambda fs: any(f.startswith("_find_and_load ") for f in fs)),
    ("known_hosts file re-read and parsed for every connection (asyncssh.known_hosts)",
     lambda fs: any("asyncssh/known_hosts.py" in f for f in fs)),
    ("load inventory + playbook", lambda fs: any(x in f for f in fs for x in ("coordinator/config/inventory.py",
                                                                              "coordinator/config/playbook.py"))),
    ("JSON report: to_json + json.dumps(indent=2)", lambda fs: any(x in f for f in fs for x in (
        "coordinator/views/render.py", "json/encoder.py")) or any(f.startswith("to_json ") for f in fs)),
    ("checks + lint (evaluate)",
     lambda fs: any(x in f for f in fs for x in ("coordinator/preflight/checks/", "coordinator/preflight/lint.py"))),
    ("facts built from probe output (parse + build)", lambda fs: any(x in f for f in fs for x in (
        "coordinator/facts/", "parse_probe_output "))),
    ("probe command built (worker args: every peer, per node)", lambda fs: any(
        f.startswith(("build_probe ", "worker_args ")) for f in fs)),
    ("probe output read line by line (transport.stream/_merge_lines)", lambda fs: any(
        f.startswith(("_merge_lines ", "pump ", "stream ")) and "coordinator/fleet/transport.py" in f for f in fs)),
    ("SSH handshake, key exchange, auth (asyncssh)", lambda fs: any(x in f for f in fs for x in (
        "asyncssh/kex", "asyncssh/auth.py", "asyncssh/public_key.py", "asyncssh/crypto/", "asyncssh/eddsa.py",
        "_process_kexinit", "_process_userauth", "connect (asyncssh/connection.py"))),
    ("asyncssh packet I/O (ciphers, channels)", lambda fs: any("asyncssh/" in f for f in fs)),
    ("event loop, other", lambda fs: True),
)


def py_spy_tables(raw: Path, top: int, run: Sample, timed_cpu: float, nodes: int) -> str:
    """Markdown: samples by activity, top functions by own samples, coordinator functions by inclusive samples."""
    activity: dict[str, int] = dict.fromkeys((a for a, _ in ACTIVITIES), 0)
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        total += count
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + count
        for f in set(frames):
            if "coordinator/" in f:
                inclusive[f] = inclusive.get(f, 0) + count
        for name, test in ACTIVITIES:
            if test(frames):
                activity[name] += count
                break
    if not total:
        return "py-spy recorded no samples.\n"
    out = [f"py-spy run (100 Hz, {total} samples of the coordinator's non-idle thread stacks): "
           f"{run.reached}/{nodes} nodes reached, wall {run.wall:.1f} s. "
           f"`≈ CPU s` = share x the timed runs' median CPU ({timed_cpu:.1f} s).\n",
           "| activity | samples | share | ≈ CPU s |", "|---|---:|---:|---:|"]
    for name, n in sorted(activity.items(), key=lambda kv: -kv[1]):
        if n:
            out.append(f"| {name} | {n} | {100 * n / total:.1f}% | {timed_cpu * n / total:.1f} |")
    out += ["", f"Top {top} functions by own samples:\n", "| function | samples | share |", "|---|---:|---:|"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"| `{f}` | {n} | {100 * n / total:.1f}% |")
    out += ["", f"Top {top} coordinator functions by inclusive samples:\n", "| function | samples | share |",
            "|---|---:|---:|"]
    for f, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"| `{f}` | {n} | {100 * n / total:.1f}% |")
    return "\n".join(out) + "\n"


def cprofile_table(prof: Path, top: int) -> str:
    out: list[str] = []
    stats = pstats.Stats(str(prof), stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = max((ct for (_, _, ct, _) in ((v[0], v[1], v[3], v[4]) for v in raw.values())), default=0.0)

    def where(func: tuple[str, int, str]) -> str:
        file, line, name = func
        for prefix in (str(ROOT) + "/", str(Path(sys.prefix)) + "/lib/python3.11/site-packages/"):
            file = file.replace(prefix, "")
        return f"`{file}:{line}({name})`" if line else f"`{name}`"

    own = str(ROOT / "coordinator") + "/"
    for title, key, keep in (("own time (tottime), any function", 2, lambda f: True),
                             ("cumulative time, coordinator/ functions", 3, lambda f: f[0].startswith(own))):
        rows = sorted(((f, v) for f, v in raw.items() if keep(f)), key=lambda kv: kv[1][key], reverse=True)[:top]
        out.append(f"Top {top} by {title} (cProfile; total {total:.2f} s, profiler overhead included):\n")
        out.append("| function | calls | own s | cumulative s |\n|---|---:|---:|---:|")
        for func, (_cc, nc, tt, ct, _callers) in rows:
            out.append(f"| {where(func)} | {nc} | {tt:.3f} | {ct:.3f} |")
        out.append("")
    return "\n".join(out)


def machine_info() -> dict[str, str]:
    return shared_machine_info(("mlx", "asyncssh", "cryptography"), extra={
        "RLIMIT_NOFILE (soft, hard)": str(resource.getrlimit(resource.RLIMIT_NOFILE))})


def bench(args: argparse.Namespace) -> int:
    info = machine_info()
    command = "python benchmarks/bench_scale.py " + shlex.join(sys.argv[1:])
    coordinator = shutil.which("coordinator", path=str(BIN)) or "coordinator"
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmpdir:
        work = Path(tmpdir)
        t0 = time.perf_counter()
        names, client_key, client_pub, prof, worker_json = build_fixtures(work, args.nodes, args.profile)
        servers = start_servers(args.nodes, args.servers, work, client_pub, prof, worker_json)
        try:
            known = work / "known_hosts"
            known.write_text("".join(servers.known_hosts))
            inv, pb = work / "inventory.yaml", work / "playbook.yaml"
            write_inventory(inv, names, servers.ports, client_key, known)
            pb.write_text(PLAYBOOK)
            print(f"{args.nodes} listeners in {len(servers.procs)} server processes ready in "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
            argv = [coordinator, "preflight", "-i", str(inv), "-p", str(pb), "--json"]
            startup = [run_cli([coordinator, "--version"], work, f"version-{i}", servers, None)
                       for i in range(args.repeat)]
            for w in range(args.warmup):
                warm = run_cli(argv, work, f"warmup-{w}", servers, names)
                print(f"warm-up: wall {warm.wall:.2f}s cpu {warm.cpu:.2f}s", file=sys.stderr)
            samples: list[Sample] = []
            for r in range(args.repeat):
                s = run_cli(argv, work, f"run-{r}", servers, names)
                samples.append(s)
                print(f"run {r + 1}: wall {s.wall:.2f}s cpu {s.cpu:.2f}s rss {s.maxrss_mib:.0f} MiB "
                      f"servers {s.servers_cpu:.2f}s", file=sys.stderr)
            checks = summary_of(work / "run-0.out")
            fd_row = None
            if args.fd_limit:
                fd_row = run_cli(argv, work, "fdlimit", servers, names, fd_limit=args.fd_limit)
            phase_rows = asyncio.run(phases(inv, pb)) if args.phases else None
            stage_rows = stages(inv, pb, known, prof, worker_json) if args.stages else None
            prof_text = []
            slow = ["--connect-timeout", "120"]
            if args.py_spy:
                raw = work / "cli.raw"
                s = run_cli([py_spy(), "record", "--format", "raw", "--rate", "100", "--nonblocking", "-o", str(raw),
                             "--", *argv, *slow], work, "py-spy", servers, names)
                prof_text.append(py_spy_tables(raw, args.py_spy, s, statistics.median(x.cpu for x in samples), len(names)))
            if args.cprofile:
                prof_out = work / "cli.prof"
                s = run_cli([sys.executable, "-m", "cProfile", "-o", str(prof_out), "-m", "coordinator", *argv[1:], *slow],
                            work, "cprofile", servers, names)
                prof_text.append(f"cProfile run: {s.reached}/{len(names)} nodes reached, wall {s.wall:.1f} s.\n\n"
                                 + cprofile_table(prof_out, args.cprofile))
                if args.keep_prof:
                    shutil.copyfile(prof_out, args.keep_prof)
        finally:
            servers.close()
    info["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())

    n = args.nodes
    print(f"### Scale: coordinator preflight of {n} simulated nodes\n\nCommand: `{command}`\n")
    print("| machine | |\n|---|---|")
    for k, v in info.items():
        print(f"| {k} | {v} |")
    print(f"\nNodes: {n} asyncssh listeners on 127.0.0.1 (own port + host key each) in {len(servers.procs)} server "
          f"processes, answering as the fake Mac `{args.profile}` plus a canned worker answer; strict host-key "
          f"checking against a {n}-line known_hosts. Report summary: {checks}. "
          f"{args.repeat} timed runs after {args.warmup} warm-up run(s); medians.\n")
    print("| run | nodes reached | wall s | coordinator CPU s (user+sys) | CPU ms / node | peak RSS MiB "
          "| servers' CPU s | JSON report |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, s in enumerate(samples, 1):
        print(f"| {i} | {s.reached} | {s.wall:.2f} | {s.cpu:.2f} | {1000 * s.cpu / n:.2f} | {s.maxrss_mib:.0f} "
              f"| {s.servers_cpu:.2f} | {s.out_bytes / 1e6:.1f} MB |")
    med = {k: statistics.median(getattr(s, k) for s in samples) for k in ("wall", "cpu", "maxrss_mib", "servers_cpu")}
    print(f"| **median** | | **{med['wall']:.2f}** | **{med['cpu']:.2f}** | **{1000 * med['cpu'] / n:.2f}** "
          f"| {med['maxrss_mib']:.0f} | {med['servers_cpu']:.2f} | |")
    st_wall = statistics.median(s.wall for s in startup)
    st_cpu = statistics.median(s.cpu for s in startup)
    print(f"| CLI start-up alone (`coordinator --version`, median of {len(startup)}) | | {st_wall:.2f} | {st_cpu:.2f} "
          f"| | | | |")
    for s in samples:
        if s.problem:
            print(f"\nNot every node was reached in every run; e.g. {s.problem}")
            break
    verdict = "met" if med["wall"] < 10 else "MISSED"
    print(f"\n- wall time {med['wall']:.2f} s for {n} nodes: goal < 10 s {verdict} "
          f"({med['wall'] / 10:.2f}x the budget)")
    print(f"- coordinator CPU {med['cpu']:.2f} s = {1000 * med['cpu'] / n:.2f} ms per node "
          f"(the servers, on the same {os.cpu_count()} cores, used {med['servers_cpu']:.2f} s meanwhile)")
    if fd_row is not None:
        print(f"- with `ulimit -n {args.fd_limit}` (RLIMIT_NOFILE soft limit): exit {fd_row.rc}, wall {fd_row.wall:.2f} s, "
              f"{fd_row.reached}/{n} nodes reached" + (f"; e.g. {fd_row.problem}" if fd_row.problem else ""))
    print()
    if phase_rows is not None:
        print("Phases, in-process through the API (same inventory and playbook, one run):\n")
        print("| phase | wall s | CPU s (this process) |\n|---|---:|---:|")
        for name, wall, cpu in phase_rows:
            print(f"| {name} | {wall:.2f} | {cpu:.2f} |")
        print(f"| **total** | **{sum(r[1] for r in phase_rows):.2f}** | **{sum(r[2] for r in phase_rows):.2f}** |\n")
    if stage_rows is not None:
        print(f"Stages without the network, in-process, {n} nodes (CPU seconds of this process; one pass):\n")
        print("| stage | CPU s | CPU ms / node | note |\n|---|---:|---:|---|")
        for name, cpu, note in stage_rows:
            print(f"| {name} | {cpu:.2f} | {1000 * cpu / n:.2f} | {note} |")
        print()
    for text in prof_text:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    parser.add_argument("--servers", type=int, default=10, help="server processes sharing the listeners (default 10)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    parser.add_argument("--profile", default="m5max-mbp-tb5", help="fake-Mac profile the nodes answer with")
    parser.add_argument("--stages", action="store_true", help="also time the non-network stages in-process")
    parser.add_argument("--phases", action="store_true", help="also time each phase in-process through the API")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="also one cProfile'd run: top N functions")
    parser.add_argument("--py-spy", type=int, default=0, metavar="N", help="also one py-spy'd run: top N functions")
    parser.add_argument("--keep-prof", metavar="FILE", help="with --cprofile: keep the raw profile here (pstats)")
    parser.add_argument("--fd-limit", type=int, default=0, metavar="L", help="also one run with `ulimit -n L`")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listeners", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--client-pub", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args)
    if args.nodes < 1 or args.servers < 1 or args.repeat < 1:
        parser.error("--nodes, --servers and --repeat must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks stop the servers
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
