"""`coordinator nettest`'s pure core (link kinds from recorded facts, judging, parsing) and the worker's protocol
over a real loopback socket."""

from __future__ import annotations

import ast
import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.facts.model import HardwarePort, NetInterface, NetLink, NodeFacts, ThunderboltPort
from coordinator.facts.probe import Section
from coordinator.fleet.nettest import (
    FAIL_FRACTION,
    LINK_SPECS,
    WARN_FRACTION,
    LinkEnd,
    LinkKind,
    Measurement,
    NettestReport,
    ParseError,
    classify_endpoint,
    classify_linux_link,
    combine_ends,
    evaluate_pair,
    judge_link,
    parse_client_output,
    plan_pairs,
)
from coordinator.fleet.nettestrun import run_nettest
from coordinator.models import Connection, Inventory, Node, Status
from tests.factsutil import (
    MBP,
    NODEV,
    OLD,
    STUDIO,
    capture,
    facts_from,
    linux_sections,
    profile_sections,
    studio_mesh,
)
from worker import nettest as wn

REPO = Path(__file__).resolve().parents[2]
GB = 1e9 / 8  # bytes/second in one Gb/s

# ------------------------------------------------------------------------------------------------ judge_link

# (kind, negotiated Gb/s, measured Gb/s, rtt ms, status, text in the summary)
JUDGE_CASES = [
    # TB5: expected goodput 0.4 x 80 = 32 Gb/s; warn below 16, fail below 3.2.
    ("thunderbolt", 80.0, 30.0, 0.1, Status.PASS, "thunderbolt 80 Gb/s"),
    ("thunderbolt", 80.0, 12.0, 0.1, Status.WARN, "38% of"),
    ("thunderbolt", 80.0, 0.9, 0.1, Status.FAIL, "another interface"),
    # TB with no negotiated speed: judged as TB4 (40 -> 16 expected).
    ("thunderbolt", None, 10.0, 0.1, Status.PASS, "thunderbolt 40 Gb/s"),
    ("thunderbolt", 40.0, 7.0, 0.1, Status.WARN, "44% of"),
    # Ethernet: 1 GbE floor, 0.94 expected.
    ("ethernet", None, 0.93, 0.3, Status.PASS, "ethernet 1 Gb/s"),
    ("ethernet", None, 0.3, 0.3, Status.WARN, ""),
    ("ethernet", 10.0, 0.5, 0.3, Status.FAIL, ""),
    # RTT alone.
    ("ethernet", None, 0.93, 2.0, Status.WARN, "rtt 2.000 ms > 1 ms"),
    ("thunderbolt", 80.0, 30.0, 25.0, Status.FAIL, "> 10 ms"),
    # Wi-Fi is at best a warning.
    ("wifi", None, 0.4, 3.0, Status.WARN, "Wi-Fi data plane"),
    ("wifi", None, 0.01, 3.0, Status.FAIL, ""),
    ("wifi", None, 0.4, 150.0, Status.FAIL, "> 100 ms"),
    # Unknown and virtual (veth, bridge): any positive throughput passes; RTT still judged.
    ("unknown", None, 0.001, 0.2, Status.PASS, "no nominal speed"),
    ("virtual", None, 0.001, 0.2, Status.PASS, "virtual: "),
    ("virtual", None, 5.0, 6.0, Status.WARN, "> 5 ms"),
    ("unknown", None, 5.0, 6.0, Status.WARN, "> 5 ms"),
    # Nothing got through: always a failure.
    ("unknown", None, 0.0, 0.2, Status.FAIL, "no data got through"),
    ("thunderbolt", 80.0, 0.0, None, Status.FAIL, "no data got through"),
]


@pytest.mark.parametrize(("kind", "speed", "gbps", "rtt", "status", "text"), JUDGE_CASES)
def test_judge_link(kind: str, speed: float | None, gbps: float, rtt: float | None, status: Status,
                    text: str) -> None:
    got, summary = judge_link(kind, speed, gbps * GB, rtt)
    assert got is status, summary
    assert text in summary


def test_judge_link_thresholds_are_the_documented_fractions() -> None:
    spec = LINK_SPECS[LinkKind.THUNDERBOLT]
    expected = 80 * GB * spec.efficiency
    assert judge_link("thunderbolt", 80, expected * WARN_FRACTION * 1.01, 0.1)[0] is Status.PASS
    assert judge_link("thunderbolt", 80, expected * WARN_FRACTION * 0.99, 0.1)[0] is Status.WARN
    assert judge_link("thunderbolt", 80, expected * FAIL_FRACTION * 1.01, 0.1)[0] is Status.WARN
    assert judge_link("thunderbolt", 80, expected * FAIL_FRACTION * 0.99, 0.1)[0] is Status.FAIL


def test_judge_link_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError):
        judge_link("carrier-pigeon", None, 1.0, 1.0)


# ---------------------------------------------------------------------------------------- link classification


@pytest.mark.parametrize(("profile", "ip", "kind", "speed", "iface", "port"), [
    (MBP, "192.168.10.1", LinkKind.THUNDERBOLT, 80.0, "en1", "Thunderbolt 1"),  # TB5 cable to the studio
    (NODEV, "192.168.20.1", LinkKind.THUNDERBOLT, 40.0, "en1", "Thunderbolt 1"),  # TB4
    (STUDIO, "192.168.10.2", LinkKind.THUNDERBOLT, 80.0, "en3", "Thunderbolt 2"),
    (MBP, "192.168.2.46", LinkKind.WIFI, None, "en0", "Wi-Fi"),
    (STUDIO, "192.168.2.47", LinkKind.ETHERNET, None, "en0", "Ethernet"),
])  # fmt: skip
def test_classify_endpoint_from_recorded_macs(profile: str, ip: str, kind: LinkKind, speed: float | None,
                                              iface: str, port: str) -> None:
    end = classify_endpoint("n", ip, facts_from("n", profile_sections(profile)))
    assert (end.kind, end.speed_gbps, end.interface, end.port) == (kind, speed, iface, port)


def test_classify_endpoint_studio_mesh_receptacles() -> None:
    # Cable 0: studio 0 receptacle 2 <-> studio 1 receptacle 4; both ends are TB5 80 Gb/s.
    mesh = studio_mesh(2, [(0, 2, 1, 4)])
    a = classify_endpoint("s0", "10.0.0.1", facts_from("s0", mesh[0]))
    b = classify_endpoint("s1", "10.0.0.2", facts_from("s1", mesh[1]))
    assert (a.kind, a.speed_gbps, a.port) == (LinkKind.THUNDERBOLT, 80.0, "Thunderbolt 2")
    assert (b.kind, b.speed_gbps, b.port) == (LinkKind.THUNDERBOLT, 80.0, "Thunderbolt 4")


def test_classify_endpoint_unknowns_say_why() -> None:
    sections = linux_sections()
    del sections["sys_class_net"]
    end = classify_endpoint("l", "192.0.2.2", facts_from("l", sections))
    assert (end.kind, end.interface, end.note) == (LinkKind.UNKNOWN, "eth0", "no /sys/class/net facts")
    assert "on no interface" in classify_endpoint("m", "10.9.9.9", facts_from("m", profile_sections(OLD))).note
    assert classify_endpoint("x", "10.0.0.1", None).note == "no facts"


def test_classify_endpoint_linux_from_recorded_sys_class_net() -> None:
    # This VM's NIC: virtio hardware (a `device` link) whose speed the kernel does not know (-1).
    end = classify_endpoint("l", "192.0.2.2", facts_from("l", linux_sections()))
    assert (end.kind, end.speed_gbps, end.interface, end.driver) == (LinkKind.ETHERNET, None, "eth0", "virtio_net")
    assert end.note == "eth0: virtio_net, type ether, speed not known"
    # A test-bed host: the namespace end of a veth pair; and a bridge whose only port is another veth.
    sections = {**linux_sections(), "ip_addr": Section("ip_addr", capture("ip_addr/netns-veth-bridge.txt"), 0),
                "sys_class_net": Section("sys_class_net", capture("sys_class_net/netns-veth-bridge.txt"), 0)}
    facts = facts_from("h1", sections)
    veth = classify_endpoint("h1", "10.77.0.2", facts)
    assert (veth.kind, veth.speed_gbps, veth.driver) == (LinkKind.VIRTUAL, None, None)  # its 10000 Mb/s is not used
    assert veth.note == "eth0: type ether, 10000 Mb/s, virtual"
    bridge = classify_endpoint("h1", "10.78.0.1", facts)
    assert (bridge.kind, bridge.driver) == (LinkKind.VIRTUAL, "bridge")


def _nic(name: str, speed: int | None = None, **kw: Any) -> NetLink:
    kw.setdefault("path", f"/sys/devices/pci0000:00/0000:00:1c.0/net/{name}")
    return NetLink(name, kw.pop("arphrd_type", 1), speed, "up", has_device=kw.pop("has_device", True),
                   wireless=kw.pop("wireless", False), **kw)


def _virt(name: str, *lower: str, devtype: str | None = None) -> NetLink:
    return NetLink(name, 1, 10000, "up", has_device=False, wireless=False, devtype=devtype, lower=lower,
                   path=f"/sys/devices/virtual/net/{name}")


LINUX_LINKS = (
    _nic("enp3s0", 1000, driver="e1000e"),
    _nic("enp4s0", 10000, driver="ixgbe"),
    _nic("eno1", None, driver="igb"),
    _nic("wlp2s0", None, wireless=True, devtype="wlan", driver="iwlwifi"),
    _nic("thunderbolt0", 20000, driver="thunderbolt-net"),
    _nic("ib0", 100000, arphrd_type=32, driver="mlx5_core"),
    _virt("veth1"),
    _virt("br0", "enp4s0", "veth1", devtype="bridge"),  # a VM host's bridge: a 10 GbE uplink and a guest
    _virt("br1", "enp3s0", "enp4s0", devtype="bridge"),
    _virt("br2", "veth1", devtype="bridge"),
    _virt("vlan5", "br1", devtype="vlan"),
    _virt("loop1", "loop2"),
    _virt("loop2", "loop1"),
    _nic("odd0", None, has_device=False, path="/sys/devices/platform/odd0"),  # no `device` link: virtual
)


@pytest.mark.parametrize(("name", "kind", "speed", "driver", "note"), [
    ("enp3s0", LinkKind.ETHERNET, 1.0, "e1000e", "enp3s0: e1000e, type ether, 1000 Mb/s"),
    ("enp4s0", LinkKind.ETHERNET, 10.0, "ixgbe", ""),
    ("eno1", LinkKind.ETHERNET, None, "igb", "speed not known"),  # judged against the 1 GbE default
    ("wlp2s0", LinkKind.WIFI, None, "iwlwifi", ""),
    ("thunderbolt0", LinkKind.THUNDERBOLT, 20.0, "thunderbolt-net", ""),
    ("ib0", LinkKind.UNKNOWN, None, "mlx5_core", "type infiniband"),
    ("veth1", LinkKind.VIRTUAL, None, None, "virtual"),
    ("br0", LinkKind.ETHERNET, 10.0, "bridge", "br0: bridge, type ether, 10000 Mb/s, virtual over enp4s0: ixgbe"),
    ("br1", LinkKind.ETHERNET, 1.0, "bridge", "over enp3s0"),  # the slower port
    ("br2", LinkKind.VIRTUAL, None, "bridge", ""),
    ("vlan5", LinkKind.ETHERNET, 1.0, "vlan", "vlan5: vlan, type ether, 10000 Mb/s, virtual over br1"),
    ("loop1", LinkKind.VIRTUAL, None, None, ""),  # a cycle of lower links ends
    ("odd0", LinkKind.VIRTUAL, None, None, ""),
    ("nope0", LinkKind.UNKNOWN, None, None, "nope0 is not in /sys/class/net"),
])  # fmt: skip
def test_classify_linux_link(name: str, kind: LinkKind, speed: float | None, driver: str | None, note: str) -> None:
    got = classify_linux_link(name, LINUX_LINKS)
    assert got[:3] == (kind, speed, driver)
    assert note in got[3]


def _bridge_facts(speeds: dict[str, float | None]) -> NodeFacts:
    """A Mac whose data IP sits on bridge0 over Thunderbolt 1..N (receptacle -> negotiated speed or None)."""
    members = tuple(f"en{r}" for r in speeds)
    return NodeFacts(
        node="b",
        hardware_ports=(HardwarePort("Thunderbolt Bridge", "bridge0"),
                        *(HardwarePort(f"Thunderbolt {r}", f"en{r}") for r in speeds)),
        interfaces=(NetInterface("bridge0", ipv4=("10.1.1.1",), up=True, members=members),),
        thunderbolt=tuple(ThunderboltPort(bus=f"bus{r}", domain_uuid=None, receptacle=r, connected=s is not None,
                                          speed_gbps=s, max_speed_gbps=None if s else 120.0)
                          for r, s in speeds.items()),
    )


def test_classify_endpoint_thunderbolt_bridge_uses_slowest_connected_member() -> None:
    end = classify_endpoint("b", "10.1.1.1", _bridge_facts({"1": 80.0, "2": 40.0, "3": None}))
    assert (end.kind, end.speed_gbps, end.interface) == (LinkKind.THUNDERBOLT, 40.0, "bridge0")
    end = classify_endpoint("b", "10.1.1.1", _bridge_facts({"1": None}))
    assert (end.kind, end.speed_gbps) == (LinkKind.THUNDERBOLT, None)


@pytest.mark.parametrize(("a", "b", "want"), [
    ((LinkKind.THUNDERBOLT, 80.0), (LinkKind.THUNDERBOLT, 40.0), (LinkKind.THUNDERBOLT, 40.0)),
    ((LinkKind.THUNDERBOLT, 80.0), (LinkKind.UNKNOWN, None), (LinkKind.THUNDERBOLT, 80.0)),
    ((LinkKind.UNKNOWN, None), (LinkKind.UNKNOWN, None), (LinkKind.UNKNOWN, None)),
    ((LinkKind.ETHERNET, None), (LinkKind.WIFI, None), (LinkKind.WIFI, None)),  # same 1 Gb/s: Wi-Fi is slower
    ((LinkKind.THUNDERBOLT, None), (LinkKind.ETHERNET, None), (LinkKind.ETHERNET, None)),
    ((LinkKind.VIRTUAL, None), (LinkKind.ETHERNET, 10.0), (LinkKind.ETHERNET, 10.0)),  # hardware sets the pace
    ((LinkKind.VIRTUAL, None), (LinkKind.UNKNOWN, None), (LinkKind.VIRTUAL, None)),
    ((LinkKind.VIRTUAL, None), (LinkKind.VIRTUAL, None), (LinkKind.VIRTUAL, None)),
])  # fmt: skip
def test_combine_ends_takes_the_slower_end(a: tuple[LinkKind, float | None], b: tuple[LinkKind, float | None],
                                           want: tuple[LinkKind, float | None]) -> None:
    end_a = LinkEnd("a", "10.0.0.1", kind=a[0], speed_gbps=a[1])
    end_b = LinkEnd("b", "10.0.0.2", kind=b[0], speed_gbps=b[1])
    assert combine_ends(end_a, end_b) == want
    assert combine_ends(end_b, end_a) == want


# ----------------------------------------------------------------------------------------- pairs and parsing


def test_plan_pairs_unordered_in_inventory_order() -> None:
    assert plan_pairs(["c", "a", "b"]) == [("c", "a"), ("c", "b"), ("a", "b")]
    assert plan_pairs(["a"]) == []
    assert len(plan_pairs([f"n{i}" for i in range(8)])) == 28
    with pytest.raises(ValueError, match="duplicate"):
        plan_pairs(["a", "a"])


GOOD = {"rtt_ms": 0.2, "rtt_min_ms": 0.1, "rtt_max_ms": 0.9, "pings": 50, "up_bps": 1e9, "up_bytes": 2e9,
        "up_seconds": 2.0, "down_bps": 5e8, "down_bytes": 1e9, "down_seconds": 2.0, "seconds": 4.1}


def test_parse_client_output() -> None:
    m = parse_client_output("noise\n" + json.dumps(GOOD) + "\n")
    assert (m.rtt_ms, m.up_bps, m.down_bps, m.bottleneck_bps) == (0.2, 1e9, 5e8, 5e8)
    assert m.to_json()["a_to_b_gbit_per_s"] == pytest.approx(8.0)


@pytest.mark.parametrize(("text", "message"), [
    ("", "printed nothing"),
    ("Traceback (most recent call last):", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"error": "10.0.0.2:5: [Errno 111] Connection refused"}', "Connection refused"),
    ('{"rtt_ms": 1}', "missing or bad field"),
    (json.dumps({**GOOD, "up_bps": "fast"}), "missing or bad field"),
])  # fmt: skip
def test_parse_client_output_errors(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_client_output(text)


def test_evaluate_pair_and_report() -> None:
    a = LinkEnd("a", "10.0.0.1", kind=LinkKind.THUNDERBOLT, speed_gbps=80.0, interface="en1", port="Thunderbolt 1")
    b = LinkEnd("b", "10.0.0.2")
    c = LinkEnd("c", "10.0.0.3")
    fast = Measurement(rtt_ms=0.1, rtt_min_ms=0.05, rtt_max_ms=0.3, up_bps=30 * GB, down_bps=28 * GB, seconds=4.0)
    slow = Measurement(rtt_ms=0.1, rtt_min_ms=0.05, rtt_max_ms=0.3, up_bps=30 * GB, down_bps=8 * GB, seconds=4.0)
    ok = evaluate_pair(a, b, fast, None)
    warn = evaluate_pair(a, c, slow, None)  # the slower direction is judged
    down = evaluate_pair(b, c, None, "c: cannot connect to 10.0.0.3")
    assert (ok.status, warn.status, down.status) == (Status.PASS, Status.WARN, Status.FAIL)
    assert down.summary == "not measured: c: cannot connect to 10.0.0.3" and down.measurement is None
    report = NettestReport((ok, warn, down), 12.0, {"c": "unreachable"})
    assert report.counts() == {"pass": 1, "warn": 1, "fail": 1}
    assert not report.ok()
    assert NettestReport((ok, warn), 1.0).ok() and not NettestReport((ok, warn), 1.0).ok(strict=True)
    doc: dict[str, Any] = json.loads(json.dumps(report.to_json()))
    first = doc["pairs"][0]
    assert first["link"] == {"kind": "thunderbolt", "speed_gbit_per_s": 80.0, "ends": [a.to_json(), b.to_json()]}
    assert (first["a"], first["b"], first["a_ip"], first["b_ip"]) == ("a", "b", "10.0.0.1", "10.0.0.2")
    assert doc["pairs"][2]["error"] == "c: cannot connect to 10.0.0.3"
    assert doc["node_errors"] == {"c": "unreachable"} and doc["ok"] is False


# ----------------------------------------------------------------------------- worker protocol on loopback


def test_worker_session_over_loopback() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                wn.serve_session(conn)
            except (OSError, wn.NetTestError) as exc:
                errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    result = wn.run_client("127.0.0.1", port, seconds=0.2, pings=7, connect_timeout=5)
    thread.join(timeout=10)
    listener.close()
    assert not errors and not thread.is_alive()
    assert result["pings"] == 7 and 0 < result["rtt_min_ms"] <= result["rtt_ms"] <= result["rtt_max_ms"]
    assert result["up_bytes"] > 0 and result["down_bytes"] > 0
    assert result["up_bps"] > 0 and result["down_bps"] > 0
    m = parse_client_output(json.dumps(result))  # the coordinator reads exactly what the worker prints
    assert m.up_bps == result["up_bps"]


def _python_39() -> list[str]:
    """The oldest node python we support, when this machine has one (nodes may run it: worker is 3.9+)."""
    for python in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9"))):
        check = "import sys; sys.exit(sys.version_info[:2] != (3, 9))"
        if subprocess.run([python, "-c", check], capture_output=True, timeout=30, check=False).returncode == 0:
            return [python]
    return []


PYTHONS = [sys.executable, *_python_39()]


def test_worker_is_stdlib_only() -> None:
    tree = ast.parse(Path(wn.__file__).read_text(), feature_version=(3, 9))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= sys.stdlib_module_names, names - sys.stdlib_module_names


def _worker(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.nettest", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("python", PYTHONS)
def test_worker_cli_serve_and_client(python: str) -> None:
    server = subprocess.Popen([python, "-m", "worker.nettest", "serve", "--bind", "127.0.0.1", "--timeout", "10"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        client = subprocess.run([python, "-m", "worker.nettest", "client", "--to", "127.0.0.1", "--port", str(port),
                                 "--seconds", "0.2", "--pings", "5"], capture_output=True, text=True, timeout=30,
                                check=False, cwd=REPO)
        assert client.returncode == 0, client.stdout + client.stderr
        assert parse_client_output(client.stdout).rtt_ms > 0
        assert server.wait(timeout=10) == 0  # one session, then it exits by itself
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_worker_cli_failures_are_json() -> None:
    serve = _worker("serve", "--bind", "127.0.0.1", "--timeout", "0.3")
    lines = [json.loads(line) for line in serve.stdout.splitlines()]
    assert serve.returncode == 1 and "port" in lines[0] and "no client connected" in lines[1]["error"]
    bad_bind = _worker("serve", "--bind", "192.0.2.123", "--timeout", "0.3")  # TEST-NET-1: not ours
    assert bad_bind.returncode == 1 and "cannot listen" in json.loads(bad_bind.stdout)["error"]
    # A port nobody listens on: the one a just-closed listener had.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    free = sock.getsockname()[1]
    sock.close()
    refused = _worker("client", "--to", "127.0.0.1", "--port", str(free), "--seconds", "0.1")
    assert refused.returncode == 1 and "error" in json.loads(refused.stdout)
    with pytest.raises(ParseError):
        parse_client_output(refused.stdout)


# ------------------------------------------------------------------------- the I/O shell on local "nodes"


def test_run_nettest_on_local_nodes(tmp_path: Path) -> None:
    """Three `connection: local` nodes on 127.0.0.1 (the verb's real code path minus SSH); one whose python
    does not exist fails its pairs while the others are measured."""
    def node(name: str, python: str = sys.executable) -> Node:
        return Node(name=name, host="127.0.0.1", connection=Connection.LOCAL, python=python,
                    workdir=str(tmp_path / name), ips=("127.0.0.1",))

    inv = Inventory((node("a"), node("b"), node("broken", python=str(tmp_path / "no-python"))))
    seen: list[tuple[str, str]] = []
    report = asyncio.run(run_nettest(inv, seconds=0.1, pings=3, progress=lambda a, b: seen.append((a, b))))
    assert seen == [("a", "b"), ("a", "broken"), ("b", "broken")]
    by_pair = {(p.a.node, p.b.node): p for p in report.pairs}
    good = by_pair[("a", "b")]
    # (a loaded box may push the RTT over the `unknown` link's 5 ms warning; it is measured all the same)
    assert good.status is not Status.FAIL and good.measurement is not None and good.measurement.bottleneck_bps > 0
    for key in (("a", "broken"), ("b", "broken")):
        assert by_pair[key].status is Status.FAIL and "broken" in (by_pair[key].error or "")
    assert set(report.node_errors) == {"broken"}
    assert not report.ok()


def test_nccl_between_the_gpus_of_a_node_is_judged_from_the_workers_line() -> None:
    from coordinator.fleet.nettest import NettestReport, evaluate_gpu_bus
    from worker.gpunettest import bus_bandwidth

    algbw, busbw = bus_bandwidth(2**30, 10, 0.05, 2)  # 10 all-reduces of 1 GiB in 50 ms over 2 GPUs
    assert algbw == 2**30 * 200 and busbw == algbw  # 2(n-1)/n = 1 for two ranks
    assert bus_bandwidth(1, 1, 1.0, 4)[1] == 1.5
    line = json.dumps({"devices": ["GPU-a", "GPU-b"], "bytes": 2**28, "iters": 20, "seconds": 0.1,
                       "algbw_bytes_per_s": 5.4e10, "busbw_bytes_per_s": 3.29e11})
    ok = evaluate_gpu_bus("box", ["GPU-a", "GPU-b"], "warning from a profile\n" + line)
    assert ok.status == "pass" and ok.busbw_bps == 3.29e11 and "329.0 GB/s" in ok.summary
    bad = evaluate_gpu_bus("box", ["GPU-a", "GPU-b"], json.dumps({"error": "RuntimeError: [nccl] invalid usage"}))
    assert bad.status == "fail" and bad.error == "RuntimeError: [nccl] invalid usage"
    assert evaluate_gpu_bus("box", [], None, "connection lost").summary == "not measured: connection lost"
    report = NettestReport((), 1.0, {}, (ok, bad))
    assert report.counts() == {"pass": 1, "warn": 0, "fail": 1} and not report.ok()
    assert report.to_json()["gpus"][0]["busbw_bytes_per_s"] == 3.29e11


def test_the_gpu_test_needs_two_devices_and_says_so_in_json(capsys) -> None:
    from worker.gpunettest import main

    assert main(["--devices", "GPU-a"]) == 1
    assert json.loads(capsys.readouterr().out) == {"error": "ValueError: --devices needs at least two GPUs"}
