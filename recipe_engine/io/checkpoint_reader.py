"""The engine's checkpoint reader: tensors of a safetensors checkpoint directory (one ``model.safetensors`` or
a sharded index), read lazily by name; the counterpart of ``checkpoint_writer``."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from torch import nn

from ..errors import SourceError


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Lazy reader of a safetensors checkpoint directory: one ``model.safetensors`` or a sharded index.

    ``read(names)`` opens each shard with ``safe_open`` only for the duration of the call; the returned
    tensors are memory-mapped views (copy-on-write), valid after the file is closed.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            path = self.directory / SINGLE_FILE
            with safe_open(str(path), "pt") as handle:
                self.files = {name: path for name in handle.keys()}
        else:
            raise SourceError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} to stream weights from")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [n for n in names if n not in self.files]
        if missing:
            raise SourceError(f"{self.directory}: tensors missing from the checkpoint: {missing[:3]}")
        tensors: dict[str, torch.Tensor] = {}
        by_file = itertools.groupby(sorted(names, key=lambda n: str(self.files[n])), key=lambda n: self.files[n])
        for path, group in by_file:
            with safe_open(str(path), "pt") as handle:
                for name in group:
                    tensors[name] = handle.get_tensor(name)
        return tensors


def is_materialized(module: nn.Module) -> bool:
    """Every parameter and persistent buffer of ``module`` holds real values (none is on the meta device)."""
    return all(t.device.type != "meta" for t in module.state_dict(keep_vars=True).values())
