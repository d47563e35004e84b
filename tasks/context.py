"""What a stage function receives as ``ctx``: its communicator, identity and places."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class StageContext:
    """The per-rank context of one stage attempt.

    ``comm`` is a private mpi4py communicator of exactly ``size`` ranks (never
    ``COMM_WORLD`` of a shared pool).  ``cores`` and ``gpus`` are what the pilot
    gave this rank; ``CUDA_VISIBLE_DEVICES`` is already set from ``gpus``, so
    inside the process the visible devices are numbered ``0..len(gpus)-1``.
    ``workdir`` is private to this attempt; ``checkpoint_dir`` is stable across
    attempts of the same stage in the same run (so a retry can resume).
    """

    comm: Any
    stage: str
    run_id: str
    attempt: int
    params: Mapping[str, Any]
    workdir: Path
    checkpoint_dir: Path
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    node: str = "localhost"
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("hetflow.stage"))

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self.comm.Get_size())

    @property
    def device(self) -> str:
        """``"cuda"`` when this rank was given a GPU and torch sees one, else ``"cpu"``."""
        if not self.gpus:
            return "cpu"
        try:
            import torch
        except ImportError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def dtable(self, table: Any) -> Any:
        """Wrap this rank's partition as a distributed table over ``comm``."""
        from hetflow.operators import DTable

        return DTable(self.comm, table)
