"""Object storage against the local file system: write and read throughput of Parquet through the
operators at N ranks, and the bytes each rank read (issue 29).

One command starts a local S3-compatible server (moto's server mode, as the tests do: tests/_s3.py),
then runs ``mpiexec -n RANKS`` once.  In that run every rank generates its share of ``--size-mb`` of
Parquet (random int64 and float64 columns, which do not compress), and, to the local file system and
to the server in turn:

* **write**: ``DTable.write_parquet(directory)`` (one file per rank; local: temp file, fsync, rename;
  S3: serialized, then one upload), timed from a barrier to the last rank's end;
* **read**: ``read_parquet(comm, directory)`` (footers dealt out, each rank reads its row groups'
  byte ranges), timed likewise; the result is checked (row count and a checksum of the keys);

The S3 side goes through ``filesystem=`` (a ``pyarrow.fs.S3FileSystem`` on the server with a long
request timeout, see :func:`worker`) rather than an ``s3://`` URI: the same reads and uploads.
* **bytes read per rank**: the same read again through ``metered_filesystem``, which counts what
  each rank asked of the storage, against the size of the files.

MB/s is the Parquet bytes written or read (the files' total size) per second, 1 MB = 10^6 bytes.
The local reads come from the page cache (the files were just written), so the local figure is the
operators' own ceiling, not a disk's.

    .venv/bin/python benchmarks/object_store.py --size-mb 1024 --ranks 2 --out results.json
    .venv/bin/python benchmarks/object_store.py --size-mb 8            # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "OBJECT_STORE_RESULT "
ROW_BYTES = 16   # an int64 and a float64 column
GROUP_ROWS = 1 << 20


def _table(rows: int, rank: int) -> Any:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(1000 + rank)
    return pa.table({"k": pa.array(rng.integers(0, 1 << 62, rows, dtype=np.int64)),
                     "v": pa.array(rng.standard_normal(rows))})


def _checksum(table: Any) -> int:
    """The row count and the sum of the keys' low 16 bits, as one number (order-free, exact)."""
    import pyarrow.compute as pc

    low = pc.sum(pc.bit_wise_and(table.column("k"), 0xFFFF)).as_py() or 0
    return int(low) * (1 << 24) + table.num_rows


def worker(size_mb: float, local_dir: str, s3_prefix: str) -> None:
    """One rank of the measurement (run under mpiexec)."""
    import pyarrow.fs as pafs
    from hetflow.operators import DTable, read_parquet
    from hetflow.operators.location import s3_endpoint
    from hetflow.operators.metered import metered_filesystem
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = int(size_mb * 1e6 / ROW_BYTES / size)
    mine = DTable(comm, _table(rows, rank))
    want = comm.allreduce(_checksum(mine.to_arrow()))
    # moto answers CompleteMultipartUpload only after it has checksummed the whole object in Python
    # (tens of seconds for hundreds of MB on a loaded machine); the AWS SDK's default request timeout
    # then retries it, and moto's second answer fails.  So the S3 file system here waits longer.
    s3 = pafs.S3FileSystem(endpoint_override=s3_endpoint(), region=os.environ.get("AWS_REGION", "us-east-1"),
                           request_timeout=600, connect_timeout=30)
    results: dict[str, Any] = {}
    for name, target, fs in (("local", local_dir, pafs.LocalFileSystem()), ("s3", s3_prefix, s3)):
        given = None if name == "local" else fs
        comm.Barrier()
        start = time.perf_counter()
        files = mine.write_parquet(target, filesystem=given)
        comm.Barrier()
        write_s = time.perf_counter() - start
        data_bytes = comm.bcast(sum(fs.get_file_info(f).size for f in files) if rank == 0 else 0)
        comm.Barrier()
        start = time.perf_counter()
        back = read_parquet(comm, target, filesystem=given)
        comm.Barrier()
        read_s = time.perf_counter() - start
        got = comm.allreduce(_checksum(back.to_arrow()))
        if got != want:
            raise SystemExit(f"{name}: what was read (checksum {got}) is not what was written ({want})")
        del back
        metered_fs, meter = metered_filesystem(fs)
        comm.Barrier()
        start = time.perf_counter()
        metered = read_parquet(comm, target, filesystem=metered_fs)
        comm.Barrier()
        metered_s = time.perf_counter() - start
        del metered
        per_rank = comm.allgather(meter.bytes)
        results[name] = {
            "data_bytes": data_bytes, "write_s": write_s, "read_s": read_s, "metered_read_s": metered_s,
            "write_MBps": data_bytes / 1e6 / write_s, "read_MBps": data_bytes / 1e6 / read_s,
            "bytes_read_per_rank": per_rank,
            "share_of_data_per_rank": [b / data_bytes for b in per_rank],
        }
    if rank == 0:
        results["ratio_s3_over_local"] = {
            "write_MBps": results["s3"]["write_MBps"] / results["local"]["write_MBps"],
            "read_MBps": results["s3"]["read_MBps"] / results["local"]["read_MBps"]}
        results["rows"] = rows * size
        print(MARK + json.dumps(results), flush=True)
    comm.Free()


def _uptime() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024.0, help="Parquet to write and read, in MB (10^6 bytes)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where the local files go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--worker", nargs=3, metavar=("SIZE_MB", "LOCAL_DIR", "BUCKET_PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(float(args.worker[0]), args.worker[1], args.worker[2])
        return 0
    if args.size_mb <= 0 or args.ranks < 1:
        parser.error(f"--size-mb must be > 0 and --ranks >= 1, got {args.size_mb} and {args.ranks}")
    sys.path.insert(0, str(ROOT / "tests"))
    from _s3 import S3Server  # the tests' server: moto's server mode on 127.0.0.1

    work = Path(tempfile.mkdtemp(prefix="hetflow-objstore-", dir=args.workdir))
    server = S3Server(work)
    server.start()
    try:
        bucket = server.make_bucket()
        env = dict(os.environ, **server.env)
        mpiexec = Path(sys.executable).with_name("mpiexec")
        load_before = _uptime()
        proc = subprocess.run([str(mpiexec), "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()),
                               "--worker", str(args.size_mb), str(work / "local"), f"{bucket}/bench"],
                              env=env, capture_output=True, text=True, check=False)
        load_after = _uptime()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        print(f"object_store: the {args.ranks}-rank run failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    results = json.loads(lines[-1][len(MARK):])
    results.update(size_mb=args.size_mb, ranks=args.ranks, load_before=load_before, load_after=load_after)
    for name in ("local", "s3"):
        r = results[name]
        print(f"{name:5s}  {r['data_bytes'] / 1e6:8.1f} MB  write {r['write_s']:7.2f} s {r['write_MBps']:8.1f} MB/s"
              f"  read {r['read_s']:7.2f} s {r['read_MBps']:8.1f} MB/s  bytes read per rank "
              + ", ".join(f"{b / 1e6:.1f} MB ({s:.1%})" for b, s in zip(r["bytes_read_per_rank"],
                                                                      r["share_of_data_per_rank"])))
    ratio = results["ratio_s3_over_local"]
    print(f"s3/local  write {ratio['write_MBps']:.3f}  read {ratio['read_MBps']:.3f}  "
          f"(load average before {load_before}, after {load_after})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
