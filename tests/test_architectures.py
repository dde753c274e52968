"""Role-map adapters on Qwen3, Gemma 3 text and Phi-3 (tiny random configs), each against an independent
reference: HF's own forward and loss, HF with layers removed, and for Phi-3 the same model written as Llama
(fused q/k/v and gate/up split into separate linears: identical logits, so every step must give the same
result on both)."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.modifiers.flatten_adjacent import FlattenAdjacent, head_norm_spread, merge_layers
from recipe_engine.modifiers.gptq import GPTQ
from recipe_engine.architectures.adapters import ADAPTERS, adapter_for
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session
from recipe_engine.architectures.shape import ModelShape
from tests.helpers import ARCHITECTURES, CharTokenizer, hf_model_with_layers, random_tokens, tiny_config, tiny_model

NEW = ("qwen3", "gemma3_text", "phi3")
TEXT = "Calibration text for the architecture tests, repeated to have enough tokens. " * 300


def recipe(tmp_path, steps, samples=4):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data_file = tmp_path / "cal.txt"
    data_file.write_text(TEXT)
    return {"version": 1, "name": "arch", "model": "tiny", "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(data_file), "samples": samples, "seq_len": 32, "batch_size": 2},
            "modifiers": steps}


def run(tmp_path, model, steps):
    return recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=CharTokenizer(), progress=False)


def phi3_as_llama(phi):
    """The Llama model that computes exactly what ``phi`` (a tiny Phi-3) computes: fused rows split."""
    llama = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=phi.config.num_hidden_layers))
    adapter, state = ADAPTERS["phi3"], {}
    head_dim = phi.config.head_dim
    for index, layer in enumerate(phi.model.layers):
        for role in ("qkv_proj", "gate_up_proj"):
            for member, (weight, _) in adapter.member_parts(layer, role, head_dim).items():
                block = "self_attn" if role == "qkv_proj" else "mlp"
                state[f"model.layers.{index}.{block}.{member}.weight"] = weight.detach()
    state.update({k: v for k, v in phi.state_dict().items() if "qkv_proj" not in k and "gate_up_proj" not in k})
    llama.load_state_dict(state)
    return llama.eval()


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_layer_sequential_nll_equals_hf_loss(model_type):
    """The session's layer-by-layer run (inputs captured once, per-layer-type masks and rotary embeddings
    for Gemma 3's sliding/global layers) gives HF's own loss."""
    model = tiny_model(model_type, num_hidden_layers=6)
    tokens = random_tokens(4, 32)
    config = CalibrationConfig(samples=4, seq_len=32, batch_size=2)
    session = Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")), model, tokens).view
    with torch.no_grad():
        expected = sum(float(model(b, labels=b).loss) for b in tokens.split(2)) / 2
    assert session.calibration_nll() == pytest.approx(expected, rel=1e-5)


def test_gemma3_sliding_layers_get_their_own_kwargs():
    """Without the per-type kwargs every layer would get layer 0's sliding mask: the loss would differ."""
    model = tiny_model("gemma3_text", num_hidden_layers=3)
    tokens = random_tokens(2, 32)
    session = Session(RunContext(None, adapter_for(model.config),
                                 CalibrationConfig(samples=2, seq_len=32, batch_size=2), torch.device("cpu")),
                      model, tokens).view
    kwargs = session.capture_inputs().kwargs[0]
    by_type = kwargs["_recipe_layer_type_kwargs"]
    assert set(by_type) == {"sliding_attention", "full_attention"}
    sliding, full = by_type["sliding_attention"], by_type["full_attention"]
    assert sliding["attention_mask"] is not None  # a window of 8 over 32 tokens: never the plain causal mask
    assert not torch.equal(sliding["position_embeddings"][0], full["position_embeddings"][0])  # rope bases


@pytest.mark.parametrize("model_type", NEW)
def test_fuse_norm_keeps_logits(tmp_path, model_type):
    model = tiny_model(model_type)
    tokens = random_tokens()
    with torch.no_grad():
        expected = model(tokens).logits
    result, _ = run(tmp_path, model, ["FuseNorm<untie:true>"])
    adapter = adapter_for(result.config)
    for layer in result.model.layers:
        for norm, _ in adapter.norm_reads:
            torch.testing.assert_close(adapter.norm_gain(adapter.norm(layer, norm)), torch.ones(64))
    with torch.no_grad():
        torch.testing.assert_close(result(tokens).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", NEW)
def test_shortgpt_equals_hf_with_those_layers_removed(tmp_path, model_type):
    model = tiny_model(model_type, num_hidden_layers=6)
    original = copy.deepcopy(model)
    result, report = run(tmp_path, model, ["ShortGPT<n:2>"])
    removed = [origin[0] for origin in report.steps[0].result["removed"]]
    kept = [i for i in range(6) if i not in removed]
    reference = hf_model_with_layers(original, kept)
    tokens = random_tokens()
    with torch.no_grad():
        torch.testing.assert_close(result(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def _phi3_weights_as_llama(phi):
    return phi3_as_llama(phi).state_dict()


@pytest.mark.parametrize("steps", [["GPTQ<group_size:32>"], ["GPTQ<group_size:32,sequential:false>"],
                                   ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]])
def test_phi3_steps_equal_the_same_steps_on_its_llama_form(tmp_path, steps):
    """Fused qkv/gate_up: quantizing the fused rows, merging member by member and pruning member rows
    gives exactly what the unfused (Llama) form gives."""
    phi = tiny_model("phi3", num_hidden_layers=6)
    llama = phi3_as_llama(phi)
    phi_out, _ = run(tmp_path / "phi", phi, steps)
    llama_out, _ = run(tmp_path / "llama", llama, steps)
    expected = llama_out.state_dict()
    for name, value in _phi3_weights_as_llama(phi_out).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    tokens = random_tokens()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "phi" / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, llama_out(tokens).logits, rtol=1e-4, atol=1e-4)


def parallel_layer(layers, x, position_embeddings, mask):
    """h = x + Σ_j Attn_j(norm_j(x)); out = h + Σ_j MLP_j(norm'_j(h)), with the original layers."""
    h = x + sum(layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings,
                                attention_mask=mask)[0] for layer in layers)
    return h + sum(layer.mlp(layer.post_attention_layernorm(h)) for layer in layers)


@pytest.mark.parametrize("shared_head_norms", [True, False])
def test_qwen3_merge_is_the_parallel_sum_when_head_norm_gains_agree(shared_head_norms):
    """Qwen3's per-head q/k norm gain is one per layer: the merge is exact when the sources agree, and
    otherwise the reported spread is positive and the output differs."""
    model = tiny_model("qwen3", attn_implementation="eager")
    layers = [model.model.layers[i] for i in range(2)]
    if shared_head_norms:
        with torch.no_grad():
            for norm in ("q_norm", "k_norm"):
                getattr(layers[1].self_attn, norm).weight.copy_(getattr(layers[0].self_attn, norm).weight)
    originals = [copy.deepcopy(layer) for layer in layers]
    adapter = adapter_for(model.config)
    merged = merge_layers(layers, adapter)
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    position_embeddings = model.model.rotary_emb(x, torch.arange(10)[None].expand(2, -1))
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        got = merged(x, position_embeddings=position_embeddings, attention_mask=mask)
        expected = parallel_layer(originals, x, position_embeddings, mask)
    spread = head_norm_spread(originals, adapter)
    if shared_head_norms:
        assert spread == 0.0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert spread > 0.1
        assert (got - expected).norm() / (expected - x).norm() > 1e-3


def test_flatten_is_refused_on_gemma3_at_validation():
    shape = ModelShape.from_config(tiny_config("gemma3_text"))
    with pytest.raises(RecipeError, match="post-attention/post-feedforward norms") as caught:
        FlattenAdjacent(n=1).check(shape)
    assert "\n" not in str(caught.value)


def test_phi3_partial_fused_target_is_refused_at_validation():
    shape = ModelShape.from_config(tiny_config("phi3"))
    with pytest.raises(RecipeError, match="phi3 fuses q_proj, k_proj, v_proj into qkv_proj"):
        GPTQ(group_size=32, targets=["q_proj", "o_proj"]).check(shape)
    GPTQ(group_size=32, targets=["q_proj", "k_proj", "v_proj"]).check(ModelShape.from_config(tiny_config("phi3")))


def test_legacy_target_paths_name_the_same_roles():
    assert GPTQ(targets=["self_attn.q_proj", "mlp.down_proj"]).targets == ["q_proj", "down_proj"]


@pytest.mark.parametrize("model_type, steps", [
    ("qwen3", ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]),
    ("phi3", ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]),
    ("gemma3_text", ["FuseNorm", "ShortGPT<n:1>", "GPTQ<group_size:32>"]),
])
def test_streamed_run_equals_in_memory(tmp_path, model_type, steps):
    """Streamed from disk (one unit materialized at a time), every architecture gives the in-memory weights."""
    from tests.test_streaming import assert_same_weights, run_both, saved_model

    saved_model(tmp_path / "model", model_type, shard="40KB", tie_word_embeddings=model_type == "gemma3_text")
    (memory, streamed), _ = run_both(tmp_path, tmp_path / "model", steps)
    assert_same_weights(memory, streamed)


def test_shape_takes_qkv_biases_from_the_adapter():
    """``ModelShape.qkv_bias`` (memory estimates) is the adapter's fact, or the config's ``attention_bias``."""
    from transformers import AutoConfig

    from recipe_engine.architectures.adapters import ADAPTERS
    from recipe_engine.architectures.shape import ModelShape

    for model_type, adapter in ADAPTERS.items():
        config = AutoConfig.for_model(model_type, num_hidden_layers=2)
        assert ModelShape.from_config(config).qkv_bias == adapter.qkv_bias, model_type
    assert ModelShape.from_config(AutoConfig.for_model("llama", num_hidden_layers=2, attention_bias=True)).qkv_bias


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_layer_tensors_are_the_tensors_hf_builds(model_type):
    """``ModelShape.layer_tensors`` (the plan's pinned host copies round each tensor up on its own) lists a
    decoder layer's tensors as transformers builds them: the same element counts, tensor by tensor (a fused
    projection, Phi-3's qkv and gate/up, is one tensor there and counted as its parts here: the same total)."""
    config = tiny_config(model_type, num_hidden_layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sorted(t.numel() for t in model.model.layers[0].state_dict().values())
    shape = ModelShape.from_config(config)
    counted = sorted(shape.layer_tensors(shape.layers[0]))
    assert sum(counted) == sum(built) == shape.layer_parameters(shape.layers[0])
    if model_type != "phi3":
        assert counted == built
