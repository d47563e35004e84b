"""A trained model as an Arrow table: weights as rows, a small manifest as metadata.

One row per tensor of the ``state_dict`` (``index``, ``name``, ``dtype``,
``shape``, ``data`` = raw little-endian bytes) and, in the schema metadata
under ``hetflow.model``, a JSON manifest: architecture name and constructor
arguments, feature columns, label, normalisation, metrics, torch version.
Being a table, the model is a dataset like any other stage output (cached,
checksummed, recorded in provenance), and it is rebuilt from the
architecture registry — never unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from hetflow.ml.errors import ModelArtifactError

METADATA_KEY = b"hetflow.model"
FORMAT_VERSION = 1

SCHEMA = pa.schema([
    pa.field("index", pa.int32(), nullable=False),
    pa.field("name", pa.string(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
])

# torch dtypes numpy has no type for travel as same-width integers
_BIT_VIEWS = {"bfloat16": "int16"}


@dataclass(frozen=True)
class ModelManifest:
    """What a model artifact says about itself."""

    architecture: str
    kwargs: Mapping[str, Any]
    features: tuple[str, ...]
    label: str | None = None
    normalization: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    torch_version: str = ""
    tensors: int = 0

    def __post_init__(self) -> None:
        if not self.architecture:
            raise ModelArtifactError("model manifest has no architecture name")
        if not self.features:
            raise ModelArtifactError("model manifest names no feature columns")

    def to_json(self) -> str:
        """The manifest as JSON text, as stored in a model table's schema metadata (see :func:`read_manifest`)."""
        return json.dumps({"format": FORMAT_VERSION, "architecture": self.architecture,
                           "kwargs": dict(self.kwargs), "features": list(self.features),
                           "label": self.label,
                           "normalization": {k: list(v) for k, v in self.normalization.items()},
                           "metrics": dict(self.metrics), "torch_version": self.torch_version,
                           "tensors": self.tensors}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ModelManifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT_VERSION:
                raise ModelArtifactError(f"model manifest format {raw.get('format')!r} "
                                         f"(this hetflow reads format {FORMAT_VERSION})")
            return cls(architecture=raw["architecture"], kwargs=raw["kwargs"],
                       features=tuple(raw["features"]), label=raw["label"],
                       normalization={k: (float(v[0]), float(v[1])) for k, v in raw["normalization"].items()},
                       metrics=raw["metrics"], torch_version=raw["torch_version"], tensors=int(raw["tensors"]))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            if isinstance(exc, ModelArtifactError):
                raise
            raise ModelArtifactError(f"malformed model manifest: {exc!r}") from exc


def read_manifest(table: pa.Table | pa.Schema) -> ModelManifest:
    """The manifest in a model table's schema metadata."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    meta = schema.metadata or {}
    if METADATA_KEY not in meta:
        raise ModelArtifactError(f"not a model table: no {METADATA_KEY.decode()!r} schema metadata "
                                 f"(keys: {sorted(k.decode() for k in meta)})")
    return ModelManifest.from_json(meta[METADATA_KEY])


def model_to_table(model: Any, *, features: Sequence[str], label: str | None = None,
                   normalization: Mapping[str, tuple[float, float]] | None = None,
                   metrics: Mapping[str, float] | None = None) -> pa.Table:
    """Serialise a registered-architecture model (DDP-wrapped or not) to a model table."""
    import torch

    from hetflow.ml.models import architecture_of

    name, kwargs = architecture_of(model)
    inner = getattr(model, "module", model)
    state = inner.state_dict()
    rows: dict[str, list[Any]] = {"index": [], "name": [], "dtype": [], "shape": [], "data": []}
    for i, (key, tensor) in enumerate(state.items()):
        t = tensor.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype in _BIT_VIEWS:
            t = t.view(getattr(torch, _BIT_VIEWS[dtype]))
        arr = t.numpy()
        rows["index"].append(i)
        rows["name"].append(key)
        rows["dtype"].append(dtype)
        rows["shape"].append(list(tensor.shape))
        rows["data"].append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    manifest = ModelManifest(architecture=name, kwargs=kwargs, features=tuple(features), label=label,
                             normalization=dict(normalization or {}),
                             metrics={k: float(v) for k, v in (metrics or {}).items()},
                             torch_version=torch.__version__, tensors=len(state))
    return pa.table(rows, schema=SCHEMA.with_metadata({METADATA_KEY: manifest.to_json().encode()}))


def model_from_table(table: pa.Table) -> tuple[Any, ModelManifest]:
    """Rebuild ``(model, manifest)`` from a whole model table (eval mode, on CPU)."""
    import torch

    from hetflow.ml.models import build_model

    manifest = read_manifest(table)
    if table.num_rows != manifest.tensors:
        raise ModelArtifactError(f"model table has {table.num_rows} tensor rows, its manifest says "
                                 f"{manifest.tensors} (a partial table? use gather_model_table)")
    model = build_model(manifest.architecture, dict(manifest.kwargs))
    state: dict[str, Any] = {}
    for row in table.sort_by("index").to_pylist():
        dtype = row["dtype"]
        np_dtype = np.dtype(_BIT_VIEWS.get(dtype, dtype)).newbyteorder("<")
        try:
            arr = np.frombuffer(row["data"], dtype=np_dtype).astype(np_dtype.newbyteorder("="))
            t = torch.from_numpy(arr.reshape(row["shape"]).copy())
        except ValueError as exc:
            raise ModelArtifactError(f"tensor {row['name']!r}: {exc}") from exc
        state[row["name"]] = t.view(getattr(torch, dtype)) if dtype in _BIT_VIEWS else t
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelArtifactError(f"model table does not fit architecture {manifest.architecture!r}: {exc}") from exc
    model.eval()
    return model, manifest


def gather_model_table(comm: Any, part: pa.Table | None) -> pa.Table:
    """Reassemble a model table whose rows were split over ``comm``'s ranks.

    A pipeline hands each consumer rank a share of an input's rows; a model
    table is small, so every rank gathers all of it.  Rows that arrive more
    than once (when each rank already had the whole table) are kept once.
    """
    parts = [p for p in comm.allgather(part) if p is not None]
    with_meta = [p for p in parts if p.schema.metadata and METADATA_KEY in p.schema.metadata]
    if not with_meta:
        raise ModelArtifactError("no rank holds a model table (no partition with model metadata)")
    schema = with_meta[0].schema
    whole = pa.concat_tables([p.select(schema.names).cast(schema) for p in parts])
    _, first = np.unique(whole.column("index").to_numpy(), return_index=True)
    return whole.take(pa.array(first)).replace_schema_metadata(schema.metadata)
