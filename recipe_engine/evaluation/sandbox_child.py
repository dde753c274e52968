"""The sandbox's launcher: a fresh interpreter (``python -I -S -B sandbox_child.py CONFIG``) that isolates itself,
then runs the program under the harness. Run as a script by ``sandbox.py``, never imported by the engine.

Namespace modes (``namespaces`` as root, ``user-namespaces`` as another user): the launcher joins the run's
cgroups, unshares mount, network, PID, IPC and UTS namespaces (and a user namespace when not root) and forks the
program's PID 1, which builds a root of its own and ``pivot_root``s into it:

* a read-only tmpfs holding read-only binds of the system directories (``/usr``, ``/etc``, the merged-``/usr``
  links, the interpreter's prefix and any extra readable path), a ``/dev`` of ``null``, ``zero``, ``full``,
  ``random``, ``urandom``, a fresh ``/proc``; no ``/run``, ``/var``, ``/home``, ``/sys`` or user directory;
* the only writable places: ``/tmp`` and ``/dev/shm``, fresh tmpfs of ``disk_bytes`` each;

then sets the resource limits, ``no_new_privs``, takes the program's identity (a disposable uid with no groups
as root; inside its user namespace a non-zero uid, so the exec drops every capability) and execs the harness.
Both the launcher and PID 1 die with their parent (``PR_SET_PDEATHSIG``); when PID 1 dies the kernel kills
every process of its namespace.

``audit-hook`` (only when the user asks for it by name): the same user and file system; the limits, an audit
hook and a subreaper that kills whatever the program left behind. Python-level only: not a boundary.

The harness runs the program as ``__main__`` in fresh globals and writes the verdict nonce (read from a pipe
it then closes) to the verdict descriptor only after the program's last statement returned; any exception,
``SystemExit`` included, or an exit of any kind before that, leaves no nonce. Exit code 125 = the launcher
failed (the message is on stderr after ``sandbox:``), never the program.
"""
import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 32, 4096, 16384, 1 << 18, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
INNER_UID = 1000  # the program's uid inside its user namespace: not 0, so its exec keeps no capability
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
NEW_ROOT, WORK = "/tmp", "/tmp/sandbox"
LAUNCH_FAILED = 125

# The harness: argv[1] the nonce's pipe, argv[2] the verdict descriptor. The program sees neither the nonce nor
# these names: it runs in fresh globals, with sys.argv = ['program.py'].
HARNESS = """
import os as _os, sys as _sys
def _harness(nonce_fd, verdict_fd, guard):
    nonce = _os.read(nonce_fd, 64)
    _os.close(nonce_fd)
    _sys.argv[:] = ['program.py']
    with open('program.py', encoding='utf-8') as handle:
        code = compile(handle.read(), 'program.py', 'exec')
    namespace = {'__name__': '__main__', '__builtins__': __builtins__}
    if guard is not None:
        guard()
    status = None
    try:
        exec(code, namespace)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    for stream in (_sys.stdout, _sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if status is None:
        _os.write(verdict_fd, nonce)
    _os._exit(status or 0)
_fds = [int(a) for a in _sys.argv[1:3]]
del _sys.argv[1:]
"""

# audit-hook mode: refuse sockets, processes, signals, frames and writes outside the working directory.
AUDIT_GUARD = """
def _guard():
    import os, sys
    root = os.path.realpath(os.getcwd())
    def inside(p):
        try:
            return (isinstance(p, (str, bytes, os.PathLike))
                    and os.path.realpath(os.fsdecode(p)).startswith(root + os.sep))
        except Exception:
            return False
    refused = ('socket.', 'os.system', 'subprocess.Popen', 'os.exec', 'os.posix_spawn', 'os.spawn', 'os.fork',
               'os.forkpty', 'os.kill', 'os.killpg', 'signal.pthread_kill', 'os.setsid', 'ctypes.', 'gc.get_',
               'os.link', 'os.symlink', 'os.chdir', 'os.fchdir', 'mmap.')
    dir_fds = {'os.remove': (1,), 'os.rmdir': (1,), 'os.rename': (2, 3), 'os.chmod': (2,), 'os.chown': (3,),
               'os.mkdir': (2,), 'os.utime': (3,), 'shutil.rmtree': (1,), 'os.truncate': (), 'os.chflags': (),
               'os.setxattr': (), 'os.removexattr': ()}
    modules = ('_posixsubprocess', 'subprocess', 'multiprocessing', 'ctypes', '_ctypes', 'pty', 'socket', '_socket')
    def hook(event, args):
        if event == 'import' and args[0].split('.')[0] in modules:
            raise PermissionError('sandbox: import ' + args[0] + ' refused')
        if event.startswith(refused):
            raise PermissionError('sandbox: ' + event + ' refused')
        if event in dir_fds and (not inside(args[0]) or event == 'os.rename' and not inside(args[1])
                                 or any(args[i] not in (None, -1) for i in dir_fds[event] if i < len(args))):
            raise PermissionError('sandbox: ' + event + ' outside the sandbox refused')
        if event == 'open' and args[0] is not None and not isinstance(args[0], int):
            mode, flags = args[1] or 'r', args[2] or 0
            writes = any(c in str(mode) for c in 'wax+') or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and not inside(args[0]) or not inside(args[0]) and os.path.isdir(args[0]):
                raise PermissionError('sandbox: writing outside the sandbox, or a directory outside it, refused')
    sys.addaudithook(hook)
_harness(*_fds, _guard)
"""

libc = ctypes.CDLL(None, use_errno=True)


def fail(message: str) -> None:
    sys.stderr.write(f"sandbox: {message}\n")
    sys.stderr.flush()
    os._exit(LAUNCH_FAILED)


def call(rc: int, what: str) -> None:
    if rc != 0:
        fail(f"{what}: {os.strerror(ctypes.get_errno())}")


def prctl(option: int, value: int) -> None:
    call(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def mount(source, target, fstype, flags, data=None) -> None:
    call(libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                    ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def kept_flags(path: str) -> int:
    """The mount flags of ``path``'s mount that a remount must keep (the kernel locks them in a user namespace)."""
    flags = os.statvfs(path).f_flag
    kept = flags & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return kept | (MS_RELATIME if flags & os.ST_RELATIME else 0)


def bind_read_only(path: str) -> None:
    """Bind ``path`` (and the mounts under it) at the same place in the new root, read-only."""
    target = NEW_ROOT + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    mount(path, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept_flags(path))


def build_root(cfg: dict, source: str) -> None:
    """PID 1 of the new namespaces: a root of read-only system directories and fresh tmpfs, then pivot into it."""
    os.umask(0o022)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    bound: list[str] = []
    for path in (*SYSTEM_PATHS, cfg["prefix"], *cfg["readable"]):
        if os.path.islink(path) and os.path.dirname(path) == "/":
            os.symlink(os.readlink(path), NEW_ROOT + path)
        elif os.path.exists(path) and not any(path == b or path.startswith(b + "/") for b in bound):
            bind_read_only(path)
            bound.append(path)
    os.mkdir(NEW_ROOT + "/dev", 0o755)
    mount("tmpfs", NEW_ROOT + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        open(f"{NEW_ROOT}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{NEW_ROOT}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    size = f"size={cfg['disk_bytes']}"
    for path in ("/tmp", "/dev/shm"):
        os.mkdir(NEW_ROOT + path, 0o755)
        mount("tmpfs", NEW_ROOT + path, "tmpfs", MS_NOSUID | MS_NODEV, size + ",mode=1777")
    mount(None, NEW_ROOT + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(NEW_ROOT + "/proc", 0o555)
    mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(NEW_ROOT)
    call(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    call(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.mkdir(WORK, 0o700)
    with open(f"{WORK}/program.py", "w", encoding="utf-8") as handle:
        handle.write(source)
    if cfg["mode"] == "namespaces":
        os.chown(f"{WORK}/program.py", cfg["uid"], cfg["uid"])
        os.chown(WORK, cfg["uid"], cfg["uid"])
    os.chdir(WORK)


def limit(cfg: dict) -> None:
    for name, value in (("RLIMIT_CPU", cfg["cpu_s"]), ("RLIMIT_AS", cfg["memory_bytes"]),
                        ("RLIMIT_FSIZE", cfg["file_bytes"]), ("RLIMIT_NPROC", cfg["processes"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def die_with(parent_alive_fd: int) -> None:
    """Be SIGKILLed when the parent dies; exit now if it is already gone (its end of the pipe closed)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_alive_fd is not None and select.select([parent_alive_fd], [], [], 0)[0]:
        os._exit(LAUNCH_FAILED)


def join_cgroups(cfg: dict) -> None:
    for directory in cfg["cgroups"]:
        with open(os.path.join(directory, "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))


def harness_argv(cfg: dict, guard: bool) -> list[str]:
    tail = AUDIT_GUARD if guard else "_harness(*_fds, None)\n"
    return [cfg["python"], "-I", "-S", "-B", "-c", HARNESS + tail, str(cfg["nonce_fd"]), str(cfg["verdict_fd"])]


def exit_like(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def run_audit_hook(cfg: dict, env: dict) -> None:
    """Same user: a subreaper parent that kills every process the program left once it has exited."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    pid = os.fork()
    if pid == 0:
        os.chdir(cfg["workdir"])
        limit(cfg)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.execve(cfg["python"], harness_argv(cfg, guard=True), env)
    _, status = os.waitpid(pid, 0)
    for fd in (cfg["nonce_fd"], cfg["verdict_fd"]):
        os.close(fd)
    while True:  # orphans of the program are reparented to this subreaper: kill and reap them
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid()]
        if not children:
            break
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            break
    exit_like(status)


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with(None)
    if os.getppid() != cfg["engine_pid"]:  # the engine died before the death signal was set
        os._exit(LAUNCH_FAILED)
    join_cgroups(cfg)
    with open(cfg["program"], encoding="utf-8") as handle:
        source = handle.read()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if cfg["mode"] == "audit-hook":
        env.update(HOME=cfg["workdir"], TMPDIR=cfg["workdir"])
        run_audit_hook(cfg, env)
    outer_uid, outer_gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    user = cfg["mode"] == "user-namespaces"
    call(libc.unshare(flags | (CLONE_NEWUSER if user else 0)), "unshare (user, mount, network, PID namespaces)"
         if user else "unshare (mount, network, PID namespaces)")
    if user:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_UID} {outer_uid} 1"),
                           ("gid_map", f"{INNER_UID} {outer_gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
    alive_read, alive_write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(alive_read)
        for fd in (cfg["nonce_fd"], cfg["verdict_fd"]):
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        exit_like(status)
    os.close(alive_write)
    die_with(alive_read)
    build_root(cfg, source)
    limit(cfg)
    if not user:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    die_with(alive_read)  # a change of identity clears the death signal: set it again, then check the launcher
    os.close(alive_read)
    env.update(HOME=WORK, TMPDIR=WORK)
    os.execve(cfg["python"], harness_argv(cfg, guard=False), env)


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        fail(str(exc))
