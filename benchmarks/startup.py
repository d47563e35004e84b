"""Stage start-up: what a trivial stage costs end to end, against the process-start limits.

    .venv/bin/python benchmarks/startup.py                       # this working tree
    .venv/bin/python benchmarks/startup.py --base main --reps 5  # a git revision beside it, alternating

Each case is one ``hetflow run script.py`` (a fresh work directory every
time, so nothing is cached) of a script written into a temporary directory:
a chain of 1 or of 10 trivial stages (each passes a 100-row table on), with
1 rank per stage, 1 rank with ``import torch`` at the top of the script (used by a helper
function, as a script's training part would, never by these stages), or 2
ranks per stage.  The per-stage figure is the
marginal cost ``(T(10 stages) - T(1 stage)) / 9``: what one more stage adds
to a run, without the run's fixed cost (starting Python, the CLI, importing
the script, creating the state store), which the 1-stage wall time shows.

Peers are timed in the same rounds: ``python -c pass``, ``mpiexec -n 1
python -c pass`` (the process-start limit of a stage), importing pyarrow,
numpy and mpi4py (what a rank needs for its data), and importing torch.

``--base REV`` stages that revision's package (``git archive``) next to this
working tree's, and every round runs each case once per build, in turn, so
the machine's drift falls on both alike.  Besides wall time, each case
reports the CPU seconds of every process it involved (``RUSAGE_CHILDREN``),
which a shared machine disturbs less.  Each build runs from a staged copy
on ``PYTHONPATH`` with the same interpreter and ``mpiexec``.  The runs use a
private ``XDG_RUNTIME_DIR``, so another run's core bookings on this machine
never make a stage wait.  Prints medians with min-max per case and build; the
per-stage figures are marginal costs taken within each round.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = {"pipeline": "hetflow", "tasks": "hetflow/tasks", "operators": "hetflow/operators", "ml": "hetflow/ml",
          "pilot-configs": "hetflow/pilot_configs"}
"""Source folder -> its place in the installed package (as ``pyproject.toml`` maps them)."""

KINDS = {"1-rank": (1, False), "1-rank+torch": (1, True), "2-rank": (2, False)}
"""Case kind -> (ranks per stage, ``import torch`` at the script's top)."""
STAGES = (1, 10)
TARGET = 0.25
"""Seconds per 1-rank stage (issue 18), with or without the torch import."""


def script(stages: int, ranks: int, torch: bool) -> str:
    """A pipeline of ``stages`` chained trivial stages, ``ranks`` ranks each, written as a user would."""
    lines = ["import torch  # what a scientist's script starts with" if torch else "",
             "import pyarrow as pa", "import hetflow as hf", "", 'pipe = hf.Pipeline("chain", pilot="local")', ""]
    if torch:  # the script uses torch somewhere (a helper of its training part), not in these stages
        lines += ["def as_tensor(table):", "    return torch.as_tensor(table['x'].to_numpy())", ""]
    lines += [f"@pipe.stage(ranks={ranks}, outputs=['d0'])", "def s0(ctx):",
              "    return {'d0': pa.table({'x': list(range(100))})}", ""]
    for i in range(1, stages):
        lines += [f"@pipe.stage(ranks={ranks}, inputs=['d{i - 1}'], outputs=['d{i}'])", f"def s{i}(ctx, table):",
                  f"    return {{'d{i}': table}}", ""]
    lines += ['if __name__ == "__main__":', "    pipe.run()", ""]
    return "\n".join(lines)


def stage_build(source: Path | None, revision: str | None, into: Path) -> Path:
    """A directory holding the ``hetflow`` package laid out as installed, from a tree or a git revision."""
    into.mkdir(parents=True)
    if revision is not None:
        archive = into / "src.tar"
        with archive.open("wb") as out:
            done = subprocess.run(["git", "-C", str(ROOT), "archive", revision, *LAYOUT], check=False, stdout=out,
                                  stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"--base {revision!r}: git cannot archive it ({done.stderr.strip()})")
        source = into / "src"
        with tarfile.open(archive) as tar:
            tar.extractall(source, filter="data")
    assert source is not None
    pkg = into / "pkg"
    for folder, target in sorted(LAYOUT.items(), key=lambda kv: kv[1].count("/")):
        shutil.copytree(source / folder, pkg / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True)  # no first-run penalty
    return pkg


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall seconds, and CPU seconds (user + system) of the command and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, check=False, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    took = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a git revision to time beside this working tree (e.g. main)")
    parser.add_argument("--reps", type=int, default=3, help="rounds (each runs every case once per build)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"case kinds to run (of {list(KINDS)})")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: unknown kind {unknown[0]!r} (known: {list(KINDS)})")

    work = Path(tempfile.mkdtemp(prefix="hetflow-startup-"))
    try:
        builds = {"this tree": stage_build(ROOT, None, work / "this")}
        if args.base:
            builds = {f"base {args.base}": stage_build(None, args.base, work / "base"), **builds}
        scripts = {}
        for kind in kinds:
            ranks, torch = KINDS[kind]
            for n in STAGES:
                path = work / f"{kind}-{n}.py"
                path.write_text(script(n, ranks, torch))
                scripts[(kind, n)] = path
        runtime = work / "xdg"
        runtime.mkdir(mode=0o700)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("HETFLOW_")}
        base_env.update(XDG_RUNTIME_DIR=str(runtime), PYTHONDONTWRITEBYTECODE="1")
        python = sys.executable
        mpiexec = str(Path(python).parent / "mpiexec")
        peers = {"python -c pass": [python, "-c", "pass"],
                 "mpiexec -n 1 python -c pass": [mpiexec, "-n", "1", python, "-c", "pass"],
                 "mpiexec -n 2 python -c pass": [mpiexec, "-n", "2", python, "-c", "pass"],
                 "import pyarrow, numpy, mpi4py": [python, "-c", "import pyarrow, numpy, mpi4py"],
                 "import torch": [python, "-c", "import torch"]}
        times: dict[tuple[str, ...], list[tuple[float, float]]] = {}
        for rep in range(args.reps):
            for name, argv in peers.items():
                times.setdefault(("peer", name), []).append(timed(argv, base_env, work))
            for (kind, n), path in scripts.items():
                for label, pkg in builds.items():
                    workdir = work / "workdir"  # fresh every time: nothing cached
                    env = dict(base_env, PYTHONPATH=str(pkg), HETFLOW_WORKDIR=str(workdir))
                    env.pop("PYTHONDONTWRITEBYTECODE")  # the user script's and the build's .pyc are kept
                    argv = [python, "-m", "hetflow.cli", "run", str(path), "--no-progress"]
                    times.setdefault((label, kind, str(n)), []).append(timed(argv, env, work))
                    shutil.rmtree(workdir)
            print(f"round {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
        sys.stderr.flush()
        report(times, builds, kinds, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})"


def report(times: dict[tuple[str, ...], list[tuple[float, float]]], builds: dict[str, Path], kinds: list[str],
           reps: int) -> None:
    """Seconds, median (min-max) over the rounds: wall clock, and CPU of every process involved."""
    load = os.getloadavg()[0]
    print(f"\nhetflow stage start-up: {reps} rounds on {os.cpu_count()} CPUs (load average {load:.1f} at the end); "
          "seconds, median (min-max)\n")
    print(f"{'peer':<34} {'wall':<20} cpu")
    for key, values in times.items():
        if key[0] == "peer":
            print(f"{key[1]:<34} {spread([w for w, _ in values]):<20} {spread([c for _, c in values])}")
    print(f"\n{'build':<16} {'case':<13} {'1 stage: wall':<19} {'10 stages: wall':<19} "
          f"{'per stage: wall':<19} {'per stage: cpu':<19}")
    for label in builds:
        for kind in kinds:
            one, ten = times[(label, kind, "1")], times[(label, kind, "10")]
            wall = [(t[0] - o[0]) / 9 for t, o in zip(ten, one)]  # marginal, within a round
            cpu = [(t[1] - o[1]) / 9 for t, o in zip(ten, one)]
            flag = "" if kind == "2-rank" else (" ok" if statistics.median(wall) <= TARGET else f" > {TARGET}")
            print(f"{label:<16} {kind:<13} {spread([w for w, _ in one]):<19} {spread([w for w, _ in ten]):<19} "
                  f"{spread(wall):<19} {spread(cpu):<19}{flag}")


if __name__ == "__main__":
    main()
