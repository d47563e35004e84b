"""A run shown in a notebook (``_repr_html_``) or as text (``__repr__``): one row per stage.

Each row: the stage, its state, the cache decision (ran, or reused from which
run) with its reason (or the first line of its error), its duration and its
attempts.  Every text that comes from the run (stage names, errors, reasons,
paths) is HTML-escaped: a stage named ``<script>`` shows as those characters.

``hetflow serve`` leaves a note in the work directory while it serves
(:data:`SERVE_NOTE`: its address, token, process and store); a run of that store shows
the server's address (with its token) as a link, when the note is this user's, the process is
alive and it serves that run (or the latest run).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .states import SUCCESS, State

if TYPE_CHECKING:
    from .status import RunStatus, StageStatus

SERVE_NOTE = "serve.json"
"""``hetflow serve``'s note in the work directory it serves (0600), removed when it stops."""

_COLOURS = {"DONE": "#2e7d32", "CACHED": "#1565c0", "RUNNING": "#ef6c00", "FAILED": "#c62828",
            "TIMED_OUT": "#c62828", "CANCELLED": "#6d4c41", "INTERRUPTED": "#6d4c41", "SKIPPED": "#757575"}
_HOST = re.compile(r"^[A-Za-z0-9.\-]+$|^[0-9A-Fa-f:]+$")
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{16,128}$")


def store_digest(url: str) -> str:
    """What the note says of the store it serves: a digest of its URL (which can hold a password), a
    SQLite file's path made absolute (``hetflow serve --workdir w`` and a run's ``workdir="w"`` name one)."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///file:"):
        url = "sqlite:///" + os.path.abspath(url[len("sqlite:///"):])
    return hashlib.sha256(url.encode()).hexdigest()[:32]


def write_serve_note(workdir: Path, host: str, port: int, store_url: str, run_id: str | None, token: str) -> Path:
    """The note (0600, this user's): the server's address and ``token``, the one place besides its own
    output where the token is written, so that a run shown in a notebook links to the page with it."""
    from hetflow.tasks.paths import write_private_file

    note = {"pid": os.getpid(), "host": host, "port": port, "store": store_digest(store_url), "run": run_id,
            "token": token}
    path = Path(workdir) / SERVE_NOTE
    write_private_file(path, json.dumps(note).encode(), base=workdir)
    return path


def remove_serve_note(workdir: Path) -> None:
    """Remove the note if it is this process's (a second server may have written its own since)."""
    path = Path(workdir) / SERVE_NOTE
    note = _read_note(path)
    if note is not None and note.get("pid") == os.getpid():
        try:
            path.unlink()
        except OSError:
            pass


def _read_note(path: Path) -> dict[str, Any] | None:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return None
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def serve_link(workdir: Path, store_url: str, run_id: str) -> str | None:
    """The address of a live ``hetflow serve`` that shows run ``run_id`` of the store ``store_url``, with its
    token (the page answers no request without it)."""
    note = _read_note(Path(workdir) / SERVE_NOTE)
    if note is None or note.get("store") != store_digest(store_url) or note.get("run") not in (None, run_id):
        return None
    pid, host, port, token = note.get("pid"), note.get("host"), note.get("port"), note.get("token")
    if not (isinstance(pid, int) and isinstance(host, str) and isinstance(port, int) and 0 < port < 65536
            and _HOST.match(host) and isinstance(token, str) and _TOKEN.match(token)):
        return None
    try:
        os.kill(pid, 0)
    except OSError:  # gone (or another user's process under a reused pid)
        return None
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/?token={token}"


def _duration(stage: "StageStatus", now: float) -> str:
    from .progress import elapsed_text

    if stage.started is None:
        return ""
    return elapsed_text((stage.ended or now) - stage.started)


def _decision(stage: "StageStatus") -> str:
    if stage.cache_hit is True:
        return f"reused from {stage.cached_from}" if stage.cached_from else "reused"
    if stage.cache_hit is False:
        return "ran" if stage.ended else "runs"
    return ""


def _reason(stage: "StageStatus") -> str:
    if stage.error and stage.state not in SUCCESS:
        return stage.error.strip().splitlines()[0] if stage.error.strip() else ""
    return stage.cache_reason or ""


def _items(stage: "StageStatus") -> str:
    if not stage.items:
        return ""
    return " (" + ", ".join(f"{count} {state}" for state, count in sorted(stage.items.items())) + ")"


def run_text(status: "RunStatus", *, handle: bool = False) -> str:
    """The run as plain lines: a header, then one line per stage; every text from the run made visible
    (:func:`~hetflow.terminal.visible`: a stage's error cannot retitle or clear the terminal it is printed on)."""
    status = status.for_terminal()
    now = time.time()
    kind = "RunHandle" if handle else "RunStatus"
    lines = [f"{kind}({status.id!r}, pipeline={status.pipeline!r}, state={status.state})"]
    for stage in status.stages:
        parts = [f"  {stage.name:<16} {stage.state + _items(stage):<12} {_duration(stage, now):>8}"]
        decision, reason = _decision(stage), _reason(stage)
        if decision or reason:
            parts.append(" ".join(p for p in (decision, f"({reason})" if reason else "") if p))
        lines.append("  ".join(parts).rstrip())
    if status.error and status.state != State.RUNNING:
        lines.append(f"  {status.error.strip().splitlines()[0]}")
    return "\n".join(lines)


def run_html(status: "RunStatus", *, link: str | None = None) -> str:
    """The run as an HTML table (what a notebook shows for it); every text from the run escaped."""
    now = time.time()
    e = html.escape
    began = status.started or status.created
    took = (status.ended or now) - began if began else None
    from .progress import elapsed_text

    head = (f"<b>run {e(status.id)}</b> (pipeline {e(status.pipeline)}): "
            f"<span style=\"color:{_COLOURS.get(status.state, 'inherit')}\">{e(status.state)}</span>"
            + (f" in {e(elapsed_text(took))}" if took is not None else ""))
    if link:
        head += f' &middot; <a href="{e(link, quote=True)}" target="_blank">{e(link)}</a>'
    rows = []
    for stage in status.stages:
        colour = _COLOURS.get(stage.state, "inherit")
        rows.append("<tr>" + "".join(f"<td style=\"text-align:left\">{cell}</td>" for cell in (
            e(stage.name),
            f"<span style=\"color:{colour}\">{e(stage.state)}</span>{e(_items(stage))}",
            e(_decision(stage)),
            e(_reason(stage)),
            e(_duration(stage, now)),
            str(stage.attempts))) + "</tr>")
    error = ""
    if status.error and status.state not in (State.RUNNING, State.DONE):
        error = f"<div>{e(status.error.strip().splitlines()[0])}</div>"
    header = "".join(f"<th style=\"text-align:left\">{name}</th>"
                     for name in ("stage", "state", "cache", "reason", "duration", "attempts"))
    return (f"<div class=\"hetflow-run\"><div>{head}</div>{error}<table><thead><tr>{header}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")
