"""A failing stage and a timed-out stage across two nodes on backend slurm; prints each stage's record as JSON.

    salloc -N2 --exclusive python run_faults.py WORKDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hetflow as hf

sys.path.insert(0, str(Path(__file__).parent))
import slurm_stages as S  # noqa: E402


def main(workdir: Path) -> None:
    pipe = hf.Pipeline("slurmfaults", workdir=workdir)
    pipe.stage(ranks=2, ranks_per_node=1)(S.fail_on_last_rank)
    pipe.stage(ranks=2, ranks_per_node=1)(S.exit_on_last_rank)
    pipe.stage(ranks=2, ranks_per_node=1, timeout=3)(S.sleep_long)
    run = pipe.run(pilot=hf.PilotDescription(name="lab", backend="slurm"), check=False)
    print(json.dumps({"state": run.state, "stages": {
        s.name: {"state": s.state, "error": s.error, "failed_rank": s.failed_rank,
                 "nodes": sorted({v.node for v in s.slots})} for s in run.stages}}, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
