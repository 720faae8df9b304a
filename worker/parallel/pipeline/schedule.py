"""The order of a pipeline stage's work over a step's micro-batches: pure lists of actions, one list per stage.

An action is a computation (`forward`, `backward` of micro-batch m) or a transfer with a neighbour stage
(`recv_act`/`send_act`: the activation from stage s-1 / to stage s+1; `recv_grad`/`send_grad`: the gradient of
the stage's output from stage s+1 / of its input to stage s-1). The executor (`worker.parallel.pipeline.runner`)
runs each stage's list in order; this module only decides the order, so it is tested on its own
(`simulate`: every list runs to its end under blocking, unbuffered transfers, and at most `in_flight` micro-batches
wait between their forward and their backward).

Schedules
---------
* `gpipe`: every forward, then every backward. Simple, but a stage holds all M micro-batches between the two.
* `1f1b` (the default; Megatron-LM's non-interleaved schedule): stage s runs P-1-s warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. The bubble is the same as GPipe's
  ((P-1)/(M+P-1) of the step), but a stage never holds more than P-s micro-batches between their forward and
  their backward, whatever M is, so M can grow (smaller bubble) without growing the memory held in flight.
  In-flight state here is small anyway: MLX differentiates functions, it keeps no tape between calls, so a stage
  keeps only each pending micro-batch's INPUT (and its output until it is sent) and recomputes its forward inside
  its backward (the vjp of its layers with the received gradient as cotangent). With 1F1B that is P-s inputs;
  with GPipe it would be M.

Transfers block (MLX's ring `send` returns once the bytes are written; a large activation fills the socket
buffers, so a send completes only when the peer receives). In 1F1B's steady state a stage's forward output and
the gradient it waits for cross on the same link in opposite directions; the order here is receive-then-send on
the upstream side (`recv_grad` of the backward before `send_act` of the forward) and send-then-receive on the
downstream side, so the two never both wait to send (`simulate` checks it for every P and M it is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")

RECV_ACT, FORWARD, SEND_ACT = "recv_act", "forward", "send_act"
RECV_GRAD, BACKWARD, SEND_GRAD = "recv_grad", "backward", "send_grad"


@dataclass(frozen=True)
class Action:
    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}({self.micro})"


def build_schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Stage `stage`'s actions (0-based, of `stages`) over `micro_batches` micro-batches, for schedule `name`."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r} (one of {', '.join(SCHEDULES)})")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"stage {stage} of {stages}, {micro_batches} micro-batches")
    first, last = stage == 0, stage == stages - 1
    out: list[Action] = []

    def forward(m: int, send: bool = True) -> None:
        if not first:
            out.append(Action(RECV_ACT, m))
        out.append(Action(FORWARD, m))
        if send and not last:
            out.append(Action(SEND_ACT, m))

    def backward(k: int, receive: bool = True) -> None:
        if receive and not last:
            out.append(Action(RECV_GRAD, k))
        out.append(Action(BACKWARD, k))
        if not first:
            out.append(Action(SEND_GRAD, k))

    if name == "gpipe":
        for m in range(micro_batches):
            forward(m)
        for k in range(micro_batches):
            backward(k)
        return out
    warmup = min(stages - 1 - stage, micro_batches)
    for m in range(warmup):
        forward(m)
    for i in range(micro_batches - warmup):
        m, k = warmup + i, i
        forward(m, send=False)
        if not last:
            # The gradient of micro-batch k is taken off the link before micro-batch m's output goes onto it.
            out.append(Action(RECV_GRAD, k))
            out.append(Action(SEND_ACT, m))
        backward(k, receive=False)
    for k in range(micro_batches - warmup, micro_batches):
        backward(k)
    return out


@dataclass(frozen=True)
class Simulation:
    """What running every stage's list together gave: `done` (every list ran to its end), the stuck actions
    otherwise (one per stage, None for a finished stage), and each stage's most micro-batches held in flight."""

    done: bool
    stuck: tuple[str | None, ...]
    in_flight: tuple[int, ...]


_PARTNER = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (1, SEND_GRAD)}


def simulate(schedules: Sequence[Sequence[Action]]) -> Simulation:
    """Run every stage's actions with rendezvous transfers (a send and its receive happen together, neither can
    go ahead alone: the strictest semantics a blocking transport can have). Computations always proceed. Also
    checks that each transfer meets the transfer it should (the same micro-batch)."""
    pcs = [0] * len(schedules)
    held = [0] * len(schedules)
    peak = [0] * len(schedules)
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(schedules):
            while pcs[s] < len(actions):
                action = actions[pcs[s]]
                if action.kind in (FORWARD, BACKWARD):
                    held[s] += 1 if action.kind == FORWARD else -1
                    peak[s] = max(peak[s], held[s])
                    pcs[s] += 1
                    progress = True
                    continue
                step, want = _PARTNER[action.kind]
                peer = s + step
                if not 0 <= peer < len(schedules) or pcs[peer] >= len(schedules[peer]):
                    break
                other = schedules[peer][pcs[peer]]
                if other.kind != want:
                    break
                if other.micro != action.micro:
                    raise AssertionError(f"stage {s} {action} meets stage {peer} {other}")
                pcs[s] += 1
                pcs[peer] += 1
                progress = True
    done = all(pc == len(a) for pc, a in zip(pcs, schedules))
    stuck = tuple(None if pc == len(a) else str(a[pc]) for pc, a in zip(pcs, schedules))
    return Simulation(done, stuck, tuple(peak))


def bubble(stages: int, micro_batches: int) -> float:
    """The idle share of a step with equal stages: (P-1)/(M+P-1), for GPipe and 1F1B alike."""
    return (stages - 1) / (micro_batches + stages - 1)
