"""The TCP communicator with real processes: collectives, DTable operators, authentication, abort.

Each test starts N separate Python processes (this file run as a script, one
per rank) that meet through a rendezvous file and a secret file in a private
temporary directory, like the Dask backend's ranks.  Results are compared with
a single-process reference (pyarrow / DuckDB) computed here on the same data.
Serial tests: the processes are not MPI ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from hetflow.operators import tcpcomm

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------ the ranks
def _data(rank: int, size: int) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng([5, rank, size])
    n = 40 + 13 * rank
    left = pa.table({"k": rng.integers(0, 30, n), "g": rng.integers(0, 5, n).astype(np.int32),
                     "a": rng.normal(size=n)})
    right = pa.table({"k": rng.integers(0, 30, 25 + rank), "b": rng.integers(0, 1000, 25 + rank)})
    return left, right


def _suite(comm: Any, out: Path) -> None:
    from mpi4py import MPI

    from hetflow.operators import DTable
    from hetflow.operators import collectives as tc

    rank, size = comm.Get_rank(), comm.Get_size()
    res: dict[str, Any] = {"rank": rank, "size": size}
    res["allgather"] = comm.allgather({"r": rank})
    res["bcast"] = comm.bcast(["root", rank] if rank == 0 else None, root=0)
    res["gather"] = comm.gather(rank * 2, root=size - 1)
    res["scatter"] = comm.scatter([f"to{r}" for r in range(size)] if rank == 0 else None, root=0)
    res["alltoall"] = comm.alltoall([(rank, r) for r in range(size)])
    res["sum"], res["mpi_sum"] = comm.allreduce(rank + 1), comm.allreduce(rank + 1, op=MPI.SUM)
    res["max"], res["min"] = comm.allreduce(rank, op=tcpcomm.MAX), comm.allreduce(rank, op=MPI.MIN)
    res["exscan"] = comm.exscan(rank + 1)
    res["reduce"] = comm.reduce(rank, root=0)
    comm.send({"from": rank}, dest=(rank + 1) % size, tag=3)
    res["ring"] = comm.recv(source=(rank - 1) % size, tag=3)
    comm.Barrier()
    local = np.arange(6, dtype=np.float64).reshape(2, 3) * (rank + 1)
    total = np.empty_like(local)
    comm.Allreduce(local, total)
    res["Allreduce"] = total.tolist()
    sendbuf = np.array([rank * 100 + r for r in range(size)], dtype=np.int64)
    recvbuf = np.empty(size, dtype=np.int64)
    comm.Alltoall(sendbuf, recvbuf)
    res["Alltoall"] = recvbuf.tolist()
    ring = np.full(5, rank, dtype=np.int32)
    got = np.empty(5, dtype=np.int32)
    comm.Sendrecv([ring, 5 * 4, MPI.BYTE], (rank + 1) % size, 4, [got, 5 * 4, MPI.BYTE], (rank - 1) % size, 4)
    res["Sendrecv"] = got.tolist()
    # the table collectives
    mine = pa.table({"src": [rank] * (rank + 2), "x": list(range(rank + 2))})
    shuffled = tc.alltoall_tables(comm, [mine.slice(0, d + 1) for d in range(size)])
    res["alltoall_tables"] = [t.column("src").to_pylist() for t in shuffled]
    res["allgather_table"] = [t.num_rows for t in tc.allgather_table(comm, mine)]
    gathered = tc.gather_table(comm, mine, root=0)
    res["gather_table"] = None if gathered is None else [t.num_rows for t in gathered]
    res["bcast_table"] = tc.bcast_table(comm, mine if rank == size - 1 else None, root=size - 1).num_rows
    res["scatter_tables"] = tc.scatter_tables(comm, [mine.slice(0, r + 1) for r in range(size)] if rank == 0
                                              else None).num_rows
    if size > 1:
        if rank == 0:
            tc.send_table(comm, mine, 1, tag=9)
        elif rank == 1:
            res["recv_table"] = tc.recv_table(comm, 0, tag=9).num_rows
    # DTable operators
    left, right = _data(rank, size)
    lt, rt = DTable(comm, left), DTable(comm, right)
    outputs = {"join": lt.join(rt, "k"), "sort": lt.sort_by([("k", "ascending"), ("a", "descending")]),
               "group_by": lt.group_by("g").aggregate([("a", "sum"), ("a", "count"), ("k", "max")])}
    # SQL over small inputs: rank 0 runs it alone, the others wait for its message (no Iprobe here)
    from hetflow.operators import sql

    small = sql(comm, "select l.g, count(*) as n, sum(r.b) as b from l join r on l.k = r.k where l.a > -1 group by l.g order by l.g",
                l=lt, r=rt)
    res["sql"] = [small.plans[0].operation, small.local_num_rows]
    outputs["sql"] = small
    for name, dt in outputs.items():
        whole = dt.gather(root=0)
        if rank == 0:
            assert whole is not None
            with pa.ipc.new_file(str(out / f"{name}.arrow"), whole.schema) as writer:
                writer.write_table(whole)
    (out / f"rank-{rank}.json").write_text(json.dumps(res))


class _Evil:
    """Creates the marker file if anyone ever unpickles it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _child(scenario: str, rank: int, size: int, work: Path) -> int:
    import logging

    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # these processes are not MPI ranks
    logging.basicConfig(level=logging.WARNING)
    world = tcpcomm.connect(rank, size, rendezvous=work / "address", secret=tcpcomm.read_secret(work / "secret"),
                            timeout=120, connect_timeout=60)
    comm = world.Dup()
    if scenario == "suite":
        _suite(comm, work)
    elif scenario == "abort":  # rank 1 aborts; rank 0 waits in a collective, the others compute
        (work / f"up-{rank}").touch()
        if rank == 1:
            while not all((work / f"up-{r}").exists() for r in range(size)):
                time.sleep(0.02)
            time.sleep(0.3)  # the others are in their barrier / loop now
            comm.Abort(3)
        elif rank == 0:
            comm.Barrier()
        else:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                sum(range(10000))
    elif scenario == "die":  # rank 1 dies without a word (SIGKILL); the others are waiting
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.Barrier()
    elif scenario == "ping":
        res = comm.allgather(rank)
        (work / f"rank-{rank}.json").write_text(json.dumps(res))
    world.Free()
    return 0


# ------------------------------------------------------------------ harness
def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "comm"
    work.mkdir(mode=0o700)
    tcpcomm.write_secret(work / "secret")
    return work


def _spawn(scenario: str, size: int, work: Path, ranks: range | None = None) -> dict[int, subprocess.Popen[bytes]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
               XDG_CACHE_HOME=str(work / "cache"))
    procs = {}
    for rank in ranks if ranks is not None else range(size):
        log = open(work / f"log-{rank}", "wb")
        procs[rank] = subprocess.Popen([sys.executable, str(HERE), scenario, str(rank), str(size), str(work)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
    return procs


def _wait(procs: dict[int, subprocess.Popen[bytes]], work: Path, timeout: float = 120) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for rank, proc in procs.items():
            codes[rank] = proc.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return codes


def _logs(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("log-*")))


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module", params=[1, 2, 3])
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    size = request.param
    work = _workdir(tmp_path_factory.mktemp(f"tcp{size}"))
    codes = _wait(_spawn("suite", size, work), work)
    assert codes == {r: 0 for r in range(size)}, _logs(work)
    return size, work


@pytest.mark.timeout(180)
def test_object_and_buffer_collectives(suite: tuple[int, Path]) -> None:
    size, work = suite
    res = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(size)]
    for r, got in enumerate(res):
        assert got["rank"] == r and got["size"] == size
        assert got["allgather"] == [{"r": i} for i in range(size)]
        assert got["bcast"] == ["root", 0]
        assert got["gather"] == ([2 * i for i in range(size)] if r == size - 1 else None)
        assert got["scatter"] == f"to{r}"
        assert got["alltoall"] == [[i, r] for i in range(size)]
        assert got["sum"] == got["mpi_sum"] == size * (size + 1) // 2
        assert (got["max"], got["min"]) == (size - 1, 0)
        assert got["exscan"] == (None if r == 0 else r * (r + 1) // 2)
        assert got["reduce"] == (sum(range(size)) if r == 0 else None)
        assert got["ring"] == {"from": (r - 1) % size}
        expected = (np.arange(6, dtype=np.float64).reshape(2, 3) * sum(range(1, size + 1))).tolist()
        assert got["Allreduce"] == expected
        assert got["Alltoall"] == [i * 100 + r for i in range(size)]
        assert got["Sendrecv"] == [(r - 1) % size] * 5


@pytest.mark.timeout(180)
def test_table_collectives(suite: tuple[int, Path]) -> None:
    size, work = suite
    res = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(size)]
    for r, got in enumerate(res):
        assert got["alltoall_tables"] == [[i] * min(r + 1, i + 2) for i in range(size)]
        assert got["allgather_table"] == [i + 2 for i in range(size)]
        assert got["gather_table"] == ([i + 2 for i in range(size)] if r == 0 else None)
        assert got["bcast_table"] == size + 1
        assert got["scatter_tables"] == min(r + 1, 2)  # rank 0's table has 2 rows
    if size > 1:
        assert res[1]["recv_table"] == 2


def _whole(size: int) -> tuple[pa.Table, pa.Table]:
    parts = [_data(r, size) for r in range(size)]
    return pa.concat_tables([p[0] for p in parts]), pa.concat_tables([p[1] for p in parts])


def _read(work: Path, name: str) -> pa.Table:
    return pa.ipc.open_file(str(work / f"{name}.arrow")).read_all()


@pytest.mark.timeout(180)
def test_sql_over_small_inputs_runs_on_rank_0(suite: tuple[int, Path]) -> None:
    """Over a TCP communicator too (no ``Iprobe``: the other ranks receive rank 0's closing message
    at once), a small query runs on rank 0 alone, as one DuckDB statement: DuckDB's answer."""
    import duckdb

    size, work = suite
    res = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(size)]
    left, right = _whole(size)
    con = duckdb.connect()
    con.register("l", left)
    con.register("r", right)
    want = con.execute(
        "select l.g, count(*) as n, sum(r.b) as b from l join r on l.k = r.k where l.a > -1 group by l.g order by l.g").fetchall()
    got = _read(work, "sql")
    assert list(zip(*(got.column(c).to_pylist() for c in ("g", "n", "b")))) == want
    assert [r["sql"] for r in res] == [["query", len(want)]] + [["query", 0]] * (size - 1), res


@pytest.mark.timeout(180)
def test_dtable_join_sort_group_by_match_duckdb(suite: tuple[int, Path]) -> None:
    import duckdb

    size, work = suite
    left, right = _whole(size)
    con = duckdb.connect()
    con.register("l", left)
    con.register("r", right)
    want_join = sorted(con.execute("SELECT l.k, l.g, l.a, r.b FROM l JOIN r ON l.k = r.k").fetchall())
    join = _read(work, "join")
    assert sorted(zip(*(join.column(c).to_pylist() for c in ("k", "g", "a", "b")))) == want_join

    ordered = _read(work, "sort")
    assert ordered.num_rows == left.num_rows
    want_order = con.execute("SELECT k, a FROM l ORDER BY k ASC, a DESC").fetchall()
    assert list(zip(ordered.column("k").to_pylist(), ordered.column("a").to_pylist())) == want_order

    groups = _read(work, "group_by")
    want = {g: (s, n, m) for g, s, n, m in
            con.execute("SELECT g, sum(a), count(a), max(k) FROM l GROUP BY g").fetchall()}
    got = {row[0]: tuple(row[1:]) for row in zip(*(groups.column(i).to_pylist() for i in range(4)))}
    assert set(got) == set(want)
    for g, (s, n, m) in want.items():
        assert got[g][0] == pytest.approx(s, rel=1e-12, abs=1e-12) and got[g][1:] == (n, m)


@pytest.mark.timeout(120)
def test_wrong_secret_is_refused_and_nothing_is_unpickled(tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    marker = tmp_path / "unpickled"
    procs = _spawn("ping", 2, work, ranks=range(1))  # rank 0 alone: it listens and waits for rank 1
    try:
        deadline = time.monotonic() + 60
        while not (work / "address").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, _logs(work)
            time.sleep(0.05)
        info = json.loads((work / "address").read_text())
        address = (info["host"], info["port"])
        evil = pickle.dumps(_Evil(str(marker)))
        frame = tcpcomm._HEADER.pack(tcpcomm._OBJ, 0, 0, len(evil)) + evil
        # 1: no handshake at all, straight to a pickle frame
        with socket.create_connection(address, timeout=10) as sock:
            sock.recv(64)
            sock.sendall(frame + b"\x00" * 32)
            assert _closed_by_peer(sock)
        # 2: the protocol spoken with the wrong secret
        with socket.create_connection(address, timeout=10) as sock:
            with pytest.raises(tcpcomm.TcpCommError):
                tcpcomm._handshake(sock, b"0" * 64, False, 10)
        # 3: a wrong secret claiming to be rank 1, then the pickle
        with socket.create_connection(address, timeout=10) as sock:
            challenge = sock.recv(64)
            sock.sendall(challenge[:8] + os.urandom(32) + os.urandom(32) + frame)
            assert _closed_by_peer(sock)
        assert procs[0].poll() is None, "rank 0 must keep waiting for the real rank 1"
        procs.update(_spawn("ping", 2, work, ranks=range(1, 2)))
        codes = _wait(procs, work)
    finally:
        _wait(procs, work, timeout=1)
    assert codes == {0: 0, 1: 0}, _logs(work)
    assert [json.loads((work / f"rank-{r}.json").read_text()) for r in range(2)] == [[0, 1], [0, 1]]
    assert not marker.exists()
    assert "refused a connection" in _logs(work)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.timeout(120)
def test_abort_ends_every_rank_within_seconds(tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    procs = _spawn("abort", 3, work)
    deadline = time.monotonic() + 60
    while not all((work / f"up-{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline, _logs(work)
        time.sleep(0.05)
    started = time.monotonic()
    codes = _wait(procs, work, timeout=30)
    assert time.monotonic() - started < 15, _logs(work)
    assert codes == {0: 3, 1: 3, 2: 3}, _logs(work)
    assert "rank 1 called Abort(3)" in _logs(work)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_ends_the_others(tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    codes = _wait(_spawn("die", 3, work), work, timeout=60)
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 1, _logs(work)
    assert "rank 1 went away" in _logs(work)


# ------------------------------------------------------- in-process (threads)
def _connect_threads(tmp_path: Path, size: int, **kwargs: Any) -> list[tcpcomm.TcpComm]:
    work = _workdir(tmp_path)
    comms: list[Any] = [None] * size
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            comms[rank] = tcpcomm.connect(rank, size, rendezvous=work / "address",
                                          secret=tcpcomm.read_secret(work / "secret"), **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return comms


@pytest.mark.timeout(60)
def test_timeout_names_the_silent_rank(tmp_path: Path) -> None:
    comms = _connect_threads(tmp_path, 2, timeout=0.5, on_failure="raise")
    with pytest.raises(tcpcomm.CommTimeout, match="no message from rank 1 within 0.5 s"):
        comms[0].recv(source=1, tag=5)
    with pytest.raises(TimeoutError):  # the builtin it subclasses
        comms[0].bcast(None, root=1)
    for comm in comms:
        comm.Free()


@pytest.mark.timeout(60)
def test_rendezvous_timeout_names_the_missing_rank(tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    secret = tcpcomm.read_secret(work / "secret")
    errors: list[BaseException] = []

    def rank1() -> None:
        try:
            tcpcomm.connect(1, 3, rendezvous=work / "address", secret=secret, connect_timeout=1.5)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=rank1)
    thread.start()
    with pytest.raises(tcpcomm.CommTimeout, match=r"rank 0: rank\(s\) \[2\] did not connect"):
        tcpcomm.connect(0, 3, rendezvous=work / "address", secret=secret, connect_timeout=1.5)
    thread.join(10)
    assert errors and isinstance(errors[0], (tcpcomm.CommTimeout, tcpcomm.PeerLost)), errors


@pytest.mark.timeout(60)
def test_closed_peer_and_bad_arguments_raise(tmp_path: Path) -> None:
    comms = _connect_threads(tmp_path, 2, timeout=30, on_failure="raise")
    comms[1].send([1, 2], dest=0)
    assert comms[0].recv(source=1) == [1, 2]
    comms[0].send("last words", dest=1, tag=1)
    closer = threading.Thread(target=comms[0].Free)
    closer.start()
    assert comms[1].recv(source=0, tag=1) == "last words"  # delivered before the goodbye
    with pytest.raises(tcpcomm.PeerLost, match="rank 0 has closed the communicator"):
        comms[1].recv(source=0, tag=1)
    comms[1].Free()
    closer.join(10)
    assert not closer.is_alive()
    with pytest.raises(ValueError, match="tags must be >= 0"):
        comms[1].send(1, dest=0, tag=-3)


@pytest.mark.timeout(30)
def test_secret_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    tcpcomm.write_secret(path)
    os.chmod(path, 0o644)
    with pytest.raises(tcpcomm.AuthenticationError, match="mode 0600"):
        tcpcomm.read_secret(path)
    with pytest.raises(PermissionError):
        tcpcomm.read_secret(path)


def test_single_rank_needs_no_sockets(tmp_path: Path) -> None:
    comm = tcpcomm.connect(0, 1, rendezvous=tmp_path / "unused", secret=b"x" * 32)
    assert not (tmp_path / "unused").exists()
    assert comm.allgather(5) == [5] and comm.allreduce(3) == 3 and comm.bcast("a") == "a"
    buf = np.arange(3.0)
    out = np.empty(3)
    comm.Allreduce(buf, out)
    assert out.tolist() == [0.0, 1.0, 2.0]
    comm.send("self", dest=0, tag=2)
    assert comm.recv(source=0, tag=2) == "self"
    with pytest.raises(ValueError, match="unknown reduction"):
        comm.allreduce(1, op="median")


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
