"""fit and predict over a real communicator, compared with a single-process reference.

Run as ``mpiexec -n N python -m pytest -m mpi tests/ml`` for N = 1, 2, 3.  Every
rank rebuilds the whole data set (allgather) and trains the reference model
in plain torch, one process, no torch.distributed: the global batch of step s
is the concatenation of every rank's local batch s.  The distributed run must
end with the same weights (float tolerance).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

import hetflow.ml as ml  # noqa: E402
from hetflow.tasks.context import StageContext  # noqa: E402

pytestmark = pytest.mark.mpi

FEATURES = ["a", "b", "c"]
SHARD_ROWS = [45, 58, 0]  # uneven, and at three ranks one rank has no rows at all


def _shard(rank: int) -> pa.Table:
    rng = np.random.default_rng(100 + rank)
    n = SHARD_ROWS[rank % len(SHARD_ROWS)]
    x = rng.normal(loc=[0.0, 5.0, -1.0], scale=[1.0, 3.0, 0.2], size=(n, 3))
    y = np.sin(x[:, 0]) + 0.3 * x[:, 1] - 2.0 * x[:, 2] + rng.normal(scale=0.05, size=n)
    return pa.table({"id": np.arange(n, dtype=np.int64) + 1000 * rank, "a": x[:, 0], "b": x[:, 1].astype(np.float32),
                     "c": x[:, 2], "y": y.astype(np.float32)})


def _ctx(comm: Any, root: Path, stage: str) -> StageContext:
    return StageContext(comm=comm, stage=stage, run_id="test", attempt=0, params={},
                        workdir=root / f"work-{comm.Get_rank()}", checkpoint_dir=root / f"ckpt-{stage}")


def _shared_dir(comm: Any) -> Path:
    return Path(comm.bcast(tempfile.mkdtemp(prefix="hetflow-ml-") if comm.Get_rank() == 0 else None))


def _reference(shards: list[pa.Table], *, epochs: int, batch_size: int, seed: int, lr: float) -> tuple[Any, list[float]]:
    whole = pa.concat_tables(shards)
    norm = {}
    for name in FEATURES:
        v = whole.column(name).to_numpy().astype(np.float64)
        norm[name] = (float(v.mean()), float(v.std()))
    steps = math.ceil(whole.num_rows / batch_size)
    loaders = [ml.ArrowLoader(t, FEATURES, "y", num_batches=steps, seed=seed, rank=r, normalization=norm)
               for r, t in enumerate(shards)]
    torch.manual_seed(seed)
    model = ml.MLP(3, hidden=[8])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        total = 0.0
        for batches in zip(*(loader.batches(epoch) for loader in loaders)):
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(y)
        losses.append(total / whole.num_rows)
    return model, losses


def test_distributed_fit_matches_the_single_process_reference(comm: Any) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    root = _shared_dir(comm)
    shard = _shard(rank)
    shards = comm.allgather(shard)
    seed, epochs, batch, lr = 7, 3, 16, 0.05
    torch.manual_seed(seed)
    result = ml.fit(_ctx(comm, root, "train"), shard, model=ml.MLP(3, hidden=[8]), features=FEATURES, label="y",
                    loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                    epochs=epochs, batch_size=batch, seed=seed, validation=shard)
    reference, losses = _reference(shards, epochs=epochs, batch_size=batch, seed=seed, lr=lr)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(result.model.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert result.start_epoch == 0 and result.resumed_from is None
    assert [round(h["train_loss"], 4) for h in result.history] == [round(v, 4) for v in losses]
    # every rank trained the same model
    gathered = comm.allgather(result.model.state_dict()["net.0.weight"])
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    if rank == 0:
        assert result.metrics is not None and result.metrics.num_rows == epochs
        assert result.metrics.column("samples").to_pylist() == [float(sum(t.num_rows for t in shards))] * epochs
        assert all(v > 0 for v in result.metrics.column("samples_per_s").to_pylist())
        assert "val_loss" in result.metrics.column_names
        assert result.model_table is not None
        manifest = ml.read_manifest(result.model_table)
        assert manifest.features == tuple(FEATURES) and manifest.label == "y"
        assert set(manifest.normalization) == set(FEATURES) and "val_loss" in manifest.metrics
    else:
        assert result.metrics is None and result.model_table is None
    # a rerun of the finished stage resumes after the last epoch instead of training again
    again = ml.fit(_ctx(comm, root, "train"), shard, model=ml.MLP(3, hidden=[8]), features=FEATURES, label="y",
                   loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                   epochs=epochs, batch_size=batch, seed=seed)
    assert again.start_epoch == epochs and len(again.history) == epochs
    for name, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value)


def test_predict_keys_and_rows_match_the_input_with_a_split_model_table(comm: Any) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(3)
    model = ml.MLP(3, hidden=[4])
    norm = {"b": (5.0, 3.0)}
    whole = ml.model_to_table(model, features=FEATURES, label="y", normalization=norm)
    part = whole.take(pa.array(np.arange(rank, whole.num_rows, size)))  # rows split like a pipeline input
    shard = _shard(rank)
    ctx = _ctx(comm, _shared_dir(comm), "predict")
    out = ml.predict(ctx, shard, part, key="id", batch_size=7)
    assert out is not None and out.num_rows == shard.num_rows
    assert out.column("id").to_pylist() == shard.column("id").to_pylist()
    loader = ml.ArrowLoader(shard, FEATURES, None, batch_size=max(shard.num_rows, 1), shuffle=False,
                            normalization=norm)
    with torch.no_grad():
        expected = torch.cat([model(x) for x in loader]).numpy() if shard.num_rows else np.zeros(0)
    np.testing.assert_allclose(out.column("prediction").to_numpy(), expected, rtol=1e-5, atol=1e-6)
    assert comm.allreduce(out.num_rows) == sum(SHARD_ROWS[r % 3] for r in range(size))


def test_mpi_progress_runs_beside_the_bodys_own_mpi_calls_and_stops(comm: Any) -> None:
    import threading

    from hetflow.ml.distributed import mpi_progress

    rank, size = comm.Get_rank(), comm.Get_size()
    with mpi_progress(comm):
        running = [t.name for t in threading.enumerate() if t.name == "hetflow-mpi-progress"]
        got = comm.bcast({"port": 4242} if rank == 0 else None, root=0)
        assert comm.allgather(rank) == list(range(size))
    assert got == {"port": 4242}
    assert running == ([] if size == 1 else ["hetflow-mpi-progress"])
    assert not [t for t in threading.enumerate() if t.name == "hetflow-mpi-progress"]
