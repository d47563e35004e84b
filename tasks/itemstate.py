"""What one map item run in its task's process could leave for the next: a snapshot, and the check against it.

The one-rank items of a map stage run one after another in one warm process
(:mod:`hetflow.tasks.mapitems`) as long as no item changes what a later item
would read.  :func:`take` records, before the first item, what is reachable from
the user's modules (the stage's script and every module loaded from outside the
Python installation and its packages): for each module global its identity and a
digest of its value, followed through containers (numbers and strings by value
and type), functions (defaults, closure cells, attributes), partials, the user's
classes (their attributes) and instances (their ``__dict__`` and slots), numpy
arrays and ``array.array`` (their bytes), pandas frames (their blocks and axes)
and random generators (their state); and, for the process, its working
directory, environment, ``sys.path``, live threads (raw ``_thread`` ones too)
and loaded user modules.  :func:`changed` says, in a few words, what an item
changed, or ``None``.

Decisions:

* Checked by identity and digest, not by a deep copy kept aside: an item
  never pays for a copy of the script's state, and the check after an item
  walks only what the user's modules hold.
* An item runs in the task's process only when everything reachable can be
  read: a value the walk cannot digest faithfully (a generator, an iterator, an
  ``itertools`` object, a ``functools`` cache holding values, an instance of a
  C-defined class that keeps its state out of Python attributes) raises
  :class:`Uncheckable`, naming the global that holds it, and the items fork;
  never "unreadable, so unchanged".
* Counted by identity: what cannot change in place or changes only outside the
  process (files, patterns, dates, locks, numpy scalars and dtypes), Arrow data
  (immutable) and hetflow's own objects (the pipeline the script declares).
  Not looked into: the state of installed packages and of the standard library
  (``pandas.set_option``): a map whose items change such state is declared with
  ``map_isolation="fork"``.  Python's, numpy's and torch's global random
  generators are not checked but set before each item as a process of its own
  would have them (:class:`RandomState`).
* What is too large to walk at each item (more than :data:`MAX_NODES` objects or
  :data:`MAX_BYTES` of array data) is not guessed at: :func:`take` raises
  :class:`TooLarge` and the task's items run in a process each.
"""

from __future__ import annotations

import _thread
import array
import collections
import datetime
import decimal
import functools
import hashlib
import io
import marshal
import os
import random
import re
import sys
import sysconfig
import threading
import types
import uuid
import weakref
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import HetflowError

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


class Unchecked(HetflowError):
    """The user's modules hold what a check after each item cannot read faithfully: the items run in a
    process each, and the message says why."""


class TooLarge(Unchecked):
    """The user's modules hold more than a snapshot walks."""


class Uncheckable(Unchecked):
    """The user's modules hold an object whose state the walk cannot read (a generator, an iterator, a
    filled ``functools.lru_cache``, a C object without ``__dict__``)."""


_BY_IDENTITY = (io.IOBase, re.Pattern, re.Match, datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo,
              decimal.Decimal, uuid.UUID, types.CodeType, types.GenericAlias, types.UnionType,
              types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType,
              types.GetSetDescriptorType, types.MemberDescriptorType, type(_thread.allocate_lock()),
              type(threading.RLock()), types.MappingProxyType)
"""Types whose objects count by identity: they cannot change in place, or what they change is outside the
process (a file, which a forked item shares too); a lock's state is not data an item reads."""

_HEAPTYPE = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: a class defined in Python, whose instances keep their state in ``__dict__`` or slots."""

_DIGESTS_AT_ONCE = frozenset({type(None), bool, int, float, complex, str, bytes, type(Ellipsis)})
"""Atoms ``marshal`` writes with their type: a flat container's digest is one C-level pass over them."""


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
    return user_module_file(path)


def user_module_file(path: str) -> bool:
    """A module file outside the Python installation and its packages (and not hetflow's own)."""
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
            raise TooLarge(f"the user's modules hold more than {MAX_NODES:,} objects, too many to check after each item")

    def value(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return (kind, obj if kind is not float else obj.hex())  # by value and type: hash(-1) == hash(-2)
        ident = id(obj)
        if ident in self.seen:
            return ("seen", ident)
        self.seen.add(ident)
        self._count()
        if kind is list or kind is tuple:
            return self._sequence(obj)
        if isinstance(obj, dict):
            items = list(obj.items())
            if set(map(type, obj.values())) <= _DIGESTS_AT_ONCE and set(map(type, obj)) <= _DIGESTS_AT_ONCE:
                self._count(len(items))
                return ("dict", ident, _marshalled(items), self._state(obj) if kind is not dict else None)
            return ("dict", ident, tuple((self.value(k), self.value(v)) for k, v in items),
                    self._state(obj) if kind is not dict else None)
        if isinstance(obj, (list, tuple, collections.deque)):
            return (kind.__name__, self._sequence(obj), getattr(obj, "maxlen", None), self._state(obj))
        if isinstance(obj, (set, frozenset)):
            self._count(len(obj))
            return ("set", ident, frozenset(self.value(x) for x in obj), self._state(obj))
        if isinstance(obj, (bytearray, memoryview, array.array)):
            return ("bytes", ident, getattr(obj, "typecode", None), self._crc(obj))
        if isinstance(obj, types.ModuleType):
            return ("module", ident)
        if isinstance(obj, functools._lru_cache_wrapper):
            if obj.cache_info().currsize:
                raise Uncheckable(f"a functools cache holding {obj.cache_info().currsize} value(s), which a check "
                                  "cannot read")
            return ("cache", ident, self.value(obj.__wrapped__), self._state(obj))
        if isinstance(obj, types.FunctionType):
            cells = tuple(self.value(c.cell_contents) if _filled(c) else "<empty>" for c in obj.__closure__ or ())
            return ("function", ident, id(obj.__code__), self.value(obj.__defaults__),
                    self.value(obj.__kwdefaults__), cells, self.value(obj.__dict__))
        if isinstance(obj, (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)):
            owner = getattr(obj, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType) or _reseeded(owner):
                return ("builtin", ident)
            return ("method", ident, self.value(getattr(obj, "__func__", None)), self.value(owner))
        if isinstance(obj, functools.partial):
            return ("partial", ident, self.value(obj.func), self.value(obj.args), self.value(obj.keywords),
                    self._state(obj))
        if isinstance(obj, type):
            if obj.__module__ not in self.watched:
                return ("class", ident)
            return ("class", ident, tuple((k, self.value(v)) for k, v in vars(obj).items()
                                          if k not in _SKIPPED_ATTRIBUTES))
        if isinstance(obj, random.Random):
            if _reseeded(obj) or isinstance(obj, random.SystemRandom):
                return ("random", ident)  # reseeded before each item; the system's draws have no state
            return ("random", ident, self.value(obj.getstate()), self._state(obj))
        if isinstance(obj, _BY_IDENTITY):
            return ("immutable", ident)
        module = getattr(kind, "__module__", "") or ""
        if any(module == p or module.startswith(p + ".") for p in _OPAQUE_PREFIXES):
            return ("opaque", ident)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if isinstance(obj, numpy.ndarray):
                return ("array", ident, self._array(numpy, obj))
            if isinstance(obj, (numpy.generic, numpy.dtype, numpy.ufunc)):
                return ("numpy", ident)  # scalars, dtypes and ufuncs do not change in place
            if isinstance(obj, numpy.random.Generator):
                return ("generator", ident, self.value(obj.bit_generator.state))
            if isinstance(obj, numpy.random.BitGenerator):
                return ("bitgenerator", ident, self.value(obj.state))
            if isinstance(obj, numpy.random.RandomState):
                if obj is _numpy_global(numpy):
                    return ("random", ident)  # set before each item as a process of its own has it
                return ("randomstate", ident, self.value(obj.get_state(legacy=False)))
        managers = getattr(sys.modules.get("pandas.core.internals.managers"), "BaseBlockManager", None)
        if managers is not None and isinstance(obj, managers):
            return ("frame", ident, tuple(self._array(numpy, _ndarray(numpy, block.values)) for block in obj.blocks),
                    tuple((type(axis).__name__, self._array(numpy, _ndarray(numpy, axis))) for axis in obj.axes))
        if isinstance(obj, weakref.ReferenceType):
            return ("weakref", ident, self.value(obj()))
        if isinstance(obj, (staticmethod, classmethod)):
            return (kind.__name__, ident, self.value(obj.__func__))
        if isinstance(obj, property):
            return ("property", ident, self.value(obj.fget), self.value(obj.fset))
        if isinstance(obj, BaseException):
            return ("exception", ident, self.value(obj.args), self._state(obj))
        if not _readable(kind):
            name = f"{module}.{kind.__qualname__}"
            raise Uncheckable(f"{'an' if name[0] in 'aeiou' else 'a'} {name}, whose state a check cannot read")
        return ("object", ident, kind.__qualname__, self._state(obj))

    def _sequence(self, obj: Any) -> Any:
        return (type(obj).__name__, id(obj), self._elements(obj))

    def _elements(self, values: Any) -> Any:
        if set(map(type, values)) <= _DIGESTS_AT_ONCE:  # flat: one C-level pass
            self._count(len(values))
            return _marshalled(values)
        return tuple(self.value(x) for x in values)

    def _array(self, numpy: Any, array: Any) -> Any:
        """An array's shape, type and data (its elements, for an array of objects), not its identity: a frame's
        column may be an array made for the walk."""
        if array.dtype.hasobject:
            return (array.shape, self._elements(array.ravel().tolist()))
        data = numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8)
        return (array.shape, str(array.dtype), self._crc(data))

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
            for slot in _slots(klass):
                try:
                    state.append((slot, self.value(object.__getattribute__(obj, slot))))
                except AttributeError:
                    continue
        return tuple(state)

    def _crc(self, buffer: Any) -> int:
        view = memoryview(buffer)
        self.bytes += view.nbytes
        if self.bytes > MAX_BYTES:
            raise TooLarge(f"the user's modules hold more than {MAX_BYTES >> 20} MiB of array data, too many to check "
                           "after each item")
        return zlib.crc32(view.cast("B") if view.ndim != 1 or view.format != "B" else view)


def _marshalled(values: Any) -> bytes:
    """A digest of a flat container of atoms, their types included (``marshal`` writes ``1`` and ``True`` apart)."""
    return hashlib.blake2b(marshal.dumps(tuple(values)), digest_size=16).digest()


def _slots(klass: type) -> tuple[str, ...]:
    """The attribute names ``klass``' own ``__slots__`` declares (a string is one name; ``__x`` is mangled)."""
    declared = klass.__dict__.get("__slots__", ())
    names = (declared,) if isinstance(declared, str) else tuple(declared) if isinstance(declared, Iterable) else ()
    return tuple(f"_{klass.__name__.lstrip('_')}{n}" if n.startswith("__") and not n.endswith("__") else n
                 for n in names if isinstance(n, str) and n not in ("__dict__", "__weakref__"))


def _readable(kind: type) -> bool:
    """Whether an instance's whole state is in its ``__dict__`` and slots: every class it is made of is defined
    in Python (a C-defined class keeps its state where the walk cannot see it: an iterator, a generator)."""
    return all(k in _IMMUTABLE_BASES or k.__flags__ & _HEAPTYPE for k in kind.__mro__)


_IMMUTABLE_BASES = frozenset({object, int, float, complex, str, bytes, tuple, frozenset})
"""C classes whose instances keep no state apart from their value (an ``IntEnum`` member is an ``int``)."""


def _ndarray(numpy: Any, values: Any) -> Any:
    """A frame's block or axis as the numpy array it holds (an extension array's values, not its C parts)."""
    return values if isinstance(values, numpy.ndarray) else numpy.asarray(values)


def _numpy_global(numpy: Any) -> Any:
    return getattr(getattr(numpy.random, "mtrand", None), "_rand", None)


def _reseeded(obj: Any) -> bool:
    """Whether ``obj`` is a global generator :class:`RandomState` sets before each item: not the items' state."""
    numpy = sys.modules.get("numpy")
    return obj is random._inst or (numpy is not None and obj is _numpy_global(numpy))  # type: ignore[attr-defined]


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
    state = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        try:
            state[name] = (id(value), walk.value(value))
        except Uncheckable as exc:
            raise Uncheckable(f"{_global(module.__name__, name)} holds {exc}") from None
    return state


def _watched(extra: Iterable[types.ModuleType]) -> list[types.ModuleType]:
    found = {id(m): m for m in extra}
    for module in list(sys.modules.values()):
        if user_module(module):
            found[id(module)] = module
    return sorted(found.values(), key=lambda m: m.__name__)


def take(modules: Iterable[types.ModuleType] = ()) -> Snapshot:
    """The state an item could change: ``modules`` (the stage's own, wherever it was loaded from) and every
    user module loaded now.  :class:`TooLarge` when that is more than a check after each item should walk."""
    _count_raw_threads()
    watched = _watched(modules)
    walk = _Walk(frozenset(m.__name__ for m in watched))
    return Snapshot(modules={m.__name__: _module_state(walk, m) for m in watched}, loaded=set(sys.modules),
                    cwd=os.getcwd(), environ=dict(os.environ), sys_path=tuple(sys.path),
                    threads=_threads())


def changed(before: Snapshot) -> str | None:
    """What differs from ``before`` that a later item would see, in a few words (``None``: nothing seen)."""
    if os.getcwd() != before.cwd:
        return f"the working directory changed to {os.getcwd()}"
    if os.environ != before.environ:
        names = sorted(set(os.environ.items()) ^ set(before.environ.items()))
        return f"the environment variable {names[0][0]} changed"
    if tuple(sys.path) != before.sys_path:
        return "sys.path changed"
    if _threads() > before.threads:
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
    except Unchecked as exc:
        return str(exc)
    return None


def _threads() -> int:
    """Live threads, those started with ``_thread.start_new_thread`` (which ``threading`` does not list) too:
    counted by :func:`_count_raw_threads` as they are started, since ``_thread._count()`` counts a new thread
    only once it runs."""
    return threading.active_count() + _thread._count() + _RAW_THREADS[0]


_RAW_THREADS = [0]
"""Threads started through ``_thread.start_new_thread`` since :func:`take` that have not returned."""


def _count_raw_threads() -> None:
    """Wrap ``_thread.start_new_thread`` (once per process) so that a thread counts from the call that starts it."""
    start = _thread.start_new_thread
    if getattr(start, "__hetflow_counted__", False):
        return

    def counted(function: Any, args: Any, kwargs: Any = None) -> int:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            finally:
                _RAW_THREADS[0] -= 1

        _RAW_THREADS[0] += 1
        try:
            return start(run, args, {} if kwargs is None else kwargs)
        except BaseException:
            _RAW_THREADS[0] -= 1
            raise

    counted.__hetflow_counted__ = True  # type: ignore[attr-defined]
    _thread.start_new_thread = _thread.start_new = counted  # type: ignore[assignment]


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
