"""Cost model: Hockney (α + nβ) for the exchanges, a per-byte rate for the local kernels.

``hockney(comm)`` is collective: rank 0 looks in the cache
(``$XDG_CACHE_HOME/hetflow/hockney.json``, keyed by host set and rank count);
on a miss ranks 0 and 1 run a ping-pong, rank 0 writes the cache (0600, in a
0700 directory), and the figures are broadcast.

An operator's estimate is a :class:`Cost`: the bytes the busiest rank moves to
other ranks, their Hockney time, and the local kernel work as
``*_SECONDS_PER_BYTE`` times the bytes one rank's kernel sees.  The functions
below (``shuffle_cost``, ``allgather_cost``, ``join_costs``, ``sort_cost``,
``group_by_costs``) are pure, so they are tested without MPI; operators use
them to compare algorithms and record the chosen one's estimate in a
:class:`Plan` that ``DTable.explain()`` prints.  The kernel rates are one-core
throughputs on the benchmark workload (two int64 columns), measured by
``benchmarks/operators.py --phases`` at one rank (docs/benchmarks.md, "Cost
model"): they rank algorithms and give the scale of a step, not a wall-clock
promise for other key types.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from . import safeio
from .communicator import Communicator

log = logging.getLogger(__name__)

_memo: dict[str, "Hockney"] = {}

#: local kernel seconds per byte of input on one core (docs/benchmarks.md, "Cost model"):
#: DuckDB hash join of both sides' bytes
JOIN_SECONDS_PER_BYTE = 4.1e-9
#: sort of a rank's rows (integer key: packed numpy sort and gather; other keys cost more)
SORT_SECONDS_PER_BYTE = 4.9e-9
#: group-by aggregate of a rank's key and value bytes (integer key: packed sort and reduceat)
GROUPBY_SECONDS_PER_BYTE = 5.6e-9


@dataclass(frozen=True)
class Hockney:
    """Point-to-point message time ``alpha + nbytes * beta`` (seconds)."""

    alpha: float
    beta: float
    source: str = "measured"

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"Hockney parameters must be >= 0, got alpha={self.alpha}, beta={self.beta}")

    def message(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta

    def shuffle(self, p: int, bytes_per_rank: float) -> float:
        """All-to-all where each rank holds ``bytes_per_rank`` spread evenly over ``p`` ranks."""
        if p <= 1:
            return 0.0
        return (p - 1) * self.alpha + bytes_per_rank * (p - 1) / p * self.beta

    def allgather(self, p: int, total_bytes: float) -> float:
        """Every rank receives the other ranks' share of ``total_bytes``."""
        if p <= 1:
            return 0.0
        return (p - 1) * self.alpha + total_bytes * (p - 1) / p * self.beta

    def describe(self) -> str:
        return f"alpha={self.alpha * 1e6:.1f} us, beta={self.beta * 1e9:.3f} ns/B ({1 / self.beta / 1e9 if self.beta else float('inf'):.2f} GB/s, {self.source})"


@dataclass(frozen=True)
class Cost:
    """One algorithm's estimate: ``exchange_bytes`` sent from rank to rank (all ranks together; a
    rank's own share is not counted), ``exchange_s`` their Hockney time (the busiest rank's), and
    ``compute_s`` the local kernel work of the busiest rank."""

    exchange_bytes: float = 0.0
    exchange_s: float = 0.0
    compute_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.exchange_s + self.compute_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.exchange_bytes + other.exchange_bytes, self.exchange_s + other.exchange_s,
                    self.compute_s + other.compute_s)


def shuffle_cost(model: Hockney, sizes: Sequence[float]) -> Cost:
    """All-to-all where rank ``r`` holds ``sizes[r]`` bytes spread evenly over the ranks: the
    ranks send ``(p - 1) / p`` of their bytes; the busiest rank's share sets the time."""
    p = len(sizes)
    if p <= 1:
        return Cost()
    return Cost(float(sum(sizes)) * (p - 1) / p, model.shuffle(p, float(max(sizes))))


def allgather_cost(model: Hockney, sizes: Sequence[float]) -> Cost:
    """Every rank receives the other ranks' ``sizes[r]`` bytes: each rank's bytes go to ``p - 1`` others."""
    p = len(sizes)
    if p <= 1:
        return Cost()
    return Cost(float(sum(sizes)) * (p - 1), model.allgather(p, float(sum(sizes))))


def join_costs(model: Hockney, left: Sequence[float], right: Sequence[float], how: str) -> dict[str, Cost]:
    """The join algorithms open to ``how``, from each rank's left and right input bytes: hash-shuffle
    both sides, then every rank joins ``1/p`` of all bytes; broadcast one side, then every rank joins
    all of it with its partition of the other; sort is the hash volume plus the sample allgather."""
    p = len(left)
    lt, rt = float(sum(left)), float(sum(right))
    gamma = JOIN_SECONDS_PER_BYTE
    costs = {"hash": shuffle_cost(model, [a + b for a, b in zip(left, right)]) + Cost(compute_s=gamma * (lt + rt) / p)}
    if p > 1 and how in ("inner", "left", "semi", "anti"):
        costs["broadcast"] = allgather_cost(model, right) + Cost(compute_s=gamma * (max(left) + rt))
    if p > 1 and how in ("inner", "right"):
        costs["broadcast_left"] = allgather_cost(model, left) + Cost(compute_s=gamma * (lt + max(right)))
    if p > 1:
        costs["sort"] = costs["hash"] + Cost(exchange_s=2 * (p - 1) * model.alpha)
    return costs


def sort_cost(model: Hockney, sizes: Sequence[float], sample_sizes: Sequence[float]) -> Cost:
    """Sample sort: allgather the samples (``sample_sizes[r]`` bytes from rank ``r``), shuffle the
    rows to their ranges, sort the rank's share (about its input: the splitters balance rows)."""
    compute = Cost(compute_s=SORT_SECONDS_PER_BYTE * float(max(sizes)))
    if len(sizes) <= 1:
        return compute
    return allgather_cost(model, sample_sizes) + shuffle_cost(model, sizes) + compute


def group_by_costs(model: Hockney, sizes: Sequence[float], partial_sizes: Sequence[float] | None,
                   sample_sizes: Sequence[float] | None) -> dict[str, Cost]:
    """Group-by algorithms from each rank's key and value bytes (``sizes``): ``shuffle`` (every row to
    its key's hash rank, aggregated there); ``range`` (by key ranges, after an allgather of
    ``sample_sizes``); and, for decomposable aggregations, ``combine`` (aggregate locally into
    ``partial_sizes`` bytes of partial states, shuffle those and merge them)."""
    gamma = GROUPBY_SECONDS_PER_BYTE
    top = float(max(sizes))
    costs = {"shuffle": shuffle_cost(model, sizes) + Cost(compute_s=gamma * top)}
    if sample_sizes is not None:
        costs["range"] = costs["shuffle"] + allgather_cost(model, sample_sizes)
    if partial_sizes is not None:
        costs["combine"] = shuffle_cost(model, partial_sizes) + Cost(compute_s=gamma * (top + float(max(partial_sizes))))
    return costs


@dataclass(frozen=True)
class Plan:
    """What an operator chose, why, and the model's estimate of the chosen algorithm (``cost``) and
    of the alternatives it weighed (seconds)."""

    operation: str
    algorithm: str
    cost: Cost = field(default_factory=Cost)
    alternatives: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""
    model: str = ""

    @property
    def estimate_s(self) -> float:
        return self.cost.seconds

    def __str__(self) -> str:
        alts = ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in self.alternatives.items())
        c = self.cost
        text = (f"{self.operation}: algorithm={self.algorithm}, estimated {c.seconds * 1e3:.2f} ms "
                f"(exchange {c.exchange_bytes / 1e6:.2f} MB in {c.exchange_s * 1e3:.2f} ms, "
                f"local {c.compute_s * 1e3:.2f} ms)")
        if alts:
            text += f" (alternatives: {alts})"
        if self.detail:
            text += f"; {self.detail}"
        return text


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetflow" / "hockney.json"


#: the MPI attribute key under which an mpi4py communicator keeps its ranks' host names (``_hosts``)
_hosts_keyval: int | None = None


def _hosts(comm: Communicator) -> list[str]:
    """The sorted host names of ``comm``'s ranks; collective the first time per MPI communicator.

    An mpi4py communicator keeps them as an MPI attribute: every rank sets it at the same collective
    call, so every rank finds it on later calls and none waits in an allgather the others skip (a
    duplicate of the communicator does not inherit it).  Other communicators gather them each time."""
    global _hosts_keyval
    get, put, create = getattr(comm, "Get_attr", None), getattr(comm, "Set_attr", None), getattr(type(comm), "Create_keyval", None)
    if get is not None and put is not None and create is not None:
        if _hosts_keyval is None:
            _hosts_keyval = int(create())
        found = get(_hosts_keyval)
        if found is not None:
            return list(found)
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    if put is not None and _hosts_keyval is not None:
        put(_hosts_keyval, tuple(hosts))
    return hosts


def _key(comm: Communicator) -> str:
    """Cache key of the measured α, β: the hosts, the rank count and the transport.

    MPI and the TCP communicator have very different α and β on the same hosts
    (an order of magnitude apart: docs/benchmarks.md), so they never share an entry.
    """
    hosts = _hosts(comm)
    return f"{','.join(hosts)}|np={comm.Get_size()}|{type(comm).__module__}.{type(comm).__name__}"


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: Path, key: str, value: Hockney) -> None:
    try:
        data = _load(path)
        data[key] = {"alpha": value.alpha, "beta": value.beta, "measured_at": time.time()}
        safeio.atomic_write(path, json.dumps(data, indent=1).encode(), durable=False, create_parent=True)
    except OSError as exc:  # a read-only home must not break an operator
        log.warning("could not cache Hockney parameters in %s: %s", path, exc)


def _pingpong(comm: Communicator, nbytes: int, reps: int) -> float:
    """Half round-trip time between ranks 0 and 1 (others idle)."""
    rank = comm.Get_rank()
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    best = float("inf")
    for _ in range(reps):
        if rank == 0:
            t0 = time.perf_counter()
            comm.Send([buf, nbytes, MPI.BYTE], dest=1, tag=91)
            comm.Recv([buf, nbytes, MPI.BYTE], source=1, tag=91)
            best = min(best, (time.perf_counter() - t0) / 2)
        elif rank == 1:
            comm.Recv([buf, nbytes, MPI.BYTE], source=0, tag=91)
            comm.Send([buf, nbytes, MPI.BYTE], dest=0, tag=91)
    return best


def measure(comm: Communicator) -> Hockney:
    """Ping-pong between ranks 0 and 1: α from 8-byte messages, β from the slope up to 8 MiB."""
    small, large = 8, 8 << 20
    t_small = _pingpong(comm, small, 50)
    t_large = _pingpong(comm, large, 5)
    result = None
    if comm.Get_rank() == 0:
        beta = max((t_large - t_small) / (large - small), 1e-13)
        result = Hockney(alpha=max(t_small, 0.0), beta=beta)
    return comm.bcast(result, root=0)  # type: ignore[no-any-return]


def hockney(comm: Communicator) -> Hockney:
    """α, β for this communicator's layout (collective; cached on disk and in memory)."""
    if comm.Get_size() == 1:
        return Hockney(0.0, 0.0, source="single rank")
    key = _key(comm)
    if key in _memo:
        return _memo[key]
    path = cache_path()
    cached = None
    if comm.Get_rank() == 0:
        entry = _load(path).get(key)
        if isinstance(entry, dict) and "alpha" in entry and "beta" in entry:
            cached = Hockney(float(entry["alpha"]), float(entry["beta"]), source=f"cached in {path}")
    cached = comm.bcast(cached, root=0)
    if cached is None:
        cached = measure(comm)
        if comm.Get_rank() == 0:
            _store(path, key, cached)
        log.info("measured Hockney parameters for %s: %s", key, cached.describe())
    _memo[key] = cached
    return cached
