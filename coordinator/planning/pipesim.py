"""A pipeline's predicted step: the worker's schedule played on a clock. Pure: per-stage costs in, times out.

Each stage runs its list of actions in order (`stage_actions`: the same 1F1B or GPipe order as the worker's
`worker/parallel/pipeline/schedule.py`, which a unit test holds them to): `forward` and `backward` of a
micro-batch take the stage's measured seconds; a transfer between neighbours carries one micro-batch's
activation (forward) or its gradient (backward), `activation_bytes` each way.

Transfers are eager: a send occupies its sender for bytes / bandwidth (the bytes written into the socket), and
the bytes arrive latency + bytes / bandwidth after the send began; a receive ends when its stage reaches it and
the bytes have arrived, whichever is later. (The worker's transfers block, but on activations of a few MiB the
kernel's socket buffers take a send whole; `schedule.simulate` proves that neither schedule deadlocks even when
transfers rendezvous.)

A step is then: every stage's last action, plus its optimizer update (each stage updates its own parameters as
soon as its schedule is done), plus the step's one collective (an all_sum of two numbers over the ring: 2 (P-1)
messages of latency each), from the last stage to finish. With equal stages of forward f and backward b and free
links that is the textbook (M + P - 1) (f + b); the simulation also gets unequal stages, a last stage whose
forward runs inside its backward, and slow links right.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")
FORWARD, BACKWARD = "forward", "backward"
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "recv_act", "send_act", "recv_grad", "send_grad"


@dataclass(frozen=True)
class StageCost:
    """One stage's measured seconds: per micro-batch its `forward` action (0 on the last stage, whose forward runs
    in its backward) and its `backward` action; once per step its optimizer update."""

    forward_s: float
    backward_s: float
    update_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "update_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")

    @property
    def per_micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class LinkCost:
    """The link between two neighbour stages: one-way latency (seconds) and bandwidth (bytes/s; inf: free)."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0) or not self.bytes_per_s > 0:
            raise ValueError(f"a link needs a latency >= 0 s and a bandwidth > 0 B/s, got {self.latency_s!r} s, "
                             f"{self.bytes_per_s!r} B/s")

    def busy_s(self, nbytes: int) -> float:
        """Seconds the sender spends writing `nbytes`."""
        return nbytes / self.bytes_per_s

    def transfer_s(self, nbytes: int) -> float:
        """Seconds from the send's start to the bytes' arrival."""
        return self.latency_s + self.busy_s(nbytes)


FREE_LINK = LinkCost(0.0, math.inf)


@dataclass(frozen=True)
class StepPrediction:
    """The simulated step. `step_s`: the whole step; `done_s[s]`: when stage s's last schedule action ended;
    `busy_s[s]`: its compute per step (forwards, backwards and update); `transfer_s[i]`: one micro-batch's
    transfer over link i (between stages i and i+1); `collective_s`: the step's all_sum."""

    step_s: float
    done_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    collective_s: float

    @property
    def bubble(self) -> float:
        """The idle share of the step, over all stages: 1 - sum(busy) / (P x step)."""
        if self.step_s <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s))


def stage_actions(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s actions (kind, micro-batch) over `micro_batches`: the worker's order
    (`worker.parallel.pipeline.schedule.build_schedule`, which the coordinator cannot import: it loads mlx)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"stage {stage} of {stages}, {micro_batches} micro-batches")
    first, last = stage == 0, stage == stages - 1
    out: list[tuple[str, int]] = []

    def forward(m: int, send: bool = True) -> None:
        out.extend([(RECV_ACT, m)] if not first else [])
        out.append((FORWARD, m))
        out.extend([(SEND_ACT, m)] if send and not last else [])

    def backward(k: int, receive: bool = True) -> None:
        out.extend([(RECV_GRAD, k)] if receive and not last else [])
        out.append((BACKWARD, k))
        out.extend([(SEND_GRAD, k)] if not first else [])

    if schedule == "gpipe":
        for m in range(micro_batches):
            forward(m)
        for k in range(micro_batches):
            backward(k)
        return out
    warmup = min(stages - 1 - stage, micro_batches)
    for m in range(warmup):
        forward(m)
    for i in range(micro_batches - warmup):
        forward(warmup + i, send=False)
        if not last:
            out.extend([(RECV_GRAD, i), (SEND_ACT, warmup + i)])
        backward(i, receive=False)
    for k in range(micro_batches - warmup, micro_batches):
        backward(k)
    return out


def simulate_step(costs: Sequence[StageCost], micro_batches: int, *, links: Sequence[LinkCost] | None = None,
                  activation_bytes: int = 0, schedule: str = "1f1b") -> StepPrediction:
    """The step of a pipeline of `costs` (stage order) over `micro_batches`, its neighbours joined by `links`
    (P - 1 of them; None: free links). Raises ValueError on a malformed input (wrong number of links, no stage)."""
    p = len(costs)
    if p < 1:
        raise ValueError("a pipeline needs at least one stage")
    links = tuple(links) if links is not None else (FREE_LINK,) * (p - 1)
    if len(links) != p - 1:
        raise ValueError(f"{p} stages need {p - 1} link(s), got {len(links)}")
    plans = [stage_actions(schedule, s, p, micro_batches) for s in range(p)]
    clock = [0.0] * p
    pcs = [0] * p
    # When the bytes of a send arrive: (kind of the matching receive, receiving stage, micro-batch) -> time.
    arrivals: dict[tuple[str, int, int], float] = {}
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pcs[s] < len(plans[s]):
                kind, m = plans[s][pcs[s]]
                if kind == FORWARD:
                    clock[s] += costs[s].forward_s
                elif kind == BACKWARD:
                    clock[s] += costs[s].backward_s
                elif kind in (SEND_ACT, SEND_GRAD):
                    link, peer, want = (links[s], s + 1, RECV_ACT) if kind == SEND_ACT else (links[s - 1], s - 1,
                                                                                           RECV_GRAD)
                    arrivals[(want, peer, m)] = clock[s] + link.transfer_s(activation_bytes)
                    clock[s] += link.busy_s(activation_bytes)
                else:
                    arrived = arrivals.pop((kind, s, m), None)
                    if arrived is None:
                        break  # its bytes are not sent yet: another stage goes first
                    clock[s] = max(clock[s], arrived)
                pcs[s] += 1
                progress = True
    stuck = [plan[pc] if pc < len(plan) else None for pc, plan in zip(pcs, plans, strict=True)]
    if any(x is not None for x in stuck):  # pragma: no cover - the worker's schedules are proved deadlock-free
        raise ValueError(f"schedule {schedule} deadlocks at {stuck}")
    collective = 2 * (p - 1) * max((link.latency_s for link in links), default=0.0)
    step = max(c + cost.update_s for c, cost in zip(clock, costs, strict=True)) + collective
    busy = tuple(micro_batches * c.per_micro_batch_s + c.update_s for c in costs)
    return StepPrediction(step, tuple(clock), busy, tuple(link.transfer_s(activation_bytes) for link in links),
                          collective)


__all__ = ["FREE_LINK", "LinkCost", "StageCost", "StepPrediction", "simulate_step", "stage_actions"]
