"""How far the code fingerprint reaches: cases an attack on the cache key found (issue 17), now fixed.

Each edit below changes what a stage computes, so it must change the stage's
code fingerprint (else ``hetflow run`` serves the old output as ``CACHED``);
the edits in the ``leaves`` tests must not.  The end-to-end test runs hetflow.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


SCRIPT = """
import pyarrow as pa
import hetflow as hf
from mylib import helper

pipe = hf.Pipeline("attack", pilot="local")

@pipe.stage(ranks=1, outputs=["out"])
def stage(ctx):
    return {"out": pa.table({"v": [helper()]})}
"""


@pytest.mark.timeout(180)
def test_end_to_end_a_package_constant_edit_serves_the_old_rows(tmp_path: Path) -> None:
    for rel, text in {**PACKAGE, "pipeline.py": SCRIPT}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    hetflow = [sys.executable, "-m", "hetflow.cli"] if not os.path.exists(Path(sys.executable).parent / "hetflow") \
        else [str(Path(sys.executable).parent / "hetflow")]
    run = [*hetflow, "run", "pipeline.py", "--no-progress", "--workdir", str(tmp_path / "wd")]
    subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=150)
    (tmp_path / "mylib/consts.py").write_text("SCALE = 3\n")
    second = subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=150)
    assert "CACHED" not in second.stdout + second.stderr, second.stdout + second.stderr
