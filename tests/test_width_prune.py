"""WidthPrune against independent references built from the layers' own activations (hooks, torch.linalg):
the kept MLP channels are the top ridge leverage scores, ``down_proj`` and ``o_proj`` the closed-form ridge
solves (lstsq), the kept KV groups the brute-force best; the output is a stock checkpoint that
``from_pretrained`` loads to the engine's logits; keeping every channel changes nothing; what it cannot do is
refused in one line from the config alone; a killed run resumes to the same bytes. The registry's contract tests
run it too (tests/test_contract.py on every architecture, test_streaming.py, test_bf16.py, ...), and
tests/test_distributed.py on two ranks."""
import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

import recipe_engine
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.architectures.shape import ModelShape
from recipe_engine.cli import main as cli_main
from recipe_engine.errors import RecipeError
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session, oversized_layers
from recipe_engine.modifiers.width_prune import WidthPrune
from recipe_engine.numerics.linalg import obs_kept_columns
from recipe_engine.recipe.schema import CalibrationConfig
from tests.helpers import (TINY, CharTokenizer, layer_kwargs, random_tokens, run_pass, save_tiny_model, tiny_config,
                           tiny_model)

HEAD_DIM, HIDDEN = 16, 64
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 60
ROOT = Path(__file__).resolve().parents[1]


def session_of(model, tokens):
    """A session over ``model`` calibrated on ``tokens`` (batches of 2), with a copy of it as the original."""
    original = copy.deepcopy(model)
    config = CalibrationConfig(samples=tokens.shape[0], seq_len=tokens.shape[1], batch_size=2)
    return Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")),
                   model, tokens, reference_loader=lambda: original).view, original


@torch.no_grad()
def run_with_hook(model, layer, x, module):
    """``layer(x)`` (tokens × hidden, fp64) and the input it feeds to ``module`` (tokens × width, fp64)."""
    seen = []
    handle = layer.get_submodule(module).register_forward_hook(lambda m, a, o: seen.append(a[0]))
    out = layer(x, **layer_kwargs(model, x))
    out = out[0] if isinstance(out, tuple) else out
    handle.remove()
    return out.reshape(-1, HIDDEN).double(), seen[0].reshape(-1, seen[0].shape[-1]).double()


def ridge_fit(z, weight, keep, ridge):
    """Theorem 3.1 by lstsq on ``[Z_K; √λ I] Δᵀ = [Z_D W_Dᵀ; 0]``: ``W_K + Δ`` and the error it leaves."""
    weight = weight.detach().double()
    drop = torch.tensor([c for c in range(z.shape[1]) if c not in set(keep.tolist())], dtype=torch.long)
    lhs = torch.cat([z[:, keep], ridge ** 0.5 * torch.eye(len(keep), dtype=torch.float64)])
    rhs = torch.cat([z[:, drop] @ weight[:, drop].T, torch.zeros(len(keep), weight.shape[0], dtype=torch.float64)])
    refit = weight[:, keep] + torch.linalg.lstsq(lhs, rhs).solution.T
    return refit, float(((z[:, keep] @ refit.T - z @ weight.T) ** 2).sum())


def leverage_top(act, keep, scale=10.0):
    """The ``keep`` channels of highest ridge leverage ``diag(G (G + λI)⁻¹)`` (ascending) and ``λ``."""
    gram = act.T @ act
    ridge = scale * float(torch.linalg.eigvalsh(gram).mean())
    leverage = torch.diagonal(gram @ torch.linalg.inv(gram + ridge * torch.eye(len(gram), dtype=torch.float64)))
    return leverage.topk(keep).indices.sort().values, ridge


def test_channels_are_the_top_ridge_leverage_and_down_proj_the_ridge_solve():
    """Every layer (each calibrated on the pruned layers' outputs before it): gate/up keep the 72 rows of
    highest ridge leverage of the original layer's down_proj input, down_proj is the lstsq Theorem 3.1 refit."""
    model = tiny_model("llama", attn_implementation="eager")
    tokens = random_tokens(4, 24)
    session, original = session_of(model, tokens)
    report = run_pass(session, [WidthPrune(target="none")])["0"]
    with torch.no_grad():
        states = model(tokens, output_hidden_states=True).hidden_states  # the stream the pass calibrated on
    for i, layer in enumerate(model.model.layers):
        source = original.model.layers[i]
        _, act = run_with_hook(original, source, states[i], "mlp.down_proj")
        keep, ridge = leverage_top(act, 72)
        torch.testing.assert_close(layer.mlp.gate_proj.weight, source.mlp.gate_proj.weight[keep])
        torch.testing.assert_close(layer.mlp.up_proj.weight, source.mlp.up_proj.weight[keep])
        refit, _ = ridge_fit(act, source.mlp.down_proj.weight, keep, ridge)
        torch.testing.assert_close(layer.mlp.down_proj.weight.double(), refit, rtol=1e-4, atol=1e-5)
        assert report["layers"][str(i)]["channels_kept"] == 72
    assert model.config.intermediate_size == 72 and oversized_layers(session.session) == []


@pytest.mark.parametrize("target", ["original", "layer"])
def test_target_refit_is_the_closed_form_ridge_solve(target):
    """After the Theorem 3.1 step, layer 0's down_proj is refitted towards the original layer 0's output (both
    targets coincide at the first layer): lstsq on ``[σ_K; √λ I] Wᵀ = [y* − h; √λ W'ᵀ]``, λ = 0.5 × mean eig."""
    tokens = random_tokens(4, 24)
    nystrom, _ = session_of(tiny_model("llama", attn_implementation="eager"), tokens)
    run_pass(nystrom, [WidthPrune(target="none")])
    session, original = session_of(tiny_model("llama", attn_implementation="eager"), tokens)
    entry = run_pass(session, [WidthPrune(target=target, target_scale=0.5)])["0"]["layers"]["0"]
    with torch.no_grad():
        states = original(tokens, output_hidden_states=True).hidden_states
    wanted = states[1].reshape(-1, HIDDEN).double()
    out, act = run_with_hook(nystrom.model, nystrom.layers[0], states[0], "mlp.down_proj")
    first = nystrom.layers[0].mlp.down_proj.weight.double()
    residual = wanted - out + act @ first.T  # y* − h (h: the residual stream after attention)
    ridge = 0.5 * float(torch.diagonal(act.T @ act).mean())
    expected = torch.linalg.lstsq(torch.cat([act, ridge ** 0.5 * torch.eye(72, dtype=torch.float64)]),
                                  torch.cat([residual, ridge ** 0.5 * first.T])).solution.T
    torch.testing.assert_close(session.layers[0].mlp.down_proj.weight.double(), expected, rtol=1e-4, atol=1e-5)
    refitted, _ = run_with_hook(session.model, session.layers[0], states[0], "mlp.down_proj")
    assert entry["target_error_before"] == pytest.approx(float(((wanted - out) ** 2).sum()), rel=1e-4)
    assert entry["target_error_after"] == pytest.approx(float(((wanted - refitted) ** 2).sum()), rel=1e-4)


def test_kept_kv_groups_and_o_proj_are_the_brute_force_ridge_best():
    """``kv_groups_keep: 1`` on Qwen2 (2 groups of 2 query heads, q/k/v biases): every layer keeps the group whose
    lstsq-refitted o_proj output is closest, q/k/v keep its rows (and biases), the MLP is untouched
    (``mlp_keep: 1``, no refit) and the config says 2 heads / 1 KV head."""
    model = tiny_model("qwen2", attn_implementation="eager")
    tokens = random_tokens(4, 24)
    session, original = session_of(model, tokens)
    report = run_pass(session, [WidthPrune(kv_groups_keep=1, mlp_keep=1, target="none")])["0"]
    with torch.no_grad():
        states = model(tokens, output_hidden_states=True).hidden_states
    for i, layer in enumerate(model.model.layers):
        source = original.model.layers[i]
        _, z = run_with_hook(original, source, states[i], "self_attn.o_proj")
        ridge = 0.01 * float(torch.linalg.eigvalsh(z.T @ z).mean())
        channels = lambda g: torch.arange(2 * g * HEAD_DIM, 2 * (g + 1) * HEAD_DIM)  # 2 query heads per group
        fits = {g: ridge_fit(z, source.self_attn.o_proj.weight, channels(g), ridge) for g in range(2)}
        best = min(fits, key=lambda g: fits[g][1])
        entry = report["layers"][str(i)]
        assert entry["kv_groups_kept"] == [best] and entry["kv_groups_before"] == 2
        total = float(((z @ source.self_attn.o_proj.weight.detach().double().T) ** 2).sum())
        assert entry["relative_error"] == pytest.approx(fits[best][1] / total, rel=1e-4)
        torch.testing.assert_close(layer.self_attn.o_proj.weight.double(), fits[best][0], rtol=1e-4, atol=1e-5)
        kv = torch.arange(best * HEAD_DIM, (best + 1) * HEAD_DIM)
        for name, rows in (("q_proj", channels(best)), ("k_proj", kv), ("v_proj", kv)):
            torch.testing.assert_close(getattr(layer.self_attn, name).weight,
                                       getattr(source.self_attn, name).weight[rows])
            torch.testing.assert_close(getattr(layer.self_attn, name).bias, getattr(source.self_attn, name).bias[rows])
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp, name).weight, getattr(source.mlp, name).weight)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)


def calibration_recipe(tmp_path, steps, model="tiny", **calibration):
    (tmp_path / "cal.txt").write_text(TEXT)
    return {"version": 1, "name": "width", "model": model, "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2,
                            **calibration}, "modifiers": steps}


def test_output_is_a_stock_checkpoint_with_the_engines_logits(tmp_path):
    """A Qwen2 whose config has no head_dim (derived from hidden / heads, as Qwen2.5's): after keeping 1 of 2 KV
    groups and 40 MLP channels, stock from_pretrained builds the narrower model (head_dim written out) and
    gives the logits of the engine's model in memory."""
    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result, report = recipe_engine.apply(calibration_recipe(tmp_path,
                                                            ["WidthPrune<kv_groups_keep:1,intermediate_size:40>"]),
                                         model=model, tokenizer=CharTokenizer(), progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, result(tokens).logits, rtol=1e-5, atol=1e-5)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["intermediate_size"], saved["num_attention_heads"], saved["num_key_value_heads"],
            saved["head_dim"]) == (40, 2, 1, HEAD_DIM)
    shapes = {name: tuple(p.shape) for name, p in reloaded.model.layers[3].named_parameters()}
    assert shapes["self_attn.q_proj.weight"] == (2 * HEAD_DIM, HIDDEN)
    assert shapes["self_attn.k_proj.bias"] == (HEAD_DIM,)
    assert shapes["self_attn.o_proj.weight"] == (HIDDEN, 2 * HEAD_DIM)
    assert shapes["mlp.down_proj.weight"] == (HIDDEN, 40)
    assert report.stock_checkpoint and report.after.parameters == sum(p.numel() for p in reloaded.parameters())


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_keeping_every_channel_leaves_the_model_unchanged(tmp_path, model_type):
    """``mlp_keep`` close to 1 rounds to every channel: nothing is cut, and the target refit towards the original
    model (auto: none on Gemma 3) finds no error to remove, so the logits are the original model's."""
    model = tiny_model(model_type)
    tokens = random_tokens()
    with torch.no_grad():
        before = model(tokens).logits
    result, report = recipe_engine.apply(calibration_recipe(tmp_path, ["WidthPrune<mlp_keep:0.999>"]), model=model,
                                         tokenizer=CharTokenizer(), progress=False, write=False)
    with torch.no_grad():
        assert torch.equal(result(tokens).logits, before)
    assert result.config.intermediate_size == 96 and report.after.parameters == report.before.parameters


REFUSALS = [  # model type, config changes, step, field, phrase
    ("qwen3_moe", {}, "WidthPrune", None, "mixture of 4 experts"),
    ("llama", {}, "WidthPrune<intermediate_size:96>", "intermediate_size", "not below the current width 96"),
    ("llama", {}, "WidthPrune<intermediate_size:0>", "intermediate_size", "greater than or equal to 1"),
    ("llama", {}, "WidthPrune<mlp_keep:0.001>", "mlp_keep", "keeps no channel of 96"),
    ("llama", {}, {"WidthPrune": {"mlp_keep": 0.5, "intermediate_size": 10}}, "intermediate_size", "not both"),
    ("llama", {}, "WidthPrune<kv_groups_keep:2>", "kv_groups_keep", "not below the current 2 KV groups"),
    ("llama", {"num_key_value_heads": 1}, "WidthPrune<kv_groups_keep:1>", "kv_groups_keep", "current 1 KV groups"),
    ("gemma3_text", {}, "WidthPrune<target:original>", "target", "normalizes the MLP output"),
    ("llama", {}, "WidthPrune<parameters:80>", "parameters", "a percentage of the decoder layers' parameters"),
    ("llama", {}, {"WidthPrune": {"parameters": "80%", "mlp_keep": 0.5}}, "parameters", "not both"),
    ("llama", {}, "WidthPrune<parameters:1%,multiple_of:32>", "parameters", "no MLP width fits 1%"),
]


@pytest.mark.parametrize("model_type, changes, step, field, phrase", REFUSALS)
def test_refused_in_one_line_from_the_config_alone(tmp_path, capsys, model_type, changes, step, field, phrase):
    """``recipe validate`` on a model directory holding only config.json (no weights to load): exit 2 and one
    line naming the file, the step, the field and the reason."""
    tiny_config(model_type, **changes).save_pretrained(tmp_path / "model")
    recipe = calibration_recipe(tmp_path, [step], model=str(tmp_path / "model"))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert cli_main(["validate", str(tmp_path / "r.yaml")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "step 0 (WidthPrune)" in lines[0] and phrase in lines[0], lines
    assert (f"field '{field}'" in lines[0]) == (field is not None)


def test_refused_with_one_shot_statistics_and_indivisible_groups(tmp_path):
    """``target: original`` (auto's choice here) with ``propagate: original``; query heads that do not split into
    the KV groups (a symbolic shape no config has, checked as a merged layer's would be)."""
    recipe = calibration_recipe(tmp_path, ["WidthPrune"], propagate="original")
    with pytest.raises(RecipeError, match="field 'target': target: original .* needs calibration.propagate"):
        recipe_engine.apply(recipe, model=tiny_model(), tokenizer=CharTokenizer(), progress=False)
    assert not (tmp_path / "out").exists()
    shape = ModelShape.from_config(tiny_config())
    shape.num_kv_heads = 3
    with pytest.raises(RecipeError, match="4 query heads do not divide into 3 KV groups"):
        WidthPrune(kv_groups_keep=1).check(shape)


# -- a resumed run (the subprocess driver of tests/test_resume.py) --
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
STEPS = ["WidthPrune<kv_groups_keep:1>", "PauseInPass", "PauseStep"]  # the pause points of resume_driver.py


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_killed_run_resumes_to_the_uninterrupted_runs_bytes(tmp_path):
    """SIGKILLed inside the pass (layers 0–1 pruned, the config not yet changed) or after it (the config
    changed): ``--resume`` writes the uninterrupted run's model.safetensors and config.json byte for byte.
    (Streamed runs: tests/test_streaming.py runs WidthPrune streamed; data-parallel: tests/test_distributed.py.)"""
    save_tiny_model(tmp_path / "model", num_hidden_layers=6)
    recipe = calibration_recipe(tmp_path, STEPS, model=str(tmp_path / "model"), samples=8)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "dtype": "float32"}, sort_keys=False))

    def apply(name, *extra):
        return {"name": name, "argv": ["apply", str(tmp_path / "recipe.yaml"), "--output", str(tmp_path / "out" / name),
                                       "--quiet", "--checkpoint-budget", "1", *extra]}

    cases = [apply("reference")] + [{**apply(point), "pause": point, "then": [{**apply(point, "--resume"),
                                                                              "name": f"{point}_resumed"}]}
                                    for point in ("pass", "step")]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    subprocess.run([sys.executable, str(ROOT / "tests" / "resume_driver.py"), str(tmp_path / "cases.json")],
                   env=ENV, check=True, timeout=600)
    reference = tmp_path / "out" / "reference"
    for point in ("pass", "step"):
        assert (tmp_path / f"{point}.rc").read_text() == "-9"  # killed at its pause point
        assert (tmp_path / f"{point}_resumed.rc").read_text() == "0", (tmp_path / f"{point}_resumed.err").read_text()
        for file in ("model.safetensors", "config.json"):
            assert sha256(tmp_path / "out" / point / file) == sha256(reference / file), (point, file)
        assert recipe_engine.load_report(tmp_path / "out" / point).resumed.group == (0 if point == "pass" else 1)
    config = AutoConfig.from_pretrained(reference)
    assert (config.intermediate_size, config.num_attention_heads, config.num_key_value_heads) == (72, 2, 1)


@pytest.mark.parametrize("groups", [None, 1])
def test_a_parameter_share_keeps_the_widest_multiple_that_fits(tmp_path, groups):
    """``parameters: 70%``: the MLP width is the largest multiple of 8 whose model holds at most 70 % of the
    decoder layers' parameters, counted on models HF builds from configs (the output, and the next multiple)."""
    model = tiny_model()
    before = sum(p.numel() for p in model.model.layers.parameters())
    step = "WidthPrune<parameters:70%,multiple_of:8" + (f",kv_groups_keep:{groups}>" if groups else ">")
    result, _ = recipe_engine.apply(calibration_recipe(tmp_path, [step]), model=model, tokenizer=CharTokenizer(),
                                    progress=False, write=False)
    width = result.config.intermediate_size
    kept = sum(p.numel() for p in result.model.layers.parameters())
    wider = tiny_config(intermediate_size=width + 8, **({"num_key_value_heads": groups,
                                                          "num_attention_heads": result.config.num_attention_heads}
                                                         if groups else {}))
    next_multiple = sum(p.numel() for p in AutoModelForCausalLM.from_config(wider).model.layers.parameters())
    assert width % 8 == 0 and kept <= 0.7 * before < next_multiple


def test_fluctuation_keeps_flaps_channels_and_compensates_as_leverage_does():
    """``criterion: fluctuation``: every layer keeps the 72 channels of highest FLAP score, the variance of the
    original layer's down_proj input (on the stream the pass calibrated on) times its column's squared norm,
    computed here from a hook; down_proj is the same lstsq Theorem 3.1 refit on them."""
    model = tiny_model("llama", attn_implementation="eager")
    tokens = random_tokens(4, 24)
    session, original = session_of(model, tokens)
    report = run_pass(session, [WidthPrune(target="none", criterion="fluctuation")])["0"]
    with torch.no_grad():
        states = model(tokens, output_hidden_states=True).hidden_states
    for i, layer in enumerate(model.model.layers):
        source = original.model.layers[i]
        _, act = run_with_hook(original, source, states[i], "mlp.down_proj")
        flap = act.var(0, unbiased=False) * source.mlp.down_proj.weight.detach().double().pow(2).sum(0)
        keep = flap.topk(72).indices.sort().values
        torch.testing.assert_close(layer.mlp.gate_proj.weight, source.mlp.gate_proj.weight[keep])
        _, ridge = leverage_top(act, 72)
        refit, _ = ridge_fit(act, source.mlp.down_proj.weight, keep, ridge)
        torch.testing.assert_close(layer.mlp.down_proj.weight.double(), refit, rtol=1e-4, atol=1e-5)
        assert report["layers"][str(i)]["fluctuation_kept"] < report["layers"][str(i)]["fluctuation_total"]


def test_obs_keeps_the_greedy_surgeons_channels_on_the_hooked_activations():
    """``criterion: obs``: every layer keeps the channels greedy OBS elimination leaves on the Gram of the original
    layer's down_proj input (from a hook, on the stream the pass calibrated on), one channel per step; down_proj
    is the lstsq Theorem 3.1 refit on them (tests/test_flatten_linalg.py checks the elimination by brute force)."""
    model = tiny_model("llama", attn_implementation="eager")
    tokens = random_tokens(4, 24)
    session, original = session_of(model, tokens)
    run_pass(session, [WidthPrune(target="none", criterion="obs", obs_block=1)])
    with torch.no_grad():
        states = model(tokens, output_hidden_states=True).hidden_states
    for i, layer in enumerate(model.model.layers):
        source = original.model.layers[i]
        _, act = run_with_hook(original, source, states[i], "mlp.down_proj")
        _, ridge = leverage_top(act, 72)
        keep = obs_kept_columns(source.mlp.down_proj.weight, act.T @ act, 72, ridge, block=1)
        assert keep.tolist() != leverage_top(act, 72)[0].tolist()
        torch.testing.assert_close(layer.mlp.gate_proj.weight, source.mlp.gate_proj.weight[keep])
        refit, _ = ridge_fit(act, source.mlp.down_proj.weight, keep, ridge)
        torch.testing.assert_close(layer.mlp.down_proj.weight.double(), refit, rtol=1e-4, atol=1e-5)
