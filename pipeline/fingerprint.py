"""What a stage's cached output depends on: its code (followed transitively) and its declared files.

Both fingerprints are ``{readable component name: hex digest}`` mappings, so a
cache miss can say *why* (:func:`describe_change`); :func:`fingerprint_digest`
folds one or more of them into a single key.  Pure functions: nothing is
executed, imported or pickle-loaded; a module that a function or a reached
module imports but that was never imported is only located (its file found).

Decisions, for :func:`code_fingerprint`:

* **User code** is code whose file lies under one of ``roots`` (default: the
  stage's directory, or the top of its package) and not under ``sys.prefix``,
  ``sys.base_prefix``, ``sys.exec_prefix`` or a ``site-packages`` /
  ``dist-packages`` folder.  Everything else is external: a top-level package
  with a ``__version__`` is recorded as ``"module numpy"`` -> its version; the
  standard library and packages without a version are left out.  A package
  installed from a local directory (its ``direct_url.json`` has ``dir_info``,
  PEP 610: ``pip install -e ./mylib`` or ``pip install ./mylib``) is user code
  whatever its version: an editable install's project directory counts as a
  root, a plain install's installed files count where they lie.  hetflow itself
  counts by its version (a part of every key).  A module reached that was
  loaded from a file outside the roots and outside the installation (a
  ``PYTHONPATH`` folder elsewhere, a zip archive, a file of any name given to
  ``SourceFileLoader``, an extension module, a module ``exec_module`` made
  without ``sys.modules``) counts by that file's content whatever its loader
  and its version (``"module fastlab"``; the zip member as the archive holds
  it now; above :data:`MODULE_CONTENT_LIMIT` by size and time), and the imports
  in its source are followed; it is not walked as user code.
* Functions of the stage's own module (the script) are hashed one by one, by
  **bytecode** (``co_code``, constants, names, argument layout; nested code
  objects recursively), so comments, formatting, line numbers, other stages and
  the module's name (``__main__`` in the orchestrator, ``__hetflow_script__`` in
  the worker) do not count.  Their defaults, keyword defaults and closure cells
  are hashed as values, and so are the attributes set on them (``fit.alpha =
  3`` after the ``def``; not dunder names, not ``singledispatch``'s own); the
  globals they load (``LOAD_GLOBAL``, imports) are followed.  Classes: every attribute in the class body (methods by bytecode;
  ``property``, ``cached_property``, ``partialmethod``, ``singledispatchmethod``
  by the functions in them; other values as values) plus their bases and their
  metaclass.  A ``singledispatch`` function counts its registered functions.
* Other user modules are hashed whole (``"module mylib"``: their source file)
  and their namespace is followed; so is every import statement in their
  source (parsed, not run), so ``from .consts import SCALE`` makes
  ``mylib.consts`` count.  A module is reached, not a package: a stage that
  names ``helper`` (from ``from mylib import helper``) counts the module that
  defines ``helper`` and what that module imports, not ``mylib/__init__.py``
  nor its other submodules; a stage that names ``mylib`` itself (``import
  mylib``) counts ``__init__.py`` and everything it imports.  ``from a import
  x`` (in a function or in a reached module's source) follows the submodule
  ``a.x`` if there is one, else what ``x`` is in ``a`` when that is a
  function, class or module, else ``a`` whole.  A user module that was never
  imported is located without importing it or its packages (``find_spec`` on
  the top-level name, then the path finder): its file is hashed and its
  imports read from its source; ``from a import x`` then counts ``a`` whole.
* **Values set on a module from outside it.**  The script and every imported
  user module are read (parsed, not run) for places that set a value on another
  module or class: ``mpatch.K = 2`` (also ``+=``, ``del``, in a tuple),
  ``setattr(mpatch, "K", 2)``, ``vars(mpatch)["K"] = 2``, a value changed in
  place (``mpatch.CONFIG.k = 2``, ``mpatch.ITEMS.append(2)``, ``mpatch.D[k] =
  2``: ``CONFIG``, ``ITEMS``, ``D`` count), and a call of a function that
  assigns its module's globals (``mpatch.configure(2)`` with ``global K``).
  Such ``mpatch.K`` counts, by its value now (``"mpatch.K"``), when the stage
  reaches ``mpatch`` and the code it reaches reads the name ``K`` (a loaded
  name or attribute, or an identifier string, in a reached function or in a
  reached module's source: a module counts whole, so a name it reads anywhere
  counts); on an external package, when the stage uses that package.  So a
  value set that no reached code reads does not re-run the stage.  Reached code
  that reads names built at run time (``getattr`` with a name that is not a
  string constant, ``vars``, ``globals``, ``__dict__``, ``attrgetter``: any use,
  in bytecode or in a reached module's source) reads every name: then every
  plain value of every reached module counts (the script's too).  A set site's
  object may be a name bound by an import anywhere in the source
  (``def setup(): from m import Model; Model.SCALE = 2``).  A name that
  is not a literal (``setattr(m, name, v)``, ``vars(m).update(...)``) counts
  every plain value of ``m`` that is read.  Not seen: a value set through an
  expression (``sys.modules["m"].K = 2``, a loop variable holding the module),
  a value a called function changes in place (``m.configure()`` filling
  ``m.CONFIG``), and the
  standard library's modules (``os.environ``: declare ``env=``).  Values the
  script's ``__main__`` block sets are refused by the orchestrator
  (:func:`values_set_after_declaring`), not hashed.
* **Values** are hashed through a stable text form: ``repr`` of None, bool,
  numbers, str, bytes, Path, Enum, datetime, Decimal, UUID; containers
  recursively (sets and dict keys sorted, so hash randomisation cannot reorder
  them); numpy arrays and scalars by dtype, shape and bytes (arrays holding
  objects element by element, as values); pandas frames, series and indexes by
  their content (labels, dtypes, names, ``attrs``, every value: through
  ``pandas.util.hash_pandas_object``, object columns element by element);
  Arrow tables, batches and arrays and polars frames by their Arrow IPC bytes,
  torch tensors by dtype, shape and bytes; a ``random.Random`` or numpy
  generator by its state (so its seed);
  dataclasses by their fields plus any other attribute of the instance; instances
  of user classes by their fields (``__dict__`` and set
  ``__slots__``, read without running their code); a ``functools.partial`` by
  its function and arguments, a bound method by its function and its
  ``__self__`` (so ``APPLY = Scaler(2).apply`` counts the 2); a callable
  wrapper (``functools.lru_cache``, ``update_wrapper``) by its type and the
  function in its ``__wrapped__`` (``numpy.vectorize``: ``pyfunc``; numba:
  ``py_func``; and an ``lru_cache``'s parameters); a ``SimpleNamespace`` by its
  fields; a ``logging.Logger`` by its name only (its repr shows its level).
  Any other object by its ``repr`` when its type defines one that shows no
  address, with its instance state (``__dict__``, slots: a fitted model's repr
  shows no weights); a ``repr`` that is shortened (it holds ``...``: a large pyarrow table,
  a torch tensor) cannot stand for the value, so the component that holds it is
  marked :data:`UNCACHEABLE` and its stage is never served from the cache nor
  stored in it (:func:`uncacheable`), rather than keyed by a text that misses a
  change.  An object whose ``repr`` is only its type and address counts by its
  instance state (``ConfigParser``, ``string.Template``, a ``DataLoader``; a
  ``torch.Generator`` by ``get_state()``), a lock by its type; one with no state
  to read (a connection) makes its component uncacheable the same way.  Strings
  in reached code name globals too: ``@THRESH`` (pandas ``query``/``eval``), a
  frame, table or array a DuckDB query names, and, in code that calls
  ``eval``/``exec``, every global its strings name; code that calls the builtin
  ``eval``/``exec`` counts every global of its module besides (the text may
  come from a parameter: ``eval(ctx.params["expr"])`` reading ``SCALE``).  A stage that reads the
  script's namespace by a computed name (``globals()["norm_" + m]``) counts every
  function and class of the script (so does ``getattr(sys.modules[__name__], ...)``,
  ``importlib.import_module(__name__)``); the attributes of a reached local module's
  classes count by their value now (a classmethod the script's top calls sets them).
  A function, class or module met inside a value is recorded by name and
  followed, a reached module's values too (a local module's registry holding a
  script function or class counts by their code; the cells of a reached module's
  functions made by a factory, ``register, get = make_registry()``, count as
  values); code that reads
  ``__subclasses__`` counts the user subclasses loaded of every reached class.  An
  object put in ``sys.modules`` in place of a module counts by value where it is
  imported.  Code that reads ``argv`` or calls ``parse_args`` counts the script's
  arguments (``sys.argv[1:]``).
* **Library settings.**  numpy's print options and floating-point error
  handling, pandas options and polars' ``Config``, for each of them imported,
  count where they differ from the library's defaults (``"pandas settings"``):
  a call at the script's top sets them without assigning a value the walk
  could follow, and they change what a stage outputs.  polars' random seed
  cannot be read back: each ``set_random_seed(...)`` call in the script's
  source counts by its text, and the globals it names by value.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import datetime
import decimal
import dis
import enum
import functools
import gc
import glob
import hashlib
import importlib.machinery
import importlib.util
import inspect
import io
import itertools
import json
import logging
import os
import random
import re
import sys
import struct
import sysconfig
import textwrap
import threading
import types
import uuid
import zipfile
import zipimport
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

from hetflow.operators.location import (Location, StorageError, carries_settings, check_bucket,
                                        glob_files, glob_start, is_object_store, object_versions, redact, resolve,
                                        storage_error)

UNCACHEABLE = "uncacheable "
"""The prefix of a code fingerprint's component naming a value that cannot be digested (:func:`uncacheable`)."""

NO_MATCH = "<no match>"
"""The value :func:`file_fingerprint` records for a glob that matched nothing."""

_SIMPLE = (type(None), bool, int, float, complex, str, bytes, PurePath, decimal.Decimal, uuid.UUID,
           datetime.date, datetime.time, datetime.timedelta)
_LOAD_OPS = {"LOAD_GLOBAL", "LOAD_NAME"}
_NAN_BITS = struct.pack("<d", float("nan"))
"""A NaN other than this one (``-nan``) counts by its bits: its ``repr`` is ``nan``'s."""


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _external_dirs() -> tuple[str, ...]:
    """The installation's directories (real paths): once per process for its prefixes, not at every walk
    (two per task in the orchestrator)."""
    return _external_dirs_of(sys.prefix, sys.base_prefix, sys.exec_prefix)


@functools.lru_cache(maxsize=4)
def _external_dirs_of(*prefixes: str) -> tuple[str, ...]:
    dirs = {*prefixes, *sysconfig.get_paths().values()}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def _file_of(obj: Any, realpath: Callable[[str], str] = os.path.realpath) -> str | None:
    try:
        path = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except (TypeError, OSError):
        return None
    return realpath(path) if path else None


def _target(func: Any) -> Any:
    """The function (or the class of a callable instance) that defines a stage's home module and directory."""
    while isinstance(func, functools.partial):
        func = func.func
    func = getattr(func, "__func__", func)
    return func if isinstance(func, (types.FunctionType, type)) else type(func)


def _default_roots(func: Callable[..., Any]) -> list[str]:
    """The stage's directory or the top of its package; for a ``__main__`` function without a file (a
    notebook cell, stdin, ``-c``: shipped by value, hashed by bytecode like a script's functions), the
    working directory, where its local modules are imported from (``sys.path``'s ``''``)."""
    path = _file_of(_target(func))
    if getattr(_target(func), "__module__", None) == "__main__" and (path is None or not os.path.isfile(path)):
        return [os.getcwd()]
    if path is None:
        return []
    root = os.path.dirname(path)
    while os.path.exists(os.path.join(root, "__init__.py")) and os.path.dirname(root) != root:
        root = os.path.dirname(root)
    return [root]


_USER_MODULES: dict[tuple[tuple[str, ...], ...], dict[str, tuple[Any, str, bool]]] = {}
"""Whether each imported module is user code (:meth:`_Walker.user_namespaces`), by the walk's roots: a module
object is classified once by its file's real path, not again by every stage's walk (each walk looks at every
module in ``sys.modules``).  A module imported again (a new object) or from another file is classified anew."""

_USER_NAMESPACES: dict[tuple[tuple[str, ...], ...], tuple[list[tuple[str, Any]], list[tuple[str, str, Any]]]] = {}
"""The user modules' ``(name, file, namespace)`` by the walk's roots, with the ``sys.modules`` items they were
found in: a walk finding the same items (the same names, the same module objects) takes the list as it is.
Every stage's key walks once or twice, and looking at each of a few thousand modules again cost about a
millisecond a walk; comparing the items is a C loop."""


class _Walker:
    """Follows the stage function through the user code it reaches; fills ``parts``."""

    def __init__(self, func: Callable[..., Any], roots: Sequence[str]) -> None:
        self.home = getattr(_target(func), "__module__", None)
        editable, self.installed_local = _local_installs()
        self.roots = tuple(os.path.join(os.path.realpath(r), "") for r in roots) + editable
        self.external = _external_dirs()
        self.parts: dict[str, set[str]] = {}
        self.seen: set[int | str] = set()
        self.queue: list[Any] = []
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}
        self.user_objects: dict[int, tuple[Any, bool]] = {}
        self.realpaths: dict[str, str] = {}
        self.func = func
        self.names: set[str] = set()
        """Every name the reached code reads (names and string constants in code, identifiers in sources)."""
        self.external_tops: set[str] = set()
        """The top-level names of the external packages the reached code uses."""
        self.script_by_name = False
        """The reached code of the script reads its own namespace by a computed name (``globals()[...]``)."""
        self.shortened: set[str] = set()
        """Types of the values met since the last component whose text form is shortened (``...``)."""
        self.uncacheable: dict[str, set[str]] = {}
        """``{component: types}`` of the components that hold such a value (see :func:`uncacheable`)."""
        self.classes: list[type] = []
        """The classes hashed (:meth:`visit_class`): whose subclasses count when ``__subclasses__`` is read."""
        self.valued: set[tuple[str, int]] = set()
        """``(component, id of the value)`` of the module values digested: each once, however often they are
        looked at again (:meth:`reached_by_value`)."""
        self.evaluated: set[int] = set()
        """The namespaces whose every global counts (:meth:`every_global`), by identity."""
        self.library_state: set[tuple[int, str]] = set()
        """``(id of a library module, global)`` that user code changes only by calling a function of that
        library (``psutil.process_iter()`` stores its cache of Process objects in ``psutil._pmap``): counted by
        value, except when it holds only the library's own objects (:func:`_library_own`), which count by
        type -- those (processes, handles) are its state in this process, not something a rank reads, and
        their text changes as they live (a process's status), so a key made from it would never be made
        again and a stage waiting for its slot would be stopped as changed."""
        self.library_calls: dict[tuple[int, str], set[str]] = {}
        """The calls that set each global of :attr:`library_state`, as their text and the values of the names
        they pass: what a global counted by type was made from (``lib.use("planck")`` storing a
        ``lib.Cosmology``), a component of its own (``NAME as the calls set it``) that a rank does not digest."""
        self.library_local: set[tuple[int, str]] = set()
        """The globals of :attr:`library_state` that a call inside a function sets from a name the function binds
        (its parameter: ``def setup(h0): lib.set_h0(h0)``), whose value the call's text does not show: one that
        holds a single object of the library's (a setting, not a cache of many) counts by value."""
        self.library_held: dict[str, frozenset[int]] = {}
        """What each library module holds, by identity (:func:`_kept_by_library`), found once per walk."""
        self.outsiders: dict[str, bool] = {}
        """Whether each module met outside user code was loaded from a file outside the installation (:meth:`outside`)."""

    def run(self) -> dict[str, str]:
        if isinstance(self.func, types.FunctionType):
            self.queue.append(self.func)
        else:  # a partial, a bound method, an instance with __call__: hashed as a value, what it names followed
            self.add("stage", _sha(self.value(self.func)))
        patches = self.patch_sites()
        applied: set[tuple[int, str]] = set()
        while True:
            self.drain()
            found = [(owner, attr) for owner, attr in patches
                     if (id(owner), attr) not in applied and self.patch_counts(owner, attr)]
            if not found and self.reached_by_value():
                continue  # a module's value held code (a registry, a subclass): what that reads counts too
            if not found:
                break
            for owner, attr in found:  # a patched value may reach more code: drain again
                applied.add((id(owner), attr))
                value = vars(owner).get(attr, _ABSENT)
                if (id(owner), attr) in self.library_state and _library_own(value, owner.__name__.partition(".")[0]) \
                        and not ((id(owner), attr) in self.library_local and not isinstance(value, _CONTAINER_TYPES)):
                    value = library_kept(value)  # its cache (psutil's _pmap): by type, and by the calls made
                    self.add(f"{_owner_name(owner)}.{attr} as the calls set it",
                             _sha("\n".join(sorted(self.library_calls.get((id(owner), attr), ())))))
                text = "<absent>" if value is _ABSENT else self.value(value)
                if isinstance(value, types.FunctionType):  # a.f.gain = v: the function's own attributes
                    text += " attributes " + self.value({k: v for k, v in vars(value).items()
                                                         if not k.startswith("__")})
                self.add(f"{_owner_name(owner)}.{attr}", _sha(text))
        self.library_settings()  # a formatter function in a setting, a global a seed call names: followed
        self.drain()
        self.library_calls_at_top()
        self.module_values()
        self.command_line()
        for key, kinds in self.uncacheable.items():
            cut = sorted(k for k in kinds if not k.startswith(_OPAQUE))
            opaque = sorted(k[len(_OPAQUE):] for k in kinds if k.startswith(_OPAQUE))
            said = ([f"a {' and a '.join(cut)} whose text form is shortened"] if cut else []) + \
                ([f"a {' and a '.join(opaque)} whose text form is only its type and address, with no state hetflow "
                  "can read"] if opaque else [])
            self.parts[f"{UNCACHEABLE}{key}"] = {f"holds {' and '.join(said)}"}
        return {key: next(iter(d)) if len(d) == 1 else _sha(" ".join(sorted(d))) for key, d in sorted(self.parts.items())}

    def reached_by_value(self) -> bool:
        """Count the values of the reached modules (:meth:`module_values`) and the subclasses of the reached
        classes (:meth:`subclasses`); whether that reached code not followed yet: a function or class of the
        script kept in a local module's registry (``@reg.register("a")``, ``__init_subclass__``) counts by its
        code and its class attributes, as when a stage names it."""
        self.module_values()
        self.subclasses()
        self.queue = [o for o in self.queue if (o.name if isinstance(o, _Located) else id(o)) not in self.seen]
        return bool(self.queue)

    def subclasses(self) -> None:
        """A stage whose reached code reads ``__subclasses__`` counts the user subclasses loaded now of every
        reached user class (those of a reached module too): ``Base.__subclasses__()[0]`` may be any of them."""
        if "__subclasses__" not in self.names:
            return
        classes = list(self.classes)
        for key in [k for k in self.parts if k.startswith("module ")]:
            module = sys.modules.get(key[len("module "):])
            if isinstance(module, types.ModuleType):
                classes.extend(v for v in list(vars(module).values())
                               if isinstance(v, type) and v.__module__ == module.__name__)
        for cls in classes:
            try:
                found: list[type] = type.__subclasses__(cls)
            except TypeError:  # not a plain class
                continue
            for sub in found:
                if self.is_user_object(sub):
                    self.follow(sub)

    def module_values(self) -> None:
        """The values, as they are now, of the globals of reached user modules that the reached code names:
        however the script changed one (``d["k"] = v`` through any name or function, ``d |= …``,
        ``operator.setitem``), the key has what the stage will read."""
        script = getattr(_target(self.func), "__globals__", None)
        if self.script_by_name and isinstance(script, dict) and script.get("__name__") == self.home:
            # a function or class picked by a name built at run time (globals()["norm_" + method]): every one
            # the script defines counts, and what it reaches
            for value in list(script.values()):
                if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == self.home:
                    self.follow(value)
            self.drain()
        for key in [k for k in self.parts if k.startswith("module ")]:
            name = key[len("module "):]
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            if module is None or name in (self.home, "__main__") or not isinstance(path, str) \
                    or not self.is_user(self.realpath(path)):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == name and not attr.startswith("__"):
                    self.class_values(name, value)
                if isinstance(value, types.FunctionType) and value.__closure__ and self.reads(attr) and \
                        value.__module__ == name and "__wrapped__" not in vars(value):
                    # register, get = make_registry(): the table in their cells (not a decorator's wrapper)
                    cells = [c.cell_contents for c in value.__closure__ if _filled(c)]
                    self.add_value(f"{name}.{attr}() closure", cells)
                if attr.startswith("__") or not self.reads(attr) or isinstance(value, (types.ModuleType, type)) \
                        or _is_code_like(value):
                    continue
                self.add_value(f"{name}.{attr}", value)
        script = getattr(_target(self.func), "__globals__", None)
        if ANY_NAME in self.names and isinstance(script, dict) and script.get("__name__") == self.home:
            for attr, value in list(script.items()):  # the script's own, read by a computed name
                if attr.startswith("__") or isinstance(value, (types.ModuleType, type)) or _is_code_like(value) \
                        or type(value).__module__.partition(".")[0] == "hetflow" or attr in self.parts:
                    continue
                self.add(attr, _sha(self.value(value)))

    def command_line(self) -> None:
        """The script's command-line arguments (``sys.argv[1:]``, what the ranks get too) when the reached code
        reads them: names ``argv`` (``sys.argv[1]``, ``from sys import argv``) or parses them (``parse_args()``).
        The script's path (``argv[0]``) does not count."""
        if _ARGV_READERS & self.names:
            self.add("sys.argv[1:]", _sha(self.value(list(sys.argv[1:]))))

    def library_settings(self) -> None:
        """Process-wide settings of numpy, pandas and polars that differ from the library's defaults (print
        options, floating-point error handling, pandas options, polars' ``Config``), for each of them that is
        imported: the script's top level sets them with a call (``np.set_printoptions(precision=2)``,
        ``pd.set_option(...)``) that assigns no global, and they change what a stage outputs (the text of its
        numbers, a warning that raises).  Settings left at their defaults add nothing to the key.  polars'
        random seed cannot be read back: each ``set_random_seed(...)`` call in the script's source counts by its
        text and the values of the globals it names; so does every other seeding call (``np.random.seed``,
        ``random.seed``, ``torch.manual_seed``): adding one to a script whose first run had none changes no
        state a record could hold."""
        for name, read in (("numpy", _numpy_settings), ("pandas", _pandas_settings), ("polars", _polars_settings)):
            module = sys.modules.get(name)
            if not isinstance(module, types.ModuleType) or _deferred(module):
                continue
            changed = read(module)
            if changed:
                self.add(f"{name} settings", _sha(self.value(changed)))
        script = getattr(_target(self.func), "__globals__", None)
        if not isinstance(script, dict) or script.get("__name__") != self.home:
            return
        path = script.get("__file__")
        if not isinstance(path, str):
            return
        try:
            source = Path(path).read_bytes()
        except OSError:
            return
        calls = _seed_calls(source, path)
        if calls:
            for _, names, method_of in calls:
                if _is_generator(script.get(method_of)):
                    continue  # RNG.seed(args.seed) in the main block: a stage reading RNG is refused
                for name in names:
                    if name in script:
                        self.global_value(name, script)
            self.add("seed calls", _sha(repr(sorted(text for text, _, _ in calls))))

    def library_calls_at_top(self) -> None:
        """For each installed library the reached code uses, the calls into it that the top level of the script
        and of the local modules makes as statements of their own (``fakelib.register("planck", 11)``, also
        inside a top-level ``if``/``with``/``try``/loop, not in the ``__main__`` block), directly or through a
        local function whose code names the library (``labsetup.init(11)``), or handing on a library's function
        (``list(map(lib.register, ...))``, ``OPS["reg"](...)``), or through an object (``reg.add(...)`` on a
        library's object, ``setup.apply(11)`` on a local one, counted with its value; a ``partial`` of the
        library's function, with the arguments it binds; ``SETUP = Setup(11)`` whose ``__init__`` registers):
        by their text and the values of the plain names
        they pass (a value of another kind by its type only; the user's code handed over by its code: a function,
        a class, a bound method or callable object of the user's class with the object's value, a ``partial``;
        a class whose library base registers it, ``class Sq(lib.Plugin)``).  Such a call may change the
        library's state in place (``REGISTRY[name] = Cosmology(h0)``), which no global the key follows shows;
        the library's state itself is not followed (``re._cache`` differs between processes).  The standard
        library is not a library here (its calls count as before: seeds, settings)."""
        if not self.external_tops:
            return
        calls: dict[str, set[str]] = {}
        reaching: dict[tuple[int, bool], frozenset[str]] = {}
        handed: list[Any] = []
        for _, path, namespace in self.user_namespaces():
            try:
                source = Path(path).read_bytes()
            except (OSError, TypeError):
                continue
            found = list(_top_calls(source, path))
            if not found:
                continue
            scope = {**_imported_names(source, path, namespace.get("__package__")), **namespace}
            resolved = [_resolve_call(scope, chain) for _, chain, *_ in found]
            # hetflow's own calls (pipe.stage(make(k), ...), hf.Pipeline(...)) are no calls into a library: each
            # stage they declare has its code in its own key.  The other calls of a statement that declares count
            # (pipe.stage(make(lib.register("a", K)), ...)), a local function among them by what its own body runs
            # (make registering K), not by the stage code it only defines: following that put every loop-made
            # stage's code in every stage's key
            declaring = {entry[0] for entry, called in zip(found, resolved) if _is_hetflow(called)}
            for (text, chain, names, decorated, assigned, passed), called in zip(found, resolved):
                if _is_hetflow(called):
                    continue
                # no walrus here: its name would be a cell of this frame holding the last value, which
                # _held_elsewhere takes for a holder of the user's function (W = list(map(weight, R)))
                values = {n: v for n, v in ((n, _dotted(scope, n)) for n in names) if v is not _ABSENT}
                for name in names:  # list(map(reg.add, ...)): the method an object's name leads to, found statically
                    first, _, rest = name.partition(".")
                    if rest and (name not in values or isinstance(values[name], (staticmethod, classmethod))):
                        method = _method_of(scope.get(first, _ABSENT), tuple(rest.split(".")))
                        if isinstance(method, types.FunctionType):
                            values[name] = method
                libraries = self.called_libraries(called, reaching, defined=text not in declaring)
                if not (isinstance(called, (types.FunctionType, type)) and self.is_user_code(called)):
                    libraries |= self.handed_libraries(values.values())  # map(lib.f, ...): not make(np.mean)
                if _runs_what_it_is_handed(called):  # list(map(labsetup.init, PAIRS)): map runs the local function
                    for name in passed:
                        if self.user_code_in([values.get(name)]):
                            libraries |= self.called_libraries(values[name], reaching, defined=False)
                libraries &= self.external_tops
                if not libraries or (text.rpartition(" ; ")[2].startswith(f"class {decorated}(")
                                     and not _receives_subclasses(called)):
                    continue  # class Net(torch.nn.Module): nothing of the library receives Net
                code = self.user_code_in(values.values())  # lib.register_hook(my_fn), PAIR = (sq, 1): through it
                code += [type(v) for v in values.values() if self.is_user_instance(v)
                         and _kept_by_library(called, [v], self.library_held)]  # lib.add_hook(S.apply): S's class
                results = [scope.get(n) for n in assigned]
                if assigned and not any(isinstance(r, types.FunctionType) for r in results) \
                        and not _kept_by_library(called, results, self.library_held):
                    # W = np.arange(4): a value of the script's own, counted where a stage reads W; so is
                    # W = np.array([weight(i) for i in R]) (weight called: its results are handed over, and they
                    # are W's), and VF = np.vectorize(f), a wrapper of the user's code that the library does not
                    # keep, nor the code it wraps (a stage reaching VF follows f)
                    # (or df.pipe(add_col): pandas runs add_col at once and keeps nothing of it) -- unless the
                    # called function itself stores into its module's state (rid = lib.register_id("a", 11),
                    # returning a fresh handle: what it stored counts as any call changing the library's state)
                    given = [v for n, v in values.items() if n in passed]
                    own = [c for c in code if any(c is v for v in given)]
                    if not _changes_module_state(called) and not self.runs_library_state_change(called) and \
                            not (_runs_what_it_is_handed(called)
                                 and any(self.runs_library_state_change(c) for c in own)) and \
                            not _held_elsewhere(own, results, [
                            values, code, own, given, scope, *(n for _, _, n in self.user_namespaces())]):
                        continue
                # counted when assigned: what the library keeps, a call handing it the user's code
                # (sq = lib.model("sq")(_sq)), or a decorator a library's factory made (D = lib.model("sq", 2))
                said = " ".join([text, *(f"{n}={self.handed_text(v, called, libraries)}" for n, v in values.items())])
                for library in libraries:
                    calls.setdefault(library, set()).add(said)
                handed.extend(code)
                given = namespace.get(decorated) if decorated else None  # what the library holds now: its code
                given = given if isinstance(given, (types.FunctionType, type)) else _wrapped(given)
                if isinstance(given, (types.FunctionType, type)):
                    handed.append(given)
        for library, said in sorted(calls.items()):
            self.add(f"calls into {library} at the top level", _sha("\n".join(sorted(said))))
        for given in handed:  # @lib.register("loss") def mse(...), lib.add_hook(fn): reached through the library
            self.follow(given)
        if handed:
            self.drain()

    def runs_library_state_change(self, target: Any, depth: int = 0) -> bool:
        """Whether calling the user's function, method or class (its construction) runs a library function that
        stores into its module's state (:func:`_changes_module_state`): ``SETUP = Setup(11)`` whose ``__init__``
        calls ``lib.register("a", h0)``, assigned as a fresh object of the user's; a few levels deep."""
        if isinstance(target, types.MethodType):
            target = target.__func__
        functions: list[Any] = []
        if isinstance(target, type) and self.is_user_code(target):
            for klass in target.__mro__[:-1]:
                for name in ("__new__", "__init__", "__post_init__"):
                    method = vars(klass).get(name)
                    functions.append(method.__func__ if isinstance(method, (staticmethod, classmethod)) else method)
        elif isinstance(target, types.FunctionType) and self.is_user_code(target):
            functions = [target]
        else:
            return False
        for function in functions:
            if not isinstance(function, types.FunctionType):
                continue
            if not self.is_user_code(function):
                if _changes_module_state(function):
                    return True
                continue
            for named in _named_objects(function.__code__, function.__globals__):
                if isinstance(named, (types.FunctionType, type)) and self.is_user_code(named):
                    if depth < 3 and named is not target and self.runs_library_state_change(named, depth + 1):
                        return True
                elif self.called_libraries(named, {}) and _changes_module_state(named):
                    return True
        return False

    def user_code_in(self, values: Iterable[Any], depth: int = 0) -> list[Any]:
        """The user's functions and classes among ``values`` and in the lists, tuples, sets and dicts they are
        (a few levels deep): ``lib.register_obj("sq", PAIR)`` with ``PAIR = (sq, 1)`` hands the library ``sq``."""
        found: list[Any] = []
        for value in itertools.islice(values, 1024):
            if isinstance(value, (types.FunctionType, type)):
                if self.is_user_code(value):
                    found.append(value)
            elif isinstance(value, (types.MethodType, functools.partial)):  # S.apply, partial(power, p=2)
                inner = value.__func__ if isinstance(value, types.MethodType) else value.func
                if self.user_code_in([inner], depth + 1):
                    found.append(value)
            elif depth < 3 and (inner := _wrapped(value)) is not None:  # lru_cache(sq), np.vectorize(f)
                found.extend(self.user_code_in([inner], depth + 1))
            elif depth < 3 and isinstance(value, (list, tuple, set, frozenset)):
                found.extend(self.user_code_in(list(value), depth + 1))
            elif depth < 3 and isinstance(value, dict):
                found.extend(self.user_code_in(list(value.values()), depth + 1))
        return found

    def handed_libraries(self, values: Iterable[Any], depth: int = 0) -> frozenset[str]:
        """The installed libraries whose functions or classes a top-level statement hands on (``list(map(
        lib.register, names, h0s))``) or calls out of a container (``OPS = {"reg": lib.register}``, then
        ``OPS["reg"]("a", 11)``): the call runs them.  The user's own functions handed on do not count here (a
        stage declared as ``partial(fit, k=1)`` is no call into what ``fit`` names)."""
        found: set[str] = set()
        for value in itertools.islice(values, 1024):
            if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
                if not (isinstance(value, types.FunctionType) and self.is_user_code(value)) and not _is_hetflow(value):
                    found |= self.called_libraries(value, {})
            elif depth < 3 and isinstance(value, (list, tuple)):
                found |= self.handed_libraries(list(value), depth + 1)
            elif depth < 3 and isinstance(value, dict):
                found |= self.handed_libraries(list(value.values()), depth + 1)
        return frozenset(found)

    def is_user_instance(self, value: Any) -> bool:
        """Whether ``value`` is an object of a class of the user (not a function, class or module)."""
        kind = type(value)
        return not isinstance(value, (types.FunctionType, types.MethodType, type, types.ModuleType)) and \
            self.is_user_object(kind)

    def is_user_code(self, value: Any) -> bool:
        """Whether a function or class is the user's (defined in the script or a local module)."""
        code = getattr(value, "__code__", None)
        path = code.co_filename if code is not None else getattr(sys.modules.get(value.__module__), "__file__", None)
        if isinstance(path, str) and self.is_user(self.realpath(path)):
            return True
        if isinstance(value, type):  # a script's class: __module__ "__main__" names hetflow's own entry point once
            # runpy.run_path is over, so by where its methods (its own, else its bases') were compiled
            methods = (f for k in value.__mro__[:-1] for f in list(vars(k).values())
                       if isinstance(f, types.FunctionType))
            first = next(methods, None)
            return first is not None and self.is_user(self.realpath(first.__code__.co_filename))
        return False

    def handed_text(self, value: Any, called: Any, libraries: frozenset[str]) -> str:
        """How a value a top-level call into ``libraries`` passes counts: plain data by its value, and so an
        object of the library's own type that the library keeps (``c = lib.Cosmology(70)``,
        ``lib.register_obj("planck", c)``, then ``c.h0 = 11``: what the stage reads through the library) unless
        its text is not faithful (an address: by its type, as before, not made uncacheable).  Any other object
        counts by its type: its text may be an address, or change as it lives (a pool, a session), unless it
        is the library's object whose method the call runs and that method stores into its module's state
        (``b = lib.Builder().h(11); b.install()``): what it stores comes from the object."""
        if _plain(value):
            return self.value(value)
        if isinstance(value, (list, tuple, dict)) and self.user_code_in([value]):
            return self.code_and_plain_text(value)  # PAIR = (sq, 1): sq by its name (its code counts), 1 by value
        if isinstance(value, (types.MethodType, functools.partial)) and self.user_code_in([value]):
            return self.follow(value)  # S.apply: its function's code and S's value; a partial's arguments
        if isinstance(value, functools.partial) and self.called_libraries(value, {}) & libraries:
            return self.follow(value)  # P = partial(lib.register, "a"), then P(11): the arguments P binds
        if self.is_user_instance(value) and isinstance(called, types.FunctionType) and self.is_user_code(called) \
                and _method_of(value, (called.__name__,)) is called:
            return f"{self.follow(type(value))} {self.value(value)}"  # setup.apply(): what setup holds
        if self.is_user_instance(value) and _kept_by_library(called, [value], self.library_held):
            return f"{self.follow(type(value))} {self.value(value)}"  # lib.add_hook(H): what H holds
        receiver = isinstance(called, types.FunctionType) and not self.is_user_code(called) and \
            _method_of(value, (called.__name__,)) is called and _changes_module_state(called)
        home = type(value).__module__.partition(".")[0]
        if not receiver and (home not in libraries or not _kept_by_library(called, [value], self.library_held)):
            return type(value).__qualname__
        before = set(self.shortened)
        text = self.value(value)
        if set(self.shortened) - before:
            self.shortened.intersection_update(before)
            return type(value).__qualname__
        return text

    def code_and_plain_text(self, value: Any, depth: int = 0) -> str:
        """A container's text for :meth:`handed_text`: plain values by value, the user's functions and classes by
        their names (their code counts as reached code), anything else by its type."""
        if _plain(value):
            return self.value(value)
        if isinstance(value, (types.FunctionType, type)) and self.is_user_code(value):
            return f"<{value.__module__}.{value.__qualname__}>"
        if depth < 3 and isinstance(value, (list, tuple)) and len(value) <= 1024:
            return f"{type(value).__name__}[{', '.join(self.code_and_plain_text(v, depth + 1) for v in value)}]"
        if depth < 3 and isinstance(value, dict) and len(value) <= 1024:
            return "dict{" + ", ".join(f"{self.code_and_plain_text(k, depth + 1)}: "
                                       f"{self.code_and_plain_text(v, depth + 1)}" for k, v in value.items()) + "}"
        return type(value).__qualname__

    def called_libraries(self, target: Any, reaching: dict[tuple[int, bool], frozenset[str]], depth: int = 0,
                         defined: bool = True) -> frozenset[str]:
        """The top-level packages outside the user code that calling ``target`` calls into: its own (a module,
        function or class of an installed library), or those a local function's code names (its globals: the
        library's modules, functions and classes, and the local functions it calls, a few levels deep); with
        ``defined=False``, only what its own body runs (its comprehensions too), not the functions it defines
        (a stage factory's stage)."""
        if isinstance(target, types.FunctionType) and self.is_user(self.realpath(target.__code__.co_filename)):
            if (id(target), defined) not in reaching:
                reaching[id(target), defined] = frozenset()  # a recursive helper: what it names is found once
                found: set[str] = set()
                if depth < 4:
                    for name in _code_globals(target.__code__, defined):
                        found |= self.called_libraries(target.__globals__.get(name), reaching, depth + 1)
                reaching[id(target), defined] = frozenset(found)
            return reaching[id(target), defined]
        if isinstance(target, type) and self.is_user_code(target):
            # SETUP = Setup(11): what the class's construction runs (its __new__, __init__, __post_init__, its
            # bases' too: a library base's by that library), which may register into a library
            if (id(target), defined) not in reaching:
                reaching[id(target), defined] = frozenset()
                found = set()
                if depth < 4:
                    for klass in target.__mro__[:-1]:
                        for name in ("__new__", "__init__", "__post_init__"):
                            method = vars(klass).get(name)
                            method = method.__func__ if isinstance(method, (staticmethod, classmethod)) else method
                            if isinstance(method, types.FunctionType):
                                found |= self.called_libraries(method, reaching, depth + 1)
                reaching[id(target), defined] = frozenset(found)
            return reaching[id(target), defined]
        if isinstance(target, types.MethodType):  # a bound method a name holds: its function's
            return self.called_libraries(target.__func__, reaching, depth, defined)
        if isinstance(target, functools.partial):  # P = partial(lib.register, "a"); P(11): the function it binds
            return self.called_libraries(target.func, reaching, depth, defined)
        if isinstance(target, types.ModuleType):
            home = target.__name__
        elif isinstance(target, (types.FunctionType, types.BuiltinFunctionType, type)):
            home = getattr(target, "__module__", None) or ""
        elif isinstance(target, (list, tuple, dict)) and depth < 4:
            # REGS["main"].add(...) with REGS = {"main": lib.Registry()}: whose objects the container holds
            found = set()
            for item in itertools.islice(target.values() if isinstance(target, dict) else target, 100):
                if not isinstance(item, (types.ModuleType, *_SIMPLE)):
                    found |= self.called_libraries(item, reaching, depth + 1, defined)
            return frozenset(found)
        elif target is not None and depth < 4:
            # an object called or whose method in C is called (reg.add(...) where add is not Python): its
            # __call__ when it is Python code, else its class says whose it is (a library's object: that library)
            call = inspect.getattr_static(type(target), "__call__", None)
            if isinstance(call, types.FunctionType):
                return self.called_libraries(call, reaching, depth + 1, defined)
            kind = type(target)
            return frozenset() if self.is_user_code(kind) else self.called_libraries(kind, reaching, depth + 1, defined)
        else:
            return frozenset()
        top = home.partition(".")[0]
        if not top or top in sys.stdlib_module_names or top == "builtins":
            return frozenset()
        path = getattr(sys.modules.get(home), "__file__", None)
        return frozenset() if isinstance(path, str) and self.is_user(self.realpath(path)) else frozenset({top})

    def class_values(self, module: str, cls: type) -> None:
        """The values, as they are now, of a reached module's class attributes that the reached code names: its
        source counts already, but not what the script's top set there since (``Model.configure(3)``, a
        classmethod setting ``cls.SCALE``)."""
        for attr, value in list(vars(cls).items()):
            if attr.startswith("__") or not self.reads(attr) or _is_code_like(value) or \
                    isinstance(value, (staticmethod, classmethod, property, functools.cached_property)):
                continue
            self.add_value(f"{module}.{cls.__qualname__}.{attr}", value)

    def add_value(self, key: str, value: Any) -> None:
        """Record a module's or a class's value, once per walk."""
        if (key, id(value)) not in self.valued:
            self.valued.add((key, id(value)))
            self.add(key, _sha(self.value(value)))

    def reads(self, attr: str) -> bool:
        """Whether the reached code may read a name: it names it, or reads names computed at run time."""
        return attr in self.names or ANY_NAME in self.names

    def drain(self) -> None:
        while self.queue:
            obj = self.queue.pop()
            key = obj.name if isinstance(obj, _Located) else id(obj)
            if key not in self.seen:
                self.seen.add(key)
                self.visit(obj)

    def add(self, key: str, digest: str) -> None:
        """Record a component; two closures of one factory share a name, so a name may collect several digests.
        A value met while its digest was made that could not be digested faithfully is charged to it."""
        self.parts.setdefault(key, set()).add(digest)
        if self.shortened:
            self.uncacheable.setdefault(key, set()).update(self.shortened)
            self.shortened.clear()

    # ------------------------------------------------------------ classification
    def realpath(self, path: str) -> str:
        if path not in self.realpaths:
            self.realpaths[path] = os.path.realpath(path)
        return self.realpaths[path]

    def is_user(self, path: str | None) -> bool:
        if path is not None and path.startswith(self.installed_local):
            return True  # a package installed from a local directory: its files count like local modules
        if path is None or "site-packages" in path or "dist-packages" in path:
            return False
        return path.startswith(self.roots) and not path.startswith(self.external)

    def is_user_object(self, obj: Any) -> bool:
        """Under ``__main__`` run by runpy, ``inspect`` finds the wrong file for a class: compare module names first."""
        if getattr(obj, "__module__", None) == self.home:
            return True
        if id(obj) not in self.user_objects:  # memoised per walk; the object is kept so that its id is not reused
            self.user_objects[id(obj)] = (obj, self.is_user(_file_of(obj, self.realpath)))
        return self.user_objects[id(obj)][1]

    def module_of(self, obj: Any) -> types.ModuleType | None:
        return sys.modules.get(getattr(obj, "__module__", None) or "")

    def name(self, obj: Any) -> str:
        """A component name that does not depend on the script's module name."""
        if isinstance(obj, types.ModuleType):
            return f"module {obj.__name__}"
        prefix = "" if obj.__module__ == self.home else f"{obj.__module__}."
        if isinstance(obj, type):
            return f"class {prefix}{obj.__qualname__}"
        return f"{prefix}{obj.__qualname__}()"

    def follow(self, obj: Any, stack: tuple[int, ...] = ()) -> str:
        """Queue a function, class or module for hashing; return how a value refers to it."""
        if isinstance(obj, types.MethodType):
            return f"{self.follow(obj.__func__)} bound to {self.value(obj.__self__, stack)}"
        if isinstance(obj, functools.partial):
            return (f"partial({self.follow(obj.func, stack)}, {self.value(obj.args, stack)}, "
                    f"{self.value(obj.keywords, stack)})")
        wrapped = _wrapped(obj)
        if wrapped is not None:
            return self.wrapper(obj, wrapped, stack)
        if isinstance(obj, types.ModuleType):
            if self.is_user(getattr(obj, "__file__", None)):
                self.queue.append(obj)
            else:  # the module object itself: one loaded without sys.modules (exec_module) is known only so
                self.external_module(obj.__name__, vars(obj) if not _deferred(obj) else None)
            return f"module {obj.__name__}"
        if self.is_user_object(obj):
            if obj.__module__ == self.home or self.module_of(obj) is None:
                self.queue.append(obj)
            else:
                self.queue.append(self.module_of(obj))  # hashed whole, with everything in it
            return self.name(obj)
        self.external_module(obj.__module__ or "", obj.__globals__ if isinstance(obj, types.FunctionType) else None)
        return f"{obj.__module__}.{getattr(obj, '__qualname__', '?')}"

    def external_module(self, name: str, namespace: Mapping[str, Any] | None = None) -> None:
        """A module that is not user code: one loaded from a file outside the installation counts by content
        (:meth:`outside`), a package with a version by its version, the standard library not at all."""
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top in ("builtins", ""):
            return
        self.external_tops.add(top)
        if namespace is None:
            module = sys.modules.get(name)
            namespace = vars(module) if isinstance(module, types.ModuleType) and not _deferred(module) else None
        if self.outside(name, namespace):
            return
        package = sys.modules.get(top)
        if top != name and isinstance(package, types.ModuleType) and not _deferred(package) and \
                self.outside(top, vars(package)):
            return  # a part without a file of a package loaded from outside: the package counts by content
        version = getattr(package, "__version__", None)
        if isinstance(version, str):
            self.parts[f"module {top}"] = {version}

    def outside(self, name: str, namespace: Mapping[str, Any] | None) -> bool:
        """Whether module ``name`` (its namespace, or its spec and file) was loaded from a file outside the
        roots and outside the installation (a ``sys.path``/``PYTHONPATH`` folder elsewhere, a zip archive, a
        file of any name given to ``SourceFileLoader``, an extension module, a module ``exec_module`` made
        without ``sys.modules``); if so it counts by that file's content, whatever its version, and the
        imports in its source are followed.  hetflow counts by its version."""
        if namespace is None or name.partition(".")[0] == "hetflow":
            return False
        if name in self.outsiders:
            return self.outsiders[name]
        path, archive = _module_file(namespace)
        where = self.realpath(archive or path) if path else None
        self.outsiders[name] = counted = where is not None and not where.startswith(self.external) and \
            "site-packages" not in where and "dist-packages" not in where
        if not counted or path is None:
            return False
        content = _module_content(path, archive)
        if content is None:
            self.parts[f"{UNCACHEABLE}module {name}"] = {f"is loaded from {path}, which hetflow cannot read"}
            return True
        digest, source = content
        self.add(f"module {name}", digest)
        if source is not None:  # Python source, whatever the file's name: its names and imports count
            self.names.update(_source_names(source, path))
            package = name if namespace.get("__path__") is not None else name.rpartition(".")[0]
            for level, module, names in _source_imports(source, path):
                self.imported(module, level, names, package)
        return True

    # ------------------------------------------------------------ values set from outside a module
    def library_values(self, scope: Mapping[str, Any], source: bytes, path: str) -> dict[int, tuple[Any, str]]:
        """The module-level values of the installed libraries a user module names (``import fakelib``, ``import
        matplotlib as mpl``) or imports names from (``from fakelib import CONFIG``), by identity: their home.
        A value changed in place through another name for it (``cfg = fakelib.CONFIG; cfg["h0"] = 11``, ``rc =
        mpl.rcParams; rc["font.size"] = 8``, ``cosmo = fakelib.DEFAULT; cosmo.h0 = 11``) is a change of that
        library's value, as ``fakelib.CONFIG["h0"] = 11`` is."""
        modules = [v for v in list(scope.values()) if isinstance(v, types.ModuleType)]
        modules += [m for _, name, member, _ in _import_bindings(source, path) if member is not None
                    and isinstance(m := sys.modules.get(name), types.ModuleType)]
        found: dict[int, tuple[Any, str]] = {}
        for module in modules:
            top = module.__name__.partition(".")[0]
            if top in sys.stdlib_module_names or top in ("builtins", "hetflow") or _deferred(module) or \
                    self.is_user(self.realpath(getattr(module, "__file__", None) or "")):
                continue
            for attr, value in list(vars(module).items()):
                if not attr.startswith("__") and not isinstance(value, (types.ModuleType, type)) and \
                        not _is_code_like(value) and not isinstance(value, _SIMPLE):
                    found.setdefault(id(value), (module, attr))
                    # one level inside: opts = lib.CONFIG["plot"]; opts["dpi"] = 300 changes lib.CONFIG
                    inside = list(value.values()) if isinstance(value, dict) else \
                        list(value) if isinstance(value, (list, tuple)) else []
                    for item in itertools.islice(inside, 1000):
                        if not isinstance(item, (types.ModuleType, type, *_SIMPLE)) and not _is_code_like(item):
                            found.setdefault(id(item), (module, attr))
        return found

    def patch_sites(self) -> list[tuple[Any, str]]:
        """``(module or class, attribute)`` that user code sets from outside it (see the module docstring)."""
        sites: dict[tuple[int, str], tuple[Any, str]] = {}
        set_directly: set[tuple[int, str]] = set()
        namespaces = self.user_namespaces()
        held: dict[int, tuple[Any, str]] = {}  # a module-level value of a user module, by identity: its home
        for name, _, namespace in namespaces:
            module = sys.modules.get(name)
            if module is None or name == self.home:  # the script's own globals are hashed as they are
                continue
            for attr, value in list(namespace.items()):
                if not attr.startswith("__") and not isinstance(value, (types.ModuleType, type)) and \
                        not _is_code_like(value) and not isinstance(value, _SIMPLE):
                    held.setdefault(id(value), (module, attr))
        for name, path, namespace in namespaces:
            try:
                source = Path(path).read_bytes()
            except OSError:
                continue
            scope = {**_imported_names(source, path, namespace.get("__package__")), **namespace}
            aliases = {**self.library_values(scope, source, path), **held}
            for kind, chain, text in _patch_chains(source, path):
                called = kind.startswith("call")
                for owner, attr in _resolve_patch(scope, chain, "call" if called else kind, aliases):
                    if getattr(owner, "__name__", None) == name or getattr(owner, "__module__", None) == name:
                        continue  # a module setting its own names: its source counts already
                    names = [attr] if attr is not None else [
                        k for k, v in vars(owner).items() if not k.startswith("__") and not _is_code_like(v)]
                    sites.update(((id(owner), n), (owner, n)) for n in names)
                    if called and not _passes_an_object(kind, scope) and not (
                            isinstance(owner, types.ModuleType)
                            and self.is_user(self.realpath(getattr(owner, "__file__", None) or ""))):
                        self.library_state.update((id(owner), n) for n in names)
                        if kind == "call-local":
                            self.library_local.update((id(owner), n) for n in names)
                        said = " ".join([text, *(f"{n}={self.value(scope[n])}" for n in kind.split()[1:]
                                                 if n in scope)])
                        for n in names:
                            self.library_calls.setdefault((id(owner), n), set()).add(said)
                    else:
                        set_directly.update((id(owner), n) for n in names)
        self.library_state -= set_directly
        return list(sites.values())

    def user_namespaces(self) -> list[tuple[str, str, Mapping[str, Any]]]:
        """``(module name, file, namespace)`` of the script and the imported user modules: where values set
        on other modules are looked for."""
        found: dict[str, tuple[str, str, Mapping[str, Any]]] = {}
        script = getattr(_target(self.func), "__globals__", None)
        if isinstance(script, dict) and isinstance(script.get("__file__"), str) and self.home:
            found[self.home] = (self.home, script["__file__"], script)
        roots = (self.roots, self.external, self.installed_local)
        modules = list(sys.modules.items())
        last = _USER_NAMESPACES.get(roots)
        if last is None or last[0] != modules:  # a module imported, replaced or removed since the last walk
            unresolved = tuple(os.path.join(d, "") for d in (sys.prefix, sys.base_prefix, sys.exec_prefix) if d)
            known = _USER_MODULES.setdefault(roots, {})
            users = []
            for name, module in modules:
                path = getattr(module, "__file__", None) if isinstance(module, types.ModuleType) else None
                seen = known.get(name)
                if seen is None or seen[0] is not module or seen[1] != path:  # a module not classified yet
                    user = isinstance(path, str) and path.endswith(".py") and not path.startswith(unresolved) and \
                        "site-packages" not in path and "dist-packages" not in path and \
                        self.is_user(self.realpath(path))
                    seen = known[name] = (module, path, user)
                if seen[2]:
                    users.append((name, path, vars(module)))
            _USER_NAMESPACES[roots] = last = (modules, users)
        for name, path, namespace in last[1]:
            if name not in found:
                found[name] = (name, path, namespace)
        return list(found.values())

    def patch_counts(self, owner: Any, attr: str) -> bool:
        """Whether a value set on ``owner`` counts: the stage reaches ``owner`` and its code names ``attr``."""
        module = sys.modules.get(owner.__module__ or "") if isinstance(owner, type) else owner
        if not isinstance(module, types.ModuleType) or module.__name__ in (self.home, "__main__"):
            return False  # the script's own globals and classes are hashed as they are now
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and self.is_user(self.realpath(path)):
            return id(module) in self.seen and self.reads(attr)
        return module.__name__.partition(".")[0] in self.external_tops

    # ------------------------------------------------------------ components
    def visit(self, obj: Any) -> None:
        if isinstance(obj, _Located):
            source = Path(obj.origin).read_bytes()
            self.add(f"module {obj.name}", _sha(source))
            self.names.update(_source_names(source, obj.origin))
            self.module_imports(obj.name, obj.origin, source, obj.is_package)
        elif isinstance(obj, types.ModuleType):
            self.visit_module(obj)
        elif isinstance(obj, type):
            self.visit_class(obj)
        elif isinstance(obj, types.FunctionType):
            self.add(self.name(obj), _sha(self.function(obj)))

    def visit_module(self, module: types.ModuleType) -> None:
        path = getattr(module, "__file__", None)
        content = _module_content(path, _module_file(vars(module))[1]) if path else None
        source = content[1] or b"" if content is not None else b""
        self.add(f"module {module.__name__}", content[0] if content is not None else
                 "<unreadable>" if path else "<no file>")
        if path:
            self.names.update(_source_names(source, path))
            self.module_imports(module.__name__, path, source, hasattr(module, "__path__"))
        for key, value in sorted(vars(module).items()):
            if not isinstance(value, (types.ModuleType, types.FunctionType, type)) or key.startswith("__"):
                continue
            if isinstance(value, types.ModuleType) or value.__module__ != module.__name__:
                self.follow(value)

    def visit_class(self, cls: type) -> None:
        self.classes.append(cls)
        body = [f"bases {[self.follow(b) for b in cls.__bases__ if b is not object]}"]
        if type(cls) is not type:
            body.append(f"metaclass {self.follow(type(cls))}")
        for key, value in sorted(vars(cls).items()):
            if key in ("__dict__", "__weakref__", "__module__", "__qualname__"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                body.append(f"{key} = property{[self.member(f) for f in (value.fget, value.fset, value.fdel)]}")
            else:
                body.append(f"{key} = {self.member(value)}")
        self.add(self.name(cls), _sha("\n".join(body)))

    def member(self, value: Any) -> str:
        """A class attribute: a method is part of its class, not a component of its own."""
        if isinstance(value, types.FunctionType):
            return self.function(value)
        if isinstance(value, functools.cached_property):
            return f"cached_property({self.member(value.func)})"
        if isinstance(value, functools.partialmethod):
            return f"partialmethod({self.member(value.func)}, {self.value(value.args)}, {self.value(value.keywords)})"
        if isinstance(value, functools.singledispatchmethod):
            return f"singledispatchmethod({self.member(value.dispatcher)})"
        return self.value(value)

    def wrapper(self, obj: Any, wrapped: Callable[..., Any], stack: tuple[int, ...]) -> str:
        """A callable object that wraps a function (``functools.lru_cache``, ``update_wrapper``): the function counts."""
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        parameters = getattr(obj, "cache_parameters", None) if isinstance(obj, _LRU_WRAPPER) else None
        extra = ""
        if callable(parameters) and getattr(parameters, "__module__", None) == "functools":  # never user code
            extra = f" {self.value(parameters(), stack)}"
        return f"{kind}{extra} of {self.follow(wrapped, stack)}"

    def function(self, func: types.FunctionType) -> str:
        """The text hashed for a function; queues what it reaches."""
        code = func.__code__
        self.globals_of(code, func.__globals__)
        cells = [c.cell_contents for c in func.__closure__ or () if _filled(c)]
        wrapped = getattr(func, "__wrapped__", None)
        text = (f"code {_code_text(code)}\ndefaults {self.value(func.__defaults__)}\n"
                f"kwdefaults {self.value(func.__kwdefaults__)}\ncells {self.value(cells)}\n"
                f"wraps {self.follow(wrapped) if callable(wrapped) else None}")
        registry = vars(func).get("registry")
        attributes = {k: v for k, v in vars(func).items() if not (k.startswith("__") and k.endswith("__"))}
        if isinstance(registry, Mapping) and "dispatch" in vars(func):  # functools.singledispatch
            text += f"\nregistry {self.value(dict(registry))}"
            attributes = {k: v for k, v in attributes.items() if k not in _SINGLEDISPATCH}
        if attributes:  # ``fit.alpha = 3`` after the def, read in the body as ``fit.alpha``
            text += f"\nattributes {self.value(attributes)}"
        return text

    def globals_of(self, code: types.CodeType, namespace: Mapping[str, Any]) -> None:
        """Follow the globals a code object (and the code nested in it) loads or imports."""
        builtins = namespace.get("__builtins__", {})
        builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
        self.names.update(code.co_names)
        self.names.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
        instructions = list(dis.get_instructions(code))
        if _reads_computed_names(instructions):  # getattr(consts, "K" + which): any name may be read
            self.names.add(ANY_NAME)
            if namespace.get("__name__") == self.home and _SCRIPT_READERS & set(code.co_names):
                self.script_by_name = True
        if _NAMESPACE_READERS & set(code.co_names):  # globals()["K"], getattr(sys.modules[__name__], "K")
            for const in code.co_consts:
                if isinstance(const, str) and const.isidentifier() and const in namespace:
                    self.global_value(const, namespace)
        evaluates = False
        for i, ins in enumerate(instructions):
            if ins.opname in _LOAD_OPS and isinstance(ins.argval, str):
                if ins.argval in namespace:
                    self.global_value(ins.argval, namespace)
                elif ins.argval not in builtins:
                    self.add(self.label(ins.argval, namespace), "<undefined>")
                elif _set_on_builtins(ins.argval, builtins[ins.argval]):  # builtins.SCALE = 2 at the top
                    self.global_value(ins.argval, builtins)
                elif ins.argval in ("eval", "exec"):
                    evaluates = True
            elif ins.opname == "IMPORT_NAME":
                level = instructions[i - 2].argval if i >= 2 and isinstance(instructions[i - 2].argval, int) else 0
                fromlist = instructions[i - 1].argval if i >= 1 else None
                fromlist = fromlist if isinstance(fromlist, tuple) else None
                self.imported(ins.argval, level, fromlist, namespace.get("__package__"))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.globals_of(const, namespace)
            elif isinstance(const, str):
                self.named_in_text(const, namespace, evaluated="eval" in code.co_names or "exec" in code.co_names)
        if evaluates:
            self.every_global(namespace)

    def every_global(self, namespace: Mapping[str, Any]) -> None:
        """Code that calls the builtin ``eval``/``exec`` may read any global of its module by a name in a text
        the key cannot see (a parameter, a file, ``eval(ctx.params["expr"])`` reading ``SCALE``): every global
        of that module counts, values by value, functions, classes and modules as they are followed."""
        if id(namespace) in self.evaluated:
            return
        self.evaluated.add(id(namespace))
        for key, value in list(namespace.items()):
            if key.startswith("__") or type(value).__module__.partition(".")[0] == "hetflow" or \
                    (isinstance(value, types.ModuleType) and value.__name__.partition(".")[0] == "hetflow"):
                continue
            self.global_value(key, namespace)

    def named_in_text(self, text: str, namespace: Mapping[str, Any], evaluated: bool = False) -> None:
        """Globals a string names for a library that looks them up by name: ``@THRESH`` in a pandas
        ``query``/``eval`` expression, and a frame, table or array a DuckDB query names (``FROM CATALOG``: its
        replacement scan reads the caller's variables); with ``evaluated`` (the code calls ``eval``/``exec``),
        every global the text names."""
        if evaluated:
            for name in set(_IDENTIFIER.findall(text)):
                if name in namespace:
                    self.global_value(name, namespace)
        if "@" in text:
            for name in _AT_NAME.findall(text):
                if name in namespace:
                    self.global_value(name, namespace)
        if " " in text:
            for name in set(_IDENTIFIER.findall(text)):
                value = namespace.get(name, _ABSENT)
                if value is not _ABSENT and type(value).__module__.partition(".")[0] in _SCANNED:
                    self.global_value(name, namespace)

    def global_value(self, key: str, namespace: Mapping[str, Any]) -> None:
        value = namespace[key]
        if isinstance(value, (types.FunctionType, type, types.ModuleType)):
            self.follow(value)
            return  # a partial, a bound method or a wrapper carries state: hashed as a value below
        label = self.label(key, namespace)
        if label not in self.parts:
            self.add(label, _sha(self.value(value)))
            if isinstance(value, str):  # QUERY = "flux > @THRESH", read by df.query(QUERY)
                self.named_in_text(value, namespace)

    def label(self, key: str, namespace: Mapping[str, Any]) -> str:
        module = namespace.get("__name__")
        return key if module == self.home else f"{module}.{key}"

    def imported(self, name: str, level: int, fromlist: Sequence[str] | None, package: str | None) -> None:
        """``import name`` / ``from name import *fromlist*`` (``level`` dots), met in code or in a module's source.

        ``import a.b`` follows ``a.b`` (not the package ``a``).  ``from a import x``
        follows the submodule ``a.x`` when there is one, else what ``x`` names in
        ``a`` when it is a function, class or module (so its own module, not every
        module ``a`` imports), else ``a`` whole (``x`` is a value, or ``*``).
        """
        try:
            name = importlib.util.resolve_name("." * level + name, package) if level else name
        except (ImportError, ValueError):
            return
        if not fromlist:
            self.follow_module_name(name)
            return
        base = sys.modules.get(name)
        if base is not None and not isinstance(base, types.ModuleType):  # not a module: counted by value
            self.module_stand_in(name, base)
            return
        whole = False
        for attr in fromlist:
            sub = f"{name}.{attr}"
            if attr == "*":
                whole = True
            elif sub in sys.modules:
                self.follow_module_name(sub)
            elif base is not None and attr in vars(base):
                value = vars(base)[attr]
                if isinstance(value, (types.FunctionType, type, types.ModuleType)):
                    self.follow(value)
                else:
                    whole = True
            elif (base is None or hasattr(base, "__path__")) and self.locate(sub) is not None:
                self.follow_module_name(sub)
            else:
                whole = True
        if whole:
            self.follow_module_name(name)

    def follow_module_name(self, name: str) -> None:
        """Follow a module by name: imported, or located and hashed from its file without being imported."""
        module = sys.modules.get(name)
        if module is not None and not isinstance(module, types.ModuleType):
            self.module_stand_in(name, module)
            return
        if module is not None:
            self.follow(module)
            return
        found = self.locate(name)
        if found is not None and found.has_location and found.origin and self.is_user(os.path.realpath(found.origin)):
            self.queue.append(_Located(name, found.origin, found.submodule_search_locations is not None))
        else:
            self.external_module(name, {"__spec__": found, "__file__": found.origin,
                                        "__path__": found.submodule_search_locations} if found is not None else None)

    def module_stand_in(self, name: str, obj: Any) -> None:
        """An object the script put in ``sys.modules`` in place of a module (``sys.modules["labcfg"] =
        types.SimpleNamespace(K=1)``, an instance of a class), which ``import labcfg`` gives: counted by
        value, its attributes, like a global holding it."""
        self.add(f"sys.modules[{name!r}]", _sha(self.value(obj)))

    def locate(self, name: str) -> importlib.machinery.ModuleSpec | None:
        """A module's spec, found without importing it or its packages (so none of their code runs)."""
        if name not in self.specs:
            self.specs[name] = _locate(name)
        return self.specs[name]

    def module_imports(self, name: str, path: str, source: bytes, is_package: bool) -> None:
        """Follow what a module's source imports anywhere in it (module level, functions, ``try`` blocks)."""
        if not path.endswith(".py"):
            return
        package = name if is_package else name.rpartition(".")[0]
        for level, module, names in _source_imports(source, path):
            self.imported(module, level, names, package)

    # ------------------------------------------------------------ values
    def value(self, obj: Any, stack: tuple[int, ...] = ()) -> str:
        """A stable text form of a value (see the module docstring)."""
        if id(obj) in stack:
            return "<cycle>"
        inner = stack + (id(obj),)
        if isinstance(obj, enum.Enum):
            return f"{self.follow(type(obj))}.{obj.name}"
        if isinstance(obj, float) and obj != obj and struct.pack("<d", obj) != _NAN_BITS:  # -nan: repr is nan
            return f"{type(obj).__name__}:nan {struct.pack('<d', obj).hex()}"
        if isinstance(obj, _SIMPLE):
            return f"{type(obj).__name__}:{obj!r}"
        if isinstance(obj, (list, tuple)):
            return f"{type(obj).__name__}[{', '.join(self.value(v, inner) for v in obj)}]"
        if isinstance(obj, (set, frozenset)):
            return f"{type(obj).__name__}{{{', '.join(sorted(self.value(v, inner) for v in obj))}}}"
        if isinstance(obj, dict):
            items = sorted(f"{self.value(k, inner)}: {self.value(v, inner)}" for k, v in obj.items())
            return f"{type(obj).__name__}{{{', '.join(items)}}}"
        if _is_code_like(obj):
            return self.follow(obj, inner)
        if isinstance(obj, types.SimpleNamespace):
            return f"namespace{self.value(vars(obj), inner)}"
        if isinstance(obj, logging.Logger):  # its repr shows its level, which -v changes
            name = obj.name  # getLogger(__name__) in a script: a rank runs it as SCRIPT_MODULE, not __main__
            if name == "__hetflow_script__" or name.startswith("__hetflow_script__."):
                name = "__main__" + name[len("__hetflow_script__"):]
            return f"logging.Logger {name!r}"
        if isinstance(obj, (io.StringIO, io.BytesIO)):  # a buffer in memory is data: its content
            return f"{type(obj).__name__} {_sha(self.value(obj.getvalue(), inner))}"
        if isinstance(obj, re.Pattern):  # its repr may hold "..." and is cut at 200 characters
            return f"re.Pattern {self.value(obj.pattern, inner)} {obj.flags}"
        if isinstance(obj, random.Random):  # a seeded generator: its state (its repr is an address)
            return f"random.Random {self.value(obj.getstate(), inner)}"
        if type(obj).__module__.startswith("numpy.random"):
            import numpy as np

            if isinstance(obj, np.random.Generator):
                return f"numpy.random.Generator {self.value(obj.bit_generator.state, inner)}"
            if isinstance(obj, np.random.RandomState):
                return f"numpy.random.RandomState {self.value(obj.get_state(legacy=False), inner)}"
        if isinstance(obj, types.BuiltinMethodType) and not isinstance(obj.__self__, (types.ModuleType, type(None))):
            return f"{obj.__qualname__} bound to {self.value(obj.__self__, inner)}"  # TABLE.get
        if type(obj).__module__ == "numpy":
            import numpy as np

            if isinstance(obj, (np.ndarray, np.generic)):
                if not obj.dtype.hasobject:
                    return f"numpy {obj.dtype.str} {obj.shape} {_sha(np.ascontiguousarray(obj).tobytes())}"
                # objects (or records holding objects): element by element, never their addresses
                elements = obj.ravel().tolist() if isinstance(obj, np.ndarray) else [obj.item()]
                return f"numpy {obj.dtype.str} {obj.shape} {_sha(self.value(elements, inner))}"
        top = type(obj).__module__.partition(".")[0]
        if top in ("pandas", "pyarrow", "polars", "torch"):
            text = self.pandas(obj, inner) if top == "pandas" else _data_text(obj)
            if text is not None:
                return text
        if dataclasses.is_dataclass(obj):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            extra = {k: v for k, v in (_instance_state(obj) or {}).items() if k not in fields}
            if extra:  # set on the instance besides its fields (setattr, __dict__, __post_init__)
                return f"{self.follow(type(obj))}({self.value(fields, inner)}, also {self.value(extra, inner)})"
            return f"{self.follow(type(obj))}({self.value(fields, inner)})"
        if _unkeyed(type(obj)):  # by its fields, not by its repr (a Pipeline's lists its stages)
            return f"{type(obj).__module__}.{type(obj).__qualname__} state {self.value(_instance_state(obj), inner)}"
        if self.is_user_object(type(obj)):
            state = _instance_state(obj)
            if state is not None:
                return f"{self.follow(type(obj))}({self.value(state, inner)})"
        wrapped = _wrapped(obj)
        if wrapped is not None:
            return self.wrapper(obj, wrapped, inner)
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if getattr(type(obj), "__repr__", None) is not object.__repr__:
            try:
                text = repr(obj)
                if "..." in text or "\u2026" in text:  # shortened: a change in what it leaves out would not count
                    self.shortened.add(kind)
                    return f"<shortened {kind}>"
                if " at 0x" not in text:  # with what the instance holds: a fitted model's repr shows no weights
                    state = _instance_state(obj)
                    return f"{kind} {text}" + (f" state {self.value(state, inner)}" if state else "")
            except RecursionError:  # a structure too deep to follow: not digested, so not cached
                self.shortened.add(kind)
                return f"<shortened {kind}>"
        return self.opaque(obj, kind, inner)

    def opaque(self, obj: Any, kind: str, stack: tuple[int, ...]) -> str:
        """An object whose text form is its type and address (``ConfigParser``, ``string.Template``, a pandas
        ``groupby``, a ``DataLoader``): by its state, never by its type alone; a lock by its type (it holds no
        value a result depends on); one with no state to read makes its component uncacheable."""
        if type(obj).__module__.partition(".")[0] == "torch" and type(obj).__name__ == "Generator":
            try:
                return f"{kind} {_sha(obj.get_state().numpy().tobytes())}"
            except Exception:  # noqa: BLE001 - a generator whose state cannot be read: not digested
                pass
        if type(obj).__module__ == "mpi4py.MPI":  # a predefined handle (MPI.COMM_WORLD, MPI.DOUBLE) by its name,
            try:                                   # which mpi4py gives without MPI started; no other one
                name = obj.__reduce__()
            except Exception:  # noqa: BLE001 - a handle it cannot name (a Dup()'d communicator): not digested
                name = None
            if isinstance(name, str):
                return f"mpi4py.MPI.{name}"
        if isinstance(obj, _LOCKS):
            return f"<lock {kind}>"
        state = _instance_state(obj)
        if state is not None:
            return f"{kind} state {self.value(state, stack)}"
        self.shortened.add(f"{_OPAQUE}{kind}")
        return f"<opaque {kind}>"

    def pandas(self, obj: Any, stack: tuple[int, ...]) -> str | None:
        """A pandas frame, series or index by its content: labels, dtypes, names, ``attrs`` and every value
        (numeric and extension columns through ``pandas.util.hash_pandas_object``, object columns element by
        element as values); None for another pandas type."""
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            columns = "; ".join(self.pandas_values(obj.iloc[:, i], stack) for i in range(obj.shape[1]))
            return (f"pandas.DataFrame {obj.shape} columns {self.pandas_values(obj.columns, stack)} "
                    f"index {self.pandas_values(obj.index, stack)} attrs {self.value(obj.attrs, stack)} "
                    f"[{columns}]")
        if isinstance(obj, pd.Series):
            return (f"pandas.Series {self.value(obj.name, stack)} index {self.pandas_values(obj.index, stack)} "
                    f"attrs {self.value(obj.attrs, stack)} {self.pandas_values(obj, stack)}")
        if isinstance(obj, pd.Index):
            return f"pandas.Index {self.pandas_values(obj, stack)}"
        return None

    def pandas_values(self, data: Any, stack: tuple[int, ...]) -> str:
        """The values of a series or an index (not its index), with its dtype and names."""
        import pandas as pd

        dtype = data.dtype
        head = f"{type(data).__name__} {dtype} names {self.value(list(getattr(data, 'names', [data.name])), stack)}"
        if isinstance(dtype, pd.CategoricalDtype):
            head += f" categories {self.pandas_values(dtype.categories, stack)} ordered {dtype.ordered}"
        if dtype == object or isinstance(data, pd.MultiIndex):
            return f"{head} {_sha(self.value(list(data), stack))}"
        try:
            hashed = pd.util.hash_pandas_object(data, index=False).to_numpy()
        except (TypeError, ValueError):  # values pandas cannot hash (nested Arrow lists): element by element
            return f"{head} {_sha(self.value(list(data), stack))}"
        return f"{head} {_sha(hashed.tobytes())}"


MODULE_CONTENT_LIMIT = 64 << 20
"""A module's file up to this size counts by its content, a larger one (an extension module) by size and time."""


def _deferred(module: types.ModuleType) -> bool:
    """Whether ``module`` is a deferred import not loaded yet (reading its namespace would load it)."""
    lazy = getattr(importlib.util, "_LazyModule", None)
    return lazy is not None and isinstance(module, lazy)


def _module_file(namespace: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(the file a module was loaded from, the zip archive holding it or None)``: its spec's origin (what
    any file loader read: a ``SourceFileLoader``'s ``settings.conf``, an extension's ``.so``), else its
    ``__file__``; ``(None, None)`` for a module without a file."""
    spec = namespace.get("__spec__")
    origin = getattr(spec, "origin", None) if getattr(spec, "has_location", False) else None
    path = origin if isinstance(origin, str) and origin else namespace.get("__file__")
    if not isinstance(path, str) or not path:
        return None, None
    loader = getattr(spec, "loader", None) or namespace.get("__loader__")
    archive = getattr(loader, "archive", None) if isinstance(loader, zipimport.zipimporter) else None
    return path, archive if isinstance(archive, str) else None


def _module_content(path: str, archive: str | None) -> tuple[str, bytes | None] | None:
    """``(digest, Python source or None)`` of a module's file: the sha256 of its bytes (a zip archive's member
    read from the archive as it is now), size and modification time above :data:`MODULE_CONTENT_LIMIT`;
    the source is None for an extension module or bytecode.  None when it cannot be read."""
    try:
        if archive is not None:
            member = os.path.relpath(path, archive).replace(os.sep, "/")
            with zipfile.ZipFile(archive) as zipped:
                data = zipped.read(member)
        else:
            info = os.stat(path)
            if info.st_size > MODULE_CONTENT_LIMIT:
                return f"size {info.st_size} mtime {info.st_mtime_ns}", None
            data = Path(path).read_bytes()
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    binary = path.endswith((*importlib.machinery.EXTENSION_SUFFIXES, ".pyc", ".pyo", ".pyd"))
    return _sha(data), None if binary else data


_NUMPY_PRINT_DEFAULTS = {"edgeitems": 3, "threshold": 1000, "floatmode": "maxprec", "precision": 8, "suppress": False,
                         "linewidth": 75, "nanstr": "nan", "infstr": "inf", "sign": "-", "formatter": None,
                         "legacy": False, "override_repr": None}
_NUMPY_ERR_DEFAULTS = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}
_POLARS_DEFAULTS = {"set_fmt_float": "mixed", "set_float_precision": None, "set_thousands_separator": "",
                    "set_decimal_separator": ".", "set_trim_decimal_zeros": False}


def _differs(value: Any, default: Any) -> bool:
    try:
        return value is not default and bool(value != default)
    except Exception:  # noqa: BLE001 - a value that does not compare to a plain bool: taken as changed
        return True


def _numpy_settings(np: types.ModuleType) -> dict[str, Any]:
    """numpy's print options and floating-point error handling that differ from numpy's defaults."""
    changed: dict[str, Any] = {}
    for kind, read, defaults in (("print", "get_printoptions", _NUMPY_PRINT_DEFAULTS),
                                 ("err", "geterr", _NUMPY_ERR_DEFAULTS)):
        getter = getattr(np, read, None)
        now = getter() if callable(getter) else {}
        changed.update({f"{kind} {k}": v for k, v in now.items() if _differs(v, defaults.get(k, _ABSENT))})
    return changed


def _pandas_settings(pd: types.ModuleType) -> dict[str, Any]:
    """The pandas options whose value is not their registered default (read from pandas' own table of values,
    not through ``get_option``, which warns about deprecated ones)."""
    try:
        from pandas._config import config
    except ImportError:
        return {}
    values: dict[str, Any] = {}
    _flatten(getattr(config, "_global_config", {}), "", values)
    changed: dict[str, Any] = {}
    for key, option in list(getattr(config, "_registered_options", {}).items()):
        value = values.get(key, _ABSENT)
        if value is not _ABSENT and _differs(value, getattr(option, "defval", _ABSENT)):
            changed[key] = value
    return changed


def _flatten(tree: Mapping[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for key, value in list(tree.items()):
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", into)
        else:
            into[f"{prefix}{key}"] = value


def _polars_settings(pl: types.ModuleType) -> dict[str, Any]:
    """polars' ``Config`` that is set: its environment variables and the formatting it keeps itself."""
    try:
        state = pl.Config.state(if_set=True)
    except Exception:  # noqa: BLE001 - a polars without it: nothing to read
        return {}
    return {k: v for k, v in state.items() if _differs(v, _POLARS_DEFAULTS.get(k, _ABSENT))}


_SEEDS: dict[str, tuple[tuple[str, tuple[str, ...], str], ...]] = {}
_SEED_FUNCTIONS = frozenset({"set_random_seed", "seed", "manual_seed", "manual_seed_all", "set_seed",
                             "seed_everything"})
"""Calls that seed a library's global generator (``pl.set_random_seed``, ``np.random.seed``, ``random.seed``,
``torch.manual_seed``, ...): their text counts, since a first run without one leaves no state to compare."""

_SHIPPED_SEEDERS = {"seed": ("random", "np.random", "numpy.random"), "manual_seed": ("torch", "torch.random"),
                    "set_seed": ("transformers", "accelerate", "accelerate.utils"),
                    "seed_everything": ("lightning", "pytorch_lightning", "pl", "L", "lightning.pytorch")}
"""Seeding calls (by the name called and what it is called on; called by a bare name too: ``from random import
seed``, a helper of the user's) whose generators (Python's ``random``, numpy's global one, torch's CPU one) a
main block that calls them gives to the ranks by their state (:func:`hetflow.observed.shipped_generators`): the
values the call names there (``np.random.seed(args.seed)``) need not be in the key, and are not read from it.
Others (``tf.random.set_seed(args.seed)``) seed a generator the ranks are not given: the values they name count,
and a stage is refused when the block sets them."""


def _seeds_a_shipped_generator(func: ast.expr) -> bool:
    """Whether a call of ``func`` seeds generators the ranks are given (:data:`_SHIPPED_SEEDERS`)."""
    if isinstance(func, ast.Name):
        return func.id in _SHIPPED_SEEDERS
    return isinstance(func, ast.Attribute) and ast.unparse(func.value) in _SHIPPED_SEEDERS.get(func.attr, ())


def _seed_calls(source: bytes, path: str) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """``(the call's text, the names it loads, the global it is a method of in the main block)`` for every call of a seeding function (:data:`_SEED_FUNCTIONS`:
    ``pl.set_random_seed(SEED)``, ``np.random.seed(SEED)``) in a module's source: polars' seed cannot be read
    back, and a generator left unseeded by a first run leaves no state for a later one to compare.  A call of
    :data:`_SHIPPED_SEEDERS` inside the module's ``if __name__ == "__main__":`` block names none: its generators'
    states are observed and given to the ranks, and the values it names there (``args``) are ones the ranks
    never compute (:func:`values_set_after_declaring`).  A method called there on a global (``RNG.seed(args.seed)``)
    gives that global's name: when it is a generator object, a stage that reads it is refused
    (:func:`late_components`), and the others do not depend on the call.  Nor do they on a method called there on
    a generator the call makes (``g = torch.Generator().manual_seed(args.seed)``): it seeds that one only, and a
    global it is kept in is refused to a stage that reads it, as the block set it."""
    key = hashlib.sha256(source).hexdigest()
    if key not in _SEEDS:
        found = []
        tree = _parse(source, path)
        main = {id(node) for block in tree.body if _is_main_guard(block) for node in ast.walk(block)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in _SEED_FUNCTIONS:
                shipped = id(node) in main and _seeds_a_shipped_generator(node.func)
                fresh = id(node) in main and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Call)  # torch.Generator().manual_seed(args.seed): its own
                names = () if shipped or fresh else tuple(sorted({n.id for n in ast.walk(node)
                                                                  if isinstance(n, ast.Name)}))
                method_of = node.func.value.id if id(node) in main and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) else ""
                found.append((ast.unparse(node), names, method_of))
        if len(_SEEDS) > 4096:
            _SEEDS.clear()
        _SEEDS[key] = tuple(found)
    return _SEEDS[key]


_TOP_CALLS: dict[str, tuple[_TopCall, ...]] = {}


def _top_calls(source: bytes, path: str) -> tuple[_TopCall, ...]:
    """The calls a module's top level makes: ``(text, names of the called object, names its text reads, name of
    the function or class it decorates or "")``, not those in an ``if __name__ == "__main__":`` block (never
    run in a rank), in a function's body (code, counted where it is reached), nor the seeding calls
    (:data:`_SEED_FUNCTIONS`, which count as ``seed calls``).

    Wherever the top level runs a call, it may change a library's state: as a statement of its own
    (``lib.register("a", 11)``), but also inside an assignment (``m = lib.register("a", 11)``), a
    comprehension, a ``with`` item, an ``if`` test, a class body, a default value or a decorator
    (``@lib.model("sq", scale=2)``, which hands the library the function it decorates; a bare ``@lib.plugin``
    too).  The text is the statement the call is in (a loop's header before it: ``for n, h in PAIRS:``), so
    the literal a comprehension or a loop feeds the call counts; the names read are plain names and dotted
    ones (``cfg.h0``, ``consts.H0``).  A call in what a plain assignment takes (``W = np.arange(4) * 2``) names
the names it is assigned to, last: :meth:`_Walker.library_calls_at_top` counts it only when the library keeps
what it returned.  The called object is the first name and the attributes after it, up
    to a call (``lib.get("a").set(2)``: ``("lib", "get")``; ``getattr(lib, "set")(2)``: ``("lib",)``)."""
    key = hashlib.sha256(source).hexdigest()
    if key in _TOP_CALLS:
        return _TOP_CALLS[key]
    found: list[_TopCall] = []

    def record(node: ast.expr, sites: list[tuple[str, ast.AST]], decorated: str, assigned: tuple[str, ...]) -> None:
        func: ast.expr = node
        while isinstance(func, (ast.Call, ast.Subscript)) or (
                isinstance(func, ast.Attribute) and _names(func) is None):
            if isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "getattr" \
                    and func.args:
                func = func.args[0]  # getattr(lib, "set_x")(11): a call into lib
            else:
                func = func.func if isinstance(func, ast.Call) else func.value
        chain = _names(func)
        if chain is None or (isinstance(node, ast.Call) and (
                getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in _SEED_FUNCTIONS):
            return
        names = {".".join(n) for _, site in sites for sub in ast.walk(site)
                 if isinstance(sub, (ast.Name, ast.Attribute)) and (n := _names(sub)) is not None}
        callees = {id(sub.func) for _, site in sites for sub in ast.walk(site) if isinstance(sub, ast.Call)}
        passed = {".".join(n) for _, site in sites for sub in ast.walk(site)  # weight in f(weight), not weight(i)
                  if isinstance(sub, (ast.Name, ast.Attribute)) and id(sub) not in callees
                  and (n := _names(sub)) is not None}
        found.append((" ; ".join(text for text, _ in sites), chain, tuple(sorted(names)), decorated, assigned,
                      tuple(sorted(passed))))

    def expressions(node: ast.AST, sites: list[tuple[str, ast.AST]], decorated: str = "") -> None:
        value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        assigned = tuple(t.id for t in targets if isinstance(t, ast.Name)) \
            if value is not None and all(isinstance(t, ast.Name) for t in targets) else ()
        inside = {id(v) for v in ast.walk(value)} if assigned and value is not None else set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) or (sub is node and decorated):
                record(sub, sites, decorated if sub is node else "",  # type: ignore[arg-type]
                       assigned if id(sub) in inside else ())

    def site(node: ast.AST) -> tuple[str, ast.AST]:
        return ast.unparse(node), node

    def walk(body: list[ast.stmt], loops: list[tuple[str, ast.AST]]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for decorator in node.decorator_list:
                    expressions(decorator, [*loops, (f"@{ast.unparse(decorator)} {node.name}", decorator)],
                                node.name)
                heads = [*node.bases, *node.keywords] if isinstance(node, ast.ClassDef) else \
                    [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
                for head in heads:
                    expressions(head, [*loops, site(head)])
                if isinstance(node, ast.ClassDef):
                    head = ast.Tuple(elts=[*node.bases, *(k.value for k in node.keywords)], ctx=ast.Load())
                    text = f"class {node.name}({', '.join(ast.unparse(h) for h in [*node.bases, *node.keywords])})"
                    for base in node.bases:  # class Sq(lib.Plugin, scale=2): the base's __init_subclass__ gets Sq
                        if _names(base) is not None:
                            record(base, [*loops, (text, head)], node.name, ())
                    walk(node.body, loops)  # a class body runs at the top level
            elif isinstance(node, ast.If):
                if _is_main_guard(node):
                    continue
                expressions(node.test, [*loops, site(node.test)])
                walk(node.body, loops)
                walk(node.orelse, loops)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    expressions(item.context_expr, [*loops, site(item)])
                walk(node.body, loops)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                header = (f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}", node.iter)
                expressions(node.iter, [*loops, header])
                walk(node.body, [*loops, header])
                walk(node.orelse, loops)
            elif isinstance(node, ast.While):
                header = (f"while {ast.unparse(node.test)}", node.test)
                expressions(node.test, [*loops, header])
                walk(node.body, [*loops, header])
                walk(node.orelse, loops)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                walk(node.body, loops)
                for handler in node.handlers:
                    walk(handler.body, loops)
                walk(node.orelse, loops)
                walk(node.finalbody, loops)
            elif isinstance(node, ast.Match):
                expressions(node.subject, [*loops, site(node.subject)])
                for case in node.cases:
                    if case.guard is not None:  # case 1 if lib.register("a", 11): runs while the arms are tried
                        expressions(case.guard, [*loops, site(case.guard)])
                    walk(case.body, loops)
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                expressions(node, [*loops, site(node)])

    walk(_parse(source, path).body, [])
    if len(_TOP_CALLS) > 4096:
        _TOP_CALLS.clear()
    _TOP_CALLS[key] = tuple(found)
    return _TOP_CALLS[key]


def _kept_by_library(called: Any, results: Sequence[Any], memo: dict[str, frozenset[int]]) -> bool:
    """Whether the module of ``called`` (a library's function or class) or its top package holds one of
    ``results`` (what a top-level assignment took from the call) among its globals or one level inside them
    (``REGISTRY[name] = obj; return obj``), or a result is None (a setter's): then the call changed the
    library's state, and counts; a fresh value (``np.arange(4)``) is the script's, not the library's.
    ``memo``: what each module holds, found once per walk (the script does not run meanwhile)."""
    results = [*results, *(i for r in results if isinstance(r, (list, tuple)) for i in r[:1000]),
               *(i for r in results if isinstance(r, dict) for i in list(r.values())[:1000])]
    if any(r is None for r in results):
        return True
    home = called.__name__ if isinstance(called, types.ModuleType) else getattr(called, "__module__", None)
    if not isinstance(home, str):
        return True  # cannot tell: counted
    wanted = {id(r) for r in results}
    for name in {home, home.partition(".")[0]}:
        if name not in memo:
            held: set[int] = set()
            module = sys.modules.get(name)
            for value in list(vars(module).values()) if module is not None else ():
                inside = list(itertools.islice(list(value.values()), 100000)) if isinstance(value, dict) else \
                    list(itertools.islice(list(value), 100000)) if isinstance(value, (list, tuple, set, frozenset)) \
                    else []
                for item in [value, *inside]:
                    held.add(id(item))
                    if isinstance(item, types.MethodType):
                        held.add(id(item.__self__))  # lib.add_hook(S.apply): the library keeps S
            memo[name] = frozenset(held)
        if not wanted.isdisjoint(memo[name]):
            return True
    return False


_MUTATORS = frozenset({"append", "appendleft", "extend", "insert", "update", "setdefault", "add", "__setitem__",
                       "pop", "popitem", "clear", "remove", "discard"})


def _instructions(code: types.CodeType) -> list[dis.Instruction]:
    """A code object's instructions and those of the code nested in it (comprehensions, inner functions)."""
    found = list(dis.get_instructions(code))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _instructions(const)
    return found


def _changes_module_state(called: Any, depth: int = 0) -> bool:
    """Whether a library's Python function (a class: its ``__init__``) may store into its module's state: it
    assigns a global, or loads a global dict, list or set of its module and stores an item or calls a mutating
    method (``REGISTRY[name] = h0``, ``HOOKS.append(fn)``), itself or through a function of its own module it
    calls (two levels).  A function in C (``np.array``) and a plain computation (``np.linspace``) do not."""
    func = called
    if isinstance(called, type):
        func = next((f for k in called.__mro__[:-1] if isinstance(f := vars(k).get("__init__"), types.FunctionType)),
                    None)
    if not isinstance(func, types.FunctionType) or depth > 2:
        return False
    instructions = _instructions(func.__code__)
    if _global_stores(func.__code__):
        return True
    loaded = {i.argval for i in instructions if i.opname == "LOAD_GLOBAL"}
    scope = func.__globals__
    if any(isinstance(scope.get(n), (dict, list, set)) for n in loaded) and any(
            i.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") or
            (i.opname in ("LOAD_METHOD", "LOAD_ATTR") and i.argval in _MUTATORS) for i in instructions):
        return True
    return any(isinstance(f := scope.get(n), types.FunctionType) and f.__module__ == func.__module__
               and f is not func and _changes_module_state(f, depth + 1) for n in sorted(loaded))


def _held_elsewhere(objects: Sequence[Any], holders: Sequence[Any], known: Sequence[Any]) -> bool:
    """Whether anything but ``holders`` (the wrappers a top-level assignment took: ``VF = np.vectorize(f)``, and
    their ``__dict__``), the ``known`` containers (the user's module namespaces, the walk's own) and running
    frames refers to one of ``objects``: a registry that a library keeps it in, however deep
    (``REGISTRY[name] = (f, 1)``), a cell, a wrapper's other copy; then the library may run it for any stage."""
    allowed = {id(h) for h in [*holders, *known]}
    allowed |= {id(d) for h in holders if isinstance(d := getattr(h, "__dict__", None), dict)}
    for obj in objects:
        for ref in gc.get_referrers(obj):
            if id(ref) not in allowed and not isinstance(ref, types.FrameType) and ref is not objects:
                return True
    return False


def _dotted(scope: Mapping[str, Any], name: str) -> Any:
    """The value a plain or dotted name (``cfg.h0``) holds in ``scope``, through ``vars`` (never ``getattr``:
    no property runs); :data:`_ABSENT` when it cannot be found so."""
    first, *rest = name.split(".")
    value = scope.get(first, _ABSENT)
    for part in rest:
        try:
            value = vars(value).get(part, _ABSENT)
        except TypeError:
            return _ABSENT
        if value is _ABSENT:
            break
    return value


def _resolve_call(namespace: Mapping[str, Any], chain: _Chain) -> Any:
    """What a call's names (:func:`_top_calls`) lead to, through modules and classes (``vars``, never
    ``getattr``): the function called, or the module or class where the chain meets another value (a
    library's dict, a callable object: ``np.set_printoptions``); what the first name holds when that is not a
    module or class; a builtin (``int``, ``map``) when the name is not bound, None when it is no builtin either."""
    obj = namespace.get(chain[0] or "", _ABSENT)
    if obj is _ABSENT:  # a builtin (int(v), list(map(lib.f, ...))): the builtin, not None (which says nothing)
        obj = vars(builtins).get(chain[0] or "")
    if not isinstance(obj, (types.ModuleType, type)):
        # a function the name holds (from lib import f), or an object: its method when the chain names one
        # (reg.add("a", 11) on reg = lib.Registry(), setup.apply(11) on a local class's object), else the object
        return _method_of(obj, chain[1:]) if len(chain) > 1 else obj
    for at, name in enumerate(chain[1:], 2):
        value = vars(obj).get(name or "", _ABSENT)
        if isinstance(value, (staticmethod, classmethod)):  # Setup.configure(11): the function it runs
            value = value.__func__
        if not isinstance(value, (types.ModuleType, type)):
            if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
                return value
            if value is not _ABSENT and at < len(chain):  # labcfg.REG.add(...): the method of what REG holds
                method = _method_of(value, chain[at:])
                if method is not value:
                    return method
            return obj
        obj = value
    return obj


_RUNNERS = frozenset({map, filter, sorted, min, max, functools.reduce, itertools.starmap, itertools.filterfalse,
                      itertools.takewhile, itertools.dropwhile, itertools.accumulate, itertools.groupby})


def _runs_what_it_is_handed(called: Any) -> bool:
    """Whether ``called`` is a builtin that calls the function it is handed (``map(labsetup.init, PAIRS)``)."""
    return any(called is runner for runner in _RUNNERS)


def _named_objects(code: types.CodeType, scope: Mapping[str, Any]) -> list[Any]:
    """The objects a function's code names through its globals, followed through modules and classes by the
    attributes loaded after them (``fakelib.register`` in ``fakelib.register(name, h0)``), without running code;
    nested code (comprehensions, lambdas) too (:func:`_instructions`)."""
    found: list[Any] = []
    current: Any = _ABSENT
    for instruction in _instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            current = scope.get(instruction.argval, _ABSENT)
            if current is _ABSENT:
                continue
            found.append(current)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(current, (types.ModuleType, type)):
            current = vars(current).get(instruction.argval, _ABSENT)
            if current is not _ABSENT:
                found.append(current)
        else:
            current = _ABSENT
    return found


def _method_of(obj: Any, chain: _Chain) -> Any:
    """The Python function that ``obj.a.b(...)`` calls, found without running code (``inspect.getattr_static``:
    no property, no ``__getattr__``): a method of the object's class (a staticmethod's or classmethod's
    function too), through attributes its instance holds; ``obj`` itself when it is none of these (a method in C,
    an attribute made at run time): its type then says whose it is."""
    found = obj
    for name in chain:
        value = inspect.getattr_static(found, name or "", _ABSENT)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            return value
        if value is _ABSENT or isinstance(value, (property, functools.cached_property, types.ModuleType)) or \
                hasattr(type(value), "__get__"):
            return obj
        found = value
    return obj


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def _code_globals(code: types.CodeType, defined: bool = True) -> set[str]:
    """The globals a function's code (and the code nested in it) loads; with ``defined=False``, not those of
    the functions and lambdas it defines (its comprehensions run with it)."""
    found = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and (defined or const.co_name in _COMPREHENSIONS):
            found |= _code_globals(const, defined)
    return found


def _receives_subclasses(base: Any) -> bool:
    """Whether deriving a class from ``base`` hands the class to code of the library: a class of its ancestry
    defines ``__init_subclass__`` (a plugin table filled as subclasses are made), or its metaclass is not the
    standard library's."""
    if not isinstance(base, type):
        return False

    def libraries(cls: type) -> bool:  # typing.Generic's __init_subclass__ (torch's Dataset[T]) keeps nothing
        top = cls.__module__.partition(".")[0]
        return top not in sys.stdlib_module_names and top != "builtins"

    return any("__init_subclass__" in vars(c) and libraries(c) for c in base.__mro__) or libraries(type(base))


def _is_hetflow(called: Any) -> bool:
    """Whether a call's target is hetflow's (``pipe.stage``, ``hf.Pipeline``): a declaration, no library call."""
    return str(getattr(called, "__module__", "") or "").partition(".")[0] == "hetflow"


def _is_main_guard(node: ast.AST) -> bool:
    """Whether ``node`` is an ``if __name__ == "__main__":`` statement, or one whose test is that comparison
    ``and`` others (``if __name__ == "__main__" and len(sys.argv) > 1:``): its block too runs only where the
    script is ``__main__``, never in a rank."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    tests = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return any(isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
               and {ast.unparse(t.left), ast.unparse(t.comparators[0])} == {"__name__", "'__main__'"} for t in tests)


@dataclasses.dataclass(frozen=True)
class _Located:
    """A user module that was never imported: hashed from its file, its imports read from its source."""

    name: str
    origin: str
    is_package: bool


def _locate(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of module ``name``; a package on the way that was not imported is searched, never imported."""
    spec: importlib.machinery.ModuleSpec | None = None
    search: Sequence[str] | None = None
    parts = name.split(".")
    for i in range(len(parts)):
        if i and search is None:  # the parent is not a package
            return None
        full = ".".join(parts[:i + 1])
        module = sys.modules.get(full)
        try:
            if module is not None:
                spec = getattr(module, "__spec__", None)
                search = getattr(module, "__path__", None)
                if spec is None:
                    return None
                continue
            spec = importlib.util.find_spec(full) if i == 0 else \
                importlib.machinery.PathFinder.find_spec(full, list(search or ()))
        except (ImportError, ValueError, AttributeError):
            return None
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return spec


_IMPORTS: dict[str, tuple[tuple[int, str, tuple[str, ...] | None], ...]] = {}


def _source_imports(source: bytes, path: str) -> tuple[tuple[int, str, tuple[str, ...] | None], ...]:
    """``(level, module, names or None)`` for every import statement in a module's source (parsed, not run)."""
    key = hashlib.sha256(source).hexdigest()
    if key not in _IMPORTS:
        found: list[tuple[int, str, tuple[str, ...] | None]] = []
        try:
            tree = ast.parse(source, path)
        except (SyntaxError, ValueError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.extend((0, alias.name, None) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
        if len(_IMPORTS) > 4096:
            _IMPORTS.clear()
        _IMPORTS[key] = tuple(found)
    return _IMPORTS[key]


_LOCAL: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _local_installs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(project directories of editable installs, files and package directories installed from a local
    directory)``, by each distribution's ``direct_url.json`` (PEP 610: ``dir_info``); hetflow itself is
    left out (the key has its version).  Looked up once per ``sys.path``."""
    import importlib.metadata
    from urllib.parse import unquote, urlparse

    key = tuple(sys.path)
    if key in _LOCAL:
        return _LOCAL[key]
    editable: set[str] = set()
    installed: set[str] = set()
    for dist in importlib.metadata.distributions():
        try:  # direct_url.json first: only a local install has one with dir_info, so only its METADATA is parsed
            info = json.loads(dist.read_text("direct_url.json") or "null")
            if not isinstance(info, dict) or not isinstance(info.get("dir_info"), dict):
                continue
            name = str(dist.metadata["Name"] or "").lower().replace("_", "-")
        except (OSError, ValueError, KeyError):
            continue
        if name == "hetflow":
            continue
        url = urlparse(str(info.get("url", "")))
        if info["dir_info"].get("editable"):
            if url.scheme == "file" and url.path:
                editable.add(os.path.join(os.path.realpath(unquote(url.path)), ""))
            continue
        for file in dist.files or ():
            top = file.parts[0] if file.parts else ""
            if not top or top == ".." or top.endswith((".dist-info", ".egg-info", ".pth")) or top == "__pycache__":
                continue
            where = os.path.realpath(str(dist.locate_file(top)))
            installed.add(where if top.endswith(".py") or len(file.parts) == 1 else os.path.join(where, ""))
    if len(_LOCAL) > 16:
        _LOCAL.clear()
    _LOCAL[key] = (tuple(sorted(editable)), tuple(sorted(installed)))
    return _LOCAL[key]


ANY_NAME = "<any name>"
"""In :attr:`_Walker.names`: the reached code reads names computed at run time (``getattr(m, "K" + which)``,
``vars(m)``, ``m.__dict__``, ``globals()``), so every value of a reached module counts."""
_NAMESPACE_READERS = frozenset({"globals", "vars", "getattr", "__dict__", "modules"})
_ARGV_READERS = frozenset({"argv", "parse_args", "parse_known_args", "parse_intermixed_args",
                            "parse_known_intermixed_args"})
"""Names whose use in reached code reads the command line (:meth:`_Walker.command_line`)."""
_SCRIPT_READERS = frozenset({"globals", "modules", "import_module", "__import__"})
"""Names whose use with a computed name reads the script's own namespace: ``globals()[...]``, and the module
itself: ``sys.modules[__name__]``, ``importlib.import_module(__name__)``, ``__import__(__name__)``."""
_COMPUTED_READERS = frozenset({"vars", "globals", "__dict__", "attrgetter", "methodcaller", "getattr_static",
                               "__getattribute__"})
_PLAIN_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_CONST"})


def _set_on_builtins(name: str, value: Any) -> bool:
    """Whether a name found in ``builtins`` is a value a program put there (``builtins.SCALE = 2``), which
    counts as a global does, rather than one of Python's own functions, types and constants."""
    if name.startswith("__") or value is None or isinstance(value, bool) or value is Ellipsis \
            or value is NotImplemented or type(value).__module__ == "_sitebuiltins":
        return False
    return not (isinstance(value, types.BuiltinFunctionType)
                or (callable(value) and getattr(value, "__module__", None) == "builtins"))


def _reads_computed_names(instructions: Sequence[dis.Instruction]) -> bool:
    """Whether bytecode reads a namespace by a name computed at run time: ``getattr`` whose name is not a
    string constant (``getattr(x.y, "K")`` and ``getattr(x, "K", None)`` are constant), or any use of
    ``vars``, ``globals``, ``__dict__``, ``operator.attrgetter``/``methodcaller``, ``inspect.getattr_static``."""
    for i, ins in enumerate(instructions):
        if not isinstance(ins.argval, str) or not ins.opname.startswith("LOAD_"):
            continue
        if ins.argval in _COMPUTED_READERS:
            return True
        if ins.argval != "getattr" or ins.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
            continue
        j = i + 1
        if j < len(instructions) and instructions[j].opname in _PLAIN_LOADS:
            j += 1
        while j < len(instructions) and instructions[j].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            j += 1
        constant = j < len(instructions) and instructions[j].opname == "LOAD_CONST" and \
            isinstance(instructions[j].argval, str)
        if constant and j + 1 < len(instructions) and instructions[j + 1].opname not in ("PRECALL", "CALL"):
            # a third argument (a default): one plain load, then the call
            constant = instructions[j + 1].opname in _PLAIN_LOADS and j + 2 < len(instructions) and \
                instructions[j + 2].opname in ("PRECALL", "CALL")
        if not constant:
            return True
    return False


def _computed_read(node: ast.AST) -> bool:
    """The source form of :func:`_reads_computed_names`, for a module read whole."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        return len(node.args) < 2 or not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        return node.id in _COMPUTED_READERS
    return isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in _COMPUTED_READERS


_NAMES: dict[str, frozenset[str]] = {}


def _source_names(source: bytes, path: str) -> frozenset[str]:
    """The names a module's source reads: loaded names and attributes, names imported from a module,
    and identifier-like strings."""
    key = hashlib.sha256(source).hexdigest()
    if key not in _NAMES:
        found: set[str] = set()
        for node in ast.walk(_parse(source, path)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                found.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                found.add(node.value)
            elif isinstance(node, ast.ImportFrom):  # ``from mpatch import K`` reads K when it runs
                found.update(alias.name for alias in node.names)
            if _computed_read(node):
                found.add(ANY_NAME)
        if len(_NAMES) > 4096:
            _NAMES.clear()
        _NAMES[key] = frozenset(found)
    return _NAMES[key]


def _imported_names(source: bytes, path: str, package: str | None) -> dict[str, Any]:
    """What the names bound by the import statements anywhere in a module's source (a function's own
    ``from m import Model`` too) stand for, among the modules imported now: so ``Model.SCALE = 2`` in a
    function the script calls is found although ``Model`` is not one of the script's globals."""
    found: dict[str, Any] = {}
    for level, module, name, bound in _import_bindings(source, path):
        try:
            module = importlib.util.resolve_name("." * level + module, package) if level else module
        except (ImportError, ValueError):
            continue
        if name is None:
            value = sys.modules.get(module, _ABSENT)
        else:
            base, sub = sys.modules.get(module), sys.modules.get(f"{module}.{name}")
            value = sub if sub is not None else vars(base).get(name, _ABSENT) \
                if isinstance(base, types.ModuleType) else _ABSENT
        if value is not _ABSENT:
            found[bound] = value
    return found


_BINDINGS: dict[str, tuple[tuple[int, str, str | None, str], ...]] = {}


def _import_bindings(source: bytes, path: str) -> tuple[tuple[int, str, str | None, str], ...]:
    """``(level, module, name or None, the name it binds)`` for every import statement in a module's source:
    ``import a.b`` gives ``(0, "a", None, "a")``, ``import a.b as c`` gives ``(0, "a.b", None, "c")``,
    ``from .m import X as Y`` gives ``(1, "m", "X", "Y")``."""
    key = hashlib.sha256(source).hexdigest()
    if key not in _BINDINGS:
        found: list[tuple[int, str, str | None, str]] = []
        for node in ast.walk(_parse(source, path)):
            if isinstance(node, ast.Import):
                found.extend((0, a.name if a.asname else a.name.partition(".")[0], None, a.asname or
                              a.name.partition(".")[0]) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.extend((node.level, node.module or "", a.name, a.asname or a.name) for a in node.names
                             if a.name != "*")
        if len(_BINDINGS) > 4096:
            _BINDINGS.clear()
        _BINDINGS[key] = tuple(found)
    return _BINDINGS[key]


def _parse(source: bytes, path: str) -> ast.Module:
    try:
        return ast.parse(source, path)
    except (SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[])


_Chain = tuple[str | None, ...]
_TopCall = tuple[str, _Chain, tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]
"""A call the top level makes (:func:`_top_calls`)."""
_PATCHES: dict[str, tuple[tuple[str, _Chain, str], ...]] = {}


def _patch_chains(source: bytes, path: str) -> tuple[tuple[str, _Chain, str], ...]:
    """Where a module's source may set a value on another object: ``("set", names)`` and ``("call", names)``.

    ``a.b.K = v`` (also ``+=``, annotated, ``del``, in a tuple), ``a.D[k] = v``, ``D[k] = v``, ``D |= v`` and
    ``setattr(a, "K", v)`` / ``delattr`` / ``a.__dict__["K"] = v`` / ``vars(a)["K"] = v``
    give ``("set", ("a", "b", "K"))`` and the like; a name that is not a literal
    (``setattr(a, name, v)``, ``vars(a).update(...)``) ends the chain with None.
    A call ``a.b.f(...)`` gives ``("call", ("a", "b", "f"))`` when its arguments are literals
    (``psutil.process_iter(["pid"])``), ``("call N M", ...)`` when some are names ``N``, ``M`` and the others
    literals, and ``("call-with", ...)`` when some are other expressions (``lib.set_default(lib.Model(70))``):
    an object the caller passes (:func:`_passes_an_object`); ``("call-local", ...)`` when some are names a
    function around the call binds itself (its parameter: ``def setup(h0): lib.set_h0(h0)``), whose value the
    call site does not show (:attr:`_Walker.library_local`).  The third
    member is a call's own text (``lib.set_h0(67)``), empty for the others: what a library stores from
    literals is the caller's choice as much as an object it hands over (:meth:`_Walker.patch_sites`).
    """
    key = hashlib.sha256(source).hexdigest()
    if key in _PATCHES:
        return _PATCHES[key]
    found: list[tuple[str, _Chain, str]] = []
    tree = _parse(source, path)
    bound: dict[int, set[str]] = {}  # a call inside a function: the names the functions around it bind
    for definition in ast.walk(tree):
        if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            own = _function_locals(definition)
            for call in ast.walk(definition):
                if isinstance(call, ast.Call):
                    bound.setdefault(id(call), set()).update(own)

    def target(node: ast.expr) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                target(element)
        elif isinstance(node, ast.Starred):
            target(node.value)
        elif isinstance(node, ast.Attribute):
            chain = _names(node)
            if chain is not None and len(chain) > 1:
                found.append(("set", chain, ""))
        elif isinstance(node, ast.Subscript):
            namespace = _namespace_of(node.value)
            if namespace is not None:
                name = node.slice.value if isinstance(node.slice, ast.Constant) else None
                found.append(("set", namespace + (name if isinstance(name, str) else None,), ""))
            elif isinstance(node.value, ast.Name):
                found.append(("set", (node.value.id,), ""))  # CFG[k] = v: the object CFG names, changed in place
            else:
                target(node.value)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            for each in node.targets:
                target(each)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                found.append(("set", (node.target.id,), ""))  # CFG |= {...}: a dict or list CFG names, in place
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2:
                chain = _names(node.args[0])
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if chain is not None:
                    found.append(("set", chain + (name if isinstance(name, str) else None,), ""))
            elif isinstance(func, ast.Attribute) and _namespace_of(func.value) is not None:
                found.append(("set", _namespace_of(func.value) + (None,), ""))  # type: ignore[operator]
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Subscript):
                target(func.value)  # a.D[k].append(v)
            else:
                chain = _names(func)
                if chain is not None:
                    found.append((_call_kind(node, bound.get(id(node), set())), chain, ast.unparse(node)))
    if len(_PATCHES) > 4096:
        _PATCHES.clear()
    _PATCHES[key] = tuple(dict.fromkeys(found))
    return _PATCHES[key]


def _literal(node: ast.expr) -> bool:
    """Whether ``node`` is a literal: a constant, or a list, tuple, set or dict of literals."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_literal(element) for element in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and _literal(key) for key in node.keys) and all(map(_literal, node.values))
    return False


def _call_kind(call: ast.Call, local: set[str]) -> str:
    """A call's kind for :func:`_patch_chains`, from its arguments (``local``: the names the functions around
    the call bind, whose values its module does not hold)."""
    arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
    if not all(_literal(a) or isinstance(a, ast.Name) for a in arguments):
        return "call-with"
    if any(isinstance(a, ast.Name) and a.id in local for a in arguments):
        return "call-local"
    return " ".join(["call", *sorted({a.id for a in arguments if isinstance(a, ast.Name)})])


def _passes_an_object(kind: str, scope: Mapping[str, Any]) -> bool:
    """Whether a call of :func:`_patch_chains`' ``kind`` may hand the library an object of the caller's: an
    argument other than a literal or a name of plain data (``set_default(Cosmology(H0=70))``,
    ``set_application_registry(ureg)``).  What the library stores from it counts by value, even when it is of
    the library's own type (:func:`_library_own`): its state is the caller's choice, not a cache."""
    if kind in ("call-with", "call-local"):
        return kind == "call-with"
    return any(name not in scope or not _plain(scope[name]) for name in kind.split()[1:])


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is simple values in lists, tuples, sets and dicts (a few levels deep)."""
    if isinstance(value, _SIMPLE):
        return True
    if depth > 4 or not isinstance(value, (list, tuple, set, frozenset, dict)) or len(value) > 1024:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
    return all(_plain(v, depth + 1) for v in items)


def _names(node: ast.expr) -> tuple[str, ...] | None:
    """``a.b.c`` as ``("a", "b", "c")``; None for anything else."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return tuple(reversed(names))


def _namespace_of(node: ast.expr) -> tuple[str, ...] | None:
    """``a.__dict__`` or ``vars(a)``: the names of ``a``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return _names(node.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
            and len(node.args) == 1):
        return _names(node.args[0])
    return None


_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update",
                       "setdefault", "popitem", "add", "discard", "difference_update", "intersection_update",
                       "symmetric_difference_update", "__setitem__", "__delitem__", "__setattr__", "fill",
                       "resize", "put", "itemset"})
"""Methods that change their object in place (lists, dicts, sets, numpy arrays): ``CFG.update(...)``."""


_ARGUMENT_MUTATORS = frozenset({"shuffle", "heappush", "heappop", "heapify", "heappushpop", "heapreplace",
                                "insort", "insort_left", "insort_right", "copyto", "putmask", "place",
                                "fill_diagonal"})
"""Functions that change their first argument in place: ``random.shuffle(LST)``, ``np.copyto(ARR, 2)``."""


def _root(node: ast.expr) -> str | None:
    """The global a target or a method's object starts from, through items: ``CFG["opt"]`` and
    ``CFG["opt"]["k"]`` give ``CFG``; an attribute on the way (``consts.ITEMS``) gives None (its chain is
    what is set, named on its own)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _declares_a_stage(definition: ast.AST) -> bool:
    """Whether a function is decorated as a stage (``@pipe.stage(...)``): its ranks run it as well."""
    for decorator in getattr(definition, "decorator_list", ()):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Attribute) and target.attr == "stage") or \
                (isinstance(target, ast.Name) and target.id == "stage"):
            return True
    return False


def _function_locals(definition: ast.AST) -> set[str]:
    """The names a function binds itself (parameters, plain assignments, ``for``/``with`` targets), less
    those it declares ``global``: changing what they hold does not change a global."""
    bound: set[str] = set()
    declared: set[str] = set()
    args = getattr(definition, "args", None)
    if isinstance(args, ast.arguments):
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
            if arg is not None:
                bound.add(arg.arg)
    for child in ast.walk(definition):
        if isinstance(child, ast.Global):
            declared.update(child.names)
        elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            bound.add(child.id)
    return bound - declared


def _changed_in_place(node: ast.AST, local: set[str]) -> set[str]:
    """Globals ``node`` changes in place without assigning them: ``CFG.update(...)``, ``CFG["opt"].update(...)``,
    ``LST.append(1)``, ``setattr(OPTS, "k", v)``, ``CFG["opt"]["k"] = v`` and ``OPTS.k = v`` inside a function
    (the names in ``local`` are the function's own), ``mod.__dict__["K"] = v`` (as ``mod.K``)."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            func = child.func
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
                root = _root(func.value)
                if root is not None and root not in local:
                    found.add(root)
            elif isinstance(func, ast.Name) and func.id == "setattr" and child.args:
                chain = _names(child.args[0])
                if chain is not None and chain[0] not in local:
                    found.add(chain[0])
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            changed = [child.args[0]] if name in _ARGUMENT_MUTATORS and child.args else []
            for keyword in child.keywords:
                if keyword.arg == "out":  # np.multiply(ARR, 2, out=ARR)
                    changed.append(keyword.value)
                elif keyword.arg == "inplace" and isinstance(func, ast.Attribute) and not (
                        isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                    changed.append(func.value)  # DF.drop(index=0, inplace=True)
            for argument in changed:
                root = _root(argument)
                if root is not None and root not in local:
                    found.add(root)
        targets: list[ast.expr] = []
        if isinstance(child, ast.Assign):
            targets = list(child.targets)
        elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
            targets = [child.target]
        elif isinstance(child, ast.Delete):
            targets = list(child.targets)
        for target in targets:
            if isinstance(target, ast.Subscript) and (space := _namespace_of(target.value)) is not None \
                    and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
                found.add(".".join((*space, target.slice.value)))  # helpers.__dict__["K"] = 2
            if isinstance(target, (ast.Subscript, ast.Attribute)):
                inner = target.value
                while isinstance(inner, (ast.Subscript, ast.Attribute)):
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id not in local:
                    found.add(inner.id)
                    chain = _names(target) if isinstance(target, ast.Attribute) else None
                    if chain is not None:
                        found.add(".".join(chain))  # consts.K = v in a function: consts.K
    return found


def values_set_after_declaring(source: bytes, path: str, pipelines: frozenset[str] = frozenset()) -> frozenset[str]:
    """Global names a script assigns where a stage's ranks never execute it: in its ``if __name__ ==
    "__main__":`` block, or at its top level after its first ``pipe.run(...)`` (``pipelines``: the names
    the script's pipelines are bound to; a worker executes the script as a module and stops there).

    Assignments, augmented and annotated ones, ``for``, ``with ... as``, ``except ... as`` and ``match``
    targets, ``:=``, ``del``, ``import``/``from`` bindings, ``globals()[...]``/``vars()[...]``,
    ``setattr(sys.modules[__name__], "X", v)``, globals changed in place (:func:`_changed_in_place`:
    ``CFG.update(...)``, ``LST.append(...)``, ``setattr(OPTS, "k", v)``), and the ``global`` names of the
    script's functions that such code reaches (called, or named at all: ``f = bump; f()``, ``map(bump, ...)``,
    and what those functions reach in turn) with the globals they change in place.  Code that may set any global (``exec``, ``eval``, ``globals().update(...)``,
    ``setattr`` with a computed name, ...) gives an entry starting with ``<`` naming it and its line
    (:data:`ANY_GLOBAL_SET`), which stands for every name."""
    tree = _parse(source, path)
    functions: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):  # functions and classes, methods and nested ones too, by name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            functions.setdefault(node.name, []).append(node)
    names: set[str] = set()

    def own_namespace(node: ast.AST) -> bool:
        """``globals()``, ``locals()``, ``vars()``, ``vars(sys.modules[__name__])``."""
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("globals", "vars", "locals") and \
            (not node.args or "__name__" in ast.unparse(node.args[0]) or "__main__" in ast.unparse(node.args[0]))

    def anything(child: ast.AST) -> str | None:
        """The construct, when ``child`` may set any global."""
        if not isinstance(child, ast.Call):
            return None
        func = child.func
        if isinstance(func, ast.Name) and func.id in ("exec", "eval"):
            return f"{func.id}(...)"
        if isinstance(func, ast.Name) and func.id == "setattr" and len(child.args) >= 2 and \
                not (isinstance(child.args[1], ast.Constant) and isinstance(child.args[1].value, str)):
            return "setattr(...) with a computed name"
        if isinstance(func, ast.Attribute) and own_namespace(func.value):
            return f"{ast.unparse(func.value)}.{func.attr}(...)"  # globals().update(...), .setdefault, .pop
        if isinstance(func, ast.Attribute) and func.attr in ("update", "setdefault", "__setitem__") and \
                isinstance(func.value, ast.Attribute) and func.value.attr == "__dict__":
            return f"....__dict__.{func.attr}(...)"
        return None

    def changes_its_object(method: str) -> bool:
        """Whether a script function named ``method`` changes its first parameter (``self.k = k``)."""
        for definition in functions.get(method, ()):
            args = getattr(definition, "args", None)
            first = (args.posonlyargs + args.args)[:1] if isinstance(args, ast.arguments) else []
            if first and first[0].arg in _changed_in_place(definition, _function_locals(definition) - {first[0].arg}):
                return True
        return False

    def assigned(statements: Sequence[ast.AST]) -> None:
        referenced: set[str] = set()
        named: set[str] = set()  # by a name in code, not only in a string (``run.stage("first")``)
        for node in statements:
            names.update(_changed_in_place(node, set()))
            for call in ast.walk(node):  # SC.fit(2), where the script's fit sets self.k
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                        isinstance(call.func.value, ast.Name) and changes_its_object(call.func.attr):
                    names.add(call.func.value.id)
            for child in ast.walk(node):
                targets: list[ast.AST] = []
                if isinstance(child, ast.Assign):
                    targets = list(child.targets)
                elif isinstance(child, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
                    targets = [child.target]
                elif isinstance(child, ast.Delete):
                    targets = list(child.targets)
                elif isinstance(child, ast.withitem) and child.optional_vars is not None:
                    targets = [child.optional_vars]
                elif isinstance(child, ast.ExceptHandler) and child.name or isinstance(child, (ast.MatchAs, ast.MatchStar)) and child.name:
                    names.add(child.name)
                elif isinstance(child, ast.MatchMapping) and child.rest:
                    names.add(child.rest)
                elif isinstance(child, (ast.Import, ast.ImportFrom)):
                    names.update((alias.asname or alias.name).partition(".")[0] for alias in child.names)
                elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load):
                    referenced.add(child.id)  # called, or handed on to be called
                    named.add(child.id)
                elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                    referenced.add(child.value)  # getattr(sys.modules[__name__], "bump")()
                construct = anything(child)
                if construct is not None:
                    names.add(f"<{construct} at line {getattr(child, 'lineno', '?')}>")
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "setattr" \
                        and len(child.args) >= 2 and isinstance(child.args[1], ast.Constant) and \
                        isinstance(child.args[1].value, str):
                    names.add(child.args[1].value)  # setattr(sys.modules[__name__], "X", v)
                    chain = _names(child.args[0])
                    if chain is not None:
                        names.add(".".join((*chain, child.args[1].value)))  # setattr(consts, "K", v)
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                    chain = _names(child.func.value)
                    if chain is not None and len(chain) > 1:
                        names.add(".".join(chain))  # consts.ITEMS.append(v): consts.ITEMS changed in place
                    chain = _names(child.func)
                    if chain is not None:
                        names.add(".".join(chain))  # consts.configure(v): the globals configure assigns
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute) and (chain := _names(leaf)) is not None:
                            names.add(".".join(chain))  # consts.K = v, consts.CFG["k"] = v, fit.alpha = v
                        elif isinstance(leaf, ast.Subscript) and own_namespace(leaf.value):
                            if isinstance(leaf.slice, ast.Constant) and isinstance(leaf.slice.value, str):
                                names.add(leaf.slice.value)  # globals()["X"] = v
                            else:
                                names.add(f"<{ast.unparse(leaf)} = ... at line {leaf.lineno}>")
        reached: set[str] = set()
        todo = [n for n in referenced if n in functions]
        while todo:  # bump() with ``global SCALE`` inside, and what bump reaches in turn
            name = todo.pop()
            if name in reached:
                continue
            reached.add(name)
            for definition in functions[name]:
                for child in ast.walk(definition):
                    if isinstance(child, ast.Global):
                        names.update(child.names)
                    elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load) and child.id in functions:
                        todo.append(child.id)
                    elif isinstance(child, ast.Attribute) and child.attr in functions:
                        todo.append(child.attr)  # a method: self.setup()
                    construct = anything(child)
                    if construct is not None:
                        names.add(f"<{construct} at line {getattr(child, 'lineno', '?')}, in {name}>")
        # what the functions the block calls change in place (CFG.update in a main()): those it names in code,
        # and what they name in turn, not a stage (its ranks run it too) nor a name only in a string
        called: set[str] = set()
        todo = [n for n in named if n in functions]
        while todo:
            name = todo.pop()
            if name in called or any(_declares_a_stage(d) for d in functions[name]):
                continue
            called.add(name)
            for definition in functions[name]:
                names.update(_changed_in_place(definition, _function_locals(definition)))
                todo += [c.id for c in ast.walk(definition) if isinstance(c, ast.Name)
                         and isinstance(c.ctx, ast.Load) and c.id in functions]
                todo += [c.attr for c in ast.walk(definition) if isinstance(c, ast.Attribute) and c.attr in functions]

    def is_main_guard(node: ast.stmt) -> bool:
        return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)

    def runs(node: ast.stmt) -> bool:
        return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "run"
                   and isinstance(c.func.value, ast.Name) and c.func.value.id in pipelines for c in ast.walk(node))

    after = False
    for node in tree.body:
        if is_main_guard(node):
            assigned(node.body)  # type: ignore[attr-defined]
        elif after:
            assigned([node])
        elif runs(node):
            after = True
            assigned([node])
    return frozenset(names)


def late_components(names: Iterable[str], namespace: Mapping[str, Any]) -> frozenset[str]:
    """The code fingerprint components (:func:`code_fingerprint`'s names) that the names of
    :func:`values_set_after_declaring` set, resolved in the script's ``namespace``: ``SCALE`` itself,
    ``consts.K`` as ``mylib.consts.K`` (the module's own name), ``Model.SCALE`` as ``mylib.model.Model.SCALE``,
    ``fit.alpha`` on the script's own function as ``fit()``, on its own class as ``class Model``, and
    ``consts.configure`` (called) as the globals of ``consts`` that ``configure`` assigns."""
    home = namespace.get("__name__")
    found: set[str] = set()
    for name in names:
        if name.startswith(ANY_GLOBAL_SET):
            continue
        head, _, rest = name.partition(".")
        found.add(head if not rest else name)
        obj = namespace.get(head, _ABSENT)
        if not rest or obj is _ABSENT:
            continue
        target = obj
        for part in rest.split("."):  # a module's function the block calls: the globals it assigns
            target = vars(target).get(part, _ABSENT) if isinstance(target, (types.ModuleType, type)) else _ABSENT
        if isinstance(target, types.FunctionType) and target.__globals__.get("__name__") != home:
            found.update(f"{target.__globals__.get('__name__')}.{g}" for g in _global_stores(target.__code__))
        if "." not in rest and not isinstance(obj, (types.ModuleType, type, types.FunctionType)) and \
                (_method_changes_instance(type(obj), rest, home) or (rest in _GENERATOR_SETTERS and _is_generator(obj))):
            found.add(head)  # M.load(5), where a local module's Model.load sets self.w; RNG.seed(args.seed)
        if isinstance(obj, types.ModuleType):
            found.add(f"{obj.__name__}.{rest}")
        elif isinstance(obj, (type, types.FunctionType)) and obj.__module__ != home:
            found.add(f"{obj.__module__}.{obj.__qualname__}.{rest}")
        elif isinstance(obj, types.FunctionType):
            found.add(f"{head}()")
        elif isinstance(obj, type):
            found.add(f"class {head}")
    return frozenset(found)


_GENERATOR_SETTERS = frozenset({"seed", "setstate", "set_state", "manual_seed", "set_rng_state"})
"""Methods that set a generator's state: ``RNG.seed(args.seed)`` on a global ``random.Random``, numpy
``RandomState`` or torch ``Generator`` in the main block changes it where the ranks never execute it."""


def _is_generator(value: Any) -> bool:
    """Whether ``value`` is a random generator object: a ``random.Random``, numpy's ``RandomState`` or
    ``Generator``, a torch ``Generator``."""
    import random

    kind = type(value)
    return isinstance(value, random.Random) or (kind.__name__ in ("RandomState", "Generator")
                                                and kind.__module__.partition(".")[0] in ("numpy", "torch"))


def _method_changes_instance(cls: type, name: str, home: str | None, seen: set[str] | None = None) -> bool:
    """Whether calling method ``name`` on an instance of ``cls`` changes that instance: the method, defined
    in the user's own code outside the script (a local module, a ``PYTHONPATH`` folder, an editable install;
    not the standard library nor an installed package, whose methods are not read), sets or changes in place
    an attribute of its first parameter (``self.w = w``, ``self.hist.append(v)``, ``self.update(...)``), itself
    or through a method of the same instance it calls (``self._set(w)``).  The script's own methods are read
    from its source (:func:`values_set_after_declaring`)."""
    seen = set() if seen is None else seen
    if name in seen:
        return False
    seen.add(name)
    method = next((vars(klass)[name] for klass in cls.__mro__ if name in vars(klass)), None)
    method = getattr(method, "__func__", method)  # a classmethod changes what its class holds
    if not isinstance(method, types.FunctionType) or method.__module__ == home:
        return False
    path = os.path.realpath(method.__code__.co_filename)
    if path.startswith(_external_dirs()) or "site-packages" in path or "dist-packages" in path or \
            method.__module__.partition(".")[0] == "hetflow":
        return False
    try:
        definition = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    args = getattr(definition, "args", None)
    first = (args.posonlyargs + args.args)[:1] if isinstance(args, ast.arguments) else []
    if not first:
        return False
    me = first[0].arg
    if me in _changed_in_place(definition, _function_locals(definition) - {me}):
        return True
    return any(_method_changes_instance(cls, call.func.attr, home, seen) for call in ast.walk(definition)
               if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
               and isinstance(call.func.value, ast.Name) and call.func.value.id == me)


ANY_GLOBAL_SET = "<"
"""The first character of an entry of :func:`values_set_after_declaring` that stands for every name."""


def library_kept(value: Any) -> str:
    """What the key counts of a library global that is the library's own state (:func:`_library_own`): its
    type; a rank digests its own the same way (:func:`hetflow.observed.code_in_rank`)."""
    return f"<a {type(value).__qualname__} the library keeps>"


_CONTAINER_TYPES = (list, tuple, set, frozenset, dict)


def _library_own(value: Any, top: str) -> bool:
    """Whether ``value`` is the library ``top``'s own state: an empty container, or containers (a few levels
    deep, at most a few thousand members) holding objects of that library's types and simple values, at
    least one of them the library's.  Plain data (a setting) and an object of another package (a config
    object the user passed) are not."""
    found = [False]

    def own(v: Any, depth: int, budget: list[int]) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > 4:
            return False
        if isinstance(v, _SIMPLE):
            return True
        if isinstance(v, (list, tuple, set, frozenset, dict)):
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)
            return all(own(x, depth + 1, budget) for x in items)
        if (type(v).__module__ or "").partition(".")[0] == top:
            found[0] = True
            return True
        return False

    if isinstance(value, (list, tuple, set, frozenset, dict)) and not value:
        return True  # an empty cache: counted as when it fills
    return own(value, 0, [4096]) and found[0]


def _resolve_patch(namespace: Mapping[str, Any], chain: _Chain, kind: str,
                   held: Mapping[int, tuple[Any, str]] | None = None) -> list[tuple[Any, str | None]]:
    """The ``(module or class, attribute)`` a patch site sets, looked up without running code.

    The chain is followed through modules and classes (``vars``, never ``getattr``);
    it stops at the first other value: ``a.CONFIG.k = v`` and ``a.ITEMS.append(v)``
    set ``a.CONFIG`` and ``a.ITEMS``; ``a.f.gain = v`` (an attribute of a function)
    sets ``a.f``.  A chain that starts at a value another user module holds
    (``from a import CONFIG`` then ``CONFIG["k"] = v``; ``held`` maps such values
    by identity to their module and name) sets that module's name.  A call of a
    function (``a.configure(2)``) sets the globals that function assigns
    (``global K``) in its own module.
    """
    obj = namespace.get(chain[0] or "", _ABSENT)
    names = chain[1:]
    if held and not isinstance(obj, (types.ModuleType, type)) and id(obj) in held:
        return [held[id(obj)]]  # changed in place through another name for it
    for i, name in enumerate(names):
        if not isinstance(obj, (types.ModuleType, type)):
            return []
        last = i == len(names) - 1
        if name is None or (last and kind == "set"):
            return [(obj, name)]
        value = vars(obj).get(name, _ABSENT)
        if not last and value is _ABSENT:
            return []
        if not last and not isinstance(value, (types.ModuleType, type)) and not _is_code_like(value):
            return [(obj, name)]  # a value changed in place: a.CONFIG.k = v, a.ITEMS.append(v)
        if not last and isinstance(value, types.FunctionType) and (kind == "set" or i < len(names) - 2):
            return [(obj, name)]  # an attribute of a function set from outside: a.f.gain = v
        obj = value
    if kind == "call" and isinstance(obj, types.FunctionType):
        module = sys.modules.get(obj.__globals__.get("__name__") or "")
        return [(module, name) for name in sorted(_global_stores(obj.__code__))] if module is not None else []
    return []


@functools.lru_cache(maxsize=4096)
def _global_stores(code: types.CodeType) -> frozenset[str]:
    """The globals ``code`` (and the code nested in it) assigns or deletes: a function of the code object alone,
    so kept per code object (a stage's key asks it of the same library functions again and again)."""
    found = {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _global_stores(const)
    return frozenset(found)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()
_SINGLEDISPATCH = frozenset({"registry", "dispatch", "register", "_clear_cache"})


def _owner_name(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"


_LRU_WRAPPER = type(functools.lru_cache(lambda: None))


def _wrapped(obj: Any) -> Callable[..., Any] | None:
    """The function a callable object wraps (its ``__wrapped__``, read without running a descriptor), else None."""
    if isinstance(obj, (types.FunctionType, type, types.ModuleType)) or not callable(obj):
        return None  # a function's __wrapped__ is part of the function (see function())
    try:
        inner = inspect.getattr_static(obj, "__wrapped__", None)
        # numpy.vectorize keeps its function as .pyfunc, numba's dispatchers as .py_func
        inner = inner if callable(inner) else inspect.getattr_static(obj, "pyfunc", None)
        inner = inner if callable(inner) else inspect.getattr_static(obj, "py_func", None)
    except Exception:  # noqa: BLE001 - an odd object: nothing to follow
        return None
    if isinstance(inner, (property, types.MemberDescriptorType)) or not callable(inner):
        return None
    found: Callable[..., Any] = inner
    return found


def _data_text(obj: Any) -> str | None:
    """An Arrow table, batch or array, a polars frame or series, or a torch tensor by its content (Arrow's
    IPC bytes; a tensor's dtype, shape and bytes); None for another type of those packages."""
    import pyarrow as pa

    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if type(obj).__module__.startswith("polars") and callable(getattr(obj, "to_arrow", None)):
        obj = obj.to_arrow()
    if isinstance(obj, (pa.Array, pa.ChunkedArray)):
        obj = pa.table({"": obj})
    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, obj.schema) as writer:
            writer.write(obj)
        return f"{kind} {_sha(sink.getvalue().to_pybytes())}"
    if type(obj).__module__.startswith("torch"):
        import torch

        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
            data = obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            return f"{kind} {obj.dtype} {tuple(obj.shape)} grad={obj.requires_grad} {_sha(data)}"
    return None


_AT_NAME = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCANNED = frozenset({"pandas", "pyarrow", "polars", "numpy"})
"""The libraries whose frames, tables and arrays DuckDB's replacement scan finds by a name in a query."""

_OPAQUE = "opaque "
"""In :attr:`_Walker.shortened`: a type whose value has no text form and no state hetflow can read."""
_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def _instance_state(obj: Any) -> dict[str, Any] | None:
    """An instance's fields: its ``__dict__`` and its ``__slots__`` (set ones), read without running user code."""
    state: dict[str, Any] = {}
    found = False
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        fields = None
    if isinstance(fields, dict):
        state.update(fields)
        found = True
    for cls in type(obj).__mro__:
        slots = vars(cls).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            attr = f"_{cls.__name__.lstrip('_')}{slot}" if slot.startswith("__") and not slot.endswith("__") else slot
            descriptor = vars(cls).get(attr)
            if isinstance(descriptor, types.MemberDescriptorType):
                found = True
                try:
                    state[attr] = descriptor.__get__(obj, cls)
                except AttributeError:  # not set
                    continue
    for name in _unkeyed(type(obj)):  # fields a class says are not its value (hetflow's Pipeline: its stages)
        state.pop(name, None)
    return state if found else None


def _unkeyed(cls: type) -> frozenset[str]:
    """The fields a class leaves out of its instances' values (``__hetflow_unkeyed__``, read without running
    its code): hetflow's :class:`~hetflow.Pipeline`, whose stages differ in a rank."""
    for klass in cls.__mro__:
        found = vars(klass).get("__hetflow_unkeyed__")
        if isinstance(found, frozenset):
            return found
    return frozenset()


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell: the variable is not assigned yet
        return False
    return True


def _is_code_like(obj: Any) -> bool:
    return isinstance(obj, (types.FunctionType, type, types.ModuleType, types.MethodType, functools.partial))


def _const_text(const: Any) -> str:
    """A code constant as text that is the same in every process: a ``frozenset`` constant (what a set
    literal of constants compiles to, ``x in {"ra", "dec"}``) iterates in an order that depends on the
    interpreter's hash seed, which ``repr`` would copy, so its members are sorted."""
    if isinstance(const, types.CodeType):
        return _code_text(const)
    if isinstance(const, frozenset):
        return f"frozenset{{{', '.join(sorted(_const_text(c) for c in const))}}}"
    if isinstance(const, tuple):
        return f"tuple({', '.join(_const_text(c) for c in const)})"
    return f"{type(const).__name__}:{const!r}"


def _code_text(code: types.CodeType) -> str:
    consts = [_const_text(c) for c in code.co_consts]
    return (f"{code.co_code.hex()} consts={consts} names={code.co_names} vars={code.co_varnames} "
            f"free={code.co_freevars} cell={code.co_cellvars} args={code.co_argcount},"
            f"{code.co_posonlyargcount},{code.co_kwonlyargcount} flags={code.co_flags}")


def code_fingerprint(func: Callable[..., Any], *, roots: Sequence[str | Path] | None = None) -> dict[str, str]:
    """``{component: digest}`` for a stage function and the user code it reaches (see the module docstring).

    Names read like ``"transform()"``, ``"Model.fit()"`` (a nested function:
    ``"make.<locals>.inner()"``), ``"class Model"``, ``"SCALE"``, ``"module
    mylib"``, ``"mylib.helper()"``.  A global that a function loads but that is
    not defined (yet) is recorded as ``"<undefined>"``.
    """
    chosen = [str(r) for r in roots] if roots is not None else _default_roots(func)
    return _Walker(func, chosen).run()


def uncacheable(code: Mapping[str, str]) -> str | None:
    """Why a stage with this code fingerprint must not be served from the cache nor stored in it, or None:
    it reads a value hetflow cannot digest faithfully (a type it does not know whose ``repr`` is shortened,
    so a change in what the text leaves out would not change the key)."""
    found = [f"{key[len(UNCACHEABLE):]} {text}" for key, text in sorted(code.items()) if key.startswith(UNCACHEABLE)]
    if not found:
        return None
    return (f"not cached: {'; '.join(found)} (hetflow cannot digest it, so a change inside it would not change "
            "the key): the stage runs every time; to cache it, let it read that data from a file declared in files=")


def sources_changed(code: Mapping[str, str]) -> list[str]:
    """The files of the local modules in a code fingerprint whose content is no longer what it hashed (a
    module edited since), sorted; reads only those files (no walk), so it is cheap enough for every stage's
    end.  External packages (counted by version) are not read."""
    changed = []
    for key, digest in code.items():
        if not key.startswith("module ") or len(digest) != 64:  # a version, "<no file>"
            continue
        name = key[len("module "):]
        module = sys.modules.get(name)
        path, archive = _module_file(vars(module)) if isinstance(module, types.ModuleType) and \
            not _deferred(module) else (None, None)
        if path is None:
            found = _locate(name)
            path = found.origin if found is not None and found.has_location else None
        if not isinstance(path, str):
            continue
        content = _module_content(path, archive)
        if content is None or content[0] != digest:
            changed.append(path)
    return sorted(changed)


def describe_change(old: Mapping[str, str], new: Mapping[str, str]) -> str:
    """Why two fingerprints differ: changes, then additions, then removals, each sorted by name.

    For example ``"code of transform() changed; SCALE changed; helper() added"``, or ``"unchanged"``.
    """
    changed = [f"code of {k} changed" if k.endswith("()") else f"{k} changed"
               for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    added = [f"{k} added" for k in sorted(new.keys() - old.keys())]
    removed = [f"{k} removed" for k in sorted(old.keys() - new.keys())]
    return "; ".join(changed + added + removed) or "unchanged"


def fingerprint_digest(*parts: Mapping[str, str]) -> str:
    """One hex digest over one or more fingerprints (order of the parts counts, order within each does not)."""
    return _sha(json.dumps([sorted(p.items()) for p in parts]))


# ------------------------------------------------------------------------------------ files
def _matches(patterns: Iterable[str], base: Path) -> list[tuple[str, Path | Location | None]]:
    """``(pattern, path)`` for each file a pattern names (a :class:`Location` for an object on a store),
    ``(pattern, None)`` for a glob without match."""
    found: list[tuple[str, Path | Location | None]] = []
    for pattern in patterns:
        if is_object_store(pattern):
            found.extend((pattern, where) for where in _objects(pattern))
            continue
        full = Path(pattern) if os.path.isabs(pattern) else Path(base) / pattern
        if glob.has_magic(pattern):
            hits = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if os.path.isfile(p))
            found.extend((pattern, p) for p in hits) if hits else found.append((pattern, None))
        elif full.is_file():
            found.append((pattern, full))
        elif full.exists():
            raise ValueError(f"declared file {pattern!r} is a directory ({full}); name its files with a glob "
                             f"such as {os.path.join(pattern, '**', '*')!r}")
        else:
            raise ValueError(f"declared file {pattern!r} does not exist ({full})")
    return found


def _objects(pattern: str) -> list[Location | None]:
    """The objects an object-store pattern names: the object, or a glob's matches by the readers' rule
    (:func:`hetflow.operators.location.glob_files`: segment by segment); ``[None]`` for a glob without match.
    A failed listing is a ``ValueError`` with the store's one line (bucket, key, cause)."""
    if carries_settings(pattern):
        raise ValueError(f"declared file {redact(pattern)!r}: credentials and options do not go into the URI; set "
                         "them in the AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, "
                         "AWS_PROFILE, ...)")
    where = resolve(pattern)
    try:
        if glob_start(where.path) >= 0:
            infos = glob_files(where)
            if not infos:
                check_bucket(where)
                return [None]
            scheme = where.uri.split("://", 1)[0]
            return [Location(where.filesystem, i.path, f"{scheme}://{i.path}", False) for i in infos]
        from pyarrow.fs import FileType  # only for objects: a local run never loads pyarrow.fs (and TLS)

        info = where.filesystem.get_file_info(where.path)
        if info.type == FileType.File:
            return [where]
        if info.type == FileType.Directory:
            raise ValueError(f"declared file {pattern!r} is a prefix of objects (bucket {where.bucket!r}, key "
                             f"{where.key!r}), not an object; name its objects with a glob such as "
                             f"{where.uri.rstrip('/') + '/*'!r}")
        check_bucket(where)
    except StorageError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(str(storage_error(exc, where, "list"))) from None
    raise ValueError(f"declared file {pattern!r} does not exist (bucket {where.bucket!r}, key {where.key!r})")


def check_files(patterns: Sequence[str], base: Path) -> None:
    """Raise ``ValueError`` naming the first pattern that names no file: a path that is missing or a
    directory (as :func:`resolve_files`), or a glob that matches no file, with the directory it was
    resolved against (the bucket, on an object store).  Called when a run starts: by then a file an
    earlier step of the script makes is there, and a pattern that matches nothing is a mistake (a typo,
    the wrong directory), not a stage that should run on no files."""
    for pattern, path in _matches(patterns, base):
        if path is None and is_object_store(pattern):
            where = resolve(pattern)
            raise ValueError(f"declared files glob {pattern!r} matches no object in bucket {where.bucket!r} "
                             f"(key {where.key!r})")
        if path is None:
            where = f"in {Path(base).absolute()} (the script's directory: relative patterns are resolved " \
                    "against it)" if not os.path.isabs(pattern) else "on this machine"
            raise ValueError(f"declared files glob {pattern!r} matches no file {where}")


def resolve_files(patterns: Sequence[str], base: Path) -> tuple[Path | str, ...]:
    """The absolute, distinct files the declared ``patterns`` name (globs relative to ``base``), in the
    order declared (a glob's matches sorted), so ``files=["obs.csv", "cat.csv"]`` gives ``ctx.files[0]``
    the observations.  An object on a store is its URI (a ``str``): :data:`DeclaredFile`.

    A glob that matches nothing adds nothing; a plain path that is missing or a
    directory raises ``ValueError`` naming the pattern (the caller adds the stage).
    """
    return tuple(dict.fromkeys(p.absolute() if isinstance(p, Path) else p.uri
                               for _, p in _matches(patterns, base) if p is not None))


def file_fingerprint(patterns: Sequence[str], base: Path) -> dict[str, str]:
    """``{path: blake2b of the content}`` for the files ``patterns`` name, sorted by path.

    A path is written relative to ``base`` when it lies under it, absolute
    otherwise.  A glob that matches nothing is recorded as ``{pattern:
    NO_MATCH}``, so a file that appears later changes the fingerprint.  Every
    byte is read on every call (no mtime shortcut).  An object on a store is
    ``{its URI: "etag:<ETag> size:<bytes>"}``, asked of the store without reading
    it (:func:`hetflow.operators.location.object_versions`).  Errors as :func:`resolve_files`.
    """
    base = Path(base).absolute()
    result: dict[str, str] = {}
    objects: list[Location] = []
    for pattern, path in _matches(patterns, base):
        if path is None:
            result[pattern] = NO_MATCH
        elif isinstance(path, Location):
            objects.append(path)
        else:
            path = path.absolute()
            key = path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)
            result[key] = file_digest(path)
    result.update(zip((o.uri for o in objects), _object_versions(objects)))
    return dict(sorted(result.items()))


def file_digest(path: Path | str) -> str:
    """The content digest of a declared file (also a map item's file: :mod:`hetflow.mapping`); of an
    object on a store (its URI), its ETag and size, as :func:`file_fingerprint` records them."""
    if isinstance(path, str) and is_object_store(path):
        return _object_versions([resolve(path)])[0]
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(paths: Sequence[Path | str]) -> list[str]:
    """:func:`file_digest` of each of ``paths``, the objects' asked of the store together."""
    objects = [resolve(p) for p in paths if isinstance(p, str) and is_object_store(p)]
    versions = iter(_object_versions(objects))
    return [next(versions) if isinstance(p, str) and is_object_store(p) else file_digest(p) for p in paths]


def _object_versions(objects: Sequence[Location]) -> list[str]:
    """:func:`hetflow.operators.location.object_versions`, a failure a ``ValueError`` (the store's one line)."""
    try:
        return object_versions(objects)
    except StorageError as exc:
        raise ValueError(str(exc)) from None
