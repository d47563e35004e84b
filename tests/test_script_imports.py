"""A stage does not pay for the script's top-level imports it does not use; one that uses them gets them.

Real runs of scripts written as a scientist writes them (``import torch`` at the top); each stage
reports what is loaded in its own worker.  The rules of :func:`hetflow.tasks.script.deferrable`
are checked on source text.
"""

from __future__ import annotations

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
import sys
import torch
import side_effect
import hetflow as hf
import pyarrow as pa
try:
    import not_installed_anywhere_xyz
except ImportError:
    not_installed_anywhere_xyz = None

pipe = hf.Pipeline("lazy", pilot="local")


def loaded():
    return {"torch_loaded": ["torch._C" in sys.modules], "torch_bound": ["torch" in sys.modules],
            "side_effect": [__import__("os").environ.get("SIDE_EFFECT_RAN")],
            "missing_is_none": [not_installed_anywhere_xyz is None]}


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


def _run(tmp_path: Path) -> Path:
    (tmp_path / "script.py").write_text(PIPELINE)
    (tmp_path / "side_effect.py").write_text(HELPER)
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", "script.py", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / ".hetflow" / "runs").iterdir()
    return run_dir


def _rows(run_dir: Path, name: str) -> dict:
    (row,) = open_dataset(run_dir / "datasets" / name).to_table().to_pylist()
    return row


def test_a_stage_that_does_not_use_torch_does_not_load_it_and_one_that_does_gets_it(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    unused = _rows(run_dir, "unused")
    assert unused == {"torch_loaded": False, "torch_bound": True, "side_effect": "yes", "missing_is_none": True}
    used = _rows(run_dir, "used")
    assert used["torch_loaded"] and used["total"] == 10, used
    assert _rows(run_dir, "imported") == {"total": 3, "same": True}


@pytest.mark.parametrize("source, expected", [
    ("import torch\ndef f():\n    return torch.ones(1)\n", {"torch"}),
    ("import torch as T\nx = T\n", {"torch"}),
    ("import side_effect\n", set()),  # never named again: imported for what it does
    ("from torch import nn\nnn.Linear\n", set()),  # loads its module to find the name
    ("import torch.nn\ntorch.nn.Linear\n", set()),  # a submodule needs its package loaded
    ("if True:\n    import torch\ntry:\n    import numpy as np\nexcept ImportError:\n    np = None\nnp, torch\n",
     {"torch", "numpy"}),
    ("def f():\n    import torch\n    return torch\n", set()),  # not module-level: runs when the stage does
    ("class C:\n    import torch\n    t = torch\n", set()),
])
def test_which_imports_are_deferred(source: str, expected: set[str]) -> None:
    assert deferrable(textwrap.dedent(source)) == expected
