"""``recipe bench``: speed and size of one or two checkpoints (the protocols in :mod:`.protocol`).

Per request shape: ``warmup`` untimed runs per model, then ``repeats`` timed runs interleaved A, B, A, B, ...;
reported are the median and the p90 (the slow tail) of its seconds, tokens/s = batch × new tokens / seconds
(at the median and at the p90 time), the time to the first token and the decode tokens/s after it
(batch × (new − 1) / decode seconds), the peak device memory (the model's weights plus the most any run
allocated beyond what was allocated before it) and, on a GPU, its mean utilisation over the decode windows;
each untimed warm-up run's seconds too (the first includes a compile or a capture).
Ratios are B relative to A (> 1: B is faster; latency as A/B). Size: parameters (a packed linear's rows ×
columns), the ``*.safetensors`` bytes and the weight bytes held, which one decode step reads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...architectures.adapters import count_parameters
from .generate import generate_options, time_request
from .int4 import Int4Linear
from .protocol import Shape
from .timing import BusySampler, alternate, spread


@dataclass(frozen=True)
class BenchPlan:
    """What one ``recipe bench`` times."""

    mode: str                       # served | eager
    shapes: tuple[Shape, ...]
    warmup: int
    repeats: int
    decode_step: str                # served mode: compiled | graphs | eager (generate_options)
    device: torch.device


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers as held (tied tensors once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    return sum(seen.values())


def held_weights(model) -> dict[int, int]:
    """Bytes of each weight tensor the model holds as benchmarked, by storage (tied tensors once): its
    parameters at their dtype, and each :class:`Int4Linear`'s packed codes and scales and zeros."""
    packed = [t for m in model.modules() if isinstance(m, Int4Linear) for t in m.buffers()]
    return {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *packed)}


def logical_parameters(model) -> int:
    """Parameters as the dense model counts them (tied embeddings once): an :class:`Int4Linear`'s weight as
    its rows × columns, though it is held packed."""
    return count_parameters(model) + sum(m.weight_elements for m in model.modules() if isinstance(m, Int4Linear))


def bytes_read_per_token(model) -> int:
    """Bytes of weights one decode step reads, as the model holds them while benchmarked (:func:`held_weights`:
    a packed 4-bit linear's codes, scales and zeros; a checkpoint loaded dequantized, its dequantized
    weights), except the input embeddings, a gather of one row per token, which count once, as the output
    head, when the head is tied to them. The ratio of two models' bytes is the memory-bound limit of their
    decode tokens/s. A mixture-of-experts model counts every expert: what a large batch reads (a batch-1
    step reads only the routed ones)."""
    held = held_weights(model)
    embedding = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    if head is None or head.data_ptr() != embedding.data_ptr():
        held.pop(embedding.data_ptr(), None)
    return sum(held.values())


def peak_measure(measure, device: torch.device, peaks: dict):
    """``measure`` noting, per model, the most the device allocated during a run beyond what it held before."""
    if device.type != "cuda":
        return measure

    def wrapped(model):
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = measure(model)
        peaks[id(model)] = max(peaks.get(id(model), 0), torch.cuda.max_memory_allocated(device) - before)
        return result
    return wrapped


def summarize(shape: Shape, runs: list[dict], busy: float | None) -> dict:
    """Median and p90 of one model's timed runs of ``shape``."""
    seconds = spread([r["seconds"] for r in runs])
    record = {"shape": asdict(shape), "runs": len(runs), "latency_ms": {k: 1000 * v for k, v in seconds.items()},
              "seconds": [r["seconds"] for r in runs]}
    if shape.gen_tokens:
        tokens, decoded = shape.batch * shape.gen_tokens, shape.batch * (shape.gen_tokens - 1)
        decode = spread([r["decode_s"] for r in runs])
        record.update(tokens_per_s={k: tokens / v for k, v in seconds.items()},
                      decode_tokens_per_s={k: decoded / v for k, v in decode.items()} if decoded else None,
                      first_token_ms={k: 1000 * v for k, v in spread([r["first_token_s"] for r in runs]).items()},
                      gpu_busy_decode=busy)
    return record


def bench(models: list, plan: BenchPlan) -> list[dict]:
    """Per model: parameters (:func:`logical_parameters`), layers, weight bytes, weight bytes read per token,
    peak device memory and one record per shape; the models are moved to the plan's device."""
    for model in models:
        model.to(plan.device).eval()
    options = generate_options(plan.mode == "served", plan.decode_step, plan.device)
    records = [{"parameters": logical_parameters(m), "layers": m.config.num_hidden_layers,
                "weight_bytes": weight_bytes(m), "bytes_per_token": bytes_read_per_token(m), "requests": {}}
               for m in models]
    peaks: dict = {}
    for shape in plan.shapes:
        measure = peak_measure(lambda m: time_request(m, shape, plan.device, options), plan.device, peaks)
        warmed: list[list] = []
        with BusySampler(plan.device) as sampler:
            samples = alternate(models, measure, plan.warmup, plan.repeats, warmed)
        for record, runs, warmups in zip(records, samples, warmed):
            windows = [r["decode_window"] for r in runs if "decode_window" in r]
            busy = sampler.share(windows) if sampler.source else None
            record["requests"][shape.name] = summarize(shape, runs, busy)
            record["requests"][shape.name]["warmup_s"] = [r["seconds"] for r in warmups]
            record["gpu_busy_source"] = sampler.source
    for record, model in zip(records, models):
        record["peak_device_mib"] = (record["weight_bytes"] + peaks[id(model)]) / 2**20 if id(model) in peaks else None
    return records


def ratios(a: dict, b: dict) -> dict:
    """B relative to A per request (tokens/s B/A at the median and p90, latency A/B) and sizes (B/A)."""
    def share(x, y):
        return y / x if x and y is not None else None

    out = {"parameters": share(a["parameters"], b["parameters"]),
           "checkpoint_bytes": share(a.get("checkpoint_bytes"), b.get("checkpoint_bytes")),
           "weight_bytes": share(a["weight_bytes"], b["weight_bytes"]),
           "peak_device_memory": share(a.get("peak_device_mib"), b.get("peak_device_mib")),
           "bytes_per_token": share(a.get("bytes_per_token"), b.get("bytes_per_token"))}
    for name, ra in a["requests"].items():
        rb = b["requests"][name]
        entry = {"latency_speedup_median": ra["latency_ms"]["median"] / rb["latency_ms"]["median"],
                 "latency_speedup_p90": ra["latency_ms"]["p90"] / rb["latency_ms"]["p90"]}
        if "tokens_per_s" in ra:
            entry.update(tokens_per_s_median=rb["tokens_per_s"]["median"] / ra["tokens_per_s"]["median"],
                         tokens_per_s_p90=rb["tokens_per_s"]["p90"] / ra["tokens_per_s"]["p90"])
            if ra["decode_tokens_per_s"]:
                entry["decode_tokens_per_s_median"] = (rb["decode_tokens_per_s"]["median"]
                                                       / ra["decode_tokens_per_s"]["median"])
        out[name] = entry
    return out
