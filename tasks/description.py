"""Resource requests: what one task asks of the pilot."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsatisfiableRequest


@dataclass(frozen=True)
class ResourceRequest:
    """``ranks`` processes, each with ``cores_per_rank`` cores and ``gpus_per_rank`` GPUs.

    ``ranks_per_node`` caps how many ranks share a node (``None``: pack freely).
    ``memory_per_rank`` is in bytes (``None``: not accounted).
    ``duration`` is the user's estimate in seconds, used for walltime checks.
    """

    ranks: int = 1
    cores_per_rank: int = 1
    gpus_per_rank: int = 0
    memory_per_rank: int | None = None
    ranks_per_node: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        for name in ("ranks", "cores_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UnsatisfiableRequest(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.gpus_per_rank, int) or self.gpus_per_rank < 0:
            raise UnsatisfiableRequest(f"gpus_per_rank must be an integer >= 0, got {self.gpus_per_rank!r}")
        if self.memory_per_rank is not None and (not isinstance(self.memory_per_rank, int)
                                                 or isinstance(self.memory_per_rank, bool)):
            raise UnsatisfiableRequest(f"memory_per_rank must be a number of bytes, got {self.memory_per_rank!r} "
                                       "(a stage also takes a size such as '4GB' or '4GiB')")
        if self.memory_per_rank is not None and self.memory_per_rank < 0:
            raise UnsatisfiableRequest(f"memory_per_rank must be >= 0 bytes, got {self.memory_per_rank!r}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UnsatisfiableRequest(f"ranks_per_node must be >= 1, got {self.ranks_per_node!r}")
        if self.duration is not None and self.duration <= 0:
            raise UnsatisfiableRequest(f"duration must be > 0 seconds, got {self.duration!r}")

    def __str__(self) -> str:
        parts = [f"ranks={self.ranks}", f"cores_per_rank={self.cores_per_rank}",
                 f"gpus_per_rank={self.gpus_per_rank}"]
        if self.ranks_per_node is not None:
            parts.append(f"ranks_per_node={self.ranks_per_node}")
        if self.memory_per_rank is not None:
            parts.append(f"memory_per_rank={self.memory_per_rank}")
        return ", ".join(parts)
