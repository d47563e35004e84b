"""Batches of tensors over one rank's Arrow partition.

The columns are turned into tensors once (zero-copy where the types allow, see
:mod:`hetflow.ml.tensors`); each batch is then a gather of rows out of them.
The row order of an epoch is a permutation drawn from
``numpy.random.default_rng([seed, epoch, rank])``, so it is the same on every
rerun with the same seed, differs per epoch and per rank, and does not depend
on torch's global random state.

**Layout.** A batch is gathered from one of two layouts, chosen once when the
loader is built (``layout="auto"``, the default):

* ``"rows"``: the features are laid out row-major once — one contiguous
  ``(rows, width)`` tensor of the loader's dtype, written in one pass over
  the columns (:func:`hetflow.ml.tensors.row_major`) — and each batch is
  then one ``index_select`` (shuffled rows) or one slice (consecutive rows)
  into its buffer.  A single feature column already of the loader's dtype
  (a ``fixed_size_list`` matrix) is that layout as it stands: no copy.
* ``"columns"``: each batch is gathered column by column out of the column
  tensors (views of the Arrow buffers), on the rank's cores — no second copy
  of the data, but per batch one task per column.

``"auto"`` takes ``"rows"`` when the matrix needs no copy, or when it takes
at most half of this loader's share of the host memory available when it is
built (``MemAvailable`` × ``memory_share``): the data then fit twice, once as
Arrow columns and once row-major.  ``fit`` and ``predict`` pass the rank's
share of the node's cores (:func:`memory_share_of`), so ranks and tasks that
share a node do not each plan for all of its memory.  Otherwise, or when the
available memory cannot be read, it takes ``"columns"``.  ``layout="rows"`` /
``"columns"`` force one.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from hetflow.ml.tensors import ConvertedColumn, Fill, row_major, table_to_tensors

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: feature name -> (mean, standard deviation); features are fed as (x - mean) / std
Normalization = Mapping[str, tuple[float, float]]

LAYOUTS = ("auto", "rows", "columns")

ROW_MAJOR_SHARE = 0.5
"""``layout="auto"`` lays rows out when the matrix takes at most this share of the available host memory."""


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``), or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_share_of(ctx: Any) -> float:
    """A rank's share of its node's memory: its cores over the node's (1.0 without a ctx or cores)."""
    cores = len(getattr(ctx, "cores", ()) or ()) if ctx is not None else 0
    total = os.cpu_count() or 0
    return min(1.0, cores / total) if cores and total else 1.0


def choose_layout(columns: Sequence[ConvertedColumn], rows: int, width: int, dtype: "torch.dtype",
                  available: int | None, share: float = 1.0) -> str:
    """The layout ``layout="auto"`` takes (the module docstring's rule); ``available`` in bytes or ``None``."""
    if len(columns) == 1 and columns[0].tensor.dtype == dtype:
        return "rows"  # already row-major: no copy
    nbytes = rows * width * dtype.itemsize
    return "rows" if available is not None and nbytes <= ROW_MAJOR_SHARE * available * share else "columns"


class ArrowLoader:
    """Iterate ``(features, label)`` batches (or ``features`` alone) over a table.

    Give exactly one of ``batch_size`` (batches of that many rows, the last
    one shorter unless ``drop_last``) or ``num_batches`` (the epoch split into
    that many nearly equal batches — what :func:`hetflow.ml.fit` uses so every
    rank takes the same number of steps).  Features become one
    ``(batch, width)`` tensor of ``dtype``; a string ``label`` becomes a
    ``(batch,)`` tensor.

    On a CUDA ``device``, ``prefetch`` (default 2; 0 turns staging ahead
    off) batches are gathered into pinned memory and copied ahead of the
    one in use (module docstring); ``pin_memory`` (default: on for CUDA)
    may only be asked for with a CUDA device.

    ``layout`` (``"auto"``, ``"rows"`` or ``"columns"``) picks how batches
    are gathered, ``memory_share`` (0 < share <= 1) is the part of the node's
    available memory ``"auto"`` may plan for (module docstring);
    ``self.layout`` is the one taken and
    ``self.layout_seconds`` what laying the rows out cost (0 for columns).
    """

    def __init__(self, table: pa.Table, features: Sequence[str], label: str | None = None, *,
                 batch_size: int | None = None, num_batches: int | None = None,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, drop_last: bool = False,
                 fill: Fill = None, normalization: Normalization | None = None,
                 dtype: "torch.dtype | None" = None, label_dtype: "torch.dtype | None" = None,
                 device: "str | torch.device" = "cpu", prefetch: int = 2,
                 pin_memory: bool | None = None, layout: str = "auto", memory_share: float = 1.0) -> None:
        import torch

        if (batch_size is None) == (num_batches is None):
            raise ValueError(f"give exactly one of batch_size={batch_size!r} and num_batches={num_batches!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches!r}")
        if not features:
            raise ValueError("features must name at least one column")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        if not 0 < memory_share <= 1:
            raise ValueError(f"memory_share must be in (0, 1], got {memory_share!r}")
        self.features = list(features)
        self.label = label
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = int(rank)
        self.drop_last = drop_last
        self.dtype = dtype if dtype is not None else torch.float32
        self.label_dtype = label_dtype if label_dtype is not None else self.dtype
        self.device = torch.device(device)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        cuda = self.device.type == "cuda"
        if pin_memory and not cuda:
            raise ValueError(f"pin_memory=True needs a CUDA device, got device {str(self.device)!r}")
        self.prefetch = prefetch if cuda else 0
        self.pin_memory = cuda if pin_memory is None else bool(pin_memory)
        self.num_rows = table.num_rows
        self.epoch = 0
        self.columns: list[ConvertedColumn] = table_to_tensors(table, self.features, fill=fill)
        self.label_column: ConvertedColumn | None = (
            table_to_tensors(table, [label], fill=fill)[0] if label is not None else None)
        self._mean, self._std = self._normalization_vectors(normalization)
        if layout == "auto":
            layout = choose_layout(self.columns, self.num_rows, self.width, self.dtype, available_memory(),
                                   memory_share)
        self.layout = layout
        start = time.perf_counter()
        self._matrix: torch.Tensor | None = (
            row_major(self.columns, self.dtype, threads=torch.get_num_threads()) if layout == "rows" else None)
        self.layout_seconds = time.perf_counter() - start if layout == "rows" else 0.0

    # -- set-up -----------------------------------------------------------------------------------
    def _normalization_vectors(self, normalization: Normalization | None
                               ) -> tuple["torch.Tensor | None", "torch.Tensor | None"]:
        import torch

        if normalization is None:
            return None, None
        unknown = sorted(set(normalization) - set(self.features))
        if unknown:
            raise KeyError(f"normalization names {unknown}, which are not features {self.features}")
        means: list[float] = []
        stds: list[float] = []
        for col in self.columns:
            width = 1 if col.tensor.dim() == 1 else int(col.tensor.shape[1])
            mean, std = normalization.get(col.name, (0.0, 1.0))
            if not std > 0:
                raise ValueError(f"normalization of {col.name!r} has std {std!r}; it must be > 0")
            means += [float(mean)] * width
            stds += [float(std)] * width
        return (torch.tensor(means, dtype=self.dtype, device=self.device),
                torch.tensor(stds, dtype=self.dtype, device=self.device))

    def normalize_with(self, normalization: Normalization | None) -> None:
        """Replace the normalisation applied to every batch (``None``: none)."""
        self._mean, self._std = self._normalization_vectors(normalization)

    @property
    def copies(self) -> dict[str, str]:
        """Columns that needed a copy, with the reason (empty when all are zero-copy views)."""
        cols = self.columns + ([self.label_column] if self.label_column is not None else [])
        return {c.name: c.reason for c in cols if c.reason is not None}

    # -- iteration --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose row order the next iteration uses."""
        self.epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` on this rank."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch, self.rank]).permutation(self.num_rows)

    def batch_indices(self, epoch: int) -> list[np.ndarray]:
        """Row indices of each batch of ``epoch``."""
        order = self.order(epoch)
        if self.num_batches is not None:
            return [np.asarray(b) for b in np.array_split(order, self.num_batches)] if self.num_batches else []
        assert self.batch_size is not None
        stop = self.num_rows - self.num_rows % self.batch_size if self.drop_last else self.num_rows
        return [order[i:i + self.batch_size] for i in range(0, stop, self.batch_size)]

    def __len__(self) -> int:
        if self.num_batches is not None:
            return self.num_batches
        assert self.batch_size is not None
        full, rest = divmod(self.num_rows, self.batch_size)
        return int(full) + (1 if rest and not self.drop_last else 0)

    @property
    def width(self) -> int:
        """Number of feature values per row (a fixed-size list column counts its size)."""
        return sum(1 if c.tensor.dim() == 1 else int(c.tensor.shape[1]) for c in self.columns)

    def _normalized(self, x: "torch.Tensor") -> "torch.Tensor":
        """``(x - mean) / std``, in place for floating-point batches (``x`` is always a batch's own fresh buffer)."""
        if self._mean is None or self._std is None:
            return x
        if x.is_floating_point():
            return x.sub_(self._mean).div_(self._std)  # no allocations per batch
        return (x - self._mean) / self._std  # integer features: true division makes a float batch

    def gather(self, rows: np.ndarray, out: "torch.Tensor") -> "torch.Tensor":
        """Write the (raw) features of ``rows`` into ``out[:len(rows)]`` from this loader's layout; that view."""
        if self._matrix is not None:
            return gather_matrix(self._matrix, rows, out)
        return gather_rows(self.columns, rows, out)

    def features_of(self, rows: np.ndarray) -> "torch.Tensor":
        """The (normalised) feature matrix of the given rows, on this loader's device (not staged)."""
        import torch

        x = self.gather(rows, torch.empty((len(rows), self.width), dtype=self.dtype))
        return self._normalized(x.to(self.device))

    def label_of(self, rows: np.ndarray) -> "torch.Tensor":
        """The label values of ``rows`` (row indices of this rank's partition) as a tensor on the loader's device."""
        import torch

        if self.label_column is None:
            raise ValueError("this loader has no label column")
        src = self.label_column.tensor
        y = gather_label(src, rows, torch.empty((len(rows), *src.shape[1:]), dtype=self.label_dtype))
        return y.to(self.device)

    def batches(self, epoch: int, start: int = 0
                ) -> Iterator["tuple[torch.Tensor, torch.Tensor] | torch.Tensor"]:
        """Batches of ``epoch`` from batch number ``start`` on (to resume inside an epoch)."""
        rows_list = self.batch_indices(epoch)[start:]
        if self.device.type == "cuda" and self.pin_memory:
            yield from self._staged(rows_list)
            return
        for rows in rows_list:
            x = self.features_of(rows)
            yield (x, self.label_of(rows)) if self.label_column is not None else x

    def _staged(self, rows_list: list[np.ndarray]
                ) -> Iterator["tuple[torch.Tensor, torch.Tensor] | torch.Tensor"]:
        """The CUDA path: gather into a ring of pinned buffers, copy on a side stream, ``prefetch`` ahead."""
        import torch

        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # e.g. the normalisation vectors' upload
        capacity = max((len(r) for r in rows_list), default=0)
        label = self.label_column.tensor if self.label_column is not None else None
        ring = [_PinnedSlot(
            x=torch.empty((capacity, self.width), dtype=self.dtype, pin_memory=True),
            y=None if label is None else torch.empty((capacity, *label.shape[1:]), dtype=self.label_dtype,
                                                     pin_memory=True))
            for _ in range(self.prefetch + 1)]
        staged: deque[_InFlight] = deque()

        def stage(number: int, rows: np.ndarray) -> _InFlight:
            slot = ring[number % len(ring)]
            if slot.copied is not None:
                slot.copied.synchronize()  # the copy that last read this buffer has finished
            x_host = self.gather(rows, slot.x)
            y_host = None if label is None or slot.y is None else gather_label(label, rows, slot.y)
            with torch.cuda.stream(stream):
                x = self._normalized(x_host.to(self.device, non_blocking=True))
                y = None if y_host is None else y_host.to(self.device, non_blocking=True)
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record(stream)
            slot.copied = ready
            return _InFlight(x, y, ready)

        def hand_over(batch: _InFlight) -> "tuple[torch.Tensor, torch.Tensor] | torch.Tensor":
            current = torch.cuda.current_stream(self.device)
            current.wait_event(batch.ready)
            batch.x.record_stream(current)  # keep the side stream's allocator off it until the step is done
            if batch.y is None:
                return batch.x
            batch.y.record_stream(current)
            return batch.x, batch.y

        for number, rows in enumerate(rows_list):
            staged.append(stage(number, rows))
            if len(staged) > self.prefetch:
                yield hand_over(staged.popleft())
        while staged:
            yield hand_over(staged.popleft())

    def __iter__(self) -> Iterator["tuple[torch.Tensor, torch.Tensor] | torch.Tensor"]:
        return self.batches(self.epoch)


@dataclass
class _PinnedSlot:
    """One pinned staging buffer of the ring and the event after the last copy that read it."""

    x: "torch.Tensor"
    y: "torch.Tensor | None"
    copied: Any = None


@dataclass(frozen=True)
class _InFlight:
    """A batch whose host-to-device copy was issued on the side stream; ``ready`` fires when it is done."""

    x: "torch.Tensor"
    y: "torch.Tensor | None"
    ready: Any


def _consecutive(rows: np.ndarray) -> bool:
    n = len(rows)
    return n > 0 and int(rows[-1]) - int(rows[0]) == n - 1 and bool(np.all(np.diff(rows) == 1))


def gather_matrix(matrix: "torch.Tensor", rows: np.ndarray, out: "torch.Tensor") -> "torch.Tensor":
    """Write ``rows`` of a row-major ``(rows, width)`` matrix into ``out[:len(rows)]`` and return that view.

    One ``index_select`` straight into ``out`` (a pinned staging buffer on
    the CUDA path), or one slice copy when the rows are consecutive.
    """
    import torch

    n = len(rows)
    if out.dim() != 2 or out.shape[0] < n or out.shape[1] != matrix.shape[1]:
        raise ValueError(f"out must be a (rows >= {n}, {matrix.shape[1]}) tensor, got shape {tuple(out.shape)}")
    dest = out[:n]
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if _consecutive(rows):
        first = int(rows[0])
        dest.copy_(matrix[first:first + n])
    elif matrix.dtype == out.dtype:
        torch.index_select(matrix, 0, torch.from_numpy(rows), out=dest)
    else:
        dest.copy_(matrix.index_select(0, torch.from_numpy(rows)))
    return dest


def gather_rows(columns: Sequence[ConvertedColumn], rows: np.ndarray, out: "torch.Tensor", *,
                threads: int | None = None) -> "torch.Tensor":
    """Write ``rows`` of ``columns`` side by side into ``out[:len(rows)]`` and return that view.

    The rows go from the column tensors (views of the Arrow buffers) straight
    into ``out`` — a pinned staging buffer on the CUDA path.  One column of
    ``out``'s dtype is gathered in a single ``index_select`` into ``out``;
    several columns are gathered column by column (casting as they copy), on
    up to ``threads`` threads (default: torch's intra-op thread count, which
    hetflow sets to the rank's cores): a shuffled batch of a columnar table
    costs one random memory access per value, and those overlap across
    threads.  Consecutive rows (an unshuffled loader) are sliced, not gathered.
    """
    import torch

    n = len(rows)
    if out.dim() != 2 or out.shape[0] < n:
        raise ValueError(f"out must be a (rows >= {n}, width) tensor, got shape {tuple(out.shape)}")
    widths = [1 if c.tensor.dim() == 1 else int(c.tensor.shape[1]) for c in columns]
    if sum(widths) != out.shape[1]:
        raise ValueError(f"the columns have {sum(widths)} feature values per row but out has width {out.shape[1]}")
    dest = out[:n]
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    first = int(rows[0]) if n else 0
    consecutive = _consecutive(rows)
    idx = torch.from_numpy(rows)

    def take(col: ConvertedColumn) -> "torch.Tensor":
        part: torch.Tensor = col.tensor[first:first + n] if consecutive else col.tensor.index_select(0, idx)
        return part

    if len(columns) == 1 and columns[0].tensor.dtype == out.dtype and not consecutive:
        src = columns[0].tensor
        torch.index_select(src, 0, idx, out=dest.view(n) if src.dim() == 1 else dest)
        return dest
    if consecutive and all(c.tensor.dim() == 1 and c.tensor.dtype == out.dtype for c in columns):
        torch.stack([c.tensor[first:first + n] for c in columns], dim=1, out=dest)  # one strided copy
        return dest
    offsets = np.concatenate([[0], np.cumsum(widths)]).tolist()

    def one(i: int) -> None:
        dest[:, offsets[i]:offsets[i + 1]].copy_(take(columns[i]).reshape(n, widths[i]))

    workers = min(len(columns), threads if threads is not None else torch.get_num_threads())
    if workers > 1 and n * len(columns) >= _PARALLEL_VALUES:
        inference = torch.is_inference_mode_enabled()  # thread-local: the gather threads must match the caller

        def in_thread(i: int) -> None:
            with torch.inference_mode(inference):
                one(i)

        list(_pool(workers).map(in_thread, range(len(columns))))  # torch releases the GIL in both copies
    else:
        for i in range(len(columns)):
            one(i)
    return dest


_PARALLEL_VALUES = 16384
"""Below this many values a batch is gathered on the calling thread (a pool round trip costs more)."""


@functools.lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    """A shared pool of ``workers`` gather threads (idle threads cost nothing; they end with the process)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hetflow-gather")


def gather_label(src: "torch.Tensor", rows: np.ndarray, out: "torch.Tensor") -> "torch.Tensor":
    """Write ``rows`` of the label tensor ``src`` into ``out[:len(rows)]`` (casting to ``out``'s dtype)."""
    import torch

    n = len(rows)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    dest = out[:n]
    if _consecutive(rows):
        dest.copy_(src[int(rows[0]):int(rows[0]) + n])
        return dest
    idx = torch.from_numpy(rows)
    if src.dtype == out.dtype:
        torch.index_select(src, 0, idx, out=dest)
    else:
        dest.copy_(src.index_select(0, idx))
    return dest
