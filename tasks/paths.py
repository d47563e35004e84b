"""Directories and files hetflow creates for itself: private to the user, whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: Path) -> Path:
    """Create ``path`` and any missing parents readable only by this user, whatever the umask."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o700)
    if path not in missing:
        os.chmod(path, 0o700)
    return path
