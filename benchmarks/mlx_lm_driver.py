"""Run `mlx_lm lora` in-process with a measuring callback: the mlx-lm side of benchmarks/bench_train.py.

    python benchmarks/mlx_lm_driver.py --bench-out OUT.json [--bench-trainable mlx-lm|all] -- MLX_LM_LORA_ARGV...

MLX_LM_LORA_ARGV is exactly what one would give `mlx_lm lora` (`--model DIR --train --data DIR --fine-tune-type lora
--num-layers -1 --batch-size 8 --iters 50 ...`). It is parsed by mlx-lm's own parser and completed with mlx-lm's own
CONFIG_DEFAULTS, as `mlx_lm.lora.main` does; then this driver does what `mlx_lm.lora.run` does (seed numpy, `load`
the model, `load_dataset`, `train_model`), with one difference: `run` builds its callback from `--report-to`, and
the driver passes its own `TrainingCallback` to `train_model` instead, which records every `on_train_loss_report`
(so pass `--steps-per-report 1` for per-step figures) with the wall-clock time of the report. mlx-lm's Rich
progress UI is left as it is (it goes to the captured stdout); nothing is parsed from it.

`--bench-trainable all`: unfreeze the whole model just before `mlx_lm.tuner.trainer.train` starts, so `full` trains
every parameter (embeddings, final norm) like a `full` run of ours with all layers; `mlx-lm` (the default) keeps
mlx-lm's own trainable set (for `full`: the transformer blocks only). The trainable and total parameter counts are
recorded either way, so the benchmark can show that both tools trained the same set.

OUT.json: {"argv", "args" (the resolved namespace), "reports": [{iteration, train_loss, learning_rate,
iterations_per_second, tokens_per_second, trained_tokens, peak_memory (GB, as mlx-lm reports it), wall_s}],
"trainable_params", "total_params", "trainable", "versions", "load_s", "train_s"}. Exit 0 after training; any
error propagates (traceback on stderr, exit 1): the benchmark shows the stderr tail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any


def parse_mlx_lm_args(argv: list[str]) -> types.SimpleNamespace:
    """`mlx_lm lora ARGV` resolved as `mlx_lm.lora.main` resolves it (command line, then CONFIG_DEFAULTS)."""
    from mlx_lm import lora

    args: dict[str, Any] = vars(lora.build_parser().parse_args(argv))
    if args.get("config"):
        raise SystemExit("mlx_lm_driver: -c/--config is not supported; pass the options on the command line")
    for key, value in lora.CONFIG_DEFAULTS.items():
        if args.get(key) is None:
            args[key] = value
    return types.SimpleNamespace(**args)


class Recorder:
    """mlx-lm's TrainingCallback protocol: keeps every train report with its wall-clock time."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.start = time.perf_counter()

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        self.reports.append({**{k: float(v) for k, v in info.items()}, "wall_s": time.perf_counter() - self.start})

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("mlx_lm_driver: usage: --bench-out OUT.json [--bench-trainable mlx-lm|all] -- MLX_LM_LORA_ARGV",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    own = argparse.ArgumentParser(prog="mlx_lm_driver")
    own.add_argument("--bench-out", required=True, type=Path)
    own.add_argument("--bench-trainable", choices=["mlx-lm", "all"], default="mlx-lm")
    opts = own.parse_args(argv[:cut])
    lora_argv = argv[cut + 1:]

    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # as mlx_lm.lora.main sets it
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm import lora
    from mlx_lm.tuner import trainer
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import get_total_parameters, load

    args = parse_mlx_lm_args(lora_argv)
    counts: dict[str, int] = {}
    real_train = lora.train

    def train(*targs: Any, **kwargs: Any) -> Any:
        model = kwargs["model"]
        if opts.bench_trainable == "all":
            model.unfreeze()
        counts["trainable"] = sum(int(v.size) for _, v in tree_flatten(model.trainable_parameters()))
        counts["total"] = int(get_total_parameters(model))
        return real_train(*targs, **kwargs)

    # train_model calls the `train` it imported from mlx_lm.tuner.trainer; this wrapper only counts (and, for
    # --bench-trainable all, unfreezes) before handing over to it.
    lora.train = train
    recorder = Recorder()
    tic = time.perf_counter()
    # What mlx_lm.lora.run does for --train, with our callback instead of get_reporting_callbacks(report_to).
    np.random.seed(args.seed)
    model, tokenizer = load(args.model, tokenizer_config={"trust_remote_code": args.trust_remote_code},
                            trust_remote_code=args.trust_remote_code)[:2]
    train_set, valid_set, _test_set = load_dataset(args, tokenizer)
    load_s = time.perf_counter() - tic
    recorder.start = time.perf_counter()
    lora.train_model(args, model, train_set, valid_set, recorder)
    train_s = time.perf_counter() - recorder.start
    assert trainer.train is real_train  # the trainer module itself was never patched
    out = {
        "argv": lora_argv,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), dict))},
        "reports": recorder.reports,
        "trainable_params": counts.get("trainable"),
        "total_params": counts.get("total"),
        "trainable": opts.bench_trainable,
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": sys.version.split()[0]},
        "load_s": load_s,
        "train_s": train_s,
    }
    opts.bench_out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
