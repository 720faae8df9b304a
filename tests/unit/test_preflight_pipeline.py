"""One preflight pipeline: `coordinator preflight` and the launch (job.probe_and_check) sort the probe's answers
with `fleet_facts` and judge them with one `preflight.evaluate`, so the launch refuses what the verb reports
(before, the launch's lint never saw the fleet's GPUs: `backend: nccl` on Macs passed its preflight)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.config.playbook import parse_playbook
from coordinator.errors import TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.transport import Transport
from coordinator.models import ConnectInfo, Inventory, Node, Status
from coordinator.preflight.pipeline import FleetFacts, evaluate, fleet_facts
from coordinator.run.job import probe_and_check
from tests.factsutil import MBP, STUDIO, facts_from, profile_sections, worker_answer

NODES = (Node("a", "10.0.0.1"), Node("b", "10.0.0.2"), Node("down", "10.0.0.3"), Node("mute", "10.0.0.4"))
INV = Inventory(NODES)
PB = parse_playbook({"name": "job", "model": "/m", "data": "/d", "backend": "nccl"}, path="playbook.yaml")


def answers() -> dict[str, NodeFacts | TransportError]:
    return {"a": facts_from("a", profile_sections(MBP, worker=worker_answer())),
            "b": facts_from("b", profile_sections(STUDIO, worker=worker_answer())),
            "mute": TransportError("mute", "probe produced no output (exit 1)")}


def connect() -> dict[str, ConnectInfo | TransportError]:
    return {"a": ConnectInfo("a", 0.1, 1.0, None), "b": ConnectInfo("b", 0.1, 1.0, None),
            "down": TransportError("down", "no route to host"), "mute": ConnectInfo("mute", 0.1, 1.0, None)}


def test_fleet_facts_sorts_answers_from_probe_errors() -> None:
    dialled = connect()
    ff = fleet_facts(dialled, answers())
    assert sorted(ff.facts) == ["a", "b"] and list(ff.probe_errors) == ["mute"]
    assert ff.connect == dialled


class OpenFleet:
    """A fleet already connected (launch connects, provisions assets, then probes): `map` answers the probe with
    the recorded facts, as `Fleet.map` does with each node's result or TransportError."""

    def __init__(self) -> None:
        self.nodes = NODES
        self.connected = {n: i for n, i in connect().items() if isinstance(i, ConnectInfo)}
        self.failed = {n: e for n, e in connect().items() if isinstance(e, TransportError)}

    async def map(self, fn: Callable[[Node, Transport], Awaitable[Any]]) -> dict[str, NodeFacts | TransportError]:
        return answers()


def test_the_launch_and_the_verb_make_one_report() -> None:
    verb = evaluate(INV, PB, fleet_facts(connect(), answers()))
    launch = asyncio.run(probe_and_check(OpenFleet(), INV, PB))  # type: ignore[arg-type]
    assert launch.report == verb
    assert sorted(launch.facts) == ["a", "b"]
    backend = next(lint for lint in verb.lint if lint.id == "backend")
    assert backend.status == Status.FAIL and "a, b have no NVIDIA GPU" in backend.summary
    by_node = dict(verb.nodes)
    assert {c.status for c in by_node["down"] if c.id != "ssh"} == {Status.SKIP}
    assert all(c.status == Status.ERROR and "probe produced no output" in c.summary
               for c in by_node["mute"] if c.id != "ssh")


def test_evaluate_without_a_playbook_has_no_lint() -> None:
    report = evaluate(INV, None, FleetFacts(connect(), {}, {}))
    assert report.lint == ()
