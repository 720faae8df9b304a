"""Checks `ssh`, `os`, `software` and `env`: is the node reachable, recent enough, consistent with its peers."""

from __future__ import annotations

import shlex
from typing import Any

from coordinator.checks.context import CheckContext, fact_error_result
from coordinator.errors import TransportError
from coordinator.facts.model import NodeFacts, version_tuple
from coordinator.models import CheckResult, Connection, Node, Status
from coordinator.probe import shell_path

MIN_MACOS_RING = (14, 0)
MIN_MACOS_JACCL = (26, 2)
MIN_MLX = (0, 32, 1)  # launcher pidfile and ring lost-peer fixes (mlx#3862)

REMOTE_LOGIN = "System Settings > General > Sharing > Remote Login"


def _v(t: tuple[int, ...]) -> str:
    return ".".join(map(str, t))


# --- ssh -----------------------------------------------------------------------------------------------------


def check_ssh(ctx: CheckContext, node: Node) -> CheckResult:
    """Not a facts check: evaluated from the connection attempt alone (runs even when the probe could not)."""
    outcome = ctx.connect.get(node.name)
    if node.connection is Connection.LOCAL:
        rtt = outcome.rtt_ms if outcome is not None and not isinstance(outcome, TransportError) else None
        return CheckResult("ssh", node.name, Status.PASS, "local node: runs on this machine without SSH",
                           evidence={"connection": "local", "rtt_ms": rtt})
    if outcome is None:
        return CheckResult("ssh", node.name, Status.ERROR, "no connection attempt was made",
                           "rerun preflight; if it persists, report it (the node was never connected)")
    if isinstance(outcome, TransportError):
        remedy = {
            "host_key": f"verify the node's fingerprint out of band (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`"
            f" on it); if it was reinstalled: `ssh-keygen -R {shlex.quote(node.host)}`; for a first contact rerun with "
            "--accept-new-host-keys",
            "auth": f"install your key: `ssh-copy-id -i {shell_path(node.identity) if node.identity else '~/.ssh/id_ed25519'} "
            f"{shlex.quote(node.ssh_target)}`, "
            "or fix `user`/`identity` in the inventory",
            "timeout": f"is the node on, awake and on the network? (`pmset -g`; a sleeping Mac does not answer); "
            f"enable {REMOTE_LOGIN}",
            "connect": f"enable {REMOTE_LOGIN} on the node and check the host/port in the inventory",
        }.get(outcome.kind, f"check the node and {REMOTE_LOGIN}")
        return CheckResult("ssh", node.name, Status.FAIL, str(outcome), remedy,
                           evidence={"kind": outcome.kind, "host": node.host, "port": node.port or 22})
    evidence = {
        "target": node.ssh_target,
        "port": node.port or 22,
        "connect_s": round(outcome.connect_s, 4),
        "rtt_ms": round(outcome.rtt_ms, 3),
        "host_key": outcome.host_key,
        "host_key_recorded": outcome.host_key_recorded,
    }
    recorded = " (new key recorded)" if outcome.host_key_recorded else ""
    return CheckResult("ssh", node.name, Status.PASS,
                       f"{node.ssh_target} reachable, host key verified{recorded}, round trip {outcome.rtt_ms:.1f} ms",
                       evidence=evidence)


# --- os ------------------------------------------------------------------------------------------------------


def check_os(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    os_ = facts.os
    if os_ is None:
        return fact_error_result("os", node.name, facts.errors_for("uname", "sw_vers", "os_release"), "the OS")
    evidence: dict[str, Any] = {"system": os_.system, "name": os_.name, "version": os_.version, "build": os_.build,
                "kernel": os_.kernel, "arch": os_.arch}
    backend = ctx.backend
    if not os_.is_macos:
        if backend in ("jaccl", "jaccl-ring"):
            pass  # JACCL over InfiniBand on Linux is possible; the rdma check looks at the devices.
        return CheckResult("os", node.name, Status.PASS, f"{os_.name} ({os_.kernel}, {os_.arch})", evidence=evidence)
    if os_.arch != "arm64":
        return CheckResult("os", node.name, Status.FAIL, f"macOS on {os_.arch}: MLX needs Apple silicon (arm64)",
                           "use an Apple silicon Mac; under Rosetta, run the node's python natively", evidence)
    version = os_.version_tuple()
    if version < MIN_MACOS_RING:
        return CheckResult("os", node.name, Status.FAIL, f"macOS {os_.version} is older than {_v(MIN_MACOS_RING)}",
                           "update macOS (System Settings > General > Software Update)", evidence)
    if version < MIN_MACOS_JACCL and backend in ("jaccl", "jaccl-ring"):
        return CheckResult("os", node.name, Status.FAIL,
                           f"macOS {os_.version}: RDMA over Thunderbolt ({backend}) needs macOS {_v(MIN_MACOS_JACCL)}+",
                           "update macOS to 26.2 or later, or use `backend: ring`", evidence)
    builds = ctx.macos_builds
    if len(set(builds.values())) > 1:
        evidence["builds"] = builds
        return CheckResult("os", node.name, Status.WARN,
                           f"macOS {os_.version} ({os_.build}); nodes run different builds: "
                           + ", ".join(f"{n}={b}" for n, b in sorted(builds.items())),
                           "update every node to the same macOS build (kernel and Metal differences)", evidence)
    if version < MIN_MACOS_JACCL and backend == "auto":
        return CheckResult("os", node.name, Status.WARN,
                           f"macOS {os_.version} ({os_.build}): no RDMA before {_v(MIN_MACOS_JACCL)}; auto uses ring",
                           "update macOS to 26.2+ for RDMA over Thunderbolt", evidence)
    return CheckResult("os", node.name, Status.PASS, f"macOS {os_.version} ({os_.build}) on arm64", evidence=evidence)


# --- software ------------------------------------------------------------------------------------------------

INSTALL = 'python3 -m venv ~/venvs/mlx && ~/venvs/mlx/bin/pip install "mlx>=0.32.1" mlx-lm'


def check_software(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    sw = facts.software
    if sw is None:
        return fact_error_result("software", node.name, facts.errors_for("worker"), f"python at {node.python}",
                                 f"set `python:` for {node.name} in the inventory to an interpreter with mlx "
                                 f"({INSTALL})")
    evidence: dict[str, Any] = {"python": sw.python, "python_version": sw.python_version, "mlx": sw.mlx_version,
                "mlx_lm": sw.mlx_lm_version}
    if sw.python_version is None:
        return CheckResult("software", node.name, Status.FAIL, f"python not found at {sw.python}",
                           f"set `python:` in the inventory to an interpreter that has mlx ({INSTALL})", evidence)
    if sw.mlx_version is None or sw.mlx_lm_version is None:
        missing = " and ".join(p for p, v in (("mlx", sw.mlx_version), ("mlx-lm", sw.mlx_lm_version)) if v is None)
        return CheckResult("software", node.name, Status.FAIL, f"{missing} not installed for {sw.python}",
                           f'{shell_path(sw.python)} -m pip install "mlx>=0.32.1" mlx-lm', evidence)
    if version_tuple(sw.mlx_version) < MIN_MLX:
        return CheckResult("software", node.name, Status.FAIL,
                           f"mlx {sw.mlx_version} < {_v(MIN_MLX)} (launcher and ring lost-peer fixes)",
                           f'{shell_path(sw.python)} -m pip install -U "mlx>=0.32.1"', evidence)
    versions = ctx.mlx_versions
    ref, odd = ctx.mlx_majority
    if node.name in odd:
        evidence["fleet"] = {n: {"mlx": v[0], "mlx_lm": v[1]} for n, v in versions.items()}
        others = ", ".join(f"{n}: mlx {v[0]} / mlx-lm {v[1]}" for n, v in sorted(versions.items()) if n != node.name)
        # The versions are what the other nodes reported: quoted, as everything a remedy pastes into a shell line.
        target = (f"{shlex.quote(f'mlx=={ref[0]}')} {shlex.quote(f'mlx-lm=={ref[1]}')}" if ref
                  else "the same mlx and mlx-lm versions on every node")
        return CheckResult("software", node.name, Status.FAIL,
                           f"mlx {sw.mlx_version} / mlx-lm {sw.mlx_lm_version} differ from the fleet ({others})",
                           f"{shell_path(sw.python)} -m pip install {target}" if ref else f"install {target}", evidence)
    minors = ctx.python_minors
    if len(set(minors.values())) > 1:
        evidence["python_minors"] = minors
        return CheckResult("software", node.name, Status.WARN,
                           f"python {sw.python_version}, mlx {sw.mlx_version}, mlx-lm {sw.mlx_lm_version}; python "
                           "minor versions differ: " + ", ".join(f"{n}={m}" for n, m in sorted(minors.items())),
                           "use the same python minor version on every node", evidence)
    return CheckResult("software", node.name, Status.PASS,
                       f"python {sw.python_version}, mlx {sw.mlx_version}, mlx-lm {sw.mlx_lm_version}",
                       evidence=evidence)


# --- env -----------------------------------------------------------------------------------------------------

# Set by mlx.launch for each rank: preset values would hijack the launcher's wiring.
LAUNCHER_OWNED = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE")
# MLX_* names read by mlx 0.32 (libmlx, the launcher, mlx-lm, the Metal and CUDA backends).
KNOWN_MLX_ENV = frozenset({
    *LAUNCHER_OWNED, "MLX_BFS_MAX_WIDTH", "MLX_DISABLE_COMPILE", "MLX_MPI_LIBNAME", "MLX_RING_VERBOSE",
    "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "MLX_JACCL_RING", "MLX_METAL_FAST_SYNCH", "MLX_GDN_PACKED",
    "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_METAL_DEBUG", "MLX_ENABLE_TF32",
    "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_GRAPH_CACHE_SIZE", "MLX_METAL_NO_RESIDENCY_SET",
})


def check_env(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    if facts.env is None:
        return fact_error_result("env", node.name, facts.errors_for("env"), "the SSH environment")
    job_env = {**(ctx.playbook.job_env() if ctx.playbook else {}), **node.env_dict}
    fails: list[str] = []
    warns: list[str] = []
    remedies: list[str] = []
    for where, env in (("ssh env", facts.env), ("job env", job_env)):
        for key in LAUNCHER_OWNED:
            if key in env:
                fails.append(f"{key}={env[key]} preset in the {where}")
        if env.get("MLX_METAL_FAST_SYNCH") == "1":
            warns.append(f"MLX_METAL_FAST_SYNCH=1 in the {where} (can deadlock and wedge the GPU)")
        for key in sorted(env):
            if key.startswith("MLX_") and key not in KNOWN_MLX_ENV:
                warns.append(f"unknown {key} in the {where} (typo?)")
    if fails:
        remedies.append(f"remove {', '.join(k for k in LAUNCHER_OWNED if any(k in f for f in fails))} from the "
                        "node's shell startup files (~/.zshenv, ~/.bashrc), sshd SetEnv, or the playbook/inventory env")
    if warns:
        remedies.append("unset MLX_METAL_FAST_SYNCH; fix or remove unknown MLX_* names")
    tp = job_env.get("TOKENIZERS_PARALLELISM")
    if tp is not None and tp.lower() != "false":
        fails.append(f"TOKENIZERS_PARALLELISM={tp} in the job env (tokenizer threads deadlock after fork)")
        remedies.append("remove the TOKENIZERS_PARALLELISM override: the coordinator sets it to false")
    evidence = {"ssh_env_mlx": {k: v for k, v in facts.env.items() if k.startswith(("MLX_", "TOKENIZERS"))},
                "job_env": job_env}
    if fails:
        return CheckResult("env", node.name, Status.FAIL, "; ".join(fails + warns), "; ".join(remedies), evidence)
    if warns:
        return CheckResult("env", node.name, Status.WARN, "; ".join(warns), "; ".join(remedies), evidence)
    return CheckResult("env", node.name, Status.PASS,
                       "no launcher variables preset; TOKENIZERS_PARALLELISM=false in the job env", evidence=evidence)
