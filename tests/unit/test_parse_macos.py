"""macOS parsers on recorded real outputs (tests/fixtures/captures, provenance in SOURCES.md).

Each capture is parsed to the exact value written here; each pitfall of docs/macos-outputs.md §0 has a test named
`test_pitfall_N_*` that fails if the parser ignored it; garbage raises ParseError; and every node profile in
tests/fixtures/profiles parses completely.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.facts import macos
from coordinator.facts.model import (
    CpuLevel,
    Disk,
    Gpu,
    Hardware,
    HardwarePort,
    NetInterface,
    ParseError,
    ThunderboltPort,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = FIXTURES / "captures"
PROFILES = FIXTURES / "profiles"


def cap(rel: str) -> str:
    return (CAPTURES / rel).read_text(encoding="utf-8")


def sp(rel: str) -> dict[str, Any]:
    return macos.parse_system_profiler(cap(rel))


GiB = 1024**3

# ------------------------------------------------------------------------------------------------ expectations

M5_HW = Hardware(
    chip="Apple M5 Max",
    model_id="Mac17,6",
    model_name="MacBook Pro",
    memory_bytes=128 * GiB,
    cpu_total=18,
    cpu_levels=(CpuLevel("Super", 6), CpuLevel("Performance", 12)),
)
M4_HW = Hardware(
    chip="Apple M4 Max",
    model_id="Mac16,5",
    model_name="MacBook Pro",
    memory_bytes=48 * GiB,
    cpu_total=16,
    cpu_levels=(CpuLevel("Performance", 12), CpuLevel("Efficiency", 4)),
)


def _empty(bus: str, uuid: str, receptacle: str) -> ThunderboltPort:
    """A TB5 receptacle with nothing plugged in: it reports what it can do, "Up to 120 Gb/s"."""
    return ThunderboltPort(bus, uuid, receptacle, connected=False, speed_gbps=None, max_speed_gbps=120.0)


MBP_TB = (
    _empty("thunderboltusb4_bus_2", "AD089FC0-E653-4FFE-B00A-DFF110B2F9A1", "3"),
    _empty("thunderboltusb4_bus_1", "200E23D3-C921-44E0-95F7-55144AC251CC", "2"),
    ThunderboltPort(
        "thunderboltusb4_bus_0",
        "817DCFA4-B481-4100-80FC-91C7AA969F0B",
        "1",
        connected=True,
        speed_gbps=80.0,
        max_speed_gbps=None,
        peer_domain_uuid="28CA4C30-A263-4C55-B302-953416D0B209",
        peer_name="Mac Studio",
        peer_model="Mac15,14",
        peer_rdma_service=False,  # in this capture the Studio advertised only service_ip
    ),
)
STUDIO_TB = (
    _empty("thunderboltusb4_bus_5", "1CF1083E-9B3C-4D21-8467-769814784F4D", "6"),
    _empty("thunderboltusb4_bus_4", "54AA5FD1-F8F9-438A-8825-7268E164186C", "5"),
    # The OWC Envoy Ultra (storage) has no domain UUID: a connected port without a Mac peer.
    ThunderboltPort("thunderboltusb4_bus_3", "5F771049-70BD-4C30-A4AB-4E50482D82E0", "4", True, 80.0, None),
    _empty("thunderboltusb4_bus_2", "C9B32174-396A-4D89-9601-E8E83285C21A", "3"),
    ThunderboltPort(
        "thunderboltusb4_bus_1",
        "28CA4C30-A263-4C55-B302-953416D0B209",
        "2",
        connected=True,
        speed_gbps=80.0,
        max_speed_gbps=None,
        peer_domain_uuid="817DCFA4-B481-4100-80FC-91C7AA969F0B",
        peer_name="MacBook Pro",
        peer_model="Mac17,7",
        peer_rdma_service=True,  # unknown_xd_service, protocol_id_key 64087
    ),
    _empty("thunderboltusb4_bus_0", "57AE1A4C-B830-48D1-90DD-A3EDB8AC8DFC", "1"),
)

GLPI_IFCONFIG = (
    NetInterface("lo0", ("127.0.0.1",), up=True),
    NetInterface("gif0"),
    NetInterface("stf0"),
    NetInterface("anpi1", up=True, active=False),
    NetInterface("anpi0", up=True, active=False),
    NetInterface("en4", up=True, active=False),
    NetInterface("en5", up=True, active=False),
    NetInterface("en1", up=True, active=False),
    NetInterface("en2", up=True, active=False),
    NetInterface("en3", up=True, active=False),
    NetInterface("bridge0", up=True, active=False, members=("en1", "en2", "en3")),
    NetInterface("ap1", up=True, active=False),
    NetInterface("en0", ("192.168.2.46",), up=True, active=True),
    NetInterface("awdl0", up=True, active=True),
    NetInterface("llw0", up=True, active=False),
    NetInterface("utun0", up=True),
    NetInterface("utun1", up=True),
    NetInterface("utun2", up=True),
    NetInterface("utun3", up=True),
)

VM_STAT_COUNTS = {
    "Pages free": 5264,
    "Pages active": 303523,
    "Pages inactive": 286641,
    "Pages speculative": 16492,
    "Pages throttled": 0,
    "Pages wired down": 119647,
    "Pages purgeable": 11576,
    "Translation faults": 768339733,
    "Pages copy-on-write": 107748490,
    "Pages zero filled": 303247220,
    "Pages reactivated": 9828730,
    "Pages purged": 778364,
    "File-backed pages": 207293,
    "Anonymous pages": 399363,
    "Pages stored in compressor": 643786,
    "Pages occupied by compressor": 279379,
    "Decompressions": 18381876,
    "Compressions": 20215864,
    "Pageins": 5903383,
    "Pageouts": 82802,
    "Swapins": 0,
    "Swapouts": 0,
}


def _hp(*pairs: tuple[str, str]) -> tuple[HardwarePort, ...]:
    return tuple(HardwarePort(p, d) for p, d in pairs)


# capture file -> (what to compute from its text, the exact expected value)
CASES: dict[str, tuple[Callable[[str], object], object]] = {
    "uname/darwin-23.6.0-arm64-m3-mbp.txt": (macos.parse_uname, ("Darwin", "23.6.0", "arm64")),
    "sw_vers/macos-26.5-25F71.txt": (macos.parse_sw_vers, ("macOS", "26.5", "25F71")),
    "sw_vers/macos-26.6.2-25G83-gha-runner.txt": (macos.parse_sw_vers, ("macOS", "26.6.2", "25G83")),
    "sw_vers/macos-26.4-25E246-mba-m2.txt": (macos.parse_sw_vers, ("macOS", "26.4", "25E246")),
    "sw_vers/macos-15.6.1-24G90.txt": (macos.parse_sw_vers, ("macOS", "15.6.1", "24G90")),
    "sw_vers/macos-15.7.9-24G830.txt": (macos.parse_sw_vers, ("macOS", "15.7.9", "24G830")),
    "sw_vers/macos-14.6.1-23G93-m1max.txt": (macos.parse_sw_vers, ("macOS", "14.6.1", "23G93")),
    "sysctl/m5max-mbp-perflevels.txt": (
        lambda t: macos.parse_hardware({}, macos.parse_sysctl(t)),
        Hardware(None, None, None, None, cpu_total=18, cpu_levels=(CpuLevel("Super", 6), CpuLevel("Performance", 12))),
    ),
    "sysctl/m3max-mbp-hw-excerpt.txt": (
        lambda t: macos.parse_hardware({}, macos.parse_sysctl(t)),
        Hardware(
            None,
            None,
            None,
            memory_bytes=137438953472,
            cpu_total=16,
            cpu_levels=(CpuLevel("Performance", 12), CpuLevel("Efficiency", 4)),  # perflevel0 first
            page_size=16384,
        ),
    ),
    "sysctl/macos-11.0-apple-m1-machdep-glpi.txt": (
        lambda t: macos.parse_hardware({}, macos.parse_sysctl(t)),
        Hardware("Apple M1", None, None, None, None),
    ),
    "sysctl/vm-loadavg-swapusage-mac-load.txt": (macos.parse_vm_loadavg, (4.38, 8.08, 15.92)),
    "system_profiler/SPHardwareDataType-m5max-mbp.json": (
        lambda t: macos.parse_hardware(macos.parse_system_profiler(t), {}),
        M5_HW,
    ),
    "system_profiler/SPHardwareDataType-m4max-mbp.json": (
        lambda t: macos.parse_hardware(macos.parse_system_profiler(t), {}),
        M4_HW,
    ),
    "system_profiler/SPDisplaysDataType-m5max-mbp.json": (
        lambda t: macos.parse_hardware(
            {**macos.parse_system_profiler(t), **sp("system_profiler/SPHardwareDataType-m5max-mbp.json")}, {}
        ),
        dataclasses.replace(M5_HW, gpu_cores=40),
    ),
    "system_profiler/SPThunderboltDataType-m5max-mbp.json": (
        lambda t: macos.parse_thunderbolt(macos.parse_system_profiler(t)),
        MBP_TB,
    ),
    "system_profiler/SPThunderboltDataType-m3ultra-studio.json": (
        lambda t: macos.parse_thunderbolt(macos.parse_system_profiler(t)),
        STUDIO_TB,
    ),
    "networksetup/m5max-mbp-macos26.5.txt": (
        macos.parse_hardware_ports,
        _hp(
            ("Wi-Fi", "en0"),
            ("USB 10/100/1G/2.5G/5G/10G LAN", "en16"),
            ("Ethernet Adapter (en3)", "en3"),
            ("Thunderbolt Ethernet Slot 0", "en10"),
            ("Thunderbolt Ethernet Slot 1, Port 1", "en11"),
            ("Thunderbolt Bridge", "bridge0"),
            ("Thunderbolt 1", "en1"),
            ("Thunderbolt 2", "en6"),
            ("Thunderbolt 3", "en2"),
        ),
    ),
    "networksetup/macmini.txt": (
        macos.parse_hardware_ports,
        _hp(
            ("Ethernet", "en0"),
            ("Ethernet Adapter (en5)", "en5"),
            ("Thunderbolt Bridge", "bridge0"),
            ("Wi-Fi", "en1"),
            ("Thunderbolt 1", "en2"),
        ),
    ),
    "networksetup/mbp16-2021-apple-silicon-macos14.4-glpi.txt": (
        macos.parse_hardware_ports,
        _hp(
            ("Ethernet Adapter (en4)", "en4"),
            ("Ethernet Adapter (en5)", "en5"),
            ("Thunderbolt Bridge", "bridge0"),
            ("Wi-Fi", "en0"),
            ("Thunderbolt 1", "en1"),
            ("Thunderbolt 2", "en2"),
            ("Thunderbolt 3", "en3"),
        ),
    ),
    "ifconfig/mbp16-2021-apple-silicon-macos14.4-glpi.txt": (macos.parse_ifconfig, GLPI_IFCONFIG),
    "rdma_ctl/enabled.txt": (macos.parse_rdma_ctl, "enabled"),
    "rdma_ctl/disabled.txt": (macos.parse_rdma_ctl, "disabled"),
    "ibv_devices/m3ultra-mlx-docs.txt": (
        macos.parse_ibv_devices,
        ("rdma_en2", "rdma_en3", "rdma_en5", "rdma_en4", "rdma_en6", "rdma_en7"),  # listed order, not sorted
    ),
    "ibv_devices/m5max-osaurus-macos27.txt": (macos.parse_ibv_devices, ("rdma_en1", "rdma_en6", "rdma_en2")),
    "ibv_devices/header-only-osaurus-macos27.txt": (macos.parse_ibv_devices, ()),
    "ibv_devinfo/m5max-osaurus-macos27-rdma_en1.txt": (macos.parse_ibv_devinfo, {"rdma_en1": "PORT_DOWN"}),
    "ibv_devinfo/tn3205-excerpt.txt": (macos.parse_ibv_devinfo, {"rdma_en2": "PORT_ACTIVE"}),
    "vm_stat/apple-silicon-16k.txt": (macos.parse_vm_stat, (16384, VM_STAT_COUNTS)),
    "memory_pressure/mac-16gb.txt": (macos.parse_memory_pressure, (17179869184, 57.0)),
    "pmset/macmini-m4-desktop.txt": (macos.parse_pmset, (0, ("caffeinate", "powerd"), False)),
    "pmset/laptop-2026-10-09.txt": (macos.parse_pmset, (1, ("powerd", "sharingd"), False)),
    "pmset_batt/laptop-on-battery.txt": (macos.parse_pmset_batt, (True, 91)),
    "pmset_batt/desktop-ac-power.txt": (macos.parse_pmset_batt, (False, None)),
    "df/macos-apfs-data-volume.txt": (
        lambda t: macos.parse_df(t, "/Users/me/work"),
        Disk("/Users/me/work", "/System/Volumes/Data", 482797652 * 1024, 93317752 * 1024),
    ),
    "df/osx-10.5-df-ak.txt": (
        lambda t: macos.parse_df(t, "/Volumes/GIMP 2.6.4 Leopard universal/Contents"),
        Disk(
            "/Volumes/GIMP 2.6.4 Leopard universal/Contents",
            "/Volumes/GIMP 2.6.4 Leopard universal",
            294924 * 1024,
            30076 * 1024,
        ),
    ),
    "ioreg/m1pro-max-mbp16-macos12.6-excerpt.txt": (
        macos.parse_ioreg_accelerator,
        Gpu(utilization_pct=2.0, in_use_memory_bytes=340983808, name="AGXAcceleratorG13X"),
    ),
    "ioreg/m4-idle-performance-statistics-line.txt": (
        macos.parse_ioreg_accelerator,
        Gpu(utilization_pct=0.0, in_use_memory_bytes=763723776, name=None),
    ),
}

# Captures that are the output of something other than a valid answer: they must raise.
ERROR_CAPTURES: dict[str, Callable[[str], object]] = {
    # `rdma_ctl enable` outside Recovery: an error text, not a status (reference §5f).
    "rdma_ctl/enable-outside-recovery.txt": macos.parse_rdma_ctl,
}


@pytest.mark.parametrize("rel", sorted(CASES))
def test_capture_parses_to_expected_value(rel: str) -> None:
    parse, expected = CASES[rel]
    assert parse(cap(rel)) == expected


@pytest.mark.parametrize("rel", sorted(ERROR_CAPTURES))
def test_error_capture_raises(rel: str) -> None:
    with pytest.raises(ParseError):
        ERROR_CAPTURES[rel](cap(rel))


# ----------------------------------------------------------------------------------------------------- pitfalls


@pytest.mark.parametrize(
    ("value", "total", "levels"),
    [
        ("proc 16:12:4", 16, (CpuLevel("Performance", 12), CpuLevel("Efficiency", 4))),  # macOS 15 (§2b)
        ("proc 16:12:4:0", 16, (CpuLevel("Performance", 12), CpuLevel("Efficiency", 4))),  # M4 Max, macOS 26 (§2d)
        ("proc 18:6:0:12", 18, (CpuLevel("Super", 6), CpuLevel("Performance", 12))),  # M5 Max, macOS 26 (§2a)
        ("proc 8:4:4:0", 8, (CpuLevel("Performance", 4), CpuLevel("Efficiency", 4))),  # M3 Air, macOS 26 (§2d)
        (8, 8, ()),  # Apple VM / Rosetta: a JSON integer
    ],
)
def test_pitfall_1_number_processors_shapes(value: object, total: int, levels: tuple[CpuLevel, ...]) -> None:
    assert macos.parse_number_processors(value) == (total, levels)


@pytest.mark.parametrize("value", ["proc 16:12", "proc 16:12:5", "16", "proc a:b:c", True, None, 0, "proc 18:6:0:13"])
def test_pitfall_1_number_processors_garbage(value: object) -> None:
    with pytest.raises(ParseError):
        macos.parse_number_processors(value)


def test_pitfall_1_four_field_form_read_from_captured_m5max_json() -> None:
    hw = macos.parse_hardware(sp("system_profiler/SPHardwareDataType-m5max-mbp.json"), {})
    # A 3-field reader would see 18 = 6 P + 0 E and lose the 12 second-tier cores.
    assert hw.cpu_total == 18
    assert sum(level.cores for level in hw.cpu_levels) == 18


def test_pitfall_2_perflevel_names_are_read_not_assumed() -> None:
    levels = macos.parse_hardware({}, macos.parse_sysctl(cap("sysctl/m5max-mbp-perflevels.txt"))).cpu_levels
    assert [level.name for level in levels] == ["Super", "Performance"]  # no Efficiency level on M5 Max


@pytest.mark.parametrize(
    ("sysctl_text", "levels"),
    [
        # GitHub's macOS VM runner reports one level named Standard (reference §0.2).
        ("hw.nperflevels: 1\nhw.perflevel0.physicalcpu: 3\nhw.perflevel0.name: Standard\n", (CpuLevel("Standard", 3),)),
        (
            "hw.nperflevels: 3\nhw.perflevel0.physicalcpu: 4\nhw.perflevel0.name: Super\n"
            "hw.perflevel1.physicalcpu: 6\nhw.perflevel1.name: Performance\n"
            "hw.perflevel2.physicalcpu: 4\nhw.perflevel2.name: Efficiency\n",
            (CpuLevel("Super", 4), CpuLevel("Performance", 6), CpuLevel("Efficiency", 4)),
        ),
    ],
)
def test_pitfall_2_any_number_of_levels(sysctl_text: str, levels: tuple[CpuLevel, ...]) -> None:
    hw = macos.parse_hardware({}, macos.parse_sysctl(sysctl_text))
    assert hw.cpu_levels == levels
    assert hw.cpu_total == sum(level.cores for level in levels)


def test_pitfall_2_sysctl_levels_win_over_number_processors() -> None:
    sysctl = macos.parse_sysctl(cap("sysctl/m5max-mbp-perflevels.txt"))
    hw = macos.parse_hardware(sp("system_profiler/SPHardwareDataType-m5max-mbp.json"), sysctl)
    assert hw.cpu_levels == (CpuLevel("Super", 6), CpuLevel("Performance", 12))


def test_pitfall_2_inconsistent_level_count_raises() -> None:
    with pytest.raises(ParseError):
        macos.parse_hardware({}, macos.parse_sysctl("hw.nperflevels: 2\nhw.perflevel0.name: Super\n"))


@pytest.mark.parametrize(
    ("speed", "negotiated", "maximum"),
    [("Up to 120 Gb/s", None, 120.0), ("Up to 40 Gb/s", None, 40.0), ("80 Gb/s", 80.0, None), ("40 Gb/s", 40.0, None)],
)
def test_pitfall_3_speed_forms(speed: str, negotiated: float | None, maximum: float | None) -> None:
    doc = {"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": {"current_speed_key": speed}}]}
    port = macos.parse_thunderbolt(doc)[0]
    assert (port.speed_gbps, port.max_speed_gbps) == (negotiated, maximum)


def test_pitfall_3_connected_tb5_link_is_80_not_up_to_120() -> None:
    connected = [p for p in MBP_TB if p.connected]
    parsed = [
        p for p in macos.parse_thunderbolt(sp("system_profiler/SPThunderboltDataType-m5max-mbp.json")) if p.connected
    ]
    assert parsed == connected and parsed[0].speed_gbps == 80.0 and parsed[0].max_speed_gbps is None


def test_pitfall_3_unknown_speed_raises() -> None:
    doc = {"SPThunderboltDataType": [{"_name": "b", "receptacle_1_tag": {"current_speed_key": "fast"}}]}
    with pytest.raises(ParseError):
        macos.parse_thunderbolt(doc)


def test_pitfall_4_receptacle_to_interface_is_not_sequential() -> None:
    ports = macos.parse_hardware_ports(cap("networksetup/m5max-mbp-macos26.5.txt"))
    by_receptacle = {p.thunderbolt_receptacle: p.device for p in ports if p.thunderbolt_receptacle}
    assert by_receptacle == {"1": "en1", "2": "en6", "3": "en2"}


def test_pitfall_4_dock_ethernet_slots_are_not_receptacles() -> None:
    ports = macos.parse_hardware_ports(cap("networksetup/m5max-mbp-macos26.5.txt"))
    slots = [p for p in ports if p.port.startswith("Thunderbolt Ethernet Slot")]
    assert [p.device for p in slots] == ["en10", "en11"]
    assert all(p.thunderbolt_receptacle is None for p in slots)


def test_pitfall_4_connected_receptacle_maps_to_its_interface() -> None:
    """receptacle_id_key is the N of "Thunderbolt N": the MacBook's connected receptacle 1 is en1."""
    tb = macos.parse_thunderbolt(sp("system_profiler/SPThunderboltDataType-m5max-mbp.json"))
    ports = macos.parse_hardware_ports(cap("networksetup/m5max-mbp-macos26.5.txt"))
    (link,) = [p for p in tb if p.connected]
    assert {p.thunderbolt_receptacle: p.device for p in ports}[link.receptacle] == "en1"


def test_pitfall_5_enabled_with_header_only_means_no_devices() -> None:
    assert macos.parse_rdma_ctl(cap("rdma_ctl/enabled.txt")) == "enabled"
    assert macos.parse_ibv_devices(cap("ibv_devices/header-only-osaurus-macos27.txt")) == ()


def test_pitfall_5_enabled_but_unplugged_port_is_port_down() -> None:
    assert macos.parse_ibv_devinfo(cap("ibv_devinfo/m5max-osaurus-macos27-rdma_en1.txt")) == {"rdma_en1": "PORT_DOWN"}


def test_pitfall_5_rdma_ctl_compares_the_whole_text() -> None:
    # A substring test ('enabled' in text) would read this as enabled.
    with pytest.raises(ParseError):
        macos.parse_rdma_ctl("RDMA is not enabled on this system\n")
    assert macos.parse_rdma_ctl("Enabled\n") == "enabled"
    assert macos.parse_rdma_ctl("pending\n") == "unknown"


def test_pitfall_5_no_ib_devices_is_empty() -> None:
    assert macos.parse_ibv_devinfo("No IB devices found\n") == {}


def test_pitfall_6_page_size_comes_from_the_vm_stat_header() -> None:
    assert macos.parse_vm_stat(cap("vm_stat/apple-silicon-16k.txt"))[0] == 16384
    intel = "Mach Virtual Memory Statistics: (page size of 4096 bytes)\nPages free:    10.\n"
    assert macos.parse_vm_stat(intel) == (4096, {"Pages free": 10})


def test_pitfall_6_available_memory_uses_the_real_page_size() -> None:
    memory = macos.build_memory_macos(
        cap("vm_stat/apple-silicon-16k.txt"), cap("memory_pressure/mac-16gb.txt"), {"hw.memsize": "17179869184"}
    )
    pages = 5264 + 286641 + 16492 + 11576
    assert memory.available_bytes == pages * 16384  # 4x what a 4096 assumption would say
    assert (memory.total_bytes, memory.free_percent, memory.page_size) == (17179869184, 57.0, 16384)


@pytest.mark.parametrize(
    "text",
    [
        "ProductName:\t\tmacOS\nProductVersion:\t\t14.6.1\nBuildVersion:\t\t23G93\n",  # tab runs (captures)
        "ProductName:\tmacOS\nProductVersion:\t14.6.1\nBuildVersion:\t23G93\n",  # one tab (older releases)
        # Rapid Security Response adds a line (macOS 13/14).
        "ProductName:\t\tmacOS\nProductVersion:\t\t14.6.1\nProductVersionExtra:\t(a)\nBuildVersion:\t\t23G93\n",
    ],
)
def test_pitfall_7_sw_vers_separators(text: str) -> None:
    assert macos.parse_sw_vers(text) == ("macOS", "14.6.1", "23G93")


# ---------------------------------------------------------------------------------------- other documented rules


def test_thunderbolt_absent_key_raises_but_empty_list_is_no_bus() -> None:
    with pytest.raises(ParseError):
        macos.parse_thunderbolt(sp("system_profiler/SPHardwareDataType-m5max-mbp.json"))
    assert macos.parse_thunderbolt({"SPThunderboltDataType": []}) == ()


def test_hardware_prefers_hw_memsize_and_falls_back_to_brand_string() -> None:
    hw = macos.parse_hardware({}, {"hw.memsize": "549755813888", "machdep.cpu.brand_string": "Apple M3 Ultra"})
    assert (hw.chip, hw.memory_bytes) == ("Apple M3 Ultra", 549755813888)
    with_json = macos.parse_hardware(sp("system_profiler/SPHardwareDataType-m4max-mbp.json"), {"hw.memsize": "1024"})
    assert with_json.memory_bytes == 1024


def test_ioreg_in_use_memory_is_not_the_driver_figure() -> None:
    line = cap("ioreg/m4-idle-performance-statistics-line.txt")
    assert '"In use system memory (driver)"=0' in line  # the trap comes first in the capture
    assert macos.parse_ioreg_accelerator(line).in_use_memory_bytes == 763723776
    only_driver = '"PerformanceStatistics" = {"In use system memory (driver)"=5,"Device Utilization %"=3}'
    assert macos.parse_ioreg_accelerator(only_driver) == Gpu(3.0, None, None)


def test_ioreg_model_property_names_the_gpu() -> None:
    text = (
        '+-o AGXAcceleratorG15X  <class AGXAcceleratorG15X, id 0x1>\n    {\n      "model" = "Apple M3 Ultra"\n'
        '      "PerformanceStatistics" = {"Device Utilization %"=7,"In use system memory"=10}\n'
    )
    assert macos.parse_ioreg_accelerator(text) == Gpu(7.0, 10, "Apple M3 Ultra")


@pytest.mark.parametrize("rel", ["sysctl/m5max-mbp-perflevels.txt", "sysctl/m3max-mbp-hw-excerpt.txt",
                                 "sysctl/macos-11.0-apple-m1-machdep-glpi.txt"])
def test_vm_loadavg_absent_is_unknown_not_an_error(rel: str) -> None:
    assert macos.parse_vm_loadavg(cap(rel)) is None


def test_sysctl_values_with_colons_and_unknown_oids() -> None:
    text = "sysctl: unknown oid 'kern.memorystatus_vm_pressure_level'\nmachdep.cpu.brand_string: Apple M1: x\n"
    assert macos.parse_sysctl(text) == {"machdep.cpu.brand_string": "Apple M1: x"}


def test_networksetup_ignores_vlan_trailer() -> None:
    text = cap("networksetup/macmini.txt") + "\nHardware Port: bogus\n"
    assert macos.parse_hardware_ports(text) == CASES["networksetup/macmini.txt"][1]


def test_pmset_powermode_one_is_low_power() -> None:
    text = cap("pmset/laptop-2026-10-09.txt").replace(" powermode            0", " powermode            1")
    assert macos.parse_pmset(text)[2] is True


def test_df_mount_point_with_spaces_on_a_single_row() -> None:
    text = (
        "Filesystem   1024-blocks      Used Available Capacity iused     ifree %iused  Mounted on\n"
        "/dev/disk5s1   976490576 100000000 876490576    11%     100 4294967179    0%   /Volumes/Crucial X9\n"
    )
    assert macos.parse_df(text, "/Volumes/Crucial X9/models") == Disk(
        "/Volumes/Crucial X9/models", "/Volumes/Crucial X9", 976490576 * 1024, 876490576 * 1024
    )


def test_df_block_size_comes_from_the_header() -> None:
    text = "Filesystem 512-blocks Used Available Capacity  Mounted on\n/dev/disk1s1 1000 500 500 50% /\n"
    assert macos.parse_df(text, "/").total_bytes == 1000 * 512


# ----------------------------------------------------------------------------------------------------- garbage

TRUNCATED_JSON = cap("system_profiler/SPThunderboltDataType-m5max-mbp.json")[:700]

GARBAGE: list[tuple[str, Callable[[str], object], str]] = [
    ("uname", macos.parse_uname, "sh: uname: command not found\n"),
    ("sw_vers", macos.parse_sw_vers, "zsh: command not found: sw_vers\n"),
    ("sw_vers-no-version", macos.parse_sw_vers, "ProductName:\t\tmacOS\n"),
    ("sysctl", macos.parse_sysctl, "zsh: command not found: sysctl\n"),
    ("sysctl-only-unknown", macos.parse_sysctl, "sysctl: unknown oid 'hw.bogus'\n"),
    ("system_profiler-truncated", macos.parse_system_profiler, TRUNCATED_JSON),
    ("system_profiler-text", macos.parse_system_profiler, "Hardware:\n\n    Hardware Overview:\n"),
    ("system_profiler-array", macos.parse_system_profiler, "[1, 2]\n"),
    ("networksetup", macos.parse_hardware_ports, "networksetup: command not found\n"),
    ("networksetup-no-device", macos.parse_hardware_ports, "Hardware Port: Wi-Fi\nEthernet Address: x\n"),
    ("ifconfig", macos.parse_ifconfig, "ifconfig: interface en9 does not exist\n"),
    ("rdma_ctl", macos.parse_rdma_ctl, "sh: line 2: rdma_ctl: command not found\n"),
    ("rdma_ctl-empty", macos.parse_rdma_ctl, "\n"),
    ("ibv_devices", macos.parse_ibv_devices, "ibv_devices: command not found\n"),
    ("ibv_devices-bad-row", macos.parse_ibv_devices, "device node GUID\n------ ------\nrdma_en2\n"),
    ("ibv_devinfo", macos.parse_ibv_devinfo, "Failed to get IB devices list: Function not implemented\n"),
    ("ibv_devinfo-no-state", macos.parse_ibv_devinfo, "hca_id:\trdma_en2\n\ttransport:\t\tThunderbolt (100)\n"),
    ("vm_stat", macos.parse_vm_stat, "Pages free: 5264.\n"),
    ("vm_stat-value", macos.parse_vm_stat, "Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages: x.\n"),
    ("memory_pressure", macos.parse_memory_pressure, "memory_pressure: command not found\n"),
    ("pmset", macos.parse_pmset, "pmset: command not found\n"),
    ("pmset_batt", macos.parse_pmset_batt, "pmset: command not found\n"),
    ("df", lambda t: macos.parse_df(t, "/"), "df: /nope: No such file or directory\n"),
    ("df-header-only", lambda t: macos.parse_df(t, "/"), "Filesystem 1024-blocks Used Available Capacity Mounted on\n"),
    ("ioreg", macos.parse_ioreg_accelerator, "ioreg: command not found\n"),
    ("vm_loadavg-no-braces", macos.parse_vm_loadavg, "vm.loadavg: 1 2 3\n"),
    # A decimal-comma locale (the same fixture's `{ 212,40 90,10 55,00 }`): refused, never read as 212.
    ("vm_loadavg-decimal-comma", macos.parse_vm_loadavg, "vm.loadavg: { 212,40 90,10 55,00 }\n"),
]


@pytest.mark.parametrize(("parse", "text"), [(g[1], g[2]) for g in GARBAGE], ids=[g[0] for g in GARBAGE])
def test_garbage_raises_parse_error(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(ParseError):
        parse(text)


def test_hardware_without_any_source_raises() -> None:
    with pytest.raises(ParseError):
        macos.parse_hardware({}, {})
    with pytest.raises(ParseError):
        macos.parse_hardware({"SPHardwareDataType": {"not": "a list"}}, {"hw.ncpu": "1"})


# ----------------------------------------------------------------------------------------------------- profiles

SECTIONS = (
    "uname", "sw_vers", "sysctl", "system_profiler", "networksetup", "ifconfig", "rdma_ctl", "ibv_devices",
    "ibv_devinfo", "vm_stat", "memory_pressure", "pmset", "pmset_batt", "df", "ioreg",
)  # fmt: skip
PROFILE_NAMES = ("m5max-mbp-tb5", "m3ultra-studio-tb5", "m4max-mbp-tb4-rdma-nodev", "m1max-macos14")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Every section of a recorded node profile through its parser; None for a command that does not exist."""

    uname: tuple[str, str, str]
    sw_vers: tuple[str, str, str | None]
    hardware: Hardware
    thunderbolt: tuple[ThunderboltPort, ...]
    ports: tuple[HardwarePort, ...]
    interfaces: dict[str, NetInterface]
    rdma_ctl: str | None
    ibv_devices: tuple[str, ...] | None
    ibv_devinfo: dict[str, str] | None
    vm_stat: tuple[int, dict[str, int]]
    memory_pressure: tuple[int | None, float | None]
    pmset: tuple[int | None, tuple[str, ...], bool | None]
    pmset_batt: tuple[bool, int | None]
    disk: Disk
    gpu: Gpu

    def link(self) -> tuple[ThunderboltPort, str]:
        """The one Thunderbolt port connected to another Mac, and the interface networksetup maps it to."""
        (port,) = [p for p in self.thunderbolt if p.connected and p.peer_domain_uuid]
        return port, {p.thunderbolt_receptacle: p.device for p in self.ports}[port.receptacle]


def load_profile(name: str) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for path in sorted((PROFILES / name).glob("*.out")):
        rc_file = path.with_suffix(".rc")
        rc = int(rc_file.read_text()) if rc_file.exists() else 0
        out[path.stem] = (path.read_text(encoding="utf-8"), rc)
    return out


def _tool(sections: dict[str, tuple[str, int]], name: str, parse: Callable[[str], Any]) -> Any:
    """A section whose command may be missing (exit 127): its text must then be refused by the parser.
    `ibv_devinfo` exits 255 with libibverbs' "No IB devices found", which parses as no device."""
    text, rc = sections[name]
    if rc == 127:
        with pytest.raises(ParseError):
            parse(text)
        return None
    assert rc == 0 or (name, rc) == ("ibv_devinfo", 255), (name, rc)
    return parse(text)


def parse_profile(name: str) -> Profile:
    sections = load_profile(name)
    assert set(sections) == set(SECTIONS)
    for section in set(SECTIONS) - {"rdma_ctl", "ibv_devices", "ibv_devinfo"}:
        assert sections[section][1] == 0, section
    text = {k: v[0] for k, v in sections.items()}
    doc = macos.parse_system_profiler(text["system_profiler"])
    return Profile(
        uname=macos.parse_uname(text["uname"]),
        sw_vers=macos.parse_sw_vers(text["sw_vers"]),
        hardware=macos.parse_hardware(doc, macos.parse_sysctl(text["sysctl"])),
        thunderbolt=macos.parse_thunderbolt(doc),
        ports=macos.parse_hardware_ports(text["networksetup"]),
        interfaces={i.name: i for i in macos.parse_ifconfig(text["ifconfig"])},
        rdma_ctl=_tool(sections, "rdma_ctl", macos.parse_rdma_ctl),
        ibv_devices=_tool(sections, "ibv_devices", macos.parse_ibv_devices),
        ibv_devinfo=_tool(sections, "ibv_devinfo", macos.parse_ibv_devinfo),
        vm_stat=macos.parse_vm_stat(text["vm_stat"]),
        memory_pressure=macos.parse_memory_pressure(text["memory_pressure"]),
        pmset=macos.parse_pmset(text["pmset"]),
        pmset_batt=macos.parse_pmset_batt(text["pmset_batt"]),
        disk=macos.parse_df(text["df"], "/Users/me/work"),
        gpu=macos.parse_ioreg_accelerator(text["ioreg"]),
    )


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_profile_parses_completely(name: str) -> None:
    profile = parse_profile(name)
    assert profile.uname[0] == "Darwin" and profile.uname[2] == "arm64"
    hw = profile.hardware
    assert hw.chip and hw.memory_bytes and hw.cpu_total and hw.gpu_cores and hw.page_size == 16384
    assert sum(level.cores for level in hw.cpu_levels) == hw.cpu_total
    assert profile.memory_pressure[0] == hw.memory_bytes  # the derived first line matches the machine
    assert profile.vm_stat[0] == 16384 and profile.disk.mount == "/System/Volumes/Data"
    assert profile.gpu.in_use_memory_bytes is not None


def test_tb5_profiles_are_two_ends_of_one_cable() -> None:
    mbp, studio = parse_profile("m5max-mbp-tb5"), parse_profile("m3ultra-studio-tb5")
    (mbp_port, mbp_if), (studio_port, studio_if) = mbp.link(), studio.link()
    assert mbp_port.peer_domain_uuid == studio_port.domain_uuid
    assert studio_port.peer_domain_uuid == mbp_port.domain_uuid
    assert (mbp_port.speed_gbps, studio_port.speed_gbps) == (80.0, 80.0)
    assert mbp_port.peer_rdma_service and studio_port.peer_rdma_service  # both ends have RDMA enabled
    assert mbp_port.peer_model == "Mac15,14" and studio_port.peer_model == mbp.hardware.model_id
    assert (mbp_if, studio_if) == ("en1", "en3")
    for profile, iface, ip in ((mbp, mbp_if, "192.168.10.1"), (studio, studio_if, "192.168.10.2")):
        assert profile.rdma_ctl == "enabled"
        assert profile.ibv_devices is not None and f"rdma_{iface}" in profile.ibv_devices
        assert profile.ibv_devinfo == {**{d: "PORT_DOWN" for d in profile.ibv_devices}, f"rdma_{iface}": "PORT_ACTIVE"}
        assert profile.interfaces[iface].ipv4 == (ip,) and profile.interfaces[iface].active
    assert studio.ibv_devices is not None and len(studio.ibv_devices) == 6


def test_rdma_nodev_profile() -> None:
    profile = parse_profile("m4max-mbp-tb4-rdma-nodev")
    link, iface = profile.link()
    assert link.speed_gbps == 40.0 and not link.peer_rdma_service
    assert (profile.rdma_ctl, profile.ibv_devices, profile.ibv_devinfo) == ("enabled", (), {})
    assert profile.interfaces[iface].ipv4 == ("192.168.20.1",)
    assert profile.pmset_batt == (True, 91) and profile.pmset == (1, ("powerd", "sharingd"), False)


def test_macos14_profile_has_no_rdma_tools() -> None:
    profile = parse_profile("m1max-macos14")
    assert profile.sw_vers == ("macOS", "14.6.1", "23G93")
    assert (profile.rdma_ctl, profile.ibv_devices, profile.ibv_devinfo) == (None, None, None)
    assert profile.hardware.chip == "Apple M1 Max" and not any(p.connected for p in profile.thunderbolt)
    assert {p.max_speed_gbps for p in profile.thunderbolt} == {40.0}


def test_desktop_profile_power() -> None:
    profile = parse_profile("m3ultra-studio-tb5")
    assert profile.pmset == (0, ("caffeinate", "powerd"), False)
    assert profile.pmset_batt == (False, None)


def test_profile_json_is_one_object_with_three_keys() -> None:
    for name in PROFILE_NAMES:
        doc = json.loads((PROFILES / name / "system_profiler.out").read_text(encoding="utf-8"))
        assert sorted(doc) == ["SPDisplaysDataType", "SPHardwareDataType", "SPThunderboltDataType"]


# ----------------------------------------------------------------------------------------------------- coverage

MACOS_DIRS = (
    "sw_vers", "sysctl", "system_profiler", "networksetup", "ifconfig", "rdma_ctl", "ibv_devices", "ibv_devinfo",
    "vm_stat", "memory_pressure", "pmset", "pmset_batt", "ioreg",
)  # fmt: skip


def test_every_macos_capture_has_an_expectation() -> None:
    files = {str(p.relative_to(CAPTURES)) for d in MACOS_DIRS for p in (CAPTURES / d).iterdir()}
    assert files <= set(CASES) | set(ERROR_CAPTURES)
