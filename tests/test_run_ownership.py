"""Who runs a run: claims, leases and dead owners, raced by real processes on real SQLite and PostgreSQL.

Each race starts N spawned processes that meet at a ``multiprocessing.Barrier`` and then claim the
same run.  ``read_then_write`` is the claim hetflow had before ``Store.claim_run`` (read the owner,
judge it, write ourselves): the same race shows it letting several processes in, so the harness
can see the fault it guards against.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy import select

from hetflow.errors import RunLocked
from hetflow.store import EventRecord, RunRecord, Store, owner_id
from test_store_postgres import postgres_url  # noqa: F401  (the module's private server)

HOST = socket.gethostname()
ROUNDS = 20
CLAIMERS = 8
LEASE = 30.0
GONE = f"elsewhere.invalid:4242:{time.time() - 3600:.2f}"  # another host's orchestrator, lease long expired


def _record(run_id: str) -> RunRecord:
    return RunRecord(id=run_id, pipeline="race", created=time.time(), run_dir="/nonexistent", hetflow_version="test")


def _old_owner_alive(owner: str | None, lease_until: float | None) -> bool:
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host == HOST:
        return pid.isdigit() and psutil.pid_exists(int(pid)) and int(pid) != os.getpid()
    return lease_until is not None and lease_until > time.time()


def _read_then_write(store: Store, run_id: str) -> str:
    """The claim in Orchestrator.prepare before claim_run, with its owner id ``host:pid``."""
    with store.session() as session:
        run = session.get(RunRecord, run_id)
        if run is not None and _old_owner_alive(run.owner, run.lease_until):
            raise RunLocked(f"run {run_id} is being run by another orchestrator ({run.owner})")
        if run is None:
            run = _record(run_id)
            session.add(run)
            session.flush()
        run.owner, run.lease_until, run.state = f"{HOST}:{os.getpid()}", time.time() + LEASE, "RUNNING"
        return run.owner


def _claimer(url: str, how: str, run_ids: list[str], barrier: Any, results: Any) -> None:
    store = Store(url)
    for run_id in run_ids:
        barrier.wait()
        try:
            if how == "claim_run":
                me = owner_id()
                store.claim_run(run_id, me, lease_seconds=LEASE, create=lambda r=run_id: _record(r))  # type: ignore[misc]
            else:
                me = _read_then_write(store, run_id)
            results.put((run_id, "won", me))
        except RunLocked as exc:
            results.put((run_id, "locked", str(exc)))
        except Exception as exc:  # reported, so the test names it instead of hanging
            results.put((run_id, "error", f"{type(exc).__name__}: {exc}"))
    store.close()


def _race(url: str, how: str, run_ids: list[str], n: int = CLAIMERS) -> dict[str, list[tuple[str, str]]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n, timeout=120), ctx.Queue()  # a claimer that died breaks it for the rest
    procs = [ctx.Process(target=_claimer, args=(url, how, run_ids, barrier, results), daemon=True)
             for _ in range(n)]
    for proc in procs:
        proc.start()
    outcomes: dict[str, list[tuple[str, str]]] = {run_id: [] for run_id in run_ids}
    try:
        for _ in range(n * len(run_ids)):
            run_id, outcome, text = results.get(timeout=180)
            outcomes[run_id].append((outcome, text))
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
    finally:  # never leave a claimer behind: pytest would wait for it at exit
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return outcomes


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'hetflow.db'}"
    return str(request.getfixturevalue("postgres_url"))


def _seed_dead_runs(url: str, prefix: str) -> list[str]:
    """Runs left RUNNING by an orchestrator on another host whose lease expired."""
    store = Store(url)
    ids = [f"{prefix}-{i}-{time.time_ns()}" for i in range(ROUNDS)]
    with store.session() as session:
        for run_id in ids:
            record = _record(run_id)
            record.state, record.owner, record.lease_until = "RUNNING", GONE, time.time() - 60
            session.add(record)
    store.close()
    return ids


def _winners(outcomes: dict[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
    return {run_id: [text for outcome, text in got if outcome == "won"] for run_id, got in outcomes.items()}


@pytest.mark.slow
def test_one_of_eight_concurrent_claimers_takes_a_new_or_dead_run(url: str) -> None:
    new = [f"new-{i}-{time.time_ns()}" for i in range(ROUNDS)]
    outcomes = _race(url, "claim_run", new + _seed_dead_runs(url, "dead"))
    store = Store(url)
    for run_id, got in outcomes.items():
        winners = [text for outcome, text in got if outcome == "won"]
        losers = [text for outcome, text in got if outcome != "won"]
        assert len(winners) == 1, (run_id, got)
        assert all(outcome == "locked" for outcome, _ in got if outcome != "won"), (run_id, got)
        holder = winners[0].rsplit(":", 1)[0]  # host:pid
        assert all(f"held by orchestrator {holder}," in text and "resume again" in text for text in losers), losers
        with store.session() as session:
            run = session.get(RunRecord, run_id)
            assert run is not None and run.owner == winners[0] and run.state == "RUNNING"
            claims = session.scalars(select(EventRecord).where(EventRecord.run_id == run_id,
                                                               EventRecord.state == "RUNNING")).all()
            assert len(claims) == 1
    store.close()


@pytest.mark.slow
def test_the_race_lets_the_old_read_then_write_claim_in_twice(tmp_path: Path) -> None:
    """The harness has teeth: on the same race the claim hetflow had double-takes resumed runs."""
    url = f"sqlite:///{tmp_path / 'hetflow.db'}"
    winners = _winners(_race(url, "read_then_write", _seed_dead_runs(url, "old")))
    doubled = [run_id for run_id, won in winners.items() if len(won) > 1]
    assert doubled, winners


def _open_fresh(urls: list[str], barrier: Any) -> None:
    for url in urls:
        barrier.wait()
        store = Store(url)
        with store.session() as session:
            session.add(_record(f"opened-by-{os.getpid()}"))
        store.close()


def _open_at_once(urls: list[str], n: int = 6) -> list[int | None]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n, timeout=120)  # a process that failed breaks the barrier for the others
    procs = [ctx.Process(target=_open_fresh, args=(urls, barrier)) for _ in range(n)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    return [proc.exitcode for proc in procs]


@pytest.mark.slow
def test_six_processes_open_a_fresh_store_at_once(tmp_path: Path) -> None:
    paths = [tmp_path / f"w{attempt}" / "hetflow.db" for attempt in range(10)]
    assert _open_at_once([f"sqlite:///{path}" for path in paths]) == [0] * 6, "a process failed (see its stderr)"
    assert [sqlite_count(path, "SELECT count(*) FROM runs") for path in paths] == [6] * len(paths)


def sqlite_count(path: Path, sql: str) -> int:
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        count = int(conn.execute(sa.text(sql)).scalar_one())
    engine.dispose()
    return count


@pytest.mark.slow
def test_six_processes_create_the_schema_on_a_fresh_postgres_database(postgres_url: str) -> None:  # noqa: F811
    admin = sa.create_engine(postgres_url)
    urls = []
    for attempt in range(5):
        name = f"fresh_{attempt}_{os.getpid()}"
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        urls.append(postgres_url.replace("/hetflow_test?", f"/{name}?"))
    admin.dispose()
    assert _open_at_once(urls) == [0] * 6, "a process failed (see its stderr)"


# ---------------------------------------------------------------- holders alive and dead

HOLD = """
import sys, time
from hetflow.store import RunRecord, Store, owner_id
store = Store(sys.argv[1])
store.claim_run(sys.argv[2], owner_id(), lease_seconds=float(sys.argv[3]), create=lambda: RunRecord(
    id=sys.argv[2], pipeline="held", created=time.time(), run_dir="/nonexistent", hetflow_version="test"))
print(owner_id(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(url: str) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    """A live process holding run ``held-*`` under a long lease: (run id, process, its owner id)."""
    run_id = f"held-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, url, run_id, "3600"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    owner = proc.stdout.readline().strip()
    assert owner, "the holder did not claim its run"
    yield run_id, proc, owner
    proc.kill()
    proc.wait()


def test_a_live_owner_keeps_its_run_and_is_named(url: str, holder: tuple[str, subprocess.Popen[str], str]) -> None:
    run_id, proc, owner = holder
    store = Store(url)
    with pytest.raises(RunLocked, match=rf"held by orchestrator {HOST}:{proc.pid}, running since .*kill {proc.pid}"):
        store.claim_run(run_id, owner_id(), lease_seconds=LEASE)
    assert store.renew_lease(run_id, owner_id(), LEASE) is False
    assert store.release_run(run_id, owner_id(), "DONE") is False
    assert [r.state for r in store.runs() if r.id == run_id] == ["RUNNING"]  # not reconciled: it lives
    store.close()


def test_a_killed_owners_run_can_be_claimed(url: str, holder: tuple[str, subprocess.Popen[str], str]) -> None:
    run_id, proc, owner = holder
    proc.send_signal(signal.SIGKILL)
    time.sleep(0.2)  # not reaped: a zombie is as dead as a reaped process
    store = Store(url)
    claim = store.claim_run(run_id, owner_id(), lease_seconds=LEASE)
    assert claim.previous_owner == owner and claim.previous_state == "RUNNING" and not claim.created
    assert claim.previous_reason == f"its orchestrator ({HOST}:{proc.pid}) ended without recording an outcome"
    assert claim.run.owner == owner_id() and claim.run.state == "RUNNING"
    store.close()


def test_a_reused_pid_is_not_the_holder(url: str, holder: tuple[str, subprocess.Popen[str], str]) -> None:
    """An owner id with a live pid but another start time is a dead orchestrator whose pid was reused."""
    _, proc, owner = holder
    store = Store(url)
    start = float(owner.rsplit(":", 1)[1])
    reused, same = (f"{HOST}:{proc.pid}:{s:.2f}" for s in (start - 1000, start))
    assert same == owner
    reused_id, same_id = f"reused-{time.time_ns()}", f"same-{time.time_ns()}"
    with store.session() as session:
        for run_id, held_by in ((reused_id, reused), (same_id, same)):
            record = _record(run_id)
            record.state, record.owner, record.lease_until = "RUNNING", held_by, time.time() + 3600
            session.add(record)
    claim = store.claim_run(reused_id, owner_id(), lease_seconds=LEASE)
    assert claim.previous_owner == reused
    assert "now belongs to a process started" in (claim.previous_reason or ""), claim.previous_reason
    with pytest.raises(RunLocked, match=f"held by orchestrator {HOST}:{proc.pid}"):
        store.claim_run(same_id, owner_id(), lease_seconds=LEASE)
    store.close()


def test_another_hosts_owner_holds_until_its_lease_expires(url: str) -> None:
    store = Store(url)
    run_id = f"remote-{time.time_ns()}"
    remote = f"elsewhere.invalid:4242:{time.time() - 100:.2f}"
    with store.session() as session:
        record = _record(run_id)
        record.state, record.owner, record.lease_until = "RUNNING", remote, time.time() + 3600
        session.add(record)
    with pytest.raises(RunLocked, match=r"stop it on elsewhere.invalid \(kill 4242\); it counts as gone once its lease"):
        store.claim_run(run_id, owner_id(), lease_seconds=LEASE)
    with store.session() as session:
        record = session.get(RunRecord, run_id)
        assert record is not None
        record.lease_until = time.time() - 1
    claim = store.claim_run(run_id, owner_id(), lease_seconds=LEASE)
    assert claim.previous_owner == remote and "stopped renewing its lease" in (claim.previous_reason or "")
    # the late orchestrator learns it lost the run; the new one renews and records the outcome
    assert store.renew_lease(run_id, remote, LEASE) is False
    assert store.renew_lease(run_id, owner_id(), LEASE) is True
    assert store.release_run(run_id, remote, "DONE") is False
    assert store.release_run(run_id, owner_id(), "STOPPED", detail={"why": "walltime"}) is True
    with store.session() as session:
        record = session.get(RunRecord, run_id)
        assert record is not None and (record.state, record.owner, record.lease_until) == ("STOPPED", None, None)
    # a released run is free: the next claim needs no dead holder
    claim = store.claim_run(run_id, owner_id(), lease_seconds=LEASE, detail={"resume": True})
    assert (claim.previous_owner, claim.previous_state, claim.previous_reason) == (None, "STOPPED", None)
    store.close()


def test_hetflow_runs_shows_a_run_whose_orchestrator_died_as_failed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'hetflow.db'}"
    run_id = "ghost"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, url, run_id, "3600"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    shown = subprocess.run([sys.executable, "-m", "hetflow.cli", "runs", "--workdir", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split()[:2] == ["ghost", "FAILED"], shown.stdout
    with Store(url).session() as session:
        last = session.scalars(select(EventRecord).where(EventRecord.run_id == run_id)
                               .order_by(EventRecord.id.desc())).first()
        assert last is not None and last.state == "FAILED"
        assert last.detail["reason"] == f"its orchestrator ({HOST}:{proc.pid}) ended without recording an outcome"
