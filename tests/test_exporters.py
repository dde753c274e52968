"""Output formats (``recipe_engine.formats``): every checkpoint format through the registry packs and reads
back the quantized weights bit for bit; quantizing steps write compressed-tensors by default; GPTQ v1 is
checked against the published reference's unpacking; packed outputs load with the engine, with plain
transformers + compressed-tensors, as a later recipe's model, and export to the same GGUF as their
dequantized form."""
import csv
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.formats import checkpoint_exporter, checkpoint_formats, exporters, file_formats
from recipe_engine.sources.models import load_model
from recipe_engine.numerics.quantization import Grid, QuantizedLinear
from tests.helpers import CharTokenizer, random_tokens, tiny_model
from tests.test_gguf_export import VOCAB, saved

PACKING = [name for name in checkpoint_formats() if checkpoint_exporter(name).packs]


def on_grid(weight: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, QuantizedLinear]:
    """RTN of ``weight`` on ``grid`` in fp64, stored in the weight's dtype, with its record."""
    w = weight.double()
    width = grid.width(w.shape[1])
    params = [grid.params(w[:, c:c + width]) for c in range(0, w.shape[1], width)]
    scale, zero = torch.stack([p[0] for p in params], 1), torch.stack([p[1] for p in params], 1)
    fake = grid.fake(w, grid.expand(scale, w.shape[1]), grid.expand(zero, w.shape[1])).to(weight.dtype)
    return fake, QuantizedLinear(grid, scale.float(), zero.to(torch.int16))


def test_registry_holds_each_format_once():
    assert set(checkpoint_formats()) == {"dequantized", "compressed-tensors", "gptq"}
    assert file_formats() == ["gguf"]
    assert all(exporter.name == name for name, exporter in exporters().items())


@pytest.mark.parametrize("name", PACKING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group, sym", [(4, 32, True), (8, None, True), (4, 64, False)])
def test_every_packing_format_reads_back_the_quantized_weight_bit_for_bit(name, dtype, bits, group, sym):
    exporter = checkpoint_exporter(name)
    if exporter.grid_problem(bits, sym):
        pytest.skip(exporter.grid_problem(bits, sym))
    grid = Grid(bits, group, sym, exporter.scale_dtype(dtype))
    weight = (0.05 * torch.randn(48, 128, generator=torch.Generator().manual_seed(0))).to(dtype)
    fake, record = on_grid(weight, grid)
    record.format = name
    packed = exporter.pack("layer", fake, record)
    layout = exporter.layout(fake, record)
    assert list(packed) == list(layout) and set(packed) <= set(exporter.suffixes)
    assert all(packed[k].shape == layout[k].shape and packed[k].dtype == layout[k].dtype for k in layout)
    qconfig = json.loads(json.dumps(exporter.quantization_config({"layer": grid}, ["lm_head"])))
    assert exporter.reads(qconfig)
    shape = exporter.weight_shape("layer.weight", {k: tuple(t.shape) for k, t in packed.items()}, qconfig)
    assert shape == tuple(weight.shape)
    assert torch.equal(exporter.dequantize("layer.weight", packed, shape, qconfig, dtype), fake)
    share = bits / (8 * fake.element_size()) + 0.15  # the codes plus scales (and zero points)
    assert sum(t.numel() * t.element_size() for t in packed.values()) < share * fake.numel() * fake.element_size()


def reference_gptq_v1_dequantize(qweight, qzeros, scales, g_idx, bits):
    """GPTQ v1 dequantization as AutoGPTQ's torch path does it (AutoGPTQ/AutoGPTQ,
    ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``, ``QuantLinear.forward`` without the CUDA
    extension): shift each int32 word right by 0, b, 2b, ... and mask ``2^b - 1``; ``qweight`` words hold
    consecutive input rows, ``qzeros`` words consecutive output columns; zeros are stored minus one, so
    ``zeros = unpack(qzeros) + 1``; ``W = scales[g_idx] * (unpack(qweight) - zeros[g_idx])`` (``[in, out]``).
    Written here from that description, independently of the engine's packing code."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros, 2**bits - 1) + 1
    zeros = zeros.reshape(qzeros.shape[0], -1)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight, 2**bits - 1).reshape(-1, qweight.shape[1])
    return scales.float()[g_idx.long()] * (weight - zeros[g_idx.long()]).float()


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (2, None), (4, None)])
def test_gptq_v1_unpacks_as_the_published_reference(bits, group):
    exporter = checkpoint_exporter("gptq")
    grid = Grid(bits, group, True, exporter.scale_dtype(torch.float32))
    weight = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    fake, record = on_grid(weight, grid)
    packed = exporter.pack("layer", fake, record)
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32
    reference = reference_gptq_v1_dequantize(packed["qweight"], packed["qzeros"], packed["scales"],
                                             packed["g_idx"], bits)
    assert torch.equal(reference.t(), fake)
    config = exporter.quantization_config({"layer": grid}, [])
    assert config == {**config, "quant_method": "gptq", "bits": bits, "group_size": group or -1,
                      "desc_act": False, "sym": True, "checkpoint_format": "gptq"}


def test_gptq_v1_refuses_what_it_cannot_store():
    gptq = checkpoint_exporter("gptq")
    assert "sym: true" in gptq.grid_problem(4, False)
    assert "bits" in gptq.grid_problem(3, True)
    assert "bits 4 or 8" in checkpoint_exporter("compressed-tensors").grid_problem(3, True)


def recipe(tmp_path, model, steps, output="out", **extra):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    return dict(version=1, name="export-test", model=str(model), device="cpu", output=str(tmp_path / output),
                calibration=dict(dataset=str(text), samples=4, seq_len=32, batch_size=2), modifiers=steps, **extra)


def stored_names(directory):
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_recipe_naming_no_export_writes_packed_that_loads_back_bit_for_bit(tmp_path):
    """The default is compressed-tensors; the engine reads it back to the very weights the step left, and
    plain transformers + compressed-tensors computes the engine's logits from the files."""
    from transformers import AutoModelForCausalLM

    _, directory = saved(tmp_path)
    out, report = recipe_engine.apply(recipe(tmp_path, directory, ["GPTQ<group_size:32>"]), progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    assert "model.layers.0.mlp.down_proj.weight_packed" in stored_names(tmp_path / "out")
    assert "model.layers.0.mlp.down_proj.weight" not in stored_names(tmp_path / "out")
    assert "packed (compressed-tensors)" in report.steps[0].result["format"]
    loaded, _, _ = load_model(str(tmp_path / "out"))
    assert getattr(loaded.config, "quantization_config", None) is None
    for name, tensor in out.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, out(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", ["GPTQ<group_size:32>", "Quantize<group_size:32>"])
def test_export_dequantized_writes_the_packed_defaults_weights_bit_for_bit(tmp_path, step):
    """Choosing the file format never changes the model: both grids round their scales to the model dtype."""
    _, directory = saved(tmp_path)
    name, _, params = step.partition("<")
    recipe_engine.apply(recipe(tmp_path, directory, [step], output="packed"), progress=False)
    recipe_engine.apply(recipe(tmp_path, directory, [f"{name}<export:dequantized,{params}"], output="plain"),
                        progress=False)
    assert "model.layers.0.mlp.down_proj.weight" in stored_names(tmp_path / "plain")
    packed, _, _ = load_model(str(tmp_path / "packed"))
    plain, _, _ = load_model(str(tmp_path / "plain"))
    for name, tensor in plain.state_dict().items():
        assert torch.equal(packed.state_dict()[name], tensor), name


def test_gptq_export_round_trips_through_the_engine_and_the_reference(tmp_path):
    _, directory = saved(tmp_path)
    out, _ = recipe_engine.apply(recipe(tmp_path, directory, ["GPTQ<group_size:32,export:gptq>"]), progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["checkpoint_format"], config["bits"]) == ("gptq", "gptq", 4)
    loaded, _, _ = load_model(str(tmp_path / "out"))
    for name, tensor in out.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prefix = "model.layers.1.self_attn.o_proj."
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        parts = [f.get_tensor(prefix + key) for key in ("qweight", "qzeros", "scales", "g_idx")]
    reference = reference_gptq_v1_dequantize(*parts, 4).t()
    assert torch.equal(reference, out.get_parameter(prefix + "weight"))


def test_two_gptq_steps_log_their_rows_apart(tmp_path):
    steps = ["GPTQ<group_size:32,export:dequantized>", "GPTQ<group_size:32,export:dequantized>"]
    model = tiny_model()
    recipe_engine.apply(recipe(tmp_path, "unused", steps), model=model, tokenizer=CharTokenizer(), progress=False)
    with open(tmp_path / "out" / "quantization_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[0] == "step"
    keys = [(row["step"], row["layer"], row["module"]) for row in rows]
    assert len(set(keys)) == len(keys) == 2 * model.config.num_hidden_layers * 7
    assert {row["step"] for row in rows} == {"0 GPTQ", "1 GPTQ"}


def test_a_packed_output_is_a_later_recipes_model_streamed_or_not(tmp_path):
    """A later recipe reads the packed output dequantized (in memory and streamed from its files) and, quantizing
    nothing, writes it packed again; both ways give the same model."""
    _, directory = saved(tmp_path)
    out, _ = recipe_engine.apply(recipe(tmp_path, directory, ["GPTQ<group_size:32>"]), progress=False)
    ids = random_tokens(2, 16, vocab=VOCAB)
    logits = {}
    for stream in ("on", "off"):
        recipe_engine.apply(recipe(tmp_path, tmp_path / "out", ["ShortGPT<n:1>"], f"later-{stream}", stream=stream),
                            progress=False)
        assert "quantization_config" in json.loads((tmp_path / f"later-{stream}" / "config.json").read_text())
        reloaded, _, _ = load_model(str(tmp_path / f"later-{stream}"))
        assert reloaded.config.num_hidden_layers == out.config.num_hidden_layers - 1
        with torch.no_grad():
            logits[stream] = reloaded(ids).logits
    torch.testing.assert_close(logits["on"], logits["off"], rtol=0, atol=0)


def packed_source(tmp_path, export, scale_dtype="model"):
    """A tiny model quantized by GPTQ into ``export`` (the source of a later recipe), and its config's
    ``quantization_config``."""
    _, directory = saved(tmp_path)
    step = {"GPTQ": {"group_size": 32, "export": export, "scale_dtype": scale_dtype}}
    recipe_engine.apply(recipe(tmp_path, directory, [step]), progress=False)
    return tmp_path / "out", json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]


def stored(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def source_name(name: str, origin: list[list[int]]) -> str:
    """The source tensor an output tensor came from: layer ``i`` of the output is the source's ``origin[i]``."""
    if not name.startswith("model.layers."):
        return name
    index = int(name.split(".")[2])
    return name.replace(f"model.layers.{index}.", f"model.layers.{origin[index][0]}.", 1)


@pytest.mark.parametrize("export", ["compressed-tensors", "gptq"])
def test_a_later_recipe_that_quantizes_nothing_writes_its_packed_source_packed_again(tmp_path, capsys, export):
    """A recipe that only drops layers of a packed source writes the layers it keeps packed again, every tensor
    byte for byte the source's (the source's grids carried: ``CheckpointReader.quantization_records``), with the
    source's quantization_config, in memory and streamed alike; nothing to note. ``recipe plan`` says what
    will happen before anything runs; a recipe with a quantizing step decides the output's grid itself."""
    import yaml

    from recipe_engine.cli import main

    source, qconfig = packed_source(tmp_path, export)
    original = stored(source)
    for stream in ("off", "on"):
        recipe_engine.apply(recipe(tmp_path, source, ["ShortGPT<n:1>"], f"later-{stream}", stream=stream),
                            progress=False)
        report = recipe_engine.load_report(tmp_path / f"later-{stream}")
        assert report.model.packed == f"{export}, 4-bit, groups of 32" and report.notes == []
        assert json.loads((tmp_path / f"later-{stream}" / "config.json").read_text())["quantization_config"] == qconfig
        written = stored(tmp_path / f"later-{stream}")
        assert len(written) == len(original) - sum(k.startswith(f"model.layers.{report.after.layers}.")
                                                   for k in original)  # one layer fewer
        origin = report.after.layer_origin
        assert all(torch.equal(tensor, original[source_name(k, origin)]) for k, tensor in written.items())
    assert (tmp_path / "later-on" / "model.safetensors").read_bytes() == \
        (tmp_path / "later-off" / "model.safetensors").read_bytes()

    for steps, said in ((["ShortGPT<n:1>"], True), (["ShortGPT<n:1>", "Quantize<group_size:32>"], False)):
        plan = tmp_path / "plan.yaml"
        plan.write_text(yaml.safe_dump(recipe(tmp_path, source, steps, "unused")))
        capsys.readouterr()
        assert main(["plan", str(plan)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert ("note: the source's weights are packed" in out) == said
        assert ("the linears no step changes are written packed again on their source grids" in out) == said
    recipe_engine.apply(recipe(tmp_path, source, ["ShortGPT<n:1>", "Quantize<group_size:32>"], "again"),
                        progress=False)
    assert recipe_engine.load_report(tmp_path / "again").notes == []
    again = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert again["quant_method"] == "compressed-tensors"  # Quantize's default export, not the source's


def test_linears_a_step_changes_are_written_unpacked_beside_the_packed_ones(tmp_path):
    """FuseNorm scales q/k/v and gate/up of every layer: those leave their grids and are written in the model
    dtype, named in quantization_config's ignore; o_proj and down_proj stay packed, byte for byte. Plain
    transformers (with compressed-tensors) computes the engine's logits; streamed equals in memory; the note
    says how many of each, under the summary and in the card."""
    from rich.console import Console

    from recipe_engine.cli.summary import print_summary

    source, _ = packed_source(tmp_path, "compressed-tensors")
    original = stored(source)
    for stream in ("off", "on"):
        recipe_engine.apply(recipe(tmp_path, source, ["FuseNorm", "ShortGPT<n:1>"], f"later-{stream}",
                                   stream=stream), progress=False)
    out = tmp_path / "later-off"
    assert (tmp_path / "later-on" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    report = recipe_engine.load_report(out)
    layers = report.after.layers
    changed = {f"model.layers.{i}.{p}" for i in range(layers)
               for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(config["ignore"]) == changed | {"lm_head"}
    written = stored(out)
    kept = {k.rsplit(".", 1)[0] for k in written if k.endswith(".weight_packed")}
    assert kept == {f"model.layers.{i}.{p}" for i in range(layers) for p in ("self_attn.o_proj", "mlp.down_proj")}
    assert all(torch.equal(written[k], original[source_name(k, report.after.layer_origin)])
               for k in written if k.rsplit(".", 1)[0] in kept)
    (note,) = report.notes
    assert note == (f"the source's weights are packed (compressed-tensors, 4-bit, groups of 32); {2 * layers} linears "
                    f"are written packed again on their source grids, the {5 * layers} linears a step changed "
                    f"unpacked in float32 (listed in quantization_config's ignore)")
    assert f"- note: {note}" in (out / "README.md").read_text()
    console = Console(record=True, width=400)
    print_summary(report, console)
    assert f"note: {note}" in console.export_text()
    ids = random_tokens(2, 16, vocab=VOCAB)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        ours = load_model(str(out))[0](ids).logits
    assert torch.equal(theirs, ours)


def test_a_gptq_source_changed_by_a_step_is_written_unpacked_and_says_why(tmp_path):
    """GPTQ v1 has no list of linears left out: when a step changes some linears, none is packed again."""
    source, _ = packed_source(tmp_path, "gptq")
    recipe_engine.apply(recipe(tmp_path, source, ["FuseNorm", "ShortGPT<n:1>"], "later"), progress=False)
    assert "quantization_config" not in json.loads((tmp_path / "later" / "config.json").read_text())
    (note,) = recipe_engine.load_report(tmp_path / "later").notes
    layers = recipe_engine.load_report(tmp_path / "later").after.layers
    assert note == (f"the source's weights are packed (gptq, 4-bit, groups of 32) and were read dequantized; no step "
                    f"quantized and none of its linears is packed again (the {5 * layers} linears a step changed; the "
                    f"format cannot leave them out beside packed ones), so the output is written unpacked in float32: "
                    f"end the recipe with GPTQ or Quantize to pack it (each rounds anew)")


@pytest.mark.parametrize("export", ["compressed-tensors", "gptq"])
def test_gguf_of_a_packed_output_equals_the_gguf_of_its_dequantized_form(tmp_path, export):
    import gguf

    _, directory = saved(tmp_path)
    out, _ = recipe_engine.apply(recipe(tmp_path, directory, [f"GPTQ<group_size:32,export:{export}>"],
                                        export={"format": "gguf", "type": "f32"}), progress=False)
    dense = tmp_path / "dense"
    out.save_pretrained(dense)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dense / name).write_bytes((tmp_path / "out" / name).read_bytes())
    exporters()["gguf"].write_file(dense, tmp_path / "dense.gguf", "f32", name="export-test")
    packed, plain = gguf.GGUFReader(tmp_path / "out" / "model.gguf"), gguf.GGUFReader(tmp_path / "dense.gguf")
    assert [t.name for t in packed.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(packed.tensors, plain.tensors):
        assert (a.data == b.data).all(), a.name


@pytest.mark.parametrize("change, message", [
    ({"modifiers": ["GPTQ<group_size:32,export:gptq,sym:false>"]}, "field 'sym': gptq export stores zero points"),
    ({"modifiers": ["GPTQ<group_size:32,bits:3>"]}, "field 'bits': compressed-tensors export needs bits 4 or 8"),
    ({"export": {"format": "onnx"}}, "field 'export.format': unknown export format 'onnx'; choose from gguf"),
    ({"export": {"format": "gguf", "type": "q4_0"}}, "field 'export.type': gguf export writes types")])
def test_formats_refuse_what_they_cannot_hold_before_anything_runs(tmp_path, change, message):
    from recipe_engine.errors import RecipeError
    from recipe_engine.plan.preflight import check_against_config
    from recipe_engine.recipe.schema import recipe_from_dict
    from tests.helpers import tiny_config

    data = {**recipe(tmp_path, "unused", ["GPTQ<group_size:32>"]), **change}
    with pytest.raises(RecipeError, match=message) as error:
        check_against_config(recipe_from_dict(data), tiny_config(), "r.yaml")
    assert "r.yaml" in str(error.value) and "\n" not in str(error.value)


def test_packing_moves_to_the_gpu_only_when_the_tensor_and_its_fp64_copies_fit(monkeypatch):
    from recipe_engine.checkpoint.writer import PACK_DEVICE_SHARE, pack_device

    experts = torch.zeros(8, 64, 32, dtype=torch.bfloat16)   # 8 experts of 64 × 32
    need = experts.numel() * 2 + 6 * 8 * 64 * 32               # the stack, six fp64 copies of one expert
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    free = {"bytes": int(need / PACK_DEVICE_SHARE)}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 10**12))
    assert pack_device(gpu, experts) == gpu
    assert pack_device(gpu, experts[0]) == gpu
    free["bytes"] -= 2
    assert pack_device(gpu, experts) == cpu
    assert pack_device(cpu, experts) == cpu
    assert pack_device(gpu, experts.to("meta")).type == "meta"  # a layout is never moved


@pytest.mark.parametrize("block_rows", [None, 5])
@pytest.mark.parametrize("columns, group", [(128, 32), (112, 32), (100, None)])
def test_grid_codes_equal_each_values_own_division(monkeypatch, columns, group, block_rows):
    """The codes (groups broadcast, a last partial group padded; the rows in blocks, a last partial one too)
    equal ``clamp(round(w / s) + z)`` computed for every value with its own group's scale and zero point; a
    weight moved off its grid is refused, in any block."""
    from recipe_engine.numerics import quantization
    from recipe_engine.numerics.quantization import grid_codes

    if block_rows is not None:  # 24 rows: blocks of 5, 5, 5, 5 and 4
        monkeypatch.setattr(quantization, "HOST_BLOCK_BYTES", block_rows * 8 * columns)
    grid = Grid(4, group, False, torch.bfloat16)
    weight = (0.05 * torch.randn(24, columns, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    fake, record = on_grid(weight, grid)
    width = group or columns
    expected = torch.empty(24, columns, dtype=torch.int16)
    for c in range(columns):
        s, z = record.scale[:, c // width].double(), record.zero[:, c // width].double()
        expected[:, c] = torch.clamp(torch.round(fake[:, c].double() / s) + z, 0, 15).to(torch.int16)
    assert torch.equal(grid_codes("layer", fake, record), expected)
    for row in (3, 22):  # the first block and the last, partial one
        moved = fake.clone()
        moved[row, 5] += record.scale[row, 5 // width].to(torch.bfloat16) * 0.4
        with pytest.raises(RuntimeError, match="off their quantization grid"):
            grid_codes("layer", moved, record)


@pytest.mark.parametrize("model_type,per_chunk", [("qwen3_moe", None), ("qwen3_moe", 1), ("qwen3_moe", 3),
                                                   ("mixtral", None)])
def test_stacked_experts_pack_as_one_matrix_into_each_experts_bytes(monkeypatch, model_type, per_chunk):
    """A stacked experts tensor packed as one matrix (``_packed_stack``: one division, check and host copy per
    chunk of experts; here all at once, one expert per chunk, or three with a shorter last chunk) gives every
    expert linear the names, order and bytes of packing that linear alone on the Hub's name (what
    ``PackedQuantizationCompressor`` writes, checked above), gate and up split from the fused tensor."""
    from recipe_engine.checkpoint import writer as checkpoint_writer
    from recipe_engine.checkpoint.names import saved_names
    from recipe_engine.checkpoint.writer import _packed, _stored
    from recipe_engine.numerics.quantization import Grid, QuantizedLinear
    from recipe_engine.modifiers._quant import rtn
    from tests.helpers import tiny_model

    model = tiny_model(model_type)
    rename = saved_names(model)
    name = next(n for n in model.state_dict() if n.endswith("experts.gate_up_proj"))
    stacked = model.state_dict()[name]
    if per_chunk is not None:  # a budget of exactly per_chunk experts' fp64 work
        monkeypatch.setattr(checkpoint_writer, "HOST_PACK_BYTES",
                            per_chunk * checkpoint_writer.PACK_BYTES_PER_ELEMENT * stacked[0].numel())
        assert checkpoint_writer.stack_per_chunk(stacked) == per_chunk < len(stacked)
    grid = Grid(4, 16, True, scale_dtype=stacked.dtype)
    parts = [rtn(expert, grid) for expert in stacked]
    on_grid = torch.stack([p.dequantized for p in parts]).to(stacked.dtype)
    record = QuantizedLinear(grid, torch.stack([p.scale for p in parts]).float(),
                             torch.stack([p.zero for p in parts]).to(torch.int16), parameter="gate_up_proj")
    together = _stored(name, on_grid, {name: record}, rename)
    scales, zeros = rename(name, record.scale), rename(name, record.zero)
    alone = {key: value for linear, weight in rename(name, on_grid).items()
             for key, value in _packed(linear, weight, QuantizedLinear(grid, scales[linear], zeros[linear])).items()}
    assert list(together) == list(alone) and len(alone) == 3 * 2 * len(stacked)  # gate and up of each expert
    for key, value in alone.items():
        assert together[key].dtype == value.dtype and torch.equal(together[key].contiguous(), value), key


@pytest.mark.parametrize("stream", ["off", "on"])
def test_a_packed_source_run_resumed_after_running_out_of_memory_writes_the_same_bytes(tmp_path, monkeypatch,
                                                                                        stream):
    """The carried grids go into the resume checkpoints with the model (those of a layer ShortGPT dropped go
    with it): out of memory in the step after ShortGPT, ``--resume`` writes the uninterrupted run's bytes."""
    import yaml

    from recipe_engine.cli import main
    from recipe_engine.modifiers.fuse_norm import FuseNorm

    source, _ = packed_source(tmp_path, "compressed-tensors")
    file = tmp_path / "later.yaml"
    file.write_text(yaml.safe_dump(recipe(tmp_path, source, ["ShortGPT<n:1>", "FuseNorm"], "unused", stream=stream)))
    run = lambda output, *extra: main(["apply", str(file), "--output", str(tmp_path / output), "--quiet", *extra])
    assert run("reference") == 0
    with monkeypatch.context() as patch:
        patch.setattr(FuseNorm, "apply", lambda self, session: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
        assert run("resumed") == 4
    assert run("resumed", "--resume") == 0
    assert recipe_engine.load_report(tmp_path / "resumed").resumed is not None
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == \
        (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert "ignore" in json.loads((tmp_path / "resumed" / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_16_bit_scales_of_a_packed_source_are_carried_through_a_float32_run(tmp_path, scale_dtype):
    """A float32 run holds ``(q − z) · s`` of 16-bit scales exactly: a recipe that only drops a layer of such a
    source writes every tensor it keeps byte for byte the source's, with its quantization_config, and notes
    nothing."""
    source, qconfig = packed_source(tmp_path, "compressed-tensors", scale_dtype)
    original = stored(source)
    assert {t.dtype for k, t in original.items() if k.endswith("weight_scale")} == {getattr(torch, scale_dtype)}
    recipe_engine.apply(recipe(tmp_path, source, ["ShortGPT<n:1>"], "later"), progress=False)
    report = recipe_engine.load_report(tmp_path / "later")
    assert report.notes == [] and report.model.packed.startswith("compressed-tensors, 4-bit, groups of 32")
    assert json.loads((tmp_path / "later" / "config.json").read_text())["quantization_config"] == qconfig
    written = stored(tmp_path / "later")
    assert written and all(torch.equal(tensor, original[source_name(k, report.after.layer_origin)])
                           and tensor.dtype == original[source_name(k, report.after.layer_origin)].dtype
                           for k, tensor in written.items())


def test_a_packed_source_run_in_another_dtype_is_written_unpacked_and_says_why(tmp_path):
    """compressed-tensors stores scales in the model dtype: an fp32 source's scales rounded to bf16 would pack
    weights other than the run's, so a bf16 run packs nothing again, says why, and writes the run's weights."""
    source, _ = packed_source(tmp_path, "compressed-tensors")
    recipe_engine.apply(recipe(tmp_path, source, ["ShortGPT<n:1>"], "later", dtype="bfloat16"), progress=False)
    assert "quantization_config" not in json.loads((tmp_path / "later" / "config.json").read_text())
    (note,) = recipe_engine.load_report(tmp_path / "later").notes
    assert note == ("the source's weights are packed (compressed-tensors, 4-bit, groups of 32) and were read "
                    "dequantized; no step quantized and none of its linears is packed again (the linears whose scales "
                    "the format would store in the run's dtype, not the source's), so the output is written unpacked "
                    "in bfloat16: end the recipe with GPTQ or Quantize to pack it (each rounds anew)")
    weights = load_model(str(source), "bfloat16")[0].state_dict()
    report = recipe_engine.load_report(tmp_path / "later")
    for name, tensor in stored(tmp_path / "later").items():
        assert torch.equal(tensor, weights[source_name(name, report.after.layer_origin)]), name
