"""Parsers shared by the macOS and Linux probes, and small helpers for every `parse_*` function.

Every parser here is pure: text in, typed value out. Unparseable input raises `ParseError` with a message that
names what was expected; nothing is silently defaulted.
"""

from __future__ import annotations

import re

from coordinator.facts.model import Disk, ParseError

__all__ = ["excerpt", "parse_df", "parse_uname", "require_text"]

_UNAME_TOKEN = re.compile(r"^[A-Za-z0-9_.+~()-]+$")


def excerpt(text: str, limit: int = 120) -> str:
    """A short, single-line quote of unexpected input for an error message."""
    flat = text.strip().replace("\n", "\\n")
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


def require_text(text: str, what: str) -> str:
    """The text, stripped; `ParseError` when a command printed nothing at all."""
    stripped = text.strip()
    if not stripped:
        raise ParseError(f"{what}: empty output")
    return stripped


def parse_uname(text: str) -> tuple[str, str, str]:
    """`uname -srm` -> (system, kernel release, machine), e.g. ("Darwin", "25.5.0", "arm64").

    The output is exactly one line of three whitespace-separated words (POSIX fixes the order s, r, m whatever
    the flag order). Anything else, for example a shell's "command not found" text, raises `ParseError`.
    """
    line = require_text(text, "uname")
    tokens = line.split()
    if "\n" in line or len(tokens) != 3 or not all(_UNAME_TOKEN.match(t) for t in tokens):
        raise ParseError(f"uname -srm: expected one line 'SYSTEM RELEASE MACHINE', got {excerpt(text)}")
    return tokens[0], tokens[1], tokens[2]


# `df -k PATH` rows. The device may contain spaces (autofs "map -static"), so it is matched lazily up to the
# first run of four numeric columns; macOS adds `iused ifree %iused` before the mount point (reference §7e); the
# mount point is the rest of the line and may contain spaces ("/Volumes/Crucial X9"). "-" stands for a number
# on pseudo file systems (GNU df on /proc).
_DF_ROW = re.compile(
    r"^(?P<device>\S.*?)\s+(?P<total>\d+|-)\s+(?P<used>\d+|-)\s+(?P<avail>\d+|-)\s+(?P<cap>\d+%|-)"
    r"(?:\s+(?P<iused>\d+|-)\s+(?P<ifree>\d+|-)\s+(?P<ipct>\d+%|-))?\s+(?P<mount>/.*?)\s*$"
)
_DF_BLOCKS = re.compile(r"^(?:(?P<n>\d+)-blocks|(?P<k>\d+)K-blocks)$")


def _df_block_size(header: str) -> int:
    tokens = header.split()
    if len(tokens) < 2 or tokens[0] != "Filesystem":
        raise ParseError(f"df -k: expected a 'Filesystem ... Mounted on' header, got {excerpt(header)}")
    match = _DF_BLOCKS.match(tokens[1])
    if match is None:
        raise ParseError(f"df -k: unknown block-size column {tokens[1]!r}")
    # The header names the unit: "1024-blocks" (BSD/macOS), "1K-blocks" (GNU); never assume 1024.
    return int(match["n"]) if match["n"] else int(match["k"]) * 1024


def _df_rows(lines: list[str]) -> list[tuple[str, int, int]]:
    """(mount, total blocks, available blocks) for each row; GNU df wraps a long device name onto its own line."""
    rows: list[tuple[str, int, int]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip():
            continue
        match = _DF_ROW.match(line)
        if match is None and i < len(lines) and lines[i][:1].isspace():
            # GNU df (without -P) prints a device name longer than its column alone, then the numbers indented
            # on the next line (e.g. /dev/mapper/VolGroup00-LogVol00).
            match = _DF_ROW.match(line.rstrip() + " " + lines[i].strip())
            i += 1
        if match is None:
            raise ParseError(f"df -k: unparseable row {excerpt(line)}")
        if match["total"] == "-" or match["avail"] == "-":
            continue  # pseudo file system without sizes; it can never hold the work directory's data
        rows.append((match["mount"], int(match["total"]), int(match["avail"])))
    return rows


def _mount_contains(mount: str, path: str) -> bool:
    return mount == "/" or path == mount or path.startswith(mount.rstrip("/") + "/")


def parse_df(text: str, path: str) -> Disk:
    """`df -k PATH` (macOS/BSD with its iused columns, or GNU coreutils) -> the `Disk` holding `path`.

    With a single data row (the normal `df -k PATH` answer) that row is the answer. With several rows (`df -k`
    of everything) the file system is the one whose mount point is the longest prefix of `path`. Sizes are
    converted with the block size the header names. Raises `ParseError` on a missing header, an unparseable
    row, or no row for `path`.
    """
    lines = require_text(text, "df -k").splitlines()
    block = _df_block_size(lines[0])
    rows = _df_rows(lines[1:])
    if not rows:
        raise ParseError("df -k: no file system row after the header")
    if len(rows) == 1:
        mount, total, avail = rows[0]
    else:
        candidates = [r for r in rows if _mount_contains(r[0], path)]
        if not candidates:
            raise ParseError(f"df -k: no listed file system contains {path!r}")
        mount, total, avail = max(candidates, key=lambda r: len(r[0]))
    return Disk(path=path, mount=mount, total_bytes=total * block, available_bytes=avail * block)
