"""Exporting mixture-of-experts models (tiny random Qwen3-MoE, Mixtral, Qwen2-MoE; 4 experts, top-2).

Packed (compressed-tensors ``pack-quantized``): every expert is written as linears under the Hub's per-expert
names (``mlp.experts.<e>.gate_proj.weight_packed`` / ``block_sparse_moe.experts.<e>.w1...``), the routers and
``lm_head`` in ``ignore``; stock ``from_pretrained`` (transformers + compressed-tensors) computes the engine's
logits from the files, the engine reads its own output back (a later recipe, in memory and streamed), and the
expert codes equal compressed-tensors' own compressor's on the same weights and scales. gpt-oss's fused experts
are refused in one line.

GGUF: llama.cpp's qwen3moe / qwen2moe / llama (Mixtral) layout — stacked ``ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps``, the router as ``ffn_gate_inp``, the ``expert_*`` keys — read back by ``gguf.GGUFReader`` and,
for the Qwen families, by transformers' GGUF loader with the engine's logits. (llama.cpp's own loader:
``test_gguf_architectures.py``, when llama-cpp-python is installed.)
"""
import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.errors import RecipeError
from recipe_engine.checkpoint.reader import CheckpointReader
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


def test_streamed_packed_experts_are_the_in_memory_bytes(tmp_path):
    """GPTQ on every expert of a streamed Qwen2-MoE (routed and shared experts) writes the in-memory run's bytes."""
    save_tiny_model(tmp_path / "model", "qwen2_moe", num_hidden_layers=2)
    step = GPTQ.format(extra="experts:all")
    for stream, name in (("off", "memory"), ("on", "streamed")):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step], stream, name), progress=False)
    a, b = stored(tmp_path / "memory"), stored(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.1.mlp.shared_expert.up_proj.weight_packed" in a
    assert (tmp_path / "memory/config.json").read_text() == (tmp_path / "streamed/config.json").read_text()


def test_expert_codes_are_compressed_tensors_own(tmp_path):
    """Each expert's packed tensors equal what compressed-tensors' ``PackedQuantizationCompressor`` writes for
    the same weight and scales (an independent packer)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    from recipe_engine.formats.compressed_tensors import scheme
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
    # nothing is packed again (the experts are fused in memory; an output packs every expert or none): said so
    assert "quantization_config" not in json.loads((tmp_path / "memory" / "config.json").read_text())
    (note,) = recipe_engine.load_report(tmp_path / "memory").notes
    assert note.startswith("the source's weights are packed (compressed-tensors, 4-bit, groups of 16) and were read "
                           "dequantized; no step quantized, and the engine holds a mixture-of-experts model's experts "
                           "as fused 3-D tensors") and note.endswith("so the output is written unpacked in float32: "
                                                                    "end the recipe with GPTQ or Quantize to pack it "
                                                                    "(each rounds anew)")


@pytest.mark.parametrize("model,step,message", [
    ("gpt_oss", "GPTQ<group_size:16>", "field 'export': export compressed-tensors cannot store gpt_oss's experts: "
                                       "gpt-oss stores its experts as fused 3-D tensors"),
    ("gpt_oss", "Quantize<group_size:16,export:gptq>",
     "field 'export': export gptq does not store gpt_oss's expert tensors"),
    ("qwen3_moe", "GPTQ<group_size:16,targets:[q_proj,down_proj]>",
     "field 'targets': packed experts need gate_proj, up_proj and down_proj targeted together"),
    ("qwen3_moe", "Quantize<group_size:16,sym:false>", "field 'sym': packed experts need sym: true"),
])
def test_packed_experts_that_cannot_be_stored_or_loaded_are_refused_in_one_line(tmp_path, model, step, message):
    save_tiny_model(tmp_path / "model", model, num_hidden_layers=2)
    with pytest.raises(RecipeError, match=re.escape(message)):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    assert not (tmp_path / "out").exists()


# -- GGUF -------------------------------------------------------------------------------------------------------

def gguf_file(tmp_path, model_type, kind="f32", **overrides):
    """A tiny MoE model saved with a byte-level tokenizer and exported to GGUF; returns (model, GGUFReader)."""
    import gguf

    from recipe_engine.formats.gguf.writer import export_gguf
    from tests.test_gguf_architectures import saved

    model, directory = saved(tmp_path, model_type, **overrides)
    summary = export_gguf(directory, tmp_path / "m.gguf", kind, name="tiny")
    assert summary["architecture"] == {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[model_type]
    return model, gguf.GGUFReader(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("model_type,overrides", [("qwen3_moe", dict(norm_topk_prob=True)), ("qwen2_moe", {})])
@pytest.mark.parametrize("kind,tolerance", [("f32", 1e-6), ("f16", 1e-2)])
def test_gguf_of_qwen_moe_reads_back_in_transformers_with_the_same_logits(tmp_path, model_type, overrides, kind,
                                                                         tolerance):
    """transformers' GGUF loader (``gguf_file=``) splits ``ffn_gate_exps``/``ffn_up_exps`` back into the stacked
    gate_up_proj. It reads no ``expert_feed_forward_length`` (its default expert width, 768 for Qwen3-MoE, is
    the 30B-A3B's), so the tiny model's config is passed; the metadata llama.cpp reads is checked from the file."""
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_export import relative_error

    model, reader = gguf_file(tmp_path, model_type, kind, **overrides)
    arch = reader.fields["general.architecture"].contents()
    fields = {key: field.contents() for key, field in reader.fields.items()}
    config = model.config
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    assert fields[f"{arch}.expert_feed_forward_length"] == config.moe_intermediate_size == 48
    if model_type == "qwen2_moe":
        assert fields[f"{arch}.expert_shared_feed_forward_length"] == config.shared_expert_intermediate_size
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", config=config,
                                                dtype=torch.float32).eval()
    assert relative_error(model, back) < tolerance


def test_gguf_of_mixtral_holds_llama_cpp_s_tensors(tmp_path):
    """Mixtral is llama.cpp's llama graph with experts (transformers reads no Mixtral GGUF): every key and tensor
    read back by ``gguf.GGUFReader`` — the router as ``ffn_gate_inp``, each expert tensor stacked
    ``[experts, rows, columns]`` (GGML's dimensions reversed), gate and up apart, q/k rows in llama.cpp's
    adjacent-pair rope order."""
    from recipe_engine.formats.gguf.writer import permute_rope

    model, reader = gguf_file(tmp_path, "mixtral")
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["llama.expert_count"] == 4 and fields["llama.expert_used_count"] == 2
    assert fields["llama.expert_feed_forward_length"] == fields["llama.feed_forward_length"] == 96
    written = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in reader.tensors}
    for index, layer in enumerate(model.model.layers):
        experts, block = layer.mlp.experts, f"blk.{index}."
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        assert list(written[block + "ffn_gate_exps.weight"].shape) == [4, 96, 64]
        for name, expected in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", experts.down_proj),
                               ("ffn_gate_inp", layer.mlp.gate.weight),
                               ("attn_q", permute_rope(layer.self_attn.q_proj.weight, 4)),
                               ("attn_k", permute_rope(layer.self_attn.k_proj.weight, 2))):
            assert torch.equal(written[f"{block}{name}.weight"], expected.detach()), name
    assert len(written) == len(model.state_dict()) + len(model.model.layers)  # gate_up_proj gives two


def test_gguf_of_a_packed_moe_output_holds_its_dequantized_experts(tmp_path):
    """``recipe export`` of a GPTQ output with packed experts: the GGUF experts are the engine's quantized
    weights, read from the per-expert packed tensors and stacked."""
    import gguf

    from recipe_engine.formats.gguf.writer import export_gguf

    save_tiny_model(tmp_path / "model", "qwen3_moe", num_hidden_layers=2, norm_topk_prob=True)
    from tests.test_gguf_export import bpe_tokenizer
    bpe_tokenizer().save_pretrained(tmp_path / "model")
    result, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [GPTQ.format(extra="experts:all")]),
                                    progress=False)
    export_gguf(tmp_path / "out", tmp_path / "q.gguf", "f32")
    written = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    experts = result.model.layers[1].mlp.experts
    assert torch.equal(written["blk.1.ffn_up_exps.weight"], experts.gate_up_proj.chunk(2, dim=1)[1].detach())
    assert torch.equal(written["blk.1.ffn_down_exps.weight"], experts.down_proj.detach())


@pytest.mark.parametrize("model_type,overrides,message", [
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob False differs from llama.cpp's graph, which "
                                              "renormalizes"),
    ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob True differs from llama.cpp's graph, which does not"),
    ("gpt_oss", {}, r"model_type 'gpt_oss' is not supported \(supported: .*qwen3_moe, mixtral\)"),
])
def test_gguf_moe_refusals_are_one_line(tmp_path, model_type, overrides, message):
    from recipe_engine.formats.gguf.writer import export_gguf
    from tests.test_gguf_architectures import saved

    _, directory = saved(tmp_path, model_type, **overrides)
    with pytest.raises(RecipeError, match=f"GGUF export: {message}") as caught:
        export_gguf(directory, tmp_path / "m.gguf")
    assert "\n" not in str(caught.value) and not (tmp_path / "m.gguf").exists()


def test_bench_of_packed_experts_is_refused_in_one_line(tmp_path, capsys):
    """``recipe bench`` times packed linears with PyTorch's int4 kernel; packed experts are refused before loading."""
    from recipe_engine.cli import main
    from tests.helpers import refused_in_one_line
    from tests.test_bench import SMALL

    save_tiny_model(tmp_path / "model", "mixtral", num_hidden_layers=2)
    recipe_engine.apply(recipe(tmp_path, tmp_path / "model", ["Quantize<group_size:32>"]), progress=False)
    capsys.readouterr()
    refused_in_one_line(capsys, main, ["bench", str(tmp_path / "out"), *SMALL],
                        "packed mixture-of-experts experts (model.layers.0.block_sparse_moe.experts.0.w1", "vLLM")


@pytest.mark.parametrize("model_type,overrides", [("qwen3_moe", dict(norm_topk_prob=True)), ("qwen2_moe", {})])
def test_the_engine_reads_its_moe_gguf_back(tmp_path, monkeypatch, model_type, overrides):
    """A GGUF export is a model source: the expert widths transformers' GGUF reader leaves out come from the
    file's ``expert_feed_forward_length`` keys, and the converted model computes the source's logits."""
    from tests.test_gguf_export import relative_error

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    model, _ = gguf_file(tmp_path, model_type, **overrides)
    loaded, _ = recipe_engine.load_model(str(tmp_path / "m.gguf"))
    assert loaded.config.moe_intermediate_size == 48
    assert relative_error(model, loaded) < 1e-6


def test_a_mixtral_gguf_source_is_refused_in_one_line(tmp_path, monkeypatch):
    """transformers reads a llama GGUF with experts as a dense Llama: refused instead of loading without experts."""
    from recipe_engine.errors import SourceError

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    gguf_file(tmp_path, "mixtral")
    with pytest.raises(SourceError, match="a llama GGUF file with 4 experts per layer") as caught:
        recipe_engine.load_model(str(tmp_path / "m.gguf"))
    assert "\n" not in str(caught.value)
