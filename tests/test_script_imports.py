"""A stage does not pay for the script's top-level imports: a warm one-rank stage is forked from a fork
server that executed the script once for the whole run; a stage started cold (``mpiexec``) executes the
script itself with the imports it does not use deferred; either way a stage that uses them gets them.

Real runs of scripts written as a scientist writes them (``import torch`` at the top); each stage
reports what is loaded in its own worker and which process executed the script.  The rules of
:func:`hetflow.tasks.script.deferrable` are checked on source text.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetflow.operators.dataset import open_dataset
from hetflow.tasks.script import deferrable

pytest.importorskip("torch")

HELPER = '''
import os
os.environ["SIDE_EFFECT_RAN"] = "yes"
'''

PIPELINE = '''
import os
import sys
import torch
import side_effect
import hetflow as hf
import pyarrow as pa
try:
    import not_installed_anywhere_xyz
except ImportError:
    not_installed_anywhere_xyz = None

EXECUTED_BY = os.getpid()
ARGV = list(sys.argv)
pipe = hf.Pipeline("lazy", pilot=hf.PilotDescription(
    name="lazy", cores_per_node=2, memory_per_node=2**33,
    options={"local": {"warm_start": os.environ.get("WARM") == "1"}}))


def loaded():
    return {"torch_loaded": ["torch._C" in sys.modules], "torch_bound": ["torch" in sys.modules],
            "side_effect": [__import__("os").environ.get("SIDE_EFFECT_RAN")],
            "missing_is_none": [not_installed_anywhere_xyz is None],
            "executed_by_me": [EXECUTED_BY == os.getpid()], "executed_by": [EXECUTED_BY], "argv": [ARGV]}


@pipe.stage(outputs=["unused"])
def without_torch(ctx):
    return {"unused": pa.table(loaded())}


@pipe.stage(inputs=["unused"], outputs=["used"])
def with_torch(ctx, table):
    total = int(torch.arange(5).sum().item())
    return {"used": pa.table(dict(loaded(), total=[total]))}


@pipe.stage(inputs=["used"], outputs=["imported"])
def imports_it_again(ctx, table):
    import torch as again
    return {"imported": pa.table({"total": [int(again.ones(3).sum().item())], "same": [again is torch]})}


if __name__ == "__main__":
    pipe.run()
'''


def _run(tmp_path: Path, warm: bool) -> Path:
    (tmp_path / "script.py").write_text(PIPELINE)
    (tmp_path / "side_effect.py").write_text(HELPER)
    env = dict(os.environ, WARM="1" if warm else "0")
    done = subprocess.run([sys.executable, "script.py", "--flag", "value"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    return run_dir


def _rows(run_dir: Path, name: str) -> dict:
    (row,) = open_dataset(run_dir / "datasets" / name).to_table().to_pylist()
    return row


def test_a_cold_stage_that_does_not_use_torch_does_not_load_it_and_one_that_does_gets_it(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, warm=False)
    unused = _rows(run_dir, "unused")
    argv = [str(tmp_path / "script.py"), "--flag", "value"]
    assert unused == {"torch_loaded": False, "torch_bound": True, "side_effect": "yes", "missing_is_none": True,
                      "executed_by_me": True, "executed_by": unused["executed_by"], "argv": argv}
    used = _rows(run_dir, "used")
    assert used["torch_loaded"] and used["total"] == 10 and used["executed_by_me"], used
    assert _rows(run_dir, "imported") == {"total": 3, "same": True}


def test_a_warm_stage_gets_the_scripts_installed_imports_from_the_fork_server_and_executes_the_script(
        tmp_path: Path) -> None:
    """The fork server imported torch once, before forking; each stage still executed the script itself
    (with the run's argv), so torch is loaded in a stage that never uses it, at no cost to it."""
    run_dir = _run(tmp_path, warm=True)
    unused, used = _rows(run_dir, "unused"), _rows(run_dir, "used")
    for row in (unused, used):
        assert row["torch_loaded"] and row["side_effect"] == "yes" and row["missing_is_none"], row
        assert row["executed_by_me"] and row["argv"] == [str(tmp_path / "script.py"), "--flag", "value"], row
    assert unused["executed_by"] != used["executed_by"], (unused, used)
    assert used["total"] == 10
    assert _rows(run_dir, "imported") == {"total": 3, "same": True}


@pytest.mark.parametrize("source, expected", [
    ("import torch\ndef f():\n    return torch.ones(1)\n", {"torch"}),
    ("import torch as T\nx = T\n", {"torch"}),
    ("import side_effect\n", set()),  # never named again: imported for what it does
    ("from torch import nn\nnn.Linear\n", set()),  # loads its module to find the name
    ("import torch.nn\ntorch.nn.Linear\n", set()),  # a submodule needs its package loaded
    # in a try block the import is a test of whether it imports (one that fails while it executes, a GPU
    # library without its driver, must fail there for the fallback to run): eager
    ("if True:\n    import torch\ntry:\n    import numpy as np\nexcept ImportError:\n    np = None\nnp, torch\n",
     {"torch"}),
    ("import contextlib\nwith contextlib.suppress(ImportError):\n    import torch\ntorch\n", {"contextlib"}),
    ("def f():\n    import torch\n    return torch\n", set()),  # not module-level: runs when the stage does
    ("class C:\n    import torch\n    t = torch\n", set()),
])
def test_which_imports_are_deferred(source: str, expected: set[str]) -> None:
    assert deferrable(textwrap.dedent(source)) == expected


def test_a_prepared_script_is_executed_from_its_code_and_an_edited_one_from_its_file(tmp_path: Path) -> None:
    """The fork server compiles a script once (:func:`prepare`) and each task executes that code object, but
    only while the file still has the content it was compiled from: an edited file is what runs."""
    from hetflow.tasks import script

    path = tmp_path / "flow.py"
    path.write_text("VALUE = 1\n")
    script.prepare(str(path), path.read_bytes())
    prepared = script._PREPARED[(str(path), script._digest(path.read_bytes()))]
    assert prepared[1].co_filename == str(path)  # tracebacks name the file, as the loader's code does
    # the prepared code object is what runs for this content (the file is not compiled again)
    script._PREPARED[(str(path), script._digest(path.read_bytes()))] = (prepared[0], compile("VALUE = 'prepared'",
                                                                                             str(path), "exec"))
    try:
        assert script.import_script(str(path), "flow_prepared").VALUE == "prepared"
        path.write_text("VALUE = 2\n")  # edited after the server prepared it
        assert script.import_script(str(path), "flow_edited").VALUE == 2
    finally:
        script._PREPARED.clear()
        sys.modules.pop("flow_prepared", None)
        sys.modules.pop("flow_edited", None)


def test_a_script_that_does_not_compile_is_not_prepared_and_fails_where_it_is_executed(tmp_path: Path) -> None:
    from hetflow.tasks import script

    path = tmp_path / "broken.py"
    path.write_text("def oops(:\n")
    script.prepare(str(path), path.read_bytes())
    assert script._PREPARED == {}
    with pytest.raises(SyntaxError) as raised:
        script.import_script(str(path), "broken_flow")
    assert raised.value.filename == str(path)
    sys.modules.pop("broken_flow", None)


# The user's own modules are imported where the script imports them, in every rank as in the orchestrator:
# what they do at import is state the script's top reads next (round-6 red team f07-f10).
USER_MODULES = {
    "seeding.py": "import random\nrandom.seed(7)\nVERSION = 1\n",  # seeds the generator the top draws from
    "reg.py": "REGISTRY = {}\n",
    "models.py": "from reg import REGISTRY\nREGISTRY['linear'] = 1\nREGISTRY['mlp'] = 2\nVERSION = 2\n",
    "fastimpl.py": "raise ImportError('fastimpl needs libfast.so')\n",
    "slowimpl.py": "def f(x):\n    return x + 1\n",
}

USER_PIPELINE = '''
import os
import random
import hetflow as hf
import pyarrow as pa
import seeding
from reg import REGISTRY
import models
try:
    import fastimpl as impl
except ImportError:
    import slowimpl as impl

DRAWN = random.random()
NAMES = sorted(REGISTRY)
pipe = hf.Pipeline("user-modules", pilot=hf.PilotDescription(
    name="user-modules", cores_per_node=2, memory_per_node=2**33,
    options={"local": {"warm_start": os.environ.get("WARM") == "1"}}))


@pipe.stage(outputs=["seen"])
def seen(ctx):
    return {"seen": pa.table({"drawn": [DRAWN], "names": [NAMES], "impl": [impl.f(10)],
                              "versions": [seeding.VERSION + models.VERSION]})}


if __name__ == "__main__":
    print("TOP", repr(DRAWN), NAMES, flush=True)
    pipe.run()
'''


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_users_modules_run_at_the_line_that_imports_them_in_a_rank(tmp_path: Path, warm: bool) -> None:
    (tmp_path / "script.py").write_text(USER_PIPELINE)
    for name, text in USER_MODULES.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=dict(os.environ, WARM=str(int(warm))),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    row = _rows(run_dir, "seen")
    top = [line for line in done.stdout.splitlines() if line.startswith("TOP ")]
    assert top == [f"TOP {row['drawn']!r} ['linear', 'mlp']"], (top, row)  # the draw after the seed, in both
    assert row["names"] == ["linear", "mlp"] and row["impl"] == 11 and row["versions"] == 3, row
