"""Linux parsers on recorded real outputs (tests/fixtures/captures, provenance in SOURCES.md).

The Debian captures were taken on the development machine with the probe's own commands; the others come from
public sources. Every capture is parsed to the exact value written here; garbage raises ParseError.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.facts import linux
from coordinator.facts.model import Disk, Gpu, Memory, NetInterface, NetLink, ParseError

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"


def cap(rel: str) -> str:
    return (CAPTURES / rel).read_text(encoding="utf-8")


KiB = 1024
VNET = "/sys/devices/virtual/net/"
VIRTIO_ETH0 = NetLink("eth0", 1, None, "up", has_device=True, wireless=False, driver="virtio_net",
                      path="/sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0")
VM_LINKS = (
    VIRTIO_ETH0,
    NetLink("ifb0", 1, None, "down", has_device=False, wireless=False, path=VNET + "ifb0"),
    NetLink("ifb1", 1, None, "down", has_device=False, wireless=False, path=VNET + "ifb1"),
    NetLink("lo", 772, None, "unknown", has_device=False, wireless=False, path=VNET + "lo"),
)


def _veth(name: str) -> NetLink:
    return NetLink(name, 1, 10000, "up", has_device=False, wireless=False, path=VNET + name)


CASES: dict[str, tuple[Callable[[str], object], object]] = {
    "uname/linux-6.18-x86_64-debian-12.txt": (linux.parse_uname, ("Linux", "6.18.44-fc-v657", "x86_64")),
    "os_release/debian-12.txt": (linux.parse_os_release, ("Debian GNU/Linux 12 (bookworm)", "12")),
    "meminfo/debian-12-24gib.txt": (
        linux.parse_meminfo,
        Memory(total_bytes=24684092 * KiB, available_bytes=24400868 * KiB, free_percent=98.85),
    ),
    "nproc/debian-12-2cpu.txt": (linux.parse_nproc, 2),
    "loadavg/debian-12.txt": (linux.parse_loadavg, (0.27, 0.08, 0.03)),
    "ip_addr/debian-12-eth0.txt": (
        linux.parse_ip_addr,
        (NetInterface("lo", ("127.0.0.1",), up=True), NetInterface("eth0", ("192.0.2.2",), up=True)),
    ),
    "ip_addr/netns-veth-secondary.txt": (
        linux.parse_ip_addr,
        (
            NetInterface("lo", ("127.0.0.1",), up=True),
            NetInterface("veth1", ("10.0.0.5",), up=True),
            NetInterface("veth0", ("192.168.10.1", "192.168.10.2"), up=True),  # primary + secondary, grouped
        ),
    ),
    "ip_addr/netns-veth-bridge.txt": (
        linux.parse_ip_addr,
        (
            NetInterface("lo", ("127.0.0.1",), up=True),
            NetInterface("eth0", ("10.77.0.2",), up=True),
            NetInterface("br0", ("10.78.0.1",), up=True),
        ),
    ),
    # speed -1 (SPEED_UNKNOWN) and an unreadable speed (down, loopback) are both None.
    "sys_class_net/debian-12-vm-virtio.txt": (linux.parse_sys_class_net, VM_LINKS),
    "sys_class_net/debian-12-vm-testbed-bridge.txt": (
        linux.parse_sys_class_net,
        (
            *VM_LINKS,
            NetLink("mxfa661cbr", 1, 10000, "up", has_device=False, wireless=False, devtype="bridge",
                    lower=("mxfa661cv1", "mxfa661cv2"), path=VNET + "mxfa661cbr"),
            _veth("mxfa661cv1"),
            _veth("mxfa661cv2"),
        ),
    ),
    "sys_class_net/netns-veth-bridge.txt": (
        linux.parse_sys_class_net,
        (
            NetLink("br0", 1, 10000, "up", has_device=False, wireless=False, devtype="bridge", lower=("va",),
                    path=VNET + "br0"),
            _veth("eth0"),
            NetLink("lo", 772, None, "unknown", has_device=False, wireless=False, path=VNET + "lo"),
            _veth("va"),
            _veth("vb"),
        ),
    ),
    "infiniband/mlx5-single-openshift-doc.txt": (linux.parse_infiniband, ("mlx5_0",)),
    "infiniband/mlx5-ls-columns-openshift-doc.txt": (
        linux.parse_infiniband,
        tuple(f"mlx5_{n}" for n in (0, 1, 10, 2, 3, 4, 5, 6, 7, 8, 9)),
    ),
    "df/debian-12-gnu-root.txt": (
        lambda t: linux.parse_df(t, "/work/main"),
        Disk("/work/main", "/", 264212084 * KiB, 83278848 * KiB),
    ),
    # GNU df without -P wraps a long device name; the numbers are on the next, indented line.
    "df/centos-5.2-df-ak-wrapped.txt": (
        lambda t: linux.parse_df(t, "/home/me"),
        Disk("/home/me", "/", 6983168 * KiB, 3577836 * KiB),
    ),
}

ERROR_CAPTURES: dict[str, Callable[[str], object]] = {
    # `ls` on a machine without RDMA devices: an error text, not a listing (the probe treats the section as
    # optional; the parser must still refuse it).
    "infiniband/absent-debian-12.txt": linux.parse_infiniband,
    # Real nvidia-smi rows of other queries: a three-field reader must not misread them.
    "nvidia_smi/megaminer-235-gtx770-not-supported.txt": linux.parse_nvidia_smi,
    "nvidia_smi/i3pystatus-776-na.txt": linux.parse_nvidia_smi,
}


@pytest.mark.parametrize("rel", sorted(CASES))
def test_capture_parses_to_expected_value(rel: str) -> None:
    parse, expected = CASES[rel]
    assert parse(cap(rel)) == expected


@pytest.mark.parametrize("rel", sorted(ERROR_CAPTURES))
def test_error_capture_raises(rel: str) -> None:
    with pytest.raises(ParseError):
        ERROR_CAPTURES[rel](cap(rel))


def test_df_picks_the_file_system_holding_the_path() -> None:
    text = cap("df/centos-5.2-df-ak-wrapped.txt")
    assert linux.parse_df(text, "/boot/grub") == Disk("/boot/grub", "/boot", 101086 * KiB, 78007 * KiB)
    assert linux.parse_df(text, "/dev/shm/x").mount == "/dev/shm"


# nvidia-smi: no public capture of exactly this query was found (see SOURCES.md). These rows follow the
# documented csv,noheader,nounits format; the "[Not Supported]" and "[N/A]" values are the forms seen in the
# real captures above.
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("NVIDIA GeForce RTX 4090, 37, 1024\n", Gpu(37.0, 1024 * 1024 * 1024, "NVIDIA GeForce RTX 4090")),
        ("GeForce GTX 770, [Not Supported], 1917\n", Gpu(None, 1917 * 1024 * 1024, "GeForce GTX 770")),
        ("GeForce GTX 960M, [N/A], [N/A]\n", Gpu(None, None, "GeForce GTX 960M")),
        (
            "NVIDIA A100-SXM4-80GB, 0, 10\nNVIDIA A100-SXM4-80GB, 97, 20000\n",
            Gpu(97.0, 20010 * 1024 * 1024, "2 x NVIDIA A100-SXM4-80GB"),  # busiest GPU, summed memory
        ),
        ("Tesla T4, 5, 1\nTesla P100-PCIE-16GB, 0, 2\n", Gpu(5.0, 3 * 1024 * 1024, "Tesla T4 + Tesla P100-PCIE-16GB")),
    ],
)
def test_nvidia_smi_rows(text: str, expected: Gpu) -> None:
    assert linux.parse_nvidia_smi(text) == expected


def test_os_release_quoting_and_fallbacks() -> None:
    assert linux.parse_os_release('NAME="Arch Linux"\nBUILD_ID=rolling\n# comment\n') == ("Arch Linux", "rolling")
    assert linux.parse_os_release("NAME='My OS'\nVERSION_ID=\"1.2\"\n") == ("My OS", "1.2")
    assert linux.parse_os_release('NAME="Plain"\n') == ("Plain", "")


def test_meminfo_without_memavailable() -> None:
    assert linux.parse_meminfo("MemTotal:        1024 kB\nMemFree:          512 kB\n") == Memory(1024 * KiB)


def test_ip_addr_empty_is_no_address() -> None:
    assert linux.parse_ip_addr("") == ()
    assert linux.parse_infiniband("") == ()
    assert linux.parse_sys_class_net("") == ()


def test_sys_class_net_virtual_means_no_hardware_behind_it() -> None:
    eth0, ifb0, _, lo = linux.parse_sys_class_net(cap("sys_class_net/debian-12-vm-virtio.txt"))
    assert not eth0.virtual and ifb0.virtual and lo.virtual
    veths = linux.parse_sys_class_net(cap("sys_class_net/netns-veth-bridge.txt"))
    assert all(link.virtual for link in veths)


# A physical NIC, a Wi-Fi card and a bridge over a NIC in the section's format (this VM has none of them):
# the values are the kernel's documented forms (speed in Mb/s, DRIVER of the PCI device's uevent, DEVTYPE wlan).
def test_sys_class_net_hardware_lines() -> None:
    text = (
        "enp3s0 type=1 speed=1000 operstate=up device=1 wireless=0 devtype= driver=e1000e lower= "
        "path=/sys/devices/pci0000:00/0000:00:1c.0/0000:03:00.0/net/enp3s0\n"
        "wlp2s0 type=1 speed= operstate=up device=1 wireless=1 devtype=wlan driver=iwlwifi lower= "
        "path=/sys/devices/pci0000:00/0000:00:1c.2/0000:02:00.0/net/wlp2s0\n"
        "br0 type=1 speed=0 operstate=up device=0 wireless=0 devtype=bridge driver= lower=enp3s0,veth1 "
        "path=/sys/devices/virtual/net/br0\n"
    )
    nic, wifi, br = linux.parse_sys_class_net(text)
    assert (nic.speed_mbps, nic.driver, nic.virtual) == (1000, "e1000e", False)
    assert (wifi.wireless, wifi.devtype, wifi.speed_mbps) == (True, "wlan", None)
    assert (br.speed_mbps, br.lower, br.virtual) == (None, ("enp3s0", "veth1"), True)  # speed 0 = not known


GARBAGE: list[tuple[str, Callable[[str], object], str]] = [
    ("uname", linux.parse_uname, "Linux\n"),
    ("os_release", linux.parse_os_release, "cat: /etc/os-release: No such file or directory\n"),
    ("os_release-no-name", linux.parse_os_release, 'VERSION_ID="12"\n'),
    ("meminfo", linux.parse_meminfo, "cat: /proc/meminfo: No such file or directory\n"),
    ("meminfo-no-total", linux.parse_meminfo, "MemFree:   5 kB\n"),
    ("nproc", linux.parse_nproc, "sh: nproc: not found\n"),
    ("nproc-zero", linux.parse_nproc, "0\n"),
    ("ip_addr", linux.parse_ip_addr, "sh: ip: not found\n"),
    ("ip_addr-inet6", linux.parse_ip_addr, "1: lo    inet6 ::1/128 scope host \\       valid_lft forever\n"),
    ("infiniband", linux.parse_infiniband, "ls: cannot access '/sys/class/infiniband': No such file or directory\n"),
    ("nvidia_smi", linux.parse_nvidia_smi, "No devices were found\n"),
    ("nvidia_smi-empty", linux.parse_nvidia_smi, "\n"),
    ("nvidia_smi-units", linux.parse_nvidia_smi, "Tesla T4, 5 %, 1 MiB\n"),
    ("loadavg", linux.parse_loadavg, "0.27 0.08\n"),
    ("df", lambda t: linux.parse_df(t, "/"), "df: /x: No such file or directory\n"),
    ("sys_class_net", linux.parse_sys_class_net, "sh: 1: cannot open /sys/class/net: No such file\n"),
    ("sys_class_net-missing-field", linux.parse_sys_class_net, "eth0 type=1 speed=1000\n"),
    ("sys_class_net-speed", linux.parse_sys_class_net,
     "eth0 type=1 speed=fast operstate=up device=1 wireless=0 devtype= driver= lower= path=/x\n"),
    ("sys_class_net-flag", linux.parse_sys_class_net,
     "eth0 type=1 speed=1 operstate=up device=yes wireless=0 devtype= driver= lower= path=/x\n"),
]


@pytest.mark.parametrize(("parse", "text"), [(g[1], g[2]) for g in GARBAGE], ids=[g[0] for g in GARBAGE])
def test_garbage_raises_parse_error(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(ParseError):
        parse(text)


LINUX_DIRS = ("os_release", "meminfo", "nproc", "loadavg", "ip_addr", "infiniband", "nvidia_smi", "sys_class_net")


def test_every_linux_capture_has_an_expectation() -> None:
    from tests.unit.test_parse_macos import CASES as MACOS_CASES
    from tests.unit.test_parse_macos import ERROR_CAPTURES as MACOS_ERRORS

    files = {str(p.relative_to(CAPTURES)) for d in LINUX_DIRS for p in (CAPTURES / d).iterdir()}
    assert files <= set(CASES) | set(ERROR_CAPTURES)
    # uname and df hold captures of both systems: each must be expected by one of the two modules.
    shared = {str(p.relative_to(CAPTURES)) for d in ("uname", "df") for p in (CAPTURES / d).iterdir()}
    assert shared <= set(CASES) | set(MACOS_CASES) | set(MACOS_ERRORS)
