"""hetflow.ml: Arrow to PyTorch, distributed training and inference.

- :func:`to_tensor` / :class:`ArrowLoader` — Arrow columns as tensors without
  copies where the types allow, deterministic shuffled batches per rank;
- :func:`distributed` — a torch.distributed process group over a stage's ranks
  (rendezvous through ``ctx.comm``; NCCL on GPUs, Gloo on CPUs);
- :func:`fit` — data-parallel training with atomic checkpoints and resume;
- :func:`predict` — batched inference keyed to the input rows;
- :func:`model_to_table` / :func:`model_from_table` — a model as an Arrow table
  rebuilt from the architecture registry (:class:`MLP`, :func:`register_architecture`).
"""

from __future__ import annotations

import logging

from hetflow.ml.artifact import ModelManifest, gather_model_table, model_from_table, model_to_table, read_manifest
from hetflow.ml.checkpoint import (COMMIT_MARKER, committed_checkpoints, latest_checkpoint, load_checkpoint,
                                   rng_state, save_checkpoint, set_rng_state)
from hetflow.ml.distributed import DistributedEnv, distributed
from hetflow.ml.errors import (CheckpointError, ColumnTypeError, CopyRequiredError, MLError, ModelArtifactError,
                               NullValuesError, UnknownArchitectureError)
from hetflow.ml.inference import load_model, predict
from hetflow.ml.loader import ArrowLoader
from hetflow.ml.models import MLP, architectures, build_model, register_architecture
from hetflow.ml.tensors import ConvertedColumn, arrow_data_address, table_to_tensors, to_tensor
from hetflow.ml.train import FitResult, fit, global_normalization, metrics_to_table

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "ArrowLoader", "COMMIT_MARKER", "CheckpointError", "ColumnTypeError", "ConvertedColumn", "CopyRequiredError",
    "DistributedEnv", "FitResult", "MLError", "MLP", "ModelArtifactError", "ModelManifest", "NullValuesError",
    "UnknownArchitectureError", "architectures", "arrow_data_address", "build_model", "committed_checkpoints",
    "distributed", "fit", "gather_model_table", "global_normalization", "latest_checkpoint", "load_checkpoint",
    "load_model", "metrics_to_table", "model_from_table", "model_to_table", "predict", "read_manifest",
    "register_architecture", "rng_state", "save_checkpoint", "set_rng_state", "table_to_tensors", "to_tensor",
]
