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


# A verb's `--help` answers at once (under 0.5 s on a busy 2-core machine): it imports click and the verb's
# module, none of these (each costs 0.1-1 s; together they made `status`, `monitor`, `dashboard`, `sync` and
# `setup --help` take 2-4 s). Measured as imports, not wall clock.
HEAVY = ("asyncssh", "cryptography", "rich", "pydantic", "yaml", "structlog", "mlx", "numpy")


def test_every_verbs_help_imports_nothing_heavy() -> None:
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "import coordinator.cli as cli\n"
        "names = cli.main.list_commands(None)\n"
        "out = {'(the group itself)': sorted(m.split('.')[0] for m in sys.modules)}\n"
        "for name in names:\n"
        "    before = set(sys.modules)  # before the verb's module is imported (get_command imports it)\n"
        "    cmd = cli.main.get_command(None, name)\n"
        "    subs = [[name, s] for s in cmd.list_commands(None)] if hasattr(cmd, 'list_commands') else []\n"
        "    for argv in [[name]] + subs:\n"
        "        result = CliRunner().invoke(cli.main, [*argv, '--help'])\n"
        "        assert result.exit_code == 0, (argv, result.output)\n"
        "        out[' '.join(argv)] = sorted(m.split('.')[0] for m in set(sys.modules) - before)\n"
        "        before = set(sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    imported = json.loads(done.stdout)
    assert {"status", "monitor", "dashboard", "sync", "setup", "launch", "quarantine list"} <= set(imported)
    heavy = {verb: sorted(set(mods) & set(HEAVY)) for verb, mods in imported.items() if set(mods) & set(HEAVY)}
    assert heavy == {}
