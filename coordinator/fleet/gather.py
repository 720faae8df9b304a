"""Fan-out: run the probe on every connected node and build its facts (the I/O half of `facts`/`preflight`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config.playbook import Playbook
from coordinator.errors import TransportError
from coordinator.facts.build import build_node_facts
from coordinator.facts.model import NodeFacts
from coordinator.facts.probe import build_probe, parse_probe_output, worker_source
from coordinator.facts.topology import reach_peers
from coordinator.fleet.transport import Fleet, Transport
from coordinator.models import Node

DEFAULT_PROBE_TIMEOUT = 600.0  # first hash of a large model; re-verification takes well under a second

ProgressFn = Callable[[str, int, int], None]  # (node, done_bytes, total_bytes)


def probe_peers(nodes: Sequence[Node], playbook: Playbook | None) -> dict[str, list[Node]]:
    """node name -> the peers its probe must reach (topology.reach_peers: all of them in a small fleet)."""
    by_name = {n.name: n for n in nodes}
    wanted = reach_peers([n.name for n in nodes], playbook.backend if playbook else "ring")
    return {name: [by_name[p] for p in peers] for name, peers in wanted.items()}


def worker_args(peers: Sequence[Node], playbook: Playbook | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "peers": [{"name": p.name, "ip": p.data_ip, "port": p.port or 22} for p in peers],
        "progress": True,
    }
    if playbook is not None:
        args["hash_dirs"] = [path for _, path in playbook.hashed_dirs()]
        args["model_dir"] = playbook.model
        if playbook.kind == "train" and playbook.data:
            args["data_check"] = data_check_args(playbook)
    return args


def data_check_args(pb: Playbook) -> dict[str, Any]:
    """What the trainer will read, for the probe to parse first: train.jsonl (required) and valid.jsonl (the
    evals; the trainer runs without it, with a warning), and for SFT test.jsonl too, which mlx-lm's loader
    reads whenever it exists (worker/data.py, worker/dpo.py)."""
    files: list[list[Any]] = [["train.jsonl", True], ["valid.jsonl", False]]
    if pb.train.method != "dpo":
        files.append(["test.jsonl", False])
    return {"dir": pb.data, "format": "dpo" if pb.train.method == "dpo" else "sft", "files": files}


@dataclass(frozen=True)
class ProbeRun:
    facts: NodeFacts
    elapsed_s: float


async def probe_node(
    node: Node,
    transport: Transport,
    peers: Sequence[Node],
    playbook: Playbook | None,
    *,
    timeout: float = DEFAULT_PROBE_TIMEOUT,
    progress: ProgressFn | None = None,
    source: str | None = None,
) -> NodeFacts:
    probe = build_probe(python=node.python, workdir=node.workdir, worker_args=worker_args(peers, playbook),
                        source=source)
    out: list[str] = []
    err: list[str] = []
    status = "?"
    # Chunks, not lines: a Mac answers ~1,000 lines and a yield per line is most of the coordinator's cost per
    # node on a large fleet. Only stderr (hashing progress) is read line by line.
    async for kind, text in transport.stream(probe.argv, stdin=probe.stdin, timeout=timeout, lines=False):
        if kind == "stdout":
            out.append(text)
        elif kind == "stderr":
            for line in text.splitlines(keepends=True):
                parts = line.split()
                if progress is not None and len(parts) == 3 and parts[0] == "progress" and parts[1].isdigit():
                    progress(node.name, int(parts[1]), int(parts[2]))
                else:
                    err.append(line)
        else:
            status = text
    sections = parse_probe_output("".join(out), probe.nonce)
    if not sections:
        raise TransportError(node.name, f"probe produced no output (exit {status}): {''.join(err)[-500:].strip()}")
    return build_node_facts(node.name, sections, workdir=node.workdir)


def fact_prober(
    nodes: Sequence[Node],
    playbook: Playbook | None,
    *,
    timeout: float = DEFAULT_PROBE_TIMEOUT,
    progress: ProgressFn | None = None,
) -> Callable[[Node, Transport], Awaitable[NodeFacts]]:
    """The per-node probe for a fleet of `nodes` (peers and the worker source worked out once), for
    `Fleet.map` / `Fleet.connect_and_map`."""
    source = worker_source()
    peers = probe_peers(nodes, playbook)

    async def one(node: Node, transport: Transport) -> NodeFacts:
        return await probe_node(node, transport, peers[node.name], playbook, timeout=timeout, progress=progress,
                                source=source)

    return one


async def gather_facts(
    fleet: Fleet,
    playbook: Playbook | None,
    *,
    timeout: float = DEFAULT_PROBE_TIMEOUT,
    progress: ProgressFn | None = None,
) -> dict[str, NodeFacts | TransportError]:
    """Probe every connected node concurrently; a node that fails mid-probe comes back as its error."""
    return await fleet.map(fact_prober(fleet.nodes, playbook, timeout=timeout, progress=progress))


def record_facts(facts: NodeFacts, directory: Path) -> Path:
    """Save every raw section as `<dir>/<node>/<section>.out` (+ `.rc` when non-zero): a replayable profile."""
    target = directory / facts.node
    target.mkdir(parents=True, exist_ok=True)
    for name, text in facts.raw.items():
        (target / f"{name}.out").write_text(text, encoding="utf-8")
        rc = facts.raw_rc.get(name, 0)
        if rc:
            (target / f"{name}.rc").write_text(f"{rc}\n", encoding="utf-8")
    return target
