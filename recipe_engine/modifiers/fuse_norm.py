"""FuseNorm: fold RMSNorm weights into the linears that read them (output-preserving)."""
from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from recipe_engine.api import Modifier, ModifierSession, fold_norm_into, register


@register
class FuseNorm(Modifier):
    """Fold every RMSNorm weight into the projections that read it and set the norm weights to 1.

    q/k/v (Phi-3: qkv) absorb the attention norm, gate/up (Phi-3: gate_up) the MLP norm (the adapter's
    ``norm_reads``). Norms after a nonlinearity stay: Qwen3/Gemma 3 per-head q/k norms and Gemma 3's norms
    on each block's output (a gain after ``/rms`` cannot move into the linear before it). The final norm is
    folded into ``lm_head`` only when the embeddings are untied, or with ``untie: true`` (which gives
    ``lm_head`` its own copy of the embedding matrix, adding vocab × hidden parameters). With tied
    embeddings and ``untie: false`` the final norm is left as it is: folding it into a tied matrix would
    also rescale the input embeddings. Output-preserving up to floating-point rounding.
    """

    final_norm: bool = Field(True, description="also fold the final norm into lm_head when allowed")
    untie: bool = Field(False, description="untie lm_head from the embeddings so the final norm can be folded")

    streams = True
    preserves_outputs = True

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        adapter, model = session.adapter, session.model
        for index in session.progress.track(range(len(session.layers)), "FuseNorm layers"):
            with session.placed(index, on_device=False):
                layer = session.layers[index]
                for norm, readers in adapter.norm_reads:
                    fold_norm_into(adapter.norm(layer, norm), [adapter.linear(layer, r) for r in readers], adapter)
        head, embeddings = adapter.lm_head(model), adapter.embeddings(model)
        tied = head.weight is embeddings.weight
        folded_final = False
        parts = {id(m): m for m in (embeddings, head, adapter.final_norm(model))}.values()
        with session.placed(*parts, on_device=False):
            if self.final_norm and tied and self.untie:
                head.weight = torch.nn.Parameter(head.weight.detach().clone())
                model.config.tie_word_embeddings = False
                tied = False
            if self.final_norm and not tied:
                fold_norm_into(adapter.final_norm(model), [head], adapter)
                folded_final = True
        session.release(head)  # an untied head is a unit of its own from now on
        return {"layers": len(session.layers), "final_norm_folded": folded_final, "untied": self.untie and folded_final}
