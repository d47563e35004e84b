"""Kill a 2-rank training stage after a checkpoint, rerun it, and see it resume.

Real processes: ``mpiexec -n 2`` runs tests/ml/ml_train_script.py; the first
run is SIGKILLed (whole process group) once a checkpoint is committed.  The
rerun must start from the epoch after the newest committed checkpoint, not
from scratch, and — RNG, optimizer and scheduler state restored — end with
exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.ipc as ipc
import pytest

torch = pytest.importorskip("torch")

import hetflow.ml as ml  # noqa: E402

SCRIPT = Path(__file__).with_name("ml_train_script.py")
MPIEXEC = Path(sys.executable).with_name("mpiexec")
EPOCHS = 6

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec beside python")]


def _argv(root: Path, pause: float, every: int) -> list[str]:
    return [str(MPIEXEC), "-n", "2", sys.executable, str(SCRIPT), str(root), str(EPOCHS), str(pause), str(every)]


def _run(root: Path, pause: float = 0.0, every: int = 0) -> None:
    subprocess.run(_argv(root, pause, every), check=True, timeout=180, env=os.environ | {"OMP_NUM_THREADS": "1"})


def _weights(root: Path) -> dict[str, object]:
    model, _ = ml.model_from_table(ipc.open_file(str(root / "model.arrow")).read_all())
    return model.state_dict()


STEPS_PER_EPOCH = 19  # 600 rows / 32 per global batch


def _kill_after_checkpoint(root: Path, every: int, min_step: int, mid_epoch: bool) -> tuple[int, int]:
    proc = subprocess.Popen(_argv(root, 0.03, every), start_new_session=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            latest = ml.latest_checkpoint(root / "ckpt")
            step = json.loads((latest / ml.COMMIT_MARKER).read_text())["step"] if latest else -1
            if step >= min_step and (not mid_epoch or step % STEPS_PER_EPOCH):
                break
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.01)
        else:
            pytest.fail("no checkpoint was committed in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (root / "model.arrow").exists(), "the killed run must not have finished"
    latest = ml.latest_checkpoint(root / "ckpt")
    assert latest is not None
    marker = json.loads((latest / ml.COMMIT_MARKER).read_text())
    return int(marker["epoch"]), int(marker["step"])


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Weights of an uninterrupted run (checkpointing never changes the result)."""
    root = tmp_path_factory.mktemp("whole")
    _run(root)
    return _weights(root)


def test_killed_training_resumes_at_the_next_epoch_with_identical_results(
        tmp_path: Path, expected: dict[str, object]) -> None:
    root = tmp_path / "killed"
    epoch, _ = _kill_after_checkpoint(root, every=0, min_step=1, mid_epoch=False)
    assert 1 <= epoch < EPOCHS
    _run(root)
    result = json.loads((root / "result-0.json").read_text())
    assert result["start_epoch"] == epoch and result["start_step"] == 0
    assert result["epochs"] == list(range(EPOCHS))  # the history of the killed attempt is kept
    for name, value in _weights(root).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_step_checkpoints_resume_inside_an_epoch(tmp_path: Path, expected: dict[str, object]) -> None:
    root = tmp_path / "killed"
    epoch, step = _kill_after_checkpoint(root, every=7, min_step=7, mid_epoch=True)
    _run(root, every=7)
    result = json.loads((root / "result-0.json").read_text())
    assert result["start_epoch"] == epoch
    assert result["start_step"] == step - STEPS_PER_EPOCH * epoch > 0
    for name, value in _weights(root).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
