"""Error signatures and known failure causes: pure text in, typed values out. No I/O.

A rank reports a failure as one line, `"<ExceptionType>: <message>"` (worker.train's `error` event). Two ranks
failed *the same way* when their lines have the same **signature**: the line with everything that names a place
or an instance masked (paths, numbers, hex, node names), so rank 0's "UnicodeDecodeError: ... in position 12
of /srv/work/runs/x/h1/..." and rank 2's equal the same signature. The monitor compares signatures to tell a job
error (every rank fails the same way, or the error follows the work to another node) from a node fault
(coordinator/run/monitor.py, docs/faults.md).

`explain_error` maps the failures operators meet at launch time to a plain-words cause and remedy (the table
KNOWN_ERRORS, first match wins), shown with the incident.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_PATH = re.compile(r"(?:~|\.{1,2})?/[^\s'\",:;()\[\]{}]+")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SPACE = re.compile(r"\s+")
MAX_SIGNATURE = 300  # the line's head is what identifies it; a long tail (a dumped row) only adds noise


def error_signature(message: str, names: Iterable[str] = ()) -> str:
    """The failure line with instance details masked: node `names` -> <node>, paths -> <path>, hex -> <hex>,
    numbers (rank ids, positions, line numbers, sizes) -> <n>; whitespace collapsed; at most MAX_SIGNATURE
    characters. Equal signatures mean "the same error" across ranks and nodes."""
    text = message.strip()
    for name in sorted({n for n in names if n}, key=len, reverse=True):  # longest first: "h10" before "h1"
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "<node>", text)
    text = _PATH.sub("<path>", text)
    text = _HEX.sub("<hex>", text)
    text = _NUMBER.sub("<n>", text)
    return _SPACE.sub(" ", text)[:MAX_SIGNATURE]


@dataclass(frozen=True)
class Explanation:
    """What a known failure means. `blame`: `job` (the playbook, model or data: the same on every node), `node`
    (that machine's state), `either` (the line alone cannot tell; the monitor's evidence decides), or `peer`
    (the rank that reports it failed because of another: a peer that was not listening yet, or not at all, when
    the ring was formed; the reporter's node is never blamed for it)."""

    code: str
    cause: str
    remedy: str
    blame: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "cause": self.cause, "remedy": self.remedy, "blame": self.blame}


# (pattern searched case-insensitively in the failure line, explanation). Order matters: specific first.
KNOWN_ERRORS: tuple[tuple[re.Pattern[str], Explanation], ...] = tuple((re.compile(p, re.IGNORECASE), e) for p, e in (
    (r"kIOGPUCommandBufferCallbackErrorOutOfMemory|\[metal::malloc\]|insufficient memory|out of memory|MemoryError",
     Explanation("out_of_memory", "the rank ran out of GPU memory",
                 "lower train.batch_size or train.max_seq_length, set train.grad_checkpoint: true, or lower "
                 "calibration.memory_fraction so the split gives this Mac less", "either")),
    (r"kIOGPUCommandBufferCallbackErrorTimeout|GPU Timeout Error|command buffer.*timed? ?out",
     Explanation("gpu_timeout", "Metal's GPU watchdog killed a command buffer that ran too long (a GPU hang, "
                 "or the GPU starved by the display or another process)",
                 "close GPU-heavy apps on that Mac and relaunch; if it recurs on the same Mac, reboot it; smaller "
                 "batches (train.batch_size, max_seq_length) shorten each command buffer", "node")),
    # The collective's connections are made when the ranks start (mx.distributed.init): the ring's and jaccl's
    # connect gives up after a few attempts (ring: 5, backoff 1-8 s) when the peer is not listening yet, which a
    # peer slow to start on a loaded machine is not. The error names the reporter, not the late peer.
    (r"\[(ring|jaccl|ibv)\] Couldn't (connect|bind|listen)|\[(ring|jaccl|ibv)\] .*(Connection refused|Address "
     r"already in use)",
     Explanation("ring_connect", "the ranks could not form the ring at start-up: a peer was not listening yet "
                 "(it started late on a loaded machine), or its port was taken or blocked",
                 "nothing, usually: the coordinator relaunches on the same nodes, nobody quarantined; if it recurs, "
                 "check that the nodes reach each other on the ring's ports (`coordinator nettest`), that no "
                 "leftover rank of another run holds them (`coordinator status`), and the nodes' load", "peer")),
    (r"EBUSY|device or resource busy|resource busy",
     Explanation("rdma_busy", "the RDMA device is still held (by a rank of an earlier run that crashed, or "
                 "another job): jaccl cannot open its queue pairs",
                 "find and stop the leftover process (`coordinator status`; `ps aux | grep worker.train`), or "
                 "reboot the Mac; then relaunch", "node")),
    (r"\bGID\b|\bQP\b|queue pair|ibv_modify_qp|ibv_create_qp|ibv_query_gid",
     Explanation("rdma_setup", "the RDMA connection could not be set up (GID / queue-pair error): the "
                 "Thunderbolt RDMA interface is down, unconfigured, or the cable is not where the hostfile says",
                 "run `coordinator preflight` (checks rdma and thunderbolt), `rdma_ctl status` on the Mac, reseat "
                 "the cable", "either")),
    (r"ncclInvalidUsage|invalid usage|\[nccl\]|NCCL error",
     Explanation("nccl_setup", "NCCL could not set up the ranks' communicator: most often two ranks on one GPU "
                 "(each rank needs its own device), a GPU another process holds, or NCCL_* settings that do not "
                 "fit the machine",
                 "leave CUDA_VISIBLE_DEVICES to the coordinator (one rank per GPU; inventory `gpus:` to use fewer), "
                 "check `nvidia-smi` for other processes on the GPUs, and read NCCL's own message in launcher.log "
                 "(set NCCL_DEBUG=INFO in the playbook's env for more)", "job")),
    (r"UnicodeDecodeError",
     Explanation("data_not_utf8", "a data file has bytes that are not UTF-8",
                 "fix or remove the line (`coordinator preflight` names file:line), then relaunch", "job")),
    (r"JSONDecodeError|Expecting value|Extra data|Unterminated string",
     Explanation("data_not_json", "a line of a data file is not JSON (mlx-lm reads one JSON object per line)",
                 "fix or remove the line (`coordinator preflight` names file:line); no blank lines", "job")),
    (r"train\.jsonl is missing or empty|data dir .* does not exist",
     Explanation("data_missing", "the data dir, or its train.jsonl, is missing (or train.jsonl is empty)",
                 "put train.jsonl (and valid.jsonl for evals) in the playbook's `data` dir on every node", "job")),
    (r"Unsupported data format|KeyError: '(text|messages|prompt|completion|chosen|rejected)'",
     Explanation("data_format", "data rows lack the keys the trainer needs ({\"text\"}, {\"messages\"} or "
                 "{\"prompt\", \"completion\"}; DPO: \"chosen\"/\"rejected\"), or rows mix formats",
                 "make every row of the data files use the format of the first one (docs/inventory-and-playbooks.md)",
                 "job")),
    (r"No safetensors found",
     Explanation("model_weights", "the model dir has no (readable) *.safetensors weights",
                 "copy the model's *.safetensors (not git-lfs pointers) into the playbook's `model` dir on every "
                 "node", "job")),
    (r"tokenizer",
     Explanation("model_tokenizer", "the model's tokenizer could not be loaded",
                 "put the tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json) in the model "
                 "dir on every node", "job")),
    (r"config\.json",
     Explanation("model_config", "the model dir's config.json is missing or unreadable",
                 "copy the model's config.json into the playbook's `model` dir on every node", "job")),
))


def explain_error(message: str | None) -> Explanation | None:
    """The first KNOWN_ERRORS entry whose pattern occurs in the failure line; None when none does."""
    if not message:
        return None
    return next((e for pattern, e in KNOWN_ERRORS if pattern.search(message)), None)
