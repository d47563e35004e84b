"""Wall time of the serial test suite, one process against pytest-xdist workers, alternating.

    .venv/bin/python benchmarks/serial_tests.py                       # 3 rounds, -n auto
    .venv/bin/python benchmarks/serial_tests.py --rounds 5 --workers 2 3 auto

Each round runs ``pytest -m "not mpi and not slurm" tests`` once in one process
(``-p no:xdist``) and once per ``--workers`` value (``-n N --dist loadfile``, the
grouping of tests/conftest.py), in turn, so the machine's drift falls on all alike.
Prints per case the median wall time with min-max, the CPU seconds of every process
the run involved (``RUSAGE_CHILDREN``), the ratio of the one-process median to the
case's, and any run that did not pass.  ``--select`` narrows the suite (pytest ``-k``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(workers: str | None, select: str | None) -> tuple[float, float, int, str]:
    """One suite run: wall seconds, CPU seconds of its processes, exit code, pytest's last line."""
    argv = [sys.executable, "-m", "pytest", "-m", "not mpi and not slurm", "-q", "-p", "no:cacheprovider", "tests"]
    argv += ["-p", "no:xdist"] if workers is None else ["-n", workers, "--dist", "loadfile"]
    if select:
        argv += ["-k", select]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-xdg-") as runtime:
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, XDG_RUNTIME_DIR=runtime),
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return wall, cpu, done.returncode, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", nargs="+", default=["auto"], help="xdist -n values to compare (default: auto)")
    parser.add_argument("--select", help="pytest -k expression (default: the whole serial suite)")
    args = parser.parse_args(argv)
    cases: list[str | None] = [None, *args.workers]
    walls: dict[str | None, list[float]] = {c: [] for c in cases}
    cpus: dict[str | None, list[float]] = {c: [] for c in cases}
    failed = []
    for round_ in range(args.rounds):
        for case in cases:
            wall, cpu, code, last = run_once(case, args.select)
            walls[case].append(wall)
            cpus[case].append(cpu)
            name = "1 process" if case is None else f"-n {case}"
            print(f"round {round_ + 1} {name}: {wall:.0f} s wall, {cpu:.0f} s CPU, exit {code}: {last}", flush=True)
            if code != 0:
                failed.append(f"round {round_ + 1} {name}: {last}")
    base = statistics.median(walls[None])
    print(f"\nserial suite, {args.rounds} rounds, load average at the end {os.getloadavg()[0]:.1f}")
    for case in cases:
        w, c = walls[case], cpus[case]
        name = "1 process" if case is None else f"-n {case}"
        print(f"{name:>10}: wall median {statistics.median(w):.0f} s (min {min(w):.0f}, max {max(w):.0f}), "
              f"CPU median {statistics.median(c):.0f} s, speed-up x{base / statistics.median(w):.2f}")
    for line in failed:
        print(f"NOT PASSED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
