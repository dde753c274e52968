"""FuseNorm is output-preserving: logits equal the original within 1e-5 relative (fp32)."""
import copy

import pytest
import torch

from recipe_engine.modifiers.fuse_norm import FuseNorm
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session
from tests.helpers import random_tokens, requires_smollm2, tiny_model


def run_fuse(model, tokens, **params):
    config = CalibrationConfig(samples=tokens.shape[0], seq_len=tokens.shape[1])
    session = Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")), model, tokens).view
    return FuseNorm(**params).apply(session)


def assert_relative_close(actual, expected, tol=1e-5):
    rel = (actual - expected).norm() / expected.norm()
    assert rel < tol, f"relative error {rel:.2e}"


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_fuse_norm_preserves_logits(model_type, tie):
    model = tiny_model(model_type, tie_word_embeddings=tie)
    tokens = random_tokens()
    before = model(tokens).logits
    result = run_fuse(model, tokens)
    assert_relative_close(model(tokens).logits, before)
    for layer in model.model.layers:
        assert torch.all(layer.input_layernorm.weight == 1)
        assert torch.all(layer.post_attention_layernorm.weight == 1)
    assert result["final_norm_folded"] is (not tie)
    assert bool(torch.all(model.model.norm.weight == 1)) is (not tie)


def test_fuse_norm_untie_folds_final_norm():
    model = tiny_model(tie_word_embeddings=True)
    tokens = random_tokens()
    before = model(tokens).logits
    embed_before = model.model.embed_tokens.weight.clone()
    run_fuse(model, tokens, untie=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, embed_before)
    assert torch.all(model.model.norm.weight == 1)
    assert_relative_close(model(tokens).logits, before)


@pytest.mark.slow
@requires_smollm2
def test_fuse_norm_on_smollm2(smollm2):
    model = copy.deepcopy(smollm2[0])
    tokens = random_tokens(1, 64, vocab=model.config.vocab_size)
    with torch.no_grad():
        before = model(tokens).logits
        run_fuse(model, tokens)
        assert_relative_close(model(tokens).logits, before)
