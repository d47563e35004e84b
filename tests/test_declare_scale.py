"""Declaring many stages: each declaration costs the same whatever the script's size or stage count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import ast
    import hetflow as hf

    parses = []
    parse = ast.parse
    ast.parse = lambda *a, **k: parses.append(a[1] if len(a) > 1 else "") or parse(*a, **k)

    pipe = hf.Pipeline("many", pilot=hf.PilotDescription(name="p", cores_per_node=2))


    def make(i):
        def body(ctx):
            return {}
        return body


    for i in range(300):
        pipe.stage(make(i), name=f"s{i}", outputs=[f"out{i}"])

    print("PARSES", sum(p == __file__ for p in parses), len(pipe.stages))
    TAIL
''')


def _parses(tmp_path: Path, tail: str) -> str:
    script = tmp_path / "many.py"
    script.write_text(SCRIPT.replace("TAIL", tail))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("PARSES", 1)[1].split()[0:2]


def test_a_script_without_a_main_block_is_read_once_not_once_per_stage_it_declares(tmp_path: Path):
    """``pipe.run()`` at the bottom, no ``if __name__ == "__main__":`` (as many scripts are written): the
    script was parsed again at every declaration, 300 parses for 300 stages made in a loop."""
    assert _parses(tmp_path, "") == ["1", "300"]


def test_a_script_with_a_main_block_is_read_once(tmp_path: Path):
    assert _parses(tmp_path, 'if __name__ == "__main__":\n    pass') == ["1", "300"]


LOOP_FLOW = textwrap.dedent('''
    import pyarrow as pa
    import hetflow as hf

    pipe = hf.Pipeline("loop", pilot=hf.PilotDescription(name="p", cores_per_node=2))


    def make(i):
        def body(ctx):
            return {f"out{i}": pa.table({"i": [i], "declared": [sorted(pipe.stages)]})}
        return body


    for i in range(STAGES):
        pipe.stage(make(i), name=f"s{i}", outputs=[f"out{i}"], ranks=RANKS)

    if __name__ == "__main__":
        pipe.run(progress=False)
''')


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rank_of_a_loop_made_plan_declares_its_own_stage_only(tmp_path: Path, ranks: int):
    """Each rank executes the script: it declares the stage it runs and skips the other N - 1 declarations,
    which the run checked when it started (before, every task of a plan of N loop-made stages paid for N).
    Each stage still runs its own closure, warm (one rank) or through mpiexec's stubs (two)."""
    from hetflow.operators.dataset import open_dataset

    stages = 12
    (tmp_path / "flow.py").write_text(LOOP_FLOW.replace("STAGES", str(stages)).replace("RANKS", str(ranks)))
    done = subprocess.run([str(Path(sys.executable).parent / "hetflow"), "run", "flow.py", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = (tmp_path / ".hetflow" / "runs").iterdir()
    for i in range(stages):
        rows = open_dataset(run / "datasets" / f"out{i}").to_table().to_pylist()
        assert rows == [{"i": i, "declared": [f"s{i}"]}] * ranks, rows
