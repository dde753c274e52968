"""SLEB: iterative removal of the block whose removal hurts calibration perplexity least (Song et al. 2024)."""
from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from recipe_engine.api import (LayerBudget, Modifier, ModifierSession, budget_field, calibration_nll_bytes, register,
                               remove_layers)

from ._depth import check_search_window, drop_symbolic, require_uniform


def _name(origin: tuple[int, ...]) -> str:
    return "+".join(map(str, origin))


@register
class SLEB(Modifier):
    """Remove ``n`` blocks one at a time, each round the one whose removal gives the lowest calibration NLL.

    Round r evaluates ``NLL(model without removed ∪ {j})`` for every remaining j except the first and the
    last block, removes the argmin (ties: lowest index), and re-scores in the next round (SLEB's
    iterative elimination: the metric is recomputed after every removal). About ``n × layers``
    calibration NLL passes: keep the calibration small, or score only its first ``search_samples`` windows
    × ``search_length`` tokens (the other windows are then left for later steps to fit on).
    """

    streams = True
    needs = ("calibration NLL with each remaining block skipped, re-measured after every removal",)

    n: LayerBudget = budget_field(1, "number of blocks to remove (paper: 20% of the blocks)")
    search_samples: int | None = Field(None, ge=1, description="calibration windows scored, the first ones "
                                                               "(None: all)")
    search_length: int | None = Field(None, ge=2, description="tokens scored per window, its start (None: all)")

    def working_memory(self, shape, tokens: int) -> int:
        """Each probe's calibration NLL over the scored windows (``calibration_nll_bytes``)."""
        return calibration_nll_bytes(shape, self.search_samples or shape.calibration_batch,
                                     self.search_length or shape.calibration_seq_len)

    def passes(self, shape) -> int:
        """Round r scores every remaining block but the first and last: ``Σ_{r<n} (layers − 2 − r)``."""
        return sum(shape.num_layers - 2 - r for r in range(self.n))

    def check_calibration(self, calibration) -> None:
        check_search_window(self, calibration)

    def check(self, shape) -> None:
        if self.n > shape.num_layers - 2:
            raise self.fail(f"n={self.n} is too many: the first and last of the {shape.num_layers} layers "
                            f"are never removed, so at most {max(shape.num_layers - 2, 0)}", field="n")
        require_uniform(self, shape)
        drop_symbolic(shape, self.n)

    shared_ignores = ("n",)  # greedy: the first n rounds of any larger n are this n's rounds

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        """Rounds are only skips until the end, so a sweep extends one shared list of rounds instead of
        recomputing the prefix for every ``n``."""
        rounds: list[tuple[int, dict[str, Any]]] = session.shared(self, "SLEB rounds", list)
        last = len(session.layers) - 1
        samples, length = session.calibration.shape
        probe = session if self.search_samples is None and self.search_length is None else session.branch(
            session.calibration[: self.search_samples or samples, : self.search_length or length], copy=False)
        while len(rounds) < self.n:
            removed = [index for index, _ in rounds]
            scores = {j: probe.calibration_nll(skip=tuple(removed) + (j,))
                      for j in range(1, last) if j not in removed}
            best = min(scores, key=lambda j: (scores[j], j))
            rounds.append((best, {"removed": list(session.layer_origin[best]), "nll": scores[best],
                                  "ppl": math.exp(scores[best]),
                                  "candidates": {_name(session.layer_origin[j]): v for j, v in scores.items()}}))
        remove_layers(session, [index for index, _ in rounds[: self.n]])
        return {"rounds": [record for _, record in rounds[: self.n]], "layers": len(session.layers)}
