"""``recipe bench``: interleaved timing, median and p90, the served mode's static-cache generation, the int4
kernel's linears on a packed checkpoint written by compressed-tensors itself, and the command's output."""
import json

import numpy as np
import pytest
import torch

from recipe_engine.cli import main
from recipe_engine.evaluation.bench import (Int4Linear, alternate, load_packed, percentile, protocol_note, ratios,
                                            shapes, spread)
from recipe_engine.evaluation.bench.generate import StaticGreedy, generate_options, greedy, prompt_ids, time_request
from recipe_engine.evaluation.bench.timing import Clock
from recipe_engine.evaluation.bench.int4 import dequantize, unpack_int4
from recipe_engine.evaluation.bench.protocol import PAPER, Shape
from tests.helpers import BYTE_VOCAB, byte_tokenizer, tiny_model

TIMES = [0.91, 1.30, 0.88, 1.02, 0.95, 1.71, 0.99, 1.05, 0.93, 1.12, 0.97]


def test_alternate_interleaves_after_warmup():
    calls, warmed = [], []
    samples = alternate(["A", "B"], lambda m: calls.append(m) or len(calls), warmup=2, repeats=3, warmed=warmed)
    assert calls == ["A", "A", "B", "B"] + ["A", "B"] * 3
    assert samples == [[5, 7, 9], [6, 8, 10]]  # each model's own timed runs, in order
    assert warmed == [[1, 2], [3, 4]]


@pytest.mark.parametrize("values", [TIMES, TIMES[:4], [3.0], list(range(30))])
def test_median_and_p90_match_numpy(values):
    assert percentile(values, 50) == pytest.approx(np.median(values))
    assert spread(values) == pytest.approx({"median": np.percentile(values, 50), "p90": np.percentile(values, 90)})


def test_protocol_note_names_each_difference():
    assert protocol_note("served", PAPER["served"], "cuda", True, 30) is None
    assert protocol_note("eager", PAPER["eager"], "cuda", False, 30) is None
    cpu = shapes("served", on_gpu=False)
    note = protocol_note("served", cpu, "cpu", False, 5)
    assert "device cpu (paper: GPU)" in note and "throughput batch 8 (paper 64)" in note
    assert "latency prompt tokens 256 (paper 2048)" in note and "decode step not compiled" in note
    assert "5 timed iterations" in note
    latency_only = protocol_note("served", cpu[1:], "cpu", True, 30)  # --requests latency: its own paper shape
    assert "latency prompt tokens 256 (paper 2048)" in latency_only and "batch" not in latency_only
    first, second = shapes("served", True, batch=16, prefill_tokens=1024)
    assert (first.batch, first.prompt_tokens, first.gen_tokens) == (16, 64, 128)
    assert (second.batch, second.prompt_tokens, second.gen_tokens) == (1, 1024, 128)
    assert shapes("eager", True, gen_tokens=7)[1].gen_tokens == 0  # the prefill request generates nothing


def test_ratios_are_b_over_a_per_request():
    def record(tokens, latency, params):
        return {"parameters": params, "checkpoint_bytes": 2 * params, "weight_bytes": params, "peak_device_mib": None,
                "requests": {"latency": {"latency_ms": {"median": latency, "p90": 2 * latency},
                                         "tokens_per_s": {"median": tokens, "p90": tokens / 2},
                                         "decode_tokens_per_s": {"median": tokens, "p90": tokens}}}}
    r = ratios(record(10, 30, 4), record(20, 10, 3))
    assert r["parameters"] == 0.75 and r["checkpoint_bytes"] == 0.75 and r["peak_device_memory"] is None
    assert r["latency"] == {"latency_speedup_median": 3.0, "latency_speedup_p90": 3.0, "tokens_per_s_median": 2.0,
                            "tokens_per_s_p90": 2.0, "decode_tokens_per_s_median": 2.0}


def test_static_cache_generation_equals_eager_greedy_tokens():
    torch.manual_seed(0)
    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2).eval()
    device = torch.device("cpu")
    ids = prompt_ids(BYTE_VOCAB, Shape("t", 3, 9, 12), device)
    eager = greedy(model, ids, 12, generate_options(False, "eager", device))
    static = greedy(model, ids, 12, generate_options(True, "eager", device))
    assert static.shape == (3, 21) and torch.equal(static, eager)
    assert len(set(eager[:, 9:].flatten().tolist())) > 1  # not a degenerate repeat of one token


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_graph_ready_decode_step_gives_generates_tokens(model_type):
    """``StaticGreedy`` (the step a CUDA graph captures, run eagerly here: no GPU) against transformers' own
    ``generate`` over a dynamic cache: the same tokens, request after request on the same buffers, for a longer
    prompt after a shorter one and a shorter after a longer (the cache and the mask emptied by each prefill)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    device = torch.device("cpu")
    decoder = StaticGreedy(model, 3, 9 + 12, device, capture=False)
    for prompt, new in ((9, 12), (4, 10), (9, 12)):
        ids = prompt_ids(BYTE_VOCAB, Shape("t", 3, prompt, new), device)
        expected = greedy(model, ids, new, generate_options(False, "eager", device))
        clock = Clock()
        assert torch.equal(decoder(ids, new, clock), expected), (prompt, new)
        assert clock.first_token is not None
    assert len(set(expected[:, 9:].flatten().tolist())) > 1  # not a degenerate repeat of one token


#: ATen operators that read a tensor's value on the host (``.item()``, ``bool(t)``, data-dependent shapes): each
#: waits for the device, which a CUDA graph capture forbids
HOST_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
              "aten.nonzero.default", "aten.masked_select.default", "aten.unique_consecutive.default"}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_captured_decode_step_reads_nothing_on_the_host(model_type):
    """What a capture needs of the step, checked without a GPU: every ATen operator the eager step dispatches
    (seen by a ``TorchDispatchMode``), none of which may read a value back to the host."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    config = AutoConfig.for_model(model_type, vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16)
    decoder = StaticGreedy(model, 2, 16, torch.device("cpu"), capture=False)
    with torch.no_grad():
        decoder.prefill(prompt_ids(BYTE_VOCAB, Shape("t", 2, 6, 4), torch.device("cpu")))
        with Dispatched() as seen:
            decoder.step()
        assert "aten.mm.default" in seen.ops and not seen.ops & HOST_READS, seen.ops & HOST_READS
        with Dispatched() as control:  # the check can fail: a value read back, as ``if (mask == 1).all():`` does
            bool((decoder.mask[..., :4] == 0).all())
        assert control.ops & HOST_READS


def test_graphs_requests_keep_one_decoder_per_model_and_shape():
    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2).eval()
    device, options = torch.device("cpu"), generate_options(True, "graphs", device=torch.device("cpu"))
    shape = Shape("t", 2, 5, 4)
    runs = [time_request(model, shape, device, options) for _ in range(2)]
    assert len(options["graphs"]) == 1 and all(r["first_token_s"] <= r["seconds"] for r in runs)
    time_request(model, Shape("u", 1, 7, 4), device, options)
    assert len(options["graphs"]) == 2


# -- packed int4 -----------------------------------------------------------------------------------------
def write_packed(directory, symmetric: bool, group: int = 32):
    """A tiny model packed by compressed-tensors' own compressor (pack-quantized, W4, groups of ``group``), and
    the same model with each quantized weight replaced by compressed-tensors' own fake quantization."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2, hidden_size=128, intermediate_size=256).eval()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    reference = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2, hidden_size=128, intermediate_size=256).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            grouped = module.weight.view(module.weight.shape[0], -1, group)
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module.weight_scale.copy_(scale)
            module.weight_zero_point.copy_(zero)
            reference.get_submodule(name).weight.copy_(fake_quantize(module.weight, scale, zero, args))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    byte_tokenizer().save_pretrained(directory)
    return reference


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linears_equal_the_dequantized_model(tmp_path, symmetric):
    reference = write_packed(tmp_path / "packed", symmetric)
    packed = load_packed(str(tmp_path / "packed"), torch.float32, torch.device("cpu"))
    swapped = [m for m in packed.modules() if isinstance(m, Int4Linear)]
    assert len(swapped) == 2 * 7 and not isinstance(packed.lm_head, Int4Linear)
    ids = torch.randint(0, BYTE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = packed(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_unpacking_follows_compressed_tensors_order():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = torch.randint(-8, 8, (6, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(unpack_int4(pack_to_int32(signed, 4), 40), signed.to(torch.int32) + 8)
    scale = torch.tensor([[0.5, 2.0]])
    values = torch.tensor([[8, 9, 0, 15]])
    assert torch.equal(dequantize(values, scale, torch.tensor([[1, -1]])), torch.tensor([[-0.5, 0.0, -14.0, 16.0]]))


# -- the command ------------------------------------------------------------------------------------------
@pytest.fixture
def pair(tmp_path):
    dirs = []
    for name, layers in (("dense", 4), ("shallow", 2)):
        tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=layers).save_pretrained(tmp_path / name)
        byte_tokenizer().save_pretrained(tmp_path / name)
        dirs.append(tmp_path / name)
    return dirs


SMALL = ["--batch", "2", "--prompt-tokens", "4", "--gen-tokens", "3", "--prefill-tokens", "16", "--warmup", "1",
         "--device", "cpu"]


def test_bench_cli_served_reports_median_p90_and_ratios(pair, tmp_path, capsys):
    dense, shallow = pair
    out = tmp_path / "bench.json"
    assert main(["bench", str(dense), str(shallow), *SMALL, "--repeats", "4", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    a, b = record["models"]
    assert (a["layers"], b["layers"]) == (4, 2) and record["mode"] == "served" and not record["compiled"]
    assert a["checkpoint_bytes"] == sum(p.stat().st_size for p in dense.glob("*.safetensors")) > 0
    for run in (a, b):
        throughput = run["requests"]["throughput"]
        assert throughput["runs"] == 4 and len(throughput["seconds"]) == 4
        assert throughput["latency_ms"]["median"] == pytest.approx(1000 * np.median(throughput["seconds"]))
        assert throughput["tokens_per_s"]["p90"] == pytest.approx(2 * 3 / np.percentile(throughput["seconds"], 90))
        assert throughput["gpu_busy_decode"] is None and run["peak_device_mib"] is None  # no GPU here
    ratio = record["ratio_b_over_a"]["latency"]
    assert ratio["tokens_per_s_median"] == pytest.approx(
        b["requests"]["latency"]["tokens_per_s"]["median"] / a["requests"]["latency"]["tokens_per_s"]["median"])
    text = capsys.readouterr().out
    assert "throughput tokens/s, median" in text and "latency decode tokens/s, median" in text
    assert "GPU busy while decoding" in text and "B/A" in text
    assert "not measured: peak device memory (device cpu), GPU busy share while decoding (no GPU)" in text
    assert "served mode (static KV cache, decode step not compiled)" in text
    assert all(len(r["warmup_s"]) == 1 for run in (a, b) for r in run["requests"].values())
    assert record["decode_step"] == "eager" and "warm-up (untimed; the first run of each compiles or captures): " \
        f"{dense}: throughput {a['requests']['throughput']['warmup_s'][0]:.1f} s" in text
    limit = a["bytes_per_token"] / b["bytes_per_token"]
    assert record["ratio_b_over_a"]["bytes_per_token"] == pytest.approx(1 / limit) and limit > 1.2
    assert f"limit of decode tokens/s B/A (weight bytes read per token, A/B): {limit:.3f}×" in text
    assert "note: differs from SLEB / FlattenGPT Table 2: device cpu (paper: GPU)" in text


def test_bench_cli_eager_mode_keeps_the_prefill_forward(pair, tmp_path):
    dense, _ = pair
    out = tmp_path / "bench.json"
    assert main(["bench", str(dense), *SMALL, "--mode", "eager", "--repeats", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    requests = record["models"][0]["requests"]
    assert set(requests) == {"generation", "prefill"} and "tokens_per_s" not in requests["prefill"]
    assert requests["generation"]["shape"] == {"name": "generation", "batch": 2, "prompt_tokens": 4, "gen_tokens": 3}


def test_bench_cli_times_a_packed_checkpoint_with_the_int4_kernel(pair, tmp_path):
    write_packed(tmp_path / "packed", symmetric=True)
    out = tmp_path / "bench.json"
    assert main(["bench", str(tmp_path / "packed"), *SMALL, "--repeats", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["models"][0]["weights"] == "int4 (packed)"


def test_bench_cli_refuses_what_the_int4_kernel_cannot_time(tmp_path, capsys):
    write_packed(tmp_path / "packed", symmetric=True, group=16)
    assert main(["bench", str(tmp_path / "packed"), *SMALL]) == 2
    assert "group_size 16 (config group group_0): PyTorch's int4 kernel takes 32, 64, 128, 256" in \
        capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_read_per_token_leave_out_the_embedding_gather(tmp_path, tied):
    from recipe_engine.evaluation.bench import bytes_read_per_token

    for dtype, width in ((torch.bfloat16, 2), (torch.float32, 4)):
        model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2, tie_word_embeddings=tied).to(dtype)
        read = [p for n, p in model.named_parameters() if tied or "embed_tokens" not in n]  # a tied head: once
        assert bytes_read_per_token(model) == width * sum(p.numel() for p in read)


# -- packed outputs: the dense model's parameters, the bytes as held -----------------------------------------
def dense_figures(config) -> tuple[list[tuple[int, int]], int]:
    """Each decoder linear's (rows, columns) and the dense model's parameter count, from the config alone."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d),
                 (config.intermediate_size, h), (config.intermediate_size, h), (h, config.intermediate_size)]
    linears = per_layer * config.num_hidden_layers
    norms = (2 * config.num_hidden_layers + 1) * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return linears, sum(r * c for r, c in linears) + norms + embeddings


@pytest.fixture(scope="module")
def gptq_outputs(tmp_path_factory):
    """A tiny dense model and GPTQ's outputs of it: the packed default (compressed-tensors int4, groups of 32)
    and ``export: gptq`` (GPTQ v1)."""
    import recipe_engine
    from tests.helpers import save_tiny_model

    root = tmp_path_factory.mktemp("gptq")
    save_tiny_model(root / "dense", num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    (root / "calibration.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    for name, export in (("packed", ""), ("gptq", ",export:gptq")):
        recipe_engine.apply(dict(version=1, name=f"bench-{name}", model=str(root / "dense"), device="cpu",
                                 output=str(root / name), modifiers=[f"GPTQ<group_size:32{export}>"],
                                 calibration=dict(dataset=str(root / "calibration.txt"), samples=4, seq_len=32,
                                                  batch_size=2)), progress=False)
    return root


def test_bench_counts_packed_linears_as_the_dense_parameters_and_the_bytes_as_held(gptq_outputs, tmp_path, capsys):
    from transformers import AutoConfig

    root, out = gptq_outputs, tmp_path / "bench.json"
    assert main(["bench", str(root / "packed"), str(root / "gptq"), *SMALL, "--repeats", "1",
                 "--json", str(out)]) == 0
    packed, gptq = json.loads(out.read_text())["models"]
    config = AutoConfig.from_pretrained(root / "dense")
    linears, parameters = dense_figures(config)
    assert packed["parameters"] == gptq["parameters"] == parameters
    h, norms = config.hidden_size, (2 * config.num_hidden_layers + 1) * config.hidden_size
    head = config.vocab_size * h  # untied: the head is read, the embedding gathered
    # int4 kernel: two codes a byte, a scale and a zero per group of 32 and row, fp32; norms and head in fp32
    int4 = sum(r * c // 2 + r * (c // 32) * 2 * 4 for r, c in linears) + 4 * (norms + head)
    assert packed["weights"] == "int4 (packed)" and packed["bytes_per_token"] == int4
    # GPTQ v1 runs dequantized: every weight in fp32, as the dense model's
    assert gptq["weights"] == "float32 (dequantized)" and gptq["packed"] == "gptq, 4-bit, groups of 32"
    assert gptq["bytes_per_token"] == 4 * (sum(r * c for r, c in linears) + norms + head)
    text = capsys.readouterr().out
    assert f"timed dequantized to float32: {root / 'gptq'} (gptq, 4-bit, groups of 32)" in text
    assert gptq["checkpoint_bytes"] < gptq["bytes_per_token"] / 2  # the file is packed, the held weights not


@pytest.mark.parametrize("name", ["dense", "packed", "gptq"])
def test_the_planned_weights_are_the_weights_bench_holds(gptq_outputs, name):
    """The memory check's weights, from the config and headers before loading, are what the loaded model holds."""
    from recipe_engine.cli.bench import load_for_bench
    from recipe_engine.evaluation.bench import packed_config, planned_weight_bytes
    from recipe_engine.evaluation.bench.run import held_weights
    from recipe_engine.sources.models import load_config

    location = str(gptq_outputs / name)
    for dtype in ("float32", "bfloat16"):
        model, _, _ = load_for_bench(location, dtype, torch.device("cpu"))
        planned = planned_weight_bytes(load_config(location), location, getattr(torch, dtype),
                                       packed_config(location) is not None)
        assert planned == sum(held_weights(model).values()), (name, dtype)


# -- refusals before loading ----------------------------------------------------------------------------------
def test_bench_refuses_deepseek_v3_before_loading_as_validate_does(tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from tests.helpers import forbid_loading, refused_in_one_line

    config = DeepseekV3Config(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=12, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ds")
    byte_tokenizer().save_pretrained(tmp_path / "ds")
    capsys.readouterr()  # the save's progress bar
    forbid_loading(monkeypatch, "bench loaded a model it refuses")
    refused_in_one_line(capsys, main, ["bench", str(tmp_path / "ds"), *SMALL],
                        f"error: {tmp_path / 'ds'}: unsupported architecture 'deepseek_v3': DeepSeek's multi-head "
                        f"latent attention (MLA: compressed q/kv projections) is not handled yet")


def least_need(config, shapes_: list[tuple[int, int, int]], width: int = 4) -> int:
    """What the docs promise a bench of one dense fp32 model needs at least, from the config alone: the
    weights, the KV cache (every position but the last new token's), the float32 logits of one step, the token
    ids and one hidden state."""
    _, parameters = dense_figures(config)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * width
    return max(parameters * width + kv_per_token * b * (p + g - 1) + b * config.vocab_size * 4 + b * (p + g) * 8
               + b * p * config.hidden_size * width for b, p, g in shapes_)


@pytest.mark.parametrize("mode", ["served", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt_oss", "qwen3_moe"])
def test_the_kv_cache_estimate_is_what_generate_allocates(model_type, mode):
    """The estimate's KV cache equals the bytes of the cache transformers' ``generate`` fills: 11 + 6 − 1
    positions (the last new token is never fed back); Gemma 3's and gpt-oss's sliding-window layers only their
    window of 8 (the static cache) or 7 (the dynamic one)."""
    from recipe_engine.evaluation.bench import request_memory
    from recipe_engine.evaluation.bench.generate import generate_options, greedy
    from tests.helpers import tiny_config

    model = tiny_model(model_type, vocab_size=BYTE_VOCAB, num_hidden_layers=3)
    shape, device = Shape("throughput", 3, 11, 6), torch.device("cpu")
    options = {**generate_options(mode == "served", "eager", device), "return_dict_in_generate": True}
    cache = greedy(model, prompt_ids(BYTE_VOCAB, shape, device), shape.gen_tokens, options).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    config = tiny_config(model_type, vocab_size=BYTE_VOCAB, num_hidden_layers=3)
    assert request_memory(config, shape, 0, torch.float32, mode == "served").kv_cache == held > 0


def test_bench_refuses_a_batch_memory_cannot_hold_before_loading(pair, capsys, monkeypatch):
    from recipe_engine.evaluation.bench import memory

    from tests.helpers import forbid_loading, tiny_config

    config = tiny_config(vocab_size=BYTE_VOCAB)
    monkeypatch.setattr(memory, "available_memory", lambda: 64 * 2**30)
    forbid_loading(monkeypatch, "bench loaded a model whose requests cannot fit")
    assert main(["bench", str(pair[0]), "--batch", "100000000", "--prefill-tokens", "200", "--device", "cpu"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    kv = 2 * 4 * 2 * 16 * 100_000_000 * (64 + 32 - 1) * 4
    assert len(err) == 1 and err[0].startswith(
        "error: out of host memory: the throughput request (--batch 100000000, --prompt-tokens 64, --gen-tokens 32) "
        f"needs at least {least_need(config, [(100_000_000, 64, 32)]) / 2**30:,.2f} GiB: KV cache "
        f"{kv / 2**30:,.2f} GiB (2 × 4 layers × 2 KV heads × head dim 16 × batch 100000000 × 95 positions × 4 "
        f"bytes)"), err
    assert err[0].endswith("64.00 GiB is available (MemAvailable of this host); nothing was loaded; give a smaller "
                           "--batch or --prompt-tokens or --gen-tokens"), err


def test_bench_runs_what_memory_holds_and_refuses_a_byte_less(pair, capsys, monkeypatch):
    from recipe_engine.evaluation.bench import memory

    from tests.helpers import tiny_config

    need = least_need(tiny_config(vocab_size=BYTE_VOCAB), [(2, 4, 3), (1, 16, 3)])  # SMALL's two requests
    monkeypatch.setattr(memory, "available_memory", lambda: need - 1)
    assert main(["bench", str(pair[0]), *SMALL, "--repeats", "1"]) == 4
    assert "error: out of host memory: the latency request (--prefill-tokens 16, --gen-tokens 3)" in \
        capsys.readouterr().err
    monkeypatch.setattr(memory, "available_memory", lambda: need)
    assert main(["bench", str(pair[0]), *SMALL, "--repeats", "1"]) == 0


@pytest.mark.parametrize("option, value, accepted", [
    ("--warmup", "-1", "a non-negative integer, got -1"), ("--warmup", "x", "a non-negative integer, got 'x'"),
    ("--repeats", "0", "a positive integer, got 0"), ("--batch", "0", "a positive integer, got 0"),
    ("--prompt-tokens", "0", "a positive integer, got 0"), ("--gen-tokens", "-2", "a positive integer, got -2"),
    ("--prefill-tokens", "0", "a positive integer, got 0")])
def test_bench_integer_options_say_what_they_accept(pair, capsys, option, value, accepted):
    from tests.helpers import refused_in_one_line

    refused_in_one_line(capsys, main, ["bench", str(pair[0]), option, value],
                        f"error: recipe bench: argument {option}: expected {accepted}")


def test_bench_integer_options_accept_their_least_values(pair, tmp_path):
    """Each option's message is true: the least value it names runs (0 warm-up runs, 1 of everything else)."""
    out = tmp_path / "bench.json"
    assert main(["bench", str(pair[0]), "--batch", "1", "--prompt-tokens", "1", "--gen-tokens", "1",
                 "--prefill-tokens", "1", "--warmup", "0", "--repeats", "1", "--device", "cpu",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["warmup"], record["repeats"]) == (0, 1)
    assert [r["batch"] + r["prompt_tokens"] + r["gen_tokens"] for r in record["requests"]] == [3, 3]


def test_bench_cli_refuses_graphs_without_a_gpu_before_loading(pair, capsys):
    assert main(["bench", str(pair[0]), *SMALL, "--compile", "graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --compile graphs captures the decode step as a CUDA graph: it needs a CUDA device, not "
                   "cpu; use --compile off (or on) here")


def test_bench_cli_refuses_graphs_for_sliding_window_layers_before_loading(tmp_path, capsys, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipe_engine.cli import bench as bench_cli

    config = AutoConfig.for_model("gemma3_text", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "g")
    byte_tokenizer().save_pretrained(tmp_path / "g")
    capsys.readouterr()
    monkeypatch.setattr(bench_cli, "check_device", lambda _device: torch.device("cuda"))  # graphs need CUDA
    monkeypatch.setattr(bench_cli, "load_for_bench", lambda *_a: pytest.fail("loaded a model"))
    assert main(["bench", str(tmp_path / "g"), "--compile", "graphs", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path / 'g'}: --compile graphs keeps one mask for every layer, and this model has "
                   f"sliding_attention layers; use --compile on")


def test_bench_cli_refuses_a_request_the_mode_lacks(pair, capsys):
    assert main(["bench", str(pair[0]), *SMALL, "--requests", "prefill"]) == 2
    assert "error: --requests prefill: the served mode times throughput and latency" in capsys.readouterr().err


def test_gpu_busy_share_averages_the_samples_inside_the_decode_windows():
    from recipe_engine.evaluation.bench.timing import BusySampler, parse_smi_line

    sampler = BusySampler(torch.device("cpu"))
    assert sampler.source is None  # no GPU: not measured
    sampler._offset = 100.0
    sampler.samples = [(100.5, 0.2), (101.0, 0.9), (101.5, 1.0), (103.0, 0.1), (104.2, 0.8)]
    assert sampler.share([(1.0, 1.5), (4.0, 4.5)]) == pytest.approx((0.9 + 1.0 + 0.8) / 3)
    assert sampler.share([(9.0, 9.5)]) is None
    stamp, busy = parse_smi_line("2026/11/27 10:40:39.250, 97\n")
    assert busy == 0.97 and stamp % 1 == pytest.approx(0.25)
    assert parse_smi_line("[N/A], [N/A]") is None
