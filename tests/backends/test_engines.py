"""Each backend with a real session of its engine, driven through the Backend contract.

One started backend per engine for the whole module (RP takes ~30 s to start a
pilot).  Tasks are real MPI programs started on slots the test chooses, as
the pilot's scheduler would; every backend must give the same outcomes, and
leave no process behind after ``shutdown()``.

RADICAL-Pilot's engine is in test_engines_radical.py, which collects these tests against it: the files that start
RP sessions share one xdist group (tests/conftest.py), and the other engines need not wait in it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from _procs import alive as _alive
from hetflow.tasks.backends import get_backend
from hetflow.tasks.backends.base import Backend, LaunchSpec
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot

BACKENDS = [
    "local",
    "dask",
    pytest.param("parsl", marks=pytest.mark.slow),
]  # and "radical": test_engines_radical.py

MPI_PROGRAM = """
import json, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1)
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as fh:
    json.dump({"rank": rank, "size": size, "total": total, "env": os.environ.get("HETFLOW_TEST_ENV"),
               "cwd": os.getcwd(), "pid": os.getpid()}, fh)
print(f"rank {rank} of {size}")
"""


class Engine:
    def __init__(self, backend: Backend, root: Path) -> None:
        self.backend = backend
        self.root = root
        self.count = 0

    def spec(self, argv: list[str], slots: list[RankSlot], **kwargs: Any) -> LaunchSpec:
        self.count += 1
        cwd = self.root / f"task-{self.count}"
        cwd.mkdir(mode=0o700)
        return LaunchSpec(task_id=f"run/stage-{self.count}/1", argv=tuple(argv), slots=tuple(slots), cwd=cwd,
                          stdout=cwd / "stdout", stderr=cwd / "stderr", **kwargs)


def _mpi(engine: Engine, slots: list[RankSlot], **kwargs: Any) -> LaunchSpec:
    probe = engine.spec([], slots)  # for the directory only
    return LaunchSpec(task_id=probe.task_id, argv=(sys.executable, "-c", MPI_PROGRAM, str(probe.cwd)),
                      slots=probe.slots, cwd=probe.cwd, stdout=probe.stdout, stderr=probe.stderr, **kwargs)


def started(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A started backend of engine ``name`` for a module's tests; stopped after them, checking it left no process."""
    root = tmp_path_factory.mktemp(name)
    pilot = PilotDescription(name="engine-test", backend=name, cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**33)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    backend = get_backend(name)(pilot, root / "run")
    (root / "run").mkdir(mode=0o700)
    backend.start()
    yield Engine(backend, root)
    seen = set(getattr(backend, "pids", lambda: [])())
    seen |= {p.pid for p in psutil.Process().children(recursive=True)} - before
    backend.shutdown()
    leftovers = _alive(seen)
    assert leftovers == [], f"{name} left processes behind: {leftovers}"
    assert _alive({p.pid for p in psutil.Process().children(recursive=True)} - before) == []


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from started(request.param, tmp_path_factory)


# The limits here (and in test_engines_radical.py) guard against a hang, nothing more: the first test's limit covers
# its engine's start too, and on the slow two-core machine under three test workers an RP pilot's start, one task
# and its stop took 183 s where they take 43 s alone.
@pytest.mark.timeout(900)
def test_mpi_task_on_two_slots(engine: Engine) -> None:
    spec = _mpi(engine, [RankSlot(0, (0,)), RankSlot(0, (1,))], env={"HETFLOW_TEST_ENV": "yes"})
    outcome = engine.backend.launch(spec).result(timeout=300)
    assert outcome.ok, outcome
    assert outcome.task_id == spec.task_id and outcome.returncode == 0
    assert outcome.started is not None and outcome.ended is not None and outcome.ended >= outcome.started
    ranks = [json.loads((spec.cwd / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["size"] for r in ranks} == {2} and {r["total"] for r in ranks} == {3}  # one MPI world
    assert {r["env"] for r in ranks} == {"yes"}
    assert {Path(r["cwd"]).resolve() for r in ranks} == {spec.cwd.resolve()}
    out = spec.stdout.read_text()  # both ranks' lines, possibly interleaved by the launcher
    assert "rank 0 of 2" in out and "rank 1 of 2" in out


@pytest.mark.timeout(900)
def test_two_tasks_at_once_on_disjoint_slots(engine: Engine) -> None:
    program = "import time, os, sys; open(sys.argv[1], 'w').write(f'{time.time()} '); time.sleep(2); " \
              "open(sys.argv[1], 'a').write(f'{time.time()}')"
    specs = []
    for core in (0, 1):
        probe = engine.spec([], [RankSlot(0, (core,))])
        specs.append(LaunchSpec(task_id=probe.task_id, argv=(sys.executable, "-c", program, str(probe.cwd / "t")),
                                slots=probe.slots, cwd=probe.cwd))
    futures = [engine.backend.launch(s) for s in specs]
    outcomes = [f.result(timeout=300) for f in futures]
    assert all(o.ok for o in outcomes), outcomes
    spans = [tuple(map(float, (s.cwd / "t").read_text().split())) for s in specs]
    assert max(a for a, _ in spans) < min(b for _, b in spans)  # they overlapped in time


@pytest.mark.timeout(900)
def test_failing_task_reports_its_exit_code(engine: Engine) -> None:
    spec = engine.spec([sys.executable, "-c", "import sys; sys.stderr.write('bad input\\n'); sys.exit(3)"],
                       [RankSlot(0, (0,))])
    outcome = engine.backend.launch(spec).result(timeout=300)
    assert not outcome.ok and not outcome.timed_out and not outcome.cancelled
    assert outcome.returncode == 3
    assert "bad input" in spec.stderr.read_text()


@pytest.mark.timeout(900)
def test_timeout_kills_the_task(engine: Engine) -> None:
    spec = engine.spec([sys.executable, "-c", "import os, sys, time; open('pid', 'w').write(str(os.getpid())); "
                        "time.sleep(120)"], [RankSlot(0, (0,))], timeout=3)
    started = time.monotonic()
    outcome = engine.backend.launch(spec).result(timeout=300)
    assert outcome.timed_out and not outcome.ok, outcome
    assert time.monotonic() - started < 60
    pid = int((spec.cwd / "pid").read_text())
    gone = time.monotonic() + 15  # as for a cancel: RP reports the timeout once its agent has sent the kill
    while _alive({pid}) and time.monotonic() < gone:
        time.sleep(0.2)
    assert _alive({pid}) == []


@pytest.mark.timeout(900)
def test_cancel_kills_a_running_task(engine: Engine) -> None:
    spec = engine.spec([sys.executable, "-c", "import os, time; open('pid', 'w').write(str(os.getpid())); "
                        "time.sleep(120)"], [RankSlot(0, (0,))])
    future = engine.backend.launch(spec)
    deadline = time.monotonic() + 60
    while not (spec.cwd / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # the pid file is written; the rank is in its sleep
    engine.backend.cancel(spec.task_id)
    outcome = future.result(timeout=60)
    assert outcome.cancelled and not outcome.ok, outcome
    pid = int((spec.cwd / "pid").read_text())
    gone = time.monotonic() + 15  # RP reports CANCELED once its agent has sent the kill; the process ends just after
    while _alive({pid}) and time.monotonic() < gone:
        time.sleep(0.1)
    assert _alive({pid}) == []
    engine.backend.cancel("no-such-task")  # unknown ids are ignored


@pytest.mark.timeout(900)
def test_node_names_cover_the_pilot(engine: Engine) -> None:
    names = engine.backend.node_names()
    assert len(names) == engine.backend.pilot.nodes and all(isinstance(n, str) and n for n in names)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["dask", pytest.param("parsl", marks=pytest.mark.slow)])  # radical: *_radical.py
def test_task_spanning_two_nodes(name: str, tmp_path: Path) -> None:
    """A two-node pilot on this host (one Dask worker / Parsl node-file entry / RP node per node)."""
    spanning_two_nodes(name, tmp_path)


def spanning_two_nodes(name: str, tmp_path: Path) -> None:
    """An MPI task with one rank on each node of a two-node pilot of engine ``name``: one MPI world."""
    pilot = PilotDescription(name="two-nodes", backend=name, nodes=2, cores_per_node=1,  # type: ignore[arg-type]
                             gpus_per_node=0, memory_per_node=2**33)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    backend = get_backend(name)(pilot, run)
    backend.start()
    try:
        assert len(backend.node_names()) == 2
        engine = Engine(backend, tmp_path)
        spec = _mpi(engine, [RankSlot(0, (0,)), RankSlot(1, (0,))])
        outcome = backend.launch(spec).result(timeout=300)
        assert outcome.ok, (outcome, spec.stderr.read_text() if spec.stderr.exists() else "")
        ranks = [json.loads((spec.cwd / f"rank-{r}.json").read_text()) for r in range(2)]
        assert {r["size"] for r in ranks} == {2} and {r["total"] for r in ranks} == {3}
        seen = set(getattr(backend, "pids", lambda: [])())
    finally:
        backend.shutdown()
    assert _alive(seen | ({p.pid for p in psutil.Process().children(recursive=True)} - before)) == []
