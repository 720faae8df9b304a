"""`coordinator facts` end to end: the real CLI over real SSH against fake Macs that replay recorded profiles.

`--record DIR` must give back exactly what the node printed, so a recording of a fake Mac is its profile again,
byte for byte, and can itself be replayed.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.facts.probe import MACOS_COMMANDS
from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import PROFILES_DIR, VENV_PYTHON, TestBed

CONNECT_TIMEOUT = "30"  # seconds: generous, for a loaded CI machine
MACOS_SECTIONS = {"uname", "df", *(name for name, _ in MACOS_COMMANDS)}
PROFILES = {"mbp": "m5max-mbp-tb5", "nodev": "m4max-mbp-tb4-rdma-nodev", "old": "m1max-macos14"}


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    """Three fake Macs (one per PROFILES entry), a Linux host, and `down`, whose sshd never starts."""
    bed = TestBed(tmp=tmp_path_factory.mktemp("facts") / "bed")
    try:
        for name, profile in PROFILES.items():
            bed.add_host(name, mac_profile=profile)
        bed.add_host("lin")
        bed.add_host("down", start_sshd=False)
        yield bed
    finally:
        bed.close()


def inventory(bed: TestBed, path: Path, *names: str) -> Path:
    return bed.write_inventory(path, [bed.host(n) for n in names])


def facts(run_cli: RunCli, inv: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    cp = run_cli("facts", "-i", str(inv), "--json", "--connect-timeout", CONNECT_TIMEOUT, *args, timeout=120)
    assert "Traceback" not in cp.stderr, cp.stderr
    doc = json.loads(cp.stdout)
    assert set(doc) == {"nodes"}
    validate_output("facts", doc)  # docs/json.md's schema, unknown keys refused
    return cp, doc


def by_node(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["node"]: n for n in doc["nodes"]}


def test_facts_json_of_a_fake_mac_and_a_linux_host(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    cp, doc = facts(run_cli, inventory(bed, tmp_path / "inv.yaml", "mbp", "lin"))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert [n["node"] for n in doc["nodes"]] == ["mbp", "lin"]
    mbp, lin = by_node(doc)["mbp"], by_node(doc)["lin"]

    assert mbp["errors"] == [] and "raw" not in mbp and "raw_rc" not in mbp  # raw outputs only with --raw
    assert mbp["os"] == {"system": "Darwin", "arch": "arm64", "kernel": "25.5.0", "name": "macOS", "version": "26.5",
                         "build": "25F71"}
    hw = mbp["hardware"]
    assert (hw["chip"], hw["model_id"], hw["model_name"]) == ("Apple M5 Max", "Mac17,7", "MacBook Pro")
    assert hw["memory_bytes"] == 128 * 1024**3 and hw["cpu_total"] == 18 and hw["gpu_cores"] == 40
    linked = [p for p in mbp["thunderbolt"] if p["connected"]]
    assert [(p["receptacle"], p["speed_gbps"], p["peer_name"], p["peer_model"], p["peer_rdma_service"])
            for p in linked] == [("1", 80.0, "Mac Studio", "Mac15,14", True)]
    assert mbp["rdma"] == {"ctl_status": "enabled", "devices": [
        {"name": "rdma_en1", "port_state": "PORT_ACTIVE"}, {"name": "rdma_en6", "port_state": "PORT_DOWN"},
        {"name": "rdma_en2", "port_state": "PORT_DOWN"}]}  # fmt: skip
    assert {"port": "Thunderbolt 1", "device": "en1"} in mbp["hardware_ports"]
    assert next(i for i in mbp["interfaces"] if i["name"] == "en1")["ipv4"] == ["192.168.10.1"]
    assert mbp["power"]["sleep_minutes"] == 0 and mbp["power"]["on_battery"] is False
    assert mbp["disk"]["mount"] == "/System/Volumes/Data" and mbp["disk"]["path"] == "/srv/work"
    assert mbp["software"]["python"] == VENV_PYTHON and mbp["software"]["mlx_version"]
    assert mbp["reach"] == [{"peer": "lin", "ip": bed.host("lin").ip, "ok": True,
                             "rtt_ms": mbp["reach"][0]["rtt_ms"], "error": None}]
    assert mbp["hashes"] == [] and mbp["model_config"] is None  # no playbook: nothing to hash

    assert lin["errors"] == []
    assert lin["os"]["system"] == "Linux" and lin["os"]["build"] is None
    assert lin["rdma"] == {"ctl_status": None, "devices": []} and lin["thunderbolt"] is None
    assert lin["hardware"]["cpu_total"] and lin["memory"]["total_bytes"]


def test_record_gives_back_the_profiles_byte_for_byte(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    record = tmp_path / "recorded"
    cp, _ = facts(run_cli, inventory(bed, tmp_path / "inv.yaml", *PROFILES), "--record", str(record))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert sorted(p.name for p in record.iterdir()) == sorted(PROFILES)
    for node, profile in PROFILES.items():
        src, got = PROFILES_DIR / profile, record / node
        wanted = {p.name for p in src.iterdir()}
        # Every macOS section of the profile, with its exit status when non-zero; plus the probe's own sections.
        assert {p.name for p in got.iterdir()} - {"env.out", "worker.out"} == wanted, node
        assert {p.name.split(".")[0] for p in src.glob("*.out")} == MACOS_SECTIONS, profile
        for name in sorted(wanted):
            assert (got / name).read_bytes() == (src / name).read_bytes(), f"{node}/{name} differs from {profile}"
        assert json.loads((got / "worker.out").read_text())["python"]["executable"] == VENV_PYTHON
        assert f"PATH={bed.host(node).shims}:" in (got / "env.out").read_text()
    assert (record / "old" / "rdma_ctl.rc").read_text() == "127\n"  # macOS 14: the command does not exist
    assert (record / "nodev" / "ibv_devinfo.rc").read_text() == "255\n"


def test_a_recording_replays_as_the_same_mac(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    """What `--record` wrote is a profile: a new fake Mac made from it has the same facts as the original."""
    record = tmp_path / "recorded"
    cp, first = facts(run_cli, inventory(bed, tmp_path / "inv.yaml", "nodev"), "--record", str(record))
    assert cp.returncode == 0, cp.stderr
    replay = bed.add_host("replay", mac_profile=record / "nodev")
    cp, second = facts(run_cli, bed.write_inventory(tmp_path / "inv2.yaml", [replay]))
    assert cp.returncode == 0, cp.stderr
    original, again = by_node(first)["nodev"], by_node(second)["replay"]
    for key in ("os", "hardware", "thunderbolt", "hardware_ports", "interfaces", "rdma", "memory", "power", "disk",
                "gpu", "errors"):
        assert again[key] == original[key], key


def test_limit_selects_nodes_in_inventory_order(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    record = tmp_path / "recorded"
    inv = inventory(bed, tmp_path / "inv.yaml", "mbp", "nodev", "old", "down")
    cp, doc = facts(run_cli, inv, "--limit", "old,nodev", "--record", str(record))
    assert cp.returncode == 0, cp.stdout + cp.stderr  # `down` is not asked, so nothing is unreachable
    assert [n["node"] for n in doc["nodes"]] == ["nodev", "old"]
    assert sorted(p.name for p in record.iterdir()) == ["nodev", "old"]
    # The limited fleet is the whole fleet for the probe too: each node checks reachability of the other only.
    assert [r["peer"] for r in by_node(doc)["nodev"]["reach"]] == ["old"]
    assert [r["peer"] for r in by_node(doc)["old"]["reach"]] == ["nodev"]


def test_an_unreachable_node_is_reported_and_fails(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    record = tmp_path / "recorded"
    inv = inventory(bed, tmp_path / "inv.yaml", "mbp", "down")
    cp, doc = facts(run_cli, inv, "--record", str(record))
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert [n["node"] for n in doc["nodes"]] == ["mbp", "down"]
    down = by_node(doc)["down"]
    assert down == {"node": "down", "unreachable": down["unreachable"]}
    assert down["unreachable"].startswith(f"down: cannot connect to {bed.host('down').ip}")
    assert by_node(doc)["mbp"]["os"]["name"] == "macOS"
    assert sorted(p.name for p in record.iterdir()) == ["mbp"]


def test_facts_table(bed: TestBed, run_cli: RunCli, tmp_path: Path) -> None:
    inv = inventory(bed, tmp_path / "inv.yaml", "mbp", "old")
    cp = run_cli("facts", "-i", str(inv), "--connect-timeout", CONNECT_TIMEOUT, timeout=120)
    assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stdout + cp.stderr
    assert "macOS 26.5 (25F71), arm64, kernel 25.5.0" in cp.stdout
    assert "macOS 14.6.1 (23G93), arm64, kernel 23.6.0" in cp.stdout
    assert "rcpt 1: 80 Gb/s -> Mac Studio Mac15,14" in cp.stdout
    assert "n/a; no devices" in cp.stdout  # the M1 Max on macOS 14 has no rdma_ctl
