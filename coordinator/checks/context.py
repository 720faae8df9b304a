"""What every check sees: the whole fleet's facts, so checks can compare nodes with each other."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from coordinator.errors import TransportError
from coordinator.facts.model import FactError, NodeFacts
from coordinator.models import CheckResult, Node, Status
from coordinator.playbook import Playbook
from coordinator.topology import Link, compute_links
from coordinator.transport import ConnectInfo

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class CheckContext:
    nodes: tuple[Node, ...]
    connect: Mapping[str, ConnectInfo | TransportError]
    facts: Mapping[str, NodeFacts]  # only nodes whose probe answered
    playbook: Playbook | None
    manifest: Mapping[str, str] | None = None  # "model/rel/path" | "data/rel/path" -> sha256
    links: tuple[Link, ...] = field(default=())
    probe_errors: Mapping[str, TransportError] = field(default_factory=dict)  # connected, but the probe failed

    @classmethod
    def build(
        cls,
        nodes: tuple[Node, ...],
        connect: Mapping[str, ConnectInfo | TransportError],
        facts: Mapping[str, NodeFacts],
        playbook: Playbook | None,
        manifest: Mapping[str, str] | None = None,
        probe_errors: Mapping[str, TransportError] | None = None,
    ) -> CheckContext:
        return cls(nodes, connect, facts, playbook, manifest, tuple(compute_links(facts)), dict(probe_errors or {}))

    @property
    def backend(self) -> str:
        return self.playbook.backend if self.playbook else "ring"

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


def majority(values: Mapping[str, K]) -> tuple[K | None, list[str]]:
    """The value held by strictly more nodes than any other, and the nodes that differ from it.

    With a tie (e.g. two nodes that disagree) there is no majority: (None, every node not in the largest
    group... i.e. all disagreeing nodes), so both are suspect.
    """
    if not values:
        return None, []
    counts = Counter(values.values()).most_common()
    if len(counts) == 1:
        return counts[0][0], []
    if counts[0][1] > counts[1][1]:
        winner = counts[0][0]
        return winner, [name for name, v in values.items() if v != winner]
    return None, list(values)


def fact_error_result(
    check_id: str, node: str, errors: list[FactError], what: str, remedy: str = ""
) -> CheckResult:
    return CheckResult(
        id=check_id,
        node=node,
        status=Status.ERROR,
        summary=f"could not read {what}: {errors[0].message}" if errors else f"could not read {what}",
        remedy=remedy or "rerun `coordinator facts --record DIR` and open an issue with the recorded outputs",
        evidence={"errors": [e.to_json() for e in errors]},
    )


CheckFn = Callable[[CheckContext, Node, NodeFacts], CheckResult]
