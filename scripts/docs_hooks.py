"""mkdocs hooks: the command-line reference from hetflow's own parsers, and a source tree for the API pages.

``docs/cli.md`` holds the marker ``<!-- cli-reference -->``; it is replaced at
build time by the ``--help`` text of ``hetflow`` and of every sub-command
(``hetflow simulate`` has its own parser), so the page cannot drift from the code.

mkdocstrings reads the source statically, and hetflow's folders are mapped into
one import package (``pipeline/`` is ``hetflow``, ``operators/`` is
``hetflow.operators``, ...), which it cannot follow.  ``on_config`` lays the
folders out as that package under ``build/api-src`` (symbolic links), the path
``mkdocs.yml`` gives it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "<!-- cli-reference -->"
#: ``[tool.setuptools.package-dir]`` of pyproject.toml: the sub-packages that live in their own folders
SUBPACKAGES = {"tasks": "tasks", "operators": "operators", "ml": "ml", "pilot_configs": "pilot-configs"}
ROOT_PACKAGE = "pipeline"
API_SRC = Path("build") / "api-src"


def api_source_tree(root: Path) -> Path:
    """``<root>/build/api-src/hetflow``: the package as one tree of links into the folders."""
    tree = root / API_SRC / "hetflow"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for item in (root / ROOT_PACKAGE).iterdir():
        if item.suffix in (".py", ".pyi"):
            (tree / item.name).symlink_to(item.resolve())
    for name, folder in SUBPACKAGES.items():
        (tree / name).symlink_to((root / folder).resolve(), target_is_directory=True)
    return tree


def _first(fn: F) -> F:
    """Run this event before mkdocstrings' (which drops a search path that does not exist yet)."""
    try:
        from mkdocs.plugins import event_priority
    except ImportError:  # tests/test_docs.py imports this module for the CLI reference, without mkdocs
        return fn
    return event_priority(100)(fn)


@_first
def on_config(config: Any, **kwargs: Any) -> Any:
    api_source_tree(Path(config["config_file_path"]).resolve().parent)
    return config


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public walk of sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[str, str]]:
    out = [(" ".join(words), parser.format_help())]
    for name, child in _subcommands(parser).items():
        if name == "simulate":  # a stub in hetflow's parser: the real one lives in hetflow.tasks.simulator
            out.append((" ".join([*words, name]), _simulate_help()))
        else:
            out += _walk(child, [*words, name])
    return out


def _simulate_help() -> str:
    from hetflow.tasks.simulator import cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli_main(["--help"])
    return buf.getvalue()


def cli_reference() -> str:
    from hetflow.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width gives the same page everywhere
    sections = []
    for command, text in _walk(build_parser(), ["hetflow"]):
        level = "##" if command.count(" ") <= 1 else "###"
        sections.append(f"{level} `{command}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
