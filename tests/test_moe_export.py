"""Exporting mixture-of-experts models (tiny random Qwen3-MoE, Mixtral, Qwen2-MoE; 4 experts, top-2).

Packed (compressed-tensors ``pack-quantized``): every expert is written as linears under the Hub's per-expert
names (``mlp.experts.<e>.gate_proj.weight_packed`` / ``block_sparse_moe.experts.<e>.w1...``), the routers and
``lm_head`` in ``ignore``; stock ``from_pretrained`` (transformers + compressed-tensors) computes the engine's
logits from the files, the engine reads its own output back (a later recipe, in memory and streamed), and the
expert codes equal compressed-tensors' own compressor's on the same weights and scales. gpt-oss's fused experts
are refused in one line.
"""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.errors import RecipeError
from recipe_engine.io.checkpoint_reader import CheckpointReader
from tests.helpers import BYTE_VOCAB, random_tokens, save_tiny_model
from tests.test_moe import recipe

GPTQ = "GPTQ<group_size:16,{extra}>"
#: Where each family's Hub checkpoint keeps expert 0's projections and the router of layer 0.
HUB_NAMES = {"qwen3_moe": ("model.layers.0.mlp.experts.0.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate"),
             "mixtral": ("model.layers.0.block_sparse_moe.experts.0.", ("w1", "w3", "w2"), "block_sparse_moe.gate"),
             "qwen2_moe": ("model.layers.0.mlp.experts.0.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate")}


def stored(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


@pytest.mark.parametrize("model_type,extra", [("qwen3_moe", "experts:all"), ("mixtral", "act_order:true"),
                                              ("qwen2_moe", "experts:routed")])
def test_packed_experts_load_stock_with_the_engines_logits(tmp_path, model_type, extra):
    """GPTQ on every linear and expert with the default export: the Hub's per-expert names packed, the config
    vLLM reads, and ``from_pretrained`` computes the engine's logits; the engine reads the files back to the very
    weights the step left."""
    save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=2)
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [GPTQ.format(extra=extra)]),
                                         progress=False)
    out = tmp_path / "out"
    files = stored(out)
    prefix, projections, router = HUB_NAMES[model_type]
    suffixes = ["weight_packed", "weight_scale", "weight_shape"]
    for projection in projections:
        assert sorted(k[len(prefix + projection) + 1:] for k in files if k.startswith(prefix + projection + ".")) \
            == sorted(suffixes)
    assert not any("gate_up_proj" in key or key.endswith("experts.down_proj") for key in files)
    assert f"model.layers.0.{router}.weight" in files  # the router is stored as it was
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert {"lm_head", f"model.layers.0.{router}", f"model.layers.1.{router}"} <= set(config["ignore"])
    assert "packed (compressed-tensors)" in report.steps[0].result["format"]
    tokens = random_tokens(vocab=BYTE_VOCAB)
    with torch.no_grad():
        expected = result(tokens).logits
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    reader = CheckpointReader(out, result)
    for name, tensor in result.state_dict().items():
        assert torch.equal(reader.read([name])[name], tensor), name


def test_expert_codes_are_compressed_tensors_own(tmp_path):
    """Each expert's packed tensors equal what compressed-tensors' ``PackedQuantizationCompressor`` writes for
    the same weight and scales (an independent packer)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    from recipe_engine.io.exporters.compressed_tensors import scheme
    from recipe_engine.numerics.quantization import Grid

    save_tiny_model(tmp_path / "model", "qwen3_moe", num_hidden_layers=1)
    result, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", ["Quantize<group_size:16>"]),
                                    progress=False)
    files = stored(tmp_path / "out")
    experts = result.model.layers[0].mlp.experts
    for index in (0, 3):
        gate, up = experts.gate_up_proj[index].chunk(2)
        for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", experts.down_proj[index])):
            prefix = f"model.layers.0.mlp.experts.{index}.{name}."
            theirs = PackedQuantizationCompressor.compress(
                {"weight": weight.detach(), "weight_scale": files[prefix + "weight_scale"]}, scheme(Grid(4, 16, True)))
            assert torch.equal(theirs["weight_packed"], files[prefix + "weight_packed"]), prefix
            assert files[prefix + "weight_shape"].tolist() == list(weight.shape)


def test_a_later_recipe_reads_packed_experts_in_memory_and_streamed(tmp_path):
    """The packed output is a model source: in memory and streamed, a later recipe (FuseNorm, which leaves the
    experts as they are) starts from the quantized weights, and the two runs write the same bytes."""
    save_tiny_model(tmp_path / "model", "mixtral", num_hidden_layers=2)
    first, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", ["Quantize<group_size:16>"], name="packed"),
                                   progress=False)
    for stream, name in (("off", "memory"), ("on", "streamed")):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "packed", ["FuseNorm"], stream, name), progress=False)
    a, b = stored(tmp_path / "memory"), stored(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    experts = first.model.layers[1].mlp.experts
    assert torch.equal(a["model.layers.1.block_sparse_moe.experts.2.w2.weight"], experts.down_proj[2])
    assert torch.equal(a["model.layers.1.block_sparse_moe.experts.3.w3.weight"], experts.gate_up_proj[3].chunk(2)[1])


@pytest.mark.parametrize("step,message", [
    ("GPTQ<group_size:16>", "field 'export': export compressed-tensors cannot store gpt_oss's experts: gpt-oss "
                            "stores its experts as fused 3-D tensors"),
    ("Quantize<group_size:16,export:gptq>", "field 'export': export gptq does not store gpt_oss's expert tensors"),
])
def test_gpt_oss_packed_experts_are_refused_in_one_line(tmp_path, step, message):
    save_tiny_model(tmp_path / "model", "gpt_oss", num_hidden_layers=2)
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("step,message", [
    ("GPTQ<group_size:16,targets:[q_proj,down_proj]>", "field 'targets': packed experts need gate_proj, up_proj and "
                                                       "down_proj targeted together"),
    ("Quantize<group_size:16,sym:false>", "field 'sym': packed experts need sym: true"),
])
def test_packed_experts_transformers_cannot_load_are_refused(tmp_path, step, message):
    save_tiny_model(tmp_path / "model", "qwen3_moe", num_hidden_layers=2)
    with pytest.raises(RecipeError, match=message):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    assert not (tmp_path / "out").exists()
