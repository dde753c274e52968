"""The original model beside a layer-sequential pass: its layers run serially on a pass's inputs
(``original_outputs``), and its own hidden states walked in lockstep with the pass (``reference_outputs``),
starting from states an earlier pass kept where it can (``KeptStates``)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..system.host_memory import available_memory
from .activations import Activations
from .pass_state import ReferenceStates

if TYPE_CHECKING:
    from .session import Session


@dataclass
class KeptStates:
    """A reference model's activations kept by an ``as_received`` pass (``LayerPipeline.layer_pass``):
    depth ``d`` (after its layers ``< d``) → its activations, up to ``budget`` bytes."""

    budget: int
    states: dict[int, Activations] = field(default_factory=dict)
    bytes: int = 0

    def add(self, depth: int, states: Activations) -> None:
        """Keep ``states`` (no copy) if they fit in what is left of the budget."""
        size = _size(states)
        if self.bytes + size <= self.budget:
            self.states[depth], self.bytes = states, self.bytes + size

    def take(self, depth: int, after: int) -> ReferenceStates | None:
        """The deepest kept states at a depth in ``(after, depth]`` as a walk's start, or None; every kept
        depth up to ``depth`` is dropped (walks only go deeper)."""
        start = max((d for d in self.states if after < d <= depth), default=None)
        found = None if start is None else ReferenceStates(start, self.states[start])
        for d in [d for d in self.states if d <= depth]:
            self.bytes -= _size(self.states.pop(d))
        return found


def _size(states: Activations) -> int:
    return sum(t.numel() * t.element_size() for t in states)


class ReferenceWalk:
    """One session's view of its reference model (``Session.reference_session``): ``states`` is where the
    walk in lockstep with the current pass stands (saved by a resume checkpoint with the pass); ``kept``,
    on a reference session, the states its ``as_received`` passes kept for the sessions it stands for."""

    def __init__(self, session: "Session"):
        self._session = weakref.ref(session)  # no cycle: a dropped branch is freed at once
        self.states: ReferenceStates | None = None
        self.kept: KeptStates | None = None

    @property
    def session(self) -> "Session":
        return self._session()

    def start_keeping(self) -> KeptStates:
        """Keep this (reference) model's states of the pass now starting, in a quarter of the host memory
        available now (the deepest states that do not fit are walked to instead)."""
        self.kept = KeptStates(available_memory() // 4)
        return self.kept

    @torch.no_grad()
    def reference_outputs(self, index: int) -> Activations:
        """Hidden states of the original model after the last original layer that layer ``index`` covers,
        computed from the original model's own inputs. The original layers advance in lockstep with the
        pass (one extra set of activations in memory), from the deepest kept states on the way when an
        earlier pass kept some; calls must come in increasing layer order."""
        last = max(self.session.layer_origin[index])
        if self.states is not None and self.states.next > last + 1:
            raise RuntimeError(f"reference_outputs({index}) after layer {self.states.next - 1}: calls "
                               f"must come in increasing layer order (the original model is not run twice)")
        reference = self.session.reference_session()
        kept = reference.pipeline.walk.kept
        if kept is not None:
            self.states = kept.take(last + 1, self.states.next if self.states is not None else 0) or self.states
        if self.states is None:
            self.states = ReferenceStates(0, reference.pipeline.capture_inputs())
        self.states.states = self.run_original(range(self.states.next, last + 1), self.states.states)
        self.states.next = last + 1
        return self.states.states

    def run_original(self, indices, states: Activations) -> Activations:
        """Original layers ``indices`` (of the reference model), one after another, over all batches."""
        reference = self.session.reference_session()
        for original in indices:
            with reference.residency.using(original):
                states = reference.pipeline.run_layer(reference.layers[original], states)
        return states
