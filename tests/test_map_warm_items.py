"""One-rank map items run one after another in a warm process, checked for state they leave (issue 27).

The real-run tests run ``hetflow run`` in a subprocess (real fork server,
SQLite) and record, per item, the process it ran in; the unit tests check
:mod:`hetflow.tasks.itemstate` on modules written to a temporary directory.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hetflow import Pipeline, PipelineError
from hetflow.operators.dataset import Dataset
from hetflow.tasks import itemstate

HETFLOW = [sys.executable, "-m", "hetflow.cli"]


def hetflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETFLOW, *args, "--workdir", str(cwd / "work")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)


def run(cwd: Path, script: str, ok: bool = True) -> dict[str, Any]:
    (cwd / "p.py").write_text(script)
    done = hetflow(cwd, "run", "p.py", "--no-progress")
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    data = json.loads(hetflow(cwd, "status", "--json").stdout)
    stages: dict[str, Any] = {s["name"]: s for s in data["stages"]}
    stages["_run"] = data
    stages["_stderr"] = done.stderr
    return stages


def rows(stages: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return Dataset(stages["_run"]["datasets"][name]).to_table().to_pylist()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("MARKS", str(tmp_path / "marks"))
    return tmp_path


def ran(project: Path) -> list[str]:
    path = project / "marks" / "ran.txt"
    found = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return found


# one chunk task for all items (a one-core pilot: one slot, two chunks), so consecutive items share a runner
HEAD = '''
import os
import pyarrow as pa
import hetflow as hf

pipe = hf.Pipeline("warm", pilot=hf.PilotDescription(name="one-core", cores_per_node=1, memory_per_node=2**32))
'''

CLEAN = HEAD + '''

@pipe.stage(map_over={"n": NS}, outputs=["out"]ISOLATION)
def work(ctx):
    with open(os.path.join(os.environ["MARKS"], "ran.txt"), "a") as fh:
        fh.write(f"{ctx.params['n']}\\n")
    return {"out": pa.table({"n": [ctx.params["n"]], "square": [ctx.params["n"] ** 2], "pid": [os.getpid()]})}


pipe.run()
'''


def test_items_run_in_one_warm_process_with_the_same_results_and_cache_as_forked_ones(project: Path) -> None:
    warm = run(project, CLEAN.replace("NS", "list(range(8))").replace("ISOLATION", ""))
    assert sorted(ran(project), key=int) == [str(n) for n in range(8)]
    out = rows(warm, "out")
    assert [(r["n"], r["square"]) for r in out] == [(n, n * n) for n in range(8)]
    by_chunk: dict[int, int] = {}
    for r in out:
        by_chunk[r["pid"]] = by_chunk.get(r["pid"], 0) + 1
    assert len(by_chunk) == 2 and sorted(by_chunk.values()) == [4, 4], by_chunk  # two chunks, a process each
    assert "process each" not in warm["work"]["cache"]["reason"]

    # per-item cache as before: a new point runs alone, the others are reused
    again = run(project, CLEAN.replace("NS", "list(range(9))").replace("ISOLATION", ""))
    assert ran(project) == ["8"]
    assert again["work"]["cache"]["reason"].startswith("map 9 items: 8 cached, 1 ran")

    # map_isolation="fork": a process per item, the same outputs
    forked = run(project, CLEAN.replace("NS", "list(range(8))").replace("ISOLATION", ', map_isolation="fork"')
                 .replace('ctx.params["n"] ** 2', 'ctx.params["n"] * ctx.params["n"]'))  # every item runs again
    assert len(ran(project)) == 8
    out_forked = rows(forked, "out")
    assert [(r["n"], r["square"]) for r in out_forked] == [(r["n"], r["square"]) for r in out]
    assert len({r["pid"] for r in out_forked}) == 8


def test_map_isolation_is_checked_where_declared() -> None:
    pipe = Pipeline("bad")

    def body(ctx: Any) -> None:
        return None

    with pytest.raises(PipelineError, match=r"map_isolation='spawn' is not one of \['checked', 'fork'\]"):
        pipe.stage(name="a", map_over={"n": [1]}, map_isolation="spawn")(body)
    with pytest.raises(PipelineError, match="map_isolation is for map stages"):
        pipe.stage(name="b", map_isolation="fork")(body)


LEAKS = HEAD + '''
SEEN = []
COUNT = 0


@pipe.stage(map_over={"n": list(range(8))}, outputs=["out"])
def work(ctx):
    global COUNT
    n = ctx.params["n"]
    COUNT += 1 if n >= LEAK_FROM_COUNT else 0
    if n >= LEAK_FROM_LIST:
        SEEN.append(n)
    return {"out": pa.table({"n": [n], "seen": [len(SEEN)], "count": [COUNT], "pid": [os.getpid()]})}


pipe.run()
'''


@pytest.mark.parametrize("leak, what", [("list", "the script's global 'SEEN' was changed in place"),
                                        ("count", "the script's global 'COUNT' was reassigned")])
def test_an_item_that_changes_a_global_makes_the_later_items_run_as_forked_ones_would(
        project: Path, leak: str, what: str) -> None:
    script = LEAKS.replace("LEAK_FROM_LIST", "2" if leak == "list" else "99") \
        .replace("LEAK_FROM_COUNT", "2" if leak == "count" else "99")
    stages = run(project, script)
    out = rows(stages, "out")
    assert [r["n"] for r in out] == list(range(8))
    # what a process per item gives: each item sees the script's state as it was loaded, and its own change
    assert [(r["seen"], r["count"]) for r in out] == [((n >= 2) * (leak == "list"), (n >= 2) * (leak == "count"))
                                                      for n in range(8)]
    # chunk 0 (items 0-3): items 0, 1 and 2 in one runner; 2 changed the state, so 3 ran in a process of its
    # own; chunk 1 (items 4-7) started after that was known, and ran a process per item
    assert out[0]["pid"] == out[1]["pid"] == out[2]["pid"]
    assert len({r["pid"] for r in out[2:]}) == 6
    reason = stages["work"]["cache"]["reason"]
    assert f"changed what later items would read ({what}): the items after it ran in a process each" in reason
    assert reason.count("changed what later items would read") == 1
    assert stages["_stderr"].count("changed what later items would read") == 1  # said once in the run's log
    listed = hetflow(project, "status", stages["_run"]["id"], "work", "--items")
    assert listed.stdout.count(f"({what}): the items after it ran in a process each") == 1, listed.stdout


BIG = HEAD + '''
ROWS = [[i] for i in range(30_000)]  # more than the check after each item walks


@pipe.stage(map_over={"n": list(range(4))}, outputs=["out"])
def work(ctx):
    return {"out": pa.table({"n": [ctx.params["n"] + len(ROWS)], "pid": [os.getpid()]})}


pipe.run()
'''


def test_state_too_large_to_check_runs_the_items_in_a_process_each_and_says_so(project: Path) -> None:
    stages = run(project, BIG)
    out = rows(stages, "out")
    assert [r["n"] for r in out] == [30_000 + n for n in range(4)]
    assert len({r["pid"] for r in out}) == 4
    assert stages["work"]["cache"]["reason"].endswith(
        "; the items from item 0 on ran in a process each (the user's modules hold more than 20,000 objects, "
        "too many to check after each item)")


HIDDEN = HEAD + '''
import _thread, array, collections, functools, itertools, random, time
import numpy as np

SETUP


@pipe.stage(map_over={"n": list(range(4))}, outputs=["out"]ISOLATION)
def work(ctx):
    return {"out": pa.table({"n": [ctx.params["n"]], "v": [repr(READ)], "pid": [os.getpid()]})}


pipe.run()
'''

_SLOTS = "class Counter:\n    __slots__ = 'n'\n\n    def __init__(self):\n        self.n = 0\n\n\nC = Counter()"
_PARTIAL = "def _acc(seen, x):\n    seen.append(x)\n    return len(seen)\n\n\nacc = functools.partial(_acc, [])"
_THREAD = ("STATE = {'flag': 0}\n\n\ndef bump():\n    time.sleep(0.3)\n    STATE['flag'] += 1\n\n\n"
           "def read():\n    time.sleep(0.6)\n    flag = STATE['flag']\n    _thread.start_new_thread(bump, ())\n"
           "    return flag")


@pytest.mark.parametrize("setup, read, what", [
    ("rng = np.random.default_rng(42)", "float(rng.random())",
     "item 0 ({\"n\": 0}) changed what later items would read (the script's global 'rng' was changed in place)"),
    ("prng = random.Random(7)", "prng.random()", "(the script's global 'prng' was changed in place)"),
    ("legacy = np.random.RandomState(3)", "legacy.rand()", "(the script's global 'legacy' was changed in place)"),
    ("@functools.cache\ndef names():\n    return []", "(lambda kept: (len(kept), kept.append(1)))(names())[0]",
     "(the script's global 'names' holds a functools cache holding 1 value(s), which a check cannot read)"),
    ("ids = itertools.count()", "next(ids)", ("the items from item 0 on ran in a process each (the script's "
                                              "global 'ids' holds an itertools.count, whose state a check cannot "
                                              "read)")),
    ("gen = (i for i in range(9))", "next(gen)", ("from item 0 on ran in a process each (the script's global 'gen' "
                                                 "holds a builtins.generator, whose state a check cannot read)")),
    ("recent = collections.deque(maxlen=3)", "(recent.append(1), len(recent))[1]",
     "(the script's global 'recent' was changed in place)"),
    (_PARTIAL, "acc(1)", "(the script's global 'acc' was changed in place)"),
    ("arr = array.array('i', [0])", "(arr.__setitem__(0, arr[0] + 1), arr[0])[1]",
     "(the script's global 'arr' was changed in place)"),
    (_SLOTS, "(setattr(C, 'n', C.n + 1), C.n)[1]", "(the script's global 'C' was changed in place)"),
    ("FLAT = [-1]", "(FLAT[0], FLAT.__setitem__(0, -2))[0]", "(the script's global 'FLAT' was changed in place)"),
    ("from hetflow_helpers import Running\nacc = Running()", "acc.add(1)",
     "(the script's global 'acc' was changed in place)"),
    (_THREAD, "read()", "(a thread it started is still running)"),
], ids=["default_rng", "random.Random", "RandomState", "functools.cache", "itertools.count", "generator", "deque",
        "partial", "array", "string-slots", "int-by-value", "user-module-named-like-hetflow", "raw-thread"])
def test_state_the_check_cannot_read_or_once_missed_makes_the_items_run_as_forked_ones_would(
        project: Path, setup: str, read: str, what: str) -> None:
    (project / "hetflow_helpers.py").write_text(
        "class Running:\n    def __init__(self):\n        self.seen = []\n\n"
        "    def add(self, x):\n        self.seen.append(x)\n        return len(self.seen)\n")
    script = HIDDEN.replace("SETUP", setup).replace("READ", read)
    stages = run(project, script.replace("ISOLATION", ""))
    out = rows(stages, "out")
    assert [r["n"] for r in out] == list(range(4))
    # a process per item: each item reads the state the script was loaded with
    assert len({r["v"] for r in out}) == 1, [r["v"] for r in out]
    reason = stages["work"]["cache"]["reason"]
    assert what in reason and reason.count("ran in a process each") == 1, reason
    if setup.startswith("rng"):  # the same values as map_isolation="fork" gives
        forked = run(project, script.replace("ISOLATION", ', map_isolation="fork"').replace("repr(", "str("))
        assert [r["v"] for r in rows(forked, "out")] == [r["v"] for r in out]


CRASH = HEAD + '''

@pipe.stage(map_over={"n": list(range(8))}, retries=1, outputs=["out"])
def work(ctx):
    n = ctx.params["n"]
    marks = os.environ["MARKS"]
    with open(os.path.join(marks, "ran.txt"), "a") as fh:
        fh.write(f"{n}\\n")
    if n in (1, 5) and not os.path.exists(os.path.join(marks, f"crashed-{n}")):
        open(os.path.join(marks, f"crashed-{n}"), "w").close()
        if n == 1:
            os._exit(3)
        os.kill(os.getpid(), 9)
    return {"out": pa.table({"n": [n], "pid": [os.getpid()]})}


pipe.run()
'''


def test_an_item_that_ends_its_process_loses_no_other_item_and_runs_again(project: Path) -> None:
    stages = run(project, CRASH)
    assert sorted(ran(project), key=int) == ["0", "1", "1", "2", "3", "4", "5", "5", "6", "7"]  # crashed: twice
    out = rows(stages, "out")
    assert [r["n"] for r in out] == list(range(8))
    assert stages["work"]["items"] == {"DONE": 8}
    listed = json.loads(hetflow(project, "status", stages["_run"]["id"], "work", "--items", "--json").stdout)
    assert [i["tries"] for i in listed["items"]] == [1, 2, 1, 1, 1, 2, 1, 1]
    # chunk 0 (items 0-3): item 1 ended its runner with os._exit, a new runner ran 2 and 3; chunk 1 (4-7):
    # item 5 killed its runner, a new one ran 6 and 7; items 1 and 5 ran again, each in a retry chunk
    pids = [r["pid"] for r in out]
    assert pids[2] == pids[3] and pids[6] == pids[7]
    assert len({pids[0], pids[1], pids[2], pids[4], pids[5], pids[6]}) == 6


STUCK = HEAD + '''
import time


@pipe.stage(map_over={"n": [0, 1, 2, 3]}, timeout=2, max_failures=1, outputs=["out"])
def stuck(ctx):
    if ctx.params["n"] == 0:
        while True:  # neither sleeps nor returns: only a kill ends it
            pass
    return {"out": pa.table({"n": [ctx.params["n"]], "pid": [os.getpid()]})}


pipe.run()
'''


def test_an_item_past_the_timeout_is_killed_and_the_next_go_on_warm(project: Path) -> None:
    started = time.perf_counter()
    stages = run(project, STUCK)
    assert time.perf_counter() - started < 60
    out = rows(stages, "out")
    assert [r["n"] for r in out] == [1, 2, 3]
    assert out[1]["pid"] == out[2]["pid"]  # items 2 and 3: the second chunk's, in one runner
    listed = json.loads(hetflow(project, "status", stages["_run"]["id"], "stuck", "--items", "--json").stdout)
    [failed] = [i for i in listed["items"] if i["state"] == "FAILED"]
    assert failed["index"] == 0 and "exceeded the stage's timeout of 2s and was killed" in failed["error"]


# ----------------------------------------------------------------------------- itemstate on real modules
@pytest.fixture(autouse=True)
def _only_this_tests_modules(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a runner, :func:`itemstate.take` watches every user module loaded; under pytest that is every test
    module this worker imported, whatever test ran before (one holds a functools cache: uncheckable, as it
    should be).  The itemstate tests below watch the modules they write, in their own ``tmp_path``."""
    if not request.node.name.startswith("test_itemstate_"):
        return
    here = str(request.getfixturevalue("tmp_path"))
    mine = itemstate.user_module
    monkeypatch.setattr(itemstate, "user_module",
                        lambda m: mine(m) and str(getattr(m, "__file__", None) or "").startswith(here))


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "leaky_mod.py").write_text(
        "SEEN = []\nLIMIT = 3\nTABLE = {'a': [1, 2]}\n\n"
        "def memo(x, cache={}):\n    return cache.setdefault(x, x)\n\n"
        "class Config:\n    level = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("leaky_mod")
    yield mod
    sys.modules.pop("leaky_mod", None)
    sys.modules.pop("leaky_other", None)


@pytest.mark.parametrize("change, expected", [
    (lambda m: m.SEEN.append(1), "global 'SEEN' of module 'leaky_mod' was changed in place"),
    (lambda m: setattr(m, "LIMIT", 4), "global 'LIMIT' of module 'leaky_mod' was reassigned"),
    (lambda m: m.TABLE["a"].append(3), "global 'TABLE' of module 'leaky_mod' was changed in place"),
    (lambda m: m.memo(5), "global 'memo' of module 'leaky_mod' was changed in place"),
    (lambda m: setattr(m.Config, "level", 2), "global 'Config' of module 'leaky_mod' was changed in place"),
    (lambda m: setattr(m, "EXTRA", 1), "global 'EXTRA' of module 'leaky_mod' was added"),
])
def test_itemstate_sees_a_changed_global(module: Any, change: Any, expected: str) -> None:
    before = itemstate.take([module])
    assert itemstate.changed(before) is None
    module.SEEN[:] = []  # a change undone is no change
    assert itemstate.changed(before) is None
    change(module)
    assert itemstate.changed(before) == expected


def test_itemstate_sees_the_process_state(module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = itemstate.take([module])
    import json as _json  # noqa: F401 - an installed module loaded since: not state
    importlib.import_module("email.mime.text")
    assert itemstate.changed(before) is None
    (tmp_path / "leaky_other.py").write_text("STATE = {}\n")
    importlib.import_module("leaky_other")
    assert itemstate.changed(before) == "it imported the module 'leaky_other', whose state later items would share"
    sys.modules.pop("leaky_other")
    monkeypatch.setenv("HETFLOW_TEST_LEAK", "1")
    assert itemstate.changed(before) == "the environment variable HETFLOW_TEST_LEAK changed"
    monkeypatch.delenv("HETFLOW_TEST_LEAK")
    monkeypatch.chdir(tmp_path)
    assert itemstate.changed(before) == f"the working directory changed to {tmp_path}"


def test_itemstate_refuses_state_too_large_to_check(module: Any) -> None:
    module.BIG = [[i] for i in range(itemstate.MAX_NODES)]
    with pytest.raises(itemstate.TooLarge):
        itemstate.take([module])
    module.BIG = list(range(itemstate.MAX_NODES // 2))  # flat: hashed at once, still counted
    assert itemstate.changed(itemstate.take([module])) is None


def test_itemstate_reads_a_plain_scripts_state_without_false_changes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plain_mod.py").write_text(
        "import datetime, enum, logging, math, re, threading\nfrom random import random as draw\n"
        "import numpy as np, pandas as pd, pyarrow as pa\n\n"
        "log = logging.getLogger(__name__)\nPAT = re.compile('a+')\nWHEN = datetime.datetime(2020, 1, 1)\n"
        "LOCK = threading.Lock()\nsqrt = math.sqrt\nSCALE = np.float64(2.0)\nTABLE = pa.table({'a': [1]})\n"
        "FRAME = pd.DataFrame({'a': [1, 2], 's': ['x', 'y'], 't': pd.to_datetime(['2020-01-01', '2021-01-01'])})\n"
        "NAMES = {-1, 'x'}\n\n\nclass Level(enum.IntEnum):\n    LOW = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("plain_mod")
    try:
        before = itemstate.take([mod])
        mod.draw()  # Python's global generator is reseeded before each item: not state
        mod.FRAME["a"].sum()
        assert itemstate.changed(before) is None
        mod.NAMES.discard(-1)
        mod.NAMES.add(-2)  # hash(-1) == hash(-2): read by value
        assert itemstate.changed(before) == "global 'NAMES' of module 'plain_mod' was changed in place"
        before = itemstate.take([mod])
        mod.FRAME.iloc[1, 1] = "z"
        assert itemstate.changed(before) == "global 'FRAME' of module 'plain_mod' was changed in place"
    finally:
        sys.modules.pop("plain_mod", None)
