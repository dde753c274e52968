"""Calibration on the model's own completions (``calibration.generate``): the windows are what transformers'
own ``generate`` writes, cached by fingerprint, and recorded in the report and the card."""
import json

import pytest
import torch
import yaml

import recipe_engine
from recipe_engine.errors import RecipeError
from recipe_engine.evaluation.self_generated import complete, parameters_sha256, self_generated_windows
from recipe_engine.recipe.schema import SelfGenerationConfig
from tests.helpers import CharTokenizer, random_tokens, tiny_model
from tests.test_apply import tiny_recipe


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))


def test_greedy_completions_equal_transformers_generate():
    model = tiny_model("llama").eval()
    prompts = random_tokens(batch=3, length=8)
    eos = [5]
    ours = complete(model, prompts, new_tokens=12, temperature=0, batch_size=2, seed=0, eos=eos)
    reference = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12,
                               min_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, reference)
    assert not (ours[:, 8:] == 5).any()  # the end-of-sequence token is never written


def test_sampled_completions_are_seeded_and_cached(tmp_path):
    model = tiny_model("llama").eval()
    windows = random_tokens(batch=4, length=24, seed=1)
    config = SelfGenerationConfig(prompt_tokens=6, temperature=1.0, batch_size=4)
    first, record = self_generated_windows(model, CharTokenizer(), windows, config, seed=3)
    assert record["cache"] == "written" and record["new_tokens"] == 18
    assert first.shape == windows.shape and torch.equal(first[:, :6], windows[:, :6])
    assert not torch.equal(first[:, 6:], windows[:, 6:])
    again, cached = self_generated_windows(model, CharTokenizer(), windows, config, seed=3)
    assert cached["cache"] == "hit" and cached["key"] == record["key"] and torch.equal(again, first)
    other_seed, other = self_generated_windows(model, CharTokenizer(), windows, config, seed=4)
    assert other["cache"] == "written" and not torch.equal(other_seed, first)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1e-3)  # another model: another key
    assert self_generated_windows(model, CharTokenizer(), windows, config, seed=3)[1]["key"] != record["key"]


def test_parameters_sha256_is_over_every_tensor():
    model = tiny_model("llama")
    before = parameters_sha256(model)
    assert parameters_sha256(tiny_model("llama")) == before
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert parameters_sha256(model) != before


def test_apply_records_the_self_generated_windows(tmp_path):
    recipe = tiny_recipe(tmp_path, calibration={**tiny_recipe(tmp_path)["calibration"],
                                                "generate": {"prompt_tokens": 8, "temperature": 0}})
    model = tiny_model("llama")
    _, report = recipe_engine.apply(recipe, model=model, tokenizer=CharTokenizer(), progress=False)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    generated = saved["data"]["generated"]
    assert generated["prompt_tokens"] == 8 and generated["new_tokens"] == 24 and generated["temperature"] == 0
    assert "written by the dense model itself" in (tmp_path / "out" / "README.md").read_text()
    assert yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())["calibration"]["generate"][
        "prompt_tokens"] == 8


def test_prompt_as_long_as_the_window_is_refused(tmp_path):
    recipe = tiny_recipe(tmp_path, calibration={**tiny_recipe(tmp_path)["calibration"],
                                                "generate": {"prompt_tokens": 32}})
    with pytest.raises(RecipeError, match=r"generate.prompt_tokens \(32\) must be below seq_len \(32\)"):
        recipe_engine.apply(recipe, model=tiny_model("llama"), tokenizer=CharTokenizer(), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_streamed_model_cannot_write_its_windows(tmp_path):
    from tests.test_streaming import recipe, saved_model

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    spec = recipe(tmp_path, model_dir, ["FuseNorm"], "on", "out-on")
    spec["calibration"] = {**spec["calibration"], "generate": {"prompt_tokens": 4}}
    with pytest.raises(RecipeError, match=r"field 'calibration.generate': the model cannot write its calibration "
                                          r"windows while streamed"):
        recipe_engine.apply(spec, progress=False)
    assert not (tmp_path / "out-on").exists()
