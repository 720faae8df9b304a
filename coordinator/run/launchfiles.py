"""The pure half of `coordinator launch`: run ids, each rank's plan, and every file and argv the launch writes or
runs (run.json, the rank script, ssh_config and its wrapper, the launcher's argv, a node's teardown). No I/O;
`coordinator/run/launch.py` writes and runs them."""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from coordinator.config.playbook import Playbook
from coordinator.config.yamlsrc import NAME_PATTERN
from coordinator.errors import ConfigError
from coordinator.facts.probe import pythonpath_prepend, shell_path
from coordinator.models import Connection, Inventory, Node
from coordinator.planning.pipeline import PipelinePlan
from coordinator.run.chaos import Chaos
from worker.runconfig import DpoSpec, Layout, LoraSpec, RankSpec, RunConfig, StageSpec

# mlx.launch's main(), with one fix. Its per-rank threads select() the rank process's stdin pipe for WRITING even
# when there is nothing to send, and a pipe is always writable: every thread (and, with stdin at EOF, the main
# loop) spins a core for the whole run, on the coordinator's machine, which often trains too. The coordinator
# never sends input to the ranks, so the selects wait on the outputs alone.
MLX_LAUNCH = (
    "import select, sys\n"
    "import mlx._distributed_utils.launch as launch\n"
    "_select = select.select\n"
    "launch.select = lambda r, w, x, t=None: (_select(r, [], x, t)[0], [], [])\n"
    "sys.argv[0] = 'mlx.launch'\n"
    "sys.exit(launch.main())\n"
)


FENCE_OVER_STALL = 3.0  # a rank fences itself (worker.events.Fence) after this many monitor stall windows


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: Node
    batch_size: int
    calibrated_tokens_per_s: float | None = None


def new_run_id(name: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


# A run id is a path component on both sides and part of the temp dir's name, `mlxc-<run id>-<16 hex>`: at
# most 255 bytes in all. A new one is the playbook name (<= yamlsrc.MAX_NAME_LENGTH) plus 21 characters.
MAX_RUN_ID_LENGTH = 255 - len("mlxc-") - 1 - 16


def check_run_id(run_id: str, *, what: str = "run id") -> str:
    """A run id given by a user (`--resume RUN_ID`): ConfigError unless it could be one of ours. It becomes a
    path component here and on every node, and part of shell lines there."""
    if not NAME_PATTERN.fullmatch(run_id) or run_id in (".", ".."):
        raise ConfigError(f"{what} {run_id!r}: not a run id (letters, digits, '_', '.' and '-', as in "
                          "runs/<run id>/)")
    if len(run_id) > MAX_RUN_ID_LENGTH:
        raise ConfigError(f"{what}: a run id of {len(run_id)} characters; at most {MAX_RUN_ID_LENGTH} (it is part "
                          "of file names, which are limited to 255 bytes)")
    return run_id


def node_run_dir(node: Node, run_id: str) -> str:
    """The node's own dir for a run. The node name is part of it so that nodes sharing a filesystem (local
    nodes, an NFS home) never write into each other's checkpoints."""
    return f"{node.workdir.rstrip('/')}/runs/{run_id}/{node.name}"


TMP_PREFIX = "/tmp/mlxc-"


def remote_tmp_dir(run_id: str, token: str) -> str:
    """An attempt's temp dir (the rank script), the same path on every node: mlx.launch has ONE --cwd and ONE
    command for all ranks, so it cannot be each node's own mkdtemp. `token` is a fresh random per attempt: nobody
    can create the path before the attempt does, and `worker.privatedir` refuses it unless it is a 0700 dir of
    the SSH user (docs/faults.md, "Temp dirs")."""
    return f"{TMP_PREFIX}{run_id}-{token}"


def build_rank_teardown(run_dir: str, run_id: str, pids: Sequence[int]) -> str:
    """sh: end whatever of the run is left on a node, then remove its temp dirs.

    Ranks are found by the run.json path in their command line, and by the PIDs they reported in `started` (a rank
    whose command line hides it). A reported PID is signalled only while its command line still names this run's
    dir: ranks that exited long ago leave PIDs the kernel hands to other processes (Linux's pid_max is often 32768),
    and a teardown must never signal a stranger. SIGCONT first: a stopped (SIGSTOP) rank ignores SIGTERM until
    continued. `run.jso[n]`: the regex still matches the ranks' `run.json`, but not this script's own command line."""
    config = shlex.quote(f"{run_dir}/run.jso[n]")
    follower = shlex.quote(f"worker.follo[w] --run-dir {run_dir}( |$)")  # the coordinator's channel is closed
    ours = shlex.quote(f"{run_dir}/")
    listed = " ".join(str(int(p)) for p in pids)
    by_pid = (f'ours() {{ ps -ww -o command= -p "$1" 2>/dev/null | grep -qF -- {ours}; }}; '
              f'sig_ours() {{ for p in {listed}; do ours "$p" && kill "$@" "$p"; done 2>/dev/null; }}; ') if listed else ""
    return (by_pid + ("sig_ours -CONT; sig_ours -TERM; " if listed else "")
            + f"pkill -CONT -f {config}; pkill -TERM -f {config}; sleep 1; "
            + ("sig_ours -KILL; " if listed else "")
            + f"pkill -KILL -f {config}; pkill -f {follower}; {build_tmp_cleanup(run_id)}; exit 0")


def build_tmp_cleanup(run_id: str) -> str:
    """sh: remove the run's temp dirs on a node, of every attempt (a coordinator that died leaves its own):
    only real directories owned by the SSH user, never another user's dir that merely matches the name."""
    parent, prefix = TMP_PREFIX.rsplit("/", 1)
    return (f"find {shlex.quote(parent + '/')} -maxdepth 1 -type d -name {shlex.quote(prefix + run_id + '-*')} "
            '-user "$(id -u)" -exec rm -rf {} + 2>/dev/null')


def build_layout(plan: PipelinePlan | None) -> Layout:
    """The worker's `RunConfig.layout`: dp (None), or the pipeline's stages (rank i = stage i: ring order)."""
    if plan is None:
        return Layout()
    return Layout(kind="pipeline", stages=tuple(StageSpec(i, s.first_layer, s.last_layer)
                                                for i, s in enumerate(plan.stages)),
                  micro_batches=plan.micro_batches, schedule=plan.schedule)


def build_run_config(pb: Playbook, ranks: Sequence[RankPlan], run_id: str, *, resume: bool,
                     chaos: Sequence[Chaos] = (), restart_from_scratch: bool = False,
                     layout: Layout | None = None, cpu_shares: Mapping[int, tuple[int, int]] | None = None,
                     token_census: int = 0) -> RunConfig:
    """The worker's run config (identical on every node; each rank finds its node's run dir by its rank): the
    worker's own record (worker.runconfig), so what the coordinator writes is what the worker parses.
    `run_dir` is left empty (Path()): the same file cannot name two nodes' dirs, `prepare` fills it per node.
    `layout`: how the ranks share the work (`build_layout`; dp when None). `cpu_shares`: the ranks that share a CPU
    machine and their slices of it (`colocate.cpu_shares`). `token_census`: a rehearsal's, the run's steps whose
    median real tokens rank 0 reports (planning/steptime.py)."""
    t = pb.train
    if pb.data is None:  # the playbook's validator requires it for kind train; a programming error otherwise
        raise ConfigError(f"playbook {pb.name!r} has no data directory: a training run needs one")
    return RunConfig(
        run_id=run_id, model=pb.model, data=pb.data, method=t.method, iters=t.iters,
        learning_rate=t.learning_rate, optimizer=t.optimizer, max_seq_length=t.max_seq_length,
        grad_accumulation=t.grad_accumulation, grad_checkpoint=t.grad_checkpoint, packing=t.packing, clear_cache=t.clear_cache,
        memory_headroom=t.memory_headroom,
        train_embeddings=t.train_embeddings, num_layers=t.num_layers,
        lora=LoraSpec(rank=t.lora.rank, scale=t.lora.scale, dropout=t.lora.dropout),
        dpo=DpoSpec(beta=t.dpo.beta, reference=t.dpo.reference, fine_tune_type=t.dpo.fine_tune_type)
        if t.method == "dpo" else DpoSpec(),
        save_every=t.save_every, steps_per_eval=t.steps_per_eval, val_batches=t.val_batches, seed=t.seed,
        keep_checkpoints=t.keep_checkpoints,
        ranks=tuple(RankSpec(rank=r.rank, node=r.node.name, batch_size=r.batch_size) for r in ranks),
        run_dir=Path(), resume=resume, restart_from_scratch=restart_from_scratch, heartbeat_s=1.0,
        consistency_every=pb.faults.consistency_every,
        # The node-side backstop for a stall nobody can stop: three times the monitor's stall window.
        fence=(FENCE_OVER_STALL * pb.faults.stall_factor,
               FENCE_OVER_STALL * max(pb.faults.stall_min_s, pb.heartbeat_timeout + 1.0)) if pb.faults.fence else None,
        chaos=tuple(chaos),
        layout=layout or Layout(),  # dp, a pipeline's stages (build_layout) or fsdp (preflight.pipeline.resolve_strategy)
        cpu_shares=dict(cpu_shares or {}),
        token_census=token_census,
    )


def build_rank_script(run_id: str, entries: Sequence[tuple[int, str, str, str]],
                      env: Mapping[int, Mapping[str, str]] | None = None) -> str:
    """/tmp/mlxc-<run>-<token>/rank: (rank, node run dir, python, worker dir) for every rank, plus each rank's node
    `env` from the inventory (mlx.launch's --env is global). mlx.launch runs `sh rank` for every rank with
    MLX_RANK set; the script picks that rank's python, dir and environment."""
    lines = [
        "#!/bin/sh",
        f"# mlx-coordinator run {run_id}: started by mlx.launch as `sh rank` on every rank",
        # mlx.launch leaves temp files on every host: its pidfile (holding this shell's PID: bash exec'ed us)
        # and the MLX_HOSTFILE / MLX_IBV_DEVICES files. Delete the first, move the others into the run dir.
        'for f in "${TMPDIR:-/tmp}"/tmp.*; do [ -f "$f" ] && [ "$(cat "$f" 2>/dev/null)" = "$$" ] && rm -f "$f"; done',
        'case "$MLX_RANK" in',
    ]
    for rank, run_dir, python, worker_dir in entries:
        lines += [
            f"{rank})",
            f"  cd {shell_path(run_dir)} || exit 97",
            # A one-host ring gets an EMPTY hostfile from mlx.launch, which mx.distributed.init cannot parse:
            # unset it (a world of one needs none).
            '  for v in MLX_HOSTFILE MLX_IBV_DEVICES; do eval "f=\\${$v:-}"; '
            'if [ -n "$f" ] && [ -f "$f" ]; then if grep -q "[^[:space:]]" "$f"; then '
            'mv "$f" "./$v.rank$MLX_RANK" && export "$v=$PWD/$v.rank$MLX_RANK"; else rm -f "$f"; unset "$v"; fi; fi; done',
            *(f"  {k}={shlex.quote(v)}; export {k}" for k, v in sorted((env or {}).get(rank, {}).items())),
            f"  {pythonpath_prepend(shell_path(worker_dir))}",
            f"  exec {shell_path(python)} -m worker.train --config {shell_path(run_dir)}/run.json",
            "  ;;",
        ]
    lines += ['*) echo "mlx-coordinator: unexpected MLX_RANK=$MLX_RANK" >&2; exit 98 ;;', "esac", ""]
    return "\n".join(lines)


def build_ssh_config(nodes: Sequence[Node], *, connect_timeout: float = 5.0) -> str:
    """An ssh_config making the plain `ssh` that mlx.launch runs use the inventory's credentials and the same
    host-key policy as the control plane (strict: never prompt, never accept a changed key)."""
    out = ["# written by mlx-coordinator for mlx.launch", ""]
    seen: set[str] = set()
    for node in nodes:
        # Rank nodes of one machine (one per GPU) share its entry: the hostfile's `ssh` is the machine's name.
        if node.connection is Connection.LOCAL or node.machine_name in seen:
            continue
        seen.add(node.machine_name)
        out.append(f"Host {node.machine_name}")
        out.append(f"  HostName {node.host}")
        if node.user:
            out.append(f"  User {node.user}")
        if node.port:
            out.append(f"  Port {node.port}")
        if node.identity:
            out.append(f"  IdentityFile {os.path.expanduser(node.identity)}")
            out.append("  IdentitiesOnly yes")
        out.append(f"  UserKnownHostsFile {os.path.expanduser(node.known_hosts or '~/.ssh/known_hosts')}")
        out += ["  StrictHostKeyChecking yes", "  BatchMode yes", f"  ConnectTimeout {max(1, int(connect_timeout))}",
                "  ServerAliveInterval 2", "  ServerAliveCountMax 3", ""]
    # `ssh -F` skips the user's own config: include it after ours (the first value ssh obtains wins, so the
    # inventory's settings above take precedence; aliases, ProxyJump and agents from ~/.ssh/config still apply).
    user_config = os.path.expanduser("~/.ssh/config")
    if os.path.exists(user_config):
        out += ["Host *", f"  Include {user_config}", ""]
    return "\n".join(out)


def build_ssh_wrapper(ssh_config: Path, real_ssh: str) -> str:
    return f"#!/bin/sh\nexec {shlex.quote(real_ssh)} -F {shlex.quote(str(ssh_config))} \"$@\"\n"


def build_launcher_argv(hostfile: Path, backend: str, cwd: str, port: int, env: Mapping[str, str]) -> list[str]:
    argv = [sys.executable, "-c", MLX_LAUNCH, "--hostfile", str(hostfile), "--backend", backend,
            "--cwd", cwd, "--starting-port", str(port), "--python", "/bin/sh"]
    if backend == "nccl":
        argv += ["--nccl-port", str(port)]  # mlx.launch's default (12345) would collide between concurrent jobs
    for key, value in sorted(env.items()):
        argv += ["--env", f"{key}={value}"]
    return [*argv, "rank"]


def plan_ranks(inventory: Inventory, batches: Mapping[str, int], rates: Mapping[str, float] | None = None) -> list[RankPlan]:
    """One rank per node, in inventory order (= hostfile order = rank order)."""
    ranks = []
    for i, node in enumerate(inventory.nodes):
        if node.name not in batches:
            raise ConfigError(f"the plan has no batch for node {node.name}")
        ranks.append(RankPlan(i, node, batches[node.name], (rates or {}).get(node.name)))
    return ranks
