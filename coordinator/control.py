"""`coordinator attach RUN_ID` and `coordinator stop RUN_ID`: act on a run another coordinator started.

The job does not depend on the coordinator process: mlx.launch runs in its own session and the ranks on the
nodes. `runs/<id>/meta.json` (written at each launch) names the attempt's nodes, ranks, node run dirs and the
launcher's PID; the nodes' event files hold everything else, so a new coordinator rebuilds the monitor's state
by replaying them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.errors import ConfigError
from coordinator.hostfile import Hostfile
from coordinator.inventory import load_inventory
from coordinator.launch import Launch, RankPlan, RunSummary, ViewFn, summarize, write_summary
from coordinator.models import Inventory
from coordinator.monitor import RunState
from coordinator.playbook import load_playbook
from coordinator.transport import DEFAULT_CONNECT_TIMEOUT, Fleet


def read_meta(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "meta.json"
    try:
        meta: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no run at {run_dir} (missing meta.json): see `ls {run_dir.parent}`") from None
    except ValueError as exc:
        raise ConfigError(f"unreadable run metadata: {exc}", path=str(path)) from None
    return meta


def _adopt(fleet: Fleet, run_dir: Path, meta: dict[str, Any], inv: Inventory, view: ViewFn | None) -> Launch:
    playbook_path = meta.get("playbook")
    pb = load_playbook(playbook_path if playbook_path and Path(playbook_path).exists() else run_dir / "playbook.yaml")
    by_name = {n.name: n for n in inv.nodes}
    ranks = [RankPlan(r["rank"], by_name[r["node"]], r["batch_size"], r.get("calibrated_tokens_per_s"))
             for r in meta["ranks"]]
    hostfile = Hostfile.from_json(json.loads((run_dir / "hostfile.json").read_text(encoding="utf-8")))
    launch = Launch(fleet, pb, ranks, hostfile, {}, run_id=meta["run_id"], run_dir=run_dir, view=view,
                    attempt=int(meta.get("attempt", 0)))
    launch.remote_run_dirs = dict(meta.get("remote_run_dirs") or {})
    launch.launcher_pid = meta.get("launcher_pid")
    launch.inventory_path = meta.get("inventory")
    return launch


def _inventory(meta: dict[str, Any], inventory: str | None) -> Inventory:
    path = inventory or meta.get("inventory")
    if not path:
        raise ConfigError("the run does not record its inventory: pass -i INVENTORY")
    inv = load_inventory(path)
    missing = [n for n in meta["nodes"] if n not in inv.names()]
    if missing:
        raise ConfigError(f"the inventory {path} lacks the run's node(s) {', '.join(missing)}")
    return inv.limit(list(meta["nodes"]))


async def attach(run_dir: Path, *, inventory: str | None = None, view: ViewFn | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> RunSummary:
    """Resume monitoring a running job until it ends; then tear down as `launch` would."""
    meta = read_meta(run_dir)
    inv = _inventory(meta, inventory)
    async with Fleet(inv.nodes, connect_timeout=connect_timeout) as fleet:
        await fleet.connect_all()
        launch = _adopt(fleet, run_dir, meta, inv, view)
        mon = None
        try:
            mon = await launch.monitor()
        finally:
            await launch.teardown(mon or launch.current_monitor)
        summary = summarize(launch, mon, launch.split(), "attached")
        write_summary(run_dir, summary)
        return summary


async def stop(run_dir: Path, *, inventory: str | None = None,
               connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> RunSummary:
    """Stop a run cleanly: the launcher's process group, every rank on every node, our temp files."""
    meta = read_meta(run_dir)
    inv = _inventory(meta, inventory)
    async with Fleet(inv.nodes, connect_timeout=connect_timeout) as fleet:
        await fleet.connect_all()
        launch = _adopt(fleet, run_dir, meta, inv, None)
        mon = launch.new_monitor()
        mon.stopped = True
        await launch.teardown(mon)
    previous: dict[str, Any] = {}
    try:
        previous = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = {}
    summary = summarize(launch, mon, launch.split(), "stopped by `coordinator stop`")
    summary.state = RunState.STOPPED
    summary.steps = max(summary.steps, int(previous.get("steps") or 0))
    write_summary(run_dir, summary)
    return summary
