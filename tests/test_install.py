"""A non-editable install works from any directory: import, console script, shipped configs."""

from __future__ import annotations

import json
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


JOIN_GROUP_SORT = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("installed")


@pipe.stage(ranks=2, outputs=["hits", "runs"])
def generate(ctx):
    hits = pa.table({"run_id": [(ctx.rank * 7 + i) % 5 for i in range(40)],
                     "energy": [float(ctx.rank * 100 + i) for i in range(40)]})
    mine = [r for r in range(5) if r % ctx.size == ctx.rank]
    runs = pa.table({"run_id": mine, "beam": ["proton" if r % 2 else "ion" for r in mine]})
    return {"hits": hits, "runs": runs}


@pipe.stage(ranks=2, inputs=["hits", "runs"], outputs=["summary"])
def summarize(ctx, hits, runs):
    joined = ctx.dtable(hits).join(ctx.dtable(runs), "run_id", how="inner")
    per_beam = joined.group_by(["beam"]).aggregate([("energy", "sum"), ("run_id", "count")])
    return {"summary": per_beam.sort_by([("energy_sum", "descending")]).to_arrow()}


if __name__ == "__main__":
    pipe.run()
'''


@pytest.mark.slow
def test_wheel_installed_with_its_dependencies_joins_groups_and_sorts(tmp_path: Path) -> None:
    """What `pip install hetflow[mpich]` gives a new user: the wheel and the dependencies it declares
    (from PyPI or the pip cache), in a fresh venv, used from a directory outside the source tree."""
    wheel_dir, venv = tmp_path / "wheel", tmp_path / "venv"
    # built as `pip install` builds it: in an isolated environment with the build-system requirements
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT)],
                   check=True, cwd=tmp_path, timeout=600)
    (wheel,) = wheel_dir.glob("hetflow-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                                str(ROOT / "constraints.txt"), f"{wheel}[mpich]"], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=1200)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "flow.py").write_text(JOIN_GROUP_SORT)
    done = subprocess.run([str(venv / "bin" / "hetflow"), "run", "flow.py", "--no-progress"], env=env,
                          cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout, done.stderr)
    shown = subprocess.run([str(venv / "bin" / "hetflow"), "status", "--json"], env=env, cwd=elsewhere,
                           capture_output=True, text=True, timeout=120, check=True)
    summary = json.loads(shown.stdout)["datasets"]["summary"]
    import pyarrow as pa

    from hetflow.operators.dataset import open_dataset

    got = open_dataset(summary).to_table()
    # the same join + group-by + sort on one process, with pyarrow
    hits = pa.concat_tables([pa.table({"run_id": [(r * 7 + i) % 5 for i in range(40)],
                                       "energy": [float(r * 100 + i) for i in range(40)]}) for r in range(2)])
    runs = pa.table({"run_id": list(range(5)), "beam": ["proton" if r % 2 else "ion" for r in range(5)]})
    want = (hits.join(runs, "run_id").group_by(["beam"]).aggregate([("energy", "sum"), ("run_id", "count")])
            .sort_by([("energy_sum", "descending")]))
    assert got.select(["beam", "energy_sum", "run_id_count"]).to_pylist() == \
        want.select(["beam", "energy_sum", "run_id_count"]).to_pylist()
    # the installed copy ran, not the source tree
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import hetflow; print(hetflow.__file__)"],
                           env=env, cwd=elsewhere, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(venv))
