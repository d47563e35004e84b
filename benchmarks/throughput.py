"""Tasks per second end to end: hetflow's local pilot against Parsl and Dask on the same machine.

    python benchmarks/throughput.py [--tasks 200] [--repeats 3] [--out FILE.json]
    python benchmarks/throughput.py --quick          # CI size (a test runs it)
    python benchmarks/throughput.py --lab [--tasks 100]   # backend slurm on the lab cluster

Every system runs N independent trivial one-rank tasks, each making a 1 KB
table (128 int64 values), on two workers (the 2-core machine):

- ``hetflow decorated``: a script of N ``@pipe.stage`` functions;
- ``hetflow loop``: the same N stages made by a factory in a ``for`` loop;
- ``hetflow map``: one map stage of N items (``map_over={"i": range(N)}``), one output of N partitions;
- ``hetflow torch class``: the loop script with a ``torch.nn.Module`` subclass
  at module level (as ``hf.ml.register_architecture`` needs), which no stage uses;
- ``parsl``: a ``@python_app`` returning the table's bytes, HighThroughputExecutor
  with a LocalProvider and 2 workers, N apps submitted at once;
- ``dask``: ``client.map`` of the same function on a LocalCluster of 2 single-threaded workers.

hetflow's figure is the whole ``pipe.run()`` (planning, cache look-ups, the
store, processes, commits) as a user's script sees it, measured inside a
fresh ``python script.py`` process; a fresh work directory each time, so
nothing is cached.  Parsl's and Dask's exclude their start-up (a warm executor
or cluster); each side's start-up is reported apart.  The marginal cost of a
stage is (T(N) - T(N/4)) / (N - N/4) per style.  Systems are alternated within
each repeat; figures are medians with min-max.

``--lab`` runs the loop-made script with a ``backend: slurm`` pilot inside
``salloc -N2 --exclusive`` on the Slurm lab cluster (scripts/slurm-cluster.sh,
its SLURM_CONF in the environment), twice per repeat, alternated: ``slurm``
(one-rank stages forked by the per-node agents) and ``slurm-steps``
(``options.slurm.warm_start: false``, one ``srun`` job step per stage, as
before the agents); no peers (benchmarks/backends.py --lab --stages has them).
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
from typing import Any

ROWS = 128  # 128 int64 values: 1 KB a task

SCRIPT_HEAD = '''
import os, time
import pyarrow as pa
import hetflow as hf
{torch}
pipe = hf.Pipeline("throughput", pilot={pilot})
'''

DECORATED = '''
@pipe.stage(outputs=["out{i}"])
def s{i}(ctx):
    return {{"out{i}": pa.table({{"x": pa.array(range({rows}), pa.int64())}})}}
'''

LOOP = '''
def make(i):
    def body(ctx):
        return {{f"out{{i}}": pa.table({{"x": pa.array(range({rows}), pa.int64())}})}}
    return body

for i in range({n}):
    pipe.stage(make(i), name=f"s{{i}}", outputs=[f"out{{i}}"])
'''

MAP = '''
@pipe.stage(map_over={{"i": list(range({n}))}}, outputs=["out"])
def items(ctx):
    return {{"out": pa.table({{"x": pa.array(range({rows}), pa.int64())}})}}
'''

TORCH = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
'''

SCRIPT_TAIL = '''
if __name__ == "__main__":
    started = time.perf_counter()
    run = pipe.run(progress=False)
    print("SECONDS", time.perf_counter() - started, run.state)
'''


LOCAL_PILOT = 'hf.PilotDescription(name="two-cores", cores_per_node=2, memory_per_node=2**33)'
LAB_PILOT = 'hf.PilotDescription(name="lab", backend="slurm", options={{"slurm": {{"warm_start": {warm}}}}})'
LAB_STYLES = {"slurm": "True", "slurm-steps": "False"}
"""The ``--lab`` styles: the loop script on backend slurm, with and without its agents."""


def script(style: str, n: int) -> str:
    pilot = LAB_PILOT.format(warm=LAB_STYLES[style]) if style in LAB_STYLES else LOCAL_PILOT
    head = SCRIPT_HEAD.format(torch=TORCH if style == "torch" else "", pilot=pilot)
    if style == "decorated":
        body = "".join(DECORATED.format(i=i, rows=ROWS) for i in range(n))
    elif style == "map":
        body = MAP.format(n=n, rows=ROWS)
    else:
        body = LOOP.format(n=n, rows=ROWS)
    return textwrap.dedent(head) + body + SCRIPT_TAIL


def hetflow_run(style: str, n: int) -> float:
    """Seconds of one ``pipe.run()`` of ``n`` stages in a fresh process and work directory."""
    with tempfile.TemporaryDirectory(prefix="hf-throughput-") as tmp:
        path = Path(tmp) / "pipeline.py"
        path.write_text(script(style, n))
        lab = ["salloc", "-N2", "--exclusive", "--time=30", "--job-name=hetflow-throughput"]
        done = subprocess.run([*(lab if style in LAB_STYLES else []), sys.executable, str(path)], cwd=tmp, capture_output=True, text=True, timeout=3600,
                              check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("SECONDS ")]
        if done.returncode != 0 or not lines or not lines[-1].endswith("DONE"):
            raise RuntimeError(f"hetflow {style} x{n} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return float(lines[-1].split()[1])


def table_bytes(i: int, rows: int = ROWS) -> bytes:
    """The peers' task: the same 1 KB table, returned as Arrow IPC bytes (a result must travel back).
    Self-contained (``rows`` a default): Parsl ships a ``__main__`` function by value, without its globals."""
    import pyarrow as pa

    table = pa.table({"x": pa.array(range(rows), pa.int64())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


class Parsl:
    name = "parsl"

    def __init__(self, run_dir: str) -> None:
        import parsl
        from parsl.config import Config
        from parsl.executors import HighThroughputExecutor
        from parsl.providers import LocalProvider

        started = time.perf_counter()
        # Parsl starts its interchange as a program found on PATH (interchange.py, beside this Python)
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        self.parsl = parsl
        self.dfk = parsl.load(Config(executors=[HighThroughputExecutor(
            label="htex", max_workers_per_node=2, provider=LocalProvider(init_blocks=1, max_blocks=1))],
            run_dir=run_dir, strategy="none"))
        self.app = parsl.python_app(table_bytes)
        self.app(0).result()  # workers up
        self.startup = time.perf_counter() - started

    def run(self, n: int) -> float:
        started = time.perf_counter()
        futures = [self.app(i) for i in range(n)]
        for future in futures:
            future.result()
        return time.perf_counter() - started

    def close(self) -> None:
        self.dfk.cleanup()
        self.parsl.clear()


class Dask:
    name = "dask"

    def __init__(self, run_dir: str) -> None:
        from dask.distributed import Client, LocalCluster

        started = time.perf_counter()
        self.cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                    local_directory=run_dir)
        self.client = Client(self.cluster)
        self.client.submit(table_bytes, -1, pure=False).result()
        self.startup = time.perf_counter() - started

    def run(self, n: int) -> float:
        started = time.perf_counter()
        futures = self.client.map(table_bytes, range(n), pure=False)
        self.client.gather(futures)
        return time.perf_counter() - started

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--styles", default="decorated,loop,torch")
    parser.add_argument("--peers", default="parsl,dask")
    parser.add_argument("--quick", action="store_true", help="CI size: 16 tasks, 1 repeat, no peers")
    parser.add_argument("--lab", action="store_true", help="backend slurm on the lab cluster (module docstring)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.lab:
        if not os.environ.get("SLURM_CONF"):
            parser.error("--lab needs the lab cluster's SLURM_CONF: eval \"$(scripts/slurm-cluster.sh env)\"")
        args.styles, args.peers = ",".join(LAB_STYLES), ""
    if args.quick:
        args.tasks, args.repeats, args.peers = 16, 1, ""
    if args.tasks < 4 or args.repeats < 1:
        parser.error("--tasks must be >= 4 and --repeats >= 1")
    styles = [s for s in args.styles.split(",") if s]
    unknown = set(styles) - {"decorated", "loop", "torch", "map", *LAB_STYLES}
    if unknown:
        parser.error(f"unknown --styles {sorted(unknown)} (known: decorated, loop, torch, map)")
    if "torch" in styles:
        try:
            import torch  # noqa: F401
        except ImportError:
            styles.remove("torch")
            print("torch is not installed: the 'torch class' style is left out", file=sys.stderr)
    n, small = args.tasks, max(2, args.tasks // 4)
    times: dict[str, list[float]] = {}
    marginal: dict[str, list[float]] = {}
    startup: dict[str, float] = {}
    peers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="hf-peers-") as peer_dir:
        for name in [p for p in args.peers.split(",") if p]:
            cls = {"parsl": Parsl, "dask": Dask}[name]
            peer = cls(os.path.join(peer_dir, name))
            peers.append(peer)
            startup[name] = peer.startup
        try:
            for repeat in range(args.repeats):
                order = styles + [p.name for p in peers]
                if repeat % 2:
                    order.reverse()
                for name in order:
                    peer = next((p for p in peers if p.name == name), None)
                    if peer is not None:
                        times.setdefault(name, []).append(peer.run(n))
                        continue
                    full = hetflow_run(name, n)
                    part = hetflow_run(name, small)
                    times.setdefault(f"hetflow {name}", []).append(full)
                    marginal.setdefault(f"hetflow {name}", []).append((full - part) / (n - small))
                    print(f"repeat {repeat + 1}: hetflow {name}: {n / full:.1f} tasks/s", file=sys.stderr)
        finally:
            for peer in peers:
                peer.close()
    rates = {name: summary([n / t for t in values]) for name, values in times.items()}
    result = {"tasks": n, "repeats": args.repeats, "cpus": os.cpu_count(), "tasks_per_second": rates,
              "marginal_seconds": {name: summary(v) for name, v in marginal.items()}, "startup_seconds": startup}
    best_peer = max((rates[p]["median"] for p in rates if not p.startswith("hetflow")), default=None)
    where = "backend slurm, lab cluster, 2 nodes" if args.lab else "2 workers"
    print(f"{n} trivial one-rank tasks (1 KB each), {where}, {args.repeats} repeat(s) alternated")
    print(f"{'':24s} {'tasks/s median':>15s} {'min':>8s} {'max':>8s} {'marginal s/stage':>17s}")
    for name, rate in rates.items():
        extra = f"{marginal[name] and statistics.median(marginal[name]):17.4f}" if name in marginal else ""
        print(f"{name:24s} {rate['median']:15.1f} {rate['min']:8.1f} {rate['max']:8.1f} {extra}")
    if best_peer:
        result["ratios_to_best_peer"] = {name: rate["median"] / best_peer for name, rate in rates.items()
                                         if name.startswith("hetflow")}
        print("ratio to the best peer: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ratios_to_best_peer"].items()))
    for name, seconds in startup.items():
        print(f"start-up {name}: {seconds:.2f} s (not counted above)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
