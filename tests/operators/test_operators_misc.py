"""Projection/filter/map, partitioned I/O, explain, errors, and serial kernel checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import _opdata as D


@pytest.mark.mpi
@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_filter_select_with_columns_map_batches(comm: Any, layout: str) -> None:
    from hetflow.operators import DTable

    rank, size = comm.Get_rank(), comm.Get_size()
    t = DTable(comm, D.table(8000, rank, size, layout=layout, n=25))
    res = (t.filter(pc.field("v") > 100)
            .with_columns(w=pc.field("v") * 2, g=lambda tb: pc.add(tb.column("f"), 1.0))
            .select(["k", "v", "w", "g"])
            .map_batches(lambda tb: tb.filter(pc.is_valid(tb.column("k")))))
    got, whole = res.gather(), t.gather()
    if rank == 0:
        want = D.duck("SELECT k, v, v * 2 AS w, f + 1.0 AS g FROM t WHERE v > 100 AND k IS NOT NULL", t=whole)
        D.assert_same_rows(got, want, f"layout={layout} ranks={size}")


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["parquet", "ipc", "csv"])
@pytest.mark.parametrize("layout", ["balanced", "skew", "zero_rows"])
def test_write_read_roundtrip_balanced(comm: Any, fmt: str, layout: str, tmp_path_factory: Any) -> None:
    from hetflow.operators import DTable, read_csv, read_ipc, read_parquet

    rank, size = comm.Get_rank(), comm.Get_size()
    base = comm.bcast(str(tmp_path_factory.mktemp("io")) if rank == 0 else None)
    d = Path(base) / fmt
    t = DTable(comm, D.table(8100, rank, size, layout=layout, n=33, keys={"k": pa.int64(), "d": pa.date32()}))
    if fmt == "csv":
        d.mkdir(parents=True, exist_ok=True)
        import pyarrow.csv as pcsv

        pcsv.write_csv(t.to_arrow(), d / f"part-{rank:05d}.csv")
        comm.Barrier()
        back = read_csv(comm, str(d / "*.csv"), schema=t.schema)
    elif fmt == "parquet":
        files = t.write_parquet(str(d))
        assert len(files) == size and oct(os.stat(d).st_mode & 0o777) == "0o700"
        back = read_parquet(comm, str(d))
    else:
        t.write_ipc(str(d))
        back = read_ipc(comm, [str(p) for p in sorted(d.glob("*.arrow"))])
    counts = comm.allgather(back.local_num_rows)
    assert max(counts) - min(counts) <= 1, counts
    got, whole = back.gather(), t.gather()
    if rank == 0:
        D.assert_same_rows(got, whole, f"{fmt} roundtrip layout={layout} ranks={size}", ordered=True)


@pytest.mark.mpi
def test_explain_names_algorithm_and_hockney(comm: Any) -> None:
    from hetflow.operators import DTable

    t = DTable(comm, D.table(8200, comm.Get_rank(), comm.Get_size(), n=50))
    text = t.join(t, "k", how="left").group_by("k").aggregate([("v", "sum")]).sort_by("k").explain()
    assert "join" in text and "group_by" in text and "sort_by" in text
    if comm.Get_size() > 1:
        assert "Hockney model: alpha=" in text and "ns/B" in text


@pytest.mark.mpi
def test_schema_mismatch_between_ranks(comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import SchemaMismatchError

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    table = pa.table({"k": pa.array([1], pa.int64() if rank == 0 else pa.int32())})
    with pytest.raises(SchemaMismatchError, match="rank 1"):
        DTable(comm, table)


# ---------------------------------------------------------------- serial (COMM_SELF)


@pytest.fixture
def self_comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_unknown_column_names_available(self_comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import ColumnNotFoundError

    t = DTable(self_comm, pa.table({"k": [1], "v": [2]}))
    with pytest.raises(ColumnNotFoundError, match=r"unknown column 'x'.*available columns: \['k', 'v'\]"):
        t.select(["x"])
    with pytest.raises(KeyError):
        t.join(t, "nope")
    with pytest.raises(ColumnNotFoundError, match="'zz'"):
        t.group_by("k").aggregate([("zz", "sum")])
    with pytest.raises(ColumnNotFoundError, match="'q'"):
        t.sort_by("q")


def test_key_type_mismatch(self_comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import KeyTypeMismatchError

    a = DTable(self_comm, pa.table({"k": pa.array([1], pa.int64())}))
    b = DTable(self_comm, pa.table({"k": pa.array(["1"])}))
    with pytest.raises(KeyTypeMismatchError, match="left 'k' is int64, right 'k' is string"):
        a.join(b, "k")
    c = DTable(self_comm, pa.table({"k": pa.array(["1"], pa.large_string())}))
    assert b.join(c, "k").num_rows == 1  # string and large_string are one key type


def test_unsupported_aggregation_and_options(self_comm: Any) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.errors import InvalidOptionError, UnsupportedAggregationError

    t = DTable(self_comm, pa.table({"k": [1], "s": ["a"]}))
    with pytest.raises(UnsupportedAggregationError, match="'median'.*supported"):
        t.group_by("k").aggregate([("s", "median")])  # type: ignore[list-item]
    with pytest.raises(UnsupportedAggregationError, match="s"):
        t.group_by("k").aggregate([("s", "stddev")])
    with pytest.raises(InvalidOptionError, match=r"invalid join how 'outer' \(allowed: \['inner'"):
        t.join(t, "k", how="outer")
    with pytest.raises(InvalidOptionError, match="nulls"):
        t.sort_by("k", nulls="first")
    with pytest.raises(ValueError):
        t.repartition()


def test_hash_is_deterministic_across_processes() -> None:
    import subprocess
    import sys

    code = ("import pyarrow as pa; from hetflow.operators.partition import hash_keys; "
            "t = pa.table({'a': ['x', None, 'ü'], 'b': [1, 2, None]}); "
            "print(list(hash_keys(t, ['a', 'b'])), list(hash_keys(t, ['b'])))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(outs) == 1, outs


def test_kernel_join_string_and_large_string_hash_alike() -> None:
    from hetflow.operators.partition import hash_keys

    a = pa.table({"k": pa.array(["a", "b", None])})
    b = pa.table({"k": pa.array(["a", "b", None], pa.large_string())})
    assert list(hash_keys(a, ["k"])) == list(hash_keys(b, ["k"]))


def test_hockney_cache_roundtrip(self_comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetflow.operators import costmodel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    h = costmodel.Hockney(1e-6, 1e-10)
    costmodel._store(costmodel.cache_path(), "host|np=2", h)
    assert oct(os.stat(costmodel.cache_path()).st_mode & 0o777) == "0o600"
    assert costmodel._load(costmodel.cache_path())["host|np=2"]["alpha"] == 1e-6
    assert h.shuffle(2, 1e6) == pytest.approx(1e-6 + 0.5e6 * 1e-10)
    with pytest.raises(ValueError):
        costmodel.Hockney(-1.0, 0.0)


def test_duckdb_threads_are_joined_before_interpreter_teardown(tmp_path: Path) -> None:
    """The kernels' DuckDB connections close at exit, so no database thread is left for teardown to
    destroy (which aborted a program after its last line now and then)."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, os\n"
        "atexit.register(lambda: print('threads at teardown', len(os.listdir('/proc/self/task'))))\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "import pyarrow as pa\n"
        "from hetflow.operators import kernels\n"
        "t = pa.table({'k': [1, 2, 3], 'v': [4, 5, 6]})\n"
        "joined = kernels.join(t, t, ['k'], ['k'], 'inner', '_right')\n"
        "print('joined', joined.num_rows, 'threads', len(os.listdir('/proc/self/task')), 'before', before)\n")
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120, check=True).stdout
    joined, teardown = out.splitlines()[0].split(), out.splitlines()[1].split()
    rows, running, before, left = int(joined[1]), int(joined[3]), int(joined[5]), int(teardown[-1])
    assert rows == 3 and running > before + 2, out  # DuckDB ran with its own threads
    assert left <= before + 2, out  # left for teardown: the interpreter's and pyarrow's allocator thread


def test_write_parquet_into_a_symlinked_directory_writes_through_the_link_the_user_gave(tmp_path: Path) -> None:
    """The user's directory is resolved once (a link to scratch space is fine); the part file itself is
    never written through a link planted in its place."""
    from hetflow.operators import DTable
    from hetflow.operators.safeio import UnsafePath
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    files = DTable(comm, pa.table({"x": [1, 2, 3]})).write_parquet(str(tmp_path / "out"))
    assert files == [str(tmp_path / "out" / "part-00000.parquet")] and (real / "part-00000.parquet").is_file()
    assert oct((real / "part-00000.parquet").stat().st_mode & 0o777) == "0o600"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (real / "part-00000.parquet").unlink()
    (real / "part-00000.parquet").symlink_to(victim)
    with pytest.raises(UnsafePath, match="part-00000.parquet"):
        DTable(comm, pa.table({"x": [1]})).write_parquet(str(tmp_path / "out"))
    assert victim.read_text() == "keep"
    comm.Free()
