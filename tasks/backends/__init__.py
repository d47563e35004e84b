"""Backends: the engines that start a task's ranks on the slots the pilot chose.

:func:`get_backend` maps a pilot's ``backend:`` name to its class, importing the
module only when asked, so ``import hetflow`` never pulls in RADICAL-Pilot,
Parsl or Dask.  A missing optional engine is a :class:`MissingExtraError`
that names the ``pip install 'hetflow[...]'`` that fixes it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import ConfigError, MissingExtraError

if TYPE_CHECKING:
    from .base import Backend

# name -> (module under hetflow.tasks.backends, class, top-level packages it needs, pip extra)
_REGISTRY: dict[str, tuple[str, str, tuple[str, ...], str | None]] = {
    "local": ("local", "LocalBackend", ("mpi4py",), "mpich"),
    "slurm": ("slurm", "SlurmBackend", ("mpi4py",), "mpich"),
    "radical": ("radical", "RadicalBackend", ("radical.pilot",), "radical"),
    "parsl": ("parsl", "ParslBackend", ("parsl",), "parsl"),
    "dask": ("dask", "DaskBackend", ("distributed",), "dask"),
}


def backend_names() -> list[str]:
    """The backend names :func:`get_backend` knows."""
    return list(_REGISTRY)


def require(name: str) -> None:
    """Raise :class:`MissingExtraError` if the engine behind backend ``name`` is not installed."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown backend {name!r} (known backends: {backend_names()})")
    _, _, packages, extra = _REGISTRY[name]
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            fix = f"pip install 'hetflow[{extra}]'" if extra else f"pip install {package}"
            raise MissingExtraError(
                f"backend {name!r} needs the {package!r} package, which cannot be imported ({exc}); "
                f"install it with: {fix}") from exc


def get_backend(name: str) -> "type[Backend]":
    """The :class:`Backend` subclass for ``name`` (one of :func:`backend_names`)."""
    require(name)
    module_name, class_name, _, _ = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    cls: type[Backend] = getattr(module, class_name)
    return cls
