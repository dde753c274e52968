"""Sharded safetensors output assembled unit by unit from a streamed model (never from a whole model).

The layout is ``save_pretrained``'s: ``model.safetensors`` when everything fits one shard, else
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``); tensor names are the model's ``state_dict`` names with tied duplicates written once
(``lm_head.weight`` of a tied head is the embedding matrix), each file with ``{"format": "pt"}``
metadata. Shards are packed from whole units in model order and written one at a time, so host memory
holds at most one shard (``max_shard_bytes``) of tensors, read from the source checkpoint, the staging
directory or memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .streaming import INDEX_FILE, SINGLE_FILE

#: Default shard size: bounds the host memory the writer needs (``save_pretrained``'s default is larger).
MAX_SHARD_BYTES = 2 * 2**30


def _groups(session) -> list[tuple[torch.nn.Module | None, dict[str, str]]]:
    """``(unit or None, {checkpoint name: name inside the unit})`` in ``state_dict`` order; a parameter
    outside every unit (e.g. an untied ``lm_head`` that was never released) is a group of its own."""
    model = session.model
    prefixes = {id(m): name + "." for name, m in model.named_modules()}
    unit_of = {}
    for unit in session.stream_units():
        for local in unit.state_dict(keep_vars=True):
            unit_of[prefixes[id(unit)] + local] = (unit, local)
    groups: list[tuple[torch.nn.Module | None, dict[str, str]]] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied duplicate (save_pretrained writes it once)
            continue
        seen.add(id(tensor))
        unit, local = unit_of.get(name, (None, name))
        if groups and unit is not None and groups[-1][0] is unit:
            groups[-1][1][name] = local
        else:
            groups.append((unit, {name: local}))
    return groups


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_streamed_checkpoint(session, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write the session's model into ``directory`` (weights, config, generation config); returns the
    weight file names."""
    from safetensors.torch import save_file

    model = session.model
    state = model.state_dict(keep_vars=True)
    shards: list[list[tuple[torch.nn.Module | None, dict[str, str]]]] = [[]]
    size = 0
    for group in _groups(session):
        group_bytes = sum(_nbytes(state[name]) for name in group[1])
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += group_bytes
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        tensors = {}
        for unit, names in shard:
            if unit is None:
                for name in names:
                    if not is_materialized_tensor(state[name]):
                        raise RuntimeError(f"{name} is neither streamed nor in memory")
                    tensors[name] = state[name].detach()
            else:
                values = session.stream.read_unit(unit)
                tensors.update({name: values[local] for name, local in names.items()})
        tensors = {name: t.to("cpu").contiguous() for name, t in tensors.items()}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(_nbytes(t) for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        del tensors
    if len(files) > 1:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": weight_map}, indent=2) + "\n")
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    return files


def is_materialized_tensor(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "meta"
