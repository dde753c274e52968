"""One timed request of ``recipe bench``: greedy ``generate`` of exactly ``gen_tokens`` new tokens (static KV
cache in the served mode, the decode step compiled where asked), or one forward pass over the prompt."""
from __future__ import annotations

import time

import torch

from .protocol import Shape
from .timing import Clock, sync


def prompt_ids(vocab_size: int, shape: Shape, device: torch.device) -> torch.Tensor:
    """Seeded random token ids ``[batch, prompt_tokens]`` (speed does not depend on the text)."""
    generator = torch.Generator().manual_seed(shape.prompt_tokens * 1000 + shape.batch)
    return torch.randint(0, vocab_size, (shape.batch, shape.prompt_tokens), generator=generator).to(device)


def generate_options(served: bool, compiled: bool, device: torch.device) -> dict:
    """``generate``'s arguments for the mode: served = static cache, its decode step compiled when
    ``compiled`` (``mode="reduce-overhead"`` on CUDA: the step is captured once as a CUDA graph and replayed)."""
    if not served:
        return {"disable_compile": True}
    from transformers import CompileConfig  # deferred: transformers takes seconds to import

    options: dict = {"cache_implementation": "static", "disable_compile": not compiled}
    if compiled:
        config = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
        config._compile_all_devices = device.type != "cuda"  # transformers compiles on accelerators only otherwise
        options["compile_config"] = config
    return options


@torch.no_grad()
def greedy(model, ids: torch.Tensor, gen_tokens: int, options: dict, streamer=None) -> torch.Tensor:
    """Exactly ``gen_tokens`` greedy tokens after ``ids`` (no end-of-sequence stop)."""
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_tokens,
                          min_new_tokens=gen_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                          pad_token_id=0, eos_token_id=None, streamer=streamer, **options)


@torch.no_grad()
def time_request(model, shape: Shape, device: torch.device, options: dict) -> dict:
    """Seconds of one request; for a generation also the time to the first token and the decode window
    (perf_counter start and end, for the GPU's busy share)."""
    ids = prompt_ids(model.config.vocab_size, shape, device)
    sync(device)
    if not shape.gen_tokens:
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        sync(device)
        return {"seconds": time.perf_counter() - start}
    clock = Clock()
    start = time.perf_counter()
    out = greedy(model, ids, shape.gen_tokens, options, streamer=clock)
    sync(device)
    end = time.perf_counter()
    assert out.shape == (shape.batch, shape.prompt_tokens + shape.gen_tokens), out.shape
    first = clock.first_token
    return {"seconds": end - start, "first_token_s": first - start, "decode_s": end - first,
            "decode_window": (first, end)}
