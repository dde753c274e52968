"""SLEB: greedy choice equals brute force over plain-HF models with layers deleted."""
import pytest
import torch

from recipe_engine.modifiers.sleb import SLEB
from tests.baselines_helpers import make_session, without_layers
from tests.helpers import random_tokens, tiny_model


def brute_force_greedy(model, tokens, n):
    removed = []
    for _ in range(n):
        losses = {}
        for j in range(1, model.config.num_hidden_layers - 1):
            if j not in removed:
                with torch.no_grad():
                    losses[j] = float(without_layers(model, removed + [j])(tokens, labels=tokens).loss)
        removed.append(min(losses, key=losses.get))
    return removed, losses


def test_single_removal_equals_brute_force_on_four_layers():
    model, tokens = tiny_model(num_hidden_layers=4, seed=1), random_tokens(4, 24)
    expected, losses = brute_force_greedy(model, tokens, 1)
    reference = without_layers(model, expected)(tokens).logits
    session = make_session(model, tokens)
    report = SLEB(n=1).apply(session)
    assert report["rounds"][0]["removed"] == expected
    assert report["rounds"][0]["nll"] == pytest.approx(losses[expected[0]], rel=1e-5)
    torch.testing.assert_close(model(tokens).logits, reference)


def test_iterative_removals_equal_greedy_brute_force():
    model, tokens = tiny_model(num_hidden_layers=6, seed=2), random_tokens(4, 24)
    expected, _ = brute_force_greedy(model, tokens, 3)
    session = make_session(model, tokens)
    report = SLEB(n=3).apply(session)
    assert [r["removed"][0] for r in report["rounds"]] == expected
    assert session.layer_origin == [(i,) for i in range(6) if i not in expected]
    assert 0 not in expected and 5 not in expected
