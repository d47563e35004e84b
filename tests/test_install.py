"""A non-editable install works from any directory: import, console script, shipped configs; and the
install commands the README and the quickstart print work as printed in a fresh copy of the repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
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


def _fresh_copy(target: Path) -> None:
    """What a clone of this working tree holds: its tracked and untracked, not ignored, files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _dependencies_without_hetflow(target: Path) -> Path:
    """This environment's installed packages, less hetflow itself, as one directory for ``PYTHONPATH``:
    what ``pip install`` would otherwise download (the test runs offline and in seconds)."""
    target.mkdir()
    for place in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(place).iterdir():
            if entry.name.lower().startswith(("hetflow", "__editable__")) or (target / entry.name).exists():
                continue
            (target / entry.name).symlink_to(entry)
    return target


@pytest.mark.slow
def test_the_install_commands_of_the_readme_and_the_quickstart_work_as_printed_in_a_fresh_copy(
        tmp_path: Path) -> None:
    """The README's install blocks (``<!-- install -->``: a venv, ``pip install '.[mpich]'``, a wheel) in a
    fresh copy of the repository, in one shell as a reader types them; then the README's quickstart runs
    with the hetflow they installed.  Offline: the dependencies are this environment's, on ``PYTHONPATH``
    (``pip`` finds them installed), and the build uses this environment's setuptools."""
    from test_docs import blocks

    readme = [b.code for b in blocks(ROOT / "README.md") if "install" in b.markers]
    quickstart = [b.code for b in blocks(ROOT / "docs" / "quickstart.md") if "install" in b.markers]
    assert len(readme) == 2 and len(quickstart) == 1, (readme, quickstart)
    def commands(code: str) -> list[str]:
        return [line.split("  #")[0].rstrip() for line in code.splitlines()]

    assert commands(quickstart[0]) == commands(readme[0]), "the quickstart prints the README's install commands"
    copy = tmp_path / "hetflow"
    _fresh_copy(copy)
    assert (copy / "pyproject.toml").is_file() and not (copy / ".venv").exists()
    bin_dir = tmp_path / "bin"  # python3 and the system's tools; no pip outside the venv the block makes
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("HETFLOW_")}
    env.update(PATH=os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]), PIP_NO_INDEX="1",
               PIP_NO_BUILD_ISOLATION="0",  # pip's spelling of --no-build-isolation in the environment
               PYTHONPATH=str(_dependencies_without_hetflow(tmp_path / "deps")))
    script = "\n".join(readme) + '\necho "hetflow from: $(python -c \'import hetflow; print(hetflow.__file__)\')"\n'
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hetflow 0.1.0" in done.stdout, done.stdout
    assert f"hetflow from: {copy / '.venv'}" in done.stdout, done.stdout  # installed into the venv, not editable
    assert len(list((copy / "dist").glob("hetflow-*.whl"))) == 1
    # the README's quickstart, with the hetflow just installed; MPI is this environment's mpich (its mpiexec
    # and libmpi, which pip install '.[mpich]' puts into the venv's bin/ and lib/, as pip did here)
    for block in blocks(ROOT / "README.md"):
        if block.file:
            (copy / block.file).write_text(block.code)
    env["HETFLOW_MPIEXEC"] = str(Path(sys.prefix) / "bin" / "mpiexec")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(Path(sys.prefix) / "lib"), env.get("LD_LIBRARY_PATH")]))
    venv_bin = copy / ".venv" / "bin"
    assert subprocess.run([str(venv_bin / "python"), "make_data.py"], cwd=copy, env=env, timeout=120).returncode == 0
    run = subprocess.run([str(venv_bin / "hetflow"), "run", "quickstart.py", "--no-progress"], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ": DONE" in run.stdout and "per_region" in run.stdout, run.stdout
