"""Run the backend conformance pipeline with one pilot and print what the tests compare, as JSON.

    python run_engine.py PILOT WORKDIR

PILOT is a pilot config file (tests/slurm/pilots/*.yaml: an engine that submits
its own batch jobs to the lab cluster) or ``local`` (the local backend, the
reference).  The pipeline is tests/backends/conformance.py's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
import conformance as C
import hetflow as hf
from hetflow.tasks.protocol import AttemptFiles


def main(pilot_spec: str, workdir: Path) -> None:
    if pilot_spec == "local":
        pilot = hf.PilotDescription(name="reference", backend="local", cores_per_node=2, gpus_per_node=0,
                                    memory_per_node=2**34)
    else:
        pilot = hf.load_pilot(pilot_spec)
    pipe = C.pipeline(workdir)
    started = time.monotonic()
    run = pipe.run(pilot=pilot, check=False)
    took = time.monotonic() - started
    hosts = {}
    for stage in run.stages:
        attempts = sorted((Path(run.run_dir) / "stages" / stage.name).glob("attempt-*"))
        if attempts and stage.slots:
            results = AttemptFiles(attempts[-1]).read_results(len(stage.slots))
            hosts[stage.name] = [r.host if r is not None else None for r in results]
    hashes, partitions = C.dataset_hashes(run)
    print(json.dumps({
        "state": run.state, "took": took, "transitions": C.transitions(workdir, run),
        "stages": {s.name: {"state": s.state, "error": s.error, "failed_rank": s.failed_rank,
                            "nodes": sorted({slot.node for slot in s.slots})} for s in run.stages},
        "hosts": hosts, "hashes": hashes, "partitions": partitions,
    }))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
