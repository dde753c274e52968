"""ReplaceMe against independent references: HF's own hidden states for the block choice, torch.linalg.lstsq
for the map, and an explicitly built "block removed, map applied to the MLP output" model for the fold."""
import copy
import math

import pytest
import torch
import yaml

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.modifiers.replace_me import ReplaceMe, block_distances
from recipe_engine.architectures.shape import ModelShape
from tests.baselines_helpers import make_session, without_layers
from tests.helpers import have_smollm2, random_tokens, tiny_config, tiny_model

RECIPE = "recipes/replaceme_smollm2.yaml"


def recorder(store: dict, key: str, take):
    """A forward hook that records ``take(args, output)`` under ``key`` once and returns None (keeps the output)."""
    def hook(_module, args, output):
        store.setdefault(key, take(args, output))
    return hook


def hidden(output):
    return output[0] if isinstance(output, tuple) else output


def hf_states(model, tokens) -> list[torch.Tensor]:
    """Input of every decoder layer from HF's ``output_hidden_states``, then the last layer's output before
    the final norm (HF's last entry is after it), from a forward hook."""
    got = {}
    handle = model.model.layers[-1].register_forward_hook(recorder(got, "last", lambda _a, out: hidden(out)))
    with torch.no_grad():
        states = model(tokens, output_hidden_states=True).hidden_states
    handle.remove()
    return list(states[:-1]) + [got["last"]]


def brute_force_distances(model, tokens, n: int, last_only: bool, skip_first: int = 1) -> dict[int, float]:
    states = hf_states(model, tokens)
    result = {}
    for start in range(1, len(model.model.layers) - n + 1):
        a, b = states[start].double(), states[start + n].double()
        a, b = (a[:, -1], b[:, -1]) if last_only else (a[:, skip_first:], b[:, skip_first:])
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        result[start] = float(torch.arccos(cos.clamp(-1, 1)).mean() / math.pi)
    return result


def seam_rows(model, tokens, start: int, n: int, skip_first: int = 1):
    """``M`` (MLP output of layer start − 1), ``Y`` (the residual it is added to) and ``L`` (the output of layer
    start + n − 1) of every token after the first ``skip_first`` of each window, stacked, from hooks on the
    plain HF model."""
    got = {}
    layers = model.model.layers
    handles = [layers[start - 1].mlp.register_forward_hook(recorder(got, "M", lambda _a, out: out)),
               layers[start - 1].post_attention_layernorm.register_forward_hook(recorder(got, "Y", lambda a, _o: a[0])),
               layers[start + n - 1].register_forward_hook(recorder(got, "L", lambda _a, out: hidden(out)))]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return [got[key][:, skip_first:].reshape(-1, got[key].shape[-1]).double() for key in ("M", "Y", "L")]


class MappedMLP(torch.nn.Module):
    """The reference replacement: the original MLP followed by ``x ↦ x T``."""

    def __init__(self, mlp, transform):
        super().__init__()
        self.mlp, self.transform = mlp, transform

    def forward(self, x):
        return (self.mlp(x).double() @ self.transform).to(x.dtype)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("tokens_kind", ["last", "all"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_chosen_block_is_the_brute_force_minimum_of_hf_hidden_states(model_type, tokens_kind, n):
    model, tokens = tiny_model(model_type, num_hidden_layers=5), random_tokens(4, 32)
    expected = brute_force_distances(model, tokens, n, last_only=tokens_kind == "last")
    got = block_distances(make_session(model, tokens), n, tokens_kind, skip_first=1)
    assert sorted(got) == sorted(expected) == list(range(1, 6 - n))
    assert [got[s] for s in expected] == pytest.approx(list(expected.values()), rel=1e-6)
    report = ReplaceMe(n=n, distance_tokens=tokens_kind).apply(make_session(model, tokens))
    best = min(expected, key=lambda s: (expected[s], s))
    assert report["start"] == best and report["removed"] == [[i] for i in range(best, best + n)]


def test_an_identity_block_is_chosen_and_its_replacement_is_the_identity():
    """Layers 2 and 3 with zero output projections add nothing: distance 0 for that block, and the least-
    squares map is exactly I (the plain drop), so the folded model equals the dropped one."""
    model, tokens = tiny_model(num_hidden_layers=6), random_tokens(4, 32)
    with torch.no_grad():
        for k in (2, 3):
            model.model.layers[k].self_attn.o_proj.weight.zero_()
            model.model.layers[k].mlp.down_proj.weight.zero_()
    expected = without_layers(model, [2, 3])(tokens).logits
    report = ReplaceMe(n=2, distance_tokens="all").apply(make_session(model, tokens))
    assert report["start"] == 2 and report["distance"] == pytest.approx(0, abs=1e-6)
    assert report["fit"]["drop_error"] == pytest.approx(0, abs=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type, skip_first", [("llama", 0), ("llama", 1), ("qwen2", 3)])
def test_map_is_lstsq_and_the_fold_is_the_explicit_replaced_model(model_type, skip_first):
    model, tokens = tiny_model(model_type, num_hidden_layers=6, hidden_size=32, head_dim=8), random_tokens(8, 32)
    dense = copy.deepcopy(model)
    report = ReplaceMe(n=2, skip_first=skip_first).apply(make_session(model, tokens))
    start = report["start"]
    m, y, target = seam_rows(dense, tokens, start, 2, skip_first)
    assert report["fit"]["tokens"] == 8 * (32 - skip_first) == m.shape[0]
    transform = torch.linalg.lstsq(m, target - y).solution
    # the fit's residual from the moments equals the residual of the lstsq solution
    assert report["fit"]["fit_error"] == pytest.approx(float((m @ transform + y - target).pow(2).sum()) / m.shape[0],
                                                       rel=1e-6)
    assert report["fit"]["drop_error"] == pytest.approx(float((m + y - target).pow(2).sum()) / m.shape[0], rel=1e-6)
    assert report["fit"]["relative"] < 1
    # the folded down_proj is Tᵀ W with T from lstsq
    down = dense.model.layers[start - 1].mlp.down_proj.weight.double()
    torch.testing.assert_close(model.model.layers[start - 1].mlp.down_proj.weight.double(),
                               transform.T @ down, rtol=1e-4, atol=1e-5)
    # and the folded stock model equals "block removed, T applied to the MLP output of the layer before it"
    reference = without_layers(dense, list(range(start, start + 2)))
    reference.model.layers[start - 1].mlp = MappedMLP(reference.model.layers[start - 1].mlp, transform)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4


def branch_rows(model, tokens, start: int, n: int, branch: str, skip_first: int = 1):
    """``M`` (the output of submodule ``branch`` of layer start − 1: what it adds to the residual stream), ``Y``
    (that layer's output minus ``M``) and ``L`` (the output of layer start + n − 1), from hooks on the HF model."""
    got = {}
    layers = model.model.layers
    handles = [layers[start - 1].get_submodule(branch).register_forward_hook(recorder(got, "M", lambda _a, out: out)),
               layers[start - 1].register_forward_hook(recorder(got, "H", lambda _a, out: hidden(out))),
               layers[start + n - 1].register_forward_hook(recorder(got, "L", lambda _a, out: hidden(out)))]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    m, h, target = (got[key][:, skip_first:].reshape(-1, got[key].shape[-1]).double() for key in ("M", "H", "L"))
    return m, h - m, target


def identity_block(model, layers: list[int]):
    """A deep copy of ``model`` whose ``layers`` add nothing to the residual stream (zero o_proj and down_proj:
    a removed layer, with every other layer keeping its index and attention type)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for k in layers:
            reference.model.layers[k].self_attn.o_proj.weight.zero_()
            reference.model.layers[k].mlp.down_proj.weight.zero_()
    return reference


@pytest.mark.parametrize("model_type, branch", [("gemma3_text", "post_feedforward_layernorm"), ("llama", "mlp")])
def test_hook_fold_is_the_explicit_replaced_model(model_type, branch):
    """``fold: hook``: T is lstsq of what the layer before the block adds to the residual stream (on Gemma 3
    the normalized MLP output) against the block's output, and the model equals "block removed, T applied to
    that output"; on Llama it gives the same model as the down_proj fold."""
    model, tokens = tiny_model(model_type, num_hidden_layers=6, hidden_size=32, head_dim=8), random_tokens(8, 32)
    dense = copy.deepcopy(model)
    report = ReplaceMe(n=2, fold="hook").apply(make_session(model, tokens))
    start = report["start"]
    assert report["fold"] == "hook" and report["map_on"] == branch
    m, y, target = branch_rows(dense, tokens, start, 2, branch)
    transform = torch.linalg.lstsq(m, target - y).solution
    assert report["fit"]["fit_error"] == pytest.approx(float((m @ transform + y - target).pow(2).sum()) / m.shape[0],
                                                       rel=1e-6)
    assert report["fit"]["relative"] < 1
    reference = identity_block(dense, list(range(start, start + 2)))
    reference.model.layers[start - 1].get_submodule(branch).register_forward_hook(
        lambda _module, _args, out: (out.double() @ transform).to(out.dtype))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)
    assert len(model.model.layers) == 4
    if model_type == "llama":
        folded = copy.deepcopy(dense)
        ReplaceMe(n=2).apply(make_session(folded, tokens))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens).logits, folded(tokens).logits, rtol=1e-4, atol=1e-4)


def test_ridge_shrinks_towards_the_plain_drop():
    """``T = (MᵀM + λI)⁻¹(Mᵀ(L − Y) + λI)``: the ridge problem ``‖M T − (L − Y)‖² + λ‖T − I‖²`` solved by
    lstsq on the stacked, augmented system."""
    model, tokens = tiny_model(num_hidden_layers=5, hidden_size=32, head_dim=8), random_tokens(4, 32)
    dense = copy.deepcopy(model)
    report = ReplaceMe(n=1, ridge=0.5).apply(make_session(model, tokens))
    start, lam = report["start"], report["fit"]["ridge"]
    m, y, target = seam_rows(dense, tokens, start, 1)
    assert lam == pytest.approx(0.5 * float(torch.diagonal(m.T @ m).mean()))
    eye = torch.eye(m.shape[1], dtype=torch.float64)
    transform = torch.linalg.lstsq(torch.cat([m, math.sqrt(lam) * eye]),
                                   torch.cat([target - y, math.sqrt(lam) * eye])).solution
    down = dense.model.layers[start - 1].mlp.down_proj.weight.double()
    torch.testing.assert_close(model.model.layers[start - 1].mlp.down_proj.weight.double(),
                               transform.T @ down, rtol=1e-5, atol=1e-6)


def test_cosine_objective_lowers_the_cosine_loss_and_is_seeded():
    model, tokens = tiny_model(num_hidden_layers=5), random_tokens(4, 32)
    step = ReplaceMe(n=2, objective="cosine", adam={"epochs": 5, "lr": 1e-3, "batch_tokens": 32})
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    report = step.apply(make_session(first, tokens))
    step.apply(make_session(second, tokens))
    fit = report["fit"]
    assert fit["cosine_loss"] < fit["cosine_loss_drop"] and fit["tokens"] == 4 * 31
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    # the reported cosine loss is the one of the folded model's MLP output against the target
    start = report["start"]
    m, y, target = seam_rows(model, tokens, start, 2)
    folded = first.model.layers[start - 1].mlp.down_proj.weight.detach().double()
    original = model.model.layers[start - 1].mlp.down_proj.weight.detach().double()
    transform = torch.linalg.lstsq(original.T, folded.T).solution
    loss = 1 - torch.nn.functional.cosine_similarity(m @ transform, target - y, dim=-1).mean()
    assert float(loss) == pytest.approx(fit["cosine_loss"], rel=1e-4)


def test_pad_tokens_are_left_out():
    class Pad:
        pad_token_id = 7

    model, tokens = tiny_model(num_hidden_layers=4), random_tokens(4, 16)
    tokens[:, 10:] = 7
    # 36 tokens for a 64-wide MLP output: MᵀM is singular, which is one clear error naming the field
    with pytest.raises(RecipeError, match="field 'ridge': MᵀM is singular.*set ridge > 0"):
        ReplaceMe(n=1).apply(make_session(copy.deepcopy(model), tokens, tokenizer=Pad()))
    report = ReplaceMe(n=1, ridge=0.01, distance_tokens="last").apply(make_session(model, tokens, tokenizer=Pad()))
    assert report["fit"]["tokens"] == 4 * 9  # pads and the first position left out
    # "last" is the last non-pad token of each window: the brute force on the windows cut before the pads
    expected = brute_force_distances(tiny_model(num_hidden_layers=4), tokens[:, :10], 1, last_only=True)
    assert [report["distances"][s] for s in expected] == pytest.approx(list(expected.values()), rel=1e-6)


def shape_of(model_type="llama", layers=4):
    return ModelShape.from_config(tiny_config(model_type, num_hidden_layers=layers))


def test_skip_first_must_leave_tokens(tmp_path, capsys):
    from recipe_engine.recipe.schema import CalibrationConfig

    ReplaceMe(n=1, skip_first=15).check_calibration(CalibrationConfig(seq_len=16))
    with pytest.raises(RecipeError, match="field 'skip_first': skip_first=16 leaves no token"):
        ReplaceMe(n=1, skip_first=16).check_calibration(CalibrationConfig(seq_len=16))


def test_check_bounds_and_shape():
    shape = shape_of(layers=6)
    ReplaceMe(n=5).check(shape)
    assert shape.num_layers == 1
    with pytest.raises(RecipeError, match="n=4 is too many.*at most 3"):
        ReplaceMe(n=4).check(shape_of(layers=4))
    with pytest.raises(RecipeError, match="adam applies only with objective: cosine"):
        ReplaceMe(n=1, adam={"epochs": 1}).check(shape_of())
    with pytest.raises(RecipeError, match="ridge applies only with objective: lstsq"):
        ReplaceMe(n=1, objective="cosine", ridge=1.0).check(shape_of())


def test_gemma3_is_refused_before_weights_load():
    with pytest.raises(RecipeError, match="post_feedforward_layernorm.*cannot be folded into down_proj.*fold: hook"):
        ReplaceMe(n=1).check(shape_of("gemma3_text"))


@pytest.mark.parametrize("model_type, resolved", [("gemma3_text", "hook"), ("llama", "down_proj"),
                                                  ("qwen2", "down_proj")])
def test_fold_auto_resolves_by_architecture_and_a_hook_pins_the_layers(model_type, resolved):
    step = ReplaceMe(n=1, fold="auto")
    assert step.folds_into(model_type) == resolved
    shape = shape_of(model_type)
    step.check(shape)
    assert shape.pinned == ("ReplaceMe" if resolved == "hook" else None)
    assert not step.stock_output and step.refuses_streaming and ReplaceMe(n=1).stock_output


@pytest.mark.parametrize("model_type, step, message", [
    ("llama", "ReplaceMe<n:6>", "step 0 (ReplaceMe): field 'n': n=6 is too many"),
    ("gemma3_text", "ReplaceMe<n:1>", "step 0 (ReplaceMe): field 'fold': gemma3_text normalizes the MLP output"),
])
def test_validation_errors_are_one_line_before_loading(tmp_path, capsys, model_type, step, message):
    """The model directory holds a config and no weights: the refusal comes from validation, before any
    weight would be read; one line, exit code 2, nothing written (``validate`` and ``apply`` alike)."""
    model_dir = tmp_path / "model"
    tiny_config(model_type, num_hidden_layers=6).save_pretrained(model_dir)
    (tmp_path / "cal.txt").write_text("calibration text " * 100)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "name": "r", "model": str(model_dir), "output": str(tmp_path / "out"),
        "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 2, "seq_len": 16},
        "modifiers": [step]}))
    for argv in (["validate", str(path)], ["apply", str(path), "--quiet"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and f"{path}: step 0" in err, err
    assert not (tmp_path / "out").exists()


def test_recipe_file_validates(tmp_path, capsys):
    """``recipe validate`` of the shipped recipe against a tiny Qwen2 config of SmolLM2's depth (and against
    SmolLM2 itself when installed)."""
    model_dir = tmp_path / "tiny"
    tiny_config("qwen2", num_hidden_layers=30, max_position_embeddings=8192).save_pretrained(model_dir)
    assert main(["validate", RECIPE, "--model", str(model_dir)]) == 0
    assert "ok (qwen2, 30 → 24 layers)" in capsys.readouterr().out
    if have_smollm2():
        assert main(["validate", RECIPE]) == 0
        assert "30 → 24 layers" in capsys.readouterr().out
