"""The pure builders behind `coordinator launch`: rank script, launcher argv, ssh config, run config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.config.playbook import load_playbook
from coordinator.models import Connection, Node
from coordinator.run.chaos import KINDS, Chaos
from coordinator.run.launch import spawn_launcher
from coordinator.run.launchfiles import RankPlan, build_launcher_argv, build_rank_script, build_run_config, build_ssh_config
from worker.runconfig import Layout, parse_run_config

PLAYBOOKS = sorted((Path(__file__).resolve().parents[2] / "playbooks").glob("*.yaml"))


def run_script(script: str, rank: int, tmp: Path, env: dict[str, str] | None = None) -> str:
    """Run the rank script with `exec python` replaced by printing the environment and cwd."""
    path = tmp / "rank"
    path.write_text(script.replace("exec ", "env; pwd; echo RAN ", 1).replace("exec ", "env; pwd; echo RAN "))
    out = subprocess.run(["sh", str(path)], capture_output=True, text=True, cwd=tmp,
                         env={"PATH": os.environ["PATH"], "MLX_RANK": str(rank), **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_rank_script_picks_each_rank_its_dir_python_and_env(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b space"
    a.mkdir(), b.mkdir()
    script = build_rank_script("r1", [(0, str(a), "/usr/bin/python3", "/w/a"), (1, str(b), "/opt/py", "/w/b")],
                               {0: {"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": "s3cr$t 'x'"}, 1: {"X": "1"}})
    out0 = run_script(script, 0, tmp_path)
    assert "HF_TOKEN=s3cr$t 'x'" in out0 and "TOKENIZERS_PARALLELISM=false" in out0
    assert f"\n{a}\n" in out0 and "PYTHONPATH=/w/a" in out0
    out1 = run_script(script, 1, tmp_path)
    assert "X=1" in out1 and "HF_TOKEN" not in out1 and f"\n{b}\n" in out1
    bad = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={"MLX_RANK": "7", "PATH": "/bin"})
    assert bad.returncode == 98 and "unexpected MLX_RANK=7" in bad.stderr


def test_rank_script_moves_the_hostfile_and_unsets_an_empty_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    hostfile = tmp_path / "tmp.hf"
    hostfile.write_text('[["10.0.0.1:5000"],["10.0.0.2:5001"]]')
    script = build_rank_script("r1", [(0, str(run), "/usr/bin/python3", "/w")])
    out = run_script(script, 0, tmp_path, {"MLX_HOSTFILE": str(hostfile)})
    assert f"MLX_HOSTFILE={run}/MLX_HOSTFILE.rank0" in out and not hostfile.exists()
    empty = tmp_path / "tmp.empty"
    empty.write_text("\n")  # what mlx.launch writes for a one-host ring
    out = run_script(script, 0, tmp_path, {"MLX_HOSTFILE": str(empty)})
    assert "MLX_HOSTFILE" not in out and not empty.exists()


def test_launcher_argv_carries_no_env_values() -> None:
    argv = build_launcher_argv(Path("/r/hostfile.json"), "ring", "/tmp/mlxc-r1", 40000, {})
    assert "--env" not in argv and argv[-1] == "rank"
    assert argv[argv.index("--python") + 1] == "/bin/sh" and argv[argv.index("--cwd") + 1] == "/tmp/mlxc-r1"


def test_launcher_argv_gives_nccl_the_runs_port() -> None:
    """mlx.launch's --nccl-port defaults to 12345 for every job: two concurrent nccl jobs would collide."""
    argv = build_launcher_argv(Path("/r/hostfile.json"), "nccl", "/tmp/mlxc-r1", 40000, {})
    assert argv[argv.index("--nccl-port") + 1] == "40000" and argv[argv.index("--backend") + 1] == "nccl"
    assert "--nccl-port" not in build_launcher_argv(Path("/r/h.json"), "ring", "/tmp/mlxc-r1", 40000, {})


def test_ssh_config_carries_the_inventory_credentials_and_strict_keys() -> None:
    nodes = [Node(name="ultra", host="10.0.0.1", user="mlx", port=2222, identity="/k/id", known_hosts="/k/kh"),
             Node(name="here", host="127.0.0.1", connection=Connection.LOCAL)]
    text = build_ssh_config(nodes)
    block = text.split("Host ultra", 1)[1]
    for line in ("HostName 10.0.0.1", "User mlx", "Port 2222", "IdentityFile /k/id", "UserKnownHostsFile /k/kh",
                 "StrictHostKeyChecking yes", "BatchMode yes"):
        assert line in block
    assert "Host here" not in text  # local nodes never go through ssh


def test_the_launcher_stdin_is_open_and_idle_until_closed(tmp_path: Path) -> None:
    # mlx.launch select()s on its stdin to forward input: it must block (not see EOF, which made it spin a core)
    # while the run goes on, and see EOF once the coordinator closes its end.
    probe = ("import select, sys\n"
             "r, _, _ = select.select([sys.stdin], [], [], 0.3)\n"
             "print('readable' if r else 'idle', flush=True)\n"
             "print(repr(sys.stdin.buffer.read()), flush=True)\n")
    log = tmp_path / "launcher.log"
    proc, keep_open = spawn_launcher([sys.executable, "-c", probe], log, dict(os.environ))
    try:
        for _ in range(200):  # until the child's select() has returned (closing earlier would race it)
            if log.read_text():
                break
            time.sleep(0.05)
    finally:
        os.close(keep_open)
    assert proc.wait(timeout=30) == 0
    assert log.read_text().splitlines() == ["idle", "b''"]


def test_the_launcher_waits_for_its_ranks_without_spinning(tmp_path: Path) -> None:
    # The real mlx.launch (a local rank: no SSH) running a rank that sleeps: unpatched, its per-rank thread
    # select()s the always-writable stdin pipe of the rank and burns a core the whole time.
    (tmp_path / "rank").write_text("echo hello-from-rank\nsleep 1.5\n")
    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]')
    argv = build_launcher_argv(hostfile, "ring", str(tmp_path), 23456, {})
    started = time.monotonic()
    proc, keep_open = spawn_launcher(argv, tmp_path / "launcher.log", dict(os.environ))
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        os.close(keep_open)
    wall = time.monotonic() - started
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "launcher.log").read_text() == "hello-from-rank\n"
    assert usage.ru_utime + usage.ru_stime < 0.5 * wall  # a spinning loop uses ~1 s of CPU per second


def test_every_playbook_is_covered_by_the_run_config_round_trip() -> None:
    """Every playbook in playbooks/ is a training run (round-tripped below) or a map run (no run.json)."""
    kinds = {p.name: load_playbook(p).kind for p in PLAYBOOKS}
    assert set(kinds.values()) <= {"train", "map"} and "train" in kinds.values()


@pytest.mark.parametrize("path", PLAYBOOKS, ids=lambda p: p.name)
def test_run_config_of_every_playbook_is_what_the_worker_parses(path: Path) -> None:
    """build_run_config's RunConfig, written as run.json for a node, reads back through the worker's own parser
    as the same record: one contract for writer and reader (with every chaos kind, a resume and a fence)."""
    pb = load_playbook(path)
    if pb.kind != "train":
        return  # a map run's nodes get worker.mapper's config, not a run.json
    nodes = [Node(name="mac", host="10.0.0.1"), Node(name="lin", host="127.0.0.1", connection=Connection.LOCAL)]
    ranks = [RankPlan(0, nodes[0], 3), RankPlan(1, nodes[0], 2), RankPlan(2, nodes[1], 1)]
    chaos = [Chaos(kind=k, rank=i % 3, step=i + 1, factor=2.0) for i, k in enumerate(KINDS)]
    for resume, scratch, drills, layout in ((False, False, [], None), (True, True, chaos, Layout(kind="fsdp"))):
        config = build_run_config(pb, ranks, "r-1", resume=resume, chaos=drills, restart_from_scratch=scratch,
                                  layout=layout)
        assert config.layout == (layout or Layout())
        written = replace(config, run_dir=Path("~/mlx-work/runs/r-1/mac")).to_json()
        parsed = parse_run_config(json.loads(json.dumps(written)))
        expanded = replace(config, model=os.path.expanduser(config.model), data=os.path.expanduser(config.data),
                           run_dir=Path(os.path.expanduser("~/mlx-work/runs/r-1/mac")),
                           dpo=replace(config.dpo, reference=os.path.expanduser(config.dpo.reference)
                                       if config.dpo.reference else None))
        assert parsed == expanded
        assert parsed.to_json() == {**written, "model": expanded.model, "data": expanded.data,
                                    "run_dir": str(expanded.run_dir), **({"dpo": parsed.to_json()["dpo"]}
                                                                         if "dpo" in written else {})}
        assert (parsed.resume, parsed.restart_from_scratch, len(parsed.chaos)) == (resume, scratch, len(drills))
        assert parsed.fence is not None if pb.faults.fence else parsed.fence is None
        assert parsed.digest() == expanded.digest()


def test_chaos_spec_parses_into_the_workers_record() -> None:
    """One record for a planned fault: `--chaos` parses into worker.runconfig.ChaosSpec, as run.json carries it."""
    from coordinator.errors import ConfigError
    from coordinator.run.chaos import parse_chaos
    from worker.runconfig import ChaosSpec

    assert parse_chaos("slow:rank=1,factor=3", world_size=2) == ChaosSpec(kind="slow", rank=1, step=1, factor=3.0)
    with pytest.raises(ConfigError, match="not a rank of this job"):
        parse_chaos("kill:rank=2", world_size=2)


def test_train_memory_headroom_reaches_the_ranks_run_json_and_defaults_to_the_workers() -> None:
    from worker.runconfig import DEFAULT_HEADROOM, ConfigError

    ranks = [RankPlan(0, Node(name="mac", host="10.0.0.1"), 2)]
    plain = load_playbook(PLAYBOOKS[0])
    assert plain.train.memory_headroom == DEFAULT_HEADROOM
    assert build_run_config(plain, ranks, "r-1", resume=False).memory_headroom == DEFAULT_HEADROOM
    for value in (None, 0.25):
        pb = plain.model_copy(update={"train": plain.train.model_copy(update={"memory_headroom": value})})
        config = build_run_config(pb, ranks, "r-1", resume=False)
        assert parse_run_config(json.loads(json.dumps(config.to_json()))).memory_headroom == value
        assert config.digest() == build_run_config(plain, ranks, "r-1", resume=False).digest()  # not the math
    with pytest.raises(ConfigError, match="memory_headroom"):
        parse_run_config({**build_run_config(plain, ranks, "r-1", resume=False).to_json(), "run_dir": "/r",
                          "memory_headroom": -0.5})


@pytest.mark.parametrize(("spec", "message"), [
    ("kill:rank=0,step=11", "--chaos 'kill:rank=0,step=11': step 11 is never reached: the run trains 10 step(s) "
                            "(train.iters); the drill would run without its fault"),
    ("slow:rank=0,step=11,factor=2", "step 11 is never reached"),
    ("kill:rank=0,step=3,factor=2", "factor applies to slow only (a kill has none)"),
])
def test_a_chaos_drill_that_cannot_fire_is_refused(spec: str, message: str) -> None:
    from coordinator.errors import ConfigError
    from coordinator.run.chaos import parse_chaos

    with pytest.raises(ConfigError) as info:
        parse_chaos(spec, world_size=2, iters=10)
    assert message in str(info.value)
    assert parse_chaos("stall:rank=1,step=10", world_size=2, iters=10).step == 10  # the last step is reached


@pytest.mark.parametrize(("spec", "bounds", "reason"), [
    (Chaos("kill", 2, 5), {"world_size": 2}, "rank 2 is not a rank of this run (ranks 0..1)"),
    (Chaos("kill", 1, 5), {"world_size": 2, "iters": 5}, None),
    (Chaos("nan", 0, 5), {"after_step": 5}, "step 5 is never reached: this attempt resumes after step 5 "
                                            "(a nan acts at its step only)"),
    (Chaos("hang", 0, 6), {"after_step": 5}, None),
    # slow and lie act from their step on: a resume past it still runs them
    (Chaos("slow", 0, 1, 3.0), {"after_step": 40, "iters": 100}, None),
    (Chaos("lie", 0, 10), {"after_step": 40}, None),
])
def test_compute_unreachable(spec: Chaos, bounds: dict[str, int], reason: str | None) -> None:
    from coordinator.run.chaos import compute_unreachable

    assert compute_unreachable(spec, **bounds) == reason


def test_train_clear_cache_reaches_the_ranks_run_json() -> None:
    pb = load_playbook(PLAYBOOKS[0])
    pb = pb.model_copy(update={"train": pb.train.model_copy(update={"clear_cache": True})})
    ranks = [RankPlan(0, Node(name="mac", host="10.0.0.1"), 2)]
    config = build_run_config(pb, ranks, "r-1", resume=False)
    assert config.clear_cache is True
    assert parse_run_config(json.loads(json.dumps(config.to_json()))).clear_cache is True
    assert config.digest() == build_run_config(load_playbook(PLAYBOOKS[0]), ranks, "r-1", resume=False).digest()


def test_a_pipeline_plan_is_the_layout_the_worker_parses() -> None:
    """The planner's pipeline (planning.pipeline) becomes run.json's layout: one stage per rank in ring order,
    contiguous blocks, every rank the global batch, the micro-batches and schedule; the worker parses it back."""
    from coordinator.config.playbook import parse_playbook
    from coordinator.planning.estimate import GiB, ModelShape
    from coordinator.planning.pipeline import LayerTiming, PipelineJob, StageNode, compute_layer_split
    from coordinator.run.launchfiles import build_layout
    from worker.runconfig import Layout, StageSpec

    shape = ModelShape(params=1_000_000_000, hidden=2048, layers=12, vocab=32000, intermediate=8192, heads=16)
    job = PipelineJob(shape, "full", seq_len=512, global_batch=8, micro_batches=4)
    nodes = [StageNode(n, 1000 * GiB, LayerTiming(n, 2, s)) for n, s in (("a", 1.0), ("b", 1.0), ("c", 2.0))]
    pipe = compute_layer_split(job, nodes)
    assert build_layout(None) == Layout()
    layout = build_layout(pipe)
    assert layout == Layout("pipeline", (StageSpec(0, 0, 5), StageSpec(1, 5, 10), StageSpec(2, 10, 12)), 4, "1f1b")
    pb = parse_playbook({"name": "p", "model": "/m", "data": "/d", "train": {
        "method": "full", "strategy": "pipeline", "batch_size": 8, "micro_batches": 4}}, path="p.yaml")
    plan = pipe.as_plan()
    assert plan.batch == {"a": 8, "b": 8, "c": 8} and plan.mode == "pipeline"
    ranks = [RankPlan(i, Node(name=n, host=f"10.0.0.{i + 1}"), plan.batch[n]) for i, n in enumerate(plan.batch)]
    config = build_run_config(pb, ranks, "r-1", resume=False, layout=layout)
    parsed = parse_run_config(json.loads(json.dumps(replace(config, run_dir=Path("/w/r-1/a")).to_json())))
    assert parsed.layout == layout
