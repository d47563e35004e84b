"""What a stage function receives as ``ctx``: its communicator, identity and places."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any


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


class DeclaredEnv(Mapping[str, "str | None"]):
    """A stage's declared environment variables (``env=``) and their values, ``None`` for an unset one.

    Read-only; a name the stage did not declare is a ``KeyError`` that says to declare it, since
    only declared variables are part of the stage's cache key.
    """

    def __init__(self, stage: str, values: Mapping[str, str | None]) -> None:
        self._stage = stage
        self._values = dict(values)

    def __getitem__(self, name: str) -> str | None:
        if name not in self._values:
            raise KeyError(f"stage {self._stage!r} did not declare environment variable {name!r} "
                           f"(declared: {sorted(self._values)}); add it to @pipe.stage(env=[...]) so that "
                           "its value is part of the stage's cache key")
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"DeclaredEnv({self._values!r})"


class DeclaredFiles(tuple):  # type: ignore[type-arg]
    """A stage's declared files (``files=``), resolved and absolute, in the order declared: a tuple, and also
    indexed by the name the script wrote, ``ctx.files["obs.csv"]`` or ``ctx.files["data/obs.csv"]`` (the
    one file whose path ends with those components; an object's URI likewise).  A name that matches no
    declared file, or several, is a ``KeyError`` naming the stage and what it declared."""

    _stage = ""

    def __new__(cls, stage: str, files: Iterable[Path | str] = ()) -> "DeclaredFiles":
        made = super().__new__(cls, files)
        made._stage = stage
        return made

    def __getnewargs__(self) -> tuple[str, tuple[Path | str, ...]]:
        return self._stage, tuple(self)

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, (str, os.PathLike)):
            return super().__getitem__(index)
        wanted = [part for part in os.fspath(index).split("/") if part not in ("", ".")]
        found = [f for f in self if wanted and str(f).split("/")[-len(wanted):] == wanted]
        if len(found) == 1:
            return found[0]
        listed = ", ".join(str(f) for f in self) or "none"
        if not found:
            raise KeyError(f"stage {self._stage!r} declared no file {os.fspath(index)!r} (declared: {listed}); "
                           "add it to @pipe.stage(files=[...]) so that a change to it reruns the stage")
        raise KeyError(f"stage {self._stage!r}: {os.fspath(index)!r} names {len(found)} declared files "
                       f"({', '.join(str(f) for f in found)}); give more of its path")


class DeferredWorld:
    """A one-rank stage's MPI world, started when the stage first uses ``ctx.comm``.

    Decision: a warm one-rank rank (:mod:`hetflow.tasks.forkserver`) does not start MPI before its stage
    runs: most such stages never communicate, and starting and ending a world of one is a large part of what
    a trivial stage costs.  ``start`` starts MPI and returns the communicator (a real ``MPI.Comm``), once;
    its rank and size are known without it.  Stage code that reaches MPI other than through ``ctx.comm``
    (``MPI.COMM_WORLD``) must start it first: reading ``ctx.comm`` does."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start: Callable[[], Any] | None = start
        self._comm: Any = None

    @property
    def started(self) -> bool:
        return self._start is None

    def get(self) -> Any:
        """The communicator, MPI started the first time."""
        if self._start is not None:
            self._comm = self._start()
            self._start = None
        return self._comm

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


class _Communicator:
    """``StageContext.comm``: the communicator given, or that of a :class:`DeferredWorld`, started on first read.

    A dataclass field whose default is a descriptor: the constructor's value goes through :meth:`__set__`,
    and every read through :meth:`__get__` (the field has no default: the class-level read raises)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError("comm")  # no default: every StageContext is given one
        value = obj.__dict__[self._slot]
        return value.get() if isinstance(value, DeferredWorld) else value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._slot] = value


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
    ``files`` are the stage's declared files, resolved and absolute (an object on a store: its URI, a
    ``str``); ``env`` its
    declared environment variables (:class:`DeclaredEnv`); ``inputs`` this rank's
    partition of each input, by its declared name (what :meth:`sql` reads).

    :meth:`progress` reports how far this rank is (a small file the live view reads).

    ``params`` is wrapped in :class:`TrackedParams` on construction (so every
    existing caller, the worker included, gets tracking unchanged);
    :attr:`params_read` says what the stage read.
    """

    if TYPE_CHECKING:
        comm: Any
    else:
        comm: Any = _Communicator()
    """The stage's communicator (a :class:`DeferredWorld` given here is started on first read)."""
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
    files: tuple[Path | str, ...] = ()
    """The declared files (:class:`DeclaredFiles`): ``ctx.files[0]``, or ``ctx.files["obs.csv"]`` by name."""
    env: Mapping[str, str | None] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)
    item: Any = None
    """A map stage's item (``map_over=``): the file's ``Path`` (an object's URI, a ``str``), the row as a dict, the partition's index,
    or the grid point as a dict; ``None`` in a plain stage."""
    item_index: int | None = None
    """The item's place among the map stage's items (0, 1, ...); ``None`` in a plain stage.  Its results
    should not depend on it: an item's cache key is its content, not its place."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, TrackedParams):
            object.__setattr__(self, "params", TrackedParams(self.params))
        if not isinstance(self.env, DeclaredEnv):
            object.__setattr__(self, "env", DeclaredEnv(self.stage, self.env))
        if not isinstance(self.files, DeclaredFiles):
            object.__setattr__(self, "files", DeclaredFiles(self.stage, self.files))

    @property
    def params_read(self) -> list[str] | None:
        """The param keys this rank's stage read, sorted; ``None`` means it saw all of them."""
        assert isinstance(self.params, TrackedParams)
        return self.params.read

    @property
    def rank(self) -> int:
        """This rank's index in ``comm`` (0 .. ``size`` - 1)."""
        return int(self.__dict__["_comm"].Get_rank())  # a DeferredWorld knows it without starting MPI

    @property
    def size(self) -> int:
        """The stage's rank count (``comm``'s size)."""
        return int(self.__dict__["_comm"].Get_size())

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

    def progress(self, done: float, total: float | None = None, *, unit: str = "", **metrics: Any) -> None:
        """Report this rank's progress: ``done`` of ``total`` (in ``unit``), and metrics (``loss=0.31``).

        The live view of ``hetflow run`` shows it on the stage's row.  It goes to
        ``progress-<rank>.json`` in the attempt directory, replaced atomically (no
        database write): calling it often is cheap, and reports closer than 0.1 s
        apart are dropped except the last unit (``done == total``).  Metric values
        are stored as numbers when they convert to ``float``, else as text.  A report
        that cannot be written (a full disk) is skipped with one warning: the display
        misses it, the stage goes on.
        """
        now = time.time()
        last = getattr(self, "_progress_written", 0.0)
        if now - last < 0.1 and (total is None or done < total):
            return
        object.__setattr__(self, "_progress_written", now)
        from .protocol import AttemptFiles

        values: dict[str, float | str] = {}
        for key, value in metrics.items():
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                values[key] = str(value)
        path = AttemptFiles(self.workdir).progress(self.rank)
        try:
            from hetflow.operators import safeio

            safeio.atomic_write(path, json.dumps({"done": float(done), "total": None if total is None else float(total),
                                                  "unit": unit, "metrics": values, "time": now}).encode(), durable=False)
        except OSError as exc:  # only the display misses it: a full disk or a context without a directory
            if not getattr(self, "_progress_failed", False):  # must not end a stage that is otherwise fine
                object.__setattr__(self, "_progress_failed", True)
                self.log.warning("progress not recorded (%s: %s); the stage goes on", path, exc.strerror or exc)

    def dtable(self, table: Any) -> Any:
        """Wrap this rank's partition as a distributed table over ``comm``."""
        from hetflow.operators import DTable

        return DTable(self.comm, table)

    def sql(self, query: str, **tables: Any) -> Any:
        """Run SQL over the stage's inputs, each by its declared name, and ``tables``; collective.

        ``tables`` (a ``DTable``, this rank's partition as a ``pyarrow.Table``, or a Parquet
        path/glob) add names or replace an input's.  Returns a ``DTable`` over ``comm``
        (``.to_arrow()`` is this rank's partition, ready to return as an output).  See
        :func:`hetflow.operators.sql`.
        """
        import pyarrow as pa

        from hetflow.operators import DTable, sql

        named: dict[str, Any] = {}
        lowered = query.lower()
        for name, table in self.inputs.items():
            if name not in tables and name.lower() in lowered:  # the same text on every rank: the same collectives
                named[name] = DTable(self.comm, table)
        for name, value in tables.items():
            named[name] = DTable(self.comm, value) if isinstance(value, (pa.Table, pa.RecordBatch)) else value
        return sql(self.comm, query, **named)
