"""Every path a user names for a command to write follows one rule (``recipe_engine.paths.targets``): never an
input, a device node, FIFO, socket or symbolic link, never inside another path of the same run, never a file
or directory that is not ours; refused in one line naming the option, before any weight loads, with every
victim left as it was (bytes, inode, type) and nothing written."""
import hashlib
import json
import os
import shutil
import stat

import pytest
import yaml

from recipe_engine.cli import main
from recipe_engine.execution.timings import Timings, read_timings
from recipe_engine.paths.targets import Target, check_target, is_json_record, is_timings_log
from tests.helpers import forbid_loading, save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
RECIPE = {"version": 1, "name": "t", "model": "m", "output": "out",
          "calibration": {"dataset": "cal.txt", "samples": 4, "seq_len": 32}, "modifiers": ["ShortGPT<n:1>"]}
EVAL_RECORD = {"model": {"spec": "m"}, "lm_eval_version": "0", "perplexity": {"ppl": 12.5}}

#: option → (argv with {} for the path, the option named in the refusal)
OPTIONS = {
    "apply --output": (["apply", "r.yaml", "--force", "--output", "{}"], "output '"),
    "apply --timings": (["apply", "r.yaml", "--force", "--timings", "{}"], "--timings "),
    "apply --profile": (["apply", "r.yaml", "--force", "--profile", "{}"], "--profile "),
    "eval --json": (["eval", "m", "--device", "cpu", "--baseline", "record.json", "--json", "{}"], "--json "),
    "bench --json": (["bench", "m", "--device", "cpu", "--json", "{}"], "--json "),
    "export --output": (["export", "m", "--format", "gguf", "--output", "{}"], "--output "),
    "export --force --output": (["export", "m", "--format", "gguf", "--force", "--output", "{}"], "--output "),
    "sweep --output": (["sweep", "r.yaml", "--vary", "n=1", "--quiet", "--output", "{}"], "--output "),
}

#: victim → the path given (made by ``make_victim``)
VICTIMS = {
    "model config": "m/config.json", "model weights": "m/model.safetensors", "model directory": "m",
    "recipe": "r.yaml", "calibration text": "cal.txt", "eval record": "record.json",
    "device node": "node", "/dev/null": "/dev/null", "fifo": "fifo", "socket": "sock",
    "link to a device": "null-link", "output itself": "out", "inside the output": "out/inner",
    "unmarked file": "notes.txt", "unmarked directory": "mine",
}

#: (option, victim) pairs where replacing the thing is what the user asked for
ALLOWED = {
    ("bench --json", "eval record"),  # an earlier record of ours, not an input of bench
    # export's --force replaces a regular file that is not its input (the recipe and texts are not export's)
    *(("export --force --output", victim) for victim in ("unmarked file", "eval record", "recipe", "calibration text")),
}
#: victims that are other outputs of the run: only --timings and --profile have another (the output)
OWN_OUTPUT = {"output itself", "inside the output"}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    base = tmp_path_factory.mktemp("template")
    save_tiny_model(base / "m", num_hidden_layers=3)
    return base


@pytest.fixture
def work(tmp_path, template, monkeypatch):
    shutil.copytree(template / "m", tmp_path / "m")
    (tmp_path / "cal.txt").write_text(TEXT)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(RECIPE))
    (tmp_path / "record.json").write_text(json.dumps(EVAL_RECORD))
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine\n")
    out = tmp_path / "out"  # an earlier recipe output: --force may replace it, nothing else may
    out.mkdir()
    (out / ".recipe_engine.json").write_text('{"type": "recipe-output", "version": 1, "state": "complete"}')
    (out / "report.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    forbid_loading(monkeypatch, "a model was loaded before the path was refused")
    return tmp_path


def make_victim(work, victim):
    if victim == "device node":
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(work / "node", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    elif victim == "fifo":
        os.mkfifo(work / "fifo")
    elif victim == "socket":
        import socket

        server = socket.socket(socket.AF_UNIX)
        server.bind(str(work / "sock"))
        server.close()
    elif victim == "link to a device":
        os.symlink("/dev/null", work / "null-link")
    return VICTIMS[victim]


def state(path):
    """What must not change: the kind, inode and bytes of ``path`` (every file under a directory)."""
    info = os.lstat(path)
    kind = stat.S_IFMT(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        content = sorted((str(p.relative_to(path)), state(p)) for p in path.rglob("*"))
    elif stat.S_ISREG(info.st_mode):
        content = hashlib.sha256(path.read_bytes()).hexdigest()
    elif stat.S_ISLNK(info.st_mode):
        content = os.readlink(path)
    else:
        content = (info.st_rdev,)
    return kind, info.st_ino, info.st_dev, content


def tree(work):
    """Every entry under the work directory (names, kinds, inodes, bytes): nothing written, nothing removed."""
    return sorted((str(p.relative_to(work)), state(p)[:2], state(p)[3] if p.is_file() and not p.is_symlink()
                   else None) for p in work.rglob("*"))


CASES = [(option, victim) for option in OPTIONS for victim in VICTIMS
         if (option, victim) not in ALLOWED
         and (victim not in OWN_OUTPUT or option in ("apply --timings", "apply --profile"))]


@pytest.mark.parametrize("option,victim", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_a_named_path_never_replaces_what_is_not_ours(work, capsys, option, victim):
    given = make_victim(work, victim)
    argv, named = OPTIONS[option]
    path = work / given if not given.startswith("/") else given
    before, files = (state(path) if os.path.lexists(path) else None), tree(work)
    null = state("/dev/null") if os.path.exists("/dev/null") else None
    code = main([a.replace("{}", given) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert named in err[0] and "Traceback" not in err[0], err
    assert (state(path) if os.path.lexists(path) else None) == before
    assert tree(work) == files
    assert (state("/dev/null") if os.path.exists("/dev/null") else None) == null


@pytest.mark.parametrize("option", ["apply --timings", "apply --profile", "eval --json", "sweep --output"])
@pytest.mark.parametrize("problem,value,fragment", [
    ("empty", "", "is empty"), ("too long", "x" * 300, "its name is 300 bytes"),
    ("unwritable", "/proc/no/x", "cannot write"), ("below a file", "notes.txt/x", "is a file, not a directory"),
])
def test_an_unusable_path_is_refused_up_front_naming_its_option(work, capsys, option, problem, value, fragment):
    argv, named = OPTIONS[option]
    files = tree(work)
    assert main([a.replace("{}", value) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named.strip() in err[0] and fragment in err[0] and "field 'output'" not in err[0], err
    assert tree(work) == files


def test_apply_output_inside_the_profile_directory_and_the_profile_inside_the_log(work, capsys):
    files = tree(work)
    for argv, fragment in ((["--output", "p/out", "--profile", "p"], "lies inside --profile p"),
                           (["--timings", "t", "--profile", "t"], "--timings and --profile name the same path"),
                           (["--timings", "p/t.jsonl", "--profile", "p"],
                            "--timings p/t.jsonl lies inside --profile p")):
        assert main(["apply", "r.yaml", "--force", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    assert tree(work) == files


def test_output_the_current_directory_is_refused_in_one_line_and_leaves_nothing(work, capsys, monkeypatch):
    empty = work / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    recipe = str(work / "r.yaml")
    sets = ["--model", str(work / "m"), "--set", f"calibration.dataset={work / 'cal.txt'}"]
    for output in (".", "./", "../empty"):
        assert main(["apply", recipe, *sets, "--force", "--output", output]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is the current directory" in err[0], err
    assert main(["apply", recipe, *sets, "--force", "--output", ".."]) == 2  # holds the run's inputs
    capsys.readouterr()
    assert list(empty.iterdir()) == [] and not [p for p in work.iterdir() if p.name.startswith(".")]


def test_a_rerun_replaces_its_own_log_and_profile_and_a_resumed_log_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / "m", num_hidden_layers=3)
    (tmp_path / "cal.txt").write_text(TEXT)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(RECIPE))
    argv = ["apply", "r.yaml", "--quiet", "--force", "--timings", "logs/t.jsonl", "--profile", "prof"]
    assert main(argv) == 0
    first = os.stat("logs/t.jsonl")
    assert is_timings_log(tmp_path / "logs/t.jsonl") and (tmp_path / "prof/trace.json").is_file()
    records = len(read_timings(tmp_path / "logs/t.jsonl"))
    assert main(argv) == 0  # ours: replaced (a new file renamed into place), not appended to
    again = os.stat("logs/t.jsonl")
    assert again.st_ino != first.st_ino and len(read_timings(tmp_path / "logs/t.jsonl")) == records
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["t.jsonl"]
    # a resumed run's clock appends to its own log; a fresh clock renames a new one over it
    Timings(tmp_path / "logs/t.jsonl", append=True).record(event="resumed")
    assert len(read_timings(tmp_path / "logs/t.jsonl")) == records + 1
    assert os.stat("logs/t.jsonl").st_ino == again.st_ino


def test_own_records_are_recognised_and_an_empty_file_may_be_replaced(tmp_path):
    record, log, other = tmp_path / "e.json", tmp_path / "t.jsonl", tmp_path / "o.json"
    record.write_text(json.dumps(EVAL_RECORD))
    log.write_text(json.dumps({"step": "", "seconds": {}, "at_s": 0.1}) + "\n")
    other.write_text(json.dumps({"model": "x"}))
    assert is_json_record(record) and not is_json_record(other) and not is_json_record(log)
    assert is_timings_log(log) and not is_timings_log(record)
    (tmp_path / "empty").touch()
    assert check_target(Target("--json", tmp_path / "empty", what="a record")) == tmp_path / "empty"
    with pytest.raises(Exception, match="exists and is not a record"):
        check_target(Target("--json", other, ours=is_json_record, what="a record"))


def test_a_file_where_the_default_timings_log_goes_is_kept(work, capsys):
    (work / "fresh.timings.jsonl").write_text("my notes\n")
    before, files = state(work / "fresh.timings.jsonl"), tree(work)
    assert main(["apply", "r.yaml", "--output", "fresh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the timings log fresh.timings.jsonl: exists and is not a timings log" in err[0], err
    assert "give --timings PATH" in err[0] and state(work / "fresh.timings.jsonl") == before and tree(work) == files
