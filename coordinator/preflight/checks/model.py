"""Check `model`: the playbook's model and data dirs (and DPO's reference model) hold byte-identical files on
every node, and the trainer can load them.

Loadable: the model dir has config.json, *.safetensors weights and tokenizer files; every data file the trainer
reads (train.jsonl required; valid.jsonl for the evals, a warning when absent; test.jsonl, which mlx-lm's loader
reads whenever it exists) parses row by row as valid UTF-8 JSON with the keys the trainer needs (worker/probe.py
`check_data`). Such a problem is the same on every node: launched anyway, every rank would fail the same way
(a job error, docs/faults.md), so preflight fails it first, with file:line.

Each node's files are hashed (SHA256, streamed, cached by path/size/mtime/inode on the node) and compared
with a reference: the manifest given in the playbook, else the majority of nodes. With no majority (two nodes
that disagree) every disagreeing node fails: we cannot tell which copy is right.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from coordinator.config.playbook import Playbook
from coordinator.facts.model import NodeFacts
from coordinator.models import CheckResult, Connection, Node, Status
from coordinator.preflight.checks.context import CheckContext, fact_error_result, majority, manifest_digest, node_manifest
from coordinator.units import format_bytes


def diff_manifests(mine: Mapping[str, str], ref: Mapping[str, str]) -> dict[str, list[str]]:
    return {
        "differ": sorted(p for p in mine.keys() & ref.keys() if mine[p] != ref[p]),
        "missing": sorted(ref.keys() - mine.keys()),
        "extra": sorted(mine.keys() - ref.keys()),
    }


def _describe(diff: dict[str, list[str]], limit: int = 5) -> str:
    parts = []
    for kind, paths in diff.items():
        if paths:
            shown = ", ".join(paths[:limit]) + (f" (+{len(paths) - limit} more)" if len(paths) > limit else "")
            parts.append(f"{kind}: {shown}")
    return "; ".join(parts)


def loadable_problems(pb: Playbook, facts: NodeFacts) -> tuple[list[str], list[str], list[str]]:
    """(failures, warnings, notes): what mlx-lm's load and the trainer's data loading would trip over on this
    node, and what was not proven (a file parsed only up to the probe's byte bound). A missing dir is left to
    the hashes (one message for it, not two)."""
    fails: list[str] = []
    warns: list[str] = []
    notes: list[str] = []
    if facts.model_error and not facts.model_error.startswith("no such directory"):
        fails.append(f"model {pb.model}: {facts.model_error}")
    data = facts.data
    if data is None:
        return fails, warns, notes
    if data.error and not data.error.startswith("no such directory"):
        fails.append(f"data {data.dir}: {data.error}")
    for f in data.files:
        where = f"{(data.dir or '').rstrip('/')}/{f.name}"
        if not f.exists:
            if f.required:
                fails.append(f"{where} is missing (the trainer needs it)")
            elif f.name == "valid.jsonl":
                warns.append(f"{where} is missing: the run will have no eval events")
        elif f.error:
            fails.append(f"{where} {f.error}")
        elif f.checked_bytes < f.bytes:
            notes.append(f"{f.name}: the first {f.rows} rows ({f.checked_bytes / 1e6:.0f} of {f.bytes / 1e6:.0f} MB) "
                         "parsed")
    return fails, warns, notes


def _data_evidence(facts: NodeFacts) -> list[dict[str, object]] | None:
    if facts.data is None:
        return None
    return [{"name": f.name, "exists": f.exists, "rows": f.rows, "format": f.format, "error": f.error,
             "checked_bytes": f.checked_bytes, "bytes": f.bytes} for f in facts.data.files]


def check_model(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    """Identical copies (`_check_copies`), and loadable ones (`loadable_problems`)."""
    result = _check_copies(ctx, node, facts)
    pb = ctx.playbook
    if pb is None or facts.hashes is None or result.status is not Status.PASS:
        return result
    fails, warns, notes = loadable_problems(pb, facts)
    evidence = {**result.evidence, "data_files": _data_evidence(facts), "model_params": facts.model_params}
    if fails:
        return CheckResult("model", node.name, Status.FAIL, "; ".join(fails),
                           "fix the files named (the same on every node: launched, every rank would fail loading "
                           "them); data rows are one JSON object per line, UTF-8, with the keys of the first row",
                           {**evidence, "loadable": fails})
    summary = "; ".join([result.summary, *warns, *notes])
    if warns:
        return CheckResult("model", node.name, Status.WARN, summary, "add valid.jsonl to the data dir for evals",
                           evidence)
    return CheckResult("model", node.name, Status.PASS, summary, result.remedy, evidence)


def _check_copies(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    pb = ctx.playbook
    if pb is None:
        return CheckResult("model", node.name, Status.SKIP, "no playbook: no model or data dir to verify")
    if facts.hashes is None:
        return fact_error_result("model", node.name, facts.errors_for("worker"), "file hashes")
    dirs = dict(pb.hashed_dirs())
    labels = tuple(dirs)
    mine, problems, total = node_manifest(facts, labels)
    evidence: dict[str, object] = {
        "dirs": {label: dh.path for label, dh in zip(labels, facts.hashes, strict=False)},
        "files": len(mine),
        "bytes": total,
        "digest": manifest_digest(mine),
        "cached_files": sum(dh.cached_files for dh in facts.hashes),
        "hashed_bytes": sum(dh.hashed_bytes for dh in facts.hashes),
    }

    def copy_from(good: str, paths: list[str] | None = None) -> str:
        """`coordinator sync` from the good node, and the rsync equivalent for the dirs that hold the bad files
        (both dirs when we cannot tell), addressed as the inventory addresses the nodes (`user@host`): run here when
        one end is this machine (`connection: local`), on the good node when both are remote (rsync does not copy
        between two remote hosts), none when both are this machine (one dir)."""
        labels = sorted({p.split("/", 1)[0] for p in paths}) if paths else list(labels_all)
        # Quoted: the dirs come from the playbook and are pasted into a shell by whoever follows the remedy.
        sync = (f"coordinator sync -i INVENTORY -p {shlex.quote(pb.path or 'PLAYBOOK')} --from {shlex.quote(good)} "
                f"--limit {shlex.quote(node.name)}")
        src, dst = by_name.get(good), node
        local = (src is not None and src.connection == Connection.LOCAL, dst.connection == Connection.LOCAL)
        if src is None or all(local):
            return sync

        def one(path: str) -> str:
            there = shlex.quote(f"{dst.ssh_target}:{path}/")
            if local[0]:
                return f"rsync -a --delete {shlex.quote(path + '/')} {there}"
            if local[1]:
                return f"rsync -a --delete {shlex.quote(f'{src.ssh_target}:{path}/')} {shlex.quote(path + '/')}"
            return f"ssh {shlex.quote(src.ssh_target)} rsync -a --delete {shlex.quote(path + '/')} {there}"

        rsync = "; ".join(one(dirs[lb]) for lb in labels if dirs.get(lb))
        return f"{sync} (or: {rsync})" if rsync else sync

    def get_copy(good: list[str]) -> str:
        """From a node with a good copy when there is one; when no node has one (the model simply absent), from a
        dir on this machine (`launch --fix --fix-source DIR`) or by getting the model first: `sync --from` a node
        that lacks it too cannot work."""
        if good:
            return copy_from(good[0])
        holding = " and ".join(f"{lb}/" for lb in labels_all)
        return (f"no node has a complete copy: put it in a dir on this machine (holding {holding}) and run "
                f"`coordinator launch -i INVENTORY {shlex.quote(pb.path or 'PLAYBOOK')} --fix --fix-source DIR`, or "
                f"get the model onto one node first ({', '.join(f'{lb} at {dirs[lb]}' for lb in labels_all)}), e.g. "
                f"`huggingface-cli download MODEL_ID --local-dir {shlex.quote(dirs.get('model', 'DIR'))}` there, then "
                f"`coordinator sync -i INVENTORY -p {shlex.quote(pb.path or 'PLAYBOOK')} --from THAT_NODE`")

    by_name = {n.name: n for n in ctx.nodes}
    labels_all = labels
    manifests_all, digests_all = ctx.fleet_manifests
    if problems:
        # A complete copy elsewhere: the majority's when there is one, else any.
        ref, _ = majority(digests_all)
        good = sorted((n for n in digests_all if n != node.name), key=lambda n: (digests_all[n] != ref, n))
        if ctx.manifest is not None:
            good = [n for n in good if not any(diff_manifests(manifests_all[n], ctx.manifest).values())]
        return CheckResult("model", node.name, Status.FAIL, "; ".join(problems), get_copy(good), evidence)
    if ctx.manifest is not None:
        diff = diff_manifests(mine, ctx.manifest)
        if any(diff.values()):
            evidence["diff"] = diff
            good = sorted(n for n, m in manifests_all.items()
                          if n != node.name and not any(diff_manifests(m, ctx.manifest).values()))
            return CheckResult("model", node.name, Status.FAIL, f"differs from the reference manifest: {_describe(diff)}",
                               get_copy(good), evidence)
        return CheckResult("model", node.name, Status.PASS,
                           f"{len(mine)} files ({format_bytes(total)}) match the reference manifest", evidence=evidence)
    manifests, digests = ctx.fleet_manifests
    ref_digest, odd = majority(digests)
    if node.name not in odd:
        agree = sum(1 for d in digests.values() if d == digests.get(node.name))
        return CheckResult("model", node.name, Status.PASS,
                           f"{len(mine)} files ({format_bytes(total)}) identical on {agree}/{len(digests)} nodes",
                           evidence=evidence)
    if ref_digest is not None:
        ref_node = next(n for n, d in digests.items() if d == ref_digest)
        diff = diff_manifests(mine, manifests[ref_node])
        evidence["diff"] = diff
        majority_nodes = [n for n, d in digests.items() if d == ref_digest]
        evidence["majority"] = majority_nodes
        bad = diff["differ"] + diff["missing"] + diff["extra"]
        return CheckResult("model", node.name, Status.FAIL,
                           f"differs from the majority ({', '.join(majority_nodes)}): {_describe(diff)}",
                           "copy the good files: " + copy_from(ref_node, bad), evidence)
    others = {n: diff_manifests(mine, m) for n, m in manifests.items() if n != node.name and digests[n] != digests[node.name]}
    evidence["diff"] = others
    detail = "; ".join(f"vs {n}: {_describe(d)}" for n, d in sorted(others.items()))
    return CheckResult("model", node.name, Status.FAIL,
                       f"nodes disagree with no majority, cannot tell which copy is right ({detail})",
                       "give a reference manifest (`manifest:` in the playbook, `sha256sum` format) or fix the copies",
                       evidence)
