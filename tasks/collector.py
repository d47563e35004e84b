"""Imports without the cyclic garbage collector, for the processes a run starts with.

Decision: importing a large package (SQLAlchemy's ORM, pandas, torch) allocates many objects that live as
long as the process, and every 700 net allocations start a collection that walks the young ones again: a
sizeable part of such an import's CPU (benchmarks.md, issue 26, sixth part).  The orchestrator's imports
(at the start of ``pipe.run()``) and the fork server's (its own at start, each script's installed imports
before its first fork) are done with the collector paused, and what they made is then moved to the
permanent generation (``gc.freeze``) where the caller keeps it, so no later collection walks it either.
The cycles the import machinery leaves meanwhile are collected later when not frozen, and stay with the
frozen objects otherwise (a little memory, once per import).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused(*, freeze: bool = False) -> Iterator[None]:
    """Run the block with the collector off (unless the process turned it off itself, it is back on after);
    ``freeze``: move every object tracked by then to the permanent generation when the block completes
    (not when it raises: a caller that freezes also unfreezes, and an error leaves nothing to keep)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()
