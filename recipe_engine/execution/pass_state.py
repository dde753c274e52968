"""Where a layer-sequential pass stands: what the pass carries from layer to layer and what a resume
checkpoint saves after each finished layer (``recipe_engine.execution.resume``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

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


@dataclass
class SavedPass:
    """A pass as a resume checkpoint saved it: hidden states only, per batch (the keyword arguments they go with
    are captured again when the run resumes), and the original model's states as ``(next, states)``."""

    next_layer: int
    inputs: list[torch.Tensor]
    reports: list[dict[str, Any]]
    targets: list[set[int]]
    reference: tuple[int, list[torch.Tensor]] | None = None

    def resumed(self, captured: Activations, reference: Callable[[], Activations]) -> PassState:
        """The pass state to go on from: the saved states with the keyword arguments and windows of ``captured``
        (this pass's capture) and, for the original model's states, of ``reference()`` (its capture)."""
        walk = None if self.reference is None else ReferenceStates(self.reference[0],
                                                                   reference().replace(self.reference[1]))
        return PassState(self.next_layer, captured.replace(self.inputs), self.reports, self.targets, walk)
