"""mkdocs hook: the command-line reference, generated from hetflow's own parsers at build time.

``docs/cli.md`` holds the marker ``<!-- cli-reference -->``; it is replaced by the
``--help`` text of ``hetflow`` and of every sub-command (``hetflow simulate`` has
its own parser), so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from typing import Any

MARKER = "<!-- cli-reference -->"


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
