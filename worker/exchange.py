"""How a dp step of several ranks exchanges its gradients (no mlx import: `worker.collbench` times the exchange the
run makes and imports this first).

The gradients are scaled, concatenated per dtype into buckets and each bucket is all_summed
(`worker.step.all_sum_arrays`). Three choices, by where the step computes and whether its memory is bounded
(`train.memory_headroom`):

- Bucket size: 32 MiB on the CPU backend (mlx's `average_gradients`); 256 MiB on a GPU, where each NCCL call and
  each bucket's concatenation has a fixed cost that 32 MiB buckets pay ~60 times a step on a 1 B model.
- Fused (on a GPU): no evaluation between the rank's backward and the exchange. The compute (the last micro-batch's
  backward and the rank's own statistics) is dispatched (`mx.async_eval`), the exchange and the update are built
  behind it, and the host then waits for the compute's arrays alone: that instant is `compute_s`. Unfused (the CPU
  backend, where a collective stays out of any graph that computes: inside a compiled one, 2-rank ring runs
  deadlocked, mlx 0.32.4), the compute is evaluated first, then the buckets, then the update.
- Pipelined (on a GPU with no memory bound): each bucket is dispatched as soon as it is built, before the host
  waits for the compute, so the device goes from the backward into the collectives without a gap. Not under a
  bound: there the host's dispatch can wait on the limit for a task to finish, and that task can be a collective
  waiting for a slow peer, so `compute_s` (what the straggler verdicts compare) would carry the peer's delay.
  Unpipelined, nothing of the exchange is dispatched before `compute_s` is taken.

Measured on 2x H200 (NCCL, M model 954M, full fine-tune of every weight, batch 8 x 512 per GPU,
`benchmarks/bench_gpus.py dpstep`, side by side in one process, medians of 8 steps, seconds per step, rank 0 /
rank 1; one GPU alone 0.072-0.076). With the bound (headroom 0.1, the default): evaluated 0.095 / 0.094, fused
0.091 / 0.092, fused and pipelined 0.083 / 0.085; in another process evaluated 0.099 / 0.099, fused 0.099 / 0.101
and 0.087 / 0.086 (the same configuration twice), fused and pipelined 0.091 / 0.094: bounded, fusing is within
the noise. Without it: evaluated 0.092 / 0.092, fused 0.085 / 0.085, fused and pipelined 0.077 / 0.077 (1.89x one
GPU, at 26.5 GB a rank against 18.0 GB bounded; unfused and pipelined, the default before, 0.089 / 0.090 in the
other process, where fused and pipelined took 0.079 / 0.079). Through `coordinator launch` (docs/benchmarks.md):
full 1.72-1.73x one GPU bounded, 1.90x unbounded.
Bucket sizes are counted at 4 bytes an element, as `bucket_names` counts (256 MiB: 128 MiB of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_BUCKET_BYTES = 32 * 1024**2
GPU_BUCKET_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Exchange:
    """`pipelined`: each bucket dispatched as soon as it is built, the update in the step's one last evaluation;
    `bucket_bytes`: a bucket's size, counted at 4 bytes an element; `fused`: no evaluation between the rank's
    backward and the exchange (the compute is dispatched, the exchange and update built behind it, and compute_s
    taken when the compute's arrays are complete). Neither: the buckets are evaluated on their own, between the
    compute and the update."""

    pipelined: bool
    bucket_bytes: int
    fused: bool = False


def bucket_bytes_for(on_gpu: bool) -> int:
    """The bucket size of a dp step's gradient exchange on a GPU or on the CPU backend."""
    return GPU_BUCKET_BYTES if on_gpu else CPU_BUCKET_BYTES


def exchange_for(on_gpu: bool, bounded: bool) -> Exchange:
    """The exchange a dp step makes on a GPU or on the CPU backend, with or without a memory bound (the module
    docstring says why): fused on a GPU, pipelined too where nothing bounds its memory."""
    return Exchange(on_gpu and not bounded, bucket_bytes_for(on_gpu), fused=on_gpu)
