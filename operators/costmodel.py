"""Hockney cost model (α + nβ) with α, β measured on this machine and cached.

``hockney(comm)`` is collective: rank 0 looks in the cache
(``$XDG_CACHE_HOME/hetflow/hockney.json``, keyed by host set and rank count);
on a miss ranks 0 and 1 run a ping-pong, rank 0 writes the cache (0600, in a
0700 directory), and the figures are broadcast.  Operators use it to compare
algorithms and ``DTable.explain()`` prints the estimate.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from mpi4py import MPI

from .communicator import Communicator

log = logging.getLogger(__name__)

_memo: dict[str, "Hockney"] = {}


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
class Plan:
    """What an operator chose, why, and the model's estimate in seconds (Hockney communication,
    plus the local work where the alternatives differ in it, e.g. join)."""

    operation: str
    algorithm: str
    estimate_s: float
    alternatives: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""
    model: str = ""

    def __str__(self) -> str:
        alts = ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in self.alternatives.items())
        text = f"{self.operation}: algorithm={self.algorithm}, estimated {self.estimate_s * 1e3:.2f} ms"
        if alts:
            text += f" (alternatives: {alts})"
        if self.detail:
            text += f"; {self.detail}"
        return text


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetflow" / "hockney.json"


def _key(comm: Communicator) -> str:
    """Cache key of the measured α, β: the hosts, the rank count and the transport.

    MPI and the TCP communicator have very different α and β on the same hosts
    (an order of magnitude apart: docs/benchmarks.md), so they never share an entry.
    """
    hosts = sorted(set(comm.allgather(socket.gethostname())))
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
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = _load(path)
        data[key] = {"alpha": value.alpha, "beta": value.beta, "measured_at": time.time()}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)
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
