"""Out-of-core operators at 4x their memory budget in fresh ``mpiexec -n 1`` / ``-n 2`` processes, and the
clean-up of their spill directories on success, failure, Ctrl-C and after a killed process.

The bound: per rank, ``ru_maxrss`` after the operator minus ``ru_maxrss`` just before it (imports, DuckDB
and polars loaded, inputs opened: the process's baseline, about 0.2 GB, printed by
``benchmarks/spill.py``) is at most 1.25x the budget.  The budget bounds the operator's working memory,
not the interpreter's.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hetflow.operators import scan_ipc, spilldir
from hetflow.operators.errors import AggregateOverflowError

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 64 << 20


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("spill_bench", ROOT / "benchmarks" / "spill.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mpi_comm() -> Any:
    from mpi4py import MPI

    dup = MPI.COMM_WORLD.Dup()
    yield dup
    dup.Free()


@pytest.mark.slow
@pytest.mark.parametrize(("op", "ranks"), [("join", 1), ("join", 2), ("sort", 2), ("groupby", 2)])
def test_four_times_the_budget(tmp_path: Path, op: str, ranks: int) -> None:
    bench = _bench()
    data = bench.generate(tmp_path / "in", op, 4 * BUDGET, ranks)
    base = tmp_path / "node-local"
    base.mkdir()
    out = str(tmp_path / "out")
    res = bench.run(op, "spill", ranks, data, out, BUDGET, str(base))
    for r in res["ranks"]:
        assert r["growth"] <= 1.25 * BUDGET, f"{op} at {ranks} rank(s): rank {r['rank']} grew {r['growth'] / 2**20:.1f} MiB " \
                                              f"above its baseline, budget {BUDGET >> 20} MiB"
        assert r["stats"]["spilled_bytes"] >= 3 * BUDGET  # it did run out of core
    expected, got = bench.reference(op, data, out)
    assert got == expected
    if op == "sort":
        assert bench.sorted_check(out)
    assert list(base.iterdir()) == []


def _ints(path: Path, n: int, value: int) -> None:
    t = pa.table({"g": np.arange(n, dtype=np.int64) % 3, "v": np.full(n, value, dtype=np.int64)})
    path.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as writer:
        writer.write_table(t, max_chunksize=4096)


def test_failure_removes_spill_files_and_publishes_nothing(tmp_path: Path, mpi_comm: Any) -> None:
    """An int64 sum that overflows fails after every row was spilled: the error names the column, the
    spill directory is gone and the output has no manifest (it does not exist as a dataset)."""
    _ints(tmp_path / "in", 60_000, 1 << 60)
    base = tmp_path / "node-local"
    base.mkdir()
    scan = scan_ipc(mpi_comm, tmp_path / "in")
    with pytest.raises(AggregateOverflowError, match="v"):
        scan.group_by("g").aggregate([("v", "sum")], output=tmp_path / "out", memory_budget=256 << 10, spill_dir=base)
    assert list(base.iterdir()) == []
    assert not (tmp_path / "out" / "_manifest.json").exists()


def test_unwritable_output_removes_spill_files(tmp_path: Path, mpi_comm: Any) -> None:
    _ints(tmp_path / "in", 20_000, 1)
    base = tmp_path / "node-local"
    base.mkdir()
    (tmp_path / "out").write_text("a file where the output directory should go")
    with pytest.raises(OSError):
        scan_ipc(mpi_comm, tmp_path / "in").sort_by("v", output=tmp_path / "out", memory_budget=256 << 10, spill_dir=base)
    assert list(base.iterdir()) == []


CTRL_C = """
import sys
from mpi4py import MPI
import time
from hetflow.operators import scan_ipc, spilldir
real_write_run = spilldir.write_run
def write_run_then_wait(*args, **kwargs):  # the signal finds the sort mid-way however slow this machine is
    real_write_run(*args, **kwargs)
    time.sleep(120)
spilldir.write_run = write_run_then_wait
scan_ipc(MPI.COMM_WORLD, sys.argv[1]).sort_by("v", output=sys.argv[2], memory_budget=1 << 20, spill_dir=sys.argv[3])
"""


def test_ctrl_c_removes_spill_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    t = pa.table({"v": rng.random(3_000_000)})
    (tmp_path / "in").mkdir()
    with pa.OSFile(str(tmp_path / "in" / "part-00000.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as writer:
        writer.write_table(t, max_chunksize=1 << 16)
    base = tmp_path / "node-local"
    base.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, str(tmp_path / "in"), str(tmp_path / "out"), str(base)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(spilldir.PREFIX) and any(p.iterdir()) for p in base.iterdir()):
            assert proc.poll() is None, f"the sort ended before it spilled: {proc.communicate()}"
            assert time.monotonic() < deadline, "no spill file appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert list(base.iterdir()) == []
    assert not (tmp_path / "out" / "_manifest.json").exists()


def test_orphans_of_dead_processes_are_removed(tmp_path: Path) -> None:
    """A spill directory whose process was killed outright goes when the next one opens on this node;
    one of a live process stays."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    host = spilldir._host()
    orphan = tmp_path / f"{spilldir.PREFIX}{host}-{pid}-abc"
    orphan.mkdir()
    (orphan / "left-00000.arrows").write_bytes(b"x" * 100)
    live = tmp_path / f"{spilldir.PREFIX}{host}-{os.getppid()}-def"
    live.mkdir()
    other = tmp_path / "not-ours"
    other.mkdir()
    with spilldir.SpillDir(tmp_path) as mine:
        assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
        assert not orphan.exists()
        assert live.exists() and other.exists()
    assert not mine.exists()


def test_bad_options_name_what_is_wrong(tmp_path: Path, mpi_comm: Any) -> None:
    from hetflow.operators.errors import InvalidOptionError, UnsupportedAggregationError

    _ints(tmp_path / "in", 100, 1)
    scan = scan_ipc(mpi_comm, tmp_path / "in")
    with pytest.raises(InvalidOptionError, match="memory_budget"):
        scan.sort_by("v", output=tmp_path / "o", memory_budget=0)
    with pytest.raises(UnsupportedAggregationError, match="'first' of 'v' depends on row order"):
        scan.group_by("g").aggregate([("v", "first")], output=tmp_path / "o", memory_budget=1 << 20)
    with pytest.raises(FileNotFoundError, match="node-local"):
        scan.sort_by("v", output=tmp_path / "o", memory_budget=1 << 20, spill_dir=tmp_path / "missing")
    with pytest.raises(KeyError, match="nope"):
        scan.join(scan, "nope", output=tmp_path / "o", memory_budget=1 << 20)
