"""The console script's start-up: the garbage collector is off while a verb imports, back on for its event loop."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
from importlib import metadata

from coordinator.cli.common import run_async


def test_the_console_script_is_entry_and_starts_with_the_collector_off() -> None:
    [script] = [e for e in metadata.entry_points(group="console_scripts") if e.name == "coordinator"]
    assert script.value == "coordinator.cli:entry"
    code = (
        "import asyncio, gc, json, coordinator.cli as cli\n"
        "from coordinator.cli.common import run_async\n"
        "async def inside():\n"
        "    return gc.isenabled()\n"
        "def verb():\n"
        "    before = gc.isenabled()\n"
        "    print(json.dumps([before, run_async(inside()), gc.get_freeze_count() > 1000]))\n"
        "cli.main = verb\n"
        "cli.entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # off while importing; on inside the loop; the start-up's objects frozen out of the collector's sight
    assert json.loads(done.stdout) == [False, True, True]


def test_run_async_leaves_an_enabled_collector_alone() -> None:
    # Tests (and anything calling `main` in-process) keep their collector and nothing is frozen.
    async def inside() -> bool:
        await asyncio.sleep(0)
        return gc.isenabled()

    frozen = gc.get_freeze_count()
    assert gc.isenabled()
    assert run_async(inside()) is True
    assert gc.get_freeze_count() == frozen
