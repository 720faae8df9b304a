from __future__ import annotations

import subprocess

import pytest

from coordinator.fleet.transport import build_command, python_argv


@pytest.mark.parametrize("arg", ["a b", "$(id)", "`id`", "x;y", "it's", "\n", "--", "*", "~/x"])
def test_build_command_round_trips_through_sh(arg: str) -> None:
    cmd = build_command(["printf", "%s", arg])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True)
    assert out.stdout == arg


def test_python_argv_expands_only_a_leading_tilde() -> None:
    argv = python_argv("~/bin/py thon", "-c", "x; y")
    script = build_command([*argv[:3], "sh", "printf", "%s|", "-c", "x; y"])
    # Replace the interpreter with printf to see what would run.
    argv2 = ["sh", "-c", 'exec printf "%s|" "$HOME"/\'bin/py thon\' "$@"', "sh", "-c", "x; y"]
    out = subprocess.run(argv2, capture_output=True, text=True, env={"HOME": "/h", "PATH": "/usr/bin:/bin"})
    assert out.stdout == "/h/bin/py thon|-c|x; y|"
    assert argv[0] == "sh" and "bin/py thon" in argv[2]
    assert script
    assert python_argv("/usr/bin/python3", "-V") == ["/usr/bin/python3", "-V"]


def test_empty_argv_is_rejected() -> None:
    with pytest.raises(ValueError):
        build_command([])
