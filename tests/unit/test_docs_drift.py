"""The docs list what the code has: every check id in docs/checks.md, every playbook key in
docs/inventory-and-playbooks.md, every verb in the README's verb table. Each side is read from its source (the
code's constants, the pydantic models, the click group with its lazy verbs), so a new check, key or verb fails here
until its doc row is written."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import click
from pydantic import BaseModel

from coordinator.cli import main
from coordinator.config.playbook import Playbook
from coordinator.models import CHECK_IDS

ROOT = Path(__file__).resolve().parents[2]
# Set by the loader (the file the playbook came from), never written in a playbook.
NOT_WRITTEN = {"path"}


def tables(markdown: str) -> dict[str, dict[str, str]]:
    """heading text -> {the first backticked word of a table row's first cell: the whole row}, per section."""
    out: dict[str, dict[str, str]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            out.setdefault(heading, {})
        elif line.startswith("| `"):
            key = re.match(r"\| `([^`]+)`", line)
            if key:
                out.setdefault(heading, {})[key.group(1)] = line
    return out


def submodel(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field holds (`X`, `X | None`, `Annotated[X, ...]`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (typing.Union, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = submodel(arg)
            if found is not None:
                return found
    return None


def fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    return {name: submodel(info.annotation) for name, info in model.model_fields.items() if name not in NOT_WRITTEN}


def test_the_table_reader_and_the_model_walker_see_what_they_should() -> None:
    doc = "## A\n| key | x |\n|---|---|\n| `one` | 1 |\n| `two.three` (note) | 2 |\n### `b:`\n| `four` | 4 |\n"
    assert tables(doc) == {"A": {"one": "| `one` | 1 |", "two.three": "| `two.three` (note) | 2 |"},
                           "`b:`": {"four": "| `four` | 4 |"}}
    walked = fields(Playbook)
    assert walked["name"] is None and walked["train"] is not None and walked["map"] is not None  # `MapConfig | None`
    assert "path" not in walked and fields(walked["train"])["lora"] is not None


def test_every_check_id_has_its_section_in_checks_md() -> None:
    text = (ROOT / "docs/checks.md").read_text(encoding="utf-8")
    documented = re.findall(r"^### `([a-z_]+)`:", text, flags=re.MULTILINE)
    assert [c for c in CHECK_IDS if c not in documented] == []
    assert [d for d in documented if d not in CHECK_IDS] == []  # no section for a check that is gone


def test_every_playbook_key_is_documented() -> None:
    """Top-level keys are rows of "Top-level keys". A section (`train:`) with its own heading has a row per key,
    and a row for a nested mapping (`lora`) names each of its keys; a section without a heading (`checks`) is
    written as `checks.skip` rows in the top-level table."""
    doc = tables((ROOT / "docs/inventory-and-playbooks.md").read_text(encoding="utf-8"))
    top = doc["Top-level keys"]
    sections = {m.group(1): rows for heading, rows in doc.items() if (m := re.match(r"`(\w+):`", heading))}
    missing: list[str] = []
    for name, model in fields(Playbook).items():
        if name not in top and not any(key.startswith(f"{name}.") for key in top):
            missing.append(name)
        if model is None:
            continue
        rows = sections.get(name)
        for key, inner in fields(model).items():
            if rows is None:
                if f"{name}.{key}" not in top:
                    missing.append(f"{name}.{key}")
                continue
            if key not in rows:
                missing.append(f"{name}.{key}")
                continue
            for sub in fields(inner) if inner is not None else {}:
                if not re.search(rf"\b{sub}\b", rows[key]):
                    missing.append(f"{name}.{key}.{sub}")
    assert missing == []


def readme_verbs() -> set[str]:
    """The verbs named in the first column of the README's verb table: `coordinator VERB ...` spans, and bare
    one-word spans (`monitor` in "`coordinator status`, `monitor`")."""
    table = tables((ROOT / "README.md").read_text(encoding="utf-8"))["The verbs"]
    verbs: set[str] = set()
    for row in table.values():
        first = row.split(" | ")[0]
        for span in re.findall(r"`([^`]+)`", first):
            if span.startswith("coordinator "):
                verbs.add(span.split()[1])
            elif re.fullmatch(r"[a-z][a-z-]*", span):
                verbs.add(span)
    return verbs


def test_every_verb_is_in_the_readme_table() -> None:
    ctx = click.Context(main)
    verbs = main.list_commands(ctx)  # every module of coordinator/cli/, loaded lazily
    assert {"launch", "status"} <= set(verbs)
    for name in verbs:
        assert main.get_command(ctx, name) is not None, name
    assert sorted(set(verbs) - readme_verbs()) == []
