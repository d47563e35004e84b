"""Stage declarations: what ``@pipe.stage(...)`` records."""

from __future__ import annotations

import hashlib
import functools
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from hetflow.tasks.description import ResourceRequest
from hetflow.tasks.shipping import ships_by_value

from .errors import PipelineError

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
"""Stage, dataset and pipeline names become directory names: no separators, no leading dot or dash.

Always matched with ``fullmatch``: ``^...$`` with ``match`` accepts a trailing newline.
"""


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""An environment variable a stage may declare (``env=``): what a POSIX shell can name."""


def check_env(names: Any, *, where: str) -> tuple[str, ...]:
    """``env=`` as a tuple of distinct variable names; :class:`PipelineError` naming the bad one."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        raise PipelineError(f"{where}: env must be a list of environment variable names, got {names!r}")
    for name in names:
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise PipelineError(f"{where}: env: {name!r} is not an environment variable name (letters, digits "
                                "and '_', not starting with a digit)")
    if len(set(names)) != len(names):
        raise PipelineError(f"{where}: env lists a variable twice: {list(names)}")
    return tuple(names)


def check_name(kind: str, name: Any, *, where: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise PipelineError(f"{where}: bad {kind} name {name!r} (use letters, digits, '_', '.', '-'; "
                            "not starting with '.' or '-', at most 128 characters)")
    return name


@dataclass(frozen=True)
class StageSpec:
    """One declared stage: its function, datasets, resource request and policies."""

    name: str
    func: Callable[..., Any]
    request: ResourceRequest
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    retries: int = 0
    timeout: float | None = None
    schemas: Mapping[str, Any] = field(default_factory=dict)
    """Declared Arrow schemas by dataset name, checked at the stage boundary."""
    files: tuple[str, ...] = ()
    """Files or globs the stage reads (relative to its script's directory): their content is part of its
    cache key, and ``ctx.files`` lists them resolved."""
    env: tuple[str, ...] = ()
    """Environment variables the stage reads: their values (as the orchestrator sees them) are part of its
    cache key, and ``ctx.env`` (and ``os.environ`` in the stage) hold exactly those values."""
    map_over: "MapSpec | None" = None
    """A map stage's items (:class:`MapSpec`); ``None``: a plain stage, one task."""
    max_failures: int | float = 0
    """A map stage still succeeds with up to this many failed items (a float: this fraction of its items)."""
    map_isolation: str = "checked"
    """How a map stage's one-rank items are kept apart (:data:`MAP_ISOLATION`, :mod:`hetflow.tasks.mapitems`)."""

    @property
    def module(self) -> str:
        """The module a worker imports to find the stage: the function's, or for a ``functools.partial`` (whose
        ``__module__`` is ``functools``) the module of the function it binds, where the stage is declared."""
        func = self.func
        while isinstance(func, functools.partial):
            func = func.func
        return str(getattr(func, "__module__", "__main__"))

    @functools.cached_property
    def path(self) -> str | None:
        """The file that defines the stage function (found once: the run reads it for every task): for one wrapped by a decorator that says what it wraps
        (``functools.wraps``: ``__wrapped__``), the wrapped function's, where ``__module__`` points too.
        ``None`` for a function that has no file a worker could execute (a notebook cell, stdin, ``-c``):
        it is shipped by value (:mod:`hetflow.tasks.shipping`)."""
        if self.module == "__main__" and ships_by_value(self.func):
            return None
        func = self.func
        while isinstance(func, functools.partial):
            func = func.func
        try:
            path = inspect.getsourcefile(inspect.unwrap(func))
        except (TypeError, ValueError):
            return None
        return None if path is None else os.path.abspath(path)  # workers run in another directory

    @property
    def qualname(self) -> str:
        return str(getattr(self.func, "__name__", self.name))

    def code_hash(self) -> str:
        """Hash of the stage function's source (falls back to its bytecode)."""
        try:
            text = inspect.getsource(self.func).encode()
        except (OSError, TypeError):
            code = getattr(self.func, "__code__", None)
            text = code.co_code if code is not None else repr(self.func).encode()
        return hashlib.sha256(text).hexdigest()

    def __repr__(self) -> str:
        return (f"StageSpec(name={self.name!r}, inputs={list(self.inputs)}, outputs={list(self.outputs)}, "
                f"request=ResourceRequest({self.request}), retries={self.retries}, timeout={self.timeout})")


MAP_ISOLATION = ("checked", "fork")
"""``map_isolation=``: items one after another in a warm process, checked for state they leave (``checked``), or
a process each (``fork``)."""

MAP_KINDS = ("files", "rows:NAME", "partitions:NAME", "a grid {name: [values]}")


@dataclass(frozen=True)
class MapSpec:
    """What a map stage (``map_over=``) runs once per item over.

    ``kind`` is ``files`` (each file the stage's ``files=`` name), ``rows`` or
    ``partitions`` (of the input ``input``), or ``grid`` (the cross product of
    ``grid``'s value lists, each point a dict of parameters).
    """

    kind: str
    input: str | None = None
    grid: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    def points(self) -> list[dict[str, Any]]:
        """The grid's points in order: the last name varies fastest (``itertools.product``)."""
        import itertools

        names = [name for name, _ in self.grid]
        return [dict(zip(names, values)) for values in itertools.product(*(v for _, v in self.grid))]

    def __str__(self) -> str:
        if self.kind == "grid":
            return "{" + ", ".join(f"{name!r}: {len(values)} values" for name, values in self.grid) + "}"
        return self.kind if self.input is None else f"{self.kind}:{self.input}"


def check_map(map_over: Any, *, inputs: tuple[str, ...], files: tuple[str, ...], where: str) -> MapSpec | None:
    """``map_over=`` as a :class:`MapSpec`; :class:`PipelineError` naming what is wrong with it."""
    import json

    if map_over is None:
        return None
    if isinstance(map_over, Mapping):
        if not map_over:
            raise PipelineError(f"{where}: map_over grid is empty; give {{name: [values, ...]}}")
        grid = []
        for name, values in map_over.items():
            if not isinstance(name, str) or not name:
                raise PipelineError(f"{where}: map_over grid key {name!r} must be a parameter name (a string)")
            if not isinstance(values, (list, tuple)):
                raise PipelineError(f"{where}: map_over grid value for {name!r} must be a list of values, "
                                    f"got {type(values).__name__} {values!r}")
            if not values:
                raise PipelineError(f"{where}: map_over grid value for {name!r} is an empty list")
            try:
                json.dumps(list(values), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise PipelineError(f"{where}: map_over grid values for {name!r} must be JSON values (numbers, "
                                    f"strings, booleans, None, lists, dicts): {exc}") from None
            grid.append((name, tuple(values)))
        return MapSpec("grid", grid=tuple(grid))
    if not isinstance(map_over, str):
        raise PipelineError(f"{where}: map_over must be one of {list(MAP_KINDS)}, got {type(map_over).__name__} "
                            f"{map_over!r}")
    if map_over == "files":
        if not files:
            raise PipelineError(f"{where}: map_over='files' needs files=[...] (the files or globs to map over)")
        return MapSpec("files")
    kind, _, name = map_over.partition(":")
    if kind in ("rows", "partitions") and name:
        if name not in inputs:
            raise PipelineError(f"{where}: map_over={map_over!r} names {name!r}, which is not one of its inputs "
                                f"{list(inputs)}")
        return MapSpec(kind, input=name)
    raise PipelineError(f"{where}: map_over={map_over!r} is not one of {list(MAP_KINDS)}")


def check_map_isolation(value: Any, *, mapped: bool, where: str) -> str:
    """``map_isolation=``: one of :data:`MAP_ISOLATION`, other than the default only on a map stage."""
    if value not in MAP_ISOLATION:
        raise PipelineError(f"{where}: map_isolation={value!r} is not one of {list(MAP_ISOLATION)}")
    if not mapped and value != "checked":
        raise PipelineError(f"{where}: map_isolation is for map stages (map_over=...)")
    return str(value)


def check_max_failures(value: Any, *, where: str) -> int | float:
    """``max_failures=``: a count of items (an int >= 0) or a fraction of them (a float in [0, 1))."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PipelineError(f"{where}: max_failures must be a count (int >= 0) or a fraction (float in [0, 1)), "
                            f"got {value!r}")
    if isinstance(value, int) and value < 0 or isinstance(value, float) and not 0.0 <= value < 1.0:
        raise PipelineError(f"{where}: max_failures must be a count (int >= 0) or a fraction (float in [0, 1)), "
                            f"got {value!r}")
    return value
