"""Run model-written Python in a sandbox: one child process per program, never the engine's process.

``run_program(source, limits)`` starts ``python -I -S -B sandbox_child.py`` in a new session, which isolates
itself and then becomes the program (``sandbox_child.py``). What is guaranteed:

* **Always:** a wall-clock limit after which the whole process group, and every process of the sandbox's uid,
  is killed with SIGKILL; RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (one file's size; stdout and stderr go to
  files too, so they are bounded by it and only ``output_bytes`` of each is read back), RLIMIT_NPROC, no core
  files; an environment of PATH and LANG only, HOME and TMPDIR the program's own fresh directory; stdin empty;
  that directory removed afterwards.
* **As root (``isolation() == "namespaces"``), enforced by the kernel:** the program runs under a disposable
  uid (no groups) that owns nothing on the machine, so it cannot delete, change or read the user's files
  (anything not world-readable); PID 1 of its own PID namespace (when it dies, every process it started dies)
  and of its own network namespace (no interface but a down loopback: no network); ``/tmp``, ``/var/tmp``
  and ``/dev/shm`` are fresh tmpfs of ``disk_bytes`` each, so it cannot fill the disk; RLIMIT_NPROC counts
  only its own uid, so a fork bomb stops at ``processes``.
* **Otherwise (``"audit-hook"``):** the same user, so the file and network guards are Python-level only: an
  audit hook refuses sockets, subprocesses, and deleting, renaming or writing outside the program's directory
  (code using ``ctypes`` gets round it); RLIMIT_NPROC is set to the user's current process count plus
  ``processes``. Run code evaluation as root in a container for the kernel-enforced guards.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RecipeError

CHILD = Path(__file__).with_name("sandbox_child.py")
LAUNCH_FAILED = 125
UID_RANGE = (2_000_000_000, 2_100_000_000)  # disposable uids: no account, no file on the machine


@dataclass(frozen=True)
class Limits:
    """Resource limits of one program."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    processes: int = 16
    output_bytes: int = 16 << 10


@dataclass(frozen=True)
class Outcome:
    """What a program did: exit code (negative: killed by that signal), whether the wall clock ran out."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float
    isolation: str
    uid: int  # the disposable uid it ran under (namespaces), else the user's

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def isolation() -> str:
    """``namespaces`` (root: kernel-enforced) or ``audit-hook`` (same user: Python-level guards)."""
    return "namespaces" if os.geteuid() == 0 else "audit-hook"


def uid_processes(uid: int) -> list[int]:
    """Live (not zombie) process ids whose real uid is ``uid`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:  # exited meanwhile
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith("Z"):
                pids.append(int(entry.name))
    return pids


def kill_all(pgid: int, uid: int | None) -> None:
    """SIGKILL the process group, then every process of the disposable uid (one that left the group) until
    none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while uid is not None and time.monotonic() < deadline:  # SIGKILL takes effect asynchronously
        pids = uid_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    if uid is not None and uid_processes(uid):
        raise RecipeError(f"the code sandbox could not kill every process of uid {uid}")


def disposable_uid() -> int:
    """A uid with no account and no running process (the sandbox's kill sweep and NPROC count are its own)."""
    while True:
        uid = random.randrange(*UID_RANGE)
        if not uid_processes(uid):
            return uid


def _config(limits: Limits, home: Path, program: Path) -> dict:
    mode = isolation()
    processes = limits.processes
    if mode != "namespaces":  # NPROC counts every process of the user: allow what runs now, plus the budget
        processes += len(uid_processes(os.getuid()))
    return {"isolate": mode == "namespaces", "program": str(program), "workdir": str(home / "work"),
            "python": os.path.realpath(sys.executable), "prefix": os.path.realpath(sys.base_prefix),
            "uid": disposable_uid() if mode == "namespaces" else os.getuid(), "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
            "disk_bytes": limits.disk_bytes, "processes": processes}


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as handle:
        return handle.read(limit).decode("utf-8", "replace")


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run ``source`` as ``__main__`` in a sandbox and return its ``Outcome`` (the program failing is an outcome;
    the sandbox failing to start raises ``RecipeError``)."""
    home = Path(tempfile.mkdtemp(prefix="recipe-sandbox-"))  # 0700, the engine's own: program, output files
    try:
        program = home / "program.py"
        program.write_text(source, encoding="utf-8")
        (home / "work").mkdir(mode=0o700)
        cfg = _config(limits, home, program)
        start = time.perf_counter()
        with (home / "stdout").open("wb") as out, (home / "stderr").open("wb") as err:
            child = subprocess.Popen([cfg["python"], "-I", "-S", "-B", str(CHILD), json.dumps(cfg)],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=home / "work",
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
            timed_out = False
            try:
                code = child.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            kill_all(child.pid, cfg["uid"] if cfg["isolate"] else None)
            code = child.wait()
        seconds = time.perf_counter() - start
        stdout, stderr = _read(home / "stdout", limits.output_bytes), _read(home / "stderr", limits.output_bytes)
        if code == LAUNCH_FAILED and stderr.startswith("sandbox: "):
            raise RecipeError(f"the code sandbox could not start: {stderr.splitlines()[0][9:]}")
        return Outcome(code, timed_out, stdout, stderr, seconds, "namespaces" if cfg["isolate"] else "audit-hook",
                       cfg["uid"])
    finally:
        shutil.rmtree(home, ignore_errors=True)

