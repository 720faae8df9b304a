"""Turn a node's raw probe sections into typed `NodeFacts`. Pure.

Every parser failure, missing command or non-zero exit becomes a `FactError` carrying the raw text; the
section's facts are then `None` so the checks report `error` with that evidence instead of guessing. Odd node
output is a `ParseError`; an exception of any other kind in a parser is recorded as `parser_bug` (our fault).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from coordinator.facts import linux, macos
from coordinator.facts.model import (
    DataCheck,
    DataFile,
    DirHashes,
    FactError,
    FactErrorKind,
    FileHash,
    Gpu,
    Memory,
    NodeFacts,
    OsInfo,
    ParseError,
    Rdma,
    RdmaDevice,
    Reach,
    Software,
)
from coordinator.facts.probe import OPTIONAL_SECTIONS, Section

T = TypeVar("T")

# A shell prints one of these (with exit 127) when a command does not exist.
_NOT_FOUND = ("command not found", "not found", "No such file or directory")


class _Builder:
    def __init__(self, sections: Mapping[str, Section]) -> None:
        self.sections = sections
        self.errors: list[FactError] = []

    def text(self, name: str, *, optional: bool = False) -> str | None:
        """The section's output when the command ran and succeeded; records why not otherwise."""
        sec = self.sections.get(name)
        if sec is None:
            if not optional and name not in OPTIONAL_SECTIONS:
                self.errors.append(FactError(name, "the probe returned no output for this command"))
            return None
        if sec.rc != 0:
            if optional:
                return None
            missing = sec.rc == 127 or (any(m in sec.text for m in _NOT_FOUND) and len(sec.text) < 300)
            what = "command not found" if missing else f"exited with status {sec.rc}"
            self.errors.append(FactError(name, what, sec.text))
            return None
        return sec.text

    def missing(self, name: str) -> bool:
        """True when the command does not exist on the node (exit 127), which is itself a fact."""
        sec = self.sections.get(name)
        return sec is not None and sec.rc == 127

    def parse(self, name: str, fn: Callable[[str], T], *, optional: bool = False) -> T | None:
        text = self.text(name, optional=optional)
        if text is None:
            return None
        return self.guard(name, text, lambda: fn(text))

    def guard(self, name: str, raw: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None with the failure recorded. A parser says "not what the command prints" by raising
        ParseError (or the ValueError of int()/float()/json on the node's text): the node's odd output. Any other
        exception (KeyError, TypeError, ...) is a bug in our parser, recorded as such with its type, never
        blamed on the node; and caught, so one broken parser costs its fact, not the node's other facts."""
        try:
            return fn()
        except ValueError as exc:  # ParseError is a ValueError
            self.errors.append(FactError(name, f"unparseable output: {exc}", raw))
        except Exception as exc:  # noqa: BLE001 - the point: every other exception is our bug, kept as evidence
            self.errors.append(FactError(name, f"parser bug: {type(exc).__name__}: {exc}", raw,
                                         FactErrorKind.PARSER_BUG))
        return None


def build_node_facts(node: str, sections: Mapping[str, Section], *, workdir: str = "") -> NodeFacts:
    b = _Builder(sections)
    uname = b.parse("uname", macos.parse_uname)
    fields: dict[str, Any] = {}
    if uname is not None and uname[0] == "Darwin":
        fields = _macos(b, uname)
    elif uname is not None:
        fields = _linux(b, uname)
    disk_text = b.text("df")
    if disk_text is not None:
        fields["disk"] = b.guard("df", disk_text, lambda: macos.parse_df(disk_text, workdir))
    env_text = b.text("env")
    if env_text is not None:
        fields["env"] = parse_env(env_text)
    fields.update(_worker(b))
    return NodeFacts(node=node, errors=tuple(b.errors), raw={k: s.text for k, s in sections.items()},
                     raw_rc={k: s.rc for k, s in sections.items()}, **fields)


def node_load(facts: NodeFacts) -> tuple[tuple[float, float, float] | None, str | None]:
    """(load averages, parse problem) from the node's raw sections (`status`/`monitor` show them). Linux:
    /proc/loadavg (section `loadavg`); macOS: `vm.loadavg` in the sysctl section when the probe asked for it.
    Absent -> (None, None): unknown, not an error. Malformed -> (None, "loadavg: <why>"), never an exception."""
    try:
        if facts.os is not None and facts.os.is_macos:
            text = facts.raw.get("sysctl")
            return (macos.parse_vm_loadavg(text) if text else None), None
        text = facts.raw.get("loadavg")
        if text is None or facts.raw_rc.get("loadavg", 0) != 0:
            return None, None
        return linux.parse_loadavg(text), None
    except ParseError as exc:
        return None, f"loadavg: {exc}"


def parse_env(text: str) -> dict[str, str]:
    """`env` output -> dict. Continuation lines of multi-line values are appended to the previous value."""
    env: dict[str, str] = {}
    last: str | None = None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        name = key[len("BASH_FUNC_"):-2] if key.startswith("BASH_FUNC_") and key.endswith("%%") else key
        # Exported bash functions (`BASH_FUNC_ml%%=() {...`, Lmod) start an entry too, never a continuation.
        if sep and name and (name[0].isalpha() or name[0] == "_") and all(c.isalnum() or c in "_-" for c in name):
            env[key] = value
            last = key
        elif last is not None:
            env[last] += "\n" + line
    return env


def _macos(b: _Builder, uname: tuple[str, str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sw = b.parse("sw_vers", macos.parse_sw_vers)
    if sw is not None:
        out["os"] = OsInfo(system=uname[0], kernel=uname[1], arch=uname[2], name=sw[0], version=sw[1], build=sw[2])
    sysctl = b.parse("sysctl", macos.parse_sysctl) or {}
    sp = b.parse("system_profiler", macos.parse_system_profiler)
    if sp is not None:
        sp_raw = b.sections["system_profiler"].text
        out["hardware"] = b.guard("system_profiler", sp_raw, lambda: macos.parse_hardware(sp, sysctl))
        out["thunderbolt"] = b.guard("system_profiler", sp_raw, lambda: macos.parse_thunderbolt(sp))
    out["hardware_ports"] = b.parse("networksetup", macos.parse_hardware_ports)
    out["interfaces"] = b.parse("ifconfig", macos.parse_ifconfig)
    out["rdma"] = _rdma(b)
    vm = b.parse("vm_stat", macos.parse_vm_stat)
    mp = b.parse("memory_pressure", macos.parse_memory_pressure)
    total = _int_or_none(sysctl.get("hw.memsize")) or (mp[0] if mp else None)
    pressure = _int_or_none(sysctl.get("kern.memorystatus_vm_pressure_level"))
    if total is not None or vm is not None:
        page = vm[0] if vm else _int_or_none(sysctl.get("hw.pagesize"))
        available = None
        if vm is not None:
            counts = vm[1]
            free_pages = sum(counts.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative",
                                                        "Pages purgeable"))
            available = free_pages * vm[0]
        out["memory"] = Memory(total_bytes=total, available_bytes=available,
                               free_percent=mp[1] if mp else None, pressure_level=pressure, page_size=page)
    pmset = b.parse("pmset", macos.parse_pmset)
    batt = b.parse("pmset_batt", macos.parse_pmset_batt)
    if pmset is not None:
        from coordinator.facts.model import Power

        out["power"] = Power(sleep_minutes=pmset[0], sleep_prevented_by=pmset[1], low_power=pmset[2],
                             on_battery=batt[0] if batt else None, battery_percent=batt[1] if batt else None)
    out["gpu"] = b.parse("ioreg", macos.parse_ioreg_accelerator)
    return out


def _rdma(b: _Builder) -> Rdma | None:
    if b.missing("rdma_ctl"):
        return Rdma(ctl_status=None)  # no rdma_ctl: macOS before 26.2 (a fact, not an error)
    status = b.parse("rdma_ctl", macos.parse_rdma_ctl)
    if status is None:
        return None
    devices: tuple[str, ...] = ()
    states: dict[str, str] = {}
    if not b.missing("ibv_devices"):
        parsed = b.parse("ibv_devices", macos.parse_ibv_devices)
        if parsed is None:
            return None
        devices = parsed
    if devices and not b.missing("ibv_devinfo"):
        states = b.parse("ibv_devinfo", macos.parse_ibv_devinfo) or {}
    return Rdma(ctl_status=status, devices=tuple(RdmaDevice(d, states.get(d)) for d in devices))


def _linux(b: _Builder, uname: tuple[str, str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rel = b.parse("os_release", linux.parse_os_release)
    if rel is not None:
        out["os"] = OsInfo(system=uname[0], kernel=uname[1], arch=uname[2], name=rel[0], version=rel[1])
    out["memory"] = b.parse("meminfo", linux.parse_meminfo)
    out["cgroup_memory"] = b.parse("cgroup_memory", linux.parse_cgroup_memory, optional=True)
    cores = b.parse("nproc", linux.parse_nproc)
    mem: Memory | None = out["memory"]
    if cores is not None or mem is not None:
        from coordinator.facts.model import Hardware

        cpu = b.text("cpuinfo", optional=True)  # "model name : AMD EPYC ..." (absent on some ARM boards)
        chip = cpu.split(":", 1)[1].strip() if cpu and ":" in cpu else None
        out["hardware"] = Hardware(chip=chip, model_id=None, model_name=None,
                                   memory_bytes=mem.total_bytes if mem else None, cpu_total=cores)
    out["interfaces"] = b.parse("ip_addr", linux.parse_ip_addr)
    out["net_links"] = b.parse("sys_class_net", linux.parse_sys_class_net, optional=True)
    ib = b.parse("infiniband", linux.parse_infiniband, optional=True) or ()
    out["rdma"] = Rdma(ctl_status=None, devices=tuple(RdmaDevice(d) for d in ib))
    smi = b.sections.get("nvidia_smi")  # present only where nvidia-smi exists
    if smi is not None and smi.rc != 0:
        # nvidia-smi installed but failing (no driver loaded, driver/library mismatch, too old for the query):
        # the node may have a GPU nobody can use. An error with the text, never silently "no GPU".
        b.errors.append(FactError("nvidia_smi", f"nvidia-smi exited with status {smi.rc}", smi.text))
        out["gpu"] = None
    else:
        gpu: Gpu | None = b.parse("nvidia_smi", linux.parse_nvidia_smi, optional=True)
        out["gpu"] = gpu
    return out


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _worker(b: _Builder) -> dict[str, Any]:
    sec = b.sections.get("worker")
    if sec is None:
        b.errors.append(FactError("worker", "the probe returned no worker output"))
        return {}
    if sec.rc == 127:
        b.errors.append(FactError("worker", sec.text.strip() or "python interpreter not found", sec.text))
        return {"software": Software(python=_python_from(sec.text), python_version=None, mlx_version=None,
                                     mlx_lm_version=None, errors=(sec.text.strip(),))}
    try:
        data = json.loads(sec.text)
    except json.JSONDecodeError as exc:
        b.errors.append(FactError("worker", f"the node's python did not answer JSON (exit {sec.rc}): {exc}", sec.text))
        return {}
    if not isinstance(data, dict):
        b.errors.append(FactError("worker", "worker answer is not a JSON object", sec.text))
        return {}
    return b.guard("worker", sec.text, lambda: parse_worker(data)) or {}


def _python_from(text: str) -> str:
    prefix = "python interpreter not found: "
    return text.strip()[len(prefix) :] if text.strip().startswith(prefix) else "?"


def _str_or_none(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ParseError(f"{what} must be a string, got {value!r}")


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParseError(f"{what} must be an object, got {value!r}")
    return value


def _objects(value: Any, what: str, *, required: bool = False) -> list[Mapping[str, Any]]:
    """A JSON list of objects from the worker (None: empty, unless `required`). ParseError otherwise: the node's
    answer is odd, not our parser."""
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise ParseError(f"{what} must be a list of objects, got {value!r}"[:300])
    return value


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ParseError(f"{what} must be a list, got {value!r}"[:300])
    return value


def _int(value: Any, what: str) -> int:
    """int() of a worker JSON value; a value of the wrong type is the node's odd answer (ParseError), not the
    TypeError of a parser bug."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ParseError(f"{what} must be an integer, got {value!r}"[:300])
    return int(value)


def _key(obj: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in obj:
        raise ParseError(f"{what} has no {key!r}")
    return obj[key]


def _backends(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    backends = _mapping(value, "mlx_backends")
    for dist, version in backends.items():
        if not isinstance(version, str):
            raise ParseError(f"mlx_backends.{dist} must be a version string, got {version!r}")
    return dict(backends)


def parse_worker(data: Mapping[str, Any]) -> dict[str, Any]:
    py = _mapping(data.get("python"), "python")
    pkgs = _mapping(data.get("packages"), "packages")
    out: dict[str, Any] = {
        "software": Software(
            python=str(py.get("executable") or "?"),
            python_version=_str_or_none(py.get("version"), "python.version"),
            mlx_version=_str_or_none(pkgs.get("mlx"), "packages.mlx"),
            mlx_lm_version=_str_or_none(pkgs.get("mlx_lm"), "packages.mlx_lm"),
            errors=tuple(str(e) for e in _list(data.get("errors"), "errors")),
            mlx_backends=_backends(data.get("mlx_backends")),
        )
    }
    if "hashes" in data:
        out["hashes"] = tuple(
            DirHashes(
                path=str(_key(h, "path", "hashes[]")),
                exists=bool(_key(h, "exists", "hashes[]")),
                files=tuple(FileHash(str(_key(f, "path", "hashes[].files[]")), _int(_key(f, "size", "hashes[].files[]"), "size"),
                                     str(_key(f, "sha256", "hashes[].files[]")))
                            for f in _objects(h.get("files"), "hashes[].files")),
                error=_str_or_none(h.get("error"), "hashes[].error"),
                cached_files=_int(h.get("cached_files") or 0, "cached_files"),
                hashed_bytes=_int(h.get("hashed_bytes") or 0, "hashed_bytes"),
            )
            for h in _objects(data["hashes"], "hashes", required=True)
        )
    if "reach" in data:
        out["reach"] = tuple(
            Reach(peer=str(_key(r, "peer", "reach[]")), ip=str(_key(r, "ip", "reach[]")),
                  ok=bool(_key(r, "ok", "reach[]")), rtt_ms=r.get("rtt_ms"), error=r.get("error"))
            for r in _objects(data["reach"], "reach", required=True)
        )
    model = _mapping(data.get("model"), "model")
    if isinstance(model.get("config"), dict):
        out["model_config"] = model["config"]
    if isinstance(model.get("params"), int):
        out["model_params"] = model["params"]
    out["model_error"] = _str_or_none(model.get("error"), "model.error")
    if "data" in data:
        out["data"] = parse_data_check(_mapping(data["data"], "data"))
    return out


def parse_data_check(data: Mapping[str, Any]) -> DataCheck:
    """The worker's `data` section (worker/probe.py `check_data`)."""
    files = _objects(data.get("files"), "data.files")
    return DataCheck(
        dir=_str_or_none(data.get("dir"), "data.dir"),
        files=tuple(
            DataFile(name=str(_key(f, "name", "data.files[]")), required=bool(f.get("required", True)),
                     exists=bool(_key(f, "exists", "data.files[]")),
                     rows=_int(f.get("rows") or 0, "rows"), bytes=_int(f.get("bytes") or 0, "bytes"),
                     checked_bytes=_int(f.get("checked_bytes") or 0, "checked_bytes"),
                     format=_str_or_none(f.get("format"), "data.files.format"),
                     error=_str_or_none(f.get("error"), "data.files.error"))
            for f in files),
        error=_str_or_none(data.get("error"), "data.error"),
    )
