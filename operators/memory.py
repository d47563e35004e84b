"""Large numpy work arrays from Arrow's memory pool (layer 0, no communicator).

numpy takes every array above 32 MiB from the kernel with ``mmap`` and gives it
back with ``munmap`` when it is freed, so each such array is faulted in again on
first touch.  Arrow's default pool (mimalloc or jemalloc) keeps freed memory
and hands it out again, which is several times cheaper to write into than
freshly faulted pages (figures: docs/benchmarks.md, "Scratch memory").
Operators therefore take their n-sized scratch and output arrays from
the pool through a small cache of buffers (``_take``); the array keeps its Arrow
buffer alive (``ndarray.base``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pyarrow as pa

from . import settings

#: arrays smaller than this come from numpy (its small-array cache is as good)
POOL_MIN_BYTES = 1 << 20
_cache: list[pa.Buffer] = []


def _refs(buffers: list[pa.Buffer], i: int) -> int:
    """``sys.getrefcount`` of ``buffers[i]``, taken the same way wherever the cache asks (what it counts
    beyond real users, such as the list and the argument, differs between Python versions)."""
    return sys.getrefcount(buffers[i])


#: what ``_refs`` says of a buffer nobody but the cache holds: measured, not assumed
_FREE_REFS = _refs([pa.allocate_buffer(0)], 0)


def _unused() -> list[bool]:
    """Which cached buffers nothing but the cache holds (asked before any name is bound to one)."""
    return [_refs(_cache, i) == _FREE_REFS for i in range(len(_cache))]


def empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised writable C-contiguous array; when large, from a free cached buffer (see
    ``_take``) or else from Arrow's default memory pool."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for d in dims:
        count *= int(d)
    nbytes = count * dt.itemsize
    if nbytes < POOL_MIN_BYTES:
        return np.empty(dims, dtype=dt)
    return np.frombuffer(_take(nbytes), dtype=dt, count=count).reshape(dims)


def _take(nbytes: int) -> pa.Buffer:
    """A buffer of at least ``nbytes`` (at most 1/8 more) that nothing else references.

    Allocators give large blocks back to the kernel (numpy at once, mimalloc soon after), and
    faulting them in again costs more than using them (docs/benchmarks.md, "Scratch memory").  So the
    buffers handed out are kept, and one whose arrays have all died (only this
    cache refers to it) is handed out again.  On a miss the free ones are dropped first, so an
    operator's peak memory is what it would be without the cache; ``trim`` (called when an operator
    returns) keeps ``settings.current().scratch_cache_bytes`` of free ones for the next operator
    (default none: kept buffers count as resident memory; docs/benchmarks.md, "Scratch memory")."""
    best = None
    free = _unused()
    for buf, unused in zip(_cache, free):
        if unused and nbytes <= buf.size <= nbytes + (nbytes >> 3) + POOL_MIN_BYTES \
                and (best is None or buf.size < best.size):
            best = buf
    if best is not None:
        return best
    _cache[:] = [buf for buf, unused in zip(_cache, free) if not unused]  # a miss: free ones go back first
    buf = pa.allocate_buffer(nbytes)
    _cache.append(buf)
    return buf


def trim(keep_bytes: int | None = None) -> None:
    """Drop free cached buffers beyond ``keep_bytes`` (default ``settings.current().scratch_cache_bytes``),
    largest first."""
    limit = settings.current().scratch_cache_bytes if keep_bytes is None else keep_bytes
    unused = _unused()
    keep = [buf for buf, u in zip(_cache, unused) if not u]
    free = [buf for buf, u in zip(_cache, unused) if u]
    total = 0
    for buf in sorted(free, key=lambda b: b.size):
        if total + buf.size <= limit:
            keep.append(buf)
            total += buf.size
    _cache[:] = keep


def empty_like(a: np.ndarray) -> np.ndarray:
    return empty(a.shape, a.dtype)


#: rows per block of the blockwise index builders: their temporaries (at most 64 KiB) stay below
#: glibc's 128 KiB mmap threshold, so they never cost a map, fault and unmap each
BLOCK = 1 << 16


def index_dtype(n: int) -> np.dtype:
    """The narrowest index type for positions ``0..n-1``: int32 below 2**31 rows (half the memory
    of numpy's int64 positions; ``take_rows`` widens them in cache-sized blocks), else int64."""
    return np.dtype(np.int32) if n <= np.iinfo(np.int32).max else np.dtype(np.int64)


def take_rows(values: np.ndarray, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.take(values, idx, axis=0, out=out)`` for in-range ``idx`` of any integer type: numpy casts
    non-``intp`` indices to a whole ``intp`` copy first, so those are taken block by block."""
    if idx.dtype == np.intp or idx.size <= BLOCK:
        return np.take(values, idx, axis=0, out=out, mode="clip")
    for a in range(0, idx.size, BLOCK):
        np.take(values, idx[a : a + BLOCK], axis=0, out=out[a : a + BLOCK], mode="clip")
    return out


def flatnonzero(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` built block by block into a pool array of ``index_dtype(mask.size)``."""
    out = empty(int(np.count_nonzero(mask)), index_dtype(mask.size))
    pos = 0
    for a in range(0, mask.size, BLOCK):
        found = np.flatnonzero(mask[a : a + BLOCK])
        found += a
        out[pos : pos + found.size] = found
        pos += found.size
    return out


def indices_by_id(ids: np.ndarray, n: int) -> list[np.ndarray]:
    """Row indices (ascending, ``index_dtype(ids.size)``) of every id ``0..n-1`` of small integer ``ids``, block by
    block into pool arrays: one pass over ``ids`` with cache-sized temporaries, where
    ``np.flatnonzero(ids == j)`` per id would allocate (and fault in) two ``n``-sized arrays each."""
    counts = np.zeros(n + 1, dtype=np.int64)
    for a in range(0, ids.size, BLOCK):  # bincount casts its input to int64: in blocks
        counts += np.bincount(ids[a : a + BLOCK], minlength=n + 1)[: n + 1]
    dtype = index_dtype(ids.size)
    out = [empty(int(c), dtype) for c in counts[:n]]
    pos = [0] * n
    eq = np.empty(min(ids.size, BLOCK), dtype=bool)
    for a in range(0, ids.size, BLOCK):
        block = ids[a : a + BLOCK]
        for j in range(n):
            found = np.flatnonzero(np.equal(block, j, out=eq[: block.size]))
            found += a
            out[j][pos[j] : pos[j] + found.size] = found
            pos[j] += found.size
    return out
