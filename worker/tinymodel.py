"""Build a tiny llama-style model directory, fully offline and byte-deterministic.

    python -m worker.tinymodel --out DIR [--data DATA_DIR] [--layers 2] [--hidden 64] [--seed 0]

DIR receives what `mlx_lm.utils.load(DIR)` (and so `worker.train`) needs, and nothing is downloaded:
    config.json              model_type llama, sizes, token ids (sorted keys)
    model.safetensors        float32 weights drawn from numpy's PCG64 with `seed` (not mx.random: its float
                             kernels may differ between backends, and every node must build the same SHA256s)
    tokenizer.json           a WordPiece tokenizer: specials, every printable ASCII character (as word start
                             and as `##` continuation, so any ASCII text encodes without <unk>), then the words
                             of DATA_DIR's {train,valid}.jsonl (text / prompt / completion / messages[].content),
                             most frequent first; BOS is prepended by the post-processor
    tokenizer_config.json    PreTrainedTokenizerFast with bos/eos/unk/pad and a small chat template, so the chat
    special_tokens_map.json  and completions formats of mlx-lm's datasets work too
Same arguments -> byte-identical files (the test suite checks it). Python callers use `build_tiny_model`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS, UNK = SPECIAL_TOKENS[:4]
# Words and single punctuation marks, as BertPreTokenizer splits them (ASCII data; other text maps to <unk>).
_WORD_RE = re.compile(r"[A-Za-z0-9_]+|[^\sA-Za-z0-9_]")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WEIGHT_STD = 0.02


def _texts_of(row: Any) -> Iterator[str]:
    if not isinstance(row, dict):
        return
    # text / completions / preference pairs (DPO), each either plain text or chat messages
    for key in ("text", "prompt", "completion", "chosen", "rejected", "messages"):
        value = row.get(key)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            for message in value:
                if isinstance(message, dict) and isinstance(message.get("content"), str):
                    yield message["content"]


def collect_words(data_dir: Path | None) -> list[str]:
    """Words of the dataset, most frequent first, ties by spelling (deterministic). Missing dir/files: []."""
    if data_dir is None:
        return []
    counts: Counter[str] = Counter()
    for name in ("train.jsonl", "valid.jsonl"):
        path = data_dir / name
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    for text in _texts_of(json.loads(line)):
                        counts.update(_WORD_RE.findall(text))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def build_vocab(words: Sequence[str], max_words: int) -> dict[str, int]:
    """Specials, ASCII characters (word-initial and `##` continuation), then up to `max_words` data words."""
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    chars = [chr(c) for c in range(33, 127)]
    for tok in chars + ["##" + c for c in chars]:
        vocab.setdefault(tok, len(vocab))
    added = 0
    for word in words:
        if added >= max_words:
            break
        if word not in vocab:
            vocab[word] = len(vocab)
            added += 1
    return vocab


def _tokenizer_json(vocab: dict[str, int]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=UNK, max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # Canonical JSON: the library's own serialisation is stable today, sorted keys keep it so.
    return json.dumps(json.loads(tok.to_str()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _model_config(*, vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int,
                  intermediate: int, max_positions: int, vocab: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": vocab[BOS],
        "eos_token_id": vocab[EOS],
        "pad_token_id": vocab[PAD],
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Instantiate mlx-lm's llama Model from `config` (so names and shapes are exactly what `load` expects) and
    replace every parameter with numpy-drawn values: norms 1, everything else N(0, 0.02), in sorted name order."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    model = Model(ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    params: dict[str, Any] = {}
    tree_flatten(model.parameters(), destination=params)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, param in sorted(params.items()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            values = np.ones(shape, dtype=np.float32)
        else:
            values = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
        out[name] = mx.array(values)
    return out


def build_tiny_model(out: Path, data: Path | None = None, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                     heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, max_words: int = 2000,
                     max_positions: int = 2048) -> Path:
    """Write the tiny model into `out` (created if needed; our files are overwritten) and return `out`.

    Raises ValueError for inconsistent sizes (hidden not divisible by heads, heads not by kv_heads)."""
    if layers < 1 or hidden < 8 or heads < 1 or kv_heads < 1:
        raise ValueError("layers >= 1, hidden >= 8, heads >= 1 and kv_heads >= 1 are required")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    if (hidden // heads) % 2:
        raise ValueError("head_dim (hidden / heads) must be even for RoPE")
    from worker.tensorfile import write_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(collect_words(data), max_words)
    config = _model_config(vocab_size=len(vocab), layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                           intermediate=intermediate or 2 * hidden, max_positions=max_positions, vocab=vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_safetensors(out / "model.safetensors", _random_weights(config, seed), {"format": "mlx"})
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab), encoding="utf-8")
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    tok_config = {
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n",
                                                 encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker.tinymodel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument("--data", type=Path, default=None, help="dataset dir whose words join the vocabulary")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(args.out, args.data, layers=args.layers, hidden=args.hidden, seed=args.seed,
                                heads=args.heads, kv_heads=args.kv_heads)
    except ValueError as exc:
        print(f"worker.tinymodel: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
