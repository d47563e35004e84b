"""A map stage of many items at scale: time to plan and run, the orchestrator's memory, the store's size, and
how fast ``status`` answers.

    python benchmarks/map_scale.py [--items 100000] [--out FILE.json]
    python benchmarks/map_scale.py --items 2000            # a quick look

One map stage over a grid of N points (``map_over={"i": range(N)}``), each item a
trivial one-rank task making a 1 KB table, then a downstream stage reading the one
output dataset (N partitions). Measured in a fresh ``python script.py`` process and
work directory: the wall time from ``pipe.run()`` to the first item's start (planning:
the declaration checks, the cache look-ups of N items, the store's records), the whole
run and its items per second, the orchestrator's peak RSS (``ru_maxrss``), the store's
size on disk, then the wall time of ``hetflow status`` (the run's view) and of
``hetflow status RUN STAGE --items --json`` (every item), median of 3 each; then the
same script again (every item cached: the look-up of N items).  While the first run goes,
``hetflow status RUN``, ``status RUN --json``, ``status RUN items --items`` and ``--items --json``
are timed in turn every ``--poll`` seconds (``during``: median, min and max of each, with how many
items the view counted done), as a user watching the run would call them; ``status_cpu_seconds``: the
CPU seconds of each command (on a loaded machine its wall time is mostly waiting for a core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = '''
import resource, time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("map-scale", pilot=hf.PilotDescription(name="two-cores", cores_per_node=2,
                                                          memory_per_node=2**33))


@pipe.stage(map_over={{"i": list(range({n}))}}, outputs=["out"])
def items(ctx):
    return {{"out": pa.table({{"x": pa.array(range(128), pa.int64()), "i": pa.array([ctx.params["i"]] * 128)}})}}


@pipe.stage(inputs=["out"], outputs=["total"])
def total(ctx, out):
    return {{"total": pa.table({{"rows": [out.num_rows], "sum_i": [pa.compute.sum(out["i"]).as_py()]}})}}


if __name__ == "__main__":
    started = time.perf_counter()
    run = pipe.run(progress=False, check=False)
    print("SECONDS", time.perf_counter() - started, run.state, run.id)
    print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''


def _epoch(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


CPU: dict[str, list[float]] = {}
"""CPU seconds (user + system) of each status command, by the name its wall times are reported under."""


def _run(argv: list[str], cwd: Path, name: str | None = None) -> tuple[float, subprocess.CompletedProcess[str]]:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if name is not None:  # on a loaded machine wall time is mostly waiting for a core: CPU says what it costs
        CPU.setdefault(name, []).append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return took, done


def _during(process: subprocess.Popen[str], hetflow: str, work: Path, poll: float) -> dict[str, object]:
    """Time the status commands while ``process`` (the first run) goes, every ``poll`` seconds."""
    commands = {"status_seconds": ["status", "{run}"], "status_json_seconds": ["status", "{run}", "--json"],
                "status_items_seconds": ["status", "{run}", "items", "--items"],
                "status_items_json_seconds": ["status", "{run}", "items", "--items", "--json"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    done_counts: list[int] = []
    run_id = None
    while process.poll() is None:
        time.sleep(poll)
        if run_id is None:
            listed = subprocess.run([hetflow, "status", "--json"], cwd=work, capture_output=True, text=True,
                                    check=False)
            try:
                run_id = json.loads(listed.stdout)["id"]
            except (ValueError, KeyError):
                continue
        for name, command in commands.items():
            if process.poll() is not None:
                break
            seconds, done = _run([hetflow] + [part.format(run=run_id) for part in command], work, f"during {name}")
            if done.returncode not in (0, 1):  # the items are not recorded yet: not a status time
                continue
            times[name].append(seconds)
            if name == "status_items_json_seconds":
                counts = json.loads(done.stdout)["counts"]
                done_counts.append(counts.get("DONE", 0) + counts.get("CACHED", 0))
    result: dict[str, object] = {name: {"median": statistics.median(t), "min": min(t), "max": max(t), "calls": len(t)}
                                 for name, t in times.items() if t}
    result["items_done_when_timed"] = done_counts
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--poll", type=float, default=10.0, help="seconds between status calls during the first run")
    args = parser.parse_args(argv)
    if args.items < 1:
        parser.error("--items must be >= 1")
    hetflow = str(Path(sys.executable).parent / "hetflow")
    result: dict[str, object] = {"items": args.items, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="hf-map-scale-") as tmp:
        work = Path(tmp)
        (work / "flow.py").write_text(textwrap.dedent(SCRIPT.format(n=args.items)))
        for label in ("first run", "again (all cached)"):
            if label == "first run":
                started = time.perf_counter()
                process = subprocess.Popen([sys.executable, "flow.py"], cwd=work, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
                result["during"] = _during(process, hetflow, work, args.poll)
                out, err = process.communicate()
                wall = time.perf_counter() - started
                done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
            else:
                wall, done = _run([sys.executable, "flow.py"], work)
            lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
            if "SECONDS" not in lines:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"map-scale: the {label} failed")
            seconds, state, run_id = lines["SECONDS"].split()
            if state != "DONE":  # recorded (a downstream stage may fail where the map did not): its figures stand
                print(f"map-scale: the {label} ended {state}: {done.stderr.strip().splitlines()[-1:]}",
                      file=sys.stderr)
            status = json.loads(_run([hetflow, "status", run_id, "--json"], work)[1].stdout)
            started = min((_epoch(s["started"]) for s in status["stages"] if s["name"] == "items" and s.get("started")),
                          default=None)
            entry = {"run": run_id, "state": state, "seconds": float(seconds), "process_seconds": wall,
                     "items_per_second": args.items / float(seconds),
                     "orchestrator_max_rss_mib": int(lines["MAXRSS_KB"]) / 1024}
            if started is not None and status.get("started"):
                entry["plan_seconds"] = started - _epoch(status["started"])
            result[label] = entry
        db = work / ".hetflow" / "hetflow.db"
        result["store_mib"] = db.stat().st_size / 2**20 if db.exists() else None
        run_id = result["first run"]["run"]  # type: ignore[index]
        for name, command in (("status_seconds", [hetflow, "status", run_id]),
                              ("status_json_seconds", [hetflow, "status", run_id, "--json"]),
                              ("status_items_seconds", [hetflow, "status", run_id, "items", "--items"]),
                              ("status_items_json_seconds", [hetflow, "status", run_id, "items", "--items", "--json"])):
            times = []
            for _ in range(3):
                seconds, done = _run(command, work, name)
                if done.returncode not in (0, 1):
                    raise SystemExit(f"map-scale: {' '.join(command[1:])} failed: {done.stderr[-2000:]}")
                times.append(seconds)
            result[name] = {"median": statistics.median(times), "min": min(times), "max": max(times)}
    result["status_cpu_seconds"] = {name: {"median": statistics.median(t), "min": min(t), "max": max(t)}
                                    for name, t in CPU.items()}
    result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
