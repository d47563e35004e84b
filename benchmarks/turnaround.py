"""Slot turnaround: how long a core stands idle between one trivial stage's end and the next one's launch.

    python benchmarks/turnaround.py [--tasks 100] [--repeats 3] [--against LABEL=DIR]

Runs the loop-made script of ``benchmarks/throughput.py`` (N independent one-rank stages on the two-core
pilot) in a fresh ``python script.py`` and work directory, then reads the run's own records: per attempt,
when the orchestrator launched it, when its rank started and ended (``rank-0.json``), when the backend saw
it end, and when its stage's end was recorded.  Per core, in launch order, the *gap* is the time from one
attempt's end to the next attempt's launch on the same core; with two cores and trivial stages it bounds
the rate (two stages per gap plus a stage's own time).  ``--against LABEL=DIR`` also runs with ``DIR``
first on ``PYTHONPATH`` (another checkout's packages, as in throughput.py), alternated.  Medians over all
attempts of all repeats, with the 90th percentile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # the same scripts

PHASES = ("launch -> rank started", "rank started -> rank ended", "rank ended -> seen ended",
          "seen ended -> next launch on the core (gap)", "seen ended -> its end recorded")


def measure(n: int, env: dict[str, str]) -> tuple[dict[str, list[float]], float]:
    """One run of ``n`` stages: each phase's durations (seconds), and the tasks per second from the first
    launch to the last end."""
    with tempfile.TemporaryDirectory(prefix="hf-turnaround-") as tmp:
        script = Path(tmp) / "pipeline.py"
        script.write_text(throughput.script("loop", n))
        done = subprocess.run([sys.executable, str(script)], cwd=tmp, capture_output=True, text=True,
                              timeout=1800, env=env, check=False)
        if done.returncode != 0 or not done.stdout.rstrip().endswith("DONE"):
            raise RuntimeError(f"the run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        with sqlite3.connect(Path(tmp) / ".hetflow" / "hetflow.db") as db:
            rows = db.execute("SELECT tasks.slots, attempts.started, attempts.ended, stages.ended, "
                              "attempts.attempt_dir FROM attempts JOIN tasks ON tasks.id = attempts.task_id "
                              "JOIN stages ON stages.id = attempts.stage_id").fetchall()
        phases: dict[str, list[float]] = {name: [] for name in PHASES}
        by_core: dict[int, list[tuple[float, float]]] = {}
        for slots, launched, ended, recorded, attempt_dir in rows:
            rank = json.loads((Path(attempt_dir) / "rank-0.json").read_text())
            phases[PHASES[0]].append(rank["started"] - launched)
            phases[PHASES[1]].append(rank["ended"] - rank["started"])
            phases[PHASES[2]].append(ended - rank["ended"])
            phases[PHASES[4]].append(recorded - ended)
            by_core.setdefault(json.loads(slots)[0]["cores"][0], []).append((launched, ended))
        for runs in by_core.values():
            runs.sort()
            phases[PHASES[3]] += [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(runs)]
        span = max(r[2] for r in rows) - min(r[1] for r in rows)
        return phases, len(rows) / span


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered) * 1000:7.1f} ms (p90 {ordered[int(len(ordered) * 0.9)] * 1000:.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", action="append", default=[], metavar="LABEL=DIR")
    args = parser.parse_args(argv)
    setups = [("this", dict(os.environ)), *(throughput.against(parser, spec) for spec in args.against)]
    results = {label: ({name: [] for name in PHASES}, []) for label, _ in setups}
    for repeat in range(args.repeats):
        for label, env in setups if repeat % 2 == 0 else reversed(setups):
            phases, rate = measure(args.tasks, env)
            for name, values in phases.items():
                results[label][0][name] += values
            results[label][1].append(rate)
    load = os.getloadavg()[0]
    print(f"{args.tasks} loop-made one-rank stages on 2 cores, {args.repeats} repeats (load {load:.1f} at the end)")
    for label, (phases, rates) in results.items():
        print(f"{label}: {statistics.median(rates):.1f} tasks/s from the first launch to the last end "
              f"({min(rates):.1f}-{max(rates):.1f})")
        for name in PHASES:
            print(f"  {name:45s} {_ms(phases[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
