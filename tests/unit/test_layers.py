"""The pure core imports no I/O library (docs/architecture.md): checked in a fresh interpreter, where
`sys.modules` shows everything an import pulled in, however indirectly (one type import was enough to load
asyncssh into `coordinator.checks`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PURE = ("coordinator.checks", "coordinator.facts.build", "coordinator.facts.common", "coordinator.facts.linux",
        "coordinator.facts.macos", "coordinator.facts.model", "coordinator.plan", "coordinator.monitor",
        "coordinator.hostfile", "coordinator.models")

# I/O libraries, and our modules that do I/O (the transport, the launcher, the fan-out, the CLI shell).
FORBIDDEN = ("asyncssh", "subprocess", "asyncio", "rich", "click", "structlog", "coordinator.transport",
             "coordinator.launch", "coordinator.gather", "coordinator.job", "coordinator.preflight", "coordinator.cli")


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
    loaded = loaded_after(("coordinator.transport",))
    assert {"asyncssh", "coordinator.transport"} <= set(forbidden_in(loaded))
