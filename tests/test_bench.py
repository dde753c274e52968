"""``recipe bench``: interleaved timing, median and p90, the served mode's static-cache generation, the int4
kernel's linears on a packed checkpoint written by compressed-tensors itself, and the command's output."""
import json

import numpy as np
import pytest
import torch

from recipe_engine.cli import main
from recipe_engine.evaluation.bench import (Int4Linear, alternate, load_packed, percentile, protocol_note, ratios,
                                            shapes, spread)
from recipe_engine.evaluation.bench.generate import generate_options, greedy, prompt_ids
from recipe_engine.evaluation.bench.int4 import dequantize, unpack_int4
from recipe_engine.evaluation.bench.protocol import PAPER, Shape
from tests.helpers import BYTE_VOCAB, byte_tokenizer, tiny_model

TIMES = [0.91, 1.30, 0.88, 1.02, 0.95, 1.71, 0.99, 1.05, 0.93, 1.12, 0.97]


def test_alternate_interleaves_after_warmup():
    calls = []
    samples = alternate(["A", "B"], lambda m: calls.append(m) or len(calls), warmup=2, repeats=3)
    assert calls == ["A", "A", "B", "B"] + ["A", "B"] * 3
    assert samples == [[5, 7, 9], [6, 8, 10]]  # each model's own timed runs, in order


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
    eager = greedy(model, ids, 12, generate_options(False, False, device))
    static = greedy(model, ids, 12, generate_options(True, False, device))
    assert static.shape == (3, 21) and torch.equal(static, eager)
    assert len(set(eager[:, 9:].flatten().tolist())) > 1  # not a degenerate repeat of one token


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

    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=2, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    read = [p for n, p in model.named_parameters() if tied or "embed_tokens" not in n]  # a tied head: once
    assert bytes_read_per_token(str(tmp_path), torch.bfloat16) == 2 * sum(p.numel() for p in read)
    assert bytes_read_per_token(str(tmp_path), torch.float32) == 4 * sum(p.numel() for p in read)


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
