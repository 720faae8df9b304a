"""Byte-deterministic safetensors writing and file hashing.

`mx.save_safetensors` lays the tensor data out in the iteration order of a C++ hash map, which depends on the
insertion order and on the standard library (libc++ on macOS, libstdc++ on Linux): the same arrays can give
different bytes on two nodes. Checkpoints are compared by SHA256 across nodes and the tiny model must have the
same SHA256 everywhere, so we write the (simple, documented) safetensors format ourselves: keys sorted, data
contiguous in key order, header padded with spaces to 8 bytes. `mx.load` reads it back.

Stdlib + numpy + mlx only.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

# mlx dtype -> (safetensors dtype name, dtype numpy sees the raw bytes as). bfloat16 has no numpy dtype: its
# bytes travel as uint16, which is exactly the safetensors BF16 layout.
_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.bool_: ("BOOL", None),
    mx.uint8: ("U8", None),
    mx.uint16: ("U16", None),
    mx.uint32: ("U32", None),
    mx.uint64: ("U64", None),
    mx.int8: ("I8", None),
    mx.int16: ("I16", None),
    mx.int32: ("I32", None),
    mx.int64: ("I64", None),
    mx.float16: ("F16", None),
    mx.float32: ("F32", None),
    mx.bfloat16: ("BF16", mx.uint16),
}

HASH_CHUNK = 1 << 20


def _as_numpy(array: mx.array) -> np.ndarray[Any, Any]:
    try:
        _, view = _DTYPES[array.dtype]
    except KeyError:
        raise ValueError(f"dtype {array.dtype} cannot be written to safetensors") from None
    if view is not None:
        array = array.view(view)
    return np.ascontiguousarray(np.asarray(array))


def write_safetensors(path: Path, arrays: Mapping[str, mx.array], metadata: Mapping[str, str] | None = None) -> None:
    """Write `arrays` to `path` (overwriting) in a layout that depends only on the names, dtypes and values.

    The caller owns durability (fsync) and atomicity (write to a temporary name, then rename)."""
    if sys.byteorder != "little":  # safetensors is little-endian; every MLX platform is too
        raise RuntimeError("big-endian hosts are not supported")
    names = sorted(arrays)
    mx.eval([arrays[n] for n in names])
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    blobs: list[np.ndarray[Any, Any]] = []
    offset = 0
    for name in names:
        arr = arrays[name]
        blob = _as_numpy(arr)
        size = blob.nbytes
        header[name] = {"dtype": _DTYPES[arr.dtype][0], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + size]}
        blobs.append(blob)
        offset += size
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in blobs:
            _write_array(fh, blob)


def _write_array(fh: BinaryIO, blob: np.ndarray[Any, Any]) -> None:
    if blob.nbytes:
        # memoryview of a contiguous array: no second copy of a multi-GB tensor
        fh.write(blob.reshape(-1).view(np.uint8).data)


def sha256_file(path: Path) -> str:
    """Hex SHA256 of a file's content, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
