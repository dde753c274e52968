"""Several grids in one quantizing step (``overrides``): validation, the per-linear grid in memory and in the log,
one compressed-tensors config group per grid that stock transformers loads, and bits per weight as written."""
import json
import logging

import pytest
import torch
from safetensors import safe_open

import recipe_engine
from recipe_engine.errors import RecipeError, SourceError
from recipe_engine.checkpoint.reader import CheckpointReader
from recipe_engine.plan.preflight import check_against_config
from recipe_engine.recipe.schema import recipe_from_dict
from tests.helpers import CharTokenizer, random_tokens, tiny_config, tiny_model
from tests.test_quant_modifiers import LINEARS, read_log, recipe

#: int8 for down_proj of the first and last layers, int8 in groups of 16 for layer 1's q/k/v
OVERRIDES = [{"layers": [0, -1], "targets": ["down_proj"], "bits": 8},
             {"layers": [1], "targets": ["q_proj", "k_proj", "v_proj"], "bits": 8, "group_size": 16}]
#: (layer, module) → (bits, group size) where OVERRIDES apply; every other linear: (4, 32)
GRIDS = {(0, "mlp.down_proj"): (8, 32), (3, "mlp.down_proj"): (8, 32),
         **{(1, f"self_attn.{p}"): (8, 16) for p in ("q_proj", "k_proj", "v_proj")}}


def grid_of(layer: int, module: str) -> tuple[int, int]:
    return GRIDS.get((layer, module), (4, 32))


@pytest.mark.parametrize("overrides, model_type, export, field, message", [
    ([{"layers": [4], "bits": 8}], "llama", "compressed-tensors", "overrides.0.layers",
     r"layer 4 is out of range: the step receives 4 decoder layers"),
    ([{"layers": [-5], "bits": 8}], "llama", "compressed-tensors", "overrides.0.layers", r"layer -5 is out of range"),
    ([{"layers": [0], "targets": ["o_proj"], "bits": 8}], "llama", "compressed-tensors", "overrides.0.targets",
     r"targets \['o_proj'\] are not among the step's targets \['down_proj'\]"),
    ([{"layers": [0], "bits": 3}], "llama", "compressed-tensors", "overrides.0.bits",
     "compressed-tensors export needs bits 4 or 8 \\(got 3\\)"),
    ([{"layers": [0], "bits": 8, "group_size": 64}], "llama", "compressed-tensors", "overrides.0.group_size",
     r"group_size 64 does not divide the input width 96 of model\.layers\.0\.mlp\.down_proj"),
    ([{"layers": [0], "targets": ["q_proj"], "bits": 8}], "llama", "compressed-tensors", "overrides.0.targets",
     "q_proj without k_proj, v_proj: linears reading one input take one grid"),
    ([{"layers": [0], "bits": 8}], "llama", "gptq", "overrides", "export gptq stores one grid for every linear"),
    ([{"layers": [0], "bits": 4}, {"layers": [1], "bits": 8, "sym": False}], "llama", "compressed-tensors",
     "overrides.1.sym", "overrides need symmetric grids in compressed-tensors: transformers reads"),
    ([{"layers": [0], "targets": ["down_proj"], "bits": 8}], "qwen3_moe", "compressed-tensors",
     "overrides.0.targets", "qwen3_moe's down_proj are mixture-of-experts expert tensors"),
])
def test_each_override_mistake_is_one_line_naming_the_step_and_field(tmp_path, overrides, model_type, export,
                                                                     field, message):
    step = {"bits": 4, "group_size": 16, "export": export, "overrides": overrides}
    if field == "overrides.0.targets" and model_type == "llama" and "o_proj" in message:
        step["targets"] = ["down_proj"]
    data = recipe(tmp_path, [{"GPTQ": step}])
    with pytest.raises(RecipeError, match=message) as error:
        check_against_config(recipe_from_dict(data), tiny_config(model_type), "r.yaml")
    text = str(error.value)
    assert "GPTQ" in text and f"field '{field}'" in text and "\n" not in text, text


@pytest.mark.parametrize("entry, field", [({"layers": [0], "bits": 9}, "bits"), ({"layers": [], "bits": 8}, "layers"),
                                          ({"layers": [0], "bits": 8, "size": 2}, "size"),
                                          ({"layers": [0], "bits": 8, "targets": ["lm_head"]}, "targets")])
def test_malformed_overrides_are_refused_by_the_schema_in_one_line(tmp_path, entry, field):
    data = recipe(tmp_path, [{"Quantize": {"group_size": 32, "overrides": [entry]}}])
    with pytest.raises(RecipeError) as error:
        recipe_from_dict(data)
    text = str(error.value)
    assert "Quantize" in text and f"overrides.0.{field}" in text and "\n" not in text, text


def packed_bytes(directory) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """Bytes of every packed linear's weight tensors in the file (codes, scales, zero points; not the
    ``weight_shape`` record), and its weight shape, by module name."""
    sizes, shapes = {}, {}
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        for key in handle.keys():
            module, _, suffix = key.rpartition(".")
            if suffix.startswith("weight_"):
                tensor = handle.get_tensor(key)
                if suffix == "weight_shape":
                    shapes[module] = tuple(tensor.tolist())
                else:
                    sizes[module] = sizes.get(module, 0) + tensor.numel() * tensor.element_size()
    return sizes, shapes


def test_mixed_bits_gptq_is_written_one_group_per_grid_and_loads_in_transformers(tmp_path, caplog):
    """Each linear is quantized on its own grid (the log says which), the checkpoint has one config group per
    grid, stock transformers + compressed-tensors dequantizes every linear to the weight GPTQ left in memory
    and computes its logits, the engine reads every weight and grid back, and bits_per_weight is the bytes
    written."""
    from transformers import AutoModelForCausalLM

    step = {"GPTQ": {"bits": 4, "group_size": 32, "overrides": OVERRIDES}}
    out, report = recipe_engine.apply(recipe(tmp_path, [step]), model=tiny_model(), tokenizer=CharTokenizer(),
                                      progress=False)
    directory = tmp_path / "out"
    result = report.steps[0].result
    assert result["format"] == ("int4 symmetric, groups of 32 columns, packed (compressed-tensors); int8 for 2 "
                                "linears (overrides); int8, groups of 16 columns for 3 linears (overrides)")
    rows = read_log(directory)
    assert [(int(r["bits"]), int(r["group_size"])) for r in rows] == \
        [grid_of(int(r["layer"]), r["module"]) for r in rows]

    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"]
    assert [(name, g["targets"], g["weights"]["num_bits"], g["weights"]["group_size"])
            for name, g in groups.items()] == [
        ("group_0", [r"re:^model\.layers\.0\.mlp\.down_proj$", r"re:^model\.layers\.3\.mlp\.down_proj$"], 8, 32),
        ("group_1", [r"re:^model\.layers\.1\.self_attn\.(q_proj|k_proj|v_proj|qkv_proj)$"], 8, 16),
        ("group_2", ["Linear"], 4, 32)]
    assert "dequantize" not in config and config["ignore"] == ["lm_head"]

    sizes, shapes = packed_bytes(directory)
    assert result["bits_per_weight"] == round(8 * sum(sizes.values()) / sum(r * c for r, c in shapes.values()), 4)
    assert 4.5 < result["bits_per_weight"] < 8
    # the validation's symbolic figure (a budget's) is the same bytes, before any weight is touched
    planned = check_against_config(recipe_from_dict(recipe(tmp_path, [step])), tiny_config()).linear_bits
    assert planned == pytest.approx(8 * sum(sizes.values()) / sum(r * c for r, c in shapes.values()), rel=1e-12)

    reader = CheckpointReader(directory)
    records = reader.quantization_records()
    for layer in range(4):
        for module in LINEARS:
            name = f"model.layers.{layer}.{module}.weight"
            assert (records[name].grid.bits, records[name].grid.group_size) == grid_of(layer, module), name
            assert torch.equal(reader.read([name])[name], out.get_parameter(name)), name

    # each module takes its own group's scheme (compressed-tensors' matching) and is decompressed by the first forward
    with caplog.at_level(logging.WARNING, logger="compressed_tensors"):
        loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()]  # every pattern meets its module
    assert loaded.model.layers[1].self_attn.k_proj.quantization_scheme.weights.group_size == 16
    tokens = random_tokens(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, out(tokens).logits, rtol=1e-5, atol=1e-5)
    for name, param in out.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param), name


def test_quantize_takes_overrides_and_its_output_loads_in_transformers(tmp_path):
    """Quantize takes overrides too (here another group size as well); the weights come back bit for bit."""
    from transformers import AutoModelForCausalLM

    step = {"Quantize": {"bits": 4, "group_size": 32,
                         "overrides": [{"layers": [2], "targets": ["o_proj"], "bits": 8, "group_size": 16}]}}
    out, report = recipe_engine.apply(recipe(tmp_path, [step]), model=tiny_model(), tokenizer=CharTokenizer(),
                                      progress=False)
    directory = tmp_path / "out"
    assert report.steps[0].result["format"].endswith("; int8, groups of 16 columns for 1 linears (overrides)")
    rows = read_log(directory)
    assert [(r["layer"], r["module"], r["group_size"]) for r in rows if r["bits"] == "8"] == \
        [("2", "self_attn.o_proj", "16")]
    sizes, shapes = packed_bytes(directory)
    assert report.steps[0].result["bits_per_weight"] == \
        round(8 * sum(sizes.values()) / sum(r * c for r, c in shapes.values()), 4)
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = random_tokens(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, out(tokens).logits, rtol=1e-5, atol=1e-5)
    for name, param in out.named_parameters():  # decompressed by the first forward
        assert torch.equal(loaded.get_parameter(name), param), name


def test_without_overrides_one_group_and_the_grid_bits_per_weight(tmp_path):
    """No overrides: one config group targeting Linear, as before; int4 in groups of 32 with fp32 scales is
    4 + 32/32 bits per weight (each linear's 16-byte weight_shape records its shape, not its weight)."""
    out, report = recipe_engine.apply(recipe(tmp_path, ["Quantize<group_size:32>"]), model=tiny_model(),
                                      tokenizer=CharTokenizer(), progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert list(config["config_groups"]) == ["group_0"] and config["config_groups"]["group_0"]["targets"] == ["Linear"]
    result = report.steps[0].result
    assert result["format"] == "int4 symmetric, groups of 32 columns, packed (compressed-tensors)"
    shapes = [tuple(out.get_submodule(f"model.layers.{i}.{m}").weight.shape) for i in range(4) for m in LINEARS]
    weights = sum(r * c for r, c in shapes)
    assert result["bits_per_weight"] == sum(4 * r * c + 32 * r * (c // 32) for r, c in shapes) / weights == 5.0


def test_a_mixed_checkpoint_is_carried_byte_for_byte_and_refused_by_the_int4_bench(tmp_path):
    """A later recipe that only drops a layer writes the mixed checkpoint's linears packed again, each on its own
    grid (read back by matching the config groups), every tensor byte for byte the source's; ``recipe bench``'s
    int4 kernel refuses the int8 group in one line."""
    from recipe_engine.evaluation.bench import check_packed
    from tests.test_exporters import source_name, stored
    from tests.test_gguf_export import saved

    _, model = saved(tmp_path)  # with a tokenizer: a later recipe loads it from the output
    step = {"Quantize": {"bits": 4, "group_size": 32, "overrides": OVERRIDES}}
    recipe_engine.apply({**recipe(tmp_path, [step]), "model": str(model)}, progress=False)
    source = tmp_path / "out"
    later = {**recipe(tmp_path, ["ShortGPT<n:1>"]), "model": str(source), "output": str(tmp_path / "later")}
    recipe_engine.apply(later, progress=False)
    report = recipe_engine.load_report(tmp_path / "later")
    assert report.notes == []
    original, written = stored(source), stored(tmp_path / "later")
    assert all(torch.equal(t, original[source_name(k, report.after.layer_origin)]) for k, t in written.items())
    before, after = CheckpointReader(source).quantization_records(), CheckpointReader(tmp_path / "later")
    for name, record in after.quantization_records().items():
        assert record.grid == before[source_name(name, report.after.layer_origin)].grid, name
    config = json.loads((source / "config.json").read_text())["quantization_config"]
    with pytest.raises(SourceError, match="config group group_0 is not int4 weight-only in groups") as error:
        check_packed("mixed", config, torch.device("cpu"), "float32", str(source))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype,dense_bits", [("float32", 32), ("bfloat16", 16)])
def test_the_symbolic_bits_count_unquantized_linears_in_the_model_dtype_and_bound_a_budget(tmp_path, dtype,
                                                                                            dense_bits):
    """GPTQ on the MLP only: its linears at their grid's written bits (a bfloat16 run's scales in bfloat16),
    attention's in the recipe's dtype, as the file holds them; a BestOf bits budget refuses what is over it
    with the figure."""
    step = {"GPTQ": {"bits": 4, "group_size": 32, "targets": ["gate_proj", "up_proj", "down_proj"]}}
    model = tiny_model().to(getattr(torch, dtype))  # an in-memory model runs in its own dtype
    recipe_engine.apply(recipe(tmp_path, [step], dtype=dtype), model=model, tokenizer=CharTokenizer(), progress=False)
    sizes, shapes = packed_bytes(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        dense = {k: handle.get_slice(k).get_shape() for k in handle.keys()
                 if k.startswith("model.layers.") and k.endswith("_proj.weight")}
        assert {handle.get_slice(k).get_dtype() for k in dense} == {"F32" if dense_bits == 32 else "BF16"}
    written = 8 * sum(sizes.values()) + dense_bits * sum(r * c for r, c in dense.values())
    weights = sum(r * c for r, c in shapes.values()) + sum(r * c for r, c in dense.values())
    planned = check_against_config(recipe_from_dict(recipe(tmp_path, [step], dtype=dtype)), tiny_config()).linear_bits
    assert planned == pytest.approx(written / weights, rel=1e-12)
    budget = [{"BestOf": {"budget": {"bits_per_weight": 8}, "alternatives": [["GPTQ<bits:8,group_size:32>"],
                                                                            ["GPTQ<bits:4,group_size:32>"]]}}]
    shape = check_against_config(recipe_from_dict(recipe(tmp_path, budget)), tiny_config())
    assert any("skips alternative 0" in note and "bits per weight > 8" in note for note in shape.notes)
    alone = check_against_config(recipe_from_dict(recipe(tmp_path, ["GPTQ<bits:4,group_size:32>"])), tiny_config())
    assert shape.linear_bits == alone.linear_bits < 8  # the kept alternative's figure


def test_overrides_from_a_log_promote_the_largest_errors_within_the_budget(tmp_path):
    """benchmarks/mixed_bits_from_log.py on a log of 2 layers: units by error, largest first, each promoted to
    W8 while the average written bits (codes, fp32 scales per group of 32) stays within
    the budget, recounted here from the layout."""
    import csv
    import subprocess
    import sys

    import yaml

    sizes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
             "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
    errors = {(0, "down_proj"): 0.9, (1, "o_proj"): 0.8, (0, "gate_proj"): 0.7, (1, "q_proj"): 0.1}
    block = {m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn" for m in sizes}
    rows = [{"step": "0 GPTQ", "layer": layer, "module": f"{block[m]}.{m}", "method": "gptq", "rows": r,
             "columns": c, "bits": 4, "group_size": 32, "sym": True, "error": errors.get((layer, m), 0.01)}
            for layer in range(2) for m, (r, c) in sizes.items()]
    with open(tmp_path / "log.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def written(bits, r, c):
        return r * c * bits + r * (c // 32) * 32

    weights = sum(r * c for r, c in sizes.values()) * 2
    base = 2 * sum(written(4, r, c) for r, c in sizes.values())
    budget = (base + written(8, 64, 96) - written(4, 64, 96) + written(8, 64, 64) - written(4, 64, 64)) / weights
    done = subprocess.run([sys.executable, "-m", "benchmarks.mixed_bits_from_log", str(tmp_path / "log.csv"),
                           "--budget", str(budget + 1e-9)], capture_output=True, text=True, check=True)
    overrides = yaml.safe_load(done.stdout)["overrides"]
    # down_proj of layer 0 (0.9) and o_proj of layer 1 (0.8) fit; gate/up of layer 0 (0.7) would not
    assert overrides == [{"layers": [0], "targets": ["down_proj"], "bits": 8},
                         {"layers": [1], "targets": ["o_proj"], "bits": 8}]
    assert f"{budget:.4f} bits per weight" in done.stderr
