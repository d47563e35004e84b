"""Warm multi-rank tasks on one node: ``mpiexec`` stays the launcher, the fork server forks the ranks.

A task of N ranks on this machine (one core each, no GPUs, the ``mpiexec`` installed beside this Python)
is started as ``mpiexec -n N python -I -S rankstub.py SPEC`` (:mod:`hetflow.tasks.rankstub`).  Hydra stays
the process manager: it gives each rank its PMI connection, forwards signals, and on an abort or a rank's
abnormal end kills the others and reports the exit code.  What it starts per rank is a stub with a bare
interpreter, which hands its PMI socket, standard output and error and environment to the run's fork
server over a Unix socket; the server forks the rank with them (the worker's imports done), and the rank's
``MPI_Init`` talks PMI to Hydra as a cold rank's would: its ``COMM_WORLD`` is the task's N ranks.

Decision: Hydra over an MPI of our own (``MPI_Comm_spawn``, or singletons joined by ``MPI_Comm_connect``)
because the ranks then form a true ``MPI_COMM_WORLD`` and every failure path (abort, a killed rank, a
timeout, Ctrl-C) is the launcher's, as for a cold task: only the link between stub and rank is new.

That link, kept by the server:

- the task is first *registered* by the backend (its spec, and the server imports the stage's packages, as
  for a one-rank task); the server answers with its socket's path and a token for the task's stubs, and
  refuses a stub without one (or of another user: ``SO_PEERCRED``);
- each stub's connection names its rank's child: the child's pid, then its wait status, go back on it; a
  signal the stub gets is sent to the child's process group while the child is the server's; when the
  connection closes before the child has ended (the stub was killed: Hydra's SIGKILL after another rank
  failed, the backend's kill), the child gets SIGKILL, and, as a rank killed with its witness by the
  launcher, no ``ended-<pid>.json`` is written for it;
- the child gets SIGKILL when the server dies (nobody would relay for it), and is its own session's
  leader, a subreaper, witnessed by the server, as a one-rank warm task is.

Everything here runs in the fork server (:mod:`hetflow.tasks.forkserver`), except :func:`stub_argv`.
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .forkserver import Job

STUB = Path(__file__).with_name("rankstub.py")

MAX_REQUEST = 1 << 20
"""Bytes: the longest request a stub may send (its environment)."""


def stub_argv(spec: str) -> list[str]:
    """What ``mpiexec`` runs per rank of a warm task."""
    return [sys.executable, "-I", "-S", str(STUB), spec]


@dataclass(frozen=True)
class RankJob(Job):
    """One rank of a warm multi-rank task: ``env`` is its stub's (the launcher's variables in it); its
    standard output and error and its PMI socket are the stub's, received as file descriptors."""

    fds: Mapping[str, int] = field(default_factory=dict)


@dataclass
class _Registration:
    spec: str
    ranks: int
    timeout: float | None
    connected: int = 0
    running: set[int] = field(default_factory=set)
    """Its ranks that have not been reaped yet."""
    forgotten: int | None = None
    """The request id of the backend's ``forget``, answered once no rank of the task is left."""


@dataclass
class _Stub:
    sock: socket.socket
    buffer: bytes = b""
    fds: list[int] = field(default_factory=list)
    pid: int | None = None
    token: str = ""


_listener: socket.socket | None = None
_folder: str | None = None
_owner = 0
_registered: dict[str, _Registration] = {}
_stubs: dict[int, _Stub] = {}  # by the connection's fd
_children: dict[int, _Stub] = {}  # by the rank's pid
_held: set[int] = set()
"""Descriptors received for ranks not forked yet: a rank forked meanwhile must not keep another's."""
_gone: set[int] = set()
"""Ranks killed because their stub was: ended by the launcher, not by themselves."""


def _listen() -> str:
    global _listener, _folder, _owner
    if _listener is None:
        base = os.environ.get("XDG_RUNTIME_DIR")
        base = base if base and os.path.isdir(base) and len(base) < 60 else None
        folder = tempfile.mkdtemp(prefix="hetflow-warm-", dir=base)  # 0700, this user's
        if len(folder) > 90:  # a Unix socket's path has a short limit
            shutil.rmtree(folder, ignore_errors=True)
            folder = tempfile.mkdtemp(prefix="hetflow-warm-", dir="/tmp")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(folder, "s"))
        listener.listen(64)
        _listener, _folder, _owner = listener, folder, os.getpid()
        atexit.register(_remove)
    assert _folder is not None
    return os.path.join(_folder, "s")


def _remove() -> None:
    if os.getpid() == _owner and _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)


def _mpich() -> bool:
    """Whether the MPI library loaded here speaks Hydra's PMI (MPICH, or one derived from it)."""
    from mpi4py import MPI

    version = MPI.Get_library_version()
    return "MPICH" in version or "Intel" in version


def register(job: Job, data: Mapping[str, Any]) -> dict[str, Any]:
    """A task's ranks may connect: its socket and token, or an error (then the backend starts it cold)."""
    try:
        ranks = int(data["ranks"])
        if ranks < 1:
            raise ValueError(f"ranks {ranks}")
        if not _mpich():
            return {"id": job.id, "error": "the MPI library is not MPICH's: its ranks cannot join Hydra's PMI"}
        path = _listen()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return {"id": job.id, "error": f"warm ranks: {exc}"}
    token = secrets.token_hex(16)
    _registered[token] = _Registration(job.spec, ranks, job.timeout)
    return {"id": job.id, "socket": path, "token": token}


def forget(token: str, ident: Any = None) -> dict[str, Any] | None:
    """The task's ``mpiexec`` has ended: no stub may use its token any more, and a rank still running (its
    stub gone) is killed.  The answer to the backend (request ``ident``) once none is left, else None: it
    is sent when the last one has been reaped (:func:`ended`), after what it left behind was ended."""
    registration = _registered.get(token)
    if registration is None or not registration.running:
        _registered.pop(token, None)
        return {"id": ident, "forgotten": token}
    registration.connected = registration.ranks  # no more stubs
    registration.forgotten = ident
    for pid in registration.running:
        _gone.add(pid)
        _kill(pid)
    return None


def fds() -> list[int]:
    """What the server's loop waits on for warm ranks: the socket and the stubs' connections."""
    return ([] if _listener is None else [_listener.fileno()]) + list(_stubs)


def ready(readable: Sequence[int]) -> list[RankJob]:
    """Take what came on the ready sockets; returns the ranks to fork now."""
    jobs: list[RankJob] = []
    if _listener is not None and _listener.fileno() in readable:
        _accept()
    for fd in [fd for fd in readable if fd in _stubs]:
        stub = _stubs[fd]
        try:
            data, fds, _, _ = socket.recv_fds(stub.sock, 1 << 16, 8)
        except OSError:
            data, fds = b"", []
        stub.fds += fds
        if not data:
            _lost(fd, stub)
            continue
        stub.buffer += data
        while b"\n" in stub.buffer:
            line, stub.buffer = stub.buffer.split(b"\n", 1)
            job = _message(fd, stub, line)
            if job is not None:
                jobs.append(job)
        if len(stub.buffer) > MAX_REQUEST:
            _refuse(fd, stub, "request too long")
    return jobs


def _accept() -> None:
    assert _listener is not None
    try:
        conn, _ = _listener.accept()
    except OSError:
        return
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():
        conn.close()
        return
    _stubs[conn.fileno()] = _Stub(conn)


def _message(fd: int, stub: _Stub, line: bytes) -> RankJob | None:
    try:
        message = json.loads(line)
    except ValueError:
        _refuse(fd, stub, "bad request")
        return None
    if "signal" in message:
        if stub.pid is not None:
            from .forkserver import _signal_task

            _signal_task(stub.pid, int(message["signal"]))
        return None
    if stub.pid is not None:
        return None
    token = str(message.get("token", ""))
    registration = next((r for t, r in _registered.items() if hmac.compare_digest(t, token)), None)
    names = list(message.get("fds", []))
    if (registration is None or registration.connected >= registration.ranks
            or message.get("spec") != registration.spec or len(names) != len(stub.fds)):
        _refuse(fd, stub, "not a task this server was asked to start warm")
        return None
    registration.connected += 1
    stub.token = token
    received = dict(zip(names, stub.fds))
    _held.update(stub.fds)
    stub.fds = []
    return RankJob(id=fd, spec=registration.spec, cwd=str(message["cwd"]),
                   env={str(k): str(v) for k, v in message["env"].items()}, stdout=None, stderr=None,
                   die_with_server=True, timeout=registration.timeout, fds=received)


def _send(stub: _Stub, message: Mapping[str, Any]) -> None:
    try:
        stub.sock.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _refuse(fd: int, stub: _Stub, why: str) -> None:
    _send(stub, {"error": why})
    _close(fd, stub)


def _close(fd: int, stub: _Stub) -> None:
    for received in stub.fds:
        os.close(received)
    stub.fds = []
    _stubs.pop(fd, None)
    stub.sock.close()


def _lost(fd: int, stub: _Stub) -> None:
    """A stub's connection closed: its rank, if still running, is killed (its launcher killed the stub)."""
    if stub.pid is not None and stub.pid in _children:
        _gone.add(stub.pid)
        _kill(stub.pid)
    _close(fd, stub)


def forked(job: RankJob, pid: int) -> None:
    """The server forked ``job``'s rank as ``pid``: its stub learns it; the received descriptors are the child's."""
    for received in job.fds.values():
        os.close(received)
        _held.discard(received)
    stub = _stubs.get(job.id)
    if stub is None:  # the stub went while the rank was forked
        _gone.add(pid)
        _kill(pid)
        return
    stub.pid = pid
    _children[pid] = stub
    registration = _registered.get(stub.token)
    if registration is not None:
        registration.running.add(pid)
    _send(stub, {"pid": pid})


def _kill(pid: int) -> None:
    """SIGKILL to rank ``pid``'s group, and to ``pid`` itself (it may not lead its session yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def fork_failed(job: RankJob, why: str) -> None:
    for received in job.fds.values():
        os.close(received)
        _held.discard(received)
    stub = _stubs.get(job.id)
    if stub is not None:
        _send(stub, {"error": why})  # the stub becomes the rank itself, cold


def ended_by_launcher(pid: int) -> bool:
    """Whether rank ``pid`` was killed because its stub was (no ``ended-<pid>.json``, as for a cold rank
    killed with its witness)."""
    return pid in _gone


def ended(pid: int, status: int) -> bool:
    """Rank ``pid`` has ended with wait ``status``: its stub ends the same way.  False: not a warm rank."""
    stub = _children.pop(pid, None)
    _gone.discard(pid)
    if stub is None:
        return False
    _send(stub, {"status": status})
    fd = stub.sock.fileno()
    if fd in _stubs:
        _close(fd, stub)
    registration = _registered.get(stub.token)
    if registration is not None:
        registration.running.discard(pid)
        if registration.forgotten is not None and not registration.running:
            from .forkserver import _reply

            _reply({"id": registration.forgotten, "forgotten": stub.token})
            _registered.pop(stub.token, None)
    return True


STATE_ENV = "HETFLOW_WARM_RANKS_STATE"
"""Where a server that replaces itself (``exec``) leaves this module's state for its successor."""


def before_restart() -> None:
    """The server is about to replace itself (``exec``, same pid and children): its socket, the running
    ranks' stubs' connections and the registrations are handed over (:func:`restore`); a stub not served
    yet is told to start its rank cold."""
    if _listener is None:
        return
    for fd, stub in list(_stubs.items()):
        if stub.pid is None:
            _refuse(fd, stub, "the fork server is restarting")
        else:
            os.set_inheritable(fd, True)
    _listener.set_inheritable(True)
    os.environ[STATE_ENV] = json.dumps({
        "listener": _listener.fileno(), "folder": _folder, "gone": sorted(_gone),
        "stubs": {str(fd): [stub.pid, stub.token] for fd, stub in _stubs.items()},
        "registered": {token: [r.spec, r.ranks, r.timeout, r.connected, sorted(r.running), r.forgotten]
                       for token, r in _registered.items()}})


def restore() -> None:
    """In a server that replaced itself: take over what :func:`before_restart` handed over."""
    global _listener, _folder, _owner
    text = os.environ.pop(STATE_ENV, None)
    if text is None:
        return
    state = json.loads(text)
    _listener = socket.socket(fileno=int(state["listener"]))
    _listener.set_inheritable(False)
    _folder, _owner = state["folder"], os.getpid()
    atexit.register(_remove)
    _gone.update(int(pid) for pid in state["gone"])
    for token, (spec, ranks, timeout, connected, running, forgotten) in state["registered"].items():
        _registered[token] = _Registration(spec, ranks, timeout, connected, set(running), forgotten)
    for fd, (pid, token) in state["stubs"].items():
        stub = _Stub(socket.socket(fileno=int(fd)), pid=pid, token=token)
        stub.sock.set_inheritable(False)
        _stubs[int(fd)] = stub
        _children[pid] = stub


def in_child(job: Job) -> None:
    """In every child the server forks: none of the server's sockets is kept, nor what it received for
    other ranks (a rank that held another's PMI socket would keep it open past that rank's end)."""
    global _listener
    own = set(job.fds.values()) if isinstance(job, RankJob) else set()
    for received in _held - own:
        os.close(received)
    _held.clear()
    for stub in _stubs.values():
        stub.sock.close()
        for received in stub.fds:
            os.close(received)
    _stubs.clear()
    _children.clear()
    _registered.clear()
    if _listener is not None:
        _listener.close()
        _listener = None


def become_rank(job: RankJob) -> None:
    """In the rank's child, after :func:`~hetflow.tasks.forkserver._become_task`: the stub's standard output
    and error, its environment as the launcher set it, and its PMI socket as ``PMI_FD``."""
    for target, name in ((1, "stdout"), (2, "stderr")):
        fd = job.fds.get(name)
        if fd is not None:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(job.env)  # exactly what Hydra gave the stub: no transport chosen for a world of one
    os.environ.pop("HYDI_CONTROL_FD", None)  # the proxy's descriptor in the stub, not passed: nothing here
    pmi = job.fds.get("PMI_FD")
    if pmi is not None:
        os.set_inheritable(pmi, True)  # as Hydra's, which the rank's own exec kept
        os.environ["PMI_FD"] = str(pmi)
        atexit.register(_finalize_pmi, pmi)  # runs after MPI_Finalize, registered later (atexit: last in, first out)


PMI_ACK_WAIT = 10.0
"""Seconds a rank waits for Hydra's ``finalize_ack``."""


def _finalize_pmi(fd: int) -> None:
    """Tell Hydra that this rank has finalized (PMI-1's ``cmd=finalize``, answered by ``finalize_ack``).

    MPICH does this in a C exit handler, after ``MPI_Finalize``; a rank forked by the server ends by
    ``os._exit`` (:func:`hetflow.tasks.forkserver._exit`), which runs no C exit handler, and Hydra takes a
    PMI socket closed without it for a crash: it kills the task's other ranks.  Nothing is sent for a rank
    whose MPI was not finalized (it failed, or aborted: then that is what Hydra should see)."""
    import select

    from mpi4py import MPI

    if not MPI.Is_finalized():
        return
    try:
        os.write(fd, b"cmd=finalize\n")
        answer = b""
        while b"\n" not in answer:
            ready, _, _ = select.select([fd], [], [], PMI_ACK_WAIT)
            data = os.read(fd, 1024) if ready else b""
            if not data:
                break
            answer += data
        os.close(fd)
    except OSError:
        pass
