"""Pure parsers for the outputs of the Linux commands the node probe runs.

Same contract as `coordinator.facts.macos`: text in, typed value out, `ParseError` for anything that is not
what the command prints, empty results only for valid empty answers. Nothing here does I/O.
"""

from __future__ import annotations

import re
import shlex

from coordinator.facts.common import excerpt, parse_df, parse_uname, require_text
from coordinator.facts.model import CgroupMemory, CudaDevice, Gpu, Memory, NetInterface, NetLink, ParseError

__all__ = [
    "parse_cgroup_memory",
    "parse_df",
    "parse_infiniband",
    "parse_ip_addr",
    "parse_loadavg",
    "parse_meminfo",
    "parse_nproc",
    "parse_nvidia_smi",
    "parse_os_release",
    "parse_sys_class_net",
    "parse_uname",
]

_OS_RELEASE_LINE = re.compile(r"^(?P<key>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


def parse_os_release(text: str) -> tuple[str, str]:
    """/etc/os-release -> (PRETTY_NAME or NAME, VERSION_ID).

    Lines are `KEY=value` with shell-style quoting (os-release(5)); comments and blank lines are allowed.
    Rolling distributions have no VERSION_ID: BUILD_ID ("rolling") is used, else "". Raises `ParseError` on a
    line that is not an assignment or when neither PRETTY_NAME nor NAME is set.
    """
    fields: dict[str, str] = {}
    for line in require_text(text, "os-release").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _OS_RELEASE_LINE.match(line.strip())
        if match is None:
            raise ParseError(f"os-release: expected KEY=value lines, got {excerpt(line)}")
        try:
            words = shlex.split(match["value"])
        except ValueError as exc:
            raise ParseError(f"os-release: bad quoting in {excerpt(line)} ({exc})") from None
        fields[match["key"]] = " ".join(words)
    name = fields.get("PRETTY_NAME") or fields.get("NAME")
    if not name:
        raise ParseError(f"os-release: neither PRETTY_NAME nor NAME in {excerpt(text)}")
    return name, fields.get("VERSION_ID") or fields.get("BUILD_ID") or ""


_MEMINFO_LINE = re.compile(r"^(?P<key>[A-Za-z0-9_()]+):\s+(?P<value>\d+)(?:\s+(?P<unit>kB))?\s*$")


def parse_meminfo(text: str) -> Memory:
    """/proc/meminfo -> `Memory` (MemTotal and MemAvailable, kB -> bytes; free_percent = available/total).

    MemAvailable is missing on kernels before 3.14: available and free_percent are then None. Raises
    `ParseError` on a line that is not `Key: N [kB]` or when MemTotal is missing or zero.
    """
    values: dict[str, int] = {}
    for line in require_text(text, "meminfo").splitlines():
        if not line.strip():
            continue
        match = _MEMINFO_LINE.match(line.strip())
        if match is None:
            raise ParseError(f"meminfo: expected 'Key: N kB' lines, got {excerpt(line)}")
        values[match["key"]] = int(match["value"]) * (1024 if match["unit"] else 1)
    total = values.get("MemTotal")
    if not total:
        raise ParseError("meminfo: no MemTotal")
    available = values.get("MemAvailable")
    return Memory(
        total_bytes=total,
        available_bytes=available,
        free_percent=None if available is None else round(100.0 * available / total, 2),
    )


# v1 has no "unlimited" word: an unset limit reads as the page counter's maximum (PAGE_COUNTER_MAX x page size,
# 9223372036854771712 on x86_64 with 4 KiB pages). Anything this large is no limit on a real machine.
CGROUP_UNLIMITED = 2**62
_CGROUP_LINE = re.compile(r"^(?P<version>v[12]) (?P<path>/\S*) (?P<value>\d+|max)$")


def parse_cgroup_memory(text: str) -> CgroupMemory:
    """`sh -c "$CGROUP_MEMORY"` (coordinator/facts/probe.py) -> the lowest memory limit of the probe's cgroup and
    its ancestors. Lines are `v1|v2 PATH VALUE`, VALUE a byte count or `max`; empty output is valid (no memory
    controller, or nothing readable): no limit. Raises `ParseError` on any other line."""
    best: CgroupMemory = CgroupMemory(None)
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _CGROUP_LINE.match(line.strip())
        if match is None:
            raise ParseError(f"cgroup_memory: expected 'v1|v2 PATH BYTES|max' lines, got {excerpt(line)}")
        value = match["value"]
        if value == "max" or int(value) >= CGROUP_UNLIMITED:
            continue
        if best.limit_bytes is None or int(value) < best.limit_bytes:
            best = CgroupMemory(int(value), match["version"], match["path"])
    return best


def parse_nproc(text: str) -> int:
    """`nproc` -> the number of processing units available (a positive integer on one line)."""
    body = require_text(text, "nproc")
    if not body.isdigit() or int(body) <= 0:
        raise ParseError(f"nproc: expected a positive integer, got {excerpt(body)}")
    return int(body)


# `ip -o -4 addr show`: "3: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\       valid_lft ..."
_IP_LINE = re.compile(r"^\d+:\s+(?P<name>[^\s:]+)\s+inet\s+(?P<addr>\d{1,3}(?:\.\d{1,3}){3})/\d{1,2}\b")


def parse_ip_addr(text: str) -> tuple[NetInterface, ...]:
    """`ip -o -4 addr show` -> one `NetInterface` per interface (several addresses grouped), in listed order.

    The command lists only addresses of configured interfaces, so `up` is True; `active` (a macOS notion) is
    None. Empty output is valid (no IPv4 address anywhere). Raises `ParseError` on a line that is not an
    `N: IFACE inet A.B.C.D/LEN ...` record.
    """
    order: list[str] = []
    addrs: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _IP_LINE.match(line.strip())
        if match is None:
            raise ParseError(f"ip -o -4 addr show: unexpected line {excerpt(line)}")
        if match["name"] not in addrs:
            order.append(match["name"])
            addrs[match["name"]] = []
        addrs[match["name"]].append(match["addr"])
    return tuple(NetInterface(name=n, ipv4=tuple(addrs[n]), up=True) for n in order)


_NET_FIELDS = ("type", "speed", "operstate", "device", "wireless", "devtype", "driver", "lower", "path")
_NET_NAME = re.compile(r"^[^\s/=]+$")


def _net_int(value: str, what: str, line: str) -> int | None:
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ParseError(f"/sys/class/net: {what} {value!r} is not a number in {excerpt(line)}") from None


def _net_flag(value: str, what: str, line: str) -> bool:
    if value not in ("0", "1"):
        raise ParseError(f"/sys/class/net: {what} must be 0 or 1, got {value!r} in {excerpt(line)}")
    return value == "1"


def parse_sys_class_net(text: str) -> tuple[NetLink, ...]:
    """The `sys_class_net` section (`coordinator.facts.probe.SYS_CLASS_NET`) -> one `NetLink` per interface, in order.

    Each line is `NAME type=T speed=S operstate=O device=0|1 wireless=0|1 devtype=D driver=R lower=A,B path=P`,
    every field present, empty where the file was absent or unreadable. A speed of -1 (the kernel's
    SPEED_UNKNOWN), 0 or empty is None. Empty output is valid (no /sys/class/net). Raises `ParseError` on a line
    of another shape, a missing field or a non-numeric type or speed.
    """
    links: list[NetLink] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, *pairs = line.split()
        fields: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in _NET_FIELDS:
                raise ParseError(f"/sys/class/net: unexpected field {pair!r} in {excerpt(line)}")
            fields[key] = value
        missing = [f for f in _NET_FIELDS if f not in fields]
        if not _NET_NAME.match(name) or missing:
            raise ParseError(f"/sys/class/net: expected 'NAME type=... path=...', got {excerpt(line)}")
        speed = _net_int(fields["speed"], "speed", line)
        links.append(NetLink(
            name=name,
            arphrd_type=_net_int(fields["type"], "type", line),
            speed_mbps=speed if speed is not None and speed > 0 else None,
            operstate=fields["operstate"] or None,
            has_device=_net_flag(fields["device"], "device", line),
            wireless=_net_flag(fields["wireless"], "wireless", line),
            devtype=fields["devtype"] or None,
            driver=fields["driver"] or None,
            lower=tuple(x for x in fields["lower"].split(",") if x),
            path=fields["path"] or None,
        ))
    return tuple(links)


_IB_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_infiniband(text: str) -> tuple[str, ...]:
    """`ls -1 /sys/class/infiniband` -> RDMA device names (e.g. mlx5_0); empty output is no device.

    Names are split on any whitespace, so `ls` in column mode parses too. Raises `ParseError` on a token that
    cannot be a device name (for example `ls`'s own "cannot access" error).
    """
    names = tuple(text.split())
    bad = [n for n in names if not _IB_NAME.match(n)]
    if bad:
        raise ParseError(f"/sys/class/infiniband listing: not device names: {excerpt(text)}")
    return names


_NA = frozenset({"[N/A]", "[Not Supported]", "N/A"})


def _smi_number(field: str, what: str, row: str) -> float | None:
    if field in _NA:
        return None  # nvidia-smi prints these for fields the GPU does not report
    try:
        return float(field)
    except ValueError:
        raise ParseError(f"nvidia-smi: {what} {field!r} is not a number in row {excerpt(row)}") from None


NVIDIA_SMI_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "utilization.gpu", "driver_version",
                     "compute_cap")
"""The `--query-gpu` fields of `coordinator.facts.probe.NVIDIA_SMI`, in order (one CSV row per GPU)."""

MiB = 1024 * 1024


def _smi_text(field: str) -> str | None:
    return None if field in _NA or not field else field


def parse_nvidia_smi(text: str) -> Gpu:
    """`nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,utilization.gpu,driver_version,compute_cap
    --format=csv,noheader,nounits` -> `Gpu` with one `CudaDevice` per row.

    nvidia-smi's documented CSV: one row per GPU, the queried fields in order, separated by ", ", numbers without
    units (memory in MiB) under `nounits`; a field the GPU does not report is `[N/A]` or `[Not Supported]` (None).
    The node-level summary: the busiest GPU's utilisation (any busy GPU means the node is in use), the summed
    memory in use, and the name as "NVIDIA H100 80GB HBM3" (one GPU), "8 x NVIDIA H100 80GB HBM3" (several of
    one model) or the names joined with " + ". Raises `ParseError` on no row (e.g. "No devices were found") or a
    row of another shape (the output of a different query, an error message).
    """
    rows = [r for r in require_text(text, "nvidia-smi").splitlines() if r.strip()]
    devices: list[CudaDevice] = []
    for row in rows:
        fields = [f.strip() for f in row.split(",")]
        if len(fields) != len(NVIDIA_SMI_FIELDS) or not fields[1] or not fields[0].isdigit():
            raise ParseError(f"nvidia-smi: expected '{', '.join(NVIDIA_SMI_FIELDS)}' rows, got {excerpt(row)}")
        total = _smi_number(fields[3], "memory.total", row)
        used = _smi_number(fields[4], "memory.used", row)
        devices.append(CudaDevice(
            index=int(fields[0]),
            name=fields[1],
            uuid=_smi_text(fields[2]),
            memory_total_bytes=None if total is None else int(total * MiB),
            memory_used_bytes=None if used is None else int(used * MiB),
            utilization_pct=_smi_number(fields[5], "utilization.gpu", row),
            driver_version=_smi_text(fields[6]),
            compute_cap=_smi_text(fields[7]),
        ))
    names = [d.name for d in devices]
    if len(set(names)) == 1:
        name = names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    else:
        name = " + ".join(names)
    utils = [d.utilization_pct for d in devices if d.utilization_pct is not None]
    used_all = [d.memory_used_bytes for d in devices if d.memory_used_bytes is not None]
    return Gpu(
        utilization_pct=max(utils) if utils else None,
        in_use_memory_bytes=sum(used_all) if used_all else None,
        name=name,
        devices=tuple(devices),
    )


_LOADAVG = re.compile(r"^(\d+\.\d+) (\d+\.\d+) (\d+\.\d+) \d+/\d+ \d+$")


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """/proc/loadavg -> the 1, 5 and 15 minute load averages. Raises `ParseError` on any other shape."""
    match = _LOADAVG.match(require_text(text, "loadavg"))
    if match is None:
        raise ParseError(f"/proc/loadavg: expected 'L1 L5 L15 R/T PID', got {excerpt(text)}")
    return float(match[1]), float(match[2]), float(match[3])
