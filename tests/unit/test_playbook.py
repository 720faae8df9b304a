"""Playbook loading: good files in, Playbook out; bad files in, `file:line: message` out."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.config.playbook import ChecksConfig, Playbook, TrainConfig, load_playbook
from coordinator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
GOOD = REPO / "tests" / "fixtures" / "config" / "good"
BAD = REPO / "tests" / "fixtures" / "config" / "bad"


GOOD_CASES: list[tuple[str, dict[str, object]]] = [
    ("playbook-full.yaml", {
        "name": "full.run_1", "kind": "train", "model": "/srv/models/qwen3-4b", "data": "~/datasets/chat",
        "backend": "jaccl-ring", "manifest": "manifests/qwen.sha256",
        "train": TrainConfig(method="dora", iters=500, batch_size=8, grad_accumulation=2, learning_rate=2e-5,
                             max_seq_length=1024, save_every=25, steps_per_eval=100, val_batches=5, num_layers=8,
                             grad_checkpoint=True, optimizer="adamw"),
        # YAML 1.1 reads these as 1, True, 0.5, False: kept as typed instead.
        "env": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true", "RATIO": "0.5", "FLAG": "off"},
        "checks": ChecksConfig(skip=("rdma", "thunderbolt")),
    }),
    ("playbook-minimal.yaml", {
        "name": "minimal", "kind": "train", "model": "~/m", "data": "~/d", "backend": "ring", "manifest": None,
        "train": TrainConfig(), "env": {}, "checks": ChecksConfig(),
    }),
    ("playbook-map.yaml", {
        "name": "embed", "kind": "map", "data": "~/d", "train": TrainConfig(), "env": {},
        "checks": ChecksConfig(skip=("rdma",)),
    }),
    ("playbook-anchors.yaml", {"train": TrainConfig(iters=50, batch_size=4, num_layers=None)}),
]


@pytest.mark.parametrize(("name", "expected"), GOOD_CASES, ids=[c[0] for c in GOOD_CASES])
def test_good_playbooks(name: str, expected: dict[str, object]) -> None:
    path = GOOD / name
    playbook = load_playbook(path)
    assert playbook.path == str(path)
    for key, value in expected.items():
        assert getattr(playbook, key) == value, key


def test_train_defaults_match_mlx_lm() -> None:
    t = TrainConfig()
    assert (t.method, t.iters, t.batch_size, t.grad_accumulation, t.learning_rate, t.max_seq_length) == \
        ("lora", 1000, 4, 1, 1e-5, 2048)
    assert (t.save_every, t.steps_per_eval, t.val_batches, t.optimizer, t.grad_checkpoint) == \
        (100, 200, 25, "adam", False)
    assert t.num_layers is None  # all layers (mlx-lm alone: 16)


def test_sample_smoke_playbook() -> None:
    pb = load_playbook(REPO / "playbooks" / "smoke.yaml")
    assert (pb.name, pb.kind, pb.backend, pb.train.method) == ("smoke", "train", "ring", "lora")
    assert pb.train.learning_rate == pytest.approx(1e-3)
    assert pb.assets.tiny_model is not None and pb.assets.data_from == "data/smoke"
    assert pb.job_env() == {"TOKENIZERS_PARALLELISM": "false"}


def test_sample_4b_full_playbook() -> None:
    pb = load_playbook(REPO / "playbooks" / "example-4b-full.yaml")
    t = pb.train
    assert pb.backend == "jaccl"
    assert (t.method, t.batch_size, t.grad_accumulation, t.max_seq_length) == ("full", 4, 8, 4096)
    assert t.learning_rate == pytest.approx(2.8e-5)
    assert (t.grad_checkpoint, t.save_every, t.steps_per_eval, t.val_batches, t.num_layers) == \
        (True, 500, 5000, 10, 36)


def test_job_env_adds_tokenizers_parallelism_unless_set() -> None:
    base = {"name": "x", "model": "/m", "data": "/d"}
    assert Playbook.model_validate(base).job_env() == {"TOKENIZERS_PARALLELISM": "false"}
    pb = Playbook.model_validate({**base, "env": {"TOKENIZERS_PARALLELISM": "true", "A": "1"}})
    assert pb.job_env() == {"TOKENIZERS_PARALLELISM": "true", "A": "1"}


def test_models_are_frozen() -> None:
    pb = load_playbook(GOOD / "playbook-minimal.yaml")
    with pytest.raises(ValidationError):
        pb.name = "other"


@pytest.mark.parametrize(("value", "expected"), [
    ("1e-5", 1e-5), ("2.8e-5", 2.8e-5), (3, 3.0), ("1_000", 1000.0),
])
def test_learning_rate_accepts_numeric_strings(value: object, expected: float) -> None:
    assert TrainConfig.model_validate({"learning_rate": value}).learning_rate == pytest.approx(expected)


@pytest.mark.parametrize("value", [True, "fast", "nan", "inf", 0, "-1e-5"])
def test_learning_rate_rejects(value: object) -> None:
    with pytest.raises(ValidationError):
        TrainConfig.model_validate({"learning_rate": value})


# (file, line, substring of the first message line after `file:line: `)
BAD_CASES: list[tuple[str, int, str]] = [
    ("pb-unknown-key.yaml", 4, "unknown key 'trian' (did you mean 'train'?)"),
    ("pb-unknown-train-key.yaml", 6, "train: unknown key 'optimiser' (did you mean 'optimizer'?)"),
    ("pb-duplicate-key.yaml", 7, "duplicate key 'iters' (first at line 5)"),
    ("pb-bad-type.yaml", 5, "train.iters: must be an integer (got 'many')"),
    ("pb-bad-range.yaml", 5, "train.batch_size: must be >= 1 (got 0)"),
    ("pb-bad-lr.yaml", 5, "train.learning_rate: must be > 0"),
    ("pb-bad-bool.yaml", 5, "train.grad_checkpoint: must be true or false (got 'sometimes')"),
    ("pb-unknown-check.yaml", 7, "checks.skip[1]: unknown check id 'thunderbolts' (did you mean 'thunderbolt'?)"),
    ("pb-syntax.yaml", 5, "invalid YAML: "),
    ("pb-missing-data.yaml", 1, "data: required for kind train"),
    ("pb-missing-model.yaml", 1, "missing required key 'model'"),
    ("pb-bad-backend.yaml", 4, "backend: must be one of 'ring', 'jaccl', 'jaccl-ring', 'nccl' or 'auto' (got 'mpi')"),
    ("pb-bad-name.yaml", 1, "name: invalid name 'smoke test'"),
    ("pb-path-key.yaml", 4, "unknown key 'path'"),
    ("pb-env-null.yaml", 6, "env.EMPTY: environment value must be a string, number or boolean (got null)"),
    ("pb-not-mapping.yaml", 1, "playbook is a list, not a mapping"),
    ("pb-two-docs.yaml", 4, "a second document ('---') starts here"),
    ("pb-num-layers.yaml", 5, "train.num_layers: must be a positive number of layers, or -1/null for all (got 0)"),
]


@pytest.mark.parametrize(("name", "line", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_playbooks(name: str, line: int, message: str) -> None:
    path = BAD / name
    with pytest.raises(ConfigError) as info:
        load_playbook(path)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{path}:{line}: "), first
    assert message in first
    assert info.value.line == line


def test_unknown_check_lists_known_ids() -> None:
    with pytest.raises(ConfigError) as info:
        load_playbook(BAD / "pb-unknown-check.yaml")
    assert "known: ssh, os, rdma, thunderbolt, software, model, env, resources" in str(info.value)


@pytest.mark.parametrize(("model", "data", "line", "says"), [
    ("/", "/srv/data", 2, "model: / is the filesystem root"),
    ("/usr", "/srv/data", 2, "model: /usr is a system dir"),
    ("/srv/model", "/etc/", 3, "data: /etc/ is a system dir"),
    ("/srv/model", "/home", 3, "data: /home is a system dir"),
    ("~", "/srv/data", 2, "model: ~ is the home dir"),
    ("$HOME", "/srv/data", 2, "model: $HOME is the home dir"),
    ("${HOME}/m", "/srv/data", 2, "environment variables are not expanded"),
    (".", "/srv/data", 2, "model: . is the home dir"),
    ("/Users", "/srv/data", 2, "model: /Users is a system dir"),
    ("/Users/ana", "/srv/data", 2, "model: /Users/ana is a home dir"),
    ("/home/ana/", "/srv/data", 2, "model: /home/ana/ is a home dir"),
    ("/Users/ana/Documents", "/srv/data", 2, "a standard folder of a home dir"),
    ("~/Downloads", "/srv/data", 2, "a standard folder of the home dir"),
    ("/var", "/srv/data", 2, "model: /var is a system dir"),
    ("/System", "/srv/data", 2, "model: /System is a system dir"),
    ("/Volumes/SSD", "/srv/data", 2, "a whole volume"),
    ("/srv/x", "/srv/x/", 2, "model: /srv/x is the same dir as data (/srv/x/)"),
    ("/srv/data/model", "/srv/data", 2, "model: /srv/data/model is inside data (/srv/data)"),
    ("/srv/model", "/srv/model/data", 3, "data: /srv/model/data is inside model (/srv/model)"),
    ("~/m", "m", 2, "model: ~/m is the same dir as data (m)"),
])
def test_synced_dirs_refuse_system_and_home_roots_and_overlap(tmp_path: Path, model: str, data: str, line: int,
                                                              says: str) -> None:
    path = tmp_path / "pb.yaml"
    path.write_text(f"name: x\nmodel: '{model}'\ndata: '{data}'\n")
    with pytest.raises(ConfigError) as err:
        load_playbook(path)
    assert err.value.line == line and says in str(err.value), str(err.value)


@pytest.mark.parametrize(("model", "data"), [("/m", "/d"), ("~/models/q", "~/datasets/c"), ("models/q", "data"),
                                             ("/home/ana/models/q", "/srv/data"), ("/srv/model", "/srv/model2")])
def test_synced_dirs_of_their_own_are_accepted(tmp_path: Path, model: str, data: str) -> None:
    path = tmp_path / "pb.yaml"
    path.write_text(f"name: x\nmodel: '{model}'\ndata: '{data}'\n")
    assert load_playbook(path).model == model


def test_dpo_reference_must_not_overlap_the_model(tmp_path: Path) -> None:
    path = tmp_path / "pb.yaml"
    path.write_text("name: x\nmodel: /srv/m\ndata: /srv/d\ntrain:\n  method: dpo\n  dpo:\n    reference: /srv/m/ref\n")
    with pytest.raises(ConfigError, match=r"pb.yaml:7: reference: /srv/m/ref is inside model"):
        load_playbook(path)
