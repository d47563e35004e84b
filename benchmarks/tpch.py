"""TPC-H through ``hetflow.operators.sql`` at 2 ranks against DuckDB with 2 threads, in one run.

The 22 queries as published (``tests/operators/_tpch.py``) over ``tpchgen-cli`` data (generated
once into ``--data``, not timed).  DuckDB loads the tables into its own storage first (its best
case); hetflow reads them into DTables first (``read_parquet``, each rank its share).  Each query is
timed ``--repeats`` times after a first run, and the median is reported; hetflow's time is rank 0's
wall clock around ``sql(...)`` plus a barrier (every rank done).  The first run of a query includes
its planning by sqlglot (``hf first``); the repeats reuse the cached plan (same text, same schemas).  Result row counts are checked to
agree.  DataFusion, Daft, Spark and dask-sql are not installed here, so they are not in the table.

    .venv/bin/python benchmarks/tpch.py                     # SF 0.1 and SF 1, 2 ranks
    .venv/bin/python benchmarks/tpch.py --scale 0.1 --queries 1,3,9
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "operators"))

import _tpch


def _time(fn: Any, repeats: int) -> tuple[float, Any, float]:
    """(median of ``repeats`` runs after the first, the result, the first run's seconds)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out, first


def duckdb_times(paths: dict[str, str], queries: list[int], repeats: int) -> dict[int, tuple[float, int]]:
    import duckdb

    con = duckdb.connect(config={"threads": 2})
    for name, p in paths.items():
        con.sql(f"CREATE TABLE {name} AS SELECT * FROM read_parquet('{p}')")
    out = {}
    for n in queries:
        text = _tpch.QUERIES[n]
        seconds, table, _ = _time(lambda: con.sql(text).to_arrow_table(), repeats)  # noqa: B023 - called at once
        out[n] = (seconds, table.num_rows)
    con.close()
    return out


def worker(paths: dict[str, str], queries: list[int], repeats: int, result: str) -> None:
    """Under mpiexec: time every query on the ranks of COMM_WORLD; rank 0 writes ``result``."""
    from hetflow.operators import read_parquet, settings, sql
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    settings.configure(threads=1)
    t0 = time.perf_counter()
    tables = {name: read_parquet(comm, p) for name, p in paths.items()}
    comm.Barrier()
    load = time.perf_counter() - t0
    out: dict[str, Any] = {"load_s": load, "queries": {}}
    for n in queries:
        def run() -> Any:
            table = sql(comm, _tpch.QUERIES[n], **tables)  # noqa: B023 - called at once, in this iteration
            comm.Barrier()
            return table
        seconds, table, first = _time(run, repeats)
        rows = comm.allreduce(table.local_num_rows)
        out["queries"][n] = (seconds, rows, first)
    if comm.Get_rank() == 0:
        Path(result).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, action="append", help="scale factor (repeatable; default 0.1 and 1)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--queries", default="", help="comma-separated query numbers (default all 22)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hetflow-tpch"))
    ap.add_argument("--json", default=str(HERE / "results" / "tpch.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    queries = [int(q) for q in args.queries.split(",") if q] or sorted(_tpch.QUERIES)
    if args.worker:
        spec = json.loads(args.worker)
        worker(spec["paths"], queries, args.repeats, spec["result"])
        return
    report: dict[str, Any] = {}
    for scale in args.scale or [0.1, 1.0]:
        directory = os.path.join(args.data, f"sf{scale:g}")
        os.makedirs(directory, exist_ok=True)
        paths = _tpch.generate(directory, scale)
        duck = duckdb_times(paths, queries, args.repeats)
        result = os.path.join(directory, "hetflow-times.json")
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        spec = json.dumps({"paths": paths, "result": result})
        subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, __file__, "--worker", spec, "--queries",
                        ",".join(map(str, queries)), "--repeats", str(args.repeats)], check=True)
        mine = json.loads(Path(result).read_text())
        rows = []
        print(f"\nTPC-H SF {scale:g}: hetflow sql() at {args.ranks} ranks (1 thread each) vs DuckDB (2 threads); "
              f"median of {args.repeats}, seconds")
        print(f"{'query':>5} {'hetflow':>9} {'duckdb':>9} {'ratio':>7} {'hf first':>9}")
        for n in queries:
            h, hrows, cold = mine["queries"][str(n)]
            d, drows = duck[n]
            if hrows != drows:
                raise SystemExit(f"Q{n} at SF {scale:g}: hetflow gave {hrows} rows, DuckDB {drows}")
            rows.append({"query": n, "hetflow_s": h, "duckdb_s": d, "hetflow_first_s": cold})
            print(f"{n:>5} {h:>9.3f} {d:>9.3f} {h / d:>7.2f} {cold:>9.3f}")
        th, td = sum(r["hetflow_s"] for r in rows), sum(r["duckdb_s"] for r in rows)
        tf = sum(r["hetflow_first_s"] for r in rows)
        geo = math.exp(statistics.mean(math.log(r["hetflow_s"] / r["duckdb_s"]) for r in rows))
        print(f"{'total':>5} {th:>9.3f} {td:>9.3f} {th / td:>7.2f} {tf:>9.3f}   geometric mean of ratios {geo:.2f}; "
              f"hetflow load (read_parquet) {mine['load_s']:.2f} s")
        report[f"sf{scale:g}"] = {"ranks": args.ranks, "repeats": args.repeats, "queries": rows, "total_hetflow_s": th,
                                  "total_duckdb_s": td, "total_hetflow_first_s": tf, "geomean_ratio": geo, "hetflow_load_s": mine["load_s"]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
