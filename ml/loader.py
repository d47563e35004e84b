"""Batches of tensors over one rank's Arrow partition.

The columns are turned into tensors once (zero-copy where the types allow, see
:mod:`hetflow.ml.tensors`); each batch is then a gather of rows out of them.
The row order of an epoch is a permutation drawn from
``numpy.random.default_rng([seed, epoch, rank])``, so it is the same on every
rerun with the same seed, differs per epoch and per rank, and does not depend
on torch's global random state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from hetflow.ml.tensors import ConvertedColumn, Fill, table_to_tensors

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: feature name -> (mean, standard deviation); features are fed as (x - mean) / std
Normalization = Mapping[str, tuple[float, float]]


class ArrowLoader:
    """Iterate ``(features, label)`` batches (or ``features`` alone) over a table.

    Give exactly one of ``batch_size`` (batches of that many rows, the last
    one shorter unless ``drop_last``) or ``num_batches`` (the epoch split into
    that many nearly equal batches — what :func:`hetflow.ml.fit` uses so every
    rank takes the same number of steps).  Features become one
    ``(batch, width)`` tensor of ``dtype``; a string ``label`` becomes a
    ``(batch,)`` tensor.
    """

    def __init__(self, table: pa.Table, features: Sequence[str], label: str | None = None, *,
                 batch_size: int | None = None, num_batches: int | None = None,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, drop_last: bool = False,
                 fill: Fill = None, normalization: Normalization | None = None,
                 dtype: "torch.dtype | None" = None, label_dtype: "torch.dtype | None" = None,
                 device: "str | torch.device" = "cpu") -> None:
        import torch

        if (batch_size is None) == (num_batches is None):
            raise ValueError(f"give exactly one of batch_size={batch_size!r} and num_batches={num_batches!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches!r}")
        if not features:
            raise ValueError("features must name at least one column")
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
        self.num_rows = table.num_rows
        self.epoch = 0
        self.columns: list[ConvertedColumn] = table_to_tensors(table, self.features, fill=fill)
        self.label_column: ConvertedColumn | None = (
            table_to_tensors(table, [label], fill=fill)[0] if label is not None else None)
        self._mean, self._std = self._normalization_vectors(normalization)

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

    def features_of(self, rows: np.ndarray) -> "torch.Tensor":
        """The (normalised) feature matrix of the given rows."""
        import torch

        idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        parts = [c.tensor.index_select(0, idx).reshape(len(rows), 1 if c.tensor.dim() == 1 else c.tensor.shape[1])
                 for c in self.columns]
        x = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(self.device, self.dtype)
        if self._mean is not None and self._std is not None:
            x = (x - self._mean) / self._std
        return x

    def label_of(self, rows: np.ndarray) -> "torch.Tensor":
        """The label values of ``rows`` (row indices of this rank's partition) as a tensor on the loader's device."""
        import torch

        if self.label_column is None:
            raise ValueError("this loader has no label column")
        idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        y: torch.Tensor = self.label_column.tensor.index_select(0, idx).to(self.device, self.label_dtype)
        return y

    def batches(self, epoch: int, start: int = 0
                ) -> Iterator["tuple[torch.Tensor, torch.Tensor] | torch.Tensor"]:
        """Batches of ``epoch`` from batch number ``start`` on (to resume inside an epoch)."""
        for rows in self.batch_indices(epoch)[start:]:
            x = self.features_of(rows)
            yield (x, self.label_of(rows)) if self.label_column is not None else x

    def __iter__(self) -> Iterator["tuple[torch.Tensor, torch.Tensor] | torch.Tensor"]:
        return self.batches(self.epoch)
