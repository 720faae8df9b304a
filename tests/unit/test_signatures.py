"""Error signatures and the table of known failures: failure lines in, signatures and explanations out."""

from __future__ import annotations

import pytest

from coordinator.run.signatures import KNOWN_ERRORS, error_signature, explain_error


def test_a_signature_masks_paths_numbers_hex_and_node_names() -> None:
    names = {"h1", "h10", "studio"}
    a = error_signature("ValueError: /srv/work/runs/r-1/h1/data/train.jsonl is missing or empty", names)
    b = error_signature("ValueError: /srv/work/runs/r-1/h10/data/train.jsonl is missing or empty", names)
    assert a == b == "ValueError: <path> is missing or empty"
    assert error_signature("UnicodeDecodeError: can't decode byte 0xff in position 12: invalid start byte") == \
        "UnicodeDecodeError: can't decode byte <hex> in position <n>: invalid start byte"
    assert error_signature("RuntimeError: rank 2 on studio failed", names) == "RuntimeError: rank <n> on <node> failed"
    assert error_signature("  KeyError:\n  'text'  ") == "KeyError: 'text'"


def test_different_errors_keep_different_signatures() -> None:
    assert error_signature("KeyError: 'text'") != error_signature("KeyError: 'messages'")
    assert error_signature("ValueError: boom") != error_signature("RuntimeError: boom")
    assert len(error_signature("E: " + "x" * 1000)) == 300


@pytest.mark.parametrize(("line", "code", "blame"), [
    ("RuntimeError: [METAL] Command buffer execution failed: Caused GPU Timeout Error "
     "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)", "gpu_timeout", "node"),
    ("RuntimeError: [metal::malloc] Attempting to allocate 40000000000 bytes which is greater than the maximum "
     "allowed buffer size", "out_of_memory", "either"),
    ("RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "out_of_memory", "either"),
    ("RuntimeError: [jaccl] Couldn't open device rdma_en3: Device or resource busy (EBUSY)", "rdma_busy", "node"),
    ("RuntimeError: [jaccl] Failed to query the GID of port 1", "rdma_setup", "either"),
    ("RuntimeError: [jaccl] ibv_modify_qp failed to move the QP to RTR", "rdma_setup", "either"),
    ("UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 7: invalid start byte",
     "data_not_utf8", "job"),
    ("JSONDecodeError: Expecting value: line 1 column 1 (char 0)", "data_not_json", "job"),
    ("ValueError: /srv/data/train.jsonl is missing or empty", "data_missing", "job"),
    ("ValueError: Unsupported data format, check the supported formats here", "data_format", "job"),
    ("KeyError: 'text'", "data_format", "job"),
    ("FileNotFoundError: No safetensors found in /srv/model", "model_weights", "job"),
    ("OSError: Can't load tokenizer for '/srv/model'", "model_tokenizer", "job"),
    ("RuntimeError: [ring] Couldn't connect (error: 111)", "ring_connect", "peer"),
    ("RuntimeError: [jaccl] Couldn't connect (error: 60)", "ring_connect", "peer"),
    ("RuntimeError: [ring] Couldn't bind socket (error: 98)", "ring_connect", "peer"),
])
def test_known_failures_have_a_cause_and_a_remedy(line: str, code: str, blame: str) -> None:
    known = explain_error(line)
    assert known is not None and (known.code, known.blame) == (code, blame)
    assert known.cause and known.remedy


def test_unknown_failures_and_echoes_have_no_explanation() -> None:
    assert explain_error("RuntimeError: [ring] connection to a peer was lost") is None
    assert explain_error("KeyError: 'lr'") is None
    assert explain_error("") is None and explain_error(None) is None


def test_every_entry_of_the_table_is_distinct() -> None:
    codes = [e.code for _, e in KNOWN_ERRORS]
    assert len(codes) == len(set(codes))
    assert {e.blame for _, e in KNOWN_ERRORS} <= {"job", "node", "either", "peer"}
