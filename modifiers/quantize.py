"""Quantize: calibration-free round-to-nearest weight quantization (the baseline GPTQ is compared to)."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, PositiveInt, field_validator

from recipe_engine import Modifier, register

from ._quant import LINEARS, Grid, grid_problem, known_targets, rtn


@register
class Quantize(Modifier):
    """Round every targeted decoder-layer weight to the nearest point of its group's min-max grid (RTN).

    Same grid, targets and export as ``GPTQ`` (``lm_head`` and embeddings untouched); needs no data.
    """

    method: Literal["rtn"] = Field("rtn", description="rounding method (round-to-nearest)")

    @property
    def quantizes(self) -> bool:  # packed weights must stay on their grid; dequantized ones may change
        return self.export == "compressed-tensors"

    example: ClassVar[tuple[str, ...]] = ("Quantize<group_size:32>",)  # tiny contract model: widths 64 and 96
    streams = True  # one decoder layer at a time

    bits: int = Field(4, ge=2, le=8, description="integer bits per weight")
    group_size: PositiveInt | None = Field(128, description="input columns sharing one scale (null: per row)")
    sym: bool = Field(True, description="symmetric grid (zero point at the middle); false: min-max")
    targets: list[str] = Field(list(LINEARS), min_length=1, description="linear roles of each decoder layer "
                               "(a fused Phi-3 qkv/gate_up linear: all its members)")
    export: Literal["dequantized", "compressed-tensors"] = Field(
        "dequantized", description="checkpoint format: dequantized model-dtype weights or packed int (vLLM)")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        return known_targets(value)

    def check(self, shape) -> None:
        problem = grid_problem(shape, self.targets, self.group_size, self.bits, self.export)
        if problem:
            raise self.fail(*problem)

    @torch.no_grad()
    def apply(self, session) -> dict[str, Any]:
        grid, count = Grid(self.bits, self.group_size, self.sym), 0
        for index in session.progress.track(range(len(session.layers)), "Quantize layers"):
            with session.loaded(index):  # one layer materialized at a time on a streamed model
                for target in session.adapter.module_roles(self.targets):
                    linear = session.adapter.linear(session.layers[index], target)
                    result = rtn(linear.weight, grid)
                    linear.weight.copy_(result.dequantized.to(linear.weight.dtype))
                    count += 1
                    if self.export == "compressed-tensors":
                        session.mark_quantized(linear, grid, result.scale, result.zero)
        return {"quantized_linears": count, "export": self.export}
