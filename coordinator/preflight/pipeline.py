"""`coordinator preflight` and `coordinator facts`: connect, probe, evaluate. The CLI verbs land here.

The one preflight pipeline: probe (`collect` opens the fleet and probes each node as it connects; `probe_connected`
probes a fleet already open, as launch does after provisioning assets), then `fleet_facts` sorts the answers and
`evaluate` turns them into the report. `coordinator preflight` and `coordinator launch` (job.probe_and_check) both
end in `evaluate`, so the launch refuses exactly what the verb reports.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config.playbook import Playbook
from coordinator.errors import ConfigError, TransportError
from coordinator.facts.model import NodeFacts
from coordinator.fleet.gather import DEFAULT_PROBE_TIMEOUT, ProgressFn, fact_prober, gather_facts
from coordinator.fleet.transport import DEFAULT_CONNECT_TIMEOUT, Fleet
from coordinator.models import ConnectInfo, Inventory, LintResult, PreflightReport
from coordinator.planning.estimate import model_shape
from coordinator.planning.hostfile import has_cuda, resolve_backend
from coordinator.planning.strategy import (
    NO_SEND_RECV_BACKENDS,
    NodeBudget,
    StrategyError,
    compute_strategy,
    fsdp_refusal,
    node_budget,
    pipeline_refusal,
)
from coordinator.preflight.checks import evaluate_preflight
from coordinator.preflight.checks.context import CheckContext
from coordinator.preflight.lint import lint_playbook

_MANIFEST_LINE = re.compile(r"^(?P<sha>[0-9a-fA-F]{64}) [ *](?P<path>.+)$")


def parse_manifest(text: str, *, source: str = "manifest") -> dict[str, str]:
    """`sha256sum`/`shasum -a 256` output (paths `model/...` or `data/...`) -> {path: sha256}."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _MANIFEST_LINE.match(line)
        if m is None:
            raise ConfigError("expected `<sha256>  <model|data>/<path>`", path=source, line=lineno)
        path = m["path"].removeprefix("./")
        if not path.startswith(("model/", "data/")):
            raise ConfigError(f"path {path!r} must start with model/ or data/", path=source, line=lineno)
        out[path] = m["sha"].lower()
    return out


def load_manifest(playbook: Playbook) -> dict[str, str] | None:
    if not playbook.manifest:
        return None
    base = Path(playbook.path).parent if playbook.path else Path.cwd()
    path = (base / playbook.manifest).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {path}: {exc.strerror}", path=playbook.path) from exc
    return parse_manifest(text, source=str(path))


@dataclass(frozen=True)
class FleetFacts:
    connect: dict[str, ConnectInfo | TransportError]
    facts: dict[str, NodeFacts]
    probe_errors: dict[str, TransportError]


def fleet_facts(connect: Mapping[str, ConnectInfo | TransportError],
                gathered: Mapping[str, NodeFacts | TransportError]) -> FleetFacts:
    """Sort the probe's per-node answers: facts, or the error of a node that connected but whose probe failed."""
    facts = {n: f for n, f in gathered.items() if isinstance(f, NodeFacts)}
    errors = {n: f for n, f in gathered.items() if isinstance(f, TransportError)}
    return FleetFacts(connect=dict(connect), facts=facts, probe_errors=errors)


async def collect(
    inventory: Inventory,
    playbook: Playbook | None,
    *,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
    accept_new_host_keys: bool = False,
    concurrency: int = 64,
    progress: ProgressFn | None = None,
    fleet_factory: Any = None,
) -> FleetFacts:
    factory = fleet_factory or Fleet
    async with factory(inventory.nodes, connect_timeout=connect_timeout, accept_new_host_keys=accept_new_host_keys,
                       concurrency=concurrency) as fleet:
        # Each node is probed as soon as it is connected (not after the slowest handshake of the fleet).
        connect, gathered = await fleet.connect_and_map(
            fact_prober(fleet.nodes, playbook, timeout=probe_timeout, progress=progress))
    return fleet_facts(connect, gathered)


async def probe_connected(fleet: Fleet, playbook: Playbook | None, *,
                          probe_timeout: float = DEFAULT_PROBE_TIMEOUT) -> FleetFacts:
    """Probe every connected node of an open `fleet` (its failed connections are reported as such)."""
    gathered = await gather_facts(fleet, playbook, timeout=probe_timeout)
    return fleet_facts(dict(fleet.failed) | dict(fleet.connected), gathered)


def model_config(facts: Mapping[str, NodeFacts]) -> dict[str, Any] | None:
    """The model config most nodes agree on (the lint needs one; the model check flags the odd node)."""
    configs = [f.model_config for f in facts.values() if f.model_config is not None]
    if not configs:
        return None
    keyed = Counter(repr(sorted(c.items())) for c in configs).most_common(1)[0][0]
    return next(c for c in configs if repr(sorted(c.items())) == keyed)


def fleet_budgets(inventory: Inventory, fleet: FleetFacts) -> dict[str, NodeBudget]:
    """Each node's usable training memory, for the strategy planner; {} unless every node's is known (a plan
    for part of the fleet would be wrong for the whole)."""
    budgets = {n.name: node_budget(fleet.facts[n.name]) if n.name in fleet.facts else None for n in inventory.nodes}
    known = {n: b for n, b in budgets.items() if b is not None}
    return known if len(known) == len(budgets) else {}


def resolve_strategy(inventory: Inventory, playbook: Playbook, facts: Mapping[str, NodeFacts]) -> str:
    """`dp` or `fsdp`: how the ranks of a run that is not a pipeline share the work: forced, or auto's choice by
    memory for this fleet (its rank nodes: one per GPU, `planning.gpuranks`). A pipeline is weighed and laid out
    after calibration (`run.job.calibrate_and_plan`); auto stays dp when it cannot choose (DoRA, unknown size or
    memory, nothing fits: the resources check's failure)."""
    t = playbook.train
    if t.strategy in ("dp", "fsdp"):
        return t.strategy
    if t.strategy == "pipeline" or t.fine_tune_type == "dora":
        return "dp"
    shape = model_shape(model_config(facts), None)
    budgets = fleet_budgets(inventory, FleetFacts({}, dict(facts), {}))
    if shape is None or not budgets:
        return "dp"
    backend = resolve_backend(playbook.backend, facts, inventory.nodes)
    try:
        return "fsdp" if compute_strategy("auto", shape, t, budgets, backend=backend).strategy == "fsdp" else "dp"
    except StrategyError:
        return "dp"


def strategy_refusal(inventory: Inventory, playbook: Playbook, facts: Mapping[str, NodeFacts]) -> str | None:
    """Why the run must not start with its `train.strategy` (None: it may). Launch checks this even under
    `--skip-preflight`: a pipeline on a backend without send/recv, or a run that resolves to fsdp on a backend
    without sum_scatter, must be refused, never run as dp. auto with nothing fitting is the resources check's
    failure (which --skip-preflight overrides)."""
    t = playbook.train
    if t.strategy == "dp":
        return None
    backend = resolve_backend(playbook.backend, facts, inventory.nodes)
    if t.strategy == "pipeline":
        return f"train.strategy pipeline: {pipeline_refusal(backend)}" if backend in NO_SEND_RECV_BACKENDS else None
    if resolve_strategy(inventory, playbook, facts) != "fsdp":
        return None
    refusal = fsdp_refusal(backend)
    return None if refusal is None else f"train.strategy {t.strategy} resolves to fsdp: {refusal}"


def evaluate(inventory: Inventory, playbook: Playbook | None, fleet: FleetFacts) -> PreflightReport:
    """The preflight report (the checks of every node, the playbook's lint) from the fleet's facts. Reads the
    playbook's manifest file when it names one (ConfigError when unreadable)."""
    manifest = load_manifest(playbook) if playbook is not None else None
    ctx = CheckContext.build(inventory.nodes, fleet.connect, fleet.facts, playbook, manifest, fleet.probe_errors)
    cuda = {n: has_cuda(f) for n, f in fleet.facts.items()}
    lint: tuple[LintResult, ...] = ()
    if playbook is not None:
        lint = tuple(lint_playbook(playbook, model_config(fleet.facts), cuda, budgets=fleet_budgets(inventory, fleet),
                                   backend=resolve_backend(playbook.backend, fleet.facts, inventory.nodes)))
    return evaluate_preflight(ctx, lint)
