"""One-rank stages with several cores or with GPUs start warm, from the fork server, as a cold rank would run.

Real runs on a pilot that declares GPUs (none are needed: a rank with GPUs is told which by its
visible-devices variables).  Each stage reports who started it (the fork server is a warm rank's parent),
its environment, CPU affinity and thread counts; a cold run of the same stage (``warm_start: false``) is
the reference.  A fork server that has loaded the CUDA driver (an installed package that initialised CUDA
at import, faked by a library named ``libcuda.so.1``) must not fork a rank with GPUs: that stage starts
cold, and the server's log says why.
"""

from __future__ import annotations

import _ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import _warm_stages as W
import _warm_torch_stages as T
import hetflow as hf
import pytest
from hetflow.operators.dataset import open_dataset
from hetflow.tasks.forkserver import LAUNCHER_ENV, NO_PROVIDER_DIR, SINGLETON_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server needs Linux")


def _pilot(warm: bool) -> hf.PilotDescription:
    return hf.PilotDescription(name="two-gpus" if warm else "two-gpus-cold", cores_per_node=2, gpus_per_node=2,
                               gpu_vendor="nvidia", memory_per_node=2**34,
                               options={"local": {"warm_start": warm}})


LAUNCHERS_OWN = ("GFORTRAN_UNBUFFERED_PRECONNECTED", *SINGLETON_ENV, *NO_PROVIDER_DIR)
"""What only one way of starting gives a rank: Hydra's variables for its ranks, a warm rank's MPI singleton's."""


def _env(row: dict) -> dict[str, str]:
    """A rank's environment less what its launcher (mpiexec, or the fork server's MPI singleton) adds."""
    return {k: v for k, v in json.loads(row["env"]).items()
            if not k.startswith(LAUNCHER_ENV) and k not in LAUNCHERS_OWN}


def _rows(run: hf.RunStatus, name: str) -> list[dict]:
    return open_dataset(Path(run.run_dir) / "datasets" / name).to_table().to_pylist()


def _run(tmp_path: Path, warm: bool, stages: list[tuple[str, dict]], func=W.environment) -> hf.RunStatus:
    pipe = hf.Pipeline("warm-gpu" if warm else "cold-gpu", pilot=_pilot(warm),
                       workdir=tmp_path / ("warm" if warm else "cold"))
    for name, resources in stages:
        pipe.stage(name=name, outputs=[f"{name}_env"], **resources)(func)
    run = pipe.run()
    assert run.ok, run
    return run


def test_a_one_rank_gpu_stage_starts_warm_and_sees_its_slots_gpus_as_a_cold_rank_does(tmp_path: Path) -> None:
    """Before, a stage with GPUs always paid mpiexec, an interpreter and its imports."""
    stages = [("train", {"ranks": 1, "gpus_per_rank": 1})]
    warm, cold = _run(tmp_path, True, stages), _run(tmp_path, False, stages)
    (w,), (c,) = _rows(warm, "train_env"), _rows(cold, "train_env")
    assert w["warm"] and not c["warm"], (w, c)  # the fork server is the warm rank's parent
    for run, row in ((warm, w), (cold, c)):
        (slot,) = run.stage("train").slots
        assert len(slot.gpus) == 1 and row["cuda"] == str(slot.gpus[0]), (slot, row)
    assert _env(w) == _env(c)
    assert (w["affinity"], w["torch_threads"]) == (c["affinity"], c["torch_threads"]), (w, c)


def test_two_concurrent_gpu_stages_start_warm_on_different_gpus(tmp_path: Path) -> None:
    run = _run(tmp_path, True, [(name, {"ranks": 1, "gpus_per_rank": 1, "params": {"sleep": 1.5}})
                                for name in ("a", "b")])
    (a,), (b,) = _rows(run, "a_env"), _rows(run, "b_env")
    assert a["warm"] and b["warm"], (a, b)
    assert a["started"] < b["ended"] and b["started"] < a["ended"], (a, b)  # they ran at the same time
    assert {a["cuda"], b["cuda"]} == {"0", "1"}, (a, b)
    assert [a["cuda"], b["cuda"]] == [str(run.stage(n).slots[0].gpus[0]) for n in ("a", "b")]


def test_a_two_core_stage_starts_warm_pinned_to_its_cores_with_a_cold_ranks_threads(tmp_path: Path) -> None:
    """The stage's module imports torch at its top, so the fork server loaded torch (and numpy's OpenBLAS)
    with one thread before forking: the rank must still get two, as a cold rank reads from its variables."""
    stages = [("wide", {"ranks": 1, "cores_per_rank": 2})]
    warm, cold = _run(tmp_path, True, stages, T.environment), _run(tmp_path, False, stages, T.environment)
    (w,), (c,) = _rows(warm, "wide_env"), _rows(cold, "wide_env")
    assert w["warm"] and not c["warm"], (w, c)
    cores = sorted(warm.stage("wide").slots[0].cores)
    assert len(cores) == 2 and w["affinity"] == c["affinity"] == cores, (w, c, cores)
    assert _env(w) == _env(c) and _env(w)["OMP_NUM_THREADS"] == "2", (_env(w), _env(c))
    assert w["torch_threads"] == c["torch_threads"] == 2, (w, c)
    assert w["openblas_threads"] == len(w["affinity"]), w


SCRIPT = '''
import os
import sys

import torch
import hetflow as hf
import pyarrow as pa

pipe = hf.Pipeline("torch-script", pilot=hf.PilotDescription(
    name="two-gpus", cores_per_node=2, gpus_per_node=2, gpu_vendor="nvidia", memory_per_node=2**33))


def _starter_is_the_fork_server():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
        return b"hetflow.tasks.forkserver" in fh.read() and os.getsid(0) == os.getpid()


@pipe.stage(gpus_per_rank=1, outputs=["out"])
def infer(ctx):
    return {"out": pa.table({"sum": [float(torch.ones(3).sum())], "warm": [_starter_is_the_fork_server()],
                             "cuda": [os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")],
                             "devices": [torch.cuda.device_count()]})}


if __name__ == "__main__":
    run = pipe.run(progress=False, check=False)
    print("STATE", run.state, run.stage("infer").error)
    print("GPUS", ",".join(str(g) for g in run.stage("infer").slots[0].gpus))
'''


def _script(tmp_path: Path, top: str = "", env: dict[str, str] | None = None) -> tuple[str, Path]:
    (tmp_path / "script.py").write_text(top + textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, **(env or {})))
    assert "STATE DONE" in done.stdout, done.stdout + done.stderr
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    return done.stdout, run_dir


def test_a_script_that_imports_torch_at_its_top_runs_its_gpu_stage_warm(tmp_path: Path) -> None:
    stdout, run_dir = _script(tmp_path)
    (row,) = open_dataset(run_dir / "datasets" / "out").to_table().to_pylist()
    gpus = stdout.split("GPUS ", 1)[1].split()[0]
    assert row["warm"] and row["sum"] == 3.0 and row["cuda"] == gpus and len(gpus.split(",")) == 1, (row, gpus)
    assert row["devices"] == 0  # this torch has no CUDA; the GPU machine's check (scripts/gpu-check.sh) has


def test_a_gpu_stage_starts_cold_once_the_fork_server_has_loaded_the_cuda_driver(tmp_path: Path) -> None:
    """An installed package that initialised CUDA at import (here: loads a library named like the driver's)
    makes forking a GPU rank from the server unsafe: that stage starts cold, and the log says why."""
    site = tmp_path / "lib" / "site-packages"
    (site / "fakecuda").mkdir(parents=True)
    driver = site / "fakecuda" / "libcuda.so.1"
    shutil.copy(_ctypes.__file__, driver)  # any loadable library: what counts is the driver's name in the maps
    (site / "fakecuda" / "__init__.py").write_text(f"import ctypes\nctypes.CDLL({str(driver)!r})\n")
    stdout, run_dir = _script(tmp_path, top="import fakecuda\n", env={"PYTHONPATH": str(site)})
    (row,) = open_dataset(run_dir / "datasets" / "out").to_table().to_pylist()
    gpus = stdout.split("GPUS ", 1)[1].split()[0]
    assert not row["warm"] and row["cuda"] == gpus and row["sum"] == 3.0, row
    log = (run_dir / "forkserver.log").read_text()
    assert f"a stage with GPUs starts cold: the GPU driver library {driver} is loaded in the fork server" in log, log
