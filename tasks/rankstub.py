"""What ``mpiexec`` starts for each rank of a warm multi-rank task: a stand-in that has the fork server fork the rank.

    mpiexec -n N python -I -S .../hetflow/tasks/rankstub.py SPEC.json

Run by its path with ``-I -S`` (no ``site``, no hetflow, the standard library only), so it costs a bare
interpreter's start.  It connects to the fork server's socket (``HETFLOW_WARM_SOCKET``) and, once its
server is found to be this user's (``SO_PEERCRED``: not a socket another user put in its place), sends the
registration's token (``HETFLOW_WARM_TOKEN``), its environment (the launcher's ``PMI_*`` variables among
it), its working directory and, as ``SCM_RIGHTS``, its standard output and error and the PMI socket Hydra
gave it (``PMI_FD``).  The server forks the rank with them (:mod:`hetflow.tasks.warmranks`): its
``MPI_Init`` talks PMI to this rank's Hydra proxy, as a rank started by ``mpiexec`` would.

This process then stands for the rank before Hydra: the signals it gets are relayed to the rank (through
the server, which knows whether that pid is still its child), and it ends as the rank ended (its exit code,
or killed by the same signal), so Hydra's exit codes, abort and cleanup hold.  When this process dies (Hydra's
SIGKILL after another rank failed, the backend's kill), the server sees its connection close and kills
the rank.  When the server cannot take the rank (gone, or it refuses) before it forked it, this process
becomes the rank itself, cold: it ``exec``'s the worker with the same PMI connection.
"""

import json
import os
import signal
import socket
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGCONT, signal.SIGALRM)
"""Signals passed on to the rank (Hydra forwards SIGINT/SIGTERM/SIGUSR1 to its processes; a backend's kill
reaches this process's group)."""

SOCKET_ENV = "HETFLOW_WARM_SOCKET"
TOKEN_ENV = "HETFLOW_WARM_TOKEN"


def _cold(spec: str, why: str) -> None:
    """Become the rank itself, as a cold start: the worker, with this process's PMI connection."""
    print(f"hetflow: rank started cold: {why}", file=sys.stderr, flush=True)
    for sig in RELAYED:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())  # as mpiexec would have started it
    os.execv(sys.executable, [sys.executable, "-m", "hetflow.tasks.worker", spec])


def _end_as(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(sig, signal.SIG_DFL)
        except (ImportError, OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    spec = sys.argv[1]
    path = os.environ.pop(SOCKET_ENV, "")
    token = os.environ.pop(TOKEN_ENV, "")
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)  # until the request is sent: then relayed in order
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        import struct

        owner = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    except OSError as exc:
        _cold(spec, f"the fork server's socket {path!r}: {exc}")
    if owner != os.getuid():  # the token, the environment and the PMI socket go only to this user's server
        sock.close()
        _cold(spec, f"the socket {path!r} is served by uid {owner}, not by this user's fork server")
    fds = [1, 2]
    pmi = os.environ.get("PMI_FD")
    if pmi is not None:
        fds.append(int(pmi))
    request = json.dumps({"token": token, "spec": spec, "cwd": os.getcwd(), "env": dict(os.environ),
                          "fds": ["stdout", "stderr"] + (["PMI_FD"] if pmi is not None else [])}) + "\n"
    try:
        socket.send_fds(sock, [request.encode()], fds)
    except OSError as exc:
        _cold(spec, f"the fork server did not take the request: {exc}")

    def relay(signum: int, frame: object) -> None:
        try:
            sock.sendall((json.dumps({"signal": signum}) + "\n").encode())
        except OSError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    forked = False
    buffer = b""
    while True:
        try:
            data = sock.recv(4096)
        except InterruptedError:
            continue
        if not data:
            break
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            if "pid" in message:
                forked = True
            elif "status" in message:
                _end_as(int(message["status"]))
            elif "error" in message and not forked:
                sock.close()
                _cold(spec, str(message["error"]))
    if not forked:
        _cold(spec, "the fork server ended before it started the rank")
    print("hetflow: the fork server ended while the rank ran (the rank ended with it)", file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
