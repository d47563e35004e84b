"""Where a run's datasets live: the one place that says it.

A pipeline's datasets live under its **data directory**: the work directory by default, or the
pilot's ``data_dir`` (a path or an object-store URI such as ``s3://bucket/prefix``), which
``hetflow run --data-dir`` and ``Pipeline.run(data_dir=...)`` override.  Under it, run ``R``'s
dataset ``name`` is ``<data dir>/runs/R/datasets/name`` — with the default, the run directory's
``datasets/`` as always.  Run directories (logs, specs, attempts) and the state store stay local.

A data directory URI carries no credentials and no options: those come from the AWS environment
(:mod:`hetflow.operators.location`), so what run records hold is safe to show.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hetflow.operators.location import is_object_store, is_uri, redact, resolve, storage_error

from .errors import PipelineError


def check_data_dir(data_dir: str, *, what: str) -> str:
    """``data_dir`` as runs use it: a path made absolute, or an ``s3://bucket/prefix`` URI without
    credentials or options.  :class:`PipelineError` naming ``what`` (where it was given) otherwise."""
    if not is_uri(data_dir):
        return str(Path(data_dir).expanduser().resolve())
    parts = urlsplit(data_dir)
    if not is_object_store(data_dir):
        raise PipelineError(f"{what} {redact(data_dir)!r}: unsupported scheme {parts.scheme!r} "
                            "(expected a path or s3://BUCKET/PREFIX)")
    if "@" in parts.netloc or parts.query:
        raise PipelineError(f"{what} {redact(data_dir)!r}: credentials and options do not go into the URI; "
                            "set them in the AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                            "AWS_ENDPOINT_URL, AWS_PROFILE, ...)")
    try:
        where = resolve(data_dir)
    except ValueError as exc:
        raise PipelineError(f"{what}: {exc}") from None
    return str(where.uri)


def reachable(data_dir: str, *, pipeline: str) -> None:
    """Ask the store for ``data_dir`` once, before a run starts: a missing bucket, a wrong credential or an
    endpoint that is down is one line naming bucket, key and cause, not a failure of the first stage."""
    if not is_object_store(data_dir):
        return
    from pyarrow.fs import FileType  # a data directory given: pyarrow.fs, not loaded by a run without one

    where = resolve(data_dir)
    bucket = resolve(f"s3://{where.bucket}")
    try:
        found = bucket.filesystem.get_file_info(bucket.path).type != FileType.NotFound
    except OSError as exc:
        raise PipelineError(f"pipeline {pipeline!r}: data directory: {storage_error(exc, where, 'use')}") from None
    if not found:
        missing = storage_error(OSError("NO_SUCH_BUCKET"), where, "use")
        raise PipelineError(f"pipeline {pipeline!r}: data directory: {missing}")


def unclaimed(data_dir: str, run_id: str, *, pipeline: str) -> None:
    """Refuse a new run whose id already has datasets under ``data_dir``: a data directory two work
    directories share (an object store, a shared path) could hold another store's run of the same id
    (``--run-id``), whose datasets this run's stages would withdraw and replace."""
    from pyarrow.fs import FileSelector, FileType

    root = RunDatasets(data_dir, run_id).root
    where = resolve(root)
    try:
        found = where.filesystem.get_file_info(FileSelector(where.path, recursive=True,
                                                            allow_not_found=True))
    except OSError as exc:
        raise PipelineError(f"pipeline {pipeline!r}: data directory: {storage_error(exc, where, 'list')}") from None
    if any(info.type == FileType.File for info in found):
        raise PipelineError(f"pipeline {pipeline!r}: run {run_id} is new in this store, but {where.uri} already holds "
                            f"datasets (another work directory's run of that id shares the data directory); "
                            f"choose another --run-id, or resume that run from its own work directory")


@dataclass(frozen=True)
class RunDatasets:
    """Where run ``run_id``'s datasets live: :meth:`path` of each, :attr:`root` of them all."""

    data_dir: str
    run_id: str

    @classmethod
    def of_run(cls, run_id: str, run_dir: str | os.PathLike[str], data_dir: str | None) -> RunDatasets:
        """Where the datasets of a recorded run are: its ``data_dir`` (the pilot's, as recorded), else the
        work directory its run directory is in (``<workdir>/runs/<id>``)."""
        return cls(data_dir or str(Path(run_dir).parent.parent), run_id)

    @property
    def remote(self) -> bool:
        """Whether the datasets are on an object store (no memory map, no rename, no directories)."""
        return bool(is_object_store(self.data_dir))

    @property
    def root(self) -> str:
        """The directory (or URI prefix) of this run's datasets."""
        return join(self.data_dir, "runs", self.run_id, "datasets")

    def path(self, name: str) -> str:
        """Where dataset ``name`` of this run lives: a path or a URI."""
        return join(self.root, name)


def join(base: str, *names: str) -> str:
    """``names`` below ``base``, a path or a URI (``/``-joined, whatever the OS)."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)
