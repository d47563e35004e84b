"""CPU per task, marginal: what one more trivial stage costs the orchestrator and everything it starts.

    python benchmarks/task_cpu.py [--styles decorated,loop,torch] [--small 20] [--large 80]
                                  [--repeats 3] [--against OTHER_PYTHON]

The scripts are those of ``benchmarks/throughput.py``.  Each is run in a fresh
process and work directory with ``small`` and then ``large`` stages; the figure is
``(CPU(large) - CPU(small)) / (large - small)``, for the orchestrator's process
(``RUSAGE_SELF``, printed by the script) and for all processes (this process's
``RUSAGE_CHILDREN``: the script, its fork server and every stage, as each is waited
for).  CPU, not wall time, because a shared machine's load moves wall time by a
third within minutes; and the CPU of a whole run of ``small`` stages (``--small 1``: what a run costs
besides its stages).  ``--against`` names another installation's Python (an older
checkout's venv) to measure in the same run, alternated; medians of the repeats.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402 - the same scripts

REPORT = ('import resource as _r\n'
          'print("SELF", sum(getattr(_r.getrusage(_r.RUSAGE_SELF), f) for f in ("ru_utime", "ru_stime")))\n')


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def measure(python: str, style: str, n: int) -> tuple[float, float]:
    """CPU seconds of one run of ``n`` stages: (the orchestrator's process, all processes)."""
    with tempfile.TemporaryDirectory(prefix="hf-task-cpu-") as tmp:
        path = Path(tmp) / "pipeline.py"
        path.write_text(throughput.script(style, n).replace('    print("SECONDS"', REPORT.replace(
            "import", "    import").replace("\nprint", "\n    print") + '    print("SECONDS"'))
        before = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
        done = subprocess.run([python, str(path)], cwd=tmp, capture_output=True, text=True, check=False)
        total = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - before
        own = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("SELF ")]
        if done.returncode != 0 or not own:
            raise RuntimeError(f"{python}: {style} x{n} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return float(own[-1]), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--styles", default="decorated,loop,torch")
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--large", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", help="another installation's python, measured alternately in the same run")
    args = parser.parse_args(argv)
    if not 1 <= args.small < args.large or args.repeats < 1:
        parser.error("expected 1 <= --small < --large and --repeats >= 1")
    pythons = {"this": sys.executable, **({"against": args.against} if args.against else {})}
    print(f"CPU per task, marginal between {args.small} and {args.large} stages, medians of {args.repeats}")
    for style in [s for s in args.styles.split(",") if s]:
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in pythons}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in pythons}
        for repeat in range(args.repeats):
            order = list(pythons.items())
            for name, python in (order if repeat % 2 == 0 else order[::-1]):
                small, large = measure(python, style, args.small), measure(python, style, args.large)
                rows[name].append(tuple((b - a) / (args.large - args.small) for a, b in zip(small, large)))
                runs[name].append(small)
        for name, values in rows.items():
            own = statistics.median(v[0] for v in values) * 1e3
            total = statistics.median(v[1] for v in values) * 1e3
            spread = [v[1] * 1e3 for v in values]
            print(f"{style:10s} {name:8s} orchestrator {own:6.1f} ms   all processes {total:6.1f} ms "
                  f"({min(spread):.1f}-{max(spread):.1f})")
        for name, values in runs.items():  # what the run costs besides its stages when --small is 1
            own = statistics.median(v[0] for v in values)
            spread = [v[1] for v in values]
            print(f"{style:10s} {name:8s} a run of {args.small}: orchestrator {own:.3f} s   all processes "
                  f"{statistics.median(spread):.3f} s ({min(spread):.3f}-{max(spread):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
