"""The code sandbox (``evaluation/sandbox.py``): each hostile program fails inside it and leaves nothing behind.

Every program is bounded (≤ 200 forks, ≤ 200 MiB written, limits of a few seconds) so a broken sandbox cannot
hurt the machine. The file and network guards that the kernel enforces need root (the disposable uid and the
namespaces); as another user those tests are skipped and the audit-hook guards are tested instead.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from recipe_engine.evaluation.sandbox import Limits, isolation, run_program, uid_processes

ROOT = isolation() == "namespaces"
kernel_enforced = pytest.mark.skipif(not ROOT, reason="kernel-enforced guards need root (namespaces, disposable uid)")


@pytest.fixture
def canary(tmp_path):
    """A 0600 file in the user's temporary directory, and one in a world-searchable directory beside the tests."""
    inside = tmp_path / "canary.txt"
    inside.write_text("secret-canary")
    inside.chmod(0o600)
    shared = Path(__file__).parent / f".sandbox-canary-{os.getpid()}"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    outside = shared / "canary.txt"
    outside.write_text("secret-canary")
    outside.chmod(0o600)
    yield [inside, outside]
    outside.unlink(missing_ok=True)
    shared.rmdir()


def left_behind(outcome) -> list[int]:
    return uid_processes(outcome.uid) if outcome.isolation == "namespaces" else []


def test_a_passing_and_a_failing_program():
    assert run_program("assert sum(range(4)) == 6\nprint('ok')").passed
    failed = run_program("assert 1 == 2")
    assert not failed.passed and "AssertionError" in failed.stderr


def test_deleting_the_users_files_fails(canary):
    source = "\n".join(f"import os\ntry:\n    os.remove({str(p)!r})\nexcept OSError as e:\n    print('refused', e)"
                       for p in canary) + "\nimport shutil\nshutil.rmtree(" + repr(str(canary[1].parent)) + ")"
    outcome = run_program(source)
    assert not outcome.passed
    assert all(p.read_text() == "secret-canary" for p in canary)


@kernel_enforced
def test_reading_the_users_files_fails(canary):
    outcome = run_program(f"print(open({str(canary[1])!r}).read())")
    assert not outcome.passed and "secret-canary" not in outcome.stdout
    assert "PermissionError" in outcome.stderr
    hidden = run_program(f"print(open({str(canary[0])!r}).read())")  # its directory is not even there
    assert not hidden.passed and "secret-canary" not in hidden.stdout


def test_a_fork_bomb_stops_at_the_process_limit():
    source = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
              "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
              "    print('stopped after', n)\n    raise SystemExit(3)\nprint('forked', n)")
    outcome = run_program(source, Limits(processes=8, wall_s=10))
    assert outcome.returncode != 0 and "stopped after" in outcome.stdout, outcome
    assert int(outcome.stdout.split()[-1]) < 200
    assert left_behind(outcome) == []


def test_filling_the_disk_fails():
    big = run_program("f = open('big', 'wb')\nfor _ in range(200):\n    f.write(b'x' * (1 << 20))\n    f.flush()",
                      Limits(file_bytes=4 << 20))
    assert not big.passed and "File too large" in big.stderr, big


@kernel_enforced
def test_many_files_fill_only_the_sandboxs_own_tmpfs():
    source = ("import os\nfor i in range(200):\n    with open(f'/tmp/sandbox/f{i}', 'wb') as f:\n"
              "        f.write(b'x' * (1 << 20))")
    outcome = run_program(source, Limits(file_bytes=2 << 20, disk_bytes=8 << 20))
    assert not outcome.passed and "No space left on device" in outcome.stderr, outcome


def test_the_network_is_unreachable():
    source = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)"
    outcome = run_program(source)
    assert not outcome.passed
    expected = "Network is unreachable" if ROOT else "PermissionError"
    assert expected in outcome.stderr, outcome.stderr


def test_a_hung_program_is_killed_at_its_wall_clock_limit():
    outcome = run_program("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
                          "while True:\n    pass", Limits(wall_s=1.5, cpu_s=60))
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
    source = ("import os\nprint(sorted(os.environ))\nprint(os.getcwd() == os.environ['HOME'])\n"
              "open('scratch', 'w').write('x')\nprint('y' * (1 << 20))")
    outcome = run_program(source, Limits(output_bytes=4096))
    assert outcome.passed
    first, second = outcome.stdout.splitlines()[:2]
    assert "RECIPE_SANDBOX_SECRET" not in first and second == "True"
    assert len(outcome.stdout) <= 4096
    assert list(tmp_path.iterdir()) == []  # the program's directory and its output files are removed
