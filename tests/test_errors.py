"""Every user mistake: one line naming file, step and field; exit code 2; nothing written."""
import pytest
import yaml

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError

GOOD = {"version": 1, "name": "t", "model": "smollm2-135m", "modifiers": ["FuseNorm"]}


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


def recipe_file(tmp_path, data):
    path = tmp_path / "bad.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


CASES = [
    ("yaml syntax", "version: 1\nmodifiers: [FuseNorm\n", ["bad.yaml", "YAML syntax error at line"]),
    ("not a mapping", "- FuseNorm\n", ["bad.yaml", "a recipe is a YAML mapping"]),
    ("unknown modifier", {**GOOD, "modifiers": ["FuseNorm", "FuzeNorm"]},
     ["bad.yaml: step 1: unknown modifier 'FuzeNorm'; did you mean 'FuseNorm'?"]),
    ("misspelled field", {**GOOD, "modifiers": ["FuseNorm<untei:true>"]},
     ["bad.yaml: step 0 (FuseNorm): field 'untei': unknown field; did you mean 'untie'?"]),
    ("mistyped field", {**GOOD, "modifiers": [{"FuseNorm": {"untie": "maybe"}}]},
     ["bad.yaml: step 0 (FuseNorm): field 'untie':", "'maybe'"]),
    ("out of range", {**GOOD, "calibration": {"samples": 0}},
     ["bad.yaml: field 'calibration.samples': Input should be greater than 0"]),
    ("unknown top-level field", {**GOOD, "modifier": ["FuseNorm"]},
     ["bad.yaml: field 'modifier': unknown field; did you mean 'modifiers'?"]),
    ("wrong version", {**GOOD, "version": 2}, ["bad.yaml: field 'version'"]),
    ("bad step shape", {**GOOD, "modifiers": [{"FuseNorm": {}, "Other": {}}]},
     ["bad.yaml: step 0: a step is"]),
    ("missing model", {**GOOD, "model": "./no/such/model"}, ["bad.yaml", "model not found: ./no/such/model"]),
    ("missing data", {**GOOD, "calibration": {"dataset": "./missing.jsonl"}},
     ["data not found: ./missing.jsonl"]),
]


@pytest.mark.parametrize("label,data,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_recipe_is_one_clear_line(tmp_path, capsys, label, data, expected):
    path = recipe_file(tmp_path, data if isinstance(data, str) else {**data, "output": str(tmp_path / "out")})
    code, err = run_cli(capsys, "apply", str(path), "--quiet")
    assert code == 2
    assert len(err.splitlines()) == 1, err
    for fragment in expected:
        assert fragment in err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_existing_output_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    path = recipe_file(tmp_path, {**GOOD, "output": str(out)})
    code, err = run_cli(capsys, "apply", str(path), "--quiet")
    assert code == 2
    assert f"field 'output': output '{out}' already exists (use --force to replace it)" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import GPT2Config

    model_dir = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(model_dir)
    path = recipe_file(tmp_path, {**GOOD, "model": str(model_dir), "output": str(tmp_path / "out")})
    code, err = run_cli(capsys, "validate", str(path))
    assert code == 2
    assert err == (f"error: {path}: unsupported architecture 'gpt2'; supported: gemma3_text, gpt_oss, llama, mistral, "
                   f"mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe")


def test_missing_recipe_file(capsys):
    code, err = run_cli(capsys, "show", "no/such/recipe.yaml")
    assert code == 2 and err == "error: no/such/recipe.yaml: recipe file not found"


def test_recipe_error_renders_location():
    e = RecipeError("expected an int", file="r.yaml", step=2, modifier="HeadPrune", field="n")
    assert str(e) == "r.yaml: step 2 (HeadPrune): field 'n': expected an int"
