"""The eight preflight checks. Each takes the fleet context and one node's facts and returns a CheckResult.

Ids are stable (`coordinator.models.CHECK_IDS`) and used by `checks.skip`, JSON output and docs/checks.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from coordinator.errors import TransportError
from coordinator.models import CHECK_IDS, STATUS_SEVERITY, CheckResult, LintResult, PreflightReport, Status, worst
from coordinator.preflight.checks.context import CheckContext, CheckFn
from coordinator.preflight.checks.model import check_model
from coordinator.preflight.checks.network import check_rdma, check_thunderbolt
from coordinator.preflight.checks.resources import check_resources
from coordinator.preflight.checks.system import check_env, check_os, check_software, check_ssh

FACT_CHECKS: dict[str, CheckFn] = {
    "os": check_os,
    "rdma": check_rdma,
    "thunderbolt": check_thunderbolt,
    "software": check_software,
    "model": check_model,
    "env": check_env,
    "resources": check_resources,
}
assert tuple(["ssh", *FACT_CHECKS]) == CHECK_IDS


def evaluate_node(ctx: CheckContext, name: str, skip: frozenset[str] = frozenset()) -> tuple[CheckResult, ...]:
    node = ctx.node_by_name[name]
    results = [check_ssh(ctx, node) if "ssh" not in skip else _skipped("ssh", name)]
    facts = ctx.facts.get(name)
    reachable = not isinstance(ctx.connect.get(name), TransportError) and ctx.connect.get(name) is not None
    for check_id, fn in FACT_CHECKS.items():
        if check_id in skip:
            results.append(_skipped(check_id, name))
        elif not reachable:
            results.append(CheckResult(check_id, name, Status.SKIP, "not evaluated: node unreachable"))
        elif facts is None:
            why = str(ctx.probe_errors.get(name, "the probe did not answer"))
            results.append(CheckResult(check_id, name, Status.ERROR, f"not evaluated: {why}",
                                       f"run `coordinator facts --limit {shlex.quote(name)}` to see the node's raw answers",
                                       {"probe_error": why}))
        else:
            results.append(fn(ctx, node, facts))
    return tuple(results)


def _skipped(check_id: str, node: str) -> CheckResult:
    return CheckResult(check_id, node, Status.SKIP, "skipped by the playbook (checks.skip)")


def evaluate_preflight(ctx: CheckContext, lint: tuple[LintResult, ...] = ()) -> PreflightReport:
    skip = frozenset(ctx.playbook.checks.skip) if ctx.playbook else frozenset()
    nodes = tuple((n.name, evaluate_node(ctx, n.name, skip)) for n in ctx.nodes)
    return PreflightReport(nodes=nodes, lint=lint)


def sort_for_display(results: tuple[CheckResult, ...]) -> list[CheckResult]:
    """Fails first, then errors, warnings, passes, skips; stable within a status."""
    return sorted(results, key=lambda r: -STATUS_SEVERITY[r.status])


def node_status(results: Mapping[str, CheckResult] | tuple[CheckResult, ...]) -> Status:
    values = results.values() if isinstance(results, Mapping) else results
    return worst([r.status for r in values])
