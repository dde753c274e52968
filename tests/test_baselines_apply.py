"""Depth pruning end to end through recipe_engine.apply: stock reload, extras round trip, validation."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import recipe_engine
from tests.helpers import BYTE_VOCAB, byte_tokenizer, random_tokens, tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 200


def tiny(layers: int = 6):
    return tiny_model(num_hidden_layers=layers, vocab_size=BYTE_VOCAB)


def recipe(tmp_path, modifiers, layers=6):
    (tmp_path / "cal.txt").write_text(TEXT)
    return {"version": 1, "name": "depth", "model": "tiny-in-memory", "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": modifiers}


STOCK = {"ShortGPT": ["ShortGPT<n:2>"], "LaCo": ["LaCo<C:3,T:-1,samples:2>"], "SLEB": ["SLEB<n:2>"]}


@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_methods_reload_with_from_pretrained(tmp_path, name):
    model, tokens = tiny(), random_tokens(vocab=BYTE_VOCAB)
    pruned, report = recipe_engine.apply(recipe(tmp_path, STOCK[name]), model=model, tokenizer=byte_tokenizer(),
                                         progress=False)
    assert report.stock_checkpoint and report.after.layers < 6
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_hidden_layers == report.after.layers
    torch.testing.assert_close(reloaded(tokens).logits, pruned(tokens).logits, rtol=1e-5, atol=1e-5)
    assert not (tmp_path / "out" / "recipe_extras.json").exists()


EXTRAS = [("llama", ["ShortGPT<n:2>", "LinearPatch"], "LinearPatch", "linear_patch"),
          ("llama", ["LinearPatch<select:contiguous,n:2>"], "LinearPatch", "linear_patch"),
          ("llama", ["LaCo<C:3,T:-1,samples:2>", "LinearPatch"], "LinearPatch", "linear_patch"),
          # ReplaceMe's map as a hook: on Gemma 3 on the normalized MLP output, elsewhere on the MLP's
          ("gemma3_text", ["ReplaceMe<n:2,fold:hook>"], "ReplaceMe", "replace_me_map"),
          ("llama", ["ReplaceMe<n:2,fold:hook>"], "ReplaceMe", "replace_me_map")]


@pytest.mark.parametrize("model_type, steps, modifier, kind", EXTRAS)
def test_extras_round_trip(tmp_path, model_type, steps, modifier, kind):
    """A non-stock addition is saved as an extra that ``load_model`` restores (same logits); a stock load
    without it differs."""
    tokens = random_tokens(vocab=BYTE_VOCAB)
    model = tiny_model(model_type, num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    patched, report = recipe_engine.apply(recipe(tmp_path, steps), model=model,
                                          tokenizer=byte_tokenizer(), progress=False)
    assert report.stock_checkpoint is False and report.after.layers < 6
    meta = json.loads((tmp_path / "out" / "recipe_extras.json").read_text())
    assert meta[0]["modifier"] == modifier and meta[0]["config"]["type"] == kind
    restored, _ = recipe_engine.load_model(str(tmp_path / "out"))
    torch.testing.assert_close(restored(tokens).logits, patched(tokens).logits, rtol=1e-5, atol=1e-5)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()    # loads, without the extra
    assert not torch.allclose(stock(tokens).logits, patched(tokens).logits, atol=1e-4)


ERRORS = [
    (["ShortGPT<n:6>"], r"ShortGPT.*n=6 must be smaller than the 6 layers"),
    (["SLEB<n:5>"], r"n=5 is too many: the first and last of the 6 layers are never removed, so at most 4"),
    (["LinearPatch"], r"no layers were removed or merged before LinearPatch"),
    (["FuseNorm", "LinearPatch"], r"no layers were removed or merged before LinearPatch"),
    (["LinearPatch<n:2>"], r"n applies only with select: contiguous"),
    (["ShortGPT<n:1>", "LinearPatch", "ShortGPT<n:1>"], r"changes the decoder layers after LinearPatch"),
    (["ShortGPT<n:1>", "LinearPatch", "LinearPatch"], r"already patched by LinearPatch"),
    (["ReplaceMe<n:1,fold:hook>", "ShortGPT<n:1>"], r"changes the decoder layers after ReplaceMe"),
    (["ShortGPT<n:1>", "LinearPatch", "ReplaceMe<n:1,fold:hook>"], r"already patched by LinearPatch"),
    (["LaCo<target_layers:5,T:0.5>"], r"give T or target_layers, not both"),
    (["LaCo<C:4,target_layers:1>"], r"target_layers=1 is out of reach"),
    (["LaCo<H:7>"], r"H=7 exceeds the 6 layers"),
]


@pytest.mark.parametrize("steps,message", ERRORS)
def test_validation_errors(tmp_path, steps, message):
    with pytest.raises(recipe_engine.RecipeError, match=message):
        recipe_engine.apply(recipe(tmp_path, steps), model=tiny(),
                            tokenizer=byte_tokenizer(), progress=False)
    assert not (tmp_path / "out").exists()


def test_recipes_validate_against_their_configs():
    from pathlib import Path

    from recipe_engine.recipe.files import load_recipe
    from recipe_engine.plan.preflight import check_against_config
    from tests.helpers import tiny_config

    root = Path(__file__).resolve().parents[1] / "recipes"
    for name in ("shortgpt_smollm2", "laco_smollm2", "sleb_smollm2"):
        loaded = load_recipe(str(root / f"{name}.yaml"), [])
        shape = check_against_config(loaded.recipe, tiny_config(num_hidden_layers=30, max_position_embeddings=8192))
        assert shape.num_layers == 24
    llama3 = load_recipe(str(root / "shortgpt_linearpatch_llama3.yaml"), [])
    shape = check_against_config(llama3.recipe, tiny_config(num_hidden_layers=32, max_position_embeddings=8192))
    assert shape.num_layers == 27 and shape.pinned == "LinearPatch"
