"""Safe file I/O, written once for every package of hetflow: atomic writes (temp file, fsync, rename,
fsync of the directory), opens and walks that never follow a symbolic link, private modes.

It lives in the bottom layer (``hetflow.operators`` imports nothing else of hetflow), so the dataset
format, the task layer (:mod:`hetflow.tasks.paths` re-exports its part), the orchestrator, the
checkpoints of ``hetflow.ml`` and the cost-model and TCP-communicator files all use this one copy.

Rules:

* a directory hetflow creates is 0700 and a file it creates is 0600, under any umask; a directory
  that already exists keeps its mode (a shared project directory or ``/tmp`` is never chmod'ed);
* nothing is followed through a symbolic link: entries are opened with ``O_NOFOLLOW`` relative to
  their directory's descriptor, and a link is refused with :class:`UnsafePath` naming it (callers
  with their own wording pass ``refuse=``; the dataset format raises its ``UnsafeDatasetPath``, a
  subclass);
* a write is atomic: a reader sees the old file or the new one, never a part; ``durable`` writes
  are fsynced, and so is the directory after the rename.

Two ways to reach a directory: :func:`open_dir` walks every component below ``base`` (or of the whole
absolute path) without following a link, for the trees hetflow derives from a checked root;
:func:`open_dir_nofollow` checks the last component only, for a directory whose parents are the
caller's to trust (a dataset the user named).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .errors import HetflowError

DIR_MODE = 0o700
FILE_MODE = 0o600
O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted in place of a file must not block the reader
LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


class UnsafePath(HetflowError, OSError):
    """A path hetflow would have to follow through a symlink (or a non-directory) to use; refused."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(errno.ELOOP, f"refusing {os.fspath(path)}: {problem}")
        self.path = os.fspath(path)

    def __str__(self) -> str:
        return str(self.strerror)


Refuse = Callable[[str | os.PathLike[str]], OSError]
"""Makes the error for a path that is a link or not what it must be (:func:`refusal` by default)."""


def refusal(path: str | os.PathLike[str]) -> UnsafePath:
    """The :class:`UnsafePath` for ``path``: a symbolic link, or not a directory or regular file."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        is_link = False
    if is_link:
        return UnsafePath(path, "it is a symbolic link, and hetflow never follows one inside the "
                          "directories it manages (remove it, or give the real path)")
    return UnsafePath(path, "it is not a directory or regular file as hetflow needs")


# ------------------------------------------------------------------ whole-path walks
def private_dir(path: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None) -> Path:
    """Create ``path`` and its missing parents as 0700 directories; never chmod one that exists.

    Components below ``base`` (every component when ``base`` is None) must be
    real directories, never symlinks; ``base`` itself is taken as given.
    Returns ``path``.
    """
    fd = open_dir(path, base=base, create=True)
    os.close(fd)
    return Path(path)


def open_dir(path: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
             create: bool = False) -> int:
    """A file descriptor (``O_PATH`` where the OS has it) on directory ``path``, reached without symlinks.

    The caller closes it.  It can be the ``dir_fd`` of ``os.open``/``os.mkdir``/
    ``os.replace``/``os.unlink`` so that later work on entries happens in the
    directory that was checked, not in whatever the name points at by then.
    """
    target = Path(os.path.abspath(path))
    if base is None:
        start, parts = Path(target.anchor), target.parts[1:]
    else:
        start = Path(os.path.abspath(base))
        try:
            parts = target.relative_to(start).parts
        except ValueError:
            raise UnsafePath(target, f"it is not below {start}") from None
        if create and not start.exists():  # a new base: its missing components are ours, so checked too
            anchor = _existing_ancestor(start)
            start, parts = anchor, start.relative_to(anchor).parts + parts
    fd = os.open(start, O_PATH | O_DIRECTORY)
    for depth, part in enumerate(parts):
        try:
            child = _step(fd, part, start, parts[:depth + 1], create)
        finally:
            os.close(fd)
        fd = child
    return fd


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return probe


def _step(parent_fd: int, name: str, start: Path, walked: tuple[str, ...], create: bool) -> int:
    """Open entry ``name`` of ``parent_fd`` as a directory without following it (and make it if asked);
    ``start`` joined with ``walked`` is its path, made only for a refusal's message (a walk makes a path per
    component otherwise, which was most of a private directory's cost to the orchestrator)."""
    created = False
    flags = O_PATH | O_DIRECTORY | O_NOFOLLOW
    try:
        try:
            fd = os.open(name, flags, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
                created = True
            except FileExistsError:
                pass  # made by someone else meanwhile (or a dangling symlink): checked like any other
            fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise _walk_refusal(name, parent_fd, start.joinpath(*walked)) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):  # O_PATH|O_NOFOLLOW opens a link itself rather than failing
            raise _walk_refusal(name, parent_fd, start.joinpath(*walked))
        if created and stat.S_IMODE(info.st_mode) != DIR_MODE:
            chmod_fd(fd, DIR_MODE, name, parent_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk_refusal(name: str, parent_fd: int, where: Path) -> UnsafePath:
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return UnsafePath(where, "it is a symbolic link, and hetflow never follows one inside the "
                          "directories it manages (remove it, or give the real path)")
    return UnsafePath(where, "it is not a directory")


def chmod_fd(fd: int, mode: int, name: str | None = None, parent_fd: int | None = None) -> None:
    """chmod the object ``fd`` refers to (an ``O_PATH`` fd cannot be fchmod'ed: go through /proc; without
    /proc, by ``name`` in ``parent_fd``, which the caller has checked is not a symlink)."""
    try:
        os.fchmod(fd, mode)
        return
    except OSError:
        pass
    proc = f"/proc/self/fd/{fd}"
    if os.path.exists(proc) or name is None:
        os.chmod(proc, mode)
    else:
        os.chmod(name, mode, dir_fd=parent_fd)


def write_private_file(path: str | os.PathLike[str], data: bytes, *,
                       base: str | os.PathLike[str] | None = None) -> Path:
    """Write ``data`` to ``path`` as a 0600 file: temp file, fsync, rename; never through a symlink.

    The parent is reached like :func:`private_dir` (created 0700 when
    missing); an existing symlink at ``path`` is refused rather than replaced.
    """
    target = Path(os.path.abspath(path))
    dfd = open_dir(target.parent, base=base, create=True)
    try:
        write_at(dfd, target.parent, target.name, data, durable=True, fsync_directory=False,
                 refuse=lambda p: _not_regular(p))
    finally:
        os.close(dfd)
    return target


def _not_regular(path: str | os.PathLike[str]) -> UnsafePath:
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        is_link = False
    kind = "a symbolic link" if is_link else "not a regular file"
    return UnsafePath(path, f"it is {kind}; hetflow only replaces regular files it wrote")


# ------------------------------------------------------------------ one directory, by descriptor
def open_dir_nofollow(directory: str | os.PathLike[str], *, create: bool = False, refuse: Refuse = refusal) -> int:
    """A read fd on ``directory``, opened with ``O_NOFOLLOW``: a symlink there is refused.

    With ``create``, missing components are made 0700 (fixed through the fd if
    the umask took bits away); existing ones keep their mode.
    """
    directory = Path(directory)
    try:
        return os.open(directory, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise refuse(directory) from None
        raise
    missing = []
    probe = directory
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile: checked when opened below
        fd = os.open(folder, O_PATH | O_DIRECTORY | O_NOFOLLOW)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise refuse(folder)
            if stat.S_IMODE(os.fstat(fd).st_mode) != DIR_MODE:
                fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)
    return open_dir_nofollow(directory, refuse=refuse)


def fchmod(fd: int, mode: int) -> None:
    """chmod what ``fd`` refers to (an ``O_PATH`` fd: through /proc, never by name)."""
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.chmod(f"/proc/self/fd/{fd}", mode)


def entry_mode(dfd: int, name: str) -> int | None:
    """The mode of entry ``name`` of ``dfd`` itself (a link is not followed), or None when it is missing."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


def refuse_non_regular(dfd: int, directory: str | os.PathLike[str], name: str, *, refuse: Refuse = refusal) -> None:
    """Refuse entry ``name`` if it exists and is not a regular file (a symlink, a FIFO, a directory)."""
    mode = entry_mode(dfd, name)
    if mode is not None and not stat.S_ISREG(mode):
        raise refuse(Path(directory) / name)


def open_entry(dfd: int, directory: str | os.PathLike[str], name: str, *, refuse: Refuse = refusal) -> int:
    """Open regular file ``name`` of ``dfd`` for reading, never through a symlink (nor blocking on a FIFO)."""
    try:
        fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise refuse(Path(directory) / name) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse(Path(directory) / name)
    return fd


def open_regular(path: str | os.PathLike[str], *, refuse: Refuse = refusal) -> int:
    """Open regular file ``path`` for reading, never through a symlink (its last component) nor blocking on
    a FIFO: how hetflow reads back what another program wrote (a rank's log, its progress), which a stage,
    or another user of a shared store, could have replaced by a link to a private file or by a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK)
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise refuse(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse(path)
    return fd


def create_temp(dfd: int, name: str) -> tuple[str, int]:
    """A new 0600 temp file beside ``name`` (O_EXCL, so never an existing file or link): its name and fd."""
    tmp = f".{name}.tmp-{os.getpid()}"
    try:
        os.unlink(tmp, dir_fd=dfd)  # left by a crashed writer with our pid; unlink never follows
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW, FILE_MODE, dir_fd=dfd)
    os.fchmod(fd, FILE_MODE)  # the umask may have taken bits of 0600 away
    return tmp, fd


def unlink_quiet(dfd: int, name: str) -> bool:
    """Remove entry ``name`` of ``dfd`` if it is there (a link is removed, never followed); whether it was."""
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    return True


def write_at(dfd: int, directory: str | os.PathLike[str], name: str, data: bytes | Callable[[IO[bytes]], None], *,
             durable: bool = True, fsync_directory: bool = True, refuse: Refuse = refusal) -> None:
    """Atomically write entry ``name`` of ``dfd`` (0600): temp file, (fsync,) rename (, fsync of the directory).

    ``data`` is the bytes, or a function that writes them to the open file.  An existing entry that is
    not a regular file is refused, never replaced; the temp file is removed when anything fails.
    """
    refuse_non_regular(dfd, directory, name, refuse=refuse)
    tmp, fd = create_temp(dfd, name)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        unlink_quiet(dfd, tmp)
        raise
    if durable and fsync_directory:
        os.fsync(dfd)


def atomic_write(path: str | os.PathLike[str], data: bytes | Callable[[IO[bytes]], None], *,
                 durable: bool = True, create_parent: bool = False, refuse: Refuse = refusal) -> Path:
    """Atomically write the file ``path`` (0600) in a directory reached without following its last
    component (:func:`open_dir_nofollow`, created 0700 with ``create_parent``); see :func:`write_at`."""
    target = Path(path)
    dfd = open_dir_nofollow(target.parent, create=create_parent, refuse=refuse)
    try:
        write_at(dfd, target.parent, target.name, data, durable=durable, refuse=refuse)
    finally:
        os.close(dfd)
    return target


def fsync_dir(directory: str | os.PathLike[str], *, refuse: Refuse = refusal) -> None:
    """fsync ``directory`` (what a rename or unlink in it did survives a crash); never through a symlink."""
    fd = open_dir_nofollow(directory, refuse=refuse)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
