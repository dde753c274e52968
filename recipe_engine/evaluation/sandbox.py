"""Run model-written Python in a sandbox: one child process per program, never the engine's process.

``run_program(source, limits)`` starts ``python -I -S -B sandbox_child.py`` in a new session, which isolates
itself and runs the program under a harness (``sandbox_child.py``). The mode (``isolation()``):

* ``namespaces`` (root) and ``user-namespaces`` (any other user, where the kernel allows unprivileged user
  namespaces), enforced by the kernel: the program is PID 1 of its own PID namespace (every process it starts
  dies with it) and of its own network namespace (no interface but a down loopback, so no network and no
  abstract unix socket); it sees a root of its own: read-only system directories and a fresh ``/proc``, no
  ``/run``, ``/var``, ``/home`` or user file (so no host unix socket file), and only ``/tmp`` and ``/dev/shm``
  writable, fresh tmpfs of ``disk_bytes`` each. It runs under a disposable uid with no groups (root) or a
  non-zero uid of its own user namespace (so no capability), with ``no_new_privs``.
* ``audit-hook``: the same user and file system, Python-level guards only (an audit hook, a subreaper that kills
  what the program leaves). Not a boundary against hostile code; used only when named in ``$RECIPE_SANDBOX``.

Always: a wall-clock limit after which every process of the program is killed, also when the engine is
interrupted (Ctrl-C) or killed (the launcher and the program's PID 1 die with their parent); RLIMIT_CPU,
RLIMIT_AS, RLIMIT_FSIZE (stdout and stderr go to files too, so only ``output_bytes`` of each is read back),
RLIMIT_NPROC, no core files; an environment of PATH, LANG, HOME and TMPDIR only; stdin empty. The memory limit
holds for the whole program through a cgroup (v2, or v1's memory and pids controllers) where the engine may
create one; elsewhere the program is limited to one process, so the per-process limit is the whole program's.

**The verdict**: ``passed`` only when the harness wrote the run's nonce (read from a pipe the program never
sees, then closed) to a descriptor after the program's last statement returned; an exception, ``SystemExit``,
``os._exit`` anywhere (a thread, a signal handler, a profile hook), or a timeout leaves no nonce. A program
written to find the nonce in its own memory could forge it, as it could fool OpenAI's ``check_correctness``.
"""
from __future__ import annotations

import functools
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RecipeError
from ..system.cleanup import sweep_stale, temporary_directory

CHILD = Path(__file__).with_name("sandbox_child.py")
LAUNCH_FAILED = 125
UID_RANGE = (2_000_000_000, 2_100_000_000)  # disposable uids: no account, no file on the machine
MODE_ENV = "RECIPE_SANDBOX"  # "audit-hook": the weaker same-user mode, by name


@dataclass(frozen=True)
class Limits:
    """Resource limits of one program; ``readable``: extra paths bound read-only into its file system."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    processes: int = 16
    output_bytes: int = 16 << 10
    readable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What a program did: exit code (negative: killed by that signal), whether the wall clock ran out, whether
    it ran to its end (the harness's nonce arrived), the mode and how memory was limited."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float
    isolation: str
    uid: int  # the disposable uid it ran under (namespaces), else the user's
    completed: bool = False
    memory_limit: str = ""

    @property
    def passed(self) -> bool:
        return self.completed and not self.timed_out


@functools.cache
def isolation() -> str:
    """The mode programs run in: ``namespaces`` (root), ``user-namespaces`` (another user, where the kernel
    allows it) or ``audit-hook`` (only when ``$RECIPE_SANDBOX=audit-hook``). Raises ``RecipeError`` (one line)
    when no kernel-enforced mode works and the weaker one was not asked for."""
    asked = os.environ.get(MODE_ENV, "").strip()
    if asked not in ("", "audit-hook"):
        raise RecipeError(f"{MODE_ENV}={asked!r}: the only mode that can be asked for by name is 'audit-hook'")
    if asked == "audit-hook":
        return "audit-hook"
    if os.geteuid() == 0:
        return "namespaces"
    reason = _probe("user-namespaces")
    if reason:
        raise RecipeError(f"the code sandbox needs user namespaces, which this system refuses ({reason}); "
                          f"set {MODE_ENV}=audit-hook to run model-written code with Python-level guards only "
                          f"(not a boundary against hostile code; docs/evaluation.md), or run as root")
    return "user-namespaces"


def _probe(mode: str) -> str | None:
    """Why a trivial program cannot run in ``mode``, or None when it ran to its end."""
    try:
        outcome = _run(mode, "pass", Limits(wall_s=30))
    except RecipeError as exc:
        return str(exc)
    return None if outcome.passed else f"a trivial program did not complete: {outcome.stderr.strip()[-200:]}"


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
    """SIGKILL the launcher's process group (the program's PID 1 dies with the launcher, and its namespace with
    it), then every process of the disposable uid until none is left."""
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


def _cgroup_mounts() -> dict[str, str]:
    """Mount points of the cgroup hierarchies: ``"2"`` for cgroup v2, else each v1 controller's name."""
    mounts = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("2", fields[4])
            elif fstype == "cgroup":
                for controller in ("memory", "pids"):
                    if controller in options:
                        mounts.setdefault(controller, fields[4])
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy (``"2"`` for v2, else the v1 controller)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            paths["2"] = path
        for controller in controllers.split(","):
            if controller in ("memory", "pids"):
                paths[controller] = path
    return paths


def _write(path: Path, value: int | str) -> None:
    path.write_text(str(value))


def make_cgroups(limits: Limits) -> list[Path]:
    """Fresh cgroups below this process's own, limiting the whole program's memory and process count: v2 where
    its parent delegates ``memory`` and ``pids``, else v1's memory and pids controllers; ``[]`` where neither
    can be created (the caller then limits the program to one process)."""
    mounts, own, name = _cgroup_mounts(), _own_cgroups(), f"recipe-sandbox-{secrets.token_hex(6)}"
    made: list[Path] = []
    try:
        if "2" in mounts and "2" in own:
            parent = Path(mounts["2"] + own["2"])
            if {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
                group = parent / name
                group.mkdir()
                made.append(group)
                _write(group / "memory.max", limits.memory_bytes)
                if (group / "memory.swap.max").exists():
                    _write(group / "memory.swap.max", 0)
                _write(group / "pids.max", limits.processes)
                return made
        if {"memory", "pids"} <= mounts.keys() & own.keys():
            for controller in ("memory", "pids"):
                group = Path(mounts[controller] + own[controller].rstrip("/")) / name
                group.mkdir()
                made.append(group)
            _write(made[0] / "memory.limit_in_bytes", limits.memory_bytes)
            if (made[0] / "memory.memsw.limit_in_bytes").exists():
                _write(made[0] / "memory.memsw.limit_in_bytes", limits.memory_bytes)
            _write(made[1] / "pids.max", limits.processes)
            return made
    except OSError:
        remove_cgroups(made)
    return []


def remove_cgroups(groups: list[Path]) -> None:
    """Remove the run's cgroups (their processes are gone or going: retried for up to 5 s)."""
    deadline = time.monotonic() + 5.0
    for group in reversed(groups):
        while True:
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RecipeError(f"the code sandbox could not remove its cgroup {group}") from None
                time.sleep(0.01)


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as handle:
        return handle.read(limit).decode("utf-8", "replace")


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run ``source`` as ``__main__`` in a sandbox and return its ``Outcome`` (the program failing is an outcome;
    the sandbox failing to start, or no mode being available, raises ``RecipeError``)."""
    return _run(isolation(), source, limits)


def _run(mode: str, source: str, limits: Limits) -> Outcome:
    """The program's own directory: ``$TMPDIR/.recipe-sandbox.tmp-XXXX``, marked and removed on exit; one left by
    an engine that was killed outright is swept by the next run."""
    sweep_stale(Path(tempfile.gettempdir()), "recipe-sandbox", note=lambda line: None)
    with temporary_directory(Path(tempfile.gettempdir()), "recipe-sandbox", "sandbox") as home:
        home.chmod(0o700)  # the engine's own: the program, its output files
        return _run_in(home, mode, source, limits)


def _run_in(home: Path, mode: str, source: str, limits: Limits) -> Outcome:
    groups = make_cgroups(limits)
    nonce = secrets.token_hex(16).encode()
    nonce_read, nonce_write = os.pipe()
    verdict_read, verdict_write = os.pipe()
    os.write(nonce_write, nonce)
    os.close(nonce_write)
    child, uid = None, os.getuid()
    try:
        work = home / "work"
        work.mkdir(mode=0o700)
        program = work / "program.py"
        program.write_text(source, encoding="utf-8")
        uid = disposable_uid() if mode == "namespaces" else os.getuid()
        cfg = {"mode": mode, "program": str(program), "workdir": str(work),
               "python": os.path.realpath(sys.executable), "prefix": os.path.realpath(sys.base_prefix),
               "readable": [os.path.realpath(p) for p in limits.readable], "uid": uid, "cpu_s": limits.cpu_s,
               "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
               "disk_bytes": limits.disk_bytes, "processes": limits.processes if groups else 1,
               "cgroups": [str(g) for g in groups], "engine_pid": os.getpid(),
               "nonce_fd": nonce_read, "verdict_fd": verdict_write}
        if mode == "audit-hook":  # NPROC counts every process of the user: allow what runs now, plus the budget
            cfg["processes"] += len(uid_processes(os.getuid()))
        start = time.perf_counter()
        with (home / "stdout").open("wb") as out, (home / "stderr").open("wb") as err:
            child = subprocess.Popen([cfg["python"], "-I", "-S", "-B", str(CHILD), json.dumps(cfg)],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
                                     pass_fds=(nonce_read, verdict_write))
            os.close(verdict_write)
            verdict_write = -1
            timed_out = False
            try:
                code = child.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            kill_all(child.pid, uid if mode == "namespaces" else None)
            code = child.wait()
            child = None
        seconds = time.perf_counter() - start
        os.set_blocking(verdict_read, False)
        try:
            verdict = os.read(verdict_read, 1 << 16)
        except BlockingIOError:
            verdict = b""
        stdout, stderr = _read(home / "stdout", limits.output_bytes), _read(home / "stderr", limits.output_bytes)
        if code == LAUNCH_FAILED and stderr.startswith("sandbox: "):
            raise RecipeError(f"the code sandbox could not start: {stderr.splitlines()[0][9:]}")
        return Outcome(code, timed_out, stdout, stderr, seconds, mode, uid, nonce in verdict,
                       "cgroup" if groups else "per process, one process")
    finally:
        if child is not None:  # interrupted (Ctrl-C) or failed while the program ran: kill it before leaving
            kill_all(child.pid, uid if mode == "namespaces" else None)
            child.wait()
        for fd in (nonce_read, verdict_read, verdict_write):
            if fd >= 0:
                os.close(fd)
        remove_cgroups(groups)
