"""The state store: runs, stages, tasks, attempts, datasets, partitions, events.

SQLAlchemy 2 models on SQLite (WAL, in the work directory) by default or any
SQLAlchemy URL.  The orchestrator is the single writer; ``status``, resume,
reports and provenance read it.  Every state change is also an :class:`Event`
with a timestamp.

Stage states: ``PENDING`` → ``QUEUED`` → ``RUNNING`` → ``DONE`` | ``FAILED`` |
``TIMED_OUT`` | ``SKIPPED`` (a dependency failed) | ``CACHED`` (an identical
committed output was reused) | ``CANCELLED`` | ``WALLTIME`` (cut off by the
pilot's walltime; resumable).  A run ends ``DONE``, ``FAILED`` or ``STOPPED``
(the walltime stopped it before the end; resume it in the next allocation) or
``INTERRUPTED`` (Ctrl-C; resume it).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (JSON, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint, create_engine, event,
                        select)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

TERMINAL = frozenset({"DONE", "FAILED", "TIMED_OUT", "SKIPPED", "CACHED", "CANCELLED", "WALLTIME"})
SUCCESS = frozenset({"DONE", "CACHED"})


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds")


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class RunRecord(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pipeline: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16), default="PENDING")
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
    stages: Mapped[list["StageRecord"]] = relationship(back_populates="run", order_by="StageRecord.order")


class StageRecord(Base):
    __tablename__ = "stages"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    order: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="PENDING")
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
    run: Mapped[RunRecord] = relationship(back_populates="stages")
    tasks: Mapped[list["TaskRecord"]] = relationship(back_populates="stage", order_by="TaskRecord.submitted")


class TaskRecord(Base):
    """One placement of a stage on the pilot (a stage has one task per attempt)."""

    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), default="QUEUED")
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
    state: Mapped[str] = mapped_column(String(16), default="RUNNING")
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


class EventRecord(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _add_new_columns(engine: Engine) -> None:
    """Add the columns a newer hetflow declares to tables an older one created (nullable, so no backfill)."""
    from sqlalchemy import inspect, text

    inspector = inspect(engine)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have and column.nullable:
                kind = column.type.compile(dialect=engine.dialect)
                with engine.begin() as connection:
                    connection.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))


def default_url(workdir: Path) -> str:
    return f"sqlite:///{(workdir / 'hetflow.db').resolve()}"


class Store:
    """A handle on the state store; :meth:`session` is a unit of work."""

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///"):
            path = Path(url[len("sqlite:///"):])
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                os.close(fd)
        self.engine: Engine = create_engine(url, future=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        Base.metadata.create_all(self.engine)
        _add_new_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @classmethod
    def for_workdir(cls, workdir: Path, url: str | None = None) -> "Store":
        return cls(url or os.environ.get("HETFLOW_DB") or default_url(workdir))

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session:
            with session.begin():
                yield session

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ helpers
    @staticmethod
    def event(session: Session, run_id: str, kind: str, name: str, state: str, **detail: Any) -> None:
        session.add(EventRecord(run_id=run_id, time=time.time(), kind=kind, name=name, state=state,
                          detail=json.loads(json.dumps(detail, default=str))))

    def runs(self) -> list[RunRecord]:
        with self.session() as session:
            return list(session.scalars(select(RunRecord).order_by(RunRecord.created)))

    def find_run(self, run_id: str | None) -> RunRecord | None:
        """A run by id (or unique prefix); the latest run for ``None``."""
        with self.session() as session:
            if run_id is None:
                return session.scalars(select(RunRecord).order_by(RunRecord.created.desc()).limit(1)).first()
            exact = session.get(RunRecord, run_id)
            if exact is not None:
                return exact
            matches = list(session.scalars(select(RunRecord).where(RunRecord.id.startswith(run_id))))
            return matches[0] if len(matches) == 1 else None
