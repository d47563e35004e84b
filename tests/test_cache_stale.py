"""Stale results the second red team found (issue 25): each edit below changes what a stage computes.

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage reads in the way
the attack did, runs again and checks that the stage RAN, says why, and that
its dataset holds the new value; and that what it does not read leaves it
cached.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hetflow.operators.dataset import Dataset

HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env, check=False)


def run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``hetflow run p.py ARGS``; returns the stages of ``hetflow status --json`` by name (the run as ``_run``)."""
    done = hetflow("run", "p.py", "--no-progress", *args, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return status(cwd)


def status(cwd: Path, run_id: str | None = None) -> dict[str, Any]:
    shown = hetflow("status", *([run_id] if run_id else []), "--json", cwd=cwd)
    data = json.loads(shown.stdout)
    stages: dict[str, Any] = {s["name"]: s for s in data["stages"]}
    stages["_run"] = data
    return stages


def states(stages: dict[str, Any]) -> dict[str, str]:
    return {n: s["state"] for n, s in stages.items() if n != "_run"}


def value(stages: dict[str, Any], dataset: str, column: str = "v") -> Any:
    table: pa.Table = Dataset(stages["_run"]["datasets"][dataset]).to_table()
    return table[column][0].as_py()


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


PATCHED = '''
import pyarrow as pa
import hetflow as hf
import mpatch

mpatch.K = 1
mpatch.J = 0

pipe = hf.Pipeline("patched")


@pipe.stage(outputs=["k"])
def reads_k(ctx):
    return {"k": pa.table({"v": [mpatch.K]})}


@pipe.stage(outputs=["alpha"])
def fit(ctx):
    return {"alpha": pa.table({"v": [fit.alpha]})}


fit.alpha = 3
'''


def test_a_value_the_script_sets_on_a_module_it_imports_reruns_what_reads_it(tmp_path: Path) -> None:
    (tmp_path / "mpatch.py").write_text("K = 0\n")
    (tmp_path / "p.py").write_text(PATCHED)
    first = run(tmp_path)
    assert value(first, "k") == 1 and value(first, "alpha") == 3
    edit(tmp_path / "p.py", "mpatch.K = 1", "mpatch.K = 2")
    edited = run(tmp_path)
    assert states(edited) == {"reads_k": "DONE", "fit": "CACHED"}
    assert edited["reads_k"]["cache"]["reason"] == "mpatch.K changed" and value(edited, "k") == 2
    edit(tmp_path / "p.py", "mpatch.K = 2", 'setattr(mpatch, "K", 5)')
    assert value(set_by_setattr := run(tmp_path), "k") == 5 and set_by_setattr["reads_k"]["state"] == "DONE"
    edit(tmp_path / "p.py", "mpatch.J = 0", "mpatch.J = 9")  # no stage reads mpatch.J
    assert states(run(tmp_path)) == {"reads_k": "CACHED", "fit": "CACHED"}
    edit(tmp_path / "p.py", "fit.alpha = 3", "fit.alpha = 4")  # an attribute of the stage function
    alpha = run(tmp_path)
    assert states(alpha) == {"reads_k": "CACHED", "fit": "DONE"} and value(alpha, "alpha") == 4
    assert alpha["fit"]["cache"]["reason"] == "code of fit() changed"


FORCED = '''
import os
import time
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("forced")


@pipe.stage(outputs=["a"])
def first(ctx):
    return {"a": pa.table({"v": [1]})}


@pipe.stage(inputs=["a"], outputs=["b"])
def second(ctx, a):
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, "hold")):
        open(os.path.join(here, "held"), "w").close()
        time.sleep(120)
    with open(os.path.join(here, "value.txt")) as f:  # a file the cache cannot see: why --rerun is used
        return {"b": pa.table({"v": [int(f.read())]})}


@pipe.stage(inputs=["b"], outputs=["c"])
def third(ctx, b):
    return {"c": b}
'''


def test_a_resume_keeps_the_rerun_of_a_forced_run_that_was_interrupted(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(FORCED)
    (tmp_path / "value.txt").write_text("1")
    assert value(run(tmp_path), "c") == 1
    (tmp_path / "value.txt").write_text("2")
    (tmp_path / "hold").touch()
    forced = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--rerun", "all", "--workdir",
                               str(tmp_path / "work")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    deadline = time.time() + 120
    while not (tmp_path / "held").exists():
        assert forced.poll() is None and time.time() < deadline, forced.communicate()
        time.sleep(0.2)
    forced.send_signal(signal.SIGINT)  # Ctrl-C while the forced run's second stage runs
    _, err = forced.communicate(timeout=60)
    assert forced.returncode == 130, err
    stopped = status(tmp_path)
    run_id = stopped["_run"]["id"]
    assert states(stopped) == {"first": "DONE", "second": "CANCELLED", "third": "CANCELLED"}
    assert stopped["_run"]["rerun"] == ["first", "second", "third"]  # recorded in the run
    (tmp_path / "hold").unlink()
    resumed = hetflow("resume", run_id, "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = status(tmp_path, run_id)
    # the stages the forced run had not re-run yet run now (not CACHED from the first run); first ran already
    assert states(after) == {"first": "DONE", "second": "DONE", "third": "DONE"}
    assert after["first"]["attempts"] == 1 and after["second"]["attempts"] == 2
    assert after["first"]["cache"]["reason"] == "committed earlier in this run, unchanged"
    assert after["second"]["cache"]["reason"] == "forced (--rerun of this run, kept by the resume)"
    assert value(after, "c") == 2
    shown = hetflow("status", run_id, cwd=tmp_path)
    assert "forced by --rerun (kept by every resume): first, second, third" in shown.stdout, shown.stdout
    with sqlite3.connect(tmp_path / "work" / "hetflow.db") as db:
        ((recorded,),) = db.execute("SELECT rerun FROM runs WHERE id = ?", (run_id,)).fetchall()
    assert json.loads(recorded) == ["first", "second", "third"]
    again = hetflow("resume", run_id, "--no-progress", cwd=tmp_path)  # all of it ran in this run now
    assert again.returncode == 0
    assert [s["attempts"] for n, s in status(tmp_path, run_id).items() if n != "_run"] == [1, 2, 1]
    later = run(tmp_path)  # a new run without --rerun reuses the forced run's outputs
    assert set(states(later).values()) == {"CACHED"} and value(later, "c") == 2


ENV = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("env")


@pipe.stage(outputs=["k"], env=["HF_K", "HF_UNSET"])
def reads_env(ctx):
    return {"k": pa.table({"v": [ctx.env["HF_K"]], "seen": [os.environ.get("HF_K")],
                           "unset": [ctx.env["HF_UNSET"]]})}


@pipe.stage(outputs=["other"])
def other(ctx):
    return {"other": pa.table({"v": [1]})}
'''


def test_a_declared_environment_variable_is_part_of_the_key_and_given_to_the_stage(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(ENV)
    base = {k: v for k, v in os.environ.items() if k not in ("HF_K", "HF_UNSET")}
    first = run(tmp_path, env={**base, "HF_K": "secret-1"})
    assert value(first, "k") == "secret-1" and value(first, "k", "seen") == "secret-1"
    assert value(first, "k", "unset") is None
    assert states(run(tmp_path, env={**base, "HF_K": "secret-1"})) == {"reads_env": "CACHED", "other": "CACHED"}
    changed = run(tmp_path, env={**base, "HF_K": "secret-2"})
    assert states(changed) == {"reads_env": "DONE", "other": "CACHED"}
    assert changed["reads_env"]["cache"]["reason"] == "env HF_K changed" and value(changed, "k") == "secret-2"
    unset = run(tmp_path, env=base)
    assert unset["reads_env"]["state"] == "DONE" and value(unset, "k") is None and value(unset, "k", "seen") is None
    with sqlite3.connect(tmp_path / "work" / "hetflow.db") as db:  # the key keeps digests, not the values
        materials = [m for (m,) in db.execute("SELECT cache_material FROM stages WHERE name = 'reads_env'")]
    assert materials and not any("secret" in (m or "") for m in materials)
    assert any('"HF_K": "unset"' in (m or "") for m in materials)


SECRET = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("secret")


@pipe.stage(outputs=["one"], env=["HF_SECRET", "HF_UNSET"])
def one(ctx):
    assert "HF_UNSET" not in os.environ
    return {"one": pa.table({"v": [ctx.env["HF_SECRET"] == os.environ["HF_SECRET"] == "tok-" + "3f9a1c"]})}


@pipe.stage(ranks=2, outputs=["two"], env=["HF_SECRET"])
def two(ctx):
    return {"two": pa.table({"v": [ctx.env["HF_SECRET"] == os.environ["HF_SECRET"] == "tok-" + "3f9a1c"]})}


@pipe.stage(map_over={"n": [1, 2]}, outputs=["mapped"], env=["HF_SECRET"])
def mapped(ctx):
    return {"mapped": pa.table({"v": [ctx.env["HF_SECRET"] == "tok-" + "3f9a1c"]})}
'''


def test_a_declared_variables_value_reaches_every_kind_of_rank_and_no_file_of_the_run(tmp_path: Path) -> None:
    """A declared variable is often a secret: its value goes to the stage's processes in their environment (a
    warm one-rank stage, two ranks under mpiexec, a map stage's items) and into no file the run leaves: not
    the attempts' spec.json, not the store (which keeps a digest), not a log."""
    (tmp_path / "p.py").write_text(SECRET)
    base = {k: v for k, v in os.environ.items() if k not in ("HF_SECRET", "HF_UNSET")}
    stages = run(tmp_path, env={**base, "HF_SECRET": "tok-3f9a1c"})
    assert states(stages) == {"one": "DONE", "two": "DONE", "mapped": "DONE"}
    assert value(stages, "one") is True and value(stages, "two") is True and value(stages, "mapped") is True
    specs = sorted((tmp_path / "work").glob("runs/*/stages/*/attempt-*/spec.json"))
    assert len(specs) >= 3, specs
    assert json.loads(specs[0].read_text())["env"]["HF_SECRET"].startswith("sha256:")
    leaked = [str(p) for p in (tmp_path / "work").rglob("*") if p.is_file() and b"tok-3f9a1c" in p.read_bytes()]
    assert leaked == []


def test_an_env_declaration_is_checked_when_the_stage_is_declared() -> None:
    import hetflow as hf

    pipe = hf.Pipeline("bad-env")
    rule = "(letters, digits and '_', not starting with a digit)"
    for bad, said in (("HF_K", "env must be a list of environment variable names, got 'HF_K'"),
                      (["HF_K", "1X"], f"env: '1X' is not an environment variable name {rule}"),
                      (["A=B"], f"env: 'A=B' is not an environment variable name {rule}"),
                      (["HF_K", "HF_K"], "env lists a variable twice: ['HF_K', 'HF_K']")):
        with pytest.raises(hf.PipelineError) as caught:
            pipe.stage(name="fit", env=bad)(lambda ctx: {})
        assert str(caught.value) == f"pipeline 'bad-env', stage 'fit': {said}"


def test_ctx_env_refuses_an_undeclared_name_saying_to_declare_it(tmp_path: Path) -> None:
    from hetflow.tasks.context import StageContext

    ctx = StageContext(comm=None, stage="fit", run_id="r", attempt=1, params={}, workdir=tmp_path,
                       checkpoint_dir=tmp_path, env={"HF_K": "1", "HF_UNSET": None})
    assert dict(ctx.env) == {"HF_K": "1", "HF_UNSET": None} and ctx.env["HF_UNSET"] is None
    with pytest.raises(KeyError) as caught:
        ctx.env["HOME"]
    assert "stage 'fit' did not declare environment variable 'HOME'" in str(caught.value)
    assert "@pipe.stage(env=[...])" in str(caught.value)


LIBRARY = '''
import pyarrow as pa
import hetflow as hf
import hfprobe_lib

pipe = hf.Pipeline("library")


@pipe.stage(outputs=["k"])
def uses_lib(ctx):
    return {"k": pa.table({"v": [hfprobe_lib.k()]})}


@pipe.stage(outputs=["other"])
def other(ctx):
    return {"other": pa.table({"v": [1]})}
'''


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--no-input", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def library(where: Path, value: int) -> Path:
    """The user's own library: a project with a version in its metadata and no ``__version__``."""
    (where / "hfprobe_lib").mkdir(parents=True, exist_ok=True)
    (where / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n'
                                          'build-backend = "setuptools.build_meta"\n'
                                          '[project]\nname = "hfprobe-lib"\nversion = "0.1"\n')
    (where / "hfprobe_lib" / "__init__.py").write_text(f"def k():\n    return {value}\n")
    return where


@pytest.mark.parametrize("editable", [True, False], ids=["pip-install-e", "pip-install-local-dir"])
def test_the_users_library_installed_from_a_local_directory_counts_by_its_source(tmp_path: Path,
                                                                                  editable: bool) -> None:
    source = library(tmp_path / "lib", 1)  # outside the script's directory: not a local module of it
    project = tmp_path / "project"
    project.mkdir()
    (project / "p.py").write_text(LIBRARY)
    env = dict(os.environ)
    install = ["install", "--no-build-isolation", "--no-index", "--no-deps"]
    if editable:  # into the test's own venv (its site-packages processes the editable .pth), removed after
        pip(*install, "-e", str(source))
    else:  # a plain install from the directory, into a folder of its own on PYTHONPATH (dist-info kept)
        target = tmp_path / "site"
        pip(*install, "--target", str(target), str(source))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    try:
        first = run(project, env=env)
        assert value(first, "k") == 1
        library(source, 2)  # edit the library's code (its version stays 0.1)
        if not editable:
            pip(*install, "--upgrade", "--target", str(target), str(source))
        edited = run(project, env=env)
        assert states(edited) == {"uses_lib": "DONE", "other": "CACHED"}
        assert edited["uses_lib"]["cache"]["reason"] == "module hfprobe_lib changed" and value(edited, "k") == 2
        assert states(run(project, env=env)) == {"uses_lib": "CACHED", "other": "CACHED"}
    finally:
        if editable:
            pip("uninstall", "--yes", "hfprobe-lib")


INDIRECT = '''
import pyarrow as pa
import hetflow as hf
from mylib import calib, limits, options
from mylib.consts import CFG, OPTS

CFG["threshold"] = 1
OPTS.k = 1
calib.apply_gain.gain = 1.0

pipe = hf.Pipeline("indirect")


@pipe.stage(outputs=["t"])
def threshold(ctx):
    return {"t": pa.table({"v": [limits.threshold()]})}


@pipe.stage(outputs=["o"])
def opts(ctx):
    return {"o": pa.table({"v": [options.opts_k()]})}


@pipe.stage(outputs=["g"])
def gain(ctx):
    return {"g": pa.table({"v": [calib.apply_gain(10.0)]})}
'''


def test_values_changed_through_a_from_imported_name_or_on_a_modules_function_rerun_what_reads_them(
        tmp_path: Path) -> None:
    """The third red team: ``from mylib.consts import CFG`` then ``CFG["threshold"] = 2`` (and an object's
    attribute the same way), and ``calib.apply_gain.gain = 2.5`` on a function of a local module, were
    served CACHED with the old values."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "consts.py").write_text("import types\nCFG = {'threshold': 0}\nOPTS = types.SimpleNamespace(k=0)\n")
    (lib / "limits.py").write_text("from mylib import consts\n\n\ndef threshold():\n    return consts.CFG['threshold']\n")
    (lib / "options.py").write_text("from mylib import consts\n\n\ndef opts_k():\n    return consts.OPTS.k\n")
    (lib / "calib.py").write_text("def apply_gain(x):\n    return x * apply_gain.gain\n\n\napply_gain.gain = 1.0\n")
    script = tmp_path / "p.py"
    script.write_text(INDIRECT)
    first = run(tmp_path)
    assert (value(first, "t"), value(first, "o"), value(first, "g")) == (1, 1, 10.0)
    edit(script, 'CFG["threshold"] = 1', 'CFG["threshold"] = 2')
    second = run(tmp_path)
    assert states(second) == {"threshold": "DONE", "opts": "CACHED", "gain": "CACHED"}, states(second)
    assert value(second, "t") == 2 and second["threshold"]["cache"]["reason"] == "mylib.consts.CFG changed", second
    edit(script, "OPTS.k = 1", "OPTS.k = 3")
    third = run(tmp_path)
    assert states(third) == {"threshold": "CACHED", "opts": "DONE", "gain": "CACHED"}, states(third)
    assert value(third, "o") == 3
    edit(script, "calib.apply_gain.gain = 1.0", "calib.apply_gain.gain = 2.5")
    fourth = run(tmp_path)
    assert states(fourth) == {"threshold": "CACHED", "opts": "CACHED", "gain": "DONE"}, states(fourth)
    assert value(fourth, "g") == 25.0


MAIN_BLOCK = '''
import sys
import pyarrow as pa
import hetflow as hf

SCALE = 1
pipe = hf.Pipeline("late")


@pipe.stage(outputs=["s"])
def scaled(ctx):
    return {"s": pa.table({"v": [SCALE * 10]})}


@pipe.stage(outputs=["u"])
def unrelated(ctx):
    return {"u": pa.table({"v": [7]})}


if __name__ == "__main__":
    SCALE = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    run = pipe.run(check=False)
    print(run.state, run.stage("scaled").state, run.stage("scaled").error)
'''


def test_a_stage_reading_a_value_the_main_block_sets_is_refused_not_served_a_value_it_never_saw(
        tmp_path: Path) -> None:
    """The third red team: ``python p.py 5`` set SCALE in the main block; the key said "SCALE changed" but
    the stage's ranks (which never execute that block) computed with SCALE = 1."""
    (tmp_path / "p.py").write_text(MAIN_BLOCK)
    done = subprocess.run([sys.executable, "p.py", "5"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")))
    assert done.stdout.startswith("FAILED FAILED"), done.stdout + done.stderr
    assert "it reads SCALE, which the script sets in its `if __name__ == \"__main__\":` block" in done.stdout
    shown = status(tmp_path)
    assert shown["unrelated"]["state"] == "DONE"  # a stage that does not read it runs



def test_a_main_block_refusal_says_the_script_must_change_before_a_resume(tmp_path: Path) -> None:
    """The refusal above ended 'resume it with: hetflow resume RUN', and a resume of the same script fails the
    same way: the run's error and ``hetflow run``'s summary say to change the script first."""
    (tmp_path / "p.py").write_text(MAIN_BLOCK.replace("pipe.run(check=False)", "pipe.run()"))
    env = dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work"))
    done = subprocess.run([sys.executable, "p.py", "5"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hetflow: run late-") and "it reads SCALE, which the script sets" in last, last
    assert last.endswith("; change the code as the error says first (resumed unchanged, it fails the same way), "
                         f"then resume it with: hetflow resume {status(tmp_path)['_run']['id']}"), last
    summary = hetflow("run", "p.py", "--no-progress", cwd=tmp_path, env=env)   # SCALE = 1, set in the block
    assert summary.returncode != 0
    lines = summary.stdout.splitlines()
    said = lines.index("  change the script as the error says first: resumed unchanged, it fails the same way")
    assert lines[said + 1].startswith("  resume it with: hetflow resume late-"), summary.stdout
    (tmp_path / "q.py").write_text(MAIN_BLOCK.replace("SCALE * 10", "1 // 0"))   # a failure a resume can help
    broken = hetflow("run", "q.py", "--no-progress", cwd=tmp_path, env=env)
    assert broken.returncode != 0 and "ZeroDivisionError" in broken.stdout, broken.stdout + broken.stderr
    assert "change the script" not in broken.stdout + broken.stderr and "resume it with" in broken.stdout


MUTATED = '''
import operator
import pyarrow as pa
import hetflow as hf
from mylib import consts, reader
from mylib.consts import VIA_FUNCTION, VIA_OR, VIA_HOLDER, VIA_SETITEM


def cfg(d, v):
    d["k"] = v


V = 1
cfg(VIA_FUNCTION, V)
VIA_OR |= {"k": V}
getattr(consts, "VIA_GETATTR")["k"] = V
holder = [VIA_HOLDER]
holder[0]["k"] = V
operator.setitem(VIA_SETITEM, "k", V)

pipe = hf.Pipeline("mutated")

for name in ("VIA_FUNCTION", "VIA_OR", "VIA_GETATTR", "VIA_HOLDER", "VIA_SETITEM"):
    def make(name=name):
        def stage(ctx):
            return {name: pa.table({"v": [reader.get(name)]})}
        return stage
    pipe.stage(make(), name=name.lower(), outputs=[name])
'''


def test_a_user_modules_value_changed_in_any_way_reruns_what_reads_it(tmp_path: Path) -> None:
    """The red team's second round: through a function, ``|=``, ``getattr``, another container and
    ``operator.setitem`` the change was missed (only named assignments were seen).  The key now holds the
    values, as the run starts, of the reached user modules' globals that the reached code names."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "consts.py").write_text("".join(f"{n} = {{'k': 0}}\n" for n in
                                           ("VIA_FUNCTION", "VIA_OR", "VIA_GETATTR", "VIA_HOLDER", "VIA_SETITEM")))
    (lib / "reader.py").write_text("from mylib import consts\n\n\ndef get(name):\n"
                                   "    return {'VIA_FUNCTION': consts.VIA_FUNCTION, 'VIA_OR': consts.VIA_OR,\n"
                                   "            'VIA_GETATTR': consts.VIA_GETATTR, 'VIA_HOLDER': consts.VIA_HOLDER,\n"
                                   "            'VIA_SETITEM': consts.VIA_SETITEM}[name]['k']\n")
    (tmp_path / "p.py").write_text(MUTATED)
    first = run(tmp_path)
    names = ("VIA_FUNCTION", "VIA_OR", "VIA_GETATTR", "VIA_HOLDER", "VIA_SETITEM")
    assert [value(first, n) for n in names] == [1] * 5
    edit(tmp_path / "p.py", "V = 1", "V = 2")
    second = run(tmp_path)
    assert set(states(second).values()) == {"DONE"}, states(second)
    assert [value(second, n) for n in names] == [2] * 5
    third = run(tmp_path)
    assert set(states(third).values()) == {"CACHED"}, states(third)


LATE_FORMS = '''
import subprocess
import sys
import pyarrow as pa
import hetflow as hf

VERSION = subprocess.run(["echo", "v1"], capture_output=True, text=True).stdout  # not a pipeline's run
SCALE = 1
pipe = hf.Pipeline("late-forms")


def bump():
    global SCALE
    SCALE = 5


@pipe.stage(outputs=["s"])
def scaled(ctx):
    return {"s": pa.table({"v": [SCALE * 10]})}


if __name__ == "__main__":
    FORM
    run = pipe.run(check=False)
    print(run.state, run.stage("scaled").error)
'''


@pytest.mark.parametrize("form", ['globals()["SCALE"] = 5', "bump()", 'setattr(sys.modules[__name__], "SCALE", 5)',
                                  "(SCALE := 5)", "pass"])
def test_every_way_the_main_block_sets_a_value_a_stage_reads_is_refused(tmp_path: Path, form: str) -> None:
    """The red team's second round slipped these past the first refusal; ``pass`` (nothing set, and a
    subprocess's ``.run`` at the top) must not be refused."""
    (tmp_path / "p.py").write_text(LATE_FORMS.replace("FORM", form))
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")))
    if form == "pass":
        assert done.stdout.startswith("DONE"), done.stdout + done.stderr
    else:
        assert done.stdout.startswith("FAILED") and "it reads SCALE, which the script sets" in done.stdout, \
            done.stdout + done.stderr


LATE_IN_PLACE = '''
import argparse
import random
import types
import numpy as np
import pyarrow as pa
import hetflow as hf

CFG = {"k": 1, "opt": {"k": 1}}
OPTS = types.SimpleNamespace(k=1)
LST = [1, 2, 3]
ARR = np.ones(2)


class Scaler:
    def __init__(self):
        self.k = 1

    def fit(self, k):
        self.k = k


SC = Scaler()
pipe = hf.Pipeline("late-in-place")


def apply(v):
    CFG["opt"]["k"] = v


def configure():
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=2)
    CFG.update(vars(parser.parse_args([])))


def summary(rows):
    kept = []
    kept.append(len(rows))  # its own list: no global changes
    rows.append(0)
    return kept


@pipe.stage(outputs=["s"])
def seen(ctx):
    return {"s": pa.table({"v": [str((CFG, OPTS.k, LST, ARR.tolist(), SC.k))]})}


if __name__ == "__main__":
    FORM
    run = pipe.run(check=False)
    print(run.state, run.stage("seen").error)
'''


@pytest.mark.parametrize("form, name", [
    ('CFG["opt"].update(k=2)', "CFG"), ('setattr(OPTS, "k", 2)', "OPTS"), ("LST.append(1)", "LST"),
    ("LST.extend([1])", "LST"), ("apply(2)", "CFG"), ("configure()", "CFG"),
    ("random.shuffle(LST)", "LST"), ("np.copyto(ARR, 2)", "ARR"), ("np.multiply(ARR, 2, out=ARR)", "ARR"),
    ("SC.fit(2)", "SC"),
    ("rows = []\n    rows.append(1)\n    summary(rows)", None),
])
def test_a_value_the_main_block_changes_in_place_is_refused_as_an_assignment_is(tmp_path: Path, form: str,
                                                                                name: str | None) -> None:
    """The sixth and seventh red teams (c86e, c87, mainmut, mainmeth): ``CFG.update(vars(args))`` in a
    ``main()`` the main block calls, ``random.shuffle(LST)``, ``np.copyto(ARR, 2)``, ``out=``, a method of
    the script's class setting ``self.k``,
    ``CFG["opt"].update(...)``, ``setattr(OPTS, "k", 2)``, ``LST.append(1)``, a helper that sets an item:
    the ranks computed with the values set at the top while the key held the changed ones, and the result
    was committed.  Changing the main block's own objects (and a function's own) is not refused."""
    (tmp_path / "p.py").write_text(LATE_IN_PLACE.replace("FORM", form))
    done = subprocess.run([sys.executable, "p.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HETFLOW_WORKDIR=str(tmp_path / "work")))
    if name is None:
        assert done.stdout.startswith("DONE"), done.stdout + done.stderr
    else:
        assert done.stdout.startswith("FAILED") and f"it reads {name}, which the script sets" in done.stdout, \
            done.stdout + done.stderr


WAITS = '''
import os
import time
from pathlib import Path

import pyarrow as pa
import hetflow as hf
from mylib import calc

HERE = Path(__file__).resolve().parent
pipe = hf.Pipeline("waits", pilot=hf.PilotDescription(name="two", cores_per_node=2, memory_per_node=2**33))


@pipe.stage(cores_per_rank=2, outputs=["slow"])
def slow(ctx):  # holds both cores until the test says go
    (HERE / "started").touch()
    while not (HERE / "go").exists():
        time.sleep(0.1)
    return {"slow": pa.table({"v": [0]})}


@pipe.stage(cores_per_rank=2, outputs=["uses"], files=["data.txt"])
def uses(ctx):
    return {"uses": pa.table({"v": [calc.f() * 100 + int(ctx.files[0].read_text())]})}
'''


@pytest.mark.parametrize("edited", ["module", "file", "same"])
def test_an_edit_while_a_stage_waits_for_its_slot_does_not_run_under_the_earlier_key(tmp_path: Path,
                                                                                      edited: str) -> None:
    """The red team's second round: the key was made when the stage was looked up, the worker read the
    files when it started; an edit in between stored the new result under the old key (CACHED later)."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (tmp_path / "mylib" / "calc.py").write_text("def f():\n    return 1\n")
    (tmp_path / "data.txt").write_text("1")
    (tmp_path / "p.py").write_text(WAITS)
    proc = subprocess.Popen([*HETFLOW, "run", "p.py", "--no-progress", "--workdir", str(tmp_path / "work")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.5)  # longer than the re-check's threshold
        if edited == "module":
            (tmp_path / "mylib" / "calc.py").write_text("def f():\n    return 2\n")
        else:  # "same": rewritten with what it held (a checkout, an editor): not a change
            (tmp_path / "data.txt").write_text("1" if edited == "same" else "2")
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    shown = status(tmp_path)
    if edited == "same":
        assert shown["uses"]["state"] == "DONE" and value(shown, "uses") == 101, (out, err)
        return
    assert shown["uses"]["state"] == "FAILED", (out, err)
    assert "changed while it waited for its slot" in shown["uses"]["error"], shown["uses"]["error"]
    again = run(tmp_path)  # a new run makes its key from what is there now, and computes with it
    assert again["uses"]["state"] == "DONE"
    assert value(again, "uses") == (201 if edited == "module" else 102)
