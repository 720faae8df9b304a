"""Fixtures for integration tests: SSH hosts in network namespaces (tests/testbed.py) and the real CLI.

These tests need root, iproute2, util-linux and OpenSSH (scripts/testbed-setup.sh installs them). When something
is missing every test here FAILS with the reason: nothing is skipped silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import pytest

from tests.testbed import REPO, TestBed, cleanup_stale, list_runs, remove_run, requirements_problems

CLI_TIMEOUT = 120.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _testbed_session() -> Iterator[None]:
    """Fail every integration test when the bed cannot run; clear dead runs first; check for leaks after."""
    problems = requirements_problems()
    if problems:
        pytest.fail(
            "integration test bed unavailable: " + "; ".join(problems) + " (CI: sudo scripts/testbed-setup.sh)",
            pytrace=False,
        )
    cleanup_stale()
    yield
    leaked = [r.tag for r in list_runs() if r.owner_pid == os.getpid()]
    if leaked:
        for tag in leaked:
            remove_run(tag)
        pytest.fail(f"test bed runs left open by this session: {', '.join(leaked)}", pytrace=False)


@pytest.fixture
def testbed(tmp_path: Path) -> Iterator[TestBed]:
    """A fresh, empty test bed (add hosts with add_host/add_hosts); closed after the test even on failure."""
    bed = TestBed(tmp=tmp_path / "testbed")
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture(scope="session")
def session_testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    """One bed shared by the whole session (for tests that only read hosts; do not stop or break them)."""
    bed = TestBed(tmp=tmp_path_factory.mktemp("session-testbed"))
    try:
        yield bed
    finally:
        bed.close()


class RunCli(Protocol):
    def __call__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = CLI_TIMEOUT,
        input: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]: ...


def _run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = CLI_TIMEOUT,
    input: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m coordinator ARGS` with this interpreter (the .venv's), never raising on the exit code.
    `env` is added to (and overrides) the current environment; output is plain and 200 columns wide unless
    `env` says otherwise. A timeout fails the test with whatever the CLI printed so far, so keep it below the
    suite's own per-test timeout (600 s, pyproject.toml): a CLI that hangs past that is killed by pytest-timeout
    with nothing of its output (CI12: a pipeline launch hung for 600 s and left no evidence)."""
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb", **(env or {})}
    argv = [sys.executable, "-m", "coordinator", *args]
    try:
        return subprocess.run(
            argv,
            cwd=cwd or REPO,
            env=full_env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:

        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        pytest.fail(
            f"coordinator {' '.join(args)} timed out after {timeout}s\n"
            f"--- stdout\n{text(exc.stdout)}\n--- stderr\n{text(exc.stderr)}",
            pytrace=False,
        )


@pytest.fixture
def run_cli() -> RunCli:
    """Runs the real CLI: `run_cli("check", "-i", str(inventory), env={...}, timeout=60)`."""
    return _run_cli
