"""The engine's checkpoint reader: tensors of a safetensors checkpoint directory (one ``model.safetensors`` or
a sharded index), read lazily by name; the counterpart of ``checkpoint_writer``. Also the checks of a source
checkpoint from its files' headers alone: complete files, and tensors that agree with the config."""
from __future__ import annotations

import itertools
import json
import re
import struct
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from torch import nn

from ..errors import SourceError, library_reason, reading
from .checkpoint_names import converted_names, converted_shapes


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Lazy reader of a safetensors checkpoint directory: one ``model.safetensors`` or a sharded index.

    ``read(names)`` opens each shard with ``safe_open`` only for the duration of the call; the returned
    tensors are memory-mapped views (copy-on-write), valid after the file is closed. Given the ``model`` the
    checkpoint is for, it also reads the in-memory names of tensors transformers converts at load (a Mixtral's
    fused experts from the per-expert tensors on disk; ``checkpoint_names``).
    """

    def __init__(self, directory: str | Path, model: nn.Module | None = None):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            with reading(str(index)):
                weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            path = self.directory / SINGLE_FILE
            with reading(str(path)), safe_open(str(path), "pt") as handle:
                self.files = {name: path for name in handle.keys()}
        else:
            raise SourceError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} to stream weights from")
        #: in-memory name → the on-disk tensors transformers makes it from (``checkpoint_names``)
        self.converted = converted_names(model, list(self.files)) if model is not None else {}

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.converted

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [n for n in names if n not in self]
        if missing:
            raise SourceError(f"{self.directory}: tensors missing from the checkpoint: {missing[:3]}")
        stored = [n for n in names if n in self.files]
        tensors = self._read(stored)
        for name in names:
            if name not in self.files:
                tensors[name] = self.converted[name].build(self._read)
        return tensors

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        by_file = itertools.groupby(sorted(names, key=lambda n: str(self.files[n])), key=lambda n: self.files[n])
        for path, group in by_file:
            with reading(str(path)), safe_open(str(path), "pt") as handle:
                for name in group:
                    tensors[name] = handle.get_tensor(name)
        return tensors


def is_materialized(module: nn.Module) -> bool:
    """Every parameter and persistent buffer of ``module`` holds real values (none is on the meta device)."""
    return all(t.device.type != "meta" for t in module.state_dict(keep_vars=True).values())


def has_weights(directory: Path) -> bool:
    """The directory holds a safetensors checkpoint (a shard index or ``model.safetensors``)."""
    return (directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file()


def check_safetensors(directory: Path) -> None:
    """Each ``*.safetensors`` file of a local source model holds its whole header and every tensor's data
    (the 8-byte header length, the JSON header, and the largest ``data_offsets`` end fit in the file): a
    truncated or corrupt source is one line naming the file, before any weight is read."""
    for file in sorted(directory.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem:
            raise SourceError(f"source model file {file}: {problem}")


def safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a complete safetensors file (reads its header only), or None."""
    header = safetensors_header(file)
    return header if isinstance(header, str) else None


def safetensors_header(file: Path) -> dict | str:
    """The header of a complete safetensors file (tensor name → entry), or why ``file`` is not one."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header (truncated?)"
            length = struct.unpack("<Q", head)[0]
            if length > size - 8:
                return (f"{size:,} bytes, but its header alone claims {length:,} bytes (truncated, or not a "
                        f"safetensors file)")
            header = json.loads(handle.read(length))
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "its header is not JSON (corrupt, or not a safetensors file)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (corrupt, or not a safetensors file)"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"
            and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        return "a tensor entry of its header has no valid data_offsets (corrupt)"
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"{size:,} bytes, but its tensors need {needed:,} (truncated: copy or download it again)"
    try:  # the rest safetensors itself checks (dtypes, shapes against offsets) when it opens the file
        with safe_open(str(file), "pt"):
            pass
    except Exception as exc:  # SafetensorError, and whatever else its reader raises: one line
        return f"safetensors cannot open it: {library_reason(exc)}"
    return {key: entry for key, entry in header.items() if key != "__metadata__"}


#: The tensors that replace ``<linear>.weight`` in a compressed-tensors packed checkpoint.
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of the checkpoint in ``directory`` (its shard index or ``model.safetensors``), from
    the safetensors headers alone; a shard the index names that is missing or broken is one line."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SourceError(f"{index}: not a shard index (no weight_map: {type(exc).__name__})") from None
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise SourceError(f"model directory {directory} has no model.safetensors or model.safetensors.index.json "
                          f"(safetensors weights are required)")
    shapes = {}
    for name in files:
        file = directory / name
        if not file.is_file():
            raise SourceError(f"{index}: names the shard {name}, which is missing from {directory}")
        header = safetensors_header(file)
        if isinstance(header, str):
            raise SourceError(f"source model file {file}: {header}")
        shapes.update({key: tuple(entry.get("shape", ())) for key, entry in header.items()})
    return shapes


def check_checkpoint(directory: Path, config, spec: str | None = None) -> None:
    """Every tensor ``config``'s architecture needs is in the checkpoint with the config's shape, and no other
    tensor is (headers only, no weight read; a tied ``lm_head`` may be absent; a packed linear's
    ``weight_packed``/``weight_scale``/... stand for its ``weight``; tensors transformers converts at load, such
    as per-expert names, count as what they convert to). Otherwise one line naming the first few."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM

    present = checkpoint_shapes(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    conversions = converted_names(model, list(present))
    if conversions:  # on-disk names transformers converts at load (per-expert tensors): compared converted
        sources = {name for conversion in conversions.values() for name in conversion.names}
        present = {**{k: v for k, v in present.items() if k not in sources},
                   **converted_shapes(conversions, present)}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    packed = {f"{name[:-len('weight')]}{suffix}" for name in expected if name.endswith(".weight")
              for suffix in PACKED_SUFFIXES} if getattr(config, "quantization_config", None) else set()
    optional = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [name for name in expected if name not in present and name not in optional
               and f"{name}_packed" not in present]
    unexpected = [name for name in present if name not in expected and name not in packed
                  and not any(re.search(pattern, name) for pattern in ignored)]
    wrong = [f"{name} {list(present[name])} (config: {list(shape)})" for name, shape in expected.items()
             if name in present and present[name] != shape]
    problems = [f"{label} {len(names)} tensor(s): {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong))
                if names]
    if problems:
        layers = getattr(config, "num_hidden_layers", None)
        raise SourceError(f"model '{spec or directory}': the weights in {directory} do not match its config.json "
                          f"({config.model_type}, {layers} layers): {'; '.join(problems)}")
