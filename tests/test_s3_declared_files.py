"""Inputs on an object store in a stage's cache key (issue 29): ``files=["s3://bucket/in/*.parquet"]``.

Real ``hetflow run`` subprocesses against the tests' S3-compatible server (moto's server mode, tests/_s3.py):
an object rewritten, added or removed re-runs the stage that declares it; a map stage over an ``s3://`` glob
has one item per object, keyed by its ETag; a declared URI that names nothing is refused before any stage
runs, naming the stage and the URI; the credentials reach no record.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _s3 import ACCESS_KEY, SECRET_KEY, S3Server, s3_environ
from hetflow.fingerprint import file_fingerprint, resolve_files
from hetflow.operators import filesplit
from hetflow.operators.dataset import Dataset
from hetflow.operators.location import resolve

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

# the docs' example (docs/object-storage.md), its input declared
WEATHER = '''
import hetflow as hf
from hetflow.operators import read_parquet

pipe = hf.Pipeline("weather", data_dir="s3://BUCKET/hetflow")


@pipe.stage(ranks=2, outputs=["readings"], files=["s3://BUCKET/input/*.parquet"])
def load(ctx):
    return {"readings": read_parquet(ctx.comm, ctx.files).to_arrow()}


@pipe.stage(inputs=["readings"], outputs=["by_city"])
def summarize(ctx, readings):
    return {"by_city": readings.group_by("city").aggregate([("temp", "mean")]).sort_by("city")}
'''

MAP = '''
import pyarrow as pa
import pyarrow.parquet as pq
import hetflow as hf
from hetflow.operators.location import resolve

pipe = hf.Pipeline("objects")


@pipe.stage(files=["s3://BUCKET/input/*.parquet"], map_over="files", outputs=["counts"])
def count(ctx):
    assert isinstance(ctx.item, str) and ctx.files == (ctx.item,), (ctx.item, ctx.files)
    where = resolve(ctx.item)
    table = pq.read_table(where.path, filesystem=where.filesystem)
    with open(RAN, "a") as fh:
        fh.write(ctx.item + "\\n")
    return {"counts": pa.table({"object": [ctx.item], "rows": [table.num_rows], "temp": [table["temp"][0].as_py()]})}
'''


def put(server: S3Server, bucket: str, key: str, temp: float, rows: int = 6) -> None:
    """Write a Parquet object the way any tool would (boto3, not hetflow)."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"city": ["Oslo", "Lima"] * (rows // 2), "temp": [temp] * rows}), sink)
    server.client().put_object(Bucket=bucket, Key=key, Body=sink.getvalue().to_pybytes())


def hetflow(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
                          check=False)


def run(cwd: Path, script: str, env: dict[str, str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = hetflow(cwd, "run", script, "--no-progress", env=env)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def status(cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(hetflow(cwd, "status", "--json", env=env).stdout)
    return data


def stages(data: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {s["name"]: (s["state"], s["cache"]["reason"]) for s in data["stages"]}


def test_a_stage_that_declares_its_objects_reruns_when_one_changes_and_not_otherwise(
        tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    (tmp_path / "weather.py").write_text(WEATHER.replace("BUCKET", s3_bucket))
    put(s3_server, s3_bucket, "input/readings.parquet", 1.0)
    put(s3_server, s3_bucket, "input/notes.csv", 0.0)   # not matched by the glob: not in the key
    run(tmp_path, "weather.py", env)
    first = status(tmp_path, env)
    assert {k: v[0] for k, v in stages(first).items()} == {"load": "DONE", "summarize": "DONE"}

    run(tmp_path, "weather.py", env)
    assert {k: v[0] for k, v in stages(status(tmp_path, env)).items()} == {"load": "CACHED", "summarize": "CACHED"}
    put(s3_server, s3_bucket, "input/notes.csv", 9.0)   # an object the glob does not match changed
    run(tmp_path, "weather.py", env)
    assert {k: v[0] for k, v in stages(status(tmp_path, env)).items()} == {"load": "CACHED", "summarize": "CACHED"}

    put(s3_server, s3_bucket, "input/readings.parquet", 5.0)   # same size, other content: another ETag
    run(tmp_path, "weather.py", env)
    changed = status(tmp_path, env)
    assert stages(changed) == {
        "load": ("DONE", f"file s3://{s3_bucket}/input/readings.parquet changed"),
        "summarize": ("DONE", "input readings changed")}
    assert Dataset(changed["datasets"]["by_city"]).to_table()["temp_mean"].to_pylist() == [5.0, 5.0]

    put(s3_server, s3_bucket, "input/more.parquet", 7.0)   # an object more: the glob matches it
    run(tmp_path, "weather.py", env)
    added = status(tmp_path, env)
    assert stages(added)["load"] == ("DONE", f"file s3://{s3_bucket}/input/more.parquet added")
    assert Dataset(added["datasets"]["by_city"]).to_table()["temp_mean"].to_pylist() == [6.0, 6.0]

    s3_server.client().delete_object(Bucket=s3_bucket, Key="input/more.parquet")   # back to what `changed` read
    run(tmp_path, "weather.py", env)
    removed = status(tmp_path, env)
    assert stages(removed)["load"] == ("CACHED", f"unchanged since run {changed['id']}")
    assert Dataset(removed["datasets"]["by_city"]).to_table()["temp_mean"].to_pylist() == [5.0, 5.0]

    # the key names the objects by URI, ETag and size; no credential is in any record or file of the run
    for path in (tmp_path / ".hetflow").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data, path


@pytest.mark.parametrize(("pattern", "message"), [
    ("s3://BUCKET/input/*.csv",
     "declared files glob 's3://BUCKET/input/*.csv' matches no object in bucket 'BUCKET' (key 'input/*.csv')"),
    ("s3://BUCKET/input/gone.parquet",
     "declared file 's3://BUCKET/input/gone.parquet' does not exist (bucket 'BUCKET', key 'input/gone.parquet')"),
    ("s3://BUCKET/input",
     "declared file 's3://BUCKET/input' is a prefix of objects (bucket 'BUCKET', key 'input'), not an object; "
     "name its objects with a glob such as 's3://BUCKET/input/*'"),
    ("s3://no-such-bucket-29/input/*.parquet",
     "cannot list s3://no-such-bucket-29/input/*.parquet (bucket 'no-such-bucket-29', key 'input/*.parquet'): "
     "the bucket does not exist (hetflow never creates buckets)"),
])
def test_a_declared_uri_that_names_no_object_is_refused_before_any_stage_runs(
        tmp_path: Path, s3_server: S3Server, s3_bucket: str, pattern: str, message: str) -> None:
    env = s3_environ(s3_server)
    put(s3_server, s3_bucket, "input/readings.parquet", 1.0)
    script = WEATHER.replace("s3://BUCKET/input/*.parquet", pattern).replace("BUCKET", s3_bucket)
    (tmp_path / "weather.py").write_text(script)
    done = run(tmp_path, "weather.py", env, ok=False)
    assert done.stderr.strip().splitlines()[-1] == \
        f"hetflow: error: pipeline 'weather', stage 'load': {message.replace('BUCKET', s3_bucket)}"
    assert not (tmp_path / ".hetflow" / "runs").exists() or not any((tmp_path / ".hetflow" / "runs").iterdir())


def test_credentials_in_a_declared_uri_are_refused_and_not_shown(tmp_path: Path, s3_server: S3Server,
                                                                 s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    script = WEATHER.replace("s3://BUCKET/input/", "s3://AKIAX:SECRETVALUE@BUCKET/input/").replace("BUCKET", s3_bucket)
    (tmp_path / "weather.py").write_text(script)
    done = run(tmp_path, "weather.py", env, ok=False)
    assert "SECRETVALUE" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"hetflow: error: pipeline 'weather', stage 'load': files: 's3://{s3_bucket}/input/*.parquet': credentials "
        "and options do not go into the URI; set them in the AWS environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...)")


def test_a_map_stage_over_an_s3_glob_has_an_item_per_object_keyed_by_its_etag(
        tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    ran = tmp_path / "ran.txt"
    (tmp_path / "m.py").write_text(MAP.replace("BUCKET", s3_bucket).replace("RAN", repr(str(ran))))
    put(s3_server, s3_bucket, "input/a.parquet", 1.0, rows=2)
    put(s3_server, s3_bucket, "input/b.parquet", 2.0, rows=4)
    put(s3_server, s3_bucket, "input/deeper/c.parquet", 3.0)   # '*' does not cross '/', as in the readers
    a, b = (f"s3://{s3_bucket}/input/{name}.parquet" for name in "ab")
    run(tmp_path, "m.py", env)
    first = status(tmp_path, env)
    assert sorted(ran.read_text().split()) == [a, b]
    assert Dataset(first["datasets"]["counts"]).to_table().to_pylist() == [
        {"object": a, "rows": 2, "temp": 1.0}, {"object": b, "rows": 4, "temp": 2.0}]

    ran.unlink()
    put(s3_server, s3_bucket, "input/b.parquet", 4.0, rows=4)   # one object rewritten: only its item runs
    run(tmp_path, "m.py", env)
    second = status(tmp_path, env)
    assert ran.read_text().split() == [b]
    assert stages(second)["count"] == ("DONE", f"map 2 items: 1 cached, 1 ran ({b} changed)")
    assert Dataset(second["datasets"]["counts"]).to_table()["temp"].to_pylist() == [1.0, 4.0]


def test_a_declared_s3_glob_matches_the_objects_the_readers_match(s3_env: S3Server, s3_bucket: str,
                                                                   tmp_path: Path) -> None:
    for key in ("in/a.parquet", "in/b.parquet", "in/.hidden.parquet", "in/sub/c.parquet", "in/b.parquet.bak"):
        put(s3_env, s3_bucket, key, 1.0)
    pattern = f"s3://{s3_bucket}/in/*.parquet"
    read = [f.where.uri for f in filesplit._locate(pattern, "parquet")]
    assert list(resolve_files([pattern], tmp_path)) == read == \
        [f"s3://{s3_bucket}/in/a.parquet", f"s3://{s3_bucket}/in/b.parquet"]
    # no object is read for the key: its ETag and size, as the store lists them
    head = s3_env.client().head_object(Bucket=s3_bucket, Key="in/a.parquet")
    assert file_fingerprint([pattern], tmp_path)[read[0]] == \
        f"etag:{head['ETag'].strip(chr(34))} size:{head['ContentLength']}"
    assert resolve(read[0]).bucket == s3_bucket
