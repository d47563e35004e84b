"""``scripts/gpu_check_pipeline.py`` on CPU: the GPU check's pipeline and its checks keep working here.

The script is run on a lent GPU machine only now and then; on CPU (a declared GPU, ``--device cpu``)
every check but the CUDA-only ones runs, so a change that breaks a check (the resume check once read
a log file that ``ctx.log`` no longer writes) fails in CI, not on the GPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_gpu_check_pipeline_passes_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_pipeline.py"), "--device", "cpu",
                           "--rows", "8000", "--epochs", "3", "--workdir", str(tmp_path / "photoz"),
                           "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["checkpoint/resume on the device"]["status"] == "ok", checks
    assert "attempt 2 resumed: True" in checks["checkpoint/resume on the device"]["detail"]
    assert checks["every stage DONE"]["status"] == "ok"
    assert checks["gloo process group from the task's communicator, one rank"]["status"] == "ok"
    assert {c["status"] for c in checks.values()} <= {"ok", "skipped"}
    assert checks["train sees the GPU"]["status"] == "skipped"  # CUDA-only here
