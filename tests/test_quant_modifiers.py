"""GPTQ / Quantize as recipe steps: grid membership, validation, recipe end to end, compressed-tensors export."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.modifiers.gptq import GPTQ
from recipe_engine.checkpoint.writer import write_checkpoint
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.schema import recipe_from_dict
from recipe_engine.plan.preflight import check_against_config
from tests.helpers import CharTokenizer, random_tokens, run_pass, tiny_config, tiny_model
from tests.test_session import make_session

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def recipe(tmp_path, steps, **extra):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    return dict(version=1, name="quant-test", model="tiny", device="cpu", output=str(tmp_path / "out"),
                calibration=dict(dataset=str(text), samples=4, seq_len=32, batch_size=2), modifiers=steps,
                **extra)


def rtn_reference(w, bits, group, sym):
    """Independent RTN: per row and group, min-max grid (symmetric: ±absmax on 2^b - 1 steps); the scale is
    rounded to the weight's dtype, as every output format stores it."""
    out = torch.empty_like(w, dtype=torch.float64)
    for start in range(0, w.shape[1], group):
        x = w[:, start:start + group].double()
        lo, hi = x.min(1, keepdim=True).values.clamp(max=0), x.max(1, keepdim=True).values.clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / (2 ** bits - 1)).to(w.dtype).double()
        zero = 2 ** (bits - 1) if sym else torch.round(-lo / scale)
        out[:, start:start + group] = scale * (torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1) - zero)
    return out


@pytest.mark.parametrize("bits,group,sym", [(4, 16, True), (3, 32, False), (8, 32, True)])
def test_rtn_quantize_values_lie_on_grid(tmp_path, bits, group, sym):
    model = tiny_model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = {"Quantize": {"bits": bits, "group_size": group, "sym": sym, "export": "dequantized"}}
    recipe_engine.apply(recipe(tmp_path, [step]), model=model, tokenizer=CharTokenizer(), write=False,
                        progress=False)
    for name, param in model.named_parameters():
        if any(name.endswith(f"{t}.weight") for t in LINEARS):
            expected = rtn_reference(original[name], bits, group, sym)
            torch.testing.assert_close(param.double(), expected, rtol=0, atol=1e-6)
            for start in range(0, param.shape[1], group):
                assert all(len(row.unique()) <= 2 ** bits for row in param[:, start:start + group])
        else:
            assert torch.equal(param, original[name]), name


def test_group_size_error_names_the_layer():
    smollm2_shape = tiny_config(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    data = dict(version=1, name="v", model="smollm2-135m", output="out/x", modifiers=["GPTQ<group_size:128>"])
    with pytest.raises(RecipeError, match=r"input width 576 of model\.layers\.0\.self_attn\.q_proj"):
        check_against_config(recipe_from_dict(data), smollm2_shape)
    data["modifiers"] = ["GPTQ<group_size:64,targets:[mlp.down_proj]>"]
    check_against_config(recipe_from_dict(data), smollm2_shape)
    data["modifiers"] = ["Quantize<group_size:64>"]
    with pytest.raises(RecipeError, match=r"input width 96 of model\.layers\.0\.mlp\.down_proj"):
        check_against_config(recipe_from_dict(data), tiny_config(max_position_embeddings=2048))


def test_gptq_step_uses_layer_hessians_and_beats_rtn():
    """In the shared pass each linear's error is measured on its own calibration inputs."""
    tokens = random_tokens(4, 32)
    results = {}
    for name, step in [("gptq", GPTQ(group_size=16)), ("rtn", None)]:
        model = tiny_model()
        if step is None:
            from recipe_engine.modifiers.quantize import Quantize
            Quantize(group_size=16).apply(make_session(model, tokens))
        else:
            run_pass(make_session(model, tokens), [step])
        with torch.no_grad():
            results[name] = model(tokens).logits
    reference = tiny_model()(tokens).logits.detach()
    gptq_error = (results["gptq"] - reference).norm()
    rtn_error = (results["rtn"] - reference).norm()
    assert gptq_error < rtn_error


@pytest.mark.parametrize("sym", [True, False])
def test_fusenorm_gptq_recipe_exports_compressed_tensors(tmp_path, sym):
    from transformers import CompressedTensorsConfig

    model = tiny_model()
    steps = ["FuseNorm", {"GPTQ": {"bits": 4, "group_size": 32, "sym": sym, "export": "compressed-tensors"}}]
    out, report = recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=CharTokenizer(),
                                      progress=False)
    errors = report.steps[1].result["layers"]["3"]["output_error"]
    assert set(errors) == set(LINEARS) and all(0 < e < 0.1 for e in errors.values())
    directory = tmp_path / "out"
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    # symmetric loads compressed (CompressedLinear) and dequantized; asymmetric through dequantize
    modes = [True, False] if sym else [False]
    for run_compressed in modes:
        loaded = AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=CompressedTensorsConfig(run_compressed=run_compressed))
        tokens = random_tokens(2, 16)
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens).logits, out(tokens).logits, rtol=1e-4, atol=1e-4)
    dense = loaded.model.layers[2].mlp.down_proj.weight
    torch.testing.assert_close(dense, out.model.layers[2].mlp.down_proj.weight, rtol=0, atol=1e-6)


def test_export_refuses_weights_moved_off_grid(tmp_path):
    model = tiny_model()
    session = make_session(model, random_tokens(4, 32))
    run_pass(session, [GPTQ(group_size=16, export="compressed-tensors")])
    with torch.no_grad():
        weight = model.model.layers[1].mlp.up_proj.weight
        weight.add_(1e-3 * torch.randn_like(weight))
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mlp\.up_proj: weights are .* off"):
        write_checkpoint(session.session, tmp_path)


def test_dequantized_output_is_stock_checkpoint(tmp_path):
    model = tiny_model()
    out, _ = recipe_engine.apply(recipe(tmp_path, ["GPTQ<group_size:32,act_order:true,export:dequantized>"]),
                                 model=model,
                                 tokenizer=CharTokenizer(), progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert getattr(loaded.config, "quantization_config", None) is None
    for name, param in loaded.named_parameters():
        assert torch.equal(param, out.get_parameter(name)), name


def test_flattengpt_then_gptq_shares_the_layer_pass(tmp_path):
    """FlattenAdjacent → HeadPrune → NystromMLP → GPTQ: GPTQ joins the pruning steps' layer-sequential pass
    (no capture pass of its own; at most one statistics re-run per layer) and every weight ends on its grid."""
    flatten = ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]
    _, without = recipe_engine.apply(recipe(tmp_path, flatten), model=tiny_model(num_hidden_layers=6),
                                     tokenizer=CharTokenizer(), write=False, progress=False)
    out, report = recipe_engine.apply(recipe(tmp_path, flatten + ["GPTQ<group_size:32,sym:false,export:dequantized>"]),
                                      model=tiny_model(num_hidden_layers=6), tokenizer=CharTokenizer(),
                                      progress=False)
    assert report.steps[4].shared_pass and out.config.num_hidden_layers == 4
    extra_runs = report.calibration_layer_runs - without.calibration_layer_runs
    assert 0 <= extra_runs <= out.config.num_hidden_layers
    for layer in out.model.layers:
        for target in LINEARS:
            weight = layer.get_submodule(target).weight
            for start in range(0, weight.shape[1], 32):
                assert max(len(row.unique()) for row in weight[:, start:start + 32]) <= 16
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = random_tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, out(tokens).logits)


def test_gptq_step_equals_gptq_on_each_linear_with_its_own_gram():
    """The step (Hessian sharing, row-stacked q/k/v and gate/up) equals ``gptq_quantize`` run alone on
    each layer-0 linear with the gram of that linear's input, hooked on an untouched copy of the model."""
    from recipe_engine.modifiers._quant import Grid
    from recipe_engine.modifiers.gptq import gptq_quantize

    tokens = random_tokens(4, 32)
    reference = tiny_model()
    grams, handles = {}, []
    for target in LINEARS:
        def hook(_module, args, _out, target=target):
            x = args[0].reshape(-1, args[0].shape[-1])
            grams[target] = grams.get(target, 0) + (x.T @ x).double()  # fp32 products, as the step
        handles.append(reference.model.layers[0].get_submodule(target).register_forward_hook(hook))
    with torch.no_grad():
        for batch in tokens.split(2):
            reference(batch)
    model = tiny_model()
    run_pass(make_session(model, tokens), [GPTQ(group_size=16, sym=False, act_order=True,
                                                                  sequential=False)])
    for target in LINEARS:
        original = reference.model.layers[0].get_submodule(target).weight
        expected = gptq_quantize(original, grams[target], Grid(4, 16, False), act_order=True, damp=0.01,
                                 block_size=128).dequantized
        torch.testing.assert_close(model.model.layers[0].get_submodule(target).weight.double(), expected,
                                   rtol=0, atol=1e-5)


def test_sequential_gptq_requantizes_from_refreshed_hessians():
    """``sequential``: each linear group of every layer is quantized with the gram of its input taken after
    the groups before it (q/k/v → o → gate/up → down, earlier layers included) were quantized — computed
    here group by group with full forwards of a copy (the step runs each layer piecewise instead)."""
    from recipe_engine.modifiers._quant import Grid
    from recipe_engine.modifiers.gptq import gptq_quantize

    tokens = random_tokens(4, 32)
    reference = tiny_model()
    groups = (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"])
    for layer, group in ((layer, group) for layer in reference.model.layers for group in groups):
        seen = []
        handle = layer.get_submodule(group[0]).register_forward_hook(
            lambda _m, args, _o: seen.append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            for batch in tokens.split(2):
                reference(batch)
        handle.remove()
        gram = sum((x.T @ x).double() for x in seen)  # fp32 products, fp64 sum, as the step
        for target in group:
            linear = layer.get_submodule(target)
            with torch.no_grad():
                quantized = gptq_quantize(linear.weight, gram, Grid(4, 16, True, torch.float32), act_order=True,
                                          damp=0.01, block_size=128)
                linear.weight.copy_(quantized.dequantized)
    model, one_pass = tiny_model(), tiny_model()
    # sequential, act_order: the defaults; the reference's scales rounded to the model dtype, as every format
    run_pass(make_session(model, tokens), [GPTQ(group_size=16, export="dequantized")])
    run_pass(make_session(one_pass, tokens), [GPTQ(group_size=16, sequential=False, export="dequantized")])
    for index, target in ((i, t) for i in range(len(model.model.layers)) for t in LINEARS):
        torch.testing.assert_close(model.model.layers[index].get_submodule(target).weight,
                                   reference.model.layers[index].get_submodule(target).weight, rtol=0, atol=1e-5)
    assert not torch.allclose(model.model.layers[0].mlp.down_proj.weight,
                              one_pass.model.layers[0].mlp.down_proj.weight)


def test_linear_path_of_an_unknown_architecture_is_one_line_not_llamas():
    from recipe_engine.errors import RecipeError
    from recipe_engine.modifiers._quant import linear_path

    with pytest.raises(RecipeError, match="unsupported architecture 'falcon'"):
        linear_path("falcon", "q_proj")
    assert linear_path("phi3", "q_proj") == "self_attn.qkv_proj"  # a fused linear, from phi3's own adapter


def read_log(directory):
    import csv

    with open(directory / "quantization_log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_gptq_log_has_one_row_per_linear_matching_the_report(tmp_path):
    model = tiny_model()
    out, report = recipe_engine.apply(recipe(tmp_path, ["GPTQ<group_size:32>"]), model=model,
                                      tokenizer=CharTokenizer(), progress=False)
    rows = read_log(tmp_path / "out")
    step = report.steps[0].result
    assert step["log"] == "quantization_log.csv"
    expected = [(str(layer), name) for layer in range(4) for name in LINEARS]
    assert [(r["layer"], r["module"]) for r in rows] == expected
    for row in rows:
        assert float(row["error"]) == step["layers"][row["layer"]]["output_error"][row["module"]]
        linear = out.get_submodule(f"model.layers.{row['layer']}.{row['module']}")
        assert (int(row["rows"]), int(row["columns"])) == tuple(linear.weight.shape)
        assert int(row["hessian_tokens"]) == 4 * 32  # samples × seq_len of the recipe
        assert int(row["group_size"]) == 32 and float(row["damp"]) == 0.01 and float(row["seconds"]) >= 0
    # error feedback: GPTQ's layer-output error is below round-to-nearest's on the same grams, in total
    assert sum(float(r["error"]) for r in rows) < sum(float(r["error_rtn"]) for r in rows)


def test_quantize_log_records_the_weight_error(tmp_path):
    model = tiny_model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, report = recipe_engine.apply(recipe(tmp_path, ["Quantize<group_size:16>"]), model=model,
                                      tokenizer=CharTokenizer(), progress=False)
    rows = read_log(tmp_path / "out")
    assert len(rows) == report.steps[0].result["quantized_linears"] == 4 * len(LINEARS)
    for row in rows:
        name = f"model.layers.{row['layer']}.{row['module']}.weight"
        w, q = original[name].double(), out.get_parameter(name).detach().double()
        assert float(row["weight_error"]) == pytest.approx(float(((w - q) ** 2).sum() / (w ** 2).sum()), rel=1e-6)
        assert row["error"] == "" and row["hessian_tokens"] == "0"
