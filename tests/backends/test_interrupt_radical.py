"""Ctrl-C in a script that uses the radical backend (test_interrupt.py's test on RADICAL-Pilot): nothing of RP
or the task may survive it.

A file of its own so that it is in the xdist group of the files that start RP sessions (one at a time,
tests/conftest.py) while the other engines' cases, in test_interrupt.py, go to any worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_interrupt import ctrl_c_leaves_no_process


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["radical"])
def test_ctrl_c_leaves_no_process(backend: str, tmp_path: Path) -> None:
    ctrl_c_leaves_no_process(backend, tmp_path)
