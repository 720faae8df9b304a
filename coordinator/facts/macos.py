"""Pure parsers for the outputs of the macOS commands the node probe runs.

Each `parse_*` function takes the text a command printed (stdout and stderr together, as the probe records it)
and returns a typed value from `coordinator.facts.model`. Input that is not what the command prints raises
`ParseError` with a message naming what was expected; a valid but empty answer (for example `ibv_devices`
printing only its header) is an empty result, never an error. Nothing here does I/O.

The pitfalls these parsers guard against are listed in docs/macos-outputs.md §0 and cited below as "pitfall N";
"reference §N" is the section of that page (numbered as the capture reference it was copied from).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from coordinator.facts.common import excerpt, parse_df, parse_uname, require_text
from coordinator.facts.model import (
    CpuLevel,
    Gpu,
    Hardware,
    HardwarePort,
    Memory,
    NetInterface,
    ParseError,
    ThunderboltPort,
)

__all__ = [
    "RDMA_PROTOCOL_ID",
    "build_memory_macos",
    "parse_df",
    "parse_hardware",
    "parse_hardware_ports",
    "parse_ibv_devices",
    "parse_ibv_devinfo",
    "parse_ifconfig",
    "parse_ioreg_accelerator",
    "parse_memory_pressure",
    "parse_number_processors",
    "parse_pmset",
    "parse_pmset_batt",
    "parse_rdma_ctl",
    "parse_sw_vers",
    "parse_sysctl",
    "parse_system_profiler",
    "parse_thunderbolt",
    "parse_uname",
    "parse_vm_stat",
]

# The XDomain service a Mac with RDMA enabled advertises to its Thunderbolt peer (reference §4b, §4d, §5f).
RDMA_PROTOCOL_ID = 64087


# --------------------------------------------------------------------------------------------------- sw_vers


def parse_sw_vers(text: str) -> tuple[str, str, str | None]:
    """`sw_vers` -> (ProductName, ProductVersion, BuildVersion or None).

    Each line is `Key:<tabs>value`; the separator is a run of one or two tabs depending on the release
    (pitfall 7), so a line is split on its first ':' and both sides are stripped. Extra keys such as
    `ProductVersionExtra` (Rapid Security Response, macOS 13/14) are accepted and ignored. Raises `ParseError`
    when ProductName or ProductVersion is missing, the version does not start with a number, or a line is not
    `key: value`.
    """
    fields: dict[str, str] = {}
    for line in require_text(text, "sw_vers").splitlines():
        if not line.strip():
            continue
        key, sep, value = line.partition(":")
        if not sep or not key.strip() or " " in key.strip():
            raise ParseError(f"sw_vers: expected 'Key:<tab>value' lines, got {excerpt(line)}")
        fields[key.strip()] = value.strip()
    name = fields.get("ProductName")
    version = fields.get("ProductVersion")
    if not name or not version:
        raise ParseError(f"sw_vers: ProductName and ProductVersion are required, got keys {sorted(fields)}")
    if not version[:1].isdigit():
        raise ParseError(f"sw_vers: ProductVersion {version!r} is not a version number")
    return name, version, fields.get("BuildVersion") or None


# ---------------------------------------------------------------------------------------------------- sysctl

_SYSCTL_LINE = re.compile(r"^(?P<name>[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)+): ?(?P<value>.*)$")


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl NAME...` -> {name: value}.

    Each line is `name: value`; the value is everything after the first ": ", so values may contain colons.
    Diagnostics the tool prints for names it does not know (`sysctl: unknown oid 'x'`) are skipped: one unknown
    name must not cost the others. Raises `ParseError` when no `name: value` line is present or when a line is
    neither a value nor a sysctl diagnostic (for example a shell's "command not found").
    """
    values: dict[str, str] = {}
    for line in require_text(text, "sysctl").splitlines():
        if not line.strip() or line.startswith("sysctl: "):
            continue
        match = _SYSCTL_LINE.match(line)
        if match is None:
            raise ParseError(f"sysctl: expected 'name: value' lines, got {excerpt(line)}")
        values[match["name"]] = match["value"].strip()
    if not values:
        raise ParseError(f"sysctl: no 'name: value' line in {excerpt(text)}")
    return values


_VM_LOADAVG = re.compile(r"^vm\.loadavg:\s*\{\s*([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*\}\s*$", re.MULTILINE)


def parse_vm_loadavg(sysctl_text: str) -> tuple[float, float, float] | None:
    """macOS `sysctl vm.loadavg` (`vm.loadavg: { 1.52 1.61 1.70 }`) inside a sysctl dump -> the three load
    averages; None when the key is absent. Raises `ParseError` when the key is there but malformed."""
    if not any(line.startswith("vm.loadavg") for line in sysctl_text.splitlines()):
        return None
    match = _VM_LOADAVG.search(sysctl_text)
    if match is None:
        line = next(ln for ln in sysctl_text.splitlines() if ln.startswith("vm.loadavg"))
        raise ParseError(f"vm.loadavg: expected '{{ L1 L5 L15 }}', got {line[:120]!r}")
    return float(match[1]), float(match[2]), float(match[3])


def _sysctl_int(sysctl: Mapping[str, str], name: str) -> int | None:
    raw = sysctl.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ParseError(f"sysctl {name}: {raw!r} is not an integer") from None


# ------------------------------------------------------------------------------------------- system_profiler


def parse_system_profiler(text: str) -> dict[str, Any]:
    """`system_profiler ... -json` -> the top-level JSON object (data type name -> list of entries).

    The section also carries stderr, so log lines the tool prints before or after the JSON are tolerated; the
    object itself must be complete. Raises `ParseError` on no object, invalid or truncated JSON, or a
    top-level value that is not an object.
    """
    body = require_text(text, "system_profiler")
    start = 0 if body.startswith("{") else body.find("\n{")
    if start < 0:
        raise ParseError(f"system_profiler: no JSON object in {excerpt(body)}")
    try:
        data, _end = json.JSONDecoder().raw_decode(body[start:].lstrip())
    except json.JSONDecodeError as exc:
        raise ParseError(f"system_profiler: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ParseError(f"system_profiler: expected a JSON object, got {type(data).__name__}")
    return data


def _entries(sp: Mapping[str, Any], key: str) -> list[dict[str, Any]] | None:
    """The list under a data-type key; None when the key is absent; `ParseError` when it is malformed."""
    if key not in sp:
        return None
    value = sp[key]
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise ParseError(f"system_profiler {key}: expected a list of objects, got {excerpt(json.dumps(value))}")
    return value


_PROC = re.compile(r"^proc (\d+(?::\d+){2,3})$")


def parse_number_processors(value: object) -> tuple[int, tuple[CpuLevel, ...]]:
    """SPHardwareDataType `number_processors` -> (total cores, levels from the fastest tier down).

    It has three shapes (pitfall 1):
    - "proc T:P:E" (macOS 15 and earlier): total, performance, efficiency;
    - "proc T:S:E:M" (macOS 26): total, top tier, efficiency, second tier. On chips with one fast tier the
      last field is 0 ("proc 16:12:4:0", M4 Max) and the top tier is what sysctl calls Performance; when the
      second tier is populated ("proc 18:6:0:12", M5 Max) Apple calls the top tier Super and the second tier
      Performance, which is what `hw.perflevelN.name` reports on those chips (reference §2d, §6b);
    - a JSON integer on a virtual machine or under Rosetta: the total, with no levels.
    Levels with 0 cores are omitted. Raises `ParseError` on any other shape or when the tiers do not add up.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ParseError(f"number_processors: {value} is not a core count")
        return value, ()
    match = _PROC.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ParseError(f"number_processors: unknown shape {value!r}")
    nums = [int(n) for n in match[1].split(":")]
    total = nums[0]
    if len(nums) == 3 or nums[3] == 0:
        tiers = [("Performance", nums[1]), ("Efficiency", nums[2])]
    else:
        tiers = [("Super", nums[1]), ("Performance", nums[3]), ("Efficiency", nums[2])]
    if sum(nums[1:]) != total:
        raise ParseError(f"number_processors {value!r}: the tiers do not add up to the total {total}")
    return total, tuple(CpuLevel(name, n) for name, n in tiers if n > 0)


def _sysctl_levels(sysctl: Mapping[str, str]) -> tuple[CpuLevel, ...] | None:
    """hw.perflevelN.{name,physicalcpu} for N < hw.nperflevels (pitfall 2: names are read, never assumed)."""
    count = _sysctl_int(sysctl, "hw.nperflevels")
    if count is None:
        return None
    levels: list[CpuLevel] = []
    for n in range(count):
        name = sysctl.get(f"hw.perflevel{n}.name")
        cores = _sysctl_int(sysctl, f"hw.perflevel{n}.physicalcpu")
        if name is None or cores is None:
            raise ParseError(f"sysctl: hw.nperflevels is {count} but hw.perflevel{n}.name/physicalcpu is missing")
        levels.append(CpuLevel(name, cores))
    return tuple(levels)


_MEMORY_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(MB|GB|TB)$")
_UNIT = {"MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


def _physical_memory(value: object) -> int:
    match = _MEMORY_SIZE.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ParseError(f"SPHardwareDataType physical_memory: unknown size {value!r}")
    return int(float(match[1]) * _UNIT[match[2]])


def _gpu_cores(sp: Mapping[str, Any]) -> int | None:
    displays = _entries(sp, "SPDisplaysDataType")
    for entry in displays or ():
        raw = entry.get("sppci_cores")
        if raw is None:
            continue
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ParseError(f"SPDisplaysDataType sppci_cores: {raw!r} is not a number") from None
    return None


def parse_hardware(sp: Mapping[str, Any], sysctl: Mapping[str, str]) -> Hardware:
    """SPHardwareDataType/SPDisplaysDataType (parsed system_profiler JSON) plus sysctl values -> `Hardware`.

    - chip: `chip_type`, else `machdep.cpu.brand_string`;
    - memory: `hw.memsize` (exact bytes) in preference to `physical_memory` ("128 GB");
    - CPU levels: `hw.nperflevels` with each level's name and physical cores, falling back to
      `number_processors` (see `parse_number_processors`); total: `hw.physicalcpu`, else `number_processors`,
      else the sum of the levels;
    - gpu_cores: SPDisplaysDataType `sppci_cores` (None without that data type);
    - page_size: `hw.pagesize`.
    Raises `ParseError` when neither source describes the machine or a present value is malformed.
    """
    entries = _entries(sp, "SPHardwareDataType")
    hw: Mapping[str, Any] = entries[0] if entries else {}
    if not hw and not any(k.startswith(("hw.", "machdep.cpu.")) for k in sysctl):
        raise ParseError("no SPHardwareDataType entry and no hw.* sysctl values: nothing describes this machine")

    memory = _sysctl_int(sysctl, "hw.memsize")
    if memory is None and "physical_memory" in hw:
        memory = _physical_memory(hw["physical_memory"])

    proc_total: int | None = None
    proc_levels: tuple[CpuLevel, ...] = ()
    if "number_processors" in hw:
        proc_total, proc_levels = parse_number_processors(hw["number_processors"])
    levels = _sysctl_levels(sysctl)
    cpu_levels = levels if levels is not None else proc_levels
    cpu_total = _sysctl_int(sysctl, "hw.physicalcpu") or proc_total
    if cpu_total is None and cpu_levels:
        cpu_total = sum(level.cores for level in cpu_levels)

    chip = hw.get("chip_type") or sysctl.get("machdep.cpu.brand_string") or None
    return Hardware(
        chip=str(chip) if chip else None,
        model_id=str(hw.get("machine_model") or sysctl.get("hw.model") or "") or None,
        model_name=str(hw.get("machine_name") or "") or None,
        memory_bytes=memory,
        cpu_total=cpu_total,
        cpu_levels=cpu_levels,
        gpu_cores=_gpu_cores(sp),
        page_size=_sysctl_int(sysctl, "hw.pagesize"),
    )


# ------------------------------------------------------------------------------------------------ Thunderbolt

_SPEED = re.compile(r"^(?P<upto>Up to )?(?P<num>\d+(?:\.\d+)?) Gb/s$")


def _speed(raw: object) -> tuple[float | None, float | None]:
    """current_speed_key -> (negotiated, maximum). Pitfall 3: "Up to N Gb/s" is capability, "N Gb/s" the link."""
    if raw is None:
        return None, None
    match = _SPEED.match(raw.strip()) if isinstance(raw, str) else None
    if match is None:
        raise ParseError(f"SPThunderboltDataType current_speed_key: unknown speed {raw!r}")
    value = float(match["num"])
    return (None, value) if match["upto"] else (value, None)


def _advertises_rdma(item: Mapping[str, Any]) -> bool:
    services = item.get("services_title")
    if not isinstance(services, list):
        return False
    for service in services:
        if not isinstance(service, dict):
            continue
        if service.get("protocol_id_key") == RDMA_PROTOCOL_ID or "rdma" in str(service.get("_name", "")).lower():
            return True
    return False


def parse_thunderbolt(sp: Mapping[str, Any]) -> tuple[ThunderboltPort, ...]:
    """SPThunderboltDataType (parsed system_profiler JSON) -> one `ThunderboltPort` per top-level bus.

    `receptacle` is `receptacle_1_tag.receptacle_id_key`, which is the N of "Thunderbolt N" in networksetup
    (pitfall 4); `connected` is `receptacle_status_key == "receptacle_connected"`; speeds follow pitfall 3. The
    peer is the first `_items` entry that has a `domain_uuid_key` (another Mac's bus; storage devices have
    none and are ignored, as mlx.distributed_config does); `peer_rdma_service` is set when that peer advertises
    the XDomain service with protocol id 64087 (or a service named like rdma).

    An absent SPThunderboltDataType key raises `ParseError` (the probe asked for it, so its absence means the
    output is not what we asked for); a present but empty list is a Mac without Thunderbolt buses: ().
    """
    buses = _entries(sp, "SPThunderboltDataType")
    if buses is None:
        raise ParseError("system_profiler output has no SPThunderboltDataType key")
    ports: list[ThunderboltPort] = []
    for bus in buses:
        name = bus.get("_name")
        if not isinstance(name, str) or not name:
            raise ParseError(f"SPThunderboltDataType: bus without a _name: {excerpt(json.dumps(bus))}")
        tag = bus.get("receptacle_1_tag")
        tag = tag if isinstance(tag, dict) else {}
        speed, max_speed = _speed(tag.get("current_speed_key"))
        peer: Mapping[str, Any] = {}
        items = bus.get("_items")
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict) and item.get("domain_uuid_key"):
                peer = item
                break
        receptacle = tag.get("receptacle_id_key")
        ports.append(
            ThunderboltPort(
                bus=name,
                domain_uuid=_str_or_none(bus.get("domain_uuid_key")),
                receptacle=_str_or_none(receptacle),
                connected=tag.get("receptacle_status_key") == "receptacle_connected",
                speed_gbps=speed,
                max_speed_gbps=max_speed,
                peer_domain_uuid=_str_or_none(peer.get("domain_uuid_key")),
                peer_name=_str_or_none(peer.get("_name")),
                peer_model=_str_or_none(peer.get("device_name_key")),
                peer_rdma_service=bool(peer) and _advertises_rdma(peer),
            )
        )
    return tuple(ports)


def _str_or_none(value: object) -> str | None:
    return str(value) if value is not None and value != "" else None


# ------------------------------------------------------------------------------------------------ networksetup


def parse_hardware_ports(text: str) -> tuple[HardwarePort, ...]:
    """`networksetup -listallhardwareports` -> (port name, device) pairs in listed order.

    Records are `Hardware Port:` / `Device:` / `Ethernet Address:` line groups; the `VLAN Configurations`
    trailer and everything after it is ignored. Docks add ports named "Thunderbolt Ethernet Slot N" which are
    not Thunderbolt receptacles (pitfall 4); `HardwarePort.thunderbolt_receptacle` tells them apart. Raises
    `ParseError` on an unknown line, a port without a device, or no port at all.
    """
    ports: list[HardwarePort] = []
    port: str | None = None
    for line in require_text(text, "networksetup").splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("VLAN Configurations"):
            break
        if line.startswith("Hardware Port:"):
            if port is not None:
                raise ParseError(f"networksetup: port {port!r} has no Device line")
            port = line[len("Hardware Port:") :].strip()
        elif line.startswith("Device:"):
            device = line[len("Device:") :].strip()
            if port is None or not device:
                raise ParseError(f"networksetup: Device line outside a port record: {excerpt(line)}")
            ports.append(HardwarePort(port=port, device=device))
            port = None
        elif line.startswith("Ethernet Address:"):
            continue
        else:
            raise ParseError(f"networksetup: unexpected line {excerpt(line)}")
    if port is not None:
        raise ParseError(f"networksetup: port {port!r} has no Device line")
    if not ports:
        raise ParseError("networksetup: no 'Hardware Port' records")
    return tuple(ports)


# ---------------------------------------------------------------------------------------------------- ifconfig

_IF_HEADER = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9_.-]*): flags=[0-9a-fA-F]+<(?P<flags>[^>]*)>")
_IPV4 = re.compile(r"^inet (\d{1,3}(?:\.\d{1,3}){3})\b")


def parse_ifconfig(text: str) -> tuple[NetInterface, ...]:
    """macOS `ifconfig` (BSD format) -> one `NetInterface` per interface, in listed order.

    An interface starts with `name: flags=HEX<FLAG,...>` at column 0; its indented lines carry `inet A.B.C.D`
    (every IPv4 address is recorded, loopback included), `status: active|inactive`, and for a bridge
    `member: enX` lines. `up` is the UP flag; `active` is None when no status line is printed. Raises
    `ParseError` on a column-0 line that is not an interface header, or when no interface is found.
    """
    found: list[NetInterface] = []
    name: str | None = None
    up = False
    active: bool | None = None
    ipv4: list[str] = []
    members: list[str] = []

    def flush() -> None:
        if name is not None:
            found.append(NetInterface(name, tuple(ipv4), up, active, tuple(members)))

    for line in require_text(text, "ifconfig").splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            header = _IF_HEADER.match(line)
            if header is None:
                raise ParseError(f"ifconfig: expected an interface header, got {excerpt(line)}")
            flush()
            name, up, active = header["name"], "UP" in header["flags"].split(","), None
            ipv4, members = [], []
            continue
        if name is None:
            raise ParseError(f"ifconfig: indented line before any interface: {excerpt(line)}")
        stripped = line.strip()
        ip = _IPV4.match(stripped)
        if ip:
            ipv4.append(ip[1])
        elif stripped.startswith("status: "):
            active = stripped[len("status: ") :].strip() == "active"
        elif stripped.startswith("member: "):
            members.append(stripped.split()[1])
    flush()
    if not found:
        raise ParseError("ifconfig: no interface found")
    return tuple(found)


# -------------------------------------------------------------------------------------------------------- RDMA

_ONE_WORD = re.compile(r"^[a-z_]+$")


def parse_rdma_ctl(text: str) -> str:
    """`rdma_ctl status` -> "enabled" | "disabled" | "unknown".

    The command prints one word. The whole stripped text is compared (reference §5f): a substring test would
    read an error such as "... not enabled" as enabled. Another single lower-case word is a state this code
    does not know: "unknown". Anything else (an error message, several words, nothing) raises `ParseError`.
    """
    word = require_text(text, "rdma_ctl status").lower()
    if word in ("enabled", "disabled"):
        return word
    if _ONE_WORD.match(word):
        return "unknown"
    raise ParseError(f"rdma_ctl status: expected 'enabled' or 'disabled', got {excerpt(text)}")


_GUID = re.compile(r"^[0-9a-fA-F]{16}$")


def parse_ibv_devices(text: str) -> tuple[str, ...]:
    """`ibv_devices` -> device names in listed order (the order is not sorted, reference §5c).

    The output is a `device  node GUID` header, a dashed rule, then one `name GUID` row per device; rows are
    split on any whitespace because the column padding and the leading indentation differ between captures.
    Header only is a valid answer: no devices (pitfall 5: RDMA can be enabled with no device). Raises
    `ParseError` when the header is missing or a row is not `name 16-hex-digit-GUID`.
    """
    lines = [line.split() for line in require_text(text, "ibv_devices").splitlines() if line.strip()]
    if lines[0] != ["device", "node", "GUID"]:
        raise ParseError(f"ibv_devices: expected the 'device node GUID' header, got {excerpt(text)}")
    devices: list[str] = []
    for tokens in lines[1:]:
        if len(tokens) == 2 and set(tokens[0]) == {"-"} and set(tokens[1]) == {"-"}:
            continue
        if len(tokens) != 2 or not _GUID.match(tokens[1]):
            raise ParseError(f"ibv_devices: expected 'NAME GUID' rows, got {excerpt(' '.join(tokens))}")
        devices.append(tokens[0])
    return tuple(devices)


_NO_DEVICES = "No IB devices found"


def parse_ibv_devinfo(text: str) -> dict[str, str]:
    """`ibv_devinfo` -> {device: state of its first port}, e.g. {"rdma_en2": "PORT_ACTIVE"}.

    Blocks start with `hca_id: NAME`; `state: PORT_X (n)` lines give each port's state. Fields are split on the
    first ':' with any whitespace (the real tool uses tabs, mirrors collapse them). libibverbs prints "No IB
    devices found" (and exits non-zero) when there are none: that is an empty mapping. Raises `ParseError` when
    the output does not start with `hca_id:` or a device has no port state.
    """
    body = require_text(text, "ibv_devinfo")
    if body == _NO_DEVICES:
        return {}
    states: dict[str, str] = {}
    device: str | None = None
    for line in body.splitlines():
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if device is None and key != "hca_id":
            raise ParseError(f"ibv_devinfo: expected 'hca_id: DEVICE' first, got {excerpt(line)}")
        if not sep:
            continue  # documentation excerpts elide fields with "..."
        if key == "hca_id":
            if device is not None and device not in states:
                raise ParseError(f"ibv_devinfo: device {device!r} lists no port state")
            device = value
        elif key == "state" and device is not None and device not in states and value:
            states[device] = value.split()[0]
    if device is not None and device not in states:
        raise ParseError(f"ibv_devinfo: device {device!r} lists no port state")
    return states


# ------------------------------------------------------------------------------------------------------ memory

_VM_HEADER = re.compile(r"^Mach Virtual Memory Statistics: \(page size of (\d+) bytes\)$")


def parse_vm_stat(text: str) -> tuple[int, dict[str, int]]:
    """`vm_stat` -> (page size, {counter: pages}).

    The page size comes from the header; Apple Silicon uses 16384 (pitfall 6), so it is never assumed. Lines
    are split on the last ':' because the column width varies; values end with '.'; quoted names such as
    `"Translation faults"` are unquoted. Raises `ParseError` without the header or on a non-numeric value.
    """
    lines = require_text(text, "vm_stat").splitlines()
    header = _VM_HEADER.match(lines[0].strip())
    if header is None:
        raise ParseError(f"vm_stat: expected the 'Mach Virtual Memory Statistics' header, got {excerpt(lines[0])}")
    counts: dict[str, int] = {}
    for line in lines[1:]:
        if not line.strip():
            continue
        key, sep, value = line.rpartition(":")
        value = value.strip().rstrip(".")
        if not sep or not value.isdigit():
            raise ParseError(f"vm_stat: expected 'Name: N.' lines, got {excerpt(line)}")
        counts[key.strip().strip('"')] = int(value)
    return int(header[1]), counts


_MP_TOTAL = re.compile(r"The system has (\d+) \(\d+ pages with a page size of \d+\)")
_MP_FREE = re.compile(r"System-wide memory free percentage: (\d+(?:\.\d+)?)%")


def parse_memory_pressure(text: str) -> tuple[int | None, float | None]:
    """`memory_pressure` -> (total bytes from the first line, system-wide free percentage).

    Either may be absent (`memory_pressure -Q` prints only the percentage) but not both: then the output is
    not memory_pressure's and `ParseError` is raised.
    """
    body = require_text(text, "memory_pressure")
    total = _MP_TOTAL.search(body)
    free = _MP_FREE.search(body)
    if total is None and free is None:
        raise ParseError(f"memory_pressure: neither the total nor the free percentage in {excerpt(body)}")
    return (int(total[1]) if total else None), (float(free[1]) if free else None)


def build_memory_macos(vm_stat_text: str, memory_pressure_text: str | None, sysctl: Mapping[str, str]) -> Memory:
    """`Memory` from vm_stat, memory_pressure (optional) and the sysctl values.

    total: `hw.memsize`, else memory_pressure's total. available: (free + inactive + speculative + purgeable)
    pages x the vm_stat page size, the pages macOS can hand out without swapping. Parser errors propagate.
    """
    page, counts = parse_vm_stat(vm_stat_text)
    total, free_pct = parse_memory_pressure(memory_pressure_text) if memory_pressure_text else (None, None)
    pages = sum(counts.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"))
    return Memory(
        total_bytes=_sysctl_int(sysctl, "hw.memsize") or total,
        available_bytes=pages * page,
        free_percent=free_pct,
        pressure_level=_sysctl_int(sysctl, "kern.memorystatus_vm_pressure_level"),
        page_size=page,
    )


# ------------------------------------------------------------------------------------------------------- power

_PMSET_SLEEP = re.compile(r"^\s*sleep\s+(?P<minutes>\d+)(?:\s+\((?P<note>[^)]*)\))?\s*$")
_PMSET_SETTING = re.compile(r"^\s*(?P<key>lowpowermode|powermode)\s+(?P<value>\d+)\s*$")
_PREVENTED = "sleep prevented by "


def parse_pmset(text: str) -> tuple[int | None, tuple[str, ...], bool | None]:
    """`pmset -g` -> (system sleep minutes, processes preventing sleep, low power mode).

    `sleep N (sleep prevented by a, b)` carries a parenthetical suffix; only the `sleep` key counts (not
    `disksleep`/`displaysleep`). Low power comes from `lowpowermode 1` or, on machines that print it instead,
    `powermode 1` (0 auto, 1 low, 2 high); None when neither is printed. Raises `ParseError` when the output is
    not pmset's settings list.
    """
    body = require_text(text, "pmset -g")
    if "System-wide power settings:" not in body and "Currently in use:" not in body:
        raise ParseError(f"pmset -g: expected the power settings list, got {excerpt(body)}")
    minutes: int | None = None
    prevented: tuple[str, ...] = ()
    low_power: bool | None = None
    sleep_disabled = False
    for line in body.splitlines():
        if re.match(r"^\s*SleepDisabled\s+1\s*$", line):
            sleep_disabled = True  # `pmset -a disablesleep 1`: the system never idles to sleep
            continue
        sleep = _PMSET_SLEEP.match(line)
        if sleep:
            minutes = int(sleep["minutes"])
            note = (sleep["note"] or "").strip()
            if note.startswith(_PREVENTED):
                prevented = tuple(n.strip() for n in note[len(_PREVENTED) :].split(",") if n.strip())
            continue
        setting = _PMSET_SETTING.match(line)
        if setting:
            low_power = int(setting["value"]) == 1
    if sleep_disabled:
        minutes = 0
    return minutes, prevented, low_power


_BATT_SOURCE = re.compile(r"^Now drawing from '(?P<source>[^']+)'")
_BATT_PERCENT = re.compile(r"\s(?P<pct>\d+)%;")


def parse_pmset_batt(text: str) -> tuple[bool, int | None]:
    """`pmset -g batt` -> (on battery, charge percent of the internal battery or None on a desktop).

    The first line names the source: 'AC Power' means on mains; 'Battery Power' (or a UPS) means on battery.
    Raises `ParseError` without that line.
    """
    lines = require_text(text, "pmset -g batt").splitlines()
    source = _BATT_SOURCE.match(lines[0].strip())
    if source is None:
        raise ParseError(f"pmset -g batt: expected \"Now drawing from '...'\", got {excerpt(lines[0])}")
    percent = None
    for line in lines[1:]:
        match = _BATT_PERCENT.search(line)
        if match:
            percent = int(match["pct"])
            break
    return source["source"] != "AC Power", percent


# ------------------------------------------------------------------------------------------------------- ioreg

_PERF_STATS = re.compile(r'"PerformanceStatistics" = \{(?P<body>[^}]*)\}')
_DEVICE_UTIL = re.compile(r'"Device Utilization %"=(\d+)')
# The closing quote right after "memory" keeps "In use system memory (driver)" from matching (reference §7f).
_IN_USE = re.compile(r'"In use system memory"=(\d+)')
_MODEL = re.compile(r'^\s*"model" = "(?P<model>[^"]*)"', re.MULTILINE)
_CLASS = re.compile(r"^\+-o \S+\s+<class (?P<cls>[^,>]+)", re.MULTILINE)


def parse_ioreg_accelerator(text: str) -> Gpu:
    """`ioreg -r -d 1 -w 0 -c IOAccelerator` -> `Gpu` of the first accelerator.

    Utilisation is `"Device Utilization %"` and memory `"In use system memory"` (exactly, not the "(driver)"
    variant) from `PerformanceStatistics`; the name is the `"model"` property when printed, else the registry
    class (e.g. AGXAcceleratorG13X). Raises `ParseError` when no PerformanceStatistics dictionary is present.
    """
    body = require_text(text, "ioreg")
    stats = _PERF_STATS.search(body)
    if stats is None:
        raise ParseError(f'ioreg: no "PerformanceStatistics" dictionary in {excerpt(body)}')
    util = _DEVICE_UTIL.search(stats["body"])
    in_use = _IN_USE.search(stats["body"])
    model = _MODEL.search(body)
    cls = _CLASS.search(body)
    name = model["model"] if model else (cls["cls"].strip() if cls else None)
    return Gpu(
        utilization_pct=float(util[1]) if util else None,
        in_use_memory_bytes=int(in_use[1]) if in_use else None,
        name=name,
    )
