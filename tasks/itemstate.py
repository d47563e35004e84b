"""What one map item run in its task's process could leave for the next: a snapshot, and the check against it.

The one-rank items of a map stage run one after another in one warm process
(:mod:`hetflow.tasks.mapitems`) as long as no item changes what a later item
would read.  :func:`take` records, before the first item, what is reachable from
the user's modules (the stage's script and every module loaded from outside the
Python installation and its packages): for each module global its identity and a
digest of its value, followed through containers, functions (defaults, closure
cells, attributes), the user's classes (their attributes) and instances (their
``__dict__`` and slots) and numpy arrays (their bytes); and, for the process, its
working directory, environment, ``sys.path``, live threads and loaded user
modules.  :func:`changed` says, in a few words, what an item changed, or
``None``.

Decisions:

* Checked by identity and digest, not by a deep copy kept aside: an item
  never pays for a copy of the script's state, and the check after an item
  walks only what the user's modules hold.
* Not looked into: objects of installed packages that have no ``__dict__``
  (a C extension's object), Arrow data (immutable) and hetflow's own objects (the
  pipeline the script declares); the state of installed packages and of the
  standard library (``pandas.set_option``): a map whose items change such state
  is declared with ``map_isolation="fork"``.  Python's, numpy's and torch's
  global random generators are not checked but set before each item as a
  process of its own would have them (:func:`RandomState`).
* What is too large to walk at each item (more than :data:`MAX_NODES` objects or
  :data:`MAX_BYTES` of array data) is not guessed at: :func:`take` raises
  :class:`TooLarge` and the task's items run in a process each.
"""

from __future__ import annotations

import os
import random
import sys
import sysconfig
import threading
import types
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_NODES = 20_000
"""Objects walked in one snapshot at most (elements of flat lists of numbers and strings count too)."""

MAX_BYTES = 64 << 20
"""Bytes of array data hashed in one snapshot at most."""

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis)})
_OPAQUE_PREFIXES = ("pyarrow", "hetflow")
"""Packages whose objects count by identity only: Arrow data is immutable; hetflow's are the pipeline's."""
_SKIPPED_ATTRIBUTES = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__slots__",
                                 "__annotations__", "__parameters__", "__orig_bases__", "__firstlineno__",
                                 "__static_attributes__", "__type_params__"})


class TooLarge(Exception):
    """The user's modules hold more than a snapshot walks: the items run in a process each."""


def _installed_dirs() -> tuple[str, ...]:
    found = {p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            found.add(path)
    return tuple(sorted(found | {os.path.realpath(p) for p in found}))


_INSTALLED = _installed_dirs()


def user_module(module: Any) -> bool:
    """A module loaded from a file outside the Python installation and its packages (not hetflow itself)."""
    if not isinstance(module, types.ModuleType):
        return False
    name = module.__name__
    if name == "hetflow" or name.startswith("hetflow."):
        return False
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    found = _USER_FILES.get(path)
    if found is None:
        found = _USER_FILES[path] = not (_installed(path) or _installed(os.path.realpath(path)))
    return found


def _installed(path: str) -> bool:
    """Under the Python installation, an installed package, or ``hetflow.tasks``' folder."""
    return "site-packages" in path or "dist-packages" in path or \
        any(path.startswith(d + os.sep) for d in _INSTALLED + _HETFLOW)


_HETFLOW = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.realpath(__file__)))
"""``hetflow.tasks``' folder: the worker (and the fork server) may run as ``__main__``."""


_USER_FILES: dict[str, bool] = {}
"""Module files seen, and whether each is the user's (a ``realpath`` per file once, not per check)."""


class _Walk:
    """One digest pass: counts what it walks and meets each object once (cycles, shared parts)."""

    def __init__(self, watched: frozenset[str]) -> None:
        self.watched = watched
        self.nodes = 0
        self.bytes = 0
        self.seen: set[int] = set()

    def _count(self, nodes: int = 1) -> None:
        self.nodes += nodes
        if self.nodes > MAX_NODES:
            raise TooLarge(f"the user's modules hold more than {MAX_NODES:,} objects")

    def value(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        ident = id(obj)
        if ident in self.seen:
            return ("seen", ident)
        self.seen.add(ident)
        self._count()
        if kind is list or kind is tuple:
            if set(map(type, obj)) <= _ATOMS:  # flat: one C-level hash
                self._count(len(obj))
                return (kind.__name__, ident, hash(tuple(obj)))
            return (kind.__name__, ident, tuple(self.value(x) for x in obj))
        if isinstance(obj, dict):
            items = list(obj.items())
            if set(map(type, obj.values())) <= _ATOMS and set(map(type, obj)) <= _ATOMS:
                self._count(len(items))
                return ("dict", ident, hash(tuple(items)), self._state(obj) if kind is not dict else None)
            return ("dict", ident, tuple((self.value(k), self.value(v)) for k, v in items),
                    self._state(obj) if kind is not dict else None)
        if isinstance(obj, (set, frozenset)):
            self._count(len(obj))
            return ("set", ident, hash(frozenset(hash(self.value(x)) for x in obj)))
        if isinstance(obj, (bytearray, memoryview)):
            return ("bytes", ident, self._crc(obj))
        if isinstance(obj, types.ModuleType):
            return ("module", ident)
        if isinstance(obj, types.FunctionType):
            cells = tuple(self.value(c.cell_contents) if _filled(c) else "<empty>" for c in obj.__closure__ or ())
            return ("function", ident, id(obj.__code__), self.value(obj.__defaults__),
                    self.value(obj.__kwdefaults__), cells, self.value(obj.__dict__))
        if isinstance(obj, types.MethodType):
            return ("method", ident, self.value(obj.__func__), self.value(obj.__self__))
        if isinstance(obj, type):
            if obj.__module__ not in self.watched:
                return ("class", ident)
            return ("class", ident, tuple((k, self.value(v)) for k, v in vars(obj).items()
                                          if k not in _SKIPPED_ATTRIBUTES))
        module = getattr(kind, "__module__", "") or ""
        if module.startswith(_OPAQUE_PREFIXES):
            return ("opaque", ident)
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray):
            if obj.dtype.hasobject:
                return ("array", ident, obj.shape, self.value(obj.tolist()))
            return ("array", ident, obj.shape, str(obj.dtype), self._crc(numpy.ascontiguousarray(obj)))
        if isinstance(obj, (staticmethod, classmethod)):
            return (kind.__name__, ident, self.value(obj.__func__))
        if isinstance(obj, property):
            return ("property", ident, self.value(obj.fget), self.value(obj.fset))
        return ("object", ident, kind.__qualname__, self._state(obj))

    def _state(self, obj: Any) -> Any:
        """An instance's own attributes (``__dict__`` and set slots), read without running its code."""
        state: list[Any] = []
        try:
            attributes = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attributes = None
        if isinstance(attributes, dict):
            state.append(self.value(attributes))
        for klass in type(obj).__mro__:
            for slot in klass.__dict__.get("__slots__", ()) if isinstance(klass.__dict__.get("__slots__", ()),
                                                                          (tuple, list)) else ():
                try:
                    state.append((slot, self.value(object.__getattribute__(obj, slot))))
                except AttributeError:
                    continue
        return tuple(state)

    def _crc(self, buffer: Any) -> int:
        view = memoryview(buffer)
        self.bytes += view.nbytes
        if self.bytes > MAX_BYTES:
            raise TooLarge(f"the user's modules hold more than {MAX_BYTES >> 20} MiB of array data")
        return zlib.crc32(view.cast("B") if view.ndim != 1 or view.format != "B" else view)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Snapshot:
    """What :func:`take` saw: per watched module, each global's identity and digest; the process's state."""

    modules: dict[str, dict[str, Any]]
    loaded: set[str]
    """The modules loaded then, and those of installed packages loaded since (not state: they are added)."""
    cwd: str
    environ: dict[str, str]
    sys_path: tuple[str, ...]
    threads: int


def _module_state(walk: _Walk, module: types.ModuleType) -> dict[str, Any]:
    """``{global: (identity, digest)}``: a reassigned global has another identity, a changed one another digest."""
    return {name: (id(value), walk.value(value)) for name, value in list(vars(module).items())
            if not (name.startswith("__") and name.endswith("__"))}


def _watched(extra: Iterable[types.ModuleType]) -> list[types.ModuleType]:
    found = {id(m): m for m in extra}
    for module in list(sys.modules.values()):
        if user_module(module):
            found[id(module)] = module
    return sorted(found.values(), key=lambda m: m.__name__)


def take(modules: Iterable[types.ModuleType] = ()) -> Snapshot:
    """The state an item could change: ``modules`` (the stage's own, wherever it was loaded from) and every
    user module loaded now.  :class:`TooLarge` when that is more than a check after each item should walk."""
    watched = _watched(modules)
    walk = _Walk(frozenset(m.__name__ for m in watched))
    return Snapshot(modules={m.__name__: _module_state(walk, m) for m in watched}, loaded=set(sys.modules),
                    cwd=os.getcwd(), environ=dict(os.environ), sys_path=tuple(sys.path),
                    threads=threading.active_count())


def changed(before: Snapshot) -> str | None:
    """What differs from ``before`` that a later item would see, in a few words (``None``: nothing seen)."""
    if os.getcwd() != before.cwd:
        return f"the working directory changed to {os.getcwd()}"
    if os.environ != before.environ:
        names = sorted(set(os.environ.items()) ^ set(before.environ.items()))
        return f"the environment variable {names[0][0]} changed"
    if tuple(sys.path) != before.sys_path:
        return "sys.path changed"
    if threading.active_count() > before.threads:
        return "a thread it started is still running"
    new = []
    if len(sys.modules) != len(before.loaded):
        for name in set(sys.modules) - before.loaded:
            if user_module(sys.modules.get(name)):
                new.append(name)
            else:
                before.loaded.add(name)  # what an item imports from an installed package is not its state
    if new:
        return f"it imported the module {min(new)!r}, whose state later items would share"
    walk = _Walk(frozenset(before.modules))
    try:
        for name, state in before.modules.items():
            module = sys.modules.get(name)
            if module is None:
                return f"the module {name!r} was removed from sys.modules"
            now = _module_state(walk, module)
            if now == state:
                continue
            for key in sorted(set(now) | set(state)):
                if key not in now:
                    return f"{_global(name, key)} was deleted"
                if key not in state:
                    return f"{_global(name, key)} was added"
                if now[key][0] != state[key][0]:
                    return f"{_global(name, key)} was reassigned"
                if now[key] != state[key]:
                    return f"{_global(name, key)} was changed in place"
    except TooLarge as exc:
        return str(exc)
    return None


def _global(module: str, name: str) -> str:
    if module in ("__hetflow_script__", "__main__"):
        return f"the script's global {name!r}"
    return f"global {name!r} of module {module!r}"


class RandomState:
    """The global random generators as a process of its own would start an item with them: Python's
    ``random`` freshly seeded (it reseeds itself after a fork), numpy's and torch's as the task's process
    has them (a forked child inherits them)."""

    def __init__(self) -> None:
        numpy = sys.modules.get("numpy")
        torch = sys.modules.get("torch")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.torch = torch.random.get_rng_state() if torch is not None and hasattr(torch, "random") else None

    def restore(self) -> None:
        random.seed()
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        if self.torch is not None:
            sys.modules["torch"].random.set_rng_state(self.torch)
