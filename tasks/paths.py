"""Directories and files hetflow creates for itself: private to the user, whatever the umask.

Rules, fixed here for the orchestrator, the backends and the reports:

* a directory hetflow creates is 0700 and a file it creates is 0600, under any
  umask; a directory that already exists keeps its mode (a shared project
  directory or ``/tmp`` given as ``--workdir`` is never chmod'ed);
* below ``base`` nothing is followed through a symbolic link: each component
  is opened with ``O_NOFOLLOW`` relative to its parent, and a symlink is
  refused with :class:`UnsafePath` naming it.  With no ``base`` that holds for
  every component of the absolute path, so callers that accept a path from
  the user resolve it once first (``Pipeline.run`` does, for the work
  directory) and everything hetflow derives from it is checked strictly.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import HetflowError

DIR_MODE = 0o700
FILE_MODE = 0o600
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UnsafePath(HetflowError, OSError):
    """A path hetflow would have to follow through a symlink (or a non-directory) to use; refused."""

    def __init__(self, path: "str | os.PathLike[str]", problem: str) -> None:
        message = f"refusing {os.fspath(path)}: {problem}"
        super().__init__(errno.ELOOP, message)
        self.path = os.fspath(path)

    def __str__(self) -> str:
        return str(self.strerror)


def private_dir(path: "str | os.PathLike[str]", *, base: "str | os.PathLike[str] | None" = None) -> Path:
    """Create ``path`` and its missing parents as 0700 directories; never chmod one that exists.

    Components below ``base`` (every component when ``base`` is None) must be
    real directories, never symlinks; ``base`` itself is taken as given.
    Returns ``path``.
    """
    fd = open_dir(path, base=base, create=True)
    os.close(fd)
    return Path(path)


def open_dir(path: "str | os.PathLike[str]", *, base: "str | os.PathLike[str] | None" = None,
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
    fd = os.open(start, _O_PATH | _O_DIRECTORY)
    here = start
    for part in parts:
        here = here / part
        try:
            child = _step(fd, part, here, create)
        finally:
            os.close(fd)
        fd = child
    return fd


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return probe


def _step(parent_fd: int, name: str, where: Path, create: bool) -> int:
    """Open entry ``name`` of ``parent_fd`` as a directory without following it (and make it if asked)."""
    created = False
    flags = _O_PATH | _O_DIRECTORY | _O_NOFOLLOW
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
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise _refusal(name, parent_fd, where) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):  # O_PATH|O_NOFOLLOW opens a link itself rather than failing
            raise _refusal(name, parent_fd, where)
        if created and stat.S_IMODE(info.st_mode) != DIR_MODE:
            _chmod_fd(fd, DIR_MODE, name, parent_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refusal(name: str, parent_fd: int, where: Path) -> UnsafePath:
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return UnsafePath(where, "it is a symbolic link, and hetflow never follows one inside the "
                          "directories it manages (remove it, or give the real path)")
    return UnsafePath(where, "it is not a directory")


def _chmod_fd(fd: int, mode: int, name: str, parent_fd: int) -> None:
    """chmod the object ``fd`` refers to (an ``O_PATH`` fd cannot be fchmod'ed: go through /proc)."""
    try:
        os.fchmod(fd, mode)
        return
    except OSError:
        pass
    proc = f"/proc/self/fd/{fd}"
    if os.path.exists(proc):
        os.chmod(proc, mode)
    else:  # no /proc: by name, which was just checked not to be a symlink
        os.chmod(name, mode, dir_fd=parent_fd)


def write_private_file(path: "str | os.PathLike[str]", data: bytes, *,
                       base: "str | os.PathLike[str] | None" = None) -> Path:
    """Write ``data`` to ``path`` as a 0600 file: temp file, fsync, rename; never through a symlink.

    The parent is reached like :func:`private_dir` (created 0700 when
    missing); an existing symlink at ``path`` is refused rather than replaced.
    """
    target = Path(os.path.abspath(path))
    dfd = open_dir(target.parent, base=base, create=True)
    tmp = f".{target.name}.tmp-{os.getpid()}"
    try:
        try:
            mode = os.stat(target.name, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise UnsafePath(target, f"it is {kind}; hetflow only replaces regular files it wrote")
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, FILE_MODE, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), FILE_MODE)  # the umask may have taken bits of 0600 away
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(dfd)
    return target
