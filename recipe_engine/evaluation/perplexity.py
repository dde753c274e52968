"""Perplexity as every paper in ``shared/papers`` measures it.

WikiText-2 raw test rows joined with ``"\\n\\n"``, tokenized once, cut into non-overlapping windows of
``seq_len`` tokens (the tail shorter than a window is dropped); NLL is the token-weighted mean over every
predicted token (``seq_len - 1`` per window), PPL = exp(NLL).
"""
from __future__ import annotations

import math

import torch

from ..data import tokenize
from ..errors import SourceError


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, device: torch.device, progress=None) -> tuple[float, int]:
    """Sum of next-token NLL (fp32 log-softmax) and number of predicted tokens over ``windows``."""
    total, count = 0.0, 0
    rows = progress.track(windows, "perplexity windows") if progress is not None else windows
    for window in rows:
        ids = window.unsqueeze(0).to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total += float(loss)
        count += ids.shape[1] - 1
    return total, count


def make_windows(ids: torch.Tensor, seq_len: int, limit: int | None, source: str) -> torch.Tensor:
    available = ids.numel() // seq_len
    if available == 0:
        raise SourceError(f"{source}: {ids.numel()} tokens, shorter than one window of {seq_len}")
    count = available if limit is None else min(limit, available)
    return ids[: count * seq_len].view(count, seq_len)


def perplexity(model, tokenizer, text: str, seq_len: int = 2048, limit: int | None = None,
               device: torch.device | str = "cpu", source: str = "text", progress=None) -> dict:
    """Perplexity of ``text``; returns ``{"ppl", "nll", "tokens", "windows", "windows_available"}``."""
    ids = tokenize(tokenizer, text)
    windows = make_windows(ids, seq_len, limit, source)
    total, count = window_nll(model, windows, torch.device(device), progress)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": windows.shape[0],
            "windows_available": ids.numel() // seq_len, "seq_len": seq_len}
