"""One writer per output: an advisory lock file ``PARENT/.NAME.lock`` beside the output ``PARENT/NAME``.

A run that writes an output (``recipe apply``'s directory with its ``.NAME.tmp-*`` and ``.NAME.resume``
siblings, ``recipe sweep``'s directory, ``recipe export``'s file) holds an exclusive ``flock`` on the lock
file from its pre-flight until its output is in place. A second run aimed at the same output is refused in
one line naming the holder (pid and host, written into the file), so it never sweeps, replaces or removes
the first run's temporary files or resume checkpoints.

The kernel releases a ``flock`` when its process ends, however it ends (SIGKILL, the OOM killer), so the
lock of a dead process is free: the next run takes it over (and removes what the dead run left, as
``cleanup.sweep_stale`` and ``resume`` do). The holder removes the file when done; a run that opened the
file just before that removal sees, once it holds the lock, that the path no longer names its file and
opens it again. Locks are per open file, so two runs in one process exclude each other too. ``flock`` is
honoured by local file systems and by NFS v4 (as a POSIX lock); on a file system without locks the lock
cannot be taken and the run is refused with the reason.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Iterator

from ..errors import RecipeError
from ..system.cleanup import track, untrack


def lock_path(output: str | Path) -> Path:
    """``PARENT/.NAME.lock``, the parent resolved (an output reached through a symbolic link or ``..`` is the
    same output)."""
    target = Path(output).expanduser()
    return target.parent.resolve() / f".{target.name}.lock"


@contextlib.contextmanager
def output_lock(output: str | Path, file: str | None = None) -> Iterator[Path]:
    """Hold the output's lock for the duration; a live holder → one-line :class:`RecipeError` (field
    ``output``). The parent directory must exist (the pre-flight created or checked it)."""
    path = lock_path(output)
    created = _make_parents(path.parent, output, file)
    try:
        handle = _acquire(path, output, file)
    except BaseException:
        _remove_empty(created)
        raise
    track(path)
    try:
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        handle.flush()
        yield path
    finally:
        with contextlib.suppress(OSError):
            if _same_file(handle, path):
                path.unlink()
        handle.close()  # releases the lock
        untrack(path)
        _remove_empty(created)


def _make_parents(directory: Path, output, file: str | None) -> list[Path]:
    """Create the missing directories above the output (they are removed again if the run leaves them
    empty: a refused run writes nothing); returns them, deepest first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    try:
        for path in reversed(missing):
            path.mkdir()
    except OSError as exc:
        _remove_empty(missing)
        raise RecipeError(f"cannot create '{path}': {exc.strerror or exc}", file=file, field="output") from None
    return missing


def _remove_empty(directories: list[Path]) -> None:
    for path in directories:  # deepest first
        try:
            path.rmdir()
        except OSError:
            return


def _acquire(path: Path, output, file: str | None):
    fail = lambda message: RecipeError(message, file=file, field="output")
    for _ in range(10):  # the holder may remove the file between our open and our lock: open again
        try:
            handle = open(path, "a+", encoding="utf-8")
        except OSError as exc:
            raise fail(f"cannot create the lock file {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            handle.close()
            raise fail(f"output '{output}' is being written by another run ({holder}); wait for it to finish "
                       f"or choose another --output") from None
        except OSError as exc:
            handle.close()
            raise fail(f"cannot lock {path}: {exc.strerror or exc}") from None
        if _same_file(handle, path):
            handle.seek(0)
            handle.truncate()
            return handle
        handle.close()
    raise fail(f"cannot lock {path}: it keeps being replaced")


def _same_file(handle, path: Path) -> bool:
    try:
        mine, now = os.fstat(handle.fileno()), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _holder(handle) -> str:
    """``pid N on HOST`` from the holder's record (it may not have written it yet)."""
    try:
        handle.seek(0)
        record = json.loads(handle.read() or "{}")
        return f"pid {int(record['pid'])} on {record['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is starting"
