"""Which journal mode the SQLite state store may use, from the file system it lives on.

SQLite's WAL needs shared memory between the processes that open the
database, which a network or parallel file system (NFS, Lustre, GPFS,
BeeGFS, CIFS) does not give across hosts: a run submitted with ``hetflow
submit`` writes its store from a compute node while ``hetflow status`` reads
it from the login node.  There the store uses the rollback journal
(``journal_mode=DELETE``, which relies only on POSIX locks) and hetflow warns
once per store, recommending PostgreSQL.  On a local file system it keeps WAL.

The file system type is not in ``os.statvfs``; it is the ``fstype`` field of
the mount in ``/proc/self/mountinfo`` whose mount point is the longest
prefix of the database's path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Literal

JournalMode = Literal["WAL", "DELETE"]

SHARED_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3"})
MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """Mount points in mountinfo write space, tab, newline and backslash as octal escapes."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_type(path: str, mountinfo: str) -> str | None:
    """The fstype of the mount holding absolute ``path``, per ``mountinfo``'s text; None if none matches.

    The longest mount point that is ``path`` or one of its parents wins; of equal ones, the later line
    (mounted on top of the earlier).
    """
    target = PurePosixPath(path)
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if len(fields) < separator + 2:
            continue
        point = PurePosixPath(_unescape(fields[4]))
        if target == point or point in target.parents:
            depth = len(point.parts)
            if best is None or depth >= best[0]:
                best = (depth, fields[separator + 1])
    return None if best is None else best[1]


def journal_mode(fstype: str | None) -> JournalMode:
    """``DELETE`` on a network or parallel file system (``fuse.`` prefixes ignored), else ``WAL``."""
    if fstype is None:
        return "WAL"
    name = fstype.removeprefix("fuse.")
    return "DELETE" if name in SHARED_FILE_SYSTEMS else "WAL"


def journal_mode_for(path: str) -> tuple[JournalMode, str | None]:
    """The journal mode for a database at ``path`` on this host, and the file system type it is based on."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError:  # not Linux: nothing to go on, keep the default
        return "WAL", None
    fstype = mount_type(os.path.realpath(path), text)
    return journal_mode(fstype), fstype


def default_workdir() -> Path:
    """Where hetflow keeps its runs and store unless told otherwise: ``$HETFLOW_WORKDIR``, else ``./.hetflow``."""
    return Path(os.environ.get("HETFLOW_WORKDIR", ".hetflow"))
