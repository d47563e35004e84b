"""Run one task's launcher command where an engine put us, and report how it ended.

The Dask and Parsl backends ship a :class:`RankRun` to a worker of their
engine; :func:`run_ranks` then starts the launcher (``mpiexec``/``srun``/
``jsrun`` argv, never a shell string) in a new session, waits for it, and kills
the whole process group on timeout or when the task's *cancel file* appears.
A cancel file rather than an engine call because neither Dask nor Parsl can
stop a running task; the run directory is on the file system the workers see
(where the datasets go too).

:func:`run_rank` starts ONE rank's command without a launcher (the Dask
backend's TCP mode, where every rank is its own engine task): it also stops
when the task's *abort file* appears, and creates that file when its rank
fails, so the other ranks of the task never wait for a dead one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..launchers.mpiexec import launcher_for
from ..launchers.srun import SrunStep, step_env
from ..scheduler import RankSlot

if TYPE_CHECKING:
    from .base import LaunchSpec

log = logging.getLogger(__name__)

POLL = 0.1
"""Seconds between checks of the process, the deadline and the cancel file."""

KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL of a task's process group."""


@dataclass(frozen=True)
class RankRun:
    """Everything a remote engine worker needs to start one task (picklable, no handles)."""

    task_id: str
    command: tuple[str, ...]
    slots: tuple[RankSlot, ...]
    launcher: str
    cwd: str
    cancel_file: str
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None
    stdout: str | None = None
    stderr: str | None = None
    launcher_executable: str | None = None
    abort_file: str | None = None
    """One rank of a task started alone (:func:`run_rank`): stop when this file appears."""

    @classmethod
    def of(cls, spec: "LaunchSpec", launcher: str, cancel_file: Path) -> "RankRun":
        """What an engine worker needs to run ``spec`` (paths as strings: it crosses processes)."""
        return cls(task_id=spec.task_id, command=tuple(spec.argv), slots=spec.slots, launcher=launcher,
                   cwd=str(spec.cwd), cancel_file=str(cancel_file), env=dict(spec.env), timeout=spec.timeout,
                   stdout=None if spec.stdout is None else str(spec.stdout),
                   stderr=None if spec.stderr is None else str(spec.stderr))


def find_executable(name: str) -> str:
    """``name`` next to this Python first (a venv's ``mpiexec``), then on ``PATH``."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"launcher {name!r} is neither next to {sys.executable} nor on PATH")
    return found


def launch_argv(run: RankRun, hosts: Sequence[str]) -> list[str]:
    """The launcher argv for ``run`` with ``hosts[slot.node]`` naming each node.

    ``srun`` runs inside the engine's batch job (Parsl's block, RP's pilot job): there the task is
    one job step exactly like the ``slurm`` backend's (:class:`SrunStep`: the slots' ranks per node,
    ``--exact``, PMI-2, ``--kill-on-bad-exit``), named as that backend names its steps.
    """
    executable = run.launcher_executable or find_executable(run.launcher)
    if run.launcher == "srun":
        return SrunStep(executable, job_name=f"hetflow-{safe_name(run.task_id)}").argv(run.command, run.slots, hosts)
    return launcher_for(run.launcher, executable).argv(run.command, run.slots, hosts)


def _kill_group(proc: "subprocess.Popen[bytes]", grace: float = KILL_GRACE) -> None:
    """SIGTERM to ``proc``'s session, SIGKILL after ``grace`` seconds; return once it ended."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_ranks(run: RankRun, hosts: Sequence[str] | None = None) -> dict[str, Any]:
    """Start ``run`` and wait; the result has the fields of :class:`TaskOutcome`.

    ``hosts`` names the nodes (default: every slot on ``localhost``).
    """
    if hosts is None:
        hosts = ["localhost"] * (max((s.node for s in run.slots), default=0) + 1)
    return run_argv(run, launch_argv(run, hosts), srun_step=run.launcher == "srun")


def run_rank(run: RankRun) -> dict[str, Any]:
    """Start one rank's command itself (no launcher); a failure creates ``run.abort_file``."""
    result = run_argv(run, list(run.command))
    if run.abort_file and (result["returncode"] or result["timed_out"]) and not result.get("aborted"):
        Path(run.abort_file).touch()  # the other ranks of this task stop now
    return result


def run_argv(run: RankRun, argv: list[str], *, srun_step: bool = False) -> dict[str, Any]:
    """Run ``argv`` in a new session until it ends, times out, or is cancelled (or aborted).

    ``srun_step``: ``argv`` is a job step's ``srun``, which gets :func:`step_env` (the batch
    script's layout options dropped, MPICH's netmod for Slurm's PMI).
    """
    if srun_step:
        env = step_env(os.environ, run.env)
    else:
        env = dict(os.environ)
        env.update(run.env)
    # The venv's bin first, so the launcher finds the same Python and MPI.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cancel_file = Path(run.cancel_file)
    abort_file = Path(run.abort_file) if run.abort_file else None
    result: dict[str, Any] = {"task_id": run.task_id, "returncode": None, "timed_out": False,
                              "cancelled": False, "signal": None, "detail": "", "argv": argv}
    if cancel_file.exists():
        result.update(cancelled=True, detail="cancelled before start")
        return result
    out = open(run.stdout, "ab") if run.stdout else subprocess.DEVNULL
    err = open(run.stderr, "ab") if run.stderr else subprocess.DEVNULL
    try:
        result["started"] = time.time()
        proc = subprocess.Popen(argv, cwd=run.cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        deadline = None if run.timeout is None else time.monotonic() + run.timeout
        while True:
            try:
                proc.wait(POLL)
                break
            except subprocess.TimeoutExpired:
                pass
            if cancel_file.exists():
                result.update(cancelled=True, detail="cancelled")
                _kill_group(proc)
                break
            if abort_file is not None and abort_file.exists():
                result.update(aborted=True, detail="stopped: another rank of the task failed")
                _kill_group(proc)
                break
            if deadline is not None and time.monotonic() > deadline:
                result.update(timed_out=True, detail=f"timed out after {run.timeout} s")
                _kill_group(proc)
                break
        result["ended"] = time.time()
    finally:
        for handle in (out, err):
            if handle is not subprocess.DEVNULL:
                handle.close()  # type: ignore[union-attr]
    code = proc.returncode
    if code is not None and code < 0:
        result["signal"] = -code
    result["returncode"] = code
    if code and not result["detail"]:
        result["detail"] = f"{argv[0]} exited with {code}"
    return result


def outcome_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of a :func:`run_ranks` result that :class:`TaskOutcome` takes."""
    from .base import TaskOutcome

    names = {f.name for f in dataclasses.fields(TaskOutcome)}
    return {k: v for k, v in result.items() if k in names}


def options_for(pilot: Any, backend: str, allowed: Sequence[str]) -> Mapping[str, Any]:
    """The ``options.<backend>`` section of a pilot, its keys checked against ``allowed``.

    Sections are per backend so one config can be rendered or run with several
    backends (``options: {parsl: {scheduler: slurm}, radical: {gpu_type: ROCm}}``).
    """
    from ..errors import ConfigError

    section = pilot.options.get(backend, {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"pilot {pilot.name!r}: 'options.{backend}' must be a mapping, got {section!r}")
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"pilot {pilot.name!r}: unknown option 'options.{backend}.{unknown[0]}' "
                          f"(allowed: {list(allowed)})")
    return section


def safe_name(task_id: str) -> str:
    """A file-name and engine-uid safe form of ``task_id`` (task ids may contain ``/``)."""
    import hashlib
    import re

    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", task_id)
    if clean == task_id:
        return clean
    return f"{clean}-{hashlib.sha1(task_id.encode()).hexdigest()[:8]}"


def stop_and_wait(entries: "list[Any]", timeout: float = 5.0) -> None:
    """At exit: touch every running task's cancel file (entry[-1]), then wait briefly for its future (entry[-2])."""
    for entry in entries:
        entry[-1].touch()  # the task kills its process group when it sees this file
    for entry in entries:
        try:
            entry[-2].result(timeout=timeout)
        except Exception:  # noqa: BLE001 - exiting; nothing to report to
            pass
