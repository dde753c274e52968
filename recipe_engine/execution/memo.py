"""Work shared by the variants of a sweep (``recipe sweep``): computed once, reused by every variant.

A variant differs from its siblings only in step parameters, so whatever a step computes from the model
state *before* it, independently of some of its own parameters (declared in the step's ``shared_ignores``,
e.g. FlattenAdjacent's similarity matrix does not depend on ``n``), is the same for every variant that
reached that state the same way. The key is therefore: the label, the step's name and parameters minus
``shared_ignores``, and the canonical parameters of every step completed before it in this run. The
calibration capture (hidden states entering layer 0) depends only on the embedding weights and the
windows: it is reused when the embedding matrix is equal (``torch.equal``) to the one it was taken with.
One memo serves one (model, dtype, calibration) combination; ``recipe sweep`` keeps one per combination.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

import torch


class SharedWork:
    def __init__(self) -> None:
        self._values: dict[tuple, Any] = {}
        self._captures: list[tuple[torch.Tensor, Any]] = []
        #: label → times computed / reused (what ``recipe sweep`` reports and its tests count)
        self.computed: Counter = Counter()
        self.reused: Counter = Counter()

    def step_value(self, step, completed: list[str], label: str, compute: Callable[[], Any]) -> Any:
        params = {k: v for k, v in step.model_dump(mode="json").items() if k not in step.shared_ignores}
        key = (label, step.step_name(), json.dumps(params, sort_keys=True), tuple(completed))
        if key in self._values:
            self.reused[label] += 1
        else:
            self._values[key] = compute()
            self.computed[label] += 1
        return self._values[key]

    def capture(self, embedding: torch.Tensor, compute: Callable[[], Any]) -> Any:
        for weight, value in self._captures:
            if weight.shape == embedding.shape and torch.equal(weight, embedding.detach().cpu()):
                self.reused["calibration capture"] += 1
                return value.copy()  # new lists: a caller rebinding entries cannot alter the memo
        value = compute()
        self._captures.append((embedding.detach().cpu().clone(), value))
        self.computed["calibration capture"] += 1
        return value.copy()  # new lists: a caller rebinding entries cannot alter the memo

