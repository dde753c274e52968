"""The engine's checkpoint writer: sharded safetensors assembled unit by unit (never from a whole model),
dense or with the linears a quantizing step recorded packed in the format it named
(``recipe_engine.io.exporters``).

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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from ..numerics.quantization import QuantizedLinear
from .checkpoint_names import saved_names
from .exporters import checkpoint_exporter
from .checkpoint_reader import INDEX_FILE, SINGLE_FILE, is_materialized
from .report import HASH_BATCH_BYTES, HASH_THREADS, WeightsFingerprint, segment_digests

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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: safetensors dtype names (https://github.com/huggingface/safetensors: the header's ``dtype`` field).
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


#: Bytes handed to the writing threads and not yet written, at most (beyond one batch): the next unit is
#: packed while the last one's bytes are written and hashed. Host memory while writing is then a unit, the next
#: one read ahead and this: below a pass's (a layer, the next read ahead, the calibration activations).
WRITE_BEHIND_BYTES = 512 << 20


class _WrittenBehind:
    """A file written by one thread and, when ``digests`` is a list, each buffer's sha256 appended to it in
    order (``report.WeightsFingerprint``'s segments), hashed on :data:`report.HASH_THREADS` threads; all behind
    the caller, in the order the buffers are handed over (:meth:`put`). Buffers go to the threads in batches
    (of :data:`report.HASH_BATCH_BYTES`: a packed MoE layer is thousands of small tensors, and a hand-over each
    cost more than their bytes); at most :data:`WRITE_BEHIND_BYTES` wait. File writes and sha256 release the GIL, so
    the caller's next unit is read and packed meanwhile (on a lent H200 one sha256 over the output ran at
    1.2 GB/s, and was the write's last step)."""

    def __init__(self, handle, digests: list | None):
        self._handle = handle
        self._digests = digests
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="recipe-output-writer")
        self._hashers = None if digests is None else ThreadPoolExecutor(HASH_THREADS,
                                                                        thread_name_prefix="recipe-output-hasher")
        self._batch: list = []
        self._batch_bytes = 0
        #: (the batch's write, its hash or None, its bytes), in order
        self._pending: deque[tuple[Future, Future | None, int]] = deque()
        self._bytes = 0
        self._failed = False

    def _write(self, buffers) -> None:
        if self._failed:  # nothing after a failed write: the caller raises its error
            return
        try:
            for data in buffers:
                self._handle.write(data)
        except BaseException:
            self._failed = True
            raise

    def put(self, tensor: torch.Tensor | bytes) -> None:
        """Write ``tensor``'s bytes (a host tensor, kept alive until written and hashed) or ``bytes`` next."""
        data = tensor if isinstance(tensor, bytes) else tensor.reshape(-1).view(torch.uint8).numpy().data
        if self._batch and self._batch_bytes + len(data) > HASH_BATCH_BYTES:
            self._hand_over()
        self._batch.append(data)
        self._batch_bytes += len(data)

    def _hand_over(self) -> None:
        while self._pending and self._bytes > WRITE_BEHIND_BYTES:
            self._wait_oldest()
        batch, size = self._batch, self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        hashed = None if self._hashers is None else self._hashers.submit(segment_digests, batch)
        self._pending.append((self._writer.submit(self._write, batch), hashed, size))
        self._bytes += size

    def _wait_oldest(self) -> None:
        written, hashed, size = self._pending.popleft()
        self._bytes -= size
        written.result()  # a failed write raises here
        if hashed is not None:
            self._digests.extend(hashed.result())  # in file order: the batches are waited for in order

    def finish(self) -> None:
        """Wait for every write and hash (raising the first failure; the digests are appended as their batches
        are waited for); the threads end either way."""
        try:
            if self._batch:
                self._hand_over()
            while self._pending:
                self._wait_oldest()
        finally:
            for written, hashed, _ in self._pending:
                for future in (written, hashed):
                    if future is not None:
                        future.cancel()
            for pool in (self._writer, self._hashers):
                if pool is not None:
                    pool.shutdown(wait=True)


def write_safetensors_incrementally(path: Path, layout: dict[str, torch.Tensor], chunks,
                                    digests: list | None = None) -> int:
    """A safetensors file whose tensors arrive in ``chunks`` (an iterable of ``{name: tensor}``) and are
    written as they come, so at most one chunk (and :data:`WRITE_BEHIND_BYTES` being written) is in memory.
    ``layout`` (meta tensors allowed) fixes the header: names in file order with dtype and shape; every
    chunk tensor must match it. The file format: an 8-byte little-endian header length, the JSON header
    (``__metadata__`` plus ``dtype``, ``shape`` and contiguous ``data_offsets`` per tensor, space-padded to
    8 bytes), then the raw little-endian data. ``safetensors.torch.save_file`` needs every tensor at once;
    the files are byte-compatible. ``digests`` (a list): the sha256 of each of the file's segments
    (``report.safetensors_segments``: the header with its length, then each tensor) appended in file order,
    hashed while they are written (:class:`_WrittenBehind`)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in layout.items():
        size = _nbytes(tensor)
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    expected = iter(layout.items())
    with open(path, "wb") as handle:
        behind = _WrittenBehind(handle, digests)
        try:
            behind.put(len(text).to_bytes(8, "little") + text)
            for chunk in chunks:
                for name, tensor in chunk.items():
                    want, spec = next(expected)
                    if name != want or tensor.dtype != spec.dtype or tensor.shape != spec.shape:
                        raise RuntimeError(f"{path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                                           f"expected {want} {tuple(spec.shape)} {spec.dtype}")
                    behind.put(tensor.detach().to("cpu").contiguous())  # a no-op for write_checkpoint's
        finally:
            behind.finish()
    if next(expected, None) is not None:
        raise RuntimeError(f"{path.name}: fewer tensors written than its header lists")
    return offset


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
#: fp64 working memory of packing, per element of the weight packed at once (``grid_codes``: the weight, its
#: codes, the rounded-back check and their temporaries, counted as 6 × 8 bytes).
PACK_BYTES_PER_ELEMENT = 6 * 8


def pack_device(device: torch.device, tensor: torch.Tensor) -> torch.device:
    """Where a quantized weight is packed: on the run's GPU when the tensor and the fp64 working copies of its
    largest linear (:data:`PACK_BYTES_PER_ELEMENT`) fit in ``PACK_DEVICE_SHARE`` of its free memory, else on the
    host. The packed tensors are the same bit for bit (integer codes of an fp64 division); a GPU makes the write
    of an MoE model's thousands of experts take seconds, not minutes of CPU time."""
    if device.type != "cuda" or tensor.device.type == "meta":
        return tensor.device
    linear = tensor.numel() if tensor.dim() <= 2 else tensor[0].numel()
    need = _nbytes(tensor) + PACK_BYTES_PER_ELEMENT * linear
    free, _total = torch.cuda.mem_get_info(device)
    return device if need <= PACK_DEVICE_SHARE * free else torch.device("cpu")


def _stored(name: str, tensor: torch.Tensor, quantized: dict[str, QuantizedLinear],
            rename=_as_is, device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """The file entries of one state tensor: itself (``rename``: under ``save_pretrained``'s on-disk names), or
    its packed tensors when it is a quantized weight; an MoE layer's stacked experts are split by ``rename``
    into each expert's linears (the Hub's names), their scales and zero points split the same way, and each
    linear packed. ``device``: the run's device; a quantized weight is packed where ``pack_device`` says."""
    record = quantized.get(name)
    if record is None:
        return rename(name, tensor)
    if tensor.device.type != "meta":  # a layout is computed where the tensor is
        on = pack_device(device, tensor)
        tensor, record = tensor.to(on), replace(record, scale=record.scale.to(on), zero=record.zero.to(on))
    if record.parameter != "weight":
        if tensor.device.type != "meta" and _packs_by_rows(record):
            return _packed_experts(name, tensor, record, rename)
        scales, zeros = rename(name, record.scale), rename(name, record.zero)
        return {key: value for linear, weight in rename(name, tensor).items()
                for key, value in _packed(linear, weight, replace(record, scale=scales[linear],
                                                                  zero=zeros[linear])).items()}
    return _packed(name, tensor, record)


def _packs_by_rows(record: QuantizedLinear) -> bool:
    """Whether the format packs each row of a linear on its own (compressed-tensors with a symmetric grid: codes
    packed along the columns, no zero points packed along the rows), so the rows of stacked experts can be
    packed as one matrix."""
    return record.format == "compressed-tensors" and record.grid.sym


#: fp64 working memory of packing one chunk of stacked experts (:data:`PACK_BYTES_PER_ELEMENT`), on the
#: host and on a GPU (there also at most what ``PACK_DEVICE_SHARE`` of its free memory leaves beside the tensor:
#: below a GPTQ pass's own working memory on an MoE model, so the write does not raise the run's peak).
HOST_PACK_BYTES = 1 << 30
DEVICE_PACK_BYTES = 4 << 30


def experts_per_chunk(tensor: torch.Tensor) -> int:
    """How many experts of a stacked ``[experts, rows, cols]`` tensor :func:`_packed_experts` packs at once, where
    the tensor is (at least one)."""
    per_expert = PACK_BYTES_PER_ELEMENT * tensor[0].numel()
    budget = HOST_PACK_BYTES
    if tensor.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(tensor.device)
        budget = min(DEVICE_PACK_BYTES, int(PACK_DEVICE_SHARE * free) - _nbytes(tensor))
    return max(1, min(len(tensor), budget // per_expert))


def _packed_experts(name: str, tensor: torch.Tensor, record: QuantizedLinear, rename) -> dict[str, torch.Tensor]:
    """The packed tensors of every expert of a stacked ``[experts, rows, cols]`` weight, its experts packed a chunk
    at a time as one ``[chunk · rows, cols]`` matrix (:func:`experts_per_chunk`: one division, on-grid check and
    copy to the host per chunk: 19 and 10 chunks on the host, 5 and 3 on a GPU, for Qwen3-30B-A3B's gate/up
    and down_proj) and then split into each expert's linears
    by ``rename``: the bytes of packing each linear alone (``tests/test_exporters.py``), without a kernel launch,
    host read and copy per expert (3 × 128 per Qwen3-30B-A3B layer)."""
    experts, rows, columns = tensor.shape
    exporter, chunk, pieces = checkpoint_exporter(record.format), experts_per_chunk(tensor), {}
    for first in range(0, experts, chunk):
        part = slice(first, min(first + chunk, experts))
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
    # MoE: save_pretrained's per-expert names, also for packed experts (transformers dequantizes them at load,
    # vLLM reads them); packed attention beside dense experts keeps the fused names (transformers' compressed-
    # tensors loading does not convert dense per-expert names: 5.24 fails on them)
    experts_packed = any(record.parameter != "weight" for record in quantized.values())
    per_expert = session.context.adapter.experts is not None and (experts_packed or not quantized)
    rename = saved_names(model) if per_expert else _as_is
    layout_of = {name: _stored(name, tensor.to("meta"), quantized, rename) for name, tensor in state.items()}
    shards: list[list[tuple[torch.nn.Module | None, dict[str, str]]]] = [[]]
    size = 0
    for group in _groups(session):
        group_bytes = sum(_nbytes(t) for name in group[1] for t in layout_of[name].values())
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
    experts = session.context.adapter.experts
    if experts is not None:
        names |= {f"{name}.weight" for name, _ in model.named_modules() if name.endswith(f".{experts.router}")}
    state = model.state_dict(keep_vars=True)
    return [stored[: -len(".weight")] for name in names - quantized.keys()
            for stored in rename(name, state[name].to("meta"))]


def _save_configs(session, directory: Path, quantized: dict[str, QuantizedLinear], rename=_as_is) -> None:
    model = session.model
    if quantized:
        state = model.state_dict(keep_vars=True)
        grids = {stored[: -len(".weight")]: quantized[name].grid for name in state if name in quantized
                 for stored in rename(name, state[name].to("meta"))}  # in model order; an MoE layer's experts: each
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
