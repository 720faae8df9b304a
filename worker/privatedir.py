"""Make (or verify) a private directory on THIS node and write files into it: the run's temp dir in /tmp.

Started by the coordinator with the JSON spec on stdin:
    python -m worker.privatedir        {"dir": "/tmp/mlxc-<run>-<random>", "files": {"rank": ["<text>", "700"]}}
Prints one JSON line: {"dir": PATH} (exit 0), or {"error": "PATH: why"} (exit 3). Stdlib only, Python 3.9+.

/tmp is shared by every local user, and the rank script written there is run as the SSH user. So the dir is
made with mkdir(0700), and is used only when it then is a real directory (not a symlink), owned by this user,
with mode exactly 0700, in a parent that others cannot rename it out of (sticky, like /tmp, or writable only by
its owner, who is root or this user). A dir that already exists is accepted on those same terms: only this user
can have made such a dir, e.g. another node of the same run that shares this /tmp (local nodes); anything else at
the path (another user's dir, a symlink, a file, a looser mode) is refused and nothing is written.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any


class PrivateDirError(Exception):
    """The directory cannot be made private to this user; nothing was written into it."""


def dir_problem(mode: int, uid: int, euid: int) -> str | None:
    """Why a directory with this (lstat) mode and owner is not private to `euid`, or None when it is."""
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(mode):
        return "exists and is not a directory"
    if uid != euid:
        return f"exists and is owned by uid {uid}, not by this user (uid {euid})"
    if stat.S_IMODE(mode) != 0o700:
        return f"has mode {stat.S_IMODE(mode):04o}, not 0700"
    return None


def parent_problem(mode: int, uid: int, euid: int) -> str | None:
    """Why a dir made in a parent with this (stat) mode and owner could be swapped by someone else, or None."""
    if uid not in (0, euid):
        return f"is owned by uid {uid} (neither root nor this user)"
    if stat.S_IMODE(mode) & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return "is writable by others without the sticky bit"
    return None


def ensure_private_dir(path: str) -> None:
    """Create `path` 0700 (its parent must exist), or accept it as it is when it is already private to us."""
    if not os.path.isabs(path):
        raise PrivateDirError(f"{path}: not an absolute path")
    euid = os.geteuid()
    parent = os.path.dirname(path.rstrip("/"))
    try:
        pst = os.stat(parent)  # followed: /tmp is a symlink to /private/tmp on macOS
    except OSError as exc:
        raise PrivateDirError(f"{parent}: {exc.strerror}") from None
    why = parent_problem(pst.st_mode, pst.st_uid, euid)
    if why:
        raise PrivateDirError(f"{parent} {why}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"{path}: {exc.strerror}") from None
    else:
        os.chmod(path, 0o700)  # the umask can only have taken bits away; make the mode exactly 0700
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise PrivateDirError(f"{path}: {exc.strerror}") from None
    why = dir_problem(st.st_mode, st.st_uid, euid)
    if why:
        raise PrivateDirError(f"{path} {why}: refusing to use it")


def write_private_files(path: str, files: dict[str, Any]) -> None:
    """`ensure_private_dir(path)`, then write {name: [content, octal mode]} into it, each atomically."""
    ensure_private_dir(path)
    for name, (content, mode) in sorted(files.items()):
        if "/" in name or name in ("", ".", ".."):
            raise PrivateDirError(f"{name!r}: not a plain file name")
        target = os.path.join(path, name)
        tmp = f"{target}.tmp-{os.getpid()}-{os.urandom(4).hex()}"  # nodes sharing this /tmp write concurrently
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(content)
                os.fchmod(fh.fileno(), int(mode, 8))
            os.replace(tmp, target)
        except OSError as exc:
            raise PrivateDirError(f"{target}: {exc.strerror}") from None


def main() -> int:
    spec = json.load(sys.stdin)
    try:
        write_private_files(spec["dir"], spec.get("files") or {})
    except PrivateDirError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 3
    print(json.dumps({"dir": spec["dir"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
