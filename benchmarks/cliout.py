"""The coordinator's `--json` output as the benchmarks read it: through the published schemas.

Every script here drives the real CLI and reads what it prints. Reading it as a bare dict let the scripts keep
old keys (`name` for `node`, `transfer_seconds` for `transfer_s`) long after the CLI had renamed them: they died
with a KeyError after minutes of measuring. `cli_json` checks a document against its verb's models in
coordinator/views/jsonout.py (the source of docs/json.md) first, so a drift is a one-line error naming the key, and
tests/unit/test_bench_scripts.py feeds each script's reader the documents the real writers produce.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from coordinator.views.jsonout import validate_output


def cli_json(verb: str, text: str) -> dict[str, Any]:
    """`text` (one verb's `--json` output) decoded and checked against the verb's schema. Raises ValueError when
    it is not JSON or does not fit (naming every key that does not)."""
    doc = json.loads(text)
    validate_output(verb, doc)
    if not isinstance(doc, dict):
        raise ValueError(f"`{verb} --json` printed {type(doc).__name__}, not an object")
    return doc


def by_node(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows of a document keyed by their `node` (the one key every verb names a node by)."""
    return {row["node"]: row for row in rows}
