"""Failures around the files a verb writes, and on a node that cannot build assets, through the real CLI: one
`coordinator: error: ...` line and exit 2 (usage, configuration) or 1 (the job), never a traceback.

No test bed: every case fails before any SSH connection (the inventories name TEST-NET-1 addresses, which
nothing answers), or runs on a `connection: local` node.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import RunCli

INVENTORY = "nodes:\n  - name: a\n    host: 192.0.2.1\n"
PLAYBOOK = "name: t\nmodel: /srv/model\ndata: /srv/data\nsplit: equal\n"


def one_error_line(cp: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    assert cp.returncode == code, (cp.returncode, cp.stdout, cp.stderr)
    assert "Traceback" not in cp.stderr and "Traceback" not in cp.stdout, cp.stderr
    errors = [line for line in cp.stderr.splitlines() if line.startswith("coordinator: error: ")]
    assert len(errors) == 1 and cp.stderr.rstrip("\n").endswith(errors[0]), cp.stderr  # the last line, alone
    for fragment in fragments:
        assert fragment in errors[0], (fragment, cp.stderr)
    return errors[0]


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    inv, pb = tmp_path / "inv.yaml", tmp_path / "pb.yaml"
    inv.write_text(INVENTORY)
    pb.write_text(PLAYBOOK)
    return inv, pb


def launch(run_cli: RunCli, tmp_path: Path, inv: Path, pb: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("launch", "-i", str(inv), str(pb), "--json", *extra,
                   env={"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache")},
                   timeout=120)


@pytest.mark.parametrize("where", ["under-a-file", "unwritable"])
def test_a_run_dir_that_cannot_be_created(where: str, files: tuple[Path, Path], tmp_path: Path,
                                          run_cli: RunCli) -> None:
    (tmp_path / "a-file").write_text("")
    # /sys refuses mkdir even to root (the tests run as root, whom file modes do not stop).
    root = tmp_path / "a-file" / "runs" if where == "under-a-file" else Path("/sys/mlxc-test-runs")
    cp = launch(run_cli, tmp_path, *files, "--run-dir", str(root))
    reason = "Not a directory" if where == "under-a-file" else "Operation not permitted"
    one_error_line(cp, 2, f"--run-dir {root}: cannot create the run dir {root}/t-", f"({reason})")
    assert cp.stdout == ""


def test_an_over_long_playbook_name_is_a_usage_error_with_its_line(files: tuple[Path, Path], tmp_path: Path,
                                                                   run_cli: RunCli) -> None:
    """The run id (name + 21 characters) and the temp dir (+ 22) must fit a 255-byte file name."""
    inv, pb = files
    pb.write_text(PLAYBOOK.replace("name: t", "name: " + "n" * 240))
    cp = launch(run_cli, tmp_path, inv, pb, "--run-dir", str(tmp_path / "runs"))
    one_error_line(cp, 2, f"{pb}:1: ", "name of 240 characters; at most 200")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("run_id", "fragment"), [
    ("r" * 300, "a run id of 300 characters; at most 233"),
    ("../../etc", "--resume '../../etc': not a run id"),
])
def test_a_bad_resume_run_id_is_a_usage_error(run_id: str, fragment: str, files: tuple[Path, Path], tmp_path: Path,
                                              run_cli: RunCli) -> None:
    cp = launch(run_cli, tmp_path, *files, "--run-dir", str(tmp_path / "runs"), "--resume", run_id)
    one_error_line(cp, 2, fragment)
    assert not (tmp_path / "runs").exists()


def test_hostfile_into_a_missing_directory(files: tuple[Path, Path], tmp_path: Path, run_cli: RunCli) -> None:
    inv, pb = files
    out = tmp_path / "no-such-dir" / "hostfile.json"
    cp = run_cli("hostfile", "-i", str(inv), "-p", str(pb), "-o", str(out), timeout=60)
    assert one_error_line(cp, 2) == (f"coordinator: error: -o {out}: cannot write the hostfile "
                                      "(No such file or directory)")
    assert cp.stdout == ""


def test_a_node_without_numpy_building_the_tiny_model(tmp_path: Path, run_cli: RunCli) -> None:
    """assets.tiny_model is built on the node, with the node's python: one without numpy gets one line naming
    the node, the module and the command that installs it (exit 1: the job could not run)."""
    bare = tmp_path / "python-bare"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # no site-packages: no numpy, for certain
    bare.chmod(0o755)
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"nodes": [{"name": "bare", "connection": "local", "python": str(bare),
                                              "workdir": str(tmp_path / "work")}]}))
    pb = tmp_path / "pb.yaml"
    pb.write_text(yaml.safe_dump({"name": "t", "model": str(tmp_path / "model"), "data": str(tmp_path / "data"),
                                  "split": "equal", "assets": {"tiny_model": {"layers": 1, "hidden": 8}}}))
    cp = launch(run_cli, tmp_path, inv, pb, "--run-dir", str(tmp_path / "runs"))
    one_error_line(cp, 1, "coordinator: error: bare: cannot build assets.tiny_model: the node's python ",
                   "has no module 'numpy' (install it: ", " -m pip install numpy)")
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize(("verb", "value"), [
    ("launch", ""), ("launch", ","), ("launch", " , "), ("setup", ""), ("sync", ","), ("status", " "),
    ("preflight", "a,,a"),
])
def test_a_limit_that_names_no_node_is_refused_not_widened_to_the_fleet(verb: str, value: str, files: tuple[Path, Path],
                                                                        tmp_path: Path, run_cli: RunCli) -> None:
    """`--limit "$NODES"` with an empty variable: exit 2 before any connection, never the whole fleet."""
    inv, pb = files
    args = {"launch": [str(pb), "--run-dir", str(tmp_path / "runs")], "setup": [], "sync": ["-p", str(pb)],
            "status": ["--run-dir", str(tmp_path / "runs")], "preflight": ["-p", str(pb)]}[verb]
    cp = run_cli(verb, "-i", str(inv), "--limit", value, *args,
                 env={"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=60)
    what = "has an empty name between commas" if value.strip(", ") else "names no node"
    one_error_line(cp, 2, f"coordinator: error: --limit {value!r} {what}: give comma-separated node names")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_a_chaos_drill_that_cannot_fire_is_refused_at_launch(files: tuple[Path, Path], tmp_path: Path,
                                                             run_cli: RunCli) -> None:
    """A step past train.iters (and, below, a rank that the quarantine leaves out of the run): exit 2 before any
    connection (the inventories name TEST-NET-1 addresses), never a drill that runs without its fault."""
    inv, pb = files
    pb.write_text(PLAYBOOK + "train: {iters: 10}\n")
    cp = launch(run_cli, tmp_path, inv, pb, "--run-dir", str(tmp_path / "runs"), "--chaos", "kill:rank=0,step=11")
    one_error_line(cp, 2, "--chaos 'kill:rank=0,step=11': step 11 is never reached: the run trains 10 step(s)")
    assert not (tmp_path / "runs").exists()


def test_a_chaos_drill_on_a_rank_the_quarantine_leaves_out_is_refused(files: tuple[Path, Path], tmp_path: Path,
                                                                     run_cli: RunCli) -> None:
    from coordinator.models import Node
    from coordinator.run.quarantine import QuarantineStore, inventory_key, new_entry

    inv, pb = files
    inv.write_text(INVENTORY + "  - name: b\n    host: 192.0.2.2\n")
    store = QuarantineStore(tmp_path / "state" / "mlx-coordinator" / "quarantine.json")
    store.add(new_entry(Node("b", "192.0.2.2"), inventory_key(str(inv)), "crash at step 3", run_id=None, incident={},
                        host_key=None, now=time.time(), quarantine_for=3600))
    cp = launch(run_cli, tmp_path, inv, pb, "--run-dir", str(tmp_path / "runs"), "--allow-degraded",
                "--connect-timeout", "1", "--chaos", "kill:rank=1,step=2")
    one_error_line(cp, 2, "--chaos kill:rank=1,step=2: rank 1 is not a rank of this run (ranks 0..0) (quarantine "
                          "leaves out b); the drill would run without its fault")
    assert not (tmp_path / "runs").exists()
