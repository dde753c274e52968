"""compressed-tensors ``pack-quantized``: what llm-compressor writes and vLLM, SGLang and transformers (with
the ``compressed-tensors`` package) load. Per quantized linear: ``weight_packed`` (int32, ``32 / b`` codes
per word along the input dimension, signed codes offset by ``2^(b-1)``), ``weight_scale`` ``[rows, groups]``
in the model dtype, ``weight_zero_point`` (asymmetric grids; signed, packed along rows: int32
``[ceil(rows · b / 32), groups]``, what the library's compressor writes and vLLM reads) and ``weight_shape``.
Packing and the ``quantization_config`` come from the ``compressed-tensors`` library itself.

An asymmetric grid's ``quantization_config`` also carries ``dequantize: true``, a loading option transformers
reads from it (vLLM, SGLang and compressed-tensors ignore the key). transformers' default route (5.24 with
compressed-tensors 0.20) builds each linear's ``weight_zero_point`` on the meta device, where the compressor
leaves it unpacked (``[rows, groups]`` int8), so it refuses the packed zero point of every asymmetric
pack-quantized checkpoint, compressed-tensors' own included, as a size mismatch; its ``dequantize`` route runs the
library's ``PackedQuantizationCompressor.decompress`` on the file's tensors instead, the weights the engine reads
bit for bit (tests/test_asym_packed.py)."""
from __future__ import annotations

import math

import torch

from ...numerics.quantization import Grid, QuantizedLinear, grid_codes
from . import Exporter, register


def scheme(grid: Grid):
    """The compressed-tensors ``QuantizationScheme`` of ``grid`` (weights only, every Linear)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # deferred: imports transformers

    args = QuantizationArgs(num_bits=grid.bits, type="int", symmetric=grid.sym,
                            strategy="group" if grid.group_size else "channel", group_size=grid.group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


@register
class CompressedTensors(Exporter):
    name = "compressed-tensors"
    summary = "packed int4/int8 (pack-quantized): vLLM, SGLang, transformers + compressed-tensors"
    checkpoint = True
    packs = True
    packs_experts = True  # transformers dequantizes them at load; vLLM and SGLang read them as fused-MoE weights
    leaves_linears_out = True  # quantization_config's ignore
    suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    record_parts = ("weight_scale", "weight_zero_point")

    def grid_problem(self, bits: int, sym: bool) -> str | None:
        return None if bits in (4, 8) else f"compressed-tensors export needs bits 4 or 8 (got {bits})"

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return weight_dtype

    def layout(self, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """What ``PackedQuantizationCompressor.compress`` returns (checked against it in the tests)."""
        rows, columns = weight.shape
        grid, groups = record.grid, record.scale.shape[1]
        per_word = 32 // grid.bits
        layout = {"weight_packed": ((rows, math.ceil(columns / per_word)), torch.int32),
                  "weight_scale": ((rows, groups), weight.dtype),
                  "weight_shape": ((2,), torch.int64)}
        if not grid.sym:
            layout["weight_zero_point"] = ((math.ceil(rows / per_word), groups), torch.int32)
        return {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in layout.items()}

    def pack(self, name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """Codes from the weight in fp64 (a bf16 weight divided in bf16 can land on the next code), moved to
        the signed compressed-tensors grid (``q - 2^(b-1)``, zero points likewise), packed by the library's
        ``pack_to_int32``: what ``PackedQuantizationCompressor.compress`` writes (checked in the tests)."""
        # deferred: imports transformers
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        grid, offset = record.grid, 2 ** (record.grid.bits - 1)
        codes = grid_codes(name, weight, record)
        packed = {"weight_packed": pack_to_int32((codes - offset).to(torch.int8), grid.bits),
                  "weight_scale": record.scale.to(codes.device, weight.dtype),
                  "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}
        if not grid.sym:
            zero = (record.zero.to(codes.device) - offset).to(torch.int8)
            packed["weight_zero_point"] = pack_to_int32(zero, grid.bits, packed_dim=0)
        return packed

    def quantization_config(self, grid: Grid, ignore: list[str]) -> dict:
        from compressed_tensors.quantization import QuantizationConfig  # deferred: imports transformers

        config = QuantizationConfig(config_groups={"group_0": scheme(grid)}, format="pack-quantized",
                                    quantization_status="compressed", ignore=sorted(ignore))
        dumped = config.model_dump(mode="json", exclude_none=True)
        return dumped if grid.sym else {**dumped, "dequantize": True}  # see the module docstring

    def reads(self, quantization_config: dict) -> bool:
        return quantization_config.get("quant_method") == "compressed-tensors" \
            and quantization_config.get("format") == "pack-quantized"

    def weight_shape(self, shapes: dict[str, tuple[int, ...]], quantization_config: dict) -> tuple[int, int]:
        (group,) = quantization_config["config_groups"].values()
        return shapes["weight_scale"][0], shapes["weight_packed"][1] * 32 // group["weights"]["num_bits"]

    def record(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               quantization_config: dict) -> QuantizedLinear:
        """Signed codes and zero points back on the unsigned grid (``+ 2^(b-1)``); a symmetric grid's zero
        point is ``2^(b-1)``; the scale's stored dtype is the grid's ``scale_dtype``."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # deferred: as above

        (group,) = quantization_config["config_groups"].values()
        args = group["weights"]
        bits, stored = args["num_bits"], tensors["weight_scale"]
        grid = Grid(bits, args.get("group_size"), args["symmetric"], stored.dtype)
        offset = 2 ** (bits - 1)
        if "weight_zero_point" in tensors:
            zero = unpack_from_int32(tensors["weight_zero_point"], bits, stored.shape, packed_dim=0) + offset
        else:
            zero = torch.full(stored.shape, offset)
        return QuantizedLinear(grid, stored.to(torch.float32), zero.to(torch.int16), self.name)

    def bits_and_group(self, quantization_config: dict) -> tuple[int, int | None]:
        (group,) = quantization_config["config_groups"].values()
        return group["weights"]["num_bits"], group["weights"].get("group_size")

    def dequantize(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int], quantization_config: dict,
                   dtype: torch.dtype) -> torch.Tensor:
        """``s (q - z)`` in fp32 (exact: ≤ 24 significant bits), then ``dtype``."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # deferred: as above

        (group,) = quantization_config["config_groups"].values()
        bits = group["weights"]["num_bits"]
        codes = unpack_from_int32(tensors["weight_packed"], bits, torch.Size(shape)).to(torch.float32)
        scale = tensors["weight_scale"].to(torch.float32)
        width = shape[1] // scale.shape[1]
        if "weight_zero_point" in tensors:
            zero = unpack_from_int32(tensors["weight_zero_point"], bits, torch.Size(scale.shape), packed_dim=0)
            codes = codes - zero.to(torch.float32).repeat_interleave(width, dim=1)
        return (scale.repeat_interleave(width, dim=1) * codes).to(dtype)
