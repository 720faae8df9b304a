"""What every check sees: the whole fleet's facts, so checks can compare nodes with each other."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from coordinator.config.playbook import Playbook
from coordinator.errors import TransportError
from coordinator.facts.model import FactError, FactErrorKind, NodeFacts
from coordinator.facts.topology import Link, compute_links, reach_peers
from coordinator.models import CheckResult, ConnectInfo, Node, Status
from coordinator.models import majority as majority  # re-exported: the checks use it
from coordinator.planning.estimate import model_shape
from coordinator.planning.pipeline import StagePlan
from coordinator.planning.strategy import (
    StrategyDecision,
    StrategyError,
    compute_strategy,
    node_budget,
)

K = TypeVar("K", bound=Hashable)

Manifest = dict[str, str]  # "model/<rel>" | "data/<rel>" -> sha256


def node_manifest(facts: NodeFacts, labels: tuple[str, ...]) -> tuple[Manifest, list[str], int]:
    """(manifest, problems such as missing dirs, total bytes) for the node's hashed dirs."""
    manifest: Manifest = {}
    problems: list[str] = []
    total = 0
    for label, dh in zip(labels, facts.hashes or (), strict=False):
        if not dh.exists:
            problems.append(f"{label} dir {dh.path} is missing")
            continue
        if dh.error:
            problems.append(f"{label} dir {dh.path}: {dh.error}")
        if not dh.files:
            problems.append(f"{label} dir {dh.path} is empty")
        for f in dh.files:
            manifest[f"{label}/{f.path}"] = f.sha256
            total += f.size
    return manifest, problems, total


def manifest_digest(manifest: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(manifest):
        h.update(f"{manifest[path]}  {path}\n".encode())
    return h.hexdigest()


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

    # Fleet-wide values every node's check compares itself with: computed once per context, not once per node
    # (a per-node recomputation made preflight quadratic in the fleet size).

    @cached_property
    def node_by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def reach_peers(self) -> dict[str, list[str]]:
        """node -> the peers its probe was asked to reach (the same pure function the probe's arguments use)."""
        return reach_peers(self.names, self.backend)

    @cached_property
    def links_by_pair(self) -> dict[tuple[str, str], list[Link]]:
        out: dict[tuple[str, str], list[Link]] = {}
        for link in self.links:
            out.setdefault((link.src, link.dst), []).append(link)
        return out

    @cached_property
    def links_from(self) -> dict[str, list[Link]]:
        out: dict[str, list[Link]] = {}
        for link in self.links:
            out.setdefault(link.src, []).append(link)
        return out

    @cached_property
    def macos_builds(self) -> dict[str, str]:
        return {n: f.os.build for n, f in self.facts.items() if f.os is not None and f.os.is_macos and f.os.build}

    @cached_property
    def mlx_versions(self) -> dict[str, tuple[str, str]]:
        return {n: (f.software.mlx_version, f.software.mlx_lm_version) for n, f in self.facts.items()
                if f.software is not None and f.software.mlx_version and f.software.mlx_lm_version}

    @cached_property
    def mlx_majority(self) -> tuple[tuple[str, str] | None, frozenset[str]]:
        ref, odd = majority(self.mlx_versions)
        return ref, frozenset(odd)

    @cached_property
    def fleet_manifests(self) -> tuple[dict[str, Manifest], dict[str, str]]:
        """Every node's manifest of the playbook's hashed dirs (nodes whose dirs are complete) and its digest."""
        labels = tuple(label for label, _ in self.playbook.hashed_dirs()) if self.playbook else ()
        manifests: dict[str, Manifest] = {}
        for name, f in self.facts.items():
            m, problems, _ = node_manifest(f, labels)
            if not problems and f.hashes is not None:
                manifests[name] = m
        return manifests, {name: manifest_digest(m) for name, m in manifests.items()}

    @cached_property
    def strategy_decision(self) -> StrategyDecision | None:
        """The playbook's strategy (auto or pipeline) resolved by memory, when every node's memory and the model's
        size are known; None otherwise (or when nothing fits: the strategy lint says so)."""
        pb = self.playbook
        if pb is None or pb.kind != "train" or pb.train.strategy not in ("auto", "pipeline"):
            return None
        configs = [f for f in self.facts.values() if f.model_config is not None]
        shape = model_shape(configs[0].model_config, configs[0].model_params) if configs else None
        budgets = {n.name: node_budget(self.facts[n.name]) if n.name in self.facts else None for n in self.nodes}
        known = {n: b for n, b in budgets.items() if b is not None}
        if shape is None or len(known) != len(budgets):
            return None
        try:
            return compute_strategy(pb.train.strategy, shape, pb.train, known, backend=self.backend)
        except StrategyError:
            return None

    @cached_property
    def pipeline_stages(self) -> dict[str, StagePlan]:
        """node -> its stage, when the strategy resolves to a pipeline the worker runs; {} otherwise. The
        resources check then judges a node by its stage's need, not a replica's (until the worker runs
        pipelines, such a plan is refused by the lint `strategy`: a replica's need is the truth)."""
        decision = self.strategy_decision
        if decision is None or decision.pipeline is None:
            return {}
        return {s.node: s for s in decision.pipeline.stages}

    @cached_property
    def left_out_by_strategy(self) -> frozenset[str]:
        """Nodes the strategy leaves out (dp on the nodes whose replica fits): the run does not use them."""
        decision = self.strategy_decision
        return frozenset(n.node for n in decision.left_out) if decision is not None else frozenset()

    @cached_property
    def python_minors(self) -> dict[str, str]:
        return {n: ".".join(f.software.python_version.split(".")[:2]) for n, f in self.facts.items()
                if f.software is not None and f.software.python_version}


def fact_error_result(
    check_id: str, node: str, errors: list[FactError], what: str, remedy: str = ""
) -> CheckResult:
    """An `error` verdict from the facts that could not be read. A parser bug is named as the coordinator's,
    first, so nobody goes looking for a fault on the node."""
    bugs = [e for e in errors if e.kind == FactErrorKind.PARSER_BUG]
    if bugs:
        return CheckResult(
            id=check_id, node=node, status=Status.ERROR,
            summary=f"could not read {what}: a bug in the coordinator's {bugs[0].source} parser ({bugs[0].message})",
            remedy="not a fault of the node: open an issue with the outputs of `coordinator facts --record DIR`",
            evidence={"errors": [e.to_json() for e in errors]},
        )
    return CheckResult(
        id=check_id,
        node=node,
        status=Status.ERROR,
        summary=f"could not read {what}: {errors[0].message}" if errors else f"could not read {what}",
        remedy=remedy or "rerun `coordinator facts --record DIR` and open an issue with the recorded outputs",
        evidence={"errors": [e.to_json() for e in errors]},
    )


CheckFn = Callable[[CheckContext, Node, NodeFacts], CheckResult]
