"""Temporary directories of our own making, and signals that end a run without leaving them behind.

Everything we write goes first to a temporary directory (``.NAME.tmp-XXXX`` beside its destination) made by
:func:`temporary_directory`: it holds a marker file (:data:`MARKER`, ``{"state": "writing", "pid", "host"}``)
and is registered in this process for the duration. :func:`sweep_stale` removes such directories whose
process is gone (killed with SIGKILL, power loss), with a note; a directory matching the pattern without our
marker is only mentioned, never removed.

SIGINT, SIGTERM and SIGHUP are handled alike while :func:`handle_signals` is active: the first one raises
:class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, so every ``finally`` removes what it was
writing and the CLI exits with ``128 + signal``. The main thread only notices a signal between Python
bytecodes; a long native call (a large ``torch.linalg`` solve) could delay that by tens of seconds, so a
watchdog thread woken by ``signal.set_wakeup_fd`` gives the main thread ``grace_s`` seconds and then removes
the registered temporary directories itself and ends the process with the same exit code (a second signal
does so at once).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from ..errors import note_signal

MARKER = ".recipe_engine.json"
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# process-wide by nature: signals are delivered to the process, so what to remove on one is too
_ACTIVE: set[Path] = set()
_LOCK = threading.Lock()


class Interrupted(KeyboardInterrupt):
    """A run ended by SIGINT, SIGTERM or SIGHUP; exit code ``128 + signum``."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def process_identity() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), so a reused pid is not mistaken for ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_marker(directory: Path, kind: str, state: str) -> None:
    owner = process_identity() if state in ("writing", "replacing") else {}
    record = {"type": kind, "version": 1, "state": state, **owner}
    (directory / MARKER).write_text(json.dumps(record) + "\n")


def read_marker(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@contextlib.contextmanager
def temporary_directory(parent: Path, name: str, kind: str) -> Iterator[Path]:
    """A marked, registered ``parent/.NAME.tmp-XXXX`` directory, removed on exit unless renamed away."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
    with _LOCK:
        _ACTIVE.add(tmp)
    try:
        tmp.chmod(0o755)
        write_marker(tmp, kind, "writing")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with _LOCK:
            _ACTIVE.discard(tmp)


def track(path: Path) -> None:
    """Remove ``path`` too if a signal forces the process out (``_exit_now``), like a temporary directory
    (the resume checkpoints of a live run: only a hard kill leaves them; an output's lock file)."""
    with _LOCK:
        _ACTIVE.add(path)


def untrack(path: Path) -> None:
    with _LOCK:
        _ACTIVE.discard(path)


def process_alive(record: dict) -> bool:
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return True  # another machine's process, or not ours to judge: keep
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return record.get("start") is None or _start_time(record["pid"]) == record.get("start")


def sweep_stale(parent: Path, name: str, note=None, legacy: tuple[str, ...] = ()) -> list[Path]:
    """Remove ``parent/.NAME.tmp-*`` and ``.NAME.old-*`` directories left by a process that is gone.

    An ``.old-`` directory holds the previous output while ``--force`` swaps in the new one; if the run
    died between the two renames, the previous output is put back at ``parent/NAME`` instead of removed.
    ``note`` receives one line per directory removed, restored, or (not ours) left in place. ``legacy``
    globs name temporary directories of earlier versions (no marker): empty ones older than an hour are
    removed, others only mentioned.
    """
    note = note or (lambda line: print(f"note: {line}", file=sys.stderr))
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for pattern in (f".{name}.tmp-*", f".{name}.old-*", *legacy):
        for path in sorted(parent.glob(pattern)):
            try:
                if path.is_dir() and not path.is_symlink() and _sweep_one(path, parent / name, pattern in legacy,
                                                                          note):
                    removed.append(path)
            except OSError as exc:  # a directory we may not read or remove: say so, never fail the run
                note(f"cannot sweep {path}: {exc.strerror or exc}")
    return removed


def _sweep_one(path: Path, target: Path, legacy: bool, note) -> bool:
    record = read_marker(path)
    if record is None and legacy and not any(path.iterdir()) and time.time() - path.stat().st_mtime > 3600:
        path.rmdir()
        note(f"removed empty {path}, left by an interrupted conversion of an earlier version")
        return True
    if record is None or record.get("state") not in ("writing", "replacing"):
        note(f"{path} looks like an interrupted write but has no {MARKER} of ours; not removed")
        return False
    if process_alive(record):
        return False  # a run in progress
    previous = path / "previous"
    if record["state"] == "replacing" and previous.exists() and not target.exists():
        os.replace(previous, target)
        note(f"restored {target} from {path}, left by an interrupted --force run")
    shutil.rmtree(path)
    note(f"removed {path}, left by an interrupted run (pid {record.get('pid', '?')})")
    return True


class SignalScope:
    """What :func:`handle_signals` does with a signal: raise :class:`Interrupted` (the default), or, within
    :meth:`exit_at_once`, end the process with ``128 + signum`` (nothing to clean up there)."""

    def __init__(self):
        self.at_once = False

    @contextlib.contextmanager
    def exit_at_once(self) -> Iterator[None]:
        self.at_once = True
        try:
            yield
        finally:
            self.at_once = False


@contextlib.contextmanager
def handle_signals(grace_s: float = 3.0) -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted`; a watchdog enforces exit within ``grace_s``.

    The signal is also recorded (``errors.received_signal``): a library that swallows the
    :class:`Interrupted` raised inside it and then fails otherwise can be told apart from a real failure.
    Yields a :class:`SignalScope`: within its ``exit_at_once()`` (imports, before anything is written) a
    signal ends the process at once instead of raising inside a library's C++ code, which cannot unwind it.
    Only installs anything in the main thread (signal handlers cannot be set elsewhere).
    """
    scope = SignalScope()
    if threading.current_thread() is not threading.main_thread():
        yield scope
        return
    state = {"signum": None}
    note_signal(None)
    done = threading.Event()

    def handler(signum, _frame):
        if scope.at_once:
            _exit_now(signum)
        if state["signum"] is None:
            state["signum"] = signum
            note_signal(signum)
            raise Interrupted(signum)
        # a second signal while cleaning up: the watchdog ends the process; do not break the cleanup

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {s: signal.signal(s, handler) for s in HANDLED}
    old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watchdog = threading.Thread(target=_watch, args=(read_fd, done, grace_s), daemon=True,
                                name="recipe-signal-watchdog")
    watchdog.start()
    try:
        yield scope
    finally:
        note_signal(None)
        done.set()
        signal.set_wakeup_fd(old_wakeup)
        for s, old in previous.items():
            signal.signal(s, old)
        os.close(write_fd)
        watchdog.join(timeout=1.0)
        if not watchdog.is_alive():
            os.close(read_fd)


def _watch(read_fd: int, done: threading.Event, grace_s: float) -> None:
    first = None
    while True:
        try:
            data = os.read(read_fd, 1)
        except OSError:
            return
        if not data or done.is_set():
            return
        signum = data[0]
        if signum not in HANDLED:
            continue
        if first is None:
            first = signum
            threading.Thread(target=_deadline, args=(signum, done, grace_s), daemon=True).start()
        else:
            _exit_now(first)


def _deadline(signum: int, done: threading.Event, grace_s: float) -> None:
    if not done.wait(grace_s):
        _exit_now(signum)


def _exit_now(signum: int) -> None:
    """Remove every registered temporary directory and end the process with ``128 + signum``."""
    with _LOCK:
        paths = list(_ACTIVE)
    for path in paths:
        for _ in range(5):  # the main thread may still be adding files
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:  # a file: an output's lock (``output_lock``)
                with contextlib.suppress(OSError):
                    path.unlink()
            if not path.exists():
                break
    name = signal.Signals(signum).name
    with contextlib.suppress(OSError):  # a standard error that cannot be written: the exit code says it
        os.write(2, f"interrupted by {name}; nothing written\n".encode())
    os._exit(128 + signum)
