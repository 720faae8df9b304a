"""A pipeline checkpoint as a whole: its stage shards, when it counts, and how a new split is cut from it.

Every stage writes its shard (`<run_dir>/checkpoints/stage-<rank>/step-NNNNNN/`, the `worker.checkpoint` layout):
its trainable parameters and optimizer state under the MODEL's layer numbers. Its state.json carries, besides the
step and the data position, the manifest of the whole checkpoint (`build_manifest`): which stage holds which
layers and the digest (`worker.chaos.arrays_sha256`) of each stage's weights and optimizer state, identical in
every shard of that step. So any one shard says what the complete checkpoint is made of.

A step's checkpoint counts (`evaluate_steps`) only when, for every stage its manifest lists, a shard verifies
(`worker.checkpoint.verify_checkpoint`: every file against its manifest.sha256) and carries the same manifest;
restore then checks each shard it reads against the manifest's digest. Shards are found wherever they are: under
any `stage-*` dir of the run's checkpoints (a resume onto another split finds the old split's shards there, once
the coordinator has gathered them to the node).

Resume onto a different split re-cuts by layer (`plan_recut`): a rank takes each parameter of its new range from
the shard whose range holds that layer, the embeddings from the old first stage, the final norm and lm_head from
the old last one; it refuses, naming the layers, when no valid shard holds one.

Pure but for `scan_shards`/`read_shard_names`, which read the disk, and `python -m
worker.parallel.pipeline.shards scan ROOT`, the coordinator's view (`coordinator.run.resume`)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.checkpoint import OPTIMIZER, STATE, WEIGHTS, check_checkpoint, list_checkpoints
from worker.errors import ResumeRefused
from worker.parallel.pipeline.layout import layer_of, read_header

MANIFEST_KEY = "pipeline_checkpoint"  # the whole checkpoint's manifest, in each shard's state.json
STAGE_DIR_PREFIX = "stage-"


def shard_dir(checkpoints: Path, rank: int) -> Path:
    """The directory of rank `rank`'s own shards under a run's checkpoints dir: every strategy whose ranks each write
    their own shard (pipeline stages, fsdp ranks) keeps them there, in this module's format."""
    return checkpoints / f"{STAGE_DIR_PREFIX}{rank}"


@dataclass(frozen=True)
class StageEntry:
    """One stage of a checkpoint's manifest: it holds blocks [first, last) and these digests."""

    index: int
    first: int
    last: int
    weights_sha256: str
    optimizer_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "first_layer": self.first, "last_layer": self.last,
                "weights_sha256": self.weights_sha256, "optimizer_sha256": self.optimizer_sha256}


@dataclass(frozen=True)
class Manifest:
    """The whole checkpoint of one step: every stage, in order, and where the data stood."""

    step: int
    data_position: int
    model_layers: int
    stages: tuple[StageEntry, ...]

    def to_json(self) -> dict[str, Any]:
        """What state.json stores under MANIFEST_KEY (its step and data position are state.json's own)."""
        return {"model_layers": self.model_layers, "stages": [s.to_json() for s in self.stages]}


@dataclass(frozen=True)
class Shard:
    """One stage shard dir as found: its stage (index in the manifest), and whether it verified."""

    path: Path
    step: int
    index: int
    manifest: Manifest | None  # None when the shard is invalid or carries no manifest
    valid: bool
    reason: str = ""

    @property
    def entry(self) -> StageEntry:
        assert self.manifest is not None
        return self.manifest.stages[self.index]


@dataclass(frozen=True)
class StepVerdict:
    """A step's checkpoint: complete (one valid shard per stage of its manifest, `shards[i]` is stage i's) or not,
    with why."""

    step: int
    manifest: Manifest | None
    shards: tuple[Shard, ...]
    missing: str = ""

    @property
    def complete(self) -> bool:
        return not self.missing


def whole_sha256(path: Path) -> str:
    """The digest of the whole checkpoint a shard dir belongs to: its state.json's step, data position and manifest
    (every stage's layers and digests), canonical JSON. The same in every shard of one checkpoint, so it is what a
    rank's `checkpoint` event reports for ranks to be compared by (each shard's own files, hence its
    manifest.sha256, differ from rank to rank)."""
    state = json.loads((path / STATE).read_text())
    doc = {"step": state.get("step"), "data_position": state.get("data_position"),
           MANIFEST_KEY: state.get(MANIFEST_KEY)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(step: int, data_position: int, model_layers: int,
                   stages: Sequence[tuple[int, int, str, str]]) -> Manifest:
    """The manifest from each stage's (first, last, weights digest, optimizer digest), in stage order. Raises
    ValueError unless the ranges tile [0, model_layers) in order."""
    at = 0
    for i, (first, last, _, _) in enumerate(stages):
        if first != at or last < first:
            raise ValueError(f"stage {i} holds layers [{first}, {last}), expected to start at {at}")
        at = last
    if at != model_layers:
        raise ValueError(f"the stages end at layer {at}, the model has {model_layers}")
    return Manifest(step, data_position, model_layers,
                    tuple(StageEntry(i, f, last, w, o) for i, (f, last, w, o) in enumerate(stages)))


def parse_manifest(doc: Any, step: int, data_position: int) -> Manifest:
    """Inverse of `Manifest.to_json` (with state.json's step and data position); ValueError on anything malformed
    (ranges not tiling the model included)."""
    try:
        stages = [(int(s["first_layer"]), int(s["last_layer"]), str(s["weights_sha256"]),
                   str(s["optimizer_sha256"])) for s in doc["stages"]]
        if [int(s["index"]) for s in doc["stages"]] != list(range(len(stages))):
            raise ValueError("stage indices are not 0..n-1 in order")
        return build_manifest(step, data_position, int(doc["model_layers"]), stages)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed pipeline checkpoint manifest: {exc!r}") from None


def parse_shard(path: Path, step: int, state: Mapping[str, Any] | None, valid: bool, reason: str = "") -> Shard:
    """A shard from its verdict and state.json (None when unreadable). A valid shard without a readable manifest,
    or whose manifest disagrees with its own stage, is invalid (shards of one step with different data positions
carry different manifests, so no complete checkpoint can mix them)."""
    stage = (state or {}).get("stage") or {}
    index = int(stage.get("index", -1)) if isinstance(stage, dict) else -1
    if not valid or state is None:
        return Shard(path, step, index, None, False, reason or "unreadable state.json")
    if state.get("step") != step:
        return Shard(path, step, index, None, False, f"state.json is of step {state.get('step')}")
    try:
        manifest = parse_manifest(state.get(MANIFEST_KEY), step, int(state.get("data_position", -1)))
    except (ValueError, TypeError) as exc:
        return Shard(path, step, index, None, False, f"no whole-checkpoint manifest: {exc}")
    if not 0 <= index < len(manifest.stages):
        return Shard(path, step, index, None, False, f"stage {index} is not in its manifest")
    entry = manifest.stages[index]
    if (stage.get("first_layer"), stage.get("last_layer")) != (entry.first, entry.last):
        return Shard(path, step, index, None, False,
                     f"holds layers [{stage.get('first_layer')}, {stage.get('last_layer')}), its manifest says "
                     f"[{entry.first}, {entry.last})")
    return Shard(path, step, index, manifest, True)


def evaluate_steps(shards: Iterable[Shard]) -> list[StepVerdict]:
    """Every step any shard is of, newest first: complete when one manifest is carried by a valid shard of each
    of its stages (several manifests for one step, e.g. from two attempts on different splits: the first one that
    is complete counts); else incomplete, naming the stages (and their layers) without a valid shard."""
    by_step: dict[int, list[Shard]] = {}
    for shard in shards:
        by_step.setdefault(shard.step, []).append(shard)
    out: list[StepVerdict] = []
    for step in sorted(by_step, reverse=True):
        found = by_step[step]
        valid = [s for s in found if s.valid and s.manifest is not None]
        manifests = sorted({s.manifest for s in valid if s.manifest is not None}, key=lambda m: len(m.stages))
        verdict: StepVerdict | None = None
        for manifest in manifests:
            chosen = [next((s for s in valid if s.manifest == manifest and s.index == e.index), None)
                      for e in manifest.stages]
            absent = [e for e, s in zip(manifest.stages, chosen, strict=True) if s is None]
            if not absent:
                verdict = StepVerdict(step, manifest, tuple(s for s in chosen if s is not None))
                break
            if verdict is None:
                invalid = "; ".join(f"{s.path}: {s.reason}" for s in found if not s.valid)
                verdict = StepVerdict(step, manifest, (), "no valid shard of " + ", ".join(
                    f"stage {e.index} (layers [{e.first}, {e.last}))" for e in absent)
                    + (f" (invalid: {invalid})" if invalid else ""))
        if verdict is None:
            verdict = StepVerdict(step, None, (), "no valid shard: " + "; ".join(
                f"{s.path}: {s.reason}" for s in found))
        out.append(verdict)
    return out


def plan_recut(want: Iterable[str], *, is_first: bool, is_last: bool,
               sources: Sequence[tuple[StageEntry, frozenset[str]]], stages: int, what: str) -> dict[str, int]:
    """Which source shard each wanted name is read from (name -> index into `sources`, each a stage's manifest
    entry and the names its file holds): a block's parameter from the shard whose layer range holds the block;
    anything else from a shard of the same role (the old first stage for the embeddings of a new first stage,
    the old last for the norm and head of a new last), else from any shard that has it (the optimizer's step
    and learning rate). Raises ResumeRefused naming the layers (and other names) no source holds."""
    plan: dict[str, int] = {}
    missing: dict[int | None, list[str]] = {}
    for name in sorted(want):
        layer = layer_of(name)
        if layer is not None:
            options = [i for i, (e, names) in enumerate(sources) if e.first <= layer < e.last and name in names]
        else:
            having = [i for i, (_, names) in enumerate(sources) if name in names]
            same_role = [i for i in having if (is_first and sources[i][0].index == 0)
                         or (is_last and sources[i][0].index == stages - 1)]
            options = same_role or having
        if options:
            plan[name] = options[0]
        else:
            missing.setdefault(layer, []).append(name)
    if missing:
        layers = sorted(k for k in missing if k is not None)
        others = missing.get(None, [])
        parts = ([f"layers {layers}"] if layers else []) + ([f"{others[:5]}"] if others else [])
        held = ", ".join(f"stage {e.index}: [{e.first}, {e.last})" for e, _ in sources) or "none"
        example = next(iter(missing.values()))[0]
        raise ResumeRefused(f"{what}: no valid shard holds {' and '.join(parts)} (e.g. {example}); the shards "
                            f"found hold {held}")
    return plan


# --- the disk ----------------------------------------------------------------------------------------------------


def stage_dirs(checkpoints: Path) -> list[Path]:
    """The `stage-*` dirs under a run's checkpoints dir (every split's), sorted."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith(STAGE_DIR_PREFIX))


def scan_shards(checkpoints: Path, max_step: int | None = None) -> list[Shard]:
    """Every shard under every `stage-*` dir of `checkpoints`, each verified against its manifest.sha256."""
    out = []
    for root in stage_dirs(checkpoints):
        for step, path in list_checkpoints(root):
            if max_step is not None and step > max_step:
                continue
            verdict = check_checkpoint(step, path)
            state: Any = None
            if verdict.valid:
                try:
                    state = json.loads((path / STATE).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    state = None
            out.append(parse_shard(path, step, state if isinstance(state, dict) else None, verdict.valid,
                                   verdict.reason))
    return out


def compute_shard_prune(shards: Sequence[tuple[int, Path]], keep: int, newest: int) -> list[Path]:
    """Which of `shards` (step, dir) pruning deletes once the checkpoint of step `newest` is complete (every stage
    wrote its shard: the ranks passed the barrier after writing it): the run's own rule
    (`worker.checkpoint.compute_prune`) over the STEPS, so that a checkpoint is kept or dropped whole: `newest` and
    the `keep` - 1 newest older steps are kept with every shard of theirs, older steps' shards go. Nothing of
    `newest` or newer is ever deleted (a newer dir is not this timeline's)."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    older = sorted({s for s, _ in shards if s < newest}, reverse=True)
    kept = set(older[:keep - 1])
    return [p for s, p in shards if s < newest and s not in kept]


def prune_other_shards(checkpoints: Path, own: Path, keep: int, newest: int) -> list[Path]:
    """Delete the shards under `checkpoints`' `stage-*` dirs other than this stage's own (`own`, pruned as it is
    written: `worker.checkpoint.write_checkpoint`) that `compute_shard_prune` names: the copies a resume brought
    here (`stage-<i>-from-<node>`) and the shards of an earlier split's stage, once the run's retention rule
    proves them superfluous. Does nothing unless this stage's own shard of `newest` is there (nothing proves the
    newer checkpoint then). An emptied copy dir is removed. Returns what was deleted."""
    if not any(s == newest for s, _ in list_checkpoints(own)):
        return []
    others = [d for d in stage_dirs(checkpoints) if d.resolve() != own.resolve()]
    shards = [(s, p) for d in [own, *others] for s, p in list_checkpoints(d)]
    doomed = [p for p in compute_shard_prune(shards, keep, newest) if p.parent != own]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)  # a second rank on this node may have removed it first
    for d in others:
        with contextlib.suppress(OSError):  # not empty (it holds a kept shard, or an invalid one set aside)
            d.rmdir()
    return doomed


def read_shard_names(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(weight names, optimizer-state names) of a shard, from its safetensors headers alone."""
    return frozenset(read_header(path / WEIGHTS)), frozenset(read_header(path / OPTIMIZER))


def manifest_id(manifest: Manifest) -> str:
    """A short name for one whole checkpoint (its manifest and data position): shards with equal ids belong
    together."""
    doc = json.dumps({**manifest.to_json(), "data_position": manifest.data_position}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def shard_json(shard: Shard) -> dict[str, Any]:
    """One shard as `scan` prints it (what `coordinator.run.resume` decides from)."""
    return {"step": shard.step, "index": shard.index, "path": str(shard.path), "dir": shard.path.parent.name,
            "valid": shard.valid, "reason": shard.reason,
            "stages": len(shard.manifest.stages) if shard.manifest else None,
            "first_layer": shard.entry.first if shard.manifest else None,
            "last_layer": shard.entry.last if shard.manifest else None,
            "manifest_id": manifest_id(shard.manifest) if shard.manifest else None}


def main(argv: list[str] | None = None) -> int:
    """`scan ROOT`: {"root", "shards": [shard_json...]} of every shard under ROOT's `stage-*` dirs (verified;
    nothing changes). One JSON object on stdout."""
    parser = argparse.ArgumentParser(prog="worker.parallel.pipeline.shards", description="list stage shards")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("scan").add_argument("root")
    args = parser.parse_args(argv)
    root = Path(os.path.expanduser(args.root))
    print(json.dumps({"root": str(root), "shards": [shard_json(s) for s in scan_shards(root)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
