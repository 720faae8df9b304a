"""Check `model`: the playbook's model and data dirs (and DPO's reference model) hold byte-identical files on
every node.

Each node's files are hashed (SHA256, streamed, cached by path/size/mtime/inode on the node) and compared
with a reference: the manifest given in the playbook, else the majority of nodes. With no majority (two nodes
that disagree) every disagreeing node fails: we cannot tell which copy is right.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from coordinator.checks.context import CheckContext, fact_error_result, majority, manifest_digest, node_manifest
from coordinator.facts.model import NodeFacts
from coordinator.models import CheckResult, Node, Status


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


def check_model(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
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
        """rsync commands for the dirs that hold the bad files (both dirs when we cannot tell)."""
        labels = sorted({p.split("/", 1)[0] for p in paths}) if paths else list(labels_all)
        # Quoted: the dirs come from the playbook and are pasted into a shell by whoever follows the remedy.
        return "; ".join(f"rsync -a --delete {shlex.quote(f'{good}:{dirs[lb]}/')} {shlex.quote(f'{node.name}:{dirs[lb]}/')}"
                         for lb in labels if dirs.get(lb))

    labels_all = labels
    copy = copy_from("GOOD_NODE")
    if problems:
        return CheckResult("model", node.name, Status.FAIL, "; ".join(problems), copy, evidence)
    if ctx.manifest is not None:
        diff = diff_manifests(mine, ctx.manifest)
        if any(diff.values()):
            evidence["diff"] = diff
            return CheckResult("model", node.name, Status.FAIL, f"differs from the reference manifest: {_describe(diff)}",
                               copy, evidence)
        return CheckResult("model", node.name, Status.PASS,
                           f"{len(mine)} files ({total / 1e9:.2f} GB) match the reference manifest", evidence=evidence)
    manifests, digests = ctx.fleet_manifests
    ref_digest, odd = majority(digests)
    if node.name not in odd:
        agree = sum(1 for d in digests.values() if d == digests.get(node.name))
        return CheckResult("model", node.name, Status.PASS,
                           f"{len(mine)} files ({total / 1e9:.2f} GB) identical on {agree}/{len(digests)} nodes",
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
