"""coordinator/planning/sync.py: manifests in, the plan out (copy, delete, resume offsets, disk space, the chain)."""

from __future__ import annotations

import json

import pytest

from coordinator.planning.sync import (
    NodeState,
    ParseError,
    compute_plan,
    describe_refusal,
    parse_node_state,
    verify,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64
SOURCE = {"model/w.bin": (1000, A), "model/config.json": (10, B), "data/train.jsonl": (50, C)}
BIG = 10**12


def state(node: str, manifest: dict[str, tuple[int, str]] | None = None,
          partials: dict[str, tuple[int, str]] | None = None, free: int = BIG, same_disk: bool = True) -> NodeState:
    return NodeState(node, manifest or {}, partials or {}, {"model": free, "data": free},
                     {"model": 1, "data": 1 if same_disk else 2})


def test_copies_missing_and_differing_deletes_extras_chain_in_order() -> None:
    stale = {**SOURCE, "model/config.json": (10, A), "model/extra": (1, A)}
    plan = compute_plan("h1", SOURCE, [state("h2"), state("h3", stale), state("h4", dict(SOURCE))])
    nodes = {p.node: p for p in plan.nodes}
    assert nodes["h2"].copy == ("data/train.jsonl", "model/config.json", "model/w.bin")
    assert nodes["h3"].copy == ("model/config.json",) and nodes["h3"].delete == ("model/extra",)
    assert nodes["h4"].in_sync
    assert plan.chain == ("h2", "h3")
    assert [f.path for f in plan.files] == ["data/train.jsonl", "model/config.json", "model/w.bin"]
    assert plan.stream_bytes == 1060 and not plan.problems


def test_same_size_other_digest_is_copied() -> None:
    plan = compute_plan("h1", SOURCE, [state("h2", {**SOURCE, "model/w.bin": (1000, B)})])
    assert plan.nodes[0].copy == ("model/w.bin",)


def test_stream_resumes_at_the_smallest_useful_prefix() -> None:
    plan = compute_plan("h1", {"model/w.bin": (1000, A)}, [
        state("h2", partials={"model/w.bin": (600, A)}),
        state("h3", partials={"model/w.bin": (400, A)}),
        state("h4", partials={"model/w.bin": (900, B)}),  # a prefix of another version: useless, deleted
    ])
    assert plan.files[0].start == 0  # h4 needs it all
    plan = compute_plan("h1", {"model/w.bin": (1000, A)}, [
        state("h2", partials={"model/w.bin": (600, A)}), state("h3", partials={"model/w.bin": (400, A)})])
    assert plan.files[0].start == 400 and plan.stream_bytes == 600
    nodes = {p.node: p for p in plan.nodes}
    assert nodes["h2"].kept == {"model/w.bin": 400} and nodes["h2"].write_bytes == 600
    stale = compute_plan("h1", {"model/w.bin": (1000, A)}, [state("h4", partials={"model/w.bin": (900, B)})])
    assert stale.nodes[0].delete == ("model/w.bin.partial",) and stale.files[0].start == 0


def test_partial_of_a_file_already_in_sync_is_deleted() -> None:
    plan = compute_plan("h1", SOURCE, [state("h2", dict(SOURCE), partials={"model/w.bin": (5, A)})])
    assert plan.nodes[0].copy == () and plan.nodes[0].delete == ("model/w.bin.partial",)


@pytest.mark.parametrize(("free", "same_disk", "ok"), [
    (1060 * 105 // 100 + 1, True, True),
    (1060, True, False),  # no headroom
    (1010 * 105 // 100 + 1, False, True),  # data on its own disk: the model disk needs only the model's 1010
])
def test_disk_space_needs_five_percent_headroom_per_filesystem(free: int, same_disk: bool, ok: bool) -> None:
    plan = compute_plan("h1", SOURCE, [state("h2", free=free, same_disk=same_disk)])
    assert (not plan.problems) is ok
    if not ok:
        assert "h2: not enough free disk space" in plan.problems[0]


def test_verify_names_what_still_differs() -> None:
    assert verify(SOURCE, state("h2", dict(SOURCE))) == []
    assert verify(SOURCE, state("h2", {**SOURCE, "x/y": (1, A)})) == ["extra: x/y"]


def test_parse_node_state() -> None:
    doc = {"manifest": {"model/w.bin": [1000, A]}, "partials": {}, "free": {"model": 5}, "dev": {"model": 1},
           "missing": ["data"], "errors": []}
    st = parse_node_state("h1", "noise\n" + json.dumps(doc) + "\n")
    assert st.manifest == {"model/w.bin": (1000, A)} and st.missing == ("data",)
    for bad in ("", "not json", json.dumps({"error": "bad spec"}), json.dumps({"manifest": {}})):
        with pytest.raises(ParseError, match="h1"):
            parse_node_state("h1", bad)


MODEL = {"model/w.bin": (1000, A), "model/config.json": (10, B), "model/tok.json": (10, C)}
DATA = {"data/train.jsonl": (50, C)}


@pytest.mark.parametrize(("source", "target", "doubtful"), [
    (DATA, {**MODEL, **DATA}, [("model", 3, 1020)]),  # the source's model dir is empty
    ({"model/config.json": (10, B), **DATA}, {**MODEL, **DATA}, [("model", 2, 1010)]),  # 2 of 3 files, 99% bytes
    ({"model/w.bin": (1000, A), "model/new.json": (5, A), **DATA}, {**MODEL, **DATA}, [("model", 2, 20)]),  # files
    ({"model/a.bin": (1, A), "model/b.bin": (1, B), "model/c.bin": (1, C), **DATA},
     {"model/a.bin": (1, A), "model/b.bin": (1, B), "model/big": (10, C), **DATA}, [("model", 1, 10)]),  # bytes
    ({**MODEL, "model/new.json": (5, A), **DATA}, {**MODEL, "model/old.json": (5, B), **DATA}, []),  # 1 of 4
    (MODEL, {**MODEL, "data/train.jsonl": (50, C)}, [("data", 1, 50)]),  # the source's data dir is empty
    (DATA, DATA, []),  # nothing to delete: an empty dir everywhere is no doubt
])
def test_doubtful_deletions_empty_source_or_most_of_a_node_files_or_bytes(
        source: dict[str, tuple[int, str]], target: dict[str, tuple[int, str]],
        doubtful: list[tuple[str, int, int]]) -> None:
    plan = compute_plan("h1", source, [state("h2", target)])
    assert [(d.label, d.files, d.bytes) for d in plan.doubtful] == doubtful
    node = plan.nodes[0]
    assert node.delete_bytes == sum(target[p][0] for p in node.delete)


def test_partials_are_not_doubtful_and_count_in_the_deleted_bytes() -> None:
    plan = compute_plan("h1", SOURCE, [state("h2", dict(SOURCE), partials={"model/x.bin": (700, A)})])
    assert not plan.doubtful and plan.nodes[0].delete == ("model/x.bin.partial",)
    assert plan.nodes[0].delete_bytes == 700


def test_the_refusal_names_the_source_dir_and_what_would_go_per_node() -> None:
    plan = compute_plan("h1", DATA, [state("h2", {**MODEL, **DATA}), state("h3", {**MODEL, **DATA})])
    line = describe_refusal(plan, {"model": "/srv/model", "data": "/srv/data"})
    assert "\n" not in line
    assert "source h1:/srv/model is empty" in line
    assert "3 of 3 files (1020 bytes) on h2, 3 of 3 files (1020 bytes) on h3" in line
    assert "--delete-extras" in line
