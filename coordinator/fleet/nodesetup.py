"""`coordinator setup`: make every node's `python` exist with the pinned mlx / mlx-lm and this project's worker.

Ansible's model: each node ends `ok` (nothing to do), `changed` (something was done) or `failed` (with why). A
second run on a set-up fleet only inspects (one small command per node) and answers `ok` everywhere.

How (docs/setup.md):
1. Inspect every node with its system `python3`: OS, arch, glibc / macOS version, NVIDIA driver, whether the
   inventory's `python` exists and which mlx distributions it has, whether the worker is shipped.
2. Plan (pure, `plan_node`): create the venv when `python` is missing and is a venv path (`.../bin/python`);
   install `mlx[<backend>]==PIN mlx-lm==PIN` when the versions differ; ship the worker when it is missing.
3. Download the wheels ONCE per platform on the coordinator (`pip download --only-binary :all: --platform ...
   --python-version ...`), cached under $XDG_CACHE_HOME/mlx-coordinator/wheelhouse/<platform>/<pins>/ (~/.cache/...
   without it) with each wheel's SHA256 recorded in its `.complete` marker, push the ones each node's copy lacks or
   holds different (by SHA256) over SFTP and install with `pip install --no-index --find-links`: nodes need no
   network.
4. Inspect again: a node whose plan is still not empty is `failed` with what still differs.

Nothing is used unverified: the cache's wheels are checked against their recorded SHA256 before every use (a bad
one is named, removed and fetched again), and the node checks its copy against the same hashes before it creates a
venv or runs pip. A failed install removes the venv it created; pip's output is reduced to its cause (the wheel and
the error) and kept whole in a log file whose path the message names.

Pure core: `parse_node_state`, `compute_platform`, `requirements`, `plan_node`, `build_download_argv`,
`parse_pip_failure`, `compute_bad_wheels`. I/O: `inspect_node`, `ensure_wheelhouse`, `apply_plan`, `run_setup`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError, CoordinatorError, TransportError
from coordinator.facts.model import ParseError, version_tuple
from coordinator.fleet.cachedir import cache_root
from coordinator.fleet.ship import remote_worker_dir, ship_worker
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet, Transport
from coordinator.models import Node

BACKEND_DISTS = ("mlx-cpu", "mlx-metal", "mlx-cuda-12", "mlx-cuda-13")
TRACKED_DISTS = ("mlx", "mlx-lm", *BACKEND_DISTS)
CUDA13_MIN_DRIVER = 580  # CUDA 13.0's oldest Linux driver (checks.system.CUDA_BACKENDS)
# Where a missing `.../bin/python` is an OS or package-manager interpreter, never a venv to create there.
SYSTEM_PREFIXES = frozenset({"", "/usr", "/usr/local", "/opt/homebrew", "/opt/local", "/Library/Frameworks"})
OLDEST_MANYLINUX_GLIBC = 17  # manylinux2014 = manylinux_2_17
INSPECT_TIMEOUT = 60.0
INSTALL_TIMEOUT = 1800.0  # pip installing mlx-lm's dependencies on a slow node
UPLOAD_TIMEOUT = 1800.0
DOWNLOAD_TIMEOUT = 1800.0


class Outcome(StrEnum):
    OK = "ok"
    CHANGED = "changed"
    FAILED = "failed"


class SetupError(CoordinatorError):
    """A step of `setup` failed on one node (or for one platform's wheelhouse)."""


@dataclass(frozen=True)
class Pins:
    """The mlx and mlx-lm versions every node gets, and where they came from."""

    mlx: str
    mlx_lm: str
    source: str  # "playbook.yaml software:" or "the coordinator's own"

    @property
    def key(self) -> str:
        return f"mlx-{self.mlx}_mlx-lm-{self.mlx_lm}"


def coordinator_pins() -> Pins:
    """The coordinator's own installed mlx / mlx-lm versions (the default pins). ConfigError without them."""
    try:
        return Pins(importlib.metadata.version("mlx"), importlib.metadata.version("mlx-lm"), "the coordinator's own")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(f"the coordinator has no {exc.name} installed: pin the versions with the playbook's "
                          "`software: {mlx: ..., mlx_lm: ...}` (setup -p PLAYBOOK)") from None


# --- pure: what a node is --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeState:
    """What `inspect_node` found on a node (its system python3 answers; `python` is the inventory's)."""

    system: str  # platform.system(): "Linux" | "Darwin"
    machine: str  # "x86_64" | "aarch64" | "arm64"
    python3: str  # the system python3's version, which creates a missing venv
    python3_path: str
    glibc: str | None  # Linux with glibc: "2.36"
    macos: str | None  # "14.5"
    cuda_driver: str | None  # nvidia-smi's driver version, when the node has one that answers
    python_exists: bool
    python_version: str | None  # the inventory python's version (None: missing, or it did not answer)
    python_error: str | None
    installed: dict[str, str] = field(default_factory=dict)  # TRACKED_DISTS present in `python`
    worker: bool = False  # the worker package of this coordinator is at remote_worker_dir
    # The directory a missing `python` would be the venv of: "missing", "venv" (has pyvenv.cfg) or "other".
    venv_dir: str = "missing"


def parse_node_state(text: str) -> NodeState:
    """The inspect script's JSON line -> NodeState. Raises ParseError on anything else."""
    line = text.strip().splitlines()[-1] if text.strip() else ""
    try:
        doc = json.loads(line)
    except ValueError:
        raise ParseError(f"inspect: expected one JSON line, got {text.strip()[-200:]!r}") from None
    if not isinstance(doc, dict):
        raise ParseError(f"inspect: expected a JSON object, got {line[:200]!r}")
    try:
        installed = doc.get("installed") or {}
        return NodeState(
            system=str(doc["system"]), machine=str(doc["machine"]), python3=str(doc["python3"]),
            python3_path=str(doc["python3_path"]), glibc=_opt(doc.get("glibc")), macos=_opt(doc.get("macos")),
            cuda_driver=_opt(doc.get("cuda_driver")), python_exists=bool(doc["python_exists"]),
            python_version=_opt(doc.get("python_version")), python_error=_opt(doc.get("python_error")),
            installed={str(k): str(v) for k, v in installed.items()}, worker=bool(doc.get("worker")),
            venv_dir=str(doc.get("venv_dir") or "missing"),
        )
    except (KeyError, AttributeError) as exc:
        raise ParseError(f"inspect: missing or malformed key {exc} in {line[:200]!r}") from None


def _opt(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


@dataclass(frozen=True)
class Platform:
    """What a wheel must match on a node: OS, arch, CPython minor, glibc or macOS floor, mlx backend."""

    system: str  # "linux" | "darwin"
    machine: str
    python: tuple[int, int]
    libc: tuple[int, int]  # glibc (linux) or macOS (major, minor)
    extra: str | None  # mlx's extra: "cpu", "cuda12", "cuda13"; None on macOS (plain mlx pulls mlx-metal)

    @property
    def backend_dist(self) -> str:
        return {"cpu": "mlx-cpu", "cuda12": "mlx-cuda-12", "cuda13": "mlx-cuda-13"}.get(self.extra or "", "mlx-metal")

    @property
    def key(self) -> str:
        """A directory name: `linux-x86_64-cp311-glibc2.36-cpu`, `darwin-arm64-cp312-macos14.0-metal`."""
        libc = f"glibc{self.libc[0]}.{self.libc[1]}" if self.system == "linux" else f"macos{self.libc[0]}.{self.libc[1]}"
        return f"{self.system}-{self.machine}-cp{self.python[0]}{self.python[1]}-{libc}-{self.extra or 'metal'}"

    def pip_platforms(self) -> list[str]:
        """`pip download --platform` values. pip widens a macOS tag to every older one by itself, but not a
        manylinux_2_N tag: those are listed down to manylinux_2_17 (manylinux2014), the oldest mlx builds."""
        if self.system == "darwin":
            return [f"macosx_{self.libc[0]}_0_{self.machine}"]
        return [f"manylinux_{self.libc[0]}_{n}_{self.machine}"
                for n in range(self.libc[1], OLDEST_MANYLINUX_GLIBC - 1, -1)] + [f"manylinux2014_{self.machine}"]


def _minor(version: str) -> tuple[int, int] | None:
    parts = version_tuple(version)
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def compute_platform(state: NodeState) -> Platform:
    """The platform the node's `python` runs on (the system python3's version when `python` is still to be
    made). Raises SetupError for nodes mlx publishes no wheels for."""
    version = state.python_version if state.python_exists and state.python_version else state.python3
    py = _minor(version)
    if py is None:
        raise SetupError(f"cannot read the python version {version!r}")
    if state.system == "Darwin":
        mac = _minor(state.macos or "") or ((version_tuple(state.macos or "")[:1] or (0,))[0], 0)
        if state.machine != "arm64":
            raise SetupError(f"macOS on {state.machine}: mlx needs Apple silicon (arm64)")
        if mac[0] < 11:
            raise SetupError(f"macOS {state.macos}: mlx needs macOS 14+")
        return Platform("darwin", "arm64", py, (mac[0], 0), None)
    if state.system == "Linux":
        glibc = _minor(state.glibc or "")
        if glibc is None:
            raise SetupError("Linux without glibc (musl?): mlx publishes manylinux wheels only")
        extra = "cpu"
        if state.cuda_driver is not None:
            major = (version_tuple(state.cuda_driver)[:1] or (0,))[0]
            extra = "cuda13" if major >= CUDA13_MIN_DRIVER else "cuda12"
        return Platform("linux", state.machine, py, glibc, extra)
    raise SetupError(f"unsupported OS {state.system!r}: mlx runs on macOS and Linux")


def requirements(platform: Platform, pins: Pins) -> tuple[str, ...]:
    """The pip requirement specifiers that install the pins with this platform's backend."""
    mlx = f"mlx[{platform.extra}]=={pins.mlx}" if platform.extra else f"mlx=={pins.mlx}"
    return (mlx, f"mlx-lm=={pins.mlx_lm}")


def wanted_dists(platform: Platform, pins: Pins) -> dict[str, str]:
    """distribution -> version a set-up node has (mlx's backend is mlx's own exact version)."""
    return {"mlx": pins.mlx, "mlx-lm": pins.mlx_lm, platform.backend_dist: pins.mlx}


def venv_dir_for(python: str) -> str | None:
    """`~/venvs/mlx/bin/python` -> `~/venvs/mlx`; None when the path is not `<dir>/bin/python[3[.N]]`."""
    head, name = python.rsplit("/", 1) if "/" in python else ("", python)
    if not head.endswith("/bin") or not (name == "python" or name.startswith("python3")):
        return None
    venv = head[: -len("/bin")]
    return None if venv.rstrip("/") in SYSTEM_PREFIXES else venv


@dataclass(frozen=True)
class NodePlan:
    """What `setup` does on one node. Empty (no venv, no install, no worker, no problem) means `ok`."""

    node: str
    python: str
    platform: Platform | None
    create_venv: str | None = None  # the venv directory to create with the system python3
    install: tuple[str, ...] = ()  # requirement specifiers
    ship_worker: bool = False
    reasons: tuple[str, ...] = ()  # what differs, for the output
    problem: str | None = None  # why setup cannot do it: the node fails

    @property
    def changes(self) -> bool:
        return bool(self.create_venv or self.install or self.ship_worker)

    def actions(self) -> list[str]:
        out = []
        if self.create_venv:
            out.append(f"create venv {self.create_venv}")
        if self.install:
            out.append("install " + " ".join(self.install))
        if self.ship_worker:
            out.append("ship the worker")
        return out


def plan_node(node: Node, state: NodeState, pins: Pins) -> NodePlan:
    """Facts in, actions out: what brings `node` to the pins (see NodePlan)."""
    try:
        platform = compute_platform(state)
    except SetupError as exc:
        return NodePlan(node.name, node.python, None, problem=str(exc))
    reasons: list[str] = []
    venv = None
    if not state.python_exists:
        venv = venv_dir_for(node.python)
        if venv is None:
            return NodePlan(node.name, node.python, platform, problem=(
                f"python {node.python} does not exist and is not a venv path (<dir>/bin/python): install it, or set "
                f"`python:` to a venv path such as ~/venvs/mlx/bin/python that setup creates"))
        if state.venv_dir == "other":
            return NodePlan(node.name, node.python, platform, problem=(
                f"python {node.python} does not exist and {venv} is a directory but not a venv (no pyvenv.cfg): "
                "setup creates venvs only where there is none; move it, or point `python:` elsewhere"))
        reasons.append(f"{node.python} missing")
    elif state.python_version is None:
        return NodePlan(node.name, node.python, platform,
                        problem=f"{node.python} exists but does not run: {(state.python_error or '').strip()[-300:]}")
    wanted = wanted_dists(platform, pins)
    have = {} if venv else state.installed
    differ = [f"{d} {have.get(d, 'missing')} (want {v})" for d, v in wanted.items() if have.get(d) != v]
    reasons += differ
    others = sorted(d for d in BACKEND_DISTS if d in have and d not in wanted)
    if others and differ:
        reasons.append("also installed: " + ", ".join(others) + " (left alone)")
    if not state.worker:
        reasons.append("worker not shipped")
    return NodePlan(node.name, node.python, platform, create_venv=venv, install=requirements(platform, pins) if differ else (),
                    ship_worker=not state.worker, reasons=tuple(reasons))


# --- pure: the wheelhouse --------------------------------------------------------------------------------------


def default_wheelhouse_root() -> Path:
    """The coordinator's wheel cache (under `cache_root`: $XDG_CACHE_HOME honoured)."""
    return cache_root() / "wheelhouse"


def wheelhouse_name(platform: Platform, pins: Pins) -> str:
    return f"{platform.key}/{pins.key}"


def build_download_argv(python: str, platform: Platform, pins: Pins, dest: Path, *,
                        find_links: Sequence[Path] = (), cached: Sequence[Path] = ()) -> list[str]:
    """`pip download` of the platform's wheels (and their dependencies) into `dest`, for a node's platform and
    python rather than the coordinator's. With `find_links` pip looks there first (`--no-index` with them only:
    an air-gapped coordinator with a local wheel mirror). `cached`: the good wheels of a cache being repaired, a
    source besides the index (not `--no-index`: the bad ones are fetched from it)."""
    argv = [python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary", ":all:",
            "--dest", str(dest), "--implementation", "cp",
            "--python-version", f"{platform.python[0]}.{platform.python[1]}",
            "--abi", f"cp{platform.python[0]}{platform.python[1]}"]
    for tag in platform.pip_platforms():
        argv += ["--platform", tag]
    for d in (*find_links, *cached):
        argv += ["--find-links", str(d)]
    if find_links:
        argv.append("--no-index")
    # pip itself too, unpinned: the newest that supports the node's python, to bootstrap a venv on a node whose
    # python3 has no ensurepip (Debian without python3-venv).
    return [*argv, *requirements(platform, pins), "pip"]


# --- pure: what a pip failure says, which wheels are bad ---------------------------------------------------------


def parse_pip_failure(output: str, broken: Sequence[str] = ()) -> str:
    """pip's output -> its cause in one line: the wheel(s) that do not read back (`broken`, found by a CRC check,
    as pip does not say which one it was installing) or else the only wheel pip processed, and the exception's last
    line; else pip's own `ERROR:` lines (at most two); else the output's last line."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    wheels = [m[1].rsplit("/", 1)[-1] for line in lines if (m := re.match(r"\s*Processing\s+(\S+\.whl)\b", line))]
    named = list(broken) or (wheels if len(wheels) == 1 else [])
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        cause = lines[-1].strip()
        return f"{', '.join(named)}: {cause}" if named else cause
    errors = [line[len("ERROR: "):].strip() for line in lines if line.startswith("ERROR: ")]
    if errors:
        return "; ".join(errors[:2])
    return lines[-1].strip()[-400:] if lines else "no output"


def compute_bad_wheels(recorded: Mapping[str, str], found: Mapping[str, str | None]) -> list[tuple[str, str]]:
    """(wheel, why) for each recorded wheel that is missing or whose SHA256 differs (`found`: name -> its SHA256,
    None when it could not be read), in name order."""
    bad = []
    for name, want in sorted(recorded.items()):
        got = found.get(name, "missing")
        if got == "missing":
            bad.append((name, "missing"))
        elif got is None:
            bad.append((name, "unreadable"))
        elif got != want:
            bad.append((name, f"sha256 {got[:12]}... is not the {want[:12]}... recorded at download"))
    return bad


# --- I/O: one node ---------------------------------------------------------------------------------------------

# Runs on the node's system python3 (any python 3: keep it old-syntax). argv: the inventory python, the worker dir.
_INSPECT = r"""
import json, os, platform, shutil, subprocess, sys
target = os.path.expanduser(sys.argv[1])
worker = os.path.expanduser(sys.argv[2])
names = sys.argv[3].split(",")
venv_dir = os.path.expanduser(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else ""
out = {"system": platform.system(), "machine": platform.machine(), "python3": platform.python_version(),
       "python3_path": sys.executable, "glibc": None, "macos": None, "cuda_driver": None, "python_exists": False,
       "python_version": None, "python_error": None, "installed": {},
       "worker": os.path.isfile(os.path.join(worker, "worker", "__init__.py")),
       "venv_dir": ("venv" if os.path.isfile(os.path.join(venv_dir, "pyvenv.cfg")) else "other")
                   if venv_dir and os.path.exists(venv_dir) else "missing"}
if out["system"] == "Linux":
    lib, ver = platform.libc_ver()
    out["glibc"] = ver if lib == "glibc" else None
elif out["system"] == "Darwin":
    out["macos"] = platform.mac_ver()[0]
smi = shutil.which("nvidia-smi")
if smi:
    try:
        r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=30)
        if r.returncode == 0 and r.stdout.split():
            out["cuda_driver"] = r.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
if os.path.exists(target):
    out["python_exists"] = True
    code = ("import json, platform\n"
            "import importlib.metadata as m\n"
            "d = {}\n"
            "for n in %r:\n"
            "    try:\n"
            "        d[n] = m.version(n)\n"
            "    except Exception:\n"
            "        pass\n"
            "print(json.dumps({'version': platform.python_version(), 'installed': d}))\n") % (names,)
    try:
        r = subprocess.run([target, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, timeout=60)
        if r.returncode == 0:
            got = json.loads(r.stdout.strip().splitlines()[-1])
            out["python_version"], out["installed"] = got["version"], got["installed"]
        else:
            out["python_error"] = r.stderr[-400:]
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
        out["python_error"] = str(exc)
print(json.dumps(out))
"""

# A node directory's wheels with their SHA256 (a missing directory is empty). argv: the directory.
_LIST = r"""
import hashlib, json, os, sys
d = os.path.expanduser(sys.argv[1])
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
print(json.dumps({n: sha(os.path.join(d, n)) for n in (os.listdir(d) if os.path.isdir(d) else [])
                  if n.endswith(".whl")}))
"""

# Checks the wheelhouse against the coordinator's hashes, creates the venv when asked, then pip installs from the
# wheelhouse only. A failure after the venv was created removes it: the node is left as it was. argv: one JSON object.
_INSTALL = r"""
import glob, hashlib, json, os, shutil, subprocess, sys
a = json.loads(sys.argv[1])
wheels = os.path.expanduser(a["wheelhouse"])
python = os.path.expanduser(a["python"])
made = []
def broken(output):
    # The wheel pip failed on (it names none): the first whose members fail their CRC check, looked at in pip's
    # install order ("Installing collected packages: a, b, ...").
    import re, zipfile, zlib
    norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
    order = []
    for line in output.splitlines():
        if line.startswith("Installing collected packages:"):
            order = [norm(n.strip()) for n in line.split(":", 1)[1].split(",")]
    rank = lambda path: (order.index(norm(os.path.basename(path).split("-")[0]))
                         if norm(os.path.basename(path).split("-")[0]) in order else len(order))
    for path in sorted(glob.glob(os.path.join(wheels, "*.whl")), key=rank):
        try:
            with zipfile.ZipFile(path) as zf:
                if zf.testzip() is None:
                    continue
        except (OSError, zipfile.BadZipFile, EOFError, zlib.error):
            pass
        return [os.path.basename(path)]
    return []
def fail(what, output, command=None, check=False):
    removed = None
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
        removed = path
    print(json.dumps({"failed": what, "command": command or what, "output": output, "removed": removed,
                      "broken": broken(output) if check else []}))
    sys.exit(1)
def run(what, argv, check=False):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    if r.returncode != 0:
        fail(what, r.stdout, " ".join(argv), check)
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
bad = []
for name, want in sorted(a.get("hashes", {}).items()):
    path = os.path.join(wheels, name)
    try:
        got = sha(path)
    except OSError as exc:
        got = "unreadable (%s)" % exc
    if got != want:
        bad.append(name)
        try:
            os.remove(path)  # the next setup sends it again
        except OSError:
            pass
if bad:
    fail("verify", "corrupted in %s (sha256 differs from the coordinator's; removed, sent again by the next setup): %s"
         % (wheels, ", ".join(bad)))
if a.get("venv"):
    venv = os.path.expanduser(a["venv"])
    made.append(venv)
    try:
        import ensurepip
        run("python3 -m venv " + venv, [sys.executable, "-m", "venv", venv])
    except ImportError:
        # Debian/Ubuntu without python3-venv: no ensurepip. A venv without pip, then pip from the wheelhouse.
        run("python3 -m venv --without-pip " + venv, [sys.executable, "-m", "venv", "--without-pip", venv])
        pips = sorted(glob.glob(os.path.join(wheels, "pip-*.whl")))
        if not pips:
            fail("bootstrap pip", "no ensurepip and no pip wheel")
        run("bootstrap pip", [python, os.path.join(pips[-1], "pip"), "install", "--no-index", pips[-1]], True)
if a["install"]:
    run("pip install " + " ".join(a["install"]),
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-index",
         "--find-links", wheels] + a["install"], True)
print(json.dumps({"ok": True}))
"""


async def inspect_node(transport: Transport, node: Node) -> NodeState:
    """One command on the node (its `python3` on PATH). Raises TransportError, SetupError."""
    result = await transport.run(["python3", "-c", _INSPECT, node.python, remote_worker_dir(node),
                                  ",".join(TRACKED_DISTS), venv_dir_for(node.python) or ""], timeout=INSPECT_TIMEOUT)
    if not result.ok:
        raise SetupError(f"inspecting with python3 failed (exit {result.exit_status}): "
                         f"{(result.stderr or result.stdout).strip()[-300:]} (setup needs a python3 on the node's PATH)")
    try:
        return parse_node_state(result.stdout)
    except ParseError as exc:
        raise SetupError(str(exc)) from None


def remote_wheelhouse(node: Node, name: str) -> str:
    return f"{node.workdir.rstrip('/')}/.coordinator/wheelhouse/{name}"


@dataclass(frozen=True)
class Wheelhouse:
    """A platform's verified wheel directory on the coordinator: its name (`<platform>/<pins>`) and each wheel's
    SHA256, as recorded at download."""

    path: Path
    name: str
    hashes: dict[str, str]


async def push_wheels(transport: Transport, node: Node, house: Wheelhouse, remote: str) -> int:
    """Upload the wheels the node's copy lacks or holds different (by SHA256). Returns how many were sent."""
    listed = await transport.run(["python3", "-c", _LIST, remote], timeout=INSPECT_TIMEOUT)
    have: dict[str, str] = json.loads(listed.stdout.strip().splitlines()[-1]) if listed.ok and listed.stdout.strip() else {}
    missing = [house.path / name for name, digest in sorted(house.hashes.items()) if have.get(name) != digest]
    if missing:
        await transport.upload(missing, remote, timeout=UPLOAD_TIMEOUT)
    return len(missing)


def default_log_dir() -> Path:
    """Where setup keeps pip's full output: $XDG_STATE_HOME/mlx-coordinator/setup-logs (~/.local/state/... when it
    is unset, empty or relative, as for `cachedir.cache_root`)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.expanduser("~/.local/state")
    return Path(base) / "mlx-coordinator" / "setup-logs"


def keep_log(log_dir: Path, what: str, command: str, output: str) -> Path | None:
    """pip's whole output in `log_dir/<what>-<UTC time>.log`; None when it cannot be written (the message then
    carries the cause alone)."""
    path = log_dir / f"{what}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}.log"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(f"$ {command}\n{output}", encoding="utf-8")
    except OSError:
        return None
    return path


def describe_install_failure(node: str, why: Mapping[str, Any], log_dir: Path) -> str:
    """One line for a failed `_INSTALL`: what failed, pip's cause, the venv removed, and where the whole log is."""
    what, output = str(why.get("failed", "")), str(why.get("output", ""))
    if what == "verify":
        return f"the node's wheelhouse: {output}"
    log = keep_log(log_dir, f"install-{node}", str(why.get("command") or what), output)
    listed = why.get("broken")
    broken = [str(b) for b in listed] if isinstance(listed, list) else []
    text = f"`{what[:200]}` failed: {parse_pip_failure(output, broken)}"
    if why.get("removed"):
        text += f"; removed the venv {why['removed']} this run had created (the node is as it was)"
    return text + (f"; full log: {log}" if log else "")


async def apply_plan(transport: Transport, node: Node, plan: NodePlan, state: NodeState,
                     wheelhouse: Wheelhouse | None, *, log_dir: Path | None = None) -> list[str]:
    """Carry out `plan` (`wheelhouse` when there is something to install). Returns the actions done; raises
    SetupError / TransportError. A failure leaves no venv this run created; pip's whole output goes to a file
    under `log_dir`, named in the error."""
    done: list[str] = []
    if plan.create_venv or plan.install:
        assert wheelhouse is not None
        remote = remote_wheelhouse(node, wheelhouse.name)
        sent = await push_wheels(transport, node, wheelhouse, remote)
        done.append(f"pushed {sent} wheel(s) to {remote}" if sent else f"wheelhouse {remote} already complete")
        args = {"python": node.python, "venv": plan.create_venv, "install": list(plan.install), "wheelhouse": remote,
                "hashes": wheelhouse.hashes}
        # The system python3 the inspection found (by absolute path): it makes the venv, so the venv's CPython
        # is the one the wheels were downloaded for.
        result = await transport.run([state.python3_path, "-c", _INSTALL, json.dumps(args)], timeout=INSTALL_TIMEOUT)
        if not result.ok:
            try:
                why = json.loads(result.stdout.strip().splitlines()[-1])
                message = describe_install_failure(node.name, why, log_dir or default_log_dir())
            except (ValueError, IndexError, AttributeError):
                output = (result.stderr + result.stdout).strip()
                log = keep_log(log_dir or default_log_dir(), f"install-{node.name}", "install", output)
                raise SetupError(f"install failed (exit {result.exit_status}): {parse_pip_failure(output)}"
                                 + (f"; full log: {log}" if log else "")) from None
            raise SetupError(message)
        done += plan.actions()[: (1 if plan.create_venv else 0) + (1 if plan.install else 0)]
    if plan.ship_worker:
        await ship_worker(transport, node)
        done.append("shipped the worker")
    return done


# --- I/O: the coordinator's wheelhouse -------------------------------------------------------------------------

MARKER = ".complete"


def sha256_file(path: Path) -> str | None:
    """The file's SHA256; None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _zip_ok(path: Path) -> bool:
    """Every member's CRC checks (a cache of an older coordinator recorded no hashes: its wheels are read once)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error):
        return False


def _write_marker(directory: Path, platform: Platform, pins: Pins, hashes: Mapping[str, str]) -> None:
    (directory / MARKER).write_text(json.dumps({"requirements": list(requirements(platform, pins)),
                                                "wheels": dict(sorted(hashes.items()))}, indent=1) + "\n")


def verify_wheelhouse(final: Path, platform: Platform, pins: Pins) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(the recorded hashes, the bad wheels) of a cached wheelhouse. A marker without hashes (an older
    coordinator's) gets them, once its wheels pass a zip CRC check. A marker that cannot be read: every wheel bad."""
    try:
        doc = json.loads((final / MARKER).read_text())
        recorded = doc.get("wheels") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        recorded = None
    wheels = sorted(final.glob("*.whl"))
    if isinstance(recorded, dict):
        found = {p.name: sha256_file(p) for p in wheels}
        return {str(k): str(v) for k, v in recorded.items()}, compute_bad_wheels(recorded, found)
    bad = [(p.name, "fails its zip CRC check") for p in wheels if not _zip_ok(p)]
    hashes = {p.name: digest for p in wheels if (digest := sha256_file(p)) is not None}
    if not bad and wheels:
        with contextlib.suppress(OSError):
            _write_marker(final, platform, pins, hashes)
    return hashes, bad or ([] if wheels else [("*.whl", "no wheel in the cache")])


async def _download(platform: Platform, pins: Pins, final: Path, find_links: Sequence[Path], python: str,
                    log_dir: Path, cached: Sequence[Path] = ()) -> dict[str, str]:
    """pip download into a temporary dir beside `final`, hashes recorded, renamed into place (a half-done download
    is never used). Returns the hashes; SetupError with pip's cause and the log's path."""
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = build_download_argv(python, platform, pins, tmp, find_links=find_links, cached=cached)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=DOWNLOAD_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        raise SetupError(f"pip download for {platform.key} timed out after {DOWNLOAD_TIMEOUT:g}s") from None
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        text = out.decode(errors="replace")
        log = keep_log(log_dir, f"download-{platform.key}", " ".join(argv), text)
        raise SetupError(f"pip download for {platform.key} failed: {parse_pip_failure(text)}"
                         + (f"; full log: {log}" if log else ""))
    hashes = {p.name: digest for p in tmp.glob("*.whl") if (digest := sha256_file(p)) is not None}
    _write_marker(tmp, platform, pins, hashes)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return hashes


async def ensure_wheelhouse(platform: Platform, pins: Pins, root: Path, *, find_links: Sequence[Path] = (),
                            python: str = sys.executable, log_dir: Path | None = None,
                            on_note: Callable[[str], None] | None = None) -> Wheelhouse:
    """The platform's wheel directory under `root`, downloaded on first use, every wheel's SHA256 recorded in its
    marker and checked before every use. A wheel that fails the check is named (`on_note`), removed and fetched
    again (the good ones are reused through `--find-links`); when that fetch fails (offline), SetupError names the
    wheel, the cache and what to do. Raises SetupError with pip's cause and its log's path."""
    name = wheelhouse_name(platform, pins)
    final = root / name
    log_dir = log_dir or default_log_dir()
    if not (final / MARKER).is_file():
        return Wheelhouse(final, name, await _download(platform, pins, final, find_links, python, log_dir))
    hashes, bad = verify_wheelhouse(final, platform, pins)
    if not bad:
        return Wheelhouse(final, name, hashes)
    names = ", ".join(f"{w} ({why})" for w, why in bad)
    if on_note is not None:
        on_note(f"wheel cache {final}: {names}: removed, fetching again")
    for wheel, _ in bad:
        with contextlib.suppress(OSError):
            (final / wheel).unlink()
    # The good wheels stay where they are until the new download is in place: they are its first source.
    keep = final.with_name(final.name + f".old-{os.getpid()}")
    shutil.rmtree(keep, ignore_errors=True)
    final.rename(keep)
    try:
        fresh = await _download(platform, pins, final, find_links, python, log_dir, cached=(keep,))
    except SetupError as exc:
        if not final.exists():
            keep.rename(final)  # the good wheels stay cached; the marker makes the next setup fetch the rest
        raise SetupError(f"the wheel cache {final} held {names}: removed, and fetching again failed ({exc}); with "
                         f"the network (or `--find-links DIR` holding the wheel), run setup again, or delete {final} "
                         "to download the whole platform again") from None
    shutil.rmtree(keep, ignore_errors=True)
    return Wheelhouse(final, name, fresh)


# --- I/O: the fleet --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSetup:
    """One node's outcome: ok / changed / failed, what was (or, with --check, would be) done, and why."""

    node: str
    outcome: Outcome
    actions: tuple[str, ...] = ()
    message: str = ""
    platform: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "status": str(self.outcome), "actions": list(self.actions),
                "message": self.message, "platform": self.platform}


@dataclass(frozen=True)
class SetupReport:
    pins: Pins
    nodes: tuple[NodeSetup, ...]
    check: bool

    @property
    def failed(self) -> bool:
        return any(n.outcome is Outcome.FAILED for n in self.nodes)

    def counts(self) -> dict[str, int]:
        return {str(o): sum(1 for n in self.nodes if n.outcome is o) for o in Outcome}

    def to_json(self) -> dict[str, Any]:
        return {"pins": {"mlx": self.pins.mlx, "mlx_lm": self.pins.mlx_lm, "source": self.pins.source},
                "check": self.check, "nodes": [n.to_json() for n in self.nodes], "summary": self.counts()}


def _failed(node: str, exc: BaseException, platform: Platform | None = None) -> NodeSetup:
    return NodeSetup(node, Outcome.FAILED, message=str(exc), platform=platform.key if platform else None)


async def run_setup(nodes: Sequence[Node], pins: Pins, *, check: bool = False, root: Path | None = None,
                    find_links: Sequence[Path] = (), connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                    accept_new_host_keys: bool = False,
                    on_download: Callable[[str], None] | None = None,
                    on_note: Callable[[str], None] | None = None, log_dir: Path | None = None) -> SetupReport:
    """Inspect, plan, (unless `check`) download once per platform, push, install, re-inspect. Per-node failures
    are `failed` results; nothing here raises for one node's sake. `on_note`: what the wheel cache's check found
    and did; `log_dir`: where pip's whole output goes when it fails (default_log_dir())."""
    root = root or default_wheelhouse_root()
    out: dict[str, NodeSetup] = {}
    async with Fleet(nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        connected, inspected = await fleet.connect_and_map(inspect_node_safe)
        states: dict[str, NodeState] = {}
        for node in nodes:
            got = inspected.get(node.name, connected.get(node.name))
            if isinstance(got, NodeState):
                states[node.name] = got
            else:
                out[node.name] = _failed(node.name, got if isinstance(got, BaseException) else SetupError("not connected"))
        plans = {n.name: plan_node(n, states[n.name], pins) for n in nodes if n.name in states}
        todo: dict[str, NodePlan] = {}
        for name, plan in plans.items():
            key = plan.platform.key if plan.platform else None
            if plan.problem:
                out[name] = NodeSetup(name, Outcome.FAILED, message=plan.problem, platform=key)
            elif not plan.changes:
                out[name] = NodeSetup(name, Outcome.OK, message="; ".join(plan.reasons) or "up to date", platform=key)
            elif check:
                out[name] = NodeSetup(name, Outcome.CHANGED, tuple(plan.actions()), "would: " + "; ".join(plan.reasons),
                                      key)
            else:
                todo[name] = plan
        # One download per platform, whatever the number of nodes on it.
        houses: dict[str, Wheelhouse | SetupError] = {}
        for plan in todo.values():
            if plan.platform is None or not (plan.create_venv or plan.install) or plan.platform.key in houses:
                continue
            if on_download is not None:
                on_download(wheelhouse_name(plan.platform, pins))
            try:
                houses[plan.platform.key] = await ensure_wheelhouse(plan.platform, pins, root, find_links=find_links,
                                                                    log_dir=log_dir, on_note=on_note)
            except (SetupError, OSError) as exc:
                houses[plan.platform.key] = SetupError(str(exc))

        async def apply(node: Node, transport: Transport) -> NodeSetup:
            plan = todo[node.name]
            assert plan.platform is not None
            house = houses.get(plan.platform.key)
            if isinstance(house, SetupError):
                return _failed(node.name, house, plan.platform)
            try:
                done = await apply_plan(transport, node, plan, states[node.name], house, log_dir=log_dir)
                after = plan_node(node, await inspect_node(transport, node), pins)
            except SetupError as exc:
                return _failed(node.name, exc, plan.platform)
            if after.changes or after.problem:
                return NodeSetup(node.name, Outcome.FAILED, tuple(done), "still differs after setup: "
                                 + "; ".join(after.reasons or (after.problem or "",)), plan.platform.key)
            return NodeSetup(node.name, Outcome.CHANGED, tuple(done), "; ".join(plan.reasons), plan.platform.key)

        applied = await fleet.map(apply, names=list(todo))
        for name, res in applied.items():
            out[name] = res if isinstance(res, NodeSetup) else _failed(name, res)
    return SetupReport(pins, tuple(out[n.name] for n in nodes if n.name in out), check)


async def inspect_node_safe(node: Node, transport: Transport) -> NodeState | SetupError | TransportError:
    """`inspect_node` with its failures as values (Fleet.connect_and_map keeps only TransportErrors)."""
    try:
        return await inspect_node(transport, node)
    except (SetupError, TransportError) as exc:
        return exc


def pins_from(mlx: str | None, mlx_lm: str | None) -> Pins:
    """The playbook's `software:` pins where given, the coordinator's own versions for the rest."""
    if mlx and mlx_lm:
        return Pins(mlx, mlx_lm, "the playbook's software:")
    own = coordinator_pins()
    if mlx or mlx_lm:
        return Pins(mlx or own.mlx, mlx_lm or own.mlx_lm, "the playbook's software: and the coordinator's own")
    return own


class SetupFailed(CoordinatorError):
    """At least one node ended `failed` (the per-node lines say why)."""
