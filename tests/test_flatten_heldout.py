"""Held-out options of NystromMLP (channel choice by output energy, no Theorem 3.1 refit), against
independent references built from the merged layer's own activations (hooks)."""
import copy

import pytest
import torch

from recipe_engine.modifiers.nystrom_mlp import NystromMLP
from tests.helpers import run_pass
from tests.test_flatten_pruning import merged_session, ridge_fit, run_layer_with_hook


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("compensate", [True, False])
def test_energy_criterion_keeps_the_channels_with_most_output_energy(model_type, compensate):
    """``criterion: energy``: the kept channels are the top ``E_i = Σ_t σ_ti² ‖W_:,i‖²`` computed from the
    down_proj inputs seen by a hook; down_proj is the lstsq ridge refit over them, or the plain slice."""
    session, tokens = merged_session(model_type)
    layer = copy.deepcopy(session.layers[1])
    _, _, act = run_layer_with_hook(session, tokens, layer, "mlp.down_proj")
    weight = layer.mlp.down_proj.weight.double()
    energy = torch.stack([float((act[:, i] ** 2).sum()) * weight[:, i].pow(2).sum() for i in range(192)])
    keep = energy.topk(96).indices.sort().values
    gram = act.T @ act
    leverage = torch.diagonal(gram @ torch.linalg.inv(gram + 10 * float(gram.diagonal().mean()) * torch.eye(192,
                                                                                      dtype=torch.float64)))
    assert set(leverage.topk(96).indices.tolist()) != set(keep.tolist())  # the two criteria disagree here
    ridge = 10 * float(torch.diagonal(act.T @ act).mean())
    expected = ridge_fit(act, weight, keep, ridge)[0] if compensate else weight[:, keep]

    step = NystromMLP(criterion="energy", compensate=compensate, target="merged")
    report = run_pass(session, [step])["0"]["layers"]["1"]
    mlp = session.layers[1].mlp
    torch.testing.assert_close(mlp.gate_proj.weight, layer.mlp.gate_proj.weight[keep])
    torch.testing.assert_close(mlp.up_proj.weight, layer.mlp.up_proj.weight[keep])
    torch.testing.assert_close(mlp.down_proj.weight.double(), expected, rtol=1e-4, atol=1e-5)
    assert report["energy_kept"] == pytest.approx(float(energy[keep].sum()), rel=1e-6)
    assert report["energy_total"] == pytest.approx(float(energy.sum()), rel=1e-6)
