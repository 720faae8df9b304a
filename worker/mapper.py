"""Separate-batches worker: `python -m worker.mapper` with its config as JSON on stdin. Runs on one node, no
collectives: it works through the rows of its ranges of the input JSONL and prints, on stdout, one JSON line per
result and per event. The coordinator reads them over this node's own SSH channel (the channel is the origin),
so a result is safe on the coordinator the moment it is printed: a node that dies loses nothing it reported.

Config keys: model, input (path of the JSONL), task (score | generate | command), field, prompt_field,
batch_size, max_seq_length, generate {max_tokens, temperature, top_p, seed}, command {module, args},
ranges [[start, end], ...] (rows = non-blank lines, 0-based, half-open), bench (null, or seconds: measure
examples/s over the first rows instead), heartbeat_s, workdir (for `command` shards), debug {exit_after,
sleep_s} (tests).

Lines printed: {"src": "result", "index": i, ...task fields} and {"src": "event", "event": K, ...} with K in
started (pid, rows), progress (done, rows, rows_per_s), heartbeat (done), finished (done, seconds), error (message),
or for bench {"src": "bench", "examples_per_s", "rows", "seconds"}.

Task fields: score -> logprob (sum over the scored tokens), tokens, nll (mean), perplexity; generate ->
completion, completion_tokens, finish_reason; command -> whatever object the module wrote for the row.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

Range = tuple[int, int]


class MapError(RuntimeError):
    """A row or a setting the task cannot use."""


class Out:
    """Thread-safe JSON lines on stdout (the heartbeat thread and the main thread both print)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def emit(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, allow_nan=False, default=str)
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def event(self, kind: str, **fields: Any) -> None:
        self.emit({"src": "event", "event": kind, "t": time.time(), **fields})


def read_rows(path: Path, ranges: Sequence[Range]) -> Iterator[tuple[int, Any]]:
    """(index, decoded row) for the wanted rows, in file order; rows are the non-blank lines."""
    wanted = sorted((a, b) for a, b in ranges if b > a)
    if not wanted:
        return
    last = wanted[-1][1]
    index = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if any(a <= index < b for a, b in wanted):
                try:
                    yield index, json.loads(line)
                except ValueError as exc:
                    raise MapError(f"{path}:{lineno}: not JSON: {exc}") from None
            index += 1
            if index >= last:
                return


def _text(row: Any, field: str, tokenizer: Any, where: int) -> str:
    if not isinstance(row, dict) or field not in row:
        raise MapError(f"row {where}: no field {field!r}")
    value = row[field]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        if getattr(tokenizer, "chat_template", None) is None:
            raise MapError(f"row {where}: {field!r} holds chat messages but the tokenizer has no chat template")
        return str(tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True))
    raise MapError(f"row {where}: field {field!r} must be a string or chat messages")


class Scorer:
    """Log-likelihood of `field` (after `prompt_field`, when given) under the model, in batches."""

    def __init__(self, model: Any, tokenizer: Any, cfg: dict[str, Any]) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.field, self.prompt_field = cfg["field"], cfg.get("prompt_field")
        self.max_seq_length = int(cfg.get("max_seq_length", 2048))
        self.batch_size = int(cfg.get("batch_size", 8))

    def encode(self, index: int, row: Any) -> tuple[list[int], int]:
        text = _text(row, self.field, self.tokenizer, index)
        if self.prompt_field:
            prompt = _text(row, self.prompt_field, self.tokenizer, index)
            ids = [int(t) for t in self.tokenizer.encode(prompt + text)]
            return ids, len(self.tokenizer.encode(prompt))
        return [int(t) for t in self.tokenizer.encode(text)], 0

    def results(self, rows: Iterator[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        batch: list[tuple[int, Any]] = []
        for item in rows:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield from self._score(batch)
                batch = []
        if batch:
            yield from self._score(batch)

    def _score(self, batch: list[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        import numpy as np

        from worker.data import build_batch, sequence_logps

        items = [self.encode(i, row) for i, row in batch]
        tokens, lengths = build_batch(items, self.max_seq_length)
        logps, counts = sequence_logps(self.model, tokens, lengths)
        for (index, _), lp, n in zip(batch, np.asarray(logps, dtype=np.float64).tolist(),
                                     np.asarray(counts).tolist()):
            nll = -lp / n if n else None
            yield {"index": index, "logprob": lp, "tokens": int(n), "nll": nll,
                   "perplexity": math.exp(nll) if nll is not None and nll < 700 else None}


class Generator:
    """Completions with mlx-lm's sampler; row i is sampled with seed + i (the same whichever node runs it)."""

    def __init__(self, model: Any, tokenizer: Any, cfg: dict[str, Any]) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.field = cfg["field"]
        gen = cfg.get("generate") or {}
        self.max_tokens = int(gen.get("max_tokens", 128))
        self.temperature = float(gen.get("temperature", 0.0))
        self.top_p = float(gen.get("top_p", 1.0))
        self.seed = int(gen.get("seed", 0))

    def results(self, rows: Iterator[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_sampler

        sampler = make_sampler(temp=self.temperature, top_p=self.top_p)
        for index, row in rows:
            prompt = _text(row, self.field, self.tokenizer, index)
            mx.random.seed(self.seed + index)
            text, count, reason = "", 0, None
            for resp in stream_generate(self.model, self.tokenizer, prompt, max_tokens=self.max_tokens,
                                        sampler=sampler):
                text += resp.text
                count = int(resp.generation_tokens)
                reason = resp.finish_reason
            yield {"index": index, "completion": text, "completion_tokens": count, "finish_reason": reason}


class Command:
    """`python -m MODULE --input IN --output OUT [ARGS]` over each contiguous run of rows, with the data dir as the
    working directory (so a module shipped in the data dir, hashed by preflight like the data, is importable).
    OUT must get one JSON object per input row, in order; lines are passed on as they appear, so a long shard
    reports progress and loses nothing already written if the node fails."""

    POLL_S = 0.2

    def __init__(self, cfg: dict[str, Any], workdir: Path, out: Out) -> None:
        cmd = cfg.get("command") or {}
        self.module, self.args = str(cmd["module"]), [str(a) for a in cmd.get("args", [])]
        self.workdir, self.out = workdir, out
        self.cwd = Path(os.path.expanduser(cfg["input"])).parent
        self.max_chunk: int | None = None  # the bench sets one: it must not wait for a whole shard

    def results(self, rows: Iterator[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        chunk: list[tuple[int, Any]] = []
        for item in rows:  # contiguous runs go to the module together
            if chunk and (item[0] != chunk[-1][0] + 1 or (self.max_chunk and len(chunk) >= self.max_chunk)):
                yield from self._run(chunk)
                chunk = []
            chunk.append(item)
        if chunk:
            yield from self._run(chunk)

    def _run(self, chunk: list[tuple[int, Any]]) -> Iterator[dict[str, Any]]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            src, dst, err = Path(tmp) / "input.jsonl", Path(tmp) / "output.jsonl", Path(tmp) / "stderr.txt"
            src.write_text("".join(json.dumps(row) + "\n" for _, row in chunk), encoding="utf-8")
            dst.touch()
            argv = [sys.executable, "-m", self.module, "--input", str(src), "--output", str(dst), *self.args]
            with err.open("w") as err_fh, dst.open(encoding="utf-8") as reader:
                # No bytecode written into the user's data dir (it is theirs, and may be read-only).
                env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
                proc = subprocess.Popen(argv, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=err_fh, env=env)
                emitted, pending = 0, ""
                while True:
                    finished = proc.poll() is not None  # read after the exit check: nothing written is missed
                    pending += reader.read()
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        if emitted >= len(chunk):
                            proc.kill()
                            raise MapError(f"`python -m {self.module}` wrote more results than the {len(chunk)} rows")
                        yield self._result(chunk[emitted][0], line)
                        emitted += 1
                    if finished:
                        break
                    time.sleep(self.POLL_S)
            if proc.returncode != 0:
                tail = err.read_text(encoding="utf-8", errors="replace").strip()[-1500:]
                raise MapError(f"`python -m {self.module}` exited {proc.returncode}: {tail}")
            if pending.strip():  # a last line without its newline
                if emitted >= len(chunk):
                    raise MapError(f"`python -m {self.module}` wrote more results than the {len(chunk)} rows")
                yield self._result(chunk[emitted][0], pending)
                emitted += 1
            if emitted != len(chunk):
                raise MapError(f"`python -m {self.module}` wrote {emitted} results for {len(chunk)} rows")

    def _result(self, index: int, line: str) -> dict[str, Any]:
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise MapError(f"`python -m {self.module}` wrote a line that is not JSON: {exc}") from None
        return {**(value if isinstance(value, dict) else {"value": value}), "index": index}


def make_task(cfg: dict[str, Any], out: Out) -> Any:
    task = cfg["task"]
    if task == "command":
        return Command(cfg, Path(os.path.expanduser(cfg.get("workdir") or ".")), out)
    from mlx_lm.utils import load

    model_dir = os.path.expanduser(cfg["model"])
    if not Path(model_dir).is_dir():
        raise MapError(f"model dir {model_dir} does not exist (nothing is downloaded by workers)")
    loaded = load(model_dir)
    model, tokenizer = loaded[0], loaded[1]
    model.eval()
    if task == "score":
        return Scorer(model, tokenizer, cfg)
    if task == "generate":
        return Generator(model, tokenizer, cfg)
    raise MapError(f"unknown task {task!r}")


def _heartbeat(out: Out, state: dict[str, int], interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        out.event("heartbeat", done=state["done"], pid=os.getpid())


def run(cfg: dict[str, Any], out: Out) -> None:
    path = Path(os.path.expanduser(cfg["input"]))
    if not path.is_file():
        raise MapError(f"input {path} does not exist")
    state = {"done": 0}
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(out, state, float(cfg.get("heartbeat_s", 1.0)), stop),
                     daemon=True).start()
    try:
        task = make_task(cfg, out)
        bench = cfg.get("bench")
        if bench:
            _bench(task, path, float(bench), out)
            return
        ranges = [(int(a), int(b)) for a, b in cfg["ranges"]]
        total = sum(b - a for a, b in ranges)
        out.event("started", pid=os.getpid(), rows=total, ranges=ranges)
        debug = cfg.get("debug") or {}
        tic = last = time.perf_counter()
        for result in task.results(read_rows(path, ranges)):
            out.emit({"src": "result", **result})
            state["done"] += 1
            if debug.get("sleep_s"):
                time.sleep(float(debug["sleep_s"]))
            if debug.get("exit_after") is not None and state["done"] >= int(debug["exit_after"]):
                os._exit(3)  # a crash, for tests: no error event
            now = time.perf_counter()
            if now - last >= 0.5 or state["done"] == total:
                last = now
                out.event("progress", done=state["done"], rows=total, rows_per_s=state["done"] / max(now - tic, 1e-9))
        if state["done"] != total:
            raise MapError(f"the input has fewer rows than the ranges ask for ({state['done']} of {total})")
        out.event("finished", done=state["done"], seconds=time.perf_counter() - tic)
    finally:
        stop.set()


def _bench(task: Any, path: Path, seconds: float, out: Out) -> None:
    """Examples/s over the input's rows, cycling through them until `seconds` have passed; the first batch
    (compilation, caches) is not timed."""

    def cycle() -> Iterator[tuple[int, Any]]:
        while True:
            empty = True
            for item in read_rows(path, [(0, 1 << 62)]):
                empty = False
                yield item
            if empty:
                raise MapError(f"input {path} has no rows")

    if isinstance(task, Command):
        task.max_chunk = 16
    results = task.results(cycle())
    next(results)
    tic = time.perf_counter()
    done = 0
    for _ in results:
        done += 1
        if time.perf_counter() - tic >= seconds:
            break
    elapsed = time.perf_counter() - tic
    out.emit({"src": "bench", "examples_per_s": done / max(elapsed, 1e-9), "rows": done, "seconds": elapsed})


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Out()
    try:
        cfg = json.loads(sys.stdin.read())
        run(cfg, out)
        return 0
    except Exception as exc:  # noqa: BLE001 -- the process boundary: every failure is an error event and exit 1
        out.event("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        return 1


if __name__ == "__main__":
    sys.exit(main())
