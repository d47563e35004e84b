"""Importing a pipeline script in a worker, without the top-level imports its stage does not use.

A worker finds a stage defined in a script (``__main__``) by executing the
script again, so every rank of every stage would pay for everything the
script imports at its top, ``import torch`` included, whether its stage uses
it or not.  :func:`import_script` executes the script with its top-level
``import X`` / ``import X as Y`` statements *deferred*: ``X`` is found (a
module that is not installed still fails at the import line), bound to a
lazy module (:class:`importlib.util.LazyLoader`), and executed on the first
attribute access, so a stage that uses it gets the real module and one that
does not never loads it.

Deferred are only the script's own module-level ``import`` statements of a
top-level module of an installed package or the standard library, written in
Python, not yet imported, whose bound name the script uses somewhere (a module
imported only for its side effects stays eager).  The user's own modules (beside
the script, on ``PYTHONPATH``, installed editable from a source tree) are
imported at the line that imports them, as in the orchestrator: what they do at
import (read a data file, seed a generator, fill a registry the script's top
then reads) must happen before the rest of the top level, or the rank computes
its globals from another state than the one the stage's key was made from.
Imports inside a ``try`` or ``with`` block stay eager too: a fallback (``except
ImportError: import slow as impl``, ``with suppress(ImportError):``) needs the
import to fail where it is written.
``from X import Y``, ``import X.Y``, C extensions, modules already imported and
every import made by other modules load as usual.

The fork server reads and compiles a script once (:func:`prepare`), so each
task it forks executes the code object instead of parsing and compiling the file
again; a file that no longer has the prepared content is compiled afresh.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import HetflowError

_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)
"""Loaders whose modules can be executed later (a C extension is created when it is found)."""


def deferrable(source: str | bytes) -> frozenset[str]:
    """The top-level modules the script imports as ``import X [as Y]`` at module level and uses by name."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # name in the script -> module
    todo: list[ast.stmt] = list(tree.body)
    while todo:  # module level: the body, and blocks that run with it (if, with, loops; not def or class)
        node = todo.pop()
        if isinstance(node, ast.Import):
            for alias in node.names:
                if "." not in alias.name:
                    bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, (ast.Try, ast.TryStar, ast.With)):
            continue  # in a try block or `with suppress(ImportError):` the import tests whether it imports: eager
        elif isinstance(node, (ast.If, ast.For, ast.While)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, ()):
                    todo += child.body if isinstance(child, ast.ExceptHandler) else [child]
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return frozenset(module for name, module in bound.items() if name in used)


class _Deferring(importlib.abc.MetaPathFinder):
    """Finds ``names`` lazily when the script's module-level code imports them; nothing else."""

    def __init__(self, namespace: dict[str, Any], names: frozenset[str]) -> None:
        self.namespace = namespace
        self.names = names

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or fullname not in self.names or not self._from_script_top_level():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if not _installed(spec.origin):
            return None  # the user's module: imported here and now, as the orchestrator did
        if isinstance(spec.loader, _LOADERS):
            spec.loader = importlib.util.LazyLoader(spec.loader)
        return spec

    def _from_script_top_level(self) -> bool:
        """Is the import statement being run the script's own module-level code?"""
        frame: types.FrameType | None = sys._getframe(2)  # above find_spec
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return frame is not None and frame.f_globals is self.namespace and frame.f_code.co_name == "<module>"


def _installed(origin: str | None) -> bool:
    """Whether a module found at ``origin`` belongs to the Python installation or an installed package."""
    if not origin:
        return False
    from .itemstate import user_module_file

    return not user_module_file(origin)


_PREPARED: dict[tuple[str, str], tuple[frozenset[str], types.CodeType]] = {}
"""(path, sha256 of the file's bytes) -> what :func:`import_script` needs: deferrable names, code object."""


def _digest(source: bytes) -> str:
    import hashlib

    return hashlib.sha256(source).hexdigest()


def prepare(path: str, source: bytes) -> None:
    """Analyse and compile the script ``path`` (its bytes ``source``) once, for every later
    :func:`import_script` of the same content in this process and the processes forked from it.

    Nothing of the script runs here; a file that does not compile is left to the task that
    executes it (which reports the error as a cold start would)."""
    try:
        code = compile(source, path, "exec", dont_inherit=True)  # as the source loader compiles it
        names = deferrable(source)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    _PREPARED[(path, _digest(source))] = (names, code)


SCRIPT_MODULE = "__hetflow_script__"
"""The name a worker gives the pipeline script it executes."""

class ScriptChanged(HetflowError, RuntimeError):
    """The script's file is not the version its run started with."""


def check_unchanged(path: str, digest: str | None, stage: str) -> None:
    """Raise :class:`ScriptChanged` unless the file at ``path`` has the sha256 ``digest`` (``None``: unchecked).

    A stage's cache key is made from the code the run started with; executing an edited file in a worker
    would store the new code's result under the old code's key."""
    if digest is None:
        return
    import hashlib

    try:
        now = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return  # executing it says what is wrong
    if now != digest:
        raise ScriptChanged(f"stage {stage!r}: the script {path} was changed after this run started; a run "
                            "executes only the version it started with (its stages' cache keys are that "
                            "version's), so this stage cannot run: let the run end, then run the script again "
                            "(or resume the run: a resume starts from the file as it is then)")


def import_script(path: str, module_name: str) -> types.ModuleType:
    """Execute the script at ``path`` as the module ``module_name``, its unused top-level imports deferred.

    The module is in ``sys.modules`` under ``module_name`` while it runs (so that
    its functions, classes and pickles find it) and afterwards; exceptions from
    the script propagate.
    """
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import the pipeline script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        source = Path(path).read_bytes()
    except OSError:
        source = None  # the loader reports what is wrong with the file
    prepared = _PREPARED.get((path, _digest(source))) if source is not None else None
    if prepared is not None:
        names, code = prepared
    else:
        code = None
        try:
            names = deferrable(source) if source is not None else frozenset()
        except (SyntaxError, ValueError, UnicodeDecodeError):
            names = frozenset()  # the loader reports what is wrong with the file
    finder = _Deferring(module.__dict__, names)
    sys.meta_path.insert(0, finder)
    try:
        if code is not None:
            exec(code, module.__dict__)  # what the loader's exec_module does with the code it compiles
        else:
            spec.loader.exec_module(module)
    finally:
        sys.meta_path.remove(finder)
    return module


def is_deferred(module: types.ModuleType) -> bool:
    """Whether ``module`` is a deferred import not loaded yet (looking at it does not load it)."""
    lazy = getattr(importlib.util, "_LazyModule", None)
    return lazy is not None and isinstance(module, lazy)
