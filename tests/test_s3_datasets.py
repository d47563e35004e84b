"""Datasets on an object store (issue 29): real ``hetflow`` runs with ``--data-dir s3://...`` against a real
S3-compatible server (moto's server mode, tests/_s3.py), the objects damaged and the server stopped
through the same server.

Each run is a subprocess with the server's AWS environment; what it committed is read back with
``hetflow status``/``hetflow datasets`` and :func:`hetflow.open_dataset`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from _s3 import S3Server, s3_environ
from hetflow.operators import dataset as ds
from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import hetflow as hf

pipe = hf.Pipeline("s3pipe")


@pipe.stage(ranks=2, outputs=["numbers"], params={"scale": 1, "fail": 0})
def make(ctx):
    if ctx.params["fail"]:
        raise RuntimeError("asked to fail")
    wait = os.environ.get("S3TEST_WAIT")  # the fault test holds the stage here while it stops the server
    if wait:
        Path(wait, f"started-{ctx.rank}").touch()
        while not Path(wait, "go").exists():
            time.sleep(0.05)
    lo, hi = 1000 * ctx.rank // ctx.size, 1000 * (ctx.rank + 1) // ctx.size
    return {"numbers": pa.table({"x": pa.array(range(lo, hi), pa.int64())}).append_column(
        "y", pa.array([v * ctx.params["scale"] for v in range(lo, hi)], pa.int64()))}


@pipe.stage(ranks=1, inputs=["numbers"], outputs=["total"])
def add(ctx, numbers):
    return {"total": pa.table({"rows": [numbers.num_rows], "sum": [pc.sum(numbers["y"]).as_py()]})}
'''


def hetflow(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env, check=False)


def run(cwd: Path, *args: str, env: dict[str, str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = hetflow(cwd, "run", "p.py", "--no-progress", *args, env=env)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def status(cwd: Path, env: dict[str, str], run_id: str | None = None) -> dict[str, Any]:
    shown = hetflow(cwd, "status", *([run_id] if run_id else []), "--json", env=env)
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


def states(data: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["state"] for s in data["stages"]}


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    """The objects in ``bucket`` under ``prefix`` (pyarrow's zero-byte directory markers left out)."""
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed if not o["Key"].endswith("/"))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    (tmp_path / "p.py").write_text(SCRIPT)
    return tmp_path


def test_a_pipeline_on_s3_gives_the_local_results_and_a_rerun_is_cached(script: Path, s3_server: S3Server,
                                                                         s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    data_dir = f"s3://{s3_bucket}/pipelines"
    run(script, "--data-dir", data_dir, env=env)
    first = status(script, env)
    assert states(first) == {"make": "DONE", "add": "DONE"}
    prefix = f"{data_dir}/runs/{first['id']}/datasets/"
    assert first["datasets"] == {"numbers": prefix + "numbers", "total": prefix + "total"}
    stored = keys(s3_server, s3_bucket)
    assert f"pipelines/runs/{first['id']}/datasets/total/_manifest.json" in stored
    assert sum("/numbers/part-" in k for k in stored) == 2  # one partition per rank, straight to the store
    assert not (script / "work" / "runs" / first["id"] / "datasets").exists()  # nothing local

    local = script / "local"
    local.mkdir()
    (local / "p.py").write_text(SCRIPT)
    run(local, env=env)
    here = status(local, env)
    for name in ("numbers", "total"):
        on_s3 = Dataset(first["datasets"][name]).to_table()
        assert on_s3.equals(Dataset(here["datasets"][name]).to_table())
    assert Dataset(first["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]

    run(script, "--data-dir", data_dir, env=env)
    second = status(script, env)
    assert states(second) == {"make": "CACHED", "add": "CACHED"}
    assert second["datasets"] == first["datasets"]
    listed = hetflow(script, "datasets", second["id"], "--json", env=env)
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["numbers"]["rows"] == 1000 and rows["numbers"]["path"] == prefix + "numbers"
    assert rows["total"]["damaged"] is None


def test_a_deleted_and_a_truncated_object_are_recomputed_with_a_warning(script: Path, s3_server: S3Server,
                                                                        s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    data_dir = f"s3://{s3_bucket}/d"
    run(script, "--data-dir", data_dir, env=env)
    first = status(script, env)
    client = s3_server.client()
    root = f"d/runs/{first['id']}/datasets/"
    deleted = keys(s3_server, s3_bucket, root + "numbers/part-00001")[0]
    client.delete_object(Bucket=s3_bucket, Key=deleted)
    done = run(script, "--data-dir", data_dir, env=env)
    assert f"partition object s3://{s3_bucket}/{deleted} is missing" in done.stderr
    assert "not reusing a cached output" in done.stderr
    second = status(script, env)
    assert states(second) == {"make": "DONE", "add": "DONE"}
    assert Dataset(second["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]

    # the newest commit of `total` is the second run's: cut its partition short
    part = keys(s3_server, s3_bucket, f"d/runs/{second['id']}/datasets/total/part-")[0]
    body = client.get_object(Bucket=s3_bucket, Key=part)["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=part, Body=body[: len(body) // 2])
    done = run(script, "--data-dir", data_dir, env=env)
    assert f"partition object s3://{s3_bucket}/{part} has {len(body) // 2} bytes, the manifest says {len(body)}" \
        in done.stderr
    third = status(script, env)
    assert states(third) == {"make": "CACHED", "add": "DONE"}
    assert Dataset(third["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]


def test_an_object_of_the_right_size_but_other_bytes_is_caught_by_its_checksum(script: Path, s3_server: S3Server,
                                                                               s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    run(script, "--data-dir", f"s3://{s3_bucket}/c", env=env)
    first = status(script, env)
    client = s3_server.client()
    part = keys(s3_server, s3_bucket, f"c/runs/{first['id']}/datasets/total/part-")[0]
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=part)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=part, Body=bytes(body))
    with pytest.raises(ds.CorruptDataset, match="does not match manifest"):
        Dataset(first["datasets"]["total"]).to_table()
    done = run(script, "--data-dir", f"s3://{s3_bucket}/c", env=env)
    assert "does not match its checksum" in done.stderr
    assert states(status(script, env)) == {"make": "CACHED", "add": "DONE"}


def test_the_server_stopped_mid_write_fails_cleanly_and_resume_completes(script: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(tmp_path)
    server.start()
    for key, value in server.env.items():  # this test reads what the runs wrote from this server
        monkeypatch.setenv(key, value)
    try:
        bucket = server.make_bucket("mid-write")
        env = s3_environ(server)
        markers = tmp_path / "markers"
        markers.mkdir()
        waiting = dict(env, S3TEST_WAIT=str(markers))
        proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--data-dir", f"s3://{bucket}/m",
                                 "--workdir", str(script / "work")], cwd=script, env=waiting,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not all((markers / f"started-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        server.stop()  # both ranks are about to write their partitions
        (markers / "go").touch()
        out, err = proc.communicate(timeout=240)
        assert proc.returncode != 0, out + err
        failed = status(script, env)
        assert states(failed) == {"make": "FAILED", "add": "SKIPPED"}, out + err
        make = next(s for s in failed["stages"] if s["name"] == "make")
        error = make["error"]
        assert "\n" not in error
        assert f"cannot write s3://{bucket}/m/runs/{failed['id']}/datasets/numbers/part-0000" in error
        assert f"(bucket '{bucket}', key 'm/runs/{failed['id']}/datasets/numbers/part-0000" in error
        assert f"the storage endpoint cannot be reached ({server.endpoint})" in error
        assert failed["datasets"] == {}  # nothing committed
        assert "SECRET" not in out + err and "hetflow-test-secret" not in out + err

        server.start()  # a fresh server on the same port: the bucket is made again, empty
        server.make_bucket(bucket)
        resumed = hetflow(script, "resume", failed["id"], "--no-progress", env=env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        done = status(script, env, failed["id"])
        assert states(done) == {"make": "DONE", "add": "DONE"}
        assert done["datasets"]["total"] == f"s3://{bucket}/m/runs/{failed['id']}/datasets/total"  # where it began
        assert Dataset(done["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]
    finally:
        server.stop()


def test_a_wrong_credential_and_a_missing_bucket_are_one_clear_line(script: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    s3_server: S3Server) -> None:
    missing = run(script, "--data-dir", "s3://no-such-bucket-hf/p", env=s3_environ(s3_server), ok=False)
    assert missing.stderr.strip().splitlines()[-1] == (
        "hetflow: error: pipeline 's3pipe': data directory: cannot use s3://no-such-bucket-hf/p (bucket "
        "'no-such-bucket-hf', key 'p'): the bucket does not exist (hetflow never creates buckets)")

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")  # moto checks credentials after its first request
    server = S3Server(tmp_path)
    server.start()
    try:
        bucket = server.make_bucket("creds")  # that first request
        env = dict(s3_environ(server), AWS_SECRET_ACCESS_KEY="not-the-secret-xyz", AWS_ACCESS_KEY_ID="AKIAWRONGKEY")
        done = run(script, "--data-dir", f"s3://{bucket}/p", env=env, ok=False)
        lines = done.stderr.strip().splitlines()
        assert lines[-1] == (f"hetflow: error: pipeline 's3pipe': data directory: cannot use s3://{bucket}/p (bucket "
                             f"'{bucket}', key 'p'): access denied (check the credentials and the bucket's policy)")
        assert "not-the-secret-xyz" not in done.stdout + done.stderr
    finally:
        server.stop()


def test_two_commits_of_one_dataset_never_make_a_mixed_dataset(s3_bucket: str) -> None:
    where = f"s3://{s3_bucket}/same/numbers"
    first = pa.table({"x": [1, 2, 3]})
    second = pa.table({"x": [10, 20, 30, 40]})
    # two writers, each with its partition 0 and 1, into the same dataset at once
    mine = [ds.write_partition(where, i, first.slice(2 * i, 2), rank=i) for i in range(2)]
    theirs = [ds.write_partition(where, i, second.slice(2 * i, 2), rank=i) for i in range(2)]
    assert len({p.file for p in mine + theirs}) == 4  # unique keys: no write replaces another's
    ds.commit(where, "numbers", first.schema, mine, producer={"stage": "a"})
    with pytest.raises(ds.DatasetCommitted, match=r"_manifest.json is committed already"):
        ds.commit(where, "numbers", second.schema, theirs, producer={"stage": "b"})
    assert Dataset(where).to_table().equals(first)
    assert Dataset(where).producer == {"stage": "a"}


def test_a_partial_upload_is_never_committed(s3_server: S3Server, s3_bucket: str) -> None:
    where = f"s3://{s3_bucket}/partial/out"
    part = ds.write_partition(where, 0, pa.table({"x": list(range(100))}))
    assert keys(s3_server, s3_bucket, "partial/out/") == [f"partial/out/{part.file}"]  # on the store, uncommitted
    with pytest.raises(ds.DatasetNotFound):
        Dataset(where)  # partitions without a manifest are not a dataset
    cut = ds.PartitionInfo(file=part.file, rows=part.rows, bytes=part.bytes + 1, checksum=part.checksum)
    with pytest.raises(ds.CorruptDataset, match="is missing or has the wrong size"):
        ds.commit(where, "out", pa.schema([("x", pa.int64())]), [cut])
    with pytest.raises(ds.DatasetNotFound):
        Dataset(where)


def test_two_runs_committing_the_same_dataset_names_at_once_keep_their_own(script: Path, s3_server: S3Server,
                                                                             s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    data_dir = f"s3://{s3_bucket}/both"
    procs = [subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--data-dir", data_dir, "--param",
                               f"scale={scale}", "--workdir", str(script / "work")], cwd=script, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for scale in (2, 3)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    runs = json.loads(hetflow(script, "runs", "--json", env=env).stdout)
    totals = sorted(Dataset(status(script, env, r["id"])["datasets"]["total"]).to_table()["sum"][0].as_py()
                    for r in runs)
    assert totals == [2 * 499500, 3 * 499500]


def test_a_new_run_whose_id_has_datasets_in_a_shared_data_dir_is_refused(script: Path, s3_env: S3Server,
                                                                         s3_bucket: str) -> None:
    """Two work directories, one data directory, the same --run-id: the second run would withdraw and replace
    the first one's datasets (and its rm delete them); it is refused before it starts."""
    env = s3_environ(s3_env)
    data_dir = f"s3://{s3_bucket}/shared"
    done = hetflow(script, "run", "p.py", "--no-progress", "--data-dir", data_dir, "--run-id", "exp1",
                   "--param", "scale=1", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    first = status(script, env, "exp1")
    other = script / "other"
    other.mkdir()
    (other / "p.py").write_text(SCRIPT)
    done = hetflow(other, "run", "p.py", "--no-progress", "--data-dir", data_dir, "--run-id", "exp1",
                   "--param", "scale=4", env=env)
    assert done.returncode != 0
    assert (f"run exp1 is new in this store, but {data_dir}/runs/exp1/datasets already holds datasets (another "
            "work directory's run of that id shares the data directory); choose another --run-id, or resume that "
            "run from its own work directory") in done.stderr, done.stderr
    assert Dataset(first["datasets"]["total"]).to_table()["sum"].to_pylist() == [499500]   # the first run's, whole


def test_rm_and_gc_remove_the_objects(script: Path, s3_server: S3Server, s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    data_dir = f"s3://{s3_bucket}/gc"
    run(script, "--data-dir", data_dir, "--param", "scale=5", env=env)
    kept = status(script, env)
    run(script, "--data-dir", data_dir, "--param", "scale=7", env=env)
    failed_later = status(script, env)
    edit = script / "p.py"
    edit.write_text(SCRIPT.replace('return {"total"', 'raise RuntimeError("add fails")\n    return {"total"'))
    run(script, "--data-dir", data_dir, "--param", "scale=9", env=env, ok=False)
    failed = status(script, env)
    assert states(failed) == {"make": "DONE", "add": "FAILED"}
    assert keys(s3_server, s3_bucket, f"gc/runs/{failed['id']}/datasets/numbers/")  # committed before the failure
    edit.write_text(SCRIPT)
    run(script, "--data-dir", data_dir, "--param", "scale=5", env=env)  # the latest run: the failed one is old now

    collected = hetflow(script, "gc", env=env)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert f"s3://{s3_bucket}/gc/runs/{failed['id']}/datasets/numbers" in collected.stdout
    assert keys(s3_server, s3_bucket, f"gc/runs/{failed['id']}/") == []
    assert keys(s3_server, s3_bucket, f"gc/runs/{kept['id']}/")  # DONE runs are kept

    removed = hetflow(script, "rm", failed_later["id"], env=env)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert keys(s3_server, s3_bucket, f"gc/runs/{failed_later['id']}/") == []
    # the first run's datasets are reused by the last run: kept until it goes too
    runs = [r["id"] for r in json.loads(hetflow(script, "runs", "--json", env=env).stdout)]
    removed = hetflow(script, "rm", *runs, env=env)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert keys(s3_server, s3_bucket) == []


def test_a_data_dir_uri_with_credentials_in_it_is_refused(script: Path, s3_server: S3Server) -> None:
    done = run(script, "--data-dir", "s3://AKIAX:SECRETVALUE@bkt/p", env=s3_environ(s3_server), ok=False)
    assert "SECRETVALUE" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "hetflow: error: --data-dir 's3://bkt/p': credentials and options do not go into the URI; set them in the "
        "AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...)")


def test_the_data_dir_of_a_pilot_config_is_used(script: Path, s3_server: S3Server, s3_bucket: str) -> None:
    (script / "pilot.yaml").write_text(f"name: s3pilot\nextends: local\ndata_dir: s3://{s3_bucket}/from-config\n")
    env = s3_environ(s3_server)
    run(script, "--pilot", str(script / "pilot.yaml"), env=env)
    data = status(script, env)
    assert data["datasets"]["total"] == f"s3://{s3_bucket}/from-config/runs/{data['id']}/datasets/total"
    # the store and the run directory stay local: only datasets are in the bucket
    assert all(k.startswith(f"from-config/runs/{data['id']}/datasets/") for k in keys(s3_server, s3_bucket))


def test_a_local_data_dir_holds_the_datasets_and_rm_removes_them_there(script: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    data = tmp_path / "shared" / "data"
    run(script, "--data-dir", str(data), env=env)
    done = status(script, env)
    assert done["datasets"]["total"] == str(data / "runs" / done["id"] / "datasets" / "total")
    assert Dataset(done["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]
    assert not (script / "work" / "runs" / done["id"] / "datasets").exists()
    removed = hetflow(script, "rm", done["id"], env=env)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not (data / "runs" / done["id"]).exists()


MAP_SCRIPT = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("s3map")


@pipe.stage(map_over={"lr": LRS}, outputs=["scores"])
def fit(ctx):
    with open(RAN, "a") as fh:
        fh.write(f"{ctx.params['lr']}\\n")
    return {"scores": pa.table({"lr": [ctx.params["lr"]], "score": [ctx.params["lr"] * 10]})}


@pipe.stage(inputs=["scores"], outputs=["best"])
def best(ctx, scores):
    return {"best": scores.sort_by([("score", "descending")]).slice(0, 1)}
'''


def test_a_map_stage_commits_its_items_partitions_on_the_store_and_caches_them_per_item(
        tmp_path: Path, s3_env: S3Server) -> None:
    s3_server = s3_env   # its AWS environment is this process's too, for reading back
    bucket = s3_server.make_bucket()
    env = s3_environ(s3_server)
    script = MAP_SCRIPT.replace("RAN", repr(str(tmp_path / "ran.txt")))
    (tmp_path / "p.py").write_text(script.replace("LRS", "[0.1, 0.2, 0.3]"))
    run(tmp_path, "--data-dir", f"s3://{bucket}/hf", env=env)
    first = status(tmp_path, env)
    assert states(first) == {"fit": "DONE", "best": "DONE"}
    scores = first["datasets"]["scores"]
    assert scores.startswith(f"s3://{bucket}/hf/runs/")
    assert sorted(Dataset(scores).to_table()["lr"].to_pylist()) == [0.1, 0.2, 0.3]
    assert Dataset(first["datasets"]["best"]).to_table()["lr"].to_pylist() == [0.3]
    assert len([k for k in keys(s3_server, bucket) if "/datasets/scores/part-" in k]) == 3
    ran = (tmp_path / "ran.txt").read_text().split()
    assert sorted(ran) == ["0.1", "0.2", "0.3"]

    # one grid point more: three items reused, one runs; the new dataset on the store holds four partitions
    (tmp_path / "ran.txt").unlink()
    (tmp_path / "p.py").write_text(script.replace("LRS", "[0.1, 0.2, 0.3, 0.05]"))
    run(tmp_path, "--data-dir", f"s3://{bucket}/hf", env=env)
    second = status(tmp_path, env)
    assert (tmp_path / "ran.txt").read_text().split() == ["0.05"]
    assert Dataset(second["datasets"]["scores"]).to_table()["lr"].to_pylist() == [0.1, 0.2, 0.3, 0.05]
    assert Dataset(second["datasets"]["best"]).to_table()["lr"].to_pylist() == [0.3]


def test_the_cache_never_serves_an_object_store_output_outside_the_runs_own_data_dir(
        script: Path, s3_server: S3Server, s3_bucket: str) -> None:
    """Before, the cache served an object-store output from anywhere the store recorded it: another user of
    a shared store, recording a run of theirs under your stage's key with its outputs in a bucket of theirs
    that you can read, had your next run go on from their data, ``make`` CACHED.  Now an object-store output
    is reused only under this run's own data directory: theirs is passed over (a warning names it) and your
    own earlier output is served."""
    import sqlite3

    env = s3_environ(s3_server)
    db = f"sqlite:///{script / 'shared.db'}"
    mine, theirs = f"s3://{s3_bucket}/mine", f"s3://{s3_bucket}/theirs"

    def run_in(cwd: Path, data_dir: str) -> dict[str, Any]:
        done = subprocess.run([*HETFLOW, "run", "p.py", "--no-progress", "--db", db, "--workdir", str(cwd / "work"),
                               "--data-dir", data_dir], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = subprocess.run([*HETFLOW, "status", "--json", "--db", db, "--workdir", str(cwd / "work")], cwd=cwd,
                               capture_output=True, text=True, timeout=60, env=env)
        data: dict[str, Any] = json.loads(shown.stdout)
        data["stderr"] = done.stderr
        return data

    first = run_in(script, mine)
    assert states(first) == {"make": "DONE", "add": "DONE"}
    other = script / "other"
    other.mkdir()
    (other / "p.py").write_text(SCRIPT.replace("v * ctx.params[\"scale\"]", "v * 7"))
    planted = run_in(other, theirs)
    store = sqlite3.connect(script / "shared.db")
    with store:
        key = store.execute("select cache_key from stages where run_id = ? and name = 'make'",
                            (first["id"],)).fetchone()[0]
        store.execute("update stages set cache_key = ? where run_id = ? and name = 'make'", (key, planted["id"]))
    store.close()
    second = run_in(script, mine)
    assert states(second)["make"] == "CACHED", second
    assert second["datasets"]["numbers"].startswith(f"{mine}/runs/{first['id']}/"), second["datasets"]
    assert Dataset(second["datasets"]["total"]).to_table().to_pylist() == [{"rows": 1000, "sum": 499500}]
    assert f"{theirs}/runs/{planted['id']}/datasets/numbers is not under this run's data directory {mine}" \
        in second["stderr"], second["stderr"]
