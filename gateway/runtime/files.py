"""Durable, private file replacement shared by every state file the gateway keeps
(the UPR front's log metadata and manifest, the TAP front's registry).

A rename is durable only once its directory is fsynced; state files name
clients and positions, so they are created 0600 whatever the umask.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the renames and creations in directory ``path`` survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (0600): a crash leaves the old or the new file, whole."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as handle:
        os.fchmod(fd, 0o600)  # also over an older temporary file left with other modes
        handle.write(data)
        handle.flush()
        os.fsync(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
