"""A training stage run under ``mpiexec`` by test_resume.py (not a test itself).

argv: ROOT EPOCHS SLEEP_PER_STEP CHECKPOINT_EVERY (the sleep makes a run slow enough to kill).  Writes ROOT/result-<rank>.json
(start epoch and step) and, on rank 0, ROOT/model.arrow (the model table).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
from mpi4py import MPI

import hetflow.ml as ml
from hetflow.tasks.context import StageContext


def main(argv: list[str]) -> None:
    root, epochs, pause, every = Path(argv[0]), int(argv[1]), float(argv[2]), int(argv[3])
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5, 2.0], np.float32)).astype(np.float32)
    table = pa.table({"id": np.arange(300) + 300 * rank, **{f"f{i}": x[:, i] for i in range(4)}, "y": y})
    ctx = StageContext(comm=comm, stage="train", run_id="resume", attempt=0, params={},
                       workdir=root / f"work-{rank}", checkpoint_dir=root / "ckpt")
    torch.manual_seed(0)
    result = ml.fit(ctx, table, model=ml.MLP(4, hidden=[16], dropout=0.1), features=[f"f{i}" for i in range(4)],
                    label="y", loss=lambda pred, y: (time.sleep(pause), torch.nn.functional.mse_loss(pred, y))[1],
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                    scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
                    epochs=epochs, batch_size=32, seed=1, checkpoint_every=every or None)
    (root / f"result-{rank}.json").write_text(json.dumps(
        {"start_epoch": result.start_epoch, "start_step": result.start_step,
         "epochs": [int(h["epoch"]) for h in result.history]}))
    if rank == 0 and result.model_table is not None:
        with ipc.new_file(str(root / "model.arrow"), result.model_table.schema) as writer:
            writer.write_table(result.model_table)


if __name__ == "__main__":
    main(sys.argv[1:])
