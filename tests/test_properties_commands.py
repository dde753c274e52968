"""Property test of every command's arguments: whatever the flags and values, a command given one bad
argument (among good ones) is refused by its pre-flight — exit code 2, exactly one ``error: ...`` line, no
traceback, nothing written — before any model is loaded or any GGUF tensor is written (both are replaced by
a function that fails the test). Fast: no example gets past the pre-flight.
"""
import contextlib
import io
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recipe_engine.cli import main
from tests.helpers import forbid_loading, save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Per command: flag → good values and bad values ({work} is the working directory, {model} the tiny model,
#: {exportable} the model export reads).
GOOD = {
    "plan": {"--ranks": ["1", "3"], "--json": [None], "--set": ["calibration.samples=8"], "--device": ["cuda:1"]},
    "validate": {"--device": ["cpu", "auto", "cuda:1"], "--set": ["calibration.samples=8"],
                 "--output": ["{work}/o"]},
    "apply": {"--device": ["cpu", "auto"], "--set": ["calibration.samples=8"], "--output": ["{work}/o"],
              "--no-checkpoints": [None]},
    "sweep": {"--tasks": ["arc_easy"], "--eval-limit": ["2"], "--set": ["calibration.samples=8"],
              "--quiet": [None]},
    "export": {"--type": ["f32", "q8_0"], "--force": [None]},
    "eval": {"--device": ["cpu"], "--tasks": ["arc_easy"], "--limit": ["2"], "--seq-len": ["32"],
             "--json": ["{work}/e.json"], "--dataset": ["{work}/cal.txt"]},
    "bench": {"--device": ["cpu"], "--batch": ["1"], "--json": ["{work}/b.json"], "--dtype": ["bfloat16"]},
}
BAD = {
    "plan": {"--ranks": ["0", "-2", "x", ""], "--set": ["calibration.sample=8", "modifiers.7.n=1", "x"],
             "--device": ["mps", "cpu:x"]},
    "validate": {"--device": ["mps", "xpu", "cuda:x", "", "meta"],
                 "--set": ["evaluate.tasks=[arc_esay]", "evaluate.perplexity.dataset=./none.txt",
                           "calibration.dataset=./none.txt", "modifiers.0.n=9", "model=./none",
                           "calibration.seq_len=257", "evaluate.perplexity.seq_len=300",
                           "calibration.seed=100000000000000000000000", "calibration.samples=9223372036854775808"],
                 "--output": ["{work}/" + "o" * 245, "{work}/" + "o" * 300], "--model": ["", "{work}/cal.txt"]},
    "apply": {"--device": ["mps", "cuda", "cuda:0", "xpu", ""],
              "--set": ["evaluate.tasks=[piqa, arc_esay]", "evaluate={perplexity: {dataset: ./none.txt}}",
                        "modifiers.0.n=9"],
              "--output": ["{work}/cal.txt", "/proc/x", "{work}/cal.txt/o", "", "{model}", "{work}/" + "o" * 245],
              "--model": ["", " "]},
    "sweep": {"--tasks": ["arc_esay", "hellaswga"], "--eval-limit": ["0", "-1"],
              "--output": ["{work}/cal.txt", "/proc/x"],
              "--set": ["device=mps", "device=cuda", "calibration.samples=0", "calibration.seq_len=257"],
              "--vary": ["n=1,9", "q=1", "n", "modifiers.0.n=1,2"]},
    "export": {"--type": ["q4", ""], "--output": ["{work}", "/proc/x.gguf", "{work}/cal.txt/x.gguf", "",
                                                  "{exportable}/model.safetensors", "{work}/" + "o" * 250 + ".gguf"],
               "--format": ["onnx"]},
    "eval": {"--device": ["mps", "cuda", "cuda:1"], "--tasks": ["arc_esay", "piqa_"], "--limit": ["0"],
             "--dataset": ["./none.txt"], "--seq-len": ["0", "257"],
             "--json": ["{work}", "{work}/cal.txt/x", "{model}/config.json", "{model}"],
             "--task-data": ["web"]},
    "bench": {"--device": ["mps", "cuda", "tpu"], "--batch": ["0"], "--json": ["{work}", "{model}/model.safetensors"],
              "--prefill-tokens": ["256"],
              "--repeats": ["-1"]},
}
COMMANDS = sorted(GOOD)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tests.test_gguf_export import saved

    tiny = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_model(tiny)
    return tiny, saved(tmp_path_factory.mktemp("gguf"))[1]


@pytest.fixture
def guarded(monkeypatch):
    """No CUDA (the same on every machine), and no loading or GGUF writing: either fails the property."""
    forbid_loading(monkeypatch, "got past the pre-flight")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def base_argv(command: str, work: Path, tiny: Path, exportable: Path) -> list[str]:
    recipe = work / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "version": 1, "name": "t", "model": str(tiny), "output": str(work / "out"),
        "calibration": {"dataset": str(work / "cal.txt"), "samples": 4, "seq_len": 32},
        "modifiers": [{"ShortGPT": {"n": 1}}],
        "evaluate": {"perplexity": {"dataset": [str(work / "cal.txt")], "seq_len": 32}}}))
    return {"plan": ["plan", str(recipe)], "validate": ["validate", str(recipe)],
            "apply": ["apply", str(recipe), "--quiet"],
            "sweep": ["sweep", str(recipe), "--vary", "n=1", "--output", str(work / "sw")],
            "export": ["export", str(exportable), "--format", "gguf", "--output", str(work / "m.gguf")],
            "eval": ["eval", str(tiny)],
            "bench": ["bench", str(tiny), "--prefill-tokens", "64", "--gen-tokens", "4"]}[command]


@st.composite
def arguments(draw):
    """(command, [(flag, value)]): one bad argument and up to two good ones of other flags, shuffled."""
    command = draw(st.sampled_from(COMMANDS))
    bad_flag = draw(st.sampled_from(sorted(BAD[command])))
    chosen = [(bad_flag, draw(st.sampled_from(BAD[command][bad_flag])))]
    others = sorted(flag for flag in GOOD[command] if flag != bad_flag)
    for flag in draw(st.lists(st.sampled_from(others), max_size=2, unique=True)) if others else []:
        chosen.append((flag, draw(st.sampled_from(GOOD[command][flag]))))
    return command, draw(st.permutations(chosen))


@SETTINGS
@given(case=arguments())
def test_one_bad_argument_is_refused_by_the_preflight(model_dirs, guarded, case):
    command, chosen = case
    with tempfile.TemporaryDirectory() as name:
        work = Path(name)
        (work / "cal.txt").write_text(TEXT)
        argv = base_argv(command, work, *model_dirs)
        for flag, value in chosen:
            argv += [flag] if value is None else [flag, value.replace("{work}", str(work)).replace(
                "{model}", str(model_dirs[0])).replace("{exportable}", str(model_dirs[1]))]
        before = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
        err = io.StringIO()
        with contextlib.chdir(work), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        lines = err.getvalue().strip().splitlines()
        assert code == 2, (argv, code, lines)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], (argv, lines)
        assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == before, (argv, lines)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_good_arguments_pass_the_preflight(model_dirs, guarded, command):
    """Without the bad argument the same command gets past its pre-flight (to the guard, or, for plan and
    validate, to success): the refusals above are the bad argument's."""
    with tempfile.TemporaryDirectory() as name, contextlib.chdir(name):
        work = Path(name)
        (work / "cal.txt").write_text(TEXT)
        argv = base_argv(command, work, *model_dirs)
        for flag, values in GOOD[command].items():
            argv += [flag] if values[0] is None else [flag, values[0].replace("{work}", str(work))]
        if command in ("plan", "validate"):
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(argv) == 0
        else:
            with pytest.raises(AssertionError, match="got past the pre-flight"):
                main(argv)
