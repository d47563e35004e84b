"""Out-of-core operators: peak memory against the budget, and the cost of spilling.

For join (inner on ``k``), sort (by ``k``) and group-by (sum, count and mean
of ``v`` by ``g``, a quarter as many groups as rows) it writes inputs of
``--factor`` x ``--budget`` bytes per rank as Arrow IPC files (in a separate
process), then runs each operator in fresh ``mpiexec -n P`` processes:

* ``spill``: ``scan_ipc(...).join / sort_by / group_by().aggregate`` with
  ``memory_budget=--budget`` (output written as a dataset);
* ``memory`` (with ``--memory``): the in-memory ``DTable`` operator on the
  same files (``read_ipc``), for the time ratio, where the machine has room.

Peak memory per rank: ``ru_maxrss`` after the operator minus ``ru_maxrss``
just before it (after the imports, DuckDB and polars loaded and the inputs
opened): the operator's working memory above the process's baseline, which is
what the budget bounds.  The baseline is printed too.  Results are checked
against DuckDB reading the same files (row count and a checksum of the key
and value columns).

    .venv/bin/python benchmarks/spill.py --budget 512 --factor 4 --ranks 1,2 --memory
    .venv/bin/python benchmarks/spill.py --budget 64 --ranks 2            # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPS = ("join", "sort", "groupby")
MARK = "SPILL_RESULT "
ROW_BYTES = 16  # two 8-byte columns per table
SLICE = 1 << 16


def _write(path: Path, table: Any) -> None:
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=SLICE)


def generate(directory: Path, op: str, input_bytes_per_rank: int, ranks: int, seed: int = 7) -> dict[str, Any]:
    """Input files for ``op``: ``input_bytes_per_rank`` bytes per rank in all (both sides of a join),
    written one file per rank and table; returns the input directories and row counts."""
    import numpy as np
    import pyarrow as pa

    rows = input_bytes_per_rank // ROW_BYTES
    out: dict[str, Any] = {"rows_per_rank": rows}
    if op == "join":  # left 60 %, right 40 %; right keys unique, every left key matches one right row
        nl, nr = rows * 3 // 5, rows * 2 // 5
        tables = {"left": [], "right": []}  # type: dict[str, list[Path]]
        for r in range(ranks):
            rng = np.random.default_rng([seed, r])
            left = pa.table({"k": rng.integers(0, nr * ranks, nl), "v": rng.integers(0, 1 << 40, nl)})
            right = pa.table({"k": np.arange(r * nr, (r + 1) * nr, dtype=np.int64)[rng.permutation(nr)],
                              "w": rng.integers(0, 1 << 40, nr)})
            for name, t in (("left", left), ("right", right)):
                (directory / name).mkdir(parents=True, exist_ok=True)
                path = directory / name / f"part-{r:05d}.arrow"
                _write(path, t)
                tables[name].append(path)
        out.update({"left": str(directory / "left"), "right": str(directory / "right")})
    else:
        (directory / "input").mkdir(parents=True, exist_ok=True)
        for r in range(ranks):
            rng = np.random.default_rng([seed, r])
            if op == "sort":
                t = pa.table({"k": rng.integers(0, 1 << 62, rows), "v": rng.random(rows)})
            else:
                t = pa.table({"g": rng.integers(0, max(1, rows * ranks // 4), rows), "v": rng.random(rows)})
            _write(directory / "input" / f"part-{r:05d}.arrow", t)
        out["input"] = str(directory / "input")
    return out


def _warm() -> None:
    """Load what the operators load on first use, so it counts as baseline, not as the operator's memory."""
    import numpy as np
    import pyarrow as pa
    from hetflow.operators import kernels, partition

    rng = np.random.default_rng(0)
    t = pa.table({"k": rng.integers(0, 1 << 62, 100_000), "v": rng.random(100_000)})
    kernels.join(t, t, ["k"], ["k"], "inner", "_r")
    kernels.group_aggregate(t, ["k"], [("v", "sum")])
    kernels.sort(t, [("k", "ascending")], "at_end")  # a key range too wide for the packed sort: polars
    partition.hash_keys(t.append_column("s", pa.array(["x"] * t.num_rows)), ["k", "s"])


def worker(op: str, mode: str, data: dict[str, Any], output: str, budget: int, spill_dir: str | None) -> None:
    """One rank (under mpiexec): run ``op`` once, report time and peak growth to rank 0."""
    from hetflow.operators import read_ipc, scan_ipc
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    _warm()
    if mode == "spill":
        if op == "join":
            left, right = scan_ipc(comm, data["left"]), scan_ipc(comm, data["right"])
        else:
            table = scan_ipc(comm, data["input"])
    comm.Barrier()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    stats: dict[str, Any] = {}
    if mode == "spill":
        kw = {"output": output, "memory_budget": budget, "spill_dir": spill_dir}
        if op == "join":
            res = left.join(right, "k", **kw)
        elif op == "sort":
            res = table.sort_by("k", **kw)
        else:
            res = table.group_by("g").aggregate([("v", "sum"), ("v", "count"), ("v", "mean")], **kw)
        stats = res.stats
        rows = res.num_rows
    else:
        if op == "join":
            out = read_ipc(comm, data["left"]).join(read_ipc(comm, data["right"]), "k")
        elif op == "sort":
            out = read_ipc(comm, data["input"]).sort_by("k")
        else:
            out = read_ipc(comm, data["input"]).group_by("g").aggregate([("v", "sum"), ("v", "count"), ("v", "mean")])
        rows = out.num_rows
    comm.Barrier()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    every = comm.gather({"rank": comm.Get_rank(), "baseline": base, "growth": peak - base, "stats": stats}, root=0)
    if comm.Get_rank() == 0:
        print(MARK + json.dumps({"op": op, "mode": mode, "seconds": seconds, "rows": rows, "ranks": every}), flush=True)


def reference(op: str, data: dict[str, Any], output: str) -> tuple[Any, Any]:
    """(expected, got): row count and column sums of the result, by DuckDB on the inputs and on ``output``."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads TO 1")
    out = _scan(con, "result", output)
    if op == "join":
        left, right = _scan(con, "l", data["left"]), _scan(con, "r", data["right"])
        exp = f"SELECT count(*), sum(k), sum(v % 1000003), sum(w % 1000003) FROM {left} JOIN {right} USING (k)"
        got = f"SELECT count(*), sum(k), sum(v % 1000003), sum(w % 1000003) FROM {out}"
    elif op == "sort":
        exp = f"SELECT count(*), sum(k % 1000003) FROM {_scan(con, 'i', data['input'])}"
        got = f"SELECT count(*), sum(k % 1000003) FROM {out}"
    else:
        exp = (f"SELECT count(*), sum(g), round(sum(s), 3), sum(c) FROM (SELECT g, sum(v) s, count(v) c FROM "
               f"{_scan(con, 'i', data['input'])} GROUP BY g)")
        got = f"SELECT count(*), sum(g), round(sum(v_sum), 3), sum(v_count) FROM {out}"
    return con.execute(exp).fetchone(), con.execute(got).fetchone()


def _scan(con: Any, name: str, directory: str) -> str:
    """``name``, registered in DuckDB as a pyarrow dataset of the IPC files under ``directory`` (streamed)."""
    import pyarrow.dataset as pds

    files = sorted(str(p) for p in Path(directory).glob("part-*.arrow"))
    con.register(name, pds.dataset(files, format="ipc"))
    return name


def sorted_check(output: str) -> bool:
    """The sort's output, partition by partition, is ascending in ``k`` (read a batch at a time)."""
    import numpy as np
    import pyarrow as pa

    last = None
    for path in sorted(Path(output).glob("part-*.arrow")):
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            for b in range(reader.num_record_batches):
                k = reader.get_batch(b).column(0).to_numpy()
                if k.size == 0:
                    continue
                if (last is not None and k[0] < last) or np.any(k[1:] < k[:-1]):
                    return False
                last = k[-1]
    return True


def run(op: str, mode: str, ranks: int, data: dict[str, Any], output: str, budget: int, spill_dir: str | None) -> dict[str, Any]:
    """One fresh ``mpiexec -n ranks`` run of ``op``; returns rank 0's report."""
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
           "--worker", op, mode, json.dumps(data), output, str(budget), spill_dir or ""]
    env = dict(os.environ, OMP_NUM_THREADS="1", POLARS_MAX_THREADS="1")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])  # type: ignore[no-any-return]
    raise RuntimeError(f"{' '.join(cmd[:5])} ... failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=64, help="memory budget per rank, MiB")
    ap.add_argument("--factor", type=float, default=4.0, help="input bytes per rank / budget")
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--memory", action="store_true", help="also time the in-memory DTable operators")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where inputs, outputs and spill files go (default: a temp dir)")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        op, mode, data, output, budget, spill_dir = args.worker
        worker(op, mode, json.loads(data), output, int(budget), spill_dir or None)
        return
    budget = args.budget << 20
    root = Path(tempfile.mkdtemp(prefix="hetflow-spill-bench-", dir=args.dir))
    try:
        print(f"budget {args.budget} MiB per rank, input {args.factor:g}x the budget per rank; peak growth = "
              "ru_maxrss after - before the operator, per rank (max over ranks)")
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for op in args.ops.split(","):
                data_dir = root / f"{op}-{ranks}"
                data = generate(data_dir, op, int(budget * args.factor), ranks)
                modes = ["spill"] + (["memory"] * args.memory)
                for rep in range(args.repeats):
                    for mode in modes:  # alternating
                        out = str(data_dir / f"out-{mode}")
                        res = run(op, mode, ranks, data, out, budget, str(root))
                        growth = max(r["growth"] for r in res["ranks"])
                        baseline = max(r["baseline"] for r in res["ranks"])
                        check = ""
                        if mode == "spill":
                            exp, got = reference(op, data, out)
                            check = "ok" if exp == got and (op != "sort" or sorted_check(out)) else f"MISMATCH {exp} {got}"
                        print(f"{ranks} rank(s) {op:8s} {mode:6s} {res['seconds']:7.2f} s  peak growth "
                              f"{growth / 2**20:7.1f} MiB = {growth / budget:4.2f}x budget  (baseline {baseline / 2**20:.0f} MiB) "
                              f"{res['ranks'][0]['stats']} {check}", flush=True)
                        shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(data_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
