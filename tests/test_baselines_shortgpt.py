"""ShortGPT: Block Influence against a hook-based reference; an identity layer is the one dropped."""
import pytest
import torch

from recipe_engine.modifiers.shortgpt import ShortGPT, block_influence
from tests.baselines_helpers import layer_io, make_session, without_layers
from tests.helpers import random_tokens, tiny_model


def test_block_influence_matches_per_token_cosine_reference():
    model, tokens = tiny_model(num_hidden_layers=5), random_tokens(4, 16)
    inputs, outputs = layer_io(model, tokens)
    expected = [1 - torch.nn.functional.cosine_similarity(x, y, dim=-1).double().mean().item()
                for x, y in zip(inputs, outputs)]
    assert block_influence(make_session(model, tokens)) == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("k", [1, 2])
def test_identity_layer_is_removed(k):
    model, tokens = tiny_model(num_hidden_layers=4), random_tokens(4, 16)
    with torch.no_grad():
        model.model.layers[k].self_attn.o_proj.weight.zero_()
        model.model.layers[k].mlp.down_proj.weight.zero_()
    expected = without_layers(model, [k])(tokens).logits
    session = make_session(model, tokens)
    report = ShortGPT(n=1).apply(session)
    assert report["removed"] == [[k]] and report["block_influence"][k] == pytest.approx(0, abs=1e-6)
    assert session.layer_origin == [(i,) for i in range(4) if i != k]
    assert model.config.num_hidden_layers == 3
    torch.testing.assert_close(model(tokens).logits, expected)


def test_pad_tokens_are_excluded():
    class Pad:
        pad_token_id = 7

    model, tokens = tiny_model(num_hidden_layers=3), random_tokens(2, 16)
    tokens[:, 8:] = 7
    inputs, outputs = layer_io(model, tokens)
    keep = tokens != 7
    expected = [1 - torch.nn.functional.cosine_similarity(x, y, dim=-1)[keep].double().mean().item()
                for x, y in zip(inputs, outputs)]
    assert block_influence(make_session(model, tokens, tokenizer=Pad())) == pytest.approx(expected, rel=1e-5)
