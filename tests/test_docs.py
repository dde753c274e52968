"""The documentation site: it builds with ``--strict``, its generated reference pages are what the code renders,
and the worked example of the modifier guide runs."""
import copy
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.registry import REGISTRY
from tests.helpers import CharTokenizer, hf_model_with_layers, random_tokens, tiny_model

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "writing_a_modifier.md"
TEXT = "Calibration text for the documentation example, repeated to have enough tokens. " * 300


def _render_module():
    spec = importlib.util.spec_from_file_location("render_reference", ROOT / "scripts" / "render_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_what_the_code_renders():
    render = _render_module()
    for path, text in render.rendered().items():
        assert path.exists(), f"{path.relative_to(ROOT)} is missing; generate it with `{render.COMMAND}`"
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} differs from what the code renders; regenerate with `{render.COMMAND}`")


def test_reference_lists_every_modifier_field_and_cli_option():
    render = _render_module()
    modifiers, cli = render.render_modifiers(), render.render_cli()
    for cls in REGISTRY.classes():
        assert f"## {cls.step_name()}\n" in modifiers
        for name in cls.model_fields:
            assert f"| `{name}`" in modifiers, f"{cls.step_name()}.{name} missing"
    for command in ("apply", "show", "validate", "plan", "diff", "list-modifiers", "export", "sweep", "eval", "bench"):
        assert f"## `recipe {command}`" in cli
    for option in ("--resume", "--no-checkpoints", "--ranks", "--vary", "--eval-limit"):
        assert f"`{option}" in cli, option


def test_site_builds_with_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs or mkdocs-material is not installed (pip install -e '.[test]')")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").exists() and (site / "benchmarks" / "index.html").exists()
    assert (site / "reference" / "modifiers" / "index.html").exists()
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "make demo" in home  # the README is the home page


def guide_example() -> str:
    """The Python block that follows ``<!-- example: drop_layers -->`` in the modifier guide."""
    match = re.search(r"<!-- example: drop_layers -->\n```python\n(.*?)\n```", GUIDE.read_text(encoding="utf-8"),
                      re.S)
    assert match, f"{GUIDE.name}: the marked example block is missing"
    return match.group(1)


@pytest.fixture
def drop_layers(monkeypatch):
    """The guide's modifier, registered for this test only."""
    REGISTRY.load()
    monkeypatch.setattr(REGISTRY, "_classes", dict(REGISTRY._classes))
    namespace = {"__name__": "docs_example_drop_layers"}
    exec(compile(guide_example(), str(GUIDE), "exec"), namespace)
    return namespace["DropLayers"]


def recipe(tmp_path, steps):
    data_file = tmp_path / "cal.txt"
    data_file.write_text(TEXT)
    return {"version": 1, "name": "docs-example", "model": "tiny", "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(data_file), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": steps}


def test_guide_example_modifier_equals_hf_without_those_layers(tmp_path, drop_layers):
    assert REGISTRY.get("DropLayers") is drop_layers
    model = tiny_model("llama", num_hidden_layers=6)
    original = copy.deepcopy(model)
    steps = [{"DropLayers": {"layers": [4, 1]}}, "DropLayers<layers:[0]>"]
    result, report = recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=CharTokenizer(),
                                         progress=False)
    assert report.steps[0].result["removed"] == [[1], [4]] and report.steps[1].result["removed"] == [[0]]
    kept = [2, 3, 5]
    reference = hf_model_with_layers(original, kept)
    tokens = random_tokens()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(result(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reloaded(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_guide_example_modifier_refuses_a_missing_layer_in_one_line(tmp_path, drop_layers):
    with pytest.raises(RecipeError) as caught:
        recipe_engine.apply(recipe(tmp_path, [{"DropLayers": {"layers": [6]}}]),
                            model=tiny_model("llama", num_hidden_layers=6), tokenizer=CharTokenizer(), progress=False)
    message = str(caught.value)
    assert "\n" not in message and "DropLayers" in message and "'layers'" in message and "[6] do not exist" in message
    assert not (tmp_path / "out").exists()
