"""LinearPatch: interfaces, P = I is the identity, d against an independent reference, select, tuning."""
import copy

import pytest
import torch

from recipe_engine.modifiers.linear_patch import LinearPatch, Tune, contiguous_scores, install, interfaces
from recipe_engine.modifiers.shortgpt import ShortGPT
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.numerics.hadamard import rotation
from tests.baselines_helpers import layer_io, make_session, without_layers
from tests.helpers import random_tokens, tiny_model


def test_interfaces_from_layer_origin():
    assert interfaces([(0,), (1,), (2,)], 3, "base") == []
    assert interfaces([(0,), (3,), (4,)], 5, "base") == [(1, 1, 3)]
    assert interfaces([(1,), (2,)], 4, "base") == [(0, 0, 1), (2, 3, 4)]        # first and last removed
    assert interfaces([(0,), (1, 2, 3), (4,)], 5, "base") == [(2, 2, 4)]       # merged: base kept
    assert interfaces([(0,), (1, 2, 3), (4,)], 5, "span") == []


def test_identity_patch_reproduces_unpatched_model():
    model, tokens = tiny_model(), random_tokens()
    expected = model(tokens).logits
    for position in (1, 4):                       # a decoder layer and the final norm
        install(model, adapter_for(model.config), position, torch.eye(64))
    assert torch.equal(model(tokens).logits, expected)


def test_scales_match_independent_reference_and_patch_is_applied():
    model, tokens = tiny_model(num_hidden_layers=5, seed=3), random_tokens(4, 16)
    dense = copy.deepcopy(model)
    inputs, outputs = layer_io(dense, tokens)
    session = make_session(model, tokens)
    removed = ShortGPT(n=2).apply(session)["removed"]
    report = LinearPatch().apply(session)
    h, name = rotation(64)
    assert report["rotation"] == name and name.startswith("walsh-hadamard")
    states = inputs + [outputs[-1]]               # X^{(s)}: input of layer s; X^{(N)}: last output
    pruned = without_layers(dense, [o[0] for o in removed])
    handles = []
    for item in report["interfaces"]:
        start, end = (states[item[k]].reshape(-1, 64).double() @ h for k in ("start", "end"))
        d = end.abs().mean(0) / start.abs().mean(0)
        patch = (h * d) @ h.T
        target = pruned.model.layers[item["position"]] if item["position"] < 3 else pruned.model.norm
        handles.append(target.register_forward_pre_hook(lambda m, args, p=patch: (args[0] @ p.float(),)))
    assert report["interfaces"]
    torch.testing.assert_close(model(tokens).logits, pruned(tokens).logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model(tokens).logits, without_layers(dense, [o[0] for o in removed])(tokens).logits)


def test_select_contiguous_removes_the_most_similar_block():
    model, tokens = tiny_model(num_hidden_layers=6, seed=4), random_tokens(4, 16)
    inputs, outputs = layer_io(copy.deepcopy(model), tokens)
    states = inputs + [outputs[-1]]
    n = 2
    expected = {layer: torch.nn.functional.cosine_similarity(states[layer].flatten(1).double(),
                                                             states[layer + n].flatten(1).double(), dim=1).mean().item()
                for layer in range(6 - n + 1)}
    session = make_session(model, tokens)
    assert contiguous_scores(session, n) == pytest.approx(expected, rel=1e-6)
    report = LinearPatch(select="contiguous", n=n).apply(session)
    best = max(expected, key=expected.get)
    assert report["removed"] == [[best], [best + 1]] and len(session.layers) == 4


def test_tuning_lowers_the_distillation_loss():
    model, tokens = tiny_model(num_hidden_layers=4, seed=5), random_tokens(8, 16)
    session = make_session(model, tokens)
    ShortGPT(n=1).apply(session)
    report = LinearPatch(tune=Tune(top_k=16, lr=1e-2, epochs=4)).apply(session)
    losses = report["distillation_loss"]
    assert len(losses) == 16 and losses[-1] < losses[0]
    assert all(p.requires_grad for p in model.parameters())
