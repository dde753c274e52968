"""Quantizing mixture-of-experts layers (tiny random Qwen3-MoE, Mixtral, gpt-oss, Qwen2-MoE; 4 experts, top-2):
GPTQ and Quantize cover every expert's gate/up and down slices (the router stays as it was), streamed runs write
the in-memory run's bytes, outputs reload with stock ``from_pretrained`` and the engine's logits; an expert's
Hessians equal ``XᵀX`` computed by hand from the MoE block's inputs; an expert no token reaches under
``experts: routed`` is rounded to nearest and said so in the log and the report; packed export of gpt-oss's
fused experts is refused in one line (the other families' packed experts: ``test_moe_export.py``)."""
import csv
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.cli import main
from tests.helpers import BYTE_VOCAB, random_tokens, save_tiny_model, tiny_model
from tests.test_moe import recipe

GPTQ = "GPTQ<group_size:16,export:dequantized,{extra}>"


def log_rows(out):
    with open(out / "quantization_log.csv") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_gptq_on_every_expert_streamed_equals_in_memory_and_reloads_stock(tmp_path, model_type):
    model = save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=2)
    step = GPTQ.format(extra="experts:all")
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    layout = adapter_for(model.config).experts
    for index, layer in enumerate(result.model.layers):
        before = model.model.layers[index]
        for tensor in ("gate_up_proj", "down_proj"):
            assert not torch.equal(getattr(layout.experts(layer), tensor), getattr(layout.experts(before), tensor))
        router = layer.get_submodule(layout.router)
        assert torch.equal(router.weight, before.get_submodule(layout.router).weight)  # never quantized
    rows = log_rows(tmp_path / "out")
    experts = [r for r in rows if "experts." in r["module"]]
    assert len(experts) == 2 * 4 * 2 and {r["method"] for r in experts} == {"gptq"}
    assert {int(r["hessian_tokens"]) for r in experts} == {4 * 32}  # every expert saw every token
    assert sum(float(r["error"]) for r in experts) < sum(float(r["error_rtn"]) for r in experts)
    assert report.steps[0].result["experts"]["fallback"]["count"] == 0
    assert report.steps[0].result["headline"] == "16 of 16 expert tensors by GPTQ (all calibration)"
    tokens = random_tokens(vocab=BYTE_VOCAB)
    with torch.no_grad():
        expected = result(tokens).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step], "on", "streamed"), progress=False)
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "streamed/model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def reference_hidden(model_type, experts, index, x):
    """``act(gate x) ⊙ up x`` of one expert, written from the transformers models' formulas."""
    if model_type == "gpt_oss":
        gate_up = x @ experts.gate_up_proj[index] + experts.gate_up_proj_bias[index]
        gate, up = gate_up[:, ::2].clamp(max=experts.limit), gate_up[:, 1::2].clamp(-experts.limit, experts.limit)
        return (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
    gate, up = (x @ experts.gate_up_proj[index].T).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("mode", ["all", "routed"])
def test_expert_hessians_equal_xtx_of_the_block_inputs(model_type, mode):
    from recipe_engine.modifiers._experts import MoEInputs, expert_gram, expert_grams

    model = tiny_model(model_type, num_hidden_layers=1)
    layout = adapter_for(model.config).experts
    layer = model.model.layers[0]
    seen = []
    handle = layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    captured = MoEInputs("mlp", layout, layer, torch.device("cpu"))
    layer.mlp.register_forward_pre_hook(lambda _m, args: captured.update(args[0], None))
    with torch.no_grad():
        model(random_tokens(batch=3, length=16))
    handle.remove()
    x = torch.cat(seen).double()
    router = layer.get_submodule(layout.router)
    logits = x @ router.weight.double().T + (router.bias.double() if getattr(router, "bias", None) is not None else 0)
    picks = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(router.top_k, dim=-1).indices, True)
    experts = layout.experts(layer)
    for index in range(4):
        rows = picks[:, index] if mode == "routed" else torch.ones(len(x), dtype=torch.bool)
        xe = x[rows]
        gate_up = expert_gram(captured, index, "gate_up_proj", mode == "routed", torch.device("cpu"))
        assert gate_up.count == len(xe)
        torch.testing.assert_close(gate_up.gram, xe.T @ xe, rtol=1e-5, atol=1e-4)
        with torch.no_grad():
            h = reference_hidden(model_type, experts, index, xe.float()).double()
        down = expert_gram(captured, index, "down_proj", mode == "routed", torch.device("cpu"))
        assert down.count == len(xe)
        torch.testing.assert_close(down.gram, h.T @ h, rtol=1e-5, atol=1e-4)
    # several experts per pass over the batches (one batched h): each Gram the one taken alone, bit for bit
    together = expert_grams(captured, [1, 2, 3], "down_proj", mode == "routed", torch.device("cpu"))
    for index, gram in zip([1, 2, 3], together):
        alone = expert_gram(captured, index, "down_proj", mode == "routed", torch.device("cpu"))
        assert gram.count == alone.count and torch.equal(gram.gram, alone.gram)


def test_an_unrouted_expert_falls_back_to_rtn_and_says_so(tmp_path):
    """gpt-oss's router bias of expert 3 is forced to -1e4: under ``experts: routed`` no token reaches it. The
    run finishes, expert 3 is rounded to nearest on the same grid, and the log and the report name it."""
    from safetensors.torch import load_file, save_file

    from recipe_engine.modifiers._quant import rtn
    from recipe_engine.numerics.quantization import Grid

    save_tiny_model(tmp_path / "model", "gpt_oss", num_hidden_layers=2)
    path = tmp_path / "model/model.safetensors"
    tensors = load_file(path)
    biases = [name for name in tensors if name.endswith("mlp.router.bias")]
    assert len(biases) == 2
    for name in biases:
        tensors[name][3] = -1e4
    save_file(tensors, path, metadata={"format": "pt"})
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    step = GPTQ.format(extra="experts:routed,min_expert_tokens:1")
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    rows = log_rows(tmp_path / "out")
    fallback = [(r["layer"], r["module"]) for r in rows if r["method"] == "rtn-fallback"]
    assert {(str(i), f"mlp.experts.{t}[3]") for i in range(2) for t in ("gate_up_proj", "down_proj")} <= set(fallback)
    assert all(r["hessian_tokens"] == "0" for r in rows if r["method"] == "rtn-fallback")  # min_expert_tokens 1
    assert all(int(r["hessian_tokens"]) > 0 for r in rows if r["method"] == "gptq")
    info = report.steps[0].result["experts"]["fallback"]
    assert info["count"] == len(fallback) and info["method"].startswith("round-to-nearest")
    assert "model.layers.1.mlp.experts.down_proj[3]" in info["tensors"]
    # said under the summary table and in the model card, not only in the log and report.json
    total = report.steps[0].result["experts"]["quantized"]
    assert total == 2 * 4 * 2
    headline = (f"{total - len(fallback)} of {total} expert tensors by GPTQ (routed calibration); "
                f"{len(fallback)} rounded")
    assert report.steps[0].result["headline"].startswith(headline)
    assert "fewer than 1 routed tokens" in report.steps[0].result["headline"]
    assert f"step 0 GPTQ: {headline}" in (tmp_path / "out/README.md").read_text()
    saved = json.loads((tmp_path / "out/report.json").read_text())
    assert "mlp.experts.gate_up_proj[3]" in json.dumps(saved)
    layout = adapter_for(original.config).experts
    for index, layer in enumerate(result.model.layers):
        for tensor in ("gate_up_proj", "down_proj"):
            weight = layout.weight(original.model.layers[index], 3, tensor)
            expected = rtn(weight, Grid(4, 16, True, weight.dtype)).dequantized.to(weight.dtype)
            torch.testing.assert_close(layout.weight(layer, 3, tensor), expected, rtol=0, atol=0)


def test_packed_export_of_fused_experts_is_refused_in_one_line(tmp_path, capsys):
    import yaml

    save_tiny_model(tmp_path / "model", "gpt_oss", num_hidden_layers=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, tmp_path / "model", ["GPTQ<group_size:16>"])))
    capsys.readouterr()
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot store gpt_oss's experts" in err[0] and "field 'export'" in err[0]


def test_quantize_rounds_every_expert_and_the_shared_expert(tmp_path):
    """Quantize on Qwen2-MoE: every routed expert's slices and the shared expert's linears equal round-to-nearest
    of the originals (the router and the shared expert's gate untouched); one log row per expert tensor."""
    from recipe_engine.modifiers._quant import rtn
    from recipe_engine.numerics.quantization import Grid

    original = save_tiny_model(tmp_path / "model", "qwen2_moe", num_hidden_layers=2)
    step = "Quantize<group_size:16,export:dequantized>"
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    layout = adapter_for(original.config).experts
    for index, layer in enumerate(result.model.layers):
        before = original.model.layers[index]
        assert layout.units(layer) == 5
        for unit in range(5):
            for tensor in ("gate_up_proj", "down_proj"):
                weight = layout.weight(before, unit, tensor).detach()
                expected = rtn(weight, Grid(4, 16, True, weight.dtype)).dequantized.to(weight.dtype)
                torch.testing.assert_close(layout.weight(layer, unit, tensor), expected, rtol=0, atol=0)
        assert torch.equal(layer.mlp.gate.weight, before.mlp.gate.weight)
        assert torch.equal(layer.mlp.shared_expert_gate.weight, before.mlp.shared_expert_gate.weight)
    rows = [r for r in log_rows(tmp_path / "out") if "expert" in r["module"]]
    assert len(rows) == 2 * 5 * 2 and {r["method"] for r in rows} == {"rtn"}
    assert report.steps[0].result["quantized_linears"] == 2 * (4 + 10)
    tokens = random_tokens(vocab=BYTE_VOCAB)
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(reloaded(tokens).logits, result(tokens).logits, rtol=1e-5, atol=1e-5)


def test_gptq_covers_the_shared_expert(tmp_path):
    original = save_tiny_model(tmp_path / "model", "qwen2_moe", num_hidden_layers=2)
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [GPTQ.format(extra="experts:all")]),
                                         progress=False)
    rows = {(r["layer"], r["module"]): r for r in log_rows(tmp_path / "out")}
    for layer in range(2):
        for name in ("mlp.shared_expert.gate_proj+up_proj", "mlp.shared_expert.down_proj"):
            assert rows[str(layer), name]["method"] == "gptq" and rows[str(layer), name]["hessian_tokens"] == "128"
        assert not torch.equal(result.model.layers[layer].mlp.shared_expert.down_proj.weight,
                               original.model.layers[layer].mlp.shared_expert.down_proj.weight)
    assert report.steps[0].result["experts"]["quantized"] == 2 * 5 * 2


@pytest.mark.parametrize("model_type,extra,accelerator", [
    ("qwen3_moe", "experts:all", False), ("qwen3_moe", "experts:all", True),
    ("qwen2_moe", "experts:all,act_order:false", False),
    ("gpt_oss", "experts:routed,min_expert_tokens:40", False)])
def test_experts_batched_equal_one_expert_at_a_time(tmp_path, monkeypatch, model_type, extra, accelerator):
    """The batched path (several experts' down_proj Grams per pass over the batches, one GPTQ call and one error
    evaluation per batch of experts with their own Hessians; batched on CPU as on a GPU here, or with the
    accelerator's batch sizes: ``accelerator``) writes the weights and log of the one-at-a-time path (memory
    budgets of one byte and one row: one expert per pass, per call and per stack) bit for bit; ``seconds`` is
    the call's time shared by its experts (the fallbacks of ``routed`` and the shared expert included)."""
    from recipe_engine.modifiers import _experts

    save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=2)
    step = GPTQ.format(extra=extra)
    monkeypatch.setattr(_experts, "CPU_SOLVE_BYTES", _experts.SOLVE_BYTES)  # batched here as on a GPU
    if accelerator:
        monkeypatch.setattr(_experts, "on_accelerator", lambda device: True)
    batched, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step], name="batched"), progress=False)
    monkeypatch.setattr(_experts, "on_accelerator", lambda device: False)
    for budget in ("SOLVE_BYTES", "CPU_SOLVE_BYTES", "HIDDEN_BYTES", "STACK_ROWS"):
        monkeypatch.setattr(_experts, budget, 1)
    alone, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step], name="alone"), progress=False)
    expected = alone.model.state_dict()
    for key, value in batched.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    rows, reference = log_rows(tmp_path / "batched"), log_rows(tmp_path / "alone")
    assert [{**r, "seconds": None} for r in rows] == [{**r, "seconds": None} for r in reference]
    down = [r for r in rows if r["layer"] == "0" and r["module"].startswith("mlp.experts.down_proj")
            and r["method"] == "gptq"]
    assert len(down) >= 2 and len({r["seconds"] for r in down}) == 1  # one call
    if "routed" in extra:
        assert any(r["method"] == "rtn-fallback" for r in rows)


def test_gptq_layer_reads_the_host_once_per_factorization_and_once_for_its_log(tmp_path, monkeypatch):
    """A GPTQ layer reads values on the host only to check each factorization and once to settle its log rows,
    whatever the number of experts, stacks and calls (on a GPU the host then queues the whole layer's solves
    without waiting); the Hessian every expert's gate/up shares is factored once per layer, not per stack."""
    from recipe_engine.modifiers import _experts, gptq

    from benchmarks.diagnosis.gptq_host_work import HostReads  # what it counts

    save_tiny_model(tmp_path / "model", "qwen3_moe", num_hidden_layers=2)
    monkeypatch.setattr(_experts, "STACK_ROWS", 1)  # a stack per expert: 4 gate/up stacks per layer
    factorizations, reads, layers = [], HostReads(), []
    factor = gptq.inverse_hessian_factor
    monkeypatch.setattr(gptq, "inverse_hessian_factor",
                        lambda h, damp: factorizations.append(h.shape[0]) or factor(h, damp))
    compress = gptq.GPTQ.compress_layer

    def counted(self, session, index, stats):
        before = len(factorizations), sum(reads.counts.values())
        with reads:
            entry = compress(self, session, index, stats)
        layers.append((len(factorizations) - before[0], sum(reads.counts.values()) - before[1]))
        return entry

    monkeypatch.setattr(gptq.GPTQ, "compress_layer", counted)
    recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [GPTQ.format(extra="experts:all")]), progress=False)
    rows = log_rows(tmp_path / "out")
    gate_up = [r for r in rows if r["layer"] == "0" and r["module"].startswith("mlp.experts.gate_up_proj")]
    assert len(gate_up) == 4 and len({r["seconds"] for r in gate_up}) == 4  # four stacks: four calls
    # q/k/v, o_proj, the shared gate/up Hessian once, each expert's down_proj (one per call on CPU)
    assert layers == [(2 + 1 + 4, 2 + 1 + 4 + 1)] * 2
    assert all(isinstance(float(r["error"]), float) and float(r["seconds"]) >= 0 for r in rows)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama"])
def test_the_plan_counts_the_block_programs_a_gpu_keeps(tmp_path, monkeypatch, model_type):
    """On a GPU a GPTQ run keeps one block program (its static buffers) per sweep shape for the whole run; here
    the sweeps go through the same buffers on CPU with the GPU's batch sizes, and the buffers the run kept are
    at most ``recipe plan``'s ``kept_programs_bytes`` for the shape, and at least half of it (it counts two
    shapes where a stack or batch may have one)."""
    from recipe_engine.architectures.shape import ModelShape
    from recipe_engine.modifiers import _experts, gptq
    from recipe_engine.recipe.schema import parse_step

    model = save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=2)
    monkeypatch.setattr(_experts, "on_accelerator", lambda device: True)
    sweep, kept = gptq.gptq_quantize_batch, []
    monkeypatch.setattr(gptq, "gptq_quantize_batch", lambda *a, **k: sweep(*a[:6], True, *a[7:], **k))
    get = gptq.BlockPrograms.get
    monkeypatch.setattr(gptq.BlockPrograms, "get", lambda self, *a: kept.append(self) or get(self, *a))
    step = GPTQ.format(extra="experts:all") if model_type == "qwen3_moe" else "GPTQ<group_size:16,export:dequantized>"
    recipe_engine.apply(recipe(tmp_path, tmp_path / "model", [step]), progress=False)
    assert len({id(programs) for programs in kept}) == 1  # one set for the run
    measured = sum(t.numel() * t.element_size() for program in kept[0].programs.values()
                   for t in (program.w1, program.hb, program.q_out, program.err, program.column_scale,
                             program.column_zero, program.group_scale, program.group_zero) if t is not None)
    shape = ModelShape.from_config(model.config)
    shape.on_device = True
    planned = parse_step(step, 0).kept_programs_bytes(shape)
    assert measured <= planned <= 2 * measured
