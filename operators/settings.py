"""The operators' settings: one object, set by the caller, read by the operators (layer 0).

The operators read no environment variable of their own and take no configuration
from anywhere else: what the caller does not pass as an operator option comes from
:func:`current`.  The caller decides:

* a pipeline stage's worker (``hetflow.tasks.worker``) sets ``memory_budget`` from
  the stage's ``memory_per_rank`` and ``spill_dir`` from the pilot's
  ``node_local_dir`` before it calls the stage function;
* a plain mpi4py program calls :func:`configure` once (or :func:`override` around
  a block), or passes the out-of-core operators' ``memory_budget=`` /
  ``spill_dir=`` options.

``memory_budget`` (bytes per rank) bounds the operators' working memory above the
process's baseline: a ``DTable`` join, sort or group-by whose inputs would need
more than that in memory runs out of core instead, spilling under ``spill_dir``
(else the system's temporary directory).  ``None`` (the default) keeps every
operator in memory.

Environment compatibility, read once when :func:`current` is first called and
only for the two settings users set from outside a program:
``HETFLOW_OPERATOR_THREADS`` (``threads``; the benchmarks pin the peers and
hetflow to one thread with it) and ``HETFLOW_SCRATCH_CACHE_BYTES``
(``scratch_cache_bytes``).  Everything else is set through this module only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidOptionError

#: the environment variables still read, and the setting each one gives
ENVIRONMENT = {"HETFLOW_OPERATOR_THREADS": "threads", "HETFLOW_SCRATCH_CACHE_BYTES": "scratch_cache_bytes"}


@dataclass(frozen=True)
class Settings:
    """What the operators do when the call does not say.

    :param memory_budget: bytes of working memory per rank (above the process's baseline) for
        join, sort and group-by; larger inputs spill to ``spill_dir``. ``None``: no budget.
    :param spill_dir: the node-local directory spill files go under (a private
        subdirectory, removed when the operator returns); ``None``: the temporary directory.
    :param threads: kernel threads per rank; ``None``: the cores this rank may use divided
        among the node's ranks.
    :param scratch_cache_bytes: free scratch buffers kept between operators (speed for
        repeated operators at the price of that much resident memory).
    :param join_bucket_rows: rows per hash-join bucket (larger side, per rank); ``None``: the
        default, and a join that needs no shuffle is not bucketed.
    :param join_exchange_buckets: join buckets moved per exchange of the permuted columns.
    """

    memory_budget: int | None = None
    spill_dir: str | None = None
    threads: int | None = None
    scratch_cache_bytes: int = 0
    join_bucket_rows: int | None = None
    join_exchange_buckets: int = 1

    def __post_init__(self) -> None:
        for name, low, optional in (("memory_budget", 1, True), ("threads", 1, True), ("scratch_cache_bytes", 0, False),
                                    ("join_bucket_rows", 1, True), ("join_exchange_buckets", 1, False)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                allowed = f"a whole number >= {low}" + (" or None" if optional else "")
                raise InvalidOptionError(f"setting {name}", value, [allowed])
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise InvalidOptionError("setting spill_dir", self.spill_dir, ["a directory path or None"])
        if self.spill_dir is not None:
            object.__setattr__(self, "spill_dir", os.fspath(self.spill_dir))


def from_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings the compatible environment variables give (see ``ENVIRONMENT``).

    :raises InvalidOptionError: a value that is not a whole number in range (the message names the variable).
    """
    out: dict[str, Any] = {}
    for var, name in ENVIRONMENT.items():
        text = env.get(var)
        if not text:
            continue
        low = 0 if name == "scratch_cache_bytes" else 1
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise InvalidOptionError(f"environment variable {var}", text, [f"a whole number >= {low}"])
        out[name] = value
    return out


_current: Settings | None = None


def current() -> Settings:
    """The settings in effect (the compatible environment variables the first time)."""
    global _current
    if _current is None:
        _current = Settings(**from_environment(os.environ))
    return _current


def configure(**changes: Any) -> Settings:
    """Change the settings for this process (only the fields named); returns the new settings.

    :raises TypeError: an unknown setting.
    :raises InvalidOptionError: a value outside its allowed range.
    """
    global _current
    _current = dataclasses.replace(current(), **changes)
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """``with override(memory_budget=64 << 20):`` the settings changed inside the block only."""
    global _current
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
