"""Quantizing the experts of a mixture-of-experts layer (private: helpers of ``GPTQ`` and ``Quantize``).

Each expert's ``gate_up_proj`` and ``down_proj`` slice is one linear weight ``[out, in]``
(``ExpertLayout.weight``); the router is never quantized. Calibration (``GPTQ``): the MoE block's input ``x``
(after the post-attention norm) is captured for every calibration token (:class:`MoEInputs`).

- ``experts: all`` (default, llm-compressor's "calibrate all experts"): every expert's statistics use every
  token. gate/up read ``x`` itself, so one Hessian ``Σ x xᵀ`` serves the gate/up of every expert of the layer;
  ``down_proj``'s Hessian is that expert's ``h = act(gate x) ⊙ up x`` over all tokens, computed for several
  experts per pass over the batches (one batched product per batch; memory: :data:`HIDDEN_BYTES` of ``h``).
- ``experts: routed``: each expert's statistics use only the tokens its router picks.

The layer's output (what the next layer receives) is always the model's own forward: routed experts only.
An expert whose statistics cover fewer than ``min_expert_tokens`` tokens is rounded to nearest on the same
grid instead (``method`` ``rtn-fallback`` in ``quantization_log.csv``, listed in the step's report).

Experts whose Hessians differ (``down_proj``; everything under ``routed``) have their Grams taken
:data:`SOLVE_BYTES` at a time and are solved in batches on an accelerator, one batched GPTQ call each
(``gptq_quantize_batch``: each expert's result is that of solving it alone; on CPU one expert per call,
:data:`CPU_SOLVE_BYTES`); their log errors are evaluated together and read once per layer.

The batch sizes (:func:`budgets`) differ by device. On CPU a sweep is bound by the cache, so batches stay
small. On an accelerator a sweep's time is its kernels: every column costs about ten kernels whatever the
number of rows they act on, so the stacks and batches are larger there (8x the rows, 4x the bytes: 22 → 3
gate/up stacks and 16 → 4 down_proj batches per Qwen3-30B-A3B layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from recipe_engine.api import InputCovariance, Statistic, keep_activations, load_activations

from ._quant import Seconds, log_row, output_errors, rtn

#: ``method`` of an expert rounded to nearest because too few tokens reached it.
FALLBACK = "rtn-fallback"
#: Rows of experts quantized in one GPTQ call when they share a Hessian (their column sweep at once).
STACK_ROWS = 8192
#: fp64 working memory of one batched call over experts with their own Hessians (:func:`solve_bytes` each);
#: also how many experts' Grams are taken per request.
SOLVE_BYTES = 512 << 20
#: The batched call's memory on CPU, where a batch's sweep outgrows the cache (8 experts of 2048 × 768 per call:
#: 1.3x the time of one at a time, measured): one expert per call.
CPU_SOLVE_BYTES = 0
#: Memory of the ``down_proj`` inputs ``h`` of one calibration batch computed at once for several experts.
HIDDEN_BYTES = 256 << 20
#: :data:`STACK_ROWS` and :data:`SOLVE_BYTES` (both for requests and calls) and :data:`HIDDEN_BYTES` on an
#: accelerator, where a call's time is its kernel launches (:func:`budgets`).
ACCELERATOR_STACK_ROWS = 8 * STACK_ROWS
ACCELERATOR_SOLVE_BYTES = 4 * SOLVE_BYTES
ACCELERATOR_HIDDEN_BYTES = 4 * HIDDEN_BYTES


@dataclass(frozen=True)
class Budgets:
    """How many experts go into one piece of work: ``stack_rows`` rows per stack on a shared Hessian,
    ``request_bytes`` of solve memory per request for Grams, ``call_bytes`` per batched GPTQ call,
    ``hidden_bytes`` of ``down_proj`` inputs computed at once."""

    stack_rows: int
    request_bytes: int
    call_bytes: int
    hidden_bytes: int


def budgets(on_accelerator: bool) -> Budgets:
    """The batch sizes on CPU or on an accelerator (read from the module's constants when called)."""
    if on_accelerator:
        return Budgets(ACCELERATOR_STACK_ROWS, ACCELERATOR_SOLVE_BYTES, ACCELERATOR_SOLVE_BYTES,
                       ACCELERATOR_HIDDEN_BYTES)
    return Budgets(STACK_ROWS, SOLVE_BYTES, CPU_SOLVE_BYTES, HIDDEN_BYTES)


def on_accelerator(device) -> bool:
    return torch.device(device).type != "cpu"


def solve_bytes(rows: int, columns: int) -> int:
    """fp64 working memory of one expert's ``[rows, columns]`` weight in a batched GPTQ call: the weight, its
    permuted transpose, the result and the round-to-nearest reference, and three ``columns²`` matrices (the
    Hessian, its permuted copy and the inverse factor)."""
    return 8 * (4 * rows * columns + 3 * columns * columns)


class MoEInputs(Statistic):
    """The MoE block's input of every calibration batch this process runs, kept (fp32, on ``storage``) with
    the router's picks per token, and the Gram over all tokens (``gram``)."""

    sums = ()  # the Grams are reduced by :func:`expert_statistics`' caller

    def __init__(self, module: str, layout, layer, storage):
        super().__init__(module)
        self.layout, self.layer, self.storage = layout, layer, storage
        self.inputs: list[torch.Tensor] = []
        self.picks: list[torch.Tensor] = []
        self.all_tokens = InputCovariance(module, products=torch.float32)

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        x = inputs.reshape(-1, inputs.shape[-1])
        self.all_tokens.update(x, None)
        self.picks.append(keep_activations(self.layout.routed(self.layer, x), self.storage))
        self.inputs.append(keep_activations(x.float(), self.storage))


def expert_gram(captured: MoEInputs, index: int, tensor: str, routed: bool, device) -> InputCovariance:
    """The input Gram of expert ``index``'s ``tensor`` (``gate_up_proj``: ``x``; ``down_proj``: its ``h``) over
    all tokens, or over the tokens routed to it (``routed``; the shared expert runs on every token)."""
    layout, layer = captured.layout, captured.layer
    if tensor == "gate_up_proj" and not (routed and not layout.is_shared(layer, index)):
        return captured.all_tokens
    gram = InputCovariance(f"{layout.name(index, tensor, layer)}", products=torch.float32)
    weight_dtype = layout.weight(layer, index, "down_proj").dtype
    for x, picks in zip(captured.inputs, captured.picks):
        if routed and not layout.is_shared(layer, index):
            x = x[picks[:, index]]
        if not len(x):
            continue
        x = load_activations(x, device)
        gram.update(x if tensor == "gate_up_proj" else layout.hidden(layer, index, x.to(weight_dtype)), None)
    if gram.gram is None:  # no token: an all-zero Hessian (the fallback's count)
        width = layout.weight(layer, index, tensor).shape[1]
        gram.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    return gram


def expert_grams(captured: MoEInputs, indices: list[int], tensor: str, routed: bool,
                 device) -> list[InputCovariance]:
    """:func:`expert_gram` of the experts ``indices``; ``down_proj`` over all tokens is taken for several routed
    experts per pass over the batches (as many as ``hidden_bytes`` of ``h`` allow, :func:`budgets`), with the
    same operations per expert, so the Grams are the one-at-a-time ones bit for bit."""
    layout, layer = captured.layout, captured.layer
    together = [i for i in indices if tensor == "down_proj" and not routed and not layout.is_shared(layer, i)]
    grams = {i: expert_gram(captured, i, tensor, routed, device) for i in indices if i not in together}
    if together:
        down = layout.weight(layer, together[0], "down_proj")
        tokens = max((len(x) for x in captured.inputs), default=1)
        per_expert = tokens * down.shape[1] * (4 * down.element_size() + 4)  # gate/up, act, h, its fp32 copy
        per_pass = max(1, budgets(on_accelerator(device)).hidden_bytes // per_expert)
        for first in range(0, len(together), per_pass):
            grams.update(_down_grams(captured, together[first:first + per_pass], device))
    return [grams[i] for i in indices]


def _down_grams(captured: MoEInputs, indices: list[int], device) -> dict[int, InputCovariance]:
    """All-token ``down_proj`` Grams of consecutive routed experts ``indices``, one pass over the batches."""
    layout, layer = captured.layout, captured.layer
    dtype = layout.weight(layer, indices[0], "down_proj").dtype
    grams = {i: InputCovariance(layout.name(i, "down_proj", layer), products=torch.float32) for i in indices}
    for x in captured.inputs:
        if not len(x):
            continue
        hidden = layout.hidden_batch(layer, indices[0], indices[-1] + 1, load_activations(x, device).to(dtype))
        for index, h in zip(indices, hidden):
            grams[index].update(h, None)
    for index, gram in grams.items():
        if gram.gram is None:  # no token: an all-zero Hessian (the fallback's count)
            width = layout.weight(layer, index, "down_proj").shape[1]
            gram.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    return grams


def _method(gram: InputCovariance | None, min_tokens: int) -> str:
    return "rtn" if gram is None else FALLBACK if gram.count < min_tokens else "gptq"


def quantize_experts(session, layer_index: int, tensor: str,
                     grams: Callable[[list[int]], list[InputCovariance | None]], quantize: Callable | None,
                     grid_of: Callable, min_tokens: int, damp: float | None,
                     mark: Callable | None = None, factor: Callable | None = None) -> list[dict]:
    """Quantize ``tensor`` of every expert of the layer; returns the log rows in expert order (``method`` says
    which fell back). ``mark(module, grid, scale, zero, parameter)``: records the scales and zero points for a
    packing export (``ExpertLayout.quantized_parts``), in expert order.

    ``grams(indices)``: the experts' input Grams (None: no calibration, round-to-nearest), asked for as many
    experts at a time as the request budget allows (:func:`budgets`); ``quantize(weights, grams, grid)`` the
    step's method on a batch ``[E, rows, cols]`` with ``[E, cols, cols]``. Experts whose Gram is one shared
    object are quantized row-stacked (one Hessian, ``stack_rows`` rows per call), those with their own Grams
    batched (on an accelerator one call per request; on CPU :data:`CPU_SOLVE_BYTES`), rounded ones stacked; a
    row's ``seconds`` is its call's time over the experts in it. ``factor(grams)``: the Hessians prepared for
    ``quantize`` (e.g. factored), done once for a Hessian shared by several stacks. The rows' errors and times
    are left unread (``_quant.settle_rows``): no call waits for the one before."""
    layout, layer = session.adapter.experts, session.layers[layer_index]
    units, weight = layout.units(layer), layout.weight(layer, 0, tensor)
    budget = budgets(on_accelerator(weight.device))
    request = max(1, budget.request_bytes // solve_bytes(*weight.shape))
    per_call = max(1, budget.call_bytes // solve_bytes(*weight.shape))
    rows, pending, factored = [], {}, {}  # call kind → [(index, gram)]; id(shared gram) → (gram, factored)

    def flush(key):
        calls = pending.pop(key)
        shared = None
        if key[0] == "stack" and factor is not None:
            gram = calls[0][1]
            if id(gram) not in factored:
                factored[id(gram)] = (gram, factor(gram.gram[None]))
            shared = factored[id(gram)][1]
        rows.extend(_quantize_call(session, layer_index, tensor, calls, quantize, grid_of, min_tokens, damp, shared))

    for first in range(0, units, request):
        indices = list(range(first, min(first + request, units)))
        statistics = grams(indices)
        for index, gram in zip(indices, statistics):
            method, shape = _method(gram, min_tokens), tuple(layout.weight(layer, index, tensor).shape)
            shared = method == "gptq" and (sum(g is gram for g in statistics) > 1 or ("stack", shape, id(gram))
                                           in pending)
            key = (method, shape, gram is not None and gram.count > 0) if method != "gptq" \
                else ("stack", shape, id(gram)) if shared else ("own", shape)
            if key in pending and (len(pending[key]) >= per_call if key[0] == "own"
                                   else len(pending[key]) * shape[0] >= budget.stack_rows):
                flush(key)
            pending.setdefault(key, []).append((index, gram))
        for key in [key for key in pending if key[0] == "own"]:  # their Grams go before the next are taken
            flush(key)
    for key in list(pending):
        flush(key)
    rows.sort(key=lambda item: item[0])
    if mark is not None:
        scales, zeros = [item[2] for item in rows], [item[3] for item in rows]
        for (module, parameter, scale), (*_, zero) in zip(layout.quantized_parts(layer, tensor, scales),
                                                           layout.quantized_parts(layer, tensor, zeros)):
            mark(module, rows[0][4], scale, zero, parameter)
    return [item[1] for item in rows]


def _quantize_call(session, layer_index: int, tensor: str, pending: list, quantize: Callable | None,
                   grid_of: Callable, min_tokens: int, damp: float | None, shared=None) -> list[tuple]:
    """One call of :func:`quantize_experts`: the experts of ``pending`` (``(index, gram)``) stacked on one shared
    Hessian (``shared``: that Hessian already prepared by ``factor``), batched with their own, or rounded to
    nearest; per expert ``(index, log row, scale, zero, grid)``."""
    layout, layer = session.adapter.experts, session.layers[layer_index]
    weights = [layout.weight(layer, index, tensor).detach() for index, _ in pending]
    seconds = Seconds(weights[0].device)
    grams = [gram for _, gram in pending]
    grid = grid_of(weights[0].dtype)
    method = _method(grams[0], min_tokens)
    split = [w.shape[0] for w in weights]
    if method != "gptq":
        result = rtn(torch.cat(weights), grid)
        parts = [list(t.split(split)) for t in (result.dequantized, result.scale, result.zero)]
    elif all(gram is grams[0] for gram in grams):
        result = quantize(torch.cat(weights)[None], shared if shared is not None else grams[0].gram[None], grid)
        parts = [list(t[0].split(split)) for t in (result.dequantized, result.scale, result.zero)]
    else:
        result = quantize(torch.stack(weights), torch.stack([g.gram for g in grams]), grid)
        parts = [list(t) for t in (result.dequantized, result.scale, result.zero)]
    quantized, scales, zeros = parts
    seconds.stop(len(pending))
    errors = [{}] * len(pending)
    if grams[0] is not None and grams[0].count:  # in groups of half a stack's rows (memory: the solve's)
        errors, group = [], max(1, budgets(on_accelerator(weights[0].device)).stack_rows // 2 // split[0])
        for part in (slice(first, first + group) for first in range(0, len(pending), group)):
            rounded = rtn(torch.cat(weights[part]), grid).dequantized.split(split[part])
            errors += [{"error": error, "error_rtn": error_rtn} for error, error_rtn in zip(*output_errors(
                weights[part], [quantized[part], rounded], [gram.gram for gram in grams[part]]))]
    rows = []
    for (index, gram), weight, result, scale, zero, error in zip(pending, weights, quantized, scales, zeros, errors):
        rows.append((index, log_row(layer_index, layout.name(index, tensor, layer), weight, grid, result,
                                    method=method, damp=damp, tokens=gram.count if gram is not None else 0,
                                    seconds=seconds, **error), scale, zero, grid))
        layout.set_weight(layer, index, tensor, result)
    return rows
