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

from ..errors import RecipeError, SourceError, library_reason, reading
from ..formats import packed_reader
from ..numerics.quantization import QuantizedLinear
from .names import converted_names, converted_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Lazy reader of a safetensors checkpoint directory: one ``model.safetensors`` or a sharded index.

    ``read(names)`` opens each shard with ``safe_open`` only for the duration of the call; the returned
    tensors are memory-mapped views (copy-on-write), valid after the file is closed. A packed checkpoint (a
    ``quantization_config`` a registered format reads, ``recipe_engine.formats``) is read by its
    logical names: ``<linear>.weight`` is dequantized from its packed tensors into the checkpoint's dtype.
    Given the ``model`` the checkpoint is for, it also reads the in-memory names of tensors transformers
    converts at load (a Mixtral's fused experts from the per-expert tensors on disk, packed ones dequantized
    first; ``checkpoint_names``).
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
        config_file = self.directory / "config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.format, self.packed = packed_weights(self.files, self.config)
        #: in-memory name → the on-disk tensors transformers makes it from (``checkpoint_names``)
        self.converted = converted_names(model, self.names()) if model is not None else {}

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.packed or name in self.converted

    def names(self) -> list[str]:
        """The logical tensor names: stored ones, packed linears' tensors replaced by their ``weight``."""
        hidden = {stored for parts in self.packed.values() for stored in parts.values()}
        logical = {stored: stored for stored in self.files if stored not in hidden}
        logical.update({next(iter(parts.values())): name for name, parts in self.packed.items()})
        return [logical[stored] for stored in self.files if stored in logical]

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [n for n in names if n not in self]
        if missing:
            raise SourceError(f"{self.directory}: tensors missing from the checkpoint: {missing[:3]}")
        tensors = self._read([n for n in names if n in self.files or n in self.packed])
        for name in names:
            if name not in tensors:
                tensors[name] = self.converted[name].build(self._read)
        return {name: tensors[name] for name in names}

    def quantization_records(self) -> dict[str, QuantizedLinear]:
        """Each packed linear's grid, scale and zero point, by its logical weight name (``<linear>.weight``), as
        a quantizing step records them, so that a later run can write the weights no step changes packed again,
        byte for byte; a linear whose format's layout says more than a record holds is left out."""
        qconfig = self.config.get("quantization_config") or {}
        shapes = checkpoint_shapes(self.directory)  # headers: the packed weights themselves are not read
        tensors = self._stored([part for parts in self.packed.values() for suffix, part in parts.items()
                                if suffix in self.format.record_parts])
        records = {}
        for name, parts in self.packed.items():
            shape = self.format.weight_shape(name, {suffix: shapes[part] for suffix, part in parts.items()},
                                             qconfig)
            record = self.format.record(name, {suffix: tensors[part] for suffix, part in parts.items()
                                               if part in tensors}, shape, qconfig)
            if record is not None:
                records[name] = record
        return records

    def _stored(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors as stored, by name."""
        tensors: dict[str, torch.Tensor] = {}
        by_file = itertools.groupby(sorted(names, key=lambda n: str(self.files[n])), key=lambda n: self.files[n])
        for path, group in by_file:
            with reading(str(path)), safe_open(str(path), "pt") as handle:
                for name in group:
                    tensors[name] = handle.get_tensor(name)
        return tensors

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Stored tensors by name, and packed linears' weights dequantized from their parts."""
        stored = [n for n in names if n not in self.packed]
        stored += [part for n in names if n in self.packed for part in self.packed[n].values()]
        tensors = self._stored(stored)
        dtype = checkpoint_dtype(self.config)
        for name in names:
            if name in self.packed:
                parts = {suffix: tensors.pop(part) for suffix, part in self.packed[name].items()}
                shape = self.format.weight_shape(name, {suffix: tuple(t.shape) for suffix, t in parts.items()},
                                                 self.config["quantization_config"])
                tensors[name] = self.format.dequantize(name, parts, shape, self.config["quantization_config"], dtype)
        return {name: tensors[name] for name in names}


def _config_value(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype ``config.json`` declares for the weights (``dtype``, older ``torch_dtype``; default fp32)."""
    name = _config_value(config, "dtype") or _config_value(config, "torch_dtype") or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."))


def packed_weights(names: Iterable[str], config) -> tuple:
    """``(format, {"<linear>.weight": {suffix: stored name}})`` of a packed checkpoint's tensors (``(None, {})``
    for plain weights); a ``quantization_config`` no registered format reads is one line."""
    qconfig = _config_value(config, "quantization_config")
    if not qconfig:
        return None, {}
    try:
        exporter = packed_reader(qconfig if isinstance(qconfig, dict) else qconfig.to_dict())
    except RecipeError as exc:
        raise SourceError(exc.detail) from None
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in exporter.suffixes:
            groups.setdefault(f"{prefix}.weight", {})[suffix] = name
    return exporter, groups


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


def logical_shapes(shapes: dict[str, tuple[int, ...]], config) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each packed linear's tensors replaced by its ``weight`` and that weight's shape."""
    exporter, packed = packed_weights(shapes, config)
    if exporter is None:
        return shapes
    qconfig = _config_value(config, "quantization_config")
    qconfig = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
    hidden = {stored for parts in packed.values() for stored in parts.values()}
    logical = {name: shape for name, shape in shapes.items() if name not in hidden}
    for name, parts in packed.items():
        logical[name] = tuple(exporter.weight_shape(name, {s: shapes[n] for s, n in parts.items()}, qconfig))
    return logical


def meta_model(config) -> nn.Module:
    """The config's model on the meta device (names and shapes, no weights)."""
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def in_memory_shapes(directory: Path, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors in ``directory`` by the names ``model`` holds them under, with their shapes, from
    the headers alone: a packed linear's tensors as its ``weight``, on-disk names transformers converts at load
    (per-expert tensors) as what they convert to."""
    saved = directory / "config.json"  # its quantization_config, also when the model's config was read without it
    present = logical_shapes(checkpoint_shapes(directory),
                             json.loads(saved.read_text()) if saved.is_file() else model.config)
    conversions = converted_names(model, list(present))
    if conversions:
        sources = {name for conversion in conversions.values() for name in conversion.names}
        present = {**{k: v for k, v in present.items() if k not in sources},
                   **converted_shapes(conversions, present)}
    return present


def check_checkpoint(directory: Path, config, spec: str | None = None) -> None:
    """Every tensor ``config``'s architecture needs is in the checkpoint with the config's shape, and no other
    tensor is (headers only, no weight read; a tied ``lm_head`` may be absent; a packed linear's tensors
    stand for its ``weight``, of the shape they hold; tensors transformers converts at load, such as
    per-expert names, count as what they convert to). Otherwise one line naming the first few."""
    model = meta_model(config)
    present = in_memory_shapes(directory, model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    optional = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [name for name in expected if name not in present and name not in optional]
    unexpected = [name for name in present if name not in expected
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
