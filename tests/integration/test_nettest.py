"""`coordinator nettest` end to end: the real CLI over real SSH between test-bed hosts (tests/testbed.py).

Bed hosts are Linux network namespaces on one bridge: each data IP sits on `eth0`, the namespace end of a veth
pair, which /sys/class/net shows as virtual, so every link is `virtual` and judged on positive throughput and RTT
only. What is checked here is that the link kind comes from the hosts' kernels, that every pair is measured for
real (bytes went from each data IP to the other in both directions) and that an unreachable host fails its
pairs without stopping the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import TestBed

SECONDS = "0.3"  # per direction per pair: enough bytes to be measured, short enough for a 2-core box


def _pairs(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["a"], p["b"]): p for p in doc["pairs"]}


def test_nettest_measures_every_pair(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    hosts = testbed.add_hosts(3)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    cp = run_cli("nettest", "-i", str(inv), "--json", "--seconds", SECONDS, "--pings", "20")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    validate_output("nettest", doc)  # docs/json.md's schema, unknown keys refused
    pairs = _pairs(doc)
    assert set(pairs) == {("h1", "h2"), ("h1", "h3"), ("h2", "h3")}
    # RTT on a loaded 2-core CI box may reach the `unknown` link's 5 ms warning: a warning is still a measurement.
    assert doc["ok"] is True and doc["summary"]["fail"] == 0
    ips = {h.name: h.ip for h in hosts}
    for (a, b), p in pairs.items():
        assert (p["a_ip"], p["b_ip"]) == (ips[a], ips[b])
        assert p["status"] in ("pass", "warn"), p
        assert p["error"] is None
        m = p["measurement"]
        assert m["a_to_b_bytes_per_s"] > 0 and m["b_to_a_bytes_per_s"] > 0, p
        assert 0 < m["rtt_min_ms"] <= m["rtt_ms"] <= m["rtt_max_ms"], p
        assert p["link"]["kind"] == "virtual" and p["link"]["speed_gbit_per_s"] is None, p["link"]  # veth: no speed
        for end in p["link"]["ends"]:
            assert (end["kind"], end["interface"]) == ("virtual", "eth0"), end
            # "eth0: type ether, 10000 Mb/s, virtual": the speed a veth reports is made up, and not used.
            assert end["note"].startswith("eth0: type ether, ") and end["note"].endswith(", virtual"), end
        assert "virtual" in p["summary"]


def test_nettest_table_output(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    cp = run_cli("nettest", "-i", str(inv), "--seconds", SECONDS)
    assert cp.returncode == 0, cp.stderr + cp.stdout
    assert "h1 ↔ h2" in cp.stdout and "0 fail" in cp.stdout and "ok:" in cp.stdout
    assert "virtual" in cp.stdout  # the link column


def test_nettest_unreachable_host_fails_only_its_pairs(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    _, _, h3 = testbed.add_hosts(3)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    testbed.stop_sshd(h3)
    cp = run_cli("nettest", "-i", str(inv), "--json", "--seconds", SECONDS)
    assert cp.returncode == 1, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    validate_output("nettest", doc)  # docs/json.md's schema, unknown keys refused
    pairs = _pairs(doc)
    assert doc["ok"] is False and doc["summary"]["fail"] == 2
    good = pairs[("h1", "h2")]
    assert good["status"] in ("pass", "warn") and good["measurement"]["a_to_b_bytes_per_s"] > 0
    assert good["measurement"]["b_to_a_bytes_per_s"] > 0 and good["measurement"]["rtt_ms"] > 0
    for key in (("h1", "h3"), ("h2", "h3")):
        p = pairs[key]
        assert p["status"] == "fail" and p["measurement"] is None
        assert "h3" in p["error"] and h3.ip in p["error"], p
    assert "h3" in doc["node_errors"] and set(doc["node_errors"]) == {"h3"}


def test_nettest_needs_two_nodes(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    cp = run_cli("nettest", "-i", str(inv), "--limit", "h1")
    assert cp.returncode == 2
    assert "at least two nodes" in cp.stderr
