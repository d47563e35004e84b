"""Cylon-workload benchmark: hetflow operators vs Dask and single-process engines.

Two int64 columns per table (``k``, ``v``), uniform random keys over
``[0, 4.5 * rows)`` so that ~90% of the keys are unique.  For join (inner, on
``k``), sort (by ``k``) and group-by-sum (``v`` by ``k``) it times, in one run:

* hetflow at 1 and 2 ranks (``mpiexec -n P``, one kernel thread per rank);
* dask.dataframe on ``LocalCluster(n_workers=2, threads_per_worker=1)``;
* Bodo (SPMD under ``mpiexec -n 2``) and Modin on unidist's MPI engine (2 workers), in their own
  environment (``benchmarks/peers-env.sh``; ``--peers-python``), see ``benchmarks/peers_mpi.py``;
* DuckDB, polars and pyarrow in one process with 2 threads.

Every engine sees the same rows (two seeded chunks per table), and the result
row counts are checked to agree.  Medians of ``--repeats`` runs; data
generation is not timed.  Prints a table of seconds and ratios and writes JSON
(default ``benchmarks/results/operators.json``).

Memory, per hetflow rank at 2 ranks (the larger of the two ranks): the peak
resident set (``VmHWM``) is reset after the input partition is generated, so
the window covers only the timed operator calls.  ``grow/part`` is (peak RSS
in that window - RSS just before it) / input partition bytes (both tables for
join); ``peak/part`` is the absolute peak RSS / input partition bytes, which
also counts the input itself and the interpreter with its libraries (about
0.2 GB: Python, pyarrow, numpy, DuckDB, polars, MPI).

    .venv/bin/python benchmarks/operators.py                 # the issue's 20M rows per table
    .venv/bin/python benchmarks/operators.py --rows 2000000  # quick check
    .venv/bin/python benchmarks/operators.py --phases        # where the time goes inside hetflow, and the
                                                             # cost model's estimates against it (1/2/3 ranks)
    benchmarks/peers-env.sh && .venv/bin/python benchmarks/operators.py   # with Bodo and Modin-on-MPI
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
OPS = ("join", "sort", "groupby")
CHUNKS = 2  # tables are made of this many seeded chunks, so 1 and 2 ranks see the same rows
PHASE_CHUNKS = 6  # ... for ``--phases``, which also runs 3 ranks
MARK = "BENCH_RESULT "


def make_chunk(table_id: int, chunk: int, rows: int, chunks: int = CHUNKS) -> Any:
    import numpy as np
    import pyarrow as pa

    n = rows // chunks + (1 if chunk < rows % chunks else 0)
    rng = np.random.default_rng([table_id, chunk, rows] if chunks == CHUNKS else [table_id, chunk, rows, chunks])
    return pa.table({"k": rng.integers(0, int(rows * 4.5), n), "v": rng.integers(0, 1 << 40, n)})


def make_table(table_id: int, rows: int, chunks: range | list[int] | None = None, of: int = CHUNKS) -> Any:
    """Chunks ``chunks`` (default all) of ``of`` chunks of table ``table_id``."""
    import pyarrow as pa

    return pa.concat_tables([make_chunk(table_id, c, rows, of) for c in (chunks if chunks is not None else range(of))]).combine_chunks()


def peak_rss_bytes() -> int:
    """Peak resident set of this process: ``VmHWM`` (since the last ``reset_peak_rss``), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux ``clear_refs`` 5), so that generating the input does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# --------------------------------------------------------------------------- hetflow worker (one per rank)


def hetflow_worker(op: str, rows: int, repeats: int) -> None:
    from mpi4py import MPI

    from hetflow.operators import DTable
    from hetflow.operators.costmodel import hockney

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = [c for c in range(CHUNKS) if c % size == rank]
    left = DTable(comm, make_table(1, rows, mine))
    right = DTable(comm, make_table(2, rows, mine)) if op == "join" else None
    input_bytes = left.to_arrow().nbytes + (right.to_arrow().nbytes if right is not None else 0)
    hockney(comm)  # measured (or read from the cache) before timing
    reset = reset_peak_rss()
    rss_before = current_rss_bytes()
    times, out_rows, explain = [], 0, ""
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        if op == "join":
            assert right is not None
            res = left.join(right, "k")
        elif op == "sort":
            res = left.sort_by("k")
        else:
            res = left.group_by("k").aggregate([("v", "sum")])
        comm.Barrier()
        times.append(time.perf_counter() - t0)
        out_rows = res.num_rows
        explain = res.explain()
        del res
    peaks = comm.gather({"peak_rss": peak_rss_bytes(), "rss_before": rss_before, "input_bytes": input_bytes,
                         "peak_window_reset": reset}, root=0)
    if rank == 0:
        print(MARK + json.dumps({"times": times, "rows_out": out_rows, "ranks": peaks, "explain": explain}), flush=True)


def phase_worker(rows: int, repeats: int) -> None:
    """Wall/CPU seconds of the steps inside the operators as they run them (rank 0, median; a barrier
    before each step, so CPU inside a collective includes MPI's busy-waiting).  At 1 rank the join
    and group-by are one local kernel call; the bucketed join's exchange and kernel are summed over
    its buckets."""
    from mpi4py import MPI

    from hetflow.operators import aggregate, hashjoin, kernels, sorting
    from hetflow.operators import collectives as tc

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = [c for c in range(PHASE_CHUNKS) if c % size == rank]
    left, right = make_table(1, rows, mine, PHASE_CHUNKS), make_table(2, rows, mine, PHASE_CHUNKS)
    seen: dict[str, list[tuple[float, float]]] = {}

    def step(name: str, fn: Callable[[], Any], barrier: bool = True) -> Any:
        if barrier:
            comm.Barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        seen.setdefault(name, []).append((time.perf_counter() - w0, time.process_time() - c0))
        return out

    def total(name: str, n: int) -> None:  # fold the last n entries of a per-bucket step into one
        vals = seen[name][-n:]
        del seen[name][-n:]
        seen[name].append((sum(w for w, _ in vals), sum(c for _, c in vals)))

    for _ in range(repeats):
        if size == 1:
            step("join: local kernel (DuckDB, not bucketed)", lambda: kernels.join(left, right, ["k"], ["k"], "inner", "_right"))
            step("group-by: local kernel (numpy packed sort + reduceat)", lambda: kernels.group_aggregate(left, ["k"], [("v", "sum")]))
            step("sort: local kernel (numpy packed sort + take)", lambda: kernels.sort(left, [("k", "ascending")], "at_end"))
        else:
            buckets = hashjoin.bucket_count(-(-rows // size))
            lp = step("join: hash + permute columns by (rank, bucket), left", lambda: hashjoin._permute(comm, left, ["k"], buckets))
            rp = step("join: hash + permute columns by (rank, bucket), right", lambda: hashjoin._permute(comm, right, ["k"], buckets))
            for b in range(buckets):
                lt, rt = step("join: exchange, all buckets (Alltoallv per column and bucket)", lambda: (
                    hashjoin._exchange_buckets(comm, left.schema, *lp, b, b + 1)[0],
                    hashjoin._exchange_buckets(comm, right.schema, *rp, b, b + 1)[0]))
                step("join: local kernel, all buckets (DuckDB)", lambda: kernels.join(lt, rt, ["k"], ["k"], "inner", "_right"), barrier=False)
            total("join: exchange, all buckets (Alltoallv per column and bucket)", buckets)
            total("join: local kernel, all buckets (DuckDB)", buckets)
            del lp, rp, lt, rt
            keys = left.column("k").to_numpy()
            step("group-by: groups from every 8th key", lambda: aggregate._groups_from_sample(keys))
            ids = step("group-by: range splitters + ids", lambda: sorting.range_ids(comm, keys, split_ties=False))
            g = step("group-by: shuffle", lambda: tc.shuffle(comm, left, ids))
            step("group-by: local kernel (numpy packed sort + reduceat)", lambda: kernels.group_aggregate(g, ["k"], [("v", "sum")]))
            del g, ids
        step("sort: whole (samples, ids, shuffle, local packed sort)", lambda: sorting.sample_sort(comm, left, [("k", "ascending")], "at_end"))
    if rank == 0:
        print(f"{size} rank(s), {rows:,} rows per table, median of {repeats}; wall / CPU seconds on rank 0")
        for name, vals in seen.items():
            print(f"| {name} | {statistics.median(w for w, _ in vals):.3f} / {statistics.median(c for _, c in vals):.3f} |")
        if size == 1:  # what the cost model's kernel rates are calibrated from: the least disturbed CPU time
            from hetflow.operators import costmodel

            print("\nlocal kernel CPU seconds per input byte (1 rank, fastest of the repeats) against the model's constants:")
            for label, name, nbytes, const in (
                    ("join", "join: local kernel (DuckDB, not bucketed)", left.nbytes + right.nbytes, costmodel.JOIN_SECONDS_PER_BYTE),
                    ("sort", "sort: local kernel (numpy packed sort + take)", left.nbytes, costmodel.SORT_SECONDS_PER_BYTE),
                    ("group-by", "group-by: local kernel (numpy packed sort + reduceat)", left.nbytes, costmodel.GROUPBY_SECONDS_PER_BYTE)):
                cpu = min(c for _, c in seen[name])
                print(f"| {label} | {cpu / nbytes * 1e9:.2f} ns/B | model {const * 1e9:.2f} ns/B |")
    model_worker(comm, left, right, repeats)


def model_worker(comm: Any, left: Any, right: Any, repeats: int) -> None:
    """The cost model against the measurement: each operator runs through ``DTable`` on a
    ``MeteredComm``; its plan's estimate is set beside the bytes the exchanges sent (all ranks),
    the seconds inside the calls that move table data (``DATA_CALLS``: the slowest rank's, waiting
    for the others included; the count exchanges and object collectives before them take most of
    the waiting), the rest of the operator's wall time, and the whole (medians of ``repeats``)."""
    from hetflow.operators import DTable
    from hetflow.operators.costmodel import hockney
    from hetflow.operators.metered import MeteredComm

    metered = MeteredComm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    hockney(metered)
    lt, rt = DTable(metered, left), DTable(metered, right)
    runs: dict[str, Callable[[], Any]] = {
        "join": lambda: lt.join(rt, "k"), "sort": lambda: lt.sort_by("k"),
        "groupby": lambda: lt.group_by("k").aggregate([("v", "sum")])}
    rows = []
    for op, run in runs.items():
        seen = []
        for _ in range(repeats):
            comm.Barrier()
            metered.meter.reset()
            t0 = time.perf_counter()
            plan = run().plans[-1]
            wall = comm.allreduce(time.perf_counter() - t0, op=max_op())
            sent = comm.allreduce(metered.meter.total_sent)
            inside = comm.allreduce(sum(metered.meter.seconds.get(c, 0.0) for c in DATA_CALLS), op=max_op())
            seen.append((plan, sent, inside, wall))
        plan = seen[-1][0]
        sent, inside, wall = (statistics.median(x[i] for x in seen) for i in (1, 2, 3))
        rows.append((op, plan, sent, inside, wall))
    described = hockney(metered).describe()  # collective
    if rank == 0:
        print(f"\ncost model vs measured, {size} rank(s); {described}")
        print("| op | algorithm | est. exchange MB | sent MB | est/sent | est. exchange s | in data calls s | est/meas "
              "| est. local s | rest of wall s | est/meas | est. total s | wall s | est/wall |")
        print("|" + "---|" * 14)

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}" if b > 0 else ("-" if a == 0 else "inf")
        for op, plan, sent, inside, wall in rows:
            c = plan.cost
            rest = wall - inside
            print(f"| {op} | {plan.algorithm} | {c.exchange_bytes / 1e6:.1f} | {sent / 1e6:.1f} | {ratio(c.exchange_bytes, sent)} "
                  f"| {c.exchange_s:.3f} | {inside:.3f} | {ratio(c.exchange_s, inside)} | {c.compute_s:.3f} | {rest:.3f} "
                  f"| {ratio(c.compute_s, rest)} | {c.seconds:.3f} | {wall:.3f} | {ratio(c.seconds, wall)} |")


#: the MeteredComm calls that carry table data (not counts, metadata or the Hockney ping-pong's small messages)
DATA_CALLS = ("Alltoallv", "Allgatherv", "Gatherv", "Bcast", "Sendrecv")


def max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def run_hetflow(op: str, rows: int, repeats: int, ranks: int) -> dict[str, Any]:
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    env = {**os.environ, "HETFLOW_OPERATOR_THREADS": "1", "POLARS_MAX_THREADS": "1", "OMP_NUM_THREADS": "1"}
    argv = [mpiexec, "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
            "--worker", op, "--rows", str(rows), "--repeats", str(repeats)]
    return _collect(argv, env)


def _collect(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK):]))
    raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# --------------------------------------------------------------------------- single-process engines (2 threads)


def engine_worker(engine: str, op: str, rows: int, repeats: int, threads: int) -> None:
    os.environ["POLARS_MAX_THREADS"] = str(threads)
    import pyarrow as pa

    pa.set_cpu_count(threads)
    a = make_table(1, rows)
    b = make_table(2, rows) if op == "join" else None
    fn: Callable[[], Any]
    if engine == "duckdb":
        import duckdb

        con = duckdb.connect()
        con.execute(f"SET threads={threads}")
        con.register("a", a)
        if b is not None:
            con.register("b", b)
        sql = {"join": "SELECT a.k, a.v, b.v AS v_right FROM a JOIN b ON a.k = b.k",
               "sort": "SELECT * FROM a ORDER BY k", "groupby": "SELECT k, sum(v) AS v_sum FROM a GROUP BY k"}[op]
        fn = lambda: con.sql(sql).to_arrow_table()  # noqa: E731
    elif engine == "polars":
        import polars as pl

        da, db = pl.from_arrow(a), (pl.from_arrow(b) if b is not None else None)
        fn = {"join": lambda: da.join(db, on="k"), "sort": lambda: da.sort("k"),
              "groupby": lambda: da.group_by("k").agg(pl.col("v").sum())}[op]
    elif engine == "pyarrow":
        fn = {"join": lambda: a.join(b, "k", right_suffix="_right"), "sort": lambda: a.sort_by("k"),
              "groupby": lambda: a.group_by("k").aggregate([("v", "sum")])}[op]
    else:
        raise SystemExit(f"unknown engine {engine!r} (known: duckdb, polars, pyarrow)")
    times, out_rows = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
        out_rows = len(res) if not hasattr(res, "num_rows") else res.num_rows
        del res
    print(MARK + json.dumps({"times": times, "rows_out": out_rows, "peak_rss": peak_rss_bytes()}), flush=True)


def run_engine(engine: str, op: str, rows: int, repeats: int, threads: int) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine", engine, op, "--rows", str(rows),
            "--repeats", str(repeats), "--threads", str(threads)]
    return _collect(argv, dict(os.environ))


# --------------------------------------------------------------------------- Bodo and Modin (their own Python)

PEERS_PYTHON = HERE / ".peers-venv" / "bin" / "python"


def run_peer(engine: str, op: str, rows: int, repeats: int, python: Path) -> dict[str, Any]:
    """``peers_mpi.py`` under the peers' ``mpiexec``: Bodo on 2 ranks, Modin with 2 unidist workers."""
    mpiexec = str(python.with_name("mpiexec"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "BODO_NUM_WORKERS": "2"}
    if engine == "modin":  # unidist's root and monitor, then the workers, all started by mpiexec
        env.update(UNIDIST_IS_MPI_SPAWN_WORKERS="False", MODIN_CPUS="2")
        procs = 4
    else:
        procs = 2
    argv = [mpiexec, "-n", str(procs), str(python), str(HERE / "peers_mpi.py"), engine, op, "--rows", str(rows),
            "--repeats", str(repeats)]
    return _collect_then_end(argv, env)


def _collect_then_end(argv: list[str], env: dict[str, str], linger: float = 15.0) -> dict[str, Any]:
    """Like :func:`_collect`, but ends the process group ``linger`` seconds after the result line.

    unidist's MPI shutdown can leave ``mpiexec`` waiting forever once the result is printed (seen
    when started from Python), and a benchmark must not hang on a peer's exit.
    """
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            seen_at = None
            while proc.poll() is None:
                time.sleep(0.5)
                if seen_at is None:
                    out.seek(0)
                    if MARK in out.read():
                        seen_at = time.monotonic()
                elif time.monotonic() - seen_at > linger:
                    break
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is not None:
                    break
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        text = out.read()
    for line in text.splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK):]))
    raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{text[-4000:]}")


# --------------------------------------------------------------------------- dask


def run_dask(ops: list[str], rows: int, repeats: int) -> dict[str, dict[str, Any]]:
    import dask
    import dask.dataframe as dd
    from dask.distributed import Client, LocalCluster, wait

    out: dict[str, dict[str, Any]] = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        def frame(table_id: int) -> Any:
            def part(chunk: int) -> Any:
                return make_chunk(table_id, chunk, rows).to_pandas()
            return dd.from_map(part, list(range(CHUNKS))).persist()
        a = frame(1)
        wait(a)
        b = frame(2) if "join" in ops else None
        if b is not None:
            wait(b)
        for op in ops:
            times, out_rows = [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                if op == "join":
                    res = a.merge(b, on="k", suffixes=("", "_right")).persist()
                elif op == "sort":
                    res = a.sort_values("k").persist()
                else:
                    res = a.groupby("k").v.sum(split_out=True).persist()
                wait(res)
                times.append(time.perf_counter() - t0)
                out_rows = int(res.map_partitions(len).compute().sum())
                del res
            out[op] = {"times": times, "rows_out": out_rows, "dask": dask.__version__}
    return out


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000_000, help="rows per table (default 20M, the issue's size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    ap.add_argument("--ranks", default=None, help="hetflow rank counts (default 1,2; with --phases 1,2,3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the single-process engines")
    ap.add_argument("--engines", default="duckdb,polars,pyarrow")
    ap.add_argument("--no-dask", action="store_true")
    ap.add_argument("--peers", default="bodo,modin", help="MPI dataframe peers run under --peers-python ('' for none)")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PYTHON,
                    help="the Python of the peers' environment (benchmarks/peers-env.sh makes the default one)")
    ap.add_argument("--out", default=str(HERE / "results" / "operators.json"))
    ap.add_argument("--phases", action="store_true", help="time the steps inside the hetflow operators instead (per rank count)")
    ap.add_argument("--worker", choices=OPS + ("phases",), help=argparse.SUPPRESS)
    ap.add_argument("--engine", nargs=2, metavar=("ENGINE", "OP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "phases":
        phase_worker(args.rows, args.repeats)
        return 0
    if args.worker:
        hetflow_worker(args.worker, args.rows, args.repeats)
        return 0
    if args.engine:
        engine_worker(args.engine[0], args.engine[1], args.rows, args.repeats, args.threads)
        return 0

    ops = [o for o in args.ops.split(",") if o]
    ranks = [int(r) for r in (args.ranks or ("1,2,3" if args.phases else "1,2")).split(",") if r]
    if args.phases:
        mpiexec = str(Path(sys.executable).with_name("mpiexec"))
        env = {**os.environ, "HETFLOW_OPERATOR_THREADS": "1", "POLARS_MAX_THREADS": "1", "OMP_NUM_THREADS": "1"}
        print(f"load average {os.getloadavg()[0]:.2f}")
        for p in ranks:
            argv = [mpiexec, "-n", str(p), sys.executable, str(Path(__file__).resolve()),
                    "--worker", "phases", "--rows", str(args.rows), "--repeats", str(args.repeats)]
            subprocess.run(argv, env=env, check=True)
        return 0
    engines = [e for e in args.engines.split(",") if e]
    peers = [e for e in args.peers.split(",") if e]
    if peers and not args.peers_python.exists():
        print(f"no peers' Python at {args.peers_python} (run benchmarks/peers-env.sh): {', '.join(peers)} not run",
              file=sys.stderr)
        peers = []
    load_before = os.getloadavg()
    results: dict[str, Any] = {"rows_per_table": args.rows, "repeats": args.repeats, "host": platform.node(),
                               "cpus": os.cpu_count(), "loadavg_before": load_before, "ops": {}}
    for op in ops:
        entry: dict[str, Any] = {}
        for p in ranks:
            print(f"[{op}] hetflow {p} rank(s) ...", file=sys.stderr, flush=True)
            entry[f"hetflow_{p}"] = run_hetflow(op, args.rows, args.repeats, p)
        for e in engines:
            print(f"[{op}] {e} ({args.threads} threads) ...", file=sys.stderr, flush=True)
            entry[e] = run_engine(e, op, args.rows, args.repeats, args.threads)
        for peer in peers:
            print(f"[{op}] {peer} (2 ranks/workers, {args.peers_python}) ...", file=sys.stderr, flush=True)
            entry[peer] = run_peer(peer, op, args.rows, args.repeats, args.peers_python)
        results["ops"][op] = entry
    if not args.no_dask:
        print(f"[{','.join(ops)}] dask LocalCluster(2 workers x 1 thread) ...", file=sys.stderr, flush=True)
        for op, r in run_dask(ops, args.rows, args.repeats).items():
            results["ops"][op]["dask"] = r
    results["loadavg_after"] = os.getloadavg()
    summarise(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


def summarise(results: dict[str, Any]) -> None:
    rows = results["rows_per_table"]
    print(f"\n{rows:,} rows per table, median of {results['repeats']} (seconds); load before {results['loadavg_before'][0]:.2f}")
    header = ["op", "hetflow 1r", "hetflow 2r", "dask 2w", "bodo 2r", "modin 2w", "duckdb", "polars", "pyarrow",
              "peers/het2", "het2/duckdb", "het2/best", "1r/2r", "grow/part", "peak/part"]
    print(" | ".join(f"{h:>10}" for h in header))
    for op, entry in results["ops"].items():
        med = {k: statistics.median(v["times"]) for k, v in entry.items()}
        for k, v in entry.items():
            v["median_s"] = med[k]
        counts = {k: v["rows_out"] for k, v in entry.items() if k != "pyarrow"}
        agree = len(set(counts.values())) == 1
        singles = [med[e] for e in ("duckdb", "polars", "pyarrow") if e in med]
        h1, h2 = med.get("hetflow_1"), med.get("hetflow_2")
        distributed = [p for p in ("dask", "bodo", "modin") if p in med]
        peak = absolute = None
        if "hetflow_2" in entry:
            ranks = entry["hetflow_2"]["ranks"]
            peak = max((r["peak_rss"] - r["rss_before"]) / max(r["input_bytes"], 1) for r in ranks)
            absolute = max(r["peak_rss"] / max(r["input_bytes"], 1) for r in ranks)
        entry["summary"] = {
            "row_counts_agree": agree, "row_counts": {k: v["rows_out"] for k, v in entry.items() if "rows_out" in v},
            "dask_over_hetflow2": (med["dask"] / h2) if h2 and "dask" in med else None,
            "fastest_distributed_peer_over_hetflow2": (min(med[p] for p in distributed) / h2) if h2 and distributed else None,
            "hetflow2_over_duckdb": (h2 / med["duckdb"]) if h2 and "duckdb" in med else None,
            "hetflow2_over_best_single": (h2 / min(singles)) if h2 and singles else None,
            "speedup_2_over_1": (h1 / h2) if h1 and h2 else None,
            "peak_rss_growth_over_partition_2r": peak,
            "peak_rss_over_partition_2r": absolute,
        }
        s = entry["summary"]

        def f(x: float | None, suffix: str = "") -> str:
            return "-" if x is None else f"{x:.2f}{suffix}"
        cells = [op, f(h1), f(h2), f(med.get("dask")), f(med.get("bodo")), f(med.get("modin")), f(med.get("duckdb")),
                 f(med.get("polars")), f(med.get("pyarrow")), f(s["fastest_distributed_peer_over_hetflow2"], "x"),
                 f(s["hetflow2_over_duckdb"], "x"), f(s["hetflow2_over_best_single"], "x"), f(s["speedup_2_over_1"], "x"),
                 f(peak, "x"), f(absolute, "x")]
        print(" | ".join(f"{c:>10}" for c in cells) + ("" if agree else f"   ROW COUNTS DIFFER {s['row_counts']}"))


if __name__ == "__main__":
    sys.exit(main())
