"""An ended task's slot goes to a task already queued before the end is checked and recorded, unless that
end can make a stage ready (then the slot and what it made ready go to the scheduler together)."""

from __future__ import annotations

import itertools
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

FLOW = textwrap.dedent('''
    import pyarrow as pa
    import hetflow as hf

    pipe = hf.Pipeline("turnaround", pilot=hf.PilotDescription(name="one", cores_per_node=1))


    def make(i):
        def body(ctx):
            return {f"out{i}": pa.table({"x": [i]})}
        return body


    for i in range(4):
        pipe.stage(make(i), name=f"s{i}", outputs=[f"out{i}"])

    BODY

    if __name__ == "__main__":
        print("STATE", pipe.run(progress=False).state)
''')


def _run(tmp_path: Path, body: str = "") -> dict[str, tuple[float, float, float]]:
    """Each stage's (attempt launched, attempt ended, stage's end recorded), from the store of a run on one core."""
    script = tmp_path / "flow.py"
    script.write_text(FLOW.replace("BODY", body))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0 and "STATE DONE" in done.stdout, done.stdout + done.stderr
    with sqlite3.connect(tmp_path / ".hetflow" / "hetflow.db") as db:
        rows = db.execute("SELECT stages.name, attempts.started, attempts.ended, stages.ended FROM attempts "
                          "JOIN stages ON stages.id = attempts.stage_id").fetchall()
    return {name: (launched, ended, recorded) for name, launched, ended, recorded in rows}


def test_a_queued_task_starts_on_the_slot_before_the_ended_one_is_recorded(tmp_path: Path) -> None:
    times = sorted(_run(tmp_path).values())  # one core: one at a time, in launch order
    assert len(times) == 4
    for (_, ended, recorded), (launched, _, _) in itertools.pairwise(times):
        assert ended <= launched < recorded  # the next was launched after the end, before it was recorded


def test_an_end_that_makes_a_stage_ready_releases_its_slot_with_it(tmp_path: Path) -> None:
    """s0 -> mid -> last beside s1..s3: mid, on the longer path, goes before them once s0 has ended; had s0's
    slot been released at its end, s1 (queued) would have taken it first."""
    chain = textwrap.dedent('''
        @pipe.stage(inputs=["out0"], outputs=["mid"])
        def mid(ctx, out0):
            return {"mid": out0}

        @pipe.stage(inputs=["mid"], outputs=["last"])
        def last(ctx, mid):
            return {"last": mid}
    ''')
    times = _run(tmp_path, chain)
    order = sorted(times, key=lambda name: times[name][0])
    assert order[:2] == ["s0", "mid"], order
    assert times["mid"][0] >= times["s0"][2]  # launched once s0's end was recorded
    for before, after in itertools.pairwise(order[2:]):  # the others: released at once, as above
        if before != "mid":
            assert times[after][0] < times[before][2], (before, after)
