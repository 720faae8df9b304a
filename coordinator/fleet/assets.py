"""Provision a playbook's `assets:` on nodes that lack them: copy a small local dataset into `data`, build a
tiny deterministic model into `model`. Runs before preflight, so preflight still proves every copy identical.

Each dir is built under a temporary name and renamed into place, so two nodes that share a machine (local
nodes) or an interrupted run never leave a half-written dir under the final name. An existing dir is never
touched: provisioning only fills gaps.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

from coordinator.config.playbook import Playbook
from coordinator.errors import ConfigError, TransportError
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet, Transport, python_argv
from coordinator.models import Node

MAX_DATA_BYTES = 64 * 1024 * 1024  # assets are for demos and tests; real datasets are synced by the user

_PROVISION = r"""
import json, os, shutil, sys
from pathlib import Path
spec = json.load(sys.stdin)
result = {}

def place(target, make):
    target = os.path.expanduser(target)
    if os.path.isdir(target):
        return "present"
    parent = os.path.dirname(target.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = "%s.tmp-%d" % (target.rstrip("/"), os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    make(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another provisioner won the race with the same content
        return "present"
    return "created"

def write(tmp):
    for rel, content in sorted(spec["data"]["files"].items()):
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)

def fail(**answer):
    print(json.dumps(answer))
    sys.exit(3)

# One JSON line whatever happens: the coordinator shows a node's failure as one line, never a traceback.
try:
    if spec.get("data"):
        result["data"] = place(spec["data"]["path"], write)
    tiny = spec.get("tiny")
    if tiny:
        from worker.tinymodel import build_tiny_model  # numpy; tokenizers, mlx, mlx_lm when it builds
        vocab_from = Path(os.path.expanduser(tiny["data"])) if tiny.get("data") else None
        result["model"] = place(tiny["path"], lambda tmp: build_tiny_model(
            Path(tmp), vocab_from, layers=tiny["layers"], hidden=tiny["hidden"], seed=tiny["seed"]))
except ImportError as exc:
    fail(error="missing_module", module=(exc.name or str(exc)).split(".")[0], python=sys.executable)
except Exception as exc:
    fail(error="failed", message=" ".join(("%s: %s" % (type(exc).__name__, exc)).split()), python=sys.executable)
print(json.dumps(result))
"""


def read_data_files(pb: Playbook) -> dict[str, str]:
    """The local dataset named by `assets.data_from`, as {relative path: text}."""
    assert pb.assets.data_from is not None
    base = Path(pb.path).parent if pb.path else Path.cwd()
    root = (base / pb.assets.data_from).expanduser()
    if not root.is_dir():
        raise ConfigError(f"assets.data_from: {root} is not a directory", path=pb.path)
    files: dict[str, str] = {}
    total = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        total += path.stat().st_size
        if total > MAX_DATA_BYTES:
            raise ConfigError(f"assets.data_from: {root} is over {MAX_DATA_BYTES >> 20} MiB; copy large datasets "
                              "to the nodes yourself", path=pb.path)
        files[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    return files


def build_spec(pb: Playbook, data_files: dict[str, str] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if data_files is not None and pb.data:
        spec["data"] = {"path": pb.data, "files": data_files}
    tiny = pb.assets.tiny_model
    if tiny is not None:
        spec["tiny"] = {"path": pb.model, "data": pb.data, "layers": tiny.layers, "hidden": tiny.hidden,
                        "seed": tiny.seed}
    return spec


async def provision_node(transport: Transport, node: Node, spec: dict[str, Any]) -> dict[str, str]:
    worker_dir = await ship_worker(transport, node)
    argv = ["env", f"PYTHONPATH={worker_dir}", *python_argv(node.python, "-c", _PROVISION)]
    result = await transport.run(argv, stdin=json.dumps(spec), timeout=300)
    answer = _last_json(result.stdout)
    if result.ok and answer is not None and "error" not in answer:
        return {str(k): str(v) for k, v in answer.items()}
    raise TransportError(node.name, describe_failure(answer, result.stderr, node.python))


# Modules the tiny model needs whose pip package is named differently.
_PIP_NAMES = {"mlx_lm": "mlx-lm"}


def describe_failure(answer: dict[str, Any] | None, stderr: str, python: str) -> str:
    """One line for a failed provisioning: the missing module and the command that installs it, the node's own
    error, or the last line of its stderr (never a multi-line traceback)."""
    exe = str((answer or {}).get("python") or python)
    if answer is not None and answer.get("error") == "missing_module":
        module = str(answer.get("module"))
        return (f"cannot build assets.tiny_model: the node's python {exe} has no module {module!r} "
                f"(install it: {shlex.quote(exe)} -m pip install {shlex.quote(_PIP_NAMES.get(module, module))})")
    if answer is not None and answer.get("error"):
        return f"could not provision assets with {exe}: {answer.get('message') or answer['error']}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "no output")
    return f"could not provision assets with {exe}: {last[-400:]}"


def _last_json(stdout: str) -> dict[str, Any] | None:
    lines = stdout.strip().splitlines()
    try:
        value = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def provision(fleet: Fleet, pb: Playbook) -> dict[str, dict[str, str] | TransportError]:
    """Fill missing model/data dirs on every connected node; per-node failures come back as values."""
    if pb.assets.tiny_model is None and pb.assets.data_from is None:
        return {}
    spec = build_spec(pb, read_data_files(pb) if pb.assets.data_from else None)
    # Nodes that share one machine (local nodes) race on the same dirs: the rename makes that safe, but
    # running them one after the other avoids building the same model twice.
    local = [n for n in fleet.nodes if n.connection == "local" and n.name in fleet.connected]
    results: dict[str, dict[str, str] | TransportError] = {}
    for node in local[:1]:
        try:
            results[node.name] = await provision_node(fleet.transports[node.name], node, spec)
        except TransportError as exc:
            results[node.name] = exc
    rest = [n for n in fleet.nodes if n.name in fleet.connected and n.name not in results]

    async def one(node: Node) -> dict[str, str] | TransportError:
        try:
            return await provision_node(fleet.transports[node.name], node, spec)
        except TransportError as exc:
            return exc

    for node, res in zip(rest, await asyncio.gather(*(one(n) for n in rest)), strict=True):
        results[node.name] = res
    return results


# Which of the given dirs exist and hold anything. Run with the node's system python3 (launch --fix asks before
# setup, when the inventory's python may not exist yet). argv: one JSON object label -> dir.
_DIRS = r"""
import json, os, sys
out = {}
for label, d in json.loads(sys.argv[1]).items():
    d = os.path.expanduser(d)
    out[label] = ("files" if os.listdir(d) else "empty") if os.path.isdir(d) else "missing"
print(json.dumps(out))
"""


def provided_labels(pb: Playbook) -> tuple[str, ...]:
    """The synced dirs the playbook's `assets:` fill where they are missing (`model`, `data`)."""
    return (("model",) if pb.assets.tiny_model is not None else ()) + (("data",) if pb.assets.data_from else ())


async def look_at_dirs(fleet: Fleet, names: list[str], dirs: dict[str, str]) -> dict[str, dict[str, str] | None]:
    """label -> "missing" | "empty" | "files" for each node of `names`, with its system python3; None for a node
    that did not answer (not connected, no python3, an unreadable dir)."""
    async def one(name: str) -> dict[str, str] | None:
        if name not in fleet.connected:
            return None
        try:
            result = await fleet.transports[name].run(["python3", "-c", _DIRS, json.dumps(dirs)], timeout=60)
        except TransportError:
            return None
        answer = _last_json(result.stdout) if result.ok else None
        return {str(k): str(v) for k, v in answer.items()} if answer is not None else None

    return dict(zip(names, await asyncio.gather(*(one(n) for n in names)), strict=True))
