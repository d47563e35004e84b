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
"""

from __future__ import annotations

import os
import sys

import pytest


def _world_size() -> int:
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


UNDER_MPIEXEC = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


def pytest_configure(config: pytest.Config) -> None:
    if UNDER_MPIEXEC:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            # keep the other ranks quiet; rank 0 reports for everyone
            config.option.verbose = -1
            sys.stdout = open(os.devnull, "w")


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
