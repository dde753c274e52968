"""Perplexity as every paper in ``shared/papers`` measures it (the HF / GPTQ WikiText-2 protocol).

* Text: WikiText-2 raw test rows joined with ``"\\n\\n"`` (``data.load_text``), tokenized once, no special
  tokens added (no BOS per window).
* Windows: non-overlapping, ``seq_len`` tokens each, from the start; the tail shorter than a window is
  dropped; ``limit`` keeps the first N windows. Text shorter than one window is an error.
* Loss: each window is an independent forward pass; its first token has no context and is not predicted,
  so a window contributes ``seq_len - 1`` shifted next-token losses (log-softmax in fp32).
  NLL = token-weighted mean over all predicted tokens, PPL = exp(NLL). Since every window has the same
  number of predictions, this equals GPTQ's ``exp(mean over windows of the per-window mean loss)``.
"""
from __future__ import annotations

import math

import torch

from ..errors import SourceError
from ..sources.windows import fingerprint, tokenize


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
    """The first ``limit`` (default: all) complete non-overlapping windows, shape ``(windows, seq_len)``."""
    available = ids.numel() // seq_len
    if available == 0:
        raise SourceError(f"{source}: {ids.numel()} tokens, shorter than one window of {seq_len}")
    count = available if limit is None else min(limit, available)
    return ids[: count * seq_len].view(count, seq_len)


def perplexity(model, tokenizer, text: str, seq_len: int, limit: int | None,
               device: torch.device | str = "cpu", source: str = "text", progress=None) -> dict:
    """Perplexity of ``text``; returns ppl, nll, tokens (predicted), windows (evaluated), windows_available,
    seq_len and the sha256 fingerprint of the evaluated token ids."""
    ids = tokenize(tokenizer, text)
    windows = make_windows(ids, seq_len, limit, source)
    total, count = window_nll(model, windows, torch.device(device), progress)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": windows.shape[0],
            "windows_available": ids.numel() // seq_len, "seq_len": seq_len, "fingerprint": fingerprint(windows)}


def streamed_perplexity(session, text: str, seq_len: int, limit: int | None, source: str = "text") -> dict:
    """``perplexity`` of a streamed model, computed layer by layer over the windows (one layer's weights and
    the windows' hidden states in memory): the session's ``calibration_nll`` on the evaluation windows,
    the same token-weighted next-token NLL as ``window_nll``."""
    ids = tokenize(session.context.tokenizer, text)
    windows = make_windows(ids, seq_len, limit, source)
    nll = session.sibling(session.model, session.stream, calibration=windows).view.calibration_nll()
    return {"ppl": math.exp(nll), "nll": nll, "tokens": windows.shape[0] * (seq_len - 1),
            "windows": windows.shape[0], "windows_available": ids.numel() // seq_len, "seq_len": seq_len,
            "fingerprint": fingerprint(windows)}
