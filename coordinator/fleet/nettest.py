"""`coordinator nettest`'s pure core: which link a data-plane IP rides on, which pairs to measure, and whether a
measured link is as fast as its kind should be. No I/O here (`coordinator/fleet/nettestrun.py` runs
`worker/nettest.py` on the nodes and hands the numbers to these functions).

Link kind: the interface holding the node's data IP (`NodeFacts.interfaces`) -> its networksetup hardware port
(`NodeFacts.hardware_ports`): "Thunderbolt N" (and "Thunderbolt Bridge", through its members) is Thunderbolt, with
the negotiated speed of receptacle N from `NodeFacts.thunderbolt` (80 Gb/s on TB5, 40 Gb/s on TB4); "Wi-Fi" is
Wi-Fi; a port naming Ethernet or LAN is Ethernet. On Linux the interface's /sys/class/net entry
(`NodeFacts.net_links`) says it: wireless (or DEVTYPE wlan) is Wi-Fi; the `thunderbolt-net` driver is Thunderbolt;
an interface with no hardware behind it (veth, bridge, loopback, tunnel: no `device` link, or a path under
/sys/devices/virtual) is `virtual`, unless it sits on hardware through its `lower_*` links (a bridge's ports, a
VLAN's parent), which then decide; other ARPHRD_ETHER hardware is Ethernet at its `speed` (Mb/s; -1 = not
known). IPs found on no interface, and Linux interfaces of another type (InfiniBand, ...), are `unknown`. A
pair's link is the slower of its two ends (a TB5 Mac cabled to a TB4 Mac negotiates TB4).

Thresholds (`LINK_SPECS`): a link is expected to carry `efficiency` x its nominal speed as one TCP stream of
Python `sendall`s (IP over Thunderbolt reaches roughly 40% of the signalling rate; Ethernet ~94% after
TCP/IP framing; Wi-Fi about half its PHY rate). Measured throughput (the slower direction) below
`WARN_FRACTION` (50%) of that expected goodput warns, below `FAIL_FRACTION` (10%) fails: the IP is probably
routed over another interface, the cable is a USB one, or the port renegotiated down. Median RTT above the
kind's `rtt_warn_ms`/`rtt_fail_ms` warns/fails likewise. A Wi-Fi data plane is at best `warn` (jittery and
slow for gradient all-reduce). `unknown` and `virtual` links have no nominal speed (a veth's or bridge's
`speed` is a made-up 10000): they pass on any positive throughput and are judged on RTT only. Zero throughput
always fails.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from coordinator.facts.model import HardwarePort, NetLink, NodeFacts
from coordinator.models import STATUS_SEVERITY, Status, worst

WARN_FRACTION = 0.5
FAIL_FRACTION = 0.1


class LinkKind(StrEnum):
    THUNDERBOLT = "thunderbolt"
    ETHERNET = "ethernet"
    WIFI = "wifi"
    VIRTUAL = "virtual"  # Linux: no hardware behind the interface (veth, bridge, loopback, tunnel)
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class LinkSpec:
    """What one kind of link should do. `default_gbps` is used when the facts give no negotiated speed."""

    default_gbps: float | None
    efficiency: float  # expected single-stream TCP goodput / nominal speed
    rtt_warn_ms: float
    rtt_fail_ms: float


LINK_SPECS: dict[LinkKind, LinkSpec] = {
    # TB4's 40 Gb/s when the receptacle's speed is not known (the lower of the two current generations).
    LinkKind.THUNDERBOLT: LinkSpec(default_gbps=40.0, efficiency=0.4, rtt_warn_ms=1.0, rtt_fail_ms=10.0),
    # networksetup does not say 1 or 10 GbE: judge against 1 GbE, the floor of any wired port.
    LinkKind.ETHERNET: LinkSpec(default_gbps=1.0, efficiency=0.94, rtt_warn_ms=1.0, rtt_fail_ms=10.0),
    # Wi-Fi 6 class PHY rate; the air is shared and half duplex.
    LinkKind.WIFI: LinkSpec(default_gbps=1.0, efficiency=0.5, rtt_warn_ms=10.0, rtt_fail_ms=100.0),
    # Software links carry whatever the host's CPU and the path beyond them allow (a tunnel may cross a WAN):
    # judged like `unknown`.
    LinkKind.VIRTUAL: LinkSpec(default_gbps=None, efficiency=1.0, rtt_warn_ms=5.0, rtt_fail_ms=100.0),
    LinkKind.UNKNOWN: LinkSpec(default_gbps=None, efficiency=1.0, rtt_warn_ms=5.0, rtt_fail_ms=100.0),
}

# Slowest first: the order used to pick a pair's bottleneck end when speeds are not known.
_KIND_RANK = {LinkKind.WIFI: 0, LinkKind.ETHERNET: 1, LinkKind.THUNDERBOLT: 2, LinkKind.VIRTUAL: 3,
              LinkKind.UNKNOWN: 4}

# ARPHRD_* names for the notes (include/uapi/linux/if_arp.h).
_ARPHRD = {1: "ether", 32: "infiniband", 772: "loopback", 776: "sit", 778: "gre", 65534: "none"}


def _gbps(bps: float) -> str:
    bits = bps * 8
    return f"{bits / 1e9:.2f} Gb/s" if bits >= 1e8 else f"{bits / 1e6:.1f} Mb/s"


def nominal_gbps(kind: LinkKind, speed_gbps: float | None) -> float | None:
    """The speed a link of `kind` is judged against: the negotiated one, else the kind's default."""
    return speed_gbps if speed_gbps is not None else LINK_SPECS[kind].default_gbps


def judge_link(kind: LinkKind | str, speed_gbps: float | None, measured_bps: float,
               rtt_ms: float | None) -> tuple[Status, str]:
    """Verdict on one measured link: (pass|warn|fail, one-line summary). See the module docstring for the
    thresholds. `measured_bps` is BYTES per second (the slower direction); `rtt_ms` the median round trip."""
    kind = LinkKind(kind)
    spec = LINK_SPECS[kind]
    nominal = nominal_gbps(kind, speed_gbps)
    findings: list[tuple[Status, str]] = []
    label = str(kind) if nominal is None else f"{kind} {nominal:g} Gb/s"
    if measured_bps <= 0:
        findings.append((Status.FAIL, "no data got through"))
    elif nominal is not None:
        expected_bps = nominal * 1e9 / 8 * spec.efficiency
        ratio = measured_bps / expected_bps
        share = f"{_gbps(measured_bps)} = {100 * ratio:.0f}% of the ~{_gbps(expected_bps)} expected"
        if ratio < FAIL_FRACTION:
            findings.append((Status.FAIL, f"{share} (is the IP routed over another interface?)"))
        elif ratio < WARN_FRACTION:
            findings.append((Status.WARN, f"{share}"))
        else:
            findings.append((Status.PASS, share))
    else:
        findings.append((Status.PASS, f"{_gbps(measured_bps)} (no nominal speed to compare with)"))
    if rtt_ms is not None:
        rtt = f"rtt {rtt_ms:.3f} ms"
        if rtt_ms > spec.rtt_fail_ms:
            findings.append((Status.FAIL, f"{rtt} > {spec.rtt_fail_ms:g} ms"))
        elif rtt_ms > spec.rtt_warn_ms:
            findings.append((Status.WARN, f"{rtt} > {spec.rtt_warn_ms:g} ms"))
        else:
            findings.append((Status.PASS, rtt))
    if kind is LinkKind.WIFI:
        findings.append((Status.WARN, "Wi-Fi data plane: use Thunderbolt or Ethernet for training"))
    status = worst([s for s, _ in findings])
    return status, f"{label}: " + "; ".join(text for _, text in findings)


# ------------------------------------------------------------------------------------------- link kinds


@dataclass(frozen=True)
class LinkEnd:
    """One node's side of a link: the interface holding its data IP and what networksetup calls it."""

    node: str
    ip: str
    kind: LinkKind = LinkKind.UNKNOWN
    speed_gbps: float | None = None  # negotiated speed (Thunderbolt; Linux /sys/class/net), when the facts say
    interface: str | None = None
    port: str | None = None  # networksetup hardware port, e.g. "Thunderbolt 1"
    note: str = ""
    driver: str | None = None  # Linux: the interface's driver or DEVTYPE ("e1000e", "bridge"), when known

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ip": self.ip, "kind": str(self.kind), "speed_gbit_per_s": self.speed_gbps,
                "interface": self.interface, "port": self.port, "driver": self.driver, "note": self.note}


def _port_kind(port: HardwarePort) -> LinkKind:
    name = port.port.lower()
    if port.thunderbolt_receptacle is not None or name == "thunderbolt bridge":
        return LinkKind.THUNDERBOLT
    if name in ("wi-fi", "airport"):
        return LinkKind.WIFI
    # "Ethernet", "Ethernet Adapter (en4)", "USB 10/100/1G/2.5G/5G/10G LAN", "Thunderbolt Ethernet Slot 0"
    if "ethernet" in name or "lan" in name.split():
        return LinkKind.ETHERNET
    return LinkKind.UNKNOWN


def _receptacle_speed(facts: NodeFacts, receptacle: str) -> float | None:
    for tb in facts.thunderbolt or ():
        if tb.receptacle == receptacle and tb.connected:
            return tb.speed_gbps
    return None


def _slowness(kind: LinkKind, speed_gbps: float | None) -> tuple[float, int]:
    """Sort key, slowest first: nominal speed (none known: last), then the kind's rank."""
    nominal = nominal_gbps(kind, speed_gbps)
    return (nominal if nominal is not None else float("inf"), _KIND_RANK[kind])


def _describe(link: NetLink) -> str:
    what = link.driver or link.devtype or ("wireless" if link.wireless else None)
    arphrd = "?" if link.arphrd_type is None else _ARPHRD.get(link.arphrd_type, str(link.arphrd_type))
    speed = f"{link.speed_mbps} Mb/s" if link.speed_mbps is not None else "speed not known"
    return f"{link.name}: {what + ', ' if what else ''}type {arphrd}, {speed}" + (", virtual" if link.virtual else "")


def classify_linux_link(name: str, links: Sequence[NetLink]) -> tuple[LinkKind, float | None, str | None, str]:
    """(kind, speed Gb/s, driver or DEVTYPE, note) of Linux interface `name` from its /sys/class/net entries.

    See the module docstring for the rules. A virtual interface over hardware (a bridge with a NIC among its
    ports, a VLAN on a NIC) takes the slowest of the hardware kinds below it: the traffic to a peer leaves by
    one of them, and we cannot tell which. The speed of a virtual interface itself is never used (veth and
    bridges report a fixed 10000 Mb/s whatever carries them). Never raises."""
    by_name = {link.name: link for link in links}

    def kind_of(link: NetLink, seen: frozenset[str]) -> tuple[LinkKind, float | None, list[str]]:
        speed = link.speed_mbps / 1000 if link.speed_mbps is not None else None
        if link.wireless or link.devtype == "wlan":
            return LinkKind.WIFI, None, [_describe(link)]
        if link.driver == "thunderbolt-net":
            return LinkKind.THUNDERBOLT, speed, [_describe(link)]
        if link.virtual:
            below = [kind_of(by_name[n], seen | {n}) for n in link.lower if n in by_name and n not in seen]
            hardware = [b for b in below if b[0] not in (LinkKind.VIRTUAL, LinkKind.UNKNOWN)]
            if hardware:
                slow = min(hardware, key=lambda b: _slowness(b[0], b[1]))
                return slow[0], slow[1], [_describe(link), *slow[2]]
            return LinkKind.VIRTUAL, None, [_describe(link)]
        if link.arphrd_type == 1:
            return LinkKind.ETHERNET, speed, [_describe(link)]
        return LinkKind.UNKNOWN, None, [_describe(link)]

    link = by_name.get(name)
    if link is None:
        return LinkKind.UNKNOWN, None, None, f"{name} is not in /sys/class/net"
    kind, speed, notes = kind_of(link, frozenset({name}))
    return kind, speed, link.driver or link.devtype, " over ".join(notes)


def classify_endpoint(node: str, ip: str, facts: NodeFacts | None) -> LinkEnd:
    """Which link `ip` rides on, from the node's facts. Never raises: missing facts give `unknown` with a note."""
    if facts is None:
        return LinkEnd(node, ip, note="no facts")
    iface = next((i for i in facts.interfaces or () if ip in i.ipv4), None)
    if iface is None:
        return LinkEnd(node, ip, note=f"{ip} is on no interface of the node")
    if facts.net_links is not None:  # only Linux nodes have them
        lk, lspeed, driver, note = classify_linux_link(iface.name, facts.net_links)
        return LinkEnd(node, ip, kind=lk, speed_gbps=lspeed, interface=iface.name, note=note, driver=driver)
    if facts.hardware_ports is None:
        linux = facts.os is not None and facts.os.system == "Linux"
        return LinkEnd(node, ip, interface=iface.name, note="no /sys/class/net facts" if linux else "no networksetup")
    ports = {p.device: p for p in facts.hardware_ports}
    port = ports.get(iface.name)
    if port is None:
        return LinkEnd(node, ip, interface=iface.name, note=f"{iface.name} is no networksetup hardware port")
    kind = _port_kind(port)
    speed: float | None = None
    if kind is LinkKind.THUNDERBOLT:
        receptacles = [port.thunderbolt_receptacle] if port.thunderbolt_receptacle else [
            ports[m].thunderbolt_receptacle for m in iface.members if m in ports]
        # A bridge's traffic to one peer uses one member cable we cannot tell: judge against the slowest.
        speeds = [s for r in receptacles if r is not None and (s := _receptacle_speed(facts, r)) is not None]
        speed = min(speeds) if speeds else None
    return LinkEnd(node, ip, kind=kind, speed_gbps=speed, interface=iface.name, port=port.port)


def combine_ends(a: LinkEnd, b: LinkEnd) -> tuple[LinkKind, float | None]:
    """A pair's link: the slower end (lower nominal speed; Wi-Fi < Ethernet < Thunderbolt when equal or
    unknown). An `unknown` end defers to the known one; both unknown is unknown."""
    known = [e for e in (a, b) if e.kind is not LinkKind.UNKNOWN]
    if not known:
        return LinkKind.UNKNOWN, None
    slow = min(known, key=lambda e: _slowness(e.kind, e.speed_gbps))
    return slow.kind, slow.speed_gbps


# ---------------------------------------------------------------------------------------------- pairs


def plan_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """Unordered pairs in inventory order: (a, b) with a before b. One session per pair measures both
    directions (a sends, then b sends), so ordered pairs would measure every direction twice for twice the time."""
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names: {list(names)}")
    return list(itertools.combinations(names, 2))


class ParseError(ValueError):
    """The client's output is not the JSON object worker/nettest.py prints."""


@dataclass(frozen=True)
class Measurement:
    """What `worker.nettest client` on `a` measured against the server on `b`. Rates are bytes/second."""

    rtt_ms: float
    rtt_min_ms: float
    rtt_max_ms: float
    up_bps: float  # a -> b
    down_bps: float  # b -> a
    seconds: float

    @property
    def bottleneck_bps(self) -> float:
        return min(self.up_bps, self.down_bps)

    def to_json(self) -> dict[str, Any]:
        return {"rtt_ms": self.rtt_ms, "rtt_min_ms": self.rtt_min_ms, "rtt_max_ms": self.rtt_max_ms,
                "a_to_b_bytes_per_s": self.up_bps, "b_to_a_bytes_per_s": self.down_bps,
                "a_to_b_gbit_per_s": self.up_bps * 8 / 1e9, "b_to_a_gbit_per_s": self.down_bps * 8 / 1e9,
                "duration_s": self.seconds}


def parse_client_output(text: str) -> Measurement:
    """The client's last stdout line -> Measurement. Raises ParseError (with the text) on anything else,
    including the client's own `{"error": ...}`, whose message becomes the ParseError's."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ParseError("the client printed nothing")
    try:
        doc = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise ParseError(f"not JSON: {lines[-1][:200]!r}") from exc
    if not isinstance(doc, dict):
        raise ParseError(f"not a JSON object: {lines[-1][:200]!r}")
    if "error" in doc:
        raise ParseError(str(doc["error"]))
    try:
        return Measurement(rtt_ms=float(doc["rtt_ms"]), rtt_min_ms=float(doc["rtt_min_ms"]),
                           rtt_max_ms=float(doc["rtt_max_ms"]), up_bps=float(doc["up_bps"]),
                           down_bps=float(doc["down_bps"]), seconds=float(doc["seconds"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ParseError(f"missing or bad field {exc}: {lines[-1][:200]!r}") from exc


@dataclass(frozen=True)
class PairResult:
    """One pair's verdict. `measurement` is None when the pair could not be measured (`error` says why)."""

    a: LinkEnd
    b: LinkEnd
    kind: LinkKind
    speed_gbps: float | None
    status: Status
    summary: str
    measurement: Measurement | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a.node, "b": self.b.node, "a_ip": self.a.ip, "b_ip": self.b.ip,
                "link": {"kind": str(self.kind), "speed_gbit_per_s": self.speed_gbps,
                         "ends": [self.a.to_json(), self.b.to_json()]},
                "status": str(self.status), "summary": self.summary,
                "measurement": self.measurement.to_json() if self.measurement else None, "error": self.error}


def evaluate_pair(a: LinkEnd, b: LinkEnd, measurement: Measurement | None, error: str | None) -> PairResult:
    """Judge one pair. No measurement is a failure carrying `error` (unreachable node, refused port, ...)."""
    kind, speed = combine_ends(a, b)
    if measurement is None:
        return PairResult(a, b, kind, speed, Status.FAIL, f"not measured: {error or 'unknown error'}", None,
                          error or "unknown error")
    status, summary = judge_link(kind, speed, measurement.bottleneck_bps, measurement.rtt_ms)
    return PairResult(a, b, kind, speed, status, summary, measurement, None)


@dataclass(frozen=True)
class GpuBusResult:
    """NCCL between the GPUs of one node (`worker.gpunettest`): all-reduce bus bandwidth in bytes/second
    (nccl-tests' busbw), or the error that stopped it. No nominal speed is known (NVLink generation and PCIe
    width are not in the facts): any measured bandwidth passes, a failure fails; the figure is for the operator
    (an H100 pair over NVLink moves about 300 GB/s, over PCIe a tenth of that)."""

    node: str
    devices: tuple[str, ...]
    status: Status
    summary: str
    busbw_bps: float | None = None
    algbw_bps: float | None = None
    bytes: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "devices": list(self.devices), "status": str(self.status),
                "summary": self.summary, "busbw_bytes_per_s": self.busbw_bps, "algbw_bytes_per_s": self.algbw_bps,
                "bytes": self.bytes, "error": self.error}


def evaluate_gpu_bus(node: str, devices: Sequence[str], text: str | None, error: str | None = None) -> GpuBusResult:
    """`worker.gpunettest`'s JSON line (or the transport's `error`) -> the node's GpuBusResult."""
    if error is None and text is not None:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            doc = json.loads(lines[-1]) if lines else {"error": "the GPU test printed nothing"}
        except json.JSONDecodeError:
            doc = {"error": f"not JSON: {lines[-1][:200]!r}"}
        if not isinstance(doc, dict):
            doc = {"error": f"not a JSON object: {lines[-1][:200]!r}"}
        if "error" in doc:
            error = str(doc["error"])
        else:
            try:
                bus, alg, size = float(doc["busbw_bytes_per_s"]), float(doc["algbw_bytes_per_s"]), int(doc["bytes"])
            except (KeyError, TypeError, ValueError) as exc:
                error = f"missing or bad field {exc}"
            else:
                if bus <= 0:
                    return GpuBusResult(node, tuple(devices), Status.FAIL, "no bandwidth measured", bus, alg, size)
                return GpuBusResult(node, tuple(devices), Status.PASS,
                                    f"NCCL all-reduce over {len(devices)} GPUs: {bus / 1e9:.1f} GB/s bus bandwidth "
                                    f"({size / 2**20:.0f} MiB buffers)", bus, alg, size)
    why = error or "unknown error"
    return GpuBusResult(node, tuple(devices), Status.FAIL, f"not measured: {why}", error=why)


@dataclass(frozen=True)
class NettestReport:
    pairs: tuple[PairResult, ...]
    seconds: float
    node_errors: dict[str, str] = field(default_factory=dict)  # node -> why it took part in no measurement
    gpus: tuple[GpuBusResult, ...] = ()  # one per node with several NVIDIA GPUs: NCCL between them

    def counts(self) -> dict[str, int]:
        out = {str(s): 0 for s in (Status.PASS, Status.WARN, Status.FAIL)}
        for status in self.statuses():
            out[str(status)] = out.get(str(status), 0) + 1
        return out

    def ok(self, *, strict: bool = False) -> bool:
        limit = STATUS_SEVERITY[Status.PASS if strict else Status.WARN]
        return all(STATUS_SEVERITY[status] <= limit for status in self.statuses())

    def statuses(self) -> list[Status]:
        return [p.status for p in self.pairs] + [g.status for g in self.gpus]

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        return {"ok": self.ok(strict=strict), "summary": self.counts(), "duration_s": self.seconds,
                "pairs": [p.to_json() for p in self.pairs], "gpus": [g.to_json() for g in self.gpus],
                "node_errors": dict(self.node_errors)}
