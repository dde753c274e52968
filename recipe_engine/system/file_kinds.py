"""The kinds of file no command reads as a file or replaces: devices, FIFOs, sockets, by name."""
from __future__ import annotations

import os
import stat
from pathlib import Path

#: ``stat`` file kinds that are neither a regular file, a directory nor a symbolic link, by name.
SPECIAL_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISSOCK, "a socket"))


def special_kind_of(mode: int) -> str | None:
    """``"a character device"`` etc. for a ``st_mode`` of one of :data:`SPECIAL_KINDS`, else None."""
    return next((name for test, name in SPECIAL_KINDS if test(mode)), None)


def special_kind(target: Path) -> str | None:
    """``"a character device"`` etc. when ``target`` exists and is neither a regular file, a directory nor a
    symbolic link, else None."""
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        return None
    return special_kind_of(mode)
