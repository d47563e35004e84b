"""The conformance suite of test_conformance.py on RADICAL-Pilot: the same tests, against one RP run.

A file of its own so that it is in the xdist group of the files that start RP sessions (one at a time,
tests/conftest.py) while the other engines' runs, in test_conformance.py, go to any worker.
"""

from __future__ import annotations

from typing import Any

import pytest

from test_conformance import reference, run_on  # noqa: F401  (reference: the local run, a module fixture)
from test_conformance import (  # noqa: F401  (collected here against the RP run; in test_conformance.py's order)
    test_same_datasets_as_local,
    test_same_state_transitions,
    test_same_error_for_the_failing_stage,
    test_clean_shutdown,
)

pytestmark = pytest.mark.slow  # RP starts a pilot for the run


@pytest.fixture(scope="module", params=["radical"])
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_on(request.param, tmp_path_factory.mktemp(request.param))
