"""The state store on a real PostgreSQL server (the multi-user deployment), through SQLAlchemy.

The fixture starts a private PostgreSQL cluster for this module: ``initdb`` into a fresh
directory, the server listening on a Unix socket only (no TCP), stopped at the end.  The
server refuses to run as root, so under root (CI) it runs as the ``postgres`` system user
that Debian's package creates.  ``scripts/system-deps.sh`` installs the server.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import sqlalchemy as sa

import _pipelines as P
import hetflow as hf


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.fail("PostgreSQL server binaries not found under /usr/lib/postgresql: "
                    "run scripts/system-deps.sh (installs Debian's postgresql)")
    return Path(found[-1]).parent


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    bindir = _pg_bin()
    root = Path(tempfile.mkdtemp(prefix="hetflow-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (root, sock):
            os.chown(path, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "hetflow", "--auth=trust",
                    "-E", "UTF8"], check=True, capture_output=True)
    # The server's log goes to a file: through an unread pipe, a race that logs one
    # duplicate-key ERROR per loser fills the pipe and the logging backend blocks mid-statement.
    log = root / "server.log"
    with open(log, "wb") as log_file:
        server = subprocess.Popen([*as_user, str(bindir / "postgres"), "-D", str(data), "-k", str(sock),
                                   "-c", "listen_addresses=", "-c", "fsync=off"],
                                  stdout=subprocess.DEVNULL, stderr=log_file)
    url = f"postgresql+psycopg://hetflow@/postgres?host={sock}"
    engine = sa.create_engine(url)
    try:
        for _ in range(300):
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                break
            except sa.exc.OperationalError:
                if server.poll() is not None:
                    pytest.fail(f"postgres exited: {log.read_text(errors='replace')[-4000:]}")
                time.sleep(0.1)
        else:
            pytest.fail("postgres did not accept connections within 30 s")
        # one database per test module run, like a site would give a project
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("CREATE DATABASE hetflow_test"))
        yield f"postgresql+psycopg://hetflow@/hetflow_test?host={sock}"
    finally:
        engine.dispose()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(root, ignore_errors=True)


def test_runs_resume_and_status_on_postgres(postgres_url: str, tmp_path: Path) -> None:
    pilot = hf.PilotDescription(name="two-cores", cores_per_node=2, gpus_per_node=0, memory_per_node=2**34)
    run = P.two_branches(tmp_path, sleep=0.2).run(pilot=pilot, db=postgres_url)
    assert run.ok, run

    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        q = lambda sql: conn.execute(sa.text(sql), {"run": run.id}).scalar_one()  # noqa: E731
        stages = q("SELECT count(*) FROM stages WHERE run_id = :run AND state = 'DONE'")
        assert stages == len(run.stages) >= 3
        assert q("SELECT count(*) FROM datasets WHERE run_id = :run") == len(run.datasets)
        assert q("SELECT count(*) FROM events WHERE run_id = :run AND kind = 'stage'") == 3 * stages
    engine.dispose()

    # the same run again reuses everything from the PostgreSQL store
    again = P.two_branches(tmp_path, sleep=0.2).run(pilot=pilot, db=postgres_url)
    assert again.ok and {s.state for s in again.stages} == {"CACHED"}

    # `hetflow status` reads the same server through HETFLOW_DB
    env = dict(os.environ, HETFLOW_DB=postgres_url)
    shown = subprocess.run([sys.executable, "-m", "hetflow.cli", "status", run.id, "--workdir", str(tmp_path),
                            "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f'"{run.id}"' in shown.stdout and '"DONE"' in shown.stdout



MAPPED = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("mapped")

@pipe.stage(map_over={"i": [0, 1, 2, 3, 4]}, outputs=["out"])
def fit(ctx):
    return {"out": pa.table({"i": [ctx.params["i"]]})}

if __name__ == "__main__":
    pipe.run()
'''


def test_status_of_a_map_on_postgres_reads_what_sqlite_would(postgres_url: str, tmp_path: Path) -> None:
    """``status`` and ``status RUN STAGE --items`` read a PostgreSQL store by the same SQL as a SQLite one
    (:mod:`hetflow.storefile`), through SQLAlchemy: its driver gives JSON columns decoded and booleans as such."""
    (tmp_path / "mapped.py").write_text(MAPPED)
    env = dict(os.environ, HETFLOW_DB=postgres_url)
    cli = [sys.executable, "-m", "hetflow.cli"]
    for _ in range(2):   # the second run reuses the map whole
        ran = subprocess.run([*cli, "run", "mapped.py", "--no-progress"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
    listed = subprocess.run([*cli, "runs", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    first, second = sorted((r for r in json.loads(listed.stdout) if r["pipeline"] == "mapped"),
                           key=lambda r: r["created"])
    shown = subprocess.run([*cli, "status", first["id"], "--json"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    (stage,) = json.loads(shown.stdout)["stages"]
    assert stage["items"] == {"DONE": 5} and stage["outputs"] == ["out"] and stage["cache"]["hit"] is False
    assert stage["slots"] and stage["slots"][0]["cores"], stage
    shown = subprocess.run([*cli, "status", second["id"], "--json"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert json.loads(shown.stdout)["stages"][0]["cache"]["hit"] is True
    items = subprocess.run([*cli, "status", second["id"], "fit", "--items", "--json", "--offset", "3"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    view = json.loads(items.stdout)
    assert view["items_of_run"] == first["id"] and view["total"] == 5
    assert [(i["index"], i["label"], i["state"]) for i in view["items"]] == [(3, '{"i": 3}', "DONE"),
                                                                              (4, '{"i": 4}', "DONE")]

HELD = '''
import time
from pathlib import Path
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("held")

@pipe.stage(ranks=2, outputs=["t"], params={"hold": None})
def hold(ctx):
    hold = Path(ctx.params["hold"])
    (hold.parent / f"holding-{ctx.rank}").touch()
    give_up = time.time() + 180  # a test that failed half-way leaves nothing running for long
    while hold.exists() and time.time() < give_up:
        time.sleep(0.2)
    return {"t": pa.table({"x": [ctx.rank]})}
'''


def test_cancel_and_rm_through_postgres(postgres_url: str, tmp_path: Path) -> None:
    """`hetflow cancel` reaches the orchestrator through the store alone (as it would from another
    host); `hetflow rm` then removes the run's rows from the server."""
    (tmp_path / "held.py").write_text(HELD)
    (tmp_path / "hold").touch()
    env = dict(os.environ, HETFLOW_DB=postgres_url)
    cli = [sys.executable, "-m", "hetflow.cli"]
    proc = subprocess.Popen([*cli, "run", "held.py", "--no-progress", "--param", f"hold={tmp_path / 'hold'}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "holding-1").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        listed = subprocess.run([*cli, "runs", "--state", "RUNNING", "--json"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)
        (run,) = [r for r in json.loads(listed.stdout) if r["pipeline"] == "held"]
        cancelled = subprocess.run([*cli, "cancel", run["id"]], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=120)
        assert cancelled.returncode == 0, cancelled.stderr
        assert f"run {run['id']} CANCELLED" in cancelled.stdout
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    removed = subprocess.run([*cli, "rm", run["id"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
    assert removed.returncode == 0, removed.stderr
    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        for query in ("SELECT count(*) FROM runs WHERE id = :run",
                      "SELECT count(*) FROM stages WHERE run_id = :run",
                      "SELECT count(*) FROM events WHERE run_id = :run",
                      "SELECT count(*) FROM datasets WHERE run_id = :run",
                      "SELECT count(*) FROM tasks WHERE id LIKE :run || '/%'"):
            assert conn.execute(sa.text(query), {"run": run["id"]}).scalar_one() == 0, query
    engine.dispose()
    assert not Path(run["run_dir"]).exists()


def test_datasets_lock_keeps_removal_out_while_look_ups_hold_it(postgres_url: str) -> None:
    """rm/gc take the store's datasets lock exclusive, cache look-ups shared (a PostgreSQL advisory lock,
    so across hosts): a removal in another process waits for the look-ups; look-ups never wait for each other."""
    from hetflow.store import Store

    store, other = Store(postgres_url), Store(postgres_url)
    remover = ("import sys, time\nfrom hetflow.store import Store\nstore = Store(sys.argv[1])\n"
               "with store.datasets_lock(exclusive=True):\n    print(time.time(), flush=True)\n")
    try:
        with store.datasets_lock(exclusive=False), other.datasets_lock(exclusive=False):
            proc = subprocess.Popen([sys.executable, "-c", remover, postgres_url], stdout=subprocess.PIPE, text=True)
            time.sleep(3)
            assert proc.poll() is None  # still waiting for the look-ups
            released = time.time()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and float(out) >= released
        with store.datasets_lock(exclusive=True):  # and released again by the remover
            pass
    finally:
        store.close()
        other.close()
