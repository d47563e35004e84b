"""``--param KEY=VALUE``: the rule that gives a command-line value its type.

``KEY`` must be declared by a stage (``params=``): a key no stage declares would
be read by nothing, and the run would quietly give the results of the defaults, so it
is refused before anything runs, naming the declared keys.  The value takes the type
of the declared default (``str``: the text as typed, so ``1.10`` stays ``"1.10"`` and
``no`` stays ``"no"``; ``int``, ``float``; ``bool``: ``true``/``false``, any case).
For a default of another type (``None``, a list), only what is unmistakably a number
or a JSON literal is converted — an integer (``42``, ``-3``; not ``007``), a decimal
number (``0.5``, ``1e-3``), ``true``/``false``, ``null`` — and everything else stays
text.  YAML's wider rules (``no`` → False, ``2024-01-01`` → a date) are not used: a
value is never surprising to someone who did not study them.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from .declaration import StageSpec
from .errors import ConfigError

_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(0|[1-9][0-9]*)?(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}


def untyped(text: str) -> Any:
    """The value of ``text`` for a key declared with a default that is no str, int, float or bool."""
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
            number = float(text)
        except ValueError:
            raise bad("a number") from None
        if signed_nan(number):
            raise ConfigError(f"--param {key}={text} (stage {stage!r}): {NAN_KEPT}")
        return number
    if isinstance(default, str):
        return text
    return untyped(text)


NAN_KEPT = "the run records every NaN as nan, so the cache could not tell -nan from nan: give nan"


def signed_nan(value: Any) -> bool:
    """A float NaN that is not ``nan`` itself (``-nan``, another payload): a run's parameters are recorded as
    JSON, which writes every NaN as ``NaN``, so a later run with ``nan`` would be served its result."""
    return isinstance(value, float) and math.isnan(value) and struct.pack("<d", value) != struct.pack("<d", math.nan)


def _one_slip(typed_key: str, declared: str) -> bool:
    """``typed_key`` is ``declared`` with one letter wrong, missing, extra, or two swapped (both at least five
    letters long: shorter keys are too often one letter apart on purpose, ``rate`` and ``date``)."""
    a, b = typed_key, declared
    if min(len(a), len(b)) < 5 or abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def declared_params(stages: Iterable[StageSpec]) -> dict[str, tuple[Any, str]]:
    """``{key: (default, stage)}`` for every parameter a stage declares (the first stage that declares it)."""
    declared: dict[str, tuple[Any, str]] = {}
    for spec in stages:
        for key, value in spec.params.items():
            declared.setdefault(key, (value, spec.name))
    return declared


def undeclared(given: str, key: str, declared: Mapping[str, object]) -> str:
    """Why ``key`` (given as ``given``) is refused: no stage declares it; names the declared keys."""
    known = f"declared: {', '.join(sorted(declared))}" if declared else "no stage declares any params"
    return (f"{given}: no stage declares {key!r} ({known}); a parameter no stage declares is read by none, so "
            f"declare it in the params= of the stages that read it")


def from_command_line(texts: Mapping[str, str], stages: Iterable[StageSpec]) -> dict[str, Any]:
    """The typed values of ``--param`` texts, by the stages' declared defaults.

    A key no stage declares is refused (:func:`undeclared`); one slip away from a declared key
    (``facter`` for ``factor``, :func:`_one_slip`), the message names that key as the likely meant one.
    """
    declared = declared_params(stages)
    for key, text in texts.items():
        if key in declared:
            continue
        near = [d for d in declared if _one_slip(key, d)]
        if near:
            raise ConfigError(f"--param {key}={text}: no stage declares {key!r}; did you mean {near[0]!r} "
                              f"(declared by stage {declared[near[0]][1]!r})? To pass {key!r} as well, "
                              f"declare it in a stage's params=")
        raise ConfigError(undeclared(f"--param {key}={text}", key, declared))
    return {key: typed(key, text, *declared[key]) for key, text in texts.items()}
