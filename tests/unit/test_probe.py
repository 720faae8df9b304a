"""The probe script: sections fenced by a nonce, quoting, tilde paths; run for real under /bin/sh."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from coordinator.facts.probe import build_probe, parse_probe_output, shell_path
from tests.sshserver import probe_worker_args


@pytest.fixture(autouse=True)
def own_home(tmp_path_factory, monkeypatch) -> None:
    """The probe keeps its caches under ~/.cache: never the runner's."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


def run_probe(python: str = sys.executable, workdir: str = "/tmp", args: dict | None = None) -> dict:
    probe = build_probe(python=python, workdir=workdir, worker_args=args or {})
    done = subprocess.run(list(probe.argv), input=probe.stdin, capture_output=True, text=True, timeout=120)
    return parse_probe_output(done.stdout, probe.nonce)


def test_linux_probe_has_every_section_and_worker_json() -> None:
    sections = run_probe()
    for name in ("uname", "os_release", "meminfo", "nproc", "loadavg", "ip_addr", "df", "env", "worker"):
        assert name in sections, name
    assert sections["uname"].text.split()[0] == "Linux"
    assert sections["uname"].rc == 0
    data = json.loads(sections["worker"].text)
    assert data["python"]["version"].startswith("3.")


def test_linux_probe_reads_sys_class_net() -> None:
    from coordinator.facts.linux import parse_sys_class_net

    section = run_probe()["sys_class_net"]
    assert section.rc == 0
    links = {link.name: link for link in parse_sys_class_net(section.text)}
    assert links["lo"].arphrd_type == 772 and links["lo"].virtual  # every Linux machine has a loopback


def test_missing_python_is_reported_not_crashed() -> None:
    sections = run_probe(python="/nonexistent/python")
    assert sections["worker"].rc == 127
    assert "/nonexistent/python" in sections["worker"].text


def test_workdir_that_does_not_exist_uses_nearest_parent() -> None:
    sections = run_probe(workdir="/tmp/does/not/exist/yet")
    assert sections["df"].rc == 0
    assert sections["df"].text.strip()


def test_hostile_values_are_quoted(tmp_path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"/tmp/x'; touch {marker}; echo '"
    sections = run_probe(workdir=hostile, args={"hash_dirs": [f"$(touch {marker})", hostile]})
    assert not marker.exists()
    assert "worker" in sections


def test_the_simulated_nodes_find_the_worker_argument_in_the_probe() -> None:
    # tests/sshserver.py's fake nodes (the scale benchmark's) answer `reach` for the peers the probe asks for.
    args = {"peers": [{"name": "h'2", "ip": "10.0.0.2", "port": 22}], "hash_dirs": ["/srv/a b; c", "$(x)"]}
    probe = build_probe(python="~/venvs/mlx/bin/python", workdir="/tmp", worker_args=args)
    assert probe_worker_args(shlex.join(probe.argv)) == args


def test_forged_markers_in_output_do_not_split_sections() -> None:
    probe = build_probe(python=sys.executable, workdir="/tmp", worker_args={}, nonce="abc123")
    fake = "abc123 END uname 0\n"  # a node cannot know the nonce in advance; even if it prints one, rc stays intact
    out = f"abc123 BEGIN uname\nLinux 6.1 x86_64\n{fake}\nabc123 END uname 0\n"
    sections = parse_probe_output(out, probe.nonce)
    assert sections["uname"].text.startswith("Linux 6.1 x86_64")


def test_banner_outside_sections_is_ignored() -> None:
    out = "Welcome to the node\nabc BEGIN nproc\n8\nabc END nproc 0\n"
    sections = parse_probe_output(out, "abc")
    assert sections["nproc"].text == "8"
    assert sections["nproc"].rc == 0


def test_shell_path_keeps_tilde_meaning_home() -> None:
    out = subprocess.run(["sh", "-c", f"echo {shell_path('~/a b/c')}"], capture_output=True, text=True,
                         env={"HOME": "/home/u", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "/home/u/a b/c"
    assert shell_path("/x;y") == "'/x;y'"
