"""Output formats as plug-ins: one :class:`Exporter` interface and one registry, one module per format.

Two kinds of format share the interface. A *checkpoint format* is what a quantizing step's ``export:`` names:
how the linears it quantized are stored in the output's safetensors files (``pack``/``layout``), the
``quantization_config`` that ``config.json`` carries, and how a reader gets the weights back
(``dequantize``), so every command that reads an output (``eval``, ``bench``, a later recipe, resume,
streaming, the GGUF export) works on any of them. A *file format* (``recipe export --format``, a recipe's
``export:`` block) writes one more file from a finished output directory (``write_file``). A new format is
one module here with a ``@register``-decorated class, and one test.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import ClassVar

import torch

from ...errors import RecipeError
from ...numerics.quantization import Grid, QuantizedLinear


class Exporter:
    """What a format needs. Checkpoint formats set ``checkpoint`` and implement the packing half; file
    formats set ``types`` and implement :meth:`write_file`."""

    #: The name recipes and the command line use.
    name: ClassVar[str]
    #: One line for the docs and ``--help``: what reads it.
    summary: ClassVar[str]
    #: A checkpoint format a quantizing step can name (``export:``).
    checkpoint: ClassVar[bool] = False
    #: The quantized linears are stored as integers (the step must leave them on their grid).
    packs: ClassVar[bool] = False
    #: Packs the experts of an MoE layer too (each expert's projections as linears, under the Hub's names).
    packs_experts: ClassVar[bool] = False
    #: A checkpoint may leave linears unquantized beside packed ones (named in its ``quantization_config``).
    leaves_linears_out: ClassVar[bool] = False
    #: The tensors that replace ``<linear>.weight`` of a packed linear.
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: Those of :attr:`suffixes` that :meth:`record` reads (not the packed codes).
    record_parts: ClassVar[tuple[str, ...]] = ()
    #: File formats: the accepted ``type`` values (the first is the default) and the default file name.
    types: ClassVar[tuple[str, ...]] = ()
    default_file: ClassVar[str] = ""

    # -- checkpoint formats ------------------------------------------------------------------------
    def grid_problem(self, bits: int, sym: bool) -> str | None:
        """Why this format cannot hold a grid of ``bits`` (and ``sym``), or None."""
        return None

    def mixed_grids_problem(self, sym: bool) -> str | None:
        """Why this format cannot hold linears on several grids (a step's ``overrides``), all symmetric or (not
        ``sym``) some asymmetric, or None."""
        return None

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the file stores scales in (the grid rounds its scales to it), None when not packed."""
        return None

    def layout(self, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """The packed tensors by suffix as meta tensors (dtype and shape), in file order."""
        raise NotImplementedError

    def pack(self, name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """The packed tensors of one linear's on-grid ``weight`` (keys and order as :meth:`layout`)."""
        raise NotImplementedError

    def stored_bits(self, shape: tuple[int, int], grid: Grid, dtype: torch.dtype) -> int:
        """Bits the file holds for one quantized linear of ``shape`` on ``grid`` in a model of ``dtype``: those of
        the tensors of :meth:`layout` (``numel · element bits``), or every weight in ``dtype`` where the format
        does not pack."""
        rows, columns = shape
        if not self.packs:
            return rows * columns * torch.finfo(dtype).bits
        groups = -(-columns // grid.width(columns))
        record = QuantizedLinear(grid, torch.empty(rows, groups, device="meta"),
                                 torch.empty(rows, groups, dtype=torch.int16, device="meta"), self.name)
        layout = self.layout(torch.empty(rows, columns, dtype=dtype, device="meta"), record)
        return sum(t.numel() * t.element_size() * 8 for t in layout.values())

    def quantization_config(self, grids: dict[str, Grid], ignore: list[str]) -> dict:
        """``config.json``'s ``quantization_config`` for the packed linears ``grids`` (on-disk module name →
        grid, in file order; ``ignore``: the linears left unquantized)."""
        raise NotImplementedError

    def reads(self, quantization_config: dict) -> bool:
        """This format wrote a checkpoint with this ``quantization_config``."""
        return False

    def weight_shape(self, name: str, shapes: dict[str, tuple[int, ...]],
                     quantization_config: dict) -> tuple[int, int]:
        """The packed linear ``name``'s (``<linear>.weight``) shape ``(rows, columns)`` from its packed tensors'
        shapes (by suffix)."""
        raise NotImplementedError

    def dequantize(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
                   quantization_config: dict, dtype: torch.dtype) -> torch.Tensor:
        """The linear ``name``'s weight ``[rows, columns]`` in ``dtype`` from its packed tensors (by suffix)."""
        raise NotImplementedError

    def record(self, name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               quantization_config: dict) -> QuantizedLinear | None:
        """The grid, scale and zero point of the packed linear ``name`` (its :attr:`record_parts` by suffix;
        ``shape``: its weight's), as a quantizing step records them (so the writer packs the same bytes again);
        None where this format's layout says more than a record holds."""
        return None

    def bits_and_group(self, quantization_config: dict) -> tuple[int, int | None]:
        """The bits and group size (None: one group per row) of the grid ``quantization_config`` records for
        most linears."""
        raise NotImplementedError

    def describe(self, quantization_config: dict) -> str:
        """One phrase for a checkpoint this format wrote: ``compressed-tensors, 4-bit, groups of 64``."""
        bits, group = self.bits_and_group(quantization_config)
        return f"{self.name}, {bits}-bit, " + (f"groups of {group}" if group else "one group per row")

    # -- file formats ------------------------------------------------------------------------------
    def write_file(self, directory: Path, output: Path, kind: str, *, force: bool = False, name: str | None = None,
                   origin: str | None = None, progress=None) -> dict:
        """Write ``output`` from the output directory ``directory``; returns ``{"file", "type", ...}``
        (``report.json``'s ``export``). ``origin``: the GGUF file the model was converted from, if any."""
        raise NotImplementedError

    def check_recipe(self, steps, shapes, config) -> None:
        """Before anything loads: refuse (``RecipeError``) what this file format cannot hold."""


_EXPORTERS: dict[str, Exporter] = {}
_discovered: list[bool] = []


def register(cls: type[Exporter]) -> type[Exporter]:
    """Class decorator: add one instance of ``cls`` to the registry under ``cls.name``."""
    if cls.name in _EXPORTERS:
        raise RuntimeError(f"exporter {cls.name!r} registered twice ({type(_EXPORTERS[cls.name]).__name__}, "
                           f"{cls.__name__})")
    _EXPORTERS[cls.name] = cls()
    return cls


def exporters() -> dict[str, Exporter]:
    """Every format by name; the package's modules are imported on the first call (each registers its
    format; a failing import raises), not when the package is, so a format module may import any ``io``
    module."""
    if not _discovered:
        _discovered.append(True)
        for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            importlib.import_module(f"{__name__}.{module.name}")
    return _EXPORTERS


def checkpoint_formats() -> list[str]:
    return [name for name, exporter in exporters().items() if exporter.checkpoint]


def file_formats() -> list[str]:
    return [name for name, exporter in exporters().items() if exporter.types]


def file_exporter(name: str) -> Exporter:
    """The file format ``name``; an unknown one is one line listing the known ones."""
    if name not in file_formats():
        raise RecipeError(f"unknown export format {name!r}; choose from {', '.join(file_formats())}",
                          field="format")
    return exporters()[name]


def file_export(format_: str, kind: str | None, file: str | None) -> tuple[Exporter, str, str]:
    """``(exporter, type, file name)`` of a file export, the format's defaults filled in; an unknown format
    or a type it does not write is one line."""
    exporter = file_exporter(format_)
    kind = kind or exporter.types[0]
    if kind not in exporter.types:
        raise RecipeError(f"{format_} export writes types {', '.join(exporter.types)}, not {kind!r}", field="type")
    return exporter, kind, file or exporter.default_file


def checkpoint_exporter(name: str) -> Exporter:
    if name not in checkpoint_formats():
        raise RecipeError(f"unknown checkpoint format {name!r}; choose from {', '.join(checkpoint_formats())}",
                          field="export")
    return exporters()[name]


def packed_reader(qconfig: dict) -> Exporter:
    """The format that wrote a checkpoint whose ``config.json`` has this ``quantization_config``; one no
    registered format reads is one line."""
    for exporter in exporters().values():
        if exporter.checkpoint and exporter.reads(qconfig):
            return exporter
    method = qconfig.get("quant_method")
    raise RecipeError(f"quantized checkpoint (quant_method {method!r}, format {qconfig.get('format')!r}) is not "
                      f"one the engine reads ({', '.join(f for f in checkpoint_formats() if exporters()[f].packs)})")
