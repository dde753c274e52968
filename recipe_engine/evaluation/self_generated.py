"""Calibration windows the dense model writes itself (``calibration.generate``).

Each calibration window (``seq_len`` tokens sampled from the source as usual) keeps its first ``prompt_tokens``
tokens as a prompt; the model, before any step changes it, writes the other ``seq_len − prompt_tokens`` with
the KV cache, batched (every prompt has the same length, so no padding), sampled at ``temperature`` (0: greedy)
from a generator seeded with the calibration seed, its end-of-sequence tokens suppressed so every window is
full. Williams et al. (arXiv 2410.17170) report such self-generated data matching or beating real text for
pruning and quantization; the point here is text like what the model will be asked to write.

The windows are cached under ``$RECIPE_CACHE/self-generated/`` by a key over the prompts' token ids, the
generation settings and the sha256 of the model's parameters, written atomically; the record (``report.json``
``data.generated``) says whether the cache was hit.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from ..sources.windows import fingerprint
from ..sources.packages import cache_root
from .generation import eos_ids, forward_options

FORMAT = 1


def parameters_sha256(model) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the model's parameters and buffers (each tensor once)."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def cache_key(prompts: torch.Tensor, config, seed: int, total: int, model_sha256: str) -> str:
    settings = {"format": FORMAT, "prompt_tokens": config.prompt_tokens, "temperature": config.temperature,
                "seed": seed, "seq_len": total, "prompts": fingerprint(prompts), "model": model_sha256}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _next_tokens(logits: torch.Tensor, eos: list[int], temperature: float, generator: torch.Generator):
    logits = logits.float()
    if eos:
        logits[:, [i for i in eos if i < logits.shape[-1]]] = float("-inf")
    if temperature == 0:
        return logits.argmax(-1)
    probabilities = torch.softmax(logits / temperature, dim=-1).cpu()
    return torch.multinomial(probabilities, 1, generator=generator)[:, 0].to(logits.device)


@torch.no_grad()
def complete(model, prompts: torch.Tensor, new_tokens: int, temperature: float, batch_size: int, seed: int,
             eos: list[int], progress=None) -> torch.Tensor:
    """``prompts`` (equal lengths) each followed by ``new_tokens`` tokens the model writes."""
    extra, cache_name = forward_options(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    rows = []
    batches = list(prompts.split(batch_size))
    for number, batch in enumerate(batches):
        ids = batch.to(device)
        out = model(input_ids=ids, use_cache=True, **extra)
        written = []
        for step in range(new_tokens):
            token = _next_tokens(out.logits[:, -1], eos, temperature, generator)
            written.append(token)
            if step + 1 < new_tokens:
                out = model(input_ids=token[:, None], use_cache=True, **{cache_name: out[cache_name]}, **extra)
        rows.append(torch.cat([batch, torch.stack(written, 1).cpu()], 1))
        if progress is not None:
            progress.log(f"self-generated calibration: batch {number + 1}/{len(batches)} written "
                         f"({len(batch)} × {new_tokens} tokens)")
    return torch.cat(rows)


def self_generated_windows(model, tokenizer, windows: torch.Tensor, config, seed: int,
                           progress=None) -> tuple[torch.Tensor, dict]:
    """The windows with everything after their first ``config.prompt_tokens`` written by ``model``, and the
    record of how (settings, cache hit, seconds, the key)."""
    start = time.perf_counter()
    prompts = windows[:, :config.prompt_tokens].contiguous()
    new_tokens = windows.shape[1] - config.prompt_tokens
    key = cache_key(prompts, config, seed, windows.shape[1], parameters_sha256(model))
    path = cache_root() / "self-generated" / f"{key[:32]}.safetensors"
    cached = None
    if path.is_file():
        try:
            cached = load_file(str(path))["windows"]
        except (OSError, KeyError, ValueError, RuntimeError):  # a damaged cache file is written again
            cached = None
    hit = cached is not None and cached.shape == windows.shape and torch.equal(cached[:, :config.prompt_tokens],
                                                                                prompts)
    if hit:
        written = cached
    else:
        was_training = model.training
        model.eval()
        try:
            written = complete(model, prompts, new_tokens, config.temperature, config.batch_size, seed,
                               eos_ids(model, tokenizer), progress)
        finally:
            model.train(was_training)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(handle)
        try:
            save_file({"windows": written.contiguous()}, temporary, metadata={"format": str(FORMAT)})
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    record = {"prompt_tokens": config.prompt_tokens, "new_tokens": new_tokens, "temperature": config.temperature,
              "seed": seed, "cache": "hit" if hit else "written", "key": key,
              "seconds": round(time.perf_counter() - start, 3)}
    return written, record
