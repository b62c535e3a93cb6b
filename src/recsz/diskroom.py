"""A filesystem without room for what recsz writes (a full disk, a user's quota): its
``errno``s, and the error that names the path and the room left, which a write's own error
does not (a file's ``write`` names no file; torch's checkpoint writer says only "unexpected
pos")."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

#: The ``errno``s of a filesystem without room: the same command line fails the same way
#: until someone makes room (bad input to the launcher: no restart).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def free(path: Path) -> float:
    """The bytes free on the filesystem of ``path`` (a file there, or to be); infinite
    where it says no size at all (a FUSE mount's statistics may be zeros)."""
    usage = shutil.disk_usage(path.parent)
    return usage.free if usage.total else float("inf")


def no_room(path: Path, message: str) -> OSError:
    """An ``OSError`` (``errno`` ENOSPC) saying that ``path``'s filesystem has no room for
    it, and how much it has."""
    free = shutil.disk_usage(path if path.is_dir() else path.parent).free
    e = OSError(f"cannot write {path}: {message} ({free / 2**20:.1f} MB free on its filesystem)")
    e.errno = errno.ENOSPC
    return e


def full(path: Path, e: OSError) -> OSError | None:
    """Where ``e`` (writing ``path``) says its filesystem is full, :func:`no_room` of
    ``path``; else None."""
    return no_room(path, "no space left on device") if e.errno in NO_ROOM else None
