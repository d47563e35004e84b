"""The partitioned readers and writers on object storage (issue 29): ``read_parquet``, ``read_csv``,
``read_ipc``, ``scan_ipc`` and ``DTable.write_parquet`` on ``s3://`` URIs, against a real S3-compatible
server (moto's server mode, tests/_s3.py), at every rank count the MPI tests run at.

What is read is compared with pyarrow reading the same files from the local disk; what each rank read
from the server is counted by a metering ``pyarrow.fs`` wrapper around the real S3 file system
(``hetflow.operators.metered.metered_filesystem``): each rank reads about its share of the bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server

FILES = 3
ROWS = 60_000            # per file
GROUP_ROWS = 6_000       # Parquet row group, IPC record batch: 10 units per file


def _table(seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    n = ROWS
    return pa.table({
        "id": pa.array(np.arange(seed * n, (seed + 1) * n, dtype=np.int64)),
        "x": pa.array(rng.standard_normal(n)),
        "name": pa.array([f"row-{i % 977}" for i in range(n)]),
        "flag": pa.array(rng.integers(0, 2, n).astype(bool)),
    })


class Store:
    """The shared server (started by rank 0), its bucket, and the local copies of what it holds."""

    def __init__(self, env: dict[str, str], bucket: str, local: Path) -> None:
        self.env, self.bucket, self.local = env, bucket, local

    def uri(self, *names: str) -> str:
        return "/".join([f"s3://{self.bucket}", *names])


def _write_inputs(server: S3Server, bucket: str, local: Path) -> None:
    """Three files of each format, on the local disk and uploaded as they are to the bucket."""
    client = server.client()
    for fmt in ("parquet", "csv", "ipc"):
        (local / fmt).mkdir(parents=True)
    for i in range(FILES):
        t = _table(i)
        pq.write_table(t, local / "parquet" / f"f{i}.parquet", row_group_size=GROUP_ROWS)
        pcsv.write_csv(t, local / "csv" / f"f{i}.csv")
        with pa.OSFile(str(local / "ipc" / f"f{i}.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t, max_chunksize=GROUP_ROWS)
    for path in sorted(local.rglob("*.*")):
        client.upload_file(str(path), bucket, f"data/{path.parent.name}/{path.name}")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One moto server for all ranks (rank 0 starts it and writes the inputs; every rank points its
    AWS environment at it)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Dup()
    server = None
    shared: tuple[dict[str, str], str, str] | None = None
    if world.Get_rank() == 0:
        base = tmp_path_factory.mktemp("objstore")
        server = S3Server(base)
        server.start()
        bucket = server.make_bucket()
        _write_inputs(server, bucket, base / "local")
        shared = (server.env, bucket, str(base / "local"))
    env, bucket, local = world.bcast(shared)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield Store(env, bucket, Path(local))
    finally:
        world.Barrier()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if server is not None:
            server.stop()
        world.Free()


def _local(store: Store, fmt: str) -> pa.Table:
    """What pyarrow reads from the local copies, files in name order."""
    files = sorted((store.local / fmt).iterdir())
    if fmt == "parquet":
        return pa.concat_tables(pq.read_table(f) for f in files)
    if fmt == "csv":
        return pa.concat_tables(pcsv.read_csv(f) for f in files)
    return pa.concat_tables(pa.ipc.open_file(pa.memory_map(str(f))).read_all() for f in files)


def _read(comm: Any, fmt: str, paths: Any, **kw: Any) -> Any:
    from hetflow.operators import read_csv, read_ipc, read_parquet

    return {"parquet": read_parquet, "csv": read_csv, "ipc": read_ipc}[fmt](comm, paths, **kw)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["parquet", "csv", "ipc"])
def test_reading_an_s3_prefix_gives_what_pyarrow_reads_locally(comm: Any, store: Store, fmt: str) -> None:
    ext = {"parquet": "parquet", "csv": "csv", "ipc": "arrow"}[fmt]
    forms = [store.uri("data", fmt) + "/", store.uri("data", fmt, f"*.{ext}"),
             [store.uri("data", fmt, f"f{i}.{ext}") for i in range(FILES)]]
    want = _local(store, fmt) if comm.Get_rank() == 0 else None
    for paths in forms:
        got = _read(comm, fmt, paths)
        counts = comm.allgather(got.local_num_rows)
        assert max(counts) - min(counts) <= 1, (paths, counts)
        whole = got.gather()
        if comm.Get_rank() == 0:
            assert whole.equals(want), f"{fmt} from {paths} differs from the local read"


@pytest.mark.mpi
def test_scan_ipc_on_s3_reads_the_same_rows(comm: Any, store: Store) -> None:
    from hetflow.operators import scan_ipc

    scan = scan_ipc(comm, store.uri("data", "ipc") + "/")
    assert scan.num_rows == FILES * ROWS
    whole = scan.to_dtable().gather()
    if comm.Get_rank() == 0:
        assert whole.equals(_local(store, "ipc"))


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["parquet", "ipc", "csv"])
def test_each_rank_reads_about_its_share_of_the_bytes(comm: Any, store: Store, fmt: str) -> None:
    """Counted below pyarrow, at the S3 file system: the bytes each rank asked the server for."""
    from hetflow.operators.location import s3_filesystem
    from hetflow.operators.metered import metered_filesystem

    fs, meter = metered_filesystem(s3_filesystem())
    got = _read(comm, fmt, f"{store.bucket}/data/{fmt}/", filesystem=fs)
    assert got.num_rows == FILES * ROWS
    sizes = [f.stat().st_size for f in sorted((store.local / fmt).iterdir())]
    total, size = sum(sizes), comm.Get_size()
    share = comm.allgather(meter.bytes)
    if fmt == "csv":   # whole files, each read by one rank: a rank's bytes are a run of whole files
        runs = {sum(sizes[a:b]) for a in range(FILES + 1) for b in range(a, FILES + 1)}
        assert all(b in runs for b in share) and sum(share) == total, (share, sizes)
        assert max(share) <= total / size + max(sizes), (share, sizes)
        return
    unit = total / (FILES * (ROWS // GROUP_ROWS))   # about one row group / record batch
    # every byte of the data is read by one rank; the footers (and IPC batch headers) are read by one rank
    # and then each rank reads its own files' footers again to open them: at most one more footer per file
    assert sum(share) <= total * 1.08, (fmt, share, total)
    for b in share:
        assert b <= total / size + 2 * unit, (fmt, share, total, size)
        if size <= FILES * (ROWS // GROUP_ROWS):
            assert b >= total / size - 2 * unit, (fmt, share, total, size)


@pytest.mark.mpi
def test_write_parquet_to_s3_puts_one_object_per_rank_and_reads_back(comm: Any, store: Store) -> None:
    from hetflow.operators import DTable, read_parquet

    rank, size = comm.Get_rank(), comm.Get_size()
    table = _table(10 + rank)
    prefix = store.uri("out", f"w{size}")
    files = DTable(comm, table).write_parquet(prefix)
    assert files == [f"{prefix}/part-{r:05d}.parquet" for r in range(size)]
    back = read_parquet(comm, prefix + "/").gather()
    whole = DTable(comm, table).gather()
    if rank == 0:
        assert back.equals(whole)
        from hetflow.operators.location import resolve

        where = resolve(prefix)
        import pyarrow.fs as pafs

        keys = sorted(i.base_name for i in where.filesystem.get_file_info(pafs.FileSelector(where.path)))
        assert keys == [f"part-{r:05d}.parquet" for r in range(size)]   # nothing else: no temporary objects


# ------------------------------------------------------------------------- errors (serial)
def test_a_missing_bucket_is_named_with_the_cause(comm: Any, s3_env: S3Server) -> None:
    from hetflow.operators import read_parquet
    from hetflow.operators.location import StorageError

    with pytest.raises(StorageError) as caught:
        read_parquet(comm, "s3://no-such-bucket-hf/data/")
    assert str(caught.value) == ("cannot list s3://no-such-bucket-hf/data (bucket 'no-such-bucket-hf', key 'data'): "
                                 "the bucket does not exist (hetflow never creates buckets)")


def test_a_glob_that_matches_nothing_names_bucket_and_key(comm: Any, s3_bucket: str) -> None:
    from hetflow.operators import read_csv
    from hetflow.operators.errors import InputError

    with pytest.raises(InputError) as caught:
        read_csv(comm, f"s3://{s3_bucket}/in/*.csv")
    assert str(caught.value) == (f"no csv files match s3://{s3_bucket}/in/*.csv "
                                 f"(bucket {s3_bucket!r}, key 'in/*.csv')")


def test_a_missing_object_names_bucket_and_key(comm: Any, s3_bucket: str) -> None:
    from hetflow.operators import read_ipc
    from hetflow.operators.errors import InputError

    with pytest.raises(InputError) as caught:
        read_ipc(comm, [f"s3://{s3_bucket}/in/a.arrow"])
    assert str(caught.value) == (f"ipc input s3://{s3_bucket}/in/a.arrow (bucket {s3_bucket!r}, key 'in/a.arrow') "
                                 "does not exist")


def test_an_endpoint_that_is_down_is_one_line(comm: Any, s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetflow.operators import read_parquet
    from hetflow.operators.location import StorageError

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # the discard port: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StorageError) as caught:
        read_parquet(comm, "s3://bkt/data/*.parquet")
    assert caught.value.cause == "endpoint-down"
    assert str(caught.value) == ("cannot list s3://bkt/data/*.parquet (bucket 'bkt', key 'data/*.parquet'): "
                                 "the storage endpoint cannot be reached (http://127.0.0.1:9)")


def test_the_ipc_layout_is_read_from_footer_and_headers_alone(tmp_path: Path) -> None:
    """``ipcfile`` finds every batch's rows without reading a body: checked against pyarrow."""
    from hetflow.operators import ipcfile

    t = _table(3)
    path = tmp_path / "t.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t, max_chunksize=7_000)
        w.write_table(t.slice(0, 0))
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        want = [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)]
        assert ipcfile.batch_rows(source, path.stat().st_size) == want
    with pytest.raises(ValueError, match="no ARROW1 magic"):
        ipcfile.blocks(pa.BufferReader(b"x" * 64), 64)


def test_writing_to_a_missing_bucket_names_it_and_leaves_nothing(comm: Any, s3_env: S3Server) -> None:
    from hetflow.operators import DTable
    from hetflow.operators.location import StorageError

    with pytest.raises(StorageError) as caught:
        DTable(comm, _table(0)).write_parquet("s3://no-such-bucket-hf/out")
    assert str(caught.value) == ("cannot write s3://no-such-bucket-hf/out/part-00000.parquet (bucket "
                                 "'no-such-bucket-hf', key 'out/part-00000.parquet'): the bucket does not exist "
                                 "(hetflow never creates buckets)")
    assert "no-such-bucket-hf" not in [b["Name"] for b in s3_env.client().list_buckets()["Buckets"]]
