"""What ``recipe bench``'s requests need in memory, estimated before any weight is loaded, so a request that
cannot fit ends in one line (exit code 4, :class:`~recipe_engine.errors.OutOfMemory`) instead of the kernel's
OOM killer after minutes of loading.

Per request, at least (every term is memory the run certainly holds at once; what it allocates beyond them,
attention scores and kernel workspaces, is left out, so a refusal is never wrong):

* the weights of every model benchmarked (all are loaded before the first request), as held: parameters at
  the benchmarked dtype's size, tied embeddings once; a packed 4-bit checkpoint's linears in PyTorch's int4
  layout (:func:`.int4.held_int4_bytes`), any other packed checkpoint dequantized;
* the KV cache of one model: ``2 × Σ_layers kv_heads × head_dim × batch × positions × dtype bytes``,
  ``positions`` the prompt plus the new tokens but the last (never fed back), a sliding-window layer's at
  most its window (the static cache; the dynamic cache keeps one fewer); a prefill forward keeps none;
* the logits: generation ``batch × vocab × 4`` (the float32 scores of one step); a prefill forward
  ``batch × prompt × vocab × dtype bytes``;
* activations: the token ids ``batch × (prompt + new) × 8`` and one hidden state ``batch × prompt × hidden
  × dtype bytes``.

The total is compared with the memory free where the requests run: the GPU's free memory
(``torch.cuda.mem_get_info``), else the host's ``MemAvailable``; on a GPU the host must also hold the weights
while they load.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import OutOfMemory
from ...checkpoint.reader import checkpoint_shapes, logical_shapes, meta_model, packed_weights
from ...system.host_memory import available_memory
from .int4 import held_int4_bytes
from .protocol import Shape

#: The options that size each request, as ``recipe bench`` names them.
OPTIONS = {"throughput": ("--batch", "--prompt-tokens", "--gen-tokens"),
           "generation": ("--batch", "--prompt-tokens", "--gen-tokens"),
           "latency": ("--prefill-tokens", "--gen-tokens"), "prefill": ("--prefill-tokens",)}


@dataclass(frozen=True)
class RequestMemory:
    """The least memory one request needs, in bytes, and the figures its KV cache comes from."""

    shape: Shape
    weights: int
    kv_cache: int
    logits: int
    activations: int
    kv_formula: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.logits + self.activations


def planned_weight_bytes(config, location: str, dtype: torch.dtype, int4: bool) -> int:
    """Bytes of one model's parameters as ``recipe bench`` will hold them (no weight read: the config's model
    on the meta device, and for a packed 4-bit checkpoint, ``int4``, its headers)."""
    width = torch.empty(0, dtype=dtype).element_size()
    model = meta_model(config)
    total = width * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if int4:
        directory = Path(location)
        saved = json.loads((directory / "config.json").read_text())
        shapes = checkpoint_shapes(directory)
        logical = logical_shapes(shapes, saved)
        for name, parts in packed_weights(shapes, saved)[1].items():
            rows, columns = logical[name]
            groups = shapes[parts["weight_scale"]][1]
            total += held_int4_bytes(rows, columns, groups, dtype) - rows * columns * width
    return total


def cache_tokens(config, positions: int, served: bool) -> list[int]:
    """Positions the KV cache holds per layer for a request of ``positions`` cached positions: a sliding-window
    layer at most its window (the served mode's static cache; the eager mode's dynamic cache keeps one fewer),
    a chunked layer at most its chunk, a layer without attention none."""
    window = {"sliding_attention": getattr(config, "sliding_window", None),
              "chunked_attention": getattr(config, "attention_chunk_size", None)}
    default = "sliding_attention" if window["sliding_attention"] else "full_attention"
    types = getattr(config, "layer_types", None) or [default] * config.num_hidden_layers
    held = []
    for kind in types:
        if kind in window and window[kind]:
            held.append(min(positions, window[kind] - (0 if served else 1)))
        else:
            held.append(positions if kind in window or kind == "full_attention" else 0)
    return held


def request_memory(config, shape: Shape, weights: int, dtype: torch.dtype, served: bool = True) -> RequestMemory:
    """The least one request of ``shape`` needs on a model of ``config`` beside ``weights`` bytes of weights
    (``served``: the static KV cache, else the eager mode's dynamic one). The cache holds the prompt and every
    new token but the last, which is never fed back."""
    width = torch.empty(0, dtype=dtype).element_size()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    positions = shape.prompt_tokens + shape.gen_tokens - 1
    held = cache_tokens(config, positions, served) if shape.gen_tokens else []
    kv = 2 * kv_heads * head_dim * shape.batch * sum(held) * width
    layers = sum(1 for t in held if t)
    windowed = "" if all(t == positions for t in held if t) else ", sliding windows fewer"
    formula = (f"2 × {layers} layers × {kv_heads} KV heads × head dim {head_dim} × batch {shape.batch} × "
               f"{positions} positions × {width} bytes{windowed}") if held else "none"
    logits = shape.batch * config.vocab_size * 4 if shape.gen_tokens else \
        shape.batch * shape.prompt_tokens * config.vocab_size * width
    tokens = shape.prompt_tokens + shape.gen_tokens
    activations = shape.batch * tokens * 8 + shape.batch * shape.prompt_tokens * config.hidden_size * width
    return RequestMemory(shape, weights, kv, logits, activations, formula)


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free where the requests run and what says so."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    return available_memory(), "MemAvailable of this host"


def gib(value: int) -> str:
    return f"{value / 2**30:,.2f} GiB" if value >= 2**27 else f"{value / 2**20:,.1f} MiB"


def check_memory(configs: list, weights: list[int], shapes: tuple[Shape, ...], dtype: torch.dtype,
                 device: torch.device, served: bool) -> None:
    """``OutOfMemory`` naming the request's options and the figures when the request that needs the most
    (the models' weights together, the largest model's cache, logits and activations) does not fit."""
    needs = [max((request_memory(config, shape, sum(weights), dtype, served) for config in configs),
                 key=lambda need: need.total) for shape in shapes]
    if device.type == "cuda" and sum(weights) > available_memory():
        raise OutOfMemory("host", f"the weights need {gib(sum(weights))} on the host while they load, and the "
                                  f"host has {gib(available_memory())} available (MemAvailable)",
                          advice="nothing was loaded; free memory or bench fewer or smaller models")
    free, source = free_memory(device)
    worst = max(needs, key=lambda need: need.total)
    if worst.total > free:
        shape = worst.shape
        given = {"--batch": shape.batch, "--prompt-tokens": shape.prompt_tokens, "--prefill-tokens":
                 shape.prompt_tokens, "--gen-tokens": shape.gen_tokens}
        options = OPTIONS[shape.name]
        smaller = " or ".join(o for o in options if given[o] > 1) or options[0]
        raise OutOfMemory(
            "GPU" if device.type == "cuda" else "host",
            f"the {shape.name} request ({', '.join(f'{o} {given[o]}' for o in options)}) needs at least "
            f"{gib(worst.total)}: KV cache {gib(worst.kv_cache)} ({worst.kv_formula}), logits "
            f"{gib(worst.logits)}, token ids and hidden states {gib(worst.activations)}, weights "
            f"{gib(worst.weights)}; {gib(free)} is available ({source})",
            advice=f"nothing was loaded; give a smaller {smaller}")

