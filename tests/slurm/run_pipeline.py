"""Run the slurm tests' pipeline with one backend and print what the tests compare, as JSON.

    python run_pipeline.py BACKEND WORKDIR

With ``slurm`` it must run inside an allocation (``salloc -N2 --exclusive``); the
pilot then takes the allocation's shape.  With ``local`` the pilot declares one
node of 4 cores (folded onto this machine's CPUs).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa

import hetflow as hf
from hetflow.tasks.protocol import AttemptFiles

sys.path.insert(0, str(Path(__file__).parent))
import slurm_stages as S  # noqa: E402

DATASETS = ["rows", "sorted"]


def table_hash(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def main(backend: str, workdir: Path) -> None:
    if backend == "slurm":
        pilot = hf.PilotDescription(name="lab", backend="slurm")
    else:
        pilot = hf.PilotDescription(name="lab", backend="local", cores_per_node=4, gpus_per_node=0,
                                    memory_per_node=2**34)
    pipe = hf.Pipeline("slurmtest", workdir=workdir)
    pipe.stage(ranks=4, outputs=["rows"], params={"rows_per_rank": 250})(S.generate)
    pipe.stage(ranks=4, inputs=["rows"], outputs=["sorted"])(S.sort_rows)
    pipe.stage(ranks=1, outputs=[])(S.noop)
    run = pipe.run(pilot=pilot)
    hosts = {}
    for stage in run.stages:
        attempts = sorted((Path(run.run_dir) / "stages" / stage.name).glob("attempt-*"))
        ranks = 1 if stage.name == "noop" else 4
        results = AttemptFiles(attempts[-1]).read_results(ranks) if attempts else []
        hosts[stage.name] = [r.host if r is not None else None for r in results]
    print(json.dumps({
        "id": run.id, "state": run.state, "stages": {s.name: s.state for s in run.stages},
        "hosts": hosts,
        "hashes": {n: table_hash(run.dataset(n).to_table()) for n in DATASETS if n in run.datasets},
        "partitions": {n: [table_hash(p) for p in run.dataset(n).partitions()] for n in DATASETS
                       if n in run.datasets},
    }))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
