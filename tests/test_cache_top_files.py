"""Library state the script's top sets from a file, and folders listed for plugins (issue 25, rt6 f01/f02/c53).

A stage's key holds what hetflow can follow from its code; an installed library counts by its version. What the
script's top level makes such a library (or the process) hold from a file — ``plt.style.use("paper.mplstyle")``,
a ``matplotlibrc`` named by ``MATPLOTLIBRC``, a variable set from a file — and the folders the top or the stage
lists (a plugin folder) were served ``CACHED`` after they changed.  Each test runs the ``hetflow`` command (real
subprocess, real SQLite), changes the file or folder, runs again and checks that the stage ran, why, and what it
computed; and that what did not change, or what a stage of the run wrote itself, leaves it cached.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from test_cache_stale import edit, run, states, status, value

STYLED = '''
from pathlib import Path

import matplotlib.pyplot as plt
import pyarrow as pa
import hetflow as hf

STYLE = Path(__file__).resolve().parent / "paper.mplstyle"
if STYLE.exists():
    plt.style.use(STYLE)

pipe = hf.Pipeline("styled")


@pipe.stage(outputs=["width"])
def width(ctx):
    import matplotlib

    return {"width": pa.table({"v": [float(matplotlib.rcParams["lines.linewidth"])]})}
'''


def test_a_style_file_the_scripts_top_applies_reruns_its_stage_when_edited_or_removed(tmp_path: Path) -> None:
    """rt6 f02: ``plt.style.use`` at the top reads the file inside matplotlib (an installed library, counted by
    its version): edited from 3.0 to 7.0, the stage was served CACHED with 3.0."""
    pytest.importorskip("matplotlib")
    style = tmp_path / "paper.mplstyle"
    style.write_text("lines.linewidth: 3.0\n")
    (tmp_path / "p.py").write_text(STYLED)
    assert value(run(tmp_path), "width") == 3.0
    assert states(run(tmp_path)) == {"width": "CACHED"}
    style.write_text("lines.linewidth: 7.0\n")
    edited = run(tmp_path)
    assert states(edited) == {"width": "DONE"}, edited["width"]["cache"]
    assert edited["width"]["cache"]["reason"].startswith("file paper.mplstyle read at the script's top changed")
    assert value(edited, "width") == 7.0
    assert states(run(tmp_path)) == {"width": "CACHED"}
    style.unlink()
    removed = run(tmp_path)
    assert states(removed) == {"width": "DONE"}, removed["width"]["cache"]
    assert removed["width"]["cache"]["reason"].startswith("file paper.mplstyle read at the script's top was removed")
    assert value(removed, "width") == 1.5  # matplotlib's own default


RC_IMPORTED = '''
import matplotlib  # before hetflow: run as "python p.py", hetflow does not see what this import reads
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("rcimported", pilot=PILOT, workdir="work")


@pipe.stage(outputs=["width"])
def width(ctx):
    return {"width": pa.table({"v": [float(matplotlib.rcParams["lines.linewidth"])]})}


if __name__ == "__main__":
    pipe.run()
'''

def _run_as(command: str, cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """``hetflow run p.py`` or ``python p.py``; the stages of ``hetflow status --json`` by name."""
    if command == "hetflow":
        return run(cwd, env=env)
    done = subprocess.run([sys.executable, "p.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return status(cwd)


COLD = "name: cold\nextends: local\noptions:\n  local:\n    warm_start: false\n"


def test_warm_and_cold_ranks_import_matplotlib_in_their_own_directory(tmp_path: Path) -> None:
    """rt6 f01b: a warm rank's ``import matplotlib`` happens once in the fork server, which ran it in the run's
    directory, where a ``./matplotlibrc`` beside the script applied, unlike in a cold rank (its own directory):
    the same stage gave 3.0 warm and 1.5 cold, and either was served to the other."""
    pytest.importorskip("matplotlib")
    (tmp_path / "p.py").write_text(RC_IMPORTED.replace("PILOT", '"local"'))
    (tmp_path / "cold.yaml").write_text(COLD)
    (tmp_path / "matplotlibrc").write_text("lines.linewidth: 3.0\n")  # the run's directory: not a rank's
    warm = run(tmp_path)
    cold = run(tmp_path, "--pilot", "cold.yaml", "--rerun", "all")
    assert value(warm, "width") == value(cold, "width") == 1.5


@pytest.mark.parametrize("command", ["hetflow", "python"])
def test_a_matplotlibrc_the_top_reads_when_it_imports_matplotlib_reruns_its_stage_when_edited(
        tmp_path: Path, command: str) -> None:
    """rt6 f01: ``import matplotlib`` at the top reads the rc file ``MATPLOTLIBRC`` names; a warm rank's import
    happens once in the fork server, which recorded nothing: edited, the stage was served CACHED.  Run as
    ``python p.py``, the script imports matplotlib before hetflow, which sees only what the fork server read."""
    pytest.importorskip("matplotlib")
    (tmp_path / "p.py").write_text(RC_IMPORTED.replace("PILOT", '"local"'))
    rc = tmp_path / "lab" / "lab.rc"
    rc.parent.mkdir()
    rc.write_text("lines.linewidth: 2.0\n")
    env = {**os.environ, "MATPLOTLIBRC": str(rc)}  # not in the key (as undeclared variables are not): set throughout
    assert value(_run_as(command, tmp_path, env), "width") == 2.0
    assert states(_run_as(command, tmp_path, env)) == {"width": "CACHED"}
    rc.write_text("lines.linewidth: 4.0\n")
    edited = _run_as(command, tmp_path, env)
    assert states(edited) == {"width": "DONE"}, edited["width"]["cache"]
    assert edited["width"]["cache"]["reason"].startswith("file lab/lab.rc read at the script's top changed")
    assert value(edited, "width") == 4.0


GAIN = '''
import os
from pathlib import Path

import pyarrow as pa
import hetflow as hf

HERE = Path(__file__).resolve().parent
with open(HERE / "gain.txt") as f:
    os.environ["LAB_GAIN"] = f.read().strip()  # process state from a file: no global the key follows
if (HERE / "summary.txt").exists():
    (HERE / "summary.txt").read_text()  # what an earlier run wrote, shown when the script starts
os.environ["LAB_PLUGINS"] = ",".join(sorted(os.listdir(HERE / "plugins")))

pipe = hf.Pipeline("gain")


@pipe.stage(outputs=["gain"])
def gain(ctx):
    return {"gain": pa.table({"v": [int(os.environ["LAB_GAIN"])]})}


@pipe.stage(outputs=["plugins"])
def plugins(ctx):
    return {"plugins": pa.table({"v": [len(os.environ["LAB_PLUGINS"].split(","))]})}


@pipe.stage(inputs=["gain"], outputs=["summary"])
def summarize(ctx, gain):
    import time

    (HERE / "summary.txt").write_text(f"{time.time()}\\n")  # the run's own product, new on every run
    return {"summary": gain}
'''


def test_a_file_read_and_a_folder_listed_at_the_top_rerun_what_they_set_and_a_stages_own_file_does_not(
        tmp_path: Path) -> None:
    """The top level sets process state from a file (``os.environ`` from gain.txt) and from a folder's listing:
    an edit of the file, or a file added to the folder, was served CACHED.  An edit inside a listed folder's
    file does not change the listing, and summary.txt, which the top reads and a stage writes on every run
    that runs it, is the run's own product: neither re-runs anything."""
    (tmp_path / "gain.txt").write_text("2\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "a.py").write_text("W = 1\n")
    (tmp_path / "p.py").write_text(GAIN)
    first = run(tmp_path)
    assert states(first) == {"gain": "DONE", "plugins": "DONE", "summarize": "DONE"}
    assert value(first, "gain") == 2 and value(first, "plugins") == 1
    (tmp_path / "plugins" / "a.py").write_text("W = 2\n")
    unchanged = run(tmp_path)
    assert states(unchanged) == {"gain": "CACHED", "plugins": "CACHED", "summarize": "CACHED"}, unchanged
    again = run(tmp_path, "--rerun", "summarize")  # rewrites summary.txt, which the next run's top reads
    assert states(again)["summarize"] == "DONE"
    assert states(run(tmp_path)) == {"gain": "CACHED", "plugins": "CACHED", "summarize": "CACHED"}
    (tmp_path / "gain.txt").write_text("5\n")
    edited = run(tmp_path)
    assert states(edited)["gain"] == "DONE", edited["gain"]["cache"]
    assert edited["gain"]["cache"]["reason"].startswith("file gain.txt read at the script's top changed")
    assert value(edited, "gain") == 5
    (tmp_path / "plugins" / "b.py").write_text("W = 3\n")
    added = run(tmp_path)
    assert states(added)["plugins"] == "DONE", added["plugins"]["cache"]
    assert added["plugins"]["cache"]["reason"].startswith("folder plugins listed at the script's top changed")
    assert value(added, "plugins") == 2


DISCOVERED = '''
import importlib
import pkgutil

import pyarrow as pa
import hetflow as hf
import plugins

pipe = hf.Pipeline("discovered")


@pipe.stage(outputs=["total"])
def total(ctx):
    found = 0
    for info in pkgutil.iter_modules(plugins.__path__):
        found += importlib.import_module("plugins." + info.name).WEIGHT
    return {"total": pa.table({"v": [found]})}
'''


def test_a_plugin_added_to_a_folder_the_stage_scans_reruns_it(tmp_path: Path) -> None:
    """rt6 c53: the stage finds its plugins with ``pkgutil.iter_modules``; an edited plugin re-ran it (the
    modules a stage imports are observed), an added one was served CACHED with the old total."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "__init__.py").write_text("")
    (tmp_path / "plugins" / "a.py").write_text("WEIGHT = 1\n")
    (tmp_path / "p.py").write_text(DISCOVERED)
    assert value(run(tmp_path), "total") == 1
    assert states(run(tmp_path)) == {"total": "CACHED"}
    (tmp_path / "plugins" / "b.py").write_text("WEIGHT = 10\n")
    added = run(tmp_path)
    assert states(added) == {"total": "DONE"}, added["total"]["cache"]
    assert added["total"]["cache"]["reason"].startswith("folder plugins listed by the stage changed")
    assert value(added, "total") == 11
    assert states(run(tmp_path)) == {"total": "CACHED"}
    edit(tmp_path / "plugins" / "b.py", "10", "20")
    assert value(run(tmp_path), "total") == 21
