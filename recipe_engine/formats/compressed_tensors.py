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
bit for bit (tests/test_asym_packed.py).

Linears on several grids (a step's ``overrides``) are written as one config group per grid: the grid most linears
take targets ``Linear`` (the last group), each other one names its linears by ``re:`` patterns of their exact
names. A module takes the group of its most specific match, as compressed-tensors' ``apply_quantization_config``
(``match_targets``: an exact name, then a ``re:`` pattern, then a class) and vLLM's ``find_matched_target`` (a
name or pattern before a class) choose; the readers here choose so too (:func:`weights_args`). vLLM serves q/k/v
and gate/up as one fused linear (``qkv_proj``, ``gate_up_proj``) matched by its own name before its class, so
their pattern names the fused linear too."""
from __future__ import annotations

import math
import re
from collections import Counter

import torch

from ..architectures.adapters import FUSED_ROLES
from ..errors import SourceError
from ..numerics.quantization import Grid, QuantizedLinear, block_rows, grid_codes
from . import Exporter, register


def scheme(grid: Grid, targets: tuple[str, ...] = ("Linear",)):
    """The compressed-tensors ``QuantizationScheme`` of ``grid`` (weights only) for the modules ``targets``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # deferred: imports transformers

    args = QuantizationArgs(num_bits=grid.bits, type="int", symmetric=grid.sym,
                            strategy="group" if grid.group_size else "channel", group_size=grid.group_size)
    return QuantizationScheme(targets=list(targets), weights=args)


def name_patterns(names: list[str]) -> list[str]:
    """``re:`` targets matching exactly the modules ``names``; the members of a fused linear under one parent
    (``FUSED_ROLES``: q/k/v, gate/up) share one that matches vLLM's fused name too:
    ``re:^model\\.layers\\.0\\.self_attn\\.(q_proj|k_proj|v_proj|qkv_proj)$``."""
    present, patterns, done = set(names), [], set()
    for name in names:
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f, members in FUSED_ROLES.items() if leaf in members
                      and all(f"{parent}.{m}" in present for m in members)), None)
        if fused is None:
            patterns.append(f"re:^{re.escape(name)}$")
        elif (parent, fused) not in done:
            done.add((parent, fused))
            patterns.append(f"re:^{re.escape(parent)}\\.({'|'.join((*FUSED_ROLES[fused], fused))})$")
    return patterns


def _main_group(quantization_config: dict) -> tuple[str, dict]:
    """The config group targeting ``Linear`` (the grid of most linears), else the first: ``(name, group)``."""
    groups = quantization_config["config_groups"]
    return next(((name, group) for name, group in groups.items() if "Linear" in group["targets"]),
                next(iter(groups.items())))


def weights_args(quantization_config: dict, name: str) -> dict:
    """The ``weights`` arguments of the config group that quantizes the packed linear ``name`` (its weight,
    ``<linear>.weight``): of the most specific target matching the module, as compressed-tensors' ``match_targets``
    orders them (an exact name, then a ``re:`` pattern by ``re.match``, then the class ``Linear``); the last group
    naming a target wins, as in its ``apply_quantization_config``."""
    module = name.removesuffix(".weight")
    groups = {target: group for group in quantization_config["config_groups"].values()
              for target in group["targets"]}
    for target in sorted(groups, key=lambda t: ("re:" in t, t)):
        if target == module or target.startswith("re:") and re.match(target.removeprefix("re:"), module):
            return groups[target]["weights"]
    if "Linear" in groups:
        return groups["Linear"]["weights"]
    raise SourceError(f"{module}: packed, but no config group of quantization_config targets it")


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
    metadata = ("weight_shape",)

    def grid_problem(self, bits: int, sym: bool) -> str | None:
        return None if bits in (4, 8) else f"compressed-tensors export needs bits 4 or 8 (got {bits})"

    def mixed_grids_problem(self, sym: bool) -> str | None:
        if sym:
            return None
        return ("overrides need symmetric grids in compressed-tensors: transformers reads an asymmetric checkpoint's "
                "packed zero points only by dequantizing every linear with one config group (5.24, get_dense_scheme); "
                "use sym: true, or export: dequantized")

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return weight_dtype

    def layout(self, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """What ``PackedQuantizationCompressor.compress`` returns (checked against it in the tests)."""
        rows, columns = weight.shape
        grid, groups = record.grid, record.scale.shape[1]
        per_word = 32 // grid.bits
        layout = {"weight_packed": ((rows, math.ceil(columns / per_word)), torch.int32),
                  "weight_scale": ((rows, groups), grid.scale_dtype or weight.dtype),
                  "weight_shape": ((2,), torch.int64)}
        if not grid.sym:
            layout["weight_zero_point"] = ((math.ceil(rows / per_word), groups), torch.int32)
        return {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in layout.items()}

    def pack(self, name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """Codes from the weight in fp64 (a bf16 weight divided in bf16 can land on the next code), moved to
        the signed compressed-tensors grid (``q - 2^(b-1)``, zero points likewise), packed by the library's
        ``pack_to_int32`` (on the host a block of rows at a time, as :func:`grid_codes` computes them): what
        ``PackedQuantizationCompressor.compress`` writes (checked in the tests)."""
        # deferred: imports transformers
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        grid, offset = record.grid, 2 ** (record.grid.bits - 1)
        codes = grid_codes(name, weight, record)
        rows, columns = codes.shape
        words = torch.empty((rows, math.ceil(columns * grid.bits / 32)), dtype=torch.int32, device=codes.device)
        block = block_rows(codes, 4)  # pack_to_int32's int32 temporaries
        for first in range(0, rows, block):  # each row packs on its own: on the host, a block of rows at a time
            words[first:first + block] = pack_to_int32((codes[first:first + block] - offset).to(torch.int8), grid.bits)
        packed = {"weight_packed": words,
                  "weight_scale": record.scale.to(codes.device, grid.scale_dtype or weight.dtype),
                  "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}
        if not grid.sym:
            zero = (record.zero.to(codes.device) - offset).to(torch.int8)
            packed["weight_zero_point"] = pack_to_int32(zero, grid.bits, packed_dim=0)
        return packed

    def quantization_config(self, grids: dict[str, Grid], ignore: list[str]) -> dict:
        """One config group per grid (bits, group size, symmetry): the grids other than the one most linears take
        (the first in file order among equals) in file order, each naming its linears (:func:`name_patterns`), then
        that one targeting ``Linear`` (last, so that compressed-tensors' ``match_named_modules``, which stops at a
        module's first target in config order, meets every pattern and warns of none unmatched)."""
        from compressed_tensors.quantization import QuantizationConfig  # deferred: imports transformers

        kinds = {name: (grid.bits, grid.group_size, grid.sym) for name, grid in grids.items()}
        grid_of = {kind: grid for kind, grid in zip(kinds.values(), grids.values())}
        main = Counter(kinds.values()).most_common(1)[0][0]  # ties: the first counted
        others = [kind for kind in dict.fromkeys(kinds.values()) if kind != main]
        groups = {f"group_{index}": scheme(grid_of[kind], name_patterns([n for n in kinds if kinds[n] == kind]))
                  for index, kind in enumerate(others)}
        groups[f"group_{len(others)}"] = scheme(grid_of[main])
        config = QuantizationConfig(config_groups=groups, format="pack-quantized",
                                    quantization_status="compressed", ignore=sorted(ignore))
        dumped = config.model_dump(mode="json", exclude_none=True)
        symmetric = all(grid.sym for grid in grids.values())
        return dumped if symmetric else {**dumped, "dequantize": True}  # see the module docstring

    def reads(self, quantization_config: dict) -> bool:
        return quantization_config.get("quant_method") == "compressed-tensors" \
            and quantization_config.get("format") == "pack-quantized"

    def weight_shape(self, name: str, shapes: dict[str, tuple[int, ...]],
                     quantization_config: dict) -> tuple[int, int]:
        bits = weights_args(quantization_config, name)["num_bits"]
        return shapes["weight_scale"][0], shapes["weight_packed"][1] * 32 // bits

    def record(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               quantization_config: dict) -> QuantizedLinear:
        """Signed codes and zero points back on the unsigned grid (``+ 2^(b-1)``); a symmetric grid's zero
        point is ``2^(b-1)``; the scale's stored dtype is the grid's ``scale_dtype``."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # deferred: as above

        args = weights_args(quantization_config, name)
        bits, stored = args["num_bits"], tensors["weight_scale"]
        grid = Grid(bits, args.get("group_size"), args["symmetric"], stored.dtype)
        offset = 2 ** (bits - 1)
        if "weight_zero_point" in tensors:
            zero = unpack_from_int32(tensors["weight_zero_point"], bits, stored.shape, packed_dim=0) + offset
        else:
            zero = torch.full(stored.shape, offset)
        return QuantizedLinear(grid, stored.to(torch.float32), zero.to(torch.int16), self.name)

    def bits_and_group(self, quantization_config: dict) -> tuple[int, int | None]:
        args = _main_group(quantization_config)[1]["weights"]
        return args["num_bits"], args.get("group_size")

    def describe(self, quantization_config: dict) -> str:
        """``compressed-tensors, 4-bit, groups of 64``, and the other groups' bits: ``; 8-bit (group_0) for some
        linears``."""
        main = _main_group(quantization_config)[0]
        return super().describe(quantization_config) + "".join(
            f"; {group['weights']['num_bits']}-bit ({name}) for some linears"
            for name, group in quantization_config["config_groups"].items() if name != main)

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                   quantization_config: dict, dtype: torch.dtype) -> torch.Tensor:
        """``s (q - z)`` in fp32 (exact: ≤ 24 significant bits), then ``dtype``."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # deferred: as above

        bits = weights_args(quantization_config, name)["num_bits"]
        codes = unpack_from_int32(tensors["weight_packed"], bits, torch.Size(shape)).to(torch.float32)
        scale = tensors["weight_scale"].to(torch.float32)
        width = shape[1] // scale.shape[1]
        if "weight_zero_point" in tensors:
            zero = unpack_from_int32(tensors["weight_zero_point"], bits, torch.Size(scale.shape), packed_dim=0)
            codes = codes - zero.to(torch.float32).repeat_interleave(width, dim=1)
        return (scale.repeat_interleave(width, dim=1) * codes).to(dtype)
