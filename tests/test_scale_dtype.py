"""``scale_dtype``: a float32 run that stores 16-bit scales, as a bf16 model's checkpoint would: the scales are
rounded before the grid is used (so the codes are the run's), written in that dtype, counted in bits per weight,
and read back bit for bit by stock transformers in float32 and in the 16-bit dtype itself."""
import pytest
import torch
from safetensors import safe_open

import recipe_engine
from recipe_engine.errors import RecipeError
from recipe_engine.plan.preflight import check_against_config
from recipe_engine.recipe.schema import recipe_from_dict
from tests.helpers import CharTokenizer, random_tokens, tiny_config, tiny_model
from tests.test_mixed_bits import packed_bytes
from tests.test_quant_modifiers import LINEARS, recipe


@pytest.mark.parametrize("kind", ["GPTQ", "Quantize"])
def test_bfloat16_scales_from_a_float32_run_are_written_counted_and_loaded(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    step = {kind: {"bits": 4, "group_size": 32, "scale_dtype": "bfloat16"}}
    out, report = recipe_engine.apply(recipe(tmp_path, [step]), model=tiny_model(), tokenizer=CharTokenizer(),
                                      progress=False)
    directory = tmp_path / "out"
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        scales = {key: handle.get_tensor(key) for key in handle.keys() if key.endswith(".weight_scale")}
    assert len(scales) == 4 * len(LINEARS) and {s.dtype for s in scales.values()} == {torch.bfloat16}

    # bits per weight: 4 + 16/32, equal to the bytes of the weight tensors in the file and to the validation's
    # symbolic figure
    sizes, shapes = packed_bytes(directory)
    weights = sum(r * c for r, c in shapes.values())
    written = 8 * sum(sizes.values()) / weights
    assert written == 4.5
    assert report.steps[0].result["bits_per_weight"] == round(written, 4)
    planned = check_against_config(recipe_from_dict(recipe(tmp_path, [step])), tiny_config()).linear_bits
    assert planned == pytest.approx(written, rel=1e-12)

    # the run's own weights are on the bf16-scale grid: every group's values are bf16 scale × integer codes
    for layer in range(4):
        for module in LINEARS:
            name = f"model.layers.{layer}.{module}"
            weight, scale = out.get_parameter(f"{name}.weight"), scales[f"{name}.weight_scale"].float()
            codes = weight / scale.repeat_interleave(32, dim=1)
            torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)

    tokens = random_tokens(2, 16)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        with torch.no_grad():
            logits = loaded(tokens).logits
        for name, param in out.named_parameters():  # decompressed by the first forward
            if name.startswith("model.layers."):
                assert torch.equal(loaded.get_parameter(name), param.to(dtype)), (dtype, name)
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(logits, out(tokens).logits, rtol=1e-5, atol=1e-5)


def test_the_default_keeps_the_model_dtype_scales(tmp_path):
    recipe_engine.apply(recipe(tmp_path, ["Quantize<group_size:32>"]), model=tiny_model(), tokenizer=CharTokenizer(),
                        progress=False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        dtypes = {handle.get_tensor(k).dtype for k in handle.keys() if k.endswith(".weight_scale")}
    assert dtypes == {torch.float32}


def test_gptq_export_refuses_bfloat16_scales_in_one_line(tmp_path):
    data = recipe(tmp_path, [{"GPTQ": {"group_size": 32, "export": "gptq", "scale_dtype": "bfloat16"}}])
    with pytest.raises(RecipeError, match="export gptq stores its scales in float16") as error:
        check_against_config(recipe_from_dict(data), tiny_config(), "r.yaml")
    text = str(error.value)
    assert "GPTQ" in text and "field 'scale_dtype'" in text and "\n" not in text, text
