"""``--param KEY=VALUE``: the rule that gives a command-line value its type.

A value takes the type of the default a stage declares for ``KEY`` in
``params=`` (``str``: the text as typed, so ``1.10`` stays ``"1.10"`` and ``no``
stays ``"no"``; ``int``, ``float``; ``bool``: ``true``/``false``, any case).  For a
key no stage declares, only what is unmistakably a number or a JSON literal is
converted — an integer (``42``, ``-3``; not ``007``), a decimal number (``0.5``,
``1e-3``), ``true``/``false``, ``null`` — and everything else stays text.  YAML's
wider rules (``no`` → False, ``2024-01-01`` → a date) are not used: a value is
never surprising to someone who did not study them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .declaration import StageSpec
from .errors import ConfigError

_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(0|[1-9][0-9]*)?(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}


def untyped(text: str) -> Any:
    """The value of ``text`` for a key no stage declares (see the module docstring)."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text) and any(c.isdigit() for c in text) and ("." in text or "e" in text.lower()):
        return float(text)
    return _LITERALS.get(text, text)


def typed(key: str, text: str, default: Any, stage: str) -> Any:
    """``text`` as the type of ``default`` (stage ``stage``'s declared value of ``key``)."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"--param {key}={text}: stage {stage!r} declares {key} as {expected} "
                           f"(default {default!r}); got {text!r}")

    if isinstance(default, bool):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise bad("a bool (true or false)")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
    if isinstance(default, str):
        return text
    return untyped(text)


def from_command_line(texts: Mapping[str, str], stages: Iterable[StageSpec]) -> dict[str, Any]:
    """The typed values of ``--param`` texts, by the stages' declared defaults."""
    declared: dict[str, tuple[Any, str]] = {}
    for spec in stages:
        for key, value in spec.params.items():
            declared.setdefault(key, (value, spec.name))
    return {key: typed(key, text, *declared[key]) if key in declared else untyped(text)
            for key, text in texts.items()}
