"""Errors a user can cause are one line (exit 2 for usage and configuration), naming the extra to
install where one is missing; ``--param`` values get their type by a stated rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetflow as hf

HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow_cmd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def without(module: str, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a Python where ``module`` cannot be imported (``sys.modules[module] = None``: what
    ``import`` then raises is the ModuleNotFoundError of a missing package)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


TINY = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("tiny")

@pipe.stage(outputs=["t"], params={"fail": False})
def make(ctx):
    if ctx.params.get("fail"):
        raise ValueError("bad range [/] and [bold]x[/bold] in the input")
    return {"t": pa.table({"x": [1]})}
'''


def test_report_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY)
    assert hetflow_cmd("run", "tiny.py", "--no-progress", cwd=tmp_path).returncode == 0
    done = without("matplotlib", "from hetflow.cli import main; sys.exit(main(['report']))", tmp_path)
    assert done.returncode == 2
    assert one_line(done) == ("hetflow: error: hetflow report needs matplotlib, which is not installed: "
                              "pip install 'hetflow[report]'")


def test_simulate_with_a_pipeline_script_as_workload_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY)
    done = hetflow_cmd("simulate", "--workload", "tiny.py", cwd=tmp_path)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("hetflow: error: tiny.py: not a workload spec") and "hetflow run" in line


def test_hetflow_ml_without_torch_names_the_extra(tmp_path: Path) -> None:
    for code in ("import hetflow.ml", "import hetflow as hf; hf.ml.MLP"):
        done = without("torch", code, tmp_path)
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("hetflow.tasks.errors.MissingExtraError: hetflow.ml needs PyTorch"), done.stderr
        assert last.endswith("pip install 'hetflow[ml]'")
    # hetflow itself imports without torch
    assert without("torch", "import hetflow; hetflow.Pipeline('p')", tmp_path).returncode == 0


def test_memory_per_rank_takes_the_sizes_the_pilot_config_takes(tmp_path: Path) -> None:
    pipe = hf.Pipeline("sizes")
    for i, (size, expected) in enumerate([("4GB", 4 * 10**9), ("16GiB", 16 * 2**30), ("1.5GiB", 3 * 2**29),
                                          (2048, 2048)]):
        pipe.stage(name=f"s{i}", outputs=[f"o{i}"], memory_per_rank=size)(lambda ctx: None)
        assert pipe.stages[f"s{i}"].request.memory_per_rank == expected
    config = tmp_path / "p.yaml"
    config.write_text("name: p\nbackend: local\ncores_per_node: 2\ngpus_per_node: 0\nmemory_per_node: 16GB\n")
    assert hf.load_pilot(str(config)).memory_per_node == 16 * 10**9  # the pilot reads '16GB' the same way
    with pytest.raises(hf.PipelineError) as bad:
        pipe.stage(name="bad", outputs=["b"], memory_per_rank="4 gigs")(lambda ctx: None)
    assert str(bad.value) == ("pipeline 'sizes', stage 'bad': memory_per_rank: bad size '4 gigs' (expected bytes "
                              "or a size such as '16GB' or '512GiB')")
    with pytest.raises(hf.UnsatisfiableRequest, match="memory_per_rank must be a number of bytes"):
        hf.ResourceRequest(memory_per_rank="4GB")  # type: ignore[arg-type]


def test_status_prints_error_text_with_rich_markup_literally(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY)
    assert hetflow_cmd("run", "tiny.py", "--no-progress", "--param", "fail=true", cwd=tmp_path).returncode == 1
    shown = hetflow_cmd("status", cwd=tmp_path)
    assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr
    assert "bad range [/] and [bold]x[/bold] in the input" in shown.stdout


PARAMS = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("params")

@pipe.stage(outputs=["seen"], params={"version": "1.0", "epochs": 10, "rate": 0.5, "verbose": False, "tag": None,
                                      "count": None, "n": None, "x": None, "flag": None, "date": None, "empty": None,
                                      "none": None, "words": None})
def show(ctx):
    import json
    keys = sorted(ctx.params)
    return {"seen": pa.table({"key": keys, "value": [json.dumps(ctx.params[k]) for k in keys]})}
'''


def test_a_param_no_stage_declares_is_refused_on_the_command_line_and_in_python(tmp_path: Path) -> None:
    """``--param lr=0.05`` that no stage reads would run with the defaults and say nothing: refused before
    anything runs, naming the declared keys; ``pipe.run(params=...)`` the same."""
    (tmp_path / "p.py").write_text(PARAMS)
    done = hetflow_cmd("run", "p.py", "--no-progress", "--param", "lr=0.05", cwd=tmp_path)
    assert done.returncode == 2
    assert one_line(done) == ("hetflow: error: --param lr=0.05: no stage declares 'lr' (declared: count, date, "
                              "empty, epochs, flag, n, none, rate, tag, verbose, version, words, x); a parameter no "
                              "stage declares is read by none, so declare it in the params= of the stages that "
                              "read it")
    assert not (tmp_path / ".hetflow" / "runs").exists() or not any((tmp_path / ".hetflow" / "runs").iterdir())
    pipe = hf.Pipeline("python-params", workdir=tmp_path / "w")
    pipe.stage(outputs=["t"], params={"epochs": 10})(_make_t)
    with pytest.raises(hf.PipelineError, match=r"^pipeline 'python-params': run\(params=\.\.\.\) gives 'lr': no "
                       r"stage declares 'lr' \(declared: epochs\); a parameter no stage declares is read by none"):
        pipe.run(params={"lr": 0.05})
    with pytest.raises(hf.PipelineError, match=r"no stage declares any params"):
        bare = hf.Pipeline("bare", workdir=tmp_path / "w")
        bare.stage(outputs=["t"])(_make_t)
        bare.run(params={"lr": 0.05})


def _make_t(ctx):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return {"t": pa.table({"x": [1]})}


def test_param_values_typed_by_the_declared_default_else_numbers_and_json_literals(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(PARAMS)
    args = ["version=1.10", "epochs=12", "rate=1", "verbose=TRUE", "tag=no", "count=007", "n=42", "x=1.10",
            "flag=true", "date=2024-01-01", "empty=", "none=null", "words=a=b"]
    done = hetflow_cmd("run", "p.py", "--no-progress", *[a for p in args for a in ("--param", p)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    status = json.loads(hetflow_cmd("status", "--json", cwd=tmp_path).stdout)
    table = hf.open_dataset(status["datasets"]["seen"]).to_table()
    seen = {k: json.loads(v) for k, v in zip(table["key"].to_pylist(), table["value"].to_pylist())}
    assert seen == {"version": "1.10", "epochs": 12, "rate": 1.0, "verbose": True, "tag": "no", "count": "007",
                    "n": 42, "x": 1.1, "flag": True, "date": "2024-01-01", "empty": "", "none": None,
                    "words": "a=b"}
    assert isinstance(seen["rate"], float)
    bad = hetflow_cmd("run", "p.py", "--no-progress", "--param", "epochs=ten", cwd=tmp_path)
    assert bad.returncode == 2
    assert one_line(bad) == ("hetflow: error: --param epochs=ten: stage 'show' declares epochs as an integer "
                             "(default 10); got 'ten'")
    helped = " ".join(hetflow_cmd("run", "--help", cwd=tmp_path).stdout.split())
    assert "declares for KEY" in helped and "stays text" in helped
    # a near miss of a declared key would run with the default: refused before anything runs
    runs = json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout)
    typo = hetflow_cmd("run", "p.py", "--no-progress", "--param", "epohcs=20", cwd=tmp_path)
    assert typo.returncode == 2
    assert one_line(typo) == ("hetflow: error: --param epohcs=20: no stage declares 'epohcs'; did you mean "
                              "'epochs' (declared by stage 'show')? To pass 'epohcs' as well, declare it in a "
                              "stage's params=")
    assert json.loads(hetflow_cmd("runs", "--json", cwd=tmp_path).stdout) == runs


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    """`hetflow pilots | head -1`: the closed pipe ends the command quietly, with exit 0."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        done = subprocess.run([*HETFLOW, "pilots"], cwd=tmp_path, stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_render_for_every_installed_engine(tmp_path: Path) -> None:
    """Each backend's render imports its backend module: an import broken there shows here."""
    for backend in ("radical", "parsl"):
        done = hetflow_cmd("pilot", "render", "ornl-frontier", "--backend", backend, cwd=tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (backend, done.stderr)


def test_render_for_an_engine_that_is_not_installed_names_the_extra(tmp_path: Path) -> None:
    for backend, module in (("parsl", "parsl"), ("radical", "radical.pilot")):
        done = without(module, f"from hetflow.cli import main; sys.exit(main(['pilot', 'render', 'ornl-frontier', "
                               f"'--backend', {backend!r}]))", tmp_path)
        assert done.returncode == 2, (backend, done.stderr)
        line = one_line(done)
        assert f"backend {backend!r} needs" in line and f"hetflow[{backend}]" in line, line


def test_run_on_an_engine_that_is_not_installed_is_one_line_and_records_no_run(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY)
    for backend, module in (("parsl", "parsl"), ("radical", "radical.pilot"), ("dask", "distributed")):
        done = without(module, f"from hetflow.cli import main; sys.exit(main(['run', 'tiny.py', '--backend', "
                               f"{backend!r}, '--no-progress']))", tmp_path)
        assert done.returncode == 2, (backend, done.stderr)
        line = one_line(done)
        assert line.startswith(f"hetflow: error: backend {backend!r} needs") and f"hetflow[{backend}]" in line, line
        assert "resume" not in line and done.stdout == ""           # nothing to resume: no run was started
    assert not (tmp_path / ".hetflow").exists()


def test_backend_slurm_override_that_cannot_fit_says_to_use_a_slurm_pilot_config(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text("import pyarrow as pa\nimport hetflow as hf\npipe = hf.Pipeline('big', pilot='local')\n"
                                   "@pipe.stage(ranks=64, outputs=['t'])\ndef make(ctx):\n"
                                   "    return {'t': pa.table({'x': [ctx.rank]})}\n")
    done = hetflow_cmd("run", "p.py", "--backend", "slurm", "--no-progress", cwd=tmp_path)
    assert done.returncode == 2
    line = one_line(done)
    assert "stage 'make' (ranks=64" in line and "can never run on pilot 'local'" in line, line
    assert line.endswith("; --backend slurm keeps the shape of pilot 'local': to take the allocation's nodes and "
                         "cores, give a pilot config with `backend: slurm` (--pilot my-slurm.yaml)"), line
