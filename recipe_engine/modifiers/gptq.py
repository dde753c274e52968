"""GPTQ: layer-wise weight quantization with second-order error feedback (Frantar et al., ICLR 2023)."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, NonNegativeInt, PositiveInt

from recipe_engine.api import (InputCovariance, LayerModifier, ModifierSession, StagedLayer, lower_triangular_inverse,
                               position, register)

from ._experts import FALLBACK, MoEInputs, budgets, expert_grams, quantize_experts, solve_bytes
from ._quant import (LOG_FILE, Grid, GridParameters, QuantizedWeight, Seconds, bits_per_weight, expert_targets,
                     log_row, output_errors, rtn, settle_rows)


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` with ``λ = damp · mean(diag H)`` (GPTQ §4, Step 3:
    row ``i`` of ``U`` divided by ``U_ii`` is the OBS update for column ``i`` given columns ``< i`` done).

    With ``P`` the order reversal and ``P(H + λI)P = LLᵀ``, ``U = P L⁻¹ P`` (upper triangular, positive
    diagonal, ``UᵀU = P L⁻ᵀL⁻¹ P = (H + λI)⁻¹``): one Cholesky and one triangular inverse, ``n³/3``
    multiply-adds, where the reference code's Cholesky, ``cholesky_inverse`` and second Cholesky take
    ``2n³/3`` (``down_proj`` of Llama-3-8B: n = 14336). Leading dimensions are a batch of Hessians, each with
    its own ``λ``."""
    reversed_h = hessian.flip(-2, -1)  # a copy: at most two n × n buffers beside H at any time
    diagonal = torch.diagonal(hessian, dim1=-2, dim2=-1)
    reversed_h.diagonal(dim1=-2, dim2=-1).add_(damp * diagonal.mean(-1, keepdim=True))
    lower, info = torch.linalg.cholesky_ex(reversed_h)
    del reversed_h
    if bool(info.any()):  # one synchronisation; which ones only when some failed
        failed = torch.nonzero(info.reshape(-1)).flatten().tolist()
        which = f" (Hessians {failed} of the batch)" if info.numel() > 1 else ""
        raise ValueError(f"damped Hessian not positive definite{which} (damp={damp}); raise damp")
    inverse = lower_triangular_inverse(lower)
    del lower
    return inverse.flip(-2, -1)


#: Columns per inner lazy batch of ``gptq_quantize`` (speed only).
SUB_BLOCK = 16


def quantize_block(w1: torch.Tensor, hb: torch.Tensor, q_out: torch.Tensor, err: torch.Tensor, grid: Grid,
                   sub: int, column_scale: torch.Tensor, column_zero: torch.Tensor,
                   group_scale: torch.Tensor | None = None, group_zero: torch.Tensor | None = None) -> None:
    """One lazy-batch block of GPTQ's column sweep over a batch of ``E`` weights, in place: ``w1``
    [E, block, rows] the block's (transposed) weights, ``hb`` [E, block, block] their ``U`` diagonal blocks;
    writes the dequantized columns to ``q_out`` and the scaled errors ``(w - q) / U_ii`` to ``err``. Static
    groups: ``column_scale``/``column_zero`` [E, block, rows] are each column's group parameters. Dynamic
    groups (``group_scale`` given, [E, block / width, rows]): a group's parameters are computed from the
    updated weights when its first column is reached and written there (``column_scale`` then holds the
    group width in its length only: ``block / groups``).

    Every operation is one batched tensor operation over the ``E`` weights (the same kernels a single weight
    runs, on ``E`` times the elements) with no host synchronisation, so on a GPU the whole block is captured
    once as a CUDA graph and replayed per block (``_BlockGraph``)."""
    n = w1.shape[1]
    width = n // group_scale.shape[1] if group_scale is not None else 0
    for s0 in range(0, n, sub):
        s1 = min(s0 + sub, n)
        for i in range(s0, s1):
            if group_scale is not None:
                if i % width == 0:
                    scale, zero = grid.params(w1[:, i:i + width].transpose(1, 2))
                    group_scale[:, i // width].copy_(scale)
                    group_zero[:, i // width].copy_(zero)
                scale, zero = group_scale[:, i // width], group_zero[:, i // width]
            else:
                scale, zero = column_scale[:, i], column_zero[:, i]
            q = grid.fake(w1[:, i], scale, zero)
            q_out[:, i] = q
            err[:, i] = (w1[:, i] - q) / hb[:, i, i, None]
            w1[:, i + 1:s1].addcmul_(hb[:, i, i + 1:s1, None], err[:, i, None], value=-1)
        w1[:, s1:] -= hb[:, s0:s1, s1:].transpose(1, 2) @ err[:, s0:s1]


class _BlockGraph:
    """``quantize_block`` of one shape over static buffers, captured as a CUDA graph on a GPU: ``run``
    copies a block's inputs in, replays it (about ten kernels per column launched as one graph instead of
    one by one from Python) and leaves the results in ``q_out``/``err``/``group_*``. The graph runs the
    same kernels on the same values as the eager call, so the result is identical. Off a GPU (the test
    suite) ``run`` calls the program directly over the same buffers. Capturing runs the block eagerly twice
    (warm-up and capture), so a graph is kept for every later block of its shape (:class:`BlockPrograms`)."""

    def __init__(self, count: int, rows: int, n: int, groups: int | None, grid: Grid, sub: int,
                 like: torch.Tensor):
        def buffer(*size):
            return torch.zeros(count, *size, dtype=like.dtype, device=like.device)

        self.w1, self.hb, self.q_out, self.err = buffer(n, rows), buffer(n, n), buffer(n, rows), buffer(n, rows)
        per_column = (n, rows) if groups is None else (n, 1)  # dynamic groups: only the shape is read
        self.column_scale, self.column_zero = buffer(*per_column), buffer(*per_column)
        self.group_scale = buffer(groups, rows) if groups else None
        self.group_zero = buffer(groups, rows) if groups else None
        self.hb.diagonal(dim1=1, dim2=2).fill_(1.0)
        self.program = lambda: quantize_block(self.w1, self.hb, self.q_out, self.err, grid, sub, self.column_scale,
                                              self.column_zero, self.group_scale, self.group_zero)
        self.graph = None
        if like.device.type == "cuda":
            side = torch.cuda.Stream(like.device)
            side.wait_stream(torch.cuda.current_stream(like.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (allocator and library handles)
                self.program()
            torch.cuda.current_stream(like.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's capture-unsafe CUDA calls invalidate the capture ("global", the
            # default: any thread's); a streamed run's staging thread may meanwhile wait on a copy's event and
            # free its pinned buffers (``streaming._save_when_copied``); torch.compile captures its CUDA graphs so too
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.program()

    def run(self, w1, hb, column_scale, column_zero) -> None:
        self.w1.copy_(w1)
        self.hb.copy_(hb)
        if self.group_scale is None:
            self.column_scale.copy_(column_scale)
            self.column_zero.copy_(column_zero)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.program()


class BlockPrograms:
    """The block programs (``_BlockGraph``) of a run, one per shape, kept across GPTQ calls and layers: a
    layer's sweeps (q/k/v, o, the gate/up stacks and down_proj batches of an MoE layer) have a handful of
    shapes, each captured once per run instead of once per call (a capture is two eager runs of the block,
    launched kernel by kernel from Python, while the GPU mostly waits)."""

    def __init__(self):
        self.programs: dict[tuple, _BlockGraph] = {}

    def get(self, count: int, rows: int, n: int, groups: int | None, grid: Grid, sub: int,
            like: torch.Tensor) -> _BlockGraph:
        key = (count, rows, n, groups, grid, sub, like.dtype, like.device)
        if key not in self.programs:
            self.programs[key] = _BlockGraph(count, rows, n, groups, grid, sub, like)
        return self.programs[key]


@dataclass
class FactoredHessians:
    """What GPTQ's column sweep needs of a batch of ``E`` Hessians ``[E, n, n]`` (:func:`factor_hessians`):
    ``dead`` [E, n] the inputs never seen, ``order`` [E, n] the order the columns are quantized in, ``factor``
    [E, n, n] ``U`` of the damped Hessian in that order (:func:`inverse_hessian_factor`), ``damping`` [E] the
    absolute ``λ = damp · mean(diag H)`` it added (logged; an input never seen counts 1). A Hessian shared by
    several sweeps (the gate/up of every expert of a layer, stacked ``_experts.budgets``' rows at a time) is factored
    once for all of them."""

    dead: torch.Tensor
    order: torch.Tensor
    factor: torch.Tensor
    damping: torch.Tensor


@torch.no_grad()
def factor_hessians(grams: torch.Tensor, act_order: bool, damp: float, device=None) -> FactoredHessians:
    """:class:`FactoredHessians` of the input Grams ``[E, n, n]`` (in fp64 on ``device``, default theirs): an
    input never seen (``H_ii = 0``) gets ``H_ii = 1``, as in the reference code; ``act_order`` orders the columns
    by descending ``H_ii`` (stable), else keeps them in place."""
    h = grams.detach().to(device=device or grams.device, dtype=torch.float64).clone()
    count, columns, _ = h.shape
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0
    h.diagonal(dim1=1, dim2=2).masked_fill_(dead, 1.0)
    order = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=1, descending=True, stable=True) if act_order \
        else torch.arange(columns, device=h.device).expand(count, columns)
    damping = damp * torch.diagonal(h, dim1=1, dim2=2).mean(-1)
    factor = inverse_hessian_factor(_rows_of(_rows_of(h, order).transpose(1, 2), order), damp)  # H symmetric
    return FactoredHessians(dead, order, factor, damping)


def _rows_of(matrices: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``matrices[e][order[e]]`` for every ``e`` of the batch ([E, n, m] by [E, n]), one gather."""
    return matrices.gather(1, order[:, :, None].expand(-1, -1, matrices.shape[2]))


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, gram: torch.Tensor | FactoredHessians, grid: Grid, act_order: bool,
                  damp: float, block_size: int, graphs: bool | None = None,
                  programs: BlockPrograms | None = None) -> QuantizedWeight:
    """GPTQ of one weight ``[rows, cols]`` with its input Gram ``[cols, cols]`` (or that Gram factored already, a
    batch of one): :func:`gptq_quantize_batch` on a batch of one."""
    grams = gram if isinstance(gram, FactoredHessians) else gram[None]
    result = gptq_quantize_batch(weight[None], grams, grid, act_order, damp, block_size, graphs, programs)
    return QuantizedWeight(result.dequantized[0], result.scale[0], result.zero[0])


@torch.no_grad()
def gptq_quantize_batch(weights: torch.Tensor, grams: torch.Tensor | FactoredHessians, grid: Grid, act_order: bool,
                        damp: float, block_size: int, graphs: bool | None = None,
                        programs: BlockPrograms | None = None) -> QuantizedWeight:
    """GPTQ Algorithm 1 in fp64 on ``E`` weights ``[E, rows, cols]``, each with its own input Gram
    ``[E, cols, cols]``, in one sweep: quantize columns left to right, spreading each column's error
    ``(w - q) / U_ii`` over the remaining columns with row ``i`` of ``U = chol((H + λI)⁻¹)ᵀ``; updates to
    columns after the current block are applied lazily once per block ("lazy batch"). Every step is one
    batched operation over the ``E`` weights (the experts of an MoE layer: one sweep instead of ``E``);
    each weight's result is that of solving it alone (``tests/test_quant_gptq.py``: bit for bit on CPU).

    ``gram = Σ x xᵀ`` of the layer input (``H = 2 gram``; the factor cancels since ``λ`` is relative).
    Inputs never seen (``H_ii = 0``) get ``H_ii = 1`` and zero weights, as in the reference code.
    Groups: without ``act_order`` a group's scale/zero are computed from the already-updated weights when
    its first column is reached (blocks hold whole groups, so the update is complete then).
    ``act_order`` (§4 "act-order") quantizes columns in descending ``H_ii`` order with static groups: every
    group's scale/zero come from the original weights of its contiguous original columns, so the
    checkpoint needs no ``g_idx`` permutation. Per-channel (``group_size`` None) is static as well.
    ``grams`` may be given factored already (:func:`factor_hessians`, with the same ``act_order`` and ``damp``):
    a Hessian shared by several calls is factored once.
    ``graphs`` (default: on a CUDA device) runs each block through ``_BlockGraph``, a CUDA graph on a GPU:
    the sweep launches ~10 small kernels per column, which bounds it by Python's launch rate when eager
    (8B-shaped layers on an H200: ~4 s of a layer's GPTQ); ``programs`` keeps the graphs for later calls.
    """
    w = weights.detach().to(torch.float64).clone()
    hessians = grams if isinstance(grams, FactoredHessians) else factor_hessians(grams, act_order, damp, w.device)
    count, rows, columns = w.shape
    dead, perm, factor = hessians.dead, hessians.order, hessians.factor
    w.masked_fill_(dead[:, None, :], 0.0)
    width = grid.width(columns)
    scale = torch.zeros(count, rows, columns // width, dtype=w.dtype, device=w.device)
    zero = torch.zeros_like(scale)
    static = act_order or grid.group_size is None
    if static:
        for g in range(columns // width):
            scale[:, :, g], zero[:, :, g] = grid.params(w[:, :, g * width:(g + 1) * width])
    # work on the transpose: column j of the (permuted) weight is the contiguous row j (2.3x faster on CPU)
    wt = _rows_of(w.transpose(1, 2), perm).contiguous()
    del w
    group_of = perm // width
    scale_t, zero_t = scale.transpose(1, 2), zero.transpose(1, 2)  # views: a group's parameters are a row
    block = block_size if static else width * max(1, block_size // width)
    # the lazy batch twice over: rank-1 updates within SUB_BLOCK columns, one product per sub-block for the
    # rest of the block (the reference's per-column update of the whole block is memory-bound: 1.6–1.8×
    # slower at Llama-3-8B's gate_proj shape, benchmarks/gptq_speed.py); a sub-block divides a dynamic
    # group, so a group starts on a fresh one
    sub = SUB_BLOCK if static else math.gcd(SUB_BLOCK, width)
    graphs = wt.device.type == "cuda" if graphs is None else graphs
    programs = programs if programs is not None else BlockPrograms()
    out = torch.empty_like(wt)
    for start in range(0, columns, block):
        end = min(start + block, columns)
        w1, hb = wt[:, start:end], factor[:, start:end, start:end]
        column_scale = _rows_of(scale_t, group_of[:, start:end]) if static else scale_t[:, :end - start]
        column_zero = _rows_of(zero_t, group_of[:, start:end]) if static else zero_t[:, :end - start]
        groups = None if static else (end - start) // width
        if graphs:
            program = programs.get(count, rows, end - start, groups, grid, sub, wt)
            program.run(w1, hb, column_scale, column_zero)
            out[:, start:end], err = program.q_out, program.err
            if not static:
                scale_t[:, start // width:end // width] = program.group_scale
                zero_t[:, start // width:end // width] = program.group_zero
        else:
            err = torch.empty_like(w1)
            group_scale = scale_t[:, start // width:end // width] if not static else None
            group_zero = zero_t[:, start // width:end // width] if not static else None
            quantize_block(w1, hb, out[:, start:end], err, grid, sub, column_scale, column_zero, group_scale,
                           group_zero)
        wt[:, end:] -= factor[:, start:end, end:].transpose(1, 2) @ err
    return QuantizedWeight(_rows_of(out, torch.argsort(perm, dim=1)).transpose(1, 2), scale, zero)


#: Each run's :class:`BlockPrograms`, by its session (dropped with it).
_SESSION_PROGRAMS: "weakref.WeakKeyDictionary[ModifierSession, BlockPrograms]" = weakref.WeakKeyDictionary()


@register
class GPTQ(GridParameters, LayerModifier):
    """Quantize every decoder layer's linears to ``bits``-bit integers with GPTQ inside the shared pass.

    ``sequential: true`` (default) is the GPTQ reference code's "true sequential": linears are quantized
    in dataflow order (q/k/v, o, gate/up, down) and each group's Hessian is taken from its input with the
    groups before it already quantized, so it also corrects their error. The layer runs piecewise
    (``recipe_engine.execution.staged``): each group's input is computed once, finished blocks are replayed from
    their output linear, and the layer's outputs are handed to the pass, so this costs about one layer
    forward, less than the one-pass mode's two. ``sequential: false`` quantizes all linears from grams
    collected in one run of the unquantized layer (llm-compressor's way); those statistics come from the
    shared pass, so they can be reused from a step before. q/k/v share one Hessian, as do gate/up.
    ``lm_head`` and the embeddings stay in the model dtype. Output (``export``): packed int32 weights +
    scales that vLLM and SGLang load (``compressed-tensors``, the default), GPTQ v1 (``gptq``), or the
    dequantized weights in the model dtype (``dequantized``, a stock checkpoint).
    """

    example: ClassVar[tuple[str, ...]] = ("GPTQ<group_size:32>",)  # tiny contract model: widths 64 and 96
    needs = ("input Gram of q/k/v, o_proj, gate/up and down_proj (fp32 products, fp64 sums); sequential: "
             "each after the groups before it are quantized",)

    act_order: bool = Field(True, description="quantize columns by descending Hessian diagonal (static groups); "
                                               "default true: SmolLM2 W4 g64 PPL 30.13 vs 33.16 (BENCHMARKS.md)")
    damp: float = Field(0.01, gt=0, lt=1, description="diagonal damping as a fraction of mean(diag H)")
    sequential: bool = Field(True, description="take each linear group's Hessian after quantizing the groups "
                                               "before it in the layer (false: all from the unquantized layer)")
    block_size: PositiveInt = Field(128, description="columns per lazy-batch block (speed only)")
    experts: Literal["all", "routed"] = Field("all", description=(
        "mixture-of-experts layers: the tokens behind each expert's Hessian: all (every calibration token, "
        "llm-compressor's 'calibrate all experts') or routed (only those its router picks); the layer's "
        "output always uses the routed experts"))
    min_expert_tokens: NonNegativeInt = Field(16, description=(
        "an expert whose Hessian covers fewer tokens is rounded to nearest on the same grid instead "
        "(method rtn-fallback in quantization_log.csv and the report)"))

    def working_memory(self, shape, tokens: int) -> int:
        """The fp64 Hessian of the widest input (``down_proj``: the intermediate size), its Cholesky
        inverse and a copy; sequential mode also keeps the block outputs' inputs (o_proj, down_proj) of
        every calibration token (fp32). Experts (batch sizes by device: ``_experts.budgets``): the stacked
        gate/up of up to ``stack_rows`` rows in fp64 (the weight, its transpose, the result and the
        round-to-nearest copy), or the batched down_proj solve (at most ``request_bytes``) with the batch's ``h``
        of several experts (at most ``hidden_bytes``). On a GPU, the block programs kept for the run
        (:meth:`kept_programs_bytes`)."""
        widest = max(max(layer.intermediate_size for layer in shape.layers), shape.hidden_size)
        kept = tokens * (shape.hidden_size + widest) * 4 if self.sequential else 0
        experts = 0
        if shape.num_experts:
            width, count, budget = shape.layers[0].intermediate_size, shape.num_experts, budgets(shape.on_device)
            batched = min(budget.request_bytes, count * solve_bytes(shape.hidden_size, width)) + \
                min(budget.hidden_bytes, count * tokens * width * 12)
            experts = max(4 * budget.stack_rows * shape.hidden_size * 8, batched)
        return 3 * widest * widest * 8 + kept + experts + self.kept_programs_bytes(shape)

    def kept_programs_bytes(self, shape) -> int:
        """On a GPU, the static buffers of the block programs kept for the run (:class:`BlockPrograms`): per sweep
        shape, five fp64 ``block × rows`` matrices and a ``block × block`` factor block for each weight of the
        batch; one shape for q/k/v and one for o_proj, on an MoE layer two gate/up stacks and two down_proj
        batches (a full one and the last), on a dense one gate/up and down_proj."""
        if not shape.on_device:
            return 0

        def program(count: int, rows: int, columns: int) -> int:
            n = min(self.block_size, columns)
            return count * 8 * (5 * n * rows + n * n)

        hidden, attention = shape.hidden_size, shape.num_heads * shape.head_dim
        total = program(1, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim, hidden) + \
            program(1, hidden, attention)
        if shape.num_experts:
            width, count, budget = shape.layers[0].intermediate_size, shape.num_experts, budgets(True)
            stacked = min(count, -(-budget.stack_rows // (2 * width)))  # a stack closes once it holds stack_rows
            per_call = min(count, max(1, budget.call_bytes // solve_bytes(hidden, width)))
            return total + 2 * program(1, stacked * 2 * width, hidden) + 2 * program(per_call, hidden, width)
        widest = max(layer.intermediate_size for layer in shape.layers)
        return total + program(1, 2 * widest, hidden) + program(1, hidden, widest)

    def target_layers(self, session: ModifierSession) -> list[int]:
        return list(range(len(session.layers)))

    def _sources(self, session: ModifierSession) -> dict[str, list[str]]:
        """Hessian source path → the target roles quantized with it, in dataflow order: linears reading the
        same tensor share one gram (q/k/v; gate/up; a fused qkv or gate_up linear is its own source)."""
        adapter, sources = session.adapter, {}
        for role in adapter.module_roles(self.targets, experts=True):
            group = next((g for g in (adapter.attention_inputs, adapter.mlp_inputs) if role in g), (role,))
            sources.setdefault(adapter.path(group[0]), []).append(role)
        return dict(sorted(sources.items(), key=lambda item: position(item[0])))

    def statistics(self, session: ModifierSession, layer_index: int) -> list[InputCovariance]:
        # sequential: every gram is taken inside compress_layer, after the groups before it are quantized
        return [] if self.sequential else [self._gram(source) for source in self._sources(session)]

    @staticmethod
    def _gram(source: str) -> InputCovariance:
        """fp32 products, fp64 sums: GPTQ only needs H to ~1e-6 (its reference code keeps H in fp32)."""
        return InputCovariance(source, products=torch.float32)

    def compress_layer(self, session: ModifierSession, layer_index: int, stats) -> dict[str, Any]:
        """Linears sharing a Hessian are quantized as one row-stacked matrix: GPTQ treats rows
        independently given ``H`` (same factor, same order, per-row groups), so this equals quantizing
        each alone, with one Cholesky and one column loop per input instead of per linear."""
        layer, rows = session.layers[layer_index], []
        current = session.current_layer
        staged = StagedLayer(session, layer, current.inputs) if self.sequential else None
        for source, targets in self._sources(session).items():
            linears = [session.adapter.linear(layer, t) for t in targets]
            stacked = torch.cat([linear.weight.detach() for linear in linears])
            seconds = Seconds(stacked.device)
            if staged is None:
                statistic = stats[self._gram(source).key]
            else:  # the groups before this one are quantized already
                statistic = self._gram(source)
                staged.inputs_of(source, statistic)
            gram = statistic.gram
            grid = self.grid(stacked.dtype, (layer_index, len(session.layers), targets[0]))  # one for the stack
            factored = self._factor(gram[None], stacked.device)
            result = gptq_quantize(stacked, factored, grid, self.act_order, self.damp, self.block_size,
                                   programs=self._programs(session))
            seconds.stop()
            damping, factored = factored.damping[0], None  # the n × n factor is not kept through the errors
            split = [linear.out_features for linear in linears]
            rounded = rtn(stacked, grid).dequantized
            pieces = (t.split(split) for t in (result.dequantized, result.scale, result.zero, rounded))
            for target, linear, quantized, scale, zero, rounded in zip(targets, linears, *pieces):
                path = session.adapter.path(target)
                (error,), (error_rtn,) = output_errors([linear.weight], [[quantized], [rounded]], [gram])
                rows.append(log_row(layer_index, path, linear.weight, grid, quantized, method="gptq",
                                    damp=self.damp, damping=damping, error_rtn=error_rtn, error=error,
                                    tokens=statistic.count, seconds=seconds))
                with torch.no_grad():
                    linear.weight.copy_(quantized.to(linear.weight.dtype))
                self.mark(session, linear, grid, scale, zero)
        linear_rows = len(rows)
        if session.adapter.expert_roles(self.targets):
            rows += self._quantize_experts(session, layer_index, staged)
        errors = {row["module"]: row["error"] for row in settle_rows(rows)[:linear_rows]}
        session.outputs.add_rows(LOG_FILE, rows, step=self)
        if staged is not None:
            current.provide_outputs(staged.outputs())
        return {"output_error": errors}

    def _quantize_experts(self, session: ModifierSession, layer_index: int, staged: StagedLayer) -> list[dict]:
        """Every expert's targeted tensors (``recipe_engine.modifiers._experts``), gate/up before down, from the
        MoE block's inputs with the attention linears already quantized."""
        adapter, layer = session.adapter, session.layers[layer_index]
        captured = MoEInputs(adapter.mlp_block, adapter.experts, layer, session.storage)
        staged.inputs_of(adapter.mlp_block, captured)
        split = session.current_layer.sum_over_ranks([captured.all_tokens])
        routed, rows = self.experts == "routed", []

        def grams(tensor, indices):
            statistics = expert_grams(captured, indices, tensor, routed, session.device)
            own = [statistic for statistic in statistics if statistic is not captured.all_tokens]
            if split and own:
                session.current_layer.sum_over_ranks(own)
            return statistics

        for tensor in adapter.expert_roles(self.targets):
            rows += quantize_experts(session, layer_index, tensor, partial(grams, tensor),
                                     partial(self._gptq, self._programs(session)), self.grid, self.min_expert_tokens,
                                     self.damp, partial(self.mark, session), factor=self._factor)
        return rows

    def _gptq(self, programs: BlockPrograms, weights: torch.Tensor, grams: torch.Tensor | FactoredHessians,
              grid: Grid) -> QuantizedWeight:
        return gptq_quantize_batch(weights, grams, grid, self.act_order, self.damp, self.block_size,
                                   programs=programs)

    def _factor(self, grams: torch.Tensor, device=None) -> FactoredHessians:
        return factor_hessians(grams, self.act_order, self.damp, device)

    @staticmethod
    def _programs(session: ModifierSession) -> BlockPrograms:
        """The run's block programs (captured CUDA graphs), kept while its session lives."""
        if session not in _SESSION_PROGRAMS:
            _SESSION_PROGRAMS[session] = BlockPrograms()
        return _SESSION_PROGRAMS[session]

    def check(self, shape) -> None:
        super().check(shape)
        if not self.sequential and expert_targets(shape.model_type, self.targets):
            raise self.fail("mixture-of-experts experts are quantized from the MoE block's inputs taken in the "
                            "layer's sequential run: sequential: false cannot target gate_proj/up_proj/down_proj "
                            f"on {shape.model_type}", "sequential")

    def finish(self, session: ModifierSession) -> dict[str, Any]:
        adapter = session.adapter
        roles = adapter.module_roles(self.targets, experts=True)
        rows = session.outputs.rows(LOG_FILE, step=self)  # a resumed run's earlier layers included
        result = {"quantized_linears": len(roles) * len(session.layers), "export": self.export, "log": LOG_FILE,
                  "format": self.format_line(len(session.layers), roles),
                  "bits_per_weight": bits_per_weight(rows, self, session.model.dtype)}
        if adapter.expert_roles(self.targets):
            fallbacks = [f"model.layers.{row['layer']}.{row['module']}" for row in rows if row["method"] == FALLBACK]
            experts = sum(adapter.experts.units(layer) for layer in session.layers)
            quantized = experts * len(adapter.expert_roles(self.targets))
            result["experts"] = {"calibration": self.experts, "quantized": quantized,
                                 "min_expert_tokens": self.min_expert_tokens,
                                 "fallback": {"method": "round-to-nearest on the same grid",
                                              "count": len(fallbacks), "tensors": fallbacks}}
            result["headline"] = self._experts_headline(quantized, len(fallbacks))
        return result

    def _experts_headline(self, quantized: int, fallbacks: int) -> str:
        """The step's line under the summary table and in the model card: how many expert tensors GPTQ
        solved and how many fell back to rounding (too few calibration tokens reached them)."""
        tokens = "routed" if self.experts == "routed" else "calibration"
        line = f"{quantized - fallbacks} of {quantized} expert tensors by GPTQ ({self.experts} calibration)"
        if not fallbacks:
            return line
        return (f"{line}; {fallbacks} rounded to nearest on the same grid, having fewer than "
                f"{self.min_expert_tokens} {tokens} tokens (method {FALLBACK} in {LOG_FILE}, listed in report.json)")
