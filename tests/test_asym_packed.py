"""Asymmetric packed outputs (``sym: false``, the compressed-tensors default export): GPTQ and Quantize at 4 and 8
bits, in groups and one group per row, load with stock ``transformers.AutoModelForCausalLM.from_pretrained`` (in a
child process that never imports the engine) to the very weights, and logits, of the same recipe written with
``export: dequantized``; the engine's ``load_model`` reads them back bit for bit. The zero points stay what
compressed-tensors' compressor writes and vLLM reads (packed along rows); the ``quantization_config``'s
``dequantize: true`` is what lets transformers load them (``recipe_engine/formats/compressed_tensors.py``)."""
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import recipe_engine
from recipe_engine.formats import checkpoint_exporter
from recipe_engine.sources.models import load_model
from recipe_engine.numerics.quantization import Grid

CASES = [(method, bits, group) for method in ("GPTQ", "Quantize") for bits in (4, 8) for group in (32, None)]
IDS = [f"{method}-w{bits}-{'g' + str(group) if group else 'channel'}" for method, bits, group in CASES]

#: Run by a fresh interpreter: loads each (packed, dequantized) pair with stock transformers, and the packed one
#: once more without the ``dequantize`` hint; prints one JSON line.
LOADER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

def logits_and_weights(path, **options):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits, model.state_dict()

pairs, unhinted = json.loads(sys.argv[1])
results = {}
for case, (packed, plain) in pairs.items():
    got, weights = logits_and_weights(packed)
    want, reference = logits_and_weights(plain)
    results[case] = {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max()),
                     "same_weights": sorted(weights) == sorted(reference)
                     and all(torch.equal(weights[k], reference[k]) for k in reference)}
try:
    logits_and_weights(unhinted)
    results["unhinted"] = None
except Exception as error:
    results["unhinted"] = f"{type(error).__name__}: {error}"
results["engine_imported"] = any(name.split(".")[0] == "recipe_engine" for name in sys.modules)
print(json.dumps(results))
"""


def step(method: str, bits: int, group: int | None, export: str | None = None) -> str:
    params = [f"bits:{bits}", "sym:false", f"group_size:{group if group else 'null'}"]
    return f"{method}<{','.join(params + ([f'export:{export}'] if export else []))}>"


def recipe(root, model, steps, output):
    return dict(version=1, name="asym-packed", model=str(model), device="cpu", output=str(root / output),
                calibration=dict(dataset=str(root / "calibration.txt"), samples=4, seq_len=32, batch_size=2),
                modifiers=steps)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, model_dir):
    """Every case written packed and dequantized, and what stock transformers made of them (one child process)."""
    root = tmp_path_factory.mktemp("asym")
    (root / "calibration.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    pairs = {}
    for case, (method, bits, group) in zip(IDS, CASES):
        recipe_engine.apply(recipe(root, model_dir, [step(method, bits, group)], case), progress=False)
        recipe_engine.apply(recipe(root, model_dir, [step(method, bits, group, "dequantized")], case + "-plain"),
                            progress=False)
        pairs[case] = [str(root / case), str(root / (case + "-plain"))]
    unhinted = root / "unhinted"  # the first case without the hint: transformers' default route
    unhinted.mkdir()
    for file in (root / IDS[0]).iterdir():
        (unhinted / file.name).write_bytes(file.read_bytes())
    config = json.loads((unhinted / "config.json").read_text())
    del config["quantization_config"]["dequantize"]
    (unhinted / "config.json").write_text(json.dumps(config))
    child = subprocess.run([sys.executable, "-c", LOADER, json.dumps([pairs, str(unhinted)])],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return root, json.loads(child.stdout.strip().splitlines()[-1])


def test_stock_loading_never_imports_the_engine(outputs):
    assert outputs[1]["engine_imported"] is False


@pytest.mark.parametrize("case", IDS)
def test_stock_transformers_loads_the_dequantized_exports_weights_and_logits(outputs, case):
    result = outputs[1][case]
    print(f"{case}: max |logits - dequantized export's| = {result['max_abs']:.3g} (max |logit| {result['scale']:.3g})")
    assert result["same_weights"]
    assert result["max_abs"] <= 1e-5 * result["scale"]


@pytest.mark.parametrize("case, grid", list(zip(IDS, CASES)), ids=IDS)
def test_the_zero_points_are_what_compressed_tensors_writes_and_the_engine_reads_them(outputs, case, grid):
    """int32 ``[ceil(rows · b / 32), groups]`` (vLLM's ``weight_zero_point``); the engine reads the packed output
    to the dequantized one's weights bit for bit."""
    root, _ = outputs
    _, bits, group = grid
    config = json.loads((root / case / "config.json").read_text())["quantization_config"]
    assert config["dequantize"] is True and config["config_groups"]["group_0"]["weights"]["symmetric"] is False
    with safe_open(str(root / case / "model.safetensors"), "pt") as f:
        zero = f.get_tensor("model.layers.0.mlp.gate_proj.weight_zero_point")
        rows, columns = f.get_tensor("model.layers.0.mlp.gate_proj.weight_shape").tolist()
    assert zero.dtype == torch.int32
    assert tuple(zero.shape) == (math.ceil(rows * bits / 32), columns // (group or columns))
    packed, _, _ = load_model(str(root / case))
    plain, _, _ = load_model(str(root / (case + "-plain")))
    for name, tensor in plain.state_dict().items():
        assert torch.equal(packed.state_dict()[name], tensor), name


def test_without_the_hint_transformers_default_route_refuses_the_packed_zero_points(outputs):
    """Why the hint is there: transformers' default route builds ``weight_zero_point`` unpacked (``[rows, groups]``)
    and refuses compressed-tensors' packed one. When this fails, that route reads them: the hint may go."""
    refusal = outputs[1]["unhinted"]
    assert refusal is not None and "mismatch" in refusal, refusal


def test_a_symmetric_grids_config_is_unchanged():
    exporter = checkpoint_exporter("compressed-tensors")
    assert "dequantize" not in exporter.quantization_config({"a": Grid(4, 32, True, torch.float32)}, ["lm_head"])
    assert exporter.quantization_config({"a": Grid(8, None, False, torch.float32)}, [])["dequantize"] is True
