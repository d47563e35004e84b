"""A model as an Arrow table: round trip, manifest, and never built from pickle."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

torch = pytest.importorskip("torch")

import hetflow.ml as ml  # noqa: E402


def _round_trip_ipc(table: pa.Table) -> pa.Table:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return ipc.open_file(sink.getvalue()).read_all()


def test_model_table_round_trips_through_arrow_ipc() -> None:
    torch.manual_seed(0)
    model = ml.MLP(4, hidden=[8, 8], dropout=0.1)
    table = ml.model_to_table(model, features=["a", "b", "c", "d"], label="z",
                              normalization={"a": (1.0, 2.0)}, metrics={"val_loss": 0.25})
    assert table.num_rows == len(model.state_dict())
    rebuilt, manifest = ml.model_from_table(_round_trip_ipc(table))
    assert manifest.architecture == "mlp" and manifest.features == ("a", "b", "c", "d")
    assert manifest.kwargs == {"in_features": 4, "hidden": [8, 8], "dropout": 0.1}
    assert manifest.normalization == {"a": (1.0, 2.0)} and manifest.metrics == {"val_loss": 0.25}
    assert manifest.torch_version == torch.__version__
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    x = torch.randn(5, 4)
    model.eval()
    assert torch.equal(model(x), rebuilt(x))


def test_bfloat16_and_integer_buffers_survive() -> None:
    @ml.register_architecture("test-odd-dtypes")
    class Odd(torch.nn.Module):
        def __init__(self, n: int = 3) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.bfloat16))
            self.register_buffer("count", torch.tensor([7, -2], dtype=torch.int64))

    model = Odd(5)
    rebuilt, _ = ml.model_from_table(ml.model_to_table(model, features=["x"]))
    assert torch.equal(rebuilt.w, model.w) and rebuilt.w.dtype == torch.bfloat16
    assert torch.equal(rebuilt.count, model.count)


def test_unregistered_and_unknown_architectures_are_named() -> None:
    with pytest.raises(ml.UnknownArchitectureError, match="Linear.*registered"):
        ml.model_to_table(torch.nn.Linear(2, 1), features=["x"])
    table = ml.model_to_table(ml.MLP(2), features=["x", "y"])
    manifest = ml.read_manifest(table)
    forged = table.replace_schema_metadata(
        {ml.artifact.METADATA_KEY: manifest.to_json().replace('"mlp"', '"resnet-999"').encode()})
    with pytest.raises(ml.UnknownArchitectureError, match="resnet-999.*mlp"):
        ml.model_from_table(forged)


def test_a_partial_or_corrupt_table_is_rejected() -> None:
    table = ml.model_to_table(ml.MLP(2, hidden=[3]), features=["x", "y"])
    with pytest.raises(ml.ModelArtifactError, match="partial"):
        ml.model_from_table(table.slice(0, 2))
    with pytest.raises(ml.ModelArtifactError, match="not a model table"):
        ml.model_from_table(pa.table({"a": [1]}))
    bad = table.set_column(4, "data", pa.array([b"\x00"] * table.num_rows, pa.large_binary()))
    with pytest.raises(ml.ModelArtifactError):
        ml.model_from_table(bad.replace_schema_metadata(table.schema.metadata))


def test_metrics_table_has_one_row_per_epoch() -> None:
    history = [{"epoch": 0.0, "step": 10.0, "train_loss": 1.0, "samples_per_s": 5.0},
               {"epoch": 1.0, "step": 20.0, "train_loss": 0.5, "val_loss": 0.7, "samples_per_s": 6.0}]
    t = ml.metrics_to_table(history)
    assert t.column("epoch").to_pylist() == [0, 1] and t.schema.field("epoch").type == pa.int64()
    assert t.column("val_loss").to_pylist() == [None, 0.7]
    assert np.allclose(t.column("train_loss").to_numpy(), [1.0, 0.5])
