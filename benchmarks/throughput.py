"""Tasks per second: hetflow's local pilot against Parsl and Dask on the same machine, start-up included.

    python benchmarks/throughput.py [--tasks 200] [--repeats 3] [--out FILE.json]
    python benchmarks/throughput.py --styles map --tasks 1000 --peers parsl --against main=/tmp/hfmain/lib
    python benchmarks/throughput.py --styles gpu,cores2 --tasks 40 --peers "" --against main=/tmp/hfmain/lib
    python benchmarks/throughput.py --quick          # CI size (a test runs it)
    python benchmarks/throughput.py --lab [--tasks 200]   # backend slurm and the peers' native tasks, lab cluster

Every system runs N independent trivial one-rank tasks, each making a 1 KB
table (128 int64 values), on two workers (the 2-core machine):

- ``hetflow decorated``: a script of N ``@pipe.stage`` functions;
- ``hetflow loop``: the same N stages made by a factory in a ``for`` loop;
- ``hetflow map``: one map stage of N items (``map_over={"i": range(N)}``), one output of N partitions;
- ``hetflow torch``: the loop script with a ``torch.nn.Module`` subclass
  at module level (as ``hf.ml.register_architecture`` needs), which no stage uses;
- ``hetflow gpu``: the loop script's stages with ``gpus_per_rank=1`` on a pilot that declares two
  (NVIDIA) GPUs, which no stage uses (not in the default ``--styles``);
- ``hetflow cores2``: the loop script's stages with ``cores_per_rank=2`` (one at a time; not in the
  default ``--styles``);
- ``parsl``: a ``@python_app`` returning the table's bytes, HighThroughputExecutor
  with a LocalProvider and 2 workers, N apps submitted at once;
- ``dask``: ``client.map`` of the same function on a LocalCluster of 2 single-threaded workers.

Every system is measured the same way: a fresh ``python`` process (hetflow:
``python script.py`` in a fresh work directory, so nothing is cached; a peer:
this file with ``--child NAME``, which starts its executor or cluster), timed
from just before the process is started to the moment it holds all N results
(the process prints ``time.time()`` then; its shutdown after that is not
counted).  From those times, for each system and each repeat:

- *end to end*: ``N / T(N)``, start-up included (interpreter, imports, the
  executor's or pilot's start, the run);
- *steady state*: ``(N - N/4) / (T(N) - T(N/4))``, the marginal rate, whatever
  is paid once per run cancelled out; ``fixed``: ``T(N)`` less N marginal tasks;
- *in run*, as earlier versions of this file reported: hetflow's ``pipe.run()``
  alone, a peer's N tasks on its warm executor (a peer's child runs one task
  first, to know its workers are up: its end to end time includes that task);
  *steady in run*: the steady-state formula on those times, which leaves out
  the peers' start-up and its spread (a second or more for Parsl, far more
  than its N/4 tasks take).

Systems are alternated (the order reversed every other repeat), N and N/4 in
each repeat; figures are medians with min-max, with the load average seen at
each measurement, and for hetflow the CPU seconds of all the run's processes
(``RUSAGE_CHILDREN``: each is waited for by its parent; less moved by the load
than wall time).  ``--against LABEL=DIR`` also runs hetflow with ``DIR``
first on ``PYTHONPATH`` (another checkout's packages, laid out as ``hetflow/``),
alternated with this one.  ``--bytecode`` lets the children write and use
compiled bytecode (in a cache directory of this run, after one unmeasured run
each), as a user's machine does; without it the environment decides (this
project's machine sets ``PYTHONDONTWRITEBYTECODE=1``, which makes every start
compile hetflow's modules again).

``--lab`` runs on the Slurm lab cluster (scripts/slurm-cluster.sh, its
SLURM_CONF in the environment), two whole nodes each:

- ``hetflow slurm``: the loop-made script with a ``backend: slurm`` pilot in
  ``salloc -N2 --exclusive`` (one-rank stages forked by the per-node agents);
- ``hetflow slurm-map``: the map script, the same way (its items in runners the agents fork);
- ``hetflow slurm-steps`` (only when named in ``--styles``): the loop script with
  ``options.slurm.warm_start: false``, one ``srun`` job step per stage;
- the peers' native tasks (benchmarks/lab_peers.py), each asking Slurm for its
  own two-node job: ``parsl-slurm`` (``python_app``, HighThroughputExecutor,
  ``SlurmProvider`` with ``SrunLauncher``), ``dask-slurm`` (``client.submit``,
  dask-jobqueue's ``SLURMCluster``), and, when named in ``--peers``, ``rp-raptor``
  (RADICAL-Pilot Raptor function tasks; its pilot job alone takes about a minute to start).

A job's queueing and start are in the peers' and hetflow's end to end times
alike; the ratios are against the best peer on each measure.

``--saturating N`` then runs the simulator's saturating workload scaled to this
machine, N zero-length tasks, through the simulator and for real on the local
pilot (benchmarks/saturating.py, whose docstring says how it is scaled): the
scheduler's placements per second beside the runtime's tasks per second, in
the same run and the same JSON (``"saturating"``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    pipe.stage(make(i), name=f"s{{i}}", outputs=[f"out{{i}}"]{resources})
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

SCRIPT_TAIL = """
if __name__ == "__main__":
    started = time.perf_counter()
    run = pipe.run(progress=False)
    print("RESULTS_AT", time.time(), flush=True)
    print("SECONDS", time.perf_counter() - started, run.state)
"""

LOCAL_PILOT = 'hf.PilotDescription(name="two-cores", cores_per_node=2, memory_per_node=2**33)'
GPU_PILOT = ('hf.PilotDescription(name="two-cores-two-gpus", cores_per_node=2, gpus_per_node=2, gpu_vendor="nvidia", '
             'memory_per_node=2**33)')
RESOURCES = {"gpu": ", gpus_per_rank=1", "cores2": ", cores_per_rank=2"}
"""The loop script's stage resources, by style (the others: one core, no GPU)."""
LAB_PILOT = 'hf.PilotDescription(name="lab", backend="slurm", options={{"slurm": {{"warm_start": {warm}}}}})'
LAB_STYLES = {"slurm": "True", "slurm-map": "True", "slurm-steps": "False"}
"""The ``--lab`` styles: on backend slurm, the loop script with its agents (``slurm``) and without
(``slurm-steps``), and the map script with its agents (``slurm-map``)."""
STYLES = ("decorated", "loop", "torch", "map", *RESOURCES, *LAB_STYLES)
LAB_PEERS = ("parsl-slurm", "dask-slurm", "rp-raptor")
"""The peers' native function tasks on the lab cluster (benchmarks/lab_peers.py)."""
PEERS = ("parsl", "dask", *LAB_PEERS)


def script(style: str, n: int) -> str:
    pilot = (LAB_PILOT.format(warm=LAB_STYLES[style]) if style in LAB_STYLES
             else GPU_PILOT if style == "gpu" else LOCAL_PILOT)
    head = SCRIPT_HEAD.format(torch=TORCH if style == "torch" else "", pilot=pilot)
    if style == "decorated":
        body = "".join(DECORATED.format(i=i, rows=ROWS) for i in range(n))
    elif style in ("map", "slurm-map"):
        body = MAP.format(n=n, rows=ROWS)
    else:
        body = LOOP.format(n=n, rows=ROWS, resources=RESOURCES.get(style, ""))
    return textwrap.dedent(head) + body + SCRIPT_TAIL


def _marks(stdout: str) -> dict[str, float]:
    """The ``NAME value`` lines a child printed (the last of each name)."""
    marks = {}
    for line in stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("RESULTS_AT", "SECONDS", "READY_AT", "WARM_SECONDS"):
            marks[name] = float(value.split()[0])
    return marks


def hetflow_run(style: str, n: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """One run of ``n`` tasks in a fresh ``python script.py`` and work directory: seconds from before the
    process starts to all results (``total``) and of ``pipe.run()`` alone (``in_run``)."""
    with tempfile.TemporaryDirectory(prefix="hf-throughput-") as tmp:
        path = Path(tmp) / "pipeline.py"
        path.write_text(script(style, n))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.time()
        lab = ["salloc", "-N2", "--exclusive", "--time=30", "--job-name=hetflow-throughput"]
        done = subprocess.run([*(lab if style in LAB_STYLES else []), sys.executable, str(path)], cwd=tmp, capture_output=True, text=True, timeout=3600,
                              check=False, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        marks = _marks(done.stdout)
        if done.returncode != 0 or "RESULTS_AT" not in marks or not done.stdout.rstrip().endswith("DONE"):
            raise RuntimeError(f"hetflow {style} x{n} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        # every process of the run (the script, its fork server, the ranks and runners) is waited for by its
        # parent, so its CPU is in this process's children's; a peer's workers are not all waited for that way
        cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
        return {"total": marks["RESULTS_AT"] - started, "in_run": marks["SECONDS"], "cpu": cpu}


def peer_run(name: str, n: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """One run of ``n`` tasks on a peer started afresh in a child process (``--child``): seconds from before the
    process starts to all results (``total``), to its workers' being up (``startup``) and of the N tasks alone."""
    with tempfile.TemporaryDirectory(prefix=f"hf-{name}-") as tmp:
        started = time.time()
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--tasks", str(n)],
                              cwd=tmp, capture_output=True, text=True, timeout=3600, check=False, env=env)
        marks = _marks(done.stdout)
        if done.returncode != 0 or "RESULTS_AT" not in marks:
            raise RuntimeError(f"{name} x{n} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return {"total": marks["RESULTS_AT"] - started, "in_run": marks["WARM_SECONDS"],
                "startup": marks["READY_AT"] - started}


def table_bytes(i: int, text: bool = False, rows: int = ROWS) -> bytes | str:
    """The peers' task: the same 1 KB table, returned as Arrow IPC bytes (a result must travel back); ``text``:
    as base64 text (RP's Raptor master decodes a function's result as UTF-8).
    Self-contained (``rows`` a default): Parsl ships a ``__main__`` function by value, without its globals."""
    import base64

    import pyarrow as pa

    table = pa.table({"x": pa.array(range(rows), pa.int64())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = bytes(sink.getvalue())
    return base64.b64encode(data).decode() if text else data


class Parsl:
    name = "parsl"

    def __init__(self, run_dir: str) -> None:
        import parsl
        from parsl.config import Config
        from parsl.executors import HighThroughputExecutor
        from parsl.providers import LocalProvider

        # Parsl starts its interchange as a program found on PATH (interchange.py, beside this Python)
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        self.parsl = parsl
        self.dfk = parsl.load(Config(executors=[HighThroughputExecutor(
            label="htex", max_workers_per_node=2, provider=LocalProvider(init_blocks=1, max_blocks=1))],
            run_dir=run_dir, strategy="none"))
        self.app = parsl.python_app(table_bytes)
        self.app(-1).result()  # workers up

    def run(self, n: int) -> None:
        futures = [self.app(i) for i in range(n)]
        for future in futures:
            future.result()

    def close(self) -> None:
        self.dfk.cleanup()
        self.parsl.clear()


class Dask:
    name = "dask"

    def __init__(self, run_dir: str) -> None:
        from dask.distributed import Client, LocalCluster

        self.cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                    local_directory=run_dir)
        self.client = Client(self.cluster)
        self.client.submit(table_bytes, -1, pure=False).result()  # workers up

    def run(self, n: int) -> None:
        futures = self.client.map(table_bytes, range(n), pure=False)
        self.client.gather(futures)

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def child(name: str, n: int) -> int:
    """A peer's whole run in this process: start it, one task to know its workers are up, then ``n``."""
    run_dir = os.path.join(os.getcwd(), name)
    if name in LAB_PEERS:
        from lab_peers import peer as lab_peer  # beside this file

        peer: Any = lab_peer(name, run_dir, table_bytes)
    else:
        peer = (Parsl if name == "parsl" else Dask)(run_dir)
    try:
        print("READY_AT", time.time(), flush=True)
        started = time.perf_counter()
        peer.run(n)
        print("WARM_SECONDS", time.perf_counter() - started, flush=True)
        print("RESULTS_AT", time.time(), flush=True)
    finally:
        peer.close()
    return 0


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(values: list[float], digits: int = 1) -> str:
    s = summary(values)
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def against(parser: argparse.ArgumentParser, spec: str) -> tuple[str, dict[str, str]]:
    """``--against LABEL=DIR``: the label, and the environment that puts ``DIR`` (holding a ``hetflow``
    package) first on ``PYTHONPATH``; a clear error otherwise."""
    label, _, folder = spec.partition("=")
    if not label or not os.path.isdir(os.path.join(folder, "hetflow")):
        parser.error(f"--against {spec!r}: expected LABEL=DIR with DIR/hetflow a package")
    return label, dict(os.environ, PYTHONPATH=os.path.abspath(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--styles", help="default decorated,loop,torch; with --lab slurm,slurm-map")
    parser.add_argument("--peers", help="default parsl,dask; with --lab parsl-slurm,dask-slurm (rp-raptor: named)")
    parser.add_argument("--against", action="append", default=[], metavar="LABEL=DIR",
                        help="also run hetflow with DIR first on PYTHONPATH (another checkout's packages)")
    parser.add_argument("--bytecode", action="store_true",
                        help="let the children write and use compiled bytecode, as a user's machine does")
    parser.add_argument("--quick", action="store_true", help="CI size: 16 tasks, 1 repeat, no peers")
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--lab", action="store_true", help="backend slurm on the lab cluster (module docstring)")
    parser.add_argument("--saturating", type=int, default=0, metavar="N",
                        help="also run the simulator's saturating workload of N tasks for real (benchmarks/saturating.py)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.tasks)
    if args.lab:
        if not os.environ.get("SLURM_CONF"):
            parser.error("--lab needs the lab cluster's SLURM_CONF: eval \"$(scripts/slurm-cluster.sh env)\"")
        args.styles = "slurm,slurm-map" if args.styles is None else args.styles
        args.peers = "parsl-slurm,dask-slurm" if args.peers is None else args.peers
        if set(args.styles.split(",")) - set(LAB_STYLES) - {""} or set(args.peers.split(",")) - set(LAB_PEERS) - {""}:
            parser.error(f"--lab runs the styles {', '.join(LAB_STYLES)} and the peers {', '.join(LAB_PEERS)}")
    args.styles = "decorated,loop,torch" if args.styles is None else args.styles
    args.peers = "parsl,dask" if args.peers is None else args.peers
    if args.quick:
        args.tasks, args.repeats, args.peers = 16, 1, ""
    if args.tasks < 4 or args.repeats < 1:
        parser.error("--tasks must be >= 4 and --repeats >= 1")
    styles = [s for s in args.styles.split(",") if s]
    unknown = set(styles) - set(STYLES)
    if unknown:
        parser.error(f"unknown --styles {sorted(unknown)} (known: {', '.join(STYLES)})")
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        parser.error(f"unknown --peers {sorted(set(peers) - set(PEERS))} (known: {', '.join(PEERS)})")
    builds: dict[str, dict[str, str]] = {"": dict(os.environ)}
    for spec in args.against:
        label, env = against(parser, spec)
        builds[f" [{label}]"] = env
    if "torch" in styles:
        try:
            import torch  # noqa: F401
        except ImportError:
            styles.remove("torch")
            print("torch is not installed: the 'torch' style is left out", file=sys.stderr)
    if not styles and not peers:
        if not args.saturating:
            parser.error("nothing to run: give --styles, --peers or --saturating")
        return _finish({"cpus": os.cpu_count()}, args, builds[""])
    n, small = args.tasks, max(2, args.tasks // 4)
    with tempfile.TemporaryDirectory(prefix="hf-pyc-") as pyc:
        if args.bytecode:
            for env in builds.values():
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                env["PYTHONPYCACHEPREFIX"] = pyc
            for style in styles:  # compiles and caches what each build imports: unmeasured
                for env in builds.values():
                    hetflow_run(style, small, env)
        systems = [(f"hetflow {style}{label}", style, env) for style in styles for label, env in builds.items()]
        systems += [(peer, peer, builds[""]) for peer in peers]
        runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {n: [], small: []} for name, _, _ in systems}
        loads: list[float] = []
        for repeat in range(args.repeats):
            order = systems if repeat % 2 == 0 else systems[::-1]
            for size in (n, small):
                for name, kind, env in order:
                    load = os.getloadavg()[0]
                    loads.append(load)
                    got = peer_run(kind, size, env) if kind in PEERS else hetflow_run(kind, size, env)
                    runs[name][size].append(got)
                    print(f"repeat {repeat + 1}: {name} x{size}: {size / got['total']:.1f} tasks/s end to end "
                          f"({got['total']:.2f} s), load {load:.1f}", file=sys.stderr, flush=True)
    figures: dict[str, dict[str, list[float]]] = {}
    for name, by_size in runs.items():
        f = figures[name] = {"end_to_end": [], "steady": [], "marginal": [], "fixed": [], "in_run": [],
                             "steady_in_run": []}
        if "cpu" in by_size[n][0]:
            f["cpu"] = [run["cpu"] for run in by_size[n]]
            f["marginal_cpu"] = [(full["cpu"] - part["cpu"]) / (n - small)
                                 for full, part in zip(by_size[n], by_size[small])]
        for full, part in zip(by_size[n], by_size[small]):
            marginal = (full["total"] - part["total"]) / (n - small)
            f["end_to_end"].append(n / full["total"])
            f["marginal"].append(marginal)
            f["steady"].append(1 / marginal if marginal > 0 else float("inf"))
            f["fixed"].append(full["total"] - n * marginal)
            f["in_run"].append(n / full["in_run"])
            in_run = full["in_run"] - part["in_run"]
            f["steady_in_run"].append((n - small) / in_run if in_run > 0 else float("inf"))
        if name in peers:
            f["startup"] = [run["startup"] for run in by_size[n] + by_size[small]]
    result: dict[str, Any] = {
        "tasks": n, "small": small, "repeats": args.repeats, "cpus": os.cpu_count(), "bytecode": args.bytecode,
        "load_average": summary(loads),
        **{key: {name: summary(f[key]) for name, f in figures.items() if key in f}
           for key in ("end_to_end", "steady", "marginal", "fixed", "in_run", "steady_in_run", "startup", "cpu",
                       "marginal_cpu")}}
    where = "lab cluster, 2 nodes of 2 CPUs" if args.lab else "2 workers"
    print(f"{n} trivial one-rank tasks (1 KB each), {where}, {args.repeats} repeat(s) alternated, "
          f"load average {_fmt(loads)}; medians (min-max)")
    print(f"{'':26s} {'end to end tasks/s':>22s} {'steady tasks/s':>24s} {'marginal ms/task':>18s} "
          f"{'fixed s':>18s} {'in run tasks/s':>22s} {'steady in run':>24s}")
    for name, f in figures.items():
        print(f"{name:26s} {_fmt(f['end_to_end']):>22s} {_fmt(f['steady']):>24s} "
              f"{_fmt([m * 1000 for m in f['marginal']], 2):>18s} {_fmt(f['fixed'], 2):>18s} "
              f"{_fmt(f['in_run']):>22s} {_fmt(f['steady_in_run']):>24s}")
    for name, f in figures.items():
        if "cpu" in f:
            print(f"{name}: CPU of all its processes {_fmt(f['cpu'], 2)} s for {n} tasks, marginal "
                  f"{_fmt([c * 1000 for c in f['marginal_cpu']], 2)} ms per task")
    for name, f in figures.items():
        if "startup" in f:
            print(f"{name}: workers up {_fmt(f['startup'], 2)} s after its process started (counted end to end)")
    keys = ("end_to_end", "steady", "in_run", "steady_in_run")
    if args.lab and peers:  # against the best peer on each measure (issue 26's lab target: >= 2x the best)
        best = {key: max(peers, key=lambda p: statistics.median(figures[p][key])) for key in keys}
        result["ratio_to"] = best
        result["ratios"] = {name: {key: statistics.median(f[key]) / statistics.median(figures[best[key]][key])
                                   for key in keys} for name, f in figures.items() if name.startswith("hetflow")}
        for name, ratio in result["ratios"].items():
            print(f"{name} / the best peer: " + "; ".join(f"{key.replace('_', ' ')} {ratio[key]:.2f}x ({best[key]})"
                                                         for key in keys))
    reference = next((p for p in ("parsl", "dask") if p in peers), None)
    if reference:
        result["ratio_to"] = reference
        result["ratios"] = {name: {key: statistics.median(f[key]) / statistics.median(figures[reference][key])
                                   for key in keys}
                            for name, f in figures.items() if name.startswith("hetflow")}
        for name, ratio in result["ratios"].items():
            print(f"{name} / {reference}: end to end {ratio['end_to_end']:.2f}x, steady state "
                  f"{ratio['steady']:.2f}x; in run {ratio['in_run']:.2f}x, steady in run {ratio['steady_in_run']:.2f}x")
    return _finish(result, args, builds[""])


def _finish(result: dict[str, Any], args: argparse.Namespace, env: dict[str, str]) -> int:
    """The ``--saturating`` part, then the JSON file."""
    if args.saturating:
        import saturating  # beside this file

        result["saturating"] = saturating.run(args.saturating, repeats=args.repeats, env=env)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
