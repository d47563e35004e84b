"""The worker <-> orchestrator protocol: every file of a stage attempt's directory.

The orchestrator writes a :class:`WorkerSpec` (``spec.json``) and starts
``python -m hetflow.tasks.worker SPEC.json`` once per rank.  Each rank writes
its pid (``rank-<r>.pid``) first and its :class:`RankResult` (``rank-<r>.json``)
last; its own output (stdout and stderr, ``print`` and ``ctx.log``) goes to
``rank-<r>.log`` and its latest ``ctx.progress`` to ``progress-<r>.json``; the
launcher's own output (Hydra's banners, anything said before a rank knew its
number) stays in ``stdout.log``/``stderr.log``;
a rank's witness writes ``ended-<pid>.json`` when the rank died by itself
(:mod:`hetflow.tasks.witness`).  :class:`AttemptFiles` names them all, and
:func:`diagnose` turns them and the backend's outcome into a :class:`Failure`.

Everything is JSON written atomically (mode 0600); nothing is unpickled.
Reading checks every field and raises :class:`ProtocolError` naming the file
and the field.  The worker imports this module before it forks its witness,
so heavy imports stay lazy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from hetflow.operators.safeio import open_regular

from .errors import ProtocolError
from .gpu import GPU_VENDORS, GpuVendor
from .scheduler_types import RankSlot

if TYPE_CHECKING:
    from .backends.base import TaskOutcome


FORK_SERVER = "hetflow.tasks.forkserver"
"""The module the local backend's fork server runs as (``python -m``): the command line of its children."""

WORKER_ENV = "HETFLOW_WORKER"
"""Set in every worker; ``Pipeline.run()`` raises :class:`ScriptImportStop` when it sees it."""

worker_stage: str | None = None
"""In a rank, while it executes the script (or imports the module) that declares its stage: that stage's
name.  ``Pipeline.stage`` declares only that stage there and skips the others, which the run checked when it
started: a rank of a plan of N stages made in a loop paid for N declarations otherwise."""


class ScriptImportStop(BaseException):
    """Raised by ``Pipeline.run()`` inside a worker: the script is being imported for its stages.

    It lives here, not in the worker, because the worker runs as ``__main__``
    (``python -m hetflow.tasks.worker``): a class defined there would be
    ``__main__.ScriptImportStop``, another class than the one the pipeline raises.
    """

log = logging.getLogger(__name__)

VERIFY = ("checksum", "size", "none")
MPI_PACKAGES = frozenset({"mpi4py", "petsc4py", "slepc4py", "mpi4jax", "horovod", "dolfinx", "firedrake"})
"""Packages that use MPI by themselves, not only through a communicator a stage is given: a stage whose key
holds one has MPI started before it runs (:attr:`WorkerSpec.mpi_named`)."""
WITHOUT_MPI = frozenset({"numpy", "pyarrow", "pandas", "polars", "duckdb", "scipy", "sklearn", "matplotlib", "torch",
                         "psutil", "yaml", "sqlalchemy", "rich", "PIL", "tqdm", "hetflow"})
"""Installed packages known not to call mpi4py: a warm one-rank stage whose key holds only these (and the user's
own modules) starts MPI when it first reads ``ctx.comm``; any other installed package might import mpi4py
inside a function and call MPI before that (which would abort), so with one MPI is started first."""
ITEM_ISOLATION = ("checked", "fork")
MAX_PROGRESS_BYTES = 1 << 20
"""The most of a rank's progress file read back (a report is a few hundred bytes)."""
"""How a one-rank map task runs its items: :mod:`hetflow.tasks.mapitems`."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
STATUSES = ("ok", "error", "running")
_REQUIRED: Any = object()


class _Fields:
    """Typed reads of one JSON object; every error names the file and the field."""

    def __init__(self, data: Any, where: str, prefix: str, allowed: Sequence[str]) -> None:
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: {prefix or 'the content'} must be a JSON object, got {_kind(data)}")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ProtocolError(f"{where}: unknown field {self._join(prefix, unknown[0])!r} "
                                f"(allowed: {list(allowed)})")
        self.data, self.where, self.prefix = data, where, prefix

    @staticmethod
    def _join(prefix: str, key: str) -> str:
        return f"{prefix}.{key}" if prefix else key

    def fail(self, key: str, expected: str, value: Any) -> ProtocolError:
        return ProtocolError(f"{self.where}: field {self._join(self.prefix, key)!r} must be {expected}, "
                             f"got {_kind(value)} {str(value)[:80]!r}")

    def get(self, key: str, kinds: tuple[type, ...], expected: str, default: Any = _REQUIRED) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise ProtocolError(f"{self.where}: missing field {self._join(self.prefix, key)!r}")
            return default
        value = self.data[key]
        if value is None and type(None) in kinds:
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(key, expected, value)
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(key, (str,), "a string", default)

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(key, (int,), "an integer", default)

    def items(self, key: str, kind: type, expected: str, default: Any = _REQUIRED) -> Any:
        """A list whose items are all ``kind``, as a tuple (or ``default``/``None``)."""
        value = self.get(key, (list, type(None)) if default is None else (list,), f"a list of {expected}", default)
        if not isinstance(value, list):
            return value
        if not all(isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool) for v in value):
            raise self.fail(key, f"a list of {expected}", value)
        return tuple(value)

    def text_map(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.get(key, (dict,), "an object of strings", default)
        if not all(isinstance(v, str) for v in value.values()):
            raise self.fail(key, "an object of strings", value)
        return dict(value)

    def nested(self, key: str, allowed: Sequence[str]) -> _Fields:
        return _Fields(self.get(key, (dict,), "an object"), self.where, self._join(self.prefix, key), allowed)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _write_json(path: Path, data: Mapping[str, Any], *, durable: bool = True) -> None:
    # lazy: the witness imports this module before it forks, and the dataset module loads pyarrow
    from hetflow.operators.dataset import write_json_atomic

    write_json_atomic(path, data, durable=durable)  # temp file (+ fsync) + rename, mode 0600


_T = TypeVar("_T")


def _construct(cls: type[_T], where: str, fields: dict[str, Any]) -> _T:
    """``cls(**fields)``, its own checks' errors prefixed with the file."""
    try:
        return cls(**fields)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _load(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProtocolError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise ProtocolError(f"{path}: not valid JSON ({exc})") from exc


# ------------------------------------------------------------------------ spec
@dataclass(frozen=True)
class StageFunction:
    """Where the worker finds the stage function: ``module.name`` (``path`` for a script run as ``__main__``;
    ``__main__`` without a ``path``: shipped by value in the attempt directory, :attr:`AttemptFiles.function`).
    ``pipeline``: the name of the pipeline that runs it, which decides between two pipelines of the module
    that declare a stage of the same name with functions of the same name (None: not told)."""

    module: str
    name: str
    path: str | None = None
    pipeline: str | None = None


def env_digest(value: str | None) -> str | None:
    """What a worker spec holds of a declared environment variable: ``sha256:HEX`` of its value, ``None``
    when it is unset (the same digest as the cache key's record of it)."""
    return None if value is None else "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def declared_file(text: str) -> Path | str:
    """A declared file as a stage sees it (``ctx.files``, a file item's ``ctx.item``): a local ``Path``, or the
    URI of an object on a store (``s3://bucket/key``) as a ``str``, which no ``Path`` can hold."""
    from hetflow.operators.location import is_object_store

    return text if is_object_store(text) else Path(text)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of one stage attempt is told (``spec.json``).

    ``inputs`` are ``(dataset name, directory)`` in declaration order;
    ``outputs`` map each output to the directory its partitions go to;
    ``slots[r]`` is rank r's place, ``slots[r].node`` an index into ``nodes``;
    ``schemas`` hold the declared schemas as text; ``files`` the declared input
    files as absolute paths; ``gpu_vendor`` says which variables give a rank
    its GPUs (:func:`hetflow.tasks.gpu.visible_devices_env`).  ``argv`` is the
    ``sys.argv`` the script had when its run started: the worker gives it to the
    script again when it executes it to find the stage (``argv[0]`` as the script's
    full path: the worker runs in another directory); ``script_sha256`` is the
    digest of the script's file when the run started: a worker executes no other
    version of it (:func:`hetflow.tasks.script.check_unchanged`).  ``memory_per_rank``
    (the stage's, bytes) and ``node_local_dir`` (the pilot's, as its config writes
    it: ``$VAR`` is expanded on the node) become the operators' memory budget and
    spill directory (:mod:`hetflow.operators.settings`).  ``env`` names the
    stage's declared environment variables, each with the digest of the value its
    cache key saw (:func:`env_digest`; ``None``: unset), never the value: a
    declared variable is often a secret (``API_TOKEN``), and this file stays on
    disk after the run.  The values come in the launched process's own
    environment (``LaunchSpec.env``); each rank checks them against the digests
    and unsets those that were unset (:meth:`env_values`), and ``ctx.env`` gives them.
    """

    run_id: str
    stage: str
    attempt: int
    function: StageFunction
    attempt_dir: Path
    checkpoint_dir: Path
    slots: tuple[RankSlot, ...]
    nodes: tuple[str, ...]
    inputs: tuple[tuple[str, str], ...] = ()
    outputs: Mapping[str, str] = field(default_factory=dict)
    sys_path: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    verify: Literal["checksum", "size", "none"] = "checksum"
    schemas: Mapping[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    gpu_vendor: GpuVendor = "nvidia"
    memory_per_rank: int | None = None
    node_local_dir: str | None = None
    env: Mapping[str, str | None] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    script_sha256: str | None = None
    items: tuple[Mapping[str, Any], ...] = ()
    """A map stage's items for this task (:mod:`hetflow.tasks.mapitems`): each ``{"index", "key",
    "outputs": {name: directory}}`` and one of ``"file"`` (a path or an object's URI), ``"row"`` or ``"partition"`` (an index
    into input ``map_input``) or ``"point"`` (a dict of parameters).  Empty: a plain stage."""
    map_input: str | None = None
    item_timeout: float | None = None
    """Seconds an item of a one-rank map task may run before its process is killed (the stage's ``timeout``)."""
    item_isolation: Literal["checked", "fork"] = "checked"
    """How a one-rank map task isolates its items (:mod:`hetflow.tasks.mapitems`): one after another in one
    process, checked after each for state a later item would read (``checked``), or a process each (``fork``)."""
    values: tuple[str, ...] = ()
    """The components of the stage's key that name a value (``TABLE``, ``helper.K``): the rank digests them as
    its top level left them (:func:`hetflow.observed.code_in_rank`)."""
    local_installs: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    """What the orchestrator's key counted as installed from a local directory (editable project directories,
    installed files): the rank digests what its stage reads as the key did (:func:`hetflow.observed.code_in_rank`)."""
    generators: Mapping[str, str] = field(default_factory=dict)
    """Global random generators' states the rank restores once its top level ran, before the stage (and each map
    item) runs (:func:`hetflow.observed.restore_generators`): what a session or a script's main block seeded,
    which the rank never executes; every rank gets the same states."""
    mpi_named: bool = True
    """The stage's key holds a package that uses MPI by itself (:data:`MPI_PACKAGES`: ``mpi4py``) or one hetflow
    does not know to be without MPI (:data:`WITHOUT_MPI`): a warm one-rank rank starts MPI before the stage runs,
    not when the stage first reads ``ctx.comm`` (:class:`~hetflow.tasks.context.DeferredWorld`), so
    ``MPI.COMM_WORLD`` used without ``ctx.comm``, there or inside such a package, works."""
    generators_if_drawn: tuple[str, ...] = ()
    """The generators in ``generators`` that count (their state is observed) only where the stage drew from
    them: a session's, given whether or not anyone seeded them, and those a script's main block loaded first
    (:func:`hetflow.observed.shipped_generators`)."""

    def __post_init__(self) -> None:
        if self.memory_per_rank is not None and (isinstance(self.memory_per_rank, bool)
                                                 or not isinstance(self.memory_per_rank, int)
                                                 or self.memory_per_rank < 0):
            raise ProtocolError(f"stage {self.stage!r}: memory_per_rank={self.memory_per_rank!r} "
                                "(expected a number of bytes >= 0, or null)")
        if self.gpu_vendor not in GPU_VENDORS:
            raise ProtocolError(f"stage {self.stage!r}: gpu_vendor={self.gpu_vendor!r} (allowed: {list(GPU_VENDORS)})")
        if self.verify not in VERIFY:
            raise ProtocolError(f"stage {self.stage!r}: verify={self.verify!r} (allowed: {list(VERIFY)})")
        for slot in self.slots:
            if not 0 <= slot.node < len(self.nodes):
                raise ProtocolError(f"stage {self.stage!r}: slot node {slot.node} is not an index into the "
                                    f"{len(self.nodes)} node name(s) {list(self.nodes)}")
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name) or not (value is None or isinstance(value, str) and _ENV_DIGEST.fullmatch(value)):
                raise ProtocolError(f"stage {self.stage!r}: env {name!r}={str(value)[:80]!r} (expected a variable name "
                                    "and the digest of its value, sha256:HEX, or null)")
        if self.item_timeout is not None and (isinstance(self.item_timeout, bool) or
                                              not isinstance(self.item_timeout, (int, float)) or
                                              not self.item_timeout > 0):
            raise ProtocolError(f"stage {self.stage!r}: item_timeout={self.item_timeout!r} (expected seconds > 0, "
                                "or null)")
        unknown = sorted({*self.generators, *self.generators_if_drawn} - {"random", "numpy.random", "torch.random"})
        if unknown:
            raise ProtocolError(f"stage {self.stage!r}: generators {unknown} (allowed: random, numpy.random, "
                                "torch.random)")
        if self.item_isolation not in ITEM_ISOLATION:
            raise ProtocolError(f"stage {self.stage!r}: item_isolation={self.item_isolation!r} (allowed: "
                                f"{list(ITEM_ISOLATION)})")
        for item in self.items:
            if not isinstance(item.get("index"), int) or not isinstance(item.get("key"), str) or \
                    not isinstance(item.get("outputs"), Mapping) or \
                    not all(isinstance(k, str) and isinstance(v, str) and os.path.isabs(v)
                            for k, v in item["outputs"].items()) or \
                    sum(k in item for k in ("file", "row", "partition", "point")) != 1:
                raise ProtocolError(f"stage {self.stage!r}: item {str(item)[:80]} (expected index, key, outputs "
                                    "as absolute directories and one of file, row, partition, point)")
            if set(item) - {"index", "key", "outputs", "file", "row", "partition", "point", "label"}:
                raise ProtocolError(f"stage {self.stage!r}: item {str(item)[:80]} has unknown fields")
        from hetflow.operators.location import is_object_store

        relative = [f for f in self.files if not os.path.isabs(f) and not is_object_store(f)]
        if relative:
            raise ProtocolError(f"stage {self.stage!r}: declared files must be absolute paths or object URIs "
                                f"(s3://...), got {relative[0]!r}")

    def env_values(self) -> dict[str, str | None]:
        """The declared variables' values, from this process's environment, as its cache key saw them: each set
        one checked against its digest (:class:`ProtocolError` naming it when it differs or is missing: the
        backend did not pass the run's value), each unset one removed from ``os.environ``."""
        values: dict[str, str | None] = {}
        for name, digest in self.env.items():
            if digest is None:
                os.environ.pop(name, None)
                values[name] = None
                continue
            value = os.environ.get(name)
            if value is None or env_digest(value) != digest:
                raise ProtocolError(f"stage {self.stage!r}: environment variable {name} is "
                                    f"{'unset' if value is None else 'not the value'} in this rank's environment "
                                    "where its cache key saw a value (the backend did not pass the run's value)")
            values[name] = value
        return values

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "stage": self.stage, "attempt": self.attempt,
                "function": {"module": self.function.module, "path": self.function.path, "name": self.function.name,
                             "pipeline": self.function.pipeline},
                "attempt_dir": str(self.attempt_dir), "checkpoint_dir": str(self.checkpoint_dir),
                "slots": [{"node": s.node, "cores": list(s.cores), "gpus": list(s.gpus)} for s in self.slots],
                "nodes": list(self.nodes), "inputs": [[name, path] for name, path in self.inputs],
                "outputs": dict(self.outputs), "sys_path": list(self.sys_path), "params": dict(self.params),
                "verify": self.verify, "schemas": dict(self.schemas), "files": list(self.files),
                "gpu_vendor": self.gpu_vendor, "memory_per_rank": self.memory_per_rank,
                "node_local_dir": self.node_local_dir, "env": dict(self.env), "argv": list(self.argv),
                "script_sha256": self.script_sha256, "items": [dict(item) for item in self.items],
                "map_input": self.map_input, "item_timeout": self.item_timeout,
                "item_isolation": self.item_isolation,
                "values": list(self.values),
                "local_installs": [list(self.local_installs[0]), list(self.local_installs[1])],
                "generators": dict(self.generators), "generators_if_drawn": list(self.generators_if_drawn),
                "mpi_named": self.mpi_named}

    @classmethod
    def from_json(cls, data: Any, where: str = "worker spec") -> WorkerSpec:
        top = _Fields(data, where, "", _names(cls))
        function = top.nested("function", ("module", "path", "name", "pipeline"))
        slots = []
        for i, raw in enumerate(top.get("slots", (list,), "a list of slots")):
            slot = _Fields(raw, where, f"slots[{i}]", ("node", "cores", "gpus"))
            slots.append(RankSlot(slot.integer("node"), slot.items("cores", int, "integers"),
                                  slot.items("gpus", int, "integers", ())))
        inputs = top.get("inputs", (list,), "a list of [name, path] pairs", [])
        if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in inputs):
            raise top.fail("inputs", "a list of [name, path] pairs", inputs)
        fields = {"run_id": top.text("run_id"), "stage": top.text("stage"), "attempt": top.integer("attempt"),
                      "function": StageFunction(function.text("module"), function.text("name"),
                                             function.get("path", (str, type(None)), "a string or null", None),
                                             function.get("pipeline", (str, type(None)), "a string or null", None)),
                      "attempt_dir": Path(top.text("attempt_dir")), "checkpoint_dir": Path(top.text("checkpoint_dir")),
                      "slots": tuple(slots), "nodes": top.items("nodes", str, "strings"),
                      "inputs": tuple((name, path) for name, path in inputs), "outputs": top.text_map("outputs", {}),
                      "sys_path": top.items("sys_path", str, "strings", ()),
                      "params": dict(top.get("params", (dict,), "an object", {})),
                      "verify": top.text("verify", "checksum"), "schemas": top.text_map("schemas", {}),
                      "files": top.items("files", str, "strings", ()),
                      "gpu_vendor": top.text("gpu_vendor", "nvidia"),
                      "memory_per_rank": top.get("memory_per_rank", (int, type(None)), "an integer or null", None),
                      "node_local_dir": top.get("node_local_dir", (str, type(None)), "a string or null", None),
                      "env": dict(top.get("env", (dict,), "an object of strings or nulls", {})),
                      "argv": top.items("argv", str, "strings", ()),
                      "script_sha256": top.get("script_sha256", (str, type(None)), "a string or null", None),
                      "items": tuple(top.items("items", dict, "objects", ())),
                      "map_input": top.get("map_input", (str, type(None)), "a string or null", None),
                      "item_timeout": top.get("item_timeout", (int, float, type(None)), "a number or null", None),
                      "item_isolation": top.text("item_isolation", "checked"),
                      "values": top.items("values", str, "strings", ()),
                      "local_installs": _local_installs(top),
                      "generators": top.text_map("generators", {}),
                      "generators_if_drawn": top.items("generators_if_drawn", str, "generator names", ()),
                      "mpi_named": top.get("mpi_named", (bool,), "true or false", True)}
        return _construct(cls, where, fields)

    def write(self, path: Path, *, durable: bool = True) -> None:
        """Write this spec to ``path`` atomically, readable by this user only (``durable``: fsynced too)."""
        _write_json(path, self.to_json(), durable=durable)

    @classmethod
    def read(cls, path: Path) -> WorkerSpec:
        """The spec in ``path``; :class:`ProtocolError` names the file and the bad field."""
        return cls.from_json(_load(path), str(path))


def _local_installs(top: _Fields) -> tuple[tuple[str, ...], tuple[str, ...]]:
    value = top.get("local_installs", (list,), "two lists of paths", [[], []])
    if len(value) != 2 or not all(isinstance(part, list) and all(isinstance(p, str) for p in part) for part in value):
        raise top.fail("local_installs", "two lists of paths", value)
    return tuple(value[0]), tuple(value[1])


# ---------------------------------------------------------------------- result
@dataclass(frozen=True)
class RankOutput:
    """One output partition a rank wrote: its ``PartitionInfo.to_json()`` and its schema as text."""

    partition: Mapping[str, Any]
    schema: str


@dataclass(frozen=True)
class RankError:
    type: str
    message: str
    traceback: str
    at_fault: tuple[int, ...] = ()
    """The ranks whose data the error is about, when every rank found it in a check they make together
    (their output schemas differ); empty: the error is this rank's own."""


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0 and 1``, ``ranks 0, 2 and 5``; past eight ranks, the first six and a count."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


@dataclass(frozen=True)
class RankResult:
    """What one rank reports (``rank-<r>.json``), written once, whatever happened.

    ``outputs[name]`` is ``None`` where the rank returned no table.  ``cpus``,
    ``cores``, ``gpus`` and ``visible_devices`` (the GPU-choosing variables the
    rank set, e.g. ``{"CUDA_VISIBLE_DEVICES": "0"}``) are ``None`` when the rank
    failed before pinning itself.  ``params_read`` lists the parameters the
    stage read (``None``: all of them, or not tracked).  ``raptor`` says which
    Raptor worker ran the rank (``None`` outside Raptor).
    """

    rank: int
    size: int
    pid: int
    host: str
    started: float
    status: Literal["ok", "error", "running"] = "running"
    ended: float | None = None
    outputs: Mapping[str, RankOutput | None] = field(default_factory=dict)
    error: RankError | None = None
    cpus: tuple[int, ...] | None = None
    cores: tuple[int, ...] | None = None
    gpus: tuple[int, ...] | None = None
    visible_devices: Mapping[str, str] | None = None
    params_read: list[str] | None = None
    raptor: Mapping[str, Any] | None = None
    observed: Mapping[str, str] | None = None
    """What the rank could depend on beyond its key, as :mod:`hetflow.observed` digests it (``None``: not
    observed, the rank failed before its script's top level ended)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ProtocolError(f"rank {self.rank}: status {self.status!r} (allowed: {list(STATUSES)})")
        if (self.status == "error") != (self.error is not None):
            raise ProtocolError(f"rank {self.rank}: status {self.status!r} with error {self.error!r}")

    def to_json(self) -> dict[str, Any]:
        """The JSON object; fields that are ``None`` are left out."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "outputs":
                value = {n: None if o is None else {"partition": dict(o.partition), "schema": o.schema}
                         for n, o in value.items()}
            elif f.name == "error":
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()
                         if not (k == "at_fault" and not v)}
            elif isinstance(value, tuple):
                value = list(value)
            elif f.name in ("raptor", "visible_devices", "observed"):
                value = dict(value)
            data[f.name] = value
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "rank result") -> RankResult:
        top = _Fields(data, where, "", _names(cls))
        outputs: dict[str, RankOutput | None] = {}
        for name, raw in top.get("outputs", (dict,), "an object", {}).items():
            if raw is not None:
                part = _Fields(raw, where, f"outputs.{name}", ("partition", "schema"))
                outputs[name] = RankOutput(dict(part.get("partition", (dict,), "an object")), part.text("schema"))
            else:
                outputs[name] = None
        error = None
        if top.get("error", (dict, type(None)), "an object", None) is not None:
            err = top.nested("error", ("type", "message", "traceback", "at_fault"))
            error = RankError(err.text("type"), err.text("message"), err.text("traceback"),
                              err.items("at_fault", int, "integers", ()))
        params_read = top.items("params_read", str, "strings", None)
        raptor = top.get("raptor", (dict, type(None)), "an object", None)
        visible = top.text_map("visible_devices") if top.get("visible_devices", (dict, type(None)), "an object",
                                                              None) is not None else None
        ended = top.get("ended", (int, float, type(None)), "a number", None)
        fields = {"rank": top.integer("rank"), "size": top.integer("size"), "pid": top.integer("pid"),
                      "host": top.text("host"), "started": float(top.get("started", (int, float), "a number")),
                      "status": top.text("status", "running"), "ended": None if ended is None else float(ended),
                      "outputs": outputs, "error": error, "cpus": top.items("cpus", int, "integers", None),
                      "cores": top.items("cores", int, "integers", None), "gpus": top.items("gpus", int, "integers", None),
                      "visible_devices": visible,
                      "params_read": None if params_read is None else list(params_read),
                      "raptor": None if raptor is None else dict(raptor),
                      "observed": top.text_map("observed") if top.get("observed", (dict, type(None)), "an object",
                                                                      None) is not None else None}
        return _construct(cls, where, fields)

    def write(self, path: Path) -> None:
        """Write this result to ``path`` atomically, readable by this user only; not fsynced.

        Its one reader is the orchestrator, once the rank's process has ended (the task's end, or its chunk's);
        a crash of the machine before that ends the orchestrator too, and a resume redoes every attempt the
        store left RUNNING without reading its results (:meth:`Orchestrator._reconcile`).  What must be durable
        is the outputs' partitions, and the manifest the orchestrator commits from these results."""
        _write_json(path, self.to_json(), durable=False)

    @classmethod
    def read(cls, path: Path) -> RankResult:
        """The result in ``path``; :class:`ProtocolError` names the file and the bad field."""
        return cls.from_json(_load(path), str(path))


# ------------------------------------------------------------------ directory
class AttemptFiles:
    """The name of every file in one attempt directory, and their readers."""

    SPEC = "spec.json"
    STDOUT = "stdout.log"
    STDERR = "stderr.log"
    ENDED_PREFIX = "ended-"
    """``ended-<pid>.json``: the witness's record of a rank that ended by itself."""
    FUNCTION = "function.pickle"
    """A stage function without a script file, pickled by value (:mod:`hetflow.tasks.shipping`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"AttemptFiles({str(self.directory)!r})"

    @property
    def spec(self) -> Path:
        return self.directory / self.SPEC

    @property
    def stdout(self) -> Path:
        return self.directory / self.STDOUT

    @property
    def function(self) -> Path:
        return self.directory / self.FUNCTION

    @property
    def stderr(self) -> Path:
        return self.directory / self.STDERR

    def rank_result(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.json"

    def item_results(self, rank: int) -> Path:
        """Rank ``rank``'s results of a map stage's items, one JSON object a line, appended as each ends."""
        return self.directory / f"items-{rank}.jsonl"

    def read_item_results(self, rank: int = 0) -> dict[int, dict[str, Any]]:
        """``{item index: result}`` from :meth:`item_results` (a line cut short by a crash is skipped)."""
        found: dict[int, dict[str, Any]] = {}
        try:
            text = self.item_results(rank).read_text()
        except OSError:
            return found
        for line in text.splitlines():
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and isinstance(data.get("index"), int) and \
                    data.get("status") in ("ok", "error"):
                found[data["index"]] = data
        return found

    def rank_pid(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.pid"

    def rank_log(self, rank: int) -> Path:
        """What rank ``rank`` wrote to its stdout and stderr, in order (one file per rank)."""
        return self.directory / f"rank-{rank}.log"

    def rank_logs(self) -> dict[int, Path]:
        """``{rank: rank-<r>.log}`` of every rank that has a log, by rank."""
        found = {}
        for path in self.directory.glob("rank-*.log"):
            number = path.stem.split("-", 1)[1]
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))

    def progress(self, rank: int) -> Path:
        """Rank ``rank``'s latest ``ctx.progress(done, total, **metrics)``, replaced on every report."""
        return self.directory / f"progress-{rank}.json"

    def read_progress(self) -> dict[int, dict[str, Any]]:
        """``{rank: {"done", "total", "metrics", "time"}}`` of the ranks that reported progress
        (a file being replaced or unreadable is skipped: the next look finds it)."""
        found: dict[int, dict[str, Any]] = {}
        for path in self.directory.glob("progress-*.json"):
            number = path.stem.split("-", 1)[1]
            try:  # a regular file only: a symlink or a FIFO in its place is skipped, never followed or waited on
                with os.fdopen(open_regular(path), "rb") as fh:
                    data = json.loads(fh.read(MAX_PROGRESS_BYTES))
            except (OSError, ValueError):
                continue
            if number.isdigit() and isinstance(data, dict):
                found[int(number)] = data
        return dict(sorted(found.items()))

    def ended(self, pid: int) -> Path:
        return self.directory / f"{self.ENDED_PREFIX}{pid}.json"

    def shm_segments(self, pid: int) -> Path:
        """The MPICH shared-memory segments rank process ``pid`` mapped (:mod:`hetflow.tasks.shm`)."""
        return self.directory / f"shm-{pid}.txt"

    def rank_files(self) -> list[Path]:
        """Every ``rank-<r>.json`` and ``rank-<r>.pid`` present (what a rerun in the same directory clears)."""
        return sorted(self.directory.glob("rank-*.json")) + sorted(self.directory.glob("rank-*.pid"))

    def ended_records(self) -> list[Path]:
        return sorted(self.directory.glob(f"{self.ENDED_PREFIX}*.json"))

    def write_pid(self, rank: int, pid: int) -> None:
        """Record ``rank``'s pid (written first, so the orchestrator can name and reap the rank)."""
        fd = os.open(self.rank_pid(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{pid}\n".encode())
        finally:
            os.close(fd)

    def read_results(self, ranks: int) -> list[RankResult | None]:
        """Each rank's result, ``None`` for a rank that left none (or an unreadable one)."""
        results: list[RankResult | None] = []
        for rank in range(ranks):
            path = self.rank_result(rank)
            try:
                results.append(RankResult.read(path))
            except ProtocolError as exc:
                if path.exists():
                    log.warning("%s", exc)
                results.append(None)
        return results

    def rank_pids(self) -> dict[int, int]:
        """``{rank: pid}`` from the ``rank-<r>.pid`` files."""
        pids = {}
        for path in self.directory.glob("rank-*.pid"):
            try:
                pids[int(path.stem.split("-")[1])] = int(path.read_text().strip())
            except (OSError, ValueError, IndexError):
                continue
        return pids

    def any_ended_alone(self) -> bool:
        """Has a rank of this attempt ended abnormally by itself (one directory listing)?"""
        return next(self.directory.glob(f"{self.ENDED_PREFIX}*.json"), None) is not None

    def ended_alone(self, pids: Mapping[int, int]) -> dict[int, tuple[int, float]]:
        """``{rank: (wait status, time)}`` of the ranks that ended abnormally by themselves.

        ``pids`` maps rank to pid (:meth:`rank_pids`).
        """
        rank_of = {pid: rank for rank, pid in pids.items()}
        found: dict[int, tuple[int, float]] = {}
        for path in self.ended_records():
            try:
                record = json.loads(path.read_text())
                rank = rank_of.get(int(record["pid"]))
                if rank is not None:
                    found[rank] = (int(record["status"]), float(record["ended"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found


def reap_orphans(files: AttemptFiles) -> None:
    """Kill ranks a dead orchestrator left running (only our workers of that very attempt)."""
    import psutil

    spec = str(files.spec)
    for pid in files.rank_pids().values():
        try:
            proc = psutil.Process(pid)
            cmdline = proc.cmdline()
            # a rank the fork server started has the server's command line, and the attempt as its directory
            warm = FORK_SERVER in cmdline and Path(proc.cwd()) == Path(files.directory)
            if spec in cmdline or warm:
                log.warning("killing orphaned rank pid %d of %s", pid, files.directory)
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


# ------------------------------------------------------------------ diagnosis
@dataclass(frozen=True)
class Failure:
    """Why an attempt did not succeed: its state, a message, and the rank it names."""

    state: str
    message: str
    rank: int | None = None
    traceback: str | None = None
    signal: int | None = None


def diagnose(stage_name: str, timeout: float | None, outcome: TaskOutcome, results: Sequence[RankResult | None],
             files: AttemptFiles, *, ended_by_us: bool = False, grace: float) -> Failure | None:
    """``None`` if every rank succeeded, else what went wrong and where.

    A rank that ended without a result is named by its witness's record when
    there is one (:mod:`hetflow.tasks.witness`), else from the launcher's report.
    ``ended_by_us``: the orchestrator cancelled the task ``grace`` seconds after
    a rank ended alone, because the launcher did not end the others.
    """
    if outcome.ok and all(r is not None and r.status == "ok" for r in results):
        return None
    if not outcome.launched:
        return Failure("FAILED", f"stage {stage_name!r} was not started: {outcome.detail}")
    if outcome.timed_out:
        return Failure("TIMED_OUT", f"stage {stage_name!r} exceeded its timeout of {timeout}s; "
                       "its process group was killed")
    if outcome.cancelled and not ended_by_us:
        return Failure("CANCELLED", f"stage {stage_name!r} was cancelled")
    for rank, result in enumerate(results):
        if result is not None and result.error is not None:
            err = result.error
            if err.at_fault:  # found by every rank together: named are the ranks whose data differ
                return Failure("FAILED", f"{ranks_text(err.at_fault)}: {err.type}: {err.message}",
                               min(err.at_fault), err.traceback)
            return Failure("FAILED", f"rank {rank} raised {err.type}: {err.message}", rank, err.traceback)
    signal, bad_pid = hydra_report(files)
    signal = outcome.signal or signal
    pids = files.rank_pids()
    missing = [r for r, result in enumerate(results) if result is None]
    alone = files.ended_alone(pids)  # only a rank that ended by itself has a record, result or not
    code = outcome.returncode
    killed: int | None
    if alone:  # witnessed: the rank that ended by itself first, and its own status
        killed = min(alone, key=lambda r: alone[r][1])
        status = alone[killed][0]
        signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status)
    else:  # unwitnessed (a Raptor rank, no fork): the launcher's report, which may name a rank it killed
        killed = {pid: rank for rank, pid in pids.items()}.get(bad_pid) if bad_pid is not None else None
    how = f"killed by signal {signal}" if signal else f"exit code {code}"
    who = f"rank {killed}" if killed is not None else f"rank(s) {missing}"
    ranks_said = [f"[rank {r}] {text}" for r in (missing or []) if (text := tail(files.rank_log(r), 2000))]
    output = "\n".join(t for t in (*ranks_said, tail(files.stderr), tail(files.stdout)) if t)
    if ended_by_us:
        how += f"; the launcher did not end the other ranks within {grace:g} s, so hetflow did"
    if outcome.detail:  # the launcher's own account (srun: its exit code, error lines and node)
        how += f"; {outcome.detail}"
    returned = [r for r, result in enumerate(results) if result is not None and result.status == "ok"]
    if (alone and killed in returned) or len(returned) == len(results):
        # it died on its way out, after the stage's code: a native library aborting in the teardown
        who = f"rank {killed}" if alone else "a rank"
        others = f"; rank(s) {missing} ended before returning theirs" if missing else ""
        return Failure("FAILED", f"{who} of stage {stage_name!r} returned its result, then ended badly on its way "
                       f"out, after the stage's code ({how}){others}", killed, output or None, signal)
    return Failure("FAILED", f"{who} of stage {stage_name!r} ended without a result ({how})",
                   killed if killed is not None else (missing[0] if missing else None), output or None, signal)


def hydra_report(files: AttemptFiles) -> tuple[int | None, int | None]:
    """(signal, pid) of the process Hydra's banner reports as badly terminated, if it does."""
    signal = pid = None
    for path in (files.stdout, files.stderr):
        text = tail(path, 20000) or ""
        if signal is None and (match := re.search(r"\(signal (\d+)\)", text)):
            signal = int(match.group(1))
        if pid is None and (match := re.search(r"PID (\d+) RUNNING AT", text)):
            pid = int(match.group(1))
    return signal, pid


def tail(path: Path, limit: int = 4000) -> str | None:
    """The last ``limit`` bytes of ``path`` as text (``None`` when missing or empty)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data[-limit:].decode(errors="replace") or None
