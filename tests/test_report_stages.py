"""``hetflow report`` shows a table of the run's stages above its timeline: a map stage is one row with
its items counted by state (its chunk tasks draw several bars), and every text in it is escaped."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

HETFLOW = [sys.executable, "-m", "hetflow.cli"]

SCRIPT = '''
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("sweep")


@pipe.stage(map_over={"lr": [0.1, 0.01, 0.001, 0.0001, 0.00001]}, outputs=["scores"])
def fit(ctx):
    return {"scores": pa.table({"lr": [ctx.params["lr"]], "score": [ctx.params["lr"] * OFFSET]})}


@pipe.stage(inputs=["scores"], outputs=["best"])
def pick(ctx, scores):
    return {"best": scores.sort_by([("score", "descending")]).slice(0, 1)}


OFFSET = 2
'''


def _hetflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _stage_table(page: str) -> dict[str, list[str]]:
    table = re.search(r'<table id="stages">(.*?)</table>', page, re.DOTALL)
    assert table, "the report has no stage table"
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1), re.DOTALL)
    cells = [[html.unescape(c) for c in re.findall(r"<t[dh]>(.*?)</t[dh]>", row, re.DOTALL)] for row in rows]
    header, body = cells[0], cells[1:]
    assert header == ["stage", "state", "attempts", "seconds", "items", "why"]
    return {row[0]: row for row in body}


def test_the_report_shows_a_map_stage_as_one_row_with_its_items_by_state(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(SCRIPT)
    _hetflow(tmp_path, "run", "p.py", "--no-progress")
    _hetflow(tmp_path, "report", "--out", str(tmp_path / "first.html"))
    first = _stage_table((tmp_path / "first.html").read_text())
    assert set(first) == {"fit", "pick"}
    assert first["fit"][1] == "DONE" and first["fit"][4] == "5 items: 5 done"
    assert first["pick"][1] == "DONE" and first["pick"][4] == ""

    # one grid point more: four items reused, one ran
    (tmp_path / "p.py").write_text(SCRIPT.replace("0.00001]", "0.00001, 0.5]"))
    _hetflow(tmp_path, "run", "p.py", "--no-progress")
    _hetflow(tmp_path, "report", "--out", str(tmp_path / "second.html"))
    second = _stage_table((tmp_path / "second.html").read_text())
    assert second["fit"][4] == "6 items: 5 cached, 1 done", second["fit"]
    assert second["pick"][1] == "DONE" and "ran" not in second["pick"][4]
