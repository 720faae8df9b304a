"""Checks `rdma` and `thunderbolt`: the data plane between the job's nodes."""

from __future__ import annotations

import ipaddress
import shlex
import statistics
from typing import Any

from coordinator.facts.model import NodeFacts
from coordinator.facts.topology import Link, required_pairs
from coordinator.models import CheckResult, Node, Status
from coordinator.preflight.checks.context import CheckContext, fact_error_result

RDMA_BACKENDS = ("jaccl", "jaccl-ring", "auto")
TB5_GBPS = 80.0

RECOVERY_STEPS = (
    "RDMA over Thunderbolt needs macOS 26.2+, Thunderbolt 5 on both ends and a TB5 cable: reboot into macOS "
    "Recovery, Utilities > Terminal, `rdma_ctl enable`, reboot, then verify with `ibv_devices`"
)


def _peer_links(ctx: CheckContext, node: Node, peer: str) -> list[Link]:
    return ctx.links_by_pair.get((node.name, peer), [])


def _required_peers(ctx: CheckContext, node: Node) -> list[str]:
    pairs = required_pairs(ctx.names, "jaccl-ring" if ctx.backend == "jaccl-ring" else "jaccl")
    return [b if a == node.name else a for a, b in pairs if node.name in (a, b)]


# --- rdma ----------------------------------------------------------------------------------------------------


def check_rdma(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    backend = ctx.backend
    if backend not in RDMA_BACKENDS:
        return CheckResult("rdma", node.name, Status.SKIP, f"backend {backend} does not use RDMA")
    # With `auto`, missing RDMA only means the launch falls back to ring: a warning, not a failure.
    bad = Status.WARN if backend == "auto" else Status.FAIL
    if facts.os is not None and not facts.os.is_macos:
        devices = [d.name for d in facts.rdma.devices] if facts.rdma else []
        if devices:
            return CheckResult("rdma", node.name, Status.PASS, f"InfiniBand devices: {', '.join(devices)}",
                               evidence={"devices": devices})
        return CheckResult("rdma", node.name, bad, "no RDMA devices in /sys/class/infiniband",
                           "install the RDMA drivers (rdma-core) or use `backend: ring`", {"devices": devices})
    rdma = facts.rdma
    if rdma is None:
        return fact_error_result("rdma", node.name, facts.errors_for("rdma_ctl", "ibv_devices", "ibv_devinfo"),
                                 "the RDMA state", RECOVERY_STEPS)
    evidence: dict[str, Any] = {"rdma_ctl": rdma.ctl_status,
                                "devices": {d.name: d.port_state for d in rdma.devices}}
    if rdma.ctl_status is None:
        return CheckResult("rdma", node.name, bad, "rdma_ctl not found (macOS older than 26.2?)",
                           RECOVERY_STEPS, evidence)
    if rdma.ctl_status != "enabled":
        return CheckResult("rdma", node.name, bad, f"RDMA is {rdma.ctl_status} (`rdma_ctl status`)",
                           RECOVERY_STEPS, evidence)
    if not rdma.devices:
        return CheckResult("rdma", node.name, bad,
                           "rdma_ctl says enabled but `ibv_devices` lists no rdma_* device (a Thunderbolt 4 port or "
                           "cable, or RDMA not active until reboot)",
                           "use Thunderbolt 5 ports and a TB5 cable on both Macs, reboot; if still empty re-run "
                           "`rdma_ctl enable` from Recovery OS", evidence)
    by_name = {d.name: d for d in rdma.devices}
    problems: list[str] = []
    checked: dict[str, str] = {}
    for peer in _required_peers(ctx, node):
        links = _peer_links(ctx, node, peer)
        if not links:
            continue  # the thunderbolt check reports the missing cable
        for link in links:
            dev = link.rdma_device
            if dev is None:
                problems.append(f"link to {peer} (receptacle {link.port.receptacle}) has no enX in networksetup")
            elif dev not in by_name:
                problems.append(f"no {dev} for the link to {peer}")
            elif by_name[dev].port_state != "PORT_ACTIVE":
                problems.append(f"{dev} (to {peer}) is {by_name[dev].port_state or 'not in ibv_devinfo'}")
            else:
                checked[peer] = dev
    evidence["peer_devices"] = checked
    if problems:
        return CheckResult("rdma", node.name, bad, "; ".join(problems),
                           "enable RDMA on BOTH Macs (a port is PORT_ACTIVE only when every connected Mac has RDMA "
                           "enabled), reseat the TB5 cable, reboot. " + RECOVERY_STEPS, evidence)
    if not any(d.port_state == "PORT_ACTIVE" for d in rdma.devices):
        return CheckResult("rdma", node.name, bad, "no rdma device is PORT_ACTIVE",
                           "connect a TB5 cable to a peer that has RDMA enabled; " + RECOVERY_STEPS, evidence)
    via = ", ".join(f"{dev} -> {peer}" for peer, dev in checked.items()) or "no peer links to verify"
    return CheckResult("rdma", node.name, Status.PASS, f"RDMA enabled, {len(rdma.devices)} device(s); {via}",
                       evidence=evidence)


# --- thunderbolt ---------------------------------------------------------------------------------------------


REACH_DETAIL_PEERS = 32  # above this many peers the evidence summarises the reachable ones


def _reachability(ctx: CheckContext, node: Node, facts: NodeFacts) -> tuple[list[str], dict[str, Any]]:
    """(unreachable peers described, evidence) over the peers the node was asked to reach
    (topology.reach_peers): per peer {ip, ok, rtt_ms} for up to REACH_DETAIL_PEERS peers; beyond that (a jaccl
    mesh) the unreachable peers in full and the reachable ones as a count and round-trip statistics."""
    wanted = {peer: ctx.node_by_name[peer].data_ip for peer in ctx.reach_peers.get(node.name, ())}
    got = {r.peer: r for r in facts.reach or ()}
    unreachable: list[str] = []
    evidence: dict[str, Any] = {}
    rtts: list[float] = []
    for peer, ip in wanted.items():
        r = got.get(peer)
        if r is None:
            unreachable.append(f"{peer} ({ip}): not probed")
        elif not r.ok:
            unreachable.append(f"{peer} ({ip}): {r.error}")
        elif r.rtt_ms is not None:
            rtts.append(r.rtt_ms)
        if len(wanted) <= REACH_DETAIL_PEERS or r is None or not r.ok:
            evidence[peer] = {"ip": ip, "ok": bool(r and r.ok), "rtt_ms": r.rtt_ms if r else None}
    if len(wanted) > REACH_DETAIL_PEERS:
        evidence = {"peers": len(wanted), "reached": len(wanted) - len(unreachable),
                    "rtt_ms_median": statistics.median(rtts) if rtts else None, "rtt_ms_max": max(rtts, default=None),
                    "unreachable": evidence}
    return unreachable, evidence


def _interface_of_ip(facts: NodeFacts, ip: str) -> str | None:
    for iface in facts.interfaces or ():
        if ip in iface.ipv4:
            return iface.name
    return None


def check_thunderbolt(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    if facts.reach is None:
        return fact_error_result("thunderbolt", node.name, facts.errors_for("worker"), "data-plane reachability")
    unreachable, reach_ev = _reachability(ctx, node, facts)
    evidence: dict[str, Any] = {"reach": reach_ev}
    fails: list[str] = []
    warns: list[str] = []
    remedies: list[str] = []
    if unreachable:
        fails.append("cannot reach " + "; ".join(unreachable))
        remedies.append("give every node a data-plane IP the others can reach (`ips:` in the inventory); check cables, "
                        "firewall and `ifconfig`")
    is_mac = facts.os is not None and facts.os.is_macos
    if is_mac and facts.thunderbolt is None:
        return fact_error_result("thunderbolt", node.name, facts.errors_for("system_profiler", "networksetup"),
                                 "the Thunderbolt topology")
    if is_mac and ctx.backend in ("jaccl", "jaccl-ring"):
        links_ev: dict[str, Any] = {}
        unknown: list[str] = []
        for peer in _required_peers(ctx, node):
            links = _peer_links(ctx, node, peer)
            links_ev[peer] = [{"receptacle": lk.port.receptacle, "interface": lk.interface,
                               "speed_gbps": lk.speed_gbps} for lk in links]
            peer_facts = ctx.facts.get(peer)
            peer_is_mac = peer_facts is not None and peer_facts.os is not None and peer_facts.os.is_macos
            if not links and (peer_facts is None or (peer_is_mac and peer_facts.thunderbolt is None)):
                # We cannot tell who owns the bus our cable reaches: unknown, not a missing cable.
                unknown.append(peer)
                continue
            if not links:
                fails.append(f"no Thunderbolt link to {peer}")
                remedies.append(f"connect {node.name} and {peer} with a Thunderbolt 5 cable (TB5 ports on both)")
                continue
            fast = [lk for lk in links if (lk.speed_gbps or 0) >= TB5_GBPS]
            if not fast:
                speeds = ", ".join(f"{lk.speed_gbps:g} Gb/s" if lk.speed_gbps else "unknown speed" for lk in links)
                fails.append(f"link to {peer} negotiated {speeds} (< {TB5_GBPS:g} Gb/s: Thunderbolt 4 or a TB4 cable)")
                remedies.append("use a Thunderbolt 5 cable between Thunderbolt 5 ports (RDMA needs TB5 on both ends)")
            for lk in fast:
                iface = next((i for i in facts.interfaces or () if i.name == lk.interface), None)
                if lk.interface and (iface is None or not iface.ipv4):
                    fails.append(f"{lk.interface} (to {peer}) has no IPv4 address (JACCL needs one)")
                    remedies.append(f"sudo ifconfig {shlex.quote(lk.interface)} inet 169.254.X.Y netmask 255.255.0.0 alias "
                                    "(a distinct address per link)")
        evidence["links"] = links_ev
        if unknown and not fails:
            evidence["unknown_peers"] = unknown
            return CheckResult("thunderbolt", node.name, Status.ERROR,
                               f"cannot verify the Thunderbolt link to {', '.join(unknown)}: its topology facts are "
                               "unknown", f"fix the probe on {', '.join(unknown)} (see its facts errors) and rerun",
                               evidence)
        bridge = next((i for i in facts.interfaces or () if i.name == "bridge0"), None)
        tb_ifaces = {lk.interface for lk in ctx.links_from.get(node.name, []) if lk.interface}
        if bridge is not None and bridge.up and (bridge.active is not False) and set(bridge.members) & tb_ifaces:
            fails.append(f"Thunderbolt Bridge (bridge0) is active over {', '.join(sorted(set(bridge.members) & tb_ifaces))}")
            remedies.append("disable Thunderbolt Bridge: System Settings > Network > Thunderbolt Bridge > Inactive "
                            "(or `sudo ifconfig bridge0 down`)")
    elif is_mac:
        # ring (or auto/nccl): warn when the data plane rides Wi-Fi or a 40 Gb/s Thunderbolt link.
        data_iface = _interface_of_ip(facts, node.data_ip)
        port = next((hp.port for hp in facts.hardware_ports or () if hp.device == data_iface), None)
        evidence["data_interface"] = {"ip": node.data_ip, "interface": data_iface, "port": port}
        if port == "Wi-Fi":
            warns.append(f"data-plane IP {node.data_ip} is on Wi-Fi ({data_iface}): expect a slow ring")
            remedies.append("put the data plane on Thunderbolt or Ethernet (`ips:` in the inventory)")
        slow = [lk for lk in ctx.links_from.get(node.name, []) if lk.interface == data_iface
                and lk.speed_gbps is not None and lk.speed_gbps < TB5_GBPS]
        if slow:
            warns.append(f"data plane on a {slow[0].speed_gbps:g} Gb/s Thunderbolt link ({data_iface}): Thunderbolt 4")
            remedies.append("use Thunderbolt 5 ports and cables for 80 Gb/s")
    if fails:
        return CheckResult("thunderbolt", node.name, Status.FAIL, "; ".join(fails + warns), "; ".join(remedies), evidence)
    if warns:
        return CheckResult("thunderbolt", node.name, Status.WARN, "; ".join(warns), "; ".join(remedies), evidence)
    peers = len(ctx.reach_peers.get(node.name, ()))
    which = f"all {peers} peer(s)" if peers == len(ctx.nodes) - 1 else f"its {peers} nearest ring neighbours"
    if _on_loopback(ctx, node):
        # Nodes of one machine talk over its loopback: no cable, no link speed, nothing a pass would vouch for.
        return CheckResult("thunderbolt", node.name, Status.SKIP, f"not applicable: the data plane is this machine's "
                           f"loopback ({node.data_ip}); no link to check", evidence=evidence)
    kind = "Thunderbolt 5 links and " if is_mac and ctx.backend in ("jaccl", "jaccl-ring") else ""
    return CheckResult("thunderbolt", node.name, Status.PASS, f"{kind}data plane reaches {which}", evidence=evidence)


def _on_loopback(ctx: CheckContext, node: Node) -> bool:
    """This node and every peer it must reach have loopback data-plane addresses (the local demo)."""
    names = [node.name, *ctx.reach_peers.get(node.name, ())]
    by_name = {n.name: n for n in ctx.nodes}
    return all(_is_loopback(by_name[n].data_ip) for n in names if n in by_name)


def _is_loopback(address: str) -> bool:
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False
