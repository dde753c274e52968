"""Where a layer-sequential pass stands: what the pass carries from layer to layer and what a resume
checkpoint saves after each finished layer (``recipe_engine.execution.resume``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .activations import Activations


@dataclass
class ReferenceStates:
    """The original model's activations in lockstep with a pass: after its original layers ``< next``."""

    next: int
    states: Activations


@dataclass
class PassState:
    """A pass after a finished layer: the next layer to run, its input activations, the per-step reports so
    far, each step's target layers, and the original model's states (when a step follows the original model;
    else None)."""

    next_layer: int
    inputs: Activations
    reports: list[dict[str, Any]]
    targets: list[set[int]]
    reference: ReferenceStates | None = None
