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

The code is :mod:`hetflow.operators.safeio`, the one copy of hetflow's safe file I/O (the bottom
layer, so the dataset format and ``hetflow.ml`` share it); this module keeps the task layer's names.
"""

from __future__ import annotations

from hetflow.operators.safeio import (
    DIR_MODE,
    FILE_MODE,
    UnsafePath,
    open_dir,
    private_dir,
    write_private_file,
)

__all__ = ["DIR_MODE", "FILE_MODE", "UnsafePath", "open_dir", "private_dir", "write_private_file"]
