"""The loader: deterministic per-epoch shuffling, every row once, named columns, normalisation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from hetflow.ml import ArrowLoader  # noqa: E402


def _table(n: int = 103) -> pa.Table:
    rng = np.random.default_rng(5)
    return pa.table({"id": np.arange(n), "f1": rng.normal(size=n), "f2": rng.normal(size=n).astype(np.float32),
                     "y": rng.normal(size=n)})


def _ids(loader: ArrowLoader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [x[:, 0].long().tolist() for x, _ in loader]  # type: ignore[misc]


def test_every_row_once_per_epoch_and_batches_have_the_asked_size() -> None:
    table = _table()
    loader = ArrowLoader(table, ["id", "f1"], "y", batch_size=10, seed=3)
    batches = _ids(loader, 0)
    assert len(batches) == len(loader) == 11
    assert [len(b) for b in batches] == [10] * 10 + [3]
    assert sorted(i for b in batches for i in b) == list(range(table.num_rows))
    dropped = ArrowLoader(table, ["id"], "y", batch_size=10, drop_last=True)
    assert len(dropped) == 10 and len(list(dropped)) == 10


def test_shuffle_is_the_same_on_a_rerun_and_differs_per_epoch_and_rank() -> None:
    table = _table()
    a = ArrowLoader(table, ["id"], "y", batch_size=16, seed=11)
    b = ArrowLoader(table, ["id"], "y", batch_size=16, seed=11)
    assert _ids(a, 2) == _ids(b, 2)
    assert _ids(a, 2) != _ids(a, 3)
    other_rank = ArrowLoader(table, ["id"], "y", batch_size=16, seed=11, rank=1)
    assert _ids(a, 2) != _ids(other_rank, 2)
    other_seed = ArrowLoader(table, ["id"], "y", batch_size=16, seed=12)
    assert _ids(a, 2) != _ids(other_seed, 2)
    unshuffled = ArrowLoader(table, ["id"], "y", batch_size=16, shuffle=False)
    assert [i for b in _ids(unshuffled, 4) for i in b] == list(range(table.num_rows))


def test_num_batches_splits_an_epoch_into_nearly_equal_batches() -> None:
    loader = ArrowLoader(_table(), ["id"], "y", num_batches=7)
    sizes = [len(b) for b in _ids(loader, 0)]
    assert len(sizes) == 7 and sum(sizes) == 103 and max(sizes) - min(sizes) <= 1
    empty = ArrowLoader(_table(3), ["id"], "y", num_batches=5)
    assert [len(b) for b in _ids(empty, 0)] == [1, 1, 1, 0, 0]


def test_features_and_label_come_from_the_named_columns() -> None:
    table = _table()
    loader = ArrowLoader(table, ["f2", "f1"], "y", batch_size=8, seed=1)
    rows = loader.batch_indices(0)[0]
    x, y = next(iter(loader))
    assert x.shape == (8, 2) and x.dtype == torch.float32 and y.shape == (8,)
    expected = np.stack([table.column("f2").to_numpy()[rows], table.column("f1").to_numpy()[rows]], axis=1)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), table.column("y").to_numpy()[rows], rtol=1e-6)
    with pytest.raises(KeyError, match="nope"):
        ArrowLoader(table, ["nope"], "y", batch_size=4)
    with pytest.raises(ValueError, match="exactly one"):
        ArrowLoader(table, ["f1"], "y", batch_size=4, num_batches=2)


def test_normalisation_is_applied_to_every_batch() -> None:
    table = _table()
    norm = {"f1": (0.5, 2.0)}
    loader = ArrowLoader(table, ["f1", "f2"], "y", batch_size=200, shuffle=False, normalization=norm)
    x, _ = next(iter(loader))
    np.testing.assert_allclose(x[:, 0].numpy(), (table.column("f1").to_numpy() - 0.5) / 2.0, rtol=1e-5)
    np.testing.assert_allclose(x[:, 1].numpy(), table.column("f2").to_numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="std"):
        ArrowLoader(table, ["f1"], "y", batch_size=4, normalization={"f1": (0.0, 0.0)})


def test_a_loader_without_label_yields_features_only() -> None:
    loader = ArrowLoader(_table(10), ["f1"], None, batch_size=4, shuffle=False)
    shapes = [tuple(x.shape) for x in loader]  # type: ignore[union-attr]
    assert shapes == [(4, 1), (4, 1), (2, 1)]
