"""Code and file fingerprints: real scripts and modules written to disk and imported."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetflow.fingerprint import (
    NO_MATCH,
    code_fingerprint,
    describe_change,
    file_fingerprint,
    resolve_files,
)

SCRIPT = '''
import numpy as np
import mylib

SCALE = 2
UNRELATED = 1
WEIGHTS = np.arange(4, dtype="float64")
BANDS = {"u", "g", "r", "i", "z"}


def helper(x):
    return x * SCALE


class Model:
    factor = 3

    def fit(self, x):
        return helper(x) * self.factor


def transform(ctx, table):
    # the stage under test
    return Model().fit(table) + np.sum(WEIGHTS) + len(BANDS) + mylib.offset()


def other(ctx, table):
    return UNRELATED
'''

MYLIB = '''
import mylib2

def offset():
    return mylib2.BASE + 1
'''
MYLIB2 = "BASE = 10\n"


def fingerprint(where: Path, script: str = SCRIPT, stage: str = "transform", name: str = "__hetflow_script__",
                **modules: str) -> dict[str, str]:
    """Write ``script`` (and modules) into a fresh directory, import it as ``name``, fingerprint ``stage``."""
    where.mkdir(parents=True)
    modules = {"mylib": MYLIB, "mylib2": MYLIB2, **modules}
    for module, text in modules.items():
        (where / f"{module}.py").write_text(textwrap.dedent(text))
    (where / "pipeline.py").write_text(textwrap.dedent(script))
    before = set(sys.modules)
    sys.path.insert(0, str(where))
    try:
        spec = importlib.util.spec_from_file_location(name, where / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return code_fingerprint(getattr(module, stage))
    finally:
        sys.path.remove(str(where))
        for added in set(sys.modules) - before:  # the script's own modules: the next version has the same names
            if str(getattr(sys.modules[added], "__file__", "")).startswith(str(where)):
                del sys.modules[added]


def edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.fixture
def base(tmp_path: Path) -> dict[str, str]:
    return fingerprint(tmp_path / "base")


def test_components_are_named_and_external_code_is_left_out(base: dict[str, str]) -> None:
    assert set(base) == {"transform()", "helper()", "class Model", "SCALE", "WEIGHTS", "BANDS",
                         "module mylib", "module mylib2", "module numpy",
                         "mylib2.BASE"}  # a reached local module's global that reached code names: its value
    import numpy

    assert base["module numpy"] == numpy.__version__


@pytest.mark.parametrize(("old", "new", "reason"), [
    ("SCALE = 2", "SCALE = 10", "SCALE changed"),
    ("return x * SCALE", "return x * SCALE + 0", "code of helper() changed"),
    ("+ mylib.offset()", "- mylib.offset()", "code of transform() changed"),
    ("    factor = 3", "    factor = 4", "class Model changed"),
    ("return helper(x) * self.factor", "return helper(x) / self.factor", "class Model changed"),
    ('np.arange(4, dtype="float64")', 'np.arange(4, dtype="float64") * 2', "WEIGHTS changed"),
    ('"z"}', '"y"}', "BANDS changed"),
    ("def helper(x):", "def helper(x, y=1):", "code of helper() changed"),
])
def test_what_the_stage_uses_changes_it(tmp_path: Path, base: dict[str, str], old: str, new: str,
                                        reason: str) -> None:
    changed = fingerprint(tmp_path / "changed", edit(SCRIPT, old, new))
    assert describe_change(base, changed) == reason


def test_local_modules_count_transitively(tmp_path: Path, base: dict[str, str]) -> None:
    assert describe_change(base, fingerprint(tmp_path / "a", mylib=edit(MYLIB, "+ 1", "+ 2"))) == "module mylib changed"
    assert describe_change(base, fingerprint(tmp_path / "b", mylib2="BASE = 11\n")) == \
        "module mylib2 changed; mylib2.BASE changed"


@pytest.mark.parametrize(("old", "new"), [
    ("return UNRELATED", "return UNRELATED + 1"),                      # another stage's code
    ("UNRELATED = 1", "UNRELATED = 2"),                                # a constant this stage never names
    ("import mylib\n", "import mylib\n# a comment\n\n\n"),             # a comment; every line below moves
    ("    # the stage under test\n", "    # the stage under test, reworded\n"),
    ("BANDS = {", "EXTRA = [1, 2]\nBANDS = {"),                        # a new constant nobody uses
])
def test_what_the_stage_does_not_use_leaves_it(tmp_path: Path, base: dict[str, str], old: str, new: str) -> None:
    assert fingerprint(tmp_path / "changed", edit(SCRIPT, old, new)) == base


def test_independent_of_the_scripts_module_name(tmp_path: Path, base: dict[str, str]) -> None:
    assert fingerprint(tmp_path / "main", name="__main__") == base


def test_stable_across_processes_despite_hash_randomisation(tmp_path: Path) -> None:
    """BANDS is a set of strings: its iteration order differs between these processes."""
    here = tmp_path / "script"
    fingerprint(here)  # writes the files
    code = ("import importlib.util, json, sys; sys.path.insert(0, sys.argv[1]);"
            "s = importlib.util.spec_from_file_location('__main__', sys.argv[1] + '/pipeline.py');"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m);"
            "from hetflow.fingerprint import code_fingerprint; print(json.dumps(code_fingerprint(m.transform)))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code, str(here)], check=True, capture_output=True,
                                      text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
            for seed in ("1", "2", "3")]
    assert runs[0] == runs[1] == runs[2]


def test_a_new_helper_is_reported_as_added(tmp_path: Path, base: dict[str, str]) -> None:
    script = edit(SCRIPT, "def transform(", "def extra():\n    return 0\n\n\ndef transform(")
    changed = fingerprint(tmp_path / "changed", edit(script, "+ mylib.offset()", "+ mylib.offset() + extra()"))
    assert describe_change(base, changed) == "code of transform() changed; extra() added"


FACTORY = '''
def make(scale, bias=0):
    def inner(ctx, table):
        return [v * scale + bias for v in table]
    return inner

small = make(2)
large = make(3)
shifted = make(2, bias=1)
'''


def test_a_partial_stage_counts_its_function_and_its_arguments(tmp_path: Path) -> None:
    script = FACTORY + "\nimport functools\nbound = functools.partial(make(2), bias=0)\n"
    fp = fingerprint(tmp_path / "a", script, "bound")
    assert set(fp) == {"stage", "make.<locals>.inner()"}
    changed = fingerprint(tmp_path / "b", edit(script, "bias=0)\n", "bias=1)\n"), "bound")
    assert describe_change(fp, changed) == "stage changed"


def test_closures_from_a_factory_differ_by_their_cells(tmp_path: Path) -> None:
    fps = {stage: fingerprint(tmp_path / stage, FACTORY, stage) for stage in ("small", "large", "shifted")}
    assert list(fps["small"]) == ["make.<locals>.inner()"]
    assert fps["small"] != fps["large"] and fps["small"] != fps["shifted"]
    assert fingerprint(tmp_path / "again", FACTORY, "small") == fps["small"]


RECURSIVE = '''
import json

LOOP = [1]
LOOP.append(LOOP)

def even(n):
    return n == 0 or odd(n - 1)

def odd(n):
    return n != 0 and even(n - 1)

def stage(ctx, table, default=LOOP):
    import mylib
    from local_only import thing
    return even(len(table)) and json.dumps(default) and thing
'''


def test_cycles_function_local_imports_and_never_imported_modules(tmp_path: Path) -> None:
    fp = fingerprint(tmp_path / "a", RECURSIVE, "stage", local_only="thing = 1\n")
    # mylib was never imported either: its file is hashed, and what its source imports (mylib2) too
    assert set(fp) == {"stage()", "even()", "odd()", "module mylib", "module mylib2", "module local_only"}
    changed = fingerprint(tmp_path / "b", RECURSIVE, "stage", local_only="thing = 2\n")
    assert describe_change(fp, changed) == "module local_only changed"
    changed = fingerprint(tmp_path / "c", RECURSIVE, "stage", local_only="thing = 1\n", mylib2="BASE = 11\n")
    assert describe_change(fp, changed) == "module mylib2 changed"
    assert not {"local_only", "mylib", "mylib2"} & set(sys.modules)  # found, hashed, never executed


UNHASHABLE = '''
import threading
from dataclasses import dataclass

LOCK = threading.Lock()

@dataclass(frozen=True)
class Config:
    lr: float

CONFIG = Config(lr=0.1)

class Settings:
    def __init__(self, depth):
        self.depth = depth

SETTINGS = Settings(depth=3)

def stage(ctx):
    with LOCK:
        return CONFIG.lr * SETTINGS.depth
'''


@pytest.mark.parametrize("name", ["__main__", "__hetflow_script__"])
def test_objects_by_their_fields_and_the_rest_by_type(tmp_path: Path, name: str) -> None:
    """The lock has no stable form: it counts by its type, and no address leaks into the digest."""
    fp = fingerprint(tmp_path / "a", UNHASHABLE, "stage", name)
    assert fingerprint(tmp_path / "b", UNHASHABLE, "stage", name) == fp
    changed = fingerprint(tmp_path / "c", edit(UNHASHABLE, "lr=0.1", "lr=0.2"), "stage", name)
    assert describe_change(fp, changed) == "CONFIG changed"
    changed = fingerprint(tmp_path / "d", edit(UNHASHABLE, "depth=3", "depth=4"), "stage", name)
    assert describe_change(fp, changed) == "SETTINGS changed"


def test_describe_change() -> None:
    assert describe_change({"f()": "1", "X": "1"}, {"f()": "2", "X": "1", "g()": "1"}) == \
        "code of f() changed; g() added"
    assert describe_change({"X": "1", "Y": "1"}, {"a()": "1", "Y": "2"}) == "Y changed; a() added; X removed"
    assert describe_change({"X": "1"}, {"X": "1"}) == "unchanged"


# ------------------------------------------------------------------------------------ files
def test_file_fingerprint_globs_relative_and_absolute(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("obs-2.csv", "obs-1.csv", "notes.txt"):
        (data / name).write_text(name)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.csv"
    outside.write_text("x")
    fp = file_fingerprint(["data/obs-*.csv", str(outside), "data/none-*.csv"], tmp_path)
    assert list(fp) == sorted(["data/none-*.csv", "data/obs-1.csv", "data/obs-2.csv", str(outside)])
    assert fp["data/none-*.csv"] == NO_MATCH and fp["data/obs-1.csv"] != fp["data/obs-2.csv"]
    assert resolve_files(["data/obs-*.csv", "data/obs-1.csv"], tmp_path) == (data / "obs-1.csv", data / "obs-2.csv")
    # declared order, not sorted: ctx.files[0] is the first file declared
    assert resolve_files(["data/obs-2.csv", "data/obs-*.csv"], tmp_path) == (data / "obs-2.csv", data / "obs-1.csv")

    (data / "obs-1.csv").write_text("changed")
    (data / "none-1.csv").write_text("new")
    later = file_fingerprint(["data/obs-*.csv", str(outside), "data/none-*.csv"], tmp_path)
    assert describe_change(fp, later) == "data/obs-1.csv changed; data/none-1.csv added; data/none-*.csv removed"


def test_file_fingerprint_reads_every_chunk(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (3 << 20))
    before = file_fingerprint(["big.bin"], tmp_path)
    with open(big, "r+b") as f:
        f.seek((3 << 20) - 1)
        f.write(b"\1")
    assert file_fingerprint(["big.bin"], tmp_path) != before


def test_a_missing_file_or_a_directory_is_refused_naming_the_pattern(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match=r"declared file 'data/missing.csv' does not exist"):
        file_fingerprint(["data/missing.csv"], tmp_path)
    with pytest.raises(ValueError, match=r"declared file 'data' is a directory .* glob such as 'data/\*\*/\*'"):
        resolve_files(["data"], tmp_path)


LONG_PATTERN = '''
import re

PATTERN = re.compile("x" * 300 + "A")


def stage(ctx):
    return PATTERN.match(ctx)
'''


def test_a_compiled_pattern_counts_by_its_whole_pattern(tmp_path: Path) -> None:
    """``re.Pattern``'s repr is cut at 200 characters: a change after them was not seen."""
    fp = fingerprint(tmp_path / "a", LONG_PATTERN, "stage")
    changed = fingerprint(tmp_path / "b", edit(LONG_PATTERN, '"A"', '"B"'), "stage")
    assert describe_change(fp, changed) == "PATTERN changed"


COMPUTED = '''
import consts


def stage(ctx, which):
    return FORM
'''


@pytest.mark.parametrize("form, counts", [('getattr(consts, "K" + which)', True), ("vars(consts)[which]", True),
                                          ("consts.__dict__[which]", True), ('getattr(consts, "KA")', False),
                                          ('getattr(consts, "KA", None)', False), ("consts.KA", False)])
def test_a_name_built_at_run_time_counts_every_value_of_the_module(tmp_path: Path, form: str, counts: bool) -> None:
    """``consts.KB``'s value counts when the stage may read any name of ``consts``, not when it names KA only."""
    fp = fingerprint(tmp_path / "a", COMPUTED.replace("FORM", form), "stage", consts="KA = 1\nKB = 2\n")
    assert ("consts.KB" in fp) is counts, fp


TENSORS = '''
import random

import numpy as np
import pyarrow as pa
import torch

RNG = np.random.default_rng(0)
PY_RNG = random.Random(0)
torch.manual_seed(0)
WEIGHTS = torch.tensor([0.123456])
LAYER = torch.nn.Linear(2, 2)
LOOKUP = pa.table({"v": list(range(2000))})


def stage(ctx):
    return LAYER(WEIGHTS) + LOOKUP.num_rows + RNG.random() + PY_RNG.random()
'''


@pytest.mark.parametrize("old, new, changed", [("[0.123456]", "[0.123457]", "WEIGHTS changed"),
                                               ("manual_seed(0)", "manual_seed(1)", "LAYER changed; seed calls changed"),
                                               ("range(2000)", "range(1, 2001)", "LOOKUP changed"),
                                               ("default_rng(0)", "default_rng(1)", "RNG changed"),
                                               ("Random(0)", "Random(1)", "PY_RNG changed")])
def test_tensors_models_tables_and_generators_count_by_their_content(tmp_path: Path, old: str, new: str,
                                                                  changed: str) -> None:
    """A tensor's repr rounds to four decimals, a module's shows no weights, a large table's elides rows, a
    seeded generator's is an address."""
    pytest.importorskip("torch")
    fp = fingerprint(tmp_path / "a", TENSORS, "stage")
    assert not any(k.startswith("uncacheable ") for k in fp), fp
    assert describe_change(fp, fingerprint(tmp_path / "b", edit(TENSORS, old, new), "stage")) == changed



def test_each_imported_module_is_classified_once_not_by_every_stage_s_walk(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every walk looks at every module in ``sys.modules`` for values set on user modules; whether a module is
    user code (its file's real path) is worked out once per module, not again by each stage of the run."""
    where = tmp_path / "run"
    first = fingerprint(where, stage="other")  # the first stage: every imported module classified
    resolved: list[str] = []
    real = os.path.realpath

    def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        resolved.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", counted)
    before = set(sys.modules)
    sys.path.insert(0, str(where))
    try:  # the next stage of the same script
        spec = importlib.util.spec_from_file_location("__hetflow_script__", where / "pipeline.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        again = code_fingerprint(module.other)
        transform = code_fingerprint(module.transform)
    finally:
        sys.path.remove(str(where))
        for added in set(sys.modules) - before:
            if str(getattr(sys.modules[added], "__file__", "")).startswith(str(where)):
                del sys.modules[added]
    assert again == first and "module mylib" in transform, sorted(transform)
    imported = {getattr(m, "__file__", None) for m in list(sys.modules.values())} - {None}
    # what the walk reaches (numpy, as a value's type) is looked at as before; the other modules are not
    outside = [p for p in resolved if p in imported and not p.startswith(str(tmp_path)) and "site-packages" not in p]
    assert outside == [], outside[:5]


def test_local_installs_parse_the_metadata_of_local_installs_only(tmp_path: Path) -> None:
    """Every run scans the installed distributions for local installs (their files are the user's code):
    only those with a ``direct_url.json`` naming a directory have their METADATA read, not every one's.
    In a fresh interpreter: a test process's import caches depend on what ran in it before."""
    site = tmp_path / "site"
    indexed = site / "fromindex-1.0.dist-info"
    indexed.mkdir(parents=True)
    (indexed / "METADATA").write_text("Metadata-Version: 2.1\nName: fromindex\nVersion: 1.0\n")
    local = site / "localpkg-1.0.dist-info"
    local.mkdir()
    (local / "METADATA").write_text("Metadata-Version: 2.1\nName: localpkg\nVersion: 1.0\n")
    (local / "direct_url.json").write_text(json.dumps({"url": (tmp_path / "src").as_uri(), "dir_info": {}}))
    (local / "RECORD").write_text("localpkg/__init__.py,,\n")
    probe = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(site)!r})
        opened = []
        sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open"
                         and isinstance(args[0], str) and args[0].startswith({str(site)!r}) else None)
        from hetflow import fingerprint
        editable, installed = fingerprint._local_installs()
        print(json.dumps({{"editable": editable, "installed": installed, "opened": opened}}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert os.path.join(os.path.realpath(site / "localpkg"), "") in found["installed"]
    assert not any(str(site) in path for path in found["editable"])
    assert [p for p in found["opened"] if p.endswith("METADATA")] == [str(local / "METADATA")], found["opened"]
