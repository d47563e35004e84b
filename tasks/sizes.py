"""Sizes in bytes as people write them: ``512GiB``, ``16GB``, ``1.5GiB`` or a plain integer.

One parser for the pilot config (``memory_per_node``) and a stage's ``memory_per_rank``,
so both accept the same spellings.  Decimal units are powers of 10 (``GB``), binary ones
powers of 2 (``GiB``); the result is exact (no float rounding).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .errors import ConfigError

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(value: Any) -> int:
    """Bytes from an integer or a string such as ``'512GiB'``; :class:`ConfigError` names a bad one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kKmMgGtT]?i?[bB]?)\s*", str(value))
    if isinstance(value, bool) or not match or match.group(2).lower() not in UNITS:
        raise ConfigError(f"bad size {value!r} (expected bytes or a size such as '16GB' or '512GiB')")
    return int(Fraction(match.group(1)) * UNITS[match.group(2).lower()])
