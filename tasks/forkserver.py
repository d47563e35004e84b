"""A warm start for one-rank stages on this machine: a fork server with the worker's imports done.

A stage started cold pays, on every rank, for a Python interpreter, the
launcher and the imports every worker needs (pyarrow, numpy, mpi4py, the
worker itself), which is most of what a short stage costs.  The local backend
therefore keeps one *fork server* per run (:data:`BOOT`, which runs
:func:`main`), started on first use in its own session: it
imports those modules once, without starting MPI and with one BLAS thread,
then forks one child per one-rank task it is asked to start.

Before it forks the first child of a stage, the server imports, once, the
installed packages that the stage's script (or module) imports at its top
(``import torch``, ``import pandas``, ``from sklearn import ...``): they are
then paid once per run and shared by every child forked after it,
copy-on-write.  The script itself is never executed in the server: each child
executes it, as a cold start does (with those imports already done), so what
the script makes at its top (an unseeded random generator, an open file, a
temporary directory, a signal handler, a started process) is each task's own,
as it would be in a fresh process.  The user's own modules are left to each
child too.  While the imports run, the server's standard streams are its log
and ``/dev/null`` (never the protocol's pipes) and it sees the environment of
a rank without GPUs.  An import that fails is left to the child, which meets
it.  An import that leaves a thread running (a forked child would get a copy
of its locks but not the thread), or a file, socket or pipe open (children
would share its offset or connection: one would read what another left), makes
the server replace itself, by ``exec`` with the same pid, pipes and children,
with one that loads no such imports.

A rank on several cores is forked as one on a single core is; the worker pins
it to its cores and sets its thread-count variables as in a cold rank, and the
libraries the server loaded with one thread (numpy's OpenBLAS, torch) are
told the rank's core count (:func:`_preloaded_threads`), as they would have
read it from those variables.  A rank with GPUs is forked only while the
server is clean (:func:`gpu_unsafe`: the CUDA driver is not loaded here, so
no import in the server initialised it; forking after that breaks the
child, forking before is fine); otherwise the server answers ``{"id",
"cold"}`` with the reason, logged once, and the backend starts the task
cold.  The worker sets the rank's visible-devices variables before any stage
code runs (the script's top included), as in a cold rank.

The child is what ``mpiexec -n 1 python -m hetflow.tasks.worker SPEC`` would
have been: the leader of a new session (so the backend's timeout, cancel and
Ctrl-C kill its process group as before), stdin from ``/dev/null``, stdout and
stderr appended to the attempt's logs, the task's working directory and
environment (less a launcher's ``PMI_*`` variables), then :func:`worker.run
<hetflow.tasks.worker.run>`: the child is the rank itself, one fork per task.
MPI starts in the rank as a singleton when the stage first reads ``ctx.comm``
(:class:`~hetflow.tasks.context.DeferredWorld`; a stage that never does never
starts it), so the stage's communicator is a real MPI communicator of size 1.  The child leaves the server's loop by returning
from it and ends as an interpreter does (threads joined, ``atexit`` handlers
run, MPI finalized, streams flushed) but without tearing down every module the
server imported, which would double what a short stage costs.

The server is the witness of its children (what :mod:`hetflow.tasks.witness`
is to a rank started by a launcher), since it is their parent anyway: when a
child ends abnormally it writes the child's ``ended-<pid>.json`` (and removes
its recorded MPICH segments) before it reports the end.  Nothing a rank starts
outlives it: each child is a subreaper, so what its descendants orphan stays
below it, and it ends every descendant before it exits; a child that dies
without doing so (a signal, ``os._exit``) leaves its descendants to the
server, itself a subreaper, which ends them (SIGTERM, SIGKILL after the
witness's grace) before it reports that child's end.  While it does, the
server forks nothing: only a rank killed while it had left something running
makes it wait.

Protocol, one JSON object per line: the backend writes ``{"id", "spec",
"cwd", "env", "stdout", "stderr", "die_with_server", "timeout", "threads", "gpus"}``; the server answers ``{"id", "pid"}``
once the child is forked (or ``{"id", "error"}``, or ``{"id", "cold"}``: start it cold) and ``{"pid", "status"}``
(the wait status, after the witness's work) when a child has ended; ``{"pid", "signal"}`` asks it to
signal the process group of a child it forked (what the backend does with ``killpg`` where it can: a
server on another node, a Slurm agent, has children whose pids mean nothing on the backend's machine),
and is ignored once that child has been reaped.  The server ends when its stdin
closes; children still running carry on, orphaned, like a launcher's ranks
when the orchestrator is gone.

The server need not run on the backend's machine: :class:`ForkServer` takes a
``launcher``, the argv that starts it elsewhere with its stdin and stdout
forwarded (the ``slurm`` backend's per-node agents: ``srun ... --overlap``,
:mod:`hetflow.tasks.backends.slurm`).  Such a server's children are signalled
through it, and each of them gets SIGKILL when the server dies
(``die_with_server``), as a rank does when its witness is killed: nobody on the
backend's machine could end it.
"""

from __future__ import annotations

import ast
import atexit
import gc
import importlib
import importlib.util
import json
import logging
import math
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from .collector import paused
from .errors import HetflowError
from .protocol import FORK_SERVER

log = logging.getLogger(__name__)

PRELOAD = ("pyarrow", "hetflow.tasks.worker", "hetflow.tasks.context", "hetflow.tasks.script",
           "hetflow.tasks.witness", "hetflow.tasks.ledger", "hetflow.operators.dataset",
           "hetflow.operators.settings", "hetflow.operators.errors", "hetflow.pipeline", "hetflow.fingerprint",
           "importlib.metadata")
"""What every rank imports anyway; the user's script and its imports are left to each child."""

LAUNCHER_ENV = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL")
"""Prefixes of variables a launcher sets for its ranks: a child must not join an enclosing launcher's job."""

SINGLETON_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "shm"}
"""A warm rank is an MPI world of one: MPICH's OFI module with libfabric's shared-memory provider only,
so its ``MPI_Init`` probes no network (the PyPI MPICH's default, UCX, does: several times slower) and
nothing listens on a network address."""

NO_PROVIDER_DIR = {"FI_PROVIDER_PATH": os.devnull}
"""With libfabric's ``shm`` provider (built into libfabric) chosen, no directory to load other providers from:
libfabric would otherwise load its dynamic ones (EFA, verbs, PSM2) and their libraries in every rank's
``MPI_Init``, to use none of them."""

BOOT = ("import importlib, sys\n"
        "if sys.path and sys.path[0] == '': del sys.path[0]\n"
        "importlib.import_module(sys.argv[1]).main()")
"""How the server is started: ``python -c BOOT hetflow.tasks.forkserver``.  Not ``python -m``, which puts
the directory the run was started in first on ``sys.path``, where a directory named ``hetflow`` (a clone
of hetflow, run from its parent) would be imported as hetflow itself, before an editable install's
finder is asked.  The server imports hetflow with no such entry; each child then imports the user's
script with hetflow already loaded, so nothing in the task's or the script's directory can replace it."""

BLAS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Set to 1 while the server imports: the BLAS loaded with numpy starts no threads before the forks (and
serves one-core stages only)."""


# ------------------------------------------------------------------ server
@dataclass(frozen=True)
class Job:
    """One child's task, as the backend asked for it."""

    id: int
    spec: str
    cwd: str
    env: Mapping[str, str]
    stdout: str | None
    stderr: str | None
    die_with_server: bool = False
    """The child gets SIGKILL when the server dies (a remote server's: nobody else would end it)."""
    timeout: float | None = None
    """The stage's timeout (seconds): the longest the server spends importing the stage's packages before it
    forks the task (:func:`_preload_stage`); ``None``: no bound, as a cold rank has none."""
    threads: int = 1
    """The rank's core count: the thread count of the libraries the server loaded (:func:`_preloaded_threads`)."""
    gpus: bool = False
    """The rank has GPUs: forked only while no GPU runtime is initialised here (:func:`gpu_unsafe`)."""

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Job:
        timeout = data.get("timeout")
        if timeout is not None:
            timeout = float(timeout)
            if not math.isfinite(timeout) or timeout <= 0:
                raise ValueError(f"timeout {timeout!r}: expected a positive number of seconds")
        threads = int(data.get("threads", 1))
        if threads < 1:
            raise ValueError(f"threads {threads!r}: expected a positive number of cores")
        return cls(id=int(data["id"]), spec=str(data["spec"]), cwd=str(data["cwd"]),
                   env={str(k): str(v) for k, v in data["env"].items()},
                   stdout=data.get("stdout"), stderr=data.get("stderr"),
                   die_with_server=bool(data.get("die_with_server", False)), timeout=timeout,
                   threads=threads, gpus=bool(data.get("gpus", False)))


def _reply(message: Mapping[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


_tasks: dict[int, str] = {}
"""The children this server forked for tasks (their ranks), by pid: each one's attempt directory."""


def _reap() -> None:
    """Report every task child that has ended, as its witness would (:func:`_witness`).  A child that is not a
    task is one of the orphans :func:`_end_orphans` ends: nothing to report."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        attempt_dir = _tasks.pop(pid, None)
        if attempt_dir is not None:
            ended.append((pid, status, attempt_dir))
    if ended:
        _witness(ended)


def _witness(ended: list[tuple[int, int, str]]) -> None:
    """What a rank's witness does (:mod:`hetflow.tasks.witness`), here for task children that have ended
    (``(pid, wait status, attempt directory)``): an abnormal end is recorded in its attempt directory (and
    its MPICH segments removed), what they left behind is ended (once for all of them: the children of
    this process are read once), and only then is each one's wait status reported."""
    from . import warmranks

    for pid, status, attempt_dir in ended:
        if status != 0:
            from hetflow.tasks import shm
            from hetflow.tasks.protocol import AttemptFiles
            from hetflow.tasks.witness import record_end

            if not warmranks.ended_by_launcher(pid):
                record_end(Path(attempt_dir), pid, status)
            shm.remove_recorded(AttemptFiles(Path(attempt_dir)).shm_segments(pid))
    _end_orphans()
    for pid, status, _ in ended:
        if not warmranks.ended(pid, status):  # a warm rank's end goes to its stub
            _reply({"pid": pid, "status": status})


def _signal_task(pid: int, sig: int) -> None:
    """Signal the process group of task child ``pid`` (the session it leads), if it has not been reaped: a
    reaped child's pid (and group id) may be another process's by now."""
    if pid not in _tasks:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _end_orphans() -> None:
    """End every child of this server that is not a task, with what it started: SIGTERM, SIGKILL after the
    witness's grace; return when none is left.

    Each task child is a subreaper (:func:`_become_task`): while it runs, what its descendants orphan
    becomes its own child, and it ends them all before it exits (:func:`_exit`).  So a child of this
    server that is not a task was orphaned by a task child that died without doing so (a signal,
    ``os._exit``), and belongs to a task that has ended."""
    from hetflow.tasks.witness import KILL_GRACE

    orphans = _orphans()
    if not orphans:
        return
    from hetflow.tasks.proctree import descendants

    deadline = time.monotonic() + KILL_GRACE
    termed: set[int] = set()
    while orphans:
        late = time.monotonic() >= deadline
        for pid in [p for orphan in orphans for p in (orphan, *descendants(orphan))]:
            if late or pid not in termed:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                    if not late:
                        os.kill(pid, signal.SIGCONT)  # a stopped process must run to see SIGTERM
                except ProcessLookupError:
                    pass
                termed.add(pid)
        for pid in orphans:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.005)
        orphans = _orphans()  # what an ended orphan started is ours now


def _orphans() -> list[int]:
    """This server's children that are not tasks (zombies included, until they are reaped)."""
    from hetflow.tasks.proctree import children

    return [pid for pid in children(os.getpid()) if pid not in _tasks]


NO_SCRIPTS = "--no-scripts"
"""The server's argument after an import left threads running: it loads no script's imports any more."""

_scripts: dict[tuple[str, str | None], bool] = {}
"""The scripts and modules whose imports this server loaded, by (module, path)."""


def _threads() -> int:
    """Threads of this process, native ones included (what a fork does not carry over).

    pyarrow starts its own when it is imported, before any fork: they hold no lock of ours, and forking
    with them is what every warm start has done; a script's threads are counted on top of them."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _shared_files() -> set[tuple[int, int, int]]:
    """This process's descriptors that a forked child would share with the server and its other children:
    regular files (one file offset for all), sockets and pipes (one connection, one stream), each as
    ``(fd, device, inode)``.  Terminals, character devices (``/dev/null``, ``/dev/urandom``) and
    directories carry no state a child could take from another."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            info = os.fstat(int(name))
        except (OSError, ValueError):
            continue  # the listing's own descriptor, closed by now
        if stat.S_ISREG(info.st_mode) or stat.S_ISSOCK(info.st_mode) or stat.S_ISFIFO(info.st_mode):
            found.add((int(name), info.st_dev, info.st_ino))
    return found


def installed_imports(source: bytes) -> list[str]:
    """The modules a script (or module) imports at its top level (``import a.b``, ``from a.b import c``,
    also inside ``if``/``try``/``with`` blocks) that are installed packages (in a ``site-packages``
    directory) or the standard library: not the user's own modules (beside the script, or installed
    editable from their source tree), which are left to each task."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, ()):
                    todo += child.body if isinstance(child, ast.ExceptHandler) else [child]
    found = []
    for name in dict.fromkeys(names):
        top = name.partition(".")[0]
        if top in sys.modules and name in sys.modules:
            continue
        if top not in sys.stdlib_module_names:
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                continue
            origin = spec.origin if spec is not None else None
            if origin is None or not ("site-packages" in origin or "dist-packages" in origin):
                continue
        found.append(name)
    return found


def _preload_stage(job: Job) -> bool:
    """Import here, once, the installed packages that the script (or module) of ``job``'s stage imports
    at its top, so every task forked after shares them; False when the server must not fork any more
    (an import left threads running, or was stopped halfway by the stage's timeout).  The script itself is never executed here (each task executes it,
    as a cold start would: what it creates at its top, an RNG, an open file, a temporary directory, a
    signal handler, is each task's own); an import that fails is left to the task, which meets it."""
    from hetflow.tasks.gpu import GPU_VENDORS, VISIBLE_DEVICES
    from hetflow.tasks.protocol import ProtocolError, WorkerSpec

    try:
        spec = WorkerSpec.read(Path(job.spec))
    except ProtocolError:
        return True  # the child reports it
    global _clean
    key = (spec.function.module, spec.function.path)
    if key in _scripts:
        return True
    _scripts[key] = False
    _clean = False  # what these imports do is checked again before the next GPU fork
    path = spec.function.path
    if spec.function.module != "__main__":
        try:
            found = importlib.util.find_spec(spec.function.module)
        except (ImportError, ValueError):
            found = None
        path = found.origin if found is not None else None
    try:
        source = Path(path).read_bytes() if path else b""
    except OSError:
        source = b""
    if spec.function.module == "__main__" and path and source:
        from hetflow.tasks.script import prepare

        prepare(path, source)  # parsed and compiled once here, executed by each task
    before = _threads()  # pyarrow's own (its allocator's): there before the server forked anything
    files_before = _shared_files()
    saved_env, saved_fds = dict(os.environ), (os.dup(0), os.dup(1))
    for vendor in GPU_VENDORS:  # as a rank without GPUs sees it: nothing initialises a GPU before a fork
        os.environ.update({name: "" for name in VISIBLE_DEVICES[vendor]})
    os.environ.update({name: "1" for name in BLAS_ENV})
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    os.dup2(null, 0)
    os.dup2(2, 1)  # what an import prints goes to the server's log, never into the protocol's pipe
    os.close(null)
    here = os.getcwd()
    observed = _observing(spec.function.module == "__main__" and bool(path))
    try:
        os.chdir(job.cwd)  # where the task runs, as a cold start imports them: a ./matplotlibrc is the task's
    except OSError:
        pass
    timed_out = False
    loaded = set(sys.modules)
    try:
        try:
            with _exit_handlers_recorded(), _bounded(job.timeout), paused(freeze=True):
                for name in installed_imports(source):
                    try:
                        importlib.import_module(name)
                    except _PreloadTimeout:
                        raise
                    except BaseException as exc:  # noqa: BLE001 - the task's own import meets it again
                        print(f"hetflow fork server: {name} (imported by {path}) not loaded before forking "
                              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        except _PreloadTimeout:  # an import stopped halfway leaves its parts in sys.modules: not forked from
            timed_out = True
            print(f"hetflow fork server: the imports of {path or spec.function.module} took longer than the "
                  f"stage's timeout of {job.timeout:g}s; stopped, the server restarts without loading them "
                  "and each task imports them itself", file=sys.stderr)
        _scripts[key] = True
        global mpi_held
        mpi_held = mpi_held or _hold_mpi(set(sys.modules) - loaded)
    finally:
        if observed is not None:
            observed.keep_preloaded()  # what they read at import, each rank's top level's own (hetflow.observed)
        os.chdir(here)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 0)
        os.dup2(saved_fds[1], 1)
        os.close(saved_fds[0])
        os.close(saved_fds[1])
        os.environ.clear()
        os.environ.update(saved_env)
    if timed_out:
        return False
    threads = _threads() - before
    if threads > 0:
        print(f"hetflow fork server: the imports of {path or spec.function.module} left {threads} thread(s) "
              "running; forking from it is not safe, the server restarts without loading them", file=sys.stderr)
        return False
    opened = sorted(fd for fd, *_ in _shared_files() - files_before)
    if opened:
        print(f"hetflow fork server: the imports of {path or spec.function.module} left {len(opened)} file(s), "
              f"socket(s) or pipe(s) open (descriptors {', '.join(map(str, opened))}); forked tasks would share "
              "their offsets and connections, the server restarts without loading them", file=sys.stderr)
        return False
    return True


mpi_held = False
"""A package this server imported for a script holds ``mpi4py.MPI`` or one of its objects (``from mpi4py import
MPI`` and ``COMM = MPI.COMM_WORLD`` at its top): its functions call MPI through what they hold, not through the
module a rank that defers MPI puts in its place (:func:`hetflow.tasks.worker._start_on_first_use`), so every
rank forked from here starts MPI before its stage, as a cold rank has it started (a package without a version
is not in the key, which :attr:`~hetflow.tasks.protocol.WorkerSpec.mpi_named` reads)."""


def _hold_mpi(names: Iterable[str]) -> bool:
    """Whether a module of ``names`` (not mpi4py's or hetflow's own) holds ``mpi4py.MPI`` or an object of it, at
    its top or in a class attribute of a class there."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False

    def of_mpi(value: Any) -> bool:
        return value is mpi or getattr(type(value), "__module__", None) == "mpi4py.MPI"

    for name in names:
        module = sys.modules.get(name)
        if name.partition(".")[0] in ("mpi4py", "hetflow") or not isinstance(module, types.ModuleType):
            continue
        for value in list(vars(module).values()):
            if of_mpi(value) or (isinstance(value, type) and value.__module__ == name
                                 and any(of_mpi(v) for v in list(vars(value).values()))):
                return True
    return False


class _PreloadTimeout(BaseException):
    """The stage's imports outlasted its timeout in the server (raised by SIGALRM, see :func:`_bounded`)."""


@contextmanager
def _bounded(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_PreloadTimeout` in the block once ``seconds`` have passed (no bound when ``None``).

    Decision: an import that blocks (a lock, a network file system, a package that waits at import) must
    not hold the server: while it imports, it forks nothing and reports no child's end, and the backend's
    timeout only starts counting once the task is forked.  Bounded by the stage's timeout, the server
    gives up and forks the task, which imports the package itself, as a cold rank would, and is timed
    out as a cold rank would be (the backend counts the timeout from its request).  The import stopped
    halfway leaves the modules it had loaded (a C extension set up once per process: ``torch._C``) in
    ``sys.modules``, where every later task's own import of the package would meet them and fail, so the
    server then replaces itself by one that loads no script's imports (:func:`_restart`)."""
    if seconds is None:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _PreloadTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_preloaded_exits: list[Callable[..., Any]] = []
"""The ``atexit`` handlers the stages' imports registered in the server (:func:`_exit_handlers_recorded`)."""

_preloaded_finalizers: list[weakref.finalize] = []  # type: ignore[type-arg]
"""The ``weakref.finalize`` objects the stages' imports made in the server (run at exit unless told)."""

_recording_exits = False


@contextmanager
def _exit_handlers_recorded() -> Iterator[None]:
    """Record the ``atexit`` handlers and exit-time finalizers the imports in the block register.

    Decision: what a package registers to run at exit when it is imported is about what that import made
    in the server (a temporary directory it created, a cache file): one copy, shared by every task forked
    after.  It runs once, when the server ends, and never in a task (:func:`_forget_preloaded_exits`): a
    task running it would remove, at its end, what every later task still uses (matplotlib's temporary
    config directory, made when ``$HOME`` is read-only, is one).  A cold rank runs it once for what its
    own import made; what a task registers itself runs at its end as before."""
    global _recording_exits
    real = atexit.register

    def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if _recording_exits:
            _preloaded_exits.append(func)
        return real(func, *args, **kwargs)

    before = set(weakref.finalize._registry)  # type: ignore[attr-defined]
    atexit.register = register  # type: ignore[assignment]
    _recording_exits = True
    try:
        yield
    finally:
        _recording_exits = False
        atexit.register = real  # type: ignore[assignment]
        _preloaded_finalizers.extend(f for f in list(weakref.finalize._registry)  # type: ignore[attr-defined]
                                     if f not in before)


def _forget_preloaded_exits() -> None:
    """In a task: the server's exit handlers and finalizers from the stages' imports are not the task's."""
    for func in _preloaded_exits:
        atexit.unregister(func)
    for finalizer in _preloaded_finalizers:
        finalizer.atexit = False


def _observing(script: bool) -> Any:
    """:mod:`hetflow.observed`, recording the files and folders the imports about to run read, when the stage
    is a script's (its ranks record what their top level read); else None."""
    if not script:
        return None
    from hetflow import observed  # the rank's own observations: the worker imports it too

    observed.install()
    observed.recording(True)
    return observed


def _restart(pending: bytes) -> NoReturn:
    """Replace this process by a server that loads no script's imports: same pid, pipes and children;
    ``pending`` (requests read but not served yet) and the running tasks are handed to it."""
    from . import warmranks

    warmranks.before_restart()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-c", BOOT, FORK_SERVER, NO_SCRIPTS, pending.hex(),
                              json.dumps(_tasks)])


def serve(preload: bool = True, pending: bytes = b"") -> Job | None:
    """The server's loop; returns ``None`` when its stdin closes, and in each forked child, that child's job.

    ``preload``: load each stage's installed imports before forking its first child (:func:`_preload_stage`).
    ``pending``: requests already read (from the server this one replaced)."""
    from . import warmranks

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the select
    warmranks.restore()  # the warm ranks of the server this one replaced
    _reap()  # children that ended while the server was being replaced
    first = bool(pending)
    ready: list[int] = []
    try:
        while True:
            if first:
                first = False  # serve what the replaced server had read before waiting for more
            else:
                ready, _, _ = select.select([0, wake_r, *warmranks.fds()], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap()
            if 0 in ready:
                data = os.read(0, 1 << 16)
                if not data:
                    _reap()
                    return None
                pending += data
            for rank in warmranks.ready(ready):  # the stubs of warm multi-rank tasks
                if _fork(rank, wake_r, wake_w):
                    return rank
            while b"\n" in pending:
                line, rest = pending.split(b"\n", 1)
                if line.startswith(b'{"log":'):  # an early server, adopted by a run: its log from now on
                    pending = rest
                    _log_to(line)
                    continue
                try:
                    data = json.loads(line)
                    if "signal" in data:
                        pending = rest
                        _signal_task(int(data["pid"]), int(data["signal"]))
                        continue
                    if "forget" in data:  # a warm multi-rank task's mpiexec has ended
                        pending = rest
                        answer = warmranks.forget(str(data["forget"]), data.get("id"))
                        if answer is not None:
                            _reply(answer)
                        continue
                    job = Job.from_data(data)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    pending = rest
                    _reply({"id": None, "error": f"bad request: {exc}"})
                    continue
                if preload and not _preload_stage(job):
                    signal.set_wakeup_fd(-1)
                    _restart(pending)  # this request is served by the new server
                pending = rest
                if "ranks" in data:  # a warm multi-rank task: its stubs will connect (hetflow.tasks.warmranks)
                    _reply(warmranks.register(job, data))
                    continue
                unsafe = _gpu_fork_refused() if job.gpus else None
                if unsafe is not None:
                    _refuse_gpus(job, unsafe)
                    continue
                if _fork(job, wake_r, wake_w):
                    return job
    finally:
        if os.getpid() == _server_pid:
            signal.set_wakeup_fd(-1)


def _fork(job: Job, wake_r: int, wake_w: int) -> bool:
    """Fork ``job``'s child; True in the child.  The server learns the child's pid as its witness, and the
    one who asked (the backend, or a warm rank's stub) is told it, or why it failed."""
    from hetflow import observed

    from . import warmranks

    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered here may be written again by a child
    observed.mark_imported()  # the child's observations walk only the modules it imports itself
    try:
        pid = os.fork()
    except OSError as exc:
        if isinstance(job, warmranks.RankJob):
            warmranks.fork_failed(job, f"fork failed: {exc}")
        else:
            _reply({"id": job.id, "error": f"fork failed: {exc}"})
        return False
    if pid == 0:
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
        _tasks.clear()
        warmranks.in_child(job)
        return True
    _tasks[pid] = str(Path(job.spec).parent)  # the worker's attempt directory
    if isinstance(job, warmranks.RankJob):
        warmranks.forked(job, pid)
    else:
        _reply({"id": job.id, "pid": pid})
    return False


GPU_DRIVER_LIBRARIES = ("libcuda.so",)
"""Basenames (prefixes) of GPU driver libraries, loaded into a process when its GPU runtime initialises (the CUDA
runtime, ``libcudart``, opens ``libcuda`` on its first call).  Were ``import torch`` to load it already, every GPU
rank would start cold: safe, and scripts/gpu_check_warm.py, run on a GPU machine, says so."""

GPU_DEVICE_FILES = ("/dev/nvidia",)
"""Prefixes of the device files a process initialising the NVIDIA driver opens and maps."""


def gpu_unsafe() -> str | None:
    """Why a rank with GPUs must not be forked from this process now, or ``None`` when it is clean: no GPU
    driver library is mapped and no GPU device file is open or mapped (:data:`GPU_DRIVER_LIBRARIES`,
    :data:`GPU_DEVICE_FILES`).

    Decision: a child forked after its parent initialised CUDA cannot use CUDA (the driver's state is not
    carried over a fork; PyTorch refuses, "Cannot re-initialize CUDA in forked subprocess"), while a child
    forked before can.  The server imports with no device visible, but an installed import may still
    initialise the driver (asking for devices, or loading a library that does).  Unreadable ``/proc``: unsafe.
    The server asks before each GPU fork (:func:`_gpu_fork_refused`)."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith(GPU_DRIVER_LIBRARIES):
                    return f"the GPU driver library {path} is loaded in the fork server"
                if path.startswith(GPU_DEVICE_FILES):
                    return f"the GPU device {path} is mapped in the fork server"
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(GPU_DEVICE_FILES):
                return f"the GPU device {target} is open in the fork server"
    except OSError as exc:
        return f"cannot tell whether a GPU runtime is initialised in the fork server ({exc})"
    return None


_clean = False
"""The server was found clean (:func:`gpu_unsafe`) and has run no other code than its own since: the stages'
imports are the only code it runs that is not hetflow's, and each new one clears this (:func:`_preload_stage`)."""


def _gpu_fork_refused() -> str | None:
    """:func:`gpu_unsafe`, read again only after the server imported something since it last found itself
    clean (reading ``/proc/self/maps`` costs milliseconds, a warm start's own order of cost)."""
    global _clean
    if _clean:
        return None
    reason = gpu_unsafe()
    _clean = reason is None
    return reason


_refused: set[str] = set()
"""The reasons this server gave for starting a GPU rank cold (each is logged once)."""


def _refuse_gpus(job: Job, reason: str) -> None:
    """Answer ``job`` (a rank with GPUs) with "start it cold", and say why in the server's log, once."""
    if reason not in _refused:
        _refused.add(reason)
        print(f"hetflow fork server: a stage with GPUs starts cold: {reason}, and forking after a GPU runtime "
              "is initialised breaks the child; every later stage with GPUs of this run starts cold too",
              file=sys.stderr, flush=True)
    _reply({"id": job.id, "cold": reason})


def _preloaded_threads(count: int) -> None:
    """In a task on ``count`` cores: the libraries the server loaded with one thread (:data:`BLAS_ENV`),
    numpy's OpenBLAS and torch's intra-op pool, use ``count`` threads, as a cold rank's read it from the
    variables its worker sets (``OMP_NUM_THREADS`` and the like: the rank's core count)."""
    if count <= 1:
        return  # what they were loaded with
    torch = sys.modules.get("torch")
    if torch is not None and callable(getattr(torch, "set_num_threads", None)):
        torch.set_num_threads(count)
    if "numpy" not in sys.modules:
        return
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = {p for line in fh if len(parts := line.split(None, 5)) == 6
                     and "openblas" in os.path.basename(p := parts[5].strip()).lower()}
    except OSError:
        return
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # loaded already: its handle, nothing runs again
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(library, name, None)
            if setter is not None:
                setter(ctypes.c_int(count))
                break


def _log_to(line: bytes) -> None:
    """Write the server's own messages (its stderr) to the file a ``{"log": path}`` request names."""
    try:
        fd = _open_log(str(json.loads(line)["log"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"hetflow fork server: its log stays here: {exc}", file=sys.stderr)
        return
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


def _open_log(path: str | None) -> int:
    if path is None:
        return os.open(os.devnull, os.O_WRONLY)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def _become_task(job: Job) -> None:
    """In the child: take the task's session, files, directory and environment, as a launcher would."""
    os.setsid()
    from hetflow.tasks.witness import _die_with, become_subreaper

    become_subreaper()  # what its descendants orphan stays below it, for _exit to end
    if job.die_with_server:
        _die_with(_server_pid)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.unfreeze()  # what the server froze is collected (and listed by gc) in the task as in a cold start
    _forget_preloaded_exits()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, path in ((1, job.stdout), (2, job.stderr)):
        fd = _open_log(path)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    for name, value in SINGLETON_ENV.items():  # unless the user chose a transport for their MPI
        os.environ.setdefault(name, value)
    if os.environ.get("FI_PROVIDER") == "shm":
        for name, value in NO_PROVIDER_DIR.items():
            os.environ.setdefault(name, value)
    _fresh_random_state()
    _preloaded_threads(job.threads)
    from hetflow.tasks import worker

    sys.argv = [str(worker.__file__), job.spec]
    sys.path.insert(0, job.cwd)  # as for python -m, started in the task's directory


def _fresh_random_state() -> None:
    """Seed the global generators of numpy and torch, if the server loaded them, from fresh entropy, as a
    new process's are: every child would otherwise draw the numbers the server's state would give
    (Python's ``random`` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and callable(getattr(torch, "seed", None)):
        torch.seed()


def _preload() -> None:
    saved = {name: os.environ.get(name) for name in BLAS_ENV}
    os.environ.update({name: "1" for name in BLAS_ENV})
    with paused(freeze=True):  # kept for the server's life: no collection walks it (hetflow.tasks.collector)
        import mpi4py

        mpi4py.rc.initialize = mpi4py.rc.finalize = False  # each rank starts (and ends) its own MPI
        from mpi4py import MPI  # noqa: F401 - the library loaded, not started

        for name in PRELOAD:
            importlib.import_module(name)
        if importlib.util.find_spec("pandas") is not None:
            importlib.import_module("pandas")  # pyarrow loads it for pa.table(dict) and to_pandas(): once, here
            importlib.import_module("pyarrow.pandas_compat")  # and these, on the first table it makes
            importlib.import_module("pyarrow.vendored.version")
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


_server_pid = 0


def main(argv: list[str] | None = None) -> NoReturn:
    """The server; in each forked child, the task's rank, which comes back here to end."""
    global _server_pid
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == FORK_SERVER:  # started by BOOT: the module's name comes first
        args = args[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle
    _preload()
    _server_pid = os.getpid()
    from hetflow.tasks.witness import become_subreaper

    become_subreaper()  # a task child that dies leaves its orphans to this server (_end_orphans)
    scripts = not (args and args[0] == NO_SCRIPTS)
    if not scripts and len(args) > 2:  # the tasks of the server this one replaced
        _tasks.update({int(pid): str(attempt) for pid, attempt in json.loads(args[2]).items()})
    job = serve(preload=scripts, pending=b"" if scripts else bytes.fromhex(args[1] if len(args) > 1 else ""))
    if job is None:  # the backend is done: nothing here needs tearing down
        _exit(0)
    _become_task(job)
    from hetflow.tasks import worker

    from . import warmranks

    launched = False
    if isinstance(job, warmranks.RankJob):  # one rank of a warm multi-rank task, started by its stub
        warmranks.become_rank(job)
        launched = True
    # the rank itself: this server is its witness
    _exit(worker.run(job.spec, launched=launched, mpi_held=mpi_held), task=True)


def _exit(code: int, task: bool = False) -> NoReturn:
    """End a child as the interpreter would, less the teardown of every module the server imported.

    Non-daemon threads are waited for, ``atexit`` handlers run (MPI is finalized) and the standard
    streams are flushed, as at a normal exit; objects still alive are not finalized one by one.  A
    ``task`` (a rank) then ends every descendant still there, as its witness would, so nothing it
    started outlives it.
    """
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if task:
            from hetflow.tasks.witness import end_descendants

            end_descendants()
        os._exit(code)


# ------------------------------------------------------------------ client
class ForkedTask:
    """A child of the fork server, waited on like a :class:`subprocess.Popen` (``pid``, ``wait``, ``returncode``).

    ``pid`` is the child's pid where the server runs; ``remote``: that is not this machine (signal it with
    :meth:`signal_group`, never by its pid)."""

    def __init__(self, pid: int, argv: list[str], server: ForkServer | None = None) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._server = server

    @property
    def remote(self) -> bool:
        return self._server is not None and self._server.remote

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group: by ``killpg`` here, through its server elsewhere."""
        if self.remote:
            assert self._server is not None
            self._server.signal(self.pid, sig)
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _set(self, status: int | None) -> None:
        if status is None:
            self.returncode = -signal.SIGKILL
        elif os.WIFSIGNALED(status):
            self.returncode = -os.WTERMSIG(status)
        else:
            self.returncode = os.WEXITSTATUS(status)
        self._ended.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class ForkServer:
    """The backend's side: starts the server, asks it for children, and hands out their ends.

    If the server dies, its running children are killed (nobody could report
    how they ended) and :meth:`start_task` raises :class:`ForkServerGone`.

    ``launcher``: the argv that starts the server elsewhere (another node), its stdin and stdout forwarded,
    with ``env`` as its environment.  Its children are then *remote*: signalled through the server, never
    by their pids (not this machine's), and each one gets SIGKILL when the server dies; when the server is
    gone they are reported ended (killed).
    """

    def __init__(self, log_path: Path | None, launcher: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, *, inherit_stderr: bool = False) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._running: dict[int, ForkedTask] = {}
        self._closing = False
        self.alive = True
        self.remote = bool(launcher)
        stderr: int | None = None if inherit_stderr else subprocess.DEVNULL
        if log_path is not None:
            stderr = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._proc = subprocess.Popen([*launcher, sys.executable, "-c", BOOT, FORK_SERVER],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                          env=None if env is None else dict(env), start_new_session=True)
        finally:
            if stderr is not None and stderr != subprocess.DEVNULL:
                os.close(stderr)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin = self._proc.stdin
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), name="hetflow-forkserver",
                                        daemon=True)
        self._reader.start()

    def log_to(self, path: Path) -> bool:
        """Have the server write its own messages to ``path`` from now on (an early server, adopted by a run
        whose directory did not exist when it started); False when it has ended."""
        with self._lock:
            if not self.alive:
                return False
            try:
                self._stdin.write((json.dumps({"log": str(path)}) + "\n").encode())
                self._stdin.flush()
            except (OSError, ValueError):
                return False
        return True

    def start_task(self, spec: str, cwd: Path, env: Mapping[str, str], stdout: Path | None,
                   stderr: Path | None, timeout: float | None = None, *, threads: int = 1,
                   gpus: bool = False) -> ForkedTask:
        """Fork a child running the worker on ``spec``; returns once it runs.  ``timeout``: the stage's, the
        longest the server may spend importing the stage's packages first (:func:`_bounded`); ``threads``:
        the rank's core count; ``gpus``: it has GPUs, and :class:`ColdStart` is raised when the server
        cannot fork it safely (:func:`gpu_unsafe`)."""
        clean = {k: v for k, v in env.items() if not k.startswith(LAUNCHER_ENV)}
        answer = self._ask({"spec": spec, "cwd": str(cwd), "env": clean,
                            "stdout": None if stdout is None else str(stdout),
                            "stderr": None if stderr is None else str(stderr),
                            "die_with_server": self.remote, "timeout": timeout, "threads": threads, "gpus": gpus},
                           local=False)
        if isinstance(answer, ColdStart):
            raise answer
        if not isinstance(answer, ForkedTask):
            raise ForkServerGone(str(answer))
        return answer

    def _ask(self, message: dict[str, Any], *, local: bool) -> Any:
        """Send ``message`` with a new id and wait for the server's answer to it; ``local``: only a server on
        this machine may take it.  Raises :class:`ForkServerGone` when it has ended."""
        event = threading.Event()
        answer: list[Any] = []
        with self._lock:
            if not self.alive or (local and self.remote):
                raise ForkServerGone("the fork server has ended" if not self.alive else "no fork server on this machine")
            self._next += 1
            ident = self._next
            self._waiting[ident] = (event, answer)
            try:
                self._stdin.write((json.dumps({"id": ident, **message}) + "\n").encode())
                self._stdin.flush()
            except (OSError, ValueError) as exc:
                self._waiting.pop(ident, None)
                raise ForkServerGone(f"the fork server has ended ({exc})") from None
        event.wait()
        return answer[0]

    def register_ranks(self, spec: str, cwd: Path, ranks: int, timeout: float | None = None) -> tuple[str, str]:
        """Have the server take the ``ranks`` stubs of a warm multi-rank task (:mod:`hetflow.tasks.warmranks`),
        its stage's packages imported first; returns its socket's path and the task's token.  Raises
        :class:`ForkServerGone` when it cannot (the caller starts the task cold)."""
        answer = self._ask({"spec": spec, "cwd": str(cwd), "env": {}, "ranks": ranks, "timeout": timeout},
                           local=True)
        if not isinstance(answer, tuple):
            raise ForkServerGone(str(answer))
        return answer

    def forget_ranks(self, token: str, timeout: float = 30.0) -> bool:
        """The ``mpiexec`` of the warm multi-rank task of ``token`` has ended: no stub may use the token any
        more; returns once the server has reaped its ranks (killing any still running) and ended what they
        left behind, False if it did not answer within ``timeout`` seconds."""
        event = threading.Event()
        answer: list[Any] = []
        with self._lock:
            if not self.alive:
                return True  # its children died with it
            self._next += 1
            ident = self._next
            self._waiting[ident] = (event, answer)
            try:
                self._stdin.write((json.dumps({"id": ident, "forget": token}) + "\n").encode())
                self._stdin.flush()
            except (OSError, ValueError):
                self._waiting.pop(ident, None)
                return True
        return event.wait(timeout)

    def _read(self, stream: IO[bytes]) -> None:
        """Replies, in the server's order: a child's pid always comes before its end."""
        for raw in stream:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            ended: tuple[ForkedTask, int] | None = None
            with self._lock:
                if "status" in message:
                    task = self._running.pop(int(message["pid"]), None)
                    if task is not None:
                        ended = task, int(message["status"])
                elif (waiter := self._waiting.pop(message.get("id"), None)) is not None:
                    if "pid" in message:
                        task = self._running[int(message["pid"])] = ForkedTask(int(message["pid"]), [],
                                                                                        self)
                        waiter[1].append(task)
                    elif "socket" in message:  # a warm multi-rank task's registration
                        waiter[1].append((str(message["socket"]), str(message["token"])))
                    elif "forgotten" in message:  # and its ranks are gone
                        waiter[1].append(True)
                    elif "cold" in message:
                        waiter[1].append(ColdStart(str(message["cold"])))
                    else:
                        waiter[1].append(message.get("error", "the fork server failed"))
                    waiter[0].set()
            if ended is not None:
                ended[0]._set(ended[1])
        self._lost()

    def _lost(self) -> None:
        """The server is gone: nobody will report how its children end, so end them now."""
        with self._lock:
            self.alive = False
            running = list(self._running.values())
            self._running.clear()
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for event, answer in waiting:
            answer.append("the fork server has ended")
            event.set()
        for task in running:
            if not self.remote:
                try:
                    os.killpg(task.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            task._set(None)
        if running and not self._closing:
            log.error("hetflow's fork server ended while %d tasks ran; they were %s", len(running),
                      "lost with it" if self.remote else "killed")

    def signal(self, pid: int, sig: int) -> None:
        """Ask the server to send ``sig`` to the process group of its child ``pid``; nothing once it is gone."""
        line = json.dumps({"pid": pid, "signal": int(sig)}) + "\n"
        with self._lock:
            if not self.alive:
                return
            try:
                self._stdin.write(line.encode())
                self._stdin.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """End the server (its stdin closes) and any child still running."""
        self._closing = True
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self._wait_exit(10.0)
        except subprocess.TimeoutExpired:
            self._proc.terminate()  # a launcher (srun) ends what it started on SIGTERM
            try:
                self._proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=10.0)

    def _wait_exit(self, timeout: float) -> None:
        """Wait for the server's process to end, at most ``timeout`` seconds (:class:`subprocess.TimeoutExpired`).

        Decision: woken by the process's end (its pidfd, Linux), not by polling: ``Popen.wait`` with a timeout
        sleeps in growing steps of up to 50 ms between looks, and every run waited for the next look at its end
        while the server's address space was torn down.  Without pidfds, that polling wait."""
        if self._proc.poll() is not None:
            return
        try:
            pidfd = os.pidfd_open(self._proc.pid)  # not reaped yet (poll above): the pid is still this process's
        except (AttributeError, OSError):
            self._proc.wait(timeout=timeout)
            return
        try:
            if not select.select([pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self._proc.args, timeout)
        finally:
            os.close(pidfd)
        self._proc.wait()  # it has ended: reaped at once


class ForkServerGone(HetflowError, RuntimeError):
    """The fork server cannot start a task (it has ended); the caller starts the task cold."""


class ColdStart(HetflowError, RuntimeError):
    """The fork server will not start this task (a rank with GPUs, and a GPU runtime is initialised in the
    server: :func:`gpu_unsafe`); the caller starts it cold.  The server goes on serving others."""


_early: dict[str, ForkServer] = {}
_early_lock = threading.Lock()


def start_early(key: str = "", launcher: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
    """Start a fork server now, for this process's next run to adopt (:func:`adopt_early`).

    Decision: a blocking ``pipe.run()`` on the local backend starts its server before it imports the
    orchestrator and opens the store, so the server's own imports (pyarrow, pandas, MPI's library) are
    done on the other core meanwhile instead of after, ahead of the run's first task.  The slurm backend's
    agents start the same way, one per node (``key``: the node, ``launcher``: its ``srun``, ``env``: the
    agent's environment), their imports on their nodes while this process imports.  Until a run adopts
    it, what a server writes goes to this process's stderr (it writes nothing unless it fails); the
    caller discards it (:func:`discard_early`) if no run has taken it by the end of ``run()``."""
    with _early_lock:
        if key not in _early:
            _early[key] = ForkServer(None, launcher=launcher, env=env, inherit_stderr=True)


def adopt_early(log_path: Path, key: str = "") -> ForkServer | None:
    """The server :func:`start_early` started for ``key``, its messages now going to ``log_path``; None if
    there is none."""
    with _early_lock:
        server = _early.pop(key, None)
    if server is not None and not server.log_to(log_path):
        server.close()
        return None
    return server


def discard_early() -> None:
    """End the early servers that no run adopted."""
    with _early_lock:
        servers = list(_early.values())
        _early.clear()
    for server in servers:
        server.close()


if __name__ == "__main__":
    main()
