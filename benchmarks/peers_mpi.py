"""The MPI dataframe peers of ``benchmarks/operators.py``: Bodo (SPMD) and Modin on unidist's MPI engine.

Runs under the peers' own Python (``benchmarks/peers-env.sh`` makes it: Bodo
needs ``pandas<3``, which hetflow's environment does not pin), never imports
hetflow, and rebuilds the benchmark's tables from the same seeds
(:func:`make_chunk` is the same function as in ``operators.py``), so every
engine sees the same rows.  Prints one ``BENCH_RESULT {json}`` line (rank 0 /
the root) like the benchmark's other workers.

    mpiexec -n 2 PY peers_mpi.py bodo join --rows N --repeats R
    UNIDIST_IS_MPI_SPAWN_WORKERS=False mpiexec -n 4 PY peers_mpi.py modin join --rows N --repeats R

Bodo: each rank builds its chunks (chunk ``c`` on rank ``c % size``, as
hetflow's ranks do) and calls one ``bodo.jit`` function per operator on its
distributed frames; the first call (JIT compilation) is not timed.  Modin: the
root builds the whole table and hands it to Modin (not timed); each timed call
is forced to finish with ``modin.utils.execute``.  Two unidist workers (the
other two MPI processes are unidist's root and monitor).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

CHUNKS = 2
MARK = "BENCH_RESULT "


def make_chunk(table_id: int, chunk: int, rows: int) -> Any:
    import numpy as np
    import pandas as pd

    n = rows // CHUNKS + (1 if chunk < rows % CHUNKS else 0)
    rng = np.random.default_rng([table_id, chunk, rows])
    return pd.DataFrame({"k": rng.integers(0, int(rows * 4.5), n), "v": rng.integers(0, 1 << 40, n)})


def bodo_worker(op: str, rows: int, repeats: int) -> None:
    import bodo
    import pandas as pd
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = [c for c in range(CHUNKS) if c % size == rank]
    a = pd.concat([make_chunk(1, c, rows) for c in mine], ignore_index=True)
    b = pd.concat([make_chunk(2, c, rows) for c in mine], ignore_index=True) if op == "join" else None

    @bodo.jit(distributed=["x", "y"], spawn=False)
    def join(x: Any, y: Any) -> Any:
        return x.merge(y, on="k", suffixes=("", "_right"))

    @bodo.jit(distributed=["x"], spawn=False)
    def sort(x: Any) -> Any:
        return x.sort_values("k")

    @bodo.jit(distributed=["x"], spawn=False)
    def groupby(x: Any) -> Any:
        return x.groupby("k", as_index=False)["v"].sum()

    call = {"join": lambda: join(a, b), "sort": lambda: sort(a), "groupby": lambda: groupby(a)}[op]
    comm.Barrier()
    t0 = time.perf_counter()
    call()  # compiles
    compile_s = time.perf_counter() - t0
    times, out_rows = [], 0
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        res = call()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
        out_rows = comm.allreduce(len(res))
        del res
    if rank == 0:
        print(MARK + json.dumps({"times": times, "rows_out": out_rows, "first_call_s": compile_s,
                                 "bodo": bodo.__version__}), flush=True)


def modin_worker(op: str, rows: int, repeats: int) -> None:
    import modin.config as modin_config
    import unidist.config as unidist_config

    modin_config.Engine.put("unidist")
    unidist_config.Backend.put("mpi")
    import modin
    import modin.pandas as mpd
    import pandas as pd
    from modin.utils import execute

    a = mpd.DataFrame(pd.concat([make_chunk(1, c, rows) for c in range(CHUNKS)], ignore_index=True))
    b = mpd.DataFrame(pd.concat([make_chunk(2, c, rows) for c in range(CHUNKS)], ignore_index=True)) if op == "join" else None
    execute(a)
    if b is not None:
        execute(b)
    call = {"join": lambda: a.merge(b, on="k", suffixes=("", "_right")), "sort": lambda: a.sort_values("k"),
            "groupby": lambda: a.groupby("k", as_index=False)["v"].sum()}[op]
    times, out_rows = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = call()
        execute(res)
        times.append(time.perf_counter() - t0)
        out_rows = len(res)
        del res
    print(MARK + json.dumps({"times": times, "rows_out": out_rows, "modin": modin.__version__}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=("bodo", "modin"))
    ap.add_argument("op", choices=("join", "sort", "groupby"))
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    (bodo_worker if args.engine == "bodo" else modin_worker)(args.op, args.rows, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
