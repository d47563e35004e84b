"""Batched inference over one rank's partition, keyed and row-aligned to the input."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from hetflow.ml.artifact import ModelManifest, gather_model_table, model_from_table, read_manifest
from hetflow.ml.errors import ModelArtifactError
from hetflow.ml.loader import ArrowLoader, Normalization, memory_share_of
from hetflow.ml.tensors import Fill

log = logging.getLogger(__name__)


def load_model(ctx: Any, model: pa.Table | None) -> tuple[Any, ModelManifest]:
    """Rebuild a model from a model table handed to a stage.

    With a ``ctx`` of several ranks this is collective: when any rank holds
    only part of the table (a pipeline splits inputs by rows), all ranks
    gather it first.
    """
    def incomplete(t: pa.Table | None) -> bool:
        if t is None:
            return True
        try:
            return bool(t.num_rows != read_manifest(t).tensors)
        except ModelArtifactError:
            return True

    if ctx is not None and ctx.comm.allreduce(int(incomplete(model))) > 0:
        model = gather_model_table(ctx.comm, model)
    if model is None:
        raise ModelArtifactError("no model table was given")
    return model_from_table(model)


def predict(ctx: Any, table: pa.Table | None, model: Any, *, key: str, features: Sequence[str] | None = None,
            normalization: Normalization | None = None, batch_size: int = 8192, output: str = "prediction",
            fill: Fill = None) -> pa.Table | None:
    """Predictions for every row of ``table``, as ``key`` + ``output`` columns in input order.

    ``model`` is a model table (features and normalisation come from its
    manifest) or a ``torch.nn.Module`` (then give ``features`` and, if it was
    trained on normalised inputs, ``normalization``).  ``ctx`` may be ``None``
    for a single process; with a ctx the model table is gathered if split
    and the device is the rank's.  A multi-output model gives columns
    ``{output}_0 … {output}_{k-1}``.  A rank without a partition returns ``None``.
    """
    import torch

    if isinstance(model, pa.Table) or model is None:
        net, manifest = load_model(ctx, model)
        features = list(manifest.features) if features is None else list(features)
        normalization = manifest.normalization if normalization is None else normalization
    else:
        net = model
        if features is None:
            raise ValueError("features must be given when model is a torch module, not a model table")
    if table is None:
        return None
    if key not in table.column_names:
        raise KeyError(f"key column {key!r} not in the table (columns: {table.column_names})")
    device = torch.device("cuda", 0) if ctx is not None and ctx.device == "cuda" else torch.device("cpu")
    if ctx is not None:
        torch.set_num_threads(max(1, len(getattr(ctx, "cores", ()) or ())))
    net = net.to(device).eval()
    loader = ArrowLoader(table, list(features), None, batch_size=batch_size, shuffle=False, fill=fill,
                         normalization=dict(normalization or {}) or None, device=device,
                         memory_share=memory_share_of(ctx))
    outputs: list[torch.Tensor] = []
    with torch.inference_mode():
        for x in loader:
            outputs.append(net(x).float())  # stays on the device: one copy back at the end, no sync per batch
    if outputs:
        pred = torch.cat(outputs).cpu().numpy()
    else:
        with torch.inference_mode():  # learn the output width from an empty batch
            pred = net(torch.zeros((0, loader.features_of(np.zeros(0, np.int64)).shape[1]),
                                   device=device)).float().cpu().numpy()
    columns: dict[str, Any] = {key: table.column(key)}
    if pred.ndim == 1:
        columns[output] = pa.array(pred)
    else:
        for i in range(pred.shape[1]):
            columns[f"{output}_{i}"] = pa.array(np.ascontiguousarray(pred[:, i]))
    return pa.table(columns)
