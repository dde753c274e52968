"""The sandbox's launcher: a fresh interpreter (``python -I -S -B sandbox_child.py CONFIG``) that isolates itself,
then replaces itself with the program. Run as a script by ``sandbox.py``, never imported by the engine.

As root (``isolate: true``): new mount, network and PID namespaces; fresh size-limited tmpfs over ``/tmp``,
``/var/tmp`` and ``/dev/shm``; a fresh ``/proc``; the interpreter's prefix made reachable while the rest of any
private ancestor (e.g. ``/root``) is hidden behind an empty tmpfs; then the resource limits, and the program runs
as PID 1 of its namespace under a disposable uid with no groups, in ``/tmp/sandbox`` (its home).
Otherwise: the resource limits and an audit hook only (see ``sandbox.py``). Exit code 125 = the launcher
failed (the message is on stderr after ``sandbox:``), never the program.
"""
import ctypes
import json
import os
import resource
import stat
import sys

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 32, 4096, 16384, 1 << 18, 2
WORK = "/tmp/sandbox"
LAUNCH_FAILED = 125

# Same-user mode: refuse sockets, and deleting / writing / renaming outside the working directory. Python-level
# only (ctypes gets round it): the kernel-enforced mode is the root one.
AUDIT_PRELUDE = """
import os as _o, sys as _s
_root = _o.path.realpath(_o.getcwd())
def _inside(p):
    try:
        return _o.path.realpath(_o.fsdecode(p)).startswith(_root + _o.sep)
    except Exception:
        return False
def _hook(event, args):
    if event.startswith('socket.') or event in ('os.system', 'subprocess.Popen', 'os.exec', 'os.posix_spawn'):
        raise PermissionError('sandbox: ' + event + ' refused')
    if event in ('os.remove', 'os.rmdir', 'os.rename', 'os.truncate', 'os.chmod', 'os.chown', 'shutil.rmtree'):
        if not _inside(args[0]) or (event == 'os.rename' and not _inside(args[1])):
            raise PermissionError('sandbox: ' + event + ' outside the sandbox refused')
    if event == 'open' and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or 'r', args[2] or 0
        if (any(c in str(mode) for c in 'wax+') or flags & (_o.O_WRONLY | _o.O_RDWR)) and not _inside(args[0]):
            raise PermissionError('sandbox: writing outside the sandbox refused')
_s.addaudithook(_hook)
del _hook
__name__ = '__main__'
exec(compile(open('program.py').read(), 'program.py', 'exec'))
"""

libc = ctypes.CDLL(None, use_errno=True)


def fail(message: str) -> None:
    sys.stderr.write(f"sandbox: {message}\n")
    os._exit(LAUNCH_FAILED)


def call(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        fail(f"{what}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None) -> None:
    call(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                    data.encode() if data else None), f"mount {target}")


def private_ancestor(path: str) -> str | None:
    """The outermost ancestor of ``path`` that others cannot search (e.g. ``/root``), else None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def reach_prefix(prefix: str) -> None:
    """Hide a private ancestor of the interpreter's prefix behind an empty tmpfs, the prefix bound back read-only."""
    hidden = private_ancestor(prefix)
    if hidden is None:
        return
    stage = "/tmp/.prefix"
    os.mkdir(stage)
    mount(prefix, stage, None, MS_BIND | MS_REC)
    mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.makedirs(prefix, exist_ok=True)
    mount(stage, prefix, None, MS_BIND | MS_REC)
    mount("none", prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    call(libc.umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
    os.rmdir(stage)


def isolate(cfg: dict, source: str) -> None:
    """In the new namespaces (this process is PID 1 there): fresh tmpfs dirs, /proc, the program's directory."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    size = f"size={cfg['disk_bytes']}"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size + ",mode=0755")
    for path in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, size + ",mode=1777")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    reach_prefix(cfg["prefix"])
    os.mkdir(WORK, 0o700)
    with open(f"{WORK}/program.py", "w", encoding="utf-8") as handle:
        handle.write(source)
    os.chown(f"{WORK}/program.py", cfg["uid"], cfg["uid"])
    os.chown(WORK, cfg["uid"], cfg["uid"])
    os.chdir(WORK)


def limit(cfg: dict) -> None:
    for name, value in (("RLIMIT_CPU", cfg["cpu_s"]), ("RLIMIT_AS", cfg["memory_bytes"]),
                        ("RLIMIT_FSIZE", cfg["file_bytes"]), ("RLIMIT_NPROC", cfg["processes"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with open(cfg["program"], encoding="utf-8") as handle:
        source = handle.read()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if not cfg["isolate"]:
        os.chdir(cfg["workdir"])
        limit(cfg)
        env.update(HOME=cfg["workdir"], TMPDIR=cfg["workdir"])
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", AUDIT_PRELUDE], env)
    call(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare (mount, network, PID namespaces)")
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    isolate(cfg, source)
    limit(cfg)
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    env.update(HOME=WORK, TMPDIR=WORK)
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "program.py"], env)


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        fail(str(exc))
