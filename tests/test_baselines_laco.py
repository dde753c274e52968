"""LaCo: RDSC merge against the formula, C=1 is a no-op, Algorithm 1's control flow, T search."""
import copy

import pytest
import torch

from recipe_engine.modifiers.laco import LaCo, rdsc_merge
from tests.baselines_helpers import make_session
from tests.helpers import random_tokens, tiny_model


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rdsc_merge_reserves_differences_against_frozen_base(model_type):
    model = tiny_model(model_type, num_hidden_layers=4)
    layers = list(model.model.layers)
    before = copy.deepcopy(layers)
    merged = rdsc_merge(layers, 1, 2)
    for name, param in merged.named_parameters():
        base, a, b = (before[i].get_parameter(name) for i in (1, 2, 3))
        expected = base + (a - base) + (b - base) if name.startswith(("self_attn.", "mlp.")) else base
        torch.testing.assert_close(param, expected, rtol=0, atol=1e-6)
    assert any(n.endswith("bias") for n, _ in merged.named_parameters()) == (model_type == "qwen2")
    for layer, old in zip(layers, before):   # inputs untouched (the released code overwrites θ_l)
        assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), old.parameters()))


def test_c1_changes_nothing():
    model, tokens = tiny_model(num_hidden_layers=4), random_tokens(4, 16)
    expected = model(tokens).logits
    session = make_session(model, tokens)
    report = LaCo(C=1, L=0, samples=4).apply(session)
    assert report["layers"] == 4 and session.layer_origin == [(i,) for i in range(4)]
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=0)


def _final_hidden(model, tokens):
    with torch.no_grad():
        return model.model(tokens).last_hidden_state.double().flatten(1)


def test_accept_all_follows_algorithm_1_and_similarity_matches_reference():
    tokens = random_tokens(4, 16)
    model = tiny_model(num_hidden_layers=8)
    dense = copy.deepcopy(model)
    session = make_session(model, tokens)
    report = LaCo(C=3, L=1, I=2, T=-1.0, samples=2).apply(session)
    # l = H − C = 5 merges 6, 7 into 5; l = 3 merges (4, 5..7); l = 1 merges (2, 3..7); K = min(C−1, layers−1−l)
    assert [m["origin"] for m in report["merges"]] == [[5, 6, 7], [3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
    assert session.layer_origin == [(0,), (1, 2, 3, 4, 5, 6, 7)] and model.config.num_hidden_layers == 2
    first = copy.deepcopy(dense)
    first.model.layers = torch.nn.ModuleList(list(first.model.layers[:5])
                                             + [rdsc_merge(list(dense.model.layers), 5, 2)])
    expected = torch.nn.functional.cosine_similarity(_final_hidden(first, tokens[:2]),
                                                     _final_hidden(dense, tokens[:2]), dim=1).mean()
    assert report["merges"][0]["similarity"] == pytest.approx(float(expected), rel=1e-6)


def test_threshold_one_rejects_everything():
    model, tokens = tiny_model(num_hidden_layers=6), random_tokens(4, 16)
    report = LaCo(C=2, T=1.0, samples=2).apply(make_session(model, tokens))
    assert report["merges"] == [] and model.config.num_hidden_layers == 6


def test_target_layers_search_reaches_target():
    model, tokens = tiny_model(num_hidden_layers=8), random_tokens(4, 16)
    session = make_session(model, tokens)
    dense = copy.deepcopy(model)
    report = LaCo(C=2, L=1, I=1, target_layers=5, samples=2).apply(session)
    gaps = [abs(t["layers"] - 5) for t in report["search"]]
    assert abs(report["layers"] - 5) == min(gaps) and model.config.num_hidden_layers == report["layers"]
    assert sorted(i for o in session.layer_origin for i in o) == list(range(8))
    again = make_session(dense, tokens)        # the chosen T reproduces the chosen model
    LaCo(C=2, L=1, I=1, T=report["threshold"], samples=2).apply(again)
    assert again.layer_origin == session.layer_origin
    torch.testing.assert_close(dense(tokens).logits, model(tokens).logits, rtol=0, atol=0)
