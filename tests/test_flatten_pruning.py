"""HeadPrune and NystromMLP on a merged layer, against independent references built from the layer's
own activations (hooks) and torch.linalg.lstsq."""
import copy
import itertools

import pytest
import torch

from recipe_engine.modifiers.flatten_adjacent import merge_layers
from recipe_engine.modifiers.head_prune import HeadPrune
from recipe_engine.modifiers.nystrom_mlp import NystromMLP
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session, oversized_layers
from recipe_engine.architectures.shape import ModelShape
from tests.helpers import layer_kwargs, random_tokens, run_pass, tiny_config, tiny_model

HEAD_DIM, QUERIES_PER_GROUP = 16, 2


def merged_session(model_type="llama", tokens=None, edit=None):
    """Tiny 4-layer model with layers 1 and 2 merged (layer 1: 8 heads / 4 KV groups, 192 channels);
    ``edit(model)`` changes the model (and so the original) before merging."""
    model = tiny_model(model_type, attn_implementation="eager")
    if edit is not None:
        with torch.no_grad():
            edit(model)
    tokens = random_tokens(4, 24) if tokens is None else tokens
    config = CalibrationConfig(samples=4, seq_len=24, batch_size=2)
    original = copy.deepcopy(model)
    session = Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")),
                      model, tokens, reference_loader=lambda: original).view
    layers = list(model.model.layers)
    merged = merge_layers(layers[1:3], session.adapter)
    session.set_layers([layers[0], merged, layers[3]], [(0,), (1, 2), (3,)], [0, 1, 3])
    return session, tokens


def run_layer_with_hook(session, tokens, layer, module):
    """Output of ``layer`` on its calibration input and the inputs it feeds to ``module`` (tokens × width)."""
    with torch.no_grad():
        x = session.model(tokens, output_hidden_states=True).hidden_states[1]
        seen = []
        handle = layer.get_submodule(module).register_forward_hook(lambda m, a, o: seen.append(a[0]))
        out = layer(x, **layer_kwargs(session.model, x))
        handle.remove()
    return x, out, seen[0].reshape(-1, seen[0].shape[-1]).double()


def kept_query_channels(groups):
    heads = [h for g in groups for h in range(g * QUERIES_PER_GROUP, (g + 1) * QUERIES_PER_GROUP)]
    return torch.cat([torch.arange(h * HEAD_DIM, (h + 1) * HEAD_DIM) for h in heads])


def ridge_fit(z, weight, keep, ridge):
    """Independent ridge refit: lstsq on [Z_K; √λ I] Δᵀ = [Z_D W_Dᵀ; 0]; returns W_K + Δ and the error."""
    weight = weight.detach()
    drop = torch.tensor([c for c in range(z.shape[1]) if c not in set(keep.tolist())])
    lhs = torch.cat([z[:, keep], ridge ** 0.5 * torch.eye(len(keep), dtype=torch.float64)])
    rhs = torch.cat([z[:, drop] @ weight[:, drop].T, torch.zeros(len(keep), weight.shape[0], dtype=torch.float64)])
    refit = weight[:, keep] + torch.linalg.lstsq(lhs, rhs).solution.T
    return refit, float(((z[:, keep] @ refit.T - z @ weight.T) ** 2).sum())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("compensate", [False, True])
def test_pruned_heads_keep_their_kv_groups(model_type, compensate):
    """The pruned layer equals the merged layer with dropped heads' o_proj columns zeroed (and the kept ones
    replaced by the refit), so every kept query head still reads its own KV head (and q/k/v biases)."""
    session, tokens = merged_session(model_type)
    reference = copy.deepcopy(session.layers[1])
    report = run_pass(session, [HeadPrune(compensate=compensate)])["0"]["layers"]["1"]
    pruned = session.layers[1]
    assert pruned.self_attn.q_proj.out_features == 4 * HEAD_DIM and pruned.self_attn.k_proj.out_features == 2 * HEAD_DIM
    keep = kept_query_channels(report["kv_groups_kept"])
    with torch.no_grad():
        o_weight = torch.zeros_like(reference.self_attn.o_proj.weight)
        o_weight[:, keep] = pruned.self_attn.o_proj.weight
        reference.self_attn.o_proj.weight.copy_(o_weight)
        x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))
        kwargs = layer_kwargs(session.model, x)
        torch.testing.assert_close(pruned(x, **kwargs), reference(x, **kwargs),
                                   rtol=1e-5, atol=1e-5)
    assert oversized_layers(session.session) == [1]  # the MLP is still wide


def test_eq12_keeps_the_groups_with_largest_head_importance():
    session, tokens = merged_session()
    layer = session.layers[1]
    _, _, z = run_layer_with_hook(session, tokens, layer, "self_attn.o_proj")
    row_norms = layer.self_attn.o_proj.weight.double().norm(dim=0)  # ‖W_O,h‖ rows in the paper's orientation
    per_head = (z * row_norms).reshape(z.shape[0], 8, HEAD_DIM).pow(2).sum(-1).mean(0).sqrt()
    expected = sorted(per_head.reshape(4, 2).sum(1).topk(2).indices.tolist())
    o_weight = layer.self_attn.o_proj.weight.double().clone()
    report = run_pass(session, [HeadPrune(criterion="eq12", compensate=False)])["0"]["layers"]["1"]
    assert report["kv_groups_kept"] == expected
    torch.testing.assert_close(session.layers[1].self_attn.o_proj.weight.double(),
                               o_weight[:, kept_query_channels(expected)])


@pytest.mark.parametrize("exhaustive_limit", [1024, 1])
def test_reconstruction_choice_and_refit_match_lstsq(exhaustive_limit):
    session, tokens = merged_session()
    layer = copy.deepcopy(session.layers[1])
    _, _, z = run_layer_with_hook(session, tokens, layer, "self_attn.o_proj")
    weight = layer.self_attn.o_proj.weight.double()
    ridge = 0.01 * float(torch.linalg.eigvalsh(z.T @ z).mean())

    def error(groups):
        return ridge_fit(z, weight, kept_query_channels(groups), ridge)[1]

    if exhaustive_limit > 6:
        expected = list(min(itertools.combinations(range(4), 2), key=error))
    else:  # backward elimination, one group at a time
        kept = [0, 1, 2, 3]
        while len(kept) > 2:
            kept = min(([g for g in kept if g != d] for d in kept), key=error)
        expected = kept
    head_prune = HeadPrune(lambda_scale=0.01, exhaustive_limit=exhaustive_limit)
    report = run_pass(session, [head_prune])["0"]["layers"]["1"]
    assert report["kv_groups_kept"] == expected
    refit, fit_error = ridge_fit(z, weight, kept_query_channels(expected), ridge)
    torch.testing.assert_close(session.layers[1].self_attn.o_proj.weight.double(), refit, rtol=1e-4, atol=1e-5)
    total = float(((z @ weight.T) ** 2).sum())
    assert report["relative_error"] == pytest.approx(fit_error / total, rel=1e-4)


def test_nystrom_matches_leverage_and_stacked_lstsq():
    session, tokens = merged_session()
    layer = copy.deepcopy(session.layers[1])
    _, _, act = run_layer_with_hook(session, tokens, layer, "mlp.down_proj")
    gram = act.T @ act
    ridge = 10 * float(torch.linalg.eigvalsh(gram).mean())
    leverage = torch.diagonal(gram @ torch.linalg.inv(gram + ridge * torch.eye(192, dtype=torch.float64)))
    keep = leverage.topk(96).indices.sort().values
    refit, _ = ridge_fit(act, layer.mlp.down_proj.weight.double(), keep, ridge)
    report = run_pass(session, [NystromMLP(target="merged")])["0"]["layers"]["1"]
    mlp = session.layers[1].mlp
    assert report["channels_kept"] == 96 and report["channels_before"] == 192
    torch.testing.assert_close(mlp.gate_proj.weight, layer.mlp.gate_proj.weight[keep])
    torch.testing.assert_close(mlp.up_proj.weight, layer.mlp.up_proj.weight[keep])
    torch.testing.assert_close(mlp.down_proj.weight.double(), refit, rtol=1e-4, atol=1e-5)
    assert oversized_layers(session.session) == [1]  # the heads are still wide


@pytest.mark.parametrize("target", ["serial", "original"])
def test_nystrom_refit_towards_target_matches_stacked_lstsq(target):
    """After Nyström, down_proj is refitted so the pruned layer reproduces the original layers 1 → 2 run
    serially (layer 0 is unchanged, so the serial and the original-model targets coincide here)."""
    session, tokens = merged_session()
    original = session.reference.model
    with torch.no_grad():
        wanted = original(tokens, output_hidden_states=True).hidden_states[3].reshape(-1, 64).double()
    pruned, _ = merged_session(tokens=tokens)  # the same seeded model
    run_pass(pruned, [NystromMLP(target="merged")])
    x, out, act = run_layer_with_hook(pruned, tokens, pruned.layers[1], "mlp.down_proj")
    nystrom = pruned.layers[1].mlp.down_proj.weight.double()
    residual = wanted - out.reshape(-1, 64).double() + act @ nystrom.T  # y* − h (h: after attention)
    ridge = 0.5 * float(torch.diagonal(act.T @ act).mean())
    lhs = torch.cat([act, ridge ** 0.5 * torch.eye(96, dtype=torch.float64)])
    rhs = torch.cat([residual, ridge ** 0.5 * nystrom.T])
    expected = torch.linalg.lstsq(lhs, rhs).solution.T

    report = run_pass(session, [NystromMLP(target=target, target_scale=0.5)])["0"]["layers"]["1"]
    down = session.layers[1].mlp.down_proj.weight.double()
    torch.testing.assert_close(down, expected, rtol=1e-4, atol=1e-5)
    _, refitted, _ = run_layer_with_hook(session, tokens, session.layers[1], "mlp.down_proj")
    left = float(((wanted - refitted.reshape(-1, 64).double()) ** 2).sum())
    assert report["target_error_before"] == pytest.approx(float(((wanted - out.reshape(-1, 64)) ** 2).sum()),
                                                         rel=1e-4)
    assert report["target_error_after"] == pytest.approx(left, rel=1e-4)
    assert left < report["target_error_before"]


def test_pruning_steps_need_merged_layers():
    shape = ModelShape.from_config(tiny_config())
    with pytest.raises(RecipeError, match="no layer has more heads than the config"):
        HeadPrune().check(shape)
    with pytest.raises(RecipeError, match="no layer has a wider MLP than the config"):
        NystromMLP().check(shape)
    with pytest.raises(RecipeError, match="layer 2 has 4 heads / 2 KV heads"):
        HeadPrune(layers=[2]).check(shape)
    with pytest.raises(RecipeError, match="layer 9 out of range"):
        NystromMLP(layers=[9]).check(shape)


def test_nystrom_target_scale_by_cross_validation_matches_brute_force():
    """``target_scales``: each multiple's 2-fold held-out error (batch 0 ↔ batch 1) against explicit ridge
    fits (lstsq) on the other fold; the chosen multiple is the brute-force minimiser and the final
    down_proj the stacked lstsq refit on all tokens with it."""
    session, tokens = merged_session()
    original = session.reference.model
    with torch.no_grad():
        wanted = original(tokens, output_hidden_states=True).hidden_states[3].reshape(-1, 64).double()
    pruned, _ = merged_session(tokens=tokens)
    run_pass(pruned, [NystromMLP(target="merged")])
    x, out, act = run_layer_with_hook(pruned, tokens, pruned.layers[1], "mlp.down_proj")
    nystrom = pruned.layers[1].mlp.down_proj.weight.double()
    residual = wanted - out.reshape(-1, 64).double() + act @ nystrom.T  # y* − h

    def fit(rows, scale):
        ridge = scale * float(torch.diagonal(act[rows].T @ act[rows]).mean())
        lhs = torch.cat([act[rows], ridge ** 0.5 * torch.eye(96, dtype=torch.float64)])
        rhs = torch.cat([residual[rows], ridge ** 0.5 * nystrom.T])
        return torch.linalg.lstsq(lhs, rhs).solution.T

    folds = [torch.arange(0, 48), torch.arange(48, 96)]  # batch_size 2 × 24 tokens per batch
    scales = [0.001, 0.1, 10.0]
    brute = [sum(float(((residual[held] - act[held] @ fit(other, s).T) ** 2).sum())
                 for held, other in (folds, folds[::-1])) for s in scales]
    best = scales[brute.index(min(brute))]

    report = run_pass(session, [NystromMLP(target_scales=scales)])["0"]["layers"]["1"]
    assert report["target_scale_chosen"] == best
    torch.testing.assert_close(torch.tensor(list(report["heldout_error"].values())), torch.tensor(brute),
                               rtol=1e-4, atol=0.0)
    torch.testing.assert_close(session.layers[1].mlp.down_proj.weight.double(), fit(torch.arange(96), best),
                               rtol=1e-4, atol=1e-5)


def weaken_layer_2(model):
    """Layer 2 barely changes its input: serial 1 → 2 is close to layer 1 alone."""
    for linear in (model.model.layers[2].self_attn.o_proj, model.model.layers[2].mlp.down_proj):
        linear.weight.mul_(0.01)


@pytest.mark.parametrize("model_type,edit", [("llama", None), ("qwen2", None), ("llama", weaken_layer_2)])
def test_fallback_keeps_the_candidate_with_least_refitted_error(model_type, edit):
    """``fallback``: the merged layer (after Nyström) and original layers 1 and 2 alone, each with its
    down_proj refitted towards the original model by lstsq; the step must keep the brute-force best and
    its layer must compute that candidate's refitted output."""
    session, tokens = merged_session(model_type, edit=edit)
    original = session.reference.model
    with torch.no_grad():
        wanted = original(tokens, output_hidden_states=True).hidden_states[3].reshape(-1, 64).double()
    pruned, _ = merged_session(model_type, tokens=tokens, edit=edit)
    run_pass(pruned, [NystromMLP(target="merged")])
    candidates = {"merged": pruned.layers[1], "1": original.model.layers[1], "2": original.model.layers[2]}
    outputs, errors = {}, {}
    for name, layer in candidates.items():
        x, out, act = run_layer_with_hook(pruned, tokens, layer, "mlp.down_proj")
        weight = layer.mlp.down_proj.weight.double()
        residual = wanted - out.reshape(-1, 64).double() + act @ weight.T  # y* − h
        ridge = 0.1 * float(torch.diagonal(act.T @ act).mean())
        lhs = torch.cat([act, ridge ** 0.5 * torch.eye(act.shape[1], dtype=torch.float64)])
        refit = torch.linalg.lstsq(lhs, torch.cat([residual, ridge ** 0.5 * weight.T])).solution.T
        errors[name] = float(((residual - act @ refit.T) ** 2).sum())
        outputs[name] = out.reshape(-1, 64).double() + act @ (refit - weight).T
    best = min(errors, key=errors.get)
    if edit is weaken_layer_2:
        assert best == "1"

    report = run_pass(session, [NystromMLP(fallback=True)])["0"]["layers"]["1"]
    assert report["kept"] == best
    for name, error in errors.items():
        assert report["candidates"][name] == pytest.approx(error, rel=1e-4)
    _, got, _ = run_layer_with_hook(session, tokens, session.layers[1], "mlp.down_proj")
    torch.testing.assert_close(got.reshape(-1, 64).double(), outputs[best], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ridge", [None, 0.05, 3.0])
def test_greedy_group_elimination_equals_scoring_every_candidate(seed, ridge):
    """The downdated greedy (one inverse, OBS updates) makes the same choices as re-solving and scoring
    each candidate with reconstruction_error, on 10 groups of 3 correlated channels down to 3."""
    from recipe_engine.api import greedy_group_elimination
    from recipe_engine.numerics.linalg import reconstruction_error

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 30, generator=generator, dtype=torch.float64) @ torch.randn(
        30, 30, generator=generator, dtype=torch.float64)
    gram = x.T @ x
    weight = torch.randn(7, 30, generator=generator, dtype=torch.float64)
    members = [torch.arange(3 * g, 3 * g + 3) for g in range(10)]
    scale = None if ridge is None else ridge * float(gram.diagonal().mean())

    def error(groups):
        return reconstruction_error(weight, gram, torch.cat([members[g] for g in groups]), scale)

    kept = list(range(10))
    while len(kept) > 3:
        kept = min(([g for g in kept if g != d] for d in kept), key=error)
    assert greedy_group_elimination(weight, gram, members, 3, scale) == kept
