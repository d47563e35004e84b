"""Out-of-core results with view columns are as large as their values (mpiexec -n 1/2/3/5).

A result batch cut from a larger table still points into that table's ``string_view`` data
buffers, and an IPC file stores them whole with every batch: a 5-rank join once wrote 22 GB for
5M rows (4.5 KB a row).  The result files must stay within a small factor of the plain (``string``) bytes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

pytestmark = pytest.mark.mpi


def test_join_result_with_string_views_is_not_inflated(comm: Any) -> None:
    from hetflow.operators import scan_ipc

    rank = comm.Get_rank()
    rng = np.random.default_rng([7, rank])
    n = 2000
    k = rng.integers(0, 100, n)  # 100 keys: each left row meets about 10 right rows per rank
    left = pa.table({"k": k, "sv": pa.array([f"left-payload-{v}" for v in rng.integers(0, 10**6, n)], pa.string_view())})
    right = pa.table({"k": k[: n // 2], "x": rng.integers(0, 100, n // 2)})
    root = comm.bcast(tempfile.mkdtemp(prefix="hetflow-spill-views-") if rank == 0 else None, root=0)
    for name, t in (("left", left), ("right", right)):
        (Path(root) / name).mkdir(exist_ok=True)
        with pa.OSFile(f"{root}/{name}/part-{rank:05d}.arrow", "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t, max_chunksize=1000)
    comm.Barrier()
    out = scan_ipc(comm, f"{root}/left").join(scan_ipc(comm, f"{root}/right"), "k", output=f"{root}/out",
                                               memory_budget=1 << 20, spill_dir=root)
    result = out.to_dtable().to_arrow()
    plain = result.cast(pa.schema([f.with_type(pa.string()) if f.name == "sv" else f for f in result.schema])).nbytes
    values = sum(comm.allgather(plain))
    written = sum(f.stat().st_size for f in (Path(root) / "out").glob("part-*.arrow"))  # one host: every rank's file
    comm.Barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    assert result.schema.field("sv").type == pa.string_view()
    assert written <= 3 * values, f"result files {written} B for {values} B of values"
