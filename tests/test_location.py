"""The location seam (hetflow.operators.location) against a real S3-compatible server (tests/_s3.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _s3 import S3Server
from hetflow.operators import location
from hetflow.operators.location import StorageError, redact, resolve, storage_error


def test_a_local_path_and_a_file_uri_are_local_locations(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert resolve(tmp_path).is_local and resolve(tmp_path).path == str(tmp_path)
    assert resolve(f"file://{tmp_path}").path == str(tmp_path)
    assert resolve(tmp_path).join("a", "b").path == str(tmp_path / "a" / "b")


def test_an_s3_uri_reaches_the_endpoint_of_the_aws_environment(s3_bucket: str) -> None:
    where = resolve(f"s3://{s3_bucket}/runs/")
    assert not where.is_local and where.bucket == s3_bucket and where.key == "runs"
    part = where.join("t", "part-0.parquet")
    assert part.uri == f"s3://{s3_bucket}/runs/t/part-0.parquet"
    table = pa.table({"x": [1, 2, 3]})
    pq.write_table(table, part.path, filesystem=part.filesystem)
    assert pq.read_table(part.path, filesystem=part.filesystem).equals(table)


def test_bad_uris_name_the_uri_and_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"gs://b/p: unsupported storage scheme 'gs'"):
        resolve("gs://b/p")
    with pytest.raises(ValueError, match=r"s3:///p: no bucket"):
        resolve("s3:///p")


def test_secrets_written_into_a_uri_never_reach_a_message() -> None:
    assert redact("s3://AKIAXX:VERYSECRET@bkt/p?region=x&secret_key=S2") == "s3://bkt/p?region=x"
    err = storage_error(OSError("AWS Error ACCESS_DENIED for AKIAXX:VERYSECRET"),
                        "s3://AKIAXX:VERYSECRET@bkt/p", "read")
    assert "VERYSECRET" not in str(err) and "AKIAXX" not in str(err)
    assert err.cause == "access-denied"


def test_a_missing_bucket_is_one_line_naming_bucket_key_and_cause(s3_env: S3Server) -> None:
    where = resolve("s3://no-such-bucket-hf/x/part-0.parquet")
    with pytest.raises(OSError) as caught:
        pq.write_table(pa.table({"x": [1]}), where.path, filesystem=where.filesystem)
    err = storage_error(caught.value, where, "write")
    assert str(err) == ("cannot write s3://no-such-bucket-hf/x/part-0.parquet (bucket 'no-such-bucket-hf', "
                        "key 'x/part-0.parquet'): the bucket does not exist (hetflow never creates buckets)")
    assert "\n" not in str(err) and isinstance(err, StorageError)


def test_an_endpoint_that_is_down_is_named(monkeypatch: pytest.MonkeyPatch, s3_env: S3Server) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # discard port: nothing listens
    where = resolve("s3://bkt/x")
    with pytest.raises(OSError) as caught:
        where.filesystem.get_file_info(where.path)
    err = storage_error(caught.value, where, "list")
    assert err.cause == "endpoint-down"
    assert str(err).endswith("the storage endpoint cannot be reached (http://127.0.0.1:9)")


def test_one_file_system_per_environment(monkeypatch: pytest.MonkeyPatch, s3_env: S3Server) -> None:
    first = location.s3_filesystem()
    assert location.s3_filesystem() is first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert location.s3_filesystem() is not first


def test_a_cause_is_read_from_the_message_not_from_the_names_in_it() -> None:
    """A run id (``s3pipe-20261127-214032``) holds ``403``: a connection lost while writing under it was
    reported as access denied (seen in CI when the server stopped mid-write)."""
    where = resolve("s3://mid-write/m/runs/s3pipe-20261127-214032-4f12/datasets/numbers/part-00000.arrow")
    lost = OSError("When uploading part for key 'm/runs/s3pipe-20261127-214032-4f12/datasets/numbers/part-00000"
                   ".arrow' in bucket 'mid-write': AWS Error NETWORK_CONNECTION during UploadPart operation: "
                   "curlCode: 7, Couldn't connect to server")
    assert storage_error(lost, where, "write").cause == "endpoint-down"
    other = OSError("When uploading part for key 'm/runs/s3pipe-20261127-214032-4f12/x' in bucket 'mid-write': "
                    "AWS Error UNKNOWN (HTTP status 500) during UploadPart operation")
    assert storage_error(other, where, "write").cause == "other"
    denied = OSError("When writing key 'm/runs/s3pipe-20261127-214032-4f12/x': AWS Error UNKNOWN (HTTP status 403) "
                     "during PutObject operation")
    assert storage_error(denied, where, "write").cause == "access-denied"
