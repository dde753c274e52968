"""The integer weight grid and the packed checkpoint format (compressed-tensors ``pack-quantized``) the
engine writes for quantizing steps.

Grid (Frantar et al. 2023, GPTQ reference quantizer): per row and group of ``group_size`` input columns,
``x̂ = s (clamp(round(x / s) + z, 0, 2^b - 1) - z)``. Asymmetric: ``s = (max(x⁺) - min(x⁻)) / (2^b - 1)``
with ``x⁺ = max(x, 0)``, ``x⁻ = min(x, 0)`` and ``z = round(-min(x⁻) / s)``; symmetric:
``s = 2 max|x| / (2^b - 1)``, ``z = 2^(b-1)``, which is the compressed-tensors signed grid
``[-2^(b-1), 2^(b-1) - 1]`` with zero point 0. An all-zero row gets the range [-1, 1].

A quantizing step records each linear it quantized with :meth:`Session.mark_quantized` (its grid, scale
and zero point); the engine's checkpoint writer (``recipe_engine.io.checkpoint_writer``) then stores those linears
packed — ``weight_packed`` (int32, ``32 / b`` codes per word), ``weight_scale`` (model dtype),
``weight_zero_point`` (asymmetric grids; packed int32 along rows), ``weight_shape`` — with a
``quantization_config`` that vLLM and transformers' compressed-tensors loader read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    """``bits``-bit integer grid, groups of ``group_size`` input columns (``None``: one group per row)."""

    bits: int
    group_size: int | None
    sym: bool

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    def width(self, columns: int) -> int:
        return self.group_size or columns

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point (each ``[rows]``) of the columns ``w`` [rows, cols] form one group of."""
        xmin = w.min(dim=1).values.clamp(max=0)
        xmax = w.max(dim=1).values.clamp(min=0)
        if self.sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        flat = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
        scale = (xmax - xmin) / self.maxq
        if self.sym:
            zero = torch.full_like(scale, (self.maxq + 1) / 2)
        else:
            zero = torch.round(-xmin / scale)
        return scale, zero

    def codes(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Integer codes in ``[0, 2^b - 1]``; ``scale``/``zero`` broadcast against ``w``."""
        return torch.clamp(torch.round(w / scale) + zero, 0, self.maxq)

    def fake(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Dequantized ``s (q - z)``."""
        return scale * (self.codes(w, scale, zero) - zero)

    def expand(self, per_group: torch.Tensor, columns: int) -> torch.Tensor:
        """``[rows, groups]`` → ``[rows, columns]`` (each group's value over its columns)."""
        return per_group.repeat_interleave(self.width(columns), dim=1)[:, :columns]

    def scheme(self):
        """The compressed-tensors ``QuantizationScheme`` of this grid (weights only, every Linear)."""
        # deferred: compressed-tensors is an optional extra (vLLM export) that imports transformers
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        args = QuantizationArgs(num_bits=self.bits, type="int", symmetric=self.sym,
                                strategy="group" if self.group_size else "channel", group_size=self.group_size)
        return QuantizationScheme(targets=["Linear"], weights=args)


@dataclass
class QuantizedLinear:
    """What the writer needs to pack one linear: its grid and per-group ``[rows, groups]`` scale (fp32; the
    file stores it in the model dtype) and zero point (integer codes ``0 … 2^b − 1``, int16)."""

    grid: Grid
    scale: torch.Tensor
    zero: torch.Tensor


def check_on_grid(name: str, weight: torch.Tensor, record: QuantizedLinear) -> None:
    """Refuse to pack a weight a later step moved off its grid (e.g. merged LoRA adapters)."""
    grid, w = record.grid, weight.detach().to(torch.float64)
    step = grid.expand(record.scale.to(torch.float64), w.shape[1])
    off = ((w - grid.fake(w, step, grid.expand(record.zero.to(torch.float64), w.shape[1]))).abs() / step).max()
    if off > 0.05:
        raise RuntimeError(f"{name}: weights are {float(off):.2f} grid steps off their quantization grid; "
                           f"a step after quantization changed them, so they cannot be packed")


def packed_layout(weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The packed tensors' suffixes, dtypes and shapes (meta tensors) for a ``rows × columns`` weight, in
    file order — what ``PackedQuantizationCompressor.compress`` returns (checked against it in tests)."""
    rows, columns = weight.shape
    grid, groups = record.grid, record.scale.shape[1]
    per_word = 32 // grid.bits
    layout = {"weight_packed": ((rows, math.ceil(columns / per_word)), torch.int32),
              "weight_scale": ((rows, groups), weight.dtype),
              "weight_shape": ((2,), torch.int64)}
    if not grid.sym:
        layout["weight_zero_point"] = ((math.ceil(rows / per_word), groups), torch.int32)
    return {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in layout.items()}


def pack(name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The linear's packed tensors (keys as :func:`packed_layout`). Zero points move to the signed
    compressed-tensors grid: ``z_ct = z - 2^(b-1)``."""
    # deferred: compressed-tensors is an optional extra (vLLM export) that imports transformers
    from compressed_tensors.compressors import PackedQuantizationCompressor

    check_on_grid(name, weight, record)
    grid = record.grid
    packed = PackedQuantizationCompressor.compress(
        {"weight": weight.detach().cpu(), "weight_scale": record.scale.to(weight.dtype),
         "weight_zero_point": (record.zero - 2 ** (grid.bits - 1)).to(torch.int8)}, grid.scheme())
    return {key: packed[key] for key in packed_layout(weight, record)}


def quantization_config(grid: Grid, ignore: list[str]) -> dict:
    """``config.json``'s ``quantization_config`` for linears packed on ``grid`` (``ignore``: the others)."""
    # deferred: compressed-tensors is an optional extra (vLLM export) that imports transformers
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": grid.scheme()}, format="pack-quantized",
                                quantization_status="compressed", ignore=sorted(ignore))
    return config.model_dump(mode="json", exclude_none=True)
