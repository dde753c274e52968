"""Helpers every quantizing step (``GPTQ``, ``Quantize``) uses (private: not a modifier module): which
linears a step targets, the ``group_size`` check against a symbolic shape, round-to-nearest on the engine's
grid (``recipe_engine.numerics.quantization.Grid``), the relative layer-output error used in reports, the
rows of the per-linear log (:data:`LOG_FILE`), and the grids of some linears set apart (:class:`Override`).
"""
from __future__ import annotations

import time
from typing import Literal
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from recipe_engine.api import (ADAPTERS, FUSED_ROLES, UNFUSED_ROLES, Grid, ModelShape, RecipeError,
                               checkpoint_exporter, checkpoint_formats, roles_problem)

#: Target roles (``recipe_engine.architectures.adapters``); a fused linear (Phi-3 ``qkv_proj``) is targeted by
#: all its members.
LINEARS = UNFUSED_ROLES


@dataclass
class QuantizedWeight:
    """Result of quantizing one weight: dequantized values (fp64) and per-group ``[rows, groups]``
    scale and zero point in the original column order."""

    dequantized: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@torch.no_grad()
def rtn(weight: torch.Tensor, grid: Grid) -> QuantizedWeight:
    """Round-to-nearest: every group quantized with its own min-max parameters (fp64)."""
    w = weight.detach().to(torch.float64)
    columns = w.shape[1]
    step = grid.width(columns)
    params = [grid.params(w[:, c:c + step]) for c in range(0, columns, step)]
    scale = torch.stack([p[0] for p in params], dim=1)
    zero = torch.stack([p[1] for p in params], dim=1)
    fake = grid.fake(w, grid.expand(scale, columns), grid.expand(zero, columns))
    return QuantizedWeight(fake, scale, zero)


def output_error(weight: torch.Tensor, quantized: torch.Tensor, gram: torch.Tensor) -> float:
    """Relative layer-output error ``tr(ΔW G ΔWᵀ) / tr(W G Wᵀ)`` for the input gram ``G = Σ x xᵀ``."""
    return float(output_errors([weight], [[quantized]], [gram])[0, 0])


def output_errors(weights: list[torch.Tensor], candidates: list[list[torch.Tensor]],
                  grams: list[torch.Tensor]) -> torch.Tensor:
    """:func:`output_error` of several weights of one shape, each against several candidates (e.g. GPTQ's result
    and round-to-nearest: ``candidates[k][e]`` for weight ``e``), at once: batched products into three fp64
    buffers the size of the weights, the denominator ``tr(W G Wᵀ)`` once per weight; each value is the one
    computed alone (bit for bit on CPU). Returns fp64 ``[candidate, weight]`` on the weights' device, unread
    (the log reads a layer's values at once: :func:`settle_rows`)."""
    w = torch.empty(len(weights), *weights[0].shape, dtype=torch.float64, device=weights[0].device)
    for row, weight in zip(w, weights):
        row.copy_(weight)
    g = _batch(grams) if any(gram is not grams[0] for gram in grams) else grams[0].expand(len(grams), -1, -1)
    delta, product = torch.empty_like(w), torch.empty_like(w)
    denominator = torch.matmul(w, g, out=product).mul_(w).sum((1, 2))
    errors = []
    for quantized in candidates:
        for row, weight, value in zip(delta, w, quantized):
            torch.sub(weight, value.to(torch.float64), out=row)
        errors.append(torch.matmul(delta, g, out=product).mul_(delta).sum((1, 2)) / denominator)
    return torch.stack(errors)


def _batch(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` without a copy of a single tensor (a large linear's fp64 weight)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def weight_error(weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """Relative weight error ``‖ΔW‖²_F / ‖W‖²_F`` (the output error for uncorrelated unit inputs, ``G = I``),
    a 0-dim fp64 tensor on the weight's device, unread (:func:`settle_rows`)."""
    w = weight.to(torch.float64)
    return (w - quantized.to(torch.float64)).square().sum() / w.square().sum()


class Seconds:
    """The time of one call of a step's work, for the log's ``seconds``: the wall clock on CPU; on a GPU the
    time between two events queued on the current stream around the call (the GPU's work, not its launch),
    read when the layer's rows are settled instead of synchronising after every call. ``stop(share)``: the
    call's time divided among ``share`` log rows (the experts solved together)."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.started, self.seconds, self.share = time.perf_counter(), None, 1

    def stop(self, share: int = 1) -> "Seconds":
        self.share = share
        if self.events is not None:
            self.events[1].record()
        else:
            self.seconds = time.perf_counter() - self.started
        return self

    def value(self) -> float:
        if self.seconds is None:
            self.events[1].synchronize()
            self.seconds = self.events[0].elapsed_time(self.events[1]) / 1000
        return self.seconds / self.share


def settle_rows(rows: list[dict]) -> list[dict]:
    """The log rows of a layer with their deferred values made numbers, in place: every 0-dim tensor (the
    errors, on the device they were computed on) read with one host transfer per device, every
    :class:`Seconds` read after that. On a GPU this is the layer's only wait for its quantization work, so the
    host queues every solve of the layer without waiting for the one before."""
    deferred: dict[torch.device, list[tuple[dict, str]]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, torch.Tensor):
                deferred.setdefault(value.device, []).append((row, key))
    for places in deferred.values():
        values = torch.stack([row[key].to(torch.float64) for row, key in places]).tolist()
        for (row, key), value in zip(places, values):
            row[key] = value
    for row in rows:
        if isinstance(row.get("seconds"), Seconds):
            row["seconds"] = row["seconds"].value()
    return rows


#: The per-linear quantization log in the output directory (``session.outputs.add_rows``).
LOG_FILE = "quantization_log.csv"


def log_row(layer: int, module: str, weight: torch.Tensor, grid: Grid, quantized: torch.Tensor, *, method: str,
            damp: float | None = None, damping: float | None = None, error_rtn: float | None = None,
            error: float | None = None, tokens: int = 0, seconds: "float | Seconds") -> dict:
    """One row of :data:`LOG_FILE` (call before the weight ``[out, in]`` is overwritten): ``method`` how it was
    quantized (``gptq``, ``rtn``, or ``rtn-fallback``: an expert with too few calibration tokens),
    ``error_rtn`` and ``error`` the relative layer-output errors (:func:`output_error`) of round-to-nearest
    and of the step's result on the calibration inputs (None without them); ``damping`` the absolute ``λ``
    added to ``diag H``. Errors and ``seconds`` may be left unread (tensors, :class:`Seconds`) until the
    layer's rows are settled (:func:`settle_rows`) before they are logged."""
    rows, columns = weight.shape
    return {"layer": layer, "module": module, "method": method, "rows": rows, "columns": columns,
            "bits": grid.bits, "group_size": grid.width(columns), "sym": grid.sym, "damp": damp,
            "damping": damping, "error_rtn": error_rtn, "error": error,
            "weight_error": weight_error(weight, quantized), "hessian_tokens": tokens, "seconds": seconds}


#: The model dtype of ``ModelShape.dtype_bytes``.
_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def linear_path(model_type: str, role: str) -> str:
    """Path inside a decoder layer of the linear holding ``role`` (a fused one for its members)."""
    if model_type not in ADAPTERS:
        raise RecipeError(f"unsupported architecture '{model_type}'; supported: {', '.join(sorted(ADAPTERS))}")
    adapter = ADAPTERS[model_type]
    if role not in adapter.linear_roles([role]):  # an MoE MLP role: its expert tensor
        return f"{adapter.experts.path}.{'down_proj' if role == 'down_proj' else 'gate_up_proj'}"
    return adapter.path(next((f for f, members in adapter.fused.items() if role in members), role))


def expert_targets(model_type: str, targets: list[str]) -> list[str]:
    """The expert tensors ``targets`` select on an MoE architecture ([] on a dense or unknown one)."""
    adapter = ADAPTERS.get(model_type)
    return adapter.expert_roles(targets) if adapter is not None else []


def packed_experts_problem(model_type: str, tensors: list[str], export: str, sym: bool) -> tuple[str, str] | None:
    """``(message, field)``: why the packed ``export`` cannot store the expert ``tensors`` of ``model_type`` on a
    grid with ``sym`` (None: it can)."""
    layout = ADAPTERS[model_type].experts
    if not checkpoint_exporter(export).packs_experts:
        return (f"export {export} does not store {model_type}'s expert tensors; use export: compressed-tensors or "
                f"dequantized", "export")
    if layout.packed_problem:
        return (f"export {export} cannot store {model_type}'s experts: {layout.packed_problem}; use export: "
                f"dequantized", "export")
    if len(tensors) < 2:
        return ("packed experts need gate_proj, up_proj and down_proj targeted together (vLLM loads an MoE "
                "layer's experts with one scheme); add the missing ones, or use export: dequantized", "targets")
    if not sym:
        return ("packed experts need sym: true (vLLM's MoE kernels take symmetric weights only; transformers "
                "dequantizes packed experts without zero points); use sym: true, or export: dequantized", "sym")
    return None


def known_targets(targets: list[str]) -> list[str]:
    """Validator: every target is a role of :data:`LINEARS`; the older ``self_attn.q_proj`` / ``mlp.up_proj``
    spelling names the same role."""
    roles = [t.split(".", 1)[1] if t.startswith(("self_attn.", "mlp.")) else t for t in targets]
    unknown = sorted(set(roles) - set(LINEARS))
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {list(LINEARS)}")
    return roles


def grid_problem(shape: ModelShape, targets: list[str], group_size: int | None,
                 layers: list[int] | None = None) -> tuple[str, str] | None:
    """``(message, field)`` for the first configuration error against ``shape``: a target whose input
    width ``group_size`` does not divide (named by layer; ``layers``: only these, default all)."""
    problem = roles_problem(shape.model_type, targets, experts=True)
    if problem:
        return problem, "targets"
    if group_size is None:
        return None
    for layer in range(shape.num_layers) if layers is None else layers:
        for target in targets:
            width = shape.linear_sizes(shape.layers[layer])[target][1]
            if width % group_size:
                divisors = [d for d in (256, 128, 64, 32, 16) if width % d == 0][:2]
                hint = f"; divisors of {width}: {', '.join(map(str, divisors))}" if divisors else ""
                return (f"group_size {group_size} does not divide the input width {width} of "
                        f"model.layers.{layer}.{linear_path(shape.model_type, target)}{hint}", "group_size")
    return None


class Override(BaseModel):
    """Another grid for some linears of some decoder layers (an entry of ``GridParameters.overrides``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: list[int] = Field(min_length=1, description=(
        "decoder layer indices as the step receives them (negative: from the end, -1 the last)"))
    targets: list[str] | None = Field(None, min_length=1, description="roles (null: all the step's targets)")
    bits: int = Field(ge=2, le=8, description="integer bits per weight")
    group_size: PositiveInt | None = Field(None, description="input columns sharing one scale (null: the step's)")
    sym: bool | None = Field(None, description="symmetric grid (null: the step's)")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else known_targets(value)


def override_problem(entry: Override, step_targets: list[str], shape: ModelShape) -> tuple[str, str] | None:
    """``(message, field)``: why ``entry`` cannot apply on ``shape`` to a step targeting ``step_targets`` (the
    field inside the entry), or None."""
    count = shape.num_layers
    outside = [layer for layer in entry.layers if not -count <= layer < count]
    if outside:
        return (f"layer {outside[0]} is out of range: the step receives {count} decoder layers (0 … {count - 1}, "
                f"or -{count} … -1)", "layers")
    targets = entry.targets or step_targets
    foreign = [t for t in targets if t not in step_targets]
    if foreign:
        return f"targets {foreign} are not among the step's targets {step_targets}", "targets"
    experts = [t for t in targets if expert_targets(shape.model_type, [t])]
    if experts:
        return (f"{shape.model_type}'s {', '.join(experts)} are mixture-of-experts expert tensors, which take the "
                f"step's grid; an override may target the attention linears", "targets")
    for fused, members in FUSED_ROLES.items():
        shared = [m for m in members if m in step_targets]
        named = [m for m in shared if m in targets]
        if named and len(named) < len(shared):
            return (f"{', '.join(named)} without {', '.join(m for m in shared if m not in named)}: linears reading "
                    f"one input take one grid (GPTQ solves them as one matrix, vLLM serves them as one {fused})",
                    "targets")
    if entry.group_size is not None:
        problem = grid_problem(shape, targets, entry.group_size, [layer % count for layer in entry.layers])
        if problem:
            return problem[0], "group_size"
    return None


class GridParameters(BaseModel):
    """The grid, targets and export every quantizing step takes (a base class of ``GPTQ`` and ``Quantize``),
    with their validation against the symbolic shape."""

    bits: int = Field(4, ge=2, le=8, description="integer bits per weight")
    group_size: PositiveInt | None = Field(128, description="input columns sharing one scale (null: per row)")
    sym: bool = Field(True, description="symmetric grid (zero point at the middle); false: min-max")
    targets: list[str] = Field(list(LINEARS), min_length=1, description=(
        "linear roles inside each decoder layer (q_proj … down_proj); a fused linear (Phi-3 qkv_proj, "
        "gate_up_proj) is targeted by naming all its members"))
    export: str = Field("compressed-tensors", description=(
        "checkpoint format (recipe_engine/formats): compressed-tensors (packed int, vLLM/SGLang), "
        "gptq (GPTQ v1 qweight/qzeros/scales/g_idx), dequantized (model-dtype weights on the grid)"))
    overrides: list[Override] = Field([], description=(
        "other grids for some linears: [{layers: [0, -1], targets: [down_proj], bits: 8}]; a linear takes the "
        "last entry naming its layer and role, else the step's grid"))
    scale_dtype: Literal["model", "bfloat16", "float16"] = Field("model", description=(
        "the dtype the scales are rounded to and stored in: model (the model's dtype, as llm-compressor "
        "writes them), or bfloat16/float16: a float32 run writes the 16-bit scales a bf16/fp16 model would "
        "(4 + 16/group_size bits per weight at 4 bits), exact when the checkpoint is served in that dtype"))

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        return known_targets(value)

    @field_validator("export")
    @classmethod
    def _known_export(cls, value: str) -> str:
        if value not in checkpoint_formats():
            raise ValueError(f"unknown export {value!r}; choose from {', '.join(checkpoint_formats())}")
        return value

    @property
    def quantizes(self) -> bool:  # packed weights must stay on their grid; dequantized ones may change
        return checkpoint_exporter(self.export).packs

    def override_for(self, layer: int, layers: int, role: str) -> Override | None:
        """The last of ``overrides`` naming ``layer`` (of ``layers``) and ``role`` (a fused linear's: its members),
        None where the step's grid applies."""
        members = FUSED_ROLES.get(role, (role,))
        return next((entry for entry in reversed(self.overrides) if layer in {i % layers for i in entry.layers}
                     and any(m in (entry.targets or self.targets) for m in members)), None)

    def grid(self, weight_dtype: torch.dtype | None = None, at: tuple[int, int, str] | None = None) -> Grid:
        """The grid (``at``: of the linear ``(layer, layers, role)``, its override's where one names it); with the
        weights' dtype, its scales rounded to what the export stores."""
        return self._grid_of(self.override_for(*at) if at is not None else None, self.stored_scale_dtype(weight_dtype))

    @property
    def requested_scale_dtype(self) -> torch.dtype | None:
        """``scale_dtype`` as a torch dtype; None for ``model`` (the export's default for the model dtype)."""
        return None if self.scale_dtype == "model" else getattr(torch, self.scale_dtype)

    def stored_scale_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the export stores this step's scales in for a model of ``weight_dtype`` (None: unknown)."""
        if weight_dtype is None:
            return None
        return self.requested_scale_dtype or checkpoint_exporter(self.export).scale_dtype(weight_dtype)

    def _grid_of(self, entry: Override | None, scale_dtype: torch.dtype | None = None) -> Grid:
        """The grid of one of ``overrides`` (None: the step's): what it leaves out is the step's."""
        if entry is None:
            return Grid(self.bits, self.group_size, self.sym, scale_dtype)
        return Grid(entry.bits, entry.group_size or self.group_size, self.sym if entry.sym is None else entry.sym,
                    scale_dtype)

    def mark(self, session, linear: torch.nn.Module, grid: Grid, scale: torch.Tensor, zero: torch.Tensor,
             parameter: str = "weight") -> None:
        """Record a quantized linear (or an MoE layer's expert tensor ``parameter``) for a packing export (a
        no-op for a dequantized one)."""
        if self.quantizes:
            session.outputs.mark_quantized(linear, grid, scale, zero, self.export, parameter)

    def format_line(self, layers: int, roles: list[str]) -> str:
        """The number format the weights are left in, one line (a step result's ``format``): the step's grid,
        then each override's grid with how many of the step's linears (``roles`` in each of ``layers``) take it."""
        stored = f"packed ({self.export})" if self.quantizes else "stored dequantized in the model dtype"
        line = f"{_grid_words(self.grid())}, {stored}"
        counts: dict[Grid, int] = {}
        for layer in range(layers):
            for role in roles:
                grid = self.grid(at=(layer, layers, role))
                if grid != self.grid():
                    counts[grid] = counts.get(grid, 0) + 1
        return "; ".join([line] + [f"{_grid_words(grid, self.grid())} for {count} linears (overrides)"
                                   for grid, count in counts.items()])

    def stored_linear_bits(self, shape: ModelShape) -> float | None:
        """Average stored bits per weight of the decoder's dense linears once this step has run (``Σ stored
        bits / Σ rows · columns`` over every layer's q … down_proj: the targeted ones on their grid as the export
        writes them, ``Exporter.stored_bits``; the others in the model dtype); None on mixture-of-experts
        layers, whose expert tensors this does not count."""
        if shape.num_experts:
            return None
        exporter, dtype = checkpoint_exporter(self.export), _DTYPES[shape.dtype_bytes]
        stored = weights = 0
        for layer in range(shape.num_layers):
            sizes = shape.linear_sizes(shape.layers[layer])
            for role in LINEARS:
                size = sizes[role]
                weights += size[0] * size[1]
                if role in self.targets:
                    grid = self.grid(dtype, at=(layer, shape.num_layers, role))
                    stored += exporter.stored_bits(size, grid, dtype)
                else:
                    stored += size[0] * size[1] * torch.finfo(dtype).bits
        return stored / weights

    def check(self, shape: ModelShape) -> None:
        self._check_grids(shape)
        shape.linear_bits = self.stored_linear_bits(shape)

    def _check_grids(self, shape: ModelShape) -> None:
        exporter = checkpoint_exporter(self.export)
        problem = exporter.grid_problem(self.bits, self.sym)
        if problem:
            raise self.fail(problem, "bits" if "bits" in problem else "sym")
        problem = self.requested_scale_dtype and exporter.scale_dtype_problem(self.requested_scale_dtype)
        if problem:
            raise self.fail(problem, "scale_dtype")
        experts = expert_targets(shape.model_type, self.targets)
        problem = self.quantizes and experts and packed_experts_problem(shape.model_type, experts, self.export,
                                                                         self.sym)
        if problem:
            raise self.fail(*problem)
        problem = grid_problem(shape, self.targets, self.group_size)
        if problem:
            raise self.fail(*problem)
        if self.overrides and exporter.mixed_grids_problem(sym=True):
            raise self.fail(exporter.mixed_grids_problem(sym=True), "overrides")
        asymmetric = ["sym"] * (not self.sym) + [f"overrides.{index}.sym" for index, entry in enumerate(self.overrides)
                                                 if not self._grid_of(entry).sym]
        problem = self.overrides and asymmetric and exporter.mixed_grids_problem(sym=False)
        if problem:
            raise self.fail(problem, asymmetric[0])
        for index, entry in enumerate(self.overrides):
            grid = self._grid_of(entry)
            problem = override_problem(entry, self.targets, shape) or exporter.grid_problem(grid.bits, grid.sym)
            if isinstance(problem, str):
                problem = problem, "bits" if "bits" in problem else "sym"
            if problem:
                raise self.fail(problem[0], f"overrides.{index}.{problem[1]}")


def _grid_words(grid: Grid, main: Grid | None = None) -> str:
    """``int4 symmetric, groups of 128 columns``; with the step's ``main`` grid, the bits and only what else
    differs from it (``int8``)."""
    words = f"int{grid.bits}"
    if main is None or grid.sym != main.sym:
        words += " symmetric" if grid.sym else " asymmetric"
    if main is None or grid.group_size != main.group_size:
        words += f", groups of {grid.group_size} columns" if grid.group_size else ", one group per row"
    return words


def bits_per_weight(rows: list[dict], step: GridParameters, dtype: torch.dtype) -> float:
    """Stored bits per weight of the linears of ``rows`` (the step's :data:`LOG_FILE` rows, values as read back:
    strings) in the step's export with model ``dtype``: ``Σ bits of the tensors written for a linear / Σ rows ·
    columns`` (``Exporter.stored_bits``: compressed-tensors' codes, scales and zero points as packed)."""
    exporter = checkpoint_exporter(step.export)
    stored = weights = 0
    for row in rows:
        shape = int(row["rows"]), int(row["columns"])
        grid = Grid(int(row["bits"]), int(row["group_size"]), str(row["sym"]) == "True",
                    step.stored_scale_dtype(dtype))
        stored += exporter.stored_bits(shape, grid, dtype)
        weights += shape[0] * shape[1]
    return round(stored / weights, 4) if weights else 0.0
