"""Quantize: calibration-free round-to-nearest weight quantization (the baseline GPTQ is compared to)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from recipe_engine.api import Modifier, ModifierSession, register

from ._quant import GridParameters, rtn


@register
class Quantize(GridParameters, Modifier):
    """Round every targeted decoder-layer weight to the nearest point of its group's min-max grid (RTN).

    Same grid, targets and export as ``GPTQ`` (``lm_head`` and embeddings untouched); needs no data.
    """

    example: ClassVar[tuple[str, ...]] = ("Quantize<group_size:32>",)  # tiny contract model: widths 64 and 96
    streams = True  # one decoder layer at a time


    @torch.no_grad()
    def apply(self, session: ModifierSession) -> dict[str, Any]:
        grid, count = self.grid(), 0
        for index in session.progress.track(range(len(session.layers)), "Quantize layers"):
            with session.placed(index, on_device=False):  # one layer materialized at a time on a streamed model
                for target in session.adapter.module_roles(self.targets):
                    linear = session.adapter.linear(session.layers[index], target)
                    result = rtn(linear.weight, grid)
                    linear.weight.copy_(result.dequantized.to(linear.weight.dtype))
                    count += 1
                    if self.export == "compressed-tensors":
                        session.outputs.mark_quantized(linear, grid, result.scale, result.zero)
        return {"quantized_linears": count, "export": self.export}
