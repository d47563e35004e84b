"""Text from runs, made safe to show on a terminal: :func:`visible`.

A run's stage names, errors, tracebacks, log lines and paths come from the
state store and the attempt directories, and with a shared PostgreSQL store
another user may have written them.  A terminal reads control characters as
commands (ESC starts sequences that set the window title, clear the screen,
write the clipboard or make OSC-8 links; ``\\r`` lets a line overwrite the
one hetflow printed before it), so every place that prints such text to a
terminal passes it through :func:`visible` first: ``status``, the summary at
the end of ``hetflow run``, the live and plain progress views, ``logs``,
``runs``, ``datasets`` and the one-line errors of the CLI.  Rich markup is a
different matter, handled where rich prints (``markup=False`` or
``rich.markup.escape``).
"""

from __future__ import annotations

import re

_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls (``\\x9b`` is a one-byte CSI on some terminals), the
Unicode line separators and the bidirectional overrides that make text read in another order."""


def _shown(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\r":
        return "\\r"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, newlines: bool = True) -> str:
    """``text`` with every control character written out (ESC as ``\\x1b``, CR as ``\\r``): nothing in it
    can move the cursor, recolour or retitle the terminal.  Tabs stay; newlines stay where the layout
    has room for several lines (``newlines=True``), else they show as ``\\n``."""
    shown = _HIDDEN.sub(_shown, text)
    return shown if newlines else shown.replace("\n", "\\n")
