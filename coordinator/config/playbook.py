"""What to run: `load_playbook(path) -> Playbook`.

A playbook is one YAML mapping (see `Playbook` for the keys). Models are pydantic v2, frozen, and forbid unknown
keys; every problem is a `ConfigError` with `file:line` (unknown keys get a "did you mean").

YAML 1.1 pitfalls handled on purpose:
- PyYAML reads `1e-5` (no dot) as a *string*: numeric strings are accepted wherever a number is expected.
- `env` values must be strings: unquoted `false` / `off` / `8` / `1.10` / `010` are kept as the user typed them
  ("false", "off", "8", "1.10", "010"), not as YAML 1.1 reads them (False, False, 8, 1.1, 8).
- Environment names read as booleans (`ON:`, `yes:`) are rejected with a hint to quote them.

Extending: add a field (with its default) to the model it belongs to. Each field's default is written once, on
the field, and nowhere else; the training defaults match mlx-lm's except where noted.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.config.yamlsrc import (
    EnvName,
    EnvValue,
    Name,
    config_error_from_validation,
    did_you_mean,
    format_value,
    load_yaml,
    unknown_key_message,
)
from coordinator.errors import ConfigError
from coordinator.models import CHECK_IDS

DEFAULT_QUARANTINE_FOR = 24 * 3600.0  # seconds: `faults.quarantine_for` (coordinator/run/quarantine.py applies it)

Kind = Literal["train", "map"]
Backend = Literal["ring", "jaccl", "jaccl-ring", "nccl", "auto"]
Method = Literal["full", "lora", "dora", "dpo"]
FineTuneType = Literal["full", "lora", "dora"]
Optimizer = Literal["adam", "adamw", "sgd"]

TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


def to_integer(value: Any) -> Any:
    """Accept ints, integral floats (`1.0e+3`) and numeric strings (`"1e3"`); never booleans."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer (got {format_value(value)})")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"must be an integer (got {format_value(value)})") from None
        if number.is_integer():
            return int(number)
        raise ValueError(f"must be an integer (got {format_value(value)})")
    return value


def to_number(value: Any) -> Any:
    """Accept ints, floats and numeric strings (PyYAML reads `1e-5` as a string); never booleans, never nan/inf."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number (got {format_value(value)})")
    if isinstance(value, str):
        try:
            value = float(value.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"must be a number (got {format_value(value)})") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number (got {value})")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def to_duration(value: Any) -> Any:
    """Seconds as a number, or a string with a unit: `90`, `"30m"`, `"24h"`, `"7d"`."""
    text = value.strip() if isinstance(value, str) else None
    unit = _DURATION_UNITS.get(text[-1:].lower(), 0) if text else 0
    try:
        number = to_number(text[:-1] if unit and text else value)
    except ValueError:
        raise ValueError(f"must be a duration like 3600, 30m, 24h or 7d (got {format_value(value)})") from None
    return number * unit if unit else number


def _non_empty(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty")
    return value


# Dirs that `coordinator sync` would mirror with deletion, so never a playbook's model/data/reference: the
# filesystem root, system dirs, whole volumes, every home dir and the standard folders in one.
SYSTEM_ROOTS = frozenset({
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
    "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/snap", "/nix",
    "/Applications", "/Library", "/System", "/Users", "/Volumes", "/cores", "/private",
    "/usr/bin", "/usr/lib", "/usr/local", "/usr/sbin", "/usr/share", "/usr/local/bin", "/usr/local/lib",
    "/var/lib", "/var/log", "/var/tmp", "/var/home", "/opt/homebrew", "/private/etc", "/private/tmp",
    "/private/var", "/System/Library", "/Users/Shared",
})
HOME_PARENTS = ("/home", "/Users", "/var/home")  # /home/NAME is a home dir
HOME_FOLDERS = frozenset({"Applications", "Desktop", "Documents", "Downloads", "Library", "Movies", "Music",
                          "Pictures", "Public", ".cache", ".config", ".local", ".ssh"})


def check_synced_dir(value: str) -> str | None:
    """Why `value` cannot be a synced dir (model, data, reference), or None. Pure. A relative path is relative to
    the login's home on the node, as `~/...`; `$VARIABLES` are not expanded there."""
    path = value.strip()
    if re.fullmatch(r"\$\{?HOME\}?/*", path):
        return f"{path} is the home dir"
    if "$" in path:
        return f"{path}: environment variables are not expanded on the nodes (write ~/... for the home dir)"
    home = path.startswith("~") or not path.startswith("/")
    if path.startswith("~"):
        path = path.partition("/")[2]  # ~/x or ~user/x: x, relative to a home dir
    norm = posixpath.normpath(path) if path else "."
    if home:
        if norm == ".":
            return f"{value.strip()} is the home dir"
        if norm == ".." or norm.startswith("../"):
            return f"{value.strip()} is outside the home dir it is relative to"
        if norm in HOME_FOLDERS:
            return f"{value.strip()} is a standard folder of the home dir"
        return None
    norm = "/" + norm.lstrip("/")
    if norm == "/":
        return f"{value.strip()} is the filesystem root"
    if norm in SYSTEM_ROOTS:
        return f"{value.strip()} is a system dir"
    parts = norm.strip("/").split("/")
    if norm == "/root" or (len(parts) == 2 and "/" + parts[0] in HOME_PARENTS) or \
            (len(parts) == 3 and "/" + "/".join(parts[:2]) in HOME_PARENTS):
        return f"{value.strip()} is a home dir"
    if (len(parts) == 3 and "/" + parts[0] in HOME_PARENTS and parts[2] in HOME_FOLDERS) or \
            (len(parts) == 2 and parts[0] == "root" and parts[1] in HOME_FOLDERS):
        return f"{value.strip()} is a standard folder of a home dir"
    if len(parts) == 2 and parts[0] == "Volumes":
        return f"{value.strip()} is a whole volume"
    return None


def _synced_dir(value: Any) -> Any:
    if isinstance(value, str) and value.strip():
        problem = check_synced_dir(value)
        if problem and "$" in value:
            raise ValueError(problem)
        if problem:
            raise ValueError(f"{problem}: `coordinator sync` mirrors this dir and deletes what its source lacks; use "
                             "a dir of its own, such as /srv/models/NAME or ~/models/NAME")
    return value


def _dir_key(value: str) -> str:
    """A synced dir as compared for overlap: `~/x` and `x` (relative to the home dir) alike, normalized."""
    path = value.strip()
    if path.startswith("~/") or path == "~":
        return "~/" + posixpath.normpath(path[2:] or ".")
    if not path.startswith("/"):
        return "~/" + posixpath.normpath(path)
    return posixpath.normpath(path)


def find_overlap(dirs: Sequence[tuple[str, str]]) -> tuple[str, str, str] | None:
    """(first label, second label, how) for two synced dirs that are the same dir or one inside the other
    (each sync of one would delete the other's files as extras), or None. Pure; compares the paths as written."""
    keys = [(label, _dir_key(d)) for label, d in dirs]
    for i, (a, ka) in enumerate(keys):
        for b, kb in keys[i + 1:]:
            if ka == kb:
                return a, b, "is the same dir as"
            if kb.startswith(ka.rstrip("/") + "/"):
                return b, a, "is inside"
            if ka.startswith(kb.rstrip("/") + "/"):
                return a, b, "is inside"
    return None


Int = Annotated[int, BeforeValidator(to_integer)]
PositiveInt = Annotated[int, BeforeValidator(to_integer), Field(ge=1)]
PositiveFloat = Annotated[float, BeforeValidator(to_number), Field(gt=0)]
NonEmptyStr = Annotated[str, BeforeValidator(_non_empty)]
SyncedDir = Annotated[str, BeforeValidator(_synced_dir), BeforeValidator(_non_empty)]  # model, data, reference


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(_Strict):
    """`train.lora:` (mlx-lm's lora_parameters)."""

    rank: PositiveInt = 8
    scale: PositiveFloat = 20.0
    dropout: Annotated[float, BeforeValidator(to_number), Field(ge=0, lt=1)] = 0.0


class CalibrationConfig(_Strict):
    """`calibration:`: how `coordinator calibrate` measures each node (docs/calibration.md)."""

    time_budget: PositiveFloat = 60.0  # seconds of timed steps per node
    # Seconds per node for what a cold machine pays once: importing mlx, loading the model, and the first step of
    # each batch shape, which JIT-compiles its kernels while MLX's kernel cache is empty (85 s for the first 10
    # steps on a fresh GPU machine). Generous on purpose: it only bounds a node that hangs while loading.
    one_time_budget: PositiveFloat = 600.0
    max_batch: PositiveInt = 64
    memory_fraction: Annotated[float, BeforeValidator(to_number), Field(gt=0, le=1)] = 0.8


class TinyModelConfig(_Strict):
    """Build a tiny random llama-style model offline (deterministic: identical files on every node)."""

    layers: PositiveInt = 2
    hidden: PositiveInt = 64
    seed: Int = 0


class AssetsConfig(_Strict):
    """`assets:`: provision the model/data dirs on nodes that lack them, before preflight. For demos and test
    fleets; a real model is copied by you (preflight then proves every copy is identical)."""

    tiny_model: TinyModelConfig | None = None  # build into `model` where it is missing
    data_from: NonEmptyStr | None = None  # a local dir (relative to the playbook) copied into `data` where missing


_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")


def _version(value: Any) -> Any:
    """An exact release (`0.32.4`): what `pip install mlx==...` takes. YAML reads an unquoted 0.32 as a float."""
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _VERSION.fullmatch(text.strip()):
        raise ValueError(f"must be an exact version like 0.32.4 (got {format_value(value)})")
    return text.strip()


Version = Annotated[str, BeforeValidator(_version)]


class SoftwareConfig(_Strict):
    """`software:`: the versions `coordinator setup` installs on every node (docs/setup.md). Unset: the
    coordinator's own mlx / mlx-lm versions."""

    mlx: Version | None = None  # "0.32.4": mlx and its backend (mlx-cpu / mlx-cuda-* / mlx-metal)
    mlx_lm: Version | None = None  # "0.32.2"


class FaultsConfig(_Strict):
    """`faults:`: detection thresholds and the automatic response (docs/faults.md)."""

    consistency_every: Annotated[int, BeforeValidator(to_integer), Field(ge=0)] = 50  # digest period; 0 = off
    straggler_fraction: Annotated[float, BeforeValidator(to_number), Field(gt=0, lt=1)] = 0.5
    straggler_window: PositiveInt = 5  # consecutive steps below the fraction of the calibrated rate
    # ...and for at least this many seconds: a handful of short steps is noise (a GC pause, a page-in), not a
    # slow machine. 0 makes the window purely a step count.
    straggler_min_s: Annotated[float, BeforeValidator(to_number), Field(ge=0)] = 5.0
    outlier_steps: PositiveInt = 3  # consecutive steps a rank's local loss/grad norm must be an outlier
    # A step that has not ended after stall_factor x the rank's median step time (and stall_min_s) is stalled.
    stall_factor: Annotated[float, BeforeValidator(to_number), Field(gt=1)] = 10.0
    stall_min_s: Annotated[float, BeforeValidator(to_number), Field(ge=0)] = 60.0
    # A rank that has ended no step this long after an attempt started (loading, the ring's start, the first,
    # compiling step) is stalled (seconds, or 30m / 2h): the stall window above needs a first step to measure by.
    first_step_s: Annotated[float, BeforeValidator(to_duration), Field(gt=0)] = 3600.0
    # Each rank stops itself after 3x that window (for a partitioned node or a lost coordinator); false: never.
    fence: bool = True
    max_restarts: Annotated[int, BeforeValidator(to_integer), Field(ge=0)] = 2
    min_nodes: PositiveInt = 1  # elastic shrink never goes below this many nodes (written: a fresh launch may too)
    # How long a culprit stays left out of later launches of the same fleet (seconds, or 30m / 24h / 7d); 0 = until
    # `coordinator quarantine clear`.
    quarantine_for: Annotated[float, BeforeValidator(to_duration), Field(ge=0)] = DEFAULT_QUARANTINE_FOR


class DpoConfig(_Strict):
    """`train.dpo:` for `method: dpo` (docs/dpo.md). Rows are preference pairs; the frozen reference model is
    `reference` (a model dir on every node) or, when null, the starting model itself."""

    beta: PositiveFloat = 0.1
    reference: SyncedDir | None = None
    fine_tune_type: FineTuneType = "lora"  # which parameters DPO trains (as mlx-lm's adapter_config names it)


class TrainConfig(_Strict):
    """`train:`. Defaults are mlx-lm's, except `num_layers` (None = all layers; mlx-lm alone trains 16)."""

    method: Method = "lora"
    iters: PositiveInt = 1000
    batch_size: PositiveInt = 4  # global batch, split across ranks
    grad_accumulation: PositiveInt = 1
    learning_rate: PositiveFloat = 1e-5
    max_seq_length: PositiveInt = 2048
    save_every: PositiveInt = 100
    steps_per_eval: PositiveInt = 200
    val_batches: PositiveInt = 25
    num_layers: Int | None = None  # None (or -1 in the file) = all layers; N = the last N layers
    grad_checkpoint: bool = False
    # auto: each rank's SFT rows are packed into as few sequences as they fit in (attention per row): the same
    # rows, loss and gradient without the padding, when that saves >= 10% of the computed positions and is exact
    # on the model.
    packing: Literal["auto", "on", "off"] = "auto"
    # full on all layers only: train embeddings, lm_head and the final norm too (mlx-lm's full does not).
    train_embeddings: bool = False
    # Free MLX's buffer cache after every step (mx.clear_cache, as mlx-lm's trainer does): a lower peak (on an H100,
    # S full 4.3 instead of 8.0 GB) for a slower step (every buffer is allocated again). docs/calibration.md.
    clear_cache: bool = False
    # A step holds at most its working set x (1 + this): MLX's eval waits for queued work above it, so the run-ahead
    # that raised our peak above mlx-lm's is bounded without emptying the cache (worker/memory.py). null: unbounded.
    memory_headroom: Annotated[float, BeforeValidator(to_number), Field(ge=0)] | None = 0.1
    optimizer: Optimizer = "adam"
    # dp: a full replica per rank; pipeline: each node a contiguous range of blocks (docs/strategy.md); fsdp: weights,
    # grads and Adam state sharded across ranks (LoRA: the frozen base weights sharded, the adapters whole; not DoRA); auto:
    # the feasible plan with the best predicted tokens/s (coordinator/planning/strategy.py).
    strategy: Literal["auto", "dp", "pipeline", "fsdp"] = "auto"
    # pipeline: blocks per node in ring (inventory) order, instead of the computed split; checked against memory.
    layer_split: tuple[PositiveInt, ...] | None = None
    # pipeline: micro-batches per step (1F1B); None = min(8, batch_size). More shrink the bubble (P-1)/(M+P-1).
    micro_batches: PositiveInt | None = None
    seed: Int = 0
    keep_checkpoints: PositiveInt = 2  # newest N checkpoints kept on every node
    lora: LoraConfig = Field(default_factory=lambda: LoraConfig())
    dpo: DpoConfig = Field(default_factory=lambda: DpoConfig())

    @property
    def fine_tune_type(self) -> FineTuneType:
        """Which parameters train: `method` itself, or `dpo.fine_tune_type` for DPO."""
        return self.dpo.fine_tune_type if self.method == "dpo" else self.method

    @property
    def pipeline_micro_batches(self) -> int:
        """Micro-batches of a pipeline step: `micro_batches`, else min(8, batch_size)."""
        return self.micro_batches or min(8, self.batch_size)

    @property
    def rows_per_example(self) -> int:
        """Sequences per batch row: a DPO pair is two (chosen and rejected)."""
        return 2 if self.method == "dpo" else 1

    @model_validator(mode="after")
    def _embeddings(self) -> TrainConfig:
        if self.train_embeddings and (self.fine_tune_type != "full" or self.num_layers is not None):
            raise ValueError("train_embeddings needs full fine-tuning of all layers (num_layers unset or -1)")
        if self.strategy == "pipeline" and (self.method == "dpo" or self.train_embeddings):
            raise ValueError("strategy pipeline trains neither DPO nor embeddings (train_embeddings): use strategy "
                             "dp or auto")
        if self.layer_split is not None and self.strategy != "pipeline":
            raise ValueError(f"layer_split pins a pipeline's blocks per node: it needs strategy pipeline (this one is "
                             f"{self.strategy})")
        if self.micro_batches is not None and self.micro_batches > self.batch_size:
            raise ValueError(f"micro_batches {self.micro_batches} exceeds batch_size {self.batch_size}: every "
                             "micro-batch needs an example")
        if self.strategy == "fsdp" and self.fine_tune_type == "dora":
            raise ValueError("strategy fsdp trains full and lora fine-tunes, not dora (a DoRA layer reads its base "
                             "weight directly, so the weight cannot be gathered on demand): use strategy dp or auto")
        return self

    @field_validator("num_layers")
    @classmethod
    def _layers(cls, value: int | None) -> int | None:
        if value == -1:
            return None
        if value is not None and value < 1:
            raise ValueError(f"must be a positive number of layers, or -1/null for all (got {value})")
        return value


class GenerateConfig(_Strict):
    """`map.generate:`: sampling for `task: generate` (temperature 0 = greedy)."""

    max_tokens: PositiveInt = 128
    temperature: Annotated[float, BeforeValidator(to_number), Field(ge=0)] = 0.0
    top_p: Annotated[float, BeforeValidator(to_number), Field(gt=0, le=1)] = 1.0
    seed: Int = 0  # row i is sampled with seed + i: the same output whichever node runs it


class CommandConfig(_Strict):
    """`map.command:`: `python -m MODULE --input SHARD.jsonl --output OUT.jsonl [ARGS...]` on the node; OUT must
    hold one JSON object per input row, in order."""

    module: Annotated[str, BeforeValidator(_non_empty), Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")]
    args: tuple[str, ...] = ()


class MapConfig(_Strict):
    """`map:` for `kind: map` (docs/map-jobs.md): every node works through its own contiguous shard of `input`
    (a JSONL file in the `data` dir) at its own pace; results are gathered in input order."""

    input: NonEmptyStr = "input.jsonl"  # relative to `data`
    task: Literal["score", "generate", "command"] = "score"
    field: NonEmptyStr = "text"  # score: the text to score; generate: the prompt (a string or chat messages)
    prompt_field: NonEmptyStr | None = None  # score: condition on this field, score only `field`
    batch_size: PositiveInt = 8  # rows per forward pass (score)
    max_seq_length: PositiveInt = 2048
    generate: GenerateConfig = Field(default_factory=lambda: GenerateConfig())
    command: CommandConfig | None = Field(default=None, validate_default=True)
    output: NonEmptyStr | None = None  # also copy the gathered output here (relative to the working directory)

    @field_validator("command")
    @classmethod
    def _command(cls, value: CommandConfig | None, info: ValidationInfo) -> CommandConfig | None:
        if value is None and info.data.get("task") == "command":
            raise ValueError("required for task: command ({module: my.package.scorer})")
        return value


def _skip_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _check_id(value: Any) -> Any:
    if isinstance(value, str) and value not in CHECK_IDS:
        raise ValueError(f"unknown check id {format_value(value)}{did_you_mean(value, CHECK_IDS)}; "
                         f"known: {', '.join(CHECK_IDS)}")
    return value


class ChecksConfig(_Strict):
    """`checks:`: `skip` lists check ids (coordinator.models.CHECK_IDS) preflight must not run."""

    skip: Annotated[tuple[Annotated[str, BeforeValidator(_check_id)], ...], BeforeValidator(_skip_list)] = ()


class Playbook(_Strict):
    """A job: what model and data, how to train, which backend. `path` is the file it was loaded from (set by the
    loader, never written in the file); a relative `manifest` is relative to that file's directory."""

    name: Name
    kind: Kind = "train"
    model: SyncedDir  # directory on every node
    data: SyncedDir | None = Field(default=None, validate_default=True)  # directory on every node; train needs it
    backend: Backend = "ring"
    manifest: NonEmptyStr | None = None  # local sha256sum-format file of model/... and data/... digests
    train: TrainConfig = Field(default_factory=TrainConfig)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    # Env names whose values are secret (beyond *TOKEN*, *KEY*, *SECRET*, *PASSWORD*...): never logged or printed.
    secret_env: tuple[EnvName, ...] = ()
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    # How the global batch is split: measured speed (default), equal shares, or explicit {node: fraction}.
    split: Literal["calibrated", "equal"] | dict[Name, PositiveFloat] = "calibrated"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    heartbeat_timeout: PositiveFloat = 10.0  # seconds without a heartbeat before a rank counts as hung
    faults: FaultsConfig = Field(default_factory=lambda: FaultsConfig())
    assets: AssetsConfig = Field(default_factory=AssetsConfig)
    software: SoftwareConfig = Field(default_factory=SoftwareConfig)
    map: MapConfig | None = Field(default=None, validate_default=True)  # required for kind: map
    path: str | None = None

    @field_validator("data")
    @classmethod
    def _data_for_train(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("kind") in ("train", "map"):  # absent when `kind` itself was invalid
            raise ValueError(f"required for kind {info.data.get('kind')}: the dataset directory on every node")
        return value

    @field_validator("map")
    @classmethod
    def _map_for_map(cls, value: MapConfig | None, info: ValidationInfo) -> MapConfig | None:
        kind = info.data.get("kind")
        if kind == "map" and value is None:
            return MapConfig()
        if kind == "train" and value is not None:
            raise ValueError("only for kind: map")
        return value

    @field_validator("train", "checks", "calibration", "assets", "faults", "software", mode="before")
    @classmethod
    def _null_section(cls, value: Any) -> Any:
        return {} if value is None else value  # a section whose keys are all commented out

    @field_validator("env", mode="before")
    @classmethod
    def _null_env(cls, value: Any) -> Any:
        return {} if value is None else value

    def hashed_dirs(self) -> tuple[tuple[str, str], ...]:
        """(label, dir) of every directory preflight hashes and compares across nodes, in probe order: the
        model, the data, and DPO's separate reference model."""
        dirs = [("model", self.model)]
        if self.data:
            dirs.append(("data", self.data))
        if self.kind == "train" and self.train.method == "dpo" and self.train.dpo.reference:
            dirs.append(("reference", self.train.dpo.reference))
        return tuple(dirs)

    def job_env(self) -> dict[str, str]:
        """The environment every rank gets: `env`, plus TOKENIZERS_PARALLELISM=false unless `env` sets it
        (tokenizers' thread pool deadlocks after fork and floods logs with warnings)."""
        return {TOKENIZERS_PARALLELISM: "false", **self.env}


LOADER_SET_FIELDS = frozenset({"path"})
"""Playbook fields the loader fills in; a file that writes them gets an unknown-key error."""


def parse_playbook(
    value: Any, *, path: str, line_for: Callable[[Sequence[Any]], int | None] | None = None
) -> Playbook:
    """Validate an already-loaded value (`env` values as the user means them: see `YamlSource.as_written`).
    `line_for(loc) -> int | None` locates errors (None: no lines). Raises ConfigError."""

    def locate(loc: Sequence[Any]) -> int | None:
        return line_for(loc) if line_for is not None else None

    if not isinstance(value, dict):
        what = "empty" if value is None else f"{format_value(value)}, not a mapping"
        raise ConfigError(f"playbook is {what}: expected keys name, kind, model, data, train, ...", path=path,
                          line=locate(()))
    for key in LOADER_SET_FIELDS & set(value):
        known = [f for f in Playbook.model_fields if f not in LOADER_SET_FIELDS]
        raise ConfigError(unknown_key_message(key, known), path=path, line=locate((key,)))
    try:
        playbook = Playbook.model_validate(value)
    except ValidationError as exc:
        raise config_error_from_validation(exc, model=Playbook, path=path, line_for=locate,
                                           hidden_fields=LOADER_SET_FIELDS) from None
    overlap = find_overlap(playbook.hashed_dirs())
    if overlap is not None:
        inner, outer, how = overlap
        keys = {"model": ("model",), "data": ("data",), "reference": ("train", "dpo", "reference")}
        where = dict(playbook.hashed_dirs())
        raise ConfigError(f"{inner}: {where[inner]} {how} {outer} ({where[outer]}): each would be synced with "
                          f"deletion of what the other holds; give them separate dirs", path=path,
                          line=locate(keys[inner]))
    return playbook.model_copy(update={"path": path})


def load_playbook(path: str | Path) -> Playbook:
    """Read and validate the playbook at `path`. Every problem is a ConfigError with `file:line`."""
    src = load_yaml(path, "playbook")
    value = src.value
    if isinstance(value, dict) and isinstance(value.get("env"), dict):
        value = {**value, "env": src.as_written(("env",))}
    return parse_playbook(value, path=src.path, line_for=src.line_for)
