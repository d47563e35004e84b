"""The state store: runs, stages, tasks, attempts, datasets, partitions, events.

SQLAlchemy 2 models on SQLite (WAL on a local disk, a rollback journal on a shared one: see
:mod:`hetflow.filesystem`; in the work directory) by default or any
SQLAlchemy URL.  The orchestrator is the single writer; ``status``, resume,
reports and provenance read it.  Every state change is also an :class:`Event`
with a timestamp.

Stage states: ``PENDING`` → ``QUEUED`` → ``RUNNING`` → ``DONE`` | ``FAILED`` |
``TIMED_OUT`` | ``SKIPPED`` (a dependency failed) | ``CACHED`` (an identical
committed output was reused) | ``CANCELLED`` | ``WALLTIME`` (cut off by the
pilot's walltime; resumable).  A run ends ``DONE``, ``FAILED`` or ``STOPPED``
(the walltime stopped it before the end; resume it in the next allocation) or
``INTERRUPTED`` (Ctrl-C; resume it) or ``CANCELLED`` (``hetflow cancel``; resume it).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from sqlalchemy import (JSON, Boolean, ColumnElement, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint,
                        create_engine, event, func, insert, inspect, select, text, update)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from .errors import MissingExtraError, RunLocked, StoreUnreadable, UnknownRun
from .filesystem import JournalMode, journal_mode_for
from .states import State
# who holds a run, timestamps as text, the default store: in storefile, which ``status`` reads without SQLAlchemy
from .storefile import START_TOLERANCE, Owner, default_url, iso, owner_gone, owner_id  # noqa: F401

log = logging.getLogger(__name__)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class RunRecord(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pipeline: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16), default=State.PENDING)
    created: Mapped[float] = mapped_column(Float)
    started: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    run_dir: Mapped[str] = mapped_column(Text)
    script: Mapped[str | None] = mapped_column(Text, nullable=True)
    pilot: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    hetflow_version: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str | None] = mapped_column(String(256), nullable=True)
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Why the run ended FAILED or INTERRUPTED when no stage says (no launcher, a full disk, Ctrl-C)."""
    cancel_requested: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Who asked ``hetflow cancel`` to stop the run (``host:pid at time``); its orchestrator polls it."""
    rerun: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    """The stages ``--rerun`` forced in this run, with everything downstream of them: every resume re-runs
    those that have not run in this run yet (``None``: none forced)."""
    argv: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    """The script's command-line arguments when the run started (``sys.argv[1:]``): ``hetflow resume``
    gives the script the same ones (``None``: none recorded, an older run)."""
    stages: Mapped[list["StageRecord"]] = relationship(back_populates="run", order_by="StageRecord.order")


class StageRecord(Base):
    __tablename__ = "stages"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    order: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=State.PENDING)
    function: Mapped[str] = mapped_column(Text)
    cache_key: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    inputs: Mapped[list[Any]] = mapped_column(JSON, default=list)
    outputs: Mapped[list[Any]] = mapped_column(JSON, default=list)
    request: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    timeout: Mapped[float | None] = mapped_column(Float, nullable=True)
    started: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    cached_from: Mapped[str | None] = mapped_column(String(128), nullable=True)
    cache_material: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """What ``cache_key`` was made of (:class:`hetflow.cache.KeyMaterial`), to name what changed."""
    cache_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Why the stage ran or was reused in this run."""
    cache_hit: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    """Whether this run reused a committed output (``None``: not decided yet)."""
    params_read: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    """The parameters the committed execution read (``None``: all of them, or not known)."""
    item_counts: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    """A map stage's ``map_items`` rows of this run by state, kept by the orchestrator with the rows (so
    ``status`` counts a map of any size without reading its items); ``None``: a plain stage, or a store
    written before this column (counted from the rows)."""
    run: Mapped[RunRecord] = relationship(back_populates="stages")
    tasks: Mapped[list["TaskRecord"]] = relationship(back_populates="stage", order_by="TaskRecord.submitted")


class TaskRecord(Base):
    """One placement of a stage on the pilot (a stage has one task per attempt)."""

    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), default=State.QUEUED)
    priority: Mapped[float] = mapped_column(Float, default=0.0)
    submitted: Mapped[float] = mapped_column(Float)
    slots: Mapped[list[Any]] = mapped_column(JSON, default=list)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    stage: Mapped[StageRecord] = relationship(back_populates="tasks")
    attempt: Mapped["AttemptRecord | None"] = relationship(back_populates="task", uselist=False)


class AttemptRecord(Base):
    __tablename__ = "attempts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"), unique=True)
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=State.RUNNING)
    started: Mapped[float] = mapped_column(Float)
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    returncode: Mapped[int | None] = mapped_column(Integer, nullable=True)
    signal: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempt_dir: Mapped[str] = mapped_column(Text)
    task: Mapped[TaskRecord] = relationship(back_populates="attempt")


class DatasetRecord(Base):
    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    path: Mapped[str] = mapped_column(Text)
    producer_stage: Mapped[str] = mapped_column(String(256))
    producer_attempt: Mapped[int] = mapped_column(Integer)
    num_rows: Mapped[int] = mapped_column(Integer)
    num_bytes: Mapped[int] = mapped_column(Integer)
    schema: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(128))
    committed: Mapped[float] = mapped_column(Float)
    partitions: Mapped[list["PartitionRecord"]] = relationship(back_populates="dataset", order_by="PartitionRecord.index",
                                                               cascade="all, delete-orphan")


class PartitionRecord(Base):
    __tablename__ = "partitions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    file: Mapped[str] = mapped_column(Text)
    rows: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(Integer)
    checksum: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int] = mapped_column(Integer)
    dataset: Mapped[DatasetRecord] = relationship(back_populates="partitions")


class MapItemRecord(Base):
    """One item of a map stage in one run (:mod:`hetflow.mapping`): its key, its outcome, its output partitions.

    An item whose key matches a ``DONE`` or ``CACHED`` record with intact partition files is reused.
    ``outputs`` maps each output to the item's partitions (``PartitionInfo`` JSON; ``file`` relative to
    ``directory``/<output name>); ``label`` names the item for people (a file, a row, a grid point)."""

    __tablename__ = "map_items"
    __table_args__ = (Index("ix_map_items_run_stage_index", "run_id", "stage", "index"),)
    """``status RUN STAGE --items`` reads a page of a map's items in order without reading the rest."""
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    stage: Mapped[str] = mapped_column(String(256))
    index: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(String(128), index=True)
    label: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default=State.PENDING)
    tries: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    directory: Mapped[str] = mapped_column(Text)
    outputs: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    cached_from: Mapped[str | None] = mapped_column(String(128), nullable=True)
    started: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    log: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    """``[log file, start, end]``: the bytes of its rank-0 log the item's output is (``hetflow logs --item``)."""


class EventRecord(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


@dataclass(frozen=True)
class Claim:
    """What :meth:`Store.claim_run` took: the run as now recorded, and from whom."""

    run: RunRecord
    created: bool
    previous_owner: str | None
    previous_state: str | None
    previous_reason: str | None
    """Why the previous holder no longer held it (None for a new run or a re-claim by the same owner)."""


@dataclass(frozen=True)
class DeadRun:
    """A RUNNING run whose orchestrator was gone, as :meth:`Store.reconcile_dead_runs` recorded it."""

    run_id: str
    owner: str | None
    reason: str


def _is(column: Any, value: Any) -> ColumnElement[bool]:
    condition: ColumnElement[bool] = column.is_(None) if value is None else column == value
    return condition


def _locked_message(run_id: str, owner: str, lease_until: float | None) -> str:
    try:
        holder = Owner.parse(owner)
    except ValueError:
        holder = None
    if holder is None:
        return (f"run {run_id} is held by orchestrator {owner} (lease until {iso(lease_until)}); "
                "wait for it to finish, or stop it, and resume again")
    since = f", running since {iso(holder.start)}" if holder.start is not None else ""
    if holder.host == socket.gethostname():
        todo = f"wait for it to finish, or stop it (kill {holder.pid}) and resume again"
    else:
        todo = (f"wait for it to finish, or stop it on {holder.host} (kill {holder.pid}); it counts as gone "
                f"once its lease expires ({iso(lease_until)})")
    return f"run {run_id} is held by orchestrator {holder.name}{since}; {todo}"


def _sqlite_pragmas(mode: JournalMode) -> Callable[[Any, Any], None]:
    """The connect hook for a SQLite store in ``mode`` (see :mod:`hetflow.filesystem`)."""
    def apply(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")  # first: switching the journal waits for other openers too
        cursor.execute(f"PRAGMA journal_mode={mode}")
        # WAL is durable enough with NORMAL; a rollback journal needs FULL to survive a crash
        cursor.execute(f"PRAGMA synchronous={'NORMAL' if mode == 'WAL' else 'FULL'}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return apply


def _add_new_columns(connection: Any) -> None:
    """Add the columns a newer hetflow declares to tables an older one created (nullable, so no backfill),
    and the indexes it declares on them (``create_all`` makes indexes only with their tables)."""
    from sqlalchemy import inspect

    inspector = inspect(connection)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have and column.nullable:
                kind = column.type.compile(dialect=connection.dialect)
                connection.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))
        indexes = {index["name"] for index in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(connection)


SCHEMA_LOCK_KEY = 0x6865_7466_6C6F_77  # "hetflow": the PostgreSQL advisory lock around schema creation
DATASETS_LOCK_KEY = SCHEMA_LOCK_KEY + 1  # the PostgreSQL advisory lock of Store.datasets_lock


def unreadable(url: str, exc: SQLAlchemyError) -> str:
    """One line for a store that cannot be read: its URL and the database's own words."""
    cause = str(getattr(exc, "orig", None) or exc).splitlines()[0]
    hint = " (a damaged or foreign file? move it aside to start a new store)" if url.startswith("sqlite") else ""
    return f"cannot read the state store {url}: {cause}{hint}"


def _listing(ids: list[str], *, total: int | None = None, most: int = 5) -> str:
    """``a, b, c`` (newest first), cut to ``most`` with how many more there are."""
    total = len(ids) if total is None else total
    shown = ", ".join(ids[:most])
    return shown + (f" and {total - most} more" if total > most else "")


def _older_schema(engine: Engine) -> bool:
    """Whether the store lacks a table or column this hetflow declares (an older hetflow wrote it)."""
    from sqlalchemy import inspect

    with engine.connect() as connection:
        inspector = inspect(connection)
        tables = set(inspector.get_table_names())
        return any(table.name not in tables
                   or {column.name for column in table.columns} - {c["name"] for c in inspector.get_columns(table.name)}
                   for table in Base.metadata.sorted_tables)


def _upgraded_copy(path: Path) -> Engine:
    """A read-only SQLite store an older hetflow wrote, copied into memory and given this hetflow's tables and
    columns: the file cannot be changed (an archived or a colleague's work directory) and the records name
    columns the old file lacks.  The copy is private to this process and dropped with it."""
    from sqlalchemy.pool import StaticPool

    memory = sqlite3.connect(":memory:", check_same_thread=False)
    source = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        source.backup(memory)
    finally:
        source.close()
    engine = create_engine("sqlite://", creator=lambda: memory, poolclass=StaticPool, future=True)
    with engine.begin() as connection:
        Base.metadata.create_all(connection)
        _add_new_columns(connection)
    return engine


def _writable(directory: Path) -> bool:
    try:
        return os.access(directory, os.W_OK) and not os.statvfs(directory).f_flag & os.ST_RDONLY
    except OSError:
        return False


PINNED = "hetflow.pinned"
"""``Session.info`` key: the records a :meth:`Store.batch` session has loaded, held for the batch's life."""


def _pin_in_batch(session: Session, instance: Any) -> None:
    """Hold every record a batch loads until the batch ends: a session keeps only weak references to the
    records it loaded, so one that nothing else holds is dropped after a flush, and the next ``get`` of it
    in the same batch (a stage's record, read again by each step of its task) would query it again."""
    pinned = session.info.get(PINNED)
    if pinned is not None:
        pinned.append(instance)


EVENTS = "hetflow.events"
"""``Session.info`` key: the events a :meth:`Store.batch` has recorded and not written yet."""


INSERT_BATCH = 5_000
"""Rows :func:`insert_rows` hands the database in one statement."""


def insert_rows(session: Session, model: type[Base], rows: Iterable[dict[str, Any]]) -> None:
    """Insert ``rows`` (column values) in ``session``'s transaction, :data:`INSERT_BATCH` at a time: a map of
    100,000 items writes as many item rows and partition rows at its end, never all held as dicts at once."""
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == INSERT_BATCH:
            session.execute(insert(model), batch)
            batch = []
    if batch:
        session.execute(insert(model), batch)


def _write_events(session: Session) -> None:
    """Write the events a batch has recorded, in one INSERT of many rows (not one ORM object each)."""
    pending = session.info.get(EVENTS)
    if pending:
        session.execute(insert(EventRecord), list(pending))
        pending.clear()


class Store:
    """A handle on the state store; :meth:`session` is a unit of work."""

    def __init__(self, url: str) -> None:
        self.url = url
        path: Path | None = None
        self.read_only = False
        """The store's directory cannot be written (an archived or a colleague's work directory):
        it is opened read-only, for ``runs``, ``status``, ``datasets`` and reports."""
        engine_url = url
        if url.startswith("sqlite:///"):
            path = Path(url[len("sqlite:///"):])
            if path.is_file() and not _writable(path.parent):
                self.read_only = True
                engine_url = f"sqlite:///file:{path}?mode=ro&immutable=1&uri=true"
            else:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if not path.exists():
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                    os.close(fd)
        try:
            self.engine: Engine = create_engine(engine_url, future=True)
        except ImportError as exc:  # the database driver (psycopg for PostgreSQL) is an extra
            extra = ": pip install 'hetflow[postgres]'" if url.startswith("postgresql") else ""
            raise MissingExtraError(f"the state store {url} needs a database driver that is not installed "
                                    f"({exc}){extra}") from None
        except ArgumentError as exc:
            raise StoreUnreadable(f"bad state store URL {url!r}: {exc}") from None
        self.journal_mode: JournalMode | None = None
        """SQLite only: WAL on a local file system, DELETE on a shared one (:mod:`hetflow.filesystem`)."""
        if self.engine.dialect.name == "sqlite" and not self.read_only:
            self.journal_mode, fstype = journal_mode_for(str(path)) if path is not None else ("WAL", None)
            if self.journal_mode != "WAL":
                log.warning("state store %s is on %s, a shared file system: SQLite runs without WAL there "
                            "(slower, one writer at a time); for runs across hosts use --db "
                            "postgresql+psycopg://USER@HOST/DB", path, fstype)
            event.listen(self.engine, "connect", _sqlite_pragmas(self.journal_mode))
        if not self.read_only:
            try:
                self._create_schema(path)
            except SQLAlchemyError as exc:  # a damaged file, a server that does not answer: one line
                raise StoreUnreadable(unreadable(url, exc)) from None
        elif path is not None:
            try:
                if _older_schema(self.engine):
                    self.engine.dispose()
                    self.engine = _upgraded_copy(path)
            except (SQLAlchemyError, sqlite3.Error) as exc:
                raise StoreUnreadable(unreadable(url, exc)) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        event.listen(self._sessions, "loaded_as_persistent", _pin_in_batch)
        self._batch = threading.local()
        self._path = path

    def _create_schema(self, path: Path | None) -> None:
        """Create missing tables, one process at a time: ``create_all`` checks, then creates, so two
        processes opening a fresh store at once would both create (``table runs already exists``).
        SQLite: an ``flock`` on ``hetflow.db.lock`` beside the file; PostgreSQL: an advisory lock
        held for the transaction."""
        if path is not None:
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                with self.engine.begin() as conn:
                    # a new file (every first run in a work directory): every table is made as this hetflow
                    # declares it, without asking first for each whether it exists, or reading its columns back
                    new = conn.exec_driver_sql("SELECT 1 FROM sqlite_master WHERE type = 'table' LIMIT 1").first() \
                        is None
                    Base.metadata.create_all(conn, checkfirst=not new)
                    if not new:
                        _add_new_columns(conn)
            finally:
                os.close(fd)  # releases the lock
        elif self.engine.dialect.name == "postgresql":
            with self.engine.begin() as conn:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
                Base.metadata.create_all(conn)
                _add_new_columns(conn)
        else:
            with self.engine.begin() as conn:
                Base.metadata.create_all(conn)
                _add_new_columns(conn)

    @classmethod
    def for_workdir(cls, workdir: Path, url: str | None = None) -> "Store":
        return cls(url or os.environ.get("HETFLOW_DB") or default_url(workdir))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work, committed at its end; inside :meth:`batch`, part of the batch's transaction."""
        batch = getattr(self._batch, "session", None)
        if batch is not None:
            yield batch
            return
        with self._sessions() as session:
            with session.begin():
                yield session

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: every :meth:`session` of this thread inside the block is one transaction,
        committed when the block ends (rolled back if it raises: the store stays at its last commit).

        The orchestrator records what arrives together (attempts that ended, what their ends made
        ready, the tasks it launches) in one transaction instead of one per change; what must be
        durable before it acts (a task RUNNING before its processes start) it commits with
        :meth:`commit` inside the block.  Nested batches are part of the outer one."""
        if getattr(self._batch, "session", None) is not None:
            yield
            return
        session = self._sessions()
        session.info[PINNED] = []
        session.info[EVENTS] = []
        self._batch.session = session
        try:
            yield
            _write_events(session)
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            self._batch.session = None
            session.close()

    def commit(self) -> None:
        """Commit the current :meth:`batch` now (the batch goes on in a new transaction); nothing outside one."""
        batch = getattr(self._batch, "session", None)
        if batch is not None:
            _write_events(batch)
            batch.commit()

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def datasets_lock(self, *, exclusive: bool) -> Iterator[None]:
        """Removing committed datasets (``rm``, ``gc``: ``exclusive``) against reusing them (a cache
        look-up: shared, so runs do not wait for each other).

        A look-up verifies a candidate's files and records the reuse under the shared lock; removal
        reads which datasets kept runs use, deletes the records and then the files under the
        exclusive one.  So a run either reuses a dataset removal has not touched (which removal then
        keeps: a kept run uses it) or finds its records gone and recomputes, never a reuse of files
        being deleted.  SQLite: an ``flock`` on ``hetflow.db.datasets-lock`` beside the file (the
        processes that share a SQLite store share its directory); PostgreSQL: a session advisory
        lock, which holds across hosts.  Nothing to lock for a read-only or in-memory store.
        """
        if self._path is not None and not self.read_only:
            name = self._path.with_name(self._path.name + ".datasets-lock")
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                yield
            finally:
                os.close(fd)  # releases the lock
        elif self.engine.dialect.name == "postgresql":
            kind = "" if exclusive else "_shared"
            with self.engine.connect() as conn:
                conn.execute(text(f"SELECT pg_advisory_lock{kind}(:key)"), {"key": DATASETS_LOCK_KEY})
                conn.commit()  # the lock is the session's, not the transaction's
                try:
                    yield
                finally:
                    conn.execute(text(f"SELECT pg_advisory_unlock{kind}(:key)"), {"key": DATASETS_LOCK_KEY})
                    conn.commit()
        else:
            yield

    # ------------------------------------------------------------ helpers
    @staticmethod
    def get(session: Session, kind: type[Any], ident: Any, held: Any = None) -> Any:
        """``session.get(kind, ident)``, or ``held`` (the same record, loaded by an earlier session of this
        thread and kept by the caller) put back into ``session`` without a query.

        The orchestrator's batches are one session each, so a stage's record was queried again in every batch
        that touched it (three per task).  ``held`` is taken back only when nothing else could conflict: it is
        detached, ``session`` holds no other copy of it, and no related record is loaded on it (adding it
        would add those too).  Values committed since it was loaded are its own (the orchestrator is the one
        writer of its records); after a rollback they are expired, and read again on first use."""
        if held is not None:
            state = inspect(held)
            if state.session is session:
                return held
            if state.detached and state.key is not None and session.identity_map.get(state.key) is None \
                    and state.unloaded.issuperset(state.mapper.relationships.keys()):
                session.add(held)
                return held
        return session.get(kind, ident)

    @staticmethod
    def event(session: Session, run_id: str, kind: str, name: str, state: str, **detail: Any) -> None:
        """Record an event; inside a :meth:`batch`, written with the batch's other events in one statement
        when it commits (events are only read by other sessions, never by the batch that writes them)."""
        row = {"run_id": run_id, "time": time.time(), "kind": kind, "name": name, "state": state,
               "detail": json.loads(json.dumps(detail, default=str))}
        pending = session.info.get(EVENTS)
        if pending is not None:
            pending.append(row)
        else:
            session.add(EventRecord(**row))

    def runs(self) -> list[RunRecord]:
        """All runs, oldest first, after :meth:`reconcile_dead_runs`: none is RUNNING without a live owner."""
        self.reconcile_dead_runs()
        with self.session() as session:
            return list(session.scalars(select(RunRecord).order_by(RunRecord.created)))

    # ------------------------------------------------------------ ownership
    def claim_run(self, run_id: str, owner: str, *, lease_seconds: float,
                  create: Callable[[], RunRecord] | None = None, detail: Mapping[str, Any] | None = None) -> Claim:
        """Make ``owner`` (an :func:`owner_id`) the one orchestrator of ``run_id``, state RUNNING.

        A new run is one INSERT of ``create()`` (its id must be ``run_id``): of concurrent creators,
        the primary key lets one in.  An existing run is taken with one compare-and-set UPDATE,
        conditional on the owner and lease this call saw and judged gone (:func:`owner_gone`) or
        its own: of concurrent claimers one changes the row, the others see a new, live holder.
        Raises :class:`RunLocked` naming the holder while it lives, :class:`UnknownRun` if there
        is no such run and no ``create``.  Commits, with a ``run`` event, before returning.
        """
        info = dict(detail or {})
        for _ in range(8):  # each lost race means a new holder; it is normally alive and refuses us
            now = time.time()
            with self.session() as session:
                seen = session.execute(select(RunRecord.owner, RunRecord.lease_until, RunRecord.state)
                                       .where(RunRecord.id == run_id)).first()
            if seen is None:
                if create is None:
                    raise UnknownRun(f"no run {run_id!r} in {self.url}")
                record = create()
                if record.id != run_id:
                    raise ValueError(f"create() made run {record.id!r}, not {run_id!r}")
                record.owner, record.lease_until, record.state = owner, now + lease_seconds, State.RUNNING
                record.cancel_requested = None
                record.started, record.ended = record.started or now, None
                try:
                    with self.session() as session:
                        if self.engine.dialect.name == "postgresql":  # never wait forever on a racing insert
                            session.execute(text("SET LOCAL lock_timeout = '5s'"))
                        session.add(record)
                        session.flush()
                        self.event(session, run_id, "run", record.pipeline, State.RUNNING, owner=owner, **info)
                except (IntegrityError, OperationalError):
                    continue  # another claimer created it first (or held it too long): look at its holder
                return Claim(record, True, None, None, None)
            held_by, lease_until, state = seen
            why = None if held_by in (None, owner) else owner_gone(held_by, lease_until, now=now)
            if held_by not in (None, owner) and why is None:
                raise RunLocked(_locked_message(run_id, held_by, lease_until))
            with self.session() as session:
                taken = session.execute(
                    update(RunRecord)
                    .where(RunRecord.id == run_id, _is(RunRecord.owner, held_by), _is(RunRecord.lease_until, lease_until))
                    .values(owner=owner, lease_until=now + lease_seconds, state=State.RUNNING,
                            started=func.coalesce(RunRecord.started, now), ended=None, cancel_requested=None)
                    .execution_options(synchronize_session=False))
                if taken.rowcount != 1:  # type: ignore[attr-defined]
                    continue
                taken_run = session.get(RunRecord, run_id)
                assert taken_run is not None
                self.event(session, run_id, "run", taken_run.pipeline, State.RUNNING, owner=owner, previous_owner=held_by,
                           previous_state=state, previous_reason=why, **info)
            return Claim(taken_run, False, held_by, state, why)
        raise RunLocked(f"run {run_id}: gave up claiming it after 8 contended tries; another orchestrator "
                        "keeps taking it, see `hetflow runs`")

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend ``owner``'s lease; False if it no longer holds the run (taken over, or reconciled)."""
        with self.session() as session:
            renewed = session.execute(
                update(RunRecord).where(RunRecord.id == run_id, RunRecord.owner == owner)
                .values(lease_until=time.time() + lease_seconds).execution_options(synchronize_session=False))
            return renewed.rowcount == 1  # type: ignore[attr-defined,no-any-return]

    def release_run(self, run_id: str, owner: str, state: str, *, error: str | None = None,
                    detail: Mapping[str, Any] | None = None) -> bool:
        """Record the run's outcome ``state`` (and ``error``) and give up ownership, with a ``run`` event.

        Only while ``owner`` still holds it: False (nothing written) if another took it meanwhile.
        """
        with self.session() as session:
            released = session.execute(
                update(RunRecord).where(RunRecord.id == run_id, RunRecord.owner == owner)
                .values(state=state, ended=time.time(), owner=None, lease_until=None, error=error)
                .execution_options(synchronize_session=False))
            if released.rowcount != 1:  # type: ignore[attr-defined]
                return False
            pipeline = session.scalar(select(RunRecord.pipeline).where(RunRecord.id == run_id))
            self.event(session, run_id, "run", pipeline or "", state, error=error, **dict(detail or {}))
            return True

    def request_cancel(self, run_id: str, who: str) -> bool:
        """Ask the orchestrator of RUNNING ``run_id`` to stop it (it polls :meth:`cancel_request`).

        Through the store, so it reaches an orchestrator on another host too.  False if the run is
        not RUNNING.  A later claim (a resume) clears the request.
        """
        with self.session() as session:
            asked = session.execute(
                update(RunRecord).where(RunRecord.id == run_id, RunRecord.state == State.RUNNING)
                .values(cancel_requested=who).execution_options(synchronize_session=False))
            if asked.rowcount != 1:  # type: ignore[attr-defined]
                return False
            self.event(session, run_id, "run", run_id, "CANCEL_REQUESTED", by=who)
            return True

    def cancel_request(self, run_id: str) -> str | None:
        """Who asked to cancel ``run_id`` (``None``: nobody)."""
        with self.session() as session:
            return session.scalar(select(RunRecord.cancel_requested).where(RunRecord.id == run_id))

    def reconcile_dead_runs(self) -> list[DeadRun]:
        """Record FAILED every RUNNING run whose orchestrator is gone (:func:`owner_gone`).

        The outcome was never written: the run ends FAILED now, unowned (a late holder's
        :meth:`renew_lease` then says False), with a ``run`` event giving the reason.  Each change is
        conditional on the owner and lease seen, so a run claimed meanwhile is left alone.
        ``hetflow resume`` still continues such a run.
        """
        if self.read_only:
            return []
        now = time.time()
        with self.session() as session:
            running = session.execute(select(RunRecord.id, RunRecord.pipeline, RunRecord.owner, RunRecord.lease_until)
                                      .where(RunRecord.state == State.RUNNING)).all()
        dead = []
        for run_id, pipeline, held_by, lease_until in running:
            why = owner_gone(held_by, lease_until, now=now)
            if why is None:
                continue
            with self.session() as session:
                ended = session.execute(
                    update(RunRecord)
                    .where(RunRecord.id == run_id, RunRecord.state == State.RUNNING, _is(RunRecord.owner, held_by),
                           _is(RunRecord.lease_until, lease_until))
                    .values(state=State.FAILED, ended=now, owner=None, lease_until=None)
                    .execution_options(synchronize_session=False))
                if ended.rowcount == 1:  # type: ignore[attr-defined]
                    self.event(session, run_id, "run", pipeline, State.FAILED, reason=why, owner=held_by)
                    reason = f"not finished: {why}; resume the run"
                    session.execute(update(RunRecord).where(RunRecord.id == run_id).values(error=why)
                                    .execution_options(synchronize_session=False))
                    session.execute(update(StageRecord)
                                    .where(StageRecord.run_id == run_id,
                                           StageRecord.state.in_((State.PENDING, State.LOOKING, State.QUEUED, State.RUNNING)))
                                    .values(state=State.FAILED, error=reason, ended=now)
                                    .execution_options(synchronize_session=False))
                    dead.append(DeadRun(run_id, held_by, why))
                    log.warning("run %s: %s; recorded FAILED", run_id, why)
        return dead

    def find_run(self, run_id: str | None) -> RunRecord | None:
        """A run by id (or unique prefix); the latest run for ``None``; ``None`` if none or ambiguous."""
        try:
            return self.resolve_run(run_id)
        except UnknownRun:
            return None

    def resolve_run(self, run_id: str | None) -> RunRecord:
        """A run by id or unique prefix (the latest for ``None``).

        :class:`UnknownRun` says which runs an ambiguous prefix matches, or which runs
        there are when none matches, so the next command can be typed from the message.
        """
        with self.session() as session:
            if run_id is None:
                latest = session.scalars(select(RunRecord).order_by(RunRecord.created.desc()).limit(1)).first()
                if latest is None:
                    raise UnknownRun(f"no runs yet in {self.url}")
                return latest
            exact = session.get(RunRecord, run_id)
            if exact is not None:
                return exact
            matches = list(session.scalars(select(RunRecord).where(RunRecord.id.startswith(run_id, autoescape=True))
                                           .order_by(RunRecord.created.desc())))
            if len(matches) == 1:
                return matches[0]
            if matches:
                raise UnknownRun(f"{run_id!r} matches {len(matches)} runs: {_listing([m.id for m in matches])}; "
                                 "give more of the id")
            newest = list(session.scalars(select(RunRecord.id).order_by(RunRecord.created.desc()).limit(6)))
            known = f"runs: {_listing(newest, total=session.scalar(select(func.count()).select_from(RunRecord)))}" \
                if newest else "no runs yet"
            raise UnknownRun(f"no run {run_id!r} in {self.url} ({known}; `hetflow runs` lists them)")
