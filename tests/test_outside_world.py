"""What the outside world does to a command ends in one line, never a traceback: standard output on a full
device or a closed pipe, Ctrl-C during the engine's imports, a model file transformers or safetensors rejects,
a read-only cache; and the small refusals (--version, a union field's choices, a recipe that is a device,
WORLD_SIZE), and no escape or carriage return in piped output.

Real processes where the process is the subject (``python -m recipe_engine.cli``: stdout, signals, pipes);
in-process calls of ``main`` otherwise."""
import errno
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from recipe_engine.cli import main, stdio
from recipe_engine.sources.devices import parse_device
from tests.helpers import save_tiny_model, write_tiny_gguf
from tests.test_hardening import TEXT, one_line_error, work  # noqa: F401  (work: a fixture)

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv, stdout=subprocess.PIPE, env=None, **kwargs) -> subprocess.Popen:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "recipe_engine.cli", *argv], stdout=stdout,
                            stderr=subprocess.PIPE, env=environ, cwd=kwargs.get("cwd"))


def finished(process: subprocess.Popen) -> tuple[int, str]:
    _, err = process.communicate(timeout=300)
    return process.returncode, err.decode()


def one_line(err: str, *fragments: str) -> None:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


# standard output -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["show", "R"], ["list-modifiers"], ["plan", "R"], ["validate", "R"],
                                  ["diff", "R", "R"], ["--version"]])
def test_stdout_on_a_full_device_is_one_line_exit_2(work, argv):  # noqa: F811
    _, recipe = work
    path = recipe()
    with open("/dev/full", "w") as full:
        code, err = finished(cli(*[path if a == "R" else a for a in argv], stdout=full))
    assert code == 2
    one_line(err, "error: cannot write to standard output: No space left on device; nothing written")


def test_apply_whose_summary_cannot_be_printed_says_the_output_is_complete(work):  # noqa: F811
    tmp, recipe = work
    with open("/dev/full", "w") as full:
        code, err = finished(cli("apply", recipe(), "--quiet", "--output", str(tmp / "done"), stdout=full))
    assert code == 2
    one_line(err, "cannot write to standard output: No space left on device (the output", "is complete; "
             "only its summary is missing)")
    assert (tmp / "done" / "report.json").is_file() and (tmp / "done" / "model.safetensors").is_file()


def test_a_closed_pipe_exits_quietly_like_cli_tools():
    process = cli("list-modifiers")
    process.stdout.readline()
    process.stdout.close()  # the reader goes away, as `| head -1` does
    code, err = finished(process)
    assert code == 128 + signal.SIGPIPE and err == ""


def test_guarded_streams_turn_write_errors_into_stream_errors(monkeypatch):
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(stdio.StreamError) as caught, stdio.guarded():
        print("x")
    assert caught.value.exit_code == 2 and caught.value.stream == "standard output"
    with pytest.raises(stdio.StreamError) as caught, stdio.guarded(), stdio.after_output("out/x is complete"):
        print("summary")
    assert caught.value.line() == ("error: cannot write to standard output: No space left on device "
                                   "(out/x is complete; only its summary is missing)")


# Ctrl-C at any moment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("delay", [0.1, 0.3, 0.6])
def test_ctrl_c_during_the_imports_is_one_line_exit_130(work, delay):  # noqa: F811
    _, recipe = work
    # the delay counts from when the entry point is reached: Python's own start-up before it (tens of ms,
    # more on a loaded machine) runs none of our code
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import recipe_engine.cli"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                   check=True)
    startup = time.perf_counter() - start
    process = cli("validate", recipe())
    time.sleep(startup + delay)
    process.send_signal(signal.SIGINT)
    code, err = finished(process)
    assert code == 130, err
    assert err == "interrupted by SIGINT; nothing written\n"


def test_the_entry_point_imports_nothing_heavy():
    # the console script and ``python -m`` import the package before main runs: torch must not load then
    probe = "import sys, recipe_engine.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert got.stdout.split() == ["False", "False"]


# a model that transformers, huggingface_hub or safetensors reject ---------------------------------------------

@pytest.fixture
def broken(tmp_path, model_dir):
    def copy(name: str) -> Path:
        target = tmp_path / name
        target.mkdir()
        for file in model_dir.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        return target
    return copy


@pytest.mark.parametrize("command", ["validate", "apply"])
def test_a_config_transformers_rejects_is_one_line_naming_it(work, broken, capsys, command):  # noqa: F811
    _, recipe = work
    model = broken("heads")
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=66, head_dim=None)  # not divisible by the 4 heads: huggingface_hub's strict check
    (model / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, [command, recipe(), "--model", str(model)], f"{model / 'config.json'}",
                   "The hidden size (66) is not a multiple of the number of attention heads (4)")


def test_export_of_a_config_transformers_rejects(broken, tmp_path, capsys):
    model = broken("heads")
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=66, head_dim=None)
    (model / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, ["export", str(model), "--format", "gguf", "--output", str(tmp_path / "m.gguf")],
                   f"cannot read {model / 'config.json'}", "not a multiple")
    assert not (tmp_path / "m.gguf").exists()


def test_a_safetensors_header_safetensors_rejects_is_found_by_validate(work, broken, capsys):  # noqa: F811
    _, recipe = work
    model = broken("dtype")
    file = model / "model.safetensors"
    data = file.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    header[next(k for k in header if k != "__metadata__")]["dtype"] = "Q9"  # JSON, but no dtype safetensors knows
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    one_line_error(capsys, ["validate", recipe(), "--model", str(model)], f"source model file {file}: "
                   "safetensors cannot open it")


def test_a_tokenizer_file_that_cannot_be_parsed(work, broken, capsys):  # noqa: F811
    tmp, recipe = work
    model = broken("tokenizer")
    (model / "tokenizer.json").write_text('{"x": [')
    one_line_error(capsys, ["apply", recipe(), "--model", str(model), "--quiet"],
                   f"cannot read the tokenizer of model '{model}'")
    assert not (tmp / "out").exists()


# the GGUF conversion cache, the device ------------------------------------------------------------------

def test_a_read_only_cache_is_one_line(work, capsys, monkeypatch):  # noqa: F811
    tmp, recipe = work
    if os.geteuid() == 0:  # root writes into read-only directories: a file system that refuses everyone
        cache = Path("/sys/recipe-engine-cache")
        try:
            cache.mkdir()
        except OSError:
            pass
        else:
            cache.rmdir()
            pytest.skip("needs a place nobody may write")
    else:
        cache = tmp / "cache"
        cache.mkdir()
        cache.chmod(0o500)
    monkeypatch.setenv("RECIPE_CACHE", str(cache))
    gguf = write_tiny_gguf(tmp / "tiny.gguf", layers=2)
    one_line_error(capsys, ["apply", recipe(), "--model", str(gguf), "--quiet"],
                   f"cannot write the GGUF conversion cache {cache}", "set RECIPE_CACHE to another directory")
    assert not (tmp / "out").exists()


def test_cpu_n_is_the_cpu_as_in_torch(tmp_path, capsys):
    assert parse_device("cpu:0") == parse_device("cpu") == torch.device("cpu")
    assert torch.zeros(1).to("cpu:3").device == torch.device("cpu")  # what torch users expect
    model = tmp_path / "tied"
    save_tiny_model(model, tie_word_embeddings=True)
    (tmp_path / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "t", "model": str(model), "output": str(tmp_path / "out"), "stream": "on",
              "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32,
                              "batch_size": 2}, "modifiers": ["FuseNorm"]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["apply", str(tmp_path / "r.yaml"), "--device", "cpu:0", "--quiet"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["device"] == "cpu"


# small ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(capsys, flag):
    import importlib.metadata

    assert main([flag]) == 0
    assert capsys.readouterr().out == f"recipe {importlib.metadata.version('recipe-engine')}\n"


@pytest.mark.parametrize("value", ["maybe", "3", "[1]"])
def test_offload_error_names_the_field_and_its_choices(work, capsys, value):  # noqa: F811
    _, recipe = work
    err = one_line_error(capsys, ["show", recipe(), "--set", f"calibration.offload={value}"],
                         "field 'calibration.offload': expected auto | true | false")
    assert ".bool" not in err


def test_a_recipe_that_is_not_a_regular_file(work, capsys):  # noqa: F811
    tmp, _ = work
    os.mkfifo(tmp / "fifo")
    (tmp / "link").symlink_to("/dev/null")
    for path, kind in (("/dev/null", "a character device"), (tmp / "fifo", "a FIFO"),
                       (tmp / "link", "a character device")):
        for command in ("apply", "validate", "show"):
            one_line_error(capsys, [command, str(path)], f"{path}: not a regular file ({kind})")


def test_world_size_is_named_when_it_is_not_a_count(work, capsys, monkeypatch):  # noqa: F811
    _, recipe = work
    monkeypatch.setenv("WORLD_SIZE", "abc")
    err = one_line_error(capsys, ["plan", recipe()], "environment variable WORLD_SIZE",
                         "expected a positive integer, got 'abc'")
    assert "argument --ranks" not in err
    assert main(["plan", recipe(), "--ranks", "2", "--json"]) == 0  # an explicit --ranks does not read it
    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()
    assert main(["plan", recipe(), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_parallel"] is not None


# no escape sequence or carriage return in piped output ----------------------------------------------------

def test_forced_colour_on_a_pipe_writes_plain_lines(work):  # noqa: F811
    tmp, recipe = work
    process = cli("apply", recipe(), "--output", str(tmp / "piped"),
                  env={"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "RECIPE_PROGRESS_INTERVAL": "0"})
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()
    for text in (out, err):
        assert b"\r" not in text and b"\x1b" not in text, text[:300]
    assert b"FuseNorm layers 4/4" in err and b"parameters" in out


def test_a_library_bar_on_a_pipe_leaves_the_line_it_ends_in():
    from tqdm import tqdm

    stream = io.StringIO()
    guarded = stdio._Guarded(stream, "standard error")
    for _ in tqdm(range(3), desc="bar", file=guarded, mininterval=0, ascii=True):
        pass
    guarded.write("\x1b[1mbold\x1b[0m line\n")
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("bar: 100%") and "3/3" in lines[0]
    assert lines[1] == "bold line"


def test_a_failure_a_signal_caused_is_the_interruption(monkeypatch, capsys):
    # a library that swallows the Interrupted raised inside it (transformers' lazy imports) fails otherwise
    # afterwards: that failure is reported as the interruption, not as an unreadable model or a traceback
    from recipe_engine import errors
    from recipe_engine.cli import commands

    def interrupted_then_broken(args):
        errors.note_signal(signal.SIGINT)
        with errors.reading("m/config.json"):
            raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(commands, "run", interrupted_then_broken)
    from recipe_engine.cli import main

    assert main(["validate", "r.yaml"]) == 130
    assert capsys.readouterr().err == "interrupted by SIGINT; nothing written\n"
    assert errors.received_signal() is None  # cleared for the next command in this process
    with pytest.raises(errors.SourceError, match="cannot read m/config.json: .*recursion"):
        with errors.reading("m/config.json"):  # without a signal: one line naming the file
            raise RecursionError("maximum recursion depth exceeded")
