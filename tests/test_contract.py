"""Contract tests generated from the registry, not from a hand-kept list.

Every registered modifier: its example recipe validates, dumps and reloads losslessly, runs on a tiny
CPU model end to end, and the result is saved as a checkpoint that stock transformers (or
``recipe_engine.load_model`` for non-stock outputs) loads back with the same logits.
"""
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.recipe.registry import REGISTRY
from recipe_engine.recipe.schema import dump_recipe, recipe_from_dict
from recipe_engine.errors import RecipeError
from tests.helpers import (ARCHITECTURES, BYTE_VOCAB, MOE_ARCHITECTURES, CharTokenizer, byte_tokenizer, random_tokens,
                           tiny_model)

TEXT = "Calibration text for the contract tests, repeated to have enough tokens. " * 300
NAMES = REGISTRY.names()
#: (modifier, architecture) pairs that ``recipe validate`` refuses, and a phrase of the one-line reason.
REFUSED = {(name, "gemma3_text"): "post-attention/post-feedforward norms"
           for name in ("FlattenAdjacent", "HeadPrune", "NystromMLP")}  # their examples start with FlattenAdjacent
REFUSED["ReplaceMe", "gemma3_text"] = "normalizes the MLP output"  # no exact fold through the post-MLP norm
#: Mixture-of-experts MLPs: no merge of two layers' experts, no single down_proj to prune (the examples of HeadPrune
#: and NystromMLP start with FlattenAdjacent; WidthPrune cuts every layer's down_proj). LoRARecovery's default
#: targets are the linears the model has: the attention's (naming the expert roles is refused: tests/test_moe.py).
REFUSED.update({(name, moe): "mixture of" for moe in MOE_ARCHITECTURES
                for name in ("FlattenAdjacent", "HeadPrune", "NystromMLP", "LaCo", "WidthPrune")})
#: Quantizing steps cover every expert, packed by their examples' default export, except gpt-oss's fused experts
#: (tests/test_moe_quant.py runs them with export: dequantized).
REFUSED.update({(name, "gpt_oss"): "cannot store gpt_oss's experts" for name in ("GPTQ", "Quantize")})
#: The Qwen MoE tiny experts are 48 wide: the examples' group_size 32 does not divide their down_proj input
#: (packed Qwen MoE experts: tests/test_moe_export.py, group_size 16).
REFUSED.update({(name, moe): "does not divide the input width 48" for moe in ("qwen3_moe", "qwen2_moe")
                for name in ("GPTQ", "Quantize")})


def example_recipe(tmp_path, name):
    data_file = tmp_path / "cal.txt"
    data_file.write_text(TEXT)
    return {"version": 1, "name": f"contract-{name}", "model": "tiny", "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(data_file), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": REGISTRY.get(name).example_steps()}


def test_registry_is_not_empty():
    assert "FuseNorm" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_field_is_documented(name):
    cls = REGISTRY.get(name)
    assert cls.summary(), f"{name} needs a docstring"
    assert cls.model_config.get("extra") == "forbid"
    for field_name, field in cls.model_fields.items():
        assert field.description, f"{name}.{field_name} needs a description"


@pytest.mark.parametrize("name", NAMES)
def test_yaml_round_trip(tmp_path, name):
    recipe = recipe_from_dict(example_recipe(tmp_path, name))
    assert name in [type(m).__name__ for m in recipe.modifiers]
    text = dump_recipe(recipe)
    assert recipe_from_dict(yaml.safe_load(text)) == recipe
    assert dump_recipe(recipe_from_dict(yaml.safe_load(text))) == text


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("name", NAMES)
def test_runs_on_tiny_model_and_reloads(tmp_path, name, architecture):
    """Every registered modifier on every architecture: runs and reloads, or is refused with one line."""
    # load_model (non-stock outputs) needs a tokenizer AutoTokenizer can reload: CharTokenizer is not one
    stock = REGISTRY.get(name).stock_output
    vocab = {} if stock else {"vocab_size": BYTE_VOCAB}
    model = tiny_model(architecture, num_hidden_layers=6, **vocab)
    tokens = random_tokens() if stock else random_tokens(vocab=BYTE_VOCAB)
    tokenizer = CharTokenizer() if stock else byte_tokenizer()
    if (name, architecture) in REFUSED:
        with pytest.raises(RecipeError, match=REFUSED[name, architecture]) as caught:
            recipe_engine.apply(example_recipe(tmp_path, name), model=model, tokenizer=tokenizer, progress=False)
        assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()
        return
    result, report = recipe_engine.apply(example_recipe(tmp_path, name), model=model, tokenizer=tokenizer,
                                         progress=False)
    with torch.no_grad():
        expected = result(tokens).logits
    out = tmp_path / "out"
    if report.stock_checkpoint:
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    else:
        reloaded, _ = recipe_engine.load_model(str(out))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-4, atol=1e-4)
    assert reloaded.config.num_hidden_layers == report.after.layers


@pytest.mark.parametrize("name", NAMES)
def test_constructs_from_its_defaults(name):
    """Every modifier whose parameters all have defaults is valid with them, and round-trips through a recipe."""
    cls = REGISTRY.get(name)
    required = [f for f, info in cls.model_fields.items() if info.is_required()]
    if required:
        pytest.skip(f"{name} requires {required}")
    step = cls()
    assert step.model_dump() == {f: info.get_default(call_default_factory=True) for f, info in cls.model_fields.items()}
    recipe = recipe_from_dict({"version": 1, "name": "defaults", "model": "tiny", "output": "out",
                               "modifiers": [{name: step.model_dump(mode="json")}]})
    assert recipe.modifiers == [step]
