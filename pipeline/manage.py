"""Run management: remove runs (``hetflow rm``), collect garbage (``hetflow gc``), cancel a run.

A cache hit does not copy data: the later run's dataset record points at the
earlier run's dataset directory (``runs/<earlier>/datasets/<name>``).  So removing
a run removes its records and its directory *except* the dataset directories
that a kept run's records point at; those stay where they are, and go once the
last run using them is removed (by ``rm`` of that run, or by ``gc``).  Nothing a
kept run reads, resumes from or serves from the cache is ever deleted.

Records go first (one transaction), files after: a crash in between leaves
directories no record names, which ``gc`` removes later; never a record naming
a deleted directory.

A run whose data directory is elsewhere (``--data-dir``, a path or ``s3://...``; :mod:`hetflow.datadir`)
has its datasets under ``<data dir>/runs/<id>/datasets/``: each one no kept run uses is removed there,
objects and all, as its directory would be.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from hetflow.operators import objectdataset
from hetflow.operators.location import StorageError, is_object_store, resolve, storage_error

from .datadir import RunDatasets
from .errors import HetflowError, RunLocked, hetflow_command
from .store import (
    AttemptRecord,
    DatasetRecord,
    EventRecord,
    MapItemRecord,
    PartitionRecord,
    RunRecord,
    StageRecord,
    Store,
    TaskRecord,
    owner_gone,
)
from .states import State

log = logging.getLogger(__name__)

RESUMABLE = frozenset({State.FAILED, State.INTERRUPTED, State.CANCELLED, State.STOPPED})
"""Ended runs that did not finish: what ``gc`` removes (all but each pipeline's latest)."""

ORPHAN_GRACE = 300.0
"""Seconds a directory under ``runs/`` without a record is left alone: a run being created
makes its directory just before its record."""

OBJECT_GRACE = 3600.0
"""Seconds a partition object no committed manifest names is left alone (:func:`collect_garbage`): a run
resumed after gc read its state may be uploading it, and the store's clock, which dates it, may run behind
this host's (S3 refuses requests whose clocks differ by more than 15 minutes)."""


@dataclass
class Removal:
    """What removing runs did (or, for a dry run, would do)."""

    runs: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    """Dataset directory -> the kept runs that use it (left on disk)."""


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _live(run: RunRecord) -> bool:
    return run.state == State.RUNNING and owner_gone(run.owner, run.lease_until) is None


def _hetflow_path(path: Path) -> bool:
    """``path`` has the shape hetflow creates (``…/runs/<id>`` or ``…/runs/<id>/<part>…``): nothing else is
    removed, whatever a record says."""
    parts = path.parts
    return "runs" in parts[:-1] and len(parts) - parts.index("runs") >= 2


def remove_runs(store: Store, run_ids: Sequence[str], *, dry_run: bool = False, where: Sequence[str] = ()) -> Removal:
    """Remove the runs ``run_ids`` (full ids): their records, then their files no kept run uses.

    Refuses (:class:`RunLocked`, nothing removed) while one of them is running with a live owner; its
    ``hetflow cancel`` hint carries ``where`` (:func:`hetflow.errors.store_argv`).
    Holds the store's datasets lock from reading what kept runs use until the files are gone, so a
    concurrent cache look-up either recorded its reuse before (and the dataset is kept) or finds the
    records gone and recomputes (:meth:`Store.datasets_lock`).
    """
    store.reconcile_dead_runs()
    if dry_run:
        return _remove_runs(store, run_ids, dry_run=True, where=where)
    with store.datasets_lock(exclusive=True):
        return _remove_runs(store, run_ids, dry_run=False, where=where)


def _remove_runs(store: Store, run_ids: Sequence[str], *, dry_run: bool, where: Sequence[str]) -> Removal:
    doomed = set(run_ids)
    result = Removal()
    with store.session() as session:
        runs = []
        for run_id in run_ids:
            run = session.get(RunRecord, run_id)
            if run is None:
                raise HetflowError(f"no run {run_id!r} in {store.url}")
            if _live(run):
                raise RunLocked(f"run {run.id} is running (orchestrator {run.owner}); stop it first with "
                                f"`{hetflow_command('cancel', run.id, where)}`; nothing was removed")
            runs.append(run)
        used: dict[str, list[str]] = {}  # dataset path -> kept runs whose records point at it
        for path, user in session.execute(select(DatasetRecord.path, DatasetRecord.run_id)
                                          .where(DatasetRecord.run_id.not_in(doomed))):
            used.setdefault(path, []).append(user)
        kept_dirs = [d for i, d in session.execute(select(RunRecord.id, RunRecord.run_dir)) if i not in doomed]
        reused = set(session.scalars(select(DatasetRecord.path).where(DatasetRecord.run_id.in_(doomed))))
        for run in runs:
            result.runs.append(run.id)
            kept = {p: users for p, users in used.items() if _inside(p, run.run_dir)}
            result.kept.update(kept)
            datasets = RunDatasets.of_run(run.id, run.run_dir, (run.pilot or {}).get("data_dir"))
            if kept:
                result.paths.extend(_run_dir_parts(Path(run.run_dir), datasets.root, set(kept)))
            elif os.path.lexists(run.run_dir):
                result.paths.append(run.run_dir)
            if not _inside(datasets.root, run.run_dir):  # elsewhere: each dataset no kept run uses
                for path in _dataset_dirs(datasets.root):
                    if path in used:
                        result.kept[path] = used[path]
                    else:
                        result.paths.append(path)
        # datasets the removed runs reused from a run removed before: theirs to remove now, unless a kept
        # run uses them too or they sit in a kept run's directory
        for path in sorted(reused):
            if path in used or any(_inside(path, d) for d in kept_dirs) or \
                    any(_inside(path, r.run_dir) for r in runs) or path in result.paths or not _exists(path):
                continue
            result.paths.append(path)
        result.paths = [p for p in result.paths if _hetflow_path(Path(p))]
        if dry_run:
            session.rollback()
            return result
        _delete_records(session, doomed)
    for path in result.paths:
        _remove(path)
    return result


def _dataset_dirs(root: str) -> list[str]:
    """The dataset directories (or URI prefixes) under a run's datasets ``root``."""
    if not is_object_store(root):
        try:
            return sorted(str(child) for child in Path(root).iterdir())
        except OSError:
            return []
    from pyarrow.fs import FileSelector, FileType

    where = resolve(root)
    try:
        infos = where.filesystem.get_file_info(FileSelector(where.path, allow_not_found=True))
    except OSError as exc:
        raise HetflowError(str(storage_error(exc, where, "list"))) from None
    return sorted(where.join(info.base_name).uri for info in infos if info.type == FileType.Directory)


def _exists(path: str) -> bool:
    return objectdataset.exists(resolve(path)) if is_object_store(path) else os.path.lexists(path)


def _remove(path: str) -> None:
    """Remove a dataset or run directory, or every object under an object-store prefix."""
    if is_object_store(path):
        try:
            objectdataset.remove(resolve(path))
        except StorageError as exc:
            raise HetflowError(f"{exc} (its records are removed already; the objects under it are left)") from None
    else:
        _remove_tree(Path(path))


def _run_dir_parts(run_dir: Path, datasets_root: str, kept: set[str]) -> list[str]:
    """Everything in ``run_dir`` but the kept dataset directories (in ``datasets_root``, when that is in it)."""
    parts: list[str] = []
    try:
        children = sorted(run_dir.iterdir())
    except OSError:
        return []
    for child in children:
        if str(child) == datasets_root and child.is_dir() and not child.is_symlink():
            parts.extend(str(d) for d in sorted(child.iterdir()) if str(d) not in kept)
        else:
            parts.append(str(child))
    return parts


def _delete_records(session: Session, run_ids: Iterable[str]) -> None:
    ids = list(run_ids)
    stage_ids = select(StageRecord.id).where(StageRecord.run_id.in_(ids))
    dataset_ids = select(DatasetRecord.id).where(DatasetRecord.run_id.in_(ids))
    task_ids = select(TaskRecord.id).where(TaskRecord.stage_id.in_(stage_ids))
    for statement in (delete(EventRecord).where(EventRecord.run_id.in_(ids)),
                      delete(MapItemRecord).where(MapItemRecord.run_id.in_(ids)),
                      delete(PartitionRecord).where(PartitionRecord.dataset_id.in_(dataset_ids)),
                      delete(DatasetRecord).where(DatasetRecord.run_id.in_(ids)),
                      delete(AttemptRecord).where(AttemptRecord.task_id.in_(task_ids)),
                      delete(TaskRecord).where(TaskRecord.stage_id.in_(stage_ids)),
                      delete(StageRecord).where(StageRecord.run_id.in_(ids)),
                      delete(RunRecord).where(RunRecord.id.in_(ids))):
        session.execute(statement.execution_options(synchronize_session=False))


def _remove_tree(path: Path) -> None:
    """Remove ``path`` without following a symlink out of it (a link itself is unlinked); then an
    emptied ``datasets`` directory and run directory above a removed dataset."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)  # fd-based on Linux: never follows a link inside
    except FileNotFoundError:
        pass
    if path.parent.name == "datasets":
        for directory in (path.parent, path.parent.parent):
            try:
                directory.rmdir()
            except OSError:
                break


def collect_garbage(store: Store, runs_dir: Path | None, *, dry_run: bool = False,
                    grace: float | None = None) -> Removal:
    """``hetflow gc``: remove ended runs that did not finish, except each pipeline's latest run,
    directories under ``runs_dir`` that no record names, and, under a kept run's object-store data
    directory, partition objects that no committed dataset names (:func:`_leftover_objects`).

    Kept: every DONE run, every running run, the latest run of each pipeline whatever its state
    (the one to resume), and every dataset a kept run uses.  ``grace``: seconds a leftover directory or
    object is left alone (default :data:`ORPHAN_GRACE` for directories, :data:`OBJECT_GRACE` for objects).

    Decision: with ``runs_dir`` (the work directory's ``runs/``), only the runs whose directory is there are
    candidates, and "latest" is among them.  A store that work directories share (a team's PostgreSQL
    server, one ``HETFLOW_DB`` for scratch and home) holds other directories' runs: a newer run of the same
    pipeline elsewhere, another user's, must not make this one's latest failure (the one to resume) go,
    nor may this ``gc`` remove a run it does not hold; each is collected from its own work directory.
    """
    store.reconcile_dead_runs()
    with store.session() as session:
        runs = [(run_id, pipeline, state) for run_id, pipeline, state, run_dir in session.execute(
                    select(RunRecord.id, RunRecord.pipeline, RunRecord.state, RunRecord.run_dir)
                    .order_by(RunRecord.created))
                if runs_dir is None or _inside(os.path.realpath(run_dir), os.path.realpath(runs_dir))]
    latest = {pipeline: run_id for run_id, pipeline, _ in runs}
    doomed = [run_id for run_id, pipeline, state in runs if state in RESUMABLE and latest[pipeline] != run_id]
    result = remove_runs(store, doomed, dry_run=dry_run) if doomed else Removal()
    result.paths += _leftover_objects(store, set(doomed), dry_run=dry_run,
                                      grace=OBJECT_GRACE if grace is None else grace)
    if runs_dir is not None and runs_dir.is_dir():
        _orphan_dirs(store, runs_dir, set(doomed) if dry_run else set(), result, dry_run=dry_run,
                     grace=ORPHAN_GRACE if grace is None else grace)
    return result


def _orphan_dirs(store: Store, runs_dir: Path, gone: set[str], result: Removal, *, dry_run: bool,
                 grace: float) -> None:
    """Remove (or list) the directories under ``runs_dir`` that no record names, older than ``grace`` seconds."""
    with store.session() as session:
        known = {d for i, d in session.execute(select(RunRecord.id, RunRecord.run_dir)) if i not in gone}
        used = {p for i, p in session.execute(select(DatasetRecord.run_id, DatasetRecord.path)) if i not in gone}
    now = time.time()
    for child in sorted(runs_dir.iterdir()):
        name = str(child)
        if name in known or name in result.paths or any(_inside(p, name) for p in used):
            continue
        try:
            if now - child.lstat().st_mtime < grace:
                continue
        except OSError:
            continue
        result.paths.append(name)
        if not dry_run:
            _remove_tree(child)


def _leftover_objects(store: Store, removed: set[str], *, dry_run: bool, grace: float) -> list[str]:
    """Remove (or, for a dry run, list) the partition objects under the object-store datasets of this store's
    runs that no committed manifest names (:func:`hetflow.operators.objectdataset.leftovers`): what a failed
    or crashed attempt uploaded.  Their URIs.

    Only hetflow's own layout is looked at (``<data dir>/runs/<run>/datasets/<name>/part-….arrow``), of runs
    this store records: a data directory that work directories share holds other stores' runs, whose state
    this one cannot see, and those are left alone.  An in-flight run's uploads are never removed: a run
    running with a live owner is skipped whole, and its record is read again just before its objects are
    deleted; an object younger than ``grace`` seconds is left (a run resumed after that read uploads only
    objects that young).  Runs being removed (``removed``) go whole anyway.
    """
    before = time.time() - grace
    with store.session() as session:
        runs = [(run.id, run.run_dir, (run.pilot or {}).get("data_dir")) for run in session.scalars(select(RunRecord))
                if run.id not in removed and not _live(run)]
    found: list[str] = []
    for run_id, run_dir, data_dir in runs:
        datasets = RunDatasets.of_run(run_id, run_dir, data_dir)
        if not datasets.remote:
            continue
        try:
            stray = [where for path in _dataset_dirs(datasets.root)
                     for where in objectdataset.leftovers(resolve(path), before=before)]
            if stray and not dry_run:
                with store.session() as session:
                    run = session.get(RunRecord, run_id)
                    if run is None or _live(run):   # resumed (or removed) since: its uploads are its own
                        continue
                objectdataset.delete(stray)
        except (StorageError, HetflowError) as exc:   # a bucket gone or a store down: the other runs go on
            log.warning("run %s: leftover objects not removed: %s", run_id, exc)
            continue
        found += [where.uri for where in stray]
    return found
