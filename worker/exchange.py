"""How a dp step of several ranks exchanges its gradients (no mlx import: `worker.collbench` times the exchange the
run makes and imports this first).

After every rank has evaluated its local gradient sums (its compute ends there: `compute_s`), the gradients are
scaled, concatenated per dtype into buckets and each bucket is all_summed (`worker.step.all_sum_arrays`). Two
choices, by where the step computes and whether its memory is bounded (`train.memory_headroom`):

- Bucket size: 32 MiB on the CPU backend (mlx's `average_gradients`); 256 MiB on a GPU, where each NCCL call and
  each bucket's concatenation has a fixed cost that 32 MiB buckets pay ~60 times a step on a 1 B model.
- Evaluation: the buckets are evaluated on their own, then the update, unless the step computes on a GPU with no
  memory bound: then each bucket is dispatched as soon as it is built (`mx.async_eval`) and the update follows in
  the step's last evaluation, so the host keeps queueing while the GPU works. Not under a bound: that mode keeps
  more in flight than the bound's measuring step saw, and the limit then makes MLX wait. On the CPU the collective
  stays out of any graph that computes (inside a compiled one, 2-rank ring runs deadlocked, mlx 0.32.4).

Measured on 2x H100 (NCCL, M model 954M, full fine-tune, batch 8 x 512 per GPU, `benchmarks/bench_gpus.py dpstep`,
side by side in one process, medians of 6-8 steps, seconds per step, rank 0 / rank 1), with the bound (headroom
0.1, the default): 32 MiB evaluated 0.103 / 0.103 and 0.120 / 0.121 (two leases), 256 MiB evaluated 0.101 / 0.100
and 0.096 / 0.098, 256 MiB dispatched 0.109 / 0.114; without it: 32 MiB evaluated 0.104 / 0.104, 256 MiB evaluated
0.099 / 0.100, 256 MiB dispatched 0.095 / 0.095. One GPU alone: 0.077-0.088.
Bucket sizes are counted at 4 bytes an element, as `bucket_names` counts (256 MiB: 128 MiB of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_BUCKET_BYTES = 32 * 1024**2
GPU_BUCKET_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Exchange:
    """`pipelined`: each bucket dispatched as soon as it is built, the update in the step's one last evaluation
    (else the buckets are evaluated on their own first); `bucket_bytes`: a bucket's size, counted at 4 bytes an
    element."""

    pipelined: bool
    bucket_bytes: int


def bucket_bytes_for(on_gpu: bool) -> int:
    """The bucket size of a dp step's gradient exchange on a GPU or on the CPU backend."""
    return GPU_BUCKET_BYTES if on_gpu else CPU_BUCKET_BYTES


def exchange_for(on_gpu: bool, bounded: bool) -> Exchange:
    """The exchange a dp step makes on a GPU or on the CPU backend, with or without a memory bound (the module
    docstring says why)."""
    return Exchange(on_gpu and not bounded, bucket_bytes_for(on_gpu))
