"""Linux parsers on recorded real outputs (tests/fixtures/captures, provenance in SOURCES.md).

The Debian captures were taken on the development machine with the probe's own commands; the others come from
public sources. Every capture is parsed to the exact value written here; garbage raises ParseError.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.facts import linux
from coordinator.facts.model import CgroupMemory, CudaDevice, Disk, Gpu, Memory, NetInterface, NetLink, ParseError

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"


def cap(rel: str) -> str:
    return (CAPTURES / rel).read_text(encoding="utf-8")


KiB = 1024
MiB = 1024 * KiB
H100 = CudaDevice(0, "NVIDIA H100 80GB HBM3", "GPU-00000000-0000-4000-8000-000000000001", 81559 * MiB, 0, 0.0,
                  "580.65.06", "9.0")
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
    "cgroup_memory/debian-12-v1-unlimited.txt": (linux.parse_cgroup_memory, CgroupMemory(None)),
    "cgroup_memory/debian-12-v1-capped-768mib.txt": (
        linux.parse_cgroup_memory, CgroupMemory(768 * MiB, "v1", "/mlxc-capture-x")),
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
    # Recorded on an H100 machine with the probe's exact query.
    "nvidia_smi/h100-x1-driver-580.txt": (
        linux.parse_nvidia_smi,
        Gpu(0.0, 0, "NVIDIA H100 80GB HBM3", (
            CudaDevice(0, "NVIDIA H100 80GB HBM3", "GPU-28b21d48-2549-0b80-0692-19a70ffbb369", 81559 * MiB, 0, 0.0,
                       "580.159.04", "9.0"),
        )),
    ),
    # Constructed in nvidia-smi's documented CSV format (SOURCES.md): no NVIDIA device was available to record.
    "nvidia_smi/constructed-h100-x1.txt": (
        linux.parse_nvidia_smi, Gpu(0.0, 0, "NVIDIA H100 80GB HBM3", (H100,)),
    ),
    "nvidia_smi/constructed-a100-x2.txt": (
        linux.parse_nvidia_smi,
        Gpu(97.0, 20004 * MiB, "2 x NVIDIA A100-SXM4-80GB", (  # the busiest GPU, the summed memory in use
            CudaDevice(0, "NVIDIA A100-SXM4-80GB", "GPU-00000000-0000-4000-8000-00000000000a", 81920 * MiB, 4 * MiB,
                       0.0, "535.183.01", "8.0"),
            CudaDevice(1, "NVIDIA A100-SXM4-80GB", "GPU-00000000-0000-4000-8000-00000000000b", 81920 * MiB,
                       20000 * MiB, 97.0, "535.183.01", "8.0"),
        )),
    ),
    "nvidia_smi/constructed-mixed-na.txt": (
        linux.parse_nvidia_smi,
        Gpu(37.0, 1024 * MiB, "NVIDIA GeForce RTX 4090 + Tesla T4", (
            CudaDevice(0, "NVIDIA GeForce RTX 4090", "GPU-00000000-0000-4000-8000-0000000000c0", 24564 * MiB,
                       1024 * MiB, 37.0, "550.54.14", "8.9"),
            CudaDevice(1, "Tesla T4", None, 15360 * MiB, None, None, "550.54.14", "7.5"),  # [N/A], [Not Supported]
        )),
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
    # Real nvidia-smi rows of other queries (7 and 12 fields): the eight-field reader must not misread them.
    "nvidia_smi/megaminer-235-gtx770-not-supported.txt": linux.parse_nvidia_smi,
    "nvidia_smi/i3pystatus-776-na.txt": linux.parse_nvidia_smi,
    # A driver that does not know a queried field (exit 2): an error text, never a GPU.
    "nvidia_smi/invalid-field-rc2.txt": linux.parse_nvidia_smi,
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


def test_nvidia_smi_summary_is_not_the_devices() -> None:
    gpu = linux.parse_nvidia_smi(cap("nvidia_smi/constructed-h100-x1.txt"))
    assert gpu.cuda and gpu.devices[0].memory_total_bytes == 81559 * MiB  # 85.5 GB: the GPU's, not the host's
    assert not Gpu(3.0, None, "Apple M3 Ultra").cuda  # a Mac's accelerator has no CUDA devices


def test_os_release_quoting_and_fallbacks() -> None:
    assert linux.parse_os_release('NAME="Arch Linux"\nBUILD_ID=rolling\n# comment\n') == ("Arch Linux", "rolling")
    assert linux.parse_os_release("NAME='My OS'\nVERSION_ID=\"1.2\"\n") == ("My OS", "1.2")
    assert linux.parse_os_release('NAME="Plain"\n') == ("Plain", "")


def test_cgroup_memory_takes_the_lowest_level() -> None:
    # v2 (the kernel's cgroup-v2.rst: `memory.max` is a byte count or "max"): a parent's limit binds its children.
    text = "v2 /user.slice/user-1000.slice/session-3.scope max\nv2 /user.slice/user-1000.slice 8589934592\n" \
           "v2 /user.slice max\nv2 / max\n"
    assert linux.parse_cgroup_memory(text) == CgroupMemory(8 * 1024**3, "v2", "/user.slice/user-1000.slice")
    assert linux.parse_cgroup_memory("") == CgroupMemory(None)  # no memory controller: no limit known
    assert linux.parse_cgroup_memory("v2 / max\n") == CgroupMemory(None)


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
    ("cgroup_memory", linux.parse_cgroup_memory, "v1 /a 9G\n"),
    ("cgroup_memory-no-path", linux.parse_cgroup_memory, "v2 max\n"),
    ("nproc-zero", linux.parse_nproc, "0\n"),
    ("ip_addr", linux.parse_ip_addr, "sh: ip: not found\n"),
    ("ip_addr-inet6", linux.parse_ip_addr, "1: lo    inet6 ::1/128 scope host \\       valid_lft forever\n"),
    ("infiniband", linux.parse_infiniband, "ls: cannot access '/sys/class/infiniband': No such file or directory\n"),
    ("nvidia_smi", linux.parse_nvidia_smi, "No devices were found\n"),
    ("nvidia_smi-empty", linux.parse_nvidia_smi, "\n"),
    ("nvidia_smi-units", linux.parse_nvidia_smi, "0, Tesla T4, GPU-1, 15360 MiB, 1 MiB, 5 %, 550.54.14, 7.5\n"),
    ("nvidia_smi-old-query", linux.parse_nvidia_smi, "NVIDIA A100, 37, 1024\n"),
    ("nvidia_smi-no-index", linux.parse_nvidia_smi, "GPU0, Tesla T4, GPU-1, 15360, 1, 5, 550.54.14, 7.5\n"),
    ("nvidia_smi-driver", linux.parse_nvidia_smi,
     "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
     "NVIDIA driver is installed and running.\n"),
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


LINUX_DIRS = ("os_release", "meminfo", "cgroup_memory", "nproc", "loadavg", "ip_addr", "infiniband", "nvidia_smi",
              "sys_class_net")


def test_every_linux_capture_has_an_expectation() -> None:
    from tests.unit.test_parse_macos import CASES as MACOS_CASES
    from tests.unit.test_parse_macos import ERROR_CAPTURES as MACOS_ERRORS

    files = {str(p.relative_to(CAPTURES)) for d in LINUX_DIRS for p in (CAPTURES / d).iterdir()}
    assert files <= set(CASES) | set(ERROR_CAPTURES)
    # uname and df hold captures of both systems: each must be expected by one of the two modules.
    shared = {str(p.relative_to(CAPTURES)) for d in ("uname", "df") for p in (CAPTURES / d).iterdir()}
    assert shared <= set(CASES) | set(MACOS_CASES) | set(MACOS_ERRORS)
