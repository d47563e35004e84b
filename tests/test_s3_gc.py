"""``hetflow gc`` on an object-store data directory (issue 29): partition objects no committed dataset names
(an attempt whose orchestrator died after a rank uploaded) are removed, only in hetflow's own layout, only
once older than the grace period, never while their run is in flight.

A real ``hetflow run`` is held inside its stage (after one output is uploaded), gc runs beside it, then the
run's orchestrator is killed; the server is the tests' moto (tests/_s3.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
from _s3 import S3Server, s3_environ
from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import os
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("gcs3")


@pipe.stage(outputs=["a", "b"], env=["HOLD"])
def make(ctx):
    def batches():
        hold = os.environ.get("HOLD")
        if hold:   # output a is uploaded by now: the test looks, then ends the run
            Path(hold, "started").touch()
            while not Path(hold, "go").exists():
                time.sleep(0.05)
            os._exit(3)
        yield pa.record_batch({"x": [2]})
    return {"a": pa.table({"x": [1]}), "b": pa.RecordBatchReader.from_batches(pa.schema({"x": pa.int64()}), batches())}
'''


def hetflow(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
                          check=False)


def gc(cwd: Path, *args: str, env: dict[str, str]) -> list[str]:
    done = hetflow(cwd, "gc", *args, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    """The objects under ``prefix`` (pyarrow's zero-byte directory markers left out)."""
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed if not o["Key"].endswith("/"))


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_gc_removes_the_uploads_of_a_crashed_attempt_but_not_while_the_run_is_in_flight(
        tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    env = s3_environ(s3_server)
    (tmp_path / "p.py").write_text(SCRIPT)
    data_dir = f"s3://{s3_bucket}/gc"
    done = hetflow(tmp_path, "run", "p.py", "--no-progress", "--data-dir", data_dir, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    kept = json.loads(hetflow(tmp_path, "status", "--json", env=env).stdout)
    committed = keys(s3_server, s3_bucket, f"gc/runs/{kept['id']}/")
    assert len(committed) == 4   # a and b: a manifest and a partition each

    hold = tmp_path / "hold"
    hold.mkdir()
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--data-dir", data_dir], cwd=tmp_path,
                            env={**env, "HOLD": str(hold)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(hold / "started", proc)
        crashed = [r for r in json.loads(hetflow(tmp_path, "runs", "--json", env=env).stdout)
                   if r["id"] != kept["id"]][0]
        upload = keys(s3_server, s3_bucket, f"gc/runs/{crashed['id']}/")
        assert len(upload) == 1 and "/datasets/a/part-" in upload[0]   # a uploaded, nothing committed
        # in flight: its upload is no leftover, whatever the grace
        assert gc(tmp_path, "--grace", "0", env=env) == ["nothing to remove"]
        assert keys(s3_server, s3_bucket, f"gc/runs/{crashed['id']}/") == upload
        os.killpg(proc.pid, signal.SIGKILL)   # the orchestrator dies; the rank is let go and ends itself
        proc.communicate(timeout=60)
    finally:
        (hold / "go").touch()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)

    # what no hetflow layout holds, and a run this store does not record (another work directory's), stay
    client = s3_server.client()
    foreign = ["gc/notes/part-00000-0123456789ab.arrow", f"gc/runs/{crashed['id']}/datasets/a/README.txt",
               "gc/runs/other-store-run/datasets/a/part-00000-0123456789ab.arrow"]
    for key in foreign:
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"not hetflow's to judge")

    # younger than the grace period (an hour by default): left alone
    assert gc(tmp_path, env=env) == ["nothing to remove"]
    uri = f"s3://{s3_bucket}/{upload[0]}"
    assert gc(tmp_path, "--dry-run", "--grace", "0", env=env) == [f"would remove {uri}"]
    assert keys(s3_server, s3_bucket, upload[0]) == upload
    assert gc(tmp_path, "--grace", "0", env=env) == [f"removed {uri}"]
    assert keys(s3_server, s3_bucket, f"gc/runs/{crashed['id']}/") == [foreign[1]]
    assert keys(s3_server, s3_bucket, f"gc/runs/{kept['id']}/") == committed   # committed datasets stay whole
    assert all(keys(s3_server, s3_bucket, key) == [key] for key in foreign)
    assert Dataset(kept["datasets"]["b"]).to_table() == pa.table({"x": [2]})
    assert gc(tmp_path, "--grace", "0", env=env) == ["nothing to remove"]

    # the crashed run resumes (its stage runs again) and its datasets are then committed
    resumed = hetflow(tmp_path, "resume", crashed["id"], "--no-progress", env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = json.loads(hetflow(tmp_path, "status", crashed["id"], "--json", env=env).stdout)
    assert Dataset(after["datasets"]["a"]).to_table() == pa.table({"x": [1]})



def test_gc_goes_on_past_a_data_directory_it_cannot_list(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    """A kept run whose store is down (or refuses the credentials) must not make every gc fail: it is named
    on stderr, and what else there is to collect is collected."""
    env = s3_environ(s3_server)
    (tmp_path / "p.py").write_text(SCRIPT)
    done = hetflow(tmp_path, "run", "p.py", "--no-progress", "--data-dir", f"s3://{s3_bucket}/down", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = json.loads(hetflow(tmp_path, "status", "--json", env=env).stdout)["id"]
    leftover = tmp_path / ".hetflow" / "runs" / "gcs3-19990101-000000-dead"
    leftover.mkdir()
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    down = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}"}
    collected = hetflow(tmp_path, "gc", env=down)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert collected.stdout.strip() == f"removed {leftover}"
    assert f"run {run_id}: leftover objects not removed: cannot list s3://{s3_bucket}/down/runs/{run_id}/datasets " \
        f"(bucket '{s3_bucket}', key 'down/runs/{run_id}/datasets'): the storage endpoint cannot be reached" \
        in collected.stderr, collected.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
