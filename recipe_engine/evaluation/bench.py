"""``recipe bench``: speed and size of one or two checkpoints (FlattenGPT Appendix C.2 protocol).

* Generation throughput: greedy ``generate`` of exactly ``gen_tokens`` new tokens for a batch of
  ``batch`` one-token prompts; tokens/s = batch × gen_tokens / wall time. Paper: batch 64, 128 tokens.
* Prefill latency: one forward pass over a single ``prefill_tokens``-token sequence. Paper: 2048 tokens.
* Each measurement: ``warmup`` untimed runs per model, then ``repeats`` timed runs with A and B
  alternated (A, B, A, B, ...) so drift in machine load hits both; the median is reported.
  Ratios are B relative to A: throughput B/A and latency speedup A/B (> 1 means B is faster).
* Size: parameter count and bytes of ``*.safetensors`` in the directory.
Inputs are seeded random token ids (speed does not depend on the text).
"""
from __future__ import annotations

import statistics
import time

import torch

from ..architectures.adapters import count_parameters

PAPER = {"batch": 64, "gen_tokens": 128, "prefill_tokens": 2048}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_generation(model, batch: int, gen_tokens: int, device: torch.device) -> float:
    """Seconds to generate exactly ``gen_tokens`` greedy tokens for ``batch`` one-token prompts."""
    prompt = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=gen_tokens,
                         min_new_tokens=gen_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    _sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape == (batch, 1 + gen_tokens), out.shape
    return elapsed


@torch.no_grad()
def time_prefill(model, prefill_tokens: int, device: torch.device) -> float:
    """Seconds for one forward pass over a single ``prefill_tokens``-token sequence."""
    ids = torch.randint(0, model.config.vocab_size, (1, prefill_tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    _sync(device)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False)
    _sync(device)
    return time.perf_counter() - start


def alternate(models: list, measure, warmup: int, repeats: int) -> list[float]:
    """Median seconds per model: warm-up runs each, then repeats interleaved A, B, A, B, ..."""
    for model in models:
        for _ in range(warmup):
            measure(model)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, model in enumerate(models):
            times[i].append(measure(model))
    return [statistics.median(t) for t in times]


def bench(models: list, batch: int, gen_tokens: int, prefill_tokens: int, warmup: int, repeats: int,
          device: torch.device) -> list[dict]:
    """Per model: params, generation tokens/s and prefill latency (ms); models are moved to ``device``."""
    for model in models:
        model.to(device).eval()
    gen = alternate(models, lambda m: time_generation(m, batch, gen_tokens, device), warmup, repeats)
    prefill = alternate(models, lambda m: time_prefill(m, prefill_tokens, device), warmup, repeats)
    return [{"parameters": count_parameters(m), "layers": m.config.num_hidden_layers,
             "throughput_tok_s": batch * gen_tokens / g, "prefill_latency_ms": 1000 * p}
            for m, g, p in zip(models, gen, prefill)]


def ratios(a: dict, b: dict) -> dict:
    """B relative to A (> 1 = B faster / larger)."""
    return {"throughput": b["throughput_tok_s"] / a["throughput_tok_s"],
            "prefill_speedup": a["prefill_latency_ms"] / b["prefill_latency_ms"],
            "parameters": b["parameters"] / a["parameters"],
            "checkpoint_bytes": b["checkpoint_bytes"] / a["checkpoint_bytes"] if a["checkpoint_bytes"] else None}


def protocol_note(batch: int, gen_tokens: int, prefill_tokens: int, device: torch.device) -> str | None:
    """A line saying how this run differs from the paper's protocol (None when it matches on a GPU)."""
    used = {"batch": batch, "gen_tokens": gen_tokens, "prefill_tokens": prefill_tokens}
    changed = [f"{k} {used[k]} (paper {v})" for k, v in PAPER.items() if used[k] != v]
    parts = ([f"device {device} (paper: GPU)"] if device.type == "cpu" else []) + changed
    return "differs from FlattenGPT C.2: " + ", ".join(parts) if parts else None
