"""Helpers shared by the depth-pruning modifiers (ShortGPT, LaCo, SLEB, LinearPatch); not a modifier.
Removing layers is the session's (``Session.remove_layers``)."""
from __future__ import annotations

import torch

from recipe_engine.api import ModelShape


def token_mask(session, batch: torch.Tensor) -> torch.Tensor:
    """True for tokens that count in statistics: all of them, except the tokenizer's pad token if it has one."""
    pad = getattr(session.tokenizer, "pad_token_id", None)
    return batch != pad if pad is not None else torch.ones_like(batch, dtype=torch.bool)


def require_uniform(step, shape: ModelShape) -> None:
    """Fail unless every layer has the same widths: which layers a data-driven step removes is only known
    at run time, so the symbolic shape can follow only a count when the layers are interchangeable."""
    widths = {(layer.num_heads, layer.num_kv_heads, layer.intermediate_size) for layer in shape.layers}
    if len(widths) > 1:
        raise step.fail("needs layers of equal widths at this step (an earlier step left layers of "
                        f"different widths: {sorted(widths)}); place it before that step")


def drop_symbolic(shape: ModelShape, count: int) -> None:
    """Symbolic removal of ``count`` layers (which ones is data-dependent; the shape drops the last)."""
    shape.layers = shape.layers[: shape.num_layers - count]
