"""Fit and score windows: a deterministic split of the calibration windows for choices made by loss.

A step that compares candidates by the model's loss, some of which fit weights to calibration data (a merge
pruned and refitted, a linear patch) and some of which fit nothing (a dropped layer), must not score a
candidate on the windows it was fitted on: the fitted one would be favoured by its own in-sample error.
:func:`heldout_split` divides the windows into *fit* windows (statistics, refits, searches) and *score*
windows (only ever used to measure the loss of a finished candidate).

Rule: ``k = max(1, ⌊fraction · samples + 1/2⌋)`` score windows, the first ``k`` of
``torch.randperm(samples)`` under a generator seeded with ``seed`` (the calibration's own ``seed`` by
default), sorted; the fit windows are the rest, in order. So the split depends only on ``samples``,
``fraction`` and ``seed``: two steps (or two runs) with the same settings use the same windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Share of the calibration windows held out for scoring unless a step says otherwise.
SCORE_FRACTION = 0.25


@dataclass(frozen=True)
class WindowSplit:
    """Indices (into the calibration windows) of the fit and the score windows; disjoint, sorted."""

    fit: tuple[int, ...]
    score: tuple[int, ...]

    def record(self) -> dict[str, list[int]]:
        return {"fit_windows": list(self.fit), "score_windows": list(self.score)}


def heldout_split(samples: int, seed: int, fraction: float = SCORE_FRACTION) -> WindowSplit:
    """The fit / score split of ``samples`` calibration windows (see the module docstring)."""
    if samples < 2:
        raise ValueError(f"a held-out split needs at least 2 calibration windows (got {samples})")
    if not 0 < fraction < 1:
        raise ValueError(f"the score fraction must lie strictly between 0 and 1 (got {fraction})")
    count = min(samples - 1, max(1, math.floor(fraction * samples + 0.5)))
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed)).tolist()
    score = sorted(order[:count])
    held = set(score)
    return WindowSplit(tuple(i for i in range(samples) if i not in held), tuple(score))
