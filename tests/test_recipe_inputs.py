"""Hostile and mistaken recipe input: one line (exit 2), nothing written, before any weight is loaded.

YAML bounds (size, nesting, alias expansion), YAML 1.2 booleans (``stream: on``), exact numbers in every
parameter model (no boolean as a number, finite floats), duplicate parameters, an unknown top-level key
named with a suggestion, model names (did-you-mean, not found), ``$RECIPE_CACHE`` and a truncated source
checkpoint. In-process calls of the CLI's ``main`` on a tiny random model saved to a temporary directory.
"""
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine.workflows import runner
from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.schema import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, parse_step, safe_load
from recipe_engine.sources import packages

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def work(tmp_path, model_dir, monkeypatch):
    """tmp_path (the working directory) with cal.txt, a recipe writer, and apply's loading refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cal.txt").write_text(TEXT)
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    header = f"version: 1\nname: t\nmodel: {model_dir}\noutput: {tmp_path}/out\n"
    calibration = f"calibration: {{dataset: {tmp_path}/cal.txt, samples: 4, seq_len: 32, batch_size: 2}}\n"

    def recipe(body: str, prefix: str = "", model: str | None = None) -> str:
        """``prefix``, the header (with ``model`` instead of the tiny model's directory), then ``body`` (with
        the tiny calibration section unless it has its own)."""
        path = tmp_path / "r.yaml"
        head = header if model is None else header.replace(f"model: {model_dir}", f"model: '{model}'")
        path.write_text(prefix + head + ("" if body.startswith("calibration:") else calibration) + body)
        return str(path)

    return tmp_path, recipe


def refused(capsys, recipe, *fragments, commands=("validate", "apply")):
    """Each command: exit 2, one stderr line holding the fragments; the lines of all commands returned."""
    lines = []
    for command in commands:
        code = main([command, recipe])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        for fragment in fragments:
            assert fragment in err, err
        lines.append(err)
    assert not (Path(recipe).parent / "out").exists()
    return lines


# --- YAML bounds --------------------------------------------------------------------------------------

def laughs(levels: int, width: int = 10) -> str:
    """The "billion laughs" alias bomb: ``width ** levels`` strings from a few hundred bytes."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_a_string_field_is_one_line_in_bounded_memory(work, capsys):
    """10**9 strings once expanded: refused at compose time, the process grows by a few MB at most."""
    _, recipe = work
    path = recipe("description: *l9\nmodifiers: [FuseNorm]\n", prefix=laughs(9))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    refused(capsys, path, "YAML error at line 1, column 1: aliases expand to more than 100,000 nodes")
    assert time.perf_counter() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: under 100 MB


def test_aliases_within_the_bound_still_load():
    """A recipe may share values through anchors; the bound counts the expanded size exactly."""
    assert safe_load(laughs(3))["l3"] == [[[["lol"] * 10] * 10] * 10] * 10  # l3: 11,111 nodes expanded
    expanded = 1 + sum(10 ** i for i in range(1, 5)) + 10 ** 5  # l4: 111,111 nodes, past the bound
    assert expanded > MAX_YAML_NODES
    with pytest.raises(yaml.YAMLError, match="aliases expand to more than 100,000 nodes"):
        safe_load(laughs(4))


def test_an_alias_inside_its_own_anchor_is_refused():
    with pytest.raises(yaml.YAMLError, match="an alias refers to a node that contains it"):
        safe_load("a: &a [1, *a]\n")


@pytest.mark.parametrize("depth, ok", [(MAX_YAML_DEPTH - 1, True), (MAX_YAML_DEPTH + 1, False), (5000, False)])
def test_nesting_is_bounded(depth, ok):
    """Nesting past the bound is refused by the composer (no RecursionError at any depth)."""
    text = "x: " + "[" * depth + "]" * depth
    if ok:
        value = safe_load(text)["x"]
        for _ in range(depth - 1):
            value = value[0]
        assert value == []
    else:
        with pytest.raises(yaml.YAMLError, match=f"nested deeper than {MAX_YAML_DEPTH} levels"):
            safe_load(text)


def test_deep_nesting_in_a_recipe_is_one_line(work, capsys):
    _, recipe = work
    path = recipe("description: " + "[" * 5000 + "]" * 5000 + "\nmodifiers: [FuseNorm]\n")
    refused(capsys, path, f"{path}: YAML error at line 6, column 77: nested deeper than 64 levels")


def test_a_recipe_over_the_size_bound_is_refused_before_reading(work, capsys):
    _, recipe = work
    path = recipe("description: '" + "x" * MAX_YAML_BYTES + "'\nmodifiers: [FuseNorm]\n")
    refused(capsys, path, f"{path}: {Path(path).stat().st_size:,} bytes; a recipe is read only up to "
                          f"{MAX_YAML_BYTES:,} bytes of YAML")
    with pytest.raises(yaml.YAMLError, match="bytes of YAML; at most 1,048,576 are read"):
        safe_load("x" * (MAX_YAML_BYTES + 1))  # --set and step values go through the same loader


def test_hostile_yaml_from_a_subprocess_is_one_line_without_a_traceback(tmp_path):
    """As a user meets it: the CLI in a subprocess under a 2 GiB address-space limit (an expanding bomb
    would be killed or raise MemoryError), from a directory outside the checkout."""
    import os

    for name, text in (("bomb.yaml", laughs(9) + "description: *l9\n"), ("deep.yaml", "[" * 20000 + "]" * 20000)):
        (tmp_path / name).write_text(text)
        limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
        run = subprocess.run([sys.executable, "-c", limit + "import sys; from recipe_engine.cli import main; "
                              "sys.exit(main(sys.argv[1:]))", "validate", name], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr[-2000:]
        assert run.stderr.startswith(f"error: {name}: YAML error"), run.stderr


# --- YAML 1.2 booleans: stream: on -------------------------------------------------------------------------

def test_stream_on_as_the_readme_writes_it(work, capsys):
    """``on``/``off``/``yes``/``no`` are strings (YAML 1.2): ``stream: on`` is the mode 'on'; a true/false
    field still reads them as booleans (pydantic)."""
    from recipe_engine.recipe.files import load_recipe

    _, recipe = work
    for mode in ("on", "off", "auto"):
        assert load_recipe(recipe(f"stream: {mode}\nmodifiers: [FuseNorm]\n")).recipe.stream == mode
    loaded = load_recipe(recipe("calibration: {dataset: cal.txt, offload: no}\nmodifiers: [FuseNorm]\n"))
    assert loaded.recipe.calibration.offload is False
    assert load_recipe(recipe("description: yes\nmodifiers: [FuseNorm]\n")).recipe.description == "yes"
    assert safe_load("[true, True, FALSE, on, off, yes, no, y, n]") == [True, True, False, "on", "off", "yes",
                                                                        "no", "y", "n"]
    main(["validate", recipe("stream: on\nmodifiers: [FuseNorm]\n")])
    assert capsys.readouterr().out.strip().endswith("ok (llama, 4 → 4 layers)")


def test_set_stream_on_on_the_command_line(work, capsys):
    _, recipe = work
    assert main(["show", recipe("modifiers: [FuseNorm]\n"), "--set", "stream=on"]) == 0
    assert "stream: 'on'" in capsys.readouterr().out


# --- recipe keys and parameters ----------------------------------------------------------------------------

def test_capitalised_modifiers_key_is_named_with_a_suggestion(work, capsys):
    _, recipe = work
    refused(capsys, recipe("Modifiers: [FuseNorm]\n"),
            "field 'Modifiers': unknown field; did you mean 'modifiers'?")


def test_an_unknown_key_inside_a_section_lists_that_section_s_fields(work, capsys):
    _, recipe = work
    refused(capsys, recipe("calibration: {dataset: cal.txt, sample: 4}\nmodifiers: [FuseNorm]\n"),
            "field 'calibration.sample': unknown field; did you mean 'samples'? (known: dataset, split, samples,")


@pytest.mark.parametrize("body, fragment", [
    ("modifiers: ['ShortGPT<n:2,n:3>']\n", "step 0: parameter 'n' given twice in 'ShortGPT<n:2,n:3>'"),
    ("modifiers: ['LaCo<combine:3,C:4>']\n", "step 0 (LaCo): field 'combine': given twice, as 'combine' and as its "
                                             "alias 'C'"),
    ("modifiers:\n  - ShortGPT:\n      n: 1\n      n: 2\n",
     "YAML error at line 9, column 7: duplicate key 'n' (first given at line 8)"),
])
def test_a_parameter_given_twice_is_refused(work, capsys, body, fragment):
    _, recipe = work
    refused(capsys, recipe(body), fragment)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1e999"])
def test_floats_are_finite_in_every_parameter_model(work, capsys, value):
    """Engine-wide (``recipe_engine.recipe.strict``): a modifier's float, a nested parameter model's float
    (``LinearPatch``'s ``tune``: its own ``gt=0`` may refuse first), and a recipe section's float.
    (``1e999`` is a string in YAML, which pydantic reads as inf.)"""
    _, recipe = work
    refused(capsys, recipe(f"modifiers: ['NystromMLP<lambda_scale:{value}>']\n"),
            "step 0 (NystromMLP): field 'lambda_scale': Input should be a finite number (got ")
    refused(capsys, recipe(f"modifiers: ['ShortGPT<n:1>', {{LinearPatch: {{tune: {{lr: {value}}}}}}}]\n"),
            "step 1 (LinearPatch): field 'tune", "lr")
    refused(capsys, recipe(f"evaluate: {{min_retained: {value}}}\nmodifiers: [FuseNorm]\n"),
            "field 'evaluate.min_retained': Input should be a finite number")
    if value in (".inf", "1e999"):  # past every bound check: refused as not finite
        refused(capsys, recipe(f"modifiers: ['ShortGPT<n:1>', {{LinearPatch: {{tune: {{lr: {value}}}}}}}]\n"),
                "step 1 (LinearPatch): field 'tune': lr: must be a finite number (got inf)")


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_is_not_a_number_in_any_parameter_model(work, capsys, value):
    _, recipe = work
    refused(capsys, recipe(f"modifiers: ['ShortGPT<n:{value}>']\n"),
            f"step 0 (ShortGPT): field 'n': expected a number, got the boolean {value}")
    nested = (f"step 1 (LinearPatch): field 'tune': epochs: expected a number, got the boolean {value}"
              if value == "true" else "step 1 (LinearPatch): field 'tune.epochs': Input should be greater than or "
                                      "equal to 1 (got False)")  # a nested model's own bound may refuse first
    refused(capsys, recipe(f"modifiers: ['ShortGPT<n:1>', {{LinearPatch: {{tune: {{epochs: {value}}}}}}}]\n"), nested)
    refused(capsys, recipe(f"calibration: {{dataset: cal.txt, samples: {value}}}\nmodifiers: [FuseNorm]\n"),
            f"field 'calibration.samples': expected a number, got the boolean {value}")


def test_a_boolean_in_a_list_of_numbers_is_refused(work, capsys):
    _, recipe = work
    refused(capsys, recipe("modifiers: [{HeadPrune: {layers: [1, false]}}]\n"),
            "step 0 (HeadPrune): field 'layers': item 1: expected a number, got the boolean false")


def test_numbers_and_booleans_where_they_belong_still_validate():
    """The strict checks refuse only coercions: ints, floats from ints, and true/false for bool fields."""
    step = parse_step("NystromMLP<lambda_scale:5>", 0)
    assert step.lambda_scale == 5.0 and isinstance(step.lambda_scale, float)
    assert parse_step("ShortGPT<n:3>", 0).n == 3
    assert parse_step({"LinearPatch": {"tune": {"lr": 0.001, "epochs": 2}}}, 0).tune.epochs == 2
    with pytest.raises(RecipeError, match="got the boolean true"):
        parse_step({"ShortGPT": {"n": True}}, 0)
    assert math.isfinite(parse_step("NystromMLP<lambda_scale:1e308>", 0).lambda_scale)


# --- model sources ---------------------------------------------------------------------------------------

def test_a_misspelt_builtin_model_gets_did_you_mean_without_the_hub(work, capsys, monkeypatch):
    from recipe_engine.sources import models

    monkeypatch.setattr(models, "hub_unreachable", lambda *a: pytest.fail("the hub was probed"))
    _, recipe = work
    path = recipe("modifiers: [FuseNorm]\n", model="smollm2-136m")
    refused(capsys, path, "model 'smollm2-136m' is not a builtin alias, a local directory or a .gguf file; "
                          "did you mean 'smollm2-135m'?")


@pytest.mark.parametrize("spec", ["./models/mine", "models/mine", "../elsewhere/model", "my model",
                                  "a/b/c"])
def test_a_missing_model_path_is_not_found(work, capsys, monkeypatch, spec):
    """A path-like model that does not exist is "not found" (``models/`` exists here: ``models/mine`` is a
    path, not a hub id), never a hub connection error."""
    from recipe_engine.sources import models

    monkeypatch.setattr(models, "hub_unreachable", lambda *a: pytest.fail("the hub was probed"))
    tmp, recipe = work
    (tmp / "models").mkdir()
    path = recipe("modifiers: [FuseNorm]\n", model=spec)
    refused(capsys, path, f"model not found: {spec} (not a directory, .gguf file or builtin alias; builtins: "
                          f"smollm2-135m")


def test_a_truncated_source_checkpoint_is_named_before_loading(work, capsys, model_dir, tmp_path):
    """The source's safetensors header and data are checked against the file size: the message names the
    source file, not the output."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    full = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(full - 1000)
    _, recipe = work
    path = recipe("modifiers: [FuseNorm]\n", model=str(broken))
    refused(capsys, path, f"source model file {weights}: {full - 1000:,} bytes, but its tensors need {full:,} "
                          f"(truncated")
    with open(weights, "r+b") as handle:
        handle.truncate(5)
    refused(capsys, path, f"source model file {weights}: 5 bytes: too short for a safetensors header")
    weights.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    refused(capsys, path, f"source model file {weights}: 10 bytes, but its header alone claims 1,000,000,000")


def test_recipe_cache_that_is_a_file_is_one_line(work, capsys, monkeypatch, tmp_path):
    from tests.helpers import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "cache-file").write_text("")
    _, recipe = work
    path = recipe("modifiers: [FuseNorm]\n", model=str(tmp_path / "tiny.gguf"))
    for cache, detail in ((tmp_path / "cache-file", ""),
                          (tmp_path / "cache-file" / "sub", f" ({tmp_path / 'cache-file'} is not a directory)")):
        monkeypatch.setenv("RECIPE_CACHE", str(cache))
        refused(capsys, path, f"the model cache $RECIPE_CACHE={cache} is not a directory{detail}; set "
                              f"RECIPE_CACHE to a directory")
        with pytest.raises(RecipeError):
            packages.cache_root()
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "new" / "cache"))
    assert packages.cache_root() == tmp_path / "new" / "cache"  # not there yet: created when first written
