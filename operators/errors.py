"""Errors raised by hetflow.operators, and the root of every hetflow error.

``HetflowError`` is defined here, in the bottom layer, so that every package of hetflow (and a user's
``except hetflow.HetflowError``) shares one root; ``hetflow.tasks.errors`` and ``hetflow`` re-export
it.  ``OperatorError`` is the operators' root (datasets, object storage, safe file I/O and the TCP
communicator's errors included); each error also subclasses the matching builtin (``KeyError``,
``TypeError``, ``ValueError``, ``OSError``) so generic handlers keep working.  Messages name the bad
value and the allowed ones.
"""

from __future__ import annotations

from typing import Iterable


class HetflowError(Exception):
    """Root of all hetflow errors: ``except hetflow.HetflowError`` catches every error hetflow raises
    for a user to see (an interrupt, ``KeyboardInterrupt``, is not an error and is not under it)."""


class OperatorError(HetflowError):
    """Root of all errors of the distributed dataframe operators."""


class ColumnNotFoundError(OperatorError, KeyError):
    """A column name that the table does not have."""

    def __init__(self, column: str, available: Iterable[str], *, where: str = "table") -> None:
        self.column = column
        self.available = list(available)
        super().__init__(f"unknown column {column!r} in {where} (available columns: {self.available})")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class KeyTypeMismatchError(OperatorError, TypeError):
    """Join / set-operation keys whose types differ between the two sides."""


class UnsupportedAggregationError(OperatorError, ValueError):
    """An aggregation name that is unknown, or not defined for the column's type."""


class SchemaMismatchError(OperatorError, ValueError):
    """Partitions of one distributed table (or two tables of a set operation) disagree on the schema."""


class InvalidOptionError(OperatorError, ValueError):
    """An option value outside its allowed set."""

    def __init__(self, option: str, value: object, allowed: Iterable[object]) -> None:
        self.option = option
        self.value = value
        self.allowed = list(allowed)
        super().__init__(f"invalid {option} {value!r} (allowed: {self.allowed})")


class InputError(OperatorError, FileNotFoundError):
    """Partitioned input that cannot be read (no file matches, unreadable file)."""


class AggregateOverflowError(OperatorError, OverflowError):
    """An integer sum that leaves the range of its result type (it is never wrapped silently)."""


class UnsupportedTypeError(OperatorError, TypeError):
    """A column whose Arrow type the operation cannot take (e.g. sorting by an interval)."""


class SQLError(OperatorError, ValueError):
    """A query that cannot be parsed, names an unknown table or column (the message gives its line and
    column), or uses a construct the distributed SQL engine does not run."""
