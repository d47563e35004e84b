"""hetflow.ml: Arrow to PyTorch, distributed training and inference.

- :func:`to_tensor` / :class:`ArrowLoader` — Arrow columns as tensors without
  copies where the types allow, deterministic shuffled batches per rank;
- :func:`distributed` — a torch.distributed process group over a stage's ranks
  (rendezvous through ``ctx.comm``; NCCL on GPUs, Gloo on CPUs); :func:`mpi_progress`
  keeps MPI's messages moving while ranks wait in torch;
- :func:`fit` — data-parallel training with atomic checkpoints and resume;
- :func:`predict` — batched inference keyed to the input rows;
- :func:`model_to_table` / :func:`model_from_table` — a model as an Arrow table
  rebuilt from the architecture registry (:class:`MLP`, :func:`register_architecture`).

A stage with the high-level helper::

    @pipe.stage(ranks=2, gpus_per_rank=1, inputs=["train"], outputs=["model", "metrics"])
    def train(ctx, train):
        r = hf.ml.fit(ctx, train, model=hf.ml.MLP(4), features=["a", "b", "c", "d"], label="y",
                      loss=torch.nn.functional.mse_loss,
                      optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), epochs=10, batch_size=512)
        return {"model": r.model_table, "metrics": r.metrics}   # None on ranks other than 0

The same data and set-up in a loop of your own::

    with hf.ml.distributed(ctx) as env:
        loader = hf.ml.ArrowLoader(train, ["a", "b"], "y", batch_size=64, seed=1, rank=env.rank,
                                   device=env.device)
        model = env.wrap(MyNet())                       # DistributedDataParallel
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(start, epochs):
            for x, y in loader.batches(epoch):
                ...
            if env.rank == 0:
                hf.ml.save_checkpoint(ctx.checkpoint_dir, {...}, epoch=epoch + 1, step=...)

(With ``batch_size`` the ranks may take different numbers of steps when their
partitions differ in size; DDP needs equal counts, which ``num_batches`` gives.)
"""

from __future__ import annotations

import logging

try:  # every part below needs torch: one line naming the extra instead of a traceback deep in one of them
    import torch  # noqa: F401
except ImportError as _exc:
    from hetflow.tasks.errors import MissingExtraError

    raise MissingExtraError(f"hetflow.ml needs PyTorch ({_exc}): pip install 'hetflow[ml]'") from None

from hetflow.ml.artifact import ModelManifest, gather_model_table, model_from_table, model_to_table, read_manifest
from hetflow.ml.checkpoint import (COMMIT_MARKER, committed_checkpoints, latest_checkpoint, load_checkpoint,
                                   rng_state, save_checkpoint, set_rng_state)
from hetflow.ml.distributed import DistributedEnv, distributed, mpi_progress
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
    "load_model", "metrics_to_table", "model_from_table", "model_to_table", "mpi_progress", "predict",
    "read_manifest",
    "register_architecture", "rng_state", "save_checkpoint", "set_rng_state", "table_to_tensors", "to_tensor",
]
