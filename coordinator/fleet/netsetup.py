"""`coordinator setup --network`: the Thunderbolt point-to-point addresses between Macs, made persistent.

mlx's `distributed_config --auto-setup` configures each Thunderbolt cable as its own tiny network: the Thunderbolt
Bridge (bridge0, which joins every Thunderbolt port into one broadcast domain and breaks point-to-point traffic
and RDMA) down, one /30 per cable with the lower-ranked end `.1` and the other `.2`, and the peer reached
through that cable's interface. It does so with `ifconfig`/`route`, which a reboot forgets. Here the same
addresses are computed from the probed facts (topology.compute_links pairs the two ends of a cable by their bus
domain UUIDs) and set with `networksetup`, which writes the network preferences:

    networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off
    networksetup -setmanual "Thunderbolt N" 192.168.K.1 255.255.255.252

The /30 set on the cable's own interface is its route: each cable has its own subnet, so the peer is reached
through that interface and no other (no host routes are needed, and none are left behind to go stale).

Commands are printed first; they run only with `--apply` (as the login, through `sudo -n` unless it is root).
Pure core: `compute_cables`, `plan_network`, `render_command`. I/O: `run_network_setup`.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.errors import TransportError
from coordinator.facts.model import NodeFacts
from coordinator.facts.topology import compute_links, interface_for_receptacle
from coordinator.fleet.gather import gather_facts
from coordinator.fleet.nodesetup import Outcome
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet, Transport
from coordinator.models import Node

NETMASK = "255.255.255.252"  # /30: the two ends of one cable
BRIDGE_SERVICE = "Thunderbolt Bridge"
MAX_CABLES = 256  # 192.168.0.0/30 ... 192.168.255.0/30
PROBE_TIMEOUT = 120.0
COMMAND_TIMEOUT = 60.0


@dataclass(frozen=True)
class End:
    node: str
    interface: str  # enX
    service: str  # the network service networksetup configures: the hardware port's name, "Thunderbolt N"
    ip: str


@dataclass(frozen=True)
class Cable:
    index: int  # K of 192.168.K.0/30
    a: End  # the end on the node earlier in the inventory (rank order): .1
    b: End  # .2

    @property
    def subnet(self) -> str:
        return f"192.168.{self.index}.0/30"


def _service(facts: NodeFacts, interface: str) -> str | None:
    return next((hp.port for hp in facts.hardware_ports or () if hp.device == interface), None)


def compute_cables(names: Sequence[str], facts: Mapping[str, NodeFacts]) -> tuple[list[Cable], dict[str, list[str]]]:
    """Every Thunderbolt cable between two of `names` (in inventory order), numbered, with its two ends'
    interfaces and addresses; and per node the cables it cannot configure (an end whose receptacle has no
    `Thunderbolt N` interface in networksetup)."""
    order = {n: i for i, n in enumerate(names)}
    by_uuid = {(link.src, link.port.domain_uuid): link for link in compute_links(facts)}
    cables: list[Cable] = []
    problems: dict[str, list[str]] = {}
    for link in sorted(compute_links(facts), key=lambda x: (order.get(x.src, 1 << 30), x.port.receptacle or "")):
        if order.get(link.src, 1 << 30) > order.get(link.dst, 1 << 30):
            continue  # each cable once, from its lower-ranked end
        back = by_uuid.get((link.dst, link.port.peer_domain_uuid))
        back_if = interface_for_receptacle(facts[link.dst], back.port.receptacle) if back is not None else None
        a_service = _service(facts[link.src], link.interface) if link.interface else None
        b_service = _service(facts[link.dst], back_if) if back_if else None
        if link.interface is None or a_service is None or back_if is None or b_service is None:
            what = f"cable {link.src} <-> {link.dst}: no Thunderbolt interface in networksetup for "
            problems.setdefault(link.src if link.interface is None else link.dst, []).append(
                what + (f"{link.src}'s receptacle {link.port.receptacle}" if link.interface is None
                        else f"{link.dst}'s end"))
            continue
        k = len(cables)
        if k >= MAX_CABLES:
            problems.setdefault(link.src, []).append(f"more than {MAX_CABLES} cables: 192.168.0.0/16 is used up")
            break
        cables.append(Cable(k, End(link.src, link.interface, a_service, f"192.168.{k}.1"),
                            End(link.dst, back_if, b_service, f"192.168.{k}.2")))
    return cables, problems


@dataclass(frozen=True)
class NodeNetPlan:
    """A Mac's commands (argv, without sudo) and the addresses they set; `problem` fails the node."""

    node: str
    addresses: tuple[tuple[str, str, str, str], ...] = ()  # (interface, address/30, peer node, peer address)
    commands: tuple[tuple[str, ...], ...] = ()
    note: str = ""
    problem: str | None = None


def plan_network(nodes: Sequence[Node], facts: Mapping[str, NodeFacts]) -> dict[str, NodeNetPlan]:
    """Facts in, commands out. Commands whose effect the facts already show (an interface that has its address,
    a bridge0 that is inactive with no members) are left out, so a set-up Mac plans nothing."""
    macs = {n.name: f for n in nodes if (f := facts.get(n.name)) is not None and f.os is not None and f.os.is_macos}
    cables, problems = compute_cables([n.name for n in nodes], macs)
    plans: dict[str, NodeNetPlan] = {}
    for node in nodes:
        f = facts.get(node.name)
        if node.name not in macs:
            plans[node.name] = NodeNetPlan(node.name, note="not macOS: nothing to do" if f is not None else "no facts")
            continue
        mine = [(c.a, c.b) for c in cables if c.a.node == node.name] + [(c.b, c.a) for c in cables if c.b.node == node.name]
        have = {i.name: i for i in f.interfaces or ()} if f is not None else {}
        commands: list[tuple[str, ...]] = []
        bridge = have.get("bridge0")
        if mine and bridge is not None and (bridge.members or bridge.active):
            commands.append(("networksetup", "-setnetworkserviceenabled", BRIDGE_SERVICE, "off"))
        for end, _ in mine:
            iface = have.get(end.interface)
            if iface is None or end.ip not in iface.ipv4:
                commands.append(("networksetup", "-setmanual", end.service, end.ip, NETMASK))
        addresses = tuple((end.interface, f"{end.ip}/30", peer.node, peer.ip) for end, peer in mine)
        problem = "; ".join(problems.get(node.name, [])) or None
        note = "" if mine else "no Thunderbolt cable to another node of the inventory"
        plans[node.name] = NodeNetPlan(node.name, addresses, tuple(commands), note, problem)
    return plans


def with_sudo(node: Node, argv: Sequence[str]) -> list[str]:
    """networksetup changes need root: `sudo -n` (never a password prompt over SSH) unless the login is root."""
    return list(argv) if node.user == "root" else ["sudo", "-n", *argv]


def render_command(node: Node, argv: Sequence[str]) -> str:
    return shlex.join(with_sudo(node, argv))


# --- I/O -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeNetSetup:
    node: str
    outcome: Outcome
    commands: tuple[str, ...]
    addresses: tuple[tuple[str, str, str, str], ...]
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "status": str(self.outcome), "commands": list(self.commands),
                "addresses": [{"interface": i, "address": a, "peer": p, "peer_address": pa}
                              for i, a, p, pa in self.addresses], "message": self.message}


@dataclass(frozen=True)
class NetworkReport:
    nodes: tuple[NodeNetSetup, ...]
    applied: bool

    @property
    def failed(self) -> bool:
        return any(n.outcome is Outcome.FAILED for n in self.nodes)

    def failed_nodes(self) -> list[str]:
        return [n.node for n in self.nodes if n.outcome is Outcome.FAILED]

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "nodes": [n.to_json() for n in self.nodes],
                "summary": {str(o): sum(1 for n in self.nodes if n.outcome is o) for o in Outcome}}

    def lines(self) -> list[str]:
        out: list[str] = []
        for n in self.nodes:
            for iface, addr, peer, peer_addr in n.addresses:
                out.append(f"# {n.node}: {iface} {addr} <-> {peer} {peer_addr}")
            out += [f"  {c}" for c in n.commands]
            out.append(f"{n.outcome}: [{n.node}]" + (f" {n.message}" if n.message else ""))
        if not self.applied and any(n.commands for n in self.nodes):
            out.append("not applied: rerun with --apply to run the commands above")
        return out


async def run_network_setup(nodes: Sequence[Node], *, apply: bool, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                            accept_new_host_keys: bool = False) -> NetworkReport:
    """Probe, plan, and with `apply` run each Mac's commands in order (a failing one stops that node)."""
    results: dict[str, NodeNetSetup] = {}
    async with Fleet(nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys) as fleet:
        await fleet.connect_all()
        gathered = await gather_facts(fleet, None, timeout=PROBE_TIMEOUT)
        facts = {k: v for k, v in gathered.items() if isinstance(v, NodeFacts)}
        plans = plan_network(nodes, facts)
        for node in nodes:
            got = gathered.get(node.name) or fleet.failed.get(node.name)
            if isinstance(got, TransportError):
                results[node.name] = NodeNetSetup(node.name, Outcome.FAILED, (), (), str(got))
        for node in nodes:
            if node.name in results:
                continue
            plan = plans[node.name]
            shown = tuple(render_command(node, c) for c in plan.commands)
            if plan.problem:
                results[node.name] = NodeNetSetup(node.name, Outcome.FAILED, shown, plan.addresses, plan.problem)
            elif not plan.commands:
                results[node.name] = NodeNetSetup(node.name, Outcome.OK, (), plan.addresses,
                                                  plan.note or "addresses already set")
            elif not apply:
                results[node.name] = NodeNetSetup(node.name, Outcome.CHANGED, shown, plan.addresses, "would run")

        async def run_plan(node: Node, transport: Transport) -> NodeNetSetup:
            plan = plans[node.name]
            shown = tuple(render_command(node, c) for c in plan.commands)
            for argv, text in zip(plan.commands, shown, strict=True):
                res = await transport.run(with_sudo(node, argv), timeout=COMMAND_TIMEOUT)
                if not res.ok:
                    return NodeNetSetup(node.name, Outcome.FAILED, shown, plan.addresses,
                                        f"`{text}` exited {res.exit_status}: {(res.stderr or res.stdout).strip()[-300:]}")
            return NodeNetSetup(node.name, Outcome.CHANGED, shown, plan.addresses, "applied")

        todo = [n.name for n in nodes if n.name not in results]
        for name, res in (await fleet.map(run_plan, names=todo)).items():
            results[name] = res if isinstance(res, NodeNetSetup) else NodeNetSetup(name, Outcome.FAILED, (), (), str(res))
    return NetworkReport(tuple(results[n.name] for n in nodes), apply)
