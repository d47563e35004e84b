"""The engine tests of test_engines.py on RADICAL-Pilot: the same tests against one started RP backend, a
two-node RP pilot, and RP's own placement.

A file of its own so that it is in the xdist group of the files that start RP sessions (one at a time,
tests/conftest.py) while the other engines, in test_engines.py, go to any worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from hetflow.tasks.backends import get_backend
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot
from test_engines import Engine, _mpi, spanning_two_nodes, started
from test_engines import (  # noqa: F401  (collected here against the RP engine; in test_engines.py's order)
    test_mpi_task_on_two_slots,
    test_two_tasks_at_once_on_disjoint_slots,
    test_failing_task_reports_its_exit_code,
    test_timeout_kills_the_task,
    test_cancel_kills_a_running_task,
    test_node_names_cover_the_pilot,
)

pytestmark = pytest.mark.slow  # every test here starts an RP pilot or uses the module's


@pytest.fixture(scope="module", params=["radical"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from started(request.param, tmp_path_factory)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["radical"])
def test_task_spanning_two_nodes(name: str, tmp_path: Path) -> None:
    """A two-node pilot on this host (one RP node per node)."""
    spanning_two_nodes(name, tmp_path)


@pytest.mark.timeout(900)
def test_radical_can_leave_placement_to_rp(tmp_path: Path) -> None:
    """``options.radical.placement: rp``: no slots in the RP task, RP's scheduler places the ranks."""
    from hetflow.tasks.backends.radical import task_description

    pilot = PilotDescription(name="rp-places", backend="radical", cores_per_node=2, gpus_per_node=0,
                             memory_per_node=2**33, options={"radical": {"placement": "rp"}})
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    backend = get_backend("radical")(pilot, run)
    backend.start()
    try:
        engine = Engine(backend, tmp_path)
        spec = _mpi(engine, [RankSlot(0, (0,)), RankSlot(0, (1,))])
        assert "slots" not in task_description(spec, pilot, backend.node_names(), "x", tmp_path)
        outcome = backend.launch(spec).result(timeout=300)
        assert outcome.ok, outcome
        ranks = [json.loads((spec.cwd / f"rank-{r}.json").read_text()) for r in range(2)]
        assert {r["size"] for r in ranks} == {2}
    finally:
        backend.shutdown()
