"""The layers (docs/architecture.md, "Layers"): each package of coordinator/ imports only from its own layer and
the ones below it, read from the source (every import, however deep in a function: a lazy import is still a
dependency); and the pure core imports no I/O library, checked in a fresh interpreter, where `sys.modules` shows
everything an import pulled in, however indirectly (one type import was enough to load asyncssh into the checks)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. A module may import its own layer and those before it, never one after it.
LAYERS = ("coordinator.errors coordinator.models coordinator.units", "coordinator.config", "coordinator.facts",
          "coordinator.planning", "coordinator.fleet", "coordinator.preflight", "coordinator.run", "coordinator.views",
          "coordinator.cli")

# The pure core: decisions and parsing, no network, no processes, no event loop.
PURE_LAYERS = ("coordinator.errors", "coordinator.models", "coordinator.units", "coordinator.config",
               "coordinator.facts", "coordinator.planning", "coordinator.preflight.checks", "coordinator.preflight.lint",
               "coordinator.preflight.fix", "coordinator.run.monitor", "coordinator.run.signatures",
               "coordinator.run.launchfiles", "coordinator.run.replay")
IO_LIBRARIES = ("asyncssh", "subprocess", "asyncio")

PURE = ("coordinator.preflight.checks", "coordinator.preflight.lint", "coordinator.preflight.fix",
        "coordinator.facts.build", "coordinator.facts.common", "coordinator.facts.linux", "coordinator.facts.macos",
        "coordinator.facts.model", "coordinator.facts.probe", "coordinator.facts.topology",
        "coordinator.config.inventory", "coordinator.config.playbook", "coordinator.planning.plan",
        "coordinator.planning.estimate", "coordinator.planning.strategy", "coordinator.planning.shards",
        "coordinator.planning.hostfile", "coordinator.run.monitor", "coordinator.run.launchfiles", "coordinator.models",
        "coordinator.run.replay")

# I/O libraries, and our modules that do I/O (the transport, the launcher, the fan-out, the CLI shell).
FORBIDDEN = ("asyncssh", "subprocess", "asyncio", "rich", "click", "structlog", "coordinator.fleet",
             "coordinator.run.launch", "coordinator.run.job", "coordinator.preflight.pipeline", "coordinator.cli")


def layer_of(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names.split()):
            return i
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import in `source`, at any depth; `from a import b` names a.b too (b may be a
    module)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def upward_imports(module: str, source: str) -> list[str]:
    """Each import of `source` (the module `module`) that reaches a layer above the module's own."""
    own = layer_of(module)
    assert own is not None, f"{module} is in no layer: add its package to LAYERS"
    bad = []
    for line, target in imports_of(source):
        layer = layer_of(target)
        if layer is not None and layer > own:
            bad.append(f"{module}:{line} imports {target} ({LAYERS[own].split()[0]} -> {LAYERS[layer].split()[0]})")
    return sorted(set(bad))


def coordinator_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "coordinator").rglob("*.py") if module_name(p) not in ("coordinator",
                                                                                         "coordinator.__main__"))


def test_every_module_is_in_a_layer() -> None:
    assert [module_name(p) for p in coordinator_modules() if layer_of(module_name(p)) is None] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = [b for p in coordinator_modules() for b in upward_imports(module_name(p), p.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_pure_core_imports_no_io_library() -> None:
    bad = [f"{module_name(p)}:{line} imports {target}" for p in coordinator_modules()
           if any(module_name(p) == m or module_name(p).startswith(m + ".") for m in PURE_LAYERS)
           for line, target in imports_of(p.read_text(encoding="utf-8"))
           if target.split(".")[0] in IO_LIBRARIES]
    assert bad == []


def test_the_layer_check_can_fail() -> None:
    # An upward import, even a lazy one inside a function, is seen; one downward is not.
    source = "def f():\n    from coordinator.run.job import run_job\nfrom coordinator.models import Node\n"
    assert upward_imports("coordinator.planning.plan", source) == [
        "coordinator.planning.plan:2 imports coordinator.run.job (coordinator.planning -> coordinator.run)",
        "coordinator.planning.plan:2 imports coordinator.run.job.run_job (coordinator.planning -> coordinator.run)"]
    assert upward_imports("coordinator.cli.launch", source) == []


def loaded_after(modules: tuple[str, ...]) -> set[str]:
    """The modules loaded in a fresh interpreter by importing `modules` (and not by Python's own start-up)."""
    code = ("import importlib, json, sys\nbase = set(sys.modules)\n"
            f"for m in {list(modules)!r}:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(set(sys.modules) - base)))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def forbidden_in(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


@pytest.mark.parametrize("module", PURE)
def test_a_pure_layer_imports_no_io_library(module: str) -> None:
    loaded = loaded_after((module,))
    assert module in loaded
    assert forbidden_in(loaded) == []


def test_the_check_sees_an_io_import() -> None:
    # The check above must be able to fail: the transport's import is seen, asyncssh with it.
    loaded = loaded_after(("coordinator.fleet.transport",))
    assert {"asyncssh", "coordinator.fleet.transport"} <= set(forbidden_in(loaded))


# --- worker/ -------------------------------------------------------------------------------------------------------
# The worker runs on the nodes, alone: it never imports the coordinator. Inside it, bottom to top: the flat modules
# (data, step, checkpoint, comm, ...), then the strategies (worker.parallel: one per layout), then the programs that
# drive them (the trainer and the bench). A strategy may use any flat module, never the trainer.
WORKER_PROGRAMS = ("worker.train", "worker.bench")


def worker_layer_of(module: str) -> int | None:
    if not (module == "worker" or module.startswith("worker.")):
        return None
    if module in WORKER_PROGRAMS or any(module.startswith(p + ".") for p in WORKER_PROGRAMS):
        return 2
    if module == "worker.parallel" or module.startswith("worker.parallel."):
        return 1
    return 0


def worker_violations(module: str, source: str) -> list[str]:
    own = worker_layer_of(module)
    assert own is not None
    bad = []
    for line, target in imports_of(source):
        if target == "coordinator" or target.startswith("coordinator."):
            bad.append(f"{module}:{line} imports {target} (the worker never imports the coordinator)")
        layer = worker_layer_of(target)
        if layer is not None and layer > own:
            bad.append(f"{module}:{line} imports {target} (a layer above its own)")
    return sorted(set(bad))


def worker_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "worker").rglob("*.py") if module_name(p) != "worker")


def test_no_worker_module_imports_the_coordinator_or_a_layer_above_its_own() -> None:
    assert [module_name(p) for p in worker_modules() if module_name(p).startswith("worker.parallel")]  # seen
    bad = [b for p in worker_modules() for b in worker_violations(module_name(p), p.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_worker_layer_check_can_fail() -> None:
    source = "def f():\n    from worker.train import Trainer\nimport coordinator.models\nfrom worker.step import x\n"
    assert worker_violations("worker.parallel.dp", source) == [
        "worker.parallel.dp:2 imports worker.train (a layer above its own)",
        "worker.parallel.dp:2 imports worker.train.Trainer (a layer above its own)",
        "worker.parallel.dp:3 imports coordinator.models (the worker never imports the coordinator)"]
    assert worker_violations("worker.step", "from worker.parallel import make_strategy\n") == [
        "worker.step:1 imports worker.parallel (a layer above its own)",
        "worker.step:1 imports worker.parallel.make_strategy (a layer above its own)"]
    assert worker_violations("worker.train", source) == [
        "worker.train:3 imports coordinator.models (the worker never imports the coordinator)"]
