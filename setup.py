"""Optional compiled build of the scheduler (everything else is in pyproject.toml).

    HETFLOW_COMPILE=1 pip install --no-build-isolation .     # needs mypy (the dev extra) installed
    make compiled                                             # the same into build/compiled, for tests

compiles the scheduler's modules with mypyc (the compiler mypy and black ship
with).  The code is the same, type-checked with the same annotations; the
compiled scheduler makes the same decisions, faster.  Without HETFLOW_COMPILE
(and in editable installs) hetflow stays pure Python.

mypyc names a module after its path, and the source tree maps ``hetflow.tasks``
to ``tasks/``, so the modules are compiled from a staging copy laid out as the
installed package.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from setuptools import setup

# the scheduler and its parts: compiled
COMPILED = ("node_index", "placement", "reservation", "scheduler", "scheduler_memo", "scheduler_types")
# what they import: type-checked with them, left as Python
SUPPORT = ("description", "errors", "pilot")
# what those import from outside tasks/ (the root of hetflow's error tree): staged for the type check too
OUTSIDE = {"operators": ("errors",)}


def ext_modules() -> list[Any]:
    if os.environ.get("HETFLOW_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit("HETFLOW_COMPILE=1 needs mypy (mypyc) where the build runs: install it (it is in the "
                         "dev extra) and build with pip install --no-build-isolation") from exc

    root = Path(__file__).resolve().parent
    stage = root / "build" / "mypyc-src"
    shutil.rmtree(stage, ignore_errors=True)
    package = stage / "hetflow" / "tasks"
    package.mkdir(parents=True)
    (stage / "hetflow" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in COMPILED + SUPPORT:
        shutil.copyfile(root / "tasks" / f"{name}.py", package / f"{name}.py")
    for folder, names in OUTSIDE.items():
        (stage / "hetflow" / folder).mkdir()
        (stage / "hetflow" / folder / "__init__.py").write_text("")
        for name in names:
            shutil.copyfile(root / folder / f"{name}.py", stage / "hetflow" / folder / f"{name}.py")
    paths = [str((package / f"{name}.py").relative_to(root)) for name in COMPILED]
    return mypycify(paths, opt_level="3", group_name="hetflow_scheduler")


setup(ext_modules=ext_modules())
