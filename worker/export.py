"""Export a run's newest complete checkpoint as what `mlx_lm.load` takes.

    python -m worker.export --checkpoints <run_dir>/checkpoints [--checkpoints DIR...] [--model BASE] --out DIR

* A pipeline run (`stage-*/step-N/` shards): the newest step whose checkpoint is complete
  (`worker.parallel.pipeline.shards.evaluate_steps`), every shard checked against the digest its manifest records,
  the stages' arrays merged by their global (model) names. A data-parallel run (`step-N/`): its newest valid
  checkpoint (the full copy).
* `lora`/`dora`: DIR is an adapter directory as mlx-lm writes one: `adapters.safetensors` + `adapter_config.json`
  (`mlx_lm.load(BASE_MODEL_DIR, adapter_path=DIR)`).
* `full`: DIR is a model directory: the base model's config and tokenizer files, and `model.safetensors` holding
  the base weights with every trained one replaced (`mlx_lm.load(DIR)`).

With tied embeddings a full pipeline fine-tune trains two copies of the embeddings (the first stage's input
embedding and the last stage's head); the export keeps the first stage's, the one the model's input uses.

Writes into `DIR.tmp-<pid>` and renames it to DIR at the end: DIR is never left half-written, and an existing DIR
is refused rather than overwritten. Prints one JSON object ({"out", "kind", "step", "method", "files"}; kind:
`sharded`, a pipeline's or fsdp's checkpoint assembled from its shards, or `whole`, a dp run's); errors on stderr,
exit 1."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker.chaos import arrays_sha256
from worker.checkpoint import ADAPTER_CONFIG, WEIGHTS, find_valid_checkpoint, read_json
from worker.parallel.base import load_arrays
from worker.parallel.pipeline.layout import layer_of
from worker.parallel.pipeline.shards import evaluate_steps, scan_shards, stage_dirs

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


class ExportError(Exception):
    """Nothing complete to export, or the output cannot be written."""


def gather_trained(roots: Sequence[Path]) -> tuple[int, str, dict[str, mx.array], dict[str, Any]]:
    """(step, checkpoint kind (`sharded` or `whole`), trained arrays under the model's names, adapter_config) of
    the newest complete checkpoint under the checkpoints dirs `roots` (a pipeline's or fsdp's shards may be spread
    over several: the run's own and those gathered from other nodes; a dp run's is the first)."""
    checkpoints = roots[0]
    if any(stage_dirs(r) for r in roots):
        steps = evaluate_steps([s for r in roots for s in scan_shards(r)])
        verdict = next((v for v in steps if v.complete), None)
        if verdict is None or verdict.manifest is None:
            why = "; ".join(f"step {v.step}: {v.missing}" for v in steps) or "no shards"
            raise ExportError(f"{', '.join(map(str, roots))}: no complete sharded checkpoint ({why})")
        merged: dict[str, mx.array] = {}
        for shard in verdict.shards:
            arrays = load_arrays(shard.path / WEIGHTS)
            if arrays_sha256(arrays) != shard.entry.weights_sha256:
                raise ExportError(f"{shard.path}: weights differ from the digest in the checkpoint's manifest")
            for name, arr in arrays.items():
                layer = layer_of(name)
                if layer is None and name in merged:
                    continue  # a tied head's copy on a later stage: the first stage's embeddings win
                if layer is not None and not shard.entry.first <= layer < shard.entry.last:
                    raise ExportError(f"{shard.path}: holds {name}, outside its layers")
                merged[name] = arr
        config = read_json(verdict.shards[0].path / ADAPTER_CONFIG)
        return verdict.step, "sharded", merged, config
    found = find_valid_checkpoint(checkpoints)
    if found is None:
        raise ExportError(f"{checkpoints}: no valid checkpoint")
    return found.step, "whole", load_arrays(found.path / WEIGHTS), read_json(found.path / ADAPTER_CONFIG)


def build_export(roots: Sequence[Path], model: Path | None, out: Path) -> dict[str, Any]:
    """Write the export into `out` (see the module docstring); `model` None: the base model the run trained from
    (its adapter_config.json's `model`)."""
    if out.exists():
        raise ExportError(f"{out} exists: choose a new --out (an export is never written over another)")
    step, kind, trained, config = gather_trained(roots)
    if model is None:
        model = Path(str(config.get("model", "")))
    if not (model / "config.json").is_file():
        raise ExportError(f"base model {model} has no config.json (pass --model)")
    method = str(config.get("fine_tune_type", ""))
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if method == "full":
            base: dict[str, mx.array] = {}
            for path in sorted(model.glob("model*.safetensors")):
                base.update(load_arrays(path))
            if unknown := sorted(set(trained) - set(base)):
                raise ExportError(f"trained weights not in the base model {model}: {unknown[:5]}")
            base.update(trained)
            mx.save_safetensors(str(tmp / "model.safetensors"), base, metadata={"format": "mlx"})
            for name in MODEL_FILES:
                if (model / name).is_file():
                    shutil.copy2(model / name, tmp / name)
        else:
            mx.save_safetensors(str(tmp / "adapters.safetensors"), trained, metadata={"format": "mlx"})
            config = {**config, "model": str(model)}
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "kind": kind, "step": step, "method": method,
            "files": sorted(p.name for p in out.iterdir())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker.export", description="export a run's newest complete checkpoint")
    parser.add_argument("--checkpoints", required=True, action="append",
                        help="a checkpoints dir (repeat: a pipeline's shards gathered from other nodes)")
    parser.add_argument("--model", help="the base model dir (default: the one the run trained from)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        result = build_export([Path(c).expanduser() for c in args.checkpoints],
                              Path(args.model).expanduser() if args.model else None, Path(args.out).expanduser())
    except (ExportError, OSError, ValueError) as exc:
        print(f"worker.export: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
