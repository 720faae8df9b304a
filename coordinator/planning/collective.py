"""The gradient exchange's cost in a data-parallel step. Pure: no I/O, no clock (the measurement is
`coordinator/run/collective.py`, its node side `worker/collbench.py`).

How a dp step exchanges (worker/step.py, `TrainStep.apply`; worker/exchange.py): once every rank has evaluated its
local gradient sums (its compute ends there), the gradients are scaled, concatenated per dtype into buckets (32 MiB
on the CPU, 256 MiB on a GPU, counted at 4 bytes an element) and each bucket is all_summed: all of them are
evaluated together, then the update runs (on a GPU with no memory bound each is dispatched as it is built and the
update follows in the same evaluation). No bucket starts before the whole backward is done (the all_sum runs
between two compiled graphs: inside one, 2-rank ring runs deadlocked). So the step of a dp run is

    step = max_i compute_i(b_i) + exchange(G)

where compute_i(b_i) is node i's calibrated step at its planned rows (the bench times the whole step with the
update, its collective left out) and exchange(G) the all_sum of the run's trainable-gradient bytes G over its
ranks. The slowest node's compute decides when the exchange can start: with weighted batches the split equalises
the compute times, and the exchange comes on top of the largest. It does not change the split (a constant added
to every node's time), only the prediction.

The exchange is MEASURED, not derived: calibration starts `worker.collbench` on the nodes that will train, with
the run's backend, hostfile and environment, and times all_sums of G in the run's buckets (`CollectiveCost`).
Why measured: what an all_sum costs is the backend's implementation on those hosts (the ring's chunking and
summing on the CPU, two ranks sharing one machine's cores, NCCL's algorithms), which a TCP bandwidth test does not
see (nettest's loopback measures GB/s where a 2-rank CPU ring spends milliseconds per small all_sum).

The model, used to read the measurement (and to derive one from nettest's figures where nothing was measured):
a ring all-reduce moves 2(N-1)/N of the bytes through its slowest link and takes 2(N-1) hops, so

    t(B) = 2(N-1)/N * B / bw + 2(N-1) * latency

`fit_ring` inverts it from two measured sizes (the run's bytes and a one-element all_sum, which is the latency
term alone), giving the effective bandwidth and per-hop latency the plan shows next to the measured time.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from coordinator.errors import CoordinatorError
from coordinator.planning.hostfile import Hostfile

# MLX dtype names -> bytes per element (the gradients keep the parameters' dtype, worker/step.py).
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "uint32": 4,
            "int16": 2, "uint16": 2, "int8": 1, "uint8": 1, "bool": 1}
# What the run all_sums besides the gradients: the loss sum rides in a float32 bucket of its own, or in the
# gradients' (worker/step.py `_LOSS_KEY`).
LOSS_ELEMENTS = 1


class CollectiveError(CoordinatorError, ValueError):
    """A gradient size or a measurement that makes no sense (the message names it)."""


class CostSource(StrEnum):
    MEASURED = "measured"  # a timed all_sum of the run's gradient bytes between the run's nodes
    DERIVED = "derived"  # the ring model from a measured bandwidth and latency (nettest)


@dataclass(frozen=True)
class GradientSize:
    """The trainable gradients' elements by dtype (name, count), sorted, as the bench counted them on the model
    as the run sets it up (method, layers, embeddings)."""

    elements: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        for dtype, count in self.elements:
            if dtype not in ITEMSIZE:
                raise CollectiveError(f"unknown gradient dtype {dtype!r}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise CollectiveError(f"gradient element count for {dtype} must be a count, got {count!r}")

    def exchanged(self) -> dict[str, int]:
        """What one exchange all_sums, by dtype: the gradients and the loss (one float32)."""
        out = dict(self.elements)
        out["float32"] = out.get("float32", 0) + LOSS_ELEMENTS
        return out

    @property
    def nbytes(self) -> int:
        """The bytes one exchange all_sums."""
        return sum(ITEMSIZE[d] * n for d, n in self.exchanged().items())

    def to_json(self) -> dict[str, int]:
        return dict(self.elements)

    def to_arg(self) -> str:
        """`worker.collbench --elements`: `float32:138049,bfloat16:0`."""
        return ",".join(f"{d}:{n}" for d, n in sorted(self.exchanged().items()) if n)


def parse_gradient_size(raw: Any) -> GradientSize | None:
    """The bench's `gradients` ({dtype: elements}) as a GradientSize; None when absent or malformed (an older
    worker: the exchange is then not measured, and the plan says so)."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    try:
        return GradientSize(tuple(sorted((str(k), v) for k, v in raw.items())))
    except CollectiveError:
        return None


def ring_allreduce_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Seconds of one ring all-reduce of `nbytes` over `ranks` ranks whose slowest link carries `bandwidth`
    bytes/s with `latency_s` per hop: 2(N-1)/N * B / bw + 2(N-1) * latency. One rank: 0 (no exchange).
    Raises CollectiveError for a non-positive bandwidth, negative bytes or latency."""
    if ranks < 1:
        raise CollectiveError(f"ranks must be >= 1, got {ranks}")
    if nbytes < 0 or latency_s < 0 or not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise CollectiveError(f"need bytes >= 0, latency >= 0 and a positive bandwidth, got {nbytes}, {latency_s}, "
                              f"{bandwidth}")
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency_s


def fit_ring(nbytes: int, ranks: int, seconds: float, small_s: float) -> tuple[float | None, float]:
    """(bandwidth bytes/s, per-hop latency s) of the ring model from two measured all_sums: `seconds` for
    `nbytes` and `small_s` for one element (its time is the latency term: 2(N-1) hops of nothing). The bandwidth is
    None when the bytes cost nothing measurable beyond the latency (small gradients: the exchange is all latency).
    Raises CollectiveError for fewer than two ranks or negative times."""
    if ranks < 2:
        raise CollectiveError(f"a ring needs >= 2 ranks, got {ranks}")
    if seconds < 0 or small_s < 0:
        raise CollectiveError(f"measured times must be >= 0, got {seconds}, {small_s}")
    latency = small_s / (2 * (ranks - 1))
    moving = seconds - small_s
    bandwidth = 2 * (ranks - 1) / ranks * nbytes / moving if moving > 0 and nbytes > 0 else None
    return bandwidth, latency


@dataclass(frozen=True)
class CollectiveCost:
    """One exchange of the run's gradients between its ranks: what the prediction adds to every step.

    `seconds`: the all_sum of `nbytes` (the median of the timed exchanges, the slowest rank's); `small_s`: a
    one-element all_sum (the latency term); `samples`: how many exchanges were timed; `nodes`: the ranks, in rank
    order."""

    seconds: float
    nbytes: int
    ranks: int
    backend: str
    source: CostSource
    small_s: float | None = None
    samples: int = 0
    nodes: tuple[str, ...] = ()
    cached: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise CollectiveError(f"an exchange's seconds must be finite and >= 0, got {self.seconds!r}")
        if self.ranks < 2:
            raise CollectiveError(f"an exchange needs >= 2 ranks, got {self.ranks}")

    @property
    def model(self) -> tuple[float | None, float] | None:
        """(bandwidth, latency) of the ring model read from the two measured sizes; None without the small one."""
        if self.small_s is None:
            return None
        return fit_ring(self.nbytes, self.ranks, self.seconds, min(self.small_s, self.seconds))

    def describe(self) -> str:
        """`all_sum of 552.0 KiB over 3 ranks (ring): 31.2 ms measured (ring model: 23.6 MB/s, 0.4 ms per hop)`."""
        from coordinator.units import format_bytes

        text = (f"all_sum of {format_bytes(self.nbytes)} over {self.ranks} ranks ({self.backend}): "
                f"{1000 * self.seconds:.1f} ms {self.source}")
        fit = self.model
        if fit is not None:
            bandwidth, latency = fit
            link = f"{bandwidth / 1e6:,.1f} MB/s" if bandwidth else "latency-bound"
            text += f" (ring model: {link}, {1000 * latency:.2f} ms per hop)"
        return text + (" (cached)" if self.cached else "")

    def to_json(self) -> dict[str, Any]:
        fit = self.model
        return {"seconds": round(self.seconds, 6), "bytes": self.nbytes, "ranks": self.ranks, "backend": self.backend,
                "source": str(self.source), "small_seconds": None if self.small_s is None else round(self.small_s, 6),
                "samples": self.samples, "nodes": list(self.nodes), "cached": self.cached,
                "bandwidth_bytes_per_s": round(fit[0], 1) if fit and fit[0] else None,
                "latency_s": round(fit[1], 7) if fit else None}


def derive_collective(gradients: GradientSize, nodes: Sequence[str], backend: str, bandwidth: float,
                      latency_s: float) -> CollectiveCost:
    """The exchange from a measured bandwidth (the slowest link of the ring, bytes/s) and per-hop latency (half a
    round trip), by the ring model: for a fleet whose collective was not timed (nettest's figures)."""
    seconds = ring_allreduce_s(gradients.nbytes, len(nodes), bandwidth, latency_s)
    return CollectiveCost(seconds, gradients.nbytes, len(nodes), backend, CostSource.DERIVED,
                          small_s=ring_allreduce_s(0, len(nodes), bandwidth, latency_s), nodes=tuple(nodes))


def rescale_collective(cost: CollectiveCost, nodes: Sequence[str]) -> CollectiveCost | None:
    """The exchange over `nodes` (the survivors of a fault, say) derived from a measured one by the ring model: its
    fitted bandwidth and per-hop latency (`fit_ring`), the new rank count. A latency-bound measurement scales by
    its hops. None for fewer than two nodes or a measurement without its small size (no model to read)."""
    fit = cost.model
    if len(nodes) < 2 or fit is None:
        return None
    bandwidth, latency = fit
    ranks = len(nodes)
    if bandwidth is None:
        seconds = cost.seconds * (ranks - 1) / (cost.ranks - 1)
    else:
        seconds = ring_allreduce_s(cost.nbytes, ranks, bandwidth, latency)
    return CollectiveCost(seconds, cost.nbytes, ranks, cost.backend, CostSource.DERIVED,
                          small_s=ring_allreduce_s(0, ranks, 1.0, latency), nodes=tuple(nodes))


def parse_collbench(obj: Mapping[str, Any], *, nodes: Sequence[str], backend: str,
                    cached: bool = False) -> CollectiveCost:
    """`worker.collbench`'s answer ({"seconds", "small_seconds", "bytes", "ranks", "samples"}) as a measured
    CollectiveCost. Raises CollectiveError on `{"error": ...}`, a missing or malformed field, or a rank count other
    than the nodes'."""
    if "error" in obj:
        raise CollectiveError(f"the all_sum measurement failed: {obj['error']}")
    values: dict[str, float] = {}
    for key in ("seconds", "small_seconds", "bytes", "ranks", "samples"):
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise CollectiveError(f"the all_sum measurement's {key!r} is not a number: {value!r}")
        values[key] = float(value)
    if int(values["ranks"]) != len(nodes):
        raise CollectiveError(f"the all_sum measurement ran {int(values['ranks'])} ranks, the run has {len(nodes)}")
    return CollectiveCost(values["seconds"], int(values["bytes"]), len(nodes), backend, CostSource.MEASURED,
                          small_s=values["small_seconds"], samples=int(values["samples"]), nodes=tuple(nodes),
                          cached=cached)


def collective_share(step_s: float, cost: CollectiveCost | None) -> float:
    """The exchange's share of a predicted step (0 without one)."""
    if cost is None or step_s <= 0:
        return 0.0
    return cost.seconds / step_s


# --- starting the ranks of a measurement ------------------------------------------------------------------------

MEASURABLE_BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")


@dataclass(frozen=True)
class RankStart:
    """What one rank of `worker.collbench` is started with: its environment and the files the backend reads
    (NAME -> content; the worker writes each to a temp file and exports NAME as its path), as mlx.launch gives a
    training rank (`mlx/_distributed_utils/launch.py`: `launch_ring`, `launch_nccl`, `launch_jaccl`)."""

    env: tuple[tuple[str, str], ...]
    files: tuple[tuple[str, str], ...] = ()


def build_rank_starts(hostfile: Hostfile, port: int) -> list[RankStart]:
    """One `RankStart` per hostfile entry, in rank order, for `hostfile.backend` with ports from `port` (ring: one
    per rank and IP, as mlx.launch's --starting-port; nccl and jaccl: the coordinator's). The hostfile's envs ride
    along. Raises CollectiveError for a backend that cannot be started this way (mpi) or a hostfile that lacks what
    its backend needs (ring IPs, rank 0's IP)."""
    backend, hosts = hostfile.backend, hostfile.hosts
    if backend not in MEASURABLE_BACKENDS:
        raise CollectiveError(f"the {backend} backend's all_sum is not measured (no way to start its ranks here)")
    envs = [tuple(e.split("=", 1)) for e in hostfile.envs if "=" in e]
    common: list[tuple[str, str]] = [(k, v) for k, v in envs]
    files: list[tuple[str, str]] = []
    if backend == "ring":
        if any(not h.ips for h in hosts):
            raise CollectiveError("the ring backend needs every host's IP")
        ring, next_port = [], port
        for h in hosts:
            ring.append([f"{ip}:{next_port + i}" for i, ip in enumerate(h.ips)])
            next_port += len(h.ips)
        files.append(("MLX_HOSTFILE", json.dumps(ring)))
    else:
        if not hosts[0].ips:
            raise CollectiveError(f"the {backend} backend needs rank 0's IP")
        if backend == "nccl":
            common += [("NCCL_HOST_IP", hosts[0].ips[0]), ("NCCL_PORT", str(port)),
                       ("MLX_WORLD_SIZE", str(len(hosts)))]
        else:
            common.append(("MLX_JACCL_COORDINATOR", f"{hosts[0].ips[0]}:{port}"))
            if backend == "jaccl-ring":
                common.append(("MLX_JACCL_RING", "1"))
            files.append(("MLX_IBV_DEVICES", json.dumps([list(h.rdma) for h in hosts])))
    return [RankStart(env=(*common, ("MLX_RANK", str(rank))), files=tuple(files)) for rank in range(len(hosts))]


def ports_needed(hostfile: Hostfile) -> int:
    """How many consecutive ports `build_rank_starts` uses from its base."""
    return sum(max(1, len(h.ips)) for h in hostfile.hosts) if hostfile.backend == "ring" else 1


def compute_collective_key(hostfile: Hostfile, fingerprints: Sequence[Mapping[str, Any] | None],
                           gradients: GradientSize, worker_digest: str,
                           mlx_env: Sequence[tuple[str, str]] = ()) -> str | None:
    """Digest of what a measured exchange depends on: the nodes in rank order and their hardware (`fingerprints`,
    one per hostfile entry: None for an unknown one, which is never cached), the backend and the hostfile's
    addresses and RDMA devices (another link is another exchange), the bytes by dtype, the worker that measures
    and the MLX_* environment. None when any node's hardware is unknown."""
    if any(f is None for f in fingerprints):
        return None
    inputs = {"schema": 1, "hostfile": hostfile.to_json(), "fingerprints": list(fingerprints),
              "gradients": gradients.exchanged(), "worker": worker_digest,
              "mlx_env": [[k, v] for k, v in mlx_env if k.startswith("MLX_")]}
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
