"""What a pipeline stage holds, as names (pure): which tensors of the model's safetensors it reads, and how its
parameters are named locally (its blocks numbered from 0, as its trimmed module list numbers them) and globally
(the model's layer numbers: what checkpoints store, so a shard says which layers it holds whatever the split)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class StageRange:
    """Stage `index` of `stages` holds blocks [first, last) of the model."""

    index: int
    stages: int
    first: int
    last: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1


def layer_of(name: str) -> int | None:
    """The block number in a tensor name (`model.layers.12.mlp.up_proj.weight` -> 12), None outside the blocks."""
    match = _LAYER.search(name)
    return int(match.group(2)) if match else None


def renumber(name: str, shift: int) -> str:
    """`name` with its block number moved by `shift` (local <-> global); names outside the blocks unchanged."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + shift}.", name, count=1)


def to_global(arrays: Mapping[str, object], first: int) -> dict[str, object]:
    return {renumber(k, first): v for k, v in arrays.items()}


def to_local(arrays: Mapping[str, object], first: int) -> dict[str, object]:
    return {renumber(k, -first): v for k, v in arrays.items()}


def wanted(name: str, stage: StageRange, outside: Iterable[str]) -> bool:
    """Whether stage `stage` reads tensor `name`: its own blocks, and of the tensors outside the blocks those
    under one of the module paths it keeps (`outside`: e.g. `model.embed_tokens` on the first stage)."""
    layer = layer_of(name)
    if layer is not None:
        return stage.first <= layer < stage.last
    return any(name == p or name.startswith(p + ".") for p in outside)


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) of a safetensors file, from its header alone (8-byte length, then
    JSON): no tensor data is read."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: (str(v["dtype"]), tuple(int(n) for n in v["shape"])) for k, v in header.items() if k != "__metadata__"}


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from `model.safetensors.index.json` when there is one (no
    weight file is opened), else from each `model*.safetensors` file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    out: dict[str, Path] = {}
    for path in sorted(model_dir.glob("model*.safetensors")):
        out.update({name: path for name in read_header(path)})
    return out
