"""What a stage's rank could depend on that its key does not name, observed where it ran.

The key (:mod:`hetflow.fingerprint`) is made in the orchestrator from what it
can follow statically.  What escapes that walk is observed instead, as the
script's top level left it, in the orchestrator (when ``pipe.run()`` starts:
:func:`take`; the states where the top level ends: :func:`watch_top_end`) and in
each rank (after its top level ran, and the modules again after the stage
returned: :func:`in_rank`, :func:`code_in_rank`):

* ``code NAME`` (rank only): the stage's code fingerprint made again in the
  rank (:func:`code_in_rank`), so the values the stage reads as its own top level
  computed them.  One that differs from the key's (``TABLE = pq.read_table(...)``
  whose file was edited while the stage waited: native readers open no Python
  file; or a value each process computes anew, the time) means the key does not
  say what the result was computed from: it is recorded as ``value NAME`` and the
  commit is never served (a refusal would fail every run of a stage reading the
  time).
* ``filled NAME`` (rank only, a stage shipped from a session): a module's
  container the key names (``mylib._CACHE``), digested again after the stage
  returned when it is still the module's object (:func:`filled_in_rank`).  One
  that now holds the key's content was filled by the module's own code in the
  stage, as the session's call of the same helper filled it: not a value the
  session set (:func:`differed`).
* ``kept NAME`` (rank only): a library global the key counted by type as the
  library's own state (``MPI.COMM_WORLD.Get_rank()`` in a module: its calls
  change ``mpi4py.MPI.COMM_WORLD``), digested by that rule in the rank; one that
  matches the key's is not a value the ranks computed otherwise (:func:`differed`).
* ``module PATH``: the source of every imported module that is neither under the
  stage's own directory (those the key hashes as it reaches them), nor part of
  the standard library, ``site-packages`` or hetflow: a helper module reached
  through ``sys.path``/``PYTHONPATH`` from outside the script's directory, a
  package installed with ``pip install -e``, a module a stage imports by a name
  in a string.  They count whole, for every stage of a script that imports them;
  ``values PATH``: the plain values such a module holds (what it read at import
  from a file or a variable), by the key's digest of a value.
* ``file PATH``: the files (not code) the top level opened for reading, by
  content (by size and time above :data:`CONTENT_LIMIT`); ``folder PATH``: the
  folders it listed (``os.listdir``/``os.scandir`` audit events, not the import
  system's), by their names.  The rank's files must be what the orchestrator's
  top level read when it made the key (``TABLE = pd.read_csv(...)`` edited while
  a stage waited for its slot), or the result is not committed.  Both are
  recorded with the commit (the rank's and the orchestrator's): an installed
  library's state set from a file (``plt.style.use("paper.mplstyle")``) is not
  in the key.  A warm rank counts what the fork server's imports of the script's
  installed packages read (:func:`keep_preloaded`) as its own;
* ``listed PATH`` (rank only): the folders the stage listed while it ran (a
  plugin folder it scans), by their names after it returned;
* ``wrote PATH`` (rank only): the files the stage opened for writing: a file
  the top reads that the pipeline writes itself is not a change.
* ``state NAME``: process-wide state that calls at the top set without assigning
  a global: the ``random`` and numpy global generators, torch's default
  generator and default dtype, the ``decimal`` context, the time zone (``TZ`` and
  what ``time.tzset()`` made of it).  A state the rank and the
  orchestrator agree on was set by the top level (``np.random.seed(SEED)``) and
  counts; one they do not agree on was not seeded and is left out.

The orchestrator refuses to commit a result whose ``module``/``file``
observations differ from its own (they changed after the run started), records
the others with the stage's output (a map stage's, for its items too:
:func:`to_record`), and serves that output again only while its own
observations at the start of a later run match them (:func:`stale`).  Files
and folders are seen through an audit hook (``open``, ``os.listdir``,
``os.scandir`` events) that records only while :func:`recording` or
:func:`recording_writes` is on; it returns at once otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import stat
import sys
import sysconfig
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

CONTENT_LIMIT = 256 << 20
"""Files read at the top up to this size are compared by content, larger ones by size and modification time."""

MAX_FILES = 10_000
"""At most this many files are recorded per top level (a notebook that opens many stops recording there)."""

_SKIP_PREFIXES = ("/proc/", "/sys/", "/dev/", "/etc/", "/run/")
_CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".pyd", ".pth")


class _Recorder:
    on = False
    paths: dict[str, None] = {}
    written: set[str] = set()
    """Files the top level opened for writing: its own state (a run counter, a cache it fills), not an input
    the key must hold; every process that runs the top level changes them."""
    skip: tuple[str, ...] = ()
    writes_only = False
    """Recording the files a stage opens for writing (:func:`recording_writes`), not those it reads."""
    listed: dict[str, None] = {}
    """Folders the top level listed (``os.listdir``, ``os.scandir``: ``glob``, ``pkgutil.iter_modules``)."""
    stage_listed: dict[str, None] = {}
    """Folders the stage listed while it ran (:func:`recording_writes` on)."""
    preloaded: dict[str, str] = {}
    """``{"file PATH" | "folder PATH": digest}`` read by the installed imports a fork server loaded before it
    forked this process (:func:`keep_preloaded`): the script's top imported them, in this process, there."""


def _external_dirs() -> tuple[str, ...]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


_EXTERNAL = _external_dirs()


@functools.lru_cache(maxsize=2)
def _hetflow_dirs() -> tuple[str, ...]:
    """hetflow's own package folders (``pipeline/``, ``tasks/``, ... in an editable install): counted by version."""
    found = set()
    for name in ("hetflow", "hetflow.tasks", "hetflow.operators", "hetflow.ml"):  # those imported (cached once)
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str):
            found.add(os.path.join(os.path.dirname(os.path.realpath(path)), ""))
    return tuple(found)


_LISTINGS = frozenset(("os.listdir", "os.scandir"))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not (_Recorder.on or _Recorder.writes_only):
        return
    if event in _LISTINGS:
        _listing(args[0] if args else None)
        return
    if event != "open":
        return
    path, mode = args[0], args[1]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return  # a file descriptor
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    try:
        text = os.fsdecode(path)
    except (TypeError, ValueError):
        return
    if (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            (mode is None and flags & (os.O_WRONLY | os.O_RDWR)):
        if len(_Recorder.written) < MAX_FILES:
            _Recorder.written.add(os.path.abspath(text))
        return
    if not _Recorder.on:
        return
    if len(_Recorder.paths) < MAX_FILES and not text.endswith(_CODE_SUFFIXES):
        _Recorder.paths[os.path.abspath(text)] = None


def _listing(path: Any) -> None:
    """Record a folder listed by user or library code; the import system's own listings (a path entry's
    finder filling its cache) are left out: the modules it finds are observed by their source."""
    if isinstance(path, int):
        return  # a file descriptor
    try:
        caller = sys._getframe(2).f_code.co_filename  # _audit's caller: the code that called os.listdir / os.scandir
    except ValueError:
        return  # called from no Python code
    if caller.startswith("<frozen importlib") or (f"{os.sep}importlib{os.sep}" in caller and caller.startswith(_EXTERNAL)):
        return  # the import system, importlib.metadata looking for distributions
    try:
        text = os.path.abspath(os.fsdecode(path if path is not None else "."))
    except (TypeError, ValueError):
        return
    if text in {os.path.abspath(entry or ".") for entry in sys.path if isinstance(entry, str)}:
        return  # a folder modules are imported from (pkg_resources scans them all): they count by their source
    found = _Recorder.listed if _Recorder.on else _Recorder.stage_listed
    if len(found) < MAX_FILES:
        found[text] = None


def in_hetflow_process() -> bool:
    """Whether this process is one of hetflow's own (a rank's worker, the fork server, a witness), started
    as ``python -m hetflow.tasks...``: there no user script's top level runs before ``import hetflow``."""
    return any(arg.startswith("hetflow.tasks.") for arg in getattr(sys, "orig_argv", ())[1:4])


def install() -> None:
    """Add the audit hook (once per process; it cannot be removed, so it does nothing while not recording)."""
    if not getattr(sys, "_hetflow_observed_hook", False):
        sys.addaudithook(_audit)
        sys._hetflow_observed_hook = True  # type: ignore[attr-defined]


def recording(on: bool) -> None:
    """Start (forgetting what was recorded) or stop recording the files opened for reading."""
    if on:
        _Recorder.paths = {}
        _Recorder.listed = {}
        _Recorder.written = set()
    _Recorder.on = on


@contextlib.contextmanager
def not_recording() -> Iterator[None]:
    """Files hetflow itself reads meanwhile (a run's recorded stages, read by ``hetflow resume`` where a
    script's top would run) are not the top level's reads."""
    was = _Recorder.on
    _Recorder.on = False
    try:
        yield
    finally:
        _Recorder.on = was


MAX_WRITTEN = 1_000
"""At most this many files a stage wrote are sent with its rank's result (:func:`stage_written`)."""


def recording_writes(on: bool) -> None:
    """Start (forgetting what was recorded) or stop recording the files opened for writing, while a stage runs."""
    if on:
        _Recorder.written = set()
        _Recorder.stage_listed = {}
    _Recorder.writes_only = on


def stage_written(exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{"wrote PATH": ""}``: the files the stage opened for writing while :func:`recording_writes` was on,
    less those under ``exclude`` (its run folder).  A file the script's top reads that a stage of the run
    writes (``summary.json``) is the pipeline's own product: another stage's rank reading it otherwise than
    the orchestrator did is not a change after the run started (:func:`refused`)."""
    skip = tuple(exclude)
    found = sorted(path for path in _Recorder.written if not path.startswith(skip))[:MAX_WRITTEN]
    return {f"wrote {path}": "" for path in found}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_entry(path: str) -> str | None:
    try:
        info = os.stat(path)
    except OSError:
        return "<missing>"
    if not stat.S_ISREG(info.st_mode):
        return None
    if info.st_size > CONTENT_LIMIT:
        return f"size {info.st_size} mtime {info.st_mtime_ns}"
    digest = hashlib.blake2b(digest_size=32)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return "<unreadable>"
    return digest.hexdigest()


class _Forked:
    """What a fork server had imported when it forked this process (:func:`mark_imported`)."""

    last: tuple[str, Any] | None = None
    """The last entry of ``sys.modules`` then; ``None`` in a process no fork server forked."""
    kept: tuple[str, ...] = ()
    """Those of its modules that a walk may observe (usually none: the server imports installed packages)."""


def mark_imported() -> None:
    """In a fork server, before it forks: its children's walks of the imported modules (:func:`imported`)
    look only at those imported after the last call, and at those imported before that a walk may observe.

    Decision: the modules a fork server imported are its installed packages, the standard library and
    hetflow, which no walk observes; walking them in each child touched every module object, and so made
    the kernel copy every page holding one (copy-on-write), the largest part of what observing cost a
    trivial task.  Modules are found by ``sys.modules``' order (a dict keeps its insertion order): what a
    child imports, or deletes and imports again, comes after the server's last entry.  O(1) when nothing
    was imported since the last call."""
    from hetflow.tasks.script import is_deferred

    if not sys.modules:
        return
    last = next(reversed(sys.modules.items()))
    if _Forked.last is not None and _Forked.last[0] == last[0] and _Forked.last[1] is last[1]:
        return
    modules = list(sys.modules.items())
    _Forked.last = None  # walk every module for what they keep
    observed = {name for name, _, _ in _outside()}
    _Forked.kept = tuple(name for name, module in modules if name in observed or is_deferred(module))
    _Forked.last = last


def imported() -> list[tuple[str, Any]]:
    """``sys.modules``' entries, in their order; in a fork server's child, only those imported since it
    forked and those it may observe of the server's (:func:`mark_imported`); every entry if the server's
    last one was removed from ``sys.modules`` since."""
    modules = sys.modules
    last = _Forked.last
    if last is None:
        return list(modules.items())
    since = []
    for name, module in reversed(modules.items()):
        if module is last[1] and name == last[0]:
            break
        since.append((name, module))
    else:
        return list(modules.items())
    return [(name, modules[name]) for name in _Forked.kept if name in modules] + since[::-1]


def _outside(exclude: Iterable[str] = (), before: frozenset[str] | None = None
             ) -> Iterable[tuple[str, types.ModuleType, str]]:
    """``(name, module, real path)`` of the imported modules :func:`module_sources` observes."""
    from hetflow.tasks.script import is_deferred

    skip = _EXTERNAL + _hetflow_dirs() + (tuple(exclude) if before is None else ())
    for name, module in imported():
        if (before is not None and name in before) or is_deferred(module):  # looking would load it
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py") or name.partition(".")[0] == "hetflow" \
                or path.startswith(skip) or "site-packages" in path or "dist-packages" in path:
            continue
        real = os.path.realpath(path)
        if not real.startswith(skip):
            yield name, module, real


def module_sources(exclude: Iterable[str] = (), known: Mapping[str, str] | None = None,
                   before: frozenset[str] | None = None) -> dict[str, str]:
    """``{"module PATH": sha256}`` of the imported modules outside the standard library, ``site-packages``,
    hetflow and the folders in ``exclude`` (``os.path.join(folder, "")`` each); those in ``known`` are
    neither read again nor returned.  With ``before`` (module names), only the modules imported since, and
    ``exclude`` does not apply: a module the stage imported while it ran (by a name in a string) counts
    wherever it lies."""
    found: dict[str, str] = {}
    for _, _, real in _outside(exclude, before):
        if known is not None and f"module {real}" in known:
            continue
        try:
            with open(real, "rb") as f:
                found[f"module {real}"] = _sha(f.read())
        except OSError:
            found[f"module {real}"] = "<missing>"
    return found


def module_values(exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{"values PATH": digest}``: the plain values (not functions, classes, modules) that the modules
    :func:`module_sources` observes hold now, by the key's digest of a value; a module without any is left out.
    A helper outside the script's folder that reads a file or a variable when it is imported (``GAIN =
    json.load(...)``) holds what its source does not say."""
    from . import fingerprint

    walker: Any = None
    found: dict[str, str] = {}
    for _, module, real in _outside(exclude):
        texts = []
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType,
                                                           types.BuiltinFunctionType)):
                continue
            if walker is None:
                walker = fingerprint._Walker(_nothing, ())
            try:
                texts.append(f"{attr} = {walker.value(value)}")
            except Exception as exc:  # noqa: BLE001 - a value whose text form fails: say so, deterministically
                texts.append(f"{attr} = <{type(exc).__name__}>")
        if texts:
            found[f"values {real}"] = _sha("\n".join(texts).encode())
    return found


def _nothing() -> None:
    """The function a walker that only digests values is made for."""


def value_labels(code: Mapping[str, str]) -> tuple[str, ...]:
    """The components of a key's code that name a value (``TABLE``, ``helper.K``, ``helper.Model.SCALE``): not
    modules, classes, functions, the stage itself, what could not be digested, nor what a name does not reach
    (a closure's cells, ``sys.argv[1:]``, library settings: :func:`_resolve` would find another value), nor the
    script's own ``__name__`` read by a stage (``sys.modules[__name__]``): a rank runs the script under a name of
    its own, always the same, so the value differs from the orchestrator's on every run without meaning that
    the stage computed something else (a global assigned from it, ``MODNAME = __name__``, still counts)."""
    from .fingerprint import UNCACHEABLE

    return tuple(name for name, digest in sorted(code.items())
                 if not name.startswith(("module ", "class ", UNCACHEABLE)) and not name.endswith("()")
                 and name not in ("stage", "__name__") and digest != "<undefined>"
                 and all(part.isidentifier() for part in name.split(".")))  # not "f() closure", "sys.argv[1:]"


def code_in_rank(func: Any, labels: Iterable[str], local_installs: tuple[Iterable[str], Iterable[str]],
                 roots: Iterable[str] = ()) -> dict[str, str]:
    """``{"code NAME": digest}`` of the values the key's code names (``labels``: :func:`value_labels`) as the
    rank's top level left them, by the key's digest of a value (the same walker, what was installed from a local
    directory as the key saw it).  One that differs from the key's was computed from something else than the
    key says: ``TABLE = pq.read_table(...)`` whose file changed after the key was made (any reader: native ones
    open no Python file, a hidden folder is not observed), or a value each process computes anew (the time, the
    working directory).  A name the rank cannot find is left out.  ``roots``: where the key found the stage's
    local modules, when not beside its file (a function shipped from a session: the session's working
    directory, not the rank's attempt directory), so that an instance of a local class reads as the key read it."""
    labels = list(labels)
    if not labels:
        return {}
    from . import fingerprint

    fingerprint._LOCAL[tuple(sys.path)] = (tuple(local_installs[0]), tuple(local_installs[1]))
    try:
        walker = fingerprint._Walker(func, list(roots) or fingerprint._default_roots(func))
    except Exception:  # noqa: BLE001 - the orchestrator made the key, so this is this process's problem: not compared
        return {}
    home = getattr(fingerprint._target(func), "__globals__", {})
    found = {}
    for label in labels:
        value = _resolve(label, home)
        if value is _NOT_FOUND or isinstance(value, (types.FunctionType, types.ModuleType, type)):
            continue  # followed by the key, not digested as a value
        try:
            text = "<absent>" if value is _ABSENT else walker.value(value)
        except Exception:  # noqa: BLE001 - its text form failed here: not compared
            continue
        found[f"code {label}"] = fingerprint._sha(text)
        if value is not _ABSENT and fingerprint._library_own(value, label.partition(".")[0]):
            found[f"kept {label}"] = fingerprint._sha(walker.value(fingerprint.library_kept(value)))
    return found


_NOT_FOUND = object()
_ABSENT = object()

_CONTAINERS = (dict, list, set, bytearray, collections.deque)


def containers_in_rank(func: Any, labels: Iterable[str]) -> dict[str, Any]:
    """The key's components that name a mutable container held by an imported module (``mylib._CACHE``), as the
    rank's top level left them: what the stage may fill in place through the module's own functions, a memo
    (:func:`filled_in_rank`)."""
    from .fingerprint import _target

    home = getattr(_target(func), "__globals__", {})
    return {label: value for label in labels if "." in label
            and isinstance(value := _resolve(label, home), _CONTAINERS)}


def filled_in_rank(func: Any, held: Mapping[str, Any], local_installs: tuple[Iterable[str], Iterable[str]],
                   roots: Iterable[str] = ()) -> dict[str, str]:
    """``{"filled NAME": digest}`` of each container of ``held`` (:func:`containers_in_rank`) that is still the
    module's object after the stage returned (filled in place, not replaced), digested as the key digests it.
    A session that called a memoizing helper (``mylib.get()`` filling ``mylib._CACHE``) keyed the filled
    container; a rank that ends with the same content filled it the same way (:func:`differed`)."""
    from .fingerprint import _target

    home = getattr(_target(func), "__globals__", {})
    same = [label for label, value in held.items() if _resolve(label, home) is value]
    return {f"filled {key[len('code '):]}": digest
            for key, digest in code_in_rank(func, same, local_installs, roots).items()}


def _resolve(label: str, home: Mapping[str, Any]) -> Any:
    """The value a key component names: a global of the stage's own module (``TABLE``), of another module
    (``helper.K``), a class attribute (``helper.Model.SCALE``); :data:`_ABSENT` for an attribute that is not
    set (a value set on a module that it does not have here), :data:`_NOT_FOUND` when nothing holds it."""
    if "." not in label:
        return home.get(label, _NOT_FOUND)
    parts = label.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = sys.modules.get(".".join(parts[:cut]))
        if owner is None:
            continue
        for part in parts[cut:-1]:  # a (nested) class of that module
            owner = vars(owner).get(part) if isinstance(owner, (types.ModuleType, type)) else None
        if not isinstance(owner, (types.ModuleType, type)):
            return _NOT_FOUND
        return vars(owner).get(parts[-1], _ABSENT)
    return _NOT_FOUND


def _kept(path: str, skip: tuple[str, ...]) -> bool:
    """Whether a path the top level read or listed is the user's: not under ``skip`` (the external folders,
    hetflow, /proc, /sys, /dev, /etc, /run, the run's folder), ``site-packages``, nor a hidden folder
    (``~/.cache``, ``~/.config``: what libraries keep, not data)."""
    return not (path.startswith(skip) or "site-packages" in path or "dist-packages" in path or "/." in path)


def files_read(exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{"file PATH": digest}`` of the files recorded while :func:`recording` was on, and ``{"folder PATH":
    digest}`` of the folders listed then (:func:`_folder_entry`), less those under the external folders,
    hetflow and ``exclude``, and the files the top level also wrote."""
    skip = _EXTERNAL + _hetflow_dirs() + _SKIP_PREFIXES + tuple(exclude)
    found: dict[str, str] = {}
    for path in list(_Recorder.paths):
        if path in _Recorder.written:
            continue  # the top level writes it too: see _Recorder.written
        if _kept(path, skip) and (entry := _file_entry(path)) is not None:
            found[f"file {path}"] = entry
    for path in list(_Recorder.listed):
        if _kept(os.path.join(path, ""), skip) and (entry := _folder_entry(path)) is not None:
            found[f"folder {path}"] = entry
    return found


def _folder_entry(path: str) -> str | None:
    """A folder's listing as a digest of its sorted names: a file added, removed or renamed changes it, an
    edit inside one does not (what was read of it is observed on its own), nor ``__pycache__``, which Python
    makes when it first imports from a folder; None for what is not a folder."""
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            return None
        names = sorted(name for name in os.listdir(path) if name != "__pycache__")
    except FileNotFoundError:
        return "<missing>"
    except OSError:
        return "<unreadable>"
    return _sha("\0".join(names).encode("utf-8", "surrogateescape"))


def keep_preloaded(exclude: Iterable[str] = ()) -> None:
    """Keep what was recorded (files read, folders listed) since :func:`recording` went on as what this
    process's preloaded imports read (:attr:`_Recorder.preloaded`): a fork server imports a script's
    installed packages once, and each rank it forks counts what they read as its own top level's
    (``MATPLOTLIBRC`` naming a file, a library reading its configuration at import)."""
    recording(False)
    _Recorder.preloaded.update(files_read(exclude))


def stage_listed(exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{"listed PATH": digest}``: the folders the stage listed while :func:`recording_writes` was on (a
    plugin folder it scans with ``pkgutil.iter_modules``), less those under ``exclude`` (its run folder) and
    those it wrote a file into (its own output), by their names now."""
    skip = _EXTERNAL + _hetflow_dirs() + _SKIP_PREFIXES + tuple(exclude)
    wrote = {os.path.dirname(path) for path in _Recorder.written}
    found = {}
    for path in sorted(_Recorder.stage_listed)[:MAX_WRITTEN]:
        if path not in wrote and _kept(os.path.join(path, ""), skip) and (entry := _folder_entry(path)) is not None:
            found[f"listed {path}"] = entry
    return found


def states() -> dict[str, str]:
    """``{"state NAME": digest}`` of the process-wide state a script's top can set by a call (module docstring);
    a library that is not imported is not imported for it."""
    from hetflow.tasks.script import is_deferred

    import time

    found = {"state time.zone": _sha(repr((os.environ.get("TZ"), time.tzname, time.timezone, time.altzone,
                                           time.daylight)).encode())}  # os.environ["TZ"] = ...; time.tzset()
    random = sys.modules.get("random")  # not imported: nothing at the top set it
    if random is not None:
        found["state random"] = _sha(repr(random.getstate()).encode())
    decimal = sys.modules.get("decimal")
    if decimal is not None and not is_deferred(decimal):
        context = decimal.getcontext()
        found["state decimal"] = _sha(f"{context.prec} {context.rounding} {context.Emin} {context.Emax} "
                                      f"{context.capitals} {context.clamp} "
                                      f"{sorted(k.__name__ for k, v in context.traps.items() if v)}".encode())
    generator = sys.modules.get("numpy.random")  # not imported: nothing at the top seeded it
    if generator is not None and not is_deferred(generator):
        try:
            kind, keys, pos, has_gauss, gauss = generator.get_state()
            found["state numpy.random"] = _sha(f"{kind} {pos} {has_gauss} {gauss!r} ".encode() + keys.tobytes())
        except Exception:  # noqa: BLE001 - a numpy without the legacy generator: nothing to observe
            pass
    torch = sys.modules.get("torch")
    if torch is not None and not is_deferred(torch) and hasattr(torch, "random") and hasattr(torch, "get_default_dtype"):
        try:
            found["state torch.random"] = _sha(torch.random.get_rng_state().numpy().tobytes())
            found["state torch.dtype"] = _sha(str(torch.get_default_dtype()).encode())
        except Exception:  # noqa: BLE001 - a torch build without these: nothing to observe
            pass
    return found


class _Start:
    taken: dict[str, str] | None = None
    top: dict[str, str] | None = None
    """The states when the script's top level ended (its ``if __name__ == "__main__":`` began): see
    :func:`watch_top_end`."""
    watching = False
    top_generators: dict[str, str] | None = None
    """The global generators' states where the script's top level ended (:func:`generator_states`)."""
    generators: dict[str, str] = {}
    """The global generators' states when ``pipe.run()`` started (:func:`take`)."""
    seeded: frozenset[str] = frozenset()
    """The generators the main block seeded before ``pipe.run()`` (:func:`take`): their state is shipped."""
    loaded: frozenset[str] = frozenset()
    """The generators the main block loaded first, not seen to be seeded (:func:`take`): shipped too, and
    counted only where a stage draws from them."""
    traced = False
    """The top's end could not be watched: another trace function (a debugger, coverage) was set
    (:func:`watch_top_end`)."""


_GUARD_LINES: dict[str, int | None] = {}
""":func:`_main_guard_line` by script path: found once a process.  A script without a main block would
otherwise be parsed again at every stage it declares (N parses for N stages made in a loop)."""


def _main_guard_line(path: str) -> int | None:
    """The line of the first top-level ``if __name__ == "__main__":`` in the script at ``path`` (read once)."""
    if path not in _GUARD_LINES:
        _GUARD_LINES[path] = _find_main_guard(path)
    return _GUARD_LINES[path]


def _find_main_guard(path: str) -> int | None:
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    from .fingerprint import _is_main_guard

    for node in tree.body:
        if _is_main_guard(node):
            return node.lineno
    return None


def watch_top_end() -> None:
    """Take the states (:func:`states`) when the script's top level ends, where its ``if __name__ ==
    "__main__":`` block begins, not when ``pipe.run()`` starts: what the block does first (``print(np.random.rand())``)
    changes them in this process only, its ranks never run it, and a seed the top set (``np.random.seed(SEED)``)
    must count.  Called when a stage is declared (after the imports, as a rule); until the block begins, a trace
    function follows the script's lines (and is told of each call, which it ignores).  Not in hetflow's own
    processes, not without a script file or a main block, not under another trace function (a debugger,
    coverage): there the states are those of ``pipe.run()``'s start, and the main block may have seeded any
    generator (:attr:`_Start.traced`)."""
    if _Start.watching or _Start.top is not None or in_hetflow_process():
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    line = _main_guard_line(path) if isinstance(path, str) and frame is not None else None
    if frame is None or line is None or frame.f_lineno >= line:
        return
    if sys.gettrace() is not None:
        _Start.traced = True  # what the main block seeded cannot be told: see take()
        return
    script_frame = frame

    def stop() -> None:
        sys.settrace(None)
        script_frame.f_trace = None
        _Start.watching = False

    def lines(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno >= line:
            _Start.top = states()
            _Start.top_generators = generator_states()
            stop()
            return None
        return lines

    def calls(frame: Any, event: str, arg: Any) -> None:
        return None  # other frames are not followed

    _Start.watching = True
    script_frame.f_trace = lines
    script_frame.f_trace_lines = True
    sys.settrace(calls)


def take() -> dict[str, str]:
    """The orchestrator's observations when ``pipe.run()`` starts (the script's top level has run); kept for
    :func:`latest`.  Recording of opened files stops here.  The states are those the top level left, when
    they were taken where it ended (:func:`watch_top_end`)."""
    recording(False)
    if _Start.watching and sys.gettrace() is not None:  # pipe.run() before the main block: the top ends here
        sys.settrace(None)
        _Start.watching = False
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    root = stage_root(main) if isinstance(main, str) else None  # its modules' values are in the keys
    now = states()
    _Start.generators = generator_states()
    _Start.seeded = frozenset(name for name, state in _Start.generators.items()
                              if _Start.top_generators is not None and
                              _seeded_since(name, _Start.top_generators.get(name), state, main))
    _Start.loaded = frozenset(name for name in _Start.generators if name not in _Start.seeded and (
        _Start.top_generators is not None and name not in _Start.top_generators
        or _Start.top_generators is None and _Start.traced))  # under a debugger: any may have been seeded
    kept = dict(_Start.top) if _Start.top is not None else now
    kept.update({f"state {name}": now[f"state {name}"] for name in _Start.seeded | _Start.loaded
                 if f"state {name}" in now})
    _Start.taken = {**module_sources(), **module_values((root,) if root else ()), **files_read(), **kept}
    return _Start.taken


def shipped_generators(by_value: bool) -> tuple[dict[str, str], tuple[str, ...]]:
    """The global generators' states (:func:`generator_states`) a stage's ranks restore once their top level
    ran, as they were when ``pipe.run()`` started, and those of them a stage records only if it drew from it.
    For a stage of a session (shipped by value, or imported from a module into a notebook: its ranks run none
    of the session), all of them, recorded only where drawn from: nobody may have seeded them, and a stage
    that draws from none must stay cached in a new kernel.  For a script's stage, those its main block seeded
    (``np.random.seed(int(sys.argv[1]))`` before ``pipe.run()``), which its ranks never execute, recorded as
    a seed set at the top is; and those the top had not loaded and the main block did (``import numpy`` loads
    no generator: a helper's ``np.random.seed(seed)`` called from the block is the first use), recorded only
    where drawn from, as a session's: whether the block seeded one cannot be told from its state.  Under a
    debugger (another trace function: the top's end was not watched), all of them, recorded only where drawn
    from, for the same reason.  A main
    block that only draws (``print(np.random.rand())``) from a generator the top loaded leaves the ranks the
    state the top set."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)  # python - sets "<stdin>"
    if by_value or (_Start.top_generators is None and not (isinstance(path, str) and os.path.isfile(path))
                    and not in_hetflow_process()):
        return dict(_Start.generators), tuple(sorted(_Start.generators))
    return ({name: state for name, state in _Start.generators.items() if name in _Start.seeded | _Start.loaded},
            tuple(sorted(_Start.loaded)))


GENERATOR_NAMES = ("random", "numpy.random", "torch.random")
"""The global generators a rank can be given (:func:`restore_generators`): Python's ``random``, numpy's legacy
global ``RandomState``, torch's default CPU generator."""


def generator_states() -> dict[str, str]:
    """``{name: state as JSON text}`` of the imported global generators (:data:`GENERATOR_NAMES`), exactly,
    for :func:`restore_generators`; a library that is not imported is not imported for it."""
    import json

    from hetflow.tasks.script import is_deferred

    found = {}
    random = sys.modules.get("random")
    if random is not None:
        version, internal, gauss = random.getstate()
        found["random"] = json.dumps([version, list(internal), gauss])
    generator = sys.modules.get("numpy.random")
    if generator is not None and not is_deferred(generator):
        try:
            kind, keys, pos, has_gauss, gauss = generator.get_state()
            found["numpy.random"] = json.dumps([kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)])
        except Exception:  # noqa: BLE001 - a numpy without the legacy generator: nothing to give
            pass
    torch = sys.modules.get("torch")
    if torch is not None and not is_deferred(torch) and hasattr(torch, "random"):
        try:
            found["torch.random"] = json.dumps([int(torch.initial_seed()),
                                                torch.random.get_rng_state().numpy().tobytes().hex()])
        except Exception:  # noqa: BLE001 - a torch build without these: nothing to give
            pass
    return found


def restore_generators(shipped: Mapping[str, str]) -> None:
    """Set the global generators to the states in ``shipped`` (:func:`generator_states`' text), importing
    numpy or torch when the rank has not (the orchestrator had)."""
    import importlib
    import json

    for name, text in shipped.items():
        value = json.loads(text)
        if name == "random":
            import random

            random.setstate((value[0], tuple(value[1]), value[2]))
        elif name == "numpy.random":
            numpy = importlib.import_module("numpy")
            numpy.random.set_state((value[0], numpy.array(value[1], dtype=numpy.uint32), *value[2:]))
        elif name == "torch.random":
            torch = importlib.import_module("torch")
            torch.random.set_rng_state(torch.tensor(list(bytes.fromhex(value[1])), dtype=torch.uint8))


def generators_moved(shipped: Mapping[str, str]) -> frozenset[str]:
    """The generators in ``shipped`` that hold another state now: the stage drew from them."""
    if not shipped:
        return frozenset()
    now = generator_states()
    return frozenset(name for name, state in shipped.items() if now.get(name) != state)


_MT_SIZE = 624
_MAX_TWISTS = 64
"""A main block that drew more than this many blocks of 624 words before ``pipe.run()`` counts as seeding."""


def _seeded_since(name: str, before: str | None, after: str, script: str | None) -> bool:
    """Whether generator ``name`` went from state ``before`` (the top's end) to ``after`` (``pipe.run()``) by
    more than draws: a seeding call (``np.random.seed``, ``random.seed``, ``torch.manual_seed``).  Draws
    only move a Mersenne Twister's position and regenerate its block; a seed replaces the block.  torch
    keeps the seed it was last given; the same seed given again leaves that seed's fresh state.  A generator the top had not loaded (``np.random`` first used in the
    main block) counts as seeded when the ``script`` holds a seeding call: a library the block imports
    loads it unseeded too (pandas)."""
    import json

    if before is None:
        return _holds_a_seed_call(script)
    if before == after:
        return False
    old, new = json.loads(before), json.loads(after)
    if name == "torch.random":
        if old[0] != new[0]:
            return True
        import torch  # the seed the top gave, given again after the top drew (a model's initialisation)

        return bool(new[1] != old[1] and
                    new[1] == torch.Generator().manual_seed(int(new[0])).get_state().numpy().tobytes().hex())
    if name == "random":
        old_keys, old_pos, new_keys = old[1][:_MT_SIZE], old[1][_MT_SIZE], new[1][:_MT_SIZE]
    else:
        old_keys, old_pos, new_keys = old[1], old[2], new[1]
        if new[2] < old_pos and old_keys == new_keys:
            return True
    if old_keys == new_keys:
        return False
    import numpy

    keys, target = numpy.array(old_keys, dtype=numpy.uint32), numpy.array(new_keys, dtype=numpy.uint32)
    for _ in range(_MAX_TWISTS):
        keys = _twist(keys)
        if numpy.array_equal(keys, target):
            return False
    return True


def _holds_a_seed_call(script: str | None) -> bool:
    """Whether the script's source calls a seeding function (:func:`hetflow.fingerprint._seed_calls`)."""
    if not script:
        return False
    from .fingerprint import _seed_calls

    try:
        with open(script, "rb") as f:
            return bool(_seed_calls(f.read(), script))
    except (OSError, SyntaxError, ValueError):
        return False


def _twist(mt: Any) -> Any:
    """The Mersenne Twister's next block of 624 words (MT19937's ``generate``, in four vectorized parts)."""
    import numpy

    upper, lower, matrix = numpy.uint32(0x80000000), numpy.uint32(0x7FFFFFFF), numpy.uint32(0x9908B0DF)
    new = mt.copy()

    def step(i: slice, following: Any, far: Any) -> Any:
        y = (mt[i] & upper) | (following & lower)
        return far ^ (y >> numpy.uint32(1)) ^ numpy.where(y & numpy.uint32(1), matrix, numpy.uint32(0))

    new[0:227] = step(slice(0, 227), mt[1:228], mt[397:624])
    new[227:454] = step(slice(227, 454), mt[228:455], new[0:227])
    new[454:623] = step(slice(454, 623), mt[455:624], new[227:396])
    new[623:624] = step(slice(623, 624), new[0:1], new[396:397])
    return new


def latest() -> dict[str, str]:
    """What :func:`take` found last (taken now when it was never called: a run started another way)."""
    return _Start.taken if _Start.taken is not None else take()


def stage_root(path: str | None) -> str | None:
    """The folder whose modules a stage's key hashes as it reaches them (the stage file's folder, or the top of
    its package), as ``os.path.join(folder, "")``; None without a file."""
    if not path:
        return None
    root = os.path.dirname(os.path.realpath(path))
    while os.path.exists(os.path.join(root, "__init__.py")) and os.path.dirname(root) != root:
        root = os.path.dirname(root)
    return os.path.join(root, "")


def _load_deferred_helpers(exclude: tuple[str, ...]) -> None:
    """Execute the script's deferred imports (:mod:`hetflow.tasks.script`) of helper modules that
    :func:`module_sources` observes, as the orchestrator's top level did: the values they hold once imported
    count, and after the stage ran they may hold what it left there (a cache it filled)."""
    from hetflow.tasks.script import is_deferred

    skip = _EXTERNAL + _hetflow_dirs() + exclude
    for name, module in imported():
        if not is_deferred(module) or name.partition(".")[0] == "hetflow":
            continue
        origin = getattr(object.__getattribute__(module, "__spec__"), "origin", None)  # looking would load it
        if not isinstance(origin, str) or not origin.endswith(".py") or "site-packages" in origin \
                or "dist-packages" in origin or os.path.realpath(origin).startswith(skip):
            continue
        try:
            vars(module)  # the first look executes it
        except Exception:  # noqa: BLE001 - the stage meets the error where it uses the module
            continue


def in_rank(script: str | None, exclude: Iterable[str] = (), *, files: bool = True) -> dict[str, str]:
    """A rank's observations (module docstring), less the stage's own folder and ``exclude`` (its run folder);
    ``files``: whether its files were recorded (a script's top level ran in this rank).  The script's deferred
    imports of helper modules outside its folder are executed first."""
    root = stage_root(script)
    skip = tuple(exclude) + ((root,) if root else ())
    _load_deferred_helpers(skip)
    preloaded = {key: value for key, value in _Recorder.preloaded.items()
                 if not key.partition(" ")[2].startswith(tuple(exclude))} if files else {}
    return {**module_sources(skip), **module_values(skip), **preloaded, **(files_read(exclude) if files else {}),
            **states()}


def refused(rank: Mapping[str, str], start: Mapping[str, str], written: Iterable[str] = ()) -> list[str]:
    """What a rank observed of modules and files that differs from the orchestrator's start, as ``"helper
    module PATH"`` / ``"file PATH"``: it changed after the key was made, so the result is not the key's.  Files
    a stage of the run wrote (``written``, :func:`stage_written`) are left out: the run changed them itself."""
    skip = {f"file {path}" for path in written}
    return [_label(key) for key, value in sorted(rank.items())
            if key.partition(" ")[0] in ("module", "file") and key in start and start[key] != value
            and key not in skip]


OTHER_VALUE = "<another value in its ranks>"
"""What a ``value NAME`` observation records: the ranks computed ``NAME`` otherwise than the key (:func:`to_record`)."""


def differed(rank: Mapping[str, str], code: Mapping[str, str]) -> list[str]:
    """The components of the key's code (``code``) that a rank made otherwise (:func:`code_in_rank`), less a
    module's container the stage itself filled in place to the key's content (:func:`filled_in_rank`): the
    module's own code made it what the key holds, in the rank as where the key was made; and less a library's
    own state the key counted by type (``kept NAME``: ``MPI.COMM_WORLD.Get_rank()`` in a module makes
    ``mpi4py.MPI.COMM_WORLD`` a library global its calls change, :func:`hetflow.fingerprint.library_kept`),
    which the rank holds by the same rule."""
    return sorted(name for key, value in rank.items() if key.startswith("code ")
                  and (name := key[len("code "):]) in code and code[name] != value
                  and rank.get(f"filled {name}") != code[name] and rank.get(f"kept {name}") != code[name])


MAX_RECORDED = 1_000
"""At most this many files and folders read or listed (``file``/``folder``/``listed``) are recorded with a
committed stage, the first by path: a top level that reads more (a data set, file by file) is still compared
through the values it computed (``code NAME``), but an edit to a file past this many is not seen by itself."""

_READ_KINDS = ("file", "folder", "listed")
_TOP_KINDS = ("file", "folder")


def to_record(rank: Mapping[str, str], start: Mapping[str, str], covered: tuple[str, ...] = (),
              code: Mapping[str, str] | None = None, written: Iterable[str] = ()) -> dict[str, str]:
    """What is recorded with a committed stage: its modules (source and values), less those under ``covered``
    (what the key hashes as it reaches it: an editable or local-directory install), the files its top level
    read and the folders it or the stage listed (at most :data:`MAX_RECORDED`), less what a stage of the run
    wrote (``written``, and the rank's own ``wrote`` entries: the run's own product, and a folder it wrote
    into), the states the rank and the orchestrator agree on (a state they differ on was not seeded: left
    out), and ``value NAME`` for each component of the key's ``code`` that the rank made otherwise: that
    commit is never served (:func:`stale`), its key does not say what it was computed from."""
    kept = {}
    wrote = {*written, *(key[len("wrote "):] for key in rank if key.startswith("wrote "))}
    read = []
    for key, value in rank.items():
        kind, _, name = key.partition(" ")
        if kind in ("module", "values") and not (covered and name.startswith(covered)):
            kept[key] = value
        elif kind == "state" and start.get(key) == value:
            kept[key] = value
        elif kind in _READ_KINDS and name not in wrote:
            read.append(key)
        elif kind == "wrote":
            kept[key] = value  # a later run's check of another stage leaves these out (:func:`stale`)
    read += [key for key in start if key.partition(" ")[0] in _TOP_KINDS and key not in rank
             and key.partition(" ")[2] not in wrote]  # what the orchestrator's top read: see stale()
    if read:
        folders = {os.path.dirname(path) for path in wrote}
        read = [key for key in sorted(read) if key.startswith("file ") or key.partition(" ")[2] not in folders]
        kept.update((key, rank.get(key, start.get(key, ""))) for key in read[:MAX_RECORDED])
    for name in differed(rank, code or {}):
        kept[f"value {name}"] = OTHER_VALUE
    return dict(sorted(kept.items()))


def stale(recorded: Mapping[str, str], start: Mapping[str, str],
          written: Callable[[], Collection[str]] | None = None) -> list[str]:
    """The recorded observations that no longer hold now (``start``; a module the orchestrator has not
    imported is read now, and so is a file or folder its top level did not read or list), as one-line
    reasons; empty when the committed output may be served.  A file or folder that changed but that a stage
    of the pipeline writes (``written()``, asked only then: the ``wrote`` entries recorded with its stages,
    :func:`to_record`) is the pipeline's own product, not a change (a ``summary.json`` the top shows)."""
    found = []
    own: Collection[str] | None = None
    for key, value in sorted(recorded.items()):
        kind, _, name = key.partition(" ")
        if kind == "module":
            now = start.get(key)
            if now is None:
                try:
                    with open(name, "rb") as f:
                        now = _sha(f.read())
                except OSError:
                    now = "<missing>"
            if now != value:
                found.append(f"{_label(key)} changed")
        elif kind in _READ_KINDS:
            now = start.get(key) if kind != "listed" else None
            if now is None:
                now = _now(kind, name)
            if now == value:
                continue
            if written is not None:
                own = written() if own is None else own
                if name in own or (kind != "file" and any(os.path.dirname(path) == name for path in own)):
                    continue
            found.append(f"{_label(key)} {'was removed' if now == '<missing>' else 'changed'}")
        elif (kind == "state" and start.get(key) != value) or (kind == "values" and start.get(key, value) != value):
            found.append(f"{_label(key)} changed")  # values of a module not imported now: its source says
        elif kind == "value":
            found.append(f"{_label(key)} had another value where it was computed than its key says")
    if sum(key.partition(" ")[0] in _READ_KINDS for key in recorded) < MAX_RECORDED:  # else the rest are not kept
        for key in sorted(start):
            kind, _, name = key.partition(" ")
            if kind in _TOP_KINDS and key not in recorded:
                own = (written() if written is not None else ()) if own is None else own
                if name not in own and not (kind == "folder" and any(os.path.dirname(path) == name for path in own)):
                    found.append(f"{_label(key)} is new")  # a matplotlibrc that did not exist, MATPLOTLIBRC set
    return found


_NOW: dict[tuple[str, str], tuple[tuple[int, ...], str | None]] = {}
"""What :func:`_now` found, by kind and path, with the file's or folder's stat then: many stages record the
same files, and each of their cache look-ups asks."""


def _now(kind: str, path: str) -> str | None:
    """A recorded file's or folder's digest now (:func:`_file_entry`, :func:`_folder_entry`); read again only
    when its size, times, inode or device changed since it was last read here."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "<missing>"
    except OSError:
        return "<unreadable>"
    seen = (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)
    cached = _NOW.get((kind, path))
    if cached is not None and cached[0] == seen:
        return cached[1]
    entry = _file_entry(path) if kind == "file" else _folder_entry(path)
    if len(_NOW) < MAX_FILES:
        _NOW[(kind, path)] = (seen, entry)
    return entry


def _label(key: str) -> str:
    kind, _, name = key.partition(" ")
    if kind == "module":
        return f"helper module {_short(name)}"
    if kind == "file":
        return f"file {_short(name)} read at the script's top"
    if kind == "folder":
        return f"folder {_short(name)} listed at the script's top"
    if kind == "listed":
        return f"folder {_short(name)} listed by the stage"
    if kind == "values":
        return f"the values helper module {_short(name)} holds"
    if kind == "value":
        return name
    return {"random": "the random module's global state (random.seed)",
            "numpy.random": "numpy's global random state (np.random.seed)",
            "torch.random": "torch's default generator (torch.manual_seed)",
            "torch.dtype": "torch's default dtype set at the script's top",
            "decimal": "the decimal context set at the script's top",
            "time.zone": "the time zone set at the script's top (os.environ['TZ'], time.tzset)"}.get(name, name)


def _short(path: str) -> str:
    """A path relative to the working directory when that is shorter (``../src/lib.py``)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if len(relative) < len(path) else path
