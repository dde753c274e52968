"""``--force`` replaces only ordinary outputs: a regular file or a directory this tool wrote. A device node,
FIFO or socket, the source model, its files, or anything holding it is refused in one line for every command
that writes (``apply``, ``export``, ``eval --json``, ``bench --json``), before any model loads, and the thing is
left as it was byte for byte."""
import hashlib
import os
import socket
import stat

import pytest
import yaml

from recipe_engine.cli import main
from tests.helpers import forbid_loading, refused_in_one_line, save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def digest(path):
    """sha256 over every file under ``path`` (names and bytes), or of the kind of a special file."""
    if path.is_dir():
        h = hashlib.sha256()
        for item in sorted(path.rglob("*")):
            if item.is_file():
                h.update(str(item.relative_to(path)).encode() + item.read_bytes())
        return h.hexdigest()
    mode = os.lstat(path).st_mode
    return hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(mode) else stat.S_IFMT(mode)


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A recipe output-like source model directory ``m`` (marked as an earlier output) beside cal.txt."""
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / "m")
    (tmp_path / "m" / ".recipe_engine.json").write_text('{"type": "recipe-output", "version": 1, "state": "complete"}')
    (tmp_path / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "t", "model": "m", "output": "out",
              "calibration": {"dataset": "cal.txt", "samples": 4, "seq_len": 32}, "modifiers": ["ShortGPT<n:1>"]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    forbid_loading(monkeypatch, "the model was loaded before the output was refused")
    return tmp_path


def special(tmp_path, kind):
    """A FIFO, a bound UNIX socket or (root only) a character device node named like an output."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    else:
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # the null device's numbers
    return path


def refused(capsys, argv, *fragments):
    return refused_in_one_line(capsys, main, argv, *fragments)


@pytest.mark.parametrize("argv,target,fragment", [
    (["export", "m", "--format", "gguf", "--force", "--output", "m/model.safetensors"], "m",
     "lies inside the run's input m"),
    (["export", "m", "--format", "gguf", "--force", "--output", "m"], "m", "is the run's input m"),
    (["apply", "r.yaml", "--force", "--output", "m"], "m", "output 'm' is the run's input m"),
    (["apply", "r.yaml", "--force", "--model", "./m", "--output", "m"], "m", "is the run's input ./m"),
    (["apply", "r.yaml", "--force", "--output", "."], "m", "holds the run's input m"),
    (["eval", "m", "--json", "m/config.json"], "m", "--json m/config.json: lies inside the run's input m"),
    (["bench", "m", "--json", "m/model.safetensors"], "m", "lies inside the run's input m"),
])
def test_force_never_replaces_an_input(source, capsys, argv, target, fragment):
    before = digest(source / target)
    refused(capsys, argv, fragment)
    assert digest(source / target) == before
    assert not (source / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
@pytest.mark.parametrize("command", ["export", "apply", "eval", "bench"])
def test_force_never_replaces_a_special_file(source, capsys, kind, command):
    path = special(source, kind)
    before = digest(path)
    argv = {"export": ["export", "m", "--format", "gguf", "--force", "--output", str(path)],
            "apply": ["apply", "r.yaml", "--force", "--output", str(path)],
            "eval": ["eval", "m", "--json", str(path)], "bench": ["bench", "m", "--json", str(path)]}[command]
    name = {"fifo": "a FIFO", "socket": "a socket", "device": "a character device"}[kind]
    refused(capsys, argv, name)
    assert digest(path) == before and stat.S_IFMT(os.lstat(path).st_mode) == before
