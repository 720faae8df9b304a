"""Per-block timing for the pipeline planner (`worker.bench --blocks K --micro-batch MB`): K transformer blocks
loaded ALONE, as a stage loads them (`stage.load_stage`: only their tensors are read), so a node that cannot hold
the whole model is measured too; and the two pieces only the end stages run, the embeddings and the head.

What is timed is what a stage executes per micro-batch of MB rows of `seq_len` tokens (random activations and
token ids: a block's cost does not depend on the values):
* `block_s`: a non-last stage's cost per block: its forward (whose output is sent), then its backward (the vjp
  with the output gradient as cotangent, which recomputes the forward), divided by K;
* `block_fused_s`: the last stage's cost per block: forward and backward in one pass (the backward alone);
* `embed_s`: the first stage's embedding lookup (frozen in every method a pipeline trains: no backward);
* `head_s`: the last stage's final norm, lm_head and loss, forward and backward (to the input gradient);
* `update_s`: the optimizer update of the K blocks' trainable parameters, per block (as a stage applies it: the
  gradient sum scaled in float32, then the update).
Each is the mean of its timed repetitions, after one warm-up call (the one-time compile of a new shape): a step
is the sum of many such calls, whose expected time is the sum of their means, every disturbance included (a
first quartile, the dp curve's statistic, picks the undisturbed calls: on the capped test bed it predicted 24%
above the run).

Memory (bytes, MLX's own count of its arrays, as the worker's `peak_memory`), of a stage of the K blocks over a
step of two micro-batches (both inputs held, each backward with the gradient sum beside it, then the update):
* `peak_memory`: that step's peak;
* `block_bytes`: what a trained block holds throughout (its weights and optimizer state), per block;
* `backward_bytes`: what the backward phase adds at its peak (the working set, the gradient sum, the input
  gradient sent), per block; `update_bytes`: what the update adds at its peak (the scaled gradients, new
  parameters and moments beside the old, the gradient sum still held), per block;
* `input_bytes`: one micro-batch's activation (MB x (seq_len - 1) x hidden in the stage's dtype), what a
  stage holds per pending micro-batch and sends to its neighbour;
* `embed_bytes`: the embedding's weights (the first stage's); `head_bytes`: the last stage's end alone (final
  norm and head weights, the logits and their gradient) at its peak over a loss backward."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from worker.parallel.pipeline.layout import StageRange
from worker.parallel.pipeline.stage import Chunk, Stage, load_stage
from worker.runconfig import LoraSpec
from worker.step import flatten

MIN_REPEATS = 3
PEAK_REPEATS = 3  # step probes of the memory measured; each phase's largest counts
MAX_REPEATS = 50


def _timed(fn: Callable[[], Any], window: float, clock: Callable[[], float]) -> tuple[float, int]:
    """(mean of the call's seconds, calls timed): one warm-up call, then at least MIN_REPEATS calls and
    more until `window` seconds were timed (at most MAX_REPEATS)."""
    mx.eval(fn())
    times: list[float] = []
    while len(times) < MIN_REPEATS or (sum(times) < window and len(times) < MAX_REPEATS):
        tic = clock()
        mx.eval(fn())
        times.append(clock() - tic)
    return sum(times) / len(times), len(times)


def _chunk(stage: Stage, rows: int, width: int, vocab: int) -> Chunk:
    ids = mx.random.randint(0, vocab, (rows, width))
    targets = mx.random.randint(0, vocab, (rows, width))
    scored = mx.ones((rows, width), mx.bool_)
    return Chunk(ids, targets, scored, None, mx.array(rows * width, mx.int32), mx.array(rows * width, mx.int32))


def measure_blocks(model_dir: Path, *, blocks: int, micro_batch: int, seq_len: int, method: str,
                   num_layers: int | None, lora: LoraSpec, seed: int, grad_checkpoint: bool, window: float,
                   optimizer: str = "adam", learning_rate: float = 1e-5,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """The per-block answer (see the module docstring). The K blocks timed are the model's LAST K (the ones a
    method with `num_layers` trains first); raises ValueError when the model has fewer than K blocks."""
    from mlx_lm.utils import load_config

    from worker.modelsetup import ready_optimizer

    config = load_config(model_dir)
    vocab = int(config["vocab_size"])
    width = seq_len - 1  # a row of seq_len tokens feeds seq_len - 1 positions
    common: dict[str, Any] = {"seed": seed, "method": method, "num_layers": num_layers, "lora": lora,
              "grad_checkpoint": grad_checkpoint}
    probe_total = _depth(model_dir)
    if not 1 <= blocks <= probe_total:
        raise ValueError(f"--blocks {blocks}: the model has {probe_total} blocks")
    head_s, embed_s, head_bytes, embed_bytes, x, chunk = _ends(model_dir, probe_total, micro_batch, width, vocab,
                                                               common, window, clock)
    stage, count = load_stage(model_dir, StageRange(1, 3, probe_total - blocks, probe_total), **common)
    opt = ready_optimizer(stage.model, optimizer, learning_rate)
    weights_bytes = sum(int(v.nbytes) for v in flatten(stage.model.parameters()).values())
    dy = mx.random.normal((micro_batch, width, stage.hidden)).astype(stage.dtype)
    forward_s, _ = _timed(lambda: stage.forward(x, chunk), window, clock)
    backward_s, repeats = _timed(lambda: stage.backward(x, chunk, dy), window, clock)
    update_s = _time_update(stage, opt, stage.backward(x, chunk, dy)[0], window, clock)
    state = weights_bytes + sum(int(v.nbytes) for v in flatten(opt.state).values())
    # A peak is a maximum: MLX's evaluation order moves a step's peak by a few percent between two runs of it.
    probes = [_step_peak(stage, opt, chunk, width, micro_batch) for _ in range(PEAK_REPEATS)]
    peak, backward, update = (max(p[i] for p in probes) for i in range(3))
    return {
        "blocks": blocks, "micro_batch": micro_batch, "seq_len": seq_len,
        "block_s": (forward_s + backward_s) / blocks, "block_fused_s": backward_s / blocks,
        "embed_s": embed_s, "head_s": head_s, "update_s": update_s / blocks, "peak_memory": peak,
        "block_bytes": state // blocks, "backward_bytes": backward // blocks, "update_bytes": update // blocks,
        "input_bytes": int(x.nbytes), "embed_bytes": embed_bytes, "head_bytes": head_bytes,
        "blocks_weight_bytes": weights_bytes, "model_layers": probe_total,
        "timed_layers": [probe_total - blocks, probe_total], "method": method,
        "num_layers": count, "dtype": str(stage.dtype), "hidden": stage.hidden, "repeats": repeats,
    }


def _time_update(stage: Stage, opt: Any, grads: Any, window: float, clock: Callable[[], float]) -> float:
    """Seconds of one `_update` with `grads` (released on return)."""
    mx.eval(grads)
    return _timed(lambda: _update(stage, opt, grads), window, clock)[0]


def _update(stage: Stage, opt: Any, grads: Any) -> list[Any]:
    """A stage's update as `Pipeline.step` runs it: the gradient sum scaled in float32 and cast back, the scaled
    gradient's squared norm (for the step event), the optimizer; all evaluated together."""
    inverse = mx.array(0.5, mx.float32)
    scaled = tree_map(lambda g: (g.astype(mx.float32) * inverse).astype(g.dtype), grads)
    square = sum((mx.sum(mx.square(g.astype(mx.float32))) for g in flatten(scaled).values()), mx.array(0.0))
    opt.update(stage.model, scaled)
    return [stage.model.parameters(), opt.state, square]


def _step_peak(stage: Stage, opt: Any, chunk: Chunk, width: int, rows: int) -> tuple[int, int, int]:
    """(the peak of a step of two micro-batches as a middle stage runs it, what its backward phase adds to the
    memory held before it, what its update adds): both inputs held, each backward evaluated with the gradient sum
    beside it (and the input gradient it sends), then the update (`_update`: old and new parameters and moments
    at once, the gradient sum still held)."""
    xs = [mx.random.normal((rows, width, stage.hidden)).astype(stage.dtype) for _ in range(2)]
    dy = mx.random.normal((rows, width, stage.hidden)).astype(stage.dtype)
    mx.eval(xs, dy)
    mx.clear_cache()
    before = int(mx.get_active_memory())
    mx.reset_peak_memory()
    total: Any = None
    for x in xs:
        g, dx = stage.backward(x, chunk, dy)
        total = g if total is None else tree_map(lambda a, b: a + b, total, g)
        mx.eval(total, *([dx] if dx is not None else []))
        del g, dx
    backward = int(mx.get_peak_memory())
    mx.clear_cache()
    mx.reset_peak_memory()
    mx.eval(_update(stage, opt, total))
    update = int(mx.get_peak_memory())
    return max(backward, update), max(0, backward - before), max(0, update - before)


def _ends(model_dir: Path, total: int, rows: int, width: int, vocab: int, common: dict[str, Any], window: float,
          clock: Callable[[], float]) -> tuple[float, float, int, int, mx.array, Chunk]:
    """(head_s, embed_s, head_bytes, embed_bytes, an activation and a chunk of the micro-batch's shape): the head
    timed as a last stage with no block (its peak, less the activation it is given: `head_bytes`), the
    embeddings as the first stage's lookup. Both stages are released on return."""
    mx.clear_cache()
    mx.reset_peak_memory()
    head, _ = load_stage(model_dir, StageRange(1, 2, total, total), **common)
    chunk = _chunk(head, rows, width, vocab)
    x = mx.random.normal((rows, width, head.hidden)).astype(head.dtype)
    mx.eval(x)
    head_s, _ = _timed(lambda: head.loss_backward(x, chunk)[0::2], window, clock)
    head_bytes = max(0, int(mx.get_peak_memory()) - int(x.nbytes))
    first, _ = load_stage(model_dir, StageRange(0, 2, 0, 0), **common)  # the embeddings, no block
    embed_bytes = sum(int(v.nbytes) for v in flatten(first.model.parameters()).values())
    embed_s, _ = _timed(lambda: first.model.model.embed_tokens(chunk.inputs), window, clock)
    return head_s, embed_s, head_bytes, embed_bytes, x, chunk


def _depth(model_dir: Path) -> int:
    """The model's number of transformer blocks, from its lazily built skeleton (nothing is read or allocated)."""
    from mlx_lm.utils import _get_classes, load_config

    config = load_config(model_dir)
    model_class, args_class = _get_classes(config=config)
    return len(model_class(args_class.from_dict(config)).model.layers)
