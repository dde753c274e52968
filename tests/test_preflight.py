"""Every command's pre-flight (``recipe_engine.plan.preflight``): one line, exit code 2, nothing written, and found
before any model is loaded — for ``apply`` and ``validate`` alike, and for ``export``, ``sweep``, ``eval``,
``bench`` and ``plan``. In-process calls of the CLI's ``main`` on a tiny random model."""
import json
import os
import stat
import time

import pytest
import torch
import yaml

from recipe_engine.formats.gguf import writer as gguf_export, vocabulary as gguf_vocabulary
from recipe_engine.paths import output
from recipe_engine.cli import main
from recipe_engine.evaluation import zeroshot
from tests.helpers import forbid_loading

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 bytes


@pytest.fixture(scope="module")
def gguf_ready(tmp_path_factory):
    """A tiny model directory that GGUF export accepts (a BPE tokenizer with merges)."""
    from tests.test_gguf_export import saved

    return saved(tmp_path_factory.mktemp("gguf"))[1]


@pytest.fixture
def work(tmp_path, model_dir, monkeypatch):
    """tmp_path (also the working directory) with cal.txt and a writer of recipes for the tiny model."""
    (tmp_path / "cal.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)

    def recipe(name="r.yaml", **changes):
        data = {"version": 1, "name": "t", "model": str(model_dir), "output": str(tmp_path / "out"),
                "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32},
                "modifiers": [{"ShortGPT": {"n": 1}}], **changes}
        (tmp_path / name).write_text(yaml.safe_dump(data, sort_keys=False))
        return str(tmp_path / name)

    return tmp_path, recipe


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any command gets as far as loading weights (or writing GGUF tensors)."""
    forbid_loading(monkeypatch, "the model was loaded before the error was found")


def one_line_error(capsys, argv, *fragments, code=2):
    got = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert got == code, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def listing(path):
    return sorted(p.name for p in path.iterdir())


# zero-shot task names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["validate", "apply"])
def test_misspelled_task_is_refused_up_front(work, capsys, no_loading, command):
    tmp, recipe = work
    path = recipe(evaluate={"tasks": ["arc_esay"]})
    one_line_error(capsys, [command, path], f"{path}: field 'evaluate.tasks': no offline config for task(s) "
                                            f"arc_esay; did you mean 'arc_easy'?")
    assert listing(tmp) == ["cal.txt", "r.yaml"]


def test_hub_task_names_come_from_lm_evals_index(work, capsys, no_loading, monkeypatch):
    """task_data: hub checks the name against lm-eval's own task index (read from its installed configs)."""
    monkeypatch.setattr(zeroshot, "hub_unreachable", lambda timeout_s=3.0: None)
    assert {"arc_easy", "piqa", "hellaswag"} <= zeroshot.hub_task_names()
    _, recipe = work
    path = recipe(evaluate={"tasks": ["hellaswag", "hellaswga"], "task_data": "hub"})
    one_line_error(capsys, ["validate", path], "field 'evaluate.tasks': lm-eval has no task(s) hellaswga; "
                                               "did you mean 'hellaswag'?")


@pytest.mark.parametrize("command", ["validate", "apply"])
def test_missing_perplexity_text_is_refused_up_front(work, capsys, no_loading, command):
    _, recipe = work
    path = recipe(evaluate={"perplexity": {"dataset": ["./missing.txt", "./gone.jsonl"]}})
    one_line_error(capsys, [command, path], "field 'evaluate.perplexity.dataset': no evaluation text available: "
                                            "data not found: ./missing.txt; data not found: ./gone.jsonl")


def test_validate_and_apply_refuse_the_same_recipes(work, capsys, no_loading):
    """``validate`` checks exactly what ``apply`` checks before loading (except the output and this machine's
    devices): the same one line for each bad recipe."""
    tmp, recipe = work
    bad = [{"evaluate": {"tasks": ["piqa", "wingrande"]}},
           {"evaluate": {"perplexity": {"dataset": [str(tmp / "cal.txt")], "seq_len": 4096}}},
           {"device": "mps"}, {"device": "cuda:x"}, {"calibration": {"dataset": "./none.txt"}},
           {"model": "./no/model"}, {"modifiers": [{"ShortGPT": {"n": 4}}]}]
    for changes in bad:
        path = recipe(**changes)
        assert one_line_error(capsys, ["validate", path]) == one_line_error(capsys, ["apply", path]), changes
    assert listing(tmp) == ["cal.txt", "r.yaml"]


# devices ------------------------------------------------------------------------------------------------------

def without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def device_commands(tmp, recipe, model_dir, device):
    return {"apply": ["apply", recipe(), "--device", device, "--quiet"],
            "sweep": ["sweep", recipe(), "--vary", "n=1", "--output", str(tmp / "sw"), "--set", f"device={device}"],
            "eval": ["eval", str(model_dir), "--device", device, "--no-ppl", "--tasks", "arc_easy"],
            "bench": ["bench", str(model_dir), "--device", device]}


@pytest.mark.parametrize("command", ["apply", "sweep", "eval", "bench"])
@pytest.mark.parametrize("device,message", [("mps", "device 'mps' is not supported (auto, cpu, cuda, cuda:i)"),
                                            ("xpu:0", "device 'xpu:0' is not supported"),
                                            ("cuda", "device 'cuda' requested but no CUDA device is available"),
                                            ("cuda:1", "device 'cuda:1' requested but no CUDA device")])
def test_unavailable_device_is_refused_before_loading(work, model_dir, capsys, no_loading, monkeypatch,
                                                      command, device, message):
    without_cuda(monkeypatch)
    tmp, recipe = work
    one_line_error(capsys, device_commands(tmp, recipe, model_dir, device)[command], message)
    assert listing(tmp) == ["cal.txt", "r.yaml"]


def test_cuda_index_beyond_the_machines_devices(work, capsys, no_loading, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _, recipe = work
    one_line_error(capsys, ["apply", recipe(), "--device", "cuda:2"], "field 'device': device 'cuda:2' requested "
                                                                       "but this machine has 2 CUDA device(s)")


def test_validate_accepts_a_cuda_recipe_on_a_cpu_machine_but_not_mps(work, capsys, monkeypatch):
    without_cuda(monkeypatch)
    _, recipe = work
    assert main(["validate", recipe(), "--device", "cuda:3"]) == 0
    one_line_error(capsys, ["validate", recipe(), "--device", "mps"], "field 'device': device 'mps' is not supported")


# sweep ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup,fragment", [
    ("file", "exists and is not a directory"),
    ("bad json", "sweep.json is not an earlier sweep's record"),
    ("no rows", "sweep.json is not an earlier sweep's record; move it away"),
    ("proc", "cannot write '/proc/x'"),
])
def test_sweep_output_is_checked_before_loading(work, capsys, no_loading, setup, fragment):
    tmp, recipe = work
    target = tmp / "sw"
    if setup == "file":
        target.write_text("not a directory")
    elif setup in ("bad json", "no rows"):
        target.mkdir()
        (target / "sweep.json").write_text("{" if setup == "bad json" else '{"vary": []}')
    path = recipe()
    before = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
    one_line_error(capsys, ["sweep", path, "--vary", "n=1,2", "--quiet", "--output",
                            "/proc/x" if setup == "proc" else str(target)], fragment)
    assert {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("argv,fragment", [
    (["--tasks", "arc_esay"], "field 'evaluate.tasks': no offline config for task(s) arc_esay; did you mean"),
    (["--vary", "n=1,9"], "step 0 (ShortGPT)"),  # the second variant removes more layers than the model has
    (["--set", "calibration.dataset=./none.txt"], "data not found: ./none.txt"),
    (["--eval-limit", "0"], "argument --eval-limit: expected a positive integer"),
])
def test_every_sweep_variant_is_checked_before_the_first_load(work, capsys, no_loading, argv, fragment):
    tmp, recipe = work
    args = ["sweep", recipe(), "--output", str(tmp / "sw"), "--quiet"] + argv
    one_line_error(capsys, args + ([] if "--vary" in argv else ["--vary", "n=1"]), fragment)
    assert listing(tmp) == ["cal.txt", "r.yaml"]


# export -----------------------------------------------------------------------------------------------------

def export(directory, target, *extra):
    return ["export", str(directory), "--format", "gguf", "--output", str(target), *extra]


def test_export_to_a_directory_with_force(gguf_ready, tmp_path, capsys, no_loading):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "keep.txt").write_text("mine")
    one_line_error(capsys, export(gguf_ready, tmp_path / "dir", "--force"),
                   f"--output {tmp_path / 'dir'}: is a directory; give a file name")
    assert listing(tmp_path) == ["dir"]
    assert listing(tmp_path / "dir") == ["keep.txt"]


@pytest.mark.parametrize("target,fragment", [("/proc/x.gguf", "cannot write '/proc/x.gguf': /proc:"),
                                             ("{tmp}/file/x.gguf", "is a file, not a directory")])
def test_export_to_an_unwritable_place(gguf_ready, tmp_path, capsys, no_loading, target, fragment):
    (tmp_path / "file").write_text("a file")
    one_line_error(capsys, export(gguf_ready, target.format(tmp=tmp_path)), fragment)
    assert listing(tmp_path) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_export_to_a_read_only_directory(gguf_ready, tmp_path, capsys, no_loading):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    one_line_error(capsys, export(gguf_ready, locked / "m.gguf"), "Permission denied")
    assert listing(locked) == []


def test_export_to_a_full_disk_is_refused_before_writing(gguf_ready, tmp_path, capsys, monkeypatch, no_loading):
    real = output.shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    err = one_line_error(capsys, export(gguf_ready, tmp_path / "m.gguf", "--type", "f32"),
                         f"--output {tmp_path / 'm.gguf'}: not enough disk space for the f32 GGUF file: needs about")
    assert "GiB free on" in err
    assert listing(tmp_path) == []


def test_export_size_estimate_matches_the_written_file(gguf_ready, tmp_path):
    """The free-space check's size (tensor types from the plan, vocabulary) is within 5 % of the real file."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_ready)
    adapter = gguf_export.gguf_adapter(config)
    for kind in ("f32", "q8_0"):
        written = gguf_export.export_gguf(gguf_ready, tmp_path / f"{kind}.gguf", kind)["bytes"]
        plan = gguf_export._tensor_plan(gguf_ready, config, kind, adapter)
        tokens = gguf_vocabulary._vocabulary(gguf_ready, config.vocab_size).tokens
        assert abs(gguf_export.planned_bytes(plan, tokens) - written) < 0.05 * written, kind


def test_export_disk_full_while_writing_is_one_line_and_leaves_nothing(gguf_ready, tmp_path, capsys, monkeypatch):
    import errno

    original = gguf_export._encoding
    calls = []

    def full(tensor, qtype):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(tensor, qtype)

    monkeypatch.setattr(gguf_export, "_encoding", full)
    one_line_error(capsys, export(gguf_ready, tmp_path / "m.gguf"),
                   "GGUF export: writing", "No space left on device; nothing written")
    assert listing(tmp_path) == []


def test_export_removes_the_temporary_of_a_killed_export(gguf_ready, tmp_path, capsys):
    (tmp_path / ".m.gguf.tmp-99999999").write_bytes(b"GGUF half")
    assert main(export(gguf_ready, tmp_path / "m.gguf", "--type", "f32")) == 0
    assert "removed" in capsys.readouterr().err
    assert listing(tmp_path) == ["m.gguf"]


# eval, bench, plan -----------------------------------------------------------------------------------------

def test_eval_hub_tasks_offline_is_one_line_before_loading(model_dir, tmp_path, capsys, no_loading, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    one_line_error(capsys, ["eval", str(model_dir), "--task-data", "hub", "--tasks", "piqa", "--no-ppl"],
                   "task_data: hub reads task(s) piqa from the HF hub, and the HF hub (127.0.0.1) cannot be reached")
    assert time.perf_counter() - start < 10
    assert listing(tmp_path) == []


@pytest.mark.parametrize("argv,fragment", [
    (["--tasks", "arc_esay"], "no offline config for task(s) arc_esay; did you mean 'arc_easy'?"),
    (["--dataset", "./missing.txt"], "no evaluation text available: data not found: ./missing.txt"),
])
def test_eval_checks_tasks_and_text_before_loading(model_dir, tmp_path, capsys, no_loading, monkeypatch, argv,
                                                  fragment):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, ["eval", str(model_dir), "--device", "cpu", "--json", "r.json"] + argv, fragment)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_missing_model_is_one_line_before_loading(tmp_path, capsys, no_loading, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, [command, "./no/model", "--device", "cpu"], "model not found: ./no/model")


@pytest.mark.parametrize("ranks", ["0", "-2", "x"])
def test_plan_ranks_must_be_positive(work, capsys, ranks):
    _, recipe = work
    one_line_error(capsys, ["plan", recipe(), "--ranks", ranks], "argument --ranks: expected a positive integer")


def test_plan_ranks_from_world_size(work, capsys, monkeypatch):
    _, recipe = work
    monkeypatch.setenv("WORLD_SIZE", "0")
    one_line_error(capsys, ["plan", recipe()], "environment variable WORLD_SIZE (the default of recipe plan "
                   "--ranks): expected a positive integer, got 0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["plan", recipe(), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_parallel"] is not None


# output permissions -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_output_file_has_the_umasks_mode(work, umask):
    """safetensors writes ``model.safetensors`` through a private (0600) temporary file: the output gets the
    mode every other file gets from the umask, so whoever can read the output can read the weights."""
    tmp, recipe = work
    previous = os.umask(umask)
    try:
        assert main(["apply", recipe(), "--quiet", "--device", "cpu"]) == 0
        (tmp / "probe").write_text("a plain open()")
    finally:
        os.umask(previous)
    expected = stat.S_IMODE((tmp / "probe").stat().st_mode)
    assert expected == 0o666 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp / "out").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {expected}, modes


def test_hub_rows_that_cannot_be_read_are_one_line(monkeypatch):
    """In HF offline mode the reachability check is skipped (the caches are used): a task whose rows are not
    cached fails in lm-eval with a ConnectionError, which becomes one line."""
    import lm_eval
    import lm_eval.models.huggingface as hf

    from recipe_engine.errors import SourceError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(zeroshot, "hub_task_names", lambda: frozenset({"piqa"}))
    monkeypatch.setattr(hf, "HFLM", lambda **_: type("Wrapped", (), {"device": torch.device("cpu")})())

    def offline(**_):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)\nmore")
    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    with pytest.raises(SourceError) as caught:
        zeroshot.run_harness(None, None, ["piqa"], 2, "hub")
    assert str(caught.value) == ("task_data: hub: cannot read the rows of piqa: Couldn't reach 'baber/piqa' on the "
                                 "Hub (LocalEntryNotFoundError)")
