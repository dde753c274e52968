"""The integer weight grid every quantizing step uses, and the record of one quantized linear.

Grid (Frantar et al. 2023, GPTQ reference quantizer): per row and group of ``group_size`` input columns,
``x̂ = s (clamp(round(x / s) + z, 0, 2^b - 1) - z)``. Asymmetric: ``s = (max(x⁺) - min(x⁻)) / (2^b - 1)``
with ``x⁺ = max(x, 0)``, ``x⁻ = min(x, 0)`` and ``z = round(-min(x⁻) / s)``; symmetric:
``s = 2 max|x| / (2^b - 1)``, ``z = 2^(b-1)``, which is the compressed-tensors signed grid
``[-2^(b-1), 2^(b-1) - 1]`` with zero point 0. An all-zero row gets the range [-1, 1].

``scale_dtype``: the dtype a packed checkpoint stores the scales in; the scale is rounded to it before any
weight is rounded, so ``s (q - z)`` computed from the stored scale is the quantized weight bit for bit
(one rounding of an exact product either way). A quantizing step records each linear it quantized with
``RunOutputs.mark_quantized``; the checkpoint format it names (``recipe_engine.formats``) packs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    """``bits``-bit integer grid, groups of ``group_size`` input columns (``None``: one group per row)."""

    bits: int
    group_size: int | None
    sym: bool
    scale_dtype: torch.dtype | None = None

    @property
    def maxq(self) -> int:
        return 2 ** self.bits - 1

    def width(self, columns: int) -> int:
        return self.group_size or columns

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point (each ``[rows]``) of the columns ``w`` [rows, cols] form one group of (leading
        dimensions: a batch of such matrices)."""
        xmin = w.min(dim=-1).values.clamp(max=0)
        xmax = w.max(dim=-1).values.clamp(min=0)
        if self.sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        flat = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
        scale = (xmax - xmin) / self.maxq
        if self.scale_dtype is not None:  # the stored scale (never 0 or subnormal after rounding)
            scale = scale.to(self.scale_dtype).clamp(min=torch.finfo(self.scale_dtype).tiny).to(scale.dtype)
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
class QuantizedLinear:
    """What the writer needs to pack one linear: the checkpoint ``format`` (an exporter's name), its grid and
    per-group ``[rows, groups]`` scale (fp32; the file stores it in ``grid.scale_dtype``) and zero point
    (integer codes ``0 … 2^b − 1``, int16). ``parameter``: the module's quantized tensor (``weight``; the
    experts of an MoE layer: ``gate_up_proj`` or ``down_proj``, scale and zero point ``[experts, rows, groups]``)."""

    grid: Grid
    scale: torch.Tensor
    zero: torch.Tensor
    format: str = "compressed-tensors"
    parameter: str = "weight"


def _grid_values(weight: torch.Tensor, record: QuantizedLinear):
    """``(w, step, codes, fake)`` of ``weight`` on ``record``'s grid, as views ``[rows, groups, width]`` in fp64
    (a last, partial group padded to a whole one); ``fake`` is the grid value as the weight's dtype holds it."""
    grid, (rows, columns) = record.grid, weight.shape
    width = grid.width(columns)
    groups = -(-columns // width)
    w = weight.detach().to(torch.float64)
    if columns != groups * width:  # the padding is dropped by the callers
        w = torch.nn.functional.pad(w, (0, groups * width - columns))
    w = w.view(rows, groups, width)
    step = record.scale.to(w.device, torch.float64)[:, :, None]
    zero = record.zero.to(w.device, torch.float64)[:, :, None]
    codes = grid.codes(w, step, zero)
    # bf16 keeps 8 bits: int8 codes times a scale are rounded
    return w, step, codes, (step * (codes - zero)).to(weight.dtype).to(torch.float64)


def on_grid(weight: torch.Tensor, record: QuantizedLinear) -> bool:
    """Whether ``weight`` is exactly ``s (q - z)`` of ``record``'s grid, as its dtype holds it (a packed source's
    weight no step changed; any change, however small, is off the grid)."""
    w, _, _, fake = _grid_values(weight, record)
    return bool(torch.equal(w, fake))


#: Bytes of one fp64 temporary of :func:`grid_codes` on the host: a weight is taken a block of rows at a time
#: (512 KiB: 16 rows of 4096 columns), so that its eight or so temporaries stay in the cores' caches and, below
#: the 1 MiB mmap threshold a streamed run fixes (``host_memory.release_freed_memory_eagerly``), come from the
#: heap and are reused instead of being mapped and zeroed anew. A 14336 × 4096 bf16 linear on a 2-core VM with
#: that threshold: 0.5-1.0 s, against 3.4 s whole and 4.4 s in blocks of 2 MiB (the same codes). A GPU takes the
#: whole weight at once.
HOST_BLOCK_BYTES = 512 << 10


def block_rows(tensor: torch.Tensor, bytes_per_element: int = 8) -> int:
    """Rows of the matrix ``tensor`` to take at once: on the host those whose temporaries of ``bytes_per_element``
    each fit :data:`HOST_BLOCK_BYTES` (at least one), on a GPU all of them."""
    rows, columns = tensor.shape
    return max(1, HOST_BLOCK_BYTES // (bytes_per_element * columns)) if tensor.device.type == "cpu" else rows


def grid_codes(name: str, weight: torch.Tensor, record: QuantizedLinear) -> torch.Tensor:
    """The integer codes ``clamp(round(w / s) + z, 0, 2^b - 1)`` of a quantized ``weight`` [rows, cols] (int16, on
    the weight's device), computed in fp64 (a bf16 weight divided in bf16 can land on the next code). Refuses a
    weight a later step moved off its grid (e.g. merged LoRA adapters): ``s (q - z)`` rounded to the weight's
    dtype must give the weight back within 0.05 grid steps. Each group's scale and zero point broadcast over
    its columns (a view ``[rows, groups, width]``), not expanded to the weight's size; on the host a block of
    rows at a time (:data:`HOST_BLOCK_BYTES`: every value's code depends on its own row only)."""
    rows, columns = weight.shape
    block = block_rows(weight)
    codes = torch.empty((rows, columns), dtype=torch.int16, device=weight.device)
    off = torch.zeros((), dtype=torch.float64, device=weight.device)
    for first in range(0, rows, block):
        part = slice(first, first + block)
        rows_of = QuantizedLinear(record.grid, record.scale[part], record.zero[part], record.format, record.parameter)
        w, step, block_codes, fake = _grid_values(weight[part], rows_of)
        off = torch.maximum(off, ((w - fake).abs() / step).max())
        codes[part] = block_codes.view(len(w), -1)[:, :columns]
    if off > 0.05:
        raise RuntimeError(f"{name}: weights are {float(off):.2f} grid steps off their quantization grid; "
                           f"a step after quantization changed them, so they cannot be packed")
    return codes
