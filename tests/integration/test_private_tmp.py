"""The run's temp dir on the nodes is private: another local user's dir in /tmp is never used, written or removed.

/tmp is shared by every user of a node (and, on the bed, by every host: only /srv is per host), and the rank script
written there runs as the SSH user. A user who created `/tmp/mlxc-<run id>` first used to own the dir the
coordinator then wrote the rank script into. Now each attempt makes `/tmp/mlxc-<run id>-<16 random hex>`: the
predictable name is not used at all, and a dir at the random name that is not a 0700 dir of the SSH user is
refused before anything is written (docs/faults.md, "Temp dirs").
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shlex
import shutil
import stat
from pathlib import Path

import pytest

from coordinator.config.inventory import load_inventory
from coordinator.errors import TransportError
from coordinator.fleet.ship import ship_worker
from coordinator.fleet.transport import Fleet
from coordinator.run.launch import write_private_files
from tests.integration.conftest import RunCli
from tests.integration.test_launch import launch, write_playbook
from tests.testbed import TestBed

NOBODY = pwd.getpwnam("nobody")
PLANTED = "#!/bin/sh\ntouch /tmp/pwned-by-nobody\n"


def plant(path: Path, mode: int) -> None:
    """A dir of user `nobody` holding its own `rank` script, as another local user could leave it."""
    path.mkdir()
    (path / "rank").write_text(PLANTED)
    for p in (path / "rank", path):
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)
    path.chmod(mode)


def untouched(path: Path) -> bool:
    st = path.lstat()
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == NOBODY.pw_uid and sorted(os.listdir(path)) == ["rank"]
            and (path / "rank").read_text() == PLANTED)


def test_another_users_dir_at_the_runs_temp_path_is_not_used(testbed: TestBed, run_cli: RunCli,
                                                             tmp_path: Path) -> None:
    """A resumed run (its id is known, so its old temp path was too): `nobody` squats the old path and a path
    matching the new pattern; the run succeeds in a fresh private dir and leaves both squatted dirs as they were."""
    hosts = testbed.add_hosts(1)
    inv = testbed.write_inventory(tmp_path / "inv.yaml", hosts)
    first_proc, first = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=2, name="sq"))
    assert first_proc.returncode == 0, first_proc.stderr[-3000:]
    run_id = first["run_id"]
    squatted = [Path(f"/tmp/mlxc-{run_id}"), Path(f"/tmp/mlxc-{run_id}-0123456789abcdef")]
    try:
        plant(squatted[0], 0o777)
        plant(squatted[1], 0o700)
        proc, summary = launch(run_cli, tmp_path, inv, write_playbook(tmp_path / "pb.yaml", iters=4, name="sq"),
                               "--resume", run_id)
        assert proc.returncode == 0 and summary["state"] == "succeeded" and summary["steps"] == 4, proc.stderr[-3000:]
        argv = shlex.split((tmp_path / "runs" / run_id / "launcher.argv").read_text())
        cwd = argv[argv.index("--cwd") + 1]
        assert re.fullmatch(rf"/tmp/mlxc-{re.escape(run_id)}-[0-9a-f]{{16}}", cwd) and Path(cwd) not in squatted
        assert json.loads((tmp_path / "runs" / run_id / "meta.json").read_text())["remote_tmp_dir"] == cwd
        for path in squatted:
            assert untouched(path), path  # not written into, not removed by the teardown
        assert not Path("/tmp/pwned-by-nobody").exists()
        # Our own temp dirs are gone (seen from the node), the squatted ones stay.
        left = testbed.exec(hosts[0], ["find", "/tmp", "-maxdepth", "1", "-name", f"mlxc-{run_id}*"], check=True)
        assert sorted(left.stdout.split()) == sorted(map(str, squatted))
    finally:
        for path in squatted:
            shutil.rmtree(path, ignore_errors=True)


def test_the_node_refuses_a_temp_dir_it_does_not_own(testbed: TestBed, tmp_path: Path) -> None:
    """The node-side check over real SSH (what `Launch.prepare` runs before writing the rank script): another
    user's dir, whatever its mode, and a symlink are refused with the reason and nothing is written; a fresh path
    becomes a 0700 dir of the SSH user."""
    hosts = testbed.add_hosts(1)
    inv = load_inventory(str(testbed.write_inventory(tmp_path / "inv.yaml", hosts)))
    node = inv.nodes[0]
    token = os.urandom(6).hex()
    theirs_open, theirs_private = Path(f"/tmp/mlxc-itest-{token}-open"), Path(f"/tmp/mlxc-itest-{token}-private")
    ours = Path(f"/tmp/mlxc-itest-{token}-ours")
    link, fresh = Path(f"/tmp/mlxc-itest-{token}-link"), Path(f"/tmp/mlxc-itest-{token}-fresh")

    async def write(path: Path) -> None:
        async with Fleet(inv.nodes) as fleet:
            await fleet.connect_all()
            assert not fleet.failed, fleet.failed
            transport = fleet.transports[node.name]
            worker_dir = await ship_worker(transport, node)
            await write_private_files(transport, node, worker_dir, str(path), {"rank": ("echo ours\n", "700")})

    try:
        plant(theirs_open, 0o777)
        plant(theirs_private, 0o700)
        ours.mkdir(mode=0o700)
        link.symlink_to(ours)
        for path, why in ((theirs_open, f"exists and is owned by uid {NOBODY.pw_uid}, not by this user (uid 0)"),
                          (theirs_private, f"exists and is owned by uid {NOBODY.pw_uid}, not by this user (uid 0)"),
                          (link, "is a symbolic link")):
            with pytest.raises(TransportError) as err:
                asyncio.run(write(path))
            assert str(err.value) == f"{node.name}: temp dir: {path} {why}: refusing to use it"
        assert untouched(theirs_open) and untouched(theirs_private) and os.listdir(ours) == []
        asyncio.run(write(fresh))
        st = fresh.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
        assert (fresh / "rank").read_text() == "echo ours\n" and stat.S_IMODE((fresh / "rank").stat().st_mode) == 0o700
    finally:
        link.unlink(missing_ok=True)
        for path in (theirs_open, theirs_private, ours, fresh):
            shutil.rmtree(path, ignore_errors=True)
