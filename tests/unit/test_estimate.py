"""The training-memory estimate's terms (their coefficients are fitted on measured peaks: benchmarks/bench_memory.py,
docs/calibration.md). Shapes in, bytes out."""

from __future__ import annotations

from coordinator.planning.estimate import RUNTIME_BYTES, ModelShape, estimate_training_memory, model_shape, usable_memory

# Llama-3.2-1B-like: 16 layers, hidden 2048, MLP 8192, 32 heads (8 kv), vocab 128256.
CFG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
       "num_key_value_heads": 8, "vocab_size": 128256}


def shape() -> ModelShape:
    s = model_shape(CFG, 1_235_814_400)
    assert s is not None
    return s


def test_lora_adapters_are_float32_on_every_linear_of_the_trained_blocks() -> None:
    s = shape()
    # rank 8 x (in + out): q, o (2048+2048), k, v (2048+512), gate, up, down (2048+8192)
    assert s.lora_params_per_layer() == 8 * (4096 * 2 + 2560 * 2 + 10240 * 3)
    est = estimate_training_memory(s, method="lora", batch_per_rank=1, seq_len=128, layers_trained=4)
    adapters = 4 * s.lora_params_per_layer()
    assert (est.weights, est.grads, est.optimizer) == (2 * s.params + 4 * adapters, 4 * adapters, 8 * adapters)


def test_logits_are_the_largest_term_for_a_large_vocabulary() -> None:
    est = estimate_training_memory(shape(), method="lora", batch_per_rank=4, seq_len=2048)
    logits = 10 * 4 * 2048 * 128256
    assert est.activations > logits > est.weights  # 10.5 GB of logits against 2.5 GB of weights


def test_grad_checkpoint_keeps_only_layer_inputs() -> None:
    full = estimate_training_memory(shape(), method="full", batch_per_rank=4, seq_len=1024)
    ckpt = estimate_training_memory(shape(), method="full", batch_per_rank=4, seq_len=1024, grad_checkpoint=True)
    assert ckpt.activations < full.activations and ckpt.weights == full.weights


def test_unfused_attention_adds_the_quadratic_scores() -> None:
    fused = estimate_training_memory(shape(), method="lora", batch_per_rank=1, seq_len=4096)
    cpu = estimate_training_memory(shape(), method="lora", batch_per_rank=1, seq_len=4096, fused_attention=False)
    assert cpu.activations - fused.activations == 1 * 32 * 4096 * 4096 * 16  # 1 B x heads x seq^2 x layers


def test_a_float32_checkpoint_needs_four_bytes_per_weight_grad_and_moment() -> None:
    # The worker trains in the checkpoint's dtype and MLX's Adam keeps its moments in it: a float32 model (the
    # test bed's tiny llama) needs twice a bf16 one's weights, grads and optimizer state.
    cfg = {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 1000, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    bf16, fp32 = model_shape(cfg, 10_000), model_shape({**cfg, "torch_dtype": "float32"}, 10_000)
    assert bf16 is not None and fp32 is not None and (bf16.dtype_bytes, fp32.dtype_bytes) == (2, 4)
    kw = {"method": "full", "batch_per_rank": 1, "seq_len": 8}
    a, b = estimate_training_memory(bf16, **kw), estimate_training_memory(fp32, **kw)  # type: ignore[arg-type]
    assert (a.weights, a.grads, a.optimizer) == (20_000, 20_000, 40_000)
    assert (b.weights, b.grads, b.optimizer) == (40_000, 40_000, 80_000)
    assert b.activations == a.activations


def test_a_small_linux_limit_leaves_room_for_the_process_runtime() -> None:
    # 10% of a 500 MiB cgroup cap is less than the interpreter and MLX themselves hold: the budget leaves them out.
    mib, gib = 2**20, 2**30
    assert usable_memory(500 * mib, is_macos=False) == 500 * mib - RUNTIME_BYTES
    assert usable_memory(16 * gib, is_macos=False) == int(16 * gib * 0.9)
    assert usable_memory(16 * gib, is_macos=True) == int(16 * gib * 0.67)
