"""`coordinator launch --fix`: which preflight findings `setup` and `sync` can fix, for which nodes, and where
sync copies from. Pure: a preflight report (and what the I/O shell found on this machine) in, a typed plan out.
The shell that runs the plan is `job.fix_fleet` (docs/setup.md#launch---fix).

What a tool fixes is what the check itself says fixes it: a `software` finding whose remedy names `coordinator
setup` (every software failure of the node's own python and versions; not e.g. `backend: nccl` on a node without
an NVIDIA GPU, nor a too-old driver), a `model` finding whose remedy names `coordinator sync` (missing, empty,
truncated, stale or extra files). A model finding without one (nodes that disagree with no majority) is
sync's only when a source was named (`--fix-source`): then that copy settles it. Files that every node has alike
but the trainer cannot load, and every other check (ssh, os, rdma, thunderbolt, env, resources) and the
playbook's lint, are left alone and reported.

Rounds: setup first (a node without its python has no hashes: its model finding, and any other finding its facts
could not back, is `deferred` until it is probed again with the set-up python), then sync on the report probed
after setup, then preflight once more. `compute_fix_plan` is called on each round's report.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from coordinator.errors import ConfigError
from coordinator.models import CheckResult, PreflightReport, Status
from coordinator.planning.sync import SyncPlan

BAD = (Status.FAIL, Status.ERROR)


@dataclass(frozen=True)
class FixOptions:
    """launch's `--fix [--fix-source NODE|DIR]` (JobOptions.fix)."""

    source: str | None = None


def fix_options(fix: bool, source: str | None) -> FixOptions | None:
    """launch's flags as JobOptions.fix; ConfigError for --fix-source without --fix."""
    if source is not None and not fix:
        raise ConfigError("--fix-source goes with --fix")
    return FixOptions(source) if fix else None


class FixTool(StrEnum):
    SETUP = "setup"
    SYNC = "sync"


@dataclass(frozen=True)
class Finding:
    """One failing finding of the report (`node` is `playbook` for a lint failure)."""

    check: str
    node: str
    status: Status
    summary: str

    def describe(self) -> str:
        return f"{self.check} on {self.node}: {self.summary}"

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "node": self.node, "status": str(self.status), "summary": self.summary}


@dataclass(frozen=True)
class FixPlan:
    """`setup` and `sync`: the nodes each tool runs on (inventory order). `deferred`: findings on nodes being
    set up, judged again once they are probed with the new python. `unfixable`: what --fix leaves alone."""

    setup: tuple[str, ...] = ()
    sync: tuple[str, ...] = ()
    deferred: tuple[Finding, ...] = ()
    unfixable: tuple[Finding, ...] = ()

    def nodes(self, tool: FixTool) -> tuple[str, ...]:
        return self.setup if tool is FixTool.SETUP else self.sync

    @property
    def fixes_anything(self) -> bool:
        return bool(self.setup or self.sync)

    def to_json(self) -> dict[str, Any]:
        return {"setup": list(self.setup), "sync": list(self.sync),
                "deferred": [f.to_json() for f in self.deferred], "unfixable": [f.to_json() for f in self.unfixable]}


def fixable_by(result: CheckResult, *, source_named: bool = False) -> FixTool | None:
    """The tool that fixes this failing finding, None when neither does (see the module docstring)."""
    if result.status not in BAD:
        return None
    if result.id == "software" and "coordinator setup" in result.remedy:
        return FixTool.SETUP
    if result.id == "model" and result.status is Status.FAIL:
        if "coordinator sync" in result.remedy:
            return FixTool.SYNC
        # Copies that disagree with no majority: a named source is the right copy (never for files that are
        # alike everywhere but not loadable: `loadable` in the evidence; the source would have the same ones).
        if source_named and "diff" in result.evidence and "loadable" not in result.evidence:
            return FixTool.SYNC
    return None


def compute_fix_plan(report: PreflightReport, *, source_named: bool = False) -> FixPlan:
    """Which nodes `setup` and `sync` run on to fix this report's findings, and what they leave alone."""
    setup: list[str] = []
    sync: list[str] = []
    deferred: list[Finding] = []
    unfixable: list[Finding] = []
    by_node = {name: [c for c in checks if c.status in BAD] for name, checks in report.nodes}
    for name, bad in by_node.items():
        if any(fixable_by(c) is FixTool.SETUP for c in bad):
            setup.append(name)
    for name, bad in by_node.items():
        for c in bad:
            tool = fixable_by(c, source_named=source_named)
            finding = Finding(c.id, name, c.status, c.summary)
            if tool is FixTool.SETUP:
                continue
            if name in setup:
                # Probed with a python that setup replaces: its hashes, memory and the like come from that
                # python (or from nothing). Judged again after setup; sync waits for that judgement.
                deferred.append(finding)
            elif tool is FixTool.SYNC:
                if name not in sync:
                    sync.append(name)
            else:
                unfixable.append(finding)
    unfixable += [Finding(f"lint:{lint.id}", "playbook", lint.status, lint.summary)
                  for lint in report.lint if lint.status in BAD]
    return FixPlan(tuple(setup), tuple(sync), tuple(deferred), tuple(unfixable))


@dataclass(frozen=True)
class SyncSource:
    """Where sync copies from: a node of the inventory (`sync --from`), or dirs on the coordinator's machine
    (label -> dir: `sync --source`). `why` says how it was chosen (printed)."""

    why: str
    node: str | None = None
    dirs: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        where = f"node {self.node}" if self.node else ", ".join(f"{lb} {d}" for lb, d in self.dirs) + " on this machine"
        return f"{where} ({self.why})"


def passing_copies(report: PreflightReport) -> list[str]:
    """Nodes whose model check passed or only warned: their copy is the reference preflight accepts (the
    playbook's manifest, else the majority)."""
    return [name for name, checks in report.nodes
            if any(c.id == "model" and c.status in (Status.PASS, Status.WARN) for c in checks)]


def choose_sync_source(report: PreflightReport, targets: Collection[str], *, requested: SyncSource | None,
                       local_dirs: Sequence[tuple[str, str]], local_present: bool) -> SyncSource:
    """The source of `--fix`'s sync, in this order:

    1. `--fix-source` (`requested`), as given;
    2. a node whose copy preflight accepted (its model check passed: it matches the manifest or the majority),
       that is not itself a target: syncing from it makes the targets pass that same check;
    3. the playbook's own dirs on the coordinator's machine (`local_dirs`, when `local_present`: every one of
       them exists here), for a fleet where no node has a copy preflight accepts (e.g. none has the model);
    4. else ConfigError (exit 2), naming what was looked for and the flag that names a source.
    """
    if requested is not None:
        return requested
    good = [n for n in passing_copies(report) if n not in targets]
    if good:
        return SyncSource("its copy passed preflight's model check", node=good[0])
    if local_present:
        return SyncSource("the playbook's paths on this machine", dirs=tuple(local_dirs))
    raise no_source_error(local_dirs)


def no_source_error(local_dirs: Sequence[tuple[str, str]], when: str = "") -> ConfigError:
    paths = ", ".join(d for _, d in local_dirs)
    return ConfigError(f"--fix: no source for sync{when}: no node has a copy that passes the model check, and this "
                       f"machine lacks {paths}; name one with --fix-source NODE or --fix-source DIR (holding "
                       + ", ".join(f"{lb}/" for lb, _ in local_dirs) + ")")


class DirState(StrEnum):
    """A synced dir on a node, as seen before setup (the node's own python may not exist yet)."""

    MISSING = "missing"
    EMPTY = "empty"
    FILES = "files"


def parse_dir_states(answer: Mapping[str, str] | None) -> dict[str, DirState] | None:
    """A node's answer about its dirs (label -> missing | empty | files); None for no answer or another word."""
    try:
        return {lb: DirState(st) for lb, st in answer.items()} if answer is not None else None
    except ValueError:
        return None


def will_have_copy(dirs: Mapping[str, DirState] | None, provided: Collection[str]) -> bool | None:
    """Whether a node will hold a copy of every synced dir once set up: each dir has files, or is missing and the
    playbook's `assets:` fill it (`provided`: their labels; assets never touch an existing dir, an empty one
    included). None when its dirs could not be seen."""
    if dirs is None:
        return None
    return all(st is DirState.FILES or (st is DirState.MISSING and lb in provided) for lb, st in dirs.items())


def check_sync_source_before_setup(report: PreflightReport, plan: FixPlan, *, requested: SyncSource | None,
                                   local_dirs: Sequence[tuple[str, str]], local_present: bool,
                                   node_dirs: Mapping[str, Mapping[str, DirState] | None],
                                   provided: Collection[str]) -> None:
    """Before `setup` changes any node: ConfigError (exit 2, `choose_sync_source`'s message) when sync will be
    needed after it and nothing can be its source, so that a launch refused for want of a source has installed
    nothing.

    Sync will be needed when this round already plans it, or when a node being set up (its model finding
    `deferred`) will lack a dir (`node_dirs`, seen with the system python3: a dir missing that `assets:` do not
    fill, or empty). A source can exist when one was named, the playbook's dirs are on this machine, a node's copy
    passes the model check now, or a node being set up will have every dir (or could not be seen: not refused on
    a guess). Whether that copy then passes is known after setup (`choose_sync_source` decides then)."""
    if requested is not None or local_present:
        return
    deferred = [f.node for f in plan.deferred if f.check == "model"]
    will = {n: will_have_copy(node_dirs.get(n), provided) for n in deferred}
    if not plan.sync and all(w is not False for w in will.values()):
        return
    if any(n not in plan.sync for n in passing_copies(report)) or any(w is not False for w in will.values()):
        return
    raise no_source_error(local_dirs, " (checked before setup changed any node)")


def resolve_requested(spec: str, node_names: Collection[str], labels: Sequence[str],
                      present: Mapping[str, bool], base: str) -> SyncSource:
    """`--fix-source SPEC`: a node name of the inventory, else a local dir holding one subdir per synced dir
    (`sync --source`'s layout; `present`: which of `base/<label>` exist). ConfigError for a dir that lacks one."""
    if spec in node_names:
        return SyncSource("--fix-source", node=spec)
    missing = [lb for lb in labels if not present.get(lb)]
    if missing:
        raise ConfigError(f"--fix-source {spec}: not a node of the inventory, and not a dir holding "
                          + ", ".join(f"{lb}/" for lb in labels) + f" (lacks {', '.join(f'{lb}/' for lb in missing)})")
    return SyncSource("--fix-source", dirs=tuple((lb, f"{base.rstrip('/')}/{lb}") for lb in labels))


def describe_fix_plan(plan: FixPlan) -> str:
    """One line: what each tool will run on, and what --fix leaves alone (or waits to judge)."""
    parts = [f"{tool} on {', '.join(plan.nodes(tool))}" for tool in FixTool if plan.nodes(tool)]
    if plan.deferred:
        parts.append(f"judged again after setup: {', '.join(sorted({f'{f.check} on {f.node}' for f in plan.deferred}))}")
    if plan.unfixable:
        parts.append(f"cannot fix: {', '.join(f'{f.check} on {f.node}' for f in plan.unfixable)}")
    return "; ".join(parts) if parts else "nothing to fix"


def describe_left(plan: FixPlan) -> str:
    """What is still failing after --fix, for the launch's error: the findings it does not fix, those it
    waited to judge on a node setup could not fix, and those its tools failed to fix."""
    left = [f"{f.check} on {f.node}" for f in (*plan.unfixable, *plan.deferred)]
    left += [f"software on {n} (setup did not fix it)" for n in plan.setup]
    left += [f"model on {n} (sync did not fix it)" for n in plan.sync]
    return ", ".join(left)


SyncOutcome = tuple[str, str]  # (ok | changed | failed, detail)


def compute_sync_outcomes(plan: SyncPlan | None, node_errors: Mapping[str, str],
                          verified: Mapping[str, Sequence[str]], names: Sequence[str]) -> dict[str, SyncOutcome]:
    """Each target's outcome in Ansible's words: `ok` (already identical), `changed` (files copied or deleted,
    and verified identical afterwards), `failed` (an error, a plan problem such as disk space, or a difference
    left after the copy)."""
    by_node = {p.node: p for p in plan.nodes} if plan is not None else {}
    out: dict[str, SyncOutcome] = {}
    for name in names:
        p = by_node.get(name)
        if name in node_errors:
            out[name] = ("failed", node_errors[name])
        elif plan is None or p is None:
            out[name] = ("failed", "no manifest from the node")
        elif plan.problems:
            out[name] = ("failed", "nothing copied: " + "; ".join(plan.problems))
        elif verified.get(name):
            out[name] = ("failed", "still differs: " + "; ".join(list(verified[name])[:5]))
        elif p.in_sync:
            out[name] = ("ok", "identical already")
        else:
            out[name] = ("changed", f"copied {len(p.copy)} file(s) ({p.write_bytes / 1e6:.1f} MB), deleted "
                                    f"{len(p.delete)}, verified identical")
    return out
