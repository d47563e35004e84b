"""What a stage function receives as ``ctx``: its communicator, identity and places."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TrackedParams(Mapping[str, Any]):
    """A stage's params that remember which keys the stage read, so only those enter its cache key.

    Reading one key (``[]``, ``get``, ``in``; a missing key too, since
    providing it later could change the result) records that key.  Anything
    that sees every key (iteration, ``len``, ``keys``/``items``/``values``
    once used, ``dict(...)``, ``==``, ``repr``, copying or pickling) records
    *all*.  Deliberately not a ``dict`` subclass: C code such as ``json.dumps``
    would read a dict subclass without calling these methods, so reads would go
    unrecorded; on this class it fails loudly instead (``json.dumps(dict(p))``
    works and records all).
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = dict(params)
        self._read: set[str] = set()
        self._all = False

    def __getitem__(self, key: str) -> Any:
        self._read.add(key)
        return self._params[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._read.add(key)
        return key in self._params

    def __iter__(self) -> Iterator[str]:
        self._all = True
        return iter(self._params)

    def __len__(self) -> int:
        self._all = True
        return len(self._params)

    def __repr__(self) -> str:
        self._all = True
        return f"TrackedParams({self._params!r})"

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[dict[str, Any]]]:
        self._all = True  # a copy or a pickled message can be read anywhere: count it as reading all
        return dict, (dict(self._params),)

    @property
    def read(self) -> list[str] | None:
        """The keys read so far, sorted; ``None`` when the stage saw them all."""
        return None if self._all else sorted(self._read)


@dataclass(frozen=True)
class StageContext:
    """The per-rank context of one stage attempt.

    ``comm`` is a private mpi4py communicator of exactly ``size`` ranks (never
    ``COMM_WORLD`` of a shared pool).  ``cores`` and ``gpus`` are what the pilot
    gave this rank; its vendor's visible-devices variables are already set
    from ``gpus`` (:mod:`hetflow.tasks.gpu`), so inside the process the
    visible devices are numbered ``0..len(gpus)-1``.
    ``workdir`` is private to this attempt; ``checkpoint_dir`` is stable across
    attempts of the same stage in the same run (so a retry can resume).
    ``files`` are the stage's declared files, resolved and absolute.

    ``params`` is wrapped in :class:`TrackedParams` on construction (so every
    existing caller, the worker included, gets tracking unchanged);
    :attr:`params_read` says what the stage read.
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
    files: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.params, TrackedParams):
            object.__setattr__(self, "params", TrackedParams(self.params))

    @property
    def params_read(self) -> list[str] | None:
        """The param keys this rank's stage read, sorted; ``None`` means it saw all of them."""
        assert isinstance(self.params, TrackedParams)
        return self.params.read

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
