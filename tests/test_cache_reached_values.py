"""Stale results the sixth red team got (issue 25): code and values a stage reaches other than by name.

Each test writes a small pipeline, runs it as a user would (``hetflow run`` or
``python p.py ARGS``: real processes, real mpiexec, real SQLite), changes what the
stage reads the way the attack did, runs again and checks that the stage ran and
that its dataset holds the new value, and that what it does not reach stays cached.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from test_cache_stale import edit, hetflow, run, states, status, value

REG = '''
REGISTRY = {}


class Base:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        REGISTRY[cls.name] = cls


def lookup(name):
    return REGISTRY[name]
'''

PLUGINS = '''
_PLUGINS = {}


def register(name):
    def deco(f):
        _PLUGINS[name] = f
        return f
    return deco


def get(name):
    return _PLUGINS[name]
'''

TABLES = '''
def _make():
    table = {}

    def register(name):
        def deco(f):
            table[name] = f
            return f
        return deco

    def get(name):
        return table[name]
    return register, get


register, get = _make()
'''

REGISTERED = '''
import pyarrow as pa
import hetflow as hf
import helpers
import plugins
import tables
from reg import Base, lookup


class Doubler(Base):
    name = "d"
    factor = 1


class Impl(helpers.Root):
    factor = 3


@plugins.register("a")
def norm_a(x):
    return x * 1


@tables.register("b")
def norm_b(x):
    return x + 0


pipe = hf.Pipeline("registered")


@pipe.stage(outputs=["subclass"])
def by_init_subclass(ctx):
    return {"subclass": pa.table({"v": [lookup("d").factor * 10]})}


@pipe.stage(outputs=["listed"])
def by_subclasses(ctx):
    return {"listed": pa.table({"v": [helpers.Root.__subclasses__()[0].factor * 10]})}


@pipe.stage(outputs=["plugin"])
def by_decorator(ctx):
    return {"plugin": pa.table({"v": [plugins.get("a")(10)]})}


@pipe.stage(outputs=["closed"])
def by_closure(ctx):
    return {"closed": pa.table({"v": [tables.get("b")(10)]})}
'''


def test_a_script_class_or_function_kept_in_a_local_modules_registry_reruns_what_reads_it(tmp_path: Path) -> None:
    """The sixth red team: a class of the script registered by a local module's ``__init_subclass__``, found
    by ``Root.__subclasses__()``, or a function registered by a local module's decorator (the commonest
    plugin pattern, also with the table in a closure): editing it left the stage CACHED with the old result.
    Code reached as a value of a reached module counts by its code and class attributes, as when a stage
    names it."""
    (tmp_path / "reg.py").write_text(REG)
    (tmp_path / "plugins.py").write_text(PLUGINS)
    (tmp_path / "tables.py").write_text(TABLES)
    (tmp_path / "helpers.py").write_text("class Root:\n    pass\n")
    (tmp_path / "p.py").write_text(REGISTERED)
    first = run(tmp_path)
    assert [value(first, n) for n in ("subclass", "listed", "plugin", "closed")] == [10, 30, 10, 10]
    cached = {"by_init_subclass": "CACHED", "by_subclasses": "CACHED", "by_decorator": "CACHED", "by_closure": "CACHED"}
    edit(tmp_path / "p.py", "factor = 1", "factor = 2")
    second = run(tmp_path)
    assert states(second) == {**cached, "by_init_subclass": "DONE"}
    assert value(second, "subclass") == 20 and second["by_init_subclass"]["cache"]["reason"] == "class Doubler changed"
    edit(tmp_path / "p.py", "factor = 3", "factor = 4")
    third = run(tmp_path)
    assert states(third) == {**cached, "by_subclasses": "DONE"}
    assert value(third, "listed") == 40 and third["by_subclasses"]["cache"]["reason"] == "class Impl changed"
    edit(tmp_path / "p.py", "return x * 1", "return x * 2")
    fourth = run(tmp_path)
    assert states(fourth) == {**cached, "by_decorator": "DONE"}
    assert value(fourth, "plugin") == 20 and fourth["by_decorator"]["cache"]["reason"] == "code of norm_a() changed"
    edit(tmp_path / "p.py", "return x + 0", "return x + 5")
    fifth = run(tmp_path)
    assert states(fifth) == {**cached, "by_closure": "DONE"}
    assert value(fifth, "closed") == 15 and fifth["by_closure"]["cache"]["reason"] == "code of norm_b() changed"
    assert set(states(run(tmp_path)).values()) == {"CACHED"}  # the key is the same in a new process


BY_MODULE = '''
import importlib
import sys
import pyarrow as pa
import hetflow as hf


def f_a(x):
    return x * 1


def g_a(x):
    return x * 1


MODE = "a"
pipe = hf.Pipeline("by_module")


@pipe.stage(outputs=["imported"])
def imported(ctx):
    return {"imported": pa.table({"v": [getattr(importlib.import_module(__name__), "f_" + MODE)(10)]})}


@pipe.stage(outputs=["modules"])
def modules(ctx):
    return {"modules": pa.table({"v": [getattr(sys.modules[__name__], "g_" + MODE)(10)]})}
'''


def test_a_script_function_picked_by_a_computed_name_on_the_script_module_reruns_what_reads_it(
        tmp_path: Path) -> None:
    """``getattr(importlib.import_module(__name__), "f_" + MODE)`` reads the script's namespace as
    ``globals()[...]`` does: every function of the script counts (edited: CACHED with the old result before)."""
    (tmp_path / "p.py").write_text(BY_MODULE)
    first = run(tmp_path)
    assert (value(first, "imported"), value(first, "modules")) == (10, 10)
    edit(tmp_path / "p.py", "def f_a(x):\n    return x * 1", "def f_a(x):\n    return x * 2")
    second = run(tmp_path)
    assert second["imported"]["state"] == "DONE" and value(second, "imported") == 20
    assert second["imported"]["cache"]["reason"] == "code of f_a() changed"
    edit(tmp_path / "p.py", "def g_a(x):\n    return x * 1", "def g_a(x):\n    return x * 3")
    third = run(tmp_path)
    assert third["modules"]["state"] == "DONE" and value(third, "modules") == 30


STAND_IN = '''
import sys
import types
import pyarrow as pa
import hetflow as hf


class _Cfg:
    K = 1


sys.modules["labcfg"] = types.SimpleNamespace(K=1)
sys.modules["labobj"] = _Cfg()
pipe = hf.Pipeline("stand_in")


@pipe.stage(outputs=["ns"])
def namespace(ctx):
    import labcfg
    return {"ns": pa.table({"v": [labcfg.K * 10]})}


@pipe.stage(outputs=["obj"])
def instance(ctx):
    import labobj
    return {"obj": pa.table({"v": [labobj.K * 10]})}
'''


def test_an_object_put_in_sys_modules_counts_by_value(tmp_path: Path) -> None:
    """``sys.modules["labcfg"] = types.SimpleNamespace(K=1)`` (or an instance) then ``import labcfg`` in the
    stage: the run crashed with a raw AttributeError from the fingerprint.  It counts by its attributes."""
    (tmp_path / "p.py").write_text(STAND_IN)
    first = run(tmp_path)
    assert (value(first, "ns"), value(first, "obj")) == (10, 10)
    edit(tmp_path / "p.py", "SimpleNamespace(K=1)", "SimpleNamespace(K=2)")
    second = run(tmp_path)
    assert states(second) == {"namespace": "DONE", "instance": "CACHED"} and value(second, "ns") == 20
    assert second["namespace"]["cache"]["reason"] == "sys.modules['labcfg'] changed"
    edit(tmp_path / "p.py", "    K = 1", "    K = 3")
    third = run(tmp_path)
    assert states(third) == {"namespace": "CACHED", "instance": "DONE"} and value(third, "obj") == 30


ARGV_STAGES = '''
import sys
import pyarrow as pa


def in_module(ctx):
    return {"moduled": pa.table({"v": [int(sys.argv[1]) * 100]})}
'''

ARGV = '''
import sys
import pyarrow as pa
import hetflow as hf
from stages import in_module

pipe = hf.Pipeline("argv")
pipe.stage(outputs=["moduled"])(in_module)


@pipe.stage(outputs=["arg"])
def reads_argv(ctx):
    return {"arg": pa.table({"v": [int(sys.argv[1]) * 10]})}


@pipe.stage(outputs=["other"])
def other(ctx):
    return {"other": pa.table({"v": [1]})}


if __name__ == "__main__":
    pipe.run(workdir="work")
'''


def test_a_stage_reading_the_scripts_arguments_reruns_when_they_change(tmp_path: Path) -> None:
    """``python p.py 1`` then ``python p.py 2``: a stage reading ``sys.argv[1]`` was CACHED with 1's result.
    The arguments count for a stage whose code reads them, and its ranks see the same (those of a stage
    defined in a local module too: they saw the worker's own arguments before)."""
    (tmp_path / "stages.py").write_text(ARGV_STAGES)
    (tmp_path / "p.py").write_text(ARGV)

    def script(arg: str) -> dict[str, object]:
        done = subprocess.run([sys.executable, "p.py", arg], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return status(tmp_path)

    first = script("1")
    assert (value(first, "arg"), value(first, "moduled")) == (10, 100)
    second = script("2")
    assert states(second) == {"in_module": "DONE", "reads_argv": "DONE", "other": "CACHED"}
    assert (value(second, "arg"), value(second, "moduled")) == (20, 200)
    assert second["reads_argv"]["cache"]["reason"] == "sys.argv[1:] changed"
    assert states(script("2")) == {"in_module": "CACHED", "reads_argv": "CACHED", "other": "CACHED"}


NAN = '''
import math
import pyarrow as pa
import hetflow as hf

X = float("nan")
pipe = hf.Pipeline("nan")


@pipe.stage(outputs=["out"], params={"x": 1.0})
def make(ctx):
    return {"out": pa.table({"v": [math.copysign(1, ctx.params["x"])]})}


@pipe.stage(outputs=["glob"])
def reads_global(ctx):
    return {"glob": pa.table({"v": [math.copysign(1, X)]})}
'''


def test_a_nan_with_a_minus_sign_is_refused_as_a_parameter_and_counts_by_its_bits_as_a_value(
        tmp_path: Path) -> None:
    """``--param x=-nan`` after ``x=nan`` was served nan's result: the run's record keeps every NaN as nan.
    It is refused, naming the parameter and the stage.  A global ``-nan`` (whose ``repr`` is ``nan``) counts
    by its bits."""
    (tmp_path / "p.py").write_text(NAN)
    first = run(tmp_path, "--param", "x=nan")
    assert (value(first, "out"), value(first, "glob")) == (1.0, 1.0)
    refused = hetflow("run", "p.py", "--no-progress", "--param", "x=-nan", cwd=tmp_path)
    assert refused.returncode != 0
    assert "--param x=-nan (stage 'make'): the run records every NaN as nan" in refused.stderr, refused.stderr
    edit(tmp_path / "p.py", 'X = float("nan")', 'X = -float("nan")')
    signed = run(tmp_path, "--param", "x=nan")
    assert states(signed) == {"make": "CACHED", "reads_global": "DONE"} and value(signed, "glob") == -1.0


ON_BUILTINS = '''
import builtins
import pyarrow as pa
import hetflow as hf

builtins.SCALE = 1
pipe = hf.Pipeline("on-builtins")


@pipe.stage(outputs=["scaled"])
def scaled(ctx):
    return {"scaled": pa.table({"v": [SCALE * 10, len("ab")]})}


if __name__ == "__main__":
    pipe.run()
'''


def test_a_value_the_script_puts_on_builtins_counts_where_a_stage_reads_it(tmp_path: Path) -> None:
    """``builtins.SCALE = 1`` at the top, read as a bare ``SCALE`` in the stage (round-6 red team c99): the
    name is found in builtins, which the key took for Python's own; a value put there counts as a global."""
    (tmp_path / "p.py").write_text(ON_BUILTINS)
    first = run(tmp_path)
    assert value(first, "scaled") == 10
    edit(tmp_path / "p.py", "builtins.SCALE = 1", "builtins.SCALE = 2")
    second = run(tmp_path)
    assert states(second) == {"scaled": "DONE"} and value(second, "scaled") == 20
    assert second["scaled"]["cache"]["reason"] == "builtins.SCALE changed"
    assert states(run(tmp_path)) == {"scaled": "CACHED"}


IN_MEMORY_BUFFER = '''
import csv
import io
import pyarrow as pa
import hetflow as hf

BUF = io.StringIO("k\\n1\\n")
pipe = hf.Pipeline("buffer")


@pipe.stage(outputs=["read"])
def read(ctx):
    BUF.seek(0)
    return {"read": pa.table({"v": [int(list(csv.DictReader(BUF))[0]["k"]) * 10]})}


if __name__ == "__main__":
    pipe.run()
'''


def test_a_global_buffer_in_memory_counts_by_its_content(tmp_path: Path) -> None:
    """``BUF = io.StringIO("k\\n1\\n")`` read by a stage (round-6 red team c104): it counted as an object
    without state, so an edited content was served CACHED."""
    (tmp_path / "p.py").write_text(IN_MEMORY_BUFFER)
    assert value(run(tmp_path), "read") == 10
    edit(tmp_path / "p.py", 'io.StringIO("k\\n1\\n")', 'io.StringIO("k\\n2\\n")')
    second = run(tmp_path)
    assert states(second) == {"read": "DONE"} and value(second, "read") == 20
    assert states(run(tmp_path)) == {"read": "CACHED"}


SEEDED_LATER = '''
import random
import numpy as np
import pyarrow as pa
import hetflow as hf

SEED_LINE
pipe = hf.Pipeline("seeded-later")


@pipe.stage(outputs=["drawn"])
def drawn(ctx):
    return {"drawn": pa.table({"v": [float(np.random.rand()) + random.random()]})}


if __name__ == "__main__":
    pipe.run()
'''


def test_a_seed_added_after_an_unseeded_run_reruns_the_stage(tmp_path: Path) -> None:
    """A first run without a seed leaves no generator state in its record (an unseeded state differs in
    every process); adding ``np.random.seed(1)`` then was served CACHED with the unseeded draw (round-7 red
    team seedadd, torchseed).  Seeding calls count by their text."""
    (tmp_path / "p.py").write_text(SEEDED_LATER.replace("SEED_LINE", "pass"))
    run(tmp_path)
    edit(tmp_path / "p.py", "pass\n", "np.random.seed(1)\nrandom.seed(1)\n")
    second = run(tmp_path)
    assert states(second) == {"drawn": "DONE"}, states(second)
    np.random.seed(1)
    random.seed(1)
    assert value(second, "drawn") == float(np.random.rand()) + random.random()
    assert states(run(tmp_path)) == {"drawn": "CACHED"}
    edit(tmp_path / "p.py", "np.random.seed(1)", "np.random.seed(2)")
    assert states(run(tmp_path)) == {"drawn": "DONE"}
