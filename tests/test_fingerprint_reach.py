"""How far the code fingerprint reaches: cases an attack on the cache key found (issue 17), now fixed.

Each edit below changes what a stage computes, so it must change the stage's
code fingerprint (else ``hetflow run`` serves the old output as ``CACHED``);
the edits in the ``leaves`` tests must not.  The end-to-end test runs hetflow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hetflow.fingerprint import code_fingerprint


def fingerprint(where: Path, files: dict[str, str], stage: str = "stage") -> dict[str, str]:
    """Write ``files`` (relative paths; ``pipeline.py`` is the script) into ``where``, import the script, fingerprint ``stage``."""
    where.mkdir(parents=True)
    for rel, text in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(textwrap.dedent(text))
    before = set(sys.modules)
    sys.path.insert(0, str(where))
    try:
        spec = importlib.util.spec_from_file_location("__hetflow_script__", where / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return code_fingerprint(getattr(module, stage))
    finally:
        sys.path.remove(str(where))
        for added in set(sys.modules) - before:
            if str(getattr(sys.modules[added], "__file__", "")).startswith(str(where)):
                del sys.modules[added]


def changes(tmp_path: Path, files: dict[str, str], rel: str, old: str, new: str) -> bool:
    a = fingerprint(tmp_path / "a", files)
    assert old in files[rel]
    b = fingerprint(tmp_path / "b", {**files, rel: files[rel].replace(old, new)})
    return a != b


PACKAGE = {
    "pipeline.py": """
        from mylib import helper
        def stage(ctx):
            return helper()
    """,
    "mylib/__init__.py": "from .core import helper\n",
    "mylib/core.py": "from .consts import SCALE\ndef helper():\n    return SCALE\n",
    "mylib/consts.py": "SCALE = 2\n",
}


def test_a_constant_in_a_sibling_submodule_of_a_local_package(tmp_path: Path) -> None:
    # core.py does `from .consts import SCALE`: core is hashed whole, consts.py never is
    assert changes(tmp_path, PACKAGE, "mylib/consts.py", "SCALE = 2", "SCALE = 3")


def test_star_import_of_a_package_whose_module_reads_another_submodule(tmp_path: Path) -> None:
    files = {
        "pipeline.py": "from lib2 import *\ndef stage(ctx):\n    return star_helper()\n",
        "lib2/__init__.py": "from .impl import *\n",
        "lib2/impl.py": "__all__ = ['star_helper']\nfrom .tables import FACTORS\ndef star_helper():\n    return FACTORS['a']\n",
        "lib2/tables.py": "FACTORS = {'a': 2}\n",
    }
    assert changes(tmp_path, files, "lib2/tables.py", "2", "3")


def test_a_submodule_imported_inside_the_stage(tmp_path: Path) -> None:
    # `from inner import sub` inside the function: only inner/__init__.py (empty) is hashed
    files = {
        "pipeline.py": "def stage(ctx):\n    from inner import sub\n    return sub.VAL\n",
        "inner/__init__.py": "",
        "inner/sub.py": "VAL = 2\n",
    }
    assert changes(tmp_path, files, "inner/sub.py", "VAL = 2", "VAL = 3")



def test_a_submodule_of_a_package_never_imported_is_located_not_run(tmp_path: Path) -> None:
    files = {
        "pipeline.py": "def stage(ctx):\n    from inner.deep import sub\n    return sub.VAL\n",
        "inner/__init__.py": "open(__file__ + '.ran', 'w').close()\n",
        "inner/deep/__init__.py": "open(__file__ + '.ran', 'w').close()\n",
        "inner/deep/sub.py": "VAL = 2\n",
    }
    assert changes(tmp_path, files, "inner/deep/sub.py", "VAL = 2", "VAL = 3")
    assert not list(tmp_path.rglob("*.ran"))


SPLIT = {
    "pipeline.py": """
        from pkg import fa
        def stage(ctx):
            return fa()
    """,
    "pkg/__init__.py": "from .a import fa\nfrom .b import fb\n",
    "pkg/a.py": "from .consts import A\ndef fa():\n    return A\n",
    "pkg/b.py": "from .consts import B\ndef fb():\n    return B\n",
    "pkg/consts.py": "A = 1\nB = 2\n",
    "pkg/unused.py": "C = 3\n",
}


@pytest.mark.parametrize(("rel", "old", "new"), [
    ("pkg/b.py", "return B", "return B + 1"),          # a sibling the stage never reaches
    ("pkg/unused.py", "C = 3", "C = 4"),               # a module nobody imports
    ("pkg/__init__.py", "from .b", "# re-exports\nfrom .b"),  # the package itself: the stage names fa, not pkg
])
def test_a_package_counts_by_the_modules_the_stage_reaches(tmp_path: Path, rel: str, old: str, new: str) -> None:
    assert not changes(tmp_path, SPLIT, rel, old, new)


def test_the_modules_reached_count_whole(tmp_path: Path) -> None:
    assert changes(tmp_path / "a", SPLIT, "pkg/a.py", "return A", "return A + 1")
    # a.py imports consts, so consts counts whole: B too, although only fa() runs
    assert changes(tmp_path / "c", SPLIT, "pkg/consts.py", "B = 2", "B = 3")


@pytest.mark.parametrize("stage_source", [
    "import pkg.a\ndef stage(ctx):\n    from pkg import fa\n    return fa()\n",    # imported inside the stage
    "import helper_mod\ndef stage(ctx):\n    return helper_mod.go()\n",          # through a local module
])
def test_a_name_imported_from_a_package_follows_its_own_module(tmp_path: Path, stage_source: str) -> None:
    files = {**SPLIT, "pipeline.py": stage_source, "helper_mod.py": "from pkg import fa\ndef go():\n    return fa()\n"}
    assert changes(tmp_path / "a", files, "pkg/a.py", "return A", "return A + 1")
    assert not changes(tmp_path / "b", files, "pkg/b.py", "return B", "return B + 1")


def test_a_package_never_imported_counts_whole(tmp_path: Path) -> None:
    """Without importing it, what ``fa`` is in ``pkg`` cannot be seen: pkg counts whole, with all it imports."""
    files = {**SPLIT, "pipeline.py": "def stage(ctx):\n    from pkg import fa\n    return fa()\n"}
    assert changes(tmp_path / "a", files, "pkg/a.py", "return A", "return A + 1")
    assert changes(tmp_path / "b", files, "pkg/b.py", "return B", "return B + 1")


def test_a_stage_that_names_the_package_reaches_what_it_imports(tmp_path: Path) -> None:
    """``import pkg; pkg.fa()``: the package's own source counts, and so does everything it imports."""
    files = {**SPLIT, "pipeline.py": "import pkg\ndef stage(ctx):\n    return pkg.fa()\n"}
    assert changes(tmp_path / "a", files, "pkg/__init__.py", "from .b", "# re-exports\nfrom .b")
    assert changes(tmp_path / "b", files, "pkg/b.py", "return B", "return B + 1")
    assert not changes(tmp_path / "c", files, "pkg/unused.py", "C = 3", "C = 4")


def test_the_body_of_an_lru_cache_helper(tmp_path: Path) -> None:
    # a functools._lru_cache_wrapper is neither a function nor hashable by value: "<unhashable ...>"
    files = {"pipeline.py": """
        import functools
        @functools.lru_cache
        def helper():
            return 2
        def stage(ctx):
            return helper()
    """}
    assert changes(tmp_path, files, "pipeline.py", "return 2", "return 3")


def test_a_config_object_of_a_slots_class(tmp_path: Path) -> None:
    # no __dict__: falls to repr, which shows an address: "<unhashable>", and the class is not followed
    files = {"pipeline.py": """
        class Config:
            __slots__ = ("scale",)
            def __init__(self, scale):
                self.scale = scale
        CONFIG = Config(2)
        def stage(ctx):
            return CONFIG.scale
    """}
    assert changes(tmp_path, files, "pipeline.py", "Config(2)", "Config(3)")


def test_a_cached_property_body(tmp_path: Path) -> None:
    files = {"pipeline.py": """
        import functools
        class Model:
            @functools.cached_property
            def scale(self):
                return 2
        def stage(ctx):
            return Model().scale
    """}
    assert changes(tmp_path, files, "pipeline.py", "return 2", "return 3")


def test_the_arguments_of_a_global_partial(tmp_path: Path) -> None:
    # global_value() follows a partial but throws away the text naming its arguments
    files = {"pipeline.py": """
        import functools
        def scaled(x, factor):
            return x * factor
        DOUBLE = functools.partial(scaled, factor=2)
        def stage(ctx):
            return DOUBLE(1)
    """}
    assert changes(tmp_path, files, "pipeline.py", "factor=2", "factor=3")


def test_the_instance_of_a_global_bound_method(tmp_path: Path) -> None:
    files = {"pipeline.py": """
        class Scaler:
            def __init__(self, factor):
                self.factor = factor
            def apply(self, x):
                return x * self.factor
        APPLY = Scaler(2).apply
        def stage(ctx):
            return APPLY(1)
    """}
    assert changes(tmp_path, files, "pipeline.py", "Scaler(2)", "Scaler(3)")


def test_a_metaclass_method(tmp_path: Path) -> None:
    files = {"pipeline.py": """
        class Meta(type):
            def __call__(cls):
                return 2
        class Thing(metaclass=Meta):
            pass
        def stage(ctx):
            return Thing()
    """}
    assert changes(tmp_path, files, "pipeline.py", "return 2", "return 3")



MORE = {
    "singledispatch": ("""
        import functools
        @functools.singledispatch
        def scale(x):
            return x
        @scale.register
        def _(x: int):
            return x * 2
        def stage(ctx):
            return scale(1)
    """, "x * 2", "x * 3"),
    "wraps instance": ("""
        import functools
        class traced:
            def __init__(self, func):
                functools.update_wrapper(self, func)
            def __call__(self, *args):
                return self.__wrapped__(*args)
        @traced
        def helper():
            return 2
        def stage(ctx):
            return helper()
    """, "return 2", "return 3"),
    "lru_cache method": ("""
        import functools
        class Model:
            @functools.lru_cache(maxsize=4)
            def scale(self):
                return 2
        def stage(ctx):
            return Model().scale()
    """, "return 2", "return 3"),
    "lru_cache size": ("""
        import functools
        @functools.lru_cache(maxsize=4)
        def helper():
            return 2
        def stage(ctx):
            return helper()
    """, "maxsize=4", "maxsize=8"),
    "builtin bound method": ("""
        LOOKUP = {"a": 2}.get
        def stage(ctx):
            return LOOKUP("a")
    """, '"a": 2', '"a": 3'),
    "partialmethod": ("""
        import functools
        class Model:
            def _scale(self, x, factor):
                return x * factor
            double = functools.partialmethod(_scale, factor=2)
        def stage(ctx):
            return Model().double(1)
    """, "factor=2", "factor=3"),
    "slots in a base class, mangled": ("""
        class Base:
            __slots__ = ("__scale",)
            def __init__(self, scale):
                self.__scale = scale
        class Config(Base):
            __slots__ = ("name", "__dict__")
        CONFIG = Config(2)
        CONFIG.name = "x"
        CONFIG.extra = 1
        def stage(ctx):
            return CONFIG
    """, "Config(2)", "Config(3)"),
    "a bound method of an object that holds it": ("""
        class Scaler:
            def __init__(self, factor):
                self.factor = factor
                self.callback = self.apply
            def apply(self, x):
                return x * self.factor
        APPLY = Scaler(2).apply
        def stage(ctx):
            return APPLY(1)
    """, "Scaler(2)", "Scaler(3)"),
}


@pytest.mark.parametrize("case", sorted(MORE))
def test_more_callables_and_objects(tmp_path: Path, case: str) -> None:
    source, old, new = MORE[case]
    files = {"pipeline.py": source}
    assert not changes(tmp_path / "same", files, "pipeline.py", old, old)  # stable: no address, no order
    assert changes(tmp_path / "edit", files, "pipeline.py", old, new)


LEFT = """
    import functools
    UNRELATED = 1
    class Scaler:
        __slots__ = ("factor",)
        def __init__(self, factor):
            self.factor = factor
        def apply(self, x):
            return x * self.factor
    def scaled(x, factor):
        return x * factor
    @functools.lru_cache
    def helper():
        return 2
    DOUBLE = functools.partial(scaled, factor=2)
    APPLY = Scaler(2).apply
    def stage(ctx):
        # uses a partial, a bound method and a cached helper
        return DOUBLE(1) + APPLY(1) + helper()
    def other(ctx):
        return UNRELATED
"""


@pytest.mark.parametrize(("old", "new"), [
    ("UNRELATED = 1", "UNRELATED = 2"),
    ("return UNRELATED", "return UNRELATED + 1"),
    ("# uses a partial", "# uses, reworded, a partial"),
    ("import functools\n", "import functools\n    # a comment; every line below moves\n\n"),
])
def test_what_the_stage_does_not_use_leaves_it_with_partials_methods_and_caches(tmp_path: Path, old: str,
                                                                                new: str) -> None:
    assert not changes(tmp_path, {"pipeline.py": LEFT}, "pipeline.py", old, new)


def test_a_module_logger_does_not_tie_the_key_to_the_verbosity(tmp_path: Path) -> None:
    # a Logger's repr, "<Logger name (LEVEL)>", shows the level: `hetflow -v run` must not re-run every stage
    # that logs through a module-level logger ("log changed"); a logger counts by its name
    import logging

    files = {"pipeline.py": """
        import logging
        log = logging.getLogger("attack.findings.logger")
        def stage(ctx):
            log.info("working")
            return 1
    """}
    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.WARNING)
        a = fingerprint(tmp_path / "a", files)
        root.setLevel(logging.DEBUG)
        b = fingerprint(tmp_path / "b", files)
    finally:
        root.setLevel(level)
    assert a == b


def test_a_numpy_vectorize_helper(tmp_path: Path) -> None:
    # like lru_cache, a callable wrapper object that is not a function: np.vectorize keeps it as .pyfunc
    files = {"pipeline.py": """
        import numpy as np
        @np.vectorize
        def helper(x):
            return x * 2
        def stage(ctx):
            return helper(1)
    """}
    assert changes(tmp_path, files, "pipeline.py", "x * 2", "x * 3")


def test_functions_held_in_a_simple_namespace(tmp_path: Path) -> None:
    files = {"pipeline.py": """
        import types
        def double(x):
            return x * 2
        OPS = types.SimpleNamespace(scale=double)
        def stage(ctx):
            return OPS.scale(1)
    """}
    assert changes(tmp_path, files, "pipeline.py", "x * 2", "x * 3")


MPATCH = "K = 1\nJ = 0\nITEMS = []\nclass Config:\n    A = 1\ndef scale(x):\n    return x * K\n" \
         "def configure(k):\n    global K\n    K = k\n"


@pytest.mark.parametrize("setting, stage_body", [
    ("mpatch.K = 11", "mpatch.K"),
    ("setattr(mpatch, 'K', 11)", "mpatch.K"),
    ("mpatch.K += 11", "mpatch.K"),
    ("mpatch.K = 11", "mpatch.scale(1)"),  # read inside the module, through its own global
    ("vars(mpatch)['K'] = 11", "mpatch.K"),
    ("mpatch.ITEMS.append(11)", "mpatch.ITEMS[0]"),
    ("mpatch.Config.A = 11", "mpatch.Config.A"),
    ("mpatch.configure(11)", "mpatch.scale(1)"),  # a function of the module that sets its global
    ("from mpatch import configure\nconfigure(11)", "mpatch.K"),
    ("import pkg.sub\npkg.sub.K = 11", "pkg.sub.K"),  # a package's submodule
])
def test_a_value_the_script_sets_on_a_module_it_imports(tmp_path: Path, setting: str, stage_body: str) -> None:
    files = {"pipeline.py": f"import mpatch\nimport pkg.sub\n{setting}\ndef stage(ctx):\n    return {stage_body}\n",
             "mpatch.py": MPATCH, "pkg/__init__.py": "", "pkg/sub.py": "K = 0\n"}
    assert changes(tmp_path, files, "pipeline.py", "11", "12")


def test_a_value_set_on_a_module_read_by_a_helper_module_that_imports_it_when_called(tmp_path: Path) -> None:
    files = {"pipeline.py": "import mpatch\nimport helper\nmpatch.K = 5\ndef stage(ctx):\n    return helper.get()\n",
             "helper.py": "def get():\n    from mpatch import K\n    return K\n", "mpatch.py": "K = 1\n"}
    assert changes(tmp_path, files, "pipeline.py", "5", "6")


def test_a_value_set_on_a_module_by_another_module_of_the_user(tmp_path: Path) -> None:
    files = {"pipeline.py": "import setup_run\nimport mpatch\ndef stage(ctx):\n    return mpatch.K\n",
             "setup_run.py": "import mpatch\nmpatch.K = 5\n", "mpatch.py": MPATCH}
    assert changes(tmp_path, files, "setup_run.py", "5", "6")


@pytest.mark.parametrize("setting", ["mpatch.J = 5", "setattr(mpatch, 'J', 5)", "mpatch.NEW = 5"])
def test_a_value_set_on_a_module_that_the_stage_does_not_read_leaves_it(tmp_path: Path, setting: str) -> None:
    # no code the stage reaches reads J or NEW (the module only assigns J); a name that the module reads
    # anywhere counts, as the module counts whole
    files = {"pipeline.py": f"import mpatch\n{setting}\ndef stage(ctx):\n    return mpatch.ITEMS\n",
             "mpatch.py": MPATCH}
    assert not changes(tmp_path, files, "pipeline.py", "5", "6")


def test_a_stage_that_does_not_reach_the_patched_module_is_left(tmp_path: Path) -> None:
    files = {"pipeline.py": "import mpatch\nmpatch.K = 5\ndef stage(ctx):\n    return 1\n", "mpatch.py": MPATCH}
    assert not changes(tmp_path, files, "pipeline.py", "5", "6")


def test_an_attribute_set_on_the_stage_function(tmp_path: Path) -> None:
    files = {"pipeline.py": "def stage(ctx):\n    return stage.alpha\nstage.alpha = 3\n"}
    assert changes(tmp_path, files, "pipeline.py", "= 3", "= 4")


SCRIPT = """
import pyarrow as pa
import hetflow as hf
from mylib import helper

pipe = hf.Pipeline("attack", pilot="local")

@pipe.stage(ranks=1, outputs=["out"])
def stage(ctx):
    return {"out": pa.table({"v": [helper()]})}
"""


HETFLOW = [str(Path(sys.executable).parent / "hetflow")] if os.path.exists(Path(sys.executable).parent / "hetflow") \
    else [sys.executable, "-m", "hetflow.cli"]


def _run_and_show(where: Path, script: str, *, site_packages: bool = False) -> tuple[dict[str, str], Any]:
    """Write ``script`` as ``where/pipeline.py``, ``hetflow run`` it (with ``where/site-packages`` on
    ``PYTHONPATH``: an installed-looking library) and read ``status --json``: each stage's state, and the
    first value of column ``v`` of dataset ``out``."""
    from hetflow.operators.dataset import Dataset

    env = {**os.environ, "PYTHONPATH": str(where / "site-packages")} if site_packages else None
    workdir = ["--workdir", str(where / "wd")]
    (where / "pipeline.py").write_text(script)
    done = subprocess.run([*HETFLOW, "run", "pipeline.py", "--no-progress", *workdir], cwd=where, capture_output=True,
                          text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = json.loads(subprocess.run([*HETFLOW, "status", "--json", *workdir], cwd=where, check=True,
                                      capture_output=True, text=True, env=env).stdout)
    states = {stage["name"]: stage["state"] for stage in shown["stages"]}
    return states, Dataset(shown["datasets"]["out"]).to_table().column("v")[0].as_py()


@pytest.mark.timeout(180)
def test_end_to_end_a_package_constant_edit_serves_the_old_rows(tmp_path: Path) -> None:
    for rel, text in {**PACKAGE, "pipeline.py": SCRIPT}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    run = [*HETFLOW, "run", "pipeline.py", "--no-progress", "--workdir", str(tmp_path / "wd")]
    subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=150)
    (tmp_path / "mylib/consts.py").write_text("SCALE = 3\n")
    second = subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=150)
    assert "CACHED" not in second.stdout + second.stderr, second.stdout + second.stderr


def _with_fakelib(where: Path, script: str, library: str, local: Mapping[str, str] | None = None,
                  stage: str = "stage") -> dict[str, str]:
    """The fingerprint of ``stage`` of ``script`` beside an installed-looking ``fakelib`` (a ``site-packages``
    folder on ``sys.path``: counted as a library, not as the user's code) and the local modules ``local``
    (``{module name: source}``, in the script's folder)."""
    (where / "site-packages").mkdir(parents=True)
    (where / "site-packages" / "fakelib.py").write_text(library)
    (where / "pipeline.py").write_text(script)
    for name, source in (local or {}).items():
        (where / f"{name}.py").write_text(source)
    sys.path[:0] = [str(where / "site-packages"), str(where)]
    try:
        spec = importlib.util.spec_from_file_location("__hetflow_script__", where / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return code_fingerprint(getattr(module, stage))
    finally:
        sys.path.remove(str(where / "site-packages"))
        sys.path.remove(str(where))
        for name in ["fakelib", *(local or {})]:
            sys.modules.pop(name, None)


@pytest.mark.parametrize("attrs", ['["pid"]', "attrs"])
def test_a_library_cache_that_a_call_fills_does_not_move_the_key(tmp_path: Path, attrs: str) -> None:
    """CI (session 17): a test module called ``psutil.process_iter()``, which keeps its Process objects in
    ``psutil._pmap``; every stage naming psutil counted that dict by its text, which changes as the processes
    live (a status), so a stage that waited for its slot was stopped as 'changed while it waited'.  Also when
    the call passes the helper's own parameter (red team 10 made a bare object set so count by value)."""
    import psutil

    files = {"pipeline.py": f"""
        import subprocess, sys
        import psutil
        def running(attrs=("pid",)):
            return [p.pid for p in psutil.process_iter({attrs})]
        def stage(ctx):
            return psutil.cpu_count()
    """}
    (tmp_path / "a").mkdir()
    for rel, text in files.items():
        (tmp_path / "a" / rel).write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location("__hetflow_script__", tmp_path / "a" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = code_fingerprint(module.stage)
    assert "psutil._pmap" in before  # the call site is found: a setting made so would count
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in module.running()
        filled = code_fingerprint(module.stage)
    finally:
        child.kill()
        child.wait()
    psutil.Process().children()  # the child is gone; the cache still holds its Process
    assert filled == before == code_fingerprint(module.stage)


SETTER_LIB = """
class Cosmology:
    def __init__(self, h0):
        self.h0 = h0
DEFAULT = None
def set_default(cosmology):
    global DEFAULT
    DEFAULT = cosmology
def distance(z):
    return z / DEFAULT.h0
"""


@pytest.mark.parametrize("setting", ["fakelib.set_default(fakelib.Cosmology(11))",
                                     "COSMO = fakelib.Cosmology(11)\nfakelib.set_default(COSMO)",
                                     "fakelib.set_default(cosmology=[fakelib.Cosmology(11)])"])
def test_a_library_object_the_script_hands_a_library_setter_counts_by_value(tmp_path: Path, setting: str) -> None:
    """The eighth red team (libown): ``default_cosmology.set(FlatLambdaCDM(H0=70))``, pint's
    ``set_application_registry(ureg)``: the library keeps an object of its own type, but its state is the
    script's choice.  Counted by type only, as a library's own cache is (``psutil._pmap``), an edit of H0 at
    the script's top was served CACHED."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.distance(1.0)\n"

    a, b = (_with_fakelib(tmp_path / "a", script, SETTER_LIB),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), SETTER_LIB))
    assert "fakelib.DEFAULT" in a and a["fakelib.DEFAULT"] != b["fakelib.DEFAULT"], (a, b)


@pytest.mark.parametrize("setting", ["fakelib.configure(11)", "fakelib.configure([11])",
                                     "fakelib.configure({'k': Cfg(11)})"])
def test_a_setting_a_library_call_stores_still_counts(tmp_path: Path, setting: str) -> None:
    """Plain data, or an object of the user's (not the library's own), set by calling the library."""
    script = ("import fakelib\nclass Cfg:\n    def __init__(self, k):\n        self.k = k\n"
              f"{setting}\ndef stage(ctx):\n    return fakelib.scale(1)\n")
    a, b = (_with_fakelib(tmp_path / "a", script, MPATCH),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), MPATCH))
    assert "fakelib.K" in a and a["fakelib.K"] != b["fakelib.K"], (a, b)


PRESET_LIB = SETTER_LIB + """
PRESETS = {"planck": 67, "wmap": 70}
def use(name):
    global DEFAULT
    DEFAULT = Cosmology(PRESETS[name])
def set_h0(h0):
    global DEFAULT
    DEFAULT = Cosmology(h0)
"""


@pytest.mark.parametrize("setting, edit", [
    ("fakelib.use('planck')", ("planck", "wmap")),
    ("fakelib.set_h0(h0=11)", ("11", "12")),
    ("H0 = 11\nfakelib.set_h0(H0)", ("11", "12")),
    ("def setup(h0):\n    fakelib.set_h0(h0)\nsetup(11)", ("11", "12")),
    ("def setup(c):\n    fakelib.set_default(c)\nsetup(fakelib.Cosmology(11))", ("11", "12")),
])
def test_a_library_object_a_setter_makes_from_the_scripts_arguments_counts_them(
        tmp_path: Path, setting: str, edit: tuple[str, str]) -> None:
    """The tenth red team: ``default_cosmology.set("Planck18")``-like setters given literals or plain names
    store an object of the library's own type, counted by type as its cache is; the call's arguments (or, in
    a helper, the helper's parameter) did not count, so an edit of them was served CACHED."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.distance(1.0)\n"
    a, b = (_with_fakelib(tmp_path / "a", script, PRESET_LIB),
            _with_fakelib(tmp_path / "b", script.replace(*edit), PRESET_LIB))
    assert "fakelib.DEFAULT" in a and a != b, (a, b)
    again = _with_fakelib(tmp_path / "c", script, PRESET_LIB)
    assert again == a  # and the same call makes the same key


@pytest.mark.timeout(240)
@pytest.mark.parametrize("setting", ["fakelib.set_h0(11)", "def setup(h0):\n    fakelib.set_h0(h0)\nsetup(11)"])
def test_end_to_end_an_edit_of_a_library_setters_argument_reruns_the_stage(tmp_path: Path, setting: str) -> None:
    """``hetflow run`` twice, the setter's argument edited between: the second run re-runs the stage and its
    rows are the new argument's; a third, unchanged, is served from the cache."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(PRESET_LIB)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib
        SETTING
        pipe = hf.Pipeline("setter")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.distance(1.0)]})}

        if __name__ == "__main__":
            pipe.run()
    """)

    def once(h0: str) -> tuple[str, float]:
        states, value = _run_and_show(tmp_path, script.replace("SETTING", setting.replace("11", h0)), site_packages=True)
        return states["stage"], value

    assert once("11") == ("DONE", 1 / 11)
    assert once("12") == ("DONE", 1 / 12)
    assert once("12") == ("CACHED", 1 / 12)


REGISTRY_LIB = """
class Cosmology:
    def __init__(self, h0):
        self.h0 = h0
REGISTRY = {}
_STATE = {"h0": 70}
def register(name, h0):
    REGISTRY[name] = Cosmology(h0)
def set_h0(h0):
    _STATE["h0"] = h0
def get(name):
    return REGISTRY[name]
def distance(z):
    return z / _STATE["h0"]
"""
LABSETUP = "import fakelib\ndef init(h0):\n    fakelib.register('planck', h0)\n"
INPLACE_SETTINGS = [
    ("fakelib.register('planck', 11)", "fakelib.get('planck').h0", None),
    ("from fakelib import register as reg\nreg('planck', 11)", "fakelib.get('planck').h0", None),
    ("import fakelib as fl\nH0 = 11\ntry:\n    fl.set_h0(H0)\nexcept KeyError:\n    pass", "fakelib.distance(1.0)",
     None),
    ("import labsetup\nlabsetup.init(11)", "fakelib.get('planck').h0", {"labsetup": LABSETUP}),
]


@pytest.mark.parametrize("setting, reads, local", INPLACE_SETTINGS)
def test_a_top_level_call_changing_a_librarys_state_in_place_counts_for_a_stage_using_it(
        tmp_path: Path, setting: str, reads: str, local: dict[str, str] | None) -> None:
    """The eleventh red team (libinplace): ``fakelib.register("planck", 11)`` at the script's top, where the
    library stores it in place (``REGISTRY[name] = Cosmology(h0)``, no ``global``), read by the stage through
    the library: 11 -> 12 gave the same key, so the stage was served CACHED with 11.  The call counts by its
    text and the plain values it passes, for a stage using the library; a stage that does not keeps its key."""
    script = (f"import fakelib\n{setting}\ndef stage(ctx):\n    return {reads}\n"
              "def other(ctx):\n    return 1\n")
    a, b = (_with_fakelib(tmp_path / "a", script, REGISTRY_LIB, local),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), REGISTRY_LIB, local))
    assert "calls into fakelib at the top level" in a and a != b, (a, b)
    assert _with_fakelib(tmp_path / "c", script, REGISTRY_LIB, local) == a  # the same call: the same key
    kept = [_with_fakelib(tmp_path / d, script.replace("11", h0), REGISTRY_LIB, local, stage="other")
            for d, h0 in (("d", "11"), ("e", "12"))]
    assert kept[0] == kept[1] and not any("fakelib" in k for k in kept[0]), kept


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting, local", [("fakelib.register('planck', 11)", None),
                                            ("import labsetup\nlabsetup.init(11)", {"labsetup": LABSETUP})])
def test_end_to_end_an_edit_of_a_top_level_registry_call_reruns_only_the_stage_using_the_library(
        tmp_path: Path, setting: str, local: dict[str, str] | None) -> None:
    """``hetflow run`` three times, the registered value edited after the first: the stage reading the registry
    re-runs with the new value, the stage not using the library stays CACHED; unchanged, both are CACHED."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(REGISTRY_LIB)
    for name, source in (local or {}).items():
        (tmp_path / f"{name}.py").write_text(source)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib
        SETTING
        pipe = hf.Pipeline("registry")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.get("planck").h0]})}

        @pipe.stage(outputs=["plain"])
        def other(ctx):
            return {"plain": pa.table({"v": [1]})}

        if __name__ == "__main__":
            pipe.run()
    """)

    def once(h0: str) -> tuple[dict[str, str], int]:
        return _run_and_show(tmp_path, script.replace("SETTING", setting.replace("11", h0)), site_packages=True)

    assert once("11") == ({"stage": "DONE", "other": "DONE"}, 11)
    assert once("12") == ({"stage": "DONE", "other": "CACHED"}, 12)
    assert once("12") == ({"stage": "CACHED", "other": "CACHED"}, 12)


PLUGIN_LIB = REGISTRY_LIB + """
class context:
    def __init__(self, h0):
        self.h0 = h0
    def __enter__(self):
        register("planck", self.h0)
    def __exit__(self, *exc):
        pass
def model(name, scale=1):
    def decorate(fn):
        REGISTRY[name] = (fn, scale)
        return fn
    return decorate
def apply(name, x):
    fn, scale = REGISTRY[name]
    return fn(x) * scale
def register_obj(name, obj):
    REGISTRY[name] = obj
class Plugin:
    def __init_subclass__(cls, scale=1, **kwargs):
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.__name__] = (cls().run, scale)
HOOKS = []
def add_hook(fn):
    HOOKS.append(fn)
def run_hooks(x):
    for fn in HOOKS:
        x = fn(x)
    return x
"""
CONSTS = {"consts": "H0 = 11\n"}
SCALER = "class Scaler:\n    def __init__(self, k):\n        self.k = k\n"
ANYWHERE_SETTINGS = [
    ("m = fakelib.register('planck', 11)", "fakelib.get('planck').h0", None),
    ("[fakelib.register(n, h) for n, h in [('planck', 11)]]", "fakelib.get('planck').h0", None),
    ("for n, h in [('planck', 11), ('wmap', 70)]:\n    fakelib.register(n, h)", "fakelib.get('planck').h0", None),
    ("class Setup:\n    fakelib.register('planck', 11)", "fakelib.get('planck').h0", None),
    ("with fakelib.context(11):\n    pass", "fakelib.get('planck').h0", None),
    ("if (m := fakelib.register('planck', 11)):\n    pass", "fakelib.get('planck').h0", None),
    ("getattr(fakelib, 'register')('planck', 11)", "fakelib.get('planck').h0", None),
    ("class Cfg:\n    def __init__(self):\n        self.h0 = 11\ncfg = Cfg()\nfakelib.register('planck', cfg.h0)",
     "fakelib.get('planck').h0", None),
    ("import consts\nfakelib.register('planck', consts.H0)", "fakelib.get('planck').h0", CONSTS),
    ("c = fakelib.Cosmology(70)\nfakelib.register_obj('planck', c)\nc.h0 = 11", "fakelib.get('planck').h0", None),
    ("@fakelib.model('sq', scale=11)\ndef sq(x):\n    return x", "fakelib.apply('sq', 1)", None),
    ("@fakelib.model('sq')\ndef sq(x):\n    return x * 11", "fakelib.apply('sq', 1)", None),
    ("def sq(x):\n    return x * 11\nfakelib.register_obj('sq', (sq, 1))", "fakelib.apply('sq', 1)", None),
    ("match 1:\n    case 1 if fakelib.register('planck', 11) or True:\n        pass", "fakelib.get('planck').h0",
     None),  # red team 13: a match arm's guard
    # red team 13: the user's function in a container a name holds, a decorator applied by a call and assigned,
    # a decorator a library's factory made, assigned to a name
    ("def sq(x):\n    return x * 11\nPAIR = (sq, 1)\nfakelib.register_obj('sq', PAIR)", "fakelib.apply('sq', 1)", None),
    ("def sq(x):\n    return x\nKW = {'name': 'sq', 'obj': [sq, 11]}\nfakelib.register_obj(**KW)",
     "fakelib.apply('sq', 1)", None),
    ("def _sq(x):\n    return x * 11\nsq = fakelib.model('sq')(_sq)", "fakelib.apply('sq', 1)", None),
    ("D = fakelib.model('sq', scale=11)\n@D\ndef sq(x):\n    return x", "fakelib.apply('sq', 1)", None),
    # red team 14: a bound method of the user's object, the object itself (callable) and a partial of the user's
    # function, each held by a name and handed to a library (the object's value and its class's code, the
    # partial's arguments and its function's code); a library's function handed to a builtin or called out of
    # a dict
    (SCALER + "    def apply(self, x):\n        return x * self.k\nS = Scaler(11)\nfakelib.add_hook(S.apply)",
     "fakelib.run_hooks(1)", None),
    ("class Scaler:\n    def apply(self, x):\n        return x * 11\nS = Scaler()\nfakelib.add_hook(S.apply)",
     "fakelib.run_hooks(1)", None),
    (SCALER + "    def __call__(self, x):\n        return x * self.k\nH = Scaler(11)\nfakelib.add_hook(H)",
     "fakelib.run_hooks(1)", None),
    ("import functools\ndef power(x, p):\n    return x ** p\nP = functools.partial(power, p=11)\nfakelib.add_hook(P)",
     "fakelib.run_hooks(1)", None),
    ("import functools\ndef power(x, p):\n    return x * 11 + p\nP = functools.partial(power, p=2)\nfakelib.add_hook(P)",
     "fakelib.run_hooks(1)", None),
    ("list(map(fakelib.register, ['planck'], [11]))", "fakelib.get('planck').h0", None),
    ("OPS = {'reg': fakelib.register}\nOPS['reg']('planck', 11)", "fakelib.get('planck').h0", None),
    # red team 14: a class the library's __init_subclass__ registers when the script subclasses its base
    ("class Sq(fakelib.Plugin):\n    def run(self, x):\n        return x * 11", "fakelib.apply('Sq', 1)", None),
    ("class Sq(fakelib.Plugin, scale=11):\n    def run(self, x):\n        return x", "fakelib.apply('Sq', 1)", None),
]


@pytest.mark.parametrize("setting, reads, local", ANYWHERE_SETTINGS)
def test_a_call_into_a_library_anywhere_in_the_top_level_counts_for_a_stage_using_it(
        tmp_path: Path, setting: str, reads: str, local: dict[str, str] | None) -> None:
    """The twelfth red team: only a call that was a statement of its own counted.  The same call assigned
    (``m = fakelib.register(...)``), in a comprehension, fed by a loop, in a class body, a ``with`` item, an
    ``if`` test, through ``getattr``, passing ``cfg.h0`` or ``consts.H0`` (a value by its type only), a
    decorator's argument, the body of a function a library decorator registers (the stage reaches it only
    through the library) or that a plain call hands it (``register_obj("sq", (sq, 1))``, a hook), and an
    object of the library's the script handed it and then changed (``c.h0 = 11`` after
    ``register_obj("planck", c)``): 11 -> 12 gave the same key, each served CACHED with 11."""
    script = (f"import fakelib\n{setting}\ndef stage(ctx):\n    return {reads}\n"
              "def other(ctx):\n    return 1\n")

    def edited(text: str) -> str:
        return text.replace("11", "12")

    a = _with_fakelib(tmp_path / "a", script, PLUGIN_LIB, local)
    b = _with_fakelib(tmp_path / "b", edited(script), PLUGIN_LIB,
                      None if local is None else {k: edited(v) for k, v in local.items()})
    assert a != b, (a, b)
    assert _with_fakelib(tmp_path / "c", script, PLUGIN_LIB, local) == a  # the same code: the same key
    kept = [_with_fakelib(tmp_path / d, text, PLUGIN_LIB, local, stage="other")
            for d, text in (("d", script), ("e", edited(script)))]
    assert kept[0] == kept[1] and not any("fakelib" in k for k in kept[0]), kept


@pytest.mark.timeout(300)
def test_end_to_end_an_edit_of_a_function_a_library_decorator_registers_reruns_the_stage(tmp_path: Path) -> None:
    """``hetflow run`` three times: the stage calls ``fakelib.apply("sq", 3)``, which calls the script's ``sq``
    that ``@fakelib.model("sq")`` registered; an edit of ``sq``'s body re-runs the stage with the new value
    (it was CACHED with the old one), and unchanged it is CACHED."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(PLUGIN_LIB)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib

        @fakelib.model("sq")
        def sq(x):
            return x * FACTOR

        pipe = hf.Pipeline("plugin")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.apply("sq", 3)]})}

        if __name__ == "__main__":
            pipe.run()
    """)

    def once(factor: str) -> tuple[str, int]:
        states, value = _run_and_show(tmp_path, script.replace("FACTOR", factor), site_packages=True)
        return states["stage"], value

    assert once("2") == ("DONE", 6)
    assert once("5") == ("DONE", 15)
    assert once("5") == ("CACHED", 15)


@pytest.mark.timeout(300)
def test_end_to_end_a_partial_declared_as_the_stage_runs_and_counts_its_arguments(tmp_path: Path) -> None:
    """The tenth red team's low: ``pipe.stage(name="p")(functools.partial(scaled, k=3))`` failed in its rank,
    "functools.p is not a function, and no pipeline in functools declares a stage 'p'" (a partial's module is
    ``functools``).  Now the rank finds it where its function is declared: it runs, an edit of ``k`` re-runs
    it with the new value, and unchanged it is CACHED."""
    script = textwrap.dedent("""
        import functools
        import pyarrow as pa
        import hetflow as hf

        pipe = hf.Pipeline("partial")

        def scaled(ctx, k):
            return {"out": pa.table({"v": [k]})}

        pipe.stage(name="p", outputs=["out"])(functools.partial(scaled, k=K))

        if __name__ == "__main__":
            pipe.run()
    """)
    def once(k: str) -> tuple[str, int]:
        states, value = _run_and_show(tmp_path, script.replace("K", k))
        return states["p"], value

    assert once("3") == ("DONE", 3)
    assert once("4") == ("DONE", 4)
    assert once("4") == ("CACHED", 4)


LOOP_DECLARED = '''
import pyarrow as pa
import hetflow as hf

SCALE = 2
pipe = hf.Pipeline("loop", pilot=hf.PilotDescription(name="p", cores_per_node=2))


@pipe.stage(outputs=["out"])
def load(ctx):
    return {"out": pa.table({"v": [1]})}


def make(k):
    def fit(ctx, out):
        return {f"fit{k}": pa.table({"v": [out.column("v")[0].as_py() * SCALE + k]})}
    return fit


for k in range(2):
    pipe.stage(make(k), name=f"fit{k}", inputs=["out"], outputs=[f"fit{k}"])

if __name__ == "__main__":
    pipe.run()
'''


@pytest.mark.timeout(300)
def test_a_global_only_loop_made_stages_read_moves_their_keys_not_the_others(tmp_path: Path) -> None:
    """The declaration ``pipe.stage(make(k), ...)`` at the top is hetflow's, not a call into a library: it
    put the factory's code, and SCALE, into every stage's key, so editing SCALE re-ran ``load`` too (the
    rules of red teams 12 and 13 counted it as a call into pyarrow, which ``make``'s code names)."""
    assert _run_and_show(tmp_path, LOOP_DECLARED)[0] == {"load": "DONE", "fit0": "DONE", "fit1": "DONE"}
    states, _ = _run_and_show(tmp_path, LOOP_DECLARED.replace("SCALE = 2", "SCALE = 3"))
    assert states == {"load": "CACHED", "fit0": "DONE", "fit1": "DONE"}, states


DECLARED_SETTINGS = [
    "pipe.stage(make(fakelib.register('planck', 11) or 'planck'), name='s')",
    ("def make_registered(name):\n    fakelib.register(name, K)\n    return make(name)\n"
     "pipe.stage(make_registered('planck'), name='s')"),
]


@pytest.mark.parametrize("setting", DECLARED_SETTINGS)
def test_a_library_call_in_a_statement_that_declares_a_stage_counts(tmp_path: Path, setting: str) -> None:
    """Red team 14: a statement that declares with hetflow (``pipe.stage(make(...), name=...)``) was skipped
    whole by the library-call rule, so a call into a library inside it (an argument's, or the factory's own
    body registering ``K``) was not counted: 11 -> 12 gave the same key, the stage served CACHED with 11.  The
    declaration itself still is no call into a library, nor is a factory that only defines the stage."""
    script = ("import fakelib\nimport hetflow as hf\npipe = hf.Pipeline('declared')\nK = 11\n"
              "def make(name):\n    def run(ctx):\n        return fakelib.get(name).h0\n    return run\n"
              f"{setting}\nstage = pipe.stages['s'].func\n")
    a = _with_fakelib(tmp_path / "a", script, PLUGIN_LIB)
    b = _with_fakelib(tmp_path / "b", script.replace("11", "12"), PLUGIN_LIB)
    assert "calls into fakelib at the top level" in a and a != b, (a, b)


def test_a_subclass_of_a_library_class_that_registers_nothing_stays_out_of_other_stages_keys(tmp_path: Path) -> None:
    """A class of the script deriving from a library's class that has no ``__init_subclass__`` nor metaclass of
    its own (``torch.nn.Module``) is not handed to the library: a stage using the library but not the class
    keeps its key when the class is edited."""
    script = ("import fakelib\nclass Mine(fakelib.Cosmology):\n    def f(self):\n        return 11\n"
              "def stage(ctx):\n    return fakelib.distance(1.0)\n")
    a = _with_fakelib(tmp_path / "a", script, PLUGIN_LIB)
    assert a == _with_fakelib(tmp_path / "b", script.replace("11", "12"), PLUGIN_LIB), a


@pytest.mark.timeout(300)
def test_end_to_end_an_edit_of_a_method_a_library_holds_as_a_hook_reruns_the_stage(tmp_path: Path) -> None:
    """Red team 14: ``S = Scaler(2)``, ``fakelib.add_hook(S.apply)``, a stage calling ``fakelib.run_hooks(3)``:
    an edit of ``Scaler.apply``'s body was served CACHED with the old value (the bound method, read as ``S``, counted
    by its type only).  It re-runs the stage; the stage not using the library stays CACHED."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(PLUGIN_LIB)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib

        class Scaler:
            def __init__(self, k):
                self.k = k

            def apply(self, x):
                return x * self.k + 0

        S = Scaler(2)
        fakelib.add_hook(S.apply)
        pipe = hf.Pipeline("hooks")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.run_hooks(3)]})}

        @pipe.stage(outputs=["plain"])
        def other(ctx):
            return {"plain": pa.table({"v": [1]})}

        if __name__ == "__main__":
            pipe.run()
    """)
    assert _run_and_show(tmp_path, script, site_packages=True) == ({"stage": "DONE", "other": "DONE"}, 6)
    edited = script.replace("self.k + 0", "self.k + 1")
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "DONE", "other": "CACHED"}, 7)
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "CACHED", "other": "CACHED"}, 7)


WRAP_LIB = PLUGIN_LIB + """
def total(xs):
    return sum(xs)
class vectorize:
    def __init__(self, pyfunc, otypes=None):
        self.pyfunc = pyfunc
    def __call__(self, x):
        return self.pyfunc(x)
class registering_vectorize(vectorize):
    def __init__(self, pyfunc):
        super().__init__(pyfunc)
        REGISTRY["vec"] = (pyfunc, 1)
"""
HELPER_SETTINGS = [
    # a helper called in what a library call gets: its results are handed over, not the helper
    "def w(i):\n    return 1.0 / (i + 11)\nW = fakelib.total([w(i) for i in range(3)])",
    # a helper a library wraps in an object of its own that the library does not keep (np.vectorize)
    "def f(c):\n    return c * 11\nVF = fakelib.vectorize(f)",
]


@pytest.mark.parametrize("setting", HELPER_SETTINGS)
def test_a_helper_only_another_stage_reaches_stays_out_of_a_stage_using_the_library(
        tmp_path: Path, setting: str) -> None:
    """Red team 15 (over-rerun): ``W = np.array([weight(i) for i in range(3)])`` and ``VF = np.vectorize(f)`` put
    ``weight``'s and ``f``'s code in the key of every stage naming numpy, so an edit of a helper only one stage
    reaches (through ``W`` or ``VF``) re-ran every numpy stage.  Not handed to the library (called; wrapped in an
    object the library does not keep), they count where a stage reads ``W`` or ``VF``."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.distance(1.0)\n"
    a = _with_fakelib(tmp_path / "a", script, WRAP_LIB)
    assert a == _with_fakelib(tmp_path / "b", script.replace("11", "12"), WRAP_LIB), a
    reader = script + "def reader(ctx):\n    return W if 'W' in globals() else VF(1)\n"
    reads = [_with_fakelib(tmp_path / d, text, WRAP_LIB, stage="reader")
             for d, text in (("c", reader), ("d", reader.replace("11", "12")))]
    assert reads[0] != reads[1]


def test_a_helper_a_library_wrapper_also_registers_still_counts(tmp_path: Path) -> None:
    """The counterpart: a wrapper object whose library keeps the helper as well (a registry) hands it over."""
    script = ("import fakelib\ndef f(c):\n    return c * 11\nVF = fakelib.registering_vectorize(f)\n"
              "def stage(ctx):\n    return fakelib.apply('vec', 1)\n")
    assert _with_fakelib(tmp_path / "a", script, WRAP_LIB) != \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), WRAP_LIB)


HANDED_WRAPPERS = [
    # a memoised function of the user's, held by a name and handed to a library
    "import functools\ndef sq(x):\n    return x * 11\nC = functools.lru_cache(sq)\nfakelib.add_hook(C)",
    # the user's function in a library's wrapper object (np.vectorize), held by a name and handed on
    "def f(x):\n    return x * 11\nVF = fakelib.vectorize(f)\nfakelib.add_hook(VF)",
    # an object of the user's class made in the call itself, its __call__ inherited from a user base class (the
    # class's module is not where a script's classes are looked for: "__main__" after runpy.run_path)
    "class Base:\n    def __call__(self, x):\n        return x * 11\nclass H(Base):\n    pass\nfakelib.add_hook(H())",
    "class H:\n    k = 11\n    def __call__(self, x):\n        return x * self.k\nfakelib.add_hook(H())",
]


@pytest.mark.parametrize("setting", HANDED_WRAPPERS)
def test_the_users_code_handed_to_a_library_in_a_wrapper_or_a_fresh_object_counts(
        tmp_path: Path, setting: str) -> None:
    """Red team 15: ``C = functools.lru_cache(sq)`` or ``VF = np.vectorize(f)`` handed to ``lib.add_hook``, and
    ``lib.add_hook(H())`` with ``H``'s ``__call__`` inherited from a user base class: an edit of the code (or of a
    class attribute it reads) gave the same key, served CACHED with the old hook.  Now counted; a stage not
    using the library keeps its key."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.run_hooks(1)\n" \
             "def other(ctx):\n    return 1\n"
    a = _with_fakelib(tmp_path / "a", script, WRAP_LIB)
    assert a != _with_fakelib(tmp_path / "b", script.replace("11", "12"), WRAP_LIB), a
    kept = [_with_fakelib(tmp_path / d, text, WRAP_LIB, stage="other")
            for d, text in (("c", script), ("d", script.replace("11", "12")))]
    assert kept[0] == kept[1], kept


@pytest.mark.timeout(300)
def test_end_to_end_an_edit_of_an_inherited_call_of_a_hook_object_reruns_the_stage(tmp_path: Path) -> None:
    """Red team 15: ``fakelib.add_hook(H())``, ``H``'s ``__call__`` inherited from ``Base``; editing
    ``Base.__call__`` was served CACHED (``H.__module__`` is ``"__main__"``, hetflow's entry point once the
    script has run, and the script has no ``__main__`` block calling ``pipe.run()``).  It re-runs the stage; the stage not using the library stays CACHED."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(PLUGIN_LIB)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib

        class Base:
            def __call__(self, x):
                return x * 2 + 0

        class H(Base):
            pass

        fakelib.add_hook(H())
        pipe = hf.Pipeline("hooks")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.run_hooks(3)]})}

        @pipe.stage(outputs=["plain"])
        def other(ctx):
            return {"plain": pa.table({"v": [1]})}
    """)  # no pipe.run(): hetflow run runs the pipeline once the script has run
    assert _run_and_show(tmp_path, script, site_packages=True) == ({"stage": "DONE", "other": "DONE"}, 6)
    edited = script.replace("x * 2 + 0", "x * 2 + 1")
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "DONE", "other": "CACHED"}, 7)
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "CACHED", "other": "CACHED"}, 7)


STATE_LIB = WRAP_LIB + """
def register_id(name, h0):
    register(name, h0)
    return len(REGISTRY)
class Handle:
    def __init__(self, name, h0):
        REGISTRY[name] = Cosmology(h0)
def apply_now(fn, x):
    return fn(x)
"""


@pytest.mark.parametrize("setting", ["rid = fakelib.register_id('planck', 11)", "h = fakelib.Handle('planck', 11)"])
def test_an_assigned_call_storing_into_the_librarys_state_counts_though_it_returns_a_fresh_value(
        tmp_path: Path, setting: str) -> None:
    """Red team 15: ``rid = lib.register_id("planck", 11)`` (returning a fresh count or handle, not what it
    stored) was taken for ``W = np.arange(4)``, the script's own value: an edit of 11 was served CACHED to a stage
    reading ``lib.get("planck")``.  A library function that stores into its module's globals counts."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.get('planck').h0\n"
    assert _with_fakelib(tmp_path / "a", script, STATE_LIB) != \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), STATE_LIB)


def test_a_helper_a_library_runs_at_once_stays_out_of_a_stage_using_the_library(tmp_path: Path) -> None:
    """``T = df.pipe(add_col)``: the library runs the helper at once and keeps nothing of it; its result is
    ``T``'s, counted where a stage reads ``T``, not in every stage using the library."""
    script = ("import fakelib\ndef add(x):\n    return x + 11\nT = fakelib.apply_now(add, 1)\n"
              "def stage(ctx):\n    return fakelib.distance(1.0)\ndef reader(ctx):\n    return T\n")
    assert _with_fakelib(tmp_path / "a", script, STATE_LIB) == \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), STATE_LIB)
    assert _with_fakelib(tmp_path / "c", script, STATE_LIB, stage="reader") != \
        _with_fakelib(tmp_path / "d", script.replace("11", "12"), STATE_LIB, stage="reader")


OBJECT_LIB = REGISTRY_LIB + """
class Registry:
    def add(self, name, h0):
        REGISTRY[name] = Cosmology(h0)
"""
SETUP_CLASS = ("import fakelib\nclass Setup:\n    def __init__(self, h0):\n        fakelib.register('planck', h0)\n")
SETUP_METHOD = ("import fakelib\nclass Setup:\n    def __init__(self, name):\n        self.name = name\n"
                "    def apply(self, h0):\n        fakelib.register(self.name, h0)\n")
SETUP_CLASSMETHOD = ("import fakelib\nclass Setup:\n    @classmethod\n    def configure(cls, h0):\n"
                     "        fakelib.register('planck', h0)\n")
CALLED_THROUGH_AN_OBJECT = [
    ("reg = fakelib.Registry()\nreg.add('planck', 11)", None),  # a method of the library's object
    ("from functools import partial\nreg = partial(fakelib.register, 'planck')\nreg(11)", None),  # a partial of it
    ("from labsetup import Setup\nSETUP = Setup(11)", {"labsetup": SETUP_CLASS}),  # a local class's construction
    ("from labsetup import Setup\nsetup = Setup('planck')\nsetup.apply(11)", {"labsetup": SETUP_METHOD}),
    ("import labsetup\nlabsetup.S = labsetup.Setup('planck')\nlabsetup.S.apply(11)", {"labsetup": SETUP_METHOD}),
    ("from labsetup import Setup\nSetup.configure(11)", {"labsetup": SETUP_CLASSMETHOD}),  # a classmethod
]


@pytest.mark.parametrize("setting, local", CALLED_THROUGH_AN_OBJECT)
def test_a_call_into_a_library_through_an_object_at_the_top_counts_for_a_stage_using_it(
        tmp_path: Path, setting: str, local: dict[str, str] | None) -> None:
    """Red team 16: the library's registry filled at the script's top through an object, not a name of the
    library: a method of the library's own object (``reg = lib.Registry(); reg.add("planck", 11)``), a
    ``partial`` of its function called later, a local class whose ``__init__`` registers (``SETUP = Setup(11)``,
    assigned: a fresh object of the user's) and a local object's method (``setup.apply(11)``).  Each edit of 11
    gave the same key and was served CACHED; a stage not using the library keeps its key."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.get('planck').h0\n" \
        "def other(ctx):\n    return 1\n"
    a, b = (_with_fakelib(tmp_path / "a", script, OBJECT_LIB, local),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), OBJECT_LIB, local))
    assert "calls into fakelib at the top level" in a and a != b, (a, b)
    kept = [_with_fakelib(tmp_path / d, script.replace("11", h0), OBJECT_LIB, local, stage="other")
            for d, h0 in (("c", "11"), ("d", "12"))]
    assert kept[0] == kept[1] and not any("fakelib" in k for k in kept[0]), kept


def test_a_receivers_value_and_a_partials_arguments_count_with_the_call(tmp_path: Path) -> None:
    """What the call reads besides its text: the local object whose method registers (``Setup('planck')`` ->
    ``Setup('wmap')``, then ``setup.apply(11)``) and the arguments a partial binds (``partial(lib.register,
    'planck')``) choose which entry the library fills."""
    for n, (setting, local) in enumerate(CALLED_THROUGH_AN_OBJECT[1:4:2]):
        script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.REGISTRY\n"
        assert _with_fakelib(tmp_path / f"a{n}", script, OBJECT_LIB, local) != \
            _with_fakelib(tmp_path / f"b{n}", script.replace("planck", "wmap"), OBJECT_LIB, local), setting


@pytest.mark.timeout(300)
def test_end_to_end_a_registration_through_a_local_object_reruns_only_the_stage_using_the_library(
        tmp_path: Path) -> None:
    """``hetflow run`` three times, the value a local class's ``__init__`` registers edited after the first."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakelib.py").write_text(OBJECT_LIB)
    (tmp_path / "labsetup.py").write_text(SETUP_CLASS)
    script = textwrap.dedent("""
        import pyarrow as pa
        import hetflow as hf
        import fakelib
        from labsetup import Setup
        SETUP = Setup(11)
        reg = fakelib.Registry()
        reg.add("wmap", 11)
        pipe = hf.Pipeline("registry")

        @pipe.stage(outputs=["out"])
        def stage(ctx):
            return {"out": pa.table({"v": [fakelib.get("planck").h0 * 100 + fakelib.get("wmap").h0]})}

        @pipe.stage(outputs=["plain"])
        def other(ctx):
            return {"plain": pa.table({"v": [1]})}
    """)
    assert _run_and_show(tmp_path, script, site_packages=True) == ({"stage": "DONE", "other": "DONE"}, 1111)
    edited = script.replace("Setup(11)", "Setup(12)")
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "DONE", "other": "CACHED"}, 1211)
    edited = edited.replace('"wmap", 11', '"wmap", 13')
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "DONE", "other": "CACHED"}, 1213)
    assert _run_and_show(tmp_path, edited, site_packages=True) == ({"stage": "CACHED", "other": "CACHED"}, 1213)


ALIASED_LIB = REGISTRY_LIB + """
DEFAULT = Cosmology(70)
CONFIG = {"h0": 70}
def distance(z):
    return z * DEFAULT.h0 * 1000 + CONFIG["h0"]
"""


@pytest.mark.parametrize("setting", ["cfg = fakelib.CONFIG\ncfg['h0'] = 11",
                                     "from fakelib import CONFIG\nCONFIG['h0'] = 11",
                                     "cosmo = fakelib.DEFAULT\ncosmo.h0 = 11",
                                     "import fakelib as fl\nc = fl.DEFAULT\nsetattr(c, 'h0', 11)",
                                     "cfg = fakelib.CONFIG\ncfg |= {'h0': 11}"])
def test_a_librarys_value_changed_in_place_through_another_name_counts_for_a_stage_using_it(
        tmp_path: Path, setting: str) -> None:
    """Red team 16: a library's module-level value changed at the script's top through a name of the script's
    (``cfg = fakelib.CONFIG; cfg["h0"] = 11``, as ``rc = mpl.rcParams; rc["font.size"] = 8`` is written,
    ``cosmo = fakelib.DEFAULT; cosmo.h0 = 11``), read by the stage only inside the library
    (``fakelib.distance``): 11 -> 12 gave the same key and was served CACHED.  It counts as
    ``fakelib.CONFIG["h0"] = 11`` does: the value, now, for a stage using the library."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.distance(1.0)\n" \
        "def other(ctx):\n    return 1\n"
    a, b = (_with_fakelib(tmp_path / "a", script, ALIASED_LIB),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), ALIASED_LIB))
    assert a != b, (a, b)
    kept = [_with_fakelib(tmp_path / d, script.replace("11", h0), ALIASED_LIB, stage="other")
            for d, h0 in (("c", "11"), ("d", "12"))]
    assert kept[0] == kept[1], kept


INIT_PAIR = "import fakelib\ndef init(pair):\n    fakelib.register(*pair)\n"


@pytest.mark.parametrize("setting, local", [
    ("reg = fakelib.Registry()\nlist(map(reg.add, ['planck'], [11]))", None),
    ("import labsetup\nlist(map(labsetup.init, [('planck', 11)]))", {"labsetup": INIT_PAIR}),
    ("import labsetup\ndone = list(map(labsetup.init, [('planck', 11)]))", {"labsetup": INIT_PAIR}),
])
def test_a_function_handed_to_map_at_the_top_counts_by_the_library_it_calls(
        tmp_path: Path, setting: str, local: dict[str, str] | None) -> None:
    """Red team 16: a library object's method (``list(map(reg.add, NAMES, H0S))``) or a local function naming
    the library (``list(map(labsetup.init, PAIRS))``, assigned or not) handed to ``map`` at the top registers
    into the library as a direct call does; an edit of 11 was served CACHED."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return fakelib.get('planck').h0\n"
    a, b = (_with_fakelib(tmp_path / "a", script, OBJECT_LIB, local),
            _with_fakelib(tmp_path / "b", script.replace("11", "12"), OBJECT_LIB, local))
    assert "calls into fakelib at the top level" in a and a != b, (a, b)


def test_a_helper_computing_a_value_through_map_stays_out_of_a_stage_using_the_library(tmp_path: Path) -> None:
    """``W = list(map(weight, R))`` with ``weight`` calling the library to compute: ``W`` is the script's value,
    counted where a stage reads it, not in every stage using the library (it stores nothing into it)."""
    script = ("import fakelib\ndef weight(z):\n    return fakelib.distance(z) + 11\nW = list(map(weight, [1.0]))\n"
              "def stage(ctx):\n    return fakelib.distance(1.0)\n")
    assert _with_fakelib(tmp_path / "a", script, OBJECT_LIB) == \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), OBJECT_LIB)


NESTED_LIB = REGISTRY_LIB + """
CONFIG = {"plot": {"h0": 70}}
def distance(z):
    return z * CONFIG["plot"]["h0"]
"""


@pytest.mark.parametrize("setting, library, reads", [
    ("REGS = {'main': fakelib.Registry()}\nREGS['main'].add('planck', 11)", OBJECT_LIB, "fakelib.get('planck').h0"),
    ("opts = fakelib.CONFIG['plot']\nopts['h0'] = 11", NESTED_LIB, "fakelib.distance(1.0)"),
])
def test_a_librarys_object_reached_through_a_container_or_a_nested_value_counts(
        tmp_path: Path, setting: str, library: str, reads: str) -> None:
    """Red team 16: ``REGS = {"main": lib.Registry()}; REGS["main"].add("planck", 11)`` (the call's names stop at
    the dict) and ``opts = lib.CONFIG["plot"]; opts["h0"] = 11`` (a value one level inside the library's
    ``CONFIG``) were each served CACHED after 11 -> 12."""
    script = f"import fakelib\n{setting}\ndef stage(ctx):\n    return {reads}\n"
    assert _with_fakelib(tmp_path / "a", script, library) != \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), library)


BUILDER_LIB = OBJECT_LIB + """
class Builder:
    def __init__(self):
        self.h0 = 70
    def h(self, h0):
        self.h0 = h0
        return self
    def install(self):
        register("planck", self.h0)
"""


def test_a_library_object_whose_method_registers_what_it_holds_counts_by_its_value(tmp_path: Path) -> None:
    """Red team 16: ``b = lib.Builder().h(11)`` (a fresh object, assigned: the script's own value) then
    ``b.install()``, which stores what ``b`` holds into the library's registry: ``b.install()`` counted by its
    text and ``b``'s type, so 11 -> 12 was served CACHED.  The receiver of a library method that stores into its
    module's state counts by its value."""
    script = "import fakelib\nb = fakelib.Builder().h(11)\nb.install()\n" \
        "def stage(ctx):\n    return fakelib.get('planck').h0\n"
    assert _with_fakelib(tmp_path / "a", script, BUILDER_LIB) != \
        _with_fakelib(tmp_path / "b", script.replace("11", "12"), BUILDER_LIB)
    assert _with_fakelib(tmp_path / "c", script, BUILDER_LIB) == _with_fakelib(tmp_path / "d", script, BUILDER_LIB)
