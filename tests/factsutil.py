"""Build probe sections and NodeFacts from the recorded node profiles, for "facts in, verdicts out" tests.

A profile (tests/fixtures/profiles/<name>/) answers every OS section of the probe; it has no `env` or
`worker` section, so `profile_sections` adds them: an `env` text and the JSON `worker/probe.py` prints.
Variations are made on the *raw text* (`edit`, `edit_block`) so that every case goes through the real
parsers in `build_node_facts`. Every edit asserts that the text it replaces is present: a fixture change
can never turn a case into a silent no-op.

`studio_mesh` derives N Mac Studios wired by TB5 cables from the `m3ultra-studio-tb5` profile (for 3- and
4-node jaccl / jaccl-ring topologies no recording has): each clone gets its own bus domain UUIDs, and per
cable a connected 80 Gb/s receptacle naming the peer's bus, an IPv4 on the enX behind it, and its rdma_enX
PORT_ACTIVE; every other receptacle is empty and every other rdma device PORT_DOWN.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.facts.build import build_node_facts
from coordinator.facts.model import NodeFacts
from coordinator.facts.probe import Section
from coordinator.models import Node

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROFILES = FIXTURES / "profiles"
CAPTURES = FIXTURES / "captures"

MBP = "m5max-mbp-tb5"
STUDIO = "m3ultra-studio-tb5"
NODEV = "m4max-mbp-tb4-rdma-nodev"
OLD = "m1max-macos14"
ALL_PROFILES = (MBP, STUDIO, NODEV, OLD)

PYTHON = "/Users/me/venvs/mlx/bin/python"
WORKDIR = "/Users/me/mlx-work"
MODEL_DIR = "/Users/me/models/llama-1b"
DATA_DIR = "/Users/me/data/chat"

ENV_TEXT = "HOME=/Users/me\nPATH=/usr/bin:/bin:/usr/sbin:/sbin\nSHELL=/bin/zsh\nUSER=me\n"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


MODEL_FILES: dict[str, str] = {
    "config.json": sha("config"),
    "model.safetensors": sha("weights"),
    "tokenizer.json": sha("tokenizer"),
}
DATA_FILES: dict[str, str] = {"train.jsonl": sha("train"), "valid.jsonl": sha("valid")}

# A llama-style 1.1B model: small enough for LoRA on every profile's memory.
MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
MODEL_PARAMS = 1_100_048_384


# ------------------------------------------------------------------------------------------------- sections


def load_profile(name: str) -> dict[str, Section]:
    """The recorded OS sections of a profile (`<section>.out`, exit status from `<section>.rc` or 0)."""
    out: dict[str, Section] = {}
    for path in sorted((PROFILES / name).glob("*.out")):
        rc_file = path.with_suffix(".rc")
        rc = int(rc_file.read_text().strip()) if rc_file.exists() else 0
        out[path.stem] = Section(path.stem, path.read_text(encoding="utf-8"), rc)
    assert out, f"no profile {name}"
    return out


def capture(rel: str) -> str:
    return (CAPTURES / rel).read_text(encoding="utf-8")


def linux_sections() -> dict[str, Section]:
    """A Debian 12 x86_64 node, from the Linux captures (no /sys/class/infiniband)."""
    texts = {
        "uname": capture("uname/linux-6.18-x86_64-debian-12.txt"),
        "os_release": capture("os_release/debian-12.txt"),
        "meminfo": capture("meminfo/debian-12-24gib.txt"),
        "nproc": capture("nproc/debian-12-2cpu.txt"),
        "loadavg": capture("loadavg/debian-12.txt"),
        "ip_addr": capture("ip_addr/debian-12-eth0.txt"),
        "sys_class_net": capture("sys_class_net/debian-12-vm-virtio.txt"),
        "cgroup_memory": capture("cgroup_memory/debian-12-v1-unlimited.txt"),
        "df": capture("df/debian-12-gnu-root.txt"),
    }
    out = {k: Section(k, v, 0) for k, v in texts.items()}
    out["infiniband"] = Section("infiniband", capture("infiniband/absent-debian-12.txt"), 2)
    return out


def edit(text: str, old: str, new: str, *, count: int = 1) -> str:
    """Replace `old` exactly `count` times (asserted), so an edit that no longer applies fails loudly."""
    found = text.count(old)
    assert found == count, f"expected {count} x {old!r}, found {found}"
    return text.replace(old, new)


def _blocks(text: str) -> list[tuple[str | None, list[str]]]:
    """ifconfig text -> [(interface or None for leading lines, its lines)]."""
    blocks: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in text.splitlines(keepends=True):
        m = re.match(r"^([A-Za-z0-9]+): flags=", line)
        if m:
            blocks.append((m[1], []))
        blocks[-1][1].append(line)
    return blocks


def edit_block(text: str, iface: str, old: str, new: str) -> str:
    """`edit` inside one ifconfig interface block only (status/inet lines repeat across blocks)."""
    out: list[str] = []
    hit = False
    for name, lines in _blocks(text):
        chunk = "".join(lines)
        if name == iface:
            chunk = edit(chunk, old, new)
            hit = True
        out.append(chunk)
    assert hit, f"no ifconfig block {iface}"
    return "".join(out)


def set_link_speed(sp_text: str, bus_uuid: str, speed: str, *, peer: str | None = None) -> str:
    """The system_profiler text with the receptacle of bus `bus_uuid` negotiated at `speed` ("40 Gb/s") and,
    with `peer`, its connected Mac's domain UUID replaced (the cable now goes to that Mac's bus)."""
    doc = json.loads(sp_text)
    buses = [b for b in doc["SPThunderboltDataType"] if b.get("domain_uuid_key") == bus_uuid]
    assert len(buses) == 1, f"no bus {bus_uuid}"
    tag = buses[0]["receptacle_1_tag"]
    assert tag["receptacle_status_key"] == "receptacle_connected", "the bus has no cable"
    tag["current_speed_key"] = speed
    if peer is not None:
        (mac,) = [i for i in buses[0]["_items"] if "domain_uuid_key" in i]
        mac["domain_uuid_key"] = peer
    return json.dumps(doc, indent=2)


def ibv_devinfo_state(text: str, device: str, state: str) -> str:
    """Set one device's port state in `ibv_devinfo` output (`PORT_ACTIVE (4)` / `PORT_DOWN (1)`)."""
    parts = text.split("\n\n")
    hits = 0
    for i, block in enumerate(parts):
        if re.search(rf"^hca_id:\t{re.escape(device)}$", block, re.M):
            parts[i] = re.sub(r"state:(\t+)PORT_\w+ \(\d\)", rf"state:\g<1>{state}", block)
            hits += 1
    assert hits == 1, f"no ibv_devinfo block {device}"
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------- worker


def hashes_answer(model: Mapping[str, str] | None = None, data: Mapping[str, str] | None = None, *,
                  model_dir: str = MODEL_DIR, data_dir: str | None = DATA_DIR,
                  missing: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The worker's `hashes` list for the model dir (then the data dir): {relative path: sha256}."""
    dirs: list[tuple[str, Mapping[str, str]]] = [(model_dir, MODEL_FILES if model is None else model)]
    if data_dir is not None:
        dirs.append((data_dir, DATA_FILES if data is None else data))
    out = []
    for path, files in dirs:
        exists = path not in missing
        out.append({
            "path": path,
            "exists": exists,
            "files": [{"path": rel, "size": 1000 + len(rel), "sha256": digest} for rel, digest in sorted(files.items())]
            if exists else [],
            "error": None,
            "cached_files": 0,
            "hashed_bytes": sum(1000 + len(rel) for rel in files) if exists else 0,
        })
    return out


def reach_answer(node: Node, nodes: Sequence[Node], *, down: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Every peer's data-plane IP answered, except `down` {peer: error}."""
    down = down or {}
    return [
        {"peer": p.name, "ip": p.data_ip, "ok": p.name not in down,
         "rtt_ms": None if p.name in down else 0.42, "error": down.get(p.name)}
        for p in nodes if p.name != node.name
    ]


def worker_answer(*, python: str = PYTHON, version: str = "3.12.8", mlx: str | None = "0.32.1",
                  mlx_lm: str | None = "0.31.0", hashes: list[dict[str, Any]] | None = None,
                  reach: list[dict[str, Any]] | None = None, config: Mapping[str, Any] | None = None,
                  params: int | None = MODEL_PARAMS, errors: Sequence[str] = (), model_error: str | None = None,
                  data: Mapping[str, Any] | None = None, backends: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What worker/probe.py prints (keys it omits without a playbook are omitted when None; `backends`, the
    `mlx_backends` answer, is omitted when None, as in answers recorded before the probe reported it)."""
    out: dict[str, Any] = {
        "python": {"executable": python, "version": version},
        "packages": {"mlx": mlx, "mlx_lm": mlx_lm},
        "errors": list(errors),
    }
    if backends is not None:
        out["mlx_backends"] = dict(backends)
    if hashes is not None:
        out["hashes"] = hashes
    if reach is not None:
        out["reach"] = reach
    out["model"] = {"config": dict(MODEL_CONFIG if config is None else config), "params": params,
                    "error": model_error}
    if data is not None:
        out["data"] = data
    return out


def data_answer(**files: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's `data` section for the data dir: {file name: overrides of a good file's entry}."""
    good = {"required": False, "exists": True, "rows": 10, "bytes": 400, "checked_bytes": 400, "format": "text",
            "error": None}
    return {"dir": DATA_DIR, "error": None,
            "files": [{"name": f"{name}.jsonl", **good, "required": name == "train", **over}
                      for name, over in files.items()]}


def profile_sections(profile: str | Mapping[str, Section], *, env: str | None = ENV_TEXT,
                     worker: Mapping[str, Any] | str | None = None, worker_rc: int = 0,
                     replace: Mapping[str, str | Section | None] | None = None) -> dict[str, Section]:
    """A profile's sections plus `env` and `worker`; `replace` swaps a section's text (or Section), None drops it."""
    sections = dict(load_profile(profile) if isinstance(profile, str) else profile)
    if env is not None:
        sections["env"] = Section("env", env, 0)
    if worker is not None:
        text = worker if isinstance(worker, str) else json.dumps(worker)
        sections["worker"] = Section("worker", text, worker_rc)
    for name, value in (replace or {}).items():
        if value is None:
            sections.pop(name, None)
        elif isinstance(value, Section):
            sections[name] = value
        else:
            sections[name] = Section(name, value, 0)
    return sections


def facts_from(node: str, sections: Mapping[str, Section], workdir: str = WORKDIR) -> NodeFacts:
    return build_node_facts(node, sections, workdir=workdir)


# ------------------------------------------------------------------------------------------------- studio mesh


def _studio_uuid(index: int, receptacle: int) -> str:
    return f"5717D10{index:X}-0000-4000-8000-00000000000{receptacle}"


def studio_mesh(count: int, cables: Sequence[tuple[int, int, int, int]]) -> list[dict[str, Section]]:
    """OS sections of `count` Mac Studios joined by `cables` = [(node a, receptacle a, node b, receptacle b)].

    Receptacle N is `Thunderbolt N` = en(N+1) = rdma_en(N+1) (the studio's networksetup); cable k gives
    10.0.k.1/30 to a's interface and 10.0.k.2/30 to b's. en0 (Ethernet) gets 192.168.2.(50 + index).
    """
    base = load_profile(STUDIO)
    sp = json.loads(base["system_profiler"].text)
    template_peer = next(bus["_items"][0] for bus in sp["SPThunderboltDataType"]
                         if any("domain_uuid_key" in i for i in bus.get("_items", [])))
    wired: dict[tuple[int, int], tuple[int, int, str]] = {}  # (node, receptacle) -> (peer, peer rec, my ip)
    for k, (a, ra, b, rb) in enumerate(cables):
        assert (a, ra) not in wired and (b, rb) not in wired, "one cable per receptacle"
        wired[(a, ra)] = (b, rb, f"10.0.{k}.1")
        wired[(b, rb)] = (a, ra, f"10.0.{k}.2")
    out = []
    for index in range(count):
        doc = copy.deepcopy(sp)
        for bus in doc["SPThunderboltDataType"]:
            tag = bus["receptacle_1_tag"]
            rec = int(tag["receptacle_id_key"])
            bus["domain_uuid_key"] = _studio_uuid(index, rec)
            bus.pop("_items", None)
            if (index, rec) in wired:
                peer, peer_rec, _ = wired[(index, rec)]
                item = copy.deepcopy(template_peer)
                item.update({"_name": "Mac Studio", "device_name_key": "Mac15,14",
                             "domain_uuid_key": _studio_uuid(peer, peer_rec)})
                bus["_items"] = [item]
                tag.update({"current_speed_key": "80 Gb/s", "link_status_key": "0x2",
                            "receptacle_status_key": "receptacle_connected"})
            else:
                tag.update({"current_speed_key": "Up to 120 Gb/s", "link_status_key": "0x100",
                            "receptacle_status_key": "receptacle_no_devices_connected"})
        ifconfig = _mesh_ifconfig(base["ifconfig"].text, index, {rec: ip for (n, rec), (_, _, ip) in wired.items()
                                                                 if n == index})
        devinfo = base["ibv_devinfo"].text
        for dev_rec in range(1, 7):
            state = "PORT_ACTIVE (4)" if (index, dev_rec) in wired else "PORT_DOWN (1)"
            devinfo = ibv_devinfo_state(devinfo, f"rdma_en{dev_rec + 1}", state)
        sections = dict(base)
        sections["system_profiler"] = Section("system_profiler", json.dumps(doc, indent=2), 0)
        sections["ifconfig"] = Section("ifconfig", ifconfig, 0)
        sections["ibv_devinfo"] = Section("ibv_devinfo", devinfo, 0)
        out.append(sections)
    return out


def _mesh_ifconfig(text: str, index: int, ips: Mapping[int, str]) -> str:
    out: list[str] = []
    for name, lines in _blocks(text):
        rec = int(name[2:]) - 1 if name and re.fullmatch(r"en[2-7]", name) else None
        for line in lines:
            if rec is not None and line.startswith("\tinet "):
                continue
            if rec is not None and line.startswith("\tstatus: "):
                line = "\tstatus: active\n" if rec in ips else "\tstatus: inactive\n"
            out.append(line)
            if rec is not None and rec in ips and line.startswith("\tether "):
                ip = ips[rec]
                bcast = ip.rsplit(".", 1)[0] + ".3"
                out.append(f"\tinet {ip} netmask 0xfffffffc broadcast {bcast}\n")
    return edit("".join(out), "inet 192.168.2.47 ", f"inet 192.168.2.{50 + index} ")
