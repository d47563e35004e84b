"""Pipelines on backend slurm about nodes: locality and a lost node.  Prints what the tests check, as JSON.

    salloc -N3 --exclusive python run_nodes.py locality WORKDIR
    salloc -N3 --exclusive --no-kill python run_nodes.py node-loss WORKDIR READY_DIR

``locality``: ``hold_node`` takes a whole node (n1) while ``produce`` (one rank, one core) runs
beside it (n2); ``consume`` (a whole node) reads ``produce``'s output, and with locality runs where
that output is.
``node-loss``: ``victim`` (two ranks, one per node, one retry) waits on its first attempt until the
test takes one of its nodes away; its retry must run on the nodes left.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hetflow as hf
from hetflow.store import DatasetRecord, EventRecord, StageRecord, Store, TaskRecord
from hetflow.tasks.protocol import AttemptFiles
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).parent))
import slurm_stages as S  # noqa: E402


def attempts(workdir: Path, run_id: str) -> dict[str, object]:
    """Every attempt of every stage (state, error, slots' node names, the rank records' hostnames), the
    nodes recorded LOST, and the nodes the store's partition records name."""
    store = Store.for_workdir(workdir, None)
    out: dict[str, list[dict[str, object]]] = {}
    with store.session() as session:
        for stage in session.scalars(select(StageRecord).where(StageRecord.run_id == run_id)):
            rows = []
            for task in session.scalars(select(TaskRecord).where(TaskRecord.stage_id == stage.id)
                                        .order_by(TaskRecord.submitted)):
                attempt = task.attempt
                if attempt is None:
                    continue
                ranks = AttemptFiles(Path(attempt.attempt_dir)).read_results(len(task.slots))
                rows.append({"state": attempt.state, "error": attempt.error,
                             "slots": [s["node_name"] for s in task.slots],
                             "hosts": [r.host if r is not None else None for r in ranks]})
            out[stage.name] = rows
        lost = [e.name for e in session.scalars(select(EventRecord).where(
            EventRecord.run_id == run_id, EventRecord.kind == "node", EventRecord.state == "LOST"))]
        stored = {d.name: [p.node for p in d.partitions]
                  for d in session.scalars(select(DatasetRecord).where(DatasetRecord.run_id == run_id))}
    store.close()
    return {"stages": out, "lost": lost, "partition_nodes": stored}


def main(kind: str, workdir: Path, ready: Path | None) -> None:
    pilot = hf.PilotDescription(name="lab", backend="slurm")
    pipe = hf.Pipeline(f"slurm{kind}", workdir=workdir)
    if kind == "locality":
        # the longer estimate puts hold_node first (on n1), then produce goes beside it (n2)
        pipe.stage(ranks=1, cores_per_rank=2, duration=10, params={"hold_seconds": 1.0})(S.hold_node)
        pipe.stage(ranks=1, outputs=["made"])(S.produce)
        pipe.stage(ranks=1, cores_per_rank=2, inputs=["made"], outputs=["used"])(S.consume)
    else:
        pipe.stage(ranks=2, ranks_per_node=1, retries=1, params={"ready_dir": str(ready)})(S.wait_for_node_loss)
    run = pipe.run(pilot=pilot, check=False)
    record = {"state": run.state, "stages": {s.name: s.state for s in run.stages}, **attempts(workdir, run.id),
              "manifest_nodes": {name: [p.node for p in hf.open_dataset(path).manifest.partitions]
                                 for name, path in run.datasets.items()}}
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
