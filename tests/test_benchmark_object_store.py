"""``benchmarks/object_store.py`` at CI size: a real moto server and ``mpiexec -n 2``, every figure reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_small_object_store_benchmark_reports_throughput_ratios_and_bytes_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "object_store.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "object_store.py"), "--size-mb", "6",
                           "--ranks", "2", "--workdir", str(tmp_path), "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["rows"] == 2 * int(6e6 / 16 / 2)
    for name in ("local", "s3"):
        r = data[name]
        assert r["data_bytes"] > 6e6 and r["write_MBps"] > 0 and r["read_MBps"] > 0, r
        # each rank read its half of the files (and the footer of one file: one file per rank here)
        assert len(r["bytes_read_per_rank"]) == 2 and sum(r["bytes_read_per_rank"]) <= 1.05 * r["data_bytes"], r
        for share in r["share_of_data_per_rank"]:
            assert 0.45 <= share <= 0.55, r
    assert set(data["ratio_s3_over_local"]) == {"write_MBps", "read_MBps"}
    assert "s3/local  write" in proc.stdout and "bytes read per rank" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]   # its files and the server's log are removed


def test_bad_arguments_are_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "object_store.py"), "--size-mb", "0"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--size-mb must be > 0" in proc.stderr, proc.stderr
