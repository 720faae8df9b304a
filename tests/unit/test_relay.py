"""worker/relay.py on this machine: path validation, the token, refusals, resume and the sha256 gate."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from worker import relay
from worker.relay import RelayError, check_path, safe_target


@pytest.mark.parametrize("rel", ["/etc/passwd", "model/../x", "../model/x", "model/./x", "model//x", "model",
                                 "other/x", "model/x\0", "model\\x", "", "model/x.partial", "model/x.partial.sha256"])
def test_check_path_refuses(rel: str) -> None:
    with pytest.raises(RelayError, match="refused"):
        check_path(rel, {"model": "/srv/model"})


def test_check_path_accepts_nested() -> None:
    assert check_path("model/sub/a.bin", {"model": "/srv/model"}) == ("model", "sub/a.bin")


def test_safe_target_refuses_symlinked_dirs(tmp_path: Path) -> None:
    top = tmp_path / "model"
    top.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (top / "link").symlink_to(outside)
    dirs = {"model": str(top)}
    with pytest.raises(RelayError, match="symlink"):
        safe_target("model/link/x.bin", dirs, create=True)
    assert safe_target("model/new/x.bin", dirs, create=True) == str(top / "new" / "x.bin")
    assert (top / "new").is_dir() and not any(outside.iterdir())


def test_a_symlink_at_the_final_name_is_replaced_not_written_through(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"outside")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "f.bin").symlink_to(outside)
    (tmp_path / "model" / "g.bin.partial").symlink_to(outside)  # a planted partial link
    server = Server(tmp_path, ["model/f.bin"])
    server.connect("t0k", [_entry("model/f.bin", b"new bytes")], b"new bytes")
    assert server.result()["files"] == ["model/f.bin"]
    assert not (tmp_path / "model" / "f.bin").is_symlink()
    assert (tmp_path / "model" / "f.bin").read_bytes() == b"new bytes" and outside.read_bytes() == b"outside"
    server = Server(tmp_path, ["model/g.bin"])
    server.connect("t0k", [_entry("model/g.bin", b"new")], b"new")
    doc = server.result()
    # The planted partial link is removed, never written through: the file lands, the link's target is untouched.
    assert server.code == 0 and doc["files"] == ["model/g.bin"] and outside.read_bytes() == b"outside"
    assert (tmp_path / "model" / "g.bin").read_bytes() == b"new" and not (tmp_path / "model" / "g.bin.partial").exists()


class Server:
    """`serve` in a thread on 127.0.0.1."""

    def __init__(self, tmp: Path, need: list[str], token: str = "t0k") -> None:
        self.dirs = {"model": str(tmp / "model")}
        self.out = io.StringIO()
        self.err = io.StringIO()
        spec = {"token": token, "dirs": self.dirs, "need": need, "timeout": 30}
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(spec,))
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait()
        self.port = json.loads(self.out.getvalue().splitlines()[0])["port"]

    def _run(self, spec: dict[str, Any]) -> None:
        out = self

        class Out(io.StringIO):
            def write(self, s: str) -> int:
                n = out.out.write(s)
                if '"port"' in s:
                    out.ready.set()
                return n

        self.code = relay.serve("127.0.0.1", spec, Out(), self.err)
        self.ready.set()

    def connect(self, token: str, files: list[dict[str, Any]], payload: bytes, *, refused: bool = False) -> None:
        """Send one upstream session; a refused one may see its connection reset while sending."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            try:
                s.sendall(token.encode() + b"\n" + json.dumps({"chain": [], "files": files}).encode() + b"\n"
                          + payload)
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 16):
                    pass
            except OSError:
                if not refused:
                    raise

    def result(self) -> dict[str, Any]:
        self.thread.join()
        lines = self.out.getvalue().splitlines()
        return json.loads(lines[-1])  # type: ignore[no-any-return]


def _entry(path: str, data: bytes, start: int = 0) -> dict[str, Any]:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "start": start}


def test_wrong_token_and_dotdot_are_refused_then_the_real_upstream_is_served(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the hash cache
    data = os.urandom(3 * relay.CHUNK + 5)
    server = Server(tmp_path, ["model/w.bin"])
    server.connect("wrong", [_entry("model/w.bin", data)], data, refused=True)
    server.connect("t0k", [_entry("model/../../escape.bin", b"x")], b"x", refused=True)
    server.connect("t0k", [_entry("model/w.bin", data)], data)
    doc = server.result()
    assert server.code == 0, doc
    assert doc["files"] == ["model/w.bin"] and doc["bytes"] == len(data)
    assert len(doc["refused"]) == 2
    assert "wrong token" in doc["refused"][0] and "'..'" in doc["refused"][1]
    assert (tmp_path / "model" / "w.bin").read_bytes() == data
    assert not (tmp_path / "escape.bin").exists() and not (tmp_path.parent / "escape.bin").exists()
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["w.bin"]


def test_resume_keeps_the_prefix_and_a_bad_digest_never_gets_the_final_name(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    data = os.urandom(2 * relay.CHUNK)
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin.partial").write_bytes(data[:1000] + b"junk past the resume point")
    sha = hashlib.sha256(data).hexdigest()
    (model / "w.bin.partial.sha256").write_text(sha + "\n")
    (model / "orphan.bin.partial.sha256").write_text(sha + "\n")  # its partial is gone
    plan = relay.plan({"dirs": {"model": str(model)}})
    assert plan["partials"] == {"model/w.bin": [1026, sha], "model/orphan.bin": [0, ""]} and plan["manifest"] == {}
    assert relay.delete({"dirs": {"model": str(model)}, "paths": ["model/orphan.bin.partial"]})["deleted"] == [
        "model/orphan.bin.partial"]
    assert not (model / "orphan.bin.partial.sha256").exists()

    server = Server(tmp_path, ["model/w.bin"])
    server.connect("t0k", [_entry("model/w.bin", data, start=1000)], data[1000:])
    doc = server.result()
    assert doc["bytes"] == len(data) - 1000 and doc["errors"] == []
    assert (model / "w.bin").read_bytes() == data
    assert not (model / "w.bin.partial").exists() and not (model / "w.bin.partial.sha256").exists()

    server = Server(tmp_path, ["model/v.bin"])
    server.connect("t0k", [_entry("model/v.bin", b"expected")], b"tampered")
    doc = server.result()
    assert server.code == 1 and "sha256" in doc["errors"][0]
    assert not (model / "v.bin").exists() and not (model / "v.bin.partial").exists()


def test_delete_removes_extras_and_partials_only_inside(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "extra.bin").write_text("x")
    (model / "a.bin.partial").write_text("x")
    (model / "a.bin.partial.sha256").write_text("x")
    (tmp_path / "keep").write_text("x")
    doc = relay.delete({"dirs": {"model": str(model)}, "paths": ["model/extra.bin", "model/a.bin.partial",
                                                                 "model/../keep"]})
    assert doc["deleted"] == ["model/a.bin.partial", "model/extra.bin"]
    assert len(doc["errors"]) == 1 and "refused" in doc["errors"][0]
    assert not any(model.iterdir()) and (tmp_path / "keep").exists()


def test_the_source_reads_through_symlinks_and_the_chain_delivers(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face snapshot is symlinks to blobs: `send` follows them and streams to the first hop."""
    monkeypatch.setenv("HOME", str(tmp_path))
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    blob = tmp_path / "blob"
    data = os.urandom(relay.CHUNK + 7)
    blob.write_bytes(data)
    (src / "model" / "w.bin").symlink_to(blob)
    dst = tmp_path / "dst"
    dst.mkdir()
    server = Server(dst, ["model/w.bin"])
    out, err = io.StringIO(), io.StringIO()
    spec = {"token": "t0k", "dirs": {"model": str(src / "model")}, "files": [_entry("model/w.bin", data)],
            "chain": [["127.0.0.1", server.port]], "timeout": 30}
    assert relay.send(spec, out, err) == 0, out.getvalue()
    assert json.loads(out.getvalue())["bytes"] == len(data)
    assert server.result()["files"] == ["model/w.bin"]
    assert (dst / "model" / "w.bin").read_bytes() == data


def test_a_long_name_syncs_and_a_bad_file_does_not_stop_the_ones_after_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model" / "blocked").mkdir(parents=True)
    (tmp_path / "model" / "blocked" / "f.bin.partial").mkdir()  # a dir at the partial's name...
    (tmp_path / "model" / "blocked" / "f.bin.partial" / "x").write_bytes(b"x")  # ...not empty: f.bin cannot land
    long = "n" * 250  # near NAME_MAX: `<name>.partial.sha256` would be 265 bytes
    files = [("model/blocked/f.bin", b"first"), (f"model/{long}", b"long name"), ("model/z.bin", b"after")]
    server = Server(tmp_path, [p for p, _ in files])
    server.connect("t0k", [_entry(p, d) for p, d in files], b"".join(d for _, d in files))
    doc = server.result()
    assert doc["files"] == [f"model/{long}", "model/z.bin"]
    assert len(doc["errors"]) == 1 and doc["errors"][0].startswith("model/blocked/f.bin: ")
    assert (tmp_path / "model" / long).read_bytes() == b"long name"
    assert (tmp_path / "model" / "z.bin").read_bytes() == b"after"


def test_a_shortened_partial_is_planned_resumed_and_deleted_under_its_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    long = "é" * 125  # 250 bytes of UTF-8
    data = b"0123456789" * 100
    partial = relay.partial_path(str(model / long))
    assert len(os.path.basename(partial).encode()) + len(".sha256") <= relay.NAME_MAX
    assert relay.partial_path(str(model / "short.bin")) == str(model / "short.bin.partial")
    fd, _ = relay._open_partial(str(model / long), 0, hashlib.sha256(data).hexdigest())
    os.write(fd, data[:400])
    os.close(fd)
    plan = relay.plan({"dirs": {"model": str(model)}, "cache": None})
    assert plan["manifest"] == {} and plan["partials"] == {f"model/{long}": [400, hashlib.sha256(data).hexdigest()]}
    server = Server(tmp_path, [f"model/{long}"])
    server.connect("t0k", [_entry(f"model/{long}", data, start=400)], data[400:])
    assert server.result()["files"] == [f"model/{long}"] and (model / long).read_bytes() == data
    fd, _ = relay._open_partial(str(model / long), 0, "0" * 64)
    os.close(fd)
    done = relay.delete({"dirs": {"model": str(model)}, "paths": [f"model/{long}.partial"]})
    assert done["errors"] == [] and sorted(p.name for p in model.iterdir()) == [long]


def test_a_relay_exits_when_its_lifeline_closes(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "model").mkdir()
    # `serve` with nobody connecting would wait out its 30 s accept timeout; its stdin closing ends it at once.
    proc = subprocess.Popen([sys.executable, "-m", "worker.relay", "serve", "--bind", "127.0.0.1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(relay.__file__).parents[1])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"token": "t", "dirs": {"model": str(tmp_path / "model")}, "need": [],
                                 "timeout": 30, "lifeline": True}).encode() + b"\n")
    proc.stdin.flush()
    assert "port" in json.loads(proc.stdout.readline())
    proc.stdin.close()
    assert proc.wait() == relay.LIFELINE_EXIT  # (not 1: "no upstream connected within 30s")
