"""Checks `ssh`, `os`, `software` and `env`: is the node reachable, recent enough, consistent with its peers."""

from __future__ import annotations

import shlex
from typing import Any

from coordinator.errors import TransportError
from coordinator.facts.model import Gpu, NodeFacts, version_tuple
from coordinator.facts.probe import shell_path
from coordinator.models import CheckResult, Connection, Node, Status
from coordinator.preflight.checks.context import CheckContext, fact_error_result

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


def setup_command(ctx: CheckContext, node: Node | None) -> str:
    """The `coordinator setup` line that installs the pinned mlx / mlx-lm (the playbook's `software:`, else the
    coordinator's own) with the right backend: for one node, or (node None) the whole fleet at once."""
    source = next((n.source for n in ctx.nodes if n.source), None)
    inventory = source.rsplit(":", 1)[0] if source and source.rsplit(":", 1)[-1].isdigit() else source
    words = ["coordinator", "setup", "-i", shlex.quote(inventory or "INVENTORY")]
    if ctx.playbook is not None and ctx.playbook.path:
        words += ["-p", shlex.quote(ctx.playbook.path)]
    if node is not None:
        words += ["--limit", shlex.quote(node.name)]
    return " ".join(words)


def with_setup(ctx: CheckContext, node: Node | None, by_hand: str) -> str:
    """A software remedy: the fixing `coordinator setup` command first, then the manual way."""
    return f"`{setup_command(ctx, node)}`, or by hand: {by_hand}"


# mlx's CUDA backends and the oldest Linux driver each CUDA major runs on (CUDA 12.0: 525.60.13, 13.0: 580.65.06;
# CUDA minor-version compatibility keeps that floor for every 12.x / 13.x).
CUDA_BACKENDS = {"mlx-cuda-12": ("cuda12", 525), "mlx-cuda-13": ("cuda13", 580)}


def _driver_major(gpu: Gpu) -> int | None:
    drivers = {version_tuple(d.driver_version)[:1] for d in gpu.devices if d.driver_version}
    return next(iter(drivers))[0] if len(drivers) == 1 and () not in drivers else None


def _cuda_extra(gpu: Gpu) -> str:
    """The `mlx[...]` extra for this node's driver: cuda13 from driver 580 on (or when unknown), else cuda12."""
    major = _driver_major(gpu)
    return "cuda12" if major is not None and major < CUDA_BACKENDS["mlx-cuda-13"][1] else "cuda13"


def evaluate_mlx_backend(facts: NodeFacts, python: str, mlx: str) -> tuple[Status, str, str] | None:
    """(status, summary, remedy) when the node's mlx backend cannot work, None when it can or nothing is known.

    Since mlx 0.32 the compute backend is its own distribution of mlx's exact version: without one `import
    mlx.core` fails (libmlx.so missing). A node with an NVIDIA GPU needs mlx-cuda-12 or mlx-cuda-13 (`mlx[cuda12]`,
    `mlx[cuda13]`) whose CUDA major its driver runs; another Linux node needs mlx-cpu (`mlx[cpu]`). macOS (plain
    `mlx` pulls mlx-metal) and answers without the backend list (recorded before it existed) are not judged."""
    backends = facts.software.mlx_backends if facts.software else None
    if backends is None or facts.os is None or facts.os.is_macos:
        return None
    gpu = facts.gpu
    pip = f'{python} -m pip install "mlx[{{extra}}]=={mlx}"'
    if gpu is not None and gpu.cuda:
        extra = _cuda_extra(gpu)
        cuda = {d: v for d, v in backends.items() if d in CUDA_BACKENDS}
        if not cuda:
            cpu = " (mlx-cpu is installed: training would run on the CPU)" if "mlx-cpu" in backends else ""
            return (Status.FAIL, f"{gpu.name} but mlx has no CUDA backend (mlx-cuda-12 / mlx-cuda-13){cpu}",
                    pip.format(extra=extra))
        odd = {d: v for d, v in cuda.items() if v != mlx}
        if odd:
            return (Status.FAIL, ", ".join(f"{d} {v}" for d, v in sorted(odd.items())) + f" differs from mlx {mlx} "
                    "(the backend must be mlx's exact version)", pip.format(extra=CUDA_BACKENDS[min(odd)][0]))
        major = _driver_major(gpu)
        too_new = [d for d in cuda if major is not None and major < CUDA_BACKENDS[d][1]]
        if len(cuda) == len(too_new):
            d = too_new[0]
            return (Status.FAIL, f"{d} needs NVIDIA driver {CUDA_BACKENDS[d][1]}+, the node has {major}",
                    f"upgrade the NVIDIA driver, or {python} -m pip uninstall -y {d} && {pip.format(extra=extra)}")
        if len(cuda) > 1:
            return (Status.WARN, "both mlx-cuda-12 and mlx-cuda-13 installed (one libmlx wins arbitrarily)",
                    f"{python} -m pip uninstall -y {'mlx-cuda-12' if extra == 'cuda13' else 'mlx-cuda-13'}")
        return None
    if "mlx-cpu" in backends:
        if backends["mlx-cpu"] != mlx:
            return (Status.FAIL, f"mlx-cpu {backends['mlx-cpu']} differs from mlx {mlx} (the backend must be mlx's "
                    "exact version)", pip.format(extra="cpu"))
        return None
    if any(d in backends for d in CUDA_BACKENDS):
        return (Status.WARN, "only mlx's CUDA backend is installed but no NVIDIA GPU was found (no nvidia-smi): "
                "mlx cannot run on the CPU", pip.format(extra="cpu"))
    return (Status.FAIL, "no mlx backend installed: `import mlx.core` fails (libmlx.so missing)",
            pip.format(extra="cpu") + " (on an NVIDIA node: mlx[cuda13] or mlx[cuda12])")


def check_software(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    sw = facts.software
    if sw is None:
        return fact_error_result("software", node.name, facts.errors_for("worker"), f"python at {node.python}",
                                 with_setup(ctx, node, f"set `python:` for {node.name} in the inventory to an "
                                            f"interpreter with mlx ({INSTALL})"))
    evidence: dict[str, Any] = {"python": sw.python, "python_version": sw.python_version, "mlx": sw.mlx_version,
                "mlx_lm": sw.mlx_lm_version}
    if sw.python_version is None:
        return CheckResult("software", node.name, Status.FAIL, f"python not found at {sw.python}",
                           with_setup(ctx, node, f"set `python:` in the inventory to an interpreter that has mlx "
                                      f"({INSTALL})"), evidence)
    if sw.mlx_version is None or sw.mlx_lm_version is None:
        missing = " and ".join(p for p, v in (("mlx", sw.mlx_version), ("mlx-lm", sw.mlx_lm_version)) if v is None)
        return CheckResult("software", node.name, Status.FAIL, f"{missing} not installed for {sw.python}",
                           with_setup(ctx, node, f'{shell_path(sw.python)} -m pip install "mlx>=0.32.1" mlx-lm'), evidence)
    if version_tuple(sw.mlx_version) < MIN_MLX:
        return CheckResult("software", node.name, Status.FAIL,
                           f"mlx {sw.mlx_version} < {_v(MIN_MLX)} (launcher and ring lost-peer fixes)",
                           with_setup(ctx, node, f'{shell_path(sw.python)} -m pip install -U "mlx>=0.32.1"'), evidence)
    pins = ctx.playbook.software if ctx.playbook is not None else None
    if pins is not None and ((pins.mlx and sw.mlx_version != pins.mlx) or (pins.mlx_lm and sw.mlx_lm_version != pins.mlx_lm)):
        want = {"mlx": pins.mlx or sw.mlx_version, "mlx-lm": pins.mlx_lm or sw.mlx_lm_version}
        evidence["pins"] = want
        return CheckResult("software", node.name, Status.FAIL,
                           f"mlx {sw.mlx_version} / mlx-lm {sw.mlx_lm_version} differ from the playbook's software: "
                           f"pins (mlx {want['mlx']} / mlx-lm {want['mlx-lm']})",
                           with_setup(ctx, node, f"{shell_path(sw.python)} -m pip install "
                                      + " ".join(shlex.quote(f"{d}=={v}") for d, v in want.items())), evidence)
    if facts.software is not None and facts.software.mlx_backends is not None:
        evidence["mlx_backends"] = facts.software.mlx_backends
    if facts.gpu is not None and facts.gpu.cuda:
        evidence["gpus"] = [{"index": d.index, "name": d.name, "memory_total": d.memory_total_bytes,
                             "driver": d.driver_version, "compute_cap": d.compute_cap} for d in facts.gpu.devices]
    smi_errors = facts.errors_for("nvidia_smi")
    if ctx.backend == "nccl" and not (facts.gpu is not None and facts.gpu.cuda):
        why = f"nvidia-smi failed: {smi_errors[0].raw.strip()[:200]}" if smi_errors else "no nvidia-smi"
        return CheckResult("software", node.name, Status.FAIL,
                           f"backend nccl needs an NVIDIA GPU with mlx's CUDA backend; this node has none ({why})",
                           "use `backend: ring` for fleets without NVIDIA GPUs (jaccl/jaccl-ring between Macs with "
                           "RDMA over Thunderbolt)", evidence)
    backend_finding = evaluate_mlx_backend(facts, sw.python, sw.mlx_version)
    if backend_finding is not None and backend_finding[0] is Status.FAIL and "driver" not in backend_finding[1]:
        backend_finding = (backend_finding[0], backend_finding[1], with_setup(ctx, node, backend_finding[2]))
    if smi_errors and backend_finding is None:
        backend_finding = (Status.WARN, f"nvidia-smi is installed but failed ({smi_errors[0].message}): an NVIDIA GPU "
                           "here cannot be used", "fix the NVIDIA driver until `nvidia-smi` lists the GPUs (a reboot "
                           "after a driver update, or matching kernel module and user-space versions)")
    # The fleet's version drift first: its remedy (the fleet's mlx version) also settles a backend mismatch.
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
                           with_setup(ctx, None, f"{shell_path(sw.python)} -m pip install {target}" if ref
                                      else f"install {target}"), evidence)
    if backend_finding is not None:  # a fail, or a warning that outranks the python minor versions'
        return CheckResult("software", node.name, backend_finding[0], backend_finding[1], backend_finding[2], evidence)
    minors = ctx.python_minors
    if len(set(minors.values())) > 1:
        evidence["python_minors"] = minors
        return CheckResult("software", node.name, Status.WARN,
                           f"python {sw.python_version}, mlx {sw.mlx_version}, mlx-lm {sw.mlx_lm_version}; python "
                           "minor versions differ: " + ", ".join(f"{n}={m}" for n, m in sorted(minors.items())),
                           "use the same python minor version on every node", evidence)
    on = ""
    if facts.gpu is not None and facts.gpu.cuda and sw.mlx_backends:
        on = " on " + ", ".join(d for d in sorted(sw.mlx_backends) if d in CUDA_BACKENDS)
    elif sw.mlx_backends and "mlx-cpu" in sw.mlx_backends and not (facts.os and facts.os.is_macos):
        on = " (mlx-cpu)"
    return CheckResult("software", node.name, Status.PASS,
                       f"python {sw.python_version}, mlx {sw.mlx_version}{on}, mlx-lm {sw.mlx_lm_version}",
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
