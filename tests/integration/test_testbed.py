"""The test bed itself (tests/testbed.py), checked with the plain OpenSSH client."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import RunCli
from tests.testbed import (
    PROFILES_DIR,
    REPO,
    STATE_DIR,
    VENV_PYTHON,
    TestBed,
    TestBedError,
    _links,
    _list_netns,
    _netns_pids,
    cleanup_stale,
    list_runs,
    make_mac_shims,
)

pytestmark = pytest.mark.integration

MINI = PROFILES_DIR / "_testbed_mini"


def banner(ip: str, timeout: float = 3.0) -> bytes:
    with socket.create_connection((ip, 22), timeout=timeout) as s:
        return s.recv(64)


def run_leftovers(tag: str) -> list[str]:
    """Everything of run `tag` still on the machine."""
    left = [n for n in _list_netns() if n.startswith(f"{tag}-")]
    left += [n for n in _links("veth") + _links("bridge") if n.startswith(tag)]
    if (STATE_DIR / f"{tag}.json").exists():
        left.append(f"{tag}.json")
    return left


def test_hosts_reach_each_other_and_the_root_namespace(testbed: TestBed) -> None:
    hosts = testbed.add_hosts(["a", "b", "c"])
    assert len({h.ip for h in hosts}) == 3 and len({h.ns for h in hosts}) == 3
    assert all(len(h.veth) <= 15 and len(testbed.bridge) <= 15 for h in hosts)
    for h in hosts:  # root -> host, over real SSH with strict host key checking
        r = testbed.ssh(h, "echo ok")
        assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr
    a, b, c = hosts
    # host -> host: the other hosts' sshd banners, and a full SSH hop (the bed's key files are on the shared fs)
    probe = "; ".join(f"exec 3<>/dev/tcp/{h.ip}/22 && head -c 8 <&3 && exec 3<&-" for h in (b, c))
    r = testbed.ssh(a, f"timeout 5 bash -c {shlex.quote(probe)}")
    assert r.stdout == "SSH-2.0-SSH-2.0-", r.stderr
    r = testbed.ssh(a, shlex.join(testbed.ssh_argv(c, "hostname -I")))
    assert r.stdout.split() == [c.ip], r.stderr
    # host -> root namespace: a listener on the bridge address
    with socket.create_server((testbed.gateway, 0)) as server:
        port = server.getsockname()[1]
        got: list[bytes] = []

        def accept() -> None:
            conn, _ = server.accept()
            with conn:
                got.append(conn.recv(64))

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        server.settimeout(10)
        r = testbed.ssh(b, f"timeout 5 bash -c 'exec 3<>/dev/tcp/{testbed.gateway}/{port}; echo hello-from-b >&3'")
        t.join(10)
        assert got == [b"hello-from-b\n"], r.stderr
    # and nothing else: a host has only its own /24, no default route
    r = testbed.exec(a, ["ip", "-4", "route"], check=True)
    assert r.stdout.split()[0] == str(testbed.subnet) and "default" not in r.stdout


def test_each_host_has_its_own_srv_and_shares_the_venv(testbed: TestBed) -> None:
    a, b = testbed.add_hosts(["a", "b"])
    (a.srv / "model").mkdir()
    (a.srv / "model" / "name").write_text("model-of-a\n")
    testbed.exec(b, ["sh", "-c", "mkdir -p /srv/model && echo model-of-b > /srv/model/name"], check=True)
    assert (b.srv / "model" / "name").read_text() == "model-of-b\n"
    assert testbed.ssh(a, "cat /srv/model/name").stdout == "model-of-a\n"
    assert testbed.ssh(b, "cat /srv/model/name").stdout == "model-of-b\n"
    assert not any(Path("/srv").iterdir()), "a host's /srv leaked into the root namespace"
    r = testbed.ssh(a, f"{VENV_PYTHON} -c 'import sys, yaml; print(sys.prefix)'")
    assert r.stdout.strip() == str(REPO / ".venv"), r.stderr


def test_make_mac_shims_replays_the_profile(tmp_path: Path) -> None:
    made = make_mac_shims(MINI, tmp_path)
    assert made == ["ibv_devinfo", "pmset", "rdma_ctl", "sw_vers", "uname"]  # no shim for absent sections

    def shim(*argv: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(tmp_path / argv[0]), *argv[1:]], capture_output=True, timeout=10, check=False)

    assert shim("uname", "-srm").stdout == (MINI / "uname.out").read_bytes() == b"Darwin 25.5.0 arm64\n"
    assert shim("uname", "-s").stdout == b"Darwin 25.5.0 arm64\n"  # the recorded line for any arguments
    assert shim("sw_vers").stdout == b"ProductName:\t\tmacOS\nProductVersion:\t\t26.5\nBuildVersion:\t\t25F71\n"
    assert shim("sw_vers", "-productVersion").stdout == b"26.5\n"
    assert shim("sw_vers", "-buildVersion").stdout == b"25F71\n"
    assert shim("pmset", "-g").stdout == (MINI / "pmset.out").read_bytes()
    batt = shim("pmset", "-g", "batt")  # the profile has no pmset_batt
    assert batt.returncode == 64 and b"no recording" in batt.stderr
    assert shim("rdma_ctl", "status").stdout == b"enabled\n"
    devinfo = shim("ibv_devinfo")
    assert (devinfo.returncode, devinfo.stdout, devinfo.stderr) == (255, b"", b"No IB devices found\n")


def test_networksetup_shim_replays_the_port_list_and_records_every_change(tmp_path: Path) -> None:
    profile = PROFILES_DIR / "m5max-mbp-tb5"
    shims, calls = tmp_path / "shims", tmp_path / "calls"
    calls.mkdir()
    assert "networksetup" in make_mac_shims(profile, shims)

    def networksetup(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(shims / "networksetup"), *args], capture_output=True, timeout=10, check=False,
                              env={"PATH": "/usr/bin:/bin", "MX_SHIM_CALLS": str(calls)})

    assert networksetup("-listallhardwareports").stdout == (profile / "networksetup.out").read_bytes()
    assert not (calls / "networksetup.calls").exists()  # reading is not recorded
    assert networksetup("-setmanual", "Thunderbolt 1", "192.168.0.1", "255.255.255.252").returncode == 0
    assert networksetup("-setnetworkserviceenabled", "Thunderbolt Bridge", "off").returncode == 0
    assert (calls / "networksetup.calls").read_text() == (
        "-setmanual\tThunderbolt 1\t192.168.0.1\t255.255.255.252\t\n"
        "-setnetworkserviceenabled\tThunderbolt Bridge\toff\t\n")


def test_fake_mac_answers_from_its_profile_through_ssh(testbed: TestBed) -> None:
    mac = testbed.add_host("mac", mac_profile="_testbed_mini")
    linux = testbed.add_host("linux")
    assert mac.shims is not None and linux.shims is None
    r = testbed.ssh(mac, "uname -srm")
    assert r.stdout == (MINI / "uname.out").read_text(), r.stderr
    assert testbed.ssh(mac, "sw_vers").stdout == (MINI / "sw_vers.out").read_text()
    assert testbed.ssh(mac, "python3 -c 'print(1)'").stdout == "1\n"
    r = testbed.ssh(mac, 'echo "$PATH"; command -v uname sw_vers python3 sysctl')
    path, *found = r.stdout.splitlines()
    assert path.split(":")[0] == str(mac.shims)  # first on PATH, not pushed back by a shell rc file
    assert found[:2] == [str(mac.shims / "uname"), str(mac.shims / "sw_vers")]
    assert not found[3].startswith(str(mac.shims))  # no sysctl section: the Linux sysctl answers
    r = testbed.ssh(mac, "bash -lc 'uname -srm'; sh -lc 'command -v sw_vers'")  # login shells too, as on a Mac
    assert r.stdout == f"Darwin 25.5.0 arm64\n{mac.shims / 'sw_vers'}\n", r.stderr
    # the probe's own shape: `uname -s` inside `sh -c`, output and exit codes merged
    r = testbed.ssh(mac, shlex.join(["sh", "-c", 'uname -s; ibv_devinfo 2>&1; echo "rc=$?"']))
    assert r.stdout == "Darwin 25.5.0 arm64\nNo IB devices found\nrc=255\n"
    r = testbed.ssh(linux, "uname -s; command -v sw_vers || echo no-sw_vers")
    assert r.stdout == "Linux\nno-sw_vers\n"


def test_setenv_variables_reach_non_interactive_commands(testbed: TestBed) -> None:
    env = {"MLX_RANK": "1", "MLX_HOSTFILE": '/srv/a b/"hosts".json', "MLX_RING_VERBOSE": "1"}
    h = testbed.add_host("preset", env=env)
    plain = testbed.add_host("plain")
    r = testbed.ssh(h, "printenv MLX_RANK MLX_HOSTFILE MLX_RING_VERBOSE")
    assert r.stdout.splitlines() == list(env.values()), r.stderr
    r = testbed.ssh(h, shlex.join(["sh", "-c", "env"]))
    assert "MLX_RANK=1" in r.stdout.splitlines()
    assert "MLX_" not in testbed.ssh(plain, "env").stdout


def test_stop_sshd_refuses_connections_and_start_restores(testbed: TestBed) -> None:
    h = testbed.add_host("h")
    pid = h.pid
    assert pid is not None and banner(h.ip).startswith(b"SSH-2.0-")
    testbed.stop_sshd(h)
    assert h.pid is None and not Path(f"/proc/{pid}").exists()
    with pytest.raises(ConnectionRefusedError):
        banner(h.ip)
    r = testbed.ssh(h, "true")
    assert r.returncode == 255 and "Connection refused" in r.stderr
    testbed.start_sshd(h)
    assert h.pid not in (None, pid) and testbed.ssh(h, "echo up").stdout == "up\n"


def test_changed_or_unknown_host_key_fails_strict_checking(testbed: TestBed) -> None:
    h = testbed.add_host("h")
    stranger = testbed.add_host("stranger", known=False)
    old = h.host_key_pub
    assert old in testbed.known_hosts.read_text() and stranger.host_key_pub not in testbed.known_hosts.read_text()
    new = testbed.regenerate_host_key(h)
    assert new != old and h.pid is not None
    r = testbed.ssh(h, "true")
    assert r.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr
    r = testbed.ssh(stranger, "true")
    assert r.returncode == 255 and "Host key verification failed" in r.stderr


def test_link_down_times_out_and_link_up_restores(testbed: TestBed) -> None:
    h, other = testbed.add_hosts(["h", "other"])
    assert testbed.ssh(h, "true").returncode == 0  # the root namespace has h's ARP entry, as after real use
    testbed.link_down(h)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        banner(h.ip, timeout=1.5)
    assert time.monotonic() - start >= 1.4  # a silent black hole, not a quick refusal
    r = testbed.ssh(h, "true", connect_timeout=1)
    assert r.returncode == 255 and "timed out" in r.stderr
    assert testbed.ssh(other, "echo fine").stdout == "fine\n"
    testbed.link_up(h)
    assert testbed.ssh(h, "echo back").stdout == "back\n"


def test_close_removes_every_namespace_link_and_process(tmp_path: Path) -> None:
    bed = TestBed(tmp=tmp_path / "bed")
    hosts = bed.add_hosts(3, mac_profile="_testbed_mini")
    # a session that would outlive its sshd listener
    session = subprocess.Popen(
        bed.ssh_argv(hosts[0], "echo up; exec sleep 300", connect_timeout=60),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait for the remote command itself, not a fixed time: on a loaded 2-core machine the key exchange alone
        # has taken over 10 s, and the count below was then taken before the session's shell existed.
        assert session.stdout is not None and session.stdout.readline() == "up\n"
        pids = [p for ps in _netns_pids([h.ns for h in hosts]).values() for p in ps]
        assert len(pids) >= 5 and run_leftovers(bed.tag)
        bed.close()
        assert run_leftovers(bed.tag) == []
        assert all(not Path(f"/proc/{p}").exists() or _proc_gone(p) for p in pids)
        assert session.wait(timeout=10) != 0
        bed.close()  # idempotent
    finally:
        if session.poll() is None:
            session.kill()
        session.wait(timeout=10)
        bed.close()


def _proc_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


CRASHING_RUN = """
import sys, time
from pathlib import Path
from tests.testbed import TestBed
bed = TestBed(tmp=Path(sys.argv[1]))
bed.add_hosts(2)
print(bed.tag, flush=True)
time.sleep(600)
"""


def test_cleanup_stale_removes_dead_runs_only(testbed: TestBed, tmp_path: Path) -> None:
    mine = testbed.add_host("mine")
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RUN, str(tmp_path / "crashed")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        tag = proc.stdout.readline().strip()
        assert tag, "the crashing run did not start"
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no close(): its sshds and namespaces stay behind
        proc.wait(timeout=10)
        dead = [r for r in list_runs() if r.tag == tag]
        assert dead and not dead[0].alive and len(dead[0].namespaces) == 2
        assert any(_netns_pids(list(dead[0].namespaces)).values())  # its sshds still run
        cleanup_stale()  # (a concurrent session's cleanup_stale may have got there first)
        assert run_leftovers(tag) == []
        assert next(r for r in list_runs() if r.tag == testbed.tag).alive
        assert testbed.ssh(mine, "echo still-here").stdout == "still-here\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_write_inventory(testbed: TestBed, tmp_path: Path) -> None:
    a, b = testbed.add_hosts(["a", "b"], start_sshd=False)
    assert a.pid is None
    path = testbed.write_inventory(tmp_path / "inv.yaml", [a, b], extra_nodes=[{"name": "ghost", "host": "127.0.0.9"}])
    doc = yaml.safe_load(path.read_text())
    assert doc["defaults"] == {
        "user": "root",
        "port": 22,
        "python": VENV_PYTHON,
        "workdir": "/srv/work",
        "identity": str(testbed.client_key),
        "known_hosts": str(testbed.known_hosts),
    }
    assert doc["nodes"] == [
        {"name": "a", "host": a.ip, "ips": [a.ip]},
        {"name": "b", "host": b.ip, "ips": [b.ip]},
        {"name": "ghost", "host": "127.0.0.9"},
    ]


@pytest.mark.parametrize(("count", "budget"), [(16, 10.0), (64, 40.0)])
def test_many_hosts_start_quickly(testbed: TestBed, count: int, budget: float) -> None:
    start = time.monotonic()
    hosts = testbed.add_hosts(count, mac_profile="_testbed_mini")
    elapsed = time.monotonic() - start
    assert [h.name for h in hosts] == [f"h{i}" for i in range(1, count + 1)]
    assert len({h.ip for h in hosts}) == count
    assert all(banner(h.ip).startswith(b"SSH-2.0-") for h in hosts)
    assert elapsed < budget, f"{count} hosts took {elapsed:.1f}s"


def test_failed_setup_steps_are_errors_and_close_cleans_up(tmp_path: Path) -> None:
    bed = TestBed(tmp=tmp_path / "bed")
    try:
        with pytest.raises(TestBedError, match="no such profile"):
            bed.add_host("nomac", mac_profile="no-such-profile")
        with pytest.raises(TestBedError, match="SetEnv"):
            bed.add_host("badenv", env={"NOT A NAME": "x"})
        h = bed.add_host("broken", start_sshd=False)
        h.config.write_text(h.config.read_text() + "NoSuchOption yes\n")
        with pytest.raises(TestBedError, match="NoSuchOption"):
            bed.start_sshd(h)
        assert h.pid is None
        with pytest.raises(TestBedError, match="already in use"):
            TestBed(tmp=tmp_path / "twin", run_id=bed.run_id)
        assert run_leftovers(bed.tag)  # the twin's failure removed nothing of ours
        assert bed.exec(h, ["ip", "-4", "-br", "addr", "show", "eth0"]).stdout.split()[2] == f"{h.ip}/24"
    finally:
        bed.close()
    assert run_leftovers(bed.tag) == []


def test_run_cli_runs_the_coordinator(run_cli: RunCli) -> None:
    r = run_cli("--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout
