"""The test S3 server (tests/_s3.py) is a real one: pyarrow writes and reads through it, a multipart
upload included, and it can be stopped and started on the same port."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server
from botocore.exceptions import EndpointConnectionError


def test_pyarrow_writes_and_reads_parquet_through_the_server_with_a_multipart_upload(
        s3_env: S3Server, s3_bucket: str) -> None:
    # credentials from the environment; the endpoint given explicitly, since pyarrow (26) does not read
    # AWS_ENDPOINT_URL (apache/arrow#49643): hetflow's own file-system seam must pass it on
    fs = pafs.S3FileSystem(endpoint_override=s3_env.endpoint)
    table = pa.table({"x": pa.array(range(2_000_000), pa.int64()),
                      "y": pa.array([float(i) / 7 for i in range(2_000_000)])})
    # ~32 MB uncompressed: above pyarrow's multipart part size, so CompleteMultipartUpload runs
    pq.write_table(table, f"{s3_bucket}/t/part-0.parquet", filesystem=fs, compression="none")
    info = fs.get_file_info(f"{s3_bucket}/t/part-0.parquet")
    assert info.size > 10 * 2**20
    back = pq.read_table(f"{s3_bucket}/t/part-0.parquet", filesystem=fs)
    assert back.equals(table)


def test_the_server_stops_and_starts_on_the_same_port(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = S3Server(tmp_path)
    server.start()
    try:
        bucket = server.make_bucket()
        server.stop()
        with pytest.raises(EndpointConnectionError):
            server.client().list_objects_v2(Bucket=bucket)
        server.start()
        assert [b["Name"] for b in server.client().list_buckets()["Buckets"]] == []
    finally:
        server.stop()
