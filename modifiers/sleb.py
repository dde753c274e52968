"""SLEB: iterative removal of the block whose removal hurts calibration perplexity least (Song et al. 2024)."""
from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from recipe_engine import Modifier, register

from ._depth import drop_symbolic, remove_layers, require_uniform


def _name(origin: tuple[int, ...]) -> str:
    return "+".join(map(str, origin))


@register
class SLEB(Modifier):
    """Remove ``n`` blocks one at a time, each round the one whose removal gives the lowest calibration NLL.

    Round r evaluates ``NLL(model without removed ∪ {j})`` for every remaining j except the first and the
    last block, removes the argmin (ties: lowest index), and re-scores in the next round (SLEB's
    iterative elimination: the metric is recomputed after every removal). About ``n × layers``
    calibration NLL passes: keep the calibration small.
    """

    streams = True
    needs = ("calibration NLL with each remaining block skipped, re-measured after every removal",)

    n: int = Field(1, ge=1, description="number of blocks to remove (paper: 20% of the blocks)")

    def check(self, shape) -> None:
        if self.n > shape.num_layers - 2:
            raise self.fail(f"n={self.n} is too many: the first and last of the {shape.num_layers} layers "
                            f"are never removed, so at most {max(shape.num_layers - 2, 0)}", field="n")
        require_uniform(self, shape)
        drop_symbolic(shape, self.n)

    def apply(self, session) -> dict[str, Any]:
        removed: list[int] = []
        rounds = []
        last = len(session.layers) - 1
        for _ in range(self.n):
            scores = {j: session.calibration_nll(skip=tuple(removed) + (j,))
                      for j in range(1, last) if j not in removed}
            best = min(scores, key=lambda j: (scores[j], j))
            removed.append(best)
            rounds.append({"removed": list(session.layer_origin[best]), "nll": scores[best],
                           "ppl": math.exp(scores[best]),
                           "candidates": {_name(session.layer_origin[j]): v for j, v in scores.items()}})
        remove_layers(session, removed)
        return {"rounds": rounds, "layers": len(session.layers)}
