"""Small helpers for the tensors a decoder layer takes and returns."""
from __future__ import annotations

from typing import Any

import torch


def first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer (or a linear) was called with: positional or ``hidden_states``."""
    return args[0] if args else kwargs["hidden_states"]


def hidden_state(output: Any) -> torch.Tensor:
    """A decoder layer's output hidden states (transformers returns a tuple or the tensor itself)."""
    return output[0] if isinstance(output, (tuple, list)) else output
