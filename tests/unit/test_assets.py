"""Provisioning `assets:` on a node that cannot build them: one line naming the node and what is missing.

The node here is a local one (`connection: local`, a real subprocess) whose python runs with `-S`: the standard
library only, so numpy is missing for certain, as on a fresh Mac's system python.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from coordinator.errors import TransportError
from coordinator.fleet.assets import describe_failure, provision_node
from coordinator.fleet.transport import LocalTransport
from coordinator.models import Connection, Node


def bare_python(tmp: Path) -> Path:
    """An interpreter without site-packages (no numpy, mlx, tokenizers): this venv's python with -S."""
    path = tmp / "python-bare"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    path.chmod(0o755)
    return path


def test_a_node_without_numpy_gets_one_line_naming_the_module_and_the_install(tmp_path: Path) -> None:
    python = bare_python(tmp_path)
    node = Node("studio", "127.0.0.1", Connection.LOCAL, python=str(python), workdir=str(tmp_path / "w"))
    spec = {"data": {"path": str(tmp_path / "data"), "files": {"train.jsonl": '{"text": "hi"}\n'}},
            "tiny": {"path": str(tmp_path / "model"), "data": str(tmp_path / "data"), "layers": 1, "hidden": 8,
                     "seed": 0}}
    with pytest.raises(TransportError) as err:
        asyncio.run(provision_node(LocalTransport(node), node, spec))
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("studio: cannot build assets.tiny_model: the node's python ")
    assert "has no module 'numpy'" in message and "-m pip install numpy)" in message
    assert (tmp_path / "data" / "train.jsonl").exists()  # what could be provisioned was
    assert not (tmp_path / "model").exists()  # nothing half-built under the final name


@pytest.mark.parametrize(("answer", "stderr", "expected"), [
    ({"error": "missing_module", "module": "mlx_lm", "python": "/opt/my py/bin/python"}, "",
     "cannot build assets.tiny_model: the node's python /opt/my py/bin/python has no module 'mlx_lm' "
     "(install it: '/opt/my py/bin/python' -m pip install mlx-lm)"),
    ({"error": "failed", "message": "PermissionError: [Errno 13] Permission denied: '/srv'", "python": "/p"}, "",
     "could not provision assets with /p: PermissionError: [Errno 13] Permission denied: '/srv'"),
    (None, "Traceback (most recent call last):\n  File x\nMemoryError\n\n",
     "could not provision assets with python3: MemoryError"),
    (None, "", "could not provision assets with python3: no output"),
])
def test_describe_failure(answer: dict[str, str] | None, stderr: str, expected: str) -> None:
    assert describe_failure(answer, stderr, "python3") == expected
