"""Declaring many stages: each declaration costs the same whatever the script's size or stage count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
