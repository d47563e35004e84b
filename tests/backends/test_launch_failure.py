"""A task whose launch fails ends FAILED at once, on every backend (``Backend.launch`` converts).

Before, an exception in a backend's ``launch`` reached the orchestrator's main loop and the
task stayed RUNNING forever.  Unit level here (backends not started: their own "not started"
error is a real launch failure, and no engine is needed); tests/backends/test_engines*.py
checks the same with started engines, and tests/slurm with a real allocation.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from hetflow.tasks.backends import backend_names, get_backend
from hetflow.tasks.backends.base import LaunchSpec, TaskOutcome
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.protocol import AttemptFiles, diagnose
from hetflow.tasks.scheduler import RankSlot


@pytest.mark.parametrize("name", backend_names())
def test_a_launch_that_raises_resolves_failed(name: str, tmp_path: Path) -> None:
    pilot = PilotDescription(name="unstarted", backend=name, cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**33)
    backend = get_backend(name)(pilot, tmp_path)  # start() never called: its launch cannot work
    spec = LaunchSpec(task_id="stage/1", argv=(sys.executable, "-c", "pass"), slots=(RankSlot(0, (0,)),),
                      cwd=tmp_path)
    future = backend.launch(spec)  # must not raise
    assert future.done()
    outcome = future.result(timeout=0)
    assert isinstance(outcome, TaskOutcome) and not outcome.launched and not outcome.ok
    assert outcome.task_id == "stage/1" and outcome.returncode is None
    assert outcome.detail.startswith(f"backend {name!r} could not launch it: "), outcome.detail
    assert "start" in outcome.detail, outcome.detail  # the backend's own reason: not started
    failure = diagnose("stage", None, outcome, [None], AttemptFiles(tmp_path), grace=1.0)
    assert failure is not None and failure.state == "FAILED"
    assert failure.message == f"stage 'stage' was not started: {outcome.detail}"


@pytest.mark.parametrize("slots, why", [((), "it has no rank slots"),
                                        ((RankSlot(0, (0,)), RankSlot(3, (0,))),
                                         "its slots name node(s) [3], but the pilot has 1 node(s) (0..0)")])
def test_a_spec_the_pilot_cannot_hold_is_refused_before_the_backend_sees_it(
        slots: tuple[RankSlot, ...], why: str, tmp_path: Path) -> None:
    pilot = PilotDescription(name="one-node", backend="local", cores_per_node=2, gpus_per_node=0)
    backend = get_backend("local")(pilot, tmp_path)
    backend.start()
    try:
        spec = LaunchSpec(task_id="t/1", argv=(sys.executable, "-c", "pass"), slots=slots, cwd=tmp_path)
        outcome = backend.launch(spec).result(timeout=0)
        assert not outcome.launched and outcome.detail == f"backend 'local' could not launch it: {why}"
    finally:
        backend.shutdown()


@pytest.mark.timeout(300)
def test_a_real_dask_engine_that_refuses_the_task_fails_it(tmp_path: Path) -> None:
    """A started Dask backend whose client has gone away: ``submit`` raises inside ``_launch``."""
    pilot = PilotDescription(name="dask-gone", backend="dask", cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**33)
    (tmp_path / "run").mkdir(mode=0o700)
    backend = get_backend("dask")(pilot, tmp_path / "run")
    backend.start()
    try:
        backend._client.close()  # type: ignore[attr-defined]  # the engine's own failure, not a stand-in
        spec = LaunchSpec(task_id="t/1", argv=(sys.executable, "-c", "pass"), slots=(RankSlot(0, (0,)),),
                          cwd=tmp_path)
        outcome = backend.launch(spec).result(timeout=0)
        assert not outcome.launched and outcome.detail.startswith("backend 'dask' could not launch it: "), outcome
        assert "not started" not in outcome.detail, outcome  # the engine refused, not the backend
    finally:
        backend.shutdown()


@pytest.mark.timeout(180)
def test_a_run_whose_launch_fails_ends_with_the_stage_failed(tmp_path: Path) -> None:
    """The orchestrator records a task it could not launch FAILED, and the run ends (it used to wait forever)."""
    import hetflow as hf
    import hetflow.tasks.backends as hb
    from hetflow.tasks.backends.local import LocalBackend

    sys.path.insert(0, str(Path(__file__).parent))
    import launch_failure_stages as S

    class NoDevice(LocalBackend):
        """The local backend, whose launch of stage ``second`` fails the way a lost device node would."""

        def _launch(self, spec: LaunchSpec) -> Future[TaskOutcome]:
            if "/second/" in spec.task_id:
                raise OSError(19, "No such device", "/dev/accel0")
            return super()._launch(spec)

    pipe = hf.Pipeline("launchfail", workdir=tmp_path)
    pipe.stage(outputs=["rows"])(S.first)
    pipe.stage(inputs=["rows"], outputs=["out"])(S.second)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hb, "get_backend", lambda name: NoDevice)  # looked up when the run starts
        run = pipe.run(pilot=hf.PilotDescription(name="one", backend="local", cores_per_node=2, gpus_per_node=0,
                                                 memory_per_node=2**33), check=False)
    stages = {s.name: s for s in run.stages}
    assert run.state == "FAILED" and stages["first"].state == "DONE", stages
    assert stages["second"].state == "FAILED", stages
    assert stages["second"].error == ("stage 'second' was not started: backend 'local' could not launch it: "
                                      "OSError: [Errno 19] No such device: '/dev/accel0'"), stages["second"].error
