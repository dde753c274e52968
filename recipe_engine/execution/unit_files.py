"""What a resume checkpoint's files hold (``recipe_engine.execution.resume``): fingerprints of the source and of
written files, a module's parameters, tensors read from a safetensors header alone, and a checkpointed unit
loaded back into a module (a pruned Linear rebuilt at its stored shape)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from ..errors import RecipeError
from ..checkpoint.reader import safetensors_header
from ..checkpoint.safetensors_file import SAFETENSORS_DTYPES


def model_fingerprint(location: str) -> str:
    """sha256 of the source directory's config and of each weight file's name, size and mtime (cheap; a
    rewritten or replaced checkpoint changes it)."""
    sha = hashlib.sha256()
    directory = Path(location)
    for path in sorted(directory.glob("*")):
        if path.name == "config.json":
            sha.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".gguf") or path.name.endswith(".index.json"):
            stat = path.stat()
            sha.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return sha.hexdigest()


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            sha.update(chunk)
    return sha.hexdigest()


def parameters_of(module: nn.Module, skip: set[int] = frozenset()) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module.named_parameters() if id(p) not in skip}


def meta_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as meta tensors (names, shapes, dtypes from its header alone)."""
    header = safetensors_header(path)
    if isinstance(header, str):
        raise RecipeError(f"cannot resume: {path.name}: {header}")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    return {name: torch.empty(spec["shape"], dtype=dtypes[spec["dtype"]], device="meta")
            for name, spec in header.items()}


@torch.no_grad()
def fill_module(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load ``tensors`` into ``module``'s parameters; a Linear's weight/bias of another shape is replaced
    (what pruning steps do), any other shape change is an error. Meta tensors (a streamed skeleton's unit)
    only set shapes."""
    for name, value in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        current = getattr(owner, attr)
        if current.shape == value.shape and current.dtype == value.dtype:
            current.data.copy_(value)
            continue
        if not isinstance(owner, nn.Linear):
            raise RecipeError(f"cannot resume: checkpointed {name} has shape {tuple(value.shape)}, the model "
                              f"{tuple(current.shape)}, and is not a Linear's")
        setattr(owner, attr, nn.Parameter(value.clone(), requires_grad=current.requires_grad))
        if attr == "weight":
            owner.out_features, owner.in_features = value.shape
