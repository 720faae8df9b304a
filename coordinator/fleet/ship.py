"""Ship the `worker` package to a node, content-addressed, so `python -m worker.X` runs there.

Nodes have mlx and mlx-lm but not our package. We send a gzipped tar of `worker/` on stdin to the node's own
python (no `base64`/`tar` flag differences between macOS and Linux), into
`<workdir>/.coordinator/worker-<digest>/`. A second ship of the same code is a no-op; the directory name is
the code's digest, so two versions never mix.
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

from coordinator.errors import TransportError
from coordinator.fleet.transport import Transport, python_argv
from coordinator.models import Node

# The bundle is read from stdin FIRST, even when the dir already exists: a script that exits without reading
# closes the channel while the client may still be writing ("Channel not open for sending"), which a fast node
# and a slow coordinator hit in practice.
_EXTRACT = (
    "import base64, io, os, sys, tarfile\n"
    "payload = sys.stdin.read()\n"
    "dest = os.path.expanduser(sys.argv[1])\n"
    "if not os.path.exists(os.path.join(dest, 'worker', '__init__.py')):\n"
    "    tmp = dest + '.tmp-%d' % os.getpid()\n"
    "    os.makedirs(tmp, exist_ok=True)\n"
    "    tarfile.open(fileobj=io.BytesIO(base64.b64decode(payload))).extractall(tmp)\n"
    "    try:\n"
    "        os.rename(tmp, dest)\n"
    "    except OSError:\n"
    "        pass  # another ship won the race: same digest, same content\n"
    "print(dest)\n"
)


@lru_cache(maxsize=1)
def worker_bundle() -> tuple[str, str]:
    """(digest, base64 tar.gz) of the worker package's .py files, deterministic."""
    root = Path(str(resources.files("worker")))
    buf = io.BytesIO()
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(f"worker/{path.relative_to(root).as_posix()}")
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(b"".join(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes()
                                     for p in files)).hexdigest()[:16]
    return digest, base64.b64encode(buf.getvalue()).decode()


def remote_worker_dir(node: Node) -> str:
    digest, _ = worker_bundle()
    return f"{node.workdir.rstrip('/')}/.coordinator/worker-{digest}"


async def ship_worker(transport: Transport, node: Node, *, timeout: float = 60.0) -> str:
    """Make sure the worker package is on the node; return the absolute dir to use as PYTHONPATH / cwd."""
    _, payload = worker_bundle()
    result = await transport.run(python_argv(node.python, "-c", _EXTRACT, remote_worker_dir(node)), stdin=payload,
                                 timeout=timeout)
    if not result.ok:
        raise TransportError(node.name, f"could not install the worker package: {result.stderr.strip()[-400:]}")
    return result.stdout.strip().splitlines()[-1]
