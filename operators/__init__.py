"""hetflow.operators: distributed dataframe operators on Arrow over MPI.

A standalone library: it imports nothing else of hetflow.  Layers: local
kernels on ``pa.Table`` (``kernels``), table collectives on an explicit
communicator (``comm``, ``partition``), distributed operators that choose an
algorithm with a measured Hockney model (``DTable``, ``costmodel``).
Settings the caller chooses (memory budget, spill directory, kernel threads)
are in ``settings``; the communicator is anything that satisfies ``Communicator``.

Heavy modules load on first use, so ``import hetflow.operators`` stays cheap.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from .communicator import Communicator
    from .dtable import DTable, GroupBy
    from .errors import (
        AggregateOverflowError,
        ColumnNotFoundError,
        HetflowError,
        InputError,
        InvalidOptionError,
        KeyTypeMismatchError,
        OperatorError,
        SchemaMismatchError,
        SQLError,
        UnsupportedAggregationError,
        UnsupportedTypeError,
    )
    from .location import StorageError
    from .readers import read_csv, read_ipc, read_parquet
    from .scan import Scan, scan_ipc
    from .sqlengine import sql

__all__ = [
    "AggregateOverflowError",
    "ColumnNotFoundError",
    "Communicator",
    "DTable",
    "GroupBy",
    "HetflowError",
    "InputError",
    "InvalidOptionError",
    "KeyTypeMismatchError",
    "OperatorError",
    "Scan",
    "SchemaMismatchError",
    "SQLError",
    "StorageError",
    "UnsupportedAggregationError",
    "UnsupportedTypeError",
    "read_csv",
    "read_ipc",
    "read_parquet",
    "scan_ipc",
    "sql",
]

_LAZY = {"Communicator": "communicator", "DTable": "dtable", "GroupBy": "dtable", "read_parquet": "readers", "read_csv": "readers", "read_ipc": "readers",
         "Scan": "scan", "scan_ipc": "scan", "sql": "sqlengine", **{name: "errors" for name in __all__ if name.endswith("Error")},
         "StorageError": "location"}


def __dir__() -> list[str]:
    """The public names too, before their lazy import (``dir()``, tab completion)."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
