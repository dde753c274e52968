"""Non-stock additions to a checkpoint (e.g. a residual patch) saved beside the stock weights.

``recipe_extras.json`` lists entries ``{"modifier": Name, "config": {...}}`` and
``recipe_extras.safetensors`` holds their tensors under ``"{entry index}.{tensor name}"``. Stock
``from_pretrained`` ignores both files; :func:`recipe_engine.load_model` calls the owning modifier class's
``restore_extra(model, config, tensors)`` for each entry.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import reading
from ..recipe.registry import REGISTRY

EXTRAS_JSON = "recipe_extras.json"
EXTRAS_TENSORS = "recipe_extras.safetensors"


def save_extras(directory: Path, entries: list[dict[str, Any]]) -> None:
    """``entries``: ``{"modifier", "config", "tensors": {name: Tensor}}``; nothing written when empty."""
    if not entries:
        return

    tensors = {f"{i}.{name}": t.detach().cpu().contiguous()
               for i, entry in enumerate(entries) for name, t in entry["tensors"].items()}
    save_file(tensors, str(directory / EXTRAS_TENSORS))
    meta = [{"modifier": e["modifier"], "config": e["config"]} for e in entries]
    (directory / EXTRAS_JSON).write_text(json.dumps(meta, indent=2))


def restore_extras(model: torch.nn.Module, location: str) -> list[str]:
    """Re-apply saved extras to a freshly loaded stock model; returns the modifier names applied."""
    meta_path = Path(location) / EXTRAS_JSON
    if not meta_path.is_file():
        return []

    with reading(f"{Path(location) / EXTRAS_TENSORS}"):
        tensors = load_file(str(Path(location) / EXTRAS_TENSORS))
    with reading(f"{meta_path}"):
        entries = json.loads(meta_path.read_text())
    applied = []
    for i, entry in enumerate(entries):
        prefix = f"{i}."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        REGISTRY.get(entry["modifier"]).restore_extra(model, entry["config"], own)
        applied.append(entry["modifier"])
    return applied
