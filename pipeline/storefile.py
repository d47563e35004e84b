"""What reading the state store needs without SQLAlchemy: timestamps as text, the default store's file, who
holds a run, and a read-only reader of a SQLite store.

``hetflow status`` answers from a SQLite store through the standard library's ``sqlite3``
(:func:`sqlite_rows`), read only: importing SQLAlchemy and the store's models costs more than the whole answer,
whatever the run's size.  The statements are plain SQL that :mod:`hetflow.status` runs through either reader
(this one, or a :class:`~hetflow.store.Store` session for any other database), so there is one query per view.
Whatever is out of the ordinary (no such file, a prefix that matches no run or several, a run whose
orchestrator is gone and must be recorded so, a store an older hetflow wrote) is left to
:class:`~hetflow.store.Store`, which upgrades, records or says what is wrong.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil

Rows = Callable[[str, Mapping[str, Any]], list[tuple[Any, ...]]]
"""Runs one SQL statement (``:name`` parameters) and returns its rows as tuples."""


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds")


def default_url(workdir: Path) -> str:
    return f"sqlite:///{(workdir / 'hetflow.db').resolve()}"


# ------------------------------------------------------------------ run ownership
START_TOLERANCE = 1.5
"""Seconds two readings of one process's start time may differ: psutil derives it from the boot
time in ``/proc/stat``, which some kernels report a second apart between reads.  A reused pid
started that close to the dead owner's start would need the whole pid space to wrap meanwhile."""


@dataclass(frozen=True)
class Owner:
    """An orchestrator process: ``host:pid:start`` in ``runs.owner``.

    The start time (``psutil.Process().create_time()``) tells a live holder from a later
    process that got the same pid.  An id without it (``host:pid``, written before) still parses.
    """

    host: str
    pid: int
    start: float | None

    @classmethod
    def current(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), round(psutil.Process().create_time(), 2))

    @classmethod
    def parse(cls, owner: str) -> "Owner":
        head, _, last = owner.rpartition(":")
        host, _, pid = head.rpartition(":")
        if host and pid.isdigit():
            try:
                return cls(host, int(pid), float(last))
            except ValueError:
                pass
        if head and last.isdigit():
            return cls(head, int(last), None)
        raise ValueError(f"not an owner id {owner!r} (expected host:pid:start)")

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}" + ("" if self.start is None else f":{self.start:.2f}")

    @property
    def name(self) -> str:
        """``host:pid``, for messages."""
        return f"{self.host}:{self.pid}"

    def gone(self) -> str | None:
        """Why this process is known to be gone, or None (alive, or on another host: unknown)."""
        if self.host != socket.gethostname():
            return None
        try:
            proc = psutil.Process(self.pid)
            started, zombie = proc.create_time(), proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return f"its orchestrator ({self.name}) ended without recording an outcome"
        except psutil.AccessDenied:
            return None
        if zombie:
            return f"its orchestrator ({self.name}) ended without recording an outcome"
        if self.start is not None and abs(started - self.start) > START_TOLERANCE:
            return (f"its orchestrator ({self.name}, started {iso(self.start)}) ended without recording an "
                    f"outcome; pid {self.pid} now belongs to a process started {iso(started)}")
        return None


def owner_id() -> str:
    """This process's owner id, as :meth:`Store.claim_run` records it."""
    return str(Owner.current())


def owner_gone(owner: str | None, lease_until: float | None, *, now: float | None = None) -> str | None:
    """Why the recorded holder of a run no longer holds it, or None while it does.

    On this host the process decides (gone, a zombie, or its pid reused: gone; alive: holds it,
    whatever its lease says).  On another host only the lease can: expired means gone.  An id
    without a start time (older hetflow) counts as alive only while its pid exists and its lease runs.
    """
    if not owner:
        return "no orchestrator holds it"
    now = time.time() if now is None else now
    try:
        holder = Owner.parse(owner)
    except ValueError:
        holder = None
    if holder is not None and holder.host == socket.gethostname():
        why = holder.gone()
        if why is not None or holder.start is not None:
            return why
    if lease_until is None or lease_until < now:
        name = holder.name if holder else owner
        return (f"its orchestrator ({name}) stopped renewing its lease"
                + ("" if lease_until is None else f" (expired {iso(lease_until)})"))
    return None


# ------------------------------------------------------------------ reading SQLite directly
@contextmanager
def sqlite_rows(url: str) -> Iterator[Rows | None]:
    """A reader of the SQLite store ``url`` (``sqlite:///PATH``), opened read only, every statement in one
    snapshot of the store; ``None`` when ``url`` is not a SQLite file that exists.  A statement the file cannot
    answer raises :class:`sqlite3.Error` (a damaged file, a store without this hetflow's columns)."""
    if not url.startswith("sqlite:///") or not os.path.isfile(url[len("sqlite:///"):]):
        yield None
        return
    path = url[len("sqlite:///"):]
    connection = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=30, isolation_level=None)
    try:
        connection.execute("BEGIN")  # one snapshot: the orchestrator may write between two statements

        def rows(sql: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
            return connection.execute(sql, dict(params)).fetchall()

        yield rows
    finally:
        connection.close()


def running_gone(rows: Rows) -> bool:
    """Whether a RUNNING run's orchestrator is gone (:func:`owner_gone`): :meth:`~hetflow.store.Store.
    reconcile_dead_runs` records it FAILED before a view shows it."""
    now = time.time()
    return any(owner_gone(owner, lease_until, now=now) is not None for owner, lease_until in
               rows("SELECT owner, lease_until FROM runs WHERE state = 'RUNNING'", {}))


def unique_run(rows: Rows, run_id: str | None) -> str | None:
    """The id of run ``run_id`` (an id, a prefix that one run's id starts with; ``None``: the latest run), as
    :meth:`~hetflow.store.Store.resolve_run` finds it; ``None`` where that would name no run or several."""
    if run_id is None:
        found = rows("SELECT id FROM runs ORDER BY created DESC LIMIT 1", {})
    else:
        found = rows("SELECT id FROM runs WHERE id = :id", {"id": run_id})
        if not found:  # LIKE, escaped as Store.resolve_run's startswith(autoescape=True)
            pattern = run_id.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
            found = rows("SELECT id FROM runs WHERE id LIKE :pattern ESCAPE '/' LIMIT 2", {"pattern": pattern})
    return found[0][0] if len(found) == 1 else None
