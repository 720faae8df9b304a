"""One rank per GPU (coordinator.planning.gpuranks): the rank layout, its hostfile, rank script and ssh_config,
the calibration bench's device, the plan's even split of identical GPUs, and the fleet view over one connection."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from mlx._distributed_utils.common import Hostfile as MlxHostfile

from coordinator.errors import ConfigError
from coordinator.facts.linux import parse_nvidia_smi
from coordinator.facts.model import NodeFacts
from coordinator.fleet.transport import Fleet
from coordinator.models import ConnectInfo, Connection, Inventory, Node
from coordinator.planning.gpuranks import build_rank_nodes, compute_gpu_slots, rank_facts, rank_node_from_name
from coordinator.planning.hostfile import build_hostfile
from coordinator.planning.plan import CurvePoint, NodeCalibration, compute_plan
from coordinator.run.calibrate import BenchSpec, build_bench_argv
from coordinator.run.launchfiles import build_rank_script, build_ssh_config

H100 = "NVIDIA H100 80GB HBM3, GPU-{u}, 81559, 0, 0, 580.159.04, 9.0"


def gpus(count: int, name: str = "box") -> NodeFacts:
    rows = "".join(f"{i}, " + H100.format(u=f"{i}aaa-{name}") + "\n" for i in range(count))
    return NodeFacts(node=name, gpu=parse_nvidia_smi(rows))


BOX = Node(name="box", host="10.0.0.5", user="me", ips=("10.0.0.5",), env=(("HF_HOME", "/data/hf"),))
MAC = Node(name="mac", host="10.0.0.9", ips=("10.0.0.9",))


def test_a_node_with_two_gpus_runs_two_ranks_each_on_its_own_device() -> None:
    inv = Inventory((BOX,), "inv.yaml")
    ranks = build_rank_nodes(inv, "nccl", {"box": gpus(2)})
    assert [n.name for n in ranks.nodes] == ["box/gpu0", "box/gpu1"]
    assert [n.machine for n in ranks.nodes] == ["box", "box"] and [n.gpu for n in ranks.nodes] == [0, 1]
    assert [n.env_dict["CUDA_VISIBLE_DEVICES"] for n in ranks.nodes] == ["GPU-0aaa-box", "GPU-1aaa-box"]
    assert all(n.env_dict["HF_HOME"] == "/data/hf" and n.host == "10.0.0.5" for n in ranks.nodes)
    assert ranks.path == "inv.yaml"


def test_auto_splits_a_cuda_fleet_and_ranks_follow_inventory_then_gpu_order() -> None:
    other = Node(name="one", host="10.0.0.6", ips=("10.0.0.6",))
    ranks = build_rank_nodes(Inventory((BOX, other)), "auto", {"box": gpus(3), "one": gpus(1, "one")})
    assert [n.name for n in ranks.nodes] == ["box/gpu0", "box/gpu1", "box/gpu2", "one"]
    assert ranks.nodes[3] is other  # a one-GPU node keeps its name, env and mlx.launch's device 0


def test_other_backends_and_gpu_less_fleets_are_left_alone() -> None:
    inv = Inventory((BOX, MAC))
    facts = {"box": gpus(2), "mac": NodeFacts(node="mac")}
    assert build_rank_nodes(inv, "ring", facts) is inv
    assert build_rank_nodes(inv, "auto", facts) is inv  # auto resolves to ring: mac has no NVIDIA GPU
    assert build_rank_nodes(Inventory((MAC,)), "nccl", {"mac": NodeFacts(node="mac")}).nodes == (MAC,)


def test_the_inventory_can_use_fewer_gpus_or_name_them() -> None:
    four = {"box": gpus(4)}
    assert [n.name for n in build_rank_nodes(Inventory((Node(name="box", host="h", gpus=2),)), "nccl",
                                             four).nodes] == ["box/gpu0", "box/gpu1"]
    # gpus: 1 -> one rank on the first GPU, under the node's own name, pinned to that GPU.
    one = build_rank_nodes(Inventory((Node(name="box", host="h", gpus=1),)), "nccl", four).nodes
    assert [n.name for n in one] == ["box"] and one[0].env_dict["CUDA_VISIBLE_DEVICES"] == "GPU-0aaa-box"
    # The node's own CUDA_VISIBLE_DEVICES picks and orders them (indices or UUIDs), then `gpus` caps.
    named = Node(name="box", host="h", env=(("CUDA_VISIBLE_DEVICES", "3,GPU-1aaa"),))
    slots = compute_gpu_slots(named, four["box"])
    assert [(s.index, s.device) for s in slots] == [(3, "GPU-3aaa-box"), (1, "GPU-1aaa-box")]
    assert [n.name for n in build_rank_nodes(Inventory((named,)), "nccl", four).nodes] == ["box/gpu3", "box/gpu1"]
    with pytest.raises(ConfigError, match="names '7'"):
        compute_gpu_slots(Node(name="box", host="h", env=(("CUDA_VISIBLE_DEVICES", "7"),)), four["box"])


def test_rank_facts_and_names_map_back_to_the_machine() -> None:
    facts = {"box": gpus(2)}
    ranks = build_rank_nodes(Inventory((BOX,)), "nccl", facts)
    assert rank_facts(facts, ranks.nodes)["box/gpu1"] is facts["box"]
    back = rank_node_from_name(Inventory((BOX,)), "box/gpu1")
    assert back is not None and (back.machine, back.gpu, back.env_dict["CUDA_VISIBLE_DEVICES"]) == ("box", 1, "1")
    assert rank_node_from_name(Inventory((BOX,)), "other/gpu1") is None
    assert rank_node_from_name(Inventory((BOX,)), "box") is None


def test_hostfile_has_one_entry_per_gpu_on_the_machine_and_mlx_accepts_it(tmp_path: Path) -> None:
    facts = {"box": gpus(2)}
    ranks = build_rank_nodes(Inventory((BOX,)), "auto", facts)
    hf = build_hostfile(ranks.nodes, "auto", rank_facts(facts, ranks.nodes))
    path = tmp_path / "hostfile.json"
    path.write_text(json.dumps(hf.to_json()))
    parsed = MlxHostfile.from_file(path)
    assert parsed.backend == "nccl"  # two ranks now: auto no longer sees "one node"
    assert [(h.ssh_hostname, h.ips) for h in parsed.hosts] == [("box", ["10.0.0.5"]), ("box", ["10.0.0.5"])]
    local = Node(name="gpu", host="127.0.0.1", connection=Connection.LOCAL)
    lr = build_rank_nodes(Inventory((local,)), "nccl", {"gpu": gpus(2, "gpu")})
    assert [h.ssh for h in build_hostfile(lr.nodes, "nccl").hosts] == ["127.0.0.1", "127.0.0.1"]


def test_ssh_config_has_one_entry_per_machine() -> None:
    ranks = build_rank_nodes(Inventory((BOX,)), "nccl", {"box": gpus(2)})
    text = build_ssh_config(ranks.nodes)
    assert text.count("Host box\n") == 1 and "gpu0" not in text and "HostName 10.0.0.5" in text


def test_rank_script_gives_each_rank_its_own_gpu_over_mlx_launchs(tmp_path: Path) -> None:
    """mlx.launch sets CUDA_VISIBLE_DEVICES=0 for both ranks of a hostfile with one host twice; the rank script runs
    after it and sets the rank's own."""
    ranks = build_rank_nodes(Inventory((BOX,)), "nccl", {"box": gpus(2)})
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    for d in dirs:
        d.mkdir()
    script = build_rank_script("run", [(i, str(d), "/bin/sh", str(tmp_path)) for i, d in enumerate(dirs)],
                               {i: n.env_dict for i, n in enumerate(ranks.nodes)})
    # Replace the worker's exec by a print of what the rank would see.
    script = script.replace("exec /bin/sh -m worker.train", 'echo "$CUDA_VISIBLE_DEVICES" #')
    seen = []
    for rank in (0, 1):
        env = {**os.environ, "MLX_RANK": str(rank), "CUDA_VISIBLE_DEVICES": "0"}
        seen.append(subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip())
    assert seen == ["GPU-0aaa-box", "GPU-1aaa-box"]


def test_each_calibration_bench_runs_on_its_own_gpu() -> None:
    ranks = build_rank_nodes(Inventory((BOX,)), "nccl", {"box": gpus(2)})
    spec = BenchSpec(model="/m", seq_len=64, method="lora", env=(("CUDA_VISIBLE_DEVICES", "0"),))
    devices = []
    for node in ranks.nodes:
        argv = build_bench_argv(node, "/w", spec, 10.0)
        devices.append([a for a in argv if a.startswith("CUDA_VISIBLE_DEVICES=")])
    # the node's device wins over a job env that names another
    assert devices == [["CUDA_VISIBLE_DEVICES=GPU-0aaa-box"], ["CUDA_VISIBLE_DEVICES=GPU-1aaa-box"]]


def test_two_identical_gpus_get_an_even_split() -> None:
    curve = (CurvePoint(1, 900.0, 10), CurvePoint(4, 3000.0, 40), CurvePoint(8, 5000.0, 80))
    cals = [NodeCalibration(node=n, curve=curve, matmul_gflops=1.0, memory_limit=None) for n in ("box/gpu0", "box/gpu1")]
    plan = compute_plan(cals, 16, seq_len=512)
    assert plan.batch == {"box/gpu0": 8, "box/gpu1": 8}


class _Transport:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.closed = 0

    async def connect(self) -> ConnectInfo:
        return ConnectInfo(self.node.name, 0.0, 0.0, None)

    async def close(self) -> None:
        self.closed += 1


def test_a_fleet_view_shares_the_machines_connection_and_does_not_close_it() -> None:
    made: list[_Transport] = []

    def factory(node: Node) -> _Transport:
        made.append(_Transport(node))
        return made[-1]

    async def go() -> None:
        fleet = Fleet([BOX], transport_factory=factory)  # type: ignore[arg-type]
        await fleet.connect_all()
        ranks = build_rank_nodes(Inventory((BOX,)), "nccl", {"box": gpus(2)})
        view = fleet.for_ranks(ranks.nodes)
        assert view.transports["box/gpu0"] is view.transports["box/gpu1"] is fleet.transports["box"]
        assert sorted(view.connected) == ["box/gpu0", "box/gpu1"]
        seen = await view.map(lambda node, t: asyncio.sleep(0, result=node.name))  # type: ignore[arg-type,return-value]
        assert seen == {"box/gpu0": "box/gpu0", "box/gpu1": "box/gpu1"}
        await view.reconnect("box/gpu1")  # a fresh connection, for every rank of the machine and its owner
        assert view.transports["box/gpu0"] is view.transports["box/gpu1"] is fleet.transports["box"] is made[-1]
        await view.close()
        assert made[-1].closed == 0
        await fleet.close()
        assert made[-1].closed == 1

    asyncio.run(go())


def test_identical_gpus_of_one_machine_share_one_curve_and_split_evenly() -> None:
    """Seen on the lent 2x H100: benches of a few steps each gave 22.8k and 19.3k tok/s at batch 8 and the plan
    split 62.5% / 37.5%. Same model, same machine: one pooled curve, an even split."""
    from coordinator.planning.gpuranks import pool_identical_gpus

    other = Node(name="one", host="10.0.0.6")
    ranks = build_rank_nodes(Inventory((BOX, other)), "nccl", {"box": gpus(2), "one": gpus(1, "one")})
    facts = rank_facts({"box": gpus(2), "one": gpus(1, "one")}, ranks.nodes)

    def cal(name: str, r4: float, r8: float, limit: int) -> NodeCalibration:
        return NodeCalibration(node=name, curve=(CurvePoint(4, r4, 40), CurvePoint(8, r8, 80 + limit % 7)),
                               matmul_gflops=1.0, memory_limit=limit, noisy=(4,) if r4 > 17000 else ())

    cals = {"box/gpu0": cal("box/gpu0", 17484.4, 22820.4, 1000), "box/gpu1": cal("box/gpu1", 14834.6, 19294.2, 900),
            "one": cal("one", 5000.0, 6000.0, 500)}
    assert compute_plan([cals[n] for n in ("box/gpu0", "box/gpu1")], 8, seq_len=512).batch == {"box/gpu0": 5,
                                                                                                 "box/gpu1": 3}
    pooled = pool_identical_gpus(cals, ranks.nodes, facts)
    assert pooled["box/gpu0"].curve == pooled["box/gpu1"].curve
    assert [p.tokens_per_s for p in pooled["box/gpu0"].curve] == [(17484.4 + 14834.6) / 2, (22820.4 + 19294.2) / 2]
    assert pooled["box/gpu1"].memory_limit == 900 and pooled["box/gpu1"].noisy == (4,)
    assert pooled["one"] is cals["one"]
    plan = compute_plan([pooled[n] for n in ("box/gpu0", "box/gpu1")], 8, seq_len=512)
    assert plan.batch == {"box/gpu0": 4, "box/gpu1": 4}


def test_chaos_ranks_are_checked_against_the_rank_nodes() -> None:
    from coordinator.run.chaos import parse_chaos
    from coordinator.run.job import check_chaos

    kill = parse_chaos("kill:rank=1,step=6", world_size=None)
    check_chaos([kill], 2)  # one node, two GPUs: rank 1 exists
    with pytest.raises(ConfigError, match="rank 1 is not a rank of this job"):
        check_chaos([kill], 1)
