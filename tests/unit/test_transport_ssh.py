"""SshTransport against a real in-process asyncssh server: host-key policy, auth, quoting, fan-out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from coordinator.errors import HostKeyError, TransportError
from coordinator.fleet.transport import Fleet, SshTransport
from coordinator.models import ConnectInfo, Node
from tests.sshserver import SshTestServer, run_for_real


@pytest.fixture()
def keys(tmp_path: Path) -> tuple[asyncssh.SSHKey, Path]:
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "id_ed25519"
    key.write_private_key(str(path))
    return key, path


def node_for(server: SshTestServer, key_path: Path, known: Path, name: str = "n1") -> Node:
    return Node(name=name, host="127.0.0.1", port=server.port, user="tester", identity=str(key_path),
                known_hosts=str(known))


@contextlib.asynccontextmanager
async def connected(tmp_path: Path, keys, server_cls: type[SshTestServer] = SshTestServer
                    ) -> AsyncIterator[tuple[SshTransport, ConnectInfo]]:
    """A server whose key is in known_hosts and a transport connected to it with strict verification, both
    closed afterwards. Yields (transport, connect info)."""
    server = await server_cls(run_for_real, keys[0]).start()
    known = tmp_path / "known_hosts"
    known.write_text(server.known_hosts_line())
    t = SshTransport(node_for(server, keys[1], known))
    try:
        yield t, await t.connect()
    finally:
        await t.close()
        await server.close()


def test_verified_host_runs_quoted_commands(tmp_path: Path, keys) -> None:
    async def go() -> None:
        async with connected(tmp_path, keys) as (t, info):
            assert info.host_key and info.host_key.startswith("ssh-ed25519")
            res = await t.run(["printf", "%s", "$(id); `x` 'q'"])
            assert res.stdout == "$(id); `x` 'q'"
            res = await t.run(["sh", "-c", "cat; exit 3"], stdin="hello")
            assert (res.stdout, res.exit_status) == ("hello", 3)

    asyncio.run(go())


def test_unknown_host_key_fails_unless_accept_new(tmp_path: Path, keys) -> None:
    async def go() -> None:
        server = await SshTestServer(run_for_real, keys[0]).start()
        known = tmp_path / "known_hosts"
        try:
            with pytest.raises(HostKeyError, match="unknown"):
                await SshTransport(node_for(server, keys[1], known)).connect()
            t = SshTransport(node_for(server, keys[1], known), accept_new_host_keys=True)
            info = await t.connect()
            assert info.host_key_recorded
            await t.close()
            assert f"[127.0.0.1]:{server.port}" in known.read_text()
            t2 = SshTransport(node_for(server, keys[1], known))  # now known: plain verification passes
            assert not (await t2.connect()).host_key_recorded
            await t2.close()
        finally:
            await server.close()

    asyncio.run(go())


def test_changed_host_key_always_fails(tmp_path: Path, keys) -> None:
    async def go() -> None:
        server = await SshTestServer(run_for_real, keys[0]).start()
        known = tmp_path / "known_hosts"
        other = asyncssh.generate_private_key("ssh-ed25519")
        known.write_text(f"[127.0.0.1]:{server.port} {other.export_public_key().decode().strip()}\n")
        try:
            for accept in (False, True):
                with pytest.raises(HostKeyError, match="does NOT match"):
                    await SshTransport(node_for(server, keys[1], known), accept_new_host_keys=accept).connect()
        finally:
            await server.close()

    asyncio.run(go())


def test_wrong_client_key_is_an_auth_error(tmp_path: Path, keys) -> None:
    async def go() -> None:
        server = await SshTestServer(run_for_real, keys[0]).start()
        known = tmp_path / "known_hosts"
        known.write_text(server.known_hosts_line())
        wrong = asyncssh.generate_private_key("ssh-ed25519")
        wrong_path = tmp_path / "wrong"
        wrong.write_private_key(str(wrong_path))
        try:
            with pytest.raises(TransportError) as err:
                await SshTransport(node_for(server, wrong_path, known)).connect()
            assert err.value.kind == "auth"
        finally:
            await server.close()

    asyncio.run(go())


def test_fleet_reports_dead_nodes_as_values(tmp_path: Path, keys) -> None:
    async def go() -> None:
        server = await SshTestServer(run_for_real, keys[0]).start()
        known = tmp_path / "known_hosts"
        known.write_text(server.known_hosts_line())
        # A port nobody listens on: connection refused, reported per node, others unaffected.
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        good = node_for(server, keys[1], known, "good")
        dead = Node(name="dead", host="127.0.0.1", port=dead_port, user="t", identity=str(keys[1]),
                    known_hosts=str(known))
        try:
            async with Fleet([good, dead], connect_timeout=2) as fleet:
                results = await fleet.connect_all()
                assert isinstance(results["dead"], TransportError)
                assert not isinstance(results["good"], TransportError)

                async def echo(node: Node, t) -> str:
                    return (await t.run(["echo", node.name])).stdout.strip()

                out = await fleet.map(echo)
                assert out == {"good": "good"}
        finally:
            await server.close()

    asyncio.run(go())


def test_stream_yields_lines_then_exit(tmp_path: Path, keys) -> None:
    async def go() -> None:
        async with connected(tmp_path, keys) as (t, _):
            items = [item async for item in t.stream(["sh", "-c", "echo a; echo b >&2; exit 4"])]
            assert ("stdout", "a\n") in items and ("stderr", "b\n") in items
            assert items[-1] == ("exit", "4")

    asyncio.run(go())


def test_stream_in_chunks_keeps_every_line_whole_and_in_order(tmp_path: Path, keys) -> None:
    async def go() -> None:
        script = "i=0; while [ $i -lt 3000 ]; do echo line-$i; i=$((i+1)); done; printf tail"
        async with connected(tmp_path, keys) as (t, _):
            items = [item async for item in t.stream(["sh", "-c", script], lines=False)]
            out = [text for kind, text in items if kind == "stdout"]
            assert "".join(out) == "".join(f"line-{i}\n" for i in range(3000)) + "tail"
            assert all(text.endswith("\n") for text in out[:-1])  # a chunk never splits a line
            assert len(out) < 3000 and items[-1] == ("exit", "0")

    asyncio.run(go())


class _DroppingServer(SshTestServer):
    """Writes one line, then the whole connection drops (the node's sshd and sessions die)."""

    async def _handle(self, process: asyncssh.SSHServerProcess) -> None:
        if process.command != "follow":
            await super()._handle(process)  # the connection check
            return
        process.stdout.write("tick\n")
        await asyncio.sleep(0.2)
        process.channel.get_connection().abort()


def test_a_dropped_connection_ends_a_stream_at_once(tmp_path: Path, keys) -> None:
    """A follower must learn that its node is gone when the connection drops, not at the heartbeat timeout."""
    async def go() -> None:
        lines = []
        async with connected(tmp_path, keys, _DroppingServer) as (t, _):
            with pytest.raises(TransportError, match="failed"):
                async with asyncio.timeout(10):
                    async for kind, line in t.stream(["follow"], timeout=3600):
                        lines.append((kind, line))
        assert lines == [("stdout", "tick\n")]

    asyncio.run(go())
