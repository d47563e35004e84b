"""Ctrl-C in a script that uses a backend: nothing of the engine or the task may survive it.

The script never calls ``shutdown()``; the backend's exit hook must stop the
running task (its ranks) and the engine's processes (Dask scheduler/worker,
Parsl interchange/pool, RP agent).  Checked by PID and by command line.
RADICAL-Pilot's case is in test_interrupt_radical.py, in the xdist group of the files that start RP
sessions (tests/conftest.py); the other engines' cases need not wait in it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from _procs import alive as _alive

SCRIPT = Path(__file__).with_name("interrupt_script.py")


def _naming(marker: str) -> set[int]:
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in p for p in proc.info["cmdline"] or []):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["dask", "parsl"])  # and "radical": test_interrupt_radical.py
def test_ctrl_c_leaves_no_process(backend: str, tmp_path: Path) -> None:
    ctrl_c_leaves_no_process(backend, tmp_path)


def ctrl_c_leaves_no_process(backend: str, tmp_path: Path) -> None:
    """Ctrl-C to the script while its task runs on ``backend``: the ranks and the engine's processes are gone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), backend, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
        ranks = {int(p.read_text()) for p in (run_dir / "task").glob("pid-*")}
        assert len(ranks) == 2 and len(_alive(ranks)) == 2
        engine = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)} | _naming(str(run_dir))
        engine.discard(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed: do not leave the engine running either
            stray = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for pid in _naming(str(run_dir)):
                stray.append(psutil.Process(pid))
            for p in stray:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait()
    assert _alive(ranks) == []
    assert _alive(engine) == []
    assert _naming(str(run_dir)) == set()
