"""The photo-z example end to end through the real CLI, orchestrator and workers.

A small survey, a first training attempt killed after epoch 2 (fault injection
in the example), and checks on what a user sees: the run is DONE, train needed
two attempts and the second resumed at epoch 3, predictions are keyed like
the test split, the model beats the trivial predictor, and `qa` ran while
`train` did (``hetflow status --json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pyarrow.compute as pc
import pytest

pytest.importorskip("torch")

from hetflow.operators.dataset import Dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HETFLOW = Path(sys.executable).with_name("hetflow")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HETFLOW.exists(), reason="hetflow CLI not installed")]


def test_photoz_pipeline_trains_resumes_and_beats_the_trivial_predictor(tmp_path: Path) -> None:
    env = os.environ | {"HETFLOW_WORKDIR": str(tmp_path / ".hetflow")}
    argv = [str(HETFLOW), "run", str(ROOT / "examples" / "photoz" / "pipeline.py"), "--no-progress",
            "--param", "rows=12000", "--param", "epochs=6", "--param", "crash_after_epoch=2"]
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    status = json.loads(subprocess.run([str(HETFLOW), "status", "--json"], cwd=tmp_path, env=env, check=True,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert status["state"] == "DONE"
    stages = {s["name"]: s for s in status["stages"]}
    assert stages["train"]["attempts"] == 2
    logs = "".join(p.read_text() for p in sorted(Path(status["run_dir"]).glob("stages/train/attempt-*/rank-*.log")))
    assert "injected crash after epoch 2" in logs and "resumed at epoch 3" in logs

    # heterogeneity: qa overlapped train's first attempt, on cores that attempt did not use
    start = {n: datetime.fromisoformat(stages[n]["started"]) for n in ("train", "qa")}
    end = {n: datetime.fromisoformat(stages[n]["ended"]) for n in ("train", "qa")}
    assert max(start.values()) < min(end.values())
    first = json.loads((Path(status["run_dir"]) / "stages" / "train" / "attempt-1" / "spec.json").read_text())
    train_cores = {c for slot in first["slots"] for c in slot["cores"]}
    qa_cores = {c for slot in stages["qa"]["slots"] for c in slot["cores"]}
    assert train_cores and qa_cores and not train_cores & qa_cores
    assert all(slot["gpus"] for slot in first["slots"])

    data = {name: Dataset(path).to_table() for name, path in status["datasets"].items()}
    test_ids = data["test_set"]["id"]
    assert data["predictions"].num_rows == data["test_set"].num_rows
    assert sorted(data["predictions"]["id"].to_pylist()) == sorted(test_ids.to_pylist())
    assert data["metrics"].num_rows == 6 and data["metrics"]["epoch"].to_pylist() == list(range(6))
    overall = data["photoz_metrics"].filter(pc.equal(data["photoz_metrics"]["bin"], -1)).to_pylist()[0]
    assert overall["n"] == data["test_set"].num_rows
    assert overall["sigma_nmad"] <= 0.5 * overall["sigma_nmad_trivial"]
    assert "σ_NMAD model" in run.stdout and (tmp_path / ".hetflow" / "photoz-report" / "photoz.png").stat().st_size > 0
