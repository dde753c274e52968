"""Quantize: calibration-free round-to-nearest weight quantization (the baseline GPTQ is compared to)."""
from __future__ import annotations

import time
from functools import partial
from typing import Any, ClassVar

import torch

from recipe_engine.api import Modifier, ModifierSession, register

from ._experts import quantize_experts
from ._quant import LOG_FILE, GridParameters, bits_per_weight, log_row, rtn, settle_rows


@register
class Quantize(GridParameters, Modifier):
    """Round every targeted decoder-layer weight to the nearest point of its group's min-max grid (RTN).

    Same grid, targets and export as ``GPTQ`` (``lm_head`` and embeddings untouched); needs no data, so its
    rows of ``quantization_log.csv`` have no layer-output errors (only ``weight_error``).
    """

    example: ClassVar[tuple[str, ...]] = ("Quantize<group_size:32>",)  # tiny contract model: widths 64 and 96
    streams = True  # one decoder layer at a time


    @torch.no_grad()
    def apply(self, session: ModifierSession) -> dict[str, Any]:
        count = 0
        for index in session.progress.track(range(len(session.layers)), "Quantize layers"):
            with session.placed(index, on_device=False):  # one layer materialized at a time on a streamed model
                rows = []
                for target in session.adapter.module_roles(self.targets, experts=True):
                    started = time.perf_counter()
                    linear = session.adapter.linear(session.layers[index], target)
                    grid = self.grid(linear.weight.dtype, (index, len(session.layers), target))
                    result = rtn(linear.weight, grid)
                    rows.append(log_row(index, session.adapter.path(target), linear.weight, grid,
                                        result.dequantized, method="rtn", seconds=time.perf_counter() - started))
                    linear.weight.copy_(result.dequantized.to(linear.weight.dtype))
                    count += 1
                    self.mark(session, linear, grid, result.scale, result.zero)
                for tensor in session.adapter.expert_roles(self.targets):  # mixture-of-experts: every expert
                    done = quantize_experts(session, index, tensor, lambda indices: [None] * len(indices), None,
                                            self.grid, 0, None, partial(self.mark, session))
                    rows += done
                    count += len(done)
                session.outputs.add_rows(LOG_FILE, settle_rows(rows), step=self)
        roles = session.adapter.module_roles(self.targets, experts=True)
        return {"quantized_linears": count, "export": self.export, "log": LOG_FILE,
                "format": self.format_line(len(session.layers), roles),
                "bits_per_weight": bits_per_weight(session.outputs.rows(LOG_FILE, step=self), self,
                                                   session.model.dtype)}
