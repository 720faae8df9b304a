"""This node's live training ranks, from its process table: what a new launch checks before it starts beside them.

    python -m worker.ranks --workdir WORKDIR
prints one JSON object, `{"ranks": [{"pid": P, "run_id": "...", "config": "<node run dir>/run.json"}, ...]}`:
every `worker.train` process of this user whose run.json is readable here and lies under WORKDIR/runs/ (where
the coordinator puts every run of this node). Another process (a config this node cannot read: another mount
namespace, a container, a run dir already deleted; or a trainer someone started by hand elsewhere) is left out.
Stdlib only, Python 3.9+; `ps -axo` is the same on Linux and macOS for what is asked of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

# The rank script's command (coordinator.run.launchfiles.build_rank_script): `<python> -m worker.train --config
# <node run dir>/run.json`, the path unquoted in the process table (it may hold spaces).
_RANK = re.compile(r"\s-m\s+worker\.train\s+--config\s+(.+?/run\.json)(?:\s|$)")


def parse_ps(text: str, uid: int) -> list[tuple[int, str]]:
    """`ps -axo pid=,uid=,command=` -> (pid, config path) of each worker.train process owned by `uid`."""
    found: list[tuple[int, str]] = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit() or int(parts[1]) != uid:
            continue
        match = _RANK.search(" " + parts[2])
        if match:
            found.append((int(parts[0]), match.group(1)))
    return found


def read_run_id(config: str) -> str | None:
    """The run id in a rank's run.json; None when this node cannot read it as one."""
    try:
        with open(config, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    run_id = doc.get("run_id") if isinstance(doc, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def live_ranks(workdir: str) -> list[dict[str, Any]]:
    try:
        out = subprocess.run(["ps", "-axo", "pid=,uid=,command="], capture_output=True, text=True, timeout=20,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    runs = os.path.join(os.path.realpath(os.path.expanduser(workdir)), "runs") + os.sep
    ranks = []
    for pid, config in parse_ps(out, os.getuid()):
        if not os.path.realpath(config).startswith(runs):
            continue
        run_id = read_run_id(config)
        if run_id is not None:
            ranks.append({"pid": pid, "run_id": run_id, "config": config})
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker.ranks", description="this node's live training ranks")
    parser.add_argument("--workdir", required=True, help="the node's workdir (its runs live in WORKDIR/runs)")
    args = parser.parse_args(argv)
    print(json.dumps({"ranks": live_ranks(args.workdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
