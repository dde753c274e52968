"""A packed source through a run that quantizes nothing: the linears no step changes are written packed again.

A packed checkpoint (``recipe_engine.formats``) is read dequantized, ``s (q - z)`` in the model dtype. When no
step of the recipe quantizes, the source's own records (grid, scale, zero point per linear,
``CheckpointReader.quantization_records``) are put on the run's outputs before the steps, as a quantizing step
would record them; the writer then packs those linears into the same bytes. Before the write, a record goes
with the layer a step removed, and with a weight a step changed (not exactly on its grid any more, ``on_grid``):
that linear is written in the model dtype, in the ``ignore`` list of the checkpoint's ``quantization_config``
(a format without such a list, GPTQ v1, then writes every linear unpacked). A step that quantizes decides the
output's quantization itself, so nothing is carried then.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import checkpoint_exporter
from ..numerics.quantization import on_grid


def carry_source_grids(session, reader) -> set[str]:
    """Record each packed linear of ``reader`` (the source checkpoint) that the model holds as a linear on
    ``session.outputs``; returns what was not carried: ``"fused"`` (nothing is carried where the architecture
    cannot carry grids linear by linear: ``ArchitectureAdapter.carries_linear_grids``), ``"layout"`` (a packed
    layout a record cannot hold, e.g. GPTQ v1 groups reordered by act-order),
    ``"scales"`` (the source's scales are not exact in the run's dtype, or the format would store them in
    another: the packed weights would not be the run's, :func:`_scales_kept`)."""
    if not session.context.adapter.carries_linear_grids:
        return {"fused"}
    modules = dict(session.model.named_modules())
    records = reader.quantization_records()
    left = set()
    for name in reader.packed:
        module = modules.get(name.removesuffix(".weight"))
        if not isinstance(module, nn.Linear) or name not in records:
            left.add("layout")
        elif not _scales_kept(records[name].grid.scale_dtype, session.model.dtype, reader.format):
            left.add("scales")
        else:
            session.outputs.restore_quantized(module, records[name])
    return left


def _scales_kept(scale_dtype: torch.dtype, run_dtype: torch.dtype, format) -> bool:
    """Whether a grid whose scales the source stores in ``scale_dtype`` is exactly the run's weights, and the
    format writes it so again: the format's default scales for the run's dtype, or 16-bit scales in a float32
    run (``(q − z) · s`` of a 16-bit ``s`` and an integer of at most 8 bits is exact in float32, and the writer
    stores each grid's own scale dtype)."""
    if scale_dtype == format.scale_dtype(run_dtype):
        return True
    return run_dtype == torch.float32 and scale_dtype in (torch.bfloat16, torch.float16) \
        and format.scale_dtype_problem(scale_dtype) is None


def drop_changed_grids(session) -> tuple[int, bool]:
    """Forget the records of linears no longer in the model, and of those whose weight a step changed; returns
    ``(changed, cleared)``: how many a step changed, and whether every record was forgotten because their format
    cannot leave a linear out. A streamed unit still at home in the source is unchanged by construction; one a
    step changed is read once, as the writer reads it (``WeightStream.read_unit``)."""
    quantized = session.outputs.quantized
    present = set(session.model.modules())
    units, read = {}, {}
    if session.stream is not None:
        units = {module: (unit, prefix) for unit in session.residency.stream_units()
                 for prefix, module in unit.named_modules()}
    changed = 0
    for key in list(quantized):
        module, parameter = key
        if module not in present:
            del quantized[key]
            continue
        weight = _current(session, module, parameter, units, read)
        if weight is not None and not on_grid(weight, quantized[key]):
            del quantized[key]
            changed += 1
    # the records left are the source's, all of one format: can it leave the changed linears out?
    cleared = bool(changed and quantized) \
        and not checkpoint_exporter(next(iter(quantized.values())).format).leaves_linears_out
    if cleared:
        quantized.clear()
    return changed, cleared


def _current(session, module: nn.Module, parameter: str, units: dict, read: dict):
    """The weight as it is now; None for a streamed unit whose home is still the source (``read``: the units
    read so far)."""
    tensor = getattr(module, parameter)
    if tensor.device.type != "meta":
        return tensor.detach()
    unit, prefix = units[module]
    if session.stream.home(unit).reader is session.stream.source:
        return None
    if unit not in read:
        read.clear()  # one unit held at a time (the records come unit by unit, in checkpoint order)
        read[unit] = session.stream.read_unit(unit)
    return read[unit][f"{prefix}.{parameter}" if prefix else parameter]


#: What a packed source's linears not carried were (``carry_source_grids``), as the notes say it.
UNCARRIED = {"fused": "the engine holds a mixture-of-experts model's experts as fused 3-D tensors, not the "
                        "per-expert linears its packed files hold",
             "layout": "the linears whose packed layout the engine does not write (groups reordered by act-order)",
             "scales": "the linears whose scales the format would store in the run's dtype, not the source's"}
REPACK = "end the recipe with GPTQ or Quantize to pack it (each rounds anew)"


def _read_note(packed: str, done: bool) -> str:
    """The notes' opening: the source is packed and read dequantized (``done``: said after the run)."""
    verbs = ("were", "quantized") if done else ("are", "quantizes")
    return f"the source's weights are packed ({packed}) and {verbs[0]} read dequantized; no step {verbs[1]}"


def _fused_note(packed: str, dtype: str, done: bool) -> str:
    return (f"{_read_note(packed, done)}, and {UNCARRIED['fused']}, so the output is written unpacked in {dtype}: "
            f"{REPACK}")


def plan_note(packed: str, dtype: str, adapter) -> str:
    """What a recipe that quantizes nothing will do with a source packed as ``packed`` (``packed_description``),
    on a model of ``adapter``'s architecture (None: not known)."""
    read = _read_note(packed, done=False)
    if adapter is not None and not adapter.carries_linear_grids:
        return _fused_note(packed, dtype, done=False)
    return (f"{read}, so the linears no step changes are written packed again on their source grids (in the dtype "
            f"the source stores its scales in), and those a step changes unpacked in {dtype}")


def output_note(packed: str, dtype: str, kept: int, changed: int, left: set[str], cleared: bool) -> str | None:
    """What a run that quantized nothing wrote of its packed source: ``kept`` linears packed again, the ``changed``
    ones and those ``left`` uncarried (``UNCARRIED``) unpacked; ``cleared``: the format cannot leave a linear
    out, so none was packed again. None when every linear left is packed again (what its user assumes)."""
    if not changed and not left:
        return None
    read = _read_note(packed, done=True)
    if "fused" in left:
        return _fused_note(packed, dtype, done=True)
    unpacked = " and ".join([f"the {changed} linears a step changed"] * bool(changed)
                            + [UNCARRIED[k] for k in sorted(left)])
    if kept:
        return (f"the source's weights are packed ({packed}); {kept} linears are written packed again on their "
                f"source grids, {unpacked} unpacked in {dtype} (listed in quantization_config's ignore)")
    why = "; the format cannot leave them out beside packed ones" if cleared else ""
    return (f"{read} and none of its linears is packed again ({unpacked}{why}), so the output is written unpacked "
            f"in {dtype}: {REPACK}")
