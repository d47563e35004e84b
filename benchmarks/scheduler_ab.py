"""Lockstep A/B of the scheduler: a git revision's against the working tree's, on the same events.

Both schedulers are driven by one simulation: every event goes to both, in
alternating order, each ``handle_event`` is timed, and their instructions must
be identical (a difference stops the run and prints it).  Because both see the
same machine at the same moments, the ratio survives this VM's drift, which
moves whole runs by up to a third; two copies of the same code give a ratio of
1.03-1.07 (the harness's noise).  Only the placement modules are swapped; the
event and request types must be the same in both (the script checks).

    .venv/bin/python benchmarks/scheduler_ab.py --base HEAD~1                 # half Frontier, 500,000 tasks
    .venv/bin/python benchmarks/scheduler_ab.py --base main --nodes 2352 --tasks 250000
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from hetflow.tasks import description, errors, scheduler_types, simulator
from hetflow.tasks import pilot as pilot_module
from hetflow.tasks.pilot import load_pilot
from hetflow.tasks.scheduler import Scheduler
from hetflow.tasks.workload import generate

ROOT = Path(__file__).resolve().parent.parent
SHARED = {"scheduler_types": scheduler_types, "description": description, "errors": errors, "pilot": pilot_module}


def load_base(revision: str, into: Path) -> type:
    """The ``Scheduler`` class of ``revision``'s ``tasks/`` package, imported as ``hetflow_ab_base``."""
    archive = into / "base.tar"
    with archive.open("wb") as out:
        done = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "tasks"], stdout=out,
                              stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"--base {revision!r}: git cannot archive its tasks/ ({done.stderr.strip()})")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    base_dir = into / "tasks"
    for name in SHARED:
        if not filecmp.cmp(base_dir / f"{name}.py", ROOT / "tasks" / f"{name}.py", shallow=False):
            raise SystemExit(f"tasks/{name}.py differs between {revision} and the working tree: "
                             "the two schedulers would not share event types; compare whole runs instead")
    package = types.ModuleType("hetflow_ab_base")
    package.__path__ = [str(base_dir)]
    sys.modules["hetflow_ab_base"] = package
    for name, module in SHARED.items():
        sys.modules[f"hetflow_ab_base.{name}"] = module
    import hetflow_ab_base.scheduler as base_scheduler
    scheduler_class: type = base_scheduler.Scheduler
    return scheduler_class


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        type(x) is type(y) and x.task_id == y.task_id and getattr(x, "slots", None) == getattr(y, "slots", None)
        for x, y in zip(a, b))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--nodes", type=int, default=4704)
    parser.add_argument("--tasks", type=int, default=500000)
    parser.add_argument("--workload", default="saturating")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetflow-ab-") as tmp:
        base_class = load_base(args.base, Path(tmp))
        clock = time.perf_counter
        spent = {"base": 0.0, "new": 0.0}
        flip = [False]

        class Twin:
            def __init__(self, *a: Any, **k: Any) -> None:
                try:
                    self.base = base_class(*a, **k)
                except TypeError as exc:
                    raise SystemExit(f"{args.base}'s Scheduler does not take the simulator's arguments ({exc}): "
                                     "compare whole runs instead") from None
                self.new = Scheduler(*a, **k)

            def handle_event(self, event: Any) -> list[Any]:
                flip[0] = not flip[0]
                order = (("base", self.base), ("new", self.new)) if flip[0] else (("new", self.new), ("base", self.base))
                out: dict[str, list[Any]] = {}
                for name, scheduler in order:
                    t0 = clock()
                    out[name] = scheduler.handle_event(event)
                    spent[name] += clock() - t0
                if not same(out["base"], out["new"]):
                    raise SystemExit(f"the schedulers differ on {event!r}:\n  base {out['base']!r}\n  new  {out['new']!r}")
                return out["new"]

        simulator.Scheduler = Twin
        pilot = dataclasses.replace(load_pilot("ornl-frontier"), nodes=args.nodes)
        result = simulator.simulate(pilot, generate(args.workload, tasks=args.tasks, seed=args.seed))
    base, new = spent["base"], spent["new"]
    print(f"{args.workload}: {result.placements} placements on {args.nodes} nodes, identical instructions; "
          f"scheduler time base ({args.base}) {base:.2f} s, working tree {new:.2f} s, "
          f"new/base {new / base:.3f} ({result.placements / base:,.0f} vs {result.placements / new:,.0f} placements/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
