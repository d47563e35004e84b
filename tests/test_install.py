"""A non-editable install works from any directory: import, console script, shipped configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_works_outside_the_source_tree(tmp_path: Path) -> None:
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(ROOT)], check=True, cwd=tmp_path, timeout=300)
    wheels = list(wheel_dir.glob("hetflow-*.whl"))
    assert len(wheels) == 1
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheels[0])],
                   check=True, cwd=tmp_path, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run([sys.executable, "-c", "import hetflow, hetflow.tasks.worker, hetflow.operators.dataset; "
                            "print(hetflow.__file__)"], env=env, cwd=elsewhere, capture_output=True, text=True,
                           check=True)
    assert probe.stdout.strip().startswith(str(site))
    pilots = subprocess.run([str(site / "bin" / "hetflow"), "pilots"], env=env, cwd=elsewhere,
                            capture_output=True, text=True, check=True)
    assert "local" in pilots.stdout
