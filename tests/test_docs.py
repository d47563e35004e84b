"""The documentation runs: every code block of README.md and docs/*.md that is meant to run does.

Conventions in the Markdown (an HTML comment on the line(s) just before a fence):

- a ```python block runs, unless it is marked ``<!-- not-run -->`` (fragments,
  install lines, things that need a cluster);
- ``<!-- file: NAME -->`` writes the block to ``NAME`` before running it, so later
  blocks of the page (``hetflow run NAME``) can use it;
- a ```bash block runs only when marked ``<!-- run -->`` (others submit jobs or
  need root).

The blocks of one page run in order, in one fresh directory outside the source
tree, with the installed ``python`` and ``hetflow`` (real runs on the local
pilot); each must exit 0, and every run they leave in ``./.hetflow`` must have
ended DONE (a script that ignores a failed run would still exit 0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")
#: pages whose blocks run pipelines: they must leave runs behind, all DONE
PIPELINE_PAGES = {"README.md", "quickstart.md", "ml.md", "sql.md", "object-storage.md"}
#: pages whose blocks talk to an S3-compatible server: they get the AWS environment of the tests' moto server
S3_PAGES = {"object-storage.md"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    markers: tuple[str, ...]

    @property
    def file(self) -> str | None:
        for m in self.markers:
            if m.startswith("file:"):
                return m.split(":", 1)[1].strip()
        return None

    @property
    def runs(self) -> bool:
        if "not-run" in self.markers:
            return False
        if self.lang == "python":
            return True
        return self.lang in ("bash", "sh") and "run" in self.markers


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file with the HTML-comment markers just above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        markers: list[str] = []
        j = i - 1
        while j >= 0 and MARKER.match(lines[j].strip()):
            markers.append(MARKER.match(lines[j].strip()).group(1))  # type: ignore[union-attr]
            j -= 1
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: a ``` fence that is never closed")
        out.append(Block(path.name, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", tuple(markers)))
        i = end + 1
    return out


def _runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.runs]


def test_the_marker_parser_sees_the_runnable_blocks() -> None:
    """The pages that must have running examples have them (a broken parser would run nothing)."""
    counts = {p.name: len(_runnable(p)) for p in PAGES}
    for page in ("README.md", "quickstart.md", "operators.md", "ml.md"):
        assert counts.get(page, 0) >= 1, f"{page} has no block that runs: {counts}"
    quick = _runnable(ROOT / "docs" / "quickstart.md")
    assert [b.lang for b in quick] == ["python", "python", "bash"], quick
    assert quick[1].file == "quickstart.py"
    assert any("not-run" in b.markers for b in blocks(ROOT / "docs" / "hpc.md"))
    # install commands run in tests/test_install.py (a fresh copy, a new venv), not in a page's directory
    installs = {p.name: [b for b in blocks(p) if "install" in b.markers] for p in PAGES}
    assert len(installs["README.md"]) == 2 and len(installs["quickstart.md"]) == 1, installs
    assert not any(b.runs for found in installs.values() for b in found)


def test_no_page_installs_hetflow_from_an_index_it_is_not_on() -> None:
    """``pip install 'hetflow[mpich]'`` was the README's first command and fails on a fresh machine."""
    wrong = re.compile(r"pip install\s+['\"]?hetflow\b")
    found = [f"{p.name}:{n}" for p in PAGES for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if wrong.search(line)]
    assert not found, found


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETFLOW_") and k not in ("PYTHONPATH",)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if os.environ.get("HETFLOW_MPIEXEC"):
        env["HETFLOW_MPIEXEC"] = os.environ["HETFLOW_MPIEXEC"]
    env["PYTHONFAULTHANDLER"] = "1"  # a block that dies on a signal prints every thread's Python stack
    return env


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: p.name)
def test_the_code_blocks_of_a_page_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    assert ROOT not in tmp_path.resolve().parents, "blocks must run outside the source tree"
    env = _env()
    if page.name in S3_PAGES:  # the page's own setup, as its reader would export it
        env.update(request.getfixturevalue("s3_server").env)
    for n, block in enumerate(_runnable(page)):
        where = f"{block.page}:{block.line}"
        if block.lang == "python":
            name = block.file or f"block-{n}.py"
            (tmp_path / name).write_text(block.code, encoding="utf-8")
            argv = [sys.executable, name]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", block.code]
        proc = subprocess.run(argv, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, (f"{where}: the block exited {proc.returncode}\n--- code\n{block.code}"
                                      f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    runs = _run_states(tmp_path / ".hetflow")
    if page.name in PIPELINE_PAGES:
        assert runs, f"{page.name}: its blocks ran no pipeline"
    assert all(state == "DONE" for state in runs.values()), f"{page.name}: runs that did not end DONE: {runs}"


def _run_states(workdir: Path) -> dict[str, str]:
    if not workdir.is_dir():
        return {}
    from hetflow.store import Store

    store = Store.for_workdir(workdir)
    try:
        return {run.id: run.state for run in store.runs()}
    finally:
        store.close()


# ---------------------------------------------------------------- the API reference's sources

PACKAGES = ["hetflow", "hetflow.operators", "hetflow.ml"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_listed_and_documented(package: str) -> None:
    """``dir()`` (tab completion) lists every name of ``__all__``, before anything is imported lazily,
    and every public name, and every public method of a public class, has a docstring."""
    code = (f"import importlib, json; m = importlib.import_module({package!r}); "
            "print(json.dumps([sorted(m.__all__), dir(m)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    import json

    names, listed = json.loads(out.stdout)
    assert names, f"{package} has an empty __all__"
    assert not set(names) - set(listed), f"{package}: dir() lacks {sorted(set(names) - set(listed))}"

    import importlib
    import inspect

    module = importlib.import_module(package)
    missing = []
    for name in names:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            assert obj.__doc__, f"{package}.{name}"
            continue
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        if not obj.__doc__:
            missing.append(name)
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                fn = value.fget if isinstance(value, property) else value
                if not attr.startswith("_") and callable(fn) and not getattr(fn, "__doc__", None):
                    missing.append(f"{name}.{attr}")
    assert not missing, f"{package}: no docstring on {missing}"


def test_the_cli_reference_covers_every_command() -> None:
    """docs/cli.md is generated from the real parser at build time: every sub-command is on it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from hetflow.cli import build_parser

    text = docs_hooks.cli_reference()
    commands = docs_hooks._subcommands(build_parser())
    assert commands
    for name in commands:
        assert f"## `hetflow {name}`" in text, name
    assert "--span-fraction" in text  # hetflow simulate's own parser
    assert docs_hooks.MARKER in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
