"""Stage declarations: what ``@pipe.stage(...)`` records."""

from __future__ import annotations

import hashlib
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

    @property
    def module(self) -> str:
        return str(getattr(self.func, "__module__", "__main__"))

    @property
    def path(self) -> str | None:
        """The file that defines the stage function: for one wrapped by a decorator that says what it wraps
        (``functools.wraps``: ``__wrapped__``), the wrapped function's, where ``__module__`` points too.
        ``None`` for a function that has no file a worker could execute (a notebook cell, stdin, ``-c``):
        it is shipped by value (:mod:`hetflow.tasks.shipping`)."""
        if self.module == "__main__" and ships_by_value(self.func):
            return None
        try:
            path = inspect.getsourcefile(inspect.unwrap(self.func))
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
