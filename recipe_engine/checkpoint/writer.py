"""The engine's checkpoint writer: sharded safetensors assembled unit by unit (never from a whole model),
dense or with the linears a quantizing step recorded packed in the format it named
(``recipe_engine.formats``).

The layout is ``save_pretrained``'s: ``model.safetensors`` when everything fits one shard, else
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``); tensor names are the model's ``state_dict`` names with tied duplicates written once
(``lm_head.weight`` of a tied head is the embedding matrix), each file with ``{"format": "pt"}``
metadata. Shards are packed from whole units in model order; each file is written unit by unit
(``write_safetensors_incrementally``), so host memory holds one unit's tensors, read from the source
checkpoint, the staging directory or memory. A linear recorded by ``RunOutputs.mark_quantized`` is written as
its packed tensors (``<name>.weight_packed``, ``weight_scale``, ...) in place of ``<name>.weight``, and
``config.json`` carries the ``quantization_config``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..formats import checkpoint_exporter
from ..numerics.quantization import QuantizedLinear
from ..records.fingerprints import WeightsFingerprint
from .names import saved_names
from .reader import INDEX_FILE, SINGLE_FILE, is_materialized
from .safetensors_file import nbytes, write_safetensors_incrementally

#: Default shard size (``save_pretrained``'s "5GB"); the writer holds one unit, not one shard, in memory.
MAX_SHARD_BYTES = 5 * 10**9


def _groups(session) -> list[tuple[torch.nn.Module | None, dict[str, str]]]:
    """``(unit or None, {checkpoint name: name inside the unit})`` in ``state_dict`` order; a parameter
    outside every unit (e.g. an untied ``lm_head`` that was never released) is a group of its own."""
    model = session.model
    prefixes = {id(m): name + "." for name, m in model.named_modules()}
    unit_of = {}
    for unit in session.residency.stream_units():
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


def _quantized_weights(session) -> dict[str, QuantizedLinear]:
    """``{"<module name>.<parameter>": record}`` for every weight a step recorded as quantized (a linear's
    ``weight``, an MoE layer's stacked ``experts.gate_up_proj`` / ``down_proj``)."""
    names = {module: name for name, module in session.model.named_modules()}
    missing = [module for module, _ in session.outputs.quantized if module not in names]
    if missing:
        raise RuntimeError(f"{len(missing)} quantized linears are no longer in the model")
    return {f"{names[module]}.{parameter}": record
            for (module, parameter), record in session.outputs.quantized.items()}


def _unit_values(session, unit: torch.nn.Module) -> dict[str, torch.Tensor]:
    if session.stream is not None:
        return session.stream.read_unit(unit)
    return {name: tensor.detach() for name, tensor in unit.state_dict(keep_vars=True).items()}


def _as_is(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: tensor}


#: Share of a GPU's free memory that packing one quantized tensor may take.
PACK_DEVICE_SHARE = 0.5
#: fp64 working memory of packing on a GPU, per element of the weight packed at once (``grid_codes``: the weight,
#: its codes, the rounded-back check and their temporaries, counted as 6 × 8 bytes); the host takes a block of
#: rows at a time (``HOST_BLOCK_BYTES``), so there it bounds the work of a chunk of stacked experts from above.
PACK_BYTES_PER_ELEMENT = 6 * 8


def pack_device(device: torch.device, tensor: torch.Tensor) -> torch.device:
    """Where a quantized weight is packed: on the run's GPU when the tensor and the fp64 working copies of its
    largest linear (:data:`PACK_BYTES_PER_ELEMENT`) fit in ``PACK_DEVICE_SHARE`` of its free memory, else on the
    host. The packed tensors are the same bit for bit (integer codes of an fp64 division); a GPU makes the write
    of an MoE model's thousands of experts take seconds, not minutes of CPU time."""
    if device.type != "cuda" or tensor.device.type == "meta":
        return tensor.device
    linear = tensor.numel() if tensor.dim() <= 2 else tensor[0].numel()
    need = nbytes(tensor) + PACK_BYTES_PER_ELEMENT * linear
    free, _total = torch.cuda.mem_get_info(device)
    return device if need <= PACK_DEVICE_SHARE * free else torch.device("cpu")


def _stored(name: str, tensor: torch.Tensor, quantized: dict[str, QuantizedLinear],
            rename=_as_is, device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """The file entries of one state tensor: itself (``rename``: under ``save_pretrained``'s on-disk names), or
    its packed tensors when it is a quantized weight; a stacked ``[n, rows, cols]`` tensor (an MoE layer's) is
    split by ``rename`` into its linears (the Hub's names), their scales and zero points split the same way, and
    each linear packed. ``device``: the run's device; a quantized weight is packed where ``pack_device`` says."""
    record = quantized.get(name)
    if record is None:
        return rename(name, tensor)
    if tensor.device.type != "meta":  # a layout is computed where the tensor is
        on = pack_device(device, tensor)
        tensor, record = tensor.to(on), replace(record, scale=record.scale.to(on), zero=record.zero.to(on))
    if record.parameter != "weight":
        if tensor.device.type != "meta" and _packs_by_rows(record):
            return _packed_stack(name, tensor, record, rename)
        scales, zeros = rename(name, record.scale), rename(name, record.zero)
        return {key: value for linear, weight in rename(name, tensor).items()
                for key, value in _packed(linear, weight, replace(record, scale=scales[linear],
                                                                  zero=zeros[linear])).items()}
    return _packed(name, tensor, record)


def _packs_by_rows(record: QuantizedLinear) -> bool:
    """Whether the format packs each row of a linear on its own (compressed-tensors with a symmetric grid: codes
    packed along the columns, no zero points packed along the rows), so the rows of a stacked tensor can be
    packed as one matrix."""
    return record.format == "compressed-tensors" and record.grid.sym


#: fp64 working memory of packing one chunk of a stacked tensor (:data:`PACK_BYTES_PER_ELEMENT`), on the
#: host and on a GPU (there also at most what ``PACK_DEVICE_SHARE`` of its free memory leaves beside the tensor:
#: below a GPTQ pass's own working memory on an MoE model, so the write does not raise the run's peak).
HOST_PACK_BYTES = 1 << 30
DEVICE_PACK_BYTES = 4 << 30


def stack_per_chunk(tensor: torch.Tensor) -> int:
    """How many matrices of a stacked ``[n, rows, cols]`` tensor :func:`_packed_stack` packs at once, where the
    tensor is (at least one)."""
    per_expert = PACK_BYTES_PER_ELEMENT * tensor[0].numel()
    budget = HOST_PACK_BYTES
    if tensor.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(tensor.device)
        budget = min(DEVICE_PACK_BYTES, int(PACK_DEVICE_SHARE * free) - nbytes(tensor))
    return max(1, min(len(tensor), budget // per_expert))


def _packed_stack(name: str, tensor: torch.Tensor, record: QuantizedLinear, rename) -> dict[str, torch.Tensor]:
    """The packed tensors of every matrix of a stacked ``[n, rows, cols]`` weight (an MoE layer's experts), packed
    a chunk at a time as one ``[chunk · rows, cols]`` matrix (:func:`stack_per_chunk`: one division, on-grid check
    and copy to the host per chunk: 19 and 10 chunks on the host, 5 and 3 on a GPU, for Qwen3-30B-A3B's gate/up
    and down_proj) and then split into its linears by ``rename``: the bytes of packing each linear alone
    (``tests/test_exporters.py``), without a kernel launch, host read and copy per linear (3 × 128 per
    Qwen3-30B-A3B layer)."""
    stacked, rows, columns = tensor.shape
    exporter, chunk, pieces = checkpoint_exporter(record.format), stack_per_chunk(tensor), {}
    for first in range(0, stacked, chunk):
        part = slice(first, min(first + chunk, stacked))
        count = part.stop - part.start
        flat = replace(record, scale=record.scale[part].reshape(count * rows, -1),
                       zero=record.zero[part].reshape(count * rows, -1))
        for key, value in exporter.pack(name, tensor[part].reshape(count * rows, columns), flat).items():
            if key != "weight_shape":  # weight_packed, weight_scale: per row
                pieces.setdefault(key, []).append(value.reshape(count, rows, -1).to("cpu"))
    parts = {key: rename(name, torch.cat(values)) for key, values in pieces.items()}
    out = {}
    for linear, meta in rename(name, tensor.to("meta")).items():
        base = linear[: -len("weight")]
        for key in parts:
            out[base + key] = parts[key][linear]
        out[base + "weight_shape"] = torch.tensor(list(meta.shape), dtype=torch.int64)
    return out


def _packed(name: str, tensor: torch.Tensor, record: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The packed tensors of one linear's ``weight`` (their layout for a meta tensor)."""
    prefix, exporter = name[: -len("weight")], checkpoint_exporter(record.format)
    if tensor.device.type == "meta":
        return {prefix + key: value for key, value in exporter.layout(tensor, record).items()}
    return {prefix + key: value for key, value in exporter.pack(name[: -len(".weight")], tensor, record).items()}


def write_checkpoint(session, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES,
                     fingerprint: WeightsFingerprint | None = None) -> list[str]:
    """Write the session's model into ``directory`` (weights, config, generation config), one unit at a
    time (``write_safetensors_incrementally``), streamed or in memory, quantized linears packed; returns
    the weight file names (in name order). A streamed unit's staging file is deleted once the unit is written
    (the stream is finished after this), so staging and output never hold the same unit twice on disk; the
    next unit is read ahead on a thread while one is packed, and the last one's bytes are written on another.
    ``fingerprint``: each file added as ``report.weights_fingerprint`` reads it back (its name and its segments'
    sha256), hashed while it is written: the fingerprint without reading the output again."""
    model = session.model
    state = model.state_dict(keep_vars=True)
    quantized = _quantized_weights(session)
    stacks_packed = any(record.parameter != "weight" for record in quantized.values())
    rename = saved_names(model) if session.context.adapter.writes_hub_names(bool(quantized), stacks_packed) \
        else _as_is
    layout_of = {name: _stored(name, tensor.to("meta"), quantized, rename) for name, tensor in state.items()}
    shards: list[list[tuple[torch.nn.Module | None, dict[str, str]]]] = [[]]
    size = 0
    for group in _groups(session):
        group_bytes = sum(nbytes(t) for name in group[1] for t in layout_of[name].values())
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += group_bytes
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0

    units = [unit for shard in shards for unit, _ in shard if unit is not None]
    following = dict(zip(units, units[1:]))  # the unit written after each: read ahead while this one is packed

    clock = session.context.timings  # the output's record: ``read`` and ``pack`` inside the runner's ``write``

    def chunks(shard):
        for unit, names in shard:
            if unit is None:
                for name in names:
                    if state[name].device.type == "meta":
                        raise RuntimeError(f"{name} is neither streamed nor in memory")
                values = {name: state[name] for name in names}
            else:
                with clock.phase("read"):
                    unit_values = _unit_values(session, unit)  # this unit's read ahead is taken first
                values = {name: unit_values[local] for name, local in names.items()}
                if session.stream is not None and unit in following:
                    session.stream.read_ahead(following[unit], session.context.device)  # packed there
            with clock.phase("pack"):
                stored = {key: tensor.detach().to("cpu").contiguous() for name, value in values.items()
                          for key, tensor in _stored(name, value, quantized, rename, session.context.device).items()}
            yield stored
            if unit is not None and session.stream is not None and not is_materialized(unit):
                session.stream.discard_staged(unit)  # written: its staging file is no longer needed

    assert files == sorted(files), files  # written in the fingerprint's order
    for file, shard in zip(files, shards):
        layout = {key: meta for _, names in shard for name in names for key, meta in layout_of[name].items()}
        digests = None if fingerprint is None else []
        total += write_safetensors_incrementally(directory / file, layout, chunks(shard), digests)
        if fingerprint is not None:
            fingerprint.add_file(file, digests)
        weight_map.update({name: file for name in layout})
    if len(files) > 1:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": weight_map}, indent=2) + "\n")
    _save_configs(session, directory, quantized, rename)
    return files


def _unquantized(session, quantized: dict[str, QuantizedLinear], rename) -> list[str]:
    """The on-disk names of the linears a packed checkpoint leaves unquantized (its ``ignore``): every
    ``nn.Linear`` not recorded, and an MoE layer's router (vLLM builds it as a linear; transformers' is not)."""
    model = session.model
    names = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names |= {f"{name}.weight" for name in session.context.adapter.router_names(model)}
    state = model.state_dict(keep_vars=True)
    return [stored[: -len(".weight")] for name in names - quantized.keys()
            for stored in rename(name, state[name].to("meta"))]


def _save_configs(session, directory: Path, quantized: dict[str, QuantizedLinear], rename=_as_is) -> None:
    model = session.model
    if quantized:
        state = model.state_dict(keep_vars=True)
        grids = {stored[: -len(".weight")]: quantized[name].grid for name in state if name in quantized
                 for stored in rename(name, state[name].to("meta"))}  # in model order; a stacked tensor: each linear
        ignore = _unquantized(session, quantized, rename)
        format_ = next(iter(quantized.values())).format  # one per checkpoint (RunOutputs.restore_quantized)
        model.config.quantization_config = checkpoint_exporter(format_).quantization_config(grids, ignore)
    try:
        model.config.save_pretrained(directory)
    finally:
        if quantized:
            del model.config.quantization_config
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
