"""The worker entry point: one process per rank of a stage attempt.

    python -m hetflow.tasks.worker SPEC.json

Each rank: joins its private communicator (a fresh ``mpiexec`` world, so
exactly the stage's ranks; or, with ``HETFLOW_COMM=tcp``, the TCP
communicator of :mod:`hetflow.operators.tcpcomm` for ranks that a backend
started one by one without MPI, its rank, size, rendezvous file and secret
file given by the ``HETFLOW_COMM_*`` variables, :mod:`hetflow.tasks.tcpenv`), pins itself to the cores of its slot, sets
its vendor's visible-devices variables from its GPUs (:mod:`hetflow.tasks.gpu`), opens the inputs zero-copy, imports and
calls the stage function, writes its partition of every output atomically and
a ``rank-<r>.json`` result.  The orchestrator commits the manifests after every
rank has succeeded.  A rank that fails writes its traceback and aborts the
whole communicator, so no other rank waits forever in a collective.  Each rank
runs as the child of a witness process that records how the rank ended if it
died by itself (:mod:`hetflow.tasks.witness`); a rank started warm is the fork
server's child, and the server is its witness (:mod:`hetflow.tasks.forkserver`).

The spec and the result are the typed JSON files of
:mod:`hetflow.tasks.protocol`, in a private run directory; nothing here
unpickles anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import socket
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import protocol, shm
from .errors import HetflowError
from .gpu import VISIBLE_DEVICES, GpuVendor, apply_visible_devices
from .protocol import (WORKER_ENV, AttemptFiles, RankError, RankOutput, RankResult, ScriptImportStop, WorkerSpec,
                       declared_file)

COMM_ENV = "HETFLOW_COMM"
"""``mpi`` (default: the ranks are an MPI world) or ``tcp`` (see :mod:`hetflow.operators.tcpcomm`)."""
COMMUNICATORS = ("mpi", "tcp")


def _pin(cores: list[int], gpus: list[int], vendor: GpuVendor, log: logging.Logger) -> list[int]:
    """Bind this process to its cores and GPUs; returns the CPUs actually used."""
    apply_visible_devices(os.environ, vendor, gpus)
    threads = str(max(1, len(cores)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS"):
        os.environ[var] = threads
    available = sorted(os.sched_getaffinity(0))
    if not cores:
        return available
    # A pilot may declare more cores than this machine has (a demo or test pilot):
    # fold the ids onto the real ones rather than fail, and say so.
    from .ledger import real_cpus  # the same CPUs the local backend booked

    cpus = real_cpus(cores, available)
    if cpus != sorted(cores):
        log.info("pilot core ids %s folded onto this machine's CPUs %s", cores, cpus)
    os.sched_setaffinity(0, cpus)
    return cpus


def _registered(module: Any, stage: str, name: str, pipeline: str | None = None) -> Callable[..., Any] | None:
    """The function declared as ``stage`` by a pipeline in ``module``'s namespace: stages made by a
    factory, a closure or a loop have no top-level name to look up.  Two pipelines with a stage of that
    name: the one named ``pipeline`` (the run's), then the one whose function has the name; two functions
    that still tie are refused rather than one of them run under the other's key."""
    found: list[tuple[Any, Callable[..., Any]]] = []
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            continue  # not a pipeline; and looking into a deferred import would load it
        stages = getattr(value, "stages", None)
        declared = stages.get(stage) if isinstance(stages, Mapping) else None
        func = getattr(declared, "func", None)
        if callable(func) and all(func is not f for _, f in found):
            found.append((getattr(value, "name", None), func))
    if len(found) > 1 and pipeline is not None:
        found = [(p, f) for p, f in found if p == pipeline] or found
    if len(found) > 1:
        found = [(p, f) for p, f in found if getattr(f, "__name__", None) == name] or found
    if len(found) > 1:
        raise RuntimeError(f"stage {stage!r}: {len(found)} pipelines in {getattr(module, '__file__', module)} "
                           f"named {pipeline!r} declare a stage {stage!r}; give the pipelines different names")
    return found[0][1] if found else None


@contextlib.contextmanager
def _declaring(stage: str) -> Iterator[None]:
    """While the script executes here, only ``stage`` is declared (:data:`protocol.worker_stage`)."""
    protocol.worker_stage = stage
    try:
        yield
    finally:
        protocol.worker_stage = None


def _load_function(spec: WorkerSpec) -> Callable[..., Any]:
    global _declared
    module_name, path, name = spec.function.module, spec.function.path, spec.function.name
    os.environ[WORKER_ENV] = "1"
    if spec.argv:  # the script's arguments, as the run's key counted them (a stage of a module, a shipped one)
        sys.argv = list(spec.argv)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if module_name != "__main__":
        with _declaring(spec.stage):
            module = importlib.import_module(module_name)
    else:
        if not path:  # declared without a script file (a notebook cell, stdin, -c): shipped by value
            from .shipping import load

            shipped = load(AttemptFiles(spec.attempt_dir).function, spec.stage)
            _declared = shipped  # what the key was made from: the values it reads are compared (_observe)
            return getattr(shipped, "__wrapped_stage__", shipped)  # type: ignore[no-any-return]
        from hetflow import observed

        from .script import SCRIPT_MODULE, check_unchanged, import_script

        sys.argv = [path, *spec.argv[1:]]  # what the script saw when its run started (itself by full path)
        check_unchanged(path, spec.script_sha256, spec.stage)
        observed.install()
        observed.recording(True)  # the files its top level reads (hetflow.observed)
        try:
            with _declaring(spec.stage):
                module = import_script(path, SCRIPT_MODULE)
        except ScriptImportStop:
            module = sys.modules[SCRIPT_MODULE]
        finally:
            observed.recording(False)
    func = _registered(module, spec.stage, name, spec.function.pipeline)
    if func is None:
        func = getattr(module, name, None)
    if not callable(func):
        raise RuntimeError(f"stage {spec.stage!r}: {module_name}.{name} is not a function, and no pipeline in "
                           f"{path or module_name} declares a stage {spec.stage!r} when the file is imported "
                           "(declare stages at import time, not inside a function the script calls)")
    _declared = func
    wrapped: Callable[..., Any] = getattr(func, "__wrapped_stage__", func)
    return wrapped


_declared: Any = None
"""The function the script declared as the stage (before unwrapping): what the orchestrator made its key from."""


def _run_folder(spec: WorkerSpec) -> str:
    """The run's folder (``<run>/stages/<stage>/attempt-<n>``'s top): what the run writes is not observed."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(spec.attempt_dir)))), "")


def _observe(spec: WorkerSpec) -> tuple[dict[str, str], frozenset[str]]:
    """What the rank could depend on beyond its key once its script's top level ran (:mod:`hetflow.observed`),
    and the modules imported by then.  The generators a session or the script's main block seeded are set
    first (:attr:`WorkerSpec.generators`): the stage draws from them, and their states are observed."""
    from hetflow import observed

    from .script import is_deferred

    observed.recording(False)  # on since hetflow's import in this process; the stage's own reads are not observed
    observed.restore_generators(spec.generators)
    # first what the key digests of the values the stage reads, as this rank's top level left them (a deferred
    # import it names is executed, as the stage would), then the modules, their values, files and states
    global _held
    roots = _shipped_roots(spec)
    code = observed.code_in_rank(_declared, spec.values, spec.local_installs, roots) if _declared is not None else {}
    _held = observed.containers_in_rank(_declared, spec.values) if _declared is not None and roots else {}
    found = observed.in_rank(spec.function.path, exclude=(_run_folder(spec),),  # only a script's top is recorded
                             files=spec.function.module == "__main__" and bool(spec.function.path))
    found.update(code)
    loaded = frozenset(name for name, module in observed.imported() if not is_deferred(module))
    observed.recording_writes(True)  # the files the stage writes: one the script's top reads is the run's own
    return found, loaded


def _observe_after(spec: WorkerSpec, seen: tuple[dict[str, str], frozenset[str]],
                   drew: frozenset[str] | None = None) -> dict[str, str]:
    """The modules the stage imported while it ran (or whose deferred import it loaded), added, wherever they
    lie (those it had are recorded as they were executed), the files it wrote and the folders it listed.  A
    stage does not depend on a generator it was given and did not draw from (not in ``drew``): with
    :attr:`WorkerSpec.generators_if_drawn` (a session's), its state is left out, so that a session whose
    generator nobody seeded (a new kernel) does not run it again.  ``None``: those the stage that just
    returned in this process drew from."""
    from hetflow import observed

    observed.recording_writes(False)
    if drew is None:
        drew = observed.generators_moved(spec.generators)
    filled = observed.filled_in_rank(_declared, _held, spec.local_installs, _shipped_roots(spec)) if _held else {}
    found = {**seen[0], **observed.module_sources((_run_folder(spec),), known=seen[0], before=seen[1]),
             **observed.stage_written((_run_folder(spec),)), **observed.stage_listed((_run_folder(spec),)), **filled}
    for name in (set(spec.generators) & set(spec.generators_if_drawn)) - drew:
        found.pop(f"state {name}", None)
    return found


_held: dict[str, Any] = {}
"""A shipped stage's module containers as its top level left them (:func:`hetflow.observed.containers_in_rank`)."""


def _shipped_roots(spec: WorkerSpec) -> tuple[str, ...]:
    """Where the key found a shipped stage's local modules: the session's working directory, the last entry of
    the rank's ``sys_path`` (the orchestrator's ``_worker_sys_path``); nothing for a stage with a file."""
    shipped = spec.function.module == "__main__" and not spec.function.path
    return spec.sys_path[-1:] if shipped else ()


def _open_input(path: str, rank: int, size: int, verify: str) -> Any:
    from hetflow.operators.dataset import Dataset

    dataset = Dataset(path, verify=verify)
    if dataset.producer.get("ranks") == size:
        return dataset.partitions_for_rank(rank, size)
    return dataset.rows_for_rank(rank, size)


def _check_result(stage: str, result: Any, outputs: list[str]) -> dict[str, Any]:
    import pyarrow as pa

    if not outputs:
        if result not in (None, {}):
            raise TypeError(f"stage {stage!r} declares no outputs but returned {type(result).__name__}")
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(f"stage {stage!r} must return a dict {{output name: pa.Table or None}} for outputs "
                        f"{outputs}, got {type(result).__name__}")
    missing = [o for o in outputs if o not in result]
    extra = [k for k in result if k not in outputs]
    if missing or extra:
        raise KeyError(f"stage {stage!r} returned outputs {sorted(result)}; declared outputs are {outputs}"
                       + (f" (missing {missing})" if missing else "") + (f" (undeclared {extra})" if extra else ""))
    checked: dict[str, Any] = {}
    for name in outputs:
        value = result[name]
        if isinstance(value, pa.RecordBatch):
            value = pa.Table.from_batches([value])
        dtable = sys.modules.get("hetflow.operators.dtable")  # loaded if the stage made one
        if dtable is not None and isinstance(value, dtable.DTable):
            value = value.to_arrow()  # this rank's partition, as ctx.dtable(...) took it
        if value is not None and not isinstance(value, (pa.Table, pa.RecordBatchReader)):
            raise TypeError(f"stage {stage!r}, output {name!r}: expected a pyarrow Table, RecordBatchReader, DTable "
                            f"or None, got {type(value).__name__}")
        checked[name] = value
    return checked


def _schema_text(value: Any) -> str | None:
    from hetflow.operators.dataset import schema_to_text

    return None if value is None else schema_to_text(value.schema)


class SchemaMismatch(HetflowError, TypeError):
    """A dataset's schema differs from what a stage declared."""


def schema_diff(actual: Any, expected: Any) -> list[str]:
    """Readable differences between two Arrow schemas (empty when they match)."""
    lines = []
    have = {f.name: f for f in actual}
    want = {f.name: f for f in expected}
    for name, field in want.items():
        if name not in have:
            lines.append(f"- missing column {name!r} ({field.type})")
        elif not have[name].type.equals(field.type):
            lines.append(f"~ column {name!r}: {have[name].type}, expected {field.type}")
    for name, field in have.items():
        if name not in want:
            lines.append(f"+ unexpected column {name!r} ({field.type})")
    return lines


def check_schema(stage: str, kind: str, name: str, actual: Any, expected: Any) -> None:
    diff = schema_diff(actual, expected)
    if diff:
        raise SchemaMismatch(f"stage {stage!r}, {kind} {name!r}: schema differs from the declared one:\n  "
                             + "\n  ".join(diff))


class SchemaDisagreement(HetflowError, TypeError):
    """Ranks returned different schemas for one output; ``ranks`` are those whose schema is the odd one
    out (every rank that returned one, when no schema is returned by more ranks than every other)."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


SCHEMAS_SHOWN = 6
"""At most this many distinct schemas are spelled out in a disagreement (the rest are counted)."""


def _fields_text(schema: Any) -> str:
    return ", ".join(f"{f.name}: {f.type}" + ("" if f.nullable else " not null") for f in schema)


def _agree_on_schemas(comm: Any, stage: str, tables: Mapping[str, Any]) -> None:
    """Every rank that returns an output must return the same schema for it.

    Every rank makes the check on the gathered schemas and raises the same :class:`SchemaDisagreement`,
    which names the ranks at fault: those whose schema differs from the one most ranks returned, or,
    when no schema has a majority (two ranks that differ), every rank, with each schema and the
    differences column by column."""
    from hetflow.operators.dataset import schema_from_text

    from .protocol import ranks_text

    mine = {name: _schema_text(value) for name, value in tables.items()}
    everyone = comm.allgather(mine)
    for name in tables:
        groups: dict[str, list[int]] = {}
        for r, schemas in enumerate(everyone):
            if schemas.get(name) is not None:
                groups.setdefault(schemas[name], []).append(r)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))
        majority = len(ordered[0][1]) > len(ordered[1][1])
        reference_text, reference = ordered[0]
        odd = [r for _, ranks in ordered[1:] for r in ranks] if majority else [r for _, rs in ordered for r in rs]
        if majority:
            head = f"{ranks_text(odd)} returned a schema that differs from the one {ranks_text(reference)} returned"
        else:
            head = f"{ranks_text(odd)} returned different schemas, and none is returned by more ranks than the others"
        shown = sorted(ordered[:SCHEMAS_SHOWN], key=lambda g: g[1][0])
        lines = [(f"stage {stage!r}, output {name!r}: {head} (every rank must return the same columns and types, "
                 "or None):")]
        lines += [f"  {ranks_text(ranks)}: {_fields_text(schema_from_text(text))}" for text, ranks in shown]
        expected = schema_from_text(reference_text)
        for text, ranks in shown:
            if text == reference_text:
                continue
            diff = schema_diff(schema_from_text(text), expected) or [("the same columns and types; the schemas' "
                                                                     "metadata differ")]
            lines += [f"  {ranks_text(ranks)} against {ranks_text(reference)}: {d}" for d in diff]
        if len(ordered) > SCHEMAS_SHOWN:
            lines.append(f"  ... and {len(ordered) - SCHEMAS_SHOWN} more schemas")
        raise SchemaDisagreement("\n".join(lines), tuple(sorted(odd)))


def operator_settings(spec: WorkerSpec) -> contextlib.AbstractContextManager[Any]:
    """The operators' settings while the stage function runs (:mod:`hetflow.operators.settings`): its
    ``memory_per_rank`` is their memory budget (0 or none: no budget), the pilot's ``node_local_dir``
    (``$VAR`` and ``~`` expanded here, on the node) their spill directory.  Restored afterwards, for
    workers that run several stages."""
    from hetflow.operators import settings

    spill_dir = None
    if spec.node_local_dir:
        spill_dir = os.path.expanduser(os.path.expandvars(spec.node_local_dir))
    chosen: contextlib.AbstractContextManager[Any] = settings.override(memory_budget=spec.memory_per_rank or None,
                                                                       spill_dir=spill_dir)
    return chosen


def _communicator_kind() -> str:
    kind = os.environ.get(COMM_ENV, "mpi")
    if kind not in COMMUNICATORS:
        raise ValueError(f"{COMM_ENV}={kind!r} is not a communicator kind (allowed: {list(COMMUNICATORS)})")
    return kind


def run_rank(spec: WorkerSpec, rank: int, size: int, get_comm: Callable[[], Any], *,
             stream: Any = None, fold_cores: bool = True,
             raptor: Mapping[str, Any] | None = None) -> tuple[RankResult, Any]:
    """Run rank ``rank`` of ``size`` of the stage in ``spec``; returns its result and its communicator.

    Every step a rank takes, for every way of starting one (``mpiexec``, the TCP
    communicator of the Dask backend, a Raptor worker): pid file, pinning, inputs,
    schema checks, the stage function, outputs, and the ``rank-<r>.json`` result,
    which is written whatever happens.  ``get_comm`` is called inside the recorded
    part (a failed rendezvous is recorded like any failure).  With ``fold_cores``
    false, core ids this machine does not have leave the rank unpinned instead of
    folding them onto real CPUs.  ``raptor`` is recorded as the result's ``raptor``
    (which Raptor worker ran the rank).  The caller aborts the other ranks on failure.
    """
    from hetflow.operators import dataset as ds
    from hetflow.tasks.context import StageContext

    stage = spec.stage
    attempt_dir = spec.attempt_dir
    files = AttemptFiles(attempt_dir)
    log = logging.getLogger(f"hetflow.stage.{stage}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{stage} rank {rank}/{size}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    result = RankResult(rank=rank, size=size, pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                        raptor=raptor)
    # who is who: lets the orchestrator name a rank killed by a signal, and reap orphans
    files.write_pid(rank, os.getpid())
    comm: Any = None
    params_read: Any = None
    seen: dict[str, str] | None = None
    placed: dict[str, Any] = {}
    outputs: dict[str, RankOutput | None] = {}
    try:
        comm = get_comm()
        if size > 1:  # MPICH maps its shared memory in MPI_Init; the witness removes it if this rank dies
            shm.record(files.shm_segments(os.getpid()))
        if size != len(spec.slots):
            raise RuntimeError(f"stage {stage!r} was launched with {size} ranks but placed on {len(spec.slots)} slots")
        slot = spec.slots[rank]
        if fold_cores or set(slot.cores) <= os.sched_getaffinity(0):
            cpus = _pin(list(slot.cores), list(slot.gpus), spec.gpu_vendor, log)
        else:
            log.info("pilot core ids %s are not all on this machine; rank left unpinned", list(slot.cores))
            cpus = _pin([], list(slot.gpus), spec.gpu_vendor, log)
        placed = {"cpus": tuple(cpus), "cores": slot.cores, "gpus": slot.gpus,
                  "visible_devices": {name: os.environ[name] for name in VISIBLE_DEVICES[spec.gpu_vendor]}}
        import pyarrow as pa

        pa.set_cpu_count(max(1, len(cpus)))
        func = _load_function(spec)
        top = _observe(spec)
        named_inputs = list(spec.inputs)  # declaration order
        inputs = [_open_input(path, rank, size, spec.verify) for _, path in named_inputs]
        declared = {name: ds.schema_from_text(text) for name, text in spec.schemas.items()}
        for (name, _), table in zip(named_inputs, inputs):
            if name in declared:
                check_schema(stage, "input", name, table.schema, declared[name])
        env = spec.env_values()  # what the key was made with, passed in this process's environment
        ctx = StageContext(comm=comm, stage=stage, run_id=spec.run_id, attempt=spec.attempt,
                           params=spec.params, workdir=attempt_dir,
                           checkpoint_dir=spec.checkpoint_dir, cores=slot.cores,
                           gpus=slot.gpus, node=spec.nodes[slot.node], log=log,
                           files=tuple(declared_file(f) for f in spec.files), env=env,
                           inputs={name: table for (name, _), table in zip(named_inputs, inputs)})
        with operator_settings(spec):
            tables = _check_result(stage, func(ctx, *inputs), list(spec.outputs))
        seen = _observe_after(spec, top)
        for name, value in tables.items():
            if value is not None and name in declared:
                check_schema(stage, "output", name, value.schema, declared[name])
        if size > 1:
            _agree_on_schemas(comm, stage, tables)
        for name, value in tables.items():
            if value is None:
                outputs[name] = None
                continue
            info = ds.write_partition(spec.outputs[name], rank, value if isinstance(value, pa.Table) else iter(value),
                                      schema=value.schema, rank=rank, node=ctx.node)
            outputs[name] = RankOutput(partition=info.to_json(), schema=ds.schema_to_text(value.schema))
        result = dataclasses.replace(result, status="ok")
        params_read = ctx.params_read
    except BaseException as exc:  # noqa: BLE001 - every failure must be recorded before the abort
        result = dataclasses.replace(result, status="error", error=RankError(
            type=type(exc).__name__, message=error_message(exc, spec.files), traceback=traceback.format_exc(),
            at_fault=exc.ranks if isinstance(exc, SchemaDisagreement) else ()))
        log.error("failed: %s: %s", type(exc).__name__, exc)
    finally:
        log.removeHandler(handler)
    result = dataclasses.replace(result, ended=time.time(), outputs=outputs, **placed, observed=seen,
                                 params_read=None if params_read is None else [str(k) for k in params_read])
    result.write(files.rank_result(rank))
    return result, comm


def error_message(exc: BaseException, files: Sequence[str] = ()) -> str:
    """``str(exc)``, and for a relative path that is not there (or one made absolute in the rank: a path under
    its working directory), why: the stage's working directory is its attempt directory, not the directory
    hetflow was started in.  ``files``: the stage's declared
    files, resolved; when there are some, the hint is to open them through ``ctx.files``."""
    text = str(exc)
    if not isinstance(exc, FileNotFoundError):
        return text
    name = exc.filename if isinstance(exc.filename, str) else (text if text and not any(c.isspace() for c in text)
                                                               else None)  # pyarrow gives only the path
    here = os.getcwd()
    if name is not None and os.path.isabs(name):
        if not name.startswith(os.path.join(here, "")):
            return text
        name = os.path.relpath(name, here)  # Path("data").resolve() at the script's top, resolved in this rank
        where = (f"a relative path made absolute at the script's top (Path({name.split(os.sep)[0]!r}).resolve(), "
                 f"os.path.abspath) is resolved in each rank's attempt directory {here}, not where the run was started")
    else:
        where = f"a relative path is looked up in the stage's attempt directory {here}, not where the run was started"
    if files:
        listed = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        named = os.path.basename(name) if name and any(os.path.basename(str(f)) == os.path.basename(name)
                                                       for f in files) else os.path.basename(str(files[0]))
        return text + (f" ({where}: open the declared files through ctx.files, which holds their absolute paths, "
                       f"by place or by name: ctx.files[{named!r}]; declared: {listed})")
    shown = repr(name) if name else "'data.csv'"
    return text + (f" ({where}: declare the file with files=[{shown}] (relative to the script) and open it "
                   "from ctx.files, so that a change to it also reruns the stage)")


def _start_mpi(mpi: Any) -> None:
    """Start MPI here (a singleton world without a launcher) and finalize it at exit, as mpi4py would."""
    import atexit

    mpi.Init_thread(mpi.THREAD_MULTIPLE)
    atexit.register(lambda: None if mpi.Is_finalized() else mpi.Finalize())


_MPI_WITHOUT_START = frozenset({"Is_initialized", "Is_finalized", "Get_version", "Get_library_version"})
_MPI_STARTS = frozenset({"Init", "Init_thread"})
"""What :func:`_start_on_first_use` serves by starting the deferred world: code that asks ``Is_initialized()``
(False until then) and starts MPI itself (``if not MPI.Is_initialized(): MPI.Init()``) finds it started, as
a second ``MPI_Init`` would fail."""


def _start_on_first_use(mpi: Any, world: Any) -> None:
    """Make ``mpi4py.MPI``, as code imports it from now on (``from mpi4py import MPI`` in a function of an
    installed package the key does not show), a module that starts this rank's deferred MPI world
    (:class:`~hetflow.tasks.context.DeferredWorld`) when any of its names but a few questions is first read:
    MPI used before it is started would abort the rank.  Code that took the module before (at import, in
    the fork server) holds it itself; a stage whose key shows such code has MPI started before it runs."""
    import types

    import mpi4py

    class StartingMPI(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if not name.startswith("__") and name not in _MPI_WITHOUT_START:
                world.get()
                sys.modules["mpi4py.MPI"] = mpi4py.MPI = mpi  # type: ignore[attr-defined]
                if name in _MPI_STARTS:
                    return lambda *args, **kwargs: None if name == "Init" else mpi.Query_thread()
            return getattr(mpi, name)

    starting = StartingMPI("mpi4py.MPI", getattr(mpi, "__doc__", None))
    sys.modules["mpi4py.MPI"] = mpi4py.MPI = starting  # type: ignore[attr-defined]


def own_output(files: AttemptFiles, rank: int) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2: ``print``, ``ctx.log``,
    C libraries, child processes) to ``rank-<rank>.log``, line-buffered.

    Done by the rank itself rather than the launcher, so it works the same under
    ``mpiexec``, ``srun`` and one-by-one starts, and the launcher's own output
    (Hydra's ``BAD TERMINATION`` banner) stays apart in ``stdout.log``/``stderr.log``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(files.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def run(spec_path: str, launched: bool = False, mpi_held: bool = False) -> int:
    """Run this process's rank of the stage in ``spec_path``; its exit code.  ``launched``: a warm rank
    of a multi-rank task (:mod:`hetflow.tasks.warmranks`), forked with its launcher's PMI connection but
    MPI not started: it starts it now and joins the launcher's world.  ``mpi_held``: a package the fork
    server imported holds ``mpi4py.MPI`` (:data:`hetflow.tasks.forkserver.mpi_held`), so a warm one-rank
    task starts MPI before its stage."""
    kind = _communicator_kind()
    spec = WorkerSpec.read(Path(spec_path))
    world: list[Any] = []
    if kind == "tcp":
        import mpi4py

        # The ranks are not MPI processes: the operators may import mpi4py (for MPI.BYTE),
        # but nothing may initialise MPI (a singleton MPI_Init can fail outside a launcher).
        mpi4py.rc.initialize = mpi4py.rc.finalize = False
        rank, size = int(os.environ["HETFLOW_COMM_RANK"]), int(os.environ["HETFLOW_COMM_SIZE"])

        def get_comm() -> Any:
            from .tcpenv import connect_from_env

            world.append(connect_from_env())
            return world[0].Dup()
    else:
        from mpi4py import MPI

        if launched and not MPI.Is_initialized():
            _start_mpi(MPI)
        if MPI.Is_initialized():  # mpi4py started it at import: a launcher's ranks
            mpi_comm: Any = MPI.COMM_WORLD.Dup()
            rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        else:  # a warm rank: the fork server loads MPI's library and leaves MPI to each rank, a world of one
            from .context import DeferredWorld

            def start() -> Any:
                _start_mpi(MPI)
                return MPI.COMM_WORLD.Dup()

            mpi_comm = DeferredWorld(start)  # started when the stage reads ctx.comm, if it does
            rank, size = 0, 1
            if spec.items or spec.mpi_named or mpi_held:  # a map stage's runner and item children share the rank's world
                mpi_comm = mpi_comm.get()       # (hetflow.tasks.mapitems); a stage naming mpi4py may use it directly
            else:
                _start_on_first_use(MPI, mpi_comm)

        def get_comm() -> Any:
            return mpi_comm

    own_output(AttemptFiles(spec.attempt_dir), rank)
    if spec.items:  # a map stage's items, one after another (hetflow.tasks.mapitems)
        from .mapitems import run_items

        record, comm = run_items(spec, rank, size, get_comm)
    else:
        record, comm = run_rank(spec, rank, size, get_comm)
    if record.status != "ok":
        sys.stderr.flush()
        if size > 1 and comm is not None:
            comm.Abort(1)  # end every rank now; nobody waits in a collective
        return 1
    if world:
        world[0].Free()  # goodbye to every peer once they are done too (like MPI_Finalize)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetflow.tasks.worker SPEC.json", file=sys.stderr)
        return 2
    from hetflow.tasks.witness import witnessed

    # The rank runs in a child; this process only records how it ended if it died by itself
    # (the orchestrator's spec lives in the attempt directory).
    return witnessed(Path(args[0]).parent, lambda: run(args[0]))


if __name__ == "__main__":
    sys.exit(main())
