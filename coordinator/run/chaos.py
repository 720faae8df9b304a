"""`--chaos SPEC`: deliberate faults for tests and drills. Off by default; parsing is pure.

SPEC is `KIND:key=value,...`, e.g. `kill:rank=1,step=20`, `hang:rank=1,step=20`, `nan:rank=2,step=15`,
`diverge:rank=2,step=15`, `lie:rank=1,step=10`, `slow:rank=1,factor=3`, `stall:rank=1,step=10`. The worker
applies them (worker/chaos.py) on the first attempt of a run only: a relaunch after the fault runs clean.

A drill that cannot happen is refused, never run silently without its fault (`compute_unreachable`): a rank that
is not one of the run's, a step the run never trains (past `train.iters`, or at or before the step a resumed
attempt starts after), a `factor` on a kind that has none. What the command line alone shows is refused by
`parse_chaos`; what only the launch knows (quarantine leaving nodes out, the resume step) by the launch before
any rank starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.errors import ConfigError
from worker.runconfig import CHAOS_KINDS, ChaosSpec

# One record for a planned fault on both sides: the worker's own (worker.runconfig.ChaosSpec), which run.json
# carries and the worker validates again; the coordinator only parses `--chaos SPEC` into it.
Chaos = ChaosSpec
KINDS = CHAOS_KINDS
KEYS = {"rank": int, "step": int, "factor": float}
# Kinds that act from their step on (worker.chaos.RankChaos._since); the others act at their step only.
FROM_STEP_ON = frozenset({"slow", "lie"})


def compute_unreachable(chaos: Chaos, *, world_size: int | None = None, iters: int | None = None,
                        after_step: int = 0) -> str | None:
    """Why `chaos` would never fire in an attempt of `world_size` ranks training steps `after_step + 1 .. iters`
    (None for a bound not known yet); None when it fires."""
    if world_size is not None and chaos.rank >= world_size:
        return f"rank {chaos.rank} is not a rank of this run (ranks 0..{world_size - 1})"
    if iters is not None and chaos.step > iters:
        return f"step {chaos.step} is never reached: the run trains {iters} step(s) (train.iters)"
    if after_step and chaos.step <= after_step and chaos.kind not in FROM_STEP_ON:
        return (f"step {chaos.step} is never reached: this attempt resumes after step {after_step} "
                f"(a {chaos.kind} acts at its step only)")
    return None


def describe(chaos: Chaos) -> str:
    """The SPEC back (`kill:rank=1,step=20`), for messages."""
    return f"{chaos.kind}:rank={chaos.rank},step={chaos.step}" + (f",factor={chaos.factor:g}"
                                                                  if chaos.kind == "slow" else "")


def check_reachable(specs: Sequence[Chaos], *, world_size: int | None = None, iters: int | None = None,
                    after_step: int = 0, why: str = "") -> None:
    """ConfigError (exit 2) naming the first planned fault that would never fire (`compute_unreachable`); `why`
    says where a bound came from (e.g. the quarantine that left nodes out)."""
    for chaos in specs:
        reason = compute_unreachable(chaos, world_size=world_size, iters=iters, after_step=after_step)
        if reason is not None:
            raise ConfigError(f"--chaos {describe(chaos)}: {reason}{why}; the drill would run without its fault")


def parse_chaos(spec: str, *, world_size: int | None = None, iters: int | None = None) -> Chaos:
    """`--chaos SPEC` -> Chaos; ConfigError for a malformed SPEC and for one that could never fire in a run of
    `world_size` ranks and `iters` steps."""
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
    if "factor" in values and kind != "slow":
        raise ConfigError(f"--chaos {spec!r}: factor applies to slow only (a {kind} has none)")
    reason = compute_unreachable(chaos, iters=iters)
    if reason is not None:
        raise ConfigError(f"--chaos {spec!r}: {reason}; the drill would run without its fault")
    return chaos
