"""Two runs on one machine at once never use the same core at the same time.

Real processes: two ``hetflow run`` orchestrators with their own work directories
share this machine's cores through the per-user core ledger (:mod:`hetflow.tasks.ledger`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hetflow.tasks.ledger import CoreLedger, real_cpus

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = '''
import _fault_stages as F, hetflow as hf
pipe = hf.Pipeline("NAME", pilot=hf.PilotDescription(name="two", cores_per_node=2, gpus_per_node=0,
                   memory_per_node=2**34))
pipe.stage(ranks=2, timeout=60, params=PARAMS)(F.books_cores)
'''


def _start(tmp_path: Path, name: str, params: dict) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.replace("NAME", name).replace("PARAMS", repr(params)))
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hetflow.cli", "run", str(script), "--workdir",
                                 str(tmp_path / name), "--no-progress"], env=env, stderr=err)
    return proc, log


def test_a_second_run_waits_for_the_cores_the_first_holds_and_says_so(tmp_path: Path) -> None:
    record = tmp_path / "record"
    record.mkdir()
    second_log = tmp_path / "second.log"
    first, _ = _start(tmp_path, "first", {"record": str(record), "until": str(second_log)})
    deadline = time.monotonic() + 60
    while len(list(record.glob("started-first-*"))) < 2:  # the first run holds its cores
        assert first.poll() is None and time.monotonic() < deadline, "the first run's stage never started"
        time.sleep(0.02)
    second, _ = _start(tmp_path, "second", {"record": str(record)})
    assert first.wait(90) == 0 and second.wait(90) == 0
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for path in record.glob("*.json"):
        seen = json.loads(path.read_text())
        for cpu in seen["cpus"]:
            spans.setdefault(cpu, []).append((seen["started"], seen["ended"], path.stem))
    assert sum(len(s) for s in spans.values()) >= 4, spans  # four ranks, each on at least one CPU
    for cpu, lives in spans.items():
        lives.sort()
        for (_, end, who), (start, _, other) in zip(lives, lives[1:]):
            assert end <= start, f"CPU {cpu}: {who} (until {end}) and {other} (from {start}) overlap"
    text = second_log.read_text()
    assert f"is waiting for cores {real_cpus([0, 1], sorted(os.sched_getaffinity(0)))} held by another " \
           f"hetflow run (pid {first.pid})" in text, text
    assert text.count("is waiting for cores") == 1  # once, not once per try


def test_a_run_shares_its_own_folded_cores_and_a_killed_holder_frees_them(tmp_path: Path) -> None:
    mine = CoreLedger(tmp_path)
    assert mine.book([0], "t1") and mine.book([0], "t2")  # one run's tasks do not wait for each other
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from pathlib import Path\n"
                               "from hetflow.tasks.ledger import CoreLedger\n"
                               f"CoreLedger(Path({str(tmp_path)!r})).book([1], 'other')\n"
                               "print('held', flush=True)\n"
                               "time.sleep(300)\n"], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    tries = 0

    def give_up() -> bool:
        nonlocal tries
        tries += 1
        return tries > 3

    assert not mine.book([0, 1], "t3", stop=give_up)  # held by another process: waits, then gives up
    holder.kill()
    holder.wait(10)
    assert mine.book([1], "t4", stop=lambda: True)  # the lock died with its holder
    mine.release([0])
    mine.release([0])
    mine.release([1])
    assert mine.book([0, 1], "t5", stop=lambda: True)


def test_real_cpus_fold_pilot_core_ids_onto_this_machine() -> None:
    assert real_cpus([1, 0], [0, 1, 2, 3]) == [0, 1]
    assert real_cpus([2, 3], [4, 5]) == [4, 5]
    assert real_cpus([0, 2], [4, 5]) == [4]


def test_a_runtime_directory_that_is_gone_falls_back_with_a_warning(tmp_path: Path) -> None:
    """A stale XDG_RUNTIME_DIR (its session ended, a removed temporary directory) must not fail a run."""
    script = tmp_path / "tiny.py"
    script.write_text("import hetflow as hf, pyarrow as pa\npipe = hf.Pipeline('tiny')\n"
                      "@pipe.stage(outputs=['t'])\ndef make(ctx):\n    return {'t': pa.table({'x': [1]})}\n")
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "gone"))
    done = subprocess.run([sys.executable, "-m", "hetflow.cli", "run", str(script), "--workdir", str(tmp_path / "w"),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"XDG_RUNTIME_DIR={tmp_path / 'gone'} is not a directory" in done.stderr
    assert not (tmp_path / "gone").exists()  # not created on the user's behalf
