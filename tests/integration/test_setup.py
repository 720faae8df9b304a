"""`coordinator setup` over real SSH: a node whose `python:` is a venv path that does not exist yet gets the venv
(made by the node's system python3, Debian's 3.11), the pinned mlx[cpu] / mlx-lm from a wheelhouse pushed over
SFTP and installed with --no-index, and the worker; preflight's software check then passes, and a second setup
changes nothing.

The wheelhouse is the coordinator's own cache (~/.cache/mlx-coordinator/wheelhouse/<platform>/<pins>/, as a real
fleet uses it): the first run on a machine downloads it (~60 MB for linux-x86_64-cp311, seconds); every later run,
and every test after the first, reads it from the cache without the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import TestBed

VENV = "/srv/venvs/mlx"
SETUP_TIMEOUT = 600.0  # the first install of mlx-lm's dependencies into a fresh venv on a busy 2-core machine


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    bed = TestBed(tmp=tmp_path_factory.mktemp("setup") / "bed")
    try:
        bed.add_host("fresh")
        # Debian without python3-venv: its python3 cannot `import ensurepip` (a module on PYTHONPATH says so).
        bed.add_host("bare", env={"PYTHONPATH": "/srv/shadow"})
        yield bed
    finally:
        bed.close()


def node_results(stdout: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(stdout)
    validate_output("setup", doc)  # docs/json.md's schema, unknown keys refused
    return {n["node"]: n for n in doc["nodes"]}


def test_setup_creates_the_venv_then_preflight_passes_and_a_second_setup_is_a_no_op(
        bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    host = bed.host("fresh")
    inv = bed.write_inventory(tmp_path / "inv.yaml", [host], python=f"{VENV}/bin/python", workdir="/srv/work")
    pb = tmp_path / "pb.yaml"
    pb.write_text(yaml.safe_dump({"name": "setup-test", "model": "/srv/model", "data": "/srv/data"}))

    # --check says what it would do and does nothing.
    cp = run_cli("setup", "-i", str(inv), "--check", "--json", timeout=120)
    assert cp.returncode == 0, cp.stderr
    fresh = node_results(cp.stdout)["fresh"]
    assert fresh["status"] == "changed"
    assert f"create venv {VENV}" in fresh["actions"]
    assert any(a.startswith("install mlx[cpu]==") for a in fresh["actions"])
    assert not (host.srv / "venvs").exists()

    # Before: the software check fails, and its remedy names the fixing command.
    cp = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", timeout=120)
    software = software_result(cp.stdout)
    assert software["status"] == "fail", software
    assert f"coordinator setup -i {inv}" in software["remedy"]

    cp = run_cli("setup", "-i", str(inv), "--json", timeout=SETUP_TIMEOUT)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    fresh = node_results(cp.stdout)["fresh"]
    assert fresh["status"] == "changed", fresh
    assert (host.srv / "venvs" / "mlx" / "bin" / "python").exists()
    assert any(a.startswith("pushed ") for a in fresh["actions"]), fresh
    pushed = list((host.srv / "work" / ".coordinator" / "wheelhouse").glob("*/*/mlx_cpu-*.whl"))
    assert pushed, "the mlx-cpu wheel was pushed to the node's wheelhouse"

    cp = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", timeout=120)
    software = software_result(cp.stdout)
    assert software["status"] == "pass", software
    assert "(mlx-cpu)" in software["summary"]

    # A second run: nothing to do, nothing pushed, `ok`.
    cp = run_cli("setup", "-i", str(inv), "--json", timeout=120)
    assert cp.returncode == 0, cp.stderr
    fresh = node_results(cp.stdout)["fresh"]
    assert fresh["status"] == "ok", fresh
    assert fresh["actions"] == []
    assert json.loads(cp.stdout)["summary"] == {"ok": 1, "changed": 0, "failed": 0}

    cp = run_cli("setup", "-i", str(inv), timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert "ok: [fresh] up to date" in cp.stdout


def test_setup_fails_a_node_whose_python_is_not_a_venv_path(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = bed.write_inventory(tmp_path / "inv.yaml", [bed.host("fresh")], python="/srv/nowhere/python3.11",
                              workdir="/srv/work2")
    cp = run_cli("setup", "-i", str(inv), "--json", timeout=120)
    assert cp.returncode == 1
    fresh = node_results(cp.stdout)["fresh"]
    assert fresh["status"] == "failed"
    assert "is not a venv path" in fresh["message"]
    assert "coordinator: error: setup failed on fresh" in cp.stderr


def test_setup_bootstraps_pip_from_the_wheelhouse_where_python3_has_no_ensurepip(bed: TestBed, run_cli: RunCli,
                                                                               tmp_path: Path) -> None:
    host = bed.host("bare")
    (host.srv / "shadow").mkdir()
    (host.srv / "shadow" / "ensurepip.py").write_text("raise ImportError('no ensurepip: install python3-venv')\n")
    assert "no ensurepip" in bed.ssh(host, "python3 -m ensurepip --version").stderr
    inv = bed.write_inventory(tmp_path / "inv.yaml", [host], python="/srv/venvs/bare/bin/python", workdir="/srv/work")
    cp = run_cli("setup", "-i", str(inv), "--json", timeout=SETUP_TIMEOUT)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert node_results(cp.stdout)["bare"]["status"] == "changed"
    r = bed.ssh(host, "/srv/venvs/bare/bin/python -m pip --version; /srv/venvs/bare/bin/python -c 'import mlx.core'")
    assert r.returncode == 0 and r.stdout.startswith("pip "), r.stdout + r.stderr
    cp = run_cli("setup", "-i", str(inv), "--json", timeout=120)
    assert node_results(cp.stdout)["bare"]["status"] == "ok"


def software_result(stdout: str) -> dict[str, Any]:
    doc = json.loads(stdout)
    return next(c for n in doc["nodes"] if n["node"] == "fresh" for c in n["checks"] if c["id"] == "software")


# --- --network: two fake Macs joined by one Thunderbolt 5 cable --------------------------------------------------


@pytest.fixture(scope="module")
def macs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    """`mbp` and `studio` replay the two ends of one Thunderbolt 5 cable (mbp en1 = Thunderbolt 1, studio en3 =
    Thunderbolt 2), both with the Thunderbolt Bridge active; `lin` is a Linux host."""
    bed = TestBed(tmp=tmp_path_factory.mktemp("setup-net") / "bed")
    try:
        bed.add_host("mbp", mac_profile="m5max-mbp-tb5")
        bed.add_host("studio", mac_profile="m3ultra-studio-tb5")
        bed.add_host("lin")
        yield bed
    finally:
        bed.close()


def calls(bed: TestBed, name: str) -> list[list[str]]:
    """The networksetup calls the host's shim recorded (argv after the command), in order."""
    log = bed.host(name).srv / "networksetup.calls"
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def test_setup_network_prints_the_commands_and_runs_them_only_with_apply(macs: TestBed, run_cli: RunCli,
                                                                        tmp_path: Path) -> None:
    inv = macs.write_inventory(tmp_path / "inv.yaml")
    expected = {
        "mbp": [["-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
                ["-setmanual", "Thunderbolt 1", "192.168.0.1", "255.255.255.252"]],
        "studio": [["-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
                   ["-setmanual", "Thunderbolt 2", "192.168.0.2", "255.255.255.252"]],
    }

    cp = run_cli("setup", "-i", str(inv), "--network", timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert "# mbp: en1 192.168.0.1/30 <-> studio 192.168.0.2" in cp.stdout
    assert "  networksetup -setmanual 'Thunderbolt 1' 192.168.0.1 255.255.255.252" in cp.stdout  # root: no sudo
    assert "  networksetup -setmanual 'Thunderbolt 2' 192.168.0.2 255.255.255.252" in cp.stdout
    assert "changed: [mbp] would run" in cp.stdout
    assert "ok: [lin] not macOS: nothing to do" in cp.stdout
    assert "not applied: rerun with --apply" in cp.stdout
    assert calls(macs, "mbp") == [] and calls(macs, "studio") == []

    cp = run_cli("setup", "-i", str(inv), "--network", "--apply", "--json", timeout=120)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    validate_output("setup --network", doc)
    assert doc["applied"] is True
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert by_node["mbp"]["status"] == "changed" and by_node["lin"]["status"] == "ok"
    assert by_node["studio"]["addresses"] == [{"interface": "en3", "address": "192.168.0.2/30", "peer": "mbp",
                                               "peer_address": "192.168.0.1"}]
    for name, argvs in expected.items():
        assert calls(macs, name) == argvs, name
    assert by_node["mbp"]["commands"] == [" ".join(["networksetup", *a]).replace("Thunderbolt 1", "'Thunderbolt 1'")
                                          .replace("Thunderbolt Bridge", "'Thunderbolt Bridge'")
                                          for a in expected["mbp"]]


def test_setup_apply_without_network_is_a_usage_error(macs: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = macs.write_inventory(tmp_path / "inv.yaml")
    cp = run_cli("setup", "-i", str(inv), "--apply", timeout=60)
    assert cp.returncode == 2
    assert cp.stderr.strip() == "coordinator: error: --apply goes with --network (software setup applies unless --check)"


# --- the wheel cache is verified; a failed install leaves the node as it was -------------------------------------


def corrupt(path: Path) -> None:
    """Flip bytes in the middle of a file, keeping its size (what a bad disk or a torn copy leaves)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 256):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def cached_wheelhouse(run_cli: RunCli, inv: Path) -> tuple[Path, str]:
    """The coordinator's own cache of the bed's platform (downloaded once per machine, as the tests above use it)
    and its name `<platform>/<pins>`."""
    from coordinator.fleet.nodesetup import (
        Platform,
        coordinator_pins,
        default_wheelhouse_root,
        ensure_wheelhouse,
        wheelhouse_name,
    )

    cp = run_cli("setup", "-i", str(inv), "--check", "--json", timeout=120)
    [key] = {n["platform"] for n in json.loads(cp.stdout)["nodes"]}
    platform, pins, root = Platform("linux", "x86_64", (3, 11), (2, 36), "cpu"), coordinator_pins(), default_wheelhouse_root()
    assert key == platform.key, key
    asyncio.run(ensure_wheelhouse(platform, pins, root))
    return root / wheelhouse_name(platform, pins), wheelhouse_name(platform, pins)


def test_a_corrupted_wheel_is_named_removed_and_fetched_again_and_the_nodes_copy_is_checked_too(
        bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    host = bed.host("fresh")
    inv = bed.write_inventory(tmp_path / "inv.yaml", [host], python="/srv/venvs/cache/bin/python",
                              workdir="/srv/work-cache")
    good, name = cached_wheelhouse(run_cli, inv)
    copy = tmp_path / "wheelhouse"
    shutil.copytree(good, copy / name)
    [bad] = (copy / name).glob("mlx_cpu-*.whl")
    corrupt(bad)
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}

    # Offline (no index, and no mirror that holds it): one line naming the wheel, the cache and what to do; the
    # node is not touched.
    empty = tmp_path / "empty"
    empty.mkdir()
    cp = run_cli("setup", "-i", str(inv), "--json", "--wheelhouse", str(copy), "--find-links", str(empty), env=env,
                 timeout=SETUP_TIMEOUT)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    message = node_results(cp.stdout)["fresh"]["message"]
    assert message.startswith(f"the wheel cache {copy / name} held {bad.name} (sha256 "), message
    assert "removed, and fetching again failed (pip download for linux-x86_64-cp311-glibc2.36-cpu failed: " in message
    assert f"run setup again, or delete {copy / name} to download the whole platform again" in message
    assert "\n" not in message and "Traceback" not in cp.stdout + cp.stderr
    assert not bad.exists() and not (host.srv / "venvs" / "cache").exists()

    # The node's own copy of another wheel is bad too (the same size: a name-and-size check would keep it).
    remote = host.srv / "work-cache" / ".coordinator" / "wheelhouse" / name
    remote.mkdir(parents=True)
    [lm] = (good).glob("mlx_lm-*.whl")
    shutil.copy(lm, remote / lm.name)
    corrupt(remote / lm.name)

    # With a source again (a local mirror here, as --find-links; PyPI otherwise): fetched again, the node's copy
    # sent again, installed.
    cp = run_cli("setup", "-i", str(inv), "--json", "--wheelhouse", str(copy), "--find-links", str(good), env=env,
                 timeout=SETUP_TIMEOUT)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"wheel cache {copy / name}: {bad.name} (missing): removed, fetching again" in " ".join(cp.stderr.split())
    assert (copy / name / bad.name).read_bytes() == (good / bad.name).read_bytes()
    assert (remote / lm.name).read_bytes() == lm.read_bytes()
    assert node_results(cp.stdout)["fresh"]["status"] == "changed"
    r = bed.ssh(host, "/srv/venvs/cache/bin/python -c 'import mlx.core, mlx_lm'")
    assert r.returncode == 0, r.stderr


def test_a_failed_install_removes_the_venv_it_made_and_names_the_cause_and_the_log(
        bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    """A wheel bad at its source (its recorded hash is the bad file's: the check passes, pip fails on it): one line
    naming the wheel and pip's error, the venv this run made removed, pip's whole output in the named log."""
    host = bed.host("fresh")
    inv = bed.write_inventory(tmp_path / "inv.yaml", [host], python="/srv/venvs/broken/bin/python",
                              workdir="/srv/work-broken")
    good, name = cached_wheelhouse(run_cli, inv)
    copy = tmp_path / "wheelhouse"
    shutil.copytree(good, copy / name)
    [bad] = (copy / name).glob("mlx_lm-*.whl")
    corrupt(bad)
    marker = json.loads((copy / name / ".complete").read_text())
    marker["wheels"][bad.name] = hashlib.sha256(bad.read_bytes()).hexdigest()
    (copy / name / ".complete").write_text(json.dumps(marker))

    cp = run_cli("setup", "-i", str(inv), "--json", "--wheelhouse", str(copy), env={"XDG_STATE_HOME": str(tmp_path)},
                 timeout=SETUP_TIMEOUT)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    message = node_results(cp.stdout)["fresh"]["message"]
    assert re.search(rf"^`pip install mlx\[cpu\]==[^`]*` failed: {re.escape(bad.name)}: "
                     r"(zipfile\.BadZipFile|zlib\.error): ", message), message
    assert "; removed the venv /srv/venvs/broken this run had created (the node is as it was); full log: " in message
    log = Path(message.rsplit("full log: ", 1)[1])
    assert log.parent == tmp_path / "mlx-coordinator" / "setup-logs" and "Traceback" in log.read_text()
    assert "\n" not in message and "Traceback" not in cp.stdout + cp.stderr
    assert not (host.srv / "venvs" / "broken").exists()
