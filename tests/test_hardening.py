"""Hardening: every failure is one line (exit 2), caught before the expensive work, and leaves nothing behind.

In-process calls of the CLI's ``main`` on a tiny random model saved to a temporary directory.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine.system import cleanup
from recipe_engine.paths import output
from recipe_engine.workflows import runner
from recipe_engine.cli import main
from recipe_engine.formats.gguf import source as gguf_source

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 bytes


@pytest.fixture
def work(tmp_path, model_dir):
    """tmp_path with cal.txt and a writer of recipes (mapping or raw text) for the tiny model."""
    (tmp_path / "cal.txt").write_text(TEXT)

    def recipe(data=None, name="r.yaml", **changes):
        path = tmp_path / name
        if isinstance(data, (str, bytes)):
            path.write_bytes(data.encode() if isinstance(data, str) else data)
        else:
            base = {"version": 1, "name": "t", "model": str(model_dir), "output": str(tmp_path / "out"),
                    "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32,
                                    "batch_size": 2},
                    "modifiers": ["FuseNorm"]}
            path.write_text(yaml.safe_dump({**base, **(data or {}), **changes}, sort_keys=False))
        return str(path)

    return tmp_path, recipe


def one_line_error(capsys, argv, *fragments, code=2):
    """Run the CLI in-process; assert exit code, exactly one stderr line, and the fragments in it."""
    got = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert got == code, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if apply gets as far as loading weights (every check must come before)."""
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the error was found")
    monkeypatch.setattr(runner, "load_model", refuse)


def listing(path):
    return sorted(p.name for p in path.iterdir())


# 4. duplicate YAML keys ------------------------------------------------------------------------------

def test_duplicate_top_level_key_is_refused_with_its_line(work, capsys, no_loading):
    tmp, recipe = work
    path = recipe(f"version: 1\nname: t\nmodel: {tmp}\nmodifiers: [FuseNorm]\noutput: {tmp}/out\n"
                  "modifiers: [FuseNorm, HeadPrune]\n")
    one_line_error(capsys, ["apply", path], f"{path}: YAML error at line 6, column 1: duplicate key "
                                            f"'modifiers' (first given at line 4)")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


@pytest.mark.parametrize("command", ["validate", "show", "plan"])
def test_duplicate_nested_key_is_refused(work, capsys, command):
    _, recipe = work
    path = recipe("version: 1\nname: t\nmodel: m\noutput: o\nmodifiers: [FuseNorm]\n"
                  "calibration:\n  samples: 4\n  samples: 400000\n")
    one_line_error(capsys, [command, path], "line 8, column 3: duplicate key 'samples' (first given at line 7)")


def test_duplicate_key_inside_a_step_and_in_an_override(work, capsys):
    _, recipe = work
    path = recipe("version: 1\nname: t\nmodel: m\noutput: o\nmodifiers:\n"
                  "  - FuseNorm: {untie: true, untie: false}\n")
    one_line_error(capsys, ["show", path], "duplicate key 'untie'")
    good = recipe({}, name="good.yaml")
    one_line_error(capsys, ["show", good, "--set", "calibration={samples: 1, samples: 2}"],
                   "override 'calibration={samples: 1, samples: 2}': value is not valid YAML",
                   "duplicate key 'samples'")


# 7. non-UTF-8 and binary files ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["show", "validate", "apply", "plan"])
def test_non_utf8_recipe_is_one_line(work, capsys, command):
    tmp, recipe = work
    path = recipe("version: 1\nname: caf\xe9\n".encode("latin-1"))
    one_line_error(capsys, [command, path], f"{path}: not UTF-8 text: byte 0xe9 at line 2")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


def test_show_of_a_safetensors_file_or_a_directory(work, model_dir, capsys):
    one_line_error(capsys, ["show", str(model_dir / "model.safetensors")], "is a binary file, not a YAML recipe")
    one_line_error(capsys, ["show", str(model_dir)], f"{model_dir}: is a directory, not a recipe file")


def test_non_utf8_calibration_text(work, capsys, no_loading):
    tmp, recipe = work
    (tmp / "cal.txt").write_bytes(TEXT.encode() + b"\xff\xfe")
    one_line_error(capsys, ["apply", recipe()], "cal.txt: not UTF-8 text (byte 0xff at offset 1800)")
    (tmp / "cal.jsonl").write_text('{"text": "a"}\n{"text": \n')
    one_line_error(capsys, ["validate", recipe(calibration={"dataset": str(tmp / "cal.jsonl")})],
                   "cal.jsonl: invalid JSON at line 2")


# 8. validate reports every file ----------------------------------------------------------------------

def test_validate_reports_every_file_and_fails_if_any_failed(work, capsys):
    tmp, recipe = work
    bad1 = recipe({"modifiers": ["FuzeNorm"]}, name="a.yaml")
    good = recipe({}, name="b.yaml")
    bad2 = recipe("version: 1\nversion: 1\n", name="c.yaml")
    assert main(["validate", bad1, good, bad2]) == 2
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{good}: ok (llama, 4 → 4 layers)"
    errors = captured.err.strip().splitlines()
    assert errors[0].startswith(f"error: {bad1}: step 0: unknown modifier 'FuzeNorm'")
    assert errors[1].startswith(f"error: {bad2}: YAML error at line 2")
    assert errors[2] == "2 of 3 recipes failed"
    assert main(["validate", good, good]) == 0


# 10, 11. arguments and overrides ------------------------------------------------------------------------

def test_override_with_broken_yaml_value(work, capsys):
    _, recipe = work
    one_line_error(capsys, ["apply", recipe(), "--set", "calibration.samples=[1"],
                   "override 'calibration.samples=[1': value is not valid YAML: YAML syntax error")


def test_override_unknown_path_suggests(work, capsys):
    _, recipe = work
    one_line_error(capsys, ["show", recipe(), "--set", "calibration.sample=4"],
                   "unknown path 'calibration.sample'; did you mean 'calibration.samples'?")
    one_line_error(capsys, ["show", recipe(), "--set", "modifiers.7.untie=true"], "no step 7 (recipe has 1)")
    one_line_error(capsys, ["show", recipe(), "--set", "zzz=1"], "steps are addressed as modifiers.INDEX")


def test_empty_output_is_an_error_not_ignored(work, capsys, no_loading):
    tmp, recipe = work
    one_line_error(capsys, ["apply", recipe(), "--output", ""], "field 'output': String should have at least")
    one_line_error(capsys, ["show", recipe(), "--output", ""], "field 'output'")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


def test_argument_errors_are_one_line(work, capsys):
    _, recipe = work
    one_line_error(capsys, ["apply"], "recipe apply: the following arguments are required: recipe")
    one_line_error(capsys, ["apply", recipe(), "--bogus"], "unrecognized arguments: --bogus")
    one_line_error(capsys, ["frobnicate"], "invalid choice: 'frobnicate'")


# 3. --force replaces only an earlier recipe output -------------------------------------------------------

def test_force_refuses_a_directory_that_is_not_a_recipe_output(work, capsys, no_loading):
    tmp, recipe = work
    important = tmp / "important"
    important.mkdir()
    (important / "thesis.tex").write_text("years of work")
    one_line_error(capsys, ["apply", recipe(), "--output", str(important), "--force"],
                   "field 'output'", "is not a recipe output", "--force replaces only earlier recipe outputs")
    assert listing(important) == ["thesis.tex"]


def test_force_accepts_an_empty_directory(work, capsys):
    tmp, recipe = work
    (tmp / "empty").mkdir()
    one_line_error(capsys, ["apply", recipe(), "--output", str(tmp / "empty"), "--quiet"], "already exists")
    assert main(["apply", recipe(), "--output", str(tmp / "empty"), "--force", "--quiet"]) == 0
    assert output.is_recipe_output(tmp / "empty")


def test_force_refuses_a_file(work, capsys, no_loading):
    tmp, recipe = work
    (tmp / "notes.txt").write_text("mine")
    one_line_error(capsys, ["apply", recipe(), "--output", str(tmp / "notes.txt"), "--force"],
                   "exists and is not a directory; not replaced")
    assert (tmp / "notes.txt").read_text() == "mine"


def test_force_replaces_an_earlier_output_which_carries_the_marker(work, capsys):
    tmp, recipe = work
    assert main(["apply", recipe(), "--quiet"]) == 0
    marker = json.loads((tmp / "out" / cleanup.MARKER).read_text())
    assert marker == {"type": "recipe-output", "version": 1, "state": "complete"}
    assert main(["apply", recipe(), "--quiet", "--set", "modifiers.0.untie=true", "--force"]) == 0
    assert yaml.safe_load((tmp / "out" / "recipe.yaml").read_text())["modifiers"][0]["FuseNorm"]["untie"]
    assert listing(tmp) == ["cal.txt", "out", "r.yaml"]
    # an output written before the marker existed is recognised by report.json + recipe.yaml
    (tmp / "out" / cleanup.MARKER).unlink()
    assert output.is_recipe_output(tmp / "out")
    (tmp / "out" / "recipe.yaml").unlink()
    assert not output.is_recipe_output(tmp / "out")


# 2. output path problems before any compute; late failures in one line ------------------------------------

def test_output_below_a_file(work, capsys, no_loading):
    tmp, recipe = work
    (tmp / "A").write_text("a file")
    one_line_error(capsys, ["apply", recipe(), "--output", str(tmp / "A" / "sub")],
                   f"cannot create '{tmp}/A/sub': '{tmp}/A' is a file, not a directory")


def test_output_in_proc_is_unwritable(work, capsys, no_loading):
    _, recipe = work
    one_line_error(capsys, ["apply", recipe(), "--output", "/proc/x"], "field 'output': cannot write '/proc/x': /proc:")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_in_read_only_directory(work, capsys, no_loading):
    tmp, recipe = work
    locked = tmp / "locked"
    locked.mkdir(mode=0o555)
    one_line_error(capsys, ["apply", recipe(), "--output", str(locked / "out")], "Permission denied")


def test_not_enough_free_space_is_found_before_loading(work, capsys, monkeypatch, no_loading):
    tmp, recipe = work
    real = output.shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    err = one_line_error(capsys, ["apply", recipe()], "field 'output': not enough disk space for output")
    assert "1000" not in err and "GiB free on" in err
    assert listing(tmp) == ["cal.txt", "r.yaml"]


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_disk_full_while_writing_is_one_line_and_leaves_nothing(work, capsys, monkeypatch, error):
    import errno

    import transformers
    from safetensors import SafetensorError

    tmp, recipe = work

    def full(self, directory, **_):
        (directory / "model.safetensors").write_bytes(b"half")
        if error == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("No space left on device (os error 28)\nsecond line")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    one_line_error(capsys, ["apply", recipe(), "--quiet"],
                   "field 'output': writing output", "failed: No space left on device")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


# 1. temporary directories left by killed runs ---------------------------------------------------------------

def test_stale_temporary_directories_are_swept_with_a_note(work, capsys):
    tmp, recipe = work
    stale = tmp / ".out.tmp-dead1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    record = {"type": "recipe-output", "version": 1, "state": "writing", "pid": 2**22 + 12345,
              "host": cleanup.socket.gethostname(), "start": None}
    (stale / cleanup.MARKER).write_text(json.dumps(record))
    live = tmp / ".out.tmp-live5678"
    live.mkdir()
    (live / cleanup.MARKER).write_text(json.dumps({**record, "pid": os.getpid(),
                                                   "start": cleanup._start_time(os.getpid())}))
    foreign = tmp / ".out.tmp-foreign"
    foreign.mkdir()
    assert main(["apply", recipe(), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"note: removed {stale}, left by an interrupted run (pid {2**22 + 12345})" in err
    assert f"note: {foreign} looks like an interrupted write but has no {cleanup.MARKER} of ours" in err
    assert listing(tmp) == [".out.tmp-foreign", ".out.tmp-live5678", "cal.txt", "out", "r.yaml"]


def test_interrupted_force_swap_restores_the_previous_output(tmp_path):
    parked = tmp_path / ".out.old-abc"
    (parked / "previous").mkdir(parents=True)
    (parked / "previous" / "model.safetensors").write_text("old")
    (parked / cleanup.MARKER).write_text(json.dumps({"type": "recipe-output", "version": 1,
                                                     "state": "replacing", "pid": 2**22 + 1,
                                                     "host": cleanup.socket.gethostname()}))
    notes = []
    cleanup.sweep_stale(tmp_path, "out", notes.append)
    assert (tmp_path / "out" / "model.safetensors").read_text() == "old"
    assert listing(tmp_path) == ["out"]
    assert notes[0].startswith(f"restored {tmp_path / 'out'}")


# 9. calibration data checked by validate ---------------------------------------------------------------

def test_validate_checks_calibration_data(work, capsys):
    tmp, recipe = work
    one_line_error(capsys, ["validate", recipe(calibration={"dataset": str(tmp / "missing.txt")})],
                   "data not found")
    one_line_error(capsys, ["validate", recipe(calibration={"dataset": str(tmp / "cal.txt"), "samples": 100,
                                                            "seq_len": 32})],
                   "has 1800 bytes of text; samples × seq_len = 3200 tokens need at least 3200 bytes")


def test_misspelled_dataset_fails_fast_with_a_suggestion(work, capsys, monkeypatch):
    _, recipe = work
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub is unreachable
    start = time.perf_counter()
    for command in ("validate", "apply"):
        one_line_error(capsys, [command, recipe(calibration={"dataset": "wikitxt2"})],
                       "dataset 'wikitxt2' is not a builtin", "full id, owner/name",
                       "did you mean 'wikitext2'?")
    assert time.perf_counter() - start < 10


# 5, 6. GGUF sources ------------------------------------------------------------------------------------

@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    """A tiny GGUF file and an empty RECIPE_CACHE."""
    from tests.helpers import write_tiny_gguf

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "g").mkdir()
    return write_tiny_gguf(tmp_path / "g" / "tiny.gguf", layers=3)


@pytest.mark.parametrize("damage", ["not gguf", "empty", "header cut", "tensors cut"])
@pytest.mark.parametrize("command", ["validate", "apply"])
def test_corrupt_gguf_is_one_line(work, gguf_file, capsys, no_loading, damage, command):
    tmp, recipe = work
    data = gguf_file.read_bytes()
    damaged = {"not gguf": b"hello, not a model\n", "empty": b"", "header cut": data[:100],
               "tensors cut": data[: len(data) - 5000]}[damage]
    (tmp / "bad.gguf").write_bytes(damaged)
    expected = {"not gguf": "not a GGUF file (starts with b'hell', not b'GGUF')", "empty": "empty file",
                "header cut": "truncated or corrupt GGUF file (100 bytes)",
                "tensors cut": "truncated or corrupt GGUF file"}[damage]
    one_line_error(capsys, [command, recipe(model=str(tmp / "bad.gguf"))], f"{tmp / 'bad.gguf'}: {expected}")
    assert not (tmp / "cache").exists() and not (tmp / "out").exists()


def test_validate_reads_gguf_metadata_without_converting(work, gguf_file, capsys, monkeypatch):

    tmp, recipe = work

    def refuse(*_a, **_k):
        raise AssertionError("validate converted the GGUF weights")

    monkeypatch.setattr(gguf_source, "converted_gguf", refuse)
    assert main(["validate", recipe(model=str(gguf_file), modifiers=["FuseNorm", "ShortGPT<n:1>"])]) == 0
    assert "ok (llama, 3 → 2 layers)" in capsys.readouterr().out
    kept = gguf_source.cache_root() / "gguf-config" / gguf_source.gguf_cache_dir(gguf_file).name
    assert sorted(p.relative_to(tmp / "cache").as_posix() for p in (tmp / "cache").rglob("*") if p.is_file()) \
        == [f"gguf-config/{kept.name}/config.json"]  # the metadata's config kept, no weights converted


def test_a_gguf_files_config_is_read_from_its_metadata_once(work, gguf_file, capsys, monkeypatch):
    """The second read takes the kept config.json, equal to transformers' own reading of the metadata (its
    ``_name_or_path`` aside), and parses nothing; a cache that cannot be written is read around."""
    from transformers import AutoConfig

    tmp, recipe = work
    reference = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).to_dict()
    first = gguf_source.gguf_config(gguf_file).to_dict()
    read_config = AutoConfig.from_pretrained.__func__

    def refuse(*_a, **_k):
        raise AssertionError("the GGUF metadata was parsed again")

    def from_pretrained(*args, **kwargs):
        return refuse() if "gguf_file" in kwargs else read_config(AutoConfig, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(gguf_source, "_gguf_fields", refuse)
        patched.setattr(AutoConfig, "from_pretrained", from_pretrained)
        second = gguf_source.gguf_config(gguf_file).to_dict()
        assert main(["validate", recipe(model=str(gguf_file), modifiers=["ShortGPT<n:1>"])]) == 0
    for values in (reference, first, second):
        values.pop("_name_or_path")
    assert first == reference and second == reference

    def unwritable(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setenv("RECIPE_CACHE", str(tmp / "other-cache"))
    monkeypatch.setattr(gguf_source, "temporary_directory", unwritable)
    third = gguf_source.gguf_config(gguf_file).to_dict()
    third.pop("_name_or_path")
    assert third == reference and not list((tmp / "other-cache" / "gguf-config").iterdir())


def test_gguf_apply_converts_once_into_the_cache(work, gguf_file, capsys):
    tmp, recipe = work
    assert main(["apply", recipe(model=str(gguf_file)), "--quiet"]) == 0
    entries = list((tmp / "cache" / "gguf").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("tiny-")
    assert (entries[0] / "model.safetensors").is_file() and not (entries[0] / cleanup.MARKER).exists()
    assert (tmp / "out" / "model.safetensors").is_file()


def test_stale_conversion_directory_is_swept(work, gguf_file, capsys):

    tmp, _ = work
    target = gguf_source.gguf_cache_dir(gguf_file)
    target.parent.mkdir(parents=True)
    stale = target.parent / f".{target.name}.tmp-abcd1234"
    stale.mkdir()
    (stale / cleanup.MARKER).write_text(json.dumps({"type": "gguf-cache", "state": "writing",
                                                    "pid": 2**22 + 7, "host": cleanup.socket.gethostname()}))
    assert gguf_source.converted_gguf(gguf_file) == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert f"note: removed {stale}" in capsys.readouterr().err


# 10. recipe eval arguments ------------------------------------------------------------------------------

def test_eval_arguments_are_checked_before_loading(work, model_dir, capsys, monkeypatch):
    from tests.helpers import refuse_loading

    tmp, _ = work

    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the error was found")

    refuse_loading(monkeypatch, refuse)
    one_line_error(capsys, ["eval", str(model_dir), "--limit", "-1"],
                   "recipe eval: argument --limit: expected a positive integer, got -1")
    one_line_error(capsys, ["eval", str(model_dir), "--seq-len", "abc"], "argument --seq-len")
    (tmp / "A").write_text("a file")
    one_line_error(capsys, ["eval", str(model_dir), "--json", str(tmp / "A" / "x.json")],
                   f"--json: cannot create '{tmp}/A/x.json': '{tmp}/A' is a file, not a directory")
    one_line_error(capsys, ["eval", str(model_dir), "--baseline", str(tmp / "cal.txt")],
                   f"--baseline {tmp}/cal.txt: cannot read a `recipe eval` JSON record")
    one_line_error(capsys, ["bench", str(model_dir), "--json", str(tmp / "A" / "b.json")], "is a file")
    assert listing(tmp) == ["A", "cal.txt"]


# 11. smaller ---------------------------------------------------------------------------------------------

def test_quiet_apply_prints_nothing_at_all(work, capsys):
    _, recipe = work
    assert main(["apply", recipe(), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored for whoever runs next in this process


def test_quiet_apply_runs_where_datasets_is_not_installed(work, capsys, monkeypatch):
    """A run from local text never imports ``datasets``: a machine without it (a lent GPU's image) still
    runs ``recipe apply --quiet``, and the hub's and transformers' progress bars are still silenced."""
    _, recipe = work
    monkeypatch.setitem(sys.modules, "datasets", None)  # ``import datasets`` now raises ModuleNotFoundError
    assert main(["apply", recipe(), "--quiet", "--force"]) == 0
    assert capsys.readouterr().err == ""



def test_a_quiet_run_from_local_text_never_imports_datasets(work):
    """Every command starts without ``datasets`` (about 0.7 s): a run from local text never imports it."""
    _, recipe = work
    probe = ("import sys; from recipe_engine.cli import main; code = main(sys.argv[1:]); "
             "print(code, 'datasets' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe, "apply", recipe(), "--quiet", "--force"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert run.stdout.splitlines()[-1].split() == ["0", "False"], run.stdout[-2000:] + run.stderr[-2000:]


def test_datasets_imported_inside_a_quiet_block_starts_with_its_bars_off(monkeypatch):
    """An import inside the block (a hub dataset, lm-eval's tasks) reads datasets' own switch, set for the block
    only; a switch the user set is left as it is."""
    from recipe_engine.cli.evaluate import DATASETS_BARS, quiet_libraries

    monkeypatch.delenv(DATASETS_BARS, raising=False)
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    with quiet_libraries(True):
        assert os.environ[DATASETS_BARS] == "1"
    assert DATASETS_BARS not in os.environ
    monkeypatch.setenv(DATASETS_BARS, "0")
    with quiet_libraries(True):
        assert os.environ[DATASETS_BARS] == "0"
    assert os.environ[DATASETS_BARS] == "0"

@pytest.mark.parametrize("step", ["FlattenAdjacent<n:3>", "ShortGPT<n:3>"])
def test_a_one_layer_result_is_refused(work, capsys, step):
    _, recipe = work
    one_line_error(capsys, ["validate", recipe(modifiers=["FuseNorm", step, "HeadPrune", "NystromMLP"]
                                                if step.startswith("Flatten") else ["FuseNorm", step])],
                   "field 'modifiers': the recipe leaves 1 of 4 decoder layers; a model needs at least 2")


def test_hub_model_offline_fails_fast(work, capsys, monkeypatch):
    _, recipe = work
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    one_line_error(capsys, ["validate", recipe(model="no-such-org/no-such-model")],
                   "model 'no-such-org/no-such-model' is not a local directory, .gguf file or builtin alias",
                   "the HF hub (127.0.0.1) cannot be reached")
    assert time.perf_counter() - start < 10


def test_legacy_conversion_temp_dirs_are_removed_when_empty_and_old(tmp_path):
    old_empty, old_full, fresh = (tmp_path / f".m-key.{s}" for s in ("abcd1234", "efgh5678", "ijkl9012"))
    for path in (old_empty, old_full, fresh):
        path.mkdir()
    (old_full / "model.safetensors").write_text("x")
    for path in (old_empty, old_full):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    notes = []
    removed = cleanup.sweep_stale(tmp_path, "m-key", notes.append, legacy=(".m-key.????????",))
    assert removed == [old_empty]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m-key.efgh5678", ".m-key.ijkl9012"]
    assert len(notes) == 3 and "earlier version" in notes[0] and "not removed" in notes[1]


@pytest.mark.parametrize("command", ["validate", "apply"])
def test_unparseable_device_is_one_line(work, capsys, no_loading, command):
    tmp, recipe = work
    one_line_error(capsys, [command, recipe(), "--device", ""], "device '' is not a device (auto, cpu, cuda, cuda:i)")
    one_line_error(capsys, [command, recipe(), "--device", "cpu:x"], "device 'cpu:x' is not a device")
    one_line_error(capsys, [command, recipe(), "--device", "a\nb\x1e"], "device 'a\\nb\\x1e' is not a device")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


def test_not_enough_space_for_the_gguf_cache_is_one_line(work, gguf_file, capsys, monkeypatch):
    tmp, recipe = work
    real = output.shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000) if str(p).startswith(str(tmp / "cache")) else real(p))
    one_line_error(capsys, ["apply", recipe(model=str(gguf_file), output=str(tmp / "out")), "--quiet"],
                   "not enough disk space to convert tiny.gguf into the cache: needs about",
                   "(set RECIPE_CACHE to another directory)")
    assert not list((tmp / "cache" / "gguf").iterdir()) and not (tmp / "out").exists()


def test_validate_online_asks_the_hub_whether_the_dataset_exists(work, capsys, monkeypatch):
    """Online, a hub dataset id reaches the hub's metadata API (no download); a bare near miss of a builtin
    name is refused before (``test_misspelled_dataset_fails_fast_with_a_suggestion``)."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    from recipe_engine.sources import text as data

    _, recipe = work
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(data, "hub_unreachable", lambda *a: None)
    asked = []

    def dataset_info(self, name, timeout=None):
        asked.append(name)
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # as raised for a 404
        Exception.__init__(error, f"404 {name}")
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    one_line_error(capsys, ["validate", recipe(calibration={"dataset": "someone/no-such-text"})],
                   "dataset 'someone/no-such-text' is not a builtin", "or a dataset on the HF hub")
    assert asked == ["someone/no-such-text"]
