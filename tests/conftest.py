"""Shared test set-up.

Under ``mpiexec -n N python -m pytest -m mpi`` every rank runs the same tests.
A failing rank must not leave the others waiting in a collective, so a failed
report on any rank aborts the whole job (STYLE.md); ``pytest-timeout`` with
the thread method (pyproject) ends a hang.  Only rank 0 prints.

Under CI (``CI=true``, as ``.ci/run`` is run) a test that skips because a
component is missing (Chromium, root for tmpfs, torch, the CLI) fails instead:
CI installs everything, so such a skip means an install step went missing.
Only skips that depend on the MPI size ("needs two ranks") or on a GPU ("needs a
CUDA device": CI machines have none; ``scripts/gpu-check.sh`` runs those tests on one)
stay skips.

The serial tests run in parallel under pytest-xdist (``make test-serial``: ``-n auto
--dist loadfile``; a bare ``-n N`` means the same).  A *group* runs on one worker, in
order, and two groups may run at the same time:

* each test file is a group, so a module fixture (an RP pilot, a PostgreSQL server, a
  Dask cluster) starts once, and the two tests that build the wheel in the source tree
  never overlap;
* tests/slurm/ is one group, so the lab cluster's session fixture (tests/slurm/conftest.py)
  lives in one worker: started once, stopped at the end only if it was not running.
  A test marked ``slurm`` elsewhere is a usage error;
* the files that start RADICAL-Pilot sessions are one group, so one RP session at a time
  (:data:`SHARED_GROUPS`).

xdist's own ``--dist loadgroup`` cannot carry this: it passes the group to the
scheduler by editing test ids, which pytest 9.2 no longer allows (pytest-xdist#1386),
so the scheduler here groups by test id.  The lab cluster's group is handed out first: its tests mostly
wait for Slurm, so it runs beside the others from the start.  Then the groups holding more tests marked
``slow``, so the long ones do not start last; the RP group last.  A live RP session is some twenty
processes that poll: on the slow two-core machine, 51 of them summed to 109% of a core during the
raptor tests, and the tests running beside them took 3-6 times as long as in a run where they did not
(ml/test_resume.py: 394 s against 67 s).  Handed out last, they mostly run when little else does.  (With
both at the end, in one group, a local run's last 30 minutes were that one worker's: 18 for the RP
files, then 10 for the lab cluster.)

Each test session (each worker) gets a private ``XDG_RUNTIME_DIR``, so its own core
ledger (:mod:`hetflow.tasks.ledger`): a run on one worker would otherwise wait for the
cores another worker's run holds, and log a warning tests reading stderr do not expect.

A SIGTERM that reaches the xdist controller is reported with its sender (pid, command line,
ancestry) before the controller ends by it as before (:func:`_name_sigterm_senders`): once, on
CI, every test had passed when the controller was ended so, and nothing said by whom.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Any

import pytest
from _s3 import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures: a real S3-compatible server)


def _world_size() -> int:
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


UNDER_MPIEXEC = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_RUNTIME_DIR = pytest.StashKey[tuple[str | None, str]]()


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_missing_component(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI, turn a skip for a missing component into a failure that says which."""
    if not (UNDER_CI and report.skipped) or getattr(report, "wasxfail", None) is not None:
        return
    reason = _skip_reason(report)
    if reason.startswith("Skipped: needs") and ("rank" in reason or reason == "Skipped: needs a CUDA device"):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under CI, where every component must be installed: {reason}"


def _describe_process(pid: int) -> str:
    """``pid``'s command line and its ancestry, read from /proc while they are still there."""
    chain = []
    while pid > 0 and len(chain) < 8:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/status") as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            chain.append(f"{pid} (gone)")
            break
        chain.append(f"{pid} {command[:300]!r}")
        pid = ppid
    return "\n    <- ".join(chain)


def _name_sigterm_senders() -> None:
    """In the xdist controller: report who sends it SIGTERM, then end by it as before.

    SIGTERM is blocked in this process and a thread takes it with ``sigwaitinfo``, which gives
    the sender's pid; the workers, which inherit the mask through exec, unblock it when they
    start (:func:`pytest_configure`).  Sent again to the thread that took it, SIGTERM then does
    what it did before (the default: end the process)."""
    if not (sys.platform.startswith("linux") and hasattr(signal, "sigwaitinfo")):
        return
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        info = signal.sigwaitinfo({signal.SIGTERM})
        sys.__stderr__.write(f"\n[pytest controller {os.getpid()}] SIGTERM from uid {info.si_uid}, pid "
                             f"{_describe_process(info.si_pid)}\n")
        sys.__stderr__.flush()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=wait, name="sigterm-sender", daemon=True).start()


def _release_controller_pipes_in_forks(config: pytest.Config) -> None:
    """In an xdist worker: a process forked from it lets go of the worker's pipes to the controller.

    A plain ``fork()`` (RADICAL-Pilot forks its proxy so; any ``multiprocessing`` fork child) keeps
    every fd of the worker: the two pipes of its execnet gateway, and the worker's own stdout and
    stderr, which pytest keeps at other numbers while it captures (and faulthandler once more).  When
    the worker then ends (pytest-timeout's ``os._exit`` at a test's time limit), the controller waits
    for end of file on pipes that the orphaned fork still holds: on CI one RP run past its limit held
    gw0's pipes for forty minutes, and the controller reported neither a crash nor a result until then.

    In a child forked directly from the worker, every fd open on one of those files is pointed at
    /dev/null (not closed: the file objects that hold them keep their numbers, so nothing later closes
    a number reused for another file).  A grandchild is left alone: its parent's numbers are its own."""
    import gc
    import stat

    try:
        from execnet.gateway_base import Popen2IO
    except ImportError:
        return
    fds = {f.fileno() for obj in gc.get_objects() if isinstance(obj, Popen2IO) for f in (obj.infile, obj.outfile)}
    capturing = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing", None)
    for capture in (getattr(capturing, "out", None), getattr(capturing, "err", None)):
        saved = getattr(capture, "targetfd_save", None)
        if isinstance(saved, int):
            fds.add(saved)
    held = set()
    for fd in fds:
        info = os.fstat(fd)
        if not (stat.S_ISCHR(info.st_mode) or stat.S_ISREG(info.st_mode)):  # /dev/null, a log file: harmless
            held.add((info.st_dev, info.st_ino))
    worker = os.getpid()

    def release() -> None:
        if os.getppid() != worker:
            return
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                try:
                    info = os.fstat(fd)
                except OSError:
                    continue
                if fd != devnull and (info.st_dev, info.st_ino) in held:
                    os.dup2(devnull, fd)
        finally:
            os.close(devnull)

    if held and os.path.isdir("/proc/self/fd"):
        os.register_at_fork(after_in_child=release)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked in the controller
        _release_controller_pipes_in_forks(config)
    elif getattr(config.option, "numprocesses", None) and not UNDER_MPIEXEC:
        _name_sigterm_senders()
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A non-interactive shell starts a background job (`.ci/run &`) with SIGINT ignored, every child
        # inherits that, and the tests that press Ctrl-C on hetflow (run, serve, spill) then wait for ever.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    runtime = tempfile.mkdtemp(prefix="hetflow-tests-xdg-")  # 0700, as the core ledger requires
    config.stash[_RUNTIME_DIR] = (os.environ.get("XDG_RUNTIME_DIR"), runtime)
    os.environ["XDG_RUNTIME_DIR"] = runtime
    if UNDER_MPIEXEC:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            # keep the other ranks quiet; rank 0 reports for everyone
            config.option.verbose = -1
            sys.stdout = open(os.devnull, "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    before, runtime = config.stash[_RUNTIME_DIR]
    if before is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = before
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    _fail_missing_component(report)
    if UNDER_MPIEXEC and report.failed and _world_size() > 1:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        sys.__stderr__.write(f"\n[rank {rank}] {item.nodeid} failed:\n{report.longreprtext}\n")
        sys.__stderr__.flush()
        MPI.COMM_WORLD.Abort(1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``HETFLOW_TEST_TIMELOG=FILE``: append each phase of each test to FILE as it ends (seconds since the
    epoch, worker, phase, outcome, duration, test id; tab-separated), from every xdist worker and, under mpiexec,
    from rank 0 only.  What a whole run of the suite spends where, readable while it goes and after a CI-like
    run is stopped (``--durations`` prints only at the end)."""
    path = os.environ.get("HETFLOW_TEST_TIMELOG")
    if not path or (UNDER_MPIEXEC and os.environ.get("PMI_RANK", "0") != "0"):
        return
    if getattr(report, "node", None) is not None:  # in the xdist controller: a worker's report, written there
        return
    import time

    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(path, "a") as log:
        log.write(f"{time.time():.1f}\t{worker}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\t"
                  f"{report.nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_missing_component(outcome.get_result())


@pytest.fixture
def comm():  # type: ignore[no-untyped-def]
    """A private duplicate of the world communicator (tests never use COMM_WORLD directly)."""
    from mpi4py import MPI

    dup = MPI.COMM_WORLD.Dup()
    yield dup
    dup.Free()


# ---------------------------------------------------------------- parallel runs (pytest-xdist)
MAX_WORKERS = 4
SHARED_GROUPS = {
    "tests/slurm/": "slurm",
    # the files that start RADICAL-Pilot sessions: one at a time (concurrent ones not shown safe).  The lab
    # cluster's RP case (tests/slurm/test_engines_on_slurm.py) starts one too: the slurm group is handed out first
    # and this one last, so they do not meet (on CI, RP's run on the lab cluster once failed in its set-up, after
    # 339 s at load 27, while a local RP session ran beside it).  An RP case of a suite every engine runs is in a
    # *_radical.py file of its own, so the other engines' cases are not in the group.
    "tests/backends/test_conformance_radical.py": "radical",
    "tests/backends/test_engines_radical.py": "radical",
    "tests/backends/test_interrupt_radical.py": "radical",
    "tests/backends/test_radical_raptor.py": "radical",
    "tests/backends/test_radical_shipped.py": "radical",
}
"""Test files (or folders, ending in /) that share one group, by the group's name."""


def group_of(nodeid: str) -> str:
    """The group of a test id: the one :data:`SHARED_GROUPS` gives its file, else the file."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_GROUPS.items():
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return group
    return path


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads a bare -n as --dist load
def pytest_cmdline_main(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadfile"


@pytest.hookimpl(optionalhook=True)  # the hooks of pytest-xdist, absent without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU and one more (the serial tests mostly wait for the processes they
    start), at most :data:`MAX_WORKERS`; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) + 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``: one work unit per group (:func:`group_of`), in the workers' order."""
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems chose
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a ``slurm`` test outside its group; in an xdist worker, order the groups by how many
    of their tests are marked ``slow``, the lab cluster's group first and the RP files' last."""
    for item in items:
        if item.get_closest_marker("slurm") is not None and group_of(item.nodeid) != "slurm":
            raise pytest.UsageError(f"{item.nodeid} is marked slurm but is not in tests/slurm/, whose tests "
                                    "run in one xdist worker that starts the lab cluster once")
    if not hasattr(config, "workerinput"):
        return
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)

    def cost(name: str) -> tuple[int, int]:
        return {"slurm": -1, "radical": 1}.get(name, 0), -sum(i.get_closest_marker("slow") is not None
                                                               for i in groups[name])

    items[:] = [item for name in sorted(groups, key=cost) for item in groups[name]]
