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
