"""Measure one TCP link between two nodes: round-trip latency and throughput in both directions.

Run by the coordinator (`coordinator nettest`) on the two ends of one pair (stdlib only, Python 3.9+):

    python -m worker.nettest serve --bind IP [--port 0] [--timeout 30]
    python -m worker.nettest client --to IP --port P [--seconds 2] [--pings 50] [--connect-timeout 5]

`serve` listens on IP:PORT (0 = a free port the kernel picks), prints ONE JSON line `{"port": N}` on stdout as
soon as it listens, serves exactly one client session and exits: 0 after a complete session, 1 when nobody
connected within --timeout or the session broke (then a JSON line `{"error": "..."}` follows). The accept and
every later socket operation are bounded by --timeout, so a server whose client never comes (or dies mid-way)
exits on its own; the coordinator needs no cleanup on the node.

`client` connects, then runs three phases over the one connection and prints ONE JSON object on stdout:

- ping: --pings round trips of a PING_SIZE-byte message (the server echoes it); `rtt_ms` is the median, which
  ignores the first-packet and scheduler outliers a mean would average in.
- up: the client sends for --seconds; the SERVER times the bytes it received (first byte to last byte) and
  reports them back, so socket buffers still draining do not inflate the rate.
- down: the server sends for --seconds; the client times what it received.

    {"rtt_ms", "rtt_min_ms", "rtt_max_ms", "pings", "up_bps", "up_bytes", "up_seconds", "down_bps",
     "down_bytes", "down_seconds", "seconds"}      (bps = bytes per second)

Failure semantics: any error prints `{"error": "..."}` on stdout and exits 1 (never a traceback for network
errors: connection refused, timeouts, a peer that went away).

Wire protocol (all integers big-endian): the client sends a 1-byte command and its arguments; bulk data is framed
as chunks of `u32 length + payload`, a zero length ends the stream.
    b"P" u32 size, then per ping: size bytes -> echoed; a zero-size ping ends the phase
    b"U" then framed chunks -> server replies u64 bytes, f64 seconds
    b"D" f64 seconds -> server sends framed chunks
    b"Q" -> end of session
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import time
from typing import Any

PING_SIZE = 64
CHUNK = 1 << 20  # 1 MiB per send: large enough that per-call overhead is negligible at tens of Gb/s
DEFAULT_TIMEOUT = 30.0
DEFAULT_SECONDS = 2.0
DEFAULT_PINGS = 50

_U32 = struct.Struct(">I")
_U64_F64 = struct.Struct(">Qd")
_F64 = struct.Struct(">d")


class NetTestError(Exception):
    """A protocol or network failure with a message for the JSON `error` field."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise NetTestError("peer closed the connection mid-message")
        got += k
    return bytes(buf)


def _send_stream(sock: socket.socket, seconds: float) -> int:
    """Send framed chunks for `seconds`, then the end marker. Returns payload bytes sent."""
    payload = b"\0" * CHUNK
    frame = _U32.pack(CHUNK) + payload
    sent = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sock.sendall(frame)
        sent += CHUNK
    sock.sendall(_U32.pack(0))
    return sent


def _recv_stream(sock: socket.socket) -> tuple[int, float]:
    """Receive framed chunks until the end marker. Returns (payload bytes, seconds from first to last byte)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    first: float | None = None
    last = 0.0
    while True:
        (length,) = _U32.unpack(_recv_exact(sock, _U32.size))
        if length == 0:
            break
        left = length
        while left:
            k = sock.recv_into(view[: min(left, CHUNK)], min(left, CHUNK))
            if k == 0:
                raise NetTestError("peer closed the connection mid-stream")
            if first is None:
                first = time.perf_counter()
            left -= k
            total += k
        last = time.perf_counter()
    return total, (last - first) if first is not None else 0.0


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------------- server


def serve_session(conn: socket.socket) -> None:
    """Answer one client's commands until `Q` (or raise NetTestError / OSError)."""
    while True:
        cmd = _recv_exact(conn, 1)
        if cmd == b"P":
            while True:
                (size,) = _U32.unpack(_recv_exact(conn, _U32.size))
                if size == 0:
                    break
                conn.sendall(_recv_exact(conn, size))
        elif cmd == b"U":
            nbytes, seconds = _recv_stream(conn)
            conn.sendall(_U64_F64.pack(nbytes, seconds))
        elif cmd == b"D":
            (seconds,) = _F64.unpack(_recv_exact(conn, _F64.size))
            _send_stream(conn, min(max(seconds, 0.0), 600.0))
        elif cmd == b"Q":
            return
        else:
            raise NetTestError(f"unknown command {cmd!r}")


def serve(bind: str, port: int, timeout: float) -> int:
    """Listen, print the port, serve one session. Returns the exit code."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind, port))
        listener.listen(1)
    except OSError as exc:
        _emit({"error": f"cannot listen on {bind}:{port}: {exc}"})
        return 1
    _emit({"port": listener.getsockname()[1]})
    try:
        listener.settimeout(timeout)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            _emit({"error": f"no client connected within {timeout:g}s"})
            return 1
        with conn:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            serve_session(conn)
    except (OSError, NetTestError) as exc:
        _emit({"error": f"session failed: {exc}"})
        return 1
    finally:
        listener.close()
    return 0


# ---------------------------------------------------------------------------------------------------- client


def run_client(host: str, port: int, seconds: float, pings: int, connect_timeout: float) -> dict[str, Any]:
    """One full session against a server; returns the result object (raises NetTestError / OSError)."""
    started = time.perf_counter()
    sock = socket.create_connection((host, port), timeout=connect_timeout)
    with sock:
        # A stalled peer must not hang us: every operation may wait at most this long.
        sock.settimeout(max(connect_timeout, 10.0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        rtts: list[float] = []
        msg = b"x" * PING_SIZE
        sock.sendall(b"P")
        for _ in range(max(1, pings)):
            t0 = time.perf_counter()
            sock.sendall(_U32.pack(PING_SIZE) + msg)
            _recv_exact(sock, PING_SIZE)
            rtts.append((time.perf_counter() - t0) * 1000.0)
        sock.sendall(_U32.pack(0))

        sock.sendall(b"U")
        _send_stream(sock, seconds)
        up_bytes, up_seconds = _U64_F64.unpack(_recv_exact(sock, _U64_F64.size))

        sock.sendall(b"D" + _F64.pack(seconds))
        down_bytes, down_seconds = _recv_stream(sock)

        sock.sendall(b"Q")
    return {
        "rtt_ms": statistics.median(rtts),
        "rtt_min_ms": min(rtts),
        "rtt_max_ms": max(rtts),
        "pings": len(rtts),
        "up_bps": _rate(up_bytes, up_seconds),
        "up_bytes": up_bytes,
        "up_seconds": up_seconds,
        "down_bps": _rate(down_bytes, down_seconds),
        "down_bytes": down_bytes,
        "down_seconds": down_seconds,
        "seconds": time.perf_counter() - started,
    }


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.nettest", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve", help="serve one measuring session")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    c = sub.add_parser("client", help="measure against a server")
    c.add_argument("--to", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    c.add_argument("--pings", type=int, default=DEFAULT_PINGS)
    c.add_argument("--connect-timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        return serve(args.bind, args.port, args.timeout)
    try:
        result = run_client(args.to, args.port, args.seconds, args.pings, args.connect_timeout)
    except socket.timeout:
        _emit({"error": f"timed out talking to {args.to}:{args.port}"})
        return 1
    except (OSError, NetTestError) as exc:
        _emit({"error": f"{args.to}:{args.port}: {exc}"})
        return 1
    _emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
