"""The SQLite store's journal mode follows the file system it lives on (WAL is unsafe on NFS, Lustre, GPFS)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hetflow import filesystem
from hetflow.filesystem import journal_mode, mount_type
from hetflow.store import Store

# /proc/self/mountinfo of a login node: local root, NFS home, Lustre scratch, GPFS project, a tmpfs,
# a mount point with a space (written \040) and a local disk mounted over part of the NFS tree.
CLUSTER = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
30 22 0:40 / /home rw,relatime shared:20 - nfs4 fs1:/export/home rw,vers=4.2
31 22 0:41 / /lustre/orion rw,relatime shared:21 - lustre 10.0.0.1@o2ib:/orion rw,flock
32 22 0:42 / /gpfs/alpine rw,relatime shared:22 master:3 - gpfs alpine rw
33 22 0:43 / /tmp rw,nosuid,nodev shared:23 - tmpfs tmpfs rw
34 22 0:44 / /mnt/my\\040data rw,relatime - nfs srv:/data rw
35 30 259:3 / /home/alice/local rw,relatime shared:24 - xfs /dev/nvme1n1 rw
36 22 0:45 / /beegfs rw - beegfs beegfs_nodev rw
37 22 0:46 / /cifs rw - cifs //srv/share rw
38 22 0:47 / /sshfs rw - fuse.sshfs alice@host: rw
"""


@pytest.mark.parametrize("path, fstype, mode", [
    ("/home/alice/work/hetflow.db", "nfs4", "DELETE"),
    ("/home", "nfs4", "DELETE"),
    ("/homework/hetflow.db", "ext4", "WAL"),  # a prefix of the name is not a parent directory
    ("/home/alice/local/w/hetflow.db", "xfs", "WAL"),  # the longest mount point wins
    ("/lustre/orion/proj/hetflow.db", "lustre", "DELETE"),
    ("/gpfs/alpine/p/hetflow.db", "gpfs", "DELETE"),  # optional fields before the '-' are skipped
    ("/mnt/my data/hetflow.db", "nfs", "DELETE"),
    ("/beegfs/x.db", "beegfs", "DELETE"),
    ("/cifs/x.db", "cifs", "DELETE"),
    ("/tmp/w/hetflow.db", "tmpfs", "WAL"),
    ("/var/w/hetflow.db", "ext4", "WAL"),
    ("/sshfs/x.db", "fuse.sshfs", "WAL"),
])
def test_mount_type_and_journal_mode(path: str, fstype: str, mode: str) -> None:
    assert mount_type(path, CLUSTER) == fstype
    assert journal_mode(mount_type(path, CLUSTER)) == mode


def test_the_later_of_two_mounts_on_one_point_wins_and_no_mount_means_wal() -> None:
    stacked = CLUSTER + "40 30 0:50 / /home rw - ext4 /dev/sdb1 rw\n"
    assert mount_type("/home/bob/hetflow.db", stacked) == "ext4"
    assert mount_type("/x", "") is None and journal_mode(None) == "WAL"
    assert journal_mode("fuse.lustre") == "DELETE"


def _journal(store: Store) -> str:
    with store.engine.connect() as conn:
        return str(conn.exec_driver_sql("PRAGMA journal_mode").scalar())


def test_a_store_on_a_local_disk_keeps_wal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hetflow.store"):
        store = Store.for_workdir(tmp_path)
        assert store.journal_mode == "WAL" and _journal(store) == "wal"
        store.close()
    assert not [r for r in caplog.records if "shared file system" in r.message]


def test_a_store_on_nfs_uses_the_rollback_journal_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """This host's mountinfo, with the test's directory mounted over by NFS (no NFS server here)."""
    real = Path(filesystem.MOUNTINFO).read_text()
    info = tmp_path / "mountinfo"
    point = str(tmp_path.resolve()).replace(" ", "\\040")
    info.write_text(real + f"999 22 0:99 / {point} rw,relatime - nfs4 fs1:/export rw\n")
    monkeypatch.setattr(filesystem, "MOUNTINFO", str(info))
    with caplog.at_level(logging.WARNING, logger="hetflow.store"):
        store = Store.for_workdir(tmp_path / "w")
        assert store.journal_mode == "DELETE" and _journal(store) == "delete"
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        store.close()
    warned = [r.getMessage() for r in caplog.records if "shared file system" in r.getMessage()]
    assert len(warned) == 1 and "nfs4" in warned[0] and "--db postgresql+psycopg://" in warned[0], warned
    assert not (tmp_path / "w" / "hetflow.db-wal").exists()
