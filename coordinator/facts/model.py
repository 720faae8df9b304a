"""Typed facts about one node, as parsed from the raw outputs of the probe.

A section is `None` only when its command failed or its output could not be parsed; in that case
`NodeFacts.errors` carries a `FactError` naming the command with the raw text as evidence. Nothing is
silently defaulted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

RAW_EVIDENCE_LIMIT = 2000


def clip(text: str, limit: int = RAW_EVIDENCE_LIMIT) -> str:
    """Raw output kept as evidence, bounded so one noisy command cannot bloat a report."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class ParseError(ValueError):
    """Raised by a `parse_*` function when its input is not what the command prints.

    The builder turns it into a `FactError` with the raw text; parsers never return a silent None.
    """


class FactErrorKind(StrEnum):
    """Whose fault a FactError is: the node's answer, or our parser."""

    NODE = "node"  # the command is missing, failed, or printed something it should not (the node's odd output)
    PARSER_BUG = "parser_bug"  # a parser raised something other than ParseError/ValueError: a coordinator bug


@dataclass(frozen=True)
class FactError:
    source: str  # the probe section (command) the error comes from, e.g. "sw_vers"
    message: str
    raw: str = ""
    kind: FactErrorKind = FactErrorKind.NODE

    def to_json(self) -> dict[str, str]:
        return {"source": self.source, "kind": str(self.kind), "message": self.message, "raw": clip(self.raw)}


@dataclass(frozen=True)
class OsInfo:
    system: str  # "Darwin" | "Linux" (from `uname -s`)
    arch: str  # "arm64" | "x86_64" | "aarch64" (from `uname -m`)
    kernel: str  # `uname -r`
    name: str  # "macOS" or the distro's PRETTY_NAME
    version: str  # "26.5", "14.6.1", or Linux VERSION_ID
    build: str | None = None  # macOS BuildVersion, e.g. "25F71"

    @property
    def is_macos(self) -> bool:
        return self.system == "Darwin"

    def version_tuple(self) -> tuple[int, ...]:
        return version_tuple(self.version)


def version_tuple(text: str) -> tuple[int, ...]:
    """'26.5.1' -> (26, 5, 1); stops at the first non-numeric part ('0.32.1rc1' -> (0, 32, 1))."""
    parts: list[int] = []
    for piece in text.strip().split("."):
        digits = ""
        for ch in piece:
            if ch.isdigit():
                digits += ch
            else:
                break
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


@dataclass(frozen=True)
class CpuLevel:
    name: str  # "Performance", "Efficiency", "Super", "Standard", ...
    cores: int


@dataclass(frozen=True)
class Hardware:
    chip: str | None  # "Apple M4 Max"
    model_id: str | None  # "Mac16,5"
    model_name: str | None  # "MacBook Pro", "Mac Studio"
    memory_bytes: int | None
    cpu_total: int | None
    cpu_levels: tuple[CpuLevel, ...] = ()
    gpu_cores: int | None = None
    page_size: int | None = None

    @property
    def is_ultra(self) -> bool:
        return bool(self.chip and "ultra" in self.chip.lower())


@dataclass(frozen=True)
class ThunderboltPort:
    """One Thunderbolt bus/receptacle of this Mac and, when a Mac is plugged in, that peer."""

    bus: str  # "thunderboltusb4_bus_0"
    domain_uuid: str | None  # this bus's own domain UUID
    receptacle: str | None  # receptacle_id_key; matches "Thunderbolt N" in networksetup
    connected: bool
    speed_gbps: float | None  # negotiated speed when connected ("80 Gb/s"); None when only "Up to ..."
    max_speed_gbps: float | None  # "Up to 120 Gb/s" on an empty receptacle
    peer_domain_uuid: str | None = None  # the peer Mac's bus (an `_items` entry with a domain UUID)
    peer_name: str | None = None  # "Mac Studio"
    peer_model: str | None = None  # "Mac15,14"
    peer_rdma_service: bool = False  # the peer advertises the XDomain rdma service (protocol 64087)


@dataclass(frozen=True)
class HardwarePort:
    port: str  # "Thunderbolt 1", "Wi-Fi", "Thunderbolt Bridge"
    device: str  # "en1", "bridge0"

    @property
    def thunderbolt_receptacle(self) -> str | None:
        """"Thunderbolt 3" -> "3"; None for "Thunderbolt Bridge" or "Thunderbolt Ethernet Slot 0"."""
        prefix = "Thunderbolt "
        if self.port.startswith(prefix) and self.port[len(prefix) :].isdigit():
            return self.port[len(prefix) :]
        return None


@dataclass(frozen=True)
class NetInterface:
    name: str
    ipv4: tuple[str, ...] = ()
    up: bool = False
    active: bool | None = None  # macOS `status: active`; None when not reported (Linux)
    members: tuple[str, ...] = ()  # bridge members (macOS `member:` lines)


@dataclass(frozen=True)
class NetLink:
    """One Linux interface as the kernel describes it in /sys/class/net/<name> (the `sys_class_net` section)."""

    name: str
    arphrd_type: int | None  # `type`: ARPHRD_* (1 Ethernet, 32 InfiniBand, 772 loopback, 65534 none)
    speed_mbps: int | None  # `speed`; None when the kernel does not know it (-1, or unreadable while down)
    operstate: str | None  # "up", "down", "unknown" (loopback and most virtual interfaces)
    has_device: bool  # a `device` link: backed by a bus device (PCI, USB, virtio, Thunderbolt)
    wireless: bool  # a `wireless` directory (cfg80211)
    devtype: str | None = None  # uevent DEVTYPE: "bridge", "vlan", "bond", "wlan", ...; None for plain ones
    driver: str | None = None  # DRIVER of the device's uevent: "e1000e", "virtio_net", "thunderbolt-net"
    lower: tuple[str, ...] = ()  # `lower_*` links: a bridge's ports, a VLAN's or bond's underlying interfaces
    path: str | None = None  # the real sysfs path

    @property
    def virtual(self) -> bool:
        """No hardware behind it: veth, bridge, loopback, tunnels (the kernel puts them in devices/virtual)."""
        return not self.has_device or (self.path or "").startswith("/sys/devices/virtual/")


@dataclass(frozen=True)
class RdmaDevice:
    name: str  # "rdma_en2"
    port_state: str | None = None  # "PORT_ACTIVE", "PORT_DOWN"; None when ibv_devinfo did not list it

    @property
    def interface(self) -> str | None:
        return self.name[len("rdma_") :] if self.name.startswith("rdma_") else None


@dataclass(frozen=True)
class Rdma:
    ctl_status: str | None  # "enabled" | "disabled" | "unknown"; None when rdma_ctl is absent
    devices: tuple[RdmaDevice, ...] = ()


@dataclass(frozen=True)
class Memory:
    total_bytes: int | None
    available_bytes: int | None = None
    free_percent: float | None = None
    pressure_level: int | None = None  # macOS kern.memorystatus_vm_pressure_level: 1 normal, 2 warn, 4 critical
    page_size: int | None = None


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit of the probe's own cgroup (Linux; children of the SSH session inherit it): the lowest
    `memory.limit_in_bytes` (v1) or `memory.max` (v2) of the cgroup and its ancestors. `limit_bytes` None: no
    limit (v2 `max`, v1's page-counter maximum) or no memory controller. `path` and `version` say where the
    binding limit is set."""

    limit_bytes: int | None
    version: str | None = None  # "v1" | "v2"
    path: str | None = None


@dataclass(frozen=True)
class Power:
    sleep_minutes: int | None  # 0 = never sleeps
    sleep_prevented_by: tuple[str, ...] = ()
    on_battery: bool | None = None
    battery_percent: int | None = None
    low_power: bool | None = None


@dataclass(frozen=True)
class Disk:
    path: str  # the path asked about
    mount: str
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class CudaDevice:
    """One NVIDIA GPU as `nvidia-smi --query-gpu=...` describes it (`coordinator.facts.probe.NVIDIA_SMI`)."""

    index: int  # nvidia-smi's enumeration index (what CUDA_VISIBLE_DEVICES names)
    name: str  # "NVIDIA H100 80GB HBM3"
    uuid: str | None  # "GPU-..."; stable across reboots, unlike the index
    memory_total_bytes: int | None  # the GPU's own memory (nvidia-smi reports MiB)
    memory_used_bytes: int | None  # in use now, by any process
    utilization_pct: float | None
    driver_version: str | None  # "580.65.06"
    compute_cap: str | None  # "9.0"


@dataclass(frozen=True)
class Gpu:
    utilization_pct: float | None
    in_use_memory_bytes: int | None = None
    name: str | None = None
    devices: tuple[CudaDevice, ...] = ()  # NVIDIA GPUs (from nvidia-smi); empty on a Mac

    @property
    def cuda(self) -> bool:
        """An NVIDIA GPU is present: MLX runs on it through its CUDA backend (mlx-cuda-12/13)."""
        return bool(self.devices)


@dataclass(frozen=True)
class Software:
    python: str  # the configured interpreter path
    python_version: str | None
    mlx_version: str | None
    mlx_lm_version: str | None
    errors: tuple[str, ...] = ()
    # mlx's installed backend distributions {"mlx-cuda-13": "0.32.4"} (mlx-metal, mlx-cpu, mlx-cuda-12/13);
    # None when the probe did not report them (a recorded answer from before they were asked for).
    mlx_backends: dict[str, str] | None = None


@dataclass(frozen=True)
class FileHash:
    path: str  # relative to the hashed directory
    size: int
    sha256: str


@dataclass(frozen=True)
class DirHashes:
    path: str  # as given in the playbook
    exists: bool
    files: tuple[FileHash, ...] = ()
    error: str | None = None
    cached_files: int = 0
    hashed_bytes: int = 0


@dataclass(frozen=True)
class DataFile:
    """One data file the trainer reads, parsed row by row on the node (worker/probe.py `check_data_file`)."""

    name: str  # "train.jsonl", relative to the data dir
    required: bool
    exists: bool
    rows: int  # rows that parsed and have the keys the trainer needs (up to the first problem)
    bytes: int
    checked_bytes: int  # < bytes: only the first checked_bytes were read (a bounded sample)
    format: str | None  # text | chat | completions (mlx-lm's detection, first row) | dpo
    error: str | None  # "line N: ..." or why the file could not be read


@dataclass(frozen=True)
class DataCheck:
    dir: str | None
    files: tuple[DataFile, ...] = ()
    error: str | None = None  # the dir is missing or the check could not run


@dataclass(frozen=True)
class Reach:
    peer: str
    ip: str
    ok: bool
    rtt_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    node: str
    os: OsInfo | None = None
    hardware: Hardware | None = None
    thunderbolt: tuple[ThunderboltPort, ...] | None = None
    hardware_ports: tuple[HardwarePort, ...] | None = None
    interfaces: tuple[NetInterface, ...] | None = None
    net_links: tuple[NetLink, ...] | None = None  # Linux: /sys/class/net
    rdma: Rdma | None = None
    memory: Memory | None = None
    cgroup_memory: CgroupMemory | None = None  # Linux: the cgroup memory limit ranks inherit
    power: Power | None = None
    disk: Disk | None = None
    gpu: Gpu | None = None
    software: Software | None = None
    hashes: tuple[DirHashes, ...] | None = None
    reach: tuple[Reach, ...] | None = None
    env: dict[str, str] | None = None  # the non-interactive SSH environment ranks inherit
    model_config: dict[str, Any] | None = None  # the model dir's config.json, when present
    model_params: int | None = None  # parameter count from safetensors headers
    model_error: str | None = None  # what the model dir lacks for mlx-lm's load (config, weights, tokenizer)
    data: DataCheck | None = None  # the training data files parsed as the trainer loads them; None: not asked
    errors: tuple[FactError, ...] = ()
    raw: dict[str, str] = field(default_factory=dict)  # section -> output, as the node printed it
    raw_rc: dict[str, int] = field(default_factory=dict)  # section -> exit status

    def errors_for(self, *sources: str) -> list[FactError]:
        return [e for e in self.errors if e.source in sources]
