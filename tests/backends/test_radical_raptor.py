"""The radical backend with ``options.radical.raptor: true``: stages as Raptor MPI function tasks.

One real RP session and pilot (3 cores, so a 3-rank stage fits) for the whole
module: starting one takes ~25 s.  Pipelines run on it through the public
``Pipeline.run`` API; only the backend factory is pointed at the shared,
already started backend.  Every stage result is compared with the local
backend's (content hashes), every rank record must show it ran inside the
Raptor pool (not a fallback ``mpiexec``), and the module ends by shutting the
backend down and checking by PID that nothing is left.  The Ctrl-C test needs a
client it can interrupt, so it starts its own pilot in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator

import psutil
import pyarrow as pa
import pytest

import conformance_stages as S
from _procs import alive as _alive
import hetflow as hf
import hetflow.tasks.backends as hb
from hetflow.tasks.backends.base import Backend, LaunchSpec, TaskOutcome
from hetflow.tasks.backends.radical import RadicalBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CORES = 3


# ------------------------------------------------------------- stage functions
def probe(ctx, rows):
    """What the stage's communicator looks like from inside (one row per rank)."""
    from mpi4py import MPI

    total = ctx.comm.allreduce(rows.num_rows)
    return {"probe": pa.table({
        "rank": [ctx.rank], "size": [ctx.size], "comm_size": [ctx.comm.Get_size()],
        "world_size": [MPI.COMM_WORLD.Get_size()], "rows_total": [total],
        "is_world": [MPI.Comm.Compare(ctx.comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT)],
        "ranks_seen": [json.dumps(ctx.comm.allgather(ctx.rank))],
    })}


def sort_as(ctx, rows):
    """The conformance suite's distributed sample sort, writing to the output named in params."""
    return {ctx.params["output"]: S.sort_rows(ctx, rows)["sorted"]}


def sleepy(ctx, rows):
    import time

    time.sleep(120)
    return {"never": rows}


def fail_soon(ctx, rows):
    import time

    time.sleep(1)
    return S.fail_on_rank_one(ctx, rows)


def bystander(ctx, rows):
    import time

    time.sleep(5)
    return {"kept": rows}


def fail_on_rank_zero(ctx, rows):
    raise ValueError(f"boom on rank {ctx.rank} with {rows.num_rows} rows")


# ------------------------------------------------------------------- helpers
def _pilot(backend: str) -> hf.PilotDescription:
    options = {"radical": {"raptor": True}} if backend == "radical" else {}
    return hf.PilotDescription(name="raptor-test", backend=backend, cores_per_node=CORES, gpus_per_node=0,
                               memory_per_node=2**34, options=options)


def _hash(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


class Shared(Backend):
    """Hands the pipeline the module's started RP backend; start/shutdown are the fixture's."""

    name = "radical"
    engine: RadicalBackend

    def start(self) -> None:
        pass

    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        return self.engine.launch(spec)

    def cancel(self, task_id: str) -> None:
        self.engine.cancel(task_id)

    def shutdown(self) -> None:
        pass

    def node_names(self) -> list[str]:
        return self.engine.node_names()


PREEXISTING: set[int] = set()  # this worker's children from other tests (an S3 server, a resource tracker)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RadicalBackend]:
    run_dir = tmp_path_factory.mktemp("raptor-engine") / "run"
    run_dir.mkdir(mode=0o700)
    backend = RadicalBackend(_pilot("radical"), run_dir)
    PREEXISTING.update(p.pid for p in psutil.Process().children(recursive=True))
    backend.start()
    yield backend
    backend.shutdown()  # a no-op when test_clean_shutdown already did it


def _run(pipe: hf.Pipeline, backend: str, engine: RadicalBackend | None, workdir: Path) -> Any:
    if backend == "local":
        return pipe.run(pilot=_pilot("local"), workdir=workdir, check=False)
    assert engine is not None
    Shared.engine = engine
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hb, "get_backend", lambda name: Shared)  # looked up when the run starts
        return pipe.run(pilot=_pilot("radical"), workdir=workdir, check=False)


def _stage_dirs(workdir: Path, run_id: str, stage: str) -> list[dict[str, Any]]:
    attempt = workdir / "runs" / run_id / "stages" / stage / "attempt-1"
    return [json.loads(p.read_text()) for p in sorted(attempt.glob("rank-*.json"))]


def _operators(workdir: Path) -> hf.Pipeline:
    pipe = hf.Pipeline("raptor-operators", workdir=workdir)
    pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 300})(S.generate)
    for ranks in (1, 2, 3):
        pipe.stage(name=f"sort{ranks}", ranks=ranks, inputs=["rows"], outputs=[f"sorted{ranks}"],
                   params={"output": f"sorted{ranks}"})(sort_as)
    return pipe


# --------------------------------------------------------------------- tests
def test_operator_stages_of_1_2_3_ranks_match_local(engine: RadicalBackend, tmp_path: Path) -> None:
    reference = _run(_operators(tmp_path / "local"), "local", None, tmp_path / "local")
    raptor = _run(_operators(tmp_path / "raptor"), "radical", engine, tmp_path / "raptor")
    assert {s.name: s.state for s in raptor.stages} == {s.name: s.state for s in reference.stages} \
        == {"generate": "DONE", "sort1": "DONE", "sort2": "DONE", "sort3": "DONE"}
    for name in ("rows", "sorted1", "sorted2", "sorted3"):
        assert _hash(raptor.dataset(name).to_table()) == _hash(reference.dataset(name).to_table()), name
        assert [_hash(p) for p in raptor.dataset(name).partitions()] == \
            [_hash(p) for p in reference.dataset(name).partitions()], name
    ordered = raptor.dataset("sorted3").to_table().column("key").to_pylist()
    assert ordered == sorted(ordered) and len(ordered) == 600
    pool = engine._pools[0]
    for stage, ranks in (("generate", 2), ("sort1", 1), ("sort2", 2), ("sort3", 3)):
        records = _stage_dirs(tmp_path / "raptor", raptor.id, stage)
        assert [r["rank"] for r in records] == list(range(ranks))
        assert {r["size"] for r in records} == {ranks}
        # ran inside the Raptor pool's worker (a fallback mpiexec would have no pool record)
        assert {r["raptor"]["worker"] for r in records} == {pool.worker}, records
        assert {r["raptor"]["pool_size"] for r in records} == {CORES}
        assert len({r["raptor"]["pool_rank"] for r in records}) == ranks


def test_each_stage_sees_a_private_communicator_of_its_own_size(engine: RadicalBackend, tmp_path: Path) -> None:
    pipe = hf.Pipeline("raptor-probe", workdir=tmp_path)
    pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 50})(S.generate)
    pipe.stage(name="probe2", ranks=2, inputs=["rows"], outputs=["probe"])(probe)
    run = _run(pipe, "radical", engine, tmp_path)
    assert run.state == "DONE", [(s.name, s.state, s.error) for s in run.stages]
    table = run.dataset("probe").to_table().sort_by("rank").to_pylist()
    assert [r["rank"] for r in table] == [0, 1]
    assert {r["size"] for r in table} == {r["comm_size"] for r in table} == {2}
    assert {r["world_size"] for r in table} == {CORES}  # the pool is bigger than the stage ...
    assert not any(r["is_world"] for r in table)  # ... and the stage never gets its world
    assert {r["rows_total"] for r in table} == {100}
    assert {r["ranks_seen"] for r in table} == {json.dumps([0, 1])}


def _failing(workdir: Path, name: str, func: Any, ranks: int) -> hf.Pipeline:
    pipe = hf.Pipeline(name, workdir=workdir)
    pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 60})(S.generate)
    pipe.stage(name="fails", ranks=ranks, inputs=["rows"], outputs=["never"])(func)
    pipe.stage(name="after_failure", ranks=1, inputs=["never"], outputs=["after"])(S.sort_rows)
    return pipe


@pytest.mark.parametrize("ranks, func", [(1, fail_on_rank_zero), (2, S.fail_on_rank_one)],
                         ids=["one-rank", "two-ranks"])
def test_failing_stage_gives_the_same_error_and_the_pool_carries_on(engine: RadicalBackend, tmp_path: Path,
                                                                    ranks: int, func: Any) -> None:
    reference = _run(_failing(tmp_path / "local", "raptor-fail", func, ranks), "local", None, tmp_path / "local")
    before = engine._pools[0]
    failed = _run(_failing(tmp_path / "raptor", "raptor-fail", func, ranks), "radical", engine, tmp_path / "raptor")
    expected, got = reference.stage("fails"), failed.stage("fails")
    assert got.state == expected.state == "FAILED"
    assert got.failed_rank == expected.failed_rank
    assert "ValueError: boom on rank" in (got.error or "")
    assert got.error == expected.error
    assert {s.name: s.state for s in failed.stages} == {s.name: s.state for s in reference.stages}
    assert failed.state == reference.state == "FAILED"
    after = engine._pools[0]
    if ranks == 1:
        assert after is before  # a one-rank failure only fails its task
    else:
        assert after.generation > before.generation  # Abort ended the worker; a new one replaced it
    # the (same or replaced) pool runs the next pipeline
    again = _run(_operators(tmp_path / "again"), "radical", engine, tmp_path / "again")
    assert again.state == "DONE", [(s.name, s.state, s.error) for s in again.stages]
    records = _stage_dirs(tmp_path / "again", again.id, "sort3")
    assert {r["raptor"]["worker"] for r in records} == {engine._pools[0].worker}


def test_a_bystander_of_a_lost_pool_runs_again_and_succeeds(engine: RadicalBackend, tmp_path: Path) -> None:
    """A stage that shared the pool with a stage that aborted it is not failed: it runs again in the new pool."""

    def pipeline(workdir: Path) -> hf.Pipeline:
        pipe = hf.Pipeline("raptor-bystander", workdir=workdir)
        pipe.stage(ranks=2, outputs=["rows"], params={"rows_per_rank": 40})(S.generate)
        pipe.stage(name="fails", ranks=2, inputs=["rows"], outputs=["never"])(fail_soon)
        pipe.stage(name="bystander", ranks=1, inputs=["rows"], outputs=["kept"])(bystander)
        return pipe

    reference = _run(pipeline(tmp_path / "local"), "local", None, tmp_path / "local")
    before = engine._pools[0]
    run = _run(pipeline(tmp_path / "raptor"), "radical", engine, tmp_path / "raptor")
    assert {s.name: s.state for s in run.stages} == {s.name: s.state for s in reference.stages} \
        == {"generate": "DONE", "fails": "FAILED", "bystander": "DONE"}
    assert run.stage("fails").error == reference.stage("fails").error
    assert _hash(run.dataset("kept").to_table()) == _hash(reference.dataset("kept").to_table())
    after = engine._pools[0]
    assert after.generation > before.generation
    (record,) = _stage_dirs(tmp_path / "raptor", run.id, "bystander")
    assert record["raptor"]["worker"] == after.worker  # it ran (again) in the replacement pool


def test_timeout_replaces_the_pool_and_kills_the_stage(engine: RadicalBackend, tmp_path: Path) -> None:
    """A function cannot be killed inside a worker: the timed-out stage's pool is stopped and replaced."""
    import time

    def pipeline(workdir: Path) -> hf.Pipeline:
        pipe = hf.Pipeline("raptor-timeout", workdir=workdir)
        pipe.stage(ranks=1, outputs=["rows"], params={"rows_per_rank": 10})(S.generate)
        pipe.stage(name="slow", ranks=2, inputs=["rows"], outputs=["never"], timeout=3)(sleepy)
        return pipe

    reference = _run(pipeline(tmp_path / "local"), "local", None, tmp_path / "local")
    before = engine._pools[0]
    started = time.monotonic()
    run = _run(pipeline(tmp_path / "raptor"), "radical", engine, tmp_path / "raptor")
    assert time.monotonic() - started < 60
    assert run.stage("slow").state == reference.stage("slow").state == "TIMED_OUT"
    assert run.stage("slow").error == reference.stage("slow").error
    assert engine._pools[0].generation > before.generation
    attempt = tmp_path / "raptor" / "runs" / run.id / "stages" / "slow" / "attempt-1"
    pids = {int(p.read_text()) for p in attempt.glob("rank-*.pid")}
    assert len(pids) == 2
    deadline = time.monotonic() + 60
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(pids) == []  # the old worker's ranks are gone with their stage


def test_ineligible_launches_run_as_normal_rp_tasks(engine: RadicalBackend, tmp_path: Path) -> None:
    """An arbitrary program (not the hetflow worker entry point) still runs, as a plain RP task."""
    import sys

    from hetflow.tasks.backends.raptor import ineligible
    from hetflow.tasks.scheduler import RankSlot

    slots = (RankSlot(0, (0,)), RankSlot(0, (1,)))
    argv = (sys.executable, "-c", "import os; open('out', 'w').write(os.environ.get('PMI_SIZE', '?'))")
    assert ineligible(argv, slots, (0, 1, 2)) is not None
    assert ineligible((sys.executable, "-m", "hetflow.tasks.worker", "x.json"), slots, (0, 1, 2)) is None
    assert "GPUs" in (ineligible((sys.executable, "-m", "hetflow.tasks.worker", "x.json"),
                                 (RankSlot(0, (0,), (0,)),), (0, 1, 2)) or "")
    assert "4 ranks" in (ineligible((sys.executable, "-m", "hetflow.tasks.worker", "x.json"),
                                    tuple(RankSlot(0, (c,)) for c in (0, 1, 2, 0)), (0, 1, 2)) or "")
    cwd = tmp_path / "plain"
    cwd.mkdir(mode=0o700)
    outcome = engine.launch(LaunchSpec(task_id="plain/1", argv=argv, slots=slots, cwd=cwd)).result(timeout=300)
    assert outcome.ok, outcome
    assert (cwd / "out").read_text() == "2"  # its own mpiexec world of 2


def test_clean_shutdown_leaves_no_process(engine: RadicalBackend) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)} - PREEXISTING
    seen = set(engine.pids())
    workers = [p for p in seen if _is_raptor(p)]
    assert workers, "no Raptor master/worker process was recorded for the session"
    engine.shutdown()
    assert _alive(seen | before) == []


def _is_raptor(pid: int) -> bool:
    try:
        return any("radical-pilot-raptor" in part for part in psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False


INTERRUPTED = """
import json, signal, sys, time
from pathlib import Path
from hetflow.tasks.backends.base import LaunchSpec
from hetflow.tasks.backends.radical import RadicalBackend
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, also when started by CI
run_dir, attempt, tests = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
pilot = PilotDescription(name="interrupt", backend="radical", cores_per_node=2, gpus_per_node=0,
                         memory_per_node=2**33, options={"radical": {"raptor": True}})
backend = RadicalBackend(pilot, run_dir)
backend.start()
spec = {"run_id": "interrupt", "stage": "slow", "attempt": 1, "params": {}, "inputs": [],
        "function": {"module": "test_radical_raptor", "path": None, "name": "sleepy_alone"},
        "sys_path": [tests], "outputs": {}, "attempt_dir": str(attempt), "checkpoint_dir": str(attempt),
        "nodes": ["localhost"], "slots": [{"node": 0, "cores": [c], "gpus": []} for c in (0, 1)]}
(attempt / "spec.json").write_text(json.dumps(spec))
future = backend.launch(LaunchSpec(task_id="slow/1", argv=(sys.executable, "-m", "hetflow.tasks.worker",
                                   str(attempt / "spec.json")), slots=(RankSlot(0, (0,)), RankSlot(0, (1,))),
                                   cwd=attempt))
deadline = time.monotonic() + 120
while len(list(attempt.glob("rank-*.pid"))) < 2:
    if time.monotonic() > deadline:
        raise SystemExit("the stage never started")
    time.sleep(0.1)
print("READY", flush=True)
future.result()  # until interrupted; no shutdown() on purpose
"""


def sleepy_alone(ctx):
    import time

    time.sleep(600)


def test_ctrl_c_leaves_no_raptor_process(tmp_path: Path) -> None:
    """Ctrl-C while a stage runs in the pool: the exit hook ends agent, master, worker and stage ranks."""
    import signal
    import subprocess
    import sys

    run_dir, attempt = tmp_path / "run", tmp_path / "attempt"
    run_dir.mkdir(mode=0o700)
    attempt.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(run_dir), str(attempt), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
        ranks = {int(p.read_text()) for p in attempt.glob("rank-*.pid")}
        assert len(ranks) == 2 and len(_alive(ranks)) == 2  # the stage runs in the pool's worker ranks
        engine = _engine(proc.pid, str(run_dir))  # RP's agent is detached from the client
        assert any(_is_raptor(pid) for pid in engine), "no Raptor master/worker found"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed: do not leave the engine running either
            for pid in _engine(proc.pid, str(run_dir)) | {proc.pid}:
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait()
    assert _alive(ranks) == []
    assert _alive(engine) == []
    assert _engine(None, str(run_dir)) == set()


def _engine(client: int | None, marker: str) -> set[int]:
    """The client's descendants and every live process naming ``marker`` (with its descendants)."""
    roots = [psutil.Process(client)] if client is not None and psutil.pid_exists(client) else []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in p for p in proc.info["cmdline"] or []):
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = set()
    for root in roots:
        try:
            found |= {root.pid} | {c.pid for c in root.children(recursive=True)}
        except psutil.NoSuchProcess:
            continue
    found.discard(client or -1)
    return {pid for pid in found if _alive({pid})}
