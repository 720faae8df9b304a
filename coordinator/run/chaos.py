"""`--chaos SPEC`: deliberate faults for tests and drills. Off by default; parsing is pure.

SPEC is `KIND:key=value,...`, e.g. `kill:rank=1,step=20`, `hang:rank=1,step=20`, `nan:rank=2,step=15`,
`diverge:rank=2,step=15`, `lie:rank=1,step=10`, `slow:rank=1,factor=3`, `stall:rank=1,step=10`. The worker
applies them (worker/chaos.py) on the first attempt of a run only: a relaunch after the fault runs clean.
"""

from __future__ import annotations

from typing import Any

from coordinator.errors import ConfigError
from worker.runconfig import CHAOS_KINDS, ChaosSpec

# One record for a planned fault on both sides: the worker's own (worker.runconfig.ChaosSpec), which run.json
# carries and the worker validates again; the coordinator only parses `--chaos SPEC` into it.
Chaos = ChaosSpec
KINDS = CHAOS_KINDS
KEYS = {"rank": int, "step": int, "factor": float}


def parse_chaos(spec: str, *, world_size: int | None = None) -> Chaos:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise ConfigError(f"--chaos {spec!r}: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in KEYS:
            raise ConfigError(f"--chaos {spec!r}: expected key=value with keys {', '.join(KEYS)}, got {part!r}")
        try:
            values[key] = KEYS[key](raw)
        except ValueError:
            raise ConfigError(f"--chaos {spec!r}: {key} must be a number, got {raw!r}") from None
    if "rank" not in values:
        raise ConfigError(f"--chaos {spec!r}: rank=N is required")
    chaos = Chaos(kind=kind, **values)
    if chaos.rank < 0 or (world_size is not None and chaos.rank >= world_size):
        raise ConfigError(f"--chaos {spec!r}: rank {chaos.rank} is not a rank of this job (0..{(world_size or 1) - 1})")
    if chaos.step < 1 or chaos.factor < 1:
        raise ConfigError(f"--chaos {spec!r}: step must be >= 1 and factor >= 1")
    return chaos
