"""Where a layer-sequential pass stands: what the pass carries from layer to layer and what a resume
checkpoint saves after each finished layer (``recipe_engine.execution.resume``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ReferenceStates:
    """The original model's hidden states in lockstep with a pass: after its original layers ``< next``,
    one tensor per batch, with the keyword arguments its layers take (None until captured again after a
    resume)."""

    next: int
    states: list[torch.Tensor]
    kwargs_list: list[dict[str, Any]] | None = None


@dataclass
class PassState:
    """A pass after a finished layer: the next layer to run, its inputs (one tensor per batch), the
    per-step reports so far, each step's target layers, and the original model's states (when a step
    follows the original model; else None)."""

    next_layer: int
    inputs: list[torch.Tensor]
    reports: list[dict[str, Any]]
    targets: list[set[int]]
    reference: ReferenceStates | None = None

