"""An in-process asyncssh server on 127.0.0.1:0 for transport tests and the scale benchmark.

`responder(command, stdin) -> (stdout, stderr, exit_status)` decides what a command answers; `run_for_real`
executes it with /bin/sh (tests of quoting and streaming), `ProfileResponder` answers the probe from a
recorded node profile (the 1,000-node benchmark).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh

Responder = Callable[[str, str], Awaitable[tuple[str, str, int]]]


async def run_for_real(command: str, stdin: str) -> tuple[str, str, int]:
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(stdin.encode())
    return out.decode(), err.decode(), proc.returncode or 0


@dataclass
class ProfileResponder:
    """Answers the coordinator's probe like a node with the recorded `profile` dir; `true` answers 0.

    `reach_all_ok`: the worker section's `reach` answers every peer the probe asked for as reachable (a
    network where every link works), instead of whatever the canned `worker` answer holds."""

    profile: Path
    worker: dict = field(default_factory=dict)
    reach_all_ok: bool = False

    def __post_init__(self) -> None:
        self.sections: dict[str, tuple[str, int]] = {}
        for out in sorted(self.profile.glob("*.out")):
            rc_file = out.with_suffix(".rc")
            rc = int(rc_file.read_text().strip()) if rc_file.exists() else 0
            self.sections[out.stem] = (out.read_text(encoding="utf-8"), rc)

    async def __call__(self, command: str, stdin: str) -> tuple[str, str, int]:
        if command == "true":
            return "", "", 0
        m = re.search(r"N=([0-9a-f]+)", command)
        if not m:
            return "", f"unexpected command: {command[:80]}", 127
        nonce = m.group(1)
        parts = []
        for name, (text, rc) in self.sections.items():
            if name == "worker":
                continue
            parts.append(f"{nonce} BEGIN {name}\n{text}\n{nonce} END {name} {rc}\n")
        answer = dict(self.worker)
        if self.reach_all_ok:
            answer["reach"] = [{"peer": p["name"], "ip": p["ip"], "ok": True, "rtt_ms": 0.2, "error": None}
                               for p in probe_worker_args(command).get("peers", [])]
        worker = self.sections.get("worker", (json.dumps(answer), 0))
        parts.append(f"{nonce} BEGIN worker\n{worker[0]}\n{nonce} END worker {worker[1]}\n")
        return "".join(parts), "", 0


def probe_worker_args(command: str) -> dict:
    """The JSON argument the probe script passes to worker/probe.py (`"$PY" -c BOOTSTRAP KEY '<json>';`), from
    the command: the last word before the `;` (tests/unit/test_probe.py keeps this in step with build_probe)."""
    script = shlex.split(command)[-1]
    rest = script[script.index('then "$PY" ') + len('then "$PY" '):]
    lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word == ";":
            break
        words.append(word)
    return dict(json.loads(words[-1]))


class _Server(asyncssh.SSHServer):
    def __init__(self, users: set[str] | None) -> None:
        self.users = users

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False


class SshTestServer:
    def __init__(self, responder: Responder, client_key: asyncssh.SSHKey, *,
                 host_key: asyncssh.SSHKey | None = None) -> None:
        self.responder = responder
        self.client_key = client_key
        self.host_key = host_key or asyncssh.generate_private_key("ssh-ed25519")
        self.server: asyncssh.SSHAcceptor | None = None
        self.port = 0
        self.commands: list[str] = []

    async def _handle(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command or ""
        self.commands.append(command)
        stdin = ""
        if not process.stdin.at_eof():
            stdin = await process.stdin.read()
        out, err, rc = await self.responder(command, stdin)
        process.stdout.write(out)
        process.stderr.write(err)
        process.exit(rc)

    async def start(self) -> SshTestServer:
        authorized = asyncssh.import_authorized_keys(self.client_key.export_public_key().decode())
        self.server = await asyncssh.create_server(
            lambda: _Server(None), "127.0.0.1", 0, server_host_keys=[self.host_key],
            authorized_client_keys=authorized, process_factory=self._handle, encoding="utf-8")
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_key.export_public_key().decode().strip()}\n"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
