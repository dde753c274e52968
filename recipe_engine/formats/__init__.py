"""Formats as plug-ins: the interfaces and registries, one module (or package) per format, found by scanning this
package.

An :class:`Exporter` writes a format. A *checkpoint format* is what a quantizing step's ``export:`` names:
how the linears it quantized are stored in the output's safetensors files (``pack``/``layout``), the
``quantization_config`` that ``config.json`` carries, and how a reader gets the weights back
(``dequantize``), so every command that reads an output (``eval``, ``bench``, a later recipe, resume,
streaming, a file export) works on any of them. A *file format* (``recipe export --format``, a recipe's
``export:`` block) writes one more file from a finished output directory (``write_file``), and states its own
checks (``check_recipe``, ``check_source``) and its line in the model card (``card_line``). A
:class:`SourceFormat` reads a model file the engine converts once into a cached checkpoint (and the builtin
aliases that name such files). A new format is one module here (or a package, for one that reads and writes)
with ``@register``-decorated classes, and one test.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import ClassVar

import torch

from ..errors import RecipeError
from ..numerics.quantization import Grid, QuantizedLinear


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
    #: suffixes of :attr:`suffixes` that record a linear's shape, not its weight (not counted in its bits)
    metadata: ClassVar[tuple[str, ...]] = ()
    #: File formats: the accepted ``type`` values (the first is the default) and the default file name.
    types: ClassVar[tuple[str, ...]] = ()
    default_file: ClassVar[str] = ""
    #: File formats: the program a file is written for (``recipe export --help``).
    reader: ClassVar[str] = ""

    # -- checkpoint formats ------------------------------------------------------------------------
    def grid_problem(self, bits: int, sym: bool) -> str | None:
        """Why this format cannot hold a grid of ``bits`` (and ``sym``), or None."""
        return None

    def mixed_grids_problem(self, sym: bool) -> str | None:
        """Why this format cannot hold linears on several grids (a step's ``overrides``), all symmetric or (not
        ``sym``) some asymmetric, or None."""
        return None

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the file stores scales in by default (the grid rounds its scales to it), None when not
        packed."""
        return None

    def scale_dtype_problem(self, dtype: torch.dtype) -> str | None:
        """Why this format cannot store scales in ``dtype`` (a step's ``scale_dtype``), or None."""
        return None

    def layout(self, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """The packed tensors by suffix as meta tensors (dtype and shape), in file order."""
        raise NotImplementedError

    def pack(self, name: str, weight: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
        """The packed tensors of one linear's on-grid ``weight`` (keys and order as :meth:`layout`)."""
        raise NotImplementedError

    def stored_bits(self, shape: tuple[int, int], grid: Grid, dtype: torch.dtype) -> int:
        """Bits the file holds for one quantized linear's weight of ``shape`` on ``grid`` in a model of
        ``dtype``: those of the tensors of :meth:`layout` (``numel · element bits``) but the shape records of
        :attr:`metadata`, or every weight in ``dtype`` where the format does not pack."""
        rows, columns = shape
        if not self.packs:
            return rows * columns * torch.finfo(dtype).bits
        groups = -(-columns // grid.width(columns))
        record = QuantizedLinear(grid, torch.empty(rows, groups, device="meta"),
                                 torch.empty(rows, groups, dtype=torch.int16, device="meta"), self.name)
        layout = self.layout(torch.empty(rows, columns, dtype=dtype, device="meta"), record)
        return sum(t.numel() * t.element_size() * 8 for key, t in layout.items() if key not in self.metadata)

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
                   source=None, progress=None) -> dict:
        """Write ``output`` from the output directory ``directory``; returns ``{"file", "type", ...}``
        (``report.json``'s ``export``). ``source``: the model record (``report.ModelRecord``) of the run that
        wrote the directory, if known."""
        raise NotImplementedError

    def check_recipe(self, steps, shapes, config) -> None:
        """Before anything loads: refuse (``RecipeError``) what this file format cannot hold."""

    def check_source(self, spec: str, config) -> None:
        """Before anything loads: refuse (``RecipeError``) a model source ``spec`` (its ``config``) whose files
        this format cannot carry over (the tokenizer a run saves is the source's)."""

    def card_line(self, export) -> str:
        """The model card's line on the file written (``export``: the report's ``ExportRecord``)."""
        return f"`{export.file}`: the same model as one {self.name} file ({export.type})."


class SourceFormat:
    """A model file format the engine reads: a file (or a builtin alias naming one) converted once into a cached
    HF checkpoint, which every command then reads as a local directory."""

    #: ``ModelSource.kind`` of a file of this format, and the ``report.ModelRecord`` field recording the file.
    name: ClassVar[str]
    #: The file name's suffix (``.name``).
    suffix: ClassVar[str]
    #: Builtin alias → the hub repository its file was converted from (a model card's ``base_model``).
    builtins: ClassVar[dict[str, str]] = {}

    def builtin_file(self, alias: str) -> Path:
        """The file a builtin alias names (assembled or located once)."""
        raise NotImplementedError

    def convert(self, path: Path) -> Path:
        """The cached HF checkpoint directory of the file ``path`` (converted on the first call)."""
        raise NotImplementedError

    def config(self, path: Path):
        """The HF config of the file ``path``, read from its metadata without converting its weights."""
        raise NotImplementedError

    def license(self, path: Path) -> str | None:
        """The license the file ``path`` states, or None."""
        return None

    def origin(self, source) -> str | None:
        """The file of this format a ``ModelSource``'s weights were converted from (for a local directory, the
        one its ``report.json`` records), or None."""
        return None


_EXPORTERS: dict[str, Exporter] = {}
_SOURCES: dict[str, SourceFormat] = {}
_discovered: list[bool] = []


def register(cls: type) -> type:
    """Class decorator: add one instance of ``cls`` (an :class:`Exporter` or a :class:`SourceFormat`) to its
    registry under ``cls.name``."""
    registry = _SOURCES if issubclass(cls, SourceFormat) else _EXPORTERS
    if cls.name in registry:
        raise RuntimeError(f"format {cls.name!r} registered twice ({type(registry[cls.name]).__name__}, "
                           f"{cls.__name__})")
    registry[cls.name] = cls()
    return cls


def _discover() -> None:
    """Import every module and package here once (each registers its formats; a failing import raises), on the
    first call, not when this package is imported, so a format may import any module below the engine's run."""
    if not _discovered:
        _discovered.append(True)
        for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            importlib.import_module(f"{__name__}.{module.name}")


def exporters() -> dict[str, Exporter]:
    """Every format written, by name."""
    _discover()
    return _EXPORTERS


def source_formats() -> dict[str, SourceFormat]:
    """Every model file format read, by name."""
    _discover()
    return _SOURCES


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
