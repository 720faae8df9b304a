"""Fleet.connect_and_map: each node's work starts when that node is connected; failures come back as values."""

from __future__ import annotations

import asyncio

from coordinator.errors import TransportError
from coordinator.fleet.transport import Fleet, Transport
from coordinator.models import ConnectInfo, Node


class FakeTransport:
    def __init__(self, node: Node, delays: dict[str, float], log: list[str]) -> None:
        self.node = node
        self.delay = delays.get(node.name, 0.0)
        self.log = log

    async def connect(self) -> ConnectInfo:
        await asyncio.sleep(self.delay)
        if self.node.name == "down":
            raise TransportError(self.node.name, "no route to host")
        self.log.append(f"connected {self.node.name}")
        return ConnectInfo(self.node.name, self.delay, 0.1, None)

    async def close(self) -> None:
        return None


def test_work_starts_per_node_and_failures_are_values() -> None:
    log: list[str] = []
    nodes = [Node(name=n, host="127.0.0.1") for n in ("slow", "fast", "down", "broken")]

    async def work(node: Node, transport: Transport) -> str:
        log.append(f"work {node.name}")
        if node.name == "broken":
            raise TransportError(node.name, "probe failed")
        return node.name.upper()

    async def go() -> tuple[dict, dict]:
        fleet = Fleet(nodes, transport_factory=lambda n: FakeTransport(n, {"slow": 0.2}, log))  # type: ignore[arg-type,return-value]
        async with fleet:
            return await fleet.connect_and_map(work)

    connect, done = asyncio.run(go())
    assert isinstance(connect["down"], TransportError) and "down" not in done
    assert done["slow"] == "SLOW" and done["fast"] == "FAST" and isinstance(done["broken"], TransportError)
    assert log.index("work fast") < log.index("connected slow")  # no barrier after the handshakes
