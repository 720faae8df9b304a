"""File sync wall time: `coordinator sync` vs scp, rsync and `ansible -m copy`, on rate-limited test-bed hosts.

One source host and N target hosts (tests/testbed.py: network namespaces with their own sshd and /srv, on this
machine). Every host's veth is shaped with `tc tbf` at --rate in BOTH directions (the root-namespace end shapes
what enters the host, the host's eth0 what leaves it), so the network, not the disk or the CPU, is the
bottleneck, as on a real LAN. The source's /srv/model holds --mib MiB of random data in a few safetensors-like
shards (plus config.json), /srv/data one small train.jsonl. Every host has HOME=/srv/home (its own hash cache).

Each tool starts from empty targets (their model/data dirs removed) and copies the source's two dirs to all N:

  sync                 `coordinator sync -i INV -p PB --from src --json`: the relay chain (src -> t1 -> ... -> tN)
  scp (serial)         `scp -r` from the source to each target in turn (run inside the source's namespace)
  rsync (parallel)     `rsync -a --delete` from the source to all targets at once
  ansible -m copy      `ansible targets -m copy -a src=... dest=...` run from the source (-f N)

plus, for sync only:
  warm re-sync         the same command again with nothing changed (N targets verified from their hash caches)
  killed + resumed     a sync killed (SIGKILL to its process group) once the last target holds ~40% of the big
                       shard, then the same command again: bytes the second run sent vs what was missing

"one copy at link rate" is the data size over --rate (the time a single perfect copy takes); the goal is sync's wall
<= 1.3x that. Every copy is checked byte-identical (sha256 of every file) before its time counts.

    sudo .venv/bin/python benchmarks/bench_sync.py [--targets 4] [--mib 256] [--rate-mbit 200] [--tools ...]

Needs root (namespaces, tc), OpenSSH's scp, rsync, and ansible-core (pyproject's `[bench]` extra). Prints
Markdown; cleans up every namespace and process it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cliout import cli_json  # noqa: E402
from tests.testbed import Host, TestBed  # noqa: E402

BIN = Path(sys.executable).parent
MIB = 1 << 20
SHARDS = 4


def shape(host: Host, rate_mbit: int) -> None:
    spec = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "50ms"]
    subprocess.run(["tc", "qdisc", "add", "dev", host.veth, *spec], check=True)
    subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", "eth0", *spec], check=True)


def fill_source(src: Host, mib: int) -> int:
    model = src.srv / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 100}))
    per = mib * MIB // SHARDS
    for i in range(SHARDS):
        with open(model / f"model-{i:05d}-of-{SHARDS:05d}.safetensors", "wb") as fh:
            for _ in range(per // MIB):
                fh.write(os.urandom(MIB))
    data = src.srv / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text('{"text": "hello"}\n' * 100)
    return sum(p.stat().st_size for d in ("model", "data") for p in (src.srv / d).rglob("*") if p.is_file())


def tree(host: Host) -> dict[str, str]:
    out = {}
    for d in ("model", "data"):
        for p in sorted((host.srv / d).rglob("*")):
            if p.is_file():
                h = hashlib.sha256()
                with open(p, "rb") as fh:
                    while block := fh.read(8 * MIB):
                        h.update(block)
                out[str(p.relative_to(host.srv))] = h.hexdigest()
    return out


def clear(targets: list[Host]) -> None:
    for h in targets:
        for d in ("model", "data"):
            shutil.rmtree(h.srv / d, ignore_errors=True)


def check_identical(tag: str, src_tree: dict[str, str], targets: list[Host]) -> None:
    for h in targets:
        got = tree(h)
        if got != src_tree:
            raise SystemExit(f"{tag}: {h.name} is not identical to the source ({len(got)} vs {len(src_tree)} files)")


def ssh_opts(bed: TestBed) -> list[str]:
    return ["-i", str(bed.client_key), "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={bed.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]


def timed(argv: list[str], *, env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    cp = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - started, cp


def in_source(bed: TestBed, src: Host, argv: list[str]) -> list[str]:
    """argv run inside the source host (its namespace and its /srv)."""
    return [*bed._ns_prefix(src), *argv]  # the bed's own prefix, as bed.exec uses it


def sync_row(wall: float, link_s: float, doc: dict[str, Any]) -> tuple[str, str, str]:
    """The report's row for one cold sync, from `sync --json` (read through its schema: `cli_json`)."""
    return ("coordinator sync (relay chain)", f"{wall:.2f}",
            f"{wall / link_s:.2f}x one copy; sent {int(doc['sent_bytes']) / 1e6:.1f} MB once; "
            f"transfer {doc['transfer_s']} s")


def run_sync(inv: Path, pb: Path) -> tuple[float, dict[str, Any]]:
    wall, cp = timed([sys.executable, "-m", "coordinator", "sync", "-i", str(inv), "-p", str(pb), "--from", "src",
                      "--json"], env={**os.environ, "PYTHONPATH": str(ROOT)})
    if cp.returncode != 0:
        raise SystemExit(f"sync exited {cp.returncode}: {cp.stderr[-2000:]} {cp.stdout[-2000:]}")
    return wall, cli_json("sync", cp.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rate-mbit", type=int, default=200)
    parser.add_argument("--tools", default="sync,warm,resume,scp,rsync,ansible")
    args = parser.parse_args()
    tools = args.tools.split(",")
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp, TestBed(tmp=Path(tmp) / "bed") as bed:
        work = Path(tmp)
        hosts = bed.add_hosts(["src", *(f"t{i}" for i in range(1, args.targets + 1))], env={"HOME": "/srv/home"})
        src, targets = hosts[0], hosts[1:]
        for h in hosts:
            (h.srv / "home").mkdir(exist_ok=True)
            shape(h, args.rate_mbit)
        size = fill_source(src, args.mib)
        src_tree = tree(src)
        link_s = size * 8 / (args.rate_mbit * 1e6)
        inv = bed.write_inventory(work / "inv.yaml", hosts)
        pb = work / "pb.yaml"
        pb.write_text("name: bench\nkind: train\nmodel: /srv/model\ndata: /srv/data\nbackend: ring\n"
                      "train: {method: lora, iters: 20}\n")
        print(f"source: {size / 1e6:.1f} MB ({SHARDS} shards + config, data), {args.targets} targets, "
              f"{args.rate_mbit} Mbit/s each way per host; one copy at link rate: {link_s:.2f} s", file=sys.stderr)

        if "sync" in tools:
            clear(targets)
            wall, doc = run_sync(inv, pb)
            check_identical("sync", src_tree, targets)
            rows.append(sync_row(wall, link_s, doc))
        if "warm" in tools:
            if "sync" not in tools:
                clear(targets)
                run_sync(inv, pb)
            walls = []
            for _ in range(3):
                wall, doc = run_sync(inv, pb)
                if doc["sent_bytes"] != 0:
                    raise SystemExit(f"warm re-sync sent {doc['sent_bytes']} bytes")
                walls.append(wall)
            rows.append(("coordinator sync, warm (nothing changed)", f"{sorted(walls)[1]:.2f}",
                         f"median of 3 ({', '.join(f'{w:.2f}' for w in walls)}); 0 bytes sent"))
        if "resume" in tools:
            clear(targets)
            big = f"model/model-{SHARDS - 1:05d}-of-{SHARDS:05d}.safetensors"
            partial = targets[-1].srv / (big + ".partial")
            shard = (src.srv / big).stat().st_size
            proc = subprocess.Popen([sys.executable, "-m", "coordinator", "sync", "-i", str(inv), "-p", str(pb),
                                     "--from", "src", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > 0.4 * shard):
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(2)  # the relays notice their sessions are gone at their next progress line, and exit
            missing = 0  # the stream serves every target: what the least advanced one lacks
            for h in targets:
                have = 0  # complete files equal to the source's, and kept partial prefixes
                for rel, digest in src_tree.items():
                    p = h.srv / rel
                    if p.exists() and tree_file(p) == digest:
                        have += p.stat().st_size
                    elif Path(str(p) + ".partial").exists():
                        have += Path(str(p) + ".partial").stat().st_size
                missing = max(missing, size - have)
            wall, doc = run_sync(inv, pb)
            check_identical("resume", src_tree, targets)
            sent = int(doc["sent_bytes"])
            rows.append(("coordinator sync, killed at ~40% of the last shard, then re-run", f"{wall:.2f}",
                         f"re-run sent {sent / 1e6:.2f} MB of {size / 1e6:.1f}; the least advanced target missed "
                         f"{missing / 1e6:.2f} MB; excess {(sent - missing) / MIB:+.2f} MiB (goal <= +1 MiB chunk)"))
        if "scp" in tools:
            clear(targets)
            per = []
            started = time.perf_counter()
            for h in targets:
                wall, cp = timed(in_source(bed, src, ["scp", "-q", "-r", *ssh_opts(bed), "/srv/model", "/srv/data",
                                                      f"root@{h.ip}:/srv/"]))
                if cp.returncode != 0:
                    raise SystemExit(f"scp to {h.name}: {cp.stderr[-1000:]}")
                per.append(wall)
            total = time.perf_counter() - started
            check_identical("scp", src_tree, targets)
            rows.append(("scp -r, one target after another", f"{total:.2f}",
                         f"{total / link_s:.2f}x one copy; one scp {min(per):.2f} s"))
        if "rsync" in tools:
            clear(targets)
            ssh = "ssh " + " ".join(ssh_opts(bed))
            started = time.perf_counter()
            procs = [subprocess.Popen(in_source(bed, src, ["rsync", "-a", "--delete", "-e", ssh, "/srv/model",
                                                           "/srv/data", f"root@{h.ip}:/srv/"]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in targets]
            for p in procs:
                _, err = p.communicate()
                if p.returncode != 0:
                    raise SystemExit(f"rsync: {err[-1000:]}")
            total = time.perf_counter() - started
            check_identical("rsync", src_tree, targets)
            rows.append(("rsync -a, all targets in parallel from the source", f"{total:.2f}",
                         f"{total / link_s:.2f}x one copy"))
        if "ansible" in tools:
            clear(targets)
            ini = work / "targets.ini"
            common = " ".join(ssh_opts(bed)[2:])
            ini.write_text("\n".join(["[targets]", *(f"{h.name} ansible_host={h.ip}" for h in targets), "",
                                      "[targets:vars]", "ansible_user=root",
                                      f"ansible_ssh_private_key_file={bed.client_key}",
                                      f"ansible_python_interpreter={sys.executable}",
                                      f"ansible_ssh_common_args='{common}'", ""]))
            env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
            env.update({"ANSIBLE_HOME": str(work / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp"),
                        "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_NOCOLOR": "1",
                        "ANSIBLE_DEPRECATION_WARNINGS": "False"})
            started = time.perf_counter()
            for d in ("model", "data"):
                cp = subprocess.run(in_source(bed, src, [str(BIN / "ansible"), "targets", "-i", str(ini), "-f",
                                                         str(len(targets)), "-m", "copy", "-a",
                                                         f"src=/srv/{d}/ dest=/srv/{d}/"]),
                                    capture_output=True, text=True, env=env, check=False)
                if cp.returncode != 0:
                    raise SystemExit(f"ansible: {cp.stdout[-1500:]} {cp.stderr[-1000:]}")
            total = time.perf_counter() - started
            check_identical("ansible", src_tree, targets)
            rows.append(("ansible -m copy (-f N), from the source", f"{total:.2f}", f"{total / link_s:.2f}x one copy"))

    print(f"`{' '.join(['benchmarks/bench_sync.py', *sys.argv[1:]])}`: {size / 1e6:.0f} MB to {args.targets} targets, "
          f"{args.rate_mbit} Mbit/s per host each way; one copy at link rate {link_s:.2f} s\n")
    print("| tool | wall s | notes |\n|---|---|---|")
    for tool, wall_s, notes in rows:
        print(f"| {tool} | {wall_s} | {notes} |")


def tree_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while block := fh.read(8 * MIB):
            h.update(block)
    return h.hexdigest()


if __name__ == "__main__":
    main()
