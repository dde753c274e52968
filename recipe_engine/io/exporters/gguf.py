"""GGUF, one file for llama.cpp / Ollama / LM Studio, written from a finished output directory by
``recipe_engine.io.gguf_export`` (packed checkpoints are dequantized as they are read)."""
from __future__ import annotations

from pathlib import Path

from .. import gguf_export
from . import Exporter, register


@register
class GGUF(Exporter):
    name = "gguf"
    summary = "one file for llama.cpp, Ollama, LM Studio (f32, f16, bf16, q8_0)"
    types = ("f16", "f32", "bf16", "q8_0")  # the first is the default; gguf_export.TYPES in another order
    default_file = "model.gguf"

    def write_file(self, directory: Path, output: Path, kind: str, *, force: bool = False, name: str | None = None,
                   origin: str | None = None, progress=None) -> dict:
        return gguf_export.export_gguf(directory, output, kind, force=force, name=name, progress=progress,
                           vocabulary_from=Path(origin) if origin else None)

    def check_recipe(self, steps, shapes, config) -> None:
        gguf_export.check_recipe_exportable(steps, shapes, config)
