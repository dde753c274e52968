"""The code sandbox (``evaluation/sandbox.py``): each hostile program fails inside it and leaves nothing behind.

Every program is bounded (≤ 200 forks, ≤ 200 MiB written, limits of a few seconds) so a broken sandbox cannot
hurt the machine. Run as root, the file also runs itself as an unprivileged user (``nobody``), so both kernel-
enforced modes (``namespaces``, ``user-namespaces``) are tested in CI; the ``audit-hook`` mode, asked for by name,
is tested for what it refuses.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from recipe_engine.errors import RecipeError
from recipe_engine.evaluation import sandbox
from recipe_engine.evaluation.sandbox import Limits, isolation, run_program, uid_processes

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")
pytestmark = linux_only


@pytest.fixture
def canary(tmp_path):
    """A 0600 file in the user's temporary directory, and one in a world-searchable directory."""
    inside = tmp_path / "canary.txt"
    inside.write_text("secret-canary")
    inside.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    outside = shared / "canary.txt"
    outside.write_text("secret-canary")
    outside.chmod(0o644)  # even a world-readable file: the program's file system does not hold it
    return [inside, outside]


@pytest.fixture
def audit_hook_mode(monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "audit-hook")
    isolation.cache_clear()
    yield
    isolation.cache_clear()


def left_behind(outcome) -> list[int]:
    return uid_processes(outcome.uid) if outcome.isolation == "namespaces" else []


def test_a_passing_and_a_failing_program():
    passed = run_program("assert sum(range(4)) == 6\nprint('ok')")
    assert passed.passed and passed.completed and passed.stdout == "ok\n"
    assert passed.isolation == ("namespaces" if ROOT else "user-namespaces")
    failed = run_program("assert 1 == 2")
    assert not failed.passed and "AssertionError" in failed.stderr
    stopped = run_program("print(1)\nraise SystemExit(0)")
    assert stopped.returncode == 0 and stopped.stdout == "1\n" and not stopped.passed


WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\ncheck(add)\n"

#: Each trick exits 0 (or tries to) before a wrong program's asserts fail: (name, code before the function,
#: code inside its body). OpenAI's check_correctness fails every one; so must the sandbox.
EARLY_EXITS = [
    ("raise SystemExit at module level", "raise SystemExit\n", ""),
    ("sys.exit() at module level", "import sys\nsys.exit()\n", ""),
    ("sys.exit(256) at module level", "import sys\nsys.exit(256)\n", ""),
    ("os._exit(0) in the body", "import os\n", "    os._exit(0)\n"),
    ("os._exit(0) at module level", "import os\nos._exit(0)\n", ""),
    ("raise SystemExit in the body", "", "    raise SystemExit(0)\n"),
    ("os._exit(0) in a thread", "import os, threading, time\n",
     "    threading.Thread(target=os._exit, args=(0,)).start()\n    time.sleep(2)\n"),
    ("a SIGALRM handler", "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
     "signal.setitimer(signal.ITIMER_REAL, 0.05)\n", "    time.sleep(2)\n"),
    ("a profile hook", "import os, sys\nsys.setprofile(lambda f, e, a: os._exit(0) if f.f_code.co_name == 'check'"
     " else None)\n", ""),
    ("an atexit hook", "import atexit, os\natexit.register(os._exit, 0)\n", ""),
    ("sys.excepthook", "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n", ""),
    ("a trace hook", "import os, sys\nsys.settrace(lambda f, e, a: os._exit(0) if e == 'exception' else None)\n",
     ""),
]


def with_trick(function: str, before: str, body: str) -> str:
    header, rest = function.split("\n", 1)
    return before + header + "\n" + body + rest + CHECK


@pytest.mark.parametrize("name, before, body", EARLY_EXITS, ids=[case[0] for case in EARLY_EXITS])
def test_a_wrong_program_that_exits_early_fails(name, before, body):
    outcome = run_program(with_trick(WRONG, before, body), Limits(wall_s=10))
    assert not outcome.passed and not outcome.completed, (name, outcome)


def test_a_right_program_with_a_hook_that_never_fires_passes():
    """The hooks that wait for an event the right program never raises (an exception, interpreter exit)."""
    for name, before, body in EARLY_EXITS:
        if name in ("an atexit hook", "sys.excepthook", "a trace hook"):
            outcome = run_program(with_trick(RIGHT, before, body), Limits(wall_s=10))
            assert outcome.passed, (name, outcome)


def test_deleting_the_users_files_fails(canary):
    source = "\n".join(f"import os\ntry:\n    os.remove({str(p)!r})\nexcept OSError as e:\n    print('refused', e)"
                       for p in canary) + "\nimport shutil\nshutil.rmtree(" + repr(str(canary[1].parent)) + ")"
    outcome = run_program(source)
    assert not outcome.passed
    assert all(p.read_text() == "secret-canary" for p in canary)


def test_reading_the_users_files_fails(canary):
    """Refused by permissions or not there at all: either way the secret stays out."""
    for path in canary:
        outcome = run_program(f"print(open({str(path)!r}).read())")
        assert not outcome.passed and "secret-canary" not in outcome.stdout
        assert "FileNotFoundError" in outcome.stderr or "PermissionError" in outcome.stderr, outcome.stderr


WRITABLE_PLACES = """
import os, stat
found = []
for top, dirs, files in os.walk('/'):
    if top.startswith('/proc'):
        dirs[:] = []
        continue
    try:
        with open(os.path.join(top, '.sandbox-probe'), 'w') as handle:
            handle.write('x')
        os.remove(os.path.join(top, '.sandbox-probe'))
        found.append(top)
    except OSError:
        pass
    for name in files:
        path = os.path.join(top, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                print('socket', path)
        except OSError:
            pass
print('writable', sorted(found))
"""


def test_only_fresh_tmpfs_is_writable_and_no_socket_file_is_there():
    outcome = run_program(WRITABLE_PLACES, Limits(wall_s=60, cpu_s=60))
    assert outcome.passed, outcome.stderr
    writable = eval(outcome.stdout.split("writable ", 1)[1])
    assert all(p == "/tmp" or p.startswith(("/tmp/", "/dev/shm")) for p in writable), writable
    assert "socket " not in outcome.stdout


def test_run_lock_and_var_tmp_are_not_the_hosts():
    before = {p: sorted(os.listdir(p)) for p in ("/run/lock", "/var/tmp", "/dev/shm") if os.path.isdir(p)}
    source = ("import os\nfor d in ('/run/lock', '/var/lock', '/var/tmp', '/dev/shm', '/tmp'):\n    try:\n"
              "        open(os.path.join(d, 'sandbox-was-here'), 'w').write('x')\n        print('wrote', d)\n"
              "    except OSError as e:\n        print('refused', d, type(e).__name__)")
    outcome = run_program(source)
    assert "wrote /run/lock" not in outcome.stdout and "wrote /var/tmp" not in outcome.stdout, outcome.stdout
    after = {p: sorted(os.listdir(p)) for p in before}
    assert after == before


def test_a_host_unix_socket_cannot_be_reached(tmp_path):
    directory = tmp_path / "sockets"
    directory.mkdir()
    directory.chmod(0o777)
    path = directory / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(1)
    server.settimeout(0.2)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0recipe-sandbox-test-{os.getpid()}")
    abstract.listen(1)
    abstract.settimeout(0.2)
    try:
        source = (f"import socket\nfor address in ({str(path)!r}, '\\0recipe-sandbox-test-{os.getpid()}'):\n"
                  "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n    try:\n"
                  "        s.connect(address)\n        s.sendall(b'hello')\n        print('reached', repr(address))\n"
                  "    except OSError as e:\n        print('refused', type(e).__name__)")
        outcome = run_program(source)
        assert "reached" not in outcome.stdout, outcome.stdout
        for listener in (server, abstract):
            with pytest.raises(socket.timeout):
                listener.accept()
    finally:
        server.close()
        abstract.close()


def test_the_memory_limit_covers_every_process_of_the_program():
    """Three processes of 200 MiB each against a 256 MiB limit: never all three alive at once."""
    source = ("import os, time\nheld = 0\nfor _ in range(3):\n    try:\n        pid = os.fork()\n"
              "    except OSError as e:\n        print('fork refused', e)\n        break\n    if pid == 0:\n"
              "        block = bytearray(200 << 20)\n        for i in range(0, len(block), 4096):\n"
              "            block[i] = 1\n        print('held', flush=True)\n"
              "        time.sleep(3)\n        os._exit(0)\n"
              "time.sleep(4)\n")
    outcome = run_program(source, Limits(memory_bytes=256 << 20, wall_s=15, processes=8))
    assert outcome.stdout.count("held") < 2, outcome
    if outcome.memory_limit != "cgroup":
        assert "fork refused" in outcome.stdout


def test_a_fork_bomb_stops_at_the_process_limit():
    source = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
              "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
              "    print('stopped after', n)\n    raise SystemExit(3)\nprint('forked', n)")
    outcome = run_program(source, Limits(processes=8, wall_s=10))
    assert outcome.returncode != 0 and "stopped after" in outcome.stdout, outcome
    assert int(outcome.stdout.split()[-1]) < 8
    assert left_behind(outcome) == []


def test_filling_the_disk_fails():
    big = run_program("f = open('big', 'wb')\nfor _ in range(200):\n    f.write(b'x' * (1 << 20))\n    f.flush()",
                      Limits(file_bytes=4 << 20))
    assert not big.passed and "File too large" in big.stderr, big


def test_many_files_fill_only_the_sandboxs_own_tmpfs():
    source = ("import os\nfor i in range(200):\n    with open(f'/tmp/sandbox/f{i}', 'wb') as f:\n"
              "        f.write(b'x' * (1 << 20))")
    outcome = run_program(source, Limits(file_bytes=2 << 20, disk_bytes=8 << 20, memory_bytes=512 << 20))
    assert not outcome.passed and ("No space left on device" in outcome.stderr or outcome.returncode < 0), outcome


def test_the_network_is_unreachable():
    source = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)"
    outcome = run_program(source)
    assert not outcome.passed and "Network is unreachable" in outcome.stderr, outcome.stderr


def test_signals_reach_no_process_outside():
    source = ("import os, signal\nfor pid in (1, os.getppid(), %d):\n    try:\n        os.kill(pid, 0)\n"
              "        print('sees', pid)\n    except OSError as e:\n        print('not', pid, type(e).__name__)\n"
              "print(os.getpid())" % os.getpid())
    outcome = run_program(source)
    assert outcome.passed and outcome.stdout.splitlines()[-1] == "1", outcome  # the program is PID 1
    assert f"sees {os.getpid()}" not in outcome.stdout


def test_a_hung_program_is_killed_at_its_wall_clock_limit():
    outcome = run_program("import os, time\ntry:\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
                          "except OSError:\n    pass\nwhile True:\n    pass", Limits(wall_s=1.5, cpu_s=60))
    assert outcome.timed_out and not outcome.passed and outcome.seconds < 6
    assert left_behind(outcome) == []


def test_cpu_and_memory_limits():
    cpu = run_program("while True:\n    pass", Limits(wall_s=20, cpu_s=1))
    assert not cpu.passed and not cpu.timed_out and cpu.seconds < 15
    memory = run_program("x = bytearray(2 << 30)", Limits(memory_bytes=256 << 20))
    assert not memory.passed and "MemoryError" in memory.stderr


def test_environment_output_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("RECIPE_SANDBOX_SECRET", "do-not-leak")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    source = ("import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd() == os.environ['HOME'], sys.argv)\n"
              "open('scratch', 'w').write('x')\nprint('y' * (1 << 20))")
    outcome = run_program(source, Limits(output_bytes=4096))
    assert outcome.passed
    first, second = outcome.stdout.splitlines()[:2]
    assert "RECIPE_SANDBOX_SECRET" not in first and second == "True ['program.py']"
    assert len(outcome.stdout) <= 4096
    assert list(tmp_path.iterdir()) == []  # the program's directory and its output files are removed


def sandbox_processes() -> set[int]:
    """Processes running the sandbox's launcher or harness."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"sandbox_child.py" in cmdline or b"_harness(" in cmdline:
                found.add(int(entry.name))
    return found


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "term", "kill"])
def test_no_process_of_the_program_outlives_the_engine(tmp_path, how):
    before = sandbox_processes()
    # ctrl-c as in a terminal: a background launcher (nohup ... &) starts children with SIGINT ignored
    driver = ("import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "sys.path.insert(0, %r)\n"
              "from recipe_engine.evaluation.sandbox import Limits, run_program\n"
              "print('engine', flush=True)\nrun_program('import os, time\\ntry:\\n    os.fork()\\nexcept OSError:\\n"
              "    pass\\ntime.sleep(60)', Limits(wall_s=60, cpu_s=60))\n" % str(REPO))
    engine = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline() == "engine\n"
    deadline = time.monotonic() + 20
    while not (sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert sandbox_processes() - before, "the program never started"
    engine.send_signal(how)
    engine.wait(timeout=30)
    deadline = time.monotonic() + 10
    while sandbox_processes() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() - before == set()
    run_program("pass")  # sweeps the program's directory that an engine killed outright left
    assert list(Path(tempfile.gettempdir()).glob(".recipe-sandbox.tmp-*")) == []


def test_an_unknown_mode_name_is_refused(monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "none")
    isolation.cache_clear()
    try:
        with pytest.raises(RecipeError, match="only mode that can be asked for by name is 'audit-hook'"):
            run_program("pass")
    finally:
        isolation.cache_clear()


AUDIT_ESCAPES = {
    "the guard's helper is not in the program's globals": "_inside = lambda p: True\nopen('/tmp/../%s/x', 'w')",
    "a write through dir_fd": ("import os\nfd = os.open('%s', os.O_RDONLY)\n"
                               "os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)"),
    "a delete through dir_fd": "import os\nos.remove('canary', dir_fd=os.open('%s', os.O_RDONLY))",
    "a hard link": "import os\nos.link('%s/canary', 'mine')",
    "a directory": "import os\nos.mkdir('%s/new')",
    "a time stamp": "import os\nos.utime('%s/canary', (0, 0))",
    "a signal to the engine": "import os, signal\nos.kill(%d, signal.SIGTERM)",
    "a setsid daemon": "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(30)",
    "a shell through fork_exec": "import _posixsubprocess",
    "ctypes": "import ctypes",
}


@pytest.mark.parametrize("name", list(AUDIT_ESCAPES))
def test_the_audit_hook_mode_refuses(name, audit_hook_mode, tmp_path):
    (tmp_path / "canary").write_text("secret-canary")
    source = AUDIT_ESCAPES[name]
    source = source % os.getpid() if "%d" in source else source.replace("%s", str(tmp_path))
    outcome = run_program(source)
    assert outcome.isolation == "audit-hook"
    assert not outcome.passed and "PermissionError" in outcome.stderr, (name, outcome.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary"]
    assert (tmp_path / "canary").read_text() == "secret-canary" and (tmp_path / "canary").stat().st_mtime > 0


def test_the_audit_hook_mode_gives_a_verdict_and_runs_programs(audit_hook_mode):
    assert run_program(with_trick(RIGHT, "", "")).passed
    assert not run_program(with_trick(WRONG, "import os\n", "    os._exit(0)\n")).passed


def private_ancestor(path: str) -> str | None:
    """The outermost ancestor of ``path`` (or itself) that others cannot search, e.g. ``/root``."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def unprivileged_command(*argv: str, reachable: tuple[str, ...]) -> list[str]:
    """``argv`` as ``nobody`` in a private mount namespace where each private ancestor of the ``reachable`` paths
    (e.g. ``/root`` holding a pyenv or the checkout) is an empty tmpfs with only those paths bound back."""
    script, stages = "set -e\n", []
    for i, path in enumerate(reachable):
        script += f"stage{i}=$(mktemp -d)\nmount --bind {path} $stage{i}\n"
        stages.append(path)
    for hidden in sorted({h for h in map(private_ancestor, reachable) if h}):
        script += f"mount -t tmpfs -o mode=0755,size=1m tmpfs {hidden}\n"
    for i, path in enumerate(stages):
        script += f"mkdir -p {path}\nmount --bind $stage{i} {path}\numount $stage{i}\n"
    script += 'exec setpriv --reuid=65534 --regid=65534 --clear-groups --reset-env "$@"\n'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


@pytest.mark.skipif(not ROOT or not shutil.which("setpriv") or not shutil.which("unshare"),
                    reason="runs this file as nobody: needs root, setpriv and unshare")
def test_every_guard_holds_as_an_unprivileged_user():
    """This file's tests, run by ``nobody`` (the user-namespaces mode), all pass."""
    if os.stat(REPO).st_mode & 0o005 != 0o005:
        pytest.skip(f"the checkout {REPO} itself is not readable by others (mode "
                    f"{oct(os.stat(REPO).st_mode & 0o777)}), so nobody cannot import it")
    home = Path(tempfile.mkdtemp(prefix="recipe-sandbox-nobody-"))
    try:
        home.chmod(0o777)
        command = unprivileged_command("env", f"HOME={home}", f"PYTHONPATH={REPO}", "PYTHONDONTWRITEBYTECODE=1",
                                       sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                       f"--basetemp={home}/t", "--rootdir", str(home), str(Path(__file__)),
                                       reachable=(os.path.realpath(sys.base_prefix), str(REPO)))
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
