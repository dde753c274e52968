"""A packed 4-bit checkpoint timed as served: each quantized ``nn.Linear`` becomes an :class:`Int4Linear`
that multiplies with PyTorch's int4 weight-only kernel (``aten._weight_int4pack_mm``, tinygemm, on CUDA;
``_weight_int4pack_mm_for_cpu`` on CPU), never dequantized at load.

The checkpoint is compressed-tensors' ``pack-quantized`` format, int4 weight-only in groups along the input
dimension: per linear ``weight_packed`` (int32, 8 values a word, value j of a row at bits 4·(j mod 8) of word
j // 8, stored unsigned with an offset of 8), ``weight_scale`` ``[out, in / group]``, ``weight_zero_point``
(asymmetric only: signed, packed the same way along the output dimension) and ``weight_shape``; the weight is
``(q − zero_point) · scale`` with ``q`` signed. PyTorch's kernel computes ``(u − 8) · scale + zero`` from the
unsigned ``u = q + 8``, so its per-group ``zero = −zero_point · scale``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ...architectures.experts import packed_expert_names
from ...errors import SourceError
from ...checkpoint.reader import checkpoint_shapes
from ...sources.models import skeleton_model

#: group sizes and the tile of the input dimension PyTorch's int4 kernel accepts
KERNEL_GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 8
PACKED = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """Unsigned 4-bit values (int32, 0-15) ``[rows, columns]`` from compressed-tensors' int32 words."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], -1)[:, :columns]


def dequantize(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``(u − 8 − zero_point) · scale`` per group (``values`` unsigned ``[out, in]``)."""
    rows, columns = values.shape
    groups = scale.shape[1]
    q = values.float().view(rows, groups, columns // groups) - 8
    if zero_point is not None:
        q = q - zero_point.float().unsqueeze(-1)
    return (q * scale.float().unsqueeze(-1)).view(rows, columns)


def held_int4_bytes(rows: int, columns: int, groups: int, dtype: torch.dtype) -> int:
    """Bytes an :class:`Int4Linear` of a ``rows × columns`` weight in ``groups`` groups per row holds: the int4
    codes (two a byte, on CPU and CUDA alike) and a scale and a zero per group and row in ``dtype``."""
    return rows * columns // 2 + groups * rows * 2 * torch.empty(0, dtype=dtype).element_size()


class Int4Linear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in PyTorch's int4 packed layout for ``device`` (the layout differs
    between CPU and CUDA, so the module is built where it runs; its buffers stay out of the state dict)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = values.shape
        fits = self.out_features % 8 == 0 and self.in_features % (INNER_K_TILES * 16) == 0 if device.type == "cuda" \
            else self.out_features % 16 == 0
        if not fits:
            raise SourceError(f"a {self.out_features} x {self.in_features} weight: PyTorch's int4 kernel on "
                              f"{device.type} takes rows in multiples of {8 if device.type == 'cuda' else 16}"
                              + (f" and columns in multiples of {INNER_K_TILES * 16}" if device.type == "cuda" else ""))
        self.group_size = self.in_features // scale.shape[1]
        zeros = -(zero_point.float() * scale.float()) if zero_point is not None else torch.zeros_like(scale.float())
        self.register_buffer("scale_and_zeros", torch.stack([scale.float().t(), zeros.t()], dim=-1)
                             .contiguous().to(device=device, dtype=dtype), persistent=False)
        values = values.to(device=device, dtype=torch.int32)
        if device.type == "cuda":
            pairs = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
            self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES),
                                 persistent=False)
        else:
            self.register_buffer("weight_int4",
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, INNER_K_TILES),
                                 persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
        self.on_cuda = device.type == "cuda"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale_and_zeros.dtype)
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.weight_int4, self.group_size, self.scale_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4, self.group_size,
                                                           self.scale_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def weight_elements(self) -> int:
        """The weight's logical size, rows × columns (its parameters, though held packed as buffers)."""
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def packed_config(location: str) -> dict | None:
    """The ``quantization_config`` of a compressed-tensors ``pack-quantized`` checkpoint (None otherwise)."""
    path = Path(location) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if not config or config.get("quant_method") != "compressed-tensors":
        return None
    formats = {config.get("format")} | {g.get("format") for g in config.get("config_groups", {}).values()}
    return config if "pack-quantized" in formats else None


def check_packed(spec: str, config: dict, device: torch.device, dtype: str, location: str | None = None) -> None:
    """One line for what the int4 kernel cannot time: another width, groups it lacks, act-order indices, and
    (from the headers of the checkpoint in ``location``) a mixture-of-experts layer's packed experts, which are
    no linears of transformers' model."""
    stacked = packed_expert_names(checkpoint_shapes(Path(location))) if location else []
    if stacked:
        raise SourceError(f"{spec}: packed mixture-of-experts experts ({stacked[0].removesuffix('.weight_packed')}, "
                          f"...): recipe bench times packed linears with PyTorch's int4 kernel, and transformers "
                          f"holds the experts as 3-D tensors; bench the export: dequantized output, or serve "
                          f"this one with vLLM")
    for name, group in config.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 4 or weights.get("strategy") != "group" or group.get("input_activations"):
            raise SourceError(f"{spec}: config group {name} is not int4 weight-only in groups: recipe bench times "
                              f"packed weights with PyTorch's int4 kernel (W4, group strategy)")
        if weights.get("group_size") not in KERNEL_GROUPS:
            raise SourceError(f"{spec}: group_size {weights.get('group_size')} (config group {name}): PyTorch's int4 "
                              f"kernel takes {', '.join(map(str, KERNEL_GROUPS))}")
        if weights.get("actorder") == "group":
            raise SourceError(f"{spec}: act-order groups (weight_g_idx): PyTorch's int4 kernel takes contiguous "
                              f"groups only")
    if device.type == "cuda" and dtype != "bfloat16":
        raise SourceError(f"{spec}: packed int4 weights run on CUDA in bfloat16 only: pass --dtype bfloat16")


def pop_packed(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Remove linear ``name``'s packed tensors from ``tensors``: its unsigned values ``[out, in]``, its scales
    ``[out, in / group]`` and its signed zero points (None: symmetric; packed along the output dimension)."""
    rows, columns = (int(v) for v in tensors.pop(f"{name}.weight_shape").tolist())
    values = unpack_int4(tensors.pop(f"{name}.weight_packed"), columns)
    zero_point = tensors.pop(f"{name}.weight_zero_point", None)
    if zero_point is not None:
        zero_point = unpack_int4(zero_point.t().contiguous(), rows).t() - 8
    return values, tensors.pop(f"{name}.weight_scale"), zero_point


def swap_packed(model: nn.Module, tensors: dict, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every ``nn.Linear`` whose packed tensors are in ``tensors`` by an :class:`Int4Linear` on
    ``device`` (its entries are removed from ``tensors``); returns how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if f"{name}.weight_packed" not in tensors:
            continue
        if not isinstance(module, nn.Linear) or f"{name}.weight_g_idx" in tensors:
            raise SourceError(f"packed weights of {name}: not a plain linear with contiguous groups")
        values, scale, zero_point = pop_packed(tensors, name)
        try:
            linear = Int4Linear(values, scale, zero_point, tensors.pop(f"{name}.bias", None), dtype, device)
        except SourceError as error:
            raise SourceError(f"{name}: {error}") from None
        model.set_submodule(name, linear)
        swapped += 1
    return swapped


def load_packed(location: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A ``pack-quantized`` checkpoint as a model on ``device`` whose quantized linears are :class:`Int4Linear`
    and whose other weights (embeddings, norms, head) are read as stored, in ``dtype``."""
    from safetensors import safe_open  # deferred: only a packed checkpoint needs it

    model = skeleton_model(location, dtype)
    config = model.config
    tensors = {}
    for path in sorted(Path(location).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    if not swap_packed(model, tensors, dtype, device):
        raise SourceError(f"{location}: config.json says pack-quantized but no tensor is packed")
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(set(result.missing_keys) - tied), sorted(result.unexpected_keys)
    if missing or unexpected:
        raise SourceError(f"{location}: the packed weights do not match its config.json: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()
    return model.to(device).eval()
