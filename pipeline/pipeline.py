"""The user API: declare stages on a :class:`Pipeline`, then ``run()`` it on a pilot."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping, Sequence, TypeVar, overload

from hetflow.operators.dataset import Dataset
from hetflow.tasks import protocol
from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.errors import ConfigError, UnsatisfiableRequest
from hetflow.tasks.sizes import parse_bytes
from hetflow.tasks.protocol import WORKER_ENV, ScriptImportStop
from hetflow.tasks.shipping import ships_by_value

from .declaration import StageSpec, check_env, check_map, check_max_failures, check_name
from .errors import (HetflowError, PipelineError, ResumeRefused, RunAborted, RunFailed, RunInterrupted, RunLocked,
                     Terminated, interruption, store_argv)
from .filesystem import default_workdir
from .states import State

if TYPE_CHECKING:  # the pilot, the scheduler and the backends load where a run starts, not in every worker
    from hetflow.tasks.pilot import PilotDescription

    from .handle import RunHandle
    from .status import RunStatus

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RunOptions:
    """Settings a caller (the CLI) applies to every ``Pipeline.run()`` in a script."""

    pilot: "str | PilotDescription | None" = None
    workdir: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    param_text: Mapping[str, str] = field(default_factory=dict)
    """``--param`` values as typed; each gets its type by :mod:`hetflow.params`."""
    db: str | None = None
    data_dir: str | None = None
    """``--data-dir``: where the datasets go (:mod:`hetflow.datadir`), over the script's and the pilot's."""
    backend: str | None = None
    run_id: str | None = None
    new_run_ok: bool = False
    """With ``run_id``: a run of that id that does not exist yet is started under it
    (``hetflow run --run-id``, which ``hetflow submit`` writes into the batch script)."""
    progress: bool | None = None
    script: str | None = None
    rerun: Sequence[str] = ()
    stream_logs: bool = False
    """Print every stage's output as it is written, each line labelled (``hetflow run -v``)."""
    declare_only: bool = False
    """``Pipeline.run()`` runs nothing and raises :class:`Declared` with its pipeline: the script is
    executed as ``hetflow run`` executes it, up to its first run (``hetflow submit``'s check)."""
    cwd: str | None = None
    """The directory the command started in (``hetflow run``/``resume``): the relative paths it was given
    and the default work directory name files from there (:meth:`pinned`)."""

    def pinned(self) -> "RunOptions":
        """These options with the relative paths of the command line (``--workdir``, a ``--pilot`` file, a
        SQLite ``--db``, a ``--data-dir`` path) made absolute against :attr:`cwd`.  A script's top level may
        change directory (``os.chdir(DATA)``) before its ``pipe.run()`` reads them: what was typed names
        files as seen from where it was typed.  The default work directory is taken from :attr:`cwd` by
        :meth:`Pipeline.run` (``workdir`` stays ``None`` here: the script's own ``workdir=`` still wins over
        the default).  Unchanged without :attr:`cwd`."""
        if self.cwd is None:
            return self
        import dataclasses

        from hetflow.operators.location import is_uri
        from hetflow.tasks.pilot import absolute_spec

        from .errors import absolute_db

        base = Path(self.cwd)
        pilot = self.pilot
        if isinstance(pilot, str):
            pilot = absolute_spec(pilot, base)
        data_dir = self.data_dir
        if data_dir is not None and not is_uri(data_dir):
            data_dir = str(base / Path(data_dir).expanduser())
        return dataclasses.replace(self, pilot=pilot, data_dir=data_dir,
                                   workdir=None if self.workdir is None else str(base / self.workdir),
                                   db=None if self.db is None else absolute_db(self.db, base))


class Declared(BaseException):
    """Raised by ``Pipeline.run()`` under ``RunOptions(declare_only=True)``: the script declared ``pipeline``.

    A ``BaseException``, as :class:`~hetflow.tasks.protocol.ScriptImportStop` is, so that a script's
    ``except Exception`` around its run does not swallow it.
    """

    def __init__(self, pipeline: "Pipeline") -> None:
        super().__init__(pipeline.name)
        self.pipeline = pipeline


_overrides: list[tuple[RunOptions, list[RunStatus], list[RunHandle]]] = []


def _check_own_workdir(pipeline: str, root: Path) -> None:
    """Refuse (:class:`PipelineError`) to run in a work directory that is another user's (root's excepted) or
    that others may write.

    Decision: whoever can rename entries of the work directory can put a state store and ``runs/`` of theirs
    in place of yours, and the next run would reuse, as its cached results, what they recorded there.  A
    directory hetflow makes is 0700 and yours; one made otherwise is never chmod-ed, only refused.
    Group-writable is allowed (a user's private group makes every directory so under umask 002), and so is a
    sticky one others may write (1777, a fresh tmpfs) as long as its state store and ``runs/`` are yours.
    Reading such a directory (``status``, ``runs``) is not refused."""
    import stat

    info = os.stat(root)
    problems = []
    if info.st_uid not in (os.geteuid(), 0):
        problems.append(f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        problems.append(f"has mode {stat.S_IMODE(info.st_mode):04o}, which lets others write it")
    elif info.st_mode & stat.S_IWOTH:  # sticky (1777, a fresh tmpfs): others cannot rename ours, but may make theirs
        for name in ("hetflow.db", "runs"):
            try:
                owner = os.lstat(root / name).st_uid
            except OSError:
                continue
            if owner != os.geteuid():
                problems.append(f"holds {name} of uid {owner}, not yours (uid {os.geteuid()})")
    if problems:
        raise PipelineError(f"pipeline {pipeline!r}: work directory {root} {' and '.join(problems)}: another user "
                            "could replace its state store and runs with theirs; run in a work directory of your "
                            "own (--workdir)")


@contextmanager
def run_options(options: RunOptions) -> Iterator[list[RunStatus]]:
    """Apply ``options`` to every ``Pipeline.run()`` inside the block; yields the list of runs made."""
    runs: list[RunStatus] = []
    _overrides.append((options, runs, []))
    try:
        yield runs
    finally:
        _overrides.pop()


def wait_for_background() -> None:
    """Inside :func:`run_options` (``hetflow run``/``resume``): wait for the runs the script started with
    ``wait=False`` and left going, so that they are in its runs (and summary) and are not started again
    as the runs of a script that ran none.  A run that ended other than DONE is in the runs as such."""
    if not _overrides:
        return
    for handle in _overrides[-1][2]:
        try:
            handle.wait()
        except RunFailed:
            pass


class Pipeline:
    """A DAG of stages connected by named datasets.

    >>> pipe = Pipeline("demo", pilot="local")
    >>> @pipe.stage(ranks=2, outputs=["events"])
    ... def generate(ctx): ...
    """

    __hetflow_unkeyed__ = frozenset({"stages", "_producers"})
    """Left out of the pipeline's value where a stage reads it (``pipe.name``): a rank declares only the stage it
    runs (:data:`hetflow.tasks.protocol.worker_stage`), so its ``stages`` are not the run's, and each stage's
    declaration counts in that stage's own key."""

    def __init__(self, name: str, *, pilot: "str | os.PathLike[str] | PilotDescription" = "local",
                 workdir: "str | os.PathLike[str] | None" = None, db: str | None = None,
                 data_dir: "str | os.PathLike[str] | None" = None) -> None:
        self.name = check_name("pipeline", name, where="Pipeline")
        self.pilot = pilot
        self.workdir = None if workdir is None else Path(workdir)
        self.db = db
        self.data_dir = None if data_dir is None else os.fspath(data_dir)
        """Where the datasets go (a path or ``s3://bucket/prefix``; :mod:`hetflow.datadir`); None: the pilot's
        ``data_dir``, else the work directory."""
        self.stages: dict[str, StageSpec] = {}
        self._producers: dict[str, str] = {}  # output dataset -> the stage declared to make it

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, pilot={self.pilot!r}, stages={list(self.stages)})"

    # ------------------------------------------------------------ declaring
    def stage(self, func: F | None = None, *, name: str | None = None, ranks: int = 1, cores_per_rank: int = 1,
              gpus_per_rank: int = 0, memory_per_rank: int | str | None = None, ranks_per_node: int | None = None,
              duration: float | None = None, inputs: Sequence[str] = (), outputs: Sequence[str] = (),
              params: Mapping[str, Any] | None = None, retries: int = 0,
              timeout: float | None = None, schemas: Mapping[str, Any] | None = None,
              files: Sequence[str] = (), env: Sequence[str] = (), map_over: Any = None,
              max_failures: int | float = 0, map_isolation: str = "checked") -> Any:
        """Declare a stage; the function is called once per rank as ``func(ctx, *inputs)``.

        It returns ``{output name: pa.Table | None}`` with this rank's partition
        of each output.  ``duration`` is an estimate in seconds (scheduling and
        walltime checks); ``timeout`` ends the stage as TIMED_OUT; ``retries``
        re-runs a failed attempt that many times.  ``schemas`` maps input or
        output dataset names to the ``pa.Schema`` this stage expects: a
        dataset that differs is rejected at the boundary with a diff.
        ``files`` lists files or globs the stage reads (relative to the script's
        directory, or absolute; or objects on a store, ``s3://bucket/in/*.parquet``):
        their content is part of the stage's cache key (an object's ETag and size),
        so changing, adding or removing one re-runs it; ``ctx.files`` lists them;
        each must name a file when the run starts.  ``env`` names the environment
        variables the stage reads: their values join its cache key, and ``ctx.env``
        maps each to its value (``None``: unset).  A function that cannot be
        called as ``func(ctx, *inputs)`` is refused here (:class:`PipelineError`).
        ``memory_per_rank`` is bytes or a size as the pilot config writes it
        (``"4GB"`` = 4·10⁹, ``"4GiB"`` = 4·2³⁰).  Declared without a script file (a
        notebook cell, the prompt, ``python -c``, stdin), the function is shipped to its
        workers by value (:mod:`hetflow.tasks.shipping`), and declaring a stage of the
        same name again replaces it, as re-running a cell does.

        ``map_over`` makes a map stage, run once per item, each item a task with this
        resource request and its own cache key (docs/fanout.md): ``"files"`` (each file
        ``files=`` names; ``ctx.item`` is its path, or an object's URI), ``"rows:NAME"`` (each row of input
        NAME; ``ctx.item`` is the row as a dict), ``"partitions:NAME"`` (each partition
        of input NAME, passed as that input's table) or a grid ``{name: [values]}`` (the
        cross product; ``ctx.params`` holds each point).  Each output is one dataset of
        the items' partitions in item order.  ``retries`` then counts per item, and
        ``max_failures`` (a count, or a fraction of the items) lets the stage succeed
        with that many failed items left out of its outputs.  ``map_isolation`` says how a
        one-rank item is kept from the next: ``"checked"`` (one after another in a warm
        process, checked after each for state a later item would read; the rest run in a
        process each once one changed it) or ``"fork"`` (a process each).
        """
        def register(fn: F) -> F:
            stage_name = name or getattr(fn, "__name__", None)
            if protocol.worker_stage is not None and stage_name != protocol.worker_stage:
                return fn  # a rank of another stage executes the script: see protocol.worker_stage
            from . import observed

            observed.watch_top_end()  # the states the script's top leaves (np.random.seed), before its main block
            where = f"pipeline {self.name!r}, stage {stage_name!r}"
            check_name("stage", stage_name, where=f"pipeline {self.name!r}")
            assert isinstance(stage_name, str)
            replaced = self.stages.get(stage_name)
            if replaced is not None and not (replaced.path is None and ships_by_value(fn)):
                raise PipelineError(f"{where}: a stage with this name is already declared")
            for kind, names in (("input", inputs), ("output", outputs)):
                if isinstance(names, str):
                    raise PipelineError(f"{where}: {kind}s must be a list of dataset names, got the string {names!r}")
                for dataset in names:
                    check_name(f"{kind} dataset", dataset, where=where)
            if len(set(outputs)) != len(outputs) or len(set(inputs)) != len(inputs):
                raise PipelineError(f"{where}: a dataset is listed twice in inputs {list(inputs)} or outputs {list(outputs)}")
            for dataset in sorted(outputs):  # a look-up per output: declaring N stages stays linear in N
                other = self.stages.get(self._producers.get(dataset, ""))
                if other is not None and other is not replaced and dataset in other.outputs:
                    raise PipelineError(f"{where}: output {dataset!r} is already produced by stage {other.name!r}")
            import pyarrow as pa

            for dataset, schema in (schemas or {}).items():
                if dataset not in inputs and dataset not in outputs:
                    raise PipelineError(f"{where}: schema given for {dataset!r}, which is not one of its inputs "
                                        f"{list(inputs)} or outputs {list(outputs)}")
                if not isinstance(schema, pa.Schema):
                    raise PipelineError(f"{where}: schema for {dataset!r} must be a pyarrow.Schema, "
                                        f"got {type(schema).__name__}")
            if isinstance(files, str) or not all(isinstance(f, str) and f for f in files):
                raise PipelineError(f"{where}: files must be a list of paths or globs, got {files!r}")
            for pattern in (f for f in files if "://" in f):
                from hetflow.operators.location import carries_settings, is_object_store, redact

                if not is_object_store(pattern):
                    raise PipelineError(f"{where}: files: {redact(pattern)!r} is not a path, a glob or an "
                                        "s3://BUCKET/KEY URI (object stores: S3-compatible only)")
                if carries_settings(pattern):
                    raise PipelineError(f"{where}: files: {redact(pattern)!r}: credentials and options do not go "
                                        "into the URI; set them in the AWS environment (AWS_ACCESS_KEY_ID, "
                                        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...)")
            declared_env = check_env(env, where=where)
            mapped = check_map(map_over, inputs=tuple(inputs), files=tuple(files), where=where)
            failures_allowed = check_max_failures(max_failures, where=where)
            if mapped is None and max_failures:
                raise PipelineError(f"{where}: max_failures is for map stages (map_over=...); a plain stage "
                                    "has one task, which fails or not")
            from .declaration import check_map_isolation

            check_map_isolation(map_isolation, mapped=mapped is not None, where=where)
            if not os.environ.get(WORKER_ENV):  # a worker executes a script the run checked when it started
                _check_signature(fn, tuple(inputs), where)
            if not isinstance(retries, int) or retries < 0:
                raise PipelineError(f"{where}: retries must be an integer >= 0, got {retries!r}")
            if timeout is not None and timeout <= 0:
                raise PipelineError(f"{where}: timeout must be > 0 seconds, got {timeout!r}")
            try:
                memory = None if memory_per_rank is None else parse_bytes(memory_per_rank)
            except ConfigError as exc:
                raise PipelineError(f"{where}: memory_per_rank: {exc}") from None
            try:
                request = ResourceRequest(ranks=ranks, cores_per_rank=cores_per_rank, gpus_per_rank=gpus_per_rank,
                                          memory_per_rank=memory, ranks_per_node=ranks_per_node,
                                          duration=duration)
            except UnsatisfiableRequest as exc:
                raise PipelineError(f"{where}: {exc}") from None
            if replaced is not None:  # redefined in an interactive session (a later cell): the new one counts
                for dataset in replaced.outputs:
                    if self._producers.get(dataset) == stage_name:
                        del self._producers[dataset]
            self.stages[stage_name] = StageSpec(name=stage_name, func=fn, request=request, inputs=tuple(inputs),
                                                outputs=tuple(outputs), params=dict(params or {}),
                                                retries=retries, timeout=timeout, schemas=dict(schemas or {}),
                                                files=tuple(files), env=declared_env, map_over=mapped,
                                                max_failures=failures_allowed, map_isolation=map_isolation)
            self._producers.update((dataset, stage_name) for dataset in outputs)
            return fn

        return register(func) if func is not None else register

    # ------------------------------------------------------------ checking
    def validate(self, pilot: PilotDescription) -> None:
        """Reject an invalid DAG, a request the pilot can never satisfy or a declared file that is not
        there (a glob that matches nothing), before anything runs.

        Requests are checked only against a pilot whose shape is known (``cores_per_node`` set).
        """
        from hetflow.tasks.scheduler import check_request

        shaped = pilot.cores_per_node is not None  # an unshaped slurm pilot: its job gives the shape
        if not self.stages:
            raise PipelineError(f"pipeline {self.name!r} declares no stages")
        produced = {out: s.name for s in self.stages.values() for out in s.outputs}
        for spec in self.stages.values():
            for dataset in spec.inputs:
                if dataset not in produced:
                    raise PipelineError(f"pipeline {self.name!r}, stage {spec.name!r}: input {dataset!r} is not "
                                        f"produced by any stage (outputs: {sorted(produced)})")
            if spec.files:
                from .fingerprint import check_files

                try:
                    check_files(spec.files, Path(spec.path).parent if spec.path else Path.cwd())
                except ValueError as exc:
                    raise PipelineError(f"pipeline {self.name!r}, stage {spec.name!r}: {exc}") from None
            if spec.map_over is not None and pilot.backend == "radical":
                raise PipelineError(f"pipeline {self.name!r}, stage {spec.name!r}: map stages (map_over=) run on the "
                                    "local, slurm, parsl and dask backends, not on radical")
            try:
                if shaped:
                    check_request(spec.request, pilot, what=f"stage {spec.name!r}")
            except UnsatisfiableRequest as exc:
                raise UnsatisfiableRequest(f"pipeline {self.name!r}: {exc}") from None
        visiting: set[str] = set()
        done: set[str] = set()

        def visit(name: str, path: list[str]) -> None:
            if name in done:
                return
            if name in visiting:
                raise PipelineError(f"pipeline {self.name!r}: stages form a cycle: {' -> '.join(path + [name])}")
            visiting.add(name)
            for dataset in self.stages[name].inputs:
                visit(produced[dataset], path + [name])
            visiting.discard(name)
            done.add(name)

        for name in self.stages:
            visit(name, [])

    # ------------------------------------------------------------ running
    @overload
    def run(self, *, pilot: "str | os.PathLike[str] | PilotDescription | None" = ...,
            workdir: "str | os.PathLike[str] | None" = ..., params: Mapping[str, Any] | None = ...,
            db: str | None = ..., backend: str | None = ..., run_id: str | None = ...,
            progress: bool | None = ..., check: bool = ..., rerun: Sequence[str] = ...,
            wait: Literal[True] = ..., data_dir: "str | os.PathLike[str] | None" = ...) -> RunStatus: ...

    @overload
    def run(self, *, pilot: "str | os.PathLike[str] | PilotDescription | None" = ...,
            workdir: "str | os.PathLike[str] | None" = ..., params: Mapping[str, Any] | None = ...,
            db: str | None = ..., backend: str | None = ..., run_id: str | None = ...,
            progress: bool | None = ..., check: bool = ..., rerun: Sequence[str] = ...,
            wait: Literal[False], data_dir: "str | os.PathLike[str] | None" = ...) -> RunHandle: ...

    def run(self, *, pilot: "str | os.PathLike[str] | PilotDescription | None" = None,
            workdir: "str | os.PathLike[str] | None" = None, params: Mapping[str, Any] | None = None,
            db: str | None = None, backend: str | None = None, run_id: str | None = None,
            progress: bool | None = None, check: bool = True, rerun: Sequence[str] = (),
            wait: bool = True, data_dir: "str | os.PathLike[str] | None" = None) -> "RunStatus | RunHandle":
        """Run the pipeline to the end and return its status.

        Stages whose inputs are ready run at the same time on disjoint slots.
        With the same work directory, stages whose code, parameters and inputs
        match a committed earlier execution are not run again (CACHED);
        ``run_id`` of an existing run resumes it (every stage's key is checked
        again, so what changed since re-runs).  ``rerun`` names stages to run
        again whatever the cache says (``"all"`` for every stage), and
        everything downstream of them.  ``params`` override the defaults the
        stages declare in ``params=``; a key no stage declares is refused
        (:class:`~hetflow.PipelineError`), as ``--param`` refuses it.
        ``data_dir`` (a path or ``s3://bucket/prefix``) is where the datasets go, over the
        pipeline's and the pilot's ``data_dir``; by default the work directory (docs/object-storage.md).

        A run that does not end DONE raises :class:`~hetflow.RunFailed`, which carries
        the status (``exc.status``) and names the failed stages and the resume command;
        ``check=False`` returns the status instead.  Uncaught in a script, it prints that
        one line (no traceback) and the script exits 1 (:func:`_report_uncaught`).

        ``wait=False`` returns a :class:`~hetflow.handle.RunHandle` as soon as the run is recorded
        RUNNING; the run goes on in a thread of this process (a notebook's kernel stays free for
        other cells) and ``handle.wait()`` returns or raises what ``run()`` would have.  What the
        stages read is taken when ``run()`` is called, as for a blocking run.  Its live view is off
        unless ``progress=True``.
        """
        if os.environ.get(WORKER_ENV):
            raise ScriptImportStop()
        if _overrides and _overrides[-1][0].declare_only:
            raise Declared(self)
        from . import observed

        observed.take()  # what the script's top level left, before this process does anything else
        from hetflow.tasks.pilot import load_pilot

        typed, made = _overrides[-1][:2] if _overrides else (RunOptions(), [])
        options = typed.pinned()  # what the command line named, from where it was typed
        chosen_pilot = options.pilot or pilot or self.pilot
        description = load_pilot(chosen_pilot).resolve()  # type: ignore[arg-type]
        configured = description.backend
        if options.backend or backend:
            import dataclasses

            description = dataclasses.replace(description, backend=options.backend or backend)  # type: ignore[arg-type]
        try:
            self.validate(description)
        except UnsatisfiableRequest as exc:
            if description.backend != "slurm" or configured == "slurm":
                raise
            raise UnsatisfiableRequest(f"{exc}; --backend slurm keeps the shape of pilot {description.name!r}: to "
                                       "take the allocation's nodes and cores, give a pilot config with "
                                       "`backend: slurm` (--pilot my-slurm.yaml)") from None
        from hetflow.tasks.backends import require

        require(description.backend)  # a missing engine is one line naming the extra, before a run is recorded
        early = wait and description.backend in ("local", "slurm")
        if early and description.backend == "slurm":
            from hetflow.tasks.backends.slurm import start_agents_early

            start_agents_early(description)  # each node's agent imports on its node beside the orchestrator's
        elif early:
            from hetflow.tasks.backends.local import warm_start
            from hetflow.tasks.forkserver import start_early

            if warm_start(description):
                start_early()  # its imports go on beside the orchestrator's, next
        import gc

        # Decision: a blocking run keeps what this process holds before it (the imports, the script's own
        # objects) out of the collector's scans while it runs, moving it to the permanent generation, and
        # puts it back when it ends; the orchestrator's young objects (a map's items, the store's rows)
        # made each full collection walk all of it.  Not when the process froze objects itself (we could
        # not tell its own apart at the end), nor for a run in the background (the process goes on).
        frozen = wait and gc.get_freeze_count() == 0
        try:
            return self._start(description, options, typed, made, workdir=workdir, db=db, run_id=run_id, params=params,
                               progress=progress, check=check, rerun=rerun, wait=wait, data_dir=data_dir,
                               freeze=frozen)
        finally:
            if frozen:
                gc.unfreeze()
            if early:
                from hetflow.tasks.forkserver import discard_early

                discard_early()  # not adopted: the run ended before its backend started (or took fewer nodes)

    def _start(self, description: PilotDescription, options: RunOptions, typed: RunOptions, made: list[Any], *,
               workdir: "str | os.PathLike[str] | None", db: str | None, run_id: str | None,
               params: Mapping[str, Any] | None, progress: bool | None, check: bool, rerun: Sequence[str],
               wait: bool, data_dir: "str | os.PathLike[str] | None", freeze: bool) -> "RunStatus | RunHandle":
        """The rest of :meth:`run`, once its pilot is known (and, for a blocking local run, its fork server
        started: what follows imports the orchestrator and opens the store meanwhile); ``options`` as pinned,
        ``typed`` as the command line gave them (for the commands printed).  ``freeze``: move
        what this process holds, the orchestrator's imports too, to the collector's permanent generation."""
        from hetflow.tasks.collector import paused
        from hetflow.tasks.paths import private_dir

        with paused(freeze=freeze):  # no collections of what the imports make (hetflow.tasks.collector)
            from .orchestrator import Orchestrator  # heavy (SQLAlchemy): only where a run starts
            from .store import Store

        root = Path(options.workdir or workdir or self.workdir
                    or Path(options.cwd or os.curdir) / default_workdir()).resolve()
        try:
            private_dir(root)
            probe = root / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise PipelineError(f"pipeline {self.name!r}: work directory {root} is not usable: "
                                f"{exc.strerror or exc}") from None
        _check_own_workdir(self.name, root)
        store = Store.for_workdir(root, options.db or db or self.db)
        given = store_argv(typed.workdir or workdir or self.workdir, typed.db or db or self.db)  # as typed
        resume_id = options.run_id or run_id
        if options.new_run_ok and made:
            raise PipelineError(f"pipeline {self.name!r}: --run-id {options.run_id} names one run, but the script "
                                "runs a second pipeline")
        if resume_id is not None:
            if options.new_run_ok:  # --run-id: this exact run, resumed, or a new run under that id
                record = store.find_run(resume_id)
                if record is not None and record.id != resume_id:
                    record = None  # find_run matches a prefix; --run-id names one run exactly
                the_id = record.id if record is not None else resume_id
                if record is None:
                    resume_id = None  # a new run under the id chosen for it (hetflow submit)
            else:
                the_id = store.resolve_run(resume_id).id
        else:
            the_id = f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        import dataclasses

        from .datadir import RunDatasets, check_data_dir, reachable, unclaimed

        chosen_data = options.data_dir or (None if data_dir is None else os.fspath(data_dir)) or self.data_dir \
            or description.data_dir
        if chosen_data is None and resume_id is not None:  # a resume writes where the run began
            previous = store.find_run(the_id)
            chosen_data = ((previous.pilot or {}) if previous is not None else {}).get("data_dir")
            if chosen_data is not None:  # as the run's own directory kept it, not as any store user wrote it
                from .started import check_kept_data_dir

                check_kept_data_dir(previous, Path(previous.run_dir))  # as `hetflow resume` reads it
        if chosen_data is not None:
            what = "--data-dir" if options.data_dir else "data_dir"
            description = dataclasses.replace(description, data_dir=check_data_dir(chosen_data, what=what))
            reachable(description.data_dir or "", pipeline=self.name)
            if resume_id is None:
                unclaimed(description.data_dir or "", the_id, pipeline=self.name)
        from .params import NAN_KEPT, declared_params, from_command_line, signed_nan, undeclared

        declared = declared_params(self.stages.values())
        for key in params or {}:
            if key not in declared:
                raise PipelineError(f"pipeline {self.name!r}: " + undeclared(f"run(params=...) gives {key!r}", key,
                                                                                declared))
        run_params = dict(params or {})
        run_params.update(options.params)
        run_params.update(from_command_line(options.param_text, self.stages.values()))
        for key, value in run_params.items():
            if signed_nan(value):
                raise PipelineError(f"pipeline {self.name!r}: run(params=...) gives {key!r} = -nan: {NAN_KEPT}")
        for spec in self.stages.values():
            for key, value in spec.params.items():
                if signed_nan(value):
                    raise PipelineError(f"stage {spec.name!r}: params= declares {key!r} = -nan: {NAN_KEPT}")
        show = options.progress if options.progress is not None else progress  # None: live view on a terminal,
        # plain lines otherwise; off in the background, where it would write into whatever cell runs then
        if not wait and show is None:
            show = False
        orchestrator = Orchestrator(name=self.name, stages=self.stages, pilot=description, run_id=the_id,
                                    run_dir=root / "runs" / the_id, store=store, params=run_params,
                                    datasets=RunDatasets.of_run(the_id, root / "runs" / the_id, description.data_dir),
                                    script=options.script or _script_path(self.stages), progress=show,
                                    stream_logs=options.stream_logs,
                                    rerun=tuple(options.rerun) + tuple(rerun))
        started = _Started(self.name, orchestrator, description, store, given, made, check)
        with _claimed(the_id):
            try:
                orchestrator.prepare(resume=resume_id is not None)
            except OSError as exc:
                from .orchestrator import where

                raise PipelineError(f"pipeline {self.name!r}: cannot start run {the_id}: {where(exc)}") from None
            # from here on the run is ours and RUNNING: however it ends, it ends recorded
            if orchestrator.script is None:  # no script for `hetflow resume` to execute: the stages instead
                from .recorded import record as record_stages

                started.recorded = record_stages(orchestrator.run_dir, self.name, orchestrator.stages, description,
                                          orchestrator.base_dir)
            if wait:
                return started.execute()
            from .handle import RunHandle

            orchestrator.fix_code()
            handle = RunHandle(started)
            if _overrides:
                _overrides[-1][2].append(handle)
            return handle


_running: set[str] = set()
"""The runs an orchestrator of this process executes now (:func:`_claimed`)."""
_running_lock = threading.Lock()


@contextmanager
def _claimed(run_id: str) -> Iterator[None]:
    """Hold ``run_id`` for this process while its run is prepared; the run's thread releases it
    (:meth:`_Started.execute`) when the run has ended.

    The store refuses a run whose owner is another live process, but the owner is the process: two
    runs of one kernel (``wait=False``, then ``run(run_id=...)`` of the same run) would both take it.
    """
    with _running_lock:
        if run_id in _running:
            raise RunLocked(f"run {run_id} is running in this process already (started with wait=False): "
                            "wait for it with handle.wait(), or stop it with handle.cancel(), before resuming it")
        _running.add(run_id)
    try:
        yield
    except BaseException:
        _release(run_id)
        raise


def _release(run_id: str) -> None:
    with _running_lock:
        _running.discard(run_id)


@dataclass
class _Started:
    """A run recorded RUNNING, ready to execute: here (``pipe.run()``) or in a thread (``wait=False``)."""

    pipeline: str
    orchestrator: Any
    description: Any
    store: Any
    given: tuple[str, ...]
    made: list[Any]
    check: bool
    recorded: bool = False
    """Whether the stages are recorded in the run for ``hetflow resume`` (a run without a script)."""

    @property
    def run_id(self) -> str:
        return str(self.orchestrator.run_id)

    def execute(self) -> RunStatus:
        """Run to the end; the status, or the error ``pipe.run()`` raises.  Releases the run's claim."""
        from hetflow.tasks.backends import get_backend
        from sqlalchemy.exc import SQLAlchemyError

        orchestrator, store, the_id, given = self.orchestrator, self.store, self.run_id, self.given
        script = orchestrator.script is not None
        try:
            try:
                backend_cls = get_backend(self.description.backend)
                with _sigterm_interrupts(), backend_cls(self.description, orchestrator.run_dir) as engine:
                    orchestrator.execute(engine)
            except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (scancel)
                if orchestrator.final is None:
                    orchestrator.stop(interruption(interrupt), State.INTERRUPTED)
                _report_uncaught()
                raise RunInterrupted(the_id, given, script=script, shell=self.recorded) from None
            except ResumeRefused:  # the run was left as it was (DONE)
                _report_uncaught()
                raise
            except (HetflowError, OSError, ImportError, SQLAlchemyError) as exc:
                from .orchestrator import where

                reason = where(exc)
                if isinstance(exc, SQLAlchemyError):  # a full disk under SQLite, a lost database server
                    cause = getattr(exc, "orig", None) or exc
                    reason = f"the state store {store.url} could not be written ({cause})"
                if orchestrator.final is None:
                    orchestrator.stop(reason, State.FAILED)
                _report_uncaught()
                raise RunAborted(the_id, reason, given, script=script, shell=self.recorded) from exc
            from .status import run_status  # once the run has ended: its import is not before the first task

            status = run_status(store, the_id)
            store.close()
        finally:
            _release(the_id)
        self.made.append(status)
        log.info("run %s ended %s", status.id, status.state)
        if self.check and not status.ok:
            _report_uncaught()
            status.raise_for_state(given)
        return status


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While a run executes, SIGTERM raises :class:`~hetflow.errors.Terminated` (a KeyboardInterrupt).

    ``scancel`` and the end of a Slurm job send SIGTERM, then SIGKILL after Slurm's ``KillWait``;
    without a handler the orchestrator died at once and the run showed RUNNING until its lease
    lapsed, then FAILED.  Handled as Ctrl-C is, the run's tasks are stopped and it ends INTERRUPTED,
    resumable.  A second SIGTERM while it stops is ignored (the stop is bounded).  Installed only in
    the main thread and only over Python's default action: an application's own handler is left alone.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_signature(fn: Callable[..., Any], inputs: tuple[str, ...], where: str) -> None:
    """Each rank calls the stage function as ``fn(ctx, *inputs)``: a function that cannot take that call
    is refused where it is declared, not after every stage upstream of it has run."""
    import inspect

    target = getattr(fn, "__wrapped_stage__", fn)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or an extension function: nothing to read
        return
    try:
        signature.bind("ctx", *inputs)
    except TypeError as exc:
        name = getattr(target, "__name__", type(target).__name__)
        raise PipelineError(f"{where}: {name}{signature} cannot be called as {name}({', '.join(('ctx', *inputs))}) "
                            f"({exc}): a stage function takes ctx, then one argument per input, in the order of "
                            f"inputs={list(inputs)}") from None


def _report_uncaught() -> None:
    """Let an uncaught run failure print as its one-line message, not a traceback.

    A run that did not end DONE is an outcome the status records, not a bug in the
    script, and the frames inside hetflow say nothing the message does not.  The hook
    wraps ``sys.excepthook`` only while it is Python's own (an IDE's or IPython's is
    left alone) and passes every other exception to it.  The interpreter still exits 1.
    """
    if sys.excepthook is not sys.__excepthook__:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, (RunFailed, RunAborted, RunInterrupted)):
            print(f"hetflow: {value}", file=sys.stderr)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def _script_path(stages: Mapping[str, StageSpec]) -> str | None:
    """The script ``hetflow resume`` re-executes: the one whose ``__main__`` declares the stages."""
    paths = {spec.path for spec in stages.values() if spec.module == "__main__" and spec.path}
    return str(Path(paths.pop()).resolve()) if len(paths) == 1 else None


def open_dataset(path: "str | os.PathLike[str]", *, verify: str = "checksum") -> Dataset:
    """Open a committed dataset directory, or its URI on an object store (``s3://bucket/.../name``):
    ``.to_table()`` or iterate ``.partitions()``."""
    return Dataset(path, verify=verify)  # type: ignore[arg-type]
