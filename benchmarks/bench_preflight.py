"""Preflight wall time: `coordinator preflight` vs `ansible -m setup -a gather_subset=min`, on the same SSH hosts.

The hosts are test-bed hosts (tests/testbed.py: Linux network namespaces, each with its own IP, sshd, host key
and /srv, on this machine). Every other host is a fake Mac (shims first on PATH replay a recorded profile from
tests/fixtures/profiles/, cycling through the four complete ones); the rest answer as the Debian box they are.
Every host gets HOME=/srv/home (its own home, so hash caches, ~/.ansible and the like stay per host) and the
same small model and data dirs under /srv (config.json, a small safetensors file, tokenizer.json, train/valid
jsonl), so the coordinator's preflight really hashes files, reads the model config and probes every peer.

For each host count (default 16 and 64; one bed of max(hosts) hosts, the first N are used), after one untimed
warm-up run of each tool (hash caches filled, .pyc files written, first-connection costs paid), the tools are
run --repeat times each, interleaved and alternating the order (A B C, C B A, ...) so drift hits every tool:

  coordinator          `coordinator preflight -i INV.yaml -p PB.yaml --json` (the real CLI, a subprocess)
  ansible              `ansible all -i INV.ini -m setup -a gather_subset=min -f N` (ansible-core defaults:
                       ControlMaster/ControlPersist, no pipelining; fresh ControlPath dir per run)
  ansible+pipelining   the same with ANSIBLE_PIPELINING=True (ansible's fastest stock setting)

Both tools use the same node python (--node-python; by default a plain venv with this environment's mlx and
mlx-lm, made once under ~/.cache/mlx-coordinator-bench/, like a real node's), the same client key,
the bed's known_hosts with strict host-key checking (ANSIBLE_HOST_KEY_CHECKING=True too), and ansible gets
one fork per host. A run counts only if it reached every host (coordinator: every node's `ssh` check passed
and its `model` check ran; ansible: exit 0 and one SUCCESS per host), else the benchmark stops.

Reported per tool: every run's wall seconds, the median, and the tool's median / the coordinator's; median
local CPU seconds (user+sys of the tool's process and every child it waited for: for ansible its forks and
ssh clients, for the coordinator its one process); median hosts' CPU seconds (user+sys of every host's sshd
and all it reaped: sessions, shells, probes, modules, peers' TCP probes; read 1 s after the run). Both CPU
figures are per process tree, so other load on the machine does not inflate them; wall time it does.

    .venv/bin/python benchmarks/bench_preflight.py [--hosts 16,64] [--repeat 3] [--macs 0.5]
        [--ansible-variants default,pipelining] [--file-kib 256] [--node-python PATH]

Needs root (network namespaces). Installs ansible-core into this interpreter's environment with pip if it is
missing (it is in pyproject's `[bench]` extra). Prints Markdown; cleans up every namespace and process it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cliout import by_node, cli_json  # noqa: E402 - after the path fix
from benchmarks.machine import machine_info as shared_machine_info  # noqa: E402 - after the path fix
from tests.testbed import VENV_PYTHON, Host, TestBed, requirements_problems  # noqa: E402 - after the path fix

MAC_PROFILES = ("m5max-mbp-tb5", "m3ultra-studio-tb5", "m4max-mbp-tb4-rdma-nodev", "m1max-macos14")
RUN_TIMEOUT = 900.0
SETTLE_S = 1.0
BIN = Path(sys.executable).parent

PLAYBOOK = """\
# bench_preflight: the same small model and data dirs exist on every host (under the host's own /srv)
name: bench-preflight
kind: train
model: /srv/model
data: /srv/data
backend: ring
train:
  method: lora
  iters: 10
  batch_size: 2
  max_seq_length: 128
"""

MODEL_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip


# ------------------------------------------------------------------------------------------------- helpers


def machine_info() -> dict[str, str]:
    ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False).stderr.strip()
    return shared_machine_info(("mlx", "asyncssh", "ansible-core"), extra={"openssh": ssh})


def print_machine(info: dict[str, str]) -> None:
    print("| machine | |\n|---|---|")
    for k, v in info.items():
        print(f"| {k} | {v} |")
    print()


def node_venv() -> str:
    """A node python like a real node's: a plain venv with this environment's mlx and mlx-lm versions and none of
    our packages. (The repository's .venv also has this project installed in editable mode, whose import hook
    runs at every interpreter start-up: ~12 ms of CPU for each python run on a node, by either tool, which no
    real node pays.) Made once with pip (wheels come from pip's cache after the first time) and reused."""
    versions = {d: importlib.metadata.version(d) for d in ("mlx", "mlx-lm")}
    wanted = [f"mlx=={versions['mlx']}", f"mlx-lm=={versions['mlx-lm']}"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # Linux: mlx's CPU backend is an extra
        wanted[0] = f"mlx[cpu]=={importlib.metadata.version('mlx-cpu')}"
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-mlx{versions['mlx']}-mlxlm{versions['mlx-lm']}"
    venv = Path.home() / ".cache" / "mlx-coordinator-bench" / f"node-venv-{tag}"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        print(f"making the node venv {venv} ({' '.join(wanted)})", file=sys.stderr)
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted], check=True)
        (venv / "ready").write_text(" ".join(wanted) + "\n")
    return str(python)


def ensure_ansible() -> None:
    if shutil.which("ansible", path=str(BIN)) is not None:
        return
    print("ansible-core missing: installing it with pip into", sys.prefix, file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "ansible-core>=2.16"], check=True)
    if shutil.which("ansible", path=str(BIN)) is None:
        raise SystemExit(f"pip installed ansible-core but there is no {BIN / 'ansible'}")


def hosts_cpu(hosts: Sequence[Host]) -> float:
    """CPU seconds used on the hosts' side: each host's listening sshd plus every descendant it has reaped
    (per-connection sshd children, the sessions' shells, probes and python; peers' TCP probes of its port), from
    utime+stime+cutime+cstime of /proc/<sshd>/stat. Unaffected by whatever else runs on the machine."""
    ticks = 0
    for h in hosts:
        if h.pid is None:
            continue
        fields = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def safetensors_bytes(kib: int) -> bytes:
    """A valid safetensors file of about `kib` KiB: one F32 tensor (deterministic content)."""
    n = max(1, kib * 1024 // 4)
    header = json.dumps({"embed.weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    payload = bytes((i * 7 + 3) % 251 for i in range(4 * n))
    return struct.pack("<Q", len(header)) + header + payload


def populate(host: Host, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = host.srv / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (host.srv / "home").mkdir(exist_ok=True)


def kill_pids_mentioning(marker: str) -> int:
    """SIGKILL processes whose command line contains `marker` (a temp path unique to this run: ansible's
    ControlPersist masters outlive the ansible command). Returns how many were killed."""
    killed = 0
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
    return killed


# ------------------------------------------------------------------------------------------------ the tools


@dataclass
class Sample:
    wall: float
    cpu: float
    hosts: float


@dataclass
class Tool:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    samples: list[Sample] = field(default_factory=list)
    marker: str | None = None  # see kill_pids_mentioning

    def run(self, work: Path, hosts: Sequence[Host], tag: str) -> Sample:
        out, err = work / f"{tag}.out", work / f"{tag}.err"
        env = dict(self.env)
        if self.marker is not None:  # a fresh ControlPath dir per run: no master connection survives a run
            cp = Path(self.marker) / tag
            cp.mkdir(parents=True)
            env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(cp)
        with open(out, "wb") as fo, open(err, "wb") as fe:
            cpu0, hosts0, t0 = children_cpu(), hosts_cpu(hosts), time.perf_counter()
            try:
                cp_ = subprocess.run(self.argv, stdout=fo, stderr=fe, env=env, cwd=self.cwd, timeout=RUN_TIMEOUT,
                                     check=False)
            finally:
                wall = time.perf_counter() - t0
                cpu = children_cpu() - cpu0
                if self.marker is not None:
                    kill_pids_mentioning(self.marker)
        time.sleep(SETTLE_S)  # let each sshd reap its per-connection children (their CPU lands in its cutime)
        hosts_used = hosts_cpu(hosts) - hosts0
        names = [h.name for h in hosts]
        self.verify(cp_.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), names, tag)
        return Sample(wall, cpu, hosts_used)

    def verify(self, rc: int, stdout: str, stderr: str, names: Sequence[str], tag: str) -> None:
        if self.name == "coordinator":
            try:
                report = cli_json("preflight", stdout)
            except ValueError as exc:
                raise SystemExit(f"{tag}: coordinator exited {rc} without a readable JSON report ({exc}): "
                                 f"{stderr[-2000:]}") from None
            nodes = {n: {c["id"]: c["status"] for c in row["checks"]} for n, row in by_node(report["nodes"]).items()}
            bad = [n for n in names if nodes.get(n, {}).get("ssh") != "pass" or nodes[n].get("model") in (None, "error")]
            if rc not in (0, 1) or bad or len(nodes) != len(names):
                raise SystemExit(f"{tag}: coordinator exited {rc}; nodes not fully probed: {bad[:10]} {stderr[-2000:]}")
        else:
            ok = sum(1 for line in stdout.splitlines() if " | SUCCESS" in line)
            if rc != 0 or ok != len(names):
                raise SystemExit(f"{tag}: {self.name} exited {rc}, {ok}/{len(names)} SUCCESS: "
                                 f"{(stderr or stdout)[-2000:]}")


def write_ansible_inventory(path: Path, bed: TestBed, hosts: Sequence[Host], python: str) -> None:
    common = f"-o UserKnownHostsFile={bed.known_hosts} -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes"
    lines = ["[bench]", *(f"{h.name} ansible_host={h.ip}" for h in hosts), "", "[bench:vars]",
             "ansible_user=root", "ansible_port=22", f"ansible_ssh_private_key_file={bed.client_key}",
             f"ansible_python_interpreter={python}", f"ansible_ssh_common_args='{common}'", ""]
    path.write_text("\n".join(lines))


def make_tools(bed: TestBed, hosts: Sequence[Host], work: Path, variants: Sequence[str], python: str) -> list[Tool]:
    n = len(hosts)
    inv = bed.write_inventory(work / "inventory.yaml", hosts, python=python)
    pb = work / "playbook.yaml"
    pb.write_text(PLAYBOOK)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    coordinator = shutil.which("coordinator", path=str(BIN)) or "coordinator"
    tools = [Tool("coordinator", [coordinator, "preflight", "-i", str(inv), "-p", str(pb), "--json"],
                  {**base_env, "NO_COLOR": "1", "TERM": "dumb"}, ROOT)]
    ini = work / "inventory.ini"
    write_ansible_inventory(ini, bed, hosts, python)
    cfg = work / "ansible.cfg"
    cfg.write_text("# bench_preflight: empty on purpose (ansible-core defaults, plus the ANSIBLE_* variables)\n")
    ansible_env = {
        **base_env,
        "ANSIBLE_CONFIG": str(cfg),
        "ANSIBLE_HOME": str(work / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp"),
        "ANSIBLE_REMOTE_TMP": "~/.ansible/tmp",  # HOME=/srv/home: per host
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_FORKS": str(n),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
    }
    argv = [str(BIN / "ansible"), "all", "-i", str(ini), "-m", "setup", "-a", "gather_subset=min", "-f", str(n)]
    for v in variants:
        env = {**ansible_env, "ANSIBLE_PIPELINING": "True" if v == "pipelining" else "False"}
        name = "ansible" if v == "default" else f"ansible+{v}"
        tools.append(Tool(name, argv, env, work, marker=str(work / f"cp-{v}")))
    return tools


# ------------------------------------------------------------------------------------------------- the run


def build_bed(bed: TestBed, count: int, macs: float, file_kib: int) -> list[Host]:
    """`count` hosts h01.. in order; host i is a fake Mac when floor(i*macs) > floor((i-1)*macs)."""
    specs: list[tuple[str, str | None]] = []
    n_mac = 0
    for i in range(1, count + 1):
        mac = int(i * macs) > int((i - 1) * macs)
        specs.append((f"h{i:02d}", MAC_PROFILES[n_mac % len(MAC_PROFILES)] if mac else None))
        n_mac += mac
    with ThreadPoolExecutor(max_workers=8) as pool:
        made = list(pool.map(lambda s: bed.add_host(s[0], mac_profile=s[1], env={"HOME": "/srv/home"}), specs))
    tokenizer = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {chr(97 + i): i for i in range(26)}}})
    files = {
        "model/config.json": json.dumps(MODEL_CONFIG, indent=2).encode(),
        "model/model.safetensors": safetensors_bytes(file_kib),
        "model/tokenizer.json": tokenizer.encode(),
        "data/train.jsonl": "".join(json.dumps({"text": f"sample {i} " * 8}) + "\n" for i in range(200)).encode(),
        "data/valid.jsonl": "".join(json.dumps({"text": f"valid {i} " * 8}) + "\n" for i in range(20)).encode(),
    }
    for h in made:
        populate(h, files)
    return made


def run(args: argparse.Namespace) -> int:
    counts = sorted({int(x) for x in args.hosts.split(",") if x.strip()})
    variants = [v.strip() for v in args.ansible_variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("default", "pipelining"):
            raise SystemExit(f"unknown ansible variant {v!r} (default, pipelining)")
    problems = requirements_problems()
    if problems:
        raise SystemExit("test bed unavailable: " + "; ".join(problems))
    ensure_ansible()
    if args.node_python is None:
        args.node_python = node_venv()
    info = machine_info()
    info["node python"] = args.node_python
    command = "python benchmarks/bench_preflight.py " + shlex.join(sys.argv[1:])
    results: dict[int, list[Tool]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmpdir:
        tmp = Path(tmpdir)
        with TestBed(tmp=tmp / "bed") as bed:
            t0 = time.perf_counter()
            hosts = build_bed(bed, max(counts), args.macs, args.file_kib)
            print(f"bed: {len(hosts)} hosts ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            for n in counts:
                work = tmp / f"n{n}"
                work.mkdir()
                subset = hosts[:n]
                tools = make_tools(bed, subset, work, variants, args.node_python)
                for tool in tools:  # warm-up
                    s = tool.run(work, subset, f"{tool.name}-warmup")
                    print(f"{n} hosts: warm-up {tool.name}: {s.wall:.2f}s", file=sys.stderr)
                for r in range(args.repeat):
                    order = tools if r % 2 == 0 else list(reversed(tools))
                    for tool in order:
                        s = tool.run(work, subset, f"{tool.name}-{r}")
                        tool.samples.append(s)
                        print(f"{n} hosts: run {r + 1} {tool.name}: wall {s.wall:.2f}s cpu {s.cpu:.2f}s "
                              f"hosts {s.hosts:.2f}s", file=sys.stderr)
                results[n] = tools
    info["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report(results, info, command, args)
    return 0


def report(results: dict[int, list[Tool]], info: dict[str, str], command: str, args: argparse.Namespace) -> None:
    print(f"### Preflight: coordinator vs ansible\n\nCommand: `{command}`\n")
    print_machine(info)
    n_mac = int(max(results) * args.macs)
    print(f"Hosts: test-bed network namespaces on this machine, fake Macs (shims) for a fraction {args.macs:g} "
          f"of them ({n_mac} of {max(results)}), model+data dirs of 5 files ({args.file_kib} KiB safetensors) "
          f"per host. {args.repeat} timed runs per tool after one warm-up; medians.\n")
    print("| hosts | tool | wall s (each run) | median wall s | wall / coordinator's | median local CPU s "
          "| median hosts' CPU s | local CPU / coordinator's |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for n, tools in results.items():
        coord = statistics.median([s.wall for s in tools[0].samples])
        coord_cpu = statistics.median([s.cpu for s in tools[0].samples])
        for tool in tools:
            walls = [s.wall for s in tool.samples]
            cpu = statistics.median([s.cpu for s in tool.samples])
            wall = statistics.median(walls)
            hosts = statistics.median([s.hosts for s in tool.samples])
            print(f"| {n} | {tool.name} | {', '.join(f'{w:.2f}' for w in walls)} | {wall:.2f} "
                  f"| {wall / coord:.2f}x | {cpu:.2f} | {hosts:.2f} | {cpu / coord_cpu:.2f}x |")
    print()
    for n, tools in results.items():
        coord = statistics.median([s.wall for s in tools[0].samples])
        for tool in tools[1:]:
            ratio = statistics.median([s.wall for s in tool.samples]) / coord
            goal = f" (goal >= 6x at 16 hosts: {'met' if ratio >= 6 else 'MISSED'})" if n == 16 else ""
            print(f"- {n} hosts: coordinator {coord:.2f} s vs {tool.name} "
                  f"{statistics.median([s.wall for s in tool.samples]):.2f} s: coordinator {ratio:.2f}x faster{goal}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="16,64", help="comma-separated host counts (default 16,64)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per tool and host count (default 3)")
    parser.add_argument("--macs", type=float, default=0.5, help="fraction of hosts that are fake Macs (default 0.5)")
    parser.add_argument("--ansible-variants", default="default,pipelining",
                        help="comma-separated: default, pipelining (default both)")
    parser.add_argument("--file-kib", type=int, default=256, help="size of the model's safetensors file (KiB)")
    parser.add_argument("--node-python", help="python on the nodes, for both tools (default: a plain venv with "
                        f"mlx and mlx-lm, made once; {VENV_PYTHON} is the test bed's, with this project installed)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or not 0 <= args.macs <= 1:
        parser.error("--repeat >= 1 and 0 <= --macs <= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the bed's context manager cleans up
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
