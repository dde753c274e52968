"""Integer weight grids shared by ``GPTQ`` and ``Quantize`` (private: not a modifier module).

Grid (Frantar et al. 2023, GPTQ reference quantizer): per row and group of ``group_size`` input columns,
``x̂ = s (clamp(round(x / s) + z, 0, 2^b - 1) - z)``. Asymmetric: ``s = (max(x⁺) - min(x⁻)) / (2^b - 1)``
with ``x⁺ = max(x, 0)``, ``x⁻ = min(x, 0)`` and ``z = round(-min(x⁻) / s)``; symmetric:
``s = 2 max|x| / (2^b - 1)``, ``z = 2^(b-1)``, which is the compressed-tensors signed grid
``[-2^(b-1), 2^(b-1) - 1]`` with zero point 0. An all-zero row gets the range [-1, 1].

Also the helpers every quantizing step uses: which linears a step targets, the ``group_size`` check
against a symbolic shape, and the relative layer-output error used in reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe_engine.shape import ModelShape

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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


@dataclass
class QuantizedWeight:
    """Result of quantizing one weight: dequantized values (fp64) and per-group ``[rows, groups]``
    scale and zero point in the original column order."""

    dequantized: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@torch.no_grad()
def rtn(weight: torch.Tensor, grid: Grid) -> QuantizedWeight:
    """Round-to-nearest: every group quantized with its own min-max parameters (fp64)."""
    w = weight.detach().to(torch.float64)
    columns = w.shape[1]
    step = grid.width(columns)
    params = [grid.params(w[:, c:c + step]) for c in range(0, columns, step)]
    scale = torch.stack([p[0] for p in params], dim=1)
    zero = torch.stack([p[1] for p in params], dim=1)
    fake = grid.fake(w, grid.expand(scale, columns), grid.expand(zero, columns))
    return QuantizedWeight(fake, scale, zero)


def output_error(weight: torch.Tensor, quantized: torch.Tensor, gram: torch.Tensor) -> float:
    """Relative layer-output error ``tr(ΔW G ΔWᵀ) / tr(W G Wᵀ)`` for the input gram ``G = Σ x xᵀ``."""
    w = weight.to(torch.float64)
    delta = w - quantized.to(torch.float64)
    return float(((delta @ gram) * delta).sum() / ((w @ gram) * w).sum())


def input_width(shape: ModelShape, layer: int, target: str) -> int:
    """Input width of a target linear of ``layer`` in the symbolic shape."""
    if target == "mlp.down_proj":
        return shape.layers[layer].intermediate_size
    if target == "self_attn.o_proj":
        return shape.layers[layer].num_heads * shape.head_dim
    return shape.hidden_size


def known_targets(targets: list[str]) -> list[str]:
    """Validator: every target is one of :data:`LINEARS`."""
    unknown = sorted(set(targets) - set(LINEARS))
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {list(LINEARS)}")
    return targets


def grid_problem(shape: ModelShape, targets: list[str], group_size: int | None, bits: int,
                 export: str) -> tuple[str, str] | None:
    """``(message, field)`` for the first configuration error against ``shape``: a target whose input
    width ``group_size`` does not divide (named by layer), or an export that cannot hold ``bits``."""
    if export == "compressed-tensors" and bits not in (4, 8):
        return f"compressed-tensors export needs bits 4 or 8 (got {bits})", "bits"
    if group_size is None:
        return None
    for layer in range(shape.num_layers):
        for target in targets:
            width = input_width(shape, layer, target)
            if width % group_size:
                divisors = [d for d in (256, 128, 64, 32, 16) if width % d == 0][:2]
                hint = f"; divisors of {width}: {', '.join(map(str, divisors))}" if divisors else ""
                return (f"group_size {group_size} does not divide the input width {width} of "
                        f"model.layers.{layer}.{target}{hint}", "group_size")
    return None


def _check_on_grid(name: str, weight: torch.Tensor, grid: Grid, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Refuse to pack a weight a later step moved off its grid (e.g. merged LoRA adapters)."""
    w = weight.detach().to(torch.float64)
    step = grid.expand(scale, w.shape[1])
    off = ((w - grid.fake(w, step, grid.expand(zero, w.shape[1]))).abs() / step).max()
    if off > 0.05:
        raise RuntimeError(f"{name}: weights are {float(off):.2f} grid steps off their quantization grid; "
                           f"a step after quantization changed them, so they cannot be packed")


def packed_writer(records: dict, grid: Grid):
    """A ``session.checkpoint_writer`` saving the ``records`` ({linear: (scale, zero)}) as compressed-tensors
    ``pack-quantized`` int32 weights with a ``quantization_config`` (vLLM format); other weights as they are.

    Zero points move to the signed compressed-tensors grid: ``z_ct = z - 2^(b-1)``.
    """
    def write(model: torch.nn.Module, directory) -> None:
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        strategy = "group" if grid.group_size else "channel"
        args = QuantizationArgs(num_bits=grid.bits, type="int", symmetric=grid.sym, strategy=strategy,
                                group_size=grid.group_size)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        names = {module: name for name, module in model.named_modules()}
        missing = [m for m in records if m not in names]
        if missing:
            raise RuntimeError(f"{len(missing)} quantized linears are no longer in the model")
        state = dict(model.state_dict())
        for module, (scale, zero) in records.items():
            name, dtype = names[module], module.weight.dtype
            _check_on_grid(name, module.weight, grid, scale, zero)
            packed = PackedQuantizationCompressor.compress(
                {"weight": module.weight.detach().cpu(), "weight_scale": scale.to(dtype),
                 "weight_zero_point": (zero - 2 ** (grid.bits - 1)).to(torch.int8)}, scheme)
            del state[f"{name}.weight"]
            state.update({f"{name}.{key}": value for key, value in packed.items()})
        ignore = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m not in records)
        config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                    quantization_status="compressed", ignore=ignore)
        model.config.quantization_config = config.model_dump(mode="json", exclude_none=True)
        try:
            model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        finally:
            del model.config.quantization_config

    return write
