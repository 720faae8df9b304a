"""Training throughput and memory: ours (`coordinator launch`) vs `mlx_lm lora`, side by side in one run.

For every cell (model size x data shape x method) and every round, both tools train the same random-weight llama
model on the same generated data with the same settings (global batch, max_seq_length, adam, learning rate, iters,
all layers), one after the other, the order alternating between rounds (odd rounds ours first, even rounds
mlx-lm first: ABBA), so the machine's drift over minutes favours neither. Everything is offline: models are built
from configs (worker.tinymodel, numpy-drawn weights, a WordPiece tokenizer over the generated vocabulary) and the
data is generated as mlx-lm's data dir layout (train.jsonl, valid.jsonl of {"text": ...}).

    .venv/bin/python benchmarks/bench_train.py [--sizes tiny,S,M] [--shapes long,short,variable,bimodal]
        [--methods lora,full] [--ranks 1,2] [--iters 40] [--rounds 2] [--warmup 5] [--dtype float32|bfloat16]
        [--calibration-budget SECONDS] [--recalibrate] [--skip-preflight] [--json results.json] [--keep DIR] [--ci]
    .venv/bin/python benchmarks/bench_train.py --sizes M --shapes long --build-only --keep DIR   # models and data only

Sizes (vocab 32,000 words for S and M, tied embeddings, worker.tinymodel's llama layout):
    tiny  hidden 64, 2 layers, 4 heads (2 kv), ffn 128, ~1,000-token vocab; batch 4, max_seq_length 128
    S     hidden 1024, 12 layers, 16 heads (4 kv), ffn 2816: 168.1M parameters; batch 8, max_seq_length 512
    M     hidden 2048, 22 layers, 32 heads (8 kv), ffn 4864: 953.8M parameters; batch 8, max_seq_length 512
Shapes: `long`: every row 15/16 to 16/16 of max_seq_length tokens (BOS and EOS included); `short`: lengths spread
uniformly over 16 .. max_seq_length/4 tokens; `variable`: chat-like, lognormal lengths (median 110 tokens at
max_seq_length 512, scaled with it; sigma 0.8; 8 tokens at least; about 3% of rows reach max_seq_length, where the
tail is cut), the data real fine-tunes have; `bimodal`: 70% of rows 8 .. max_seq_length/8 tokens, the rest 1/2 ..
1 of it (a set calibration was not tuned on: issue 25). Every word of the generated vocabulary is one token.

Ranks: `1` (default) compares ours with mlx-lm on one rank; `2` runs ours alone on two local nodes (one rank each,
over a loopback ring, data parallel, split calibrated): its figure is the calibration's prediction against the
run's median, the gradient all_sum timed between the two ranks included (mlx-lm is not run: its CLI has no split
to predict).

Ours: `python -m coordinator launch -i <1-node local inventory> <playbook> --json --run-dir ...` with `split:
calibrated`, so the calibration's prediction for the plan exists (`predicted_tokens_per_s` in summary.json).
Its figures: from the rank's own event file (`events/rank0.jsonl` in the node's run dir), for each step after
--warmup, tokens / step_time_s (the step's own timer); the run's value is their median. summary.json's
`tokens_per_s` (the run's median over all its steps, what the CLI prints) and `predicted_tokens_per_s` give
"prediction vs actual"; peak memory is the largest `peak_memory` of the rank's step events (mx.get_peak_memory).
mlx-lm: benchmarks/mlx_lm_driver.py runs `mlx_lm lora`'s own code path (its parser and defaults, load,
load_dataset, train_model -> mlx_lm.tuner.trainer.train) with --steps-per-report 1 and a TrainingCallback that
records each step's `tokens_per_second` (trained tokens / the step's time, evaluation excluded) and
`peak_memory`. Its Rich progress UI is never parsed. Both tools count the same tokens (mlx-lm's loss mask).
A second figure for both, `wall tok/s`: tokens / the wall time between consecutive steps' reports (what happens
between steps, event writing or batch building, included); medians after the same warm-up.

Same trainable set: LoRA is mlx-lm's linear_to_lora_layers on all layers in both (rank 8, scale 20, dropout 0).
For `full`, ours with all layers trains every parameter while mlx-lm's CLI trains the transformer blocks only; the
driver is told to unfreeze the whole model (--bench-trainable all) when ours trained every parameter, and the
trainable counts of both are recorded and shown (a differing count is marked in the table).

Settings both tools get: iters, batch, max_seq_length, learning rate 1e-5, adam, seed 0, num_layers all (-1),
one validation batch; evaluation and saving only at the end (mlx-lm also evaluates before step 1; both are
outside the timed steps). Same environment: TOKENIZERS_PARALLELISM as each tool sets it, XDG_CACHE_HOME and
XDG_STATE_HOME in the benchmark's temp dir (the calibration cache and any kernel cache start empty and are shared
by all the runs of this benchmark; calibration is measured once per cell unless --recalibrate).

Calibration's time budget is the playbook's default (`calibration.time_budget`, 60 s of timed steps), as a user's
run has it, unless --calibration-budget says otherwise. A shorter one saves device time but measures a different
calibration: on an H100 at 10 s, the batch-8 points (the batch a 1-node run trains at) were cut short, 4 timed
steps for M long LoRA after a noisy batch-4 point took a second window, 18-24 for the variable-row cells (a few
steps a batch shape), and 4 of 8 cells missed the +-15% goal (-30% to +23%); at 60 s those points got 20 and
60-120 steps (calibration used 7-29 s of the budget) and the same four cells were within -11% to +3%
(docs/benchmarks-history.md, session 9).

Goals (issues 15, 25): ours >= 1.0x mlx-lm's tokens/s on long and variable rows and >= 1.3x on short rows; peak
memory <= 1.05x mlx-lm's; the calibration's prediction within +-15% of the run's median (summary.json), on every
cell, the 2-rank one included. The table says
met/missed per cell; nothing here fails on a missed goal.

Output: Markdown (settings, the command, per-cell table, per-round figures) on stdout, progress on stderr, and with
--json PATH the raw results, rewritten after every run (a run cut short keeps what it measured). A run of either
tool that fails is recorded in its cell (`error`, with the tail of its output) and the benchmark goes on; the exit
code is 1 if any run failed, 2 for bad arguments. Temp files (models, data, runs) are removed at the end unless
--keep DIR. Needs no root: the node is `connection: local`.

--ci: the CI-sized form (tiny; long rows with both methods, variable rows with LoRA, and one 2-rank cell
(variable, LoRA); 8 iters, 1 round, warm-up 2, calibration budget 2 s):
tests/unit/test_bench_train.py runs it and checks the JSON contract. On the NVIDIA GPU machine the device tool
lends, see benchmarks/device_train.sh for the exact commands (wheels, install, S and M).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the coordinator's playbook defaults are the product's

from coordinator.config.playbook import CalibrationConfig  # noqa: E402 - after the path

DRIVER = ROOT / "benchmarks" / "mlx_lm_driver.py"
TAIL_CHARS = 2000

# Goals (issue 15).
GOAL_TOKENS_RATIO = {"long": 1.0, "short": 1.3, "variable": 1.0, "bimodal": 1.0}
GOAL_MEMORY_RATIO = 1.05
GOAL_PREDICTION = 0.15
# What a user's calibration measures for: the playbook's default, not a cheaper one (see the docstring).
DEFAULT_CALIBRATION_BUDGET: float = CalibrationConfig.model_fields["time_budget"].default


@dataclass(frozen=True)
class ModelSize:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # total tokenizer vocabulary (specials and characters included)
    batch: int
    seq_len: int

    def parameters(self) -> int:
        """Parameter count of worker.tinymodel's llama layout (tied embeddings, no biases)."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden


SIZES = {
    "tiny": ModelSize("tiny", 64, 2, 4, 2, 128, 1000, 4, 128),
    "S": ModelSize("S", 1024, 12, 16, 4, 2816, 32000, 8, 512),
    "M": ModelSize("M", 2048, 22, 32, 8, 4864, 32000, 8, 512),
}
SHAPES = ("long", "short", "variable", "bimodal")
# Not `short`: variable rows take the same packed path, and the suite runs on 2 cores (each cell: two tools' runs).
CI_SHAPES = ("long", "variable")
# `variable`: chat-like lengths, lognormal (issue 25): median VARIABLE_MEDIAN of max_seq_length 512 (scaled with
# max_seq_length), sigma VARIABLE_SIGMA, never below VARIABLE_MIN tokens; the tail is capped at max_seq_length
# (about 3% of rows at sigma 0.8), as a real chat set's longest conversations are truncated to it.
VARIABLE_MEDIAN = 110 / 512
VARIABLE_SIGMA = 0.8
VARIABLE_MIN = 8
# `bimodal` (issue 25: a length distribution calibration was not tuned on): BIMODAL_SHORT of the rows short
# (uniform over 8 .. max_seq_length/8 tokens: one-line instructions), the rest long (uniform over 1/2 .. 1 of
# max_seq_length: documents), shuffled.
BIMODAL_SHORT = 0.7
METHODS = ("lora", "full")
# worker.tinymodel's fixed tokens before the data words: 7 specials, 94 printable ASCII characters, 94 `##` ones.
BASE_VOCAB = 7 + 94 + 94


class BenchError(Exception):
    """A benchmark run that could not be measured: the message says which and why."""


# --- pure parts: data, figures, goals ----------------------------------------------------------------------------


def make_words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct lowercase words of 3+ letters (never a single character, which the tokenizer already
    has), in a seeded order."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = []
    n = 0
    while len(words) < count:
        word, k = "", n
        while True:
            word = letters[k % 26] + word
            k //= 26
            if k == 0:
                break
        words.append("q" + word + "z")  # q...z: 3+ letters, no word is another word's prefix issue for WordPiece
        n += 1
    random.Random(seed).shuffle(words)
    return words


def row_lengths(shape: str, rows: int, seq_len: int, seed: int) -> list[int]:
    """Token lengths (BOS and EOS included) of `rows` rows of `shape`, none above seq_len (mlx-lm warns and
    truncates longer rows; both tools would then train the same truncated rows, but every batch would warn)."""
    rng = random.Random(seed)
    if shape == "long":
        low = seq_len - seq_len // 16
        return [rng.randint(low, seq_len) for _ in range(rows)]
    if shape == "short":
        high = max(16, seq_len // 4)
        return [rng.randint(min(16, high), high) for _ in range(rows)]
    if shape == "variable":
        return variable_lengths(rows, seq_len, rng)
    if shape == "bimodal":
        return [rng.randint(VARIABLE_MIN, max(VARIABLE_MIN, seq_len // 8)) if rng.random() < BIMODAL_SHORT
                else rng.randint(seq_len // 2, seq_len) for _ in range(rows)]
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def variable_lengths(rows: int, seq_len: int, rng: random.Random) -> list[int]:
    """`rows` chat-like token lengths: lognormal around a median of VARIABLE_MEDIAN x seq_len (110 tokens at 512)
    with sigma VARIABLE_SIGMA, rounded, clipped to [VARIABLE_MIN, seq_len]. Deterministic for a given `rng` state
    (random.lognormvariate draws from `rng.random()` only)."""
    mu = math.log(max(VARIABLE_MIN, VARIABLE_MEDIAN * seq_len))
    return [min(seq_len, max(VARIABLE_MIN, round(rng.lognormvariate(mu, VARIABLE_SIGMA)))) for _ in range(rows)]


def mean_length(shape: str, seq_len: int) -> float:
    """The expected token length of a row of `shape` (for sizing the data; the clipping of `variable` ignored)."""
    if shape == "long":
        return seq_len - seq_len // 32
    if shape == "short":
        return (16 + max(16, seq_len // 4)) / 2
    if shape == "bimodal":
        return BIMODAL_SHORT * (VARIABLE_MIN + seq_len // 8) / 2 + (1 - BIMODAL_SHORT) * 0.75 * seq_len
    return min(seq_len, max(VARIABLE_MIN, VARIABLE_MEDIAN * seq_len) * math.exp(VARIABLE_SIGMA**2 / 2))


def make_rows(words: Sequence[str], lengths: Sequence[int], seed: int) -> list[str]:
    """One text per length (length - 2 words: the tokenizer adds BOS, mlx-lm's dataset adds EOS). The first rows
    walk through every word once (so the vocabulary the model was built with is all used), then words repeat at
    random."""
    rng = random.Random(seed)
    order = list(words)
    pos = 0
    texts = []
    for length in lengths:
        chosen = []
        for _ in range(max(1, length - 2)):
            if pos < len(order):
                chosen.append(order[pos])
                pos += 1
            else:
                chosen.append(rng.choice(order))
        texts.append(" ".join(chosen))
    return texts


def train_rows_needed(size: ModelSize, shape: str, iters: int) -> int:
    """Enough rows for `iters` batches without repeating, for every vocabulary word to occur, and at least four
    batches."""
    mean = mean_length(shape, size.seq_len)
    cover = math.ceil(1.2 * (size.vocab - BASE_VOCAB) / max(1.0, mean - 2))
    return max(size.batch * iters, cover, 4 * size.batch)


def steady_median(points: Sequence[tuple[int, float]], warmup: int) -> float | None:
    """Median of the values of steps > warmup ((step, value) pairs; non-positive values ignored); None if no
    step is left (a run shorter than its warm-up)."""
    values = [v for step, v in points if step > warmup and v > 0]
    return statistics.median(values) if values else None


def wall_rates(steps: Sequence[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """(step, tokens / seconds since the previous step's report) from (step, tokens, wall time) in step order;
    the first step has no interval."""
    out = []
    for (_, _, t0), (step, tokens, t1) in itertools.pairwise(steps):
        if t1 > t0:
            out.append((step, tokens / (t1 - t0)))
    return out


def ours_figures(events: Sequence[Mapping[str, Any]], warmup: int) -> dict[str, Any]:
    """Our run's figures from rank 0's events: steady tok/s (the step's tokens over all ranks / step_time_s),
    wall tok/s, peak memory (rank 0's), trainable parameters (the `started` event)."""
    steps = sorted((e for e in events if e.get("event") == "step" and e.get("rank", 0) == 0),
                   key=lambda e: int(e["step"]))
    def tokens(e: Mapping[str, Any]) -> float:
        return float(e.get("total_tokens") or e.get("tokens") or 0)  # every rank's tokens (a 2-rank cell)

    per_step = [(int(e["step"]), tokens(e) / float(e["step_time_s"])) for e in steps
                if e.get("step_time_s") and tokens(e)]
    wall = wall_rates([(int(e["step"]), tokens(e), float(e["t"])) for e in steps])
    started = next((e for e in events if e.get("event") == "started" and e.get("rank", 0) == 0), {})
    peaks = [int(e["peak_memory"]) for e in steps if e.get("peak_memory")]
    return {
        "tokens_per_s": steady_median(per_step, warmup),
        "wall_tokens_per_s": steady_median(wall, warmup),
        "peak_memory": max(peaks) if peaks else None,
        "steps": len(steps),
        "step_tokens_per_s": [round(v, 2) for _, v in per_step],
        "trainable_params": started.get("trainable_params"),
        "total_params": started.get("total_params"),
    }


def mlx_lm_figures(out: Mapping[str, Any], warmup: int) -> dict[str, Any]:
    """mlx-lm's figures from the driver's reports (--steps-per-report 1: one report per step)."""
    reports = sorted(out.get("reports", []), key=lambda r: r["iteration"])
    per_step = [(int(r["iteration"]), float(r["tokens_per_second"])) for r in reports]
    # tokens of a step = tokens_per_second x the step's time = tokens_per_second / iterations_per_second
    wall = wall_rates([(int(r["iteration"]), float(r["tokens_per_second"]) / float(r["iterations_per_second"]),
                        float(r["wall_s"])) for r in reports if r.get("iterations_per_second")])
    peaks = [float(r["peak_memory"]) for r in reports if r.get("peak_memory")]
    return {
        "tokens_per_s": steady_median(per_step, warmup),
        "wall_tokens_per_s": steady_median(wall, warmup),
        "peak_memory": round(max(peaks) * 1e9) if peaks else None,  # mlx-lm reports GB (1e9 bytes)
        "steps": len(reports),
        "step_tokens_per_s": [round(v, 2) for _, v in per_step],
        "trainable_params": out.get("trainable_params"),
        "total_params": out.get("total_params"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_of(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_cell(cell: Mapping[str, Any]) -> dict[str, Any]:
    """Medians over rounds, ratios (ours / mlx-lm) and the goals of one cell from its runs."""
    ours = [r for r in cell["runs"] if r["tool"] == "ours" and not r.get("error")]
    theirs = [r for r in cell["runs"] if r["tool"] == "mlx_lm" and not r.get("error")]
    o = {k: median_of(ours, k) for k in ("tokens_per_s", "wall_tokens_per_s", "peak_memory", "summary_tokens_per_s",
                                          "predicted_tokens_per_s")}
    m = {k: median_of(theirs, k) for k in ("tokens_per_s", "wall_tokens_per_s", "peak_memory")}
    tok_ratio = ratio(o["tokens_per_s"], m["tokens_per_s"])
    mem_ratio = ratio(o["peak_memory"], m["peak_memory"])
    pred_err = (o["predicted_tokens_per_s"] / o["summary_tokens_per_s"] - 1.0
                if o["predicted_tokens_per_s"] and o["summary_tokens_per_s"] else None)
    paired = []
    for rnd in sorted({r["round"] for r in cell["runs"]}):
        a = next((r for r in ours if r["round"] == rnd), None)
        b = next((r for r in theirs if r["round"] == rnd), None)
        if a and b:
            paired.append(ratio(a.get("tokens_per_s"), b.get("tokens_per_s")))
    trainable = {r.get("trainable_params") for r in ours + theirs if r.get("trainable_params")}
    return {
        "ours": o,
        "mlx_lm": m,
        "ratio": {"tokens_per_s": tok_ratio, "wall_tokens_per_s": ratio(o["wall_tokens_per_s"],
                                                                        m["wall_tokens_per_s"]),
                  "peak_memory": mem_ratio, "paired_tokens_per_s": paired},
        "prediction_error": pred_err,
        "same_trainable": len(trainable) == 1 if trainable else None,
        "goals": evaluate_goals(cell["shape"], tok_ratio, mem_ratio, pred_err),
    }


def evaluate_goals(shape: str, tok_ratio: float | None, mem_ratio: float | None,
                   pred_err: float | None) -> dict[str, str]:
    """met / missed / unmeasured for each goal of issue 15."""
    def verdict(ok: bool | None) -> str:
        return "unmeasured" if ok is None else ("met" if ok else "missed")

    goal = GOAL_TOKENS_RATIO[shape]
    return {
        "tokens_per_s": verdict(None if tok_ratio is None else tok_ratio >= goal),
        "peak_memory": verdict(None if mem_ratio is None else mem_ratio <= GOAL_MEMORY_RATIO),
        "prediction": verdict(None if pred_err is None else abs(pred_err) <= GOAL_PREDICTION),
    }


def round_order(rnd: int, ranks: int = 1) -> tuple[str, ...]:
    """ABBA: odd rounds ours first, even rounds mlx-lm first. A 2-rank cell runs ours only: its figure is the
    prediction against the run (mlx-lm's CLI has no calibrated split to compare with)."""
    if ranks > 1:
        return ("ours",)
    return ("ours", "mlx_lm") if rnd % 2 == 1 else ("mlx_lm", "ours")


def plan_cells(sizes: Sequence[str], shapes: Sequence[str], methods: Sequence[str], ranks: Sequence[int],
               ci: bool = False) -> list[tuple[str, str, str, int]]:
    """(size, shape, method, ranks) of every cell, in run order. `ci` keeps the CI-sized form short: every method
    on the first shape, the first method on the others, and one 2-rank cell (the last shape, first method)."""
    cells = [(size, shape, method, n) for size in sizes for n in ranks for shape in shapes for method in methods]
    if ci:
        one = [c for c in cells if c[3] == 1 and (c[1] == shapes[0] or c[2] == methods[0])]
        two = [c for c in cells if c[3] > 1 and c[1] == shapes[-1] and c[2] == methods[0]]
        cells = one + two[:1]
    return cells


# --- I/O: building, running ---------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_jsonl(path: Path, texts: Sequence[str]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")


def build_data(root: Path, size: ModelSize, shape: str, iters: int, words: Sequence[str]) -> Path:
    out = root / f"data-{size.name}-{shape}"
    out.mkdir(parents=True, exist_ok=True)
    rows = train_rows_needed(size, shape, iters)
    write_jsonl(out / "train.jsonl", make_rows(words, row_lengths(shape, rows, size.seq_len, 1), 2))
    valid = make_rows(words[::-1], row_lengths(shape, 2 * size.batch, size.seq_len, 3), 4)
    write_jsonl(out / "valid.jsonl", valid)
    return out


def build_model(root: Path, size: ModelSize, words: Sequence[str], dtype: str, env: Mapping[str, str]) -> Path:
    """The size's model dir, built in a subprocess (this process never imports mlx, so it holds no device
    memory while the tools run). The vocabulary is `words` (each one token), whatever the data shape."""
    vocab_dir = root / f"vocab-{size.name}"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    # collect_words sorts by frequency then spelling: one row per word keeps them all, each once.
    write_jsonl(vocab_dir / "train.jsonl", words)
    out = root / f"model-{size.name}"
    spec = {"out": str(out), "vocab_dir": str(vocab_dir), "dtype": dtype, "max_words": len(words),
            "max_positions": max(2048, size.seq_len), **asdict(size)}
    stamp = out / "bench-spec.json"
    if stamp.exists() and json.loads(stamp.read_text(encoding="utf-8")) == spec:
        return out  # built by an earlier run with the same --keep dir (M takes a minute to build)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--build-model", json.dumps(spec)]
    proc = subprocess.run(cmd, env=dict(env), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"building model {size.name} failed: {(proc.stderr or proc.stdout)[-TAIL_CHARS:]}")
    stamp.write_text(json.dumps(spec), encoding="utf-8")
    return out


def build_model_here(spec: Mapping[str, Any]) -> None:
    """--build-model: worker.tinymodel's builder with this size's shape, then the weights cast to `dtype`."""
    from worker.tinymodel import build_tiny_model

    out = Path(spec["out"])
    build_tiny_model(out, Path(spec["vocab_dir"]), layers=spec["layers"], hidden=spec["hidden"], seed=0,
                     heads=spec["heads"], kv_heads=spec["kv_heads"], intermediate=spec["intermediate"],
                     max_words=spec["max_words"], max_positions=spec["max_positions"])
    if spec["dtype"] != "float32":
        import mlx.core as mx

        weights = mx.load(str(out / "model.safetensors"))
        assert isinstance(weights, dict)  # a .safetensors file loads as {name: array}
        dtype = getattr(mx, spec["dtype"])
        mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()},
                            metadata={"format": "mlx"})
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype"] = spec["dtype"]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_inventory(root: Path, ranks: int = 1) -> Path:
    """One local node per rank: the benchmark's machine, no SSH (mlx.launch starts the ranks on 127.0.0.1, over
    a loopback ring when there are two), each with its own workdir."""
    path = root / ("inventory.yaml" if ranks == 1 else f"inventory-{ranks}.yaml")
    nodes = "".join(f"  - name: bench{'' if i == 0 else f'-{i}'}\n"
                    f"    workdir: {json.dumps(str(root / ('node' if i == 0 else f'node-{i}')))}\n"
                    for i in range(ranks))
    path.write_text("# Local nodes on the benchmark's machine, no SSH.\ndefaults:\n  connection: local\n"
                    f"nodes:\n{nodes}", encoding="utf-8")
    return path


def write_playbook(root: Path, cell: str, model: Path, data: Path, size: ModelSize, method: str, iters: int,
                   calibration_budget: float, clear_cache: bool = False, memory_headroom: str | None = None) -> Path:
    path = root / f"playbook-{cell}.yaml"
    path.write_text(
        f"name: bench-{cell}\n"
        "kind: train\n"
        f"model: {json.dumps(str(model))}\n"
        f"data: {json.dumps(str(data))}\n"
        "backend: ring\n"
        "split: calibrated\n"
        "train:\n"
        f"  method: {method}\n"
        f"  iters: {iters}\n"
        f"  batch_size: {size.batch}\n"
        "  learning_rate: 1.0e-5\n"
        f"  max_seq_length: {size.seq_len}\n"
        "  num_layers: -1\n"
        "  optimizer: adam\n"
        "  seed: 0\n"
        f"  save_every: {iters}\n"
        f"  steps_per_eval: {iters}\n"
        "  val_batches: 1\n"
        # Data parallel, as mlx-lm trains: under `auto` the 2-rank cell's two local ranks may be planned as a
        # pipeline, which has no gradient all_sum to predict.
        "  strategy: dp\n"
        + ("  clear_cache: true\n" if clear_cache else "")
        + (f"  memory_headroom: {'null' if memory_headroom == 'none' else memory_headroom}\n"
           if memory_headroom is not None else "")
        + "calibration:\n"
        f"  time_budget: {calibration_budget}\n"
        f"  max_batch: {size.batch}\n",
        encoding="utf-8")
    return path


def mlx_lm_argv(model: Path, data: Path, size: ModelSize, method: str, iters: int, adapter_path: Path) -> list[str]:
    """What `mlx_lm lora` gets: the same settings as the playbook."""
    return ["--model", str(model), "--train", "--data", str(data), "--fine-tune-type", method,
            "--optimizer", "adam", "--num-layers", "-1", "--batch-size", str(size.batch), "--iters", str(iters),
            "--val-batches", "1", "--learning-rate", "1e-5", "--steps-per-report", "1",
            "--steps-per-eval", str(iters), "--save-every", str(iters), "--max-seq-length", str(size.seq_len),
            "--adapter-path", str(adapter_path), "--seed", "0"]


def tail(text: str) -> str:
    return text[-TAIL_CHARS:]


def run_ours(root: Path, inventory: Path, playbook: Path, env: Mapping[str, str], warmup: int,
             recalibrate: bool, skip_preflight: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "coordinator", "launch", "-i", str(inventory), str(playbook), "--json",
           "--run-dir", str(root / "runs")]
    cmd += (["--recalibrate"] if recalibrate else []) + (["--skip-preflight"] if skip_preflight else [])
    tic = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(env), cwd=root, capture_output=True, text=True)
    elapsed = time.perf_counter() - tic
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise BenchError(f"`coordinator launch` exited {proc.returncode} without summary JSON: "
                         f"{tail(proc.stderr or proc.stdout)}") from None
    if summary.get("state") != "succeeded":
        raise BenchError(f"`coordinator launch` run {summary.get('run_id')} {summary.get('state')}: "
                         f"{summary.get('message')}; {tail(proc.stderr)}")
    node = summary["nodes"][0]
    events_path = Path(node["run_dir"]) / "events" / "rank0.jsonl"
    events = [json.loads(line) for line in events_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    # Weights and optimizer state are not measured, and M's fill the device's 64 GiB disk within a few runs.
    for each in summary["nodes"]:
        shutil.rmtree(Path(each["run_dir"]) / "checkpoints", ignore_errors=True)
    figures = ours_figures(events, warmup)
    plan_path = root / "runs" / str(summary.get("run_id")) / "plan.json"
    rehearsal = (json.loads(plan_path.read_text(encoding="utf-8")).get("step") or {}).get("rehearsal") \
        if plan_path.exists() else None
    figures.update({"rehearsal": rehearsal})  # its own rate (timed_tokens_per_s) and the step tokens it was moved by
    figures.update({"summary_tokens_per_s": summary.get("tokens_per_s"),
                    "predicted_tokens_per_s": summary.get("predicted_tokens_per_s"),
                    "summary_peak_memory": node.get("peak_memory"), "run_id": summary.get("run_id"),
                    "process_s": round(elapsed, 2), "command": shlex.join(cmd)})
    return figures


def run_mlx_lm(root: Path, argv: Sequence[str], trainable: str, env: Mapping[str, str], warmup: int,
               tag: str) -> dict[str, Any]:
    out = root / f"mlx_lm-{tag}.json"
    cmd = [sys.executable, str(DRIVER), "--bench-out", str(out), "--bench-trainable", trainable, "--", *argv]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(env), cwd=root, capture_output=True, text=True)
    elapsed = time.perf_counter() - tic
    shutil.rmtree(argv[argv.index("--adapter-path") + 1], ignore_errors=True)  # as for ours' checkpoints
    if proc.returncode != 0 or not out.exists():
        raise BenchError(f"mlx_lm driver exited {proc.returncode}: {tail(proc.stderr or proc.stdout)}")
    result = json.loads(out.read_text(encoding="utf-8"))
    figures = mlx_lm_figures(result, warmup)
    figures.update({"process_s": round(elapsed, 2), "trainable": trainable, "versions": result.get("versions"),
                    "command": "mlx_lm lora " + shlex.join(argv)})
    return figures


def probe_versions(env: Mapping[str, str]) -> dict[str, Any]:
    code = ("import json, platform, sys, mlx.core as mx, mlx_lm\n"
            "info = {}\n"
            "try:\n    info = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in mx.device_info().items()}\n"
            "except Exception as exc:\n    info = {'error': str(exc)}\n"
            "cuda = getattr(getattr(mx, 'cuda', None), 'is_available', lambda: False)()\n"
            "print(json.dumps({'python': sys.version.split()[0], 'mlx': mx.__version__, 'mlx_lm': mlx_lm.__version__,"
            " 'default_device': str(mx.default_device()), 'cuda': bool(cuda), 'device_info': info,"
            " 'platform': platform.platform(), 'machine': platform.machine()}))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"cannot import mlx/mlx_lm: {tail(proc.stderr)}")
    versions: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    versions["cpus"] = os.cpu_count()
    with contextlib.suppress(OSError, ValueError):
        versions["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    with contextlib.suppress(OSError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if gpu.returncode == 0:
            versions["gpu"] = gpu.stdout.strip()
    return versions


def git_commit() -> str:
    """HEAD (+dirty) of the code measured. $BENCH_COMMIT, when set, wins: the device tool's copy of the tree may
    carry a stale .git whose HEAD is not the code sent (seen: every device result named an old commit)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = proc.stdout.strip() if proc.returncode == 0 else ""
    if not commit:
        return os.environ.get("BENCH_COMMIT") or "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return commit + ("+dirty" if dirty else "")


# --- report -------------------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def render(results: Mapping[str, Any]) -> str:
    lines = [f"### Training: ours vs `mlx_lm lora` ({results['started']})", "",
             "```sh", results["command"], "```", "",
             f"Commit {results['commit']}; {results['machine']}. {results['settings_text']}", "",
             "| size | shape | method | ranks | ours tok/s | mlx-lm tok/s | ratio (goal) | wall tok/s ratio "
             "| ours peak MiB | mlx-lm peak MiB | mem ratio (<= 1.05) | predicted / run median tok/s | error (+-15%) "
             "| trainable |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cell in results["cells"]:
        s = cell.get("summary")
        if not s:
            continue
        o, m, r, g = s["ours"], s["mlx_lm"], s["ratio"], s["goals"]
        goal = GOAL_TOKENS_RATIO[cell["shape"]]
        trainable = {x.get("trainable_params") for x in cell["runs"] if x.get("trainable_params")}
        same = "same" if s["same_trainable"] else ("DIFFERENT" if s["same_trainable"] is False else "-")
        lines.append(
            f"| {cell['size']} | {cell['shape']} | {cell['method']} | {cell.get('ranks', 1)} | "
            f"{fmt(o['tokens_per_s'])} | "
            f"{fmt(m['tokens_per_s'])} | **{fmt(r['tokens_per_s'], '.2f', 'x')}** (>= {goal}x: {g['tokens_per_s']}) | "
            f"{fmt(r['wall_tokens_per_s'], '.2f', 'x')} | {mib(o['peak_memory'])} | {mib(m['peak_memory'])} | "
            f"{fmt(r['peak_memory'], '.2f', 'x')} ({g['peak_memory']}) | "
            f"{fmt(o['predicted_tokens_per_s'])} / {fmt(o['summary_tokens_per_s'])} | "
            f"{fmt(None if s['prediction_error'] is None else 100 * s['prediction_error'], '+.1f', '%')} "
            f"({g['prediction']}) | {same} ({', '.join(f'{t:,}' for t in sorted(trainable))}) |")
    lines += ["", "Per run (round, order, steady tok/s, wall tok/s, peak MiB, seconds of the whole process):", ""]
    for cell in results["cells"]:
        for run in cell["runs"]:
            what = (f"error: {run['error'][:300]}" if run.get("error") else
                    f"{fmt(run.get('tokens_per_s'))} tok/s, wall {fmt(run.get('wall_tokens_per_s'))}, "
                    f"peak {mib(run.get('peak_memory'))} MiB, {fmt(run.get('process_s'))} s")
            lines.append(f"- {cell['tag']} round {run['round']} "
                         f"({run['position']}) {run['tool']}: {what}")
    return "\n".join(lines) + "\n"


# --- main ---------------------------------------------------------------------------------------------------------


@dataclass
class Options:
    sizes: list[str]
    shapes: list[str]
    methods: list[str]
    iters: int
    rounds: int
    warmup: int
    dtype: str
    calibration_budget: float
    recalibrate: bool
    skip_preflight: bool
    json_path: Path | None
    keep: Path | None
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    clear_cache: bool = False
    ranks: list[int] = field(default_factory=lambda: [1])
    memory_headroom: str | None = None
    ci: bool = False
    build_only: bool = False


def parse_args(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(prog="bench_train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="S,M", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--shapes", default="long,short", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--methods", default="lora,full", help="comma-separated: " + ", ".join(METHODS))
    p.add_argument("--iters", type=int, default=40, help="training steps per run")
    p.add_argument("--rounds", type=int, default=2, help="rounds (ABBA order alternates between rounds)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady medians")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the models' weight dtype")
    p.add_argument("--calibration-budget", type=float, default=DEFAULT_CALIBRATION_BUDGET,
                   help="seconds of calibration steps (default: the playbook's calibration.time_budget, "
                        f"{DEFAULT_CALIBRATION_BUDGET:g})")
    p.add_argument("--recalibrate", action="store_true", help="calibrate again for every run of ours")
    p.add_argument("--clear-cache", action="store_true",
                   help="ours with train.clear_cache (mx.clear_cache() after every step, as mlx-lm's trainer does)")
    p.add_argument("--memory-headroom", default=None,
                   help="ours with this train.memory_headroom (a number, or none: unbounded); default: the playbook's")
    p.add_argument("--skip-preflight", action="store_true",
                   help="pass --skip-preflight to `coordinator launch` (preflight still runs and is shown; a "
                        "finding on an unfamiliar machine then does not stop the measurement)")
    p.add_argument("--json", dest="json_path", type=Path, help="write the raw results here (after every run)")
    p.add_argument("--keep", type=Path, help="keep models, data and runs in this directory (created)")
    p.add_argument("--ranks", default="1", help="comma-separated rank counts: 1 (ours vs mlx-lm) and/or 2 (ours "
                   "on two local ranks over ring: the prediction vs the run)")
    p.add_argument("--ci", action="store_true", help="the CI-sized form: tiny, 3 one-rank cells and a 2-rank one, "
                   "8 iters")
    p.add_argument("--build-only", action="store_true",
                   help="build the cells' models and data sets into --keep and stop (for the probes in benchmarks/)")
    args = p.parse_args(argv)
    if args.ci:
        args.sizes, args.shapes, args.methods, args.ranks = "tiny", ",".join(CI_SHAPES), "lora,full", "1,2"
        args.iters, args.rounds, args.warmup, args.calibration_budget = 8, 1, 2, 2.0

    def pick(text: str, known: Sequence[str], what: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in known]
        if bad or not items:
            p.error(f"--{what}: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
        return items

    opts = Options(pick(args.sizes, list(SIZES), "sizes"), pick(args.shapes, SHAPES, "shapes"),
                   pick(args.methods, METHODS, "methods"), args.iters, args.rounds, args.warmup, args.dtype,
                   args.calibration_budget, args.recalibrate, args.skip_preflight, args.json_path, args.keep,
                   clear_cache=args.clear_cache, ranks=[int(r) for r in pick(args.ranks, ["1", "2"], "ranks")],
                   ci=args.ci, memory_headroom=args.memory_headroom, build_only=args.build_only)
    if opts.iters < 2 or opts.rounds < 1 or opts.warmup < 0 or opts.calibration_budget <= 0:
        p.error("--iters >= 2, --rounds >= 1, --warmup >= 0 and --calibration-budget > 0 are required")
    if opts.build_only and opts.keep is None:
        p.error("--build-only needs --keep DIR: what it builds is kept there")
    if opts.warmup >= opts.iters:
        p.error(f"--warmup ({opts.warmup}) must be below --iters ({opts.iters}): no step would be left to measure")
    opts.command = shlex.join([".venv/bin/python", "benchmarks/bench_train.py", *argv])
    return opts


@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["XDG_CACHE_HOME"] = str(root / "xdg-cache")
    env["XDG_STATE_HOME"] = str(root / "xdg-state")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TOKENIZERS_PARALLELISM", None)  # each tool sets its own (ours: false, mlx-lm: true)
    return env


def write_json(path: Path | None, results: Mapping[str, Any]) -> None:
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def run(opts: Options) -> int:
    failed = 0
    with workdir(opts.keep) as root:
        env = bench_env(root)
        versions = probe_versions(env)
        machine = (f"{versions.get('gpu') or versions['default_device']}, {versions['cpus']} CPUs, "
                   f"{versions.get('memory_gib')} GiB, {versions['platform']}, Python {versions['python']}, "
                   f"mlx {versions['mlx']}, mlx-lm {versions['mlx_lm']}")
        settings = (f"iters {opts.iters}, rounds {opts.rounds} (ABBA), warm-up {opts.warmup} steps, "
                    f"dtype {opts.dtype}, adam lr 1e-5, all layers, calibration budget {opts.calibration_budget} s"
                    f"{' (recalibrated every run)' if opts.recalibrate else ''}"
                    f"{'; ours with train.clear_cache' if opts.clear_cache else ''}"
                    f"{'' if opts.memory_headroom is None else '; ours with memory_headroom ' + opts.memory_headroom}")
        results: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": opts.command,
            "commit": git_commit(), "machine": machine, "versions": versions, "settings_text": settings,
            "settings": {"iters": opts.iters, "rounds": opts.rounds, "warmup": opts.warmup, "dtype": opts.dtype,
                         "calibration_budget": opts.calibration_budget, "recalibrate": opts.recalibrate,
                         "learning_rate": 1e-5, "optimizer": "adam", "num_layers": -1},
            "goals": {"tokens_per_s": GOAL_TOKENS_RATIO, "peak_memory": GOAL_MEMORY_RATIO,
                      "prediction": GOAL_PREDICTION},
            "sizes": {n: {**asdict(SIZES[n]), "parameters": SIZES[n].parameters()} for n in opts.sizes},
            "cells": [],
        }
        log(f"{machine}; work dir {root}")
        inventories = {n: write_inventory(root, n) for n in opts.ranks}
        cells: list[dict[str, Any]] = []
        models: dict[str, Path] = {}
        datas: dict[tuple[str, str], Path] = {}
        for name, shape, method, ranks in plan_cells(opts.sizes, opts.shapes, opts.methods, opts.ranks, opts.ci):
            size = SIZES[name]
            words = make_words(size.vocab - BASE_VOCAB)
            if name not in models:
                log(f"building model {name} ({size.parameters():,} parameters, {opts.dtype})")
                models[name] = build_model(root, size, words, opts.dtype, env)
            if (name, shape) not in datas:
                datas[name, shape] = build_data(root, size, shape, opts.iters, words)
            model, data = models[name], datas[name, shape]
            tag = f"{name}-{shape}-{method}" + (f"-{ranks}r" if ranks > 1 else "")
            cells.append({"size": name, "shape": shape, "method": method, "ranks": ranks, "runs": [],
                          "playbook": str(write_playbook(root, tag, model, data, size, method, opts.iters,
                                                         opts.calibration_budget, opts.clear_cache,
                                                         opts.memory_headroom)),
                          "mlx_lm_argv": mlx_lm_argv(model, data, size, method, opts.iters, root / f"adapters-{tag}"),
                          "tag": tag})
        results["cells"] = cells
        if opts.build_only:
            for (name, shape), data in datas.items():
                print(f"{name} {shape}: model {models[name]} data {data}")
            return 0
        for rnd in range(1, opts.rounds + 1):
            for cell in cells:
                for position, tool in enumerate(round_order(rnd, cell["ranks"]), 1):
                    log(f"round {rnd}/{opts.rounds} {cell['tag']}: {tool}")
                    record: dict[str, Any] = {"tool": tool, "round": rnd, "position": position}
                    try:
                        if tool == "ours":
                            record.update(run_ours(root, inventories[cell["ranks"]], Path(cell["playbook"]), env,
                                                opts.warmup,
                                                opts.recalibrate, opts.skip_preflight))
                        else:
                            record.update(run_mlx_lm(root, cell["mlx_lm_argv"], trainable_for(cell),
                                                  env, opts.warmup, f"{cell['tag']}-r{rnd}"))
                    except (BenchError, OSError, KeyError, ValueError) as exc:
                        failed += 1
                        record["error"] = str(exc)
                        log(f"  failed: {str(exc)[:500]}")
                    else:
                        log(f"  {fmt(record.get('tokens_per_s'))} tok/s steady, peak "
                            f"{mib(record.get('peak_memory'))} MiB, {record.get('process_s')} s")
                    cell["runs"].append(record)
                    cell["summary"] = summarize_cell(cell)
                    write_json(opts.json_path, results)
        print(render(results))
    return 1 if failed else 0


def trainable_for(cell: Mapping[str, Any]) -> str:
    """mlx-lm's trainable set for this cell: `all` when ours trained every parameter (full with all layers in
    worker.train today), else mlx-lm's own. Decided from ours' `started` event when a run of ours exists; before
    that (mlx-lm first), from the method: full -> all."""
    ours = next((r for r in cell["runs"] if r["tool"] == "ours" and r.get("trainable_params")), None)
    if ours is not None:
        return "all" if ours["trainable_params"] == ours.get("total_params") else "mlx-lm"
    return "all" if cell["method"] == "full" else "mlx-lm"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--build-model"]:
        build_model_here(json.loads(argv[1]))
        return 0
    opts = parse_args(argv)
    try:
        return run(opts)
    except BenchError as exc:
        print(f"bench_train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
