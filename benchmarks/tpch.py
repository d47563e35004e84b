"""TPC-H through ``hetflow.operators.sql`` at 2 ranks against DuckDB, DataFusion, Daft, Spark SQL and
dask-sql (2 threads each), in one run.

The 22 queries as published (``tests/operators/_tpch.py``), the same SQL text for every engine, over
``tpchgen-cli`` data (generated once into ``--data``, not timed).  Each engine runs in its own
process, set up once per scale factor (not timed): DuckDB loads the tables into its own storage (its
best case); hetflow reads them into DTables (``read_parquet``, each rank its share) under
``mpiexec``; DataFusion, Daft, Spark and dask-sql register the Parquet files as tables and read
them in every query.  For every query each engine runs once (the first run: hetflow plans it then,
and every engine's result is checked against DuckDB's rows and values), then ``--repeats`` timed
rounds; within a round the engines take turns, in an order that rotates from round to round, so
the shared machine's load falls on all of them alike.  A wrong result is reported as ``wrong``
instead of a time, an error as ``error`` (its message in the JSON), a run past ``--timeout`` as
``timeout`` (the engine is restarted for the next query); an engine whose package is missing is
reported as ``not installed`` and skipped.  Times are each engine's wall clock around running the
query and materializing its result (hetflow: rank 0's, plus a barrier, every rank done).

    .venv/bin/python benchmarks/tpch.py                     # SF 0.1 and SF 1, every engine
    .venv/bin/python benchmarks/tpch.py --scale 0.1 --queries 1,3,9 --engines hetflow,duckdb,spark

Install the peers with ``pip install -c constraints.txt -e '.[bench]'``; Spark needs a Java
runtime (``apt-get install -y default-jre-headless``), see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "operators"))

import _tpch

ENGINES = ("hetflow", "duckdb", "datafusion", "daft", "spark", "dask-sql")
MODULES = {"duckdb": "duckdb", "datafusion": "datafusion", "daft": "daft", "spark": "pyspark", "dask-sql": "dask_sql"}
THREADS = 2


# ---- results, in a form every engine can be compared in ----

def _cell(v: Any) -> Any:
    if v is None or isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float, decimal.Decimal)):
        return float(v)
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()[:10]
    if hasattr(v, "isoformat"):  # pandas Timestamp
        return v.isoformat()[:10]
    return str(v).rstrip()


def normalized(table: Any) -> list[tuple[Any, ...]]:
    """The rows of an Arrow table as tuples of floats, strings and ``None``, sorted (order is not compared)."""
    columns = [[_cell(v) for v in column.to_pylist()] for column in table.columns]
    rows = list(zip(*columns))
    return sorted(rows, key=lambda r: tuple((0, "") if c is None else (1, c) if isinstance(c, float) else (2, c) for c in r))


def same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    if len(a) != len(b):
        return False
    for ra, rb in zip(a, b):
        if len(ra) != len(rb):
            return False
        for x, y in zip(ra, rb):
            if isinstance(x, float) and isinstance(y, float):
                if not math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6):
                    return False
            elif x != y:
                return False
    return True


# ---- the engines, each in a process of its own ----

def _plain_strings(table: Any) -> Any:
    import pyarrow as pa

    schema = pa.schema([f.with_type(pa.large_string()) if f.type == pa.string_view() else f for f in table.schema])
    return table.cast(schema)


def _peer(engine: str, paths: dict[str, str]) -> Callable[[str], Any]:
    """Set ``engine`` up over the Parquet files and return a function from SQL text to an Arrow table."""
    import pyarrow as pa

    if engine == "duckdb":
        import duckdb

        con = duckdb.connect(config={"threads": THREADS})
        for name, p in paths.items():
            con.sql(f"CREATE TABLE {name} AS SELECT * FROM read_parquet('{p}')")
        return lambda text: con.sql(text).to_arrow_table()
    if engine == "datafusion":
        import datafusion

        ctx = datafusion.SessionContext(datafusion.SessionConfig().with_target_partitions(THREADS))
        for name, p in paths.items():
            ctx.register_parquet(name, p)
        return lambda text: ctx.sql(text).to_arrow_table()
    if engine == "daft":
        import logging

        import daft
        import pyarrow.parquet as pq

        logging.getLogger("tracing.span").setLevel(logging.WARNING)

        daft.set_runner_native(num_threads=THREADS)
        # Daft cannot read string_view columns (tpchgen-cli's strings): it gets the tables in memory, as plain strings
        frames = {name: daft.from_arrow(_plain_strings(pq.read_table(p))) for name, p in paths.items()}
        return lambda text: daft.sql(text, **frames).to_arrow()
    if engine == "spark":
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master(f"local[{THREADS}]").appName("hetflow-tpch")
                 .config("spark.driver.memory", "4g").config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        for name, p in paths.items():
            spark.read.parquet(p).createOrReplaceTempView(name)
        return lambda text: spark.sql(text).toArrow()
    if engine == "dask-sql":
        import dask
        from dask_sql import Context

        dask.config.set(scheduler="threads", num_workers=THREADS)
        c = Context()
        for name, p in paths.items():
            c.create_table(name, p, format="parquet")
        c.sql("select count(*) from nation").compute()  # fail here, not in every query, where it cannot run
        return lambda text: pa.Table.from_pandas(c.sql(text).compute(), preserve_index=False)
    raise ValueError(engine)


def _serve(conn: Connection, run: Callable[[int], tuple[float, int, Any]]) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            seconds, rows, values = run(msg["query"], msg["check"])
            conn.send({"s": seconds, "rows": rows, "values": values})
        except Exception as e:  # noqa: BLE001 - an engine's failure on one query is a result
            conn.send({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]})


def peer_main(engine: str, paths: dict[str, str], address: str, key: bytes) -> None:
    conn = Client(address, authkey=key)
    try:
        __import__(MODULES[engine])
    except ImportError:
        conn.send({"missing": True})
        return
    try:
        run_text = _peer(engine, paths)
    except Exception as e:  # noqa: BLE001
        conn.send({"error": f"setup: {type(e).__name__}: {e}"[:300]})
        return
    conn.send({"ready": True})

    def run(n: int, check: bool) -> tuple[float, int, Any]:
        t0 = time.perf_counter()
        table = run_text(_tpch.QUERIES[n])
        seconds = time.perf_counter() - t0
        return seconds, table.num_rows, normalized(table) if check else None

    _serve(conn, run)


def hetflow_main(paths: dict[str, str], address: str, key: bytes) -> None:
    """Under mpiexec: rank 0 takes the driver's requests and the ranks run them together."""
    from hetflow.operators import read_parquet, settings, sql
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    settings.configure(threads=1)
    tables = {name: read_parquet(comm, p) for name, p in paths.items()}
    comm.Barrier()
    conn = Client(address, authkey=key) if rank == 0 else None
    if conn is not None:
        conn.send({"ready": True})
    while True:
        msg = conn.recv() if conn is not None else None
        req = comm.Ibarrier()  # wait without spinning a core while the other engines run
        while not req.Test():
            time.sleep(0.002)
        msg = comm.bcast(msg)
        if msg is None:
            return
        try:
            t0 = time.perf_counter()
            table = sql(comm, _tpch.QUERIES[msg["query"]], **tables)
            comm.Barrier()
            seconds = time.perf_counter() - t0
            rows = comm.allreduce(table.local_num_rows)
            whole = table.gather() if msg["check"] else None
            reply = {"s": seconds, "rows": rows, "values": normalized(whole) if whole is not None else None}
        except Exception as e:  # noqa: BLE001 - would leave the ranks apart; report and stop
            reply = {"error": f"{type(e).__name__}: {e}"[:300]}
            traceback.print_exc()
            if conn is not None:
                conn.send(reply)
            comm.Abort(1)
        if conn is not None:
            conn.send(reply)


class Engine:
    """The driver's side of one engine's process."""

    def __init__(self, name: str, paths: dict[str, str], ranks: int, listener: Listener, key: bytes, spec: str):
        self.name, self.conn, self.state = name, None, "starting"
        args = ["--serve", name, "--spec", spec]
        if name == "hetflow":
            mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
            argv = [mpiexec, "-n", str(ranks), sys.executable, __file__, *args]
        else:
            argv = [sys.executable, __file__, *args]
        self.proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        t0 = time.perf_counter()
        self.conn = listener.accept()
        first = self.conn.recv() if self.conn.poll(600) else {"error": "setup: no answer in 600 s"}
        self.setup_s = time.perf_counter() - t0
        self.state = "not installed" if "missing" in first else first.get("error") or "ready"

    def ask(self, query: int, check: bool, timeout: float) -> dict[str, Any]:
        try:
            self.conn.send({"query": query, "check": check})
        except OSError:
            self.close(kill=True)
            self.state = "crashed"
            return {"error": "crashed"}
        if not self.conn.poll(timeout):
            self.close(kill=True)
            self.state = "timeout"
            return {"error": "timeout"}
        try:
            reply = self.conn.recv()
        except EOFError:
            reply = {"error": "crashed"}
        if "error" in reply and (self.name == "hetflow" or reply["error"] == "crashed"):  # its ranks stopped
            self.close(kill=True)
            self.state = "crashed"
        return reply

    def close(self, kill: bool = False) -> None:
        if self.conn is not None and not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=None if not kill else 0.1)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def run_scale(scale: float, args: argparse.Namespace, queries: list[int], engines: list[str]) -> dict[str, Any]:
    directory = os.path.join(args.data, f"sf{scale:g}")
    os.makedirs(directory, exist_ok=True)
    paths = _tpch.generate(directory, scale)
    key = secrets.token_bytes(16)
    sockdir = tempfile.mkdtemp(prefix="hetflow-tpch-")
    address = os.path.join(sockdir, "driver")
    listener = Listener(address, family="AF_UNIX", authkey=key)
    spec = json.dumps({"paths": paths, "address": address, "key": key.hex()})

    def start(name: str) -> Engine:
        e = Engine(name, paths, args.ranks, listener, key, spec)
        print(f"  {name}: {e.state} (setup {e.setup_s:.1f} s)", flush=True)
        return e

    print(f"\nTPC-H SF {scale:g}: starting the engines", flush=True)
    live = {name: start(name) for name in engines}
    status = {name: e.state for name, e in live.items()}
    setup = {name: e.setup_s for name, e in live.items()}
    results: dict[str, dict[int, Any]] = {name: {} for name in engines}
    for n in queries:
        ready = [name for name in engines if live.get(name) is not None and live[name].state == "ready"]
        expected = None
        for rnd in range(args.repeats + 1):
            order = ready[rnd % len(ready):] + ready[:rnd % len(ready)] if ready else []
            for name in order:
                e = live[name]
                if e.state != "ready" or isinstance(results[name].get(n), str):
                    continue
                reply = e.ask(n, rnd == 0, args.timeout)
                if "error" in reply:
                    results[name][n] = "timeout" if reply["error"] == "timeout" else "error"
                    results[name].setdefault("errors", {})[n] = reply["error"]
                    continue
                if rnd == 0:
                    results[name][n] = {"first_s": reply["s"], "rows": reply["rows"], "values": reply["values"], "s": []}
                else:
                    results[name][n]["s"].append(reply["s"])
        if "duckdb" in results and isinstance(results["duckdb"].get(n), dict):
            expected = results["duckdb"][n]["values"]
        line = [f"Q{n:<3}"]
        for name in engines:
            r = results[name].get(n)
            if isinstance(r, dict):
                if expected is not None and name != "duckdb" and not same(r["values"], expected):
                    results[name][n] = "wrong"
                    results[name].setdefault("errors", {})[n] = f"{r['rows']} rows, DuckDB {len(expected)}; values differ"
                    line.append(f"{name} wrong")
                else:
                    r["median_s"] = statistics.median(r["s"])
                    del r["values"]
                    line.append(f"{name} {r['median_s']:.3f}")
            elif r is not None:
                line.append(f"{name} {r}")
        print("  " + "  ".join(line), flush=True)
        for name in engines:  # restart what died on this query
            if live.get(name) is not None and live[name].state in ("timeout", "crashed"):
                live[name] = start(name)
    for e in live.values():
        if e.state == "ready":
            e.close()
        else:
            e.close(kill=True)
    listener.close()
    return {"status": status, "setup_s": setup, "results": results}


def summarize(scale: float, report: dict[str, Any], engines: list[str], queries: list[int]) -> dict[str, Any]:
    res = report["results"]

    def t(name: str, n: int) -> float | None:
        r = res[name].get(n)
        return r["median_s"] if isinstance(r, dict) else None

    summary = {}
    print(f"\nTPC-H SF {scale:g}, medians (s); ratio = engine / DuckDB; hetflow wins = queries hetflow is faster on")
    print(f"{'engine':>10} {'total':>9} {'ok':>4} {'geomean':>8} {'hf wins':>8}   missing")
    for name in engines:
        if report["status"][name] != "ready":
            print(f"{name:>10}   {report['status'][name]}")
            summary[name] = report["status"][name]
            continue
        ok = [n for n in queries if t(name, n) is not None]
        total = sum(t(name, n) for n in ok)  # type: ignore[misc]
        both = [n for n in ok if t("duckdb", n) is not None] if "duckdb" in res else []
        geo = math.exp(statistics.mean(math.log(t(name, n) / t("duckdb", n)) for n in both)) if both else None  # type: ignore[operator]
        wins = sum(1 for n in ok if t("hetflow", n) is not None and t("hetflow", n) < t(name, n)) if "hetflow" in res else None  # type: ignore[operator]
        missing = {n: res[name].get(n, report["status"][name]) for n in queries if n not in ok}
        summary[name] = {"total_s": total, "queries_ok": len(ok), "geomean_ratio_to_duckdb": geo, "hetflow_faster_on": wins,
                         "not_timed": missing}
        print(f"{name:>10} {total:>9.3f} {len(ok):>4} {geo if geo is not None else float('nan'):>8.2f} "
              f"{wins if name != 'hetflow' and wins is not None else '':>8}   {' '.join(f'Q{n}:{v}' for n, v in missing.items())}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, action="append", help="scale factor (repeatable; default 0.1 and 1)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    ap.add_argument("--queries", default="", help="comma-separated query numbers (default all 22)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds one engine may take for one query")
    ap.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hetflow-tpch"))
    ap.add_argument("--json", default=str(HERE / "results" / "tpch.json"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        spec = json.loads(args.spec)
        serve = hetflow_main if args.serve == "hetflow" else lambda *a: peer_main(args.serve, *a)
        serve(spec["paths"], spec["address"], bytes.fromhex(spec["key"]))
        return
    queries = [int(q) for q in args.queries.split(",") if q] or sorted(_tpch.QUERIES)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(unknown)}; expected some of {','.join(ENGINES)}")
    report: dict[str, Any] = {"engines": engines, "ranks": args.ranks, "threads": THREADS, "repeats": args.repeats}
    for scale in args.scale or [0.1, 1.0]:
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        load = os.getloadavg()
        r = run_scale(scale, args, queries, engines)
        r["summary"] = summarize(scale, r, engines, queries)
        r["started"], r["load_at_start"], r["load_at_end"] = started, load, os.getloadavg()
        report[f"sf{scale:g}"] = r
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
