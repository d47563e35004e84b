"""``benchmarks/ml.py --quick`` runs end to end (CI size) and reports every figure it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_quick_benchmark_reports_training_and_inference_ratios(tmp_path: Path) -> None:
    out = tmp_path / "ml.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ml.py"), "--quick", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["args"]["device"] == "cpu" and data["args"]["rows"] == 4096
    for key in ("train_hetflow", "train_baseline", "train_baseline_per_row", "infer_hetflow", "infer_baseline"):
        assert data["results"][key]["median"] > 0, key
    assert data["ratios"]["train"] == pytest.approx(
        data["results"]["train_hetflow"]["median"] / data["results"]["train_baseline"]["median"])
    assert data["copies"] == {} and data["targets_met"] is None  # copy rates and targets are for a GPU
    assert "ratio train hetflow/baseline" in proc.stdout


def test_bad_arguments_are_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ml.py"), "--rows", "0"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rows must be >= 1, got 0" in proc.stderr
