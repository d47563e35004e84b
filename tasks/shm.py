"""MPICH's shared-memory segments of a rank: recorded by the rank, removed by its witness if it dies.

MPICH's shared-memory transport maps a file ``/dev/shm/mpich_shm_<job>_<node>``
(and ``mpich_vci_...``) on every node of a job with several ranks there, and
unlinks it in ``MPI_Finalize``.  A rank that is killed, or aborted with the rest
of its task, never finalizes, so each failed multi-rank task would leave a few
MB in ``/dev/shm`` for good.  hetflow removes only segments it can prove are its
own: after ``MPI_Init`` each rank writes the segments it has mapped (from
``/proc/self/maps``) into its attempt directory, and when the rank ended
abnormally its witness (:mod:`hetflow.tasks.witness`), which runs on the same
node, unlinks exactly those -- plain files with MPICH's name, owned by this
user.  Unlinking a segment other ranks still map is harmless: their mappings
stay until they end.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

SEGMENT = re.compile(r"/dev/shm/mpich_(shm|vci)_[0-9a-f]+_[0-9]+")
"""A segment MPICH's POSIX transport creates (``mpich_shm_%x_%d``: job id hash, node id)."""


def mapped_segments(maps: str) -> list[str]:
    """The MPICH segments in a ``/proc/<pid>/maps`` text that are still linked, in order."""
    found: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if SEGMENT.fullmatch(path):
            found[path] = None
    return list(found)


def record(path: Path) -> None:
    """Write the MPICH segments this process maps to ``path`` (nothing when it maps none)."""
    try:
        segments = mapped_segments(Path("/proc/self/maps").read_text())
    except OSError:
        return
    if not segments:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, "".join(f"{s}\n" for s in segments).encode())
    finally:
        os.close(fd)


def remove_recorded(path: Path) -> list[str]:
    """Unlink the segments listed in ``path`` that are still there as this user's plain files; return them."""
    try:
        listed = path.read_text().split()
    except OSError:
        return []
    removed = []
    for segment in listed:
        if not SEGMENT.fullmatch(segment):
            continue
        try:
            info = os.lstat(segment)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(segment)
                removed.append(segment)
        except OSError:
            continue  # gone already (MPICH or another rank's witness removed it)
    return removed
