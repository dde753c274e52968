"""The content-addressed files of one resume directory (``recipe_engine.execution.resume``): tensors as
``PREFIX-<sha256>.safetensors`` and raw bytes as ``PREFIX-<sha256>``, each written once, straight to disk,
and the sha256 of every file the next manifest may name."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .unit_files import file_sha256


class CheckpointFiles:
    """Files of one resume directory; ``bytes_written`` counts what this process wrote there."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.bytes_written = 0
        #: sha256 of each file the next manifest may name
        self.digests: dict[str, str] = {}
        #: tensors' signature (prefix, names, ids, versions) → (file, the tensors: held so no id is reused)
        self._written: dict[tuple, tuple[str, list[torch.Tensor]]] = {}

    def store(self, tensors: dict[str, torch.Tensor], prefix: str) -> str:
        """Write ``tensors`` as ``prefix-<sha256>.safetensors`` (content-addressed: an existing file is kept),
        straight to disk: no in-memory copy of the file; returns its name."""
        part = self.directory / f".{prefix}.part"
        save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(part))
        digest = file_sha256(part)
        name = f"{prefix}-{digest}.safetensors"
        if (self.directory / name).is_file():
            part.unlink()
        else:
            self.bytes_written += part.stat().st_size
            os.replace(part, self.directory / name)
        self.digests[name] = digest
        return name

    def store_bytes(self, data: bytes, prefix: str) -> str:
        digest = hashlib.sha256(data).hexdigest()
        name = f"{prefix}-{digest}"
        if not (self.directory / name).is_file():
            part = self.directory / f".{name}.part"
            part.write_bytes(data)
            os.replace(part, self.directory / name)
            self.bytes_written += len(data)
        self.digests[name] = digest
        return name

    def cached(self, tensors: dict[str, torch.Tensor], prefix: str) -> str:
        """``store``, skipped when these very tensors (identity and version counter) were stored already."""
        signature = (prefix, *((name, id(t), t._version) for name, t in sorted(tensors.items())))
        if signature not in self._written:
            self._written[signature] = (self.store(tensors, prefix), list(tensors.values()))
        return self._written[signature][0]

    def keep_only(self, named: dict[str, str], also: str) -> None:
        """Delete the files (and forget the stores) that ``named`` — the manifest just written — does not name,
        superseded staged units among them; ``also`` (the manifest itself) stays."""
        for path in self.directory.iterdir():
            if path.name != also and path.name not in named and path.is_file():
                path.unlink(missing_ok=True)
        self._written = {s: w for s, w in self._written.items() if w[0] in named}
        self.digests = {name: digest for name, digest in self.digests.items() if name in named}
