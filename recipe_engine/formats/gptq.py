"""GPTQ v1 (``checkpoint_format: gptq``): the form AutoGPTQ introduced and GPTQModel, vLLM, SGLang and
transformers (with ``gptqmodel``) load. Per quantized linear ``[rows, columns]`` with ``G`` groups:

- ``qweight`` int32 ``[columns · b / 32, rows]``: the codes of the transposed weight, ``32 / b`` consecutive
  input columns per word, the first in the lowest bits;
- ``qzeros`` int32 ``[G, rows · b / 32]``: the zero points **minus one** (v1's convention, undone by every
  v1 reader as ``unpack(qzeros) + 1``), packed the same way along the output dimension;
- ``scales`` fp16 ``[G, rows]``; ``g_idx`` int32 ``[columns]``: each input column's group
  (``column // group_size``: the engine's groups are contiguous, also with ``act_order``, so ``desc_act`` is
  false).

The dequantized weight is ``scales[g_idx] · (q − zeros[g_idx])``. A zero point 0 cannot be stored (``0 − 1``
wraps to all ones), so asymmetric grids are refused; symmetric grids store ``2^(b-1) − 1``.
"""
from __future__ import annotations

import torch

from ..numerics.quantization import Grid, QuantizedLinear, grid_codes
from . import Exporter, register

BITS = (2, 4, 8)


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative codes ``[n, m]`` along dim 0 into int32 ``[n · bits / 32, m]`` (first code lowest)."""
    per_word = 32 // bits
    grouped = codes.to(torch.int64).reshape(-1, per_word, codes.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device).reshape(1, per_word, 1)
    words = (grouped << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: int64 codes ``[n · 32 / bits, m]``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64).reshape(1, per_word, 1)
    codes = (words.to(torch.int64).unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(-1, words.shape[1])


def _zero_points(qzeros: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """The grid's zero points ``[groups, rows]`` from ``qzeros`` (stored minus one, packed along the rows)."""
    return unpack_words(qzeros.t(), bits).t()[:, :rows] + 1


@register
class GPTQv1(Exporter):
    name = "gptq"
    summary = "GPTQ v1 qweight/qzeros/scales/g_idx: vLLM, SGLang, GPTQModel, transformers + gptqmodel"
    checkpoint = True
    packs = True
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    record_parts = ("qzeros", "scales", "g_idx")

    def grid_problem(self, bits: int, sym: bool) -> str | None:
        if bits not in BITS:
            return f"gptq export needs bits {', '.join(map(str, BITS))} (got {bits})"
        if not sym:
            return "gptq export stores zero points minus one, so it needs sym: true (or export: compressed-tensors)"
        return None

    def mixed_grids_problem(self, sym: bool) -> str | None:
        return ("export gptq stores one grid for every linear (one bits and group_size in its quantization_config), "
                "so it cannot hold overrides; use export: compressed-tensors or dequantized")

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return torch.float16

    def scale_dtype_problem(self, dtype: torch.dtype) -> str | None:
        if dtype == torch.float16:
            return None
        return ("export gptq stores its scales in float16; use scale_dtype: float16 or model "
                "(or export: compressed-tensors)")

    def layout(self, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        rows, columns = weight.shape
        groups, bits = record.scale.shape[1], record.grid.bits
        shapes = {"qweight": ((columns * bits // 32, rows), torch.int32),
                  "qzeros": ((groups, rows * bits // 32), torch.int32),
                  "scales": ((groups, rows), torch.float16), "g_idx": ((columns,), torch.int32)}
        return {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in shapes.items()}

    def pack(self, name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        grid, (rows, columns) = record.grid, weight.shape
        per_word = 32 // grid.bits
        if columns % per_word or rows % per_word:
            raise RuntimeError(f"{name}: {rows} × {columns} is not a multiple of {per_word} codes per int32 word")
        codes = grid_codes(name, weight, record)
        width = grid.width(columns)
        return {"qweight": pack_words(codes.t().contiguous(), grid.bits),
                "qzeros": pack_words(record.zero.to(torch.int64) - 1, grid.bits).t().contiguous(),
                "scales": record.scale.t().to(torch.float16).contiguous(),
                "g_idx": (torch.arange(columns) // width).to(torch.int32)}

    def quantization_config(self, grids: dict[str, Grid], ignore: list[str]) -> dict:
        kinds = {(grid.bits, grid.group_size, grid.sym) for grid in grids.values()}
        if len(kinds) > 1:
            raise RuntimeError(f"gptq export stores one grid, and the linears are on {len(kinds)}: {sorted(kinds)}")
        grid = next(iter(grids.values()))
        return {"quant_method": "gptq", "bits": grid.bits, "group_size": grid.group_size or -1,
                "desc_act": False, "sym": grid.sym, "checkpoint_format": "gptq", "true_sequential": True,
                "lm_head": False}

    def reads(self, quantization_config: dict) -> bool:
        return quantization_config.get("quant_method") == "gptq" \
            and quantization_config.get("checkpoint_format", "gptq") == "gptq"

    def weight_shape(self, name: str, shapes: dict[str, tuple[int, ...]],
                     quantization_config: dict) -> tuple[int, int]:
        return shapes["scales"][1], shapes["g_idx"][0]

    def record(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               quantization_config: dict) -> QuantizedLinear | None:
        """Scales and zero points (``unpack(qzeros) + 1``) as ``[rows, groups]``; None when ``g_idx`` is not
        consecutive groups (act-order checkpoints that reorder groups)."""
        bits, group = self.bits_and_group(quantization_config)
        width = group or shape[1]
        if not torch.equal(tensors["g_idx"].long(), torch.arange(shape[1]) // width):
            return None
        zero = _zero_points(tensors["qzeros"], bits, shape[0])
        grid = Grid(bits, group, bool(quantization_config.get("sym", True)), tensors["scales"].dtype)
        return QuantizedLinear(grid, tensors["scales"].t().to(torch.float32).contiguous(),
                               zero.t().to(torch.int16).contiguous(), self.name)

    def bits_and_group(self, quantization_config: dict) -> tuple[int, int | None]:
        group = quantization_config.get("group_size", -1)
        return quantization_config["bits"], None if group in (None, -1) else group

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                   quantization_config: dict, dtype: torch.dtype) -> torch.Tensor:
        """``scales[g_idx] · (q − (unpack(qzeros) + 1)[g_idx])`` in fp32 (exact), then ``dtype``."""
        bits = quantization_config["bits"]
        codes = unpack_words(tensors["qweight"], bits)[: shape[1]]                 # [columns, rows]
        zeros = _zero_points(tensors["qzeros"], bits, shape[0])                     # [groups, rows]
        g_idx = tensors["g_idx"].long()
        scales = tensors["scales"].to(torch.float32)
        weight = scales[g_idx] * (codes - zeros[g_idx]).to(torch.float32)
        return weight.t().contiguous().to(dtype)
