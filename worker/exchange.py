"""How a dp step of several ranks exchanges its gradients, by where it computes (no mlx import: `worker.collbench`
times the exchange the run makes and imports this before mlx).

After every rank has evaluated its local gradient sums (its compute ends there: `compute_s`), the gradients are
scaled, concatenated per dtype into buckets and each bucket is all_summed (`worker.step.all_sum_arrays`).

- On the CPU backend the buckets are evaluated on their own, then the update: with the collective inside a compiled
  graph 2-rank ring runs deadlocked intermittently (mlx 0.32.4), and 32 MiB buckets are what mlx's
  `average_gradients` uses.
- On a GPU each bucket is dispatched (`mx.async_eval`) as soon as it is built and the update follows in the same
  evaluation as the rest of the step: the host keeps queueing while the GPU works, and no evaluation waits between
  the exchange and the update. Measured on 2x H100 (NCCL, M model 954M, full fine-tune, batch 8 x 512 per GPU,
  `benchmarks/bench_gpus.py dpstep`): a step of 0.108 s with 32 MiB buckets evaluated on their own, 0.104 s with
  256 MiB, 0.088 s dispatched in 256 MiB buckets, 0.099 s dispatched in 32 MiB ones; one GPU alone 0.082 s
  (so 1.52x -> 1.87x for two GPUs). Larger buckets: fewer dispatches and NCCL calls, a transient copy of one
  bucket more.
Bucket sizes are counted at 4 bytes an element, as `bucket_names` counts (512 MiB: 256 MiB of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_BUCKET_BYTES = 32 * 1024**2
GPU_BUCKET_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class Exchange:
    """`pipelined`: each bucket dispatched as soon as it is built, the update in the step's one last evaluation
    (else the buckets are evaluated on their own first); `bucket_bytes`: a bucket's size, counted at 4 bytes an
    element."""

    pipelined: bool
    bucket_bytes: int


def exchange_for(on_gpu: bool) -> Exchange:
    """The exchange a dp step makes on a GPU or on the CPU backend (the module docstring says why)."""
    return Exchange(True, GPU_BUCKET_BYTES) if on_gpu else Exchange(False, CPU_BUCKET_BYTES)
