"""Structured logging: JSON lines to the run dir, readable console lines, and no secret anywhere in either."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from coordinator.run.logs import (
    LOG_FILE_NAME,
    REDACTED,
    Redactor,
    collect_secrets,
    configure_logging,
    current_redactor,
    is_secret_name,
    redact,
)

HF = "hf_AbCdEfGhIjKlMnOpQrStUv"
AWS = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PLAYBOOK = "pl@ybook-s3cret"  # an explicit secret (a playbook env value marked secret)
SHORT_ENV = "1"  # FOO_KEY=1: a flag, not a secret
ENV = {"HF_TOKEN": HF, "AWS_SECRET_ACCESS_KEY": AWS, "FOO_KEY": SHORT_ENV, "HOME": "/root", "DB_PASSWORD": "pw"}
ALL_SECRETS = (HF, AWS, PLAYBOOK)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


# ------------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("GITHUB_TOKEN", True), ("api_key", True), ("OPENAI_API_KEY", True),
    ("CLIENT_SECRET", True), ("DB_PASSWORD", True), ("AWS_REGION", True), ("MY_CREDENTIALS", True),
    ("HOME", False), ("PATH", False), ("PYTHONPATH", False), ("MLX_RANK", False), ("SSH_AUTH_SOCK", False),
])  # fmt: skip
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_collect_secrets() -> None:
    got = collect_secrets(ENV, secret_env_names=["HOME"], secrets=[PLAYBOOK, "", HF])
    # Secret-looking names and named ones; short values (flags) and empty strings dropped; deduplicated.
    assert got == (HF, AWS, "/root", PLAYBOOK)


# ------------------------------------------------------------------------------------------------- redact


def test_redact_nested_values_substrings_and_keys() -> None:
    doc: dict[str, Any] = {
        "cmd": f"huggingface-cli login --token {HF} && echo ok",
        "env": {"HF_TOKEN": "anything-at-all", "AWS_SECRET_ACCESS_KEY": None, "OTHER": f"x{PLAYBOOK}y"},
        "list": [1, 2.5, True, None, (f"{AWS}", {"deep": [f"pre{HF}post"]})],
        f"key-with-{PLAYBOOK}": "v",
        "bytes": f"{HF}".encode(),
    }
    out = redact(doc, ALL_SECRETS)
    text = json.dumps(out)
    for s in ALL_SECRETS:
        assert s not in text
    assert out["cmd"] == f"huggingface-cli login --token {REDACTED} && echo ok"
    assert out["env"] == {"HF_TOKEN": REDACTED, "AWS_SECRET_ACCESS_KEY": None, "OTHER": f"x{REDACTED}y"}
    assert out["list"] == [1, 2.5, True, None, [REDACTED, {"deep": [f"pre{REDACTED}post"]}]]
    assert out[f"key-with-{REDACTED}"] == "v"
    assert out["bytes"] == REDACTED
    assert doc["cmd"].endswith("echo ok") and HF in doc["cmd"]  # the input is not modified


def test_redact_overlapping_secrets_longest_first() -> None:
    assert redact("a-abcdefgh-b", ["abcd", "abcdefgh"]) == f"a-{REDACTED}-b"
    assert redact("xxabcdxx abcdefgh", ["abcdefgh", "abcd"]) == f"xx{REDACTED}xx {REDACTED}"


def test_redact_short_secrets_only_whole_values() -> None:
    r = Redactor(("pw", "1234"))
    assert r.value({"a": "pw", "b": "pwned", "c": 1234, "d": 12345, "e": "x1234y"}) == {
        "a": REDACTED, "b": "pwned", "c": REDACTED, "d": 12345, "e": f"x{REDACTED}y"}


def test_redact_non_json_objects() -> None:
    exc = ValueError(f"bad token {HF}")
    path = Path("/tmp/plain")
    out = redact({"exc": exc, "path": path, "set": {HF}}, [HF])
    assert out["exc"] == f"bad token {REDACTED}"
    assert out["path"] is path  # no secret in it: left as it is
    assert out["set"] == [REDACTED]


def test_redact_without_secrets_is_identity() -> None:
    doc = {"a": [1, {"b": "c"}], "HF_TOKEN": ""}
    assert redact(doc, []) == doc


# -------------------------------------------------------------------------------------------- the log file


def _log_everything() -> None:
    log = structlog.get_logger("coordinator.test")
    structlog.contextvars.bind_contextvars(run_id="r1", launcher_cmd=f"env HF_TOKEN={HF} mlx.launch")
    log.info("launch", argv=["env", f"HF_TOKEN={HF}", "python"], env={"HF_TOKEN": HF, "X": f"s3:{AWS}"})
    log.warning(f"message text with {PLAYBOOK} inside", nested={"a": [{"b": (f"..{PLAYBOOK}..",)}]})
    log.info("kwarg key", HF_TOKEN="not-even-the-value")
    log.debug("filtered out at INFO", secret=HF)
    try:
        raise RuntimeError(f"login failed for {AWS}")
    except RuntimeError:
        log.exception("crash", step=3)


def _assert_clean(text: str) -> None:
    for s in ALL_SECRETS:
        assert s not in text, f"secret leaked: {s!r} in\n{text}"
    assert "not-even-the-value" not in text


def test_json_log_file_has_no_secret(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    handle = configure_logging(run_dir, console=False, secrets=[PLAYBOOK], env=ENV)
    _log_everything()
    handle.close()
    assert handle.log_file == run_dir / LOG_FILE_NAME
    text = handle.log_file.read_text()
    _assert_clean(text)
    events = [json.loads(line) for line in text.splitlines()]
    assert [e["event"] for e in events] == ["launch", f"message text with {REDACTED} inside", "kwarg key", "crash"]
    first: dict[str, Any] = events[0]
    assert first["run_id"] == "r1" and first["level"] == "info" and "timestamp" in first
    assert first["logger"] == "coordinator.test"
    assert first["argv"] == ["env", f"HF_TOKEN={REDACTED}", "python"]
    assert first["env"] == {"HF_TOKEN": REDACTED, "X": f"s3:{REDACTED}"}
    assert first["launcher_cmd"] == f"env HF_TOKEN={REDACTED} mlx.launch"
    crash = events[-1]
    assert crash["level"] == "error" and "RuntimeError: login failed for ***" in crash["exception"]


def test_console_output_has_no_secret(tmp_path: Path) -> None:
    stream = io.StringIO()
    handle = configure_logging(None, console=True, secrets=[PLAYBOOK], env=ENV, console_stream=stream)
    _log_everything()
    handle.close()
    text = stream.getvalue()
    _assert_clean(text)
    assert handle.log_file is None and not list(tmp_path.iterdir())
    assert "launch" in text and "Traceback" in text and "\x1b[" not in text  # not a terminal: no colours
    assert text.count("\n") >= 4 and not text.lstrip().startswith("{")  # readable, not JSON


def test_console_default_stream_is_stderr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    handle = configure_logging(tmp_path, console=True, secrets=[PLAYBOOK], env=ENV)
    _log_everything()
    handle.close()
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout stays free for --json results
    _assert_clean(captured.err)
    _assert_clean((tmp_path / LOG_FILE_NAME).read_text())
    assert "crash" in captured.err


def test_secrets_from_process_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-from-process-env")
    handle = configure_logging(tmp_path, console=False)
    structlog.get_logger().info("x", value="Bearer tok-from-process-env")
    handle.close()
    assert "tok-from-process-env" not in (tmp_path / LOG_FILE_NAME).read_text()


def test_reconfigure_closes_previous_file_and_appends(tmp_path: Path) -> None:
    first = configure_logging(tmp_path, console=False, env={})
    structlog.get_logger().info("one")
    second = configure_logging(tmp_path, console=False, env={}, level=30)  # WARNING
    assert first._file is not None and first._file.closed
    structlog.get_logger().info("dropped")
    structlog.get_logger().warning("two")
    second.close()
    second.close()  # idempotent
    events = [json.loads(line)["event"] for line in (tmp_path / LOG_FILE_NAME).read_text().splitlines()]
    assert events == ["one", "two"]


def test_current_redactor_follows_configuration(tmp_path: Path) -> None:
    handle = configure_logging(tmp_path, console=False, secrets=[PLAYBOOK], env=ENV)
    assert current_redactor() is handle.redactor
    assert current_redactor().value({"summary": f"x {PLAYBOOK} {HF}"}) == {"summary": f"x {REDACTED} {REDACTED}"}
    handle.close()
