"""Stale results the fifth red team found (issue 25): what a stage reads that the key did not name.

Each test writes a small pipeline, runs it with the ``hetflow`` command (real
subprocess, real mpiexec, real SQLite), changes what the stage depends on the
way the attack did, runs again and checks that the stage RAN, that its dataset
holds the new value, and that a third run is served from the cache: a module
loaded outside the installation by any loader (a zip archive, a
``SourceFileLoader`` file named ``*.conf``, ``exec_module`` without
``sys.modules``, a C extension), a library-wide setting made by a call at the
script's top, a global read by ``eval`` of a parameter (see
:mod:`hetflow.fingerprint`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import zipfile
from pathlib import Path

import pytest

from test_cache_stale import edit, run, states, value

ZIPPED = '''
import sys
sys.path.insert(0, LIB + "/tools.zip")
import pyarrow as pa
import hetflow as hf
from ziptools import calibrate

pipe = hf.Pipeline("zipped")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [calibrate(10)]})}
'''

CONF = '''
from importlib.machinery import SourceFileLoader
import pyarrow as pa
import hetflow as hf

settings = SourceFileLoader("settings", LIB + "/settings.conf").load_module()
pipe = hf.Pipeline("conf")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [settings.GAIN * 10]})}
'''

EXECUTED = '''
import importlib.util
import pyarrow as pa
import hetflow as hf

spec = importlib.util.spec_from_file_location("plug", LIB + "/plug.py")
plug = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plug)
pipe = hf.Pipeline("executed")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [plug.calibrate(10)]})}
'''

EXTENSION = '''
import sys
sys.path.insert(0, LIB)
import pyarrow as pa
import hetflow as hf
import fastlab

pipe = hf.Pipeline("extension")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [fastlab.gain() * 10]})}
'''

FASTLAB = r'''
#include <Python.h>
static PyObject* gain(PyObject* s, PyObject* a) { return PyLong_FromLong(GAIN); }
static PyMethodDef M[] = {{"gain", gain, METH_NOARGS, ""}, {0}};
static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "fastlab", 0, -1, M};
PyMODINIT_FUNC PyInit_fastlab(void) { return PyModule_Create(&D); }
'''


def write_zip(lib: Path, gain: int) -> None:
    with zipfile.ZipFile(lib / "tools.zip", "w") as zipped:
        zipped.writestr("ziptools.py", f"GAIN = {gain}\n\n\ndef calibrate(x):\n    return x * GAIN\n")


def write_conf(lib: Path, gain: int) -> None:
    (lib / "settings.conf").write_text(f"GAIN = {gain}\n")


def write_plug(lib: Path, gain: int) -> None:
    (lib / "plug.py").write_text(f"GAIN = {gain}\n\n\ndef calibrate(x):\n    return x * GAIN\n")


def build_extension(lib: Path, gain: int) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if compiler is None or not os.path.isfile(os.path.join(include, "Python.h")):
        pytest.skip("needs a C compiler and Python's headers to build an extension module")
    (lib / "fastlab.c").write_text(FASTLAB)
    target = lib / f"fastlab{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, f"-DGAIN={gain}", "-shared", "-fPIC", f"-I{include}", str(lib / "fastlab.c"), "-o",
                    str(target)], check=True, capture_output=True, timeout=120)


@pytest.mark.parametrize("script, write, module", [
    (ZIPPED, write_zip, "ziptools"), (CONF, write_conf, "settings"), (EXECUTED, write_plug, "plug"),
    (EXTENSION, build_extension, "fastlab"),
], ids=["zip-archive-on-sys-path", "source-file-loader-conf", "exec-module-without-sys-modules",
        "c-extension-rebuilt"])
def test_a_module_loaded_outside_the_installation_by_any_loader_reruns_its_stage_when_its_file_changes(
        tmp_path: Path, script: str, write, module: str) -> None:
    """The helper lies outside the script's folder, so neither the key's walk (user code) nor the ranks'
    observation (``.py`` files in ``sys.modules``) saw it: a zip member's path is no file, a ``.conf`` or a
    ``.so`` is not ``.py``, ``exec_module`` leaves ``sys.modules`` alone; an edit was served CACHED."""
    lib = tmp_path / "lib"
    lib.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    write(lib, 2)
    (project / "p.py").write_text(script.replace("LIB", repr(str(lib))))
    assert value(run(project), "out") == 20
    write(lib, 3)
    edited = run(project)
    assert states(edited) == {"make": "DONE"}, edited["make"]["cache"]
    assert f"module {module} changed" in edited["make"]["cache"]["reason"]
    assert value(edited, "out") == 30
    assert states(run(project)) == {"make": "CACHED"}


SETTINGS = '''
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import hetflow as hf

SETTING

pipe = hf.Pipeline("settings")


@pipe.stage(outputs=["out"])
def make(ctx):
    return {"out": pa.table({"v": [OUTPUT]})}
'''


@pytest.mark.parametrize("before, after, output", [
    ("np.set_printoptions(precision=5)", "np.set_printoptions(precision=2)", "str(np.array([1 / 3]))"),
    ("pd.set_option('display.precision', 6)", "pd.set_option('display.precision', 2)",
     "pd.DataFrame({'flux': [1 / 3]}).to_string()"),
    ("pl.Config.set_float_precision(5)", "pl.Config.set_float_precision(2)", "str(pl.DataFrame({'f': [1 / 3]}))"),
    ("pl.set_random_seed(1)", "pl.set_random_seed(2)",
     "str(pl.DataFrame({'a': list(range(100))}).sample(3)['a'].to_list())"),
], ids=["numpy-print-options", "pandas-option", "polars-config", "polars-random-seed"])
def test_a_library_setting_made_at_the_scripts_top_reruns_the_stage_when_it_changes(
        tmp_path: Path, before: str, after: str, output: str) -> None:
    """A call at the top sets a library-wide setting without assigning a global; the stage's output (the text
    of its numbers, its random draws) depends on it, and an edit was served CACHED."""
    (tmp_path / "p.py").write_text(SETTINGS.replace("SETTING", before).replace("OUTPUT", output))
    first = value(run(tmp_path), "out")
    edit(tmp_path / "p.py", before, after)
    edited = run(tmp_path)
    assert states(edited) == {"make": "DONE"}, edited["make"]["cache"]
    assert value(edited, "out") != first
    assert states(run(tmp_path)) == {"make": "CACHED"}


EVALUATED = '''
import pyarrow as pa
import hetflow as hf

SCALE = 2
OTHER = 1

pipe = hf.Pipeline("evaluated")


@pipe.stage(outputs=["e"], params={"expr": "SCALE * 3"})
def evaluates(ctx):
    return {"e": pa.table({"v": [eval(ctx.params["expr"])]})}


@pipe.stage(outputs=["p"])
def plain(ctx):
    return {"p": pa.table({"v": [OTHER]})}
'''


def test_a_global_that_eval_of_a_parameter_reads_reruns_the_stage_when_edited(tmp_path: Path) -> None:
    """``eval(ctx.params["expr"])`` with ``expr = "SCALE * 3"``: the global is named in a parameter's value,
    not in the code, and an edit of ``SCALE`` was served CACHED.  A stage that does not evaluate text keeps
    its cached output."""
    (tmp_path / "p.py").write_text(EVALUATED)
    assert value(run(tmp_path), "e") == 6
    edit(tmp_path / "p.py", "SCALE = 2", "SCALE = 5")
    edited = run(tmp_path)
    assert states(edited) == {"evaluates": "DONE", "plain": "CACHED"}, edited["evaluates"]["cache"]
    assert edited["evaluates"]["cache"]["reason"] == "SCALE changed"
    assert value(edited, "e") == 15
    assert states(run(tmp_path)) == {"evaluates": "CACHED", "plain": "CACHED"}
    assert value(run(tmp_path, "--param", "expr=SCALE * 4"), "e") == 20
