"""ShortGPT: remove the layers with the lowest Block Influence (Men et al. 2024, §3)."""
from __future__ import annotations

from typing import Any

import torch

from recipe_engine.api import LayerBudget, Modifier, ModifierSession, RecipeError, budget_field, register, remove_layers

from ._depth import drop_symbolic, require_uniform, token_mask


@torch.no_grad()
def block_influence(session: ModifierSession) -> list[float]:
    """``BI_i = 1 − E_{X,t} cos(X_{i,t}, X_{i+1,t})`` (ShortGPT Eq. 1) for every current layer.

    ``X_i`` is layer i's input and ``X_{i+1}`` its output; the cosine is taken per token along the hidden
    axis in fp32 and averaged (fp64 sums) over every non-pad calibration token. No NaN is masked: a NaN
    score is an error.
    """
    masks = [token_mask(session, batch) for batch in session.batches]
    scores: dict[int, float] = {}

    def visit(index: int, inputs, outputs) -> None:
        total, count = 0.0, 0
        for x, y, mask in zip(inputs, outputs, masks):
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
            total += float(cos[mask.to(cos.device)].double().sum())
            count += int(mask.sum())
        scores[index] = 1.0 - total / count

    session.layer_pass(visit, "ShortGPT block influence")
    bad = [i for i, s in scores.items() if s != s]
    if bad:
        raise RecipeError(f"Block Influence is NaN for layers {bad} (non-finite activations)", modifier="ShortGPT")
    return [scores[i] for i in range(len(session.layers))]


@register
class ShortGPT(Modifier):
    """Remove the ``n`` layers with the lowest Block Influence (1 − mean input/output cosine per token).

    One calibration pass; the output is a stock checkpoint with ``n`` fewer layers. The paper removes
    about 27% of the layers (9 of 32 on Llama-2-7B); ``n`` is a count so recipes state it per model.
    """

    streams = True
    calibration_passes = 1
    shared_ignores = ("n",)  # the scores come before the count
    needs = ("per-token cosine between every layer's input and output",)

    n: LayerBudget = budget_field(1, "number of layers to remove (paper: 9 of 32 on Llama-2-7B)")

    def check(self, shape) -> None:
        if self.n >= shape.num_layers:
            raise self.fail(f"n={self.n} must be smaller than the {shape.num_layers} layers the model has "
                            f"at this step", field="n")
        require_uniform(self, shape)
        drop_symbolic(shape, self.n)

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        scores = session.shared(self, "ShortGPT block influence", lambda: block_influence(session))
        order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
        removed = remove_layers(session, order[: self.n])
        return {"block_influence": scores, "removed": [list(o) for o in removed],
                "layers": len(session.layers)}
