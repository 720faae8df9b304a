"""One rank per GPU: an inventory node with several NVIDIA GPUs becomes one *rank node* per GPU. Pure.

mlx's nccl backend runs one process per GPU, and mlx.launch cannot place them: with a hostfile it gives every rank
`CUDA_VISIBLE_DEVICES = rank % 1 = 0`, so two ranks of one host share GPU 0 and NCCL fails with `invalid usage`.
The coordinator therefore splits such a node into rank nodes `gpu-box/gpu0`, `gpu-box/gpu1`, ... before it
calibrates: each is a `Node` of its own (its own calibration, batch, run dir, events, incidents, quarantine entry,
and the name every view shows), on the same machine (`Node.machine`: the ssh_config entry, the hostfile's `ssh`,
the connection), with `CUDA_VISIBLE_DEVICES` in its env naming its one GPU. That env reaches the calibration bench
(calibrate.build_bench_argv) and the rank (launchfiles.build_rank_script, which sets it after mlx.launch's), so
each bench and each rank sees only its own device, as device 0.

Which GPUs: those nvidia-smi lists (the node's facts), in its order, or the ones the node's own
`CUDA_VISIBLE_DEVICES` (inventory `env:`) names, in that order; at most the inventory's `gpus:`. A GPU is named by
its UUID where nvidia-smi gave one: the CUDA runtime's own order of devices (fastest first) need not be
nvidia-smi's (PCI bus order), a UUID is the same device in both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from coordinator.errors import ConfigError
from coordinator.facts.model import NodeFacts
from coordinator.models import Inventory, Node
from coordinator.planning.plan import CurvePoint, NodeCalibration

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class GpuSlot:
    """One GPU a rank node gets: nvidia-smi's `index` (the name's `gpu<i>`) and the `CUDA_VISIBLE_DEVICES` value
    that selects it."""

    index: int
    device: str


def rank_node_name(machine: str, index: int) -> str:
    return f"{machine}/gpu{index}"


def compute_gpu_slots(node: Node, facts: NodeFacts | None) -> list[GpuSlot]:
    """The GPUs `node` may use, in rank order. Empty when it has no NVIDIA GPU in its facts.

    The node's own CUDA_VISIBLE_DEVICES (from the inventory's `env:`) narrows and orders them: entries are
    nvidia-smi indices or UUIDs (`GPU-...`, a prefix as CUDA accepts it); an entry that names no listed GPU is a
    ConfigError (a typo would otherwise silently train on fewer GPUs)."""
    devices = facts.gpu.devices if facts is not None and facts.gpu is not None else ()
    if not devices:
        return []
    listed = [GpuSlot(d.index, d.uuid or str(d.index)) for d in devices]
    wanted = node.env_dict.get(CUDA_VISIBLE_DEVICES)
    if wanted is None:
        slots = listed
    else:
        slots = []
        for entry in (e.strip() for e in wanted.split(",")):
            if not entry:
                continue
            match = next((s for s, d in zip(listed, devices, strict=True)
                          if entry == str(d.index) or (d.uuid and d.uuid.startswith(entry) and entry.startswith("GPU-"))),
                         None)
            if match is None:
                raise ConfigError(f"node {node.name}: CUDA_VISIBLE_DEVICES={wanted} names {entry!r}, which is none of "
                                  f"its GPUs ({', '.join(str(d.index) for d in devices)})", path=node.source)
            if match not in slots:
                slots.append(match)
    return slots[:node.gpus] if node.gpus is not None else slots


def split_by_gpu(backend: str, facts: Mapping[str, NodeFacts], nodes: Sequence[Node]) -> bool:
    """Whether the job runs one rank per GPU: with `nccl`, or `auto` where every node has an NVIDIA GPU (what
    `hostfile.resolve_backend` picks then). Other backends keep one rank per node (ring, jaccl: a Mac's GPU is one
    device)."""
    if backend == "nccl":
        return True
    if backend != "auto" or not nodes:
        return False
    return all((f := facts.get(n.name)) is not None and f.gpu is not None and f.gpu.cuda for n in nodes)


def build_rank_nodes(inv: Inventory, backend: str, facts: Mapping[str, NodeFacts]) -> Inventory:
    """The inventory as the job runs it: every node that uses two or more GPUs replaced, in place (rank order =
    inventory order, then GPU order), by its rank nodes; every other node as it is. An inventory with no such node
    is returned unchanged (the same object). ConfigError from `compute_gpu_slots`."""
    if not split_by_gpu(backend, facts, inv.nodes):
        return inv
    out: list[Node] = []
    for node in inv.nodes:
        slots = compute_gpu_slots(node, facts.get(node.name))
        if len(slots) < 2:
            if len(slots) == 1 and (node.gpus is not None or CUDA_VISIBLE_DEVICES in node.env_dict):
                # One GPU chosen by the inventory: the rank gets exactly that one (mlx.launch's would be 0).
                out.append(replace(node, env=_with_device(node, slots[0].device)))
            else:
                out.append(node)
            continue
        for slot in slots:
            out.append(replace(node, name=rank_node_name(node.name, slot.index), machine=node.name, gpu=slot.index,
                               env=_with_device(node, slot.device)))
    if len(out) == len(inv.nodes) and all(a is b for a, b in zip(out, inv.nodes, strict=True)):
        return inv
    return Inventory(tuple(out), inv.path)


def rank_facts(facts: Mapping[str, NodeFacts], nodes: Sequence[Node]) -> dict[str, NodeFacts]:
    """`facts` with an entry for every rank node: its machine's facts (the GPU fingerprint, software, paths)."""
    out = dict(facts)
    for node in nodes:
        if node.machine is not None and node.machine in facts:
            out[node.name] = facts[node.machine]
    return out


def _with_device(node: Node, device: str) -> tuple[tuple[str, str], ...]:
    return (*((k, v) for k, v in node.env if k != CUDA_VISIBLE_DEVICES), (CUDA_VISIBLE_DEVICES, device))


def rank_node_from_name(inv: Inventory, name: str) -> Node | None:
    """The rank node `machine/gpu<i>` of `inv` from its name alone (a run's meta.json names its ranks, `attach` and
    `stop` read it): GPU <i> by its nvidia-smi index. None when `name` is no rank node of an inventory node."""
    machine, sep, gpu = name.rpartition("/gpu")
    if not sep or not gpu.isdigit():
        return None
    node = next((n for n in inv.nodes if n.name == machine), None)
    if node is None:
        return None
    return replace(node, name=name, machine=machine, gpu=int(gpu), env=_with_device(node, gpu))


def pool_identical_gpus(cals: Mapping[str, NodeCalibration], nodes: Sequence[Node],
                        facts: Mapping[str, NodeFacts]) -> dict[str, NodeCalibration]:
    """Rank nodes of one machine whose GPUs are the same model (nvidia-smi's name and memory) share ONE curve: at
    every batch all of them measured, the mean of their rates and the largest peak; their memory limit the
    smallest. Same silicon, same software, same machine: what differs between their curves is measurement noise
    (a bench of a few steps, taken while the other GPUs' benches run), and a plan split by noise gives two
    identical H100s 62.5% / 37.5% (seen on the lent 2x H100). A GPU that really is slower shows as a straggler
    in the run. Others (other machines, other GPU models, no GPU) are returned as they are."""
    groups: dict[tuple[str, str, int | None], list[str]] = {}
    for node in nodes:
        if node.machine is None or node.gpu is None or node.name not in cals:
            continue
        f = facts.get(node.name)
        device = next((d for d in (f.gpu.devices if f is not None and f.gpu is not None else ())
                       if d.index == node.gpu), None)
        if device is None:
            continue
        groups.setdefault((node.machine, device.name, device.memory_total_bytes), []).append(node.name)
    out = dict(cals)
    for names in groups.values():
        if len(names) < 2:
            continue
        members = [cals[n] for n in names]
        batches = sorted(set.intersection(*({p.batch for p in c.curve} for c in members)))
        if not batches:
            continue
        points = tuple(CurvePoint(b, sum(p.tokens_per_s for c in members for p in c.curve if p.batch == b)
                                  / len(members),
                                  max(p.peak_memory for c in members for p in c.curve if p.batch == b))
                       for b in batches)
        limits = [c.memory_limit for c in members if c.memory_limit is not None]
        for name in names:
            out[name] = replace(cals[name], curve=points, memory_limit=min(limits) if limits else None,
                                noisy=tuple(sorted({b for c in members for b in c.noisy if b in batches})))
    return out
