"""`coordinator sync`'s pure core: parse each node's manifest answer, decide what to copy, delete and resume
where, check free disk space, and order the relay chain. No I/O here (coordinator/fleet/syncrun.py runs
`worker/relay.py` on the nodes and hands the answers to these functions).

Manifests are keyed `<label>/<path>` (label: model, data, reference; as preflight's model check keys them) with
(size, sha256). A target file is copied when it is missing or its SHA256 differs (size alone is never trusted).
Extra files policy: a file under a synced dir that the source does not have is DELETED (as `rsync --delete`), as
is a leftover `<file>.partial` that is of no use to this sync; preflight's model check fails on extras, so
keeping them would leave the fleet failing. `--check` lists them first.

Resume: a leftover `<file>.partial` whose recorded sha256 is the source file's keeps its bytes. One stream per
file goes down the chain, so it starts at the SMALLEST kept offset among the nodes that need the file (each
node truncates its partial to that offset); after a killed sync every node of the chain holds about the same
prefix, so a re-run sends about what was missing.

Doubtful deletions: deleting is only as safe as the source is right. An unmounted disk or a typo'd source
dir looks like an empty (or nearly empty) source, and mirroring it would wipe every target. So for each node
and synced dir the plan measures what it would delete against what the node holds there; the deletion is
DOUBTFUL when the source's dir is empty, or it would remove more than half (DOUBT_FRACTION) of the node's files
there, or more than half of its bytes. A plan with a doubtful deletion is refused unless the user confirms
(`--delete-extras`, or yes at a terminal prompt): `describe_refusal` says what would go. Leftover partials
(our own temporary files) never count.

Disk: each node needs, per filesystem, the bytes it will write (size minus the kept prefix) plus 5% headroom;
a node short of it fails the whole sync before the first byte is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HEADROOM = 0.05
DOUBT_FRACTION = 0.5  # deleting more than this share of a node's files (or bytes) in a dir needs a confirmation


class ParseError(ValueError):
    """A relay answer that is not what worker/relay.py prints."""


@dataclass(frozen=True)
class NodeState:
    """What `worker.relay plan` found on one node."""

    node: str
    manifest: dict[str, tuple[int, str]]  # "<label>/<path>" -> (size, sha256)
    partials: dict[str, tuple[int, str]]  # "<label>/<path>" -> (bytes kept, sha256 they are a prefix of)
    free: dict[str, int]  # label -> free bytes on the dir's filesystem
    dev: dict[str, int]  # label -> st_dev of that filesystem (two labels on one disk share their space)
    missing: tuple[str, ...] = ()  # labels whose dir does not exist
    errors: tuple[str, ...] = ()


def parse_node_state(node: str, text: str) -> NodeState:
    """The last JSON line of a `plan` answer. Raises ParseError."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ParseError(f"{node}: relay plan printed nothing")
    try:
        doc = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise ParseError(f"{node}: relay plan answer is not JSON: {exc}: {lines[-1][:200]}") from exc
    if not isinstance(doc, dict) or "error" in doc:
        raise ParseError(f"{node}: relay plan: {doc.get('error') if isinstance(doc, dict) else doc!r}")
    try:
        return NodeState(
            node=node,
            manifest={str(k): (int(v[0]), str(v[1])) for k, v in doc["manifest"].items()},
            partials={str(k): (int(v[0]), str(v[1])) for k, v in doc["partials"].items()},
            free={str(k): int(v) for k, v in doc["free"].items()},
            dev={str(k): int(v) for k, v in doc["dev"].items()},
            missing=tuple(str(x) for x in doc.get("missing", [])),
            errors=tuple(str(x) for x in doc.get("errors", [])),
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ParseError(f"{node}: relay plan answer lacks {exc}") from exc


@dataclass(frozen=True)
class FileSend:
    """One file of the stream: the bytes [start, size) go down the chain."""

    path: str
    size: int
    sha256: str
    start: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "start": self.start}


@dataclass(frozen=True)
class NodePlan:
    node: str
    copy: tuple[str, ...]  # files this node receives
    kept: dict[str, int]  # file -> bytes of its partial this sync keeps (after the chain's minimum)
    delete: tuple[str, ...]  # extras, and `<file>.partial` leftovers of no use
    write_bytes: int  # bytes this node will write
    disk_problem: str | None = None
    delete_bytes: int = 0  # bytes those deletions free (extras and partials)

    @property
    def in_sync(self) -> bool:
        return not self.copy and not self.delete

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "copy": list(self.copy), "files": len(self.copy), "bytes": self.write_bytes,
                "resumed_bytes": sum(self.kept.values()), "delete": list(self.delete),
                "delete_files": len(self.delete), "delete_bytes": self.delete_bytes, "disk_problem": self.disk_problem}


@dataclass(frozen=True)
class DoubtfulDeletion:
    """Deleting `files` files (`bytes`) of the `held_files` (`held_bytes`) a node holds in one synced dir, when the
    source's copy of that dir holds `source_files`: too much to take on the source's word alone."""

    node: str
    label: str
    files: int
    bytes: int
    held_files: int
    held_bytes: int
    source_files: int

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "dir": self.label, "files": self.files, "bytes": self.bytes,
                "held_files": self.held_files, "held_bytes": self.held_bytes, "source_files": self.source_files}


@dataclass(frozen=True)
class SyncPlan:
    source: str
    manifest: dict[str, tuple[int, str]]
    nodes: tuple[NodePlan, ...]
    files: tuple[FileSend, ...]  # the stream, in order
    chain: tuple[str, ...]  # receiving nodes, in relay order
    problems: tuple[str, ...] = field(default=())
    doubtful: tuple[DoubtfulDeletion, ...] = field(default=())  # deletions that need the user's confirmation

    @property
    def stream_bytes(self) -> int:
        return sum(f.size - f.start for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "files": len(self.manifest),
                "bytes": sum(s for s, _ in self.manifest.values()), "stream_bytes": self.stream_bytes,
                "chain": list(self.chain), "nodes": [n.to_json() for n in self.nodes], "problems": list(self.problems),
                "doubtful": [d.to_json() for d in self.doubtful]}


def diff_state(source: Mapping[str, tuple[int, str]], target: NodeState) -> tuple[list[str], list[str]]:
    """(files to copy, files to delete) for one node: copy what is missing or differs by sha256 (or size)."""
    copy = sorted(p for p, v in source.items() if target.manifest.get(p) != v)
    extra = sorted(p for p in target.manifest if p not in source)
    return copy, extra


def compute_plan(source: str, manifest: Mapping[str, tuple[int, str]], targets: Sequence[NodeState]) -> SyncPlan:
    """What to send and where. `targets` in inventory order (the chain's order). A missing dir is simply
    "every file of it to copy"."""
    copies: dict[str, list[str]] = {}
    extras: dict[str, list[str]] = {}
    for t in targets:
        copies[t.node], extras[t.node] = diff_state(manifest, t)
    # The stream: every file some node needs, in path order, starting at the smallest prefix a needing node kept.
    wanted = sorted({p for c in copies.values() for p in c})
    files: list[FileSend] = []
    for path in wanted:
        size, sha = manifest[path]
        prefixes = []
        for t in targets:
            if path in copies[t.node]:
                part = t.partials.get(path)
                prefixes.append(part[0] if part is not None and part[1] == sha and part[0] <= size else 0)
        files.append(FileSend(path, size, sha, min(prefixes)))
    starts = {f.path: f.start for f in files}
    plans: list[NodePlan] = []
    problems: list[str] = []
    for t in targets:
        copy = copies[t.node]
        useful = {p for p in copy if t.partials.get(p, (0, ""))[1] == manifest[p][1]}
        stale_partials = sorted(f"{p}.partial" for p in t.partials if p not in useful)
        kept = {p: starts[p] for p in copy if p in useful and starts[p] > 0}
        write = sum(manifest[p][0] - kept.get(p, 0) for p in copy)
        need_by_dev: dict[int, int] = {}
        free_by_dev: dict[int, int] = {}
        for p in copy:
            label = p.split("/", 1)[0]
            dev = t.dev.get(label, -1)
            need_by_dev[dev] = need_by_dev.get(dev, 0) + manifest[p][0] - kept.get(p, 0)
            free_by_dev[dev] = t.free.get(label, 0)
        short = [(need, free_by_dev[dev]) for dev, need in need_by_dev.items()
                 if need * (1 + HEADROOM) > free_by_dev[dev]]
        problem = None
        if short:
            need, free = short[0]
            problem = (f"{t.node}: not enough free disk space: needs {_gb(need)} + 5% headroom, "
                       f"has {_gb(free)} free in {', '.join(sorted(set(p.split('/', 1)[0] for p in copy)))}")
            problems.append(problem)
        delete_bytes = (sum(t.manifest[p][0] for p in extras[t.node])
                        + sum(t.partials[p[: -len(".partial")]][0] for p in stale_partials))
        plans.append(NodePlan(t.node, tuple(copy), kept, tuple(extras[t.node] + stale_partials), write, problem,
                              delete_bytes))
    chain = tuple(p.node for p in plans if p.copy)
    doubtful = tuple(d for t in targets for d in evaluate_deletions(manifest, t, extras[t.node]))
    return SyncPlan(source, dict(manifest), tuple(plans), tuple(files), chain, tuple(problems), doubtful)


def _label(path: str) -> str:
    return path.split("/", 1)[0]


def evaluate_deletions(manifest: Mapping[str, tuple[int, str]], target: NodeState,
                       extras: Sequence[str]) -> list[DoubtfulDeletion]:
    """The doubtful deletions of `extras` (files of `target` the source lacks), per synced dir: the source's dir
    is empty, or they are more than DOUBT_FRACTION of the node's files or bytes there (module docstring)."""
    out: list[DoubtfulDeletion] = []
    for label in sorted({_label(p) for p in extras}):
        gone = [target.manifest[p][0] for p in extras if _label(p) == label]
        held = [size for p, (size, _) in target.manifest.items() if _label(p) == label]
        source_files = sum(1 for p in manifest if _label(p) == label)
        if (source_files == 0 or len(gone) > DOUBT_FRACTION * len(held)
                or sum(gone) > DOUBT_FRACTION * sum(held)):
            out.append(DoubtfulDeletion(target.node, label, len(gone), sum(gone), len(held), sum(held),
                                        source_files))
    return out


def describe_refusal(plan: SyncPlan, source_dirs: Mapping[str, str], *, question: bool = False) -> str:
    """One line: why the plan's deletions are refused, naming the source node and dir and what would go (with
    `question`: the same facts, asked as a yes/no question for a terminal prompt)."""
    by_label: dict[str, list[DoubtfulDeletion]] = {}
    for d in plan.doubtful:
        by_label.setdefault(d.label, []).append(d)
    parts = []
    for label, ds in by_label.items():
        where = f"{plan.source}:{source_dirs.get(label, label)}"
        why = ("is empty" if ds[0].source_files == 0
               else f"holds only {ds[0].source_files} file{'s' if ds[0].source_files != 1 else ''}")
        lost = ", ".join(f"{d.files} of {d.held_files} files ({_gb(d.bytes)}) on {d.node}" for d in ds)
        parts.append(f"source {where} {why}; syncing would delete {lost}")
    if question:
        return "; ".join(parts) + ". Delete them?"
    return ("refusing to delete on doubtful evidence: " + "; ".join(parts)
            + " (an unmounted disk or a wrong --from?); check the source, or pass --delete-extras to delete them")


def verify(manifest: Mapping[str, tuple[int, str]], state: NodeState) -> list[str]:
    """What still differs on a node after the sync (empty: identical)."""
    copy, extra = diff_state(manifest, state)
    return [f"differs or missing: {p}" for p in copy] + [f"extra: {p}" for p in extra]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB" if n >= 10**5 else f"{n} bytes"
