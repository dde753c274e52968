"""Calibration windows: text tokenized whole, seeded non-overlapping windows drawn from it, and their fingerprint."""
from __future__ import annotations

import hashlib

import torch

from ..errors import SourceError
from ..system.host_memory import trim_heap
from .text import TextSource, check_length, load_text


def load_calibration(cal) -> list[tuple[TextSource, int]]:
    """Each calibration source's text with the number of windows drawn from it (``cal.shares()``); a source
    too short for its share is a ``SourceError``."""
    loaded = [(load_text(name, cal.split, cal.text_field), share)
              for name, share in zip(cal.sources, cal.shares())]
    for text, share in loaded:
        check_length(text, share * cal.seq_len)
    return loaded


def calibration_windows(tokenizer, loaded: list[tuple[TextSource, int]], cal) -> tuple[torch.Tensor, int]:
    """The calibration windows (each source's seeded ``sample_windows`` share, sources in order) and the
    number of tokens the sources hold."""
    windows, available = [], 0
    for text, share in loaded:
        ids = tokenize(tokenizer, text.text)
        available += ids.numel()
        windows.append(sample_windows(ids, share, cal.seq_len, cal.seed, text.origin))
        del ids
    return torch.cat(windows), available


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text as one 1-D tensor (no special tokens added); the tokenizer's transient
    encodings are returned to the OS (``host_memory.trim_heap``).

    A fast tokenizer's backend encodes without character offsets (``tokenizers``' ``encode_batch_fast``: the
    same ids as calling the tokenizer): SmolLM2's tokenizer on WikiText-2 validation (268 k tokens) took
    106 MiB while it ran instead of 179 (``benchmarks/tokenize_memory.py``). Where that path does not apply
    (:func:`_fast_ids`), the tokenizer is called as usual."""
    ids = _fast_ids(tokenizer, text)
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    tensor = torch.tensor(ids, dtype=torch.long)
    del ids
    trim_heap()
    return tensor


def _fast_ids(tokenizer, text: str) -> list[int] | None:
    """The ids of ``text`` from a fast tokenizer's backend without offsets, or None where that does not apply:
    no ``tokenizers`` backend, one too old for ``encode_batch_fast`` or ``encode_special_tokens``, one set to
    truncate or pad, or one whose special-token splitting differs from the tokenizer's (``split_special_tokens``,
    which a call sets first)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation or backend.padding:
        return None
    if getattr(backend, "encode_special_tokens", None) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def sample_windows(ids: torch.Tensor, samples: int, seq_len: int, seed: int, source: str) -> torch.Tensor:
    """``samples`` distinct non-overlapping windows of ``seq_len`` tokens, chosen by seeded permutation."""
    available = ids.numel() // seq_len
    if available < samples:
        raise SourceError(f"calibration data {source} has {ids.numel()} tokens = {available} windows of "
                          f"{seq_len}; need samples × seq_len = {samples} × {seq_len} = {samples * seq_len}")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(available, generator=generator)[:samples].sort().values
    windows = ids[: available * seq_len].view(available, seq_len)
    return windows[chosen].clone()


def fingerprint(ids: torch.Tensor) -> str:
    """sha256 of the int64 token ids (little-endian bytes)."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
