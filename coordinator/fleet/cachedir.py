"""The one root of every cache the coordinator keeps on its own machine: `$XDG_CACHE_HOME/mlx-coordinator`
(`~/.cache/mlx-coordinator` when it is unset, empty or relative, as the XDG base directory spec says). The
calibration curves (`calibration/`) and setup's wheels (`wheelhouse/`) live under it; a clean-up that removes it
(`.ci/run`) leaves nothing behind. The nodes' own caches (the probe's bytecode, the hash cache) follow the same
rule on each node, in its environment: `worker.probe.cache_root` and `coordinator.facts.probe.BOOTSTRAP`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    base = (os.environ if environ is None else environ).get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.expanduser("~/.cache")
    return Path(base) / "mlx-coordinator"
