"""Quantizing the experts of a mixture-of-experts layer (private: helpers of ``GPTQ`` and ``Quantize``).

Each expert's ``gate_up_proj`` and ``down_proj`` slice is one linear weight ``[out, in]``
(``ExpertLayout.weight``); the router is never quantized. Calibration (``GPTQ``): the MoE block's input ``x``
(after the post-attention norm) is captured for every calibration token (:class:`MoEInputs`).

- ``experts: all`` (default, llm-compressor's "calibrate all experts"): every expert's statistics use every
  token. gate/up read ``x`` itself, so one Hessian ``Σ x xᵀ`` serves the gate/up of every expert of the layer;
  ``down_proj``'s Hessian is that expert's ``h = act(gate x) ⊙ up x`` over all tokens, computed one expert at a
  time (memory: one expert's activations of one batch and one ``width × width`` sum).
- ``experts: routed``: each expert's statistics use only the tokens its router picks.

The layer's output (what the next layer receives) is always the model's own forward: routed experts only.
An expert whose statistics cover fewer than ``min_expert_tokens`` tokens is rounded to nearest on the same
grid instead (``method`` ``rtn-fallback`` in ``quantization_log.csv``, listed in the step's report).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from recipe_engine.api import InputCovariance, Statistic

from ._quant import log_row, output_error, rtn

#: ``method`` of an expert rounded to nearest because too few tokens reached it.
FALLBACK = "rtn-fallback"
#: Rows of experts quantized in one GPTQ call when they share a Hessian (speed: one factorization).
STACK_ROWS = 8192


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
        self.picks.append(self.layout.routed(self.layer, x).to(self.storage))
        self.inputs.append(x.float().to(self.storage))


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
        x = x.to(device)
        gram.update(x if tensor == "gate_up_proj" else layout.hidden(layer, index, x.to(weight_dtype)), None)
    if gram.gram is None:  # no token: an all-zero Hessian (the fallback's count)
        width = layout.weight(layer, index, tensor).shape[1]
        gram.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    return gram


def quantize_experts(session, layer_index: int, tensor: str, grams: Callable[[int], InputCovariance | None],
                     quantize: Callable, grid_of: Callable, min_tokens: int, damp: float | None,
                     mark: Callable | None = None) -> list[dict]:
    """Quantize ``tensor`` of every expert of the layer; returns the log rows (``method`` says which fell back).

    ``grams(index)``: the expert's input Gram (None: no calibration, round-to-nearest); ``quantize(weight, gram,
    grid)`` the step's method. Experts whose Gram is the same object are quantized stacked (one call).
    ``mark(module, grid, scale, zero, parameter)``: records the scales and zero points for a packing export
    (``ExpertLayout.quantized_parts``)."""
    layout, layer = session.adapter.experts, session.layers[layer_index]
    rows, pending, scales, zeros, grids = [], [], [], [], []

    def flush():
        if not pending:
            return
        started = time.perf_counter()
        gram = pending[0][1]
        weights = [layout.weight(layer, index, tensor).detach() for index, _ in pending]
        stacked = torch.cat(weights)
        grid = grid_of(stacked.dtype)
        fallback = gram is not None and gram.count < min_tokens
        result = rtn(stacked, grid) if gram is None or fallback else quantize(stacked, gram.gram, grid)
        seconds = (time.perf_counter() - started) / len(pending)
        method = "rtn" if gram is None else FALLBACK if fallback else "gptq"
        split = [w.shape[0] for w in weights]
        scales.extend(result.scale.split(split))
        zeros.extend(result.zero.split(split))
        grids.append(grid)
        for (index, _), weight, quantized in zip(pending, weights, result.dequantized.split(split)):
            name = layout.name(index, tensor, layer)
            errors = {}
            if gram is not None and gram.count:
                errors = {"error": output_error(weight, quantized, gram.gram),
                          "error_rtn": output_error(weight, rtn(weight, grid).dequantized, gram.gram)}
            rows.append(log_row(layer_index, name, weight, grid, quantized, method=method, damp=damp,
                                tokens=gram.count if gram is not None else 0, seconds=seconds, **errors))
            layout.set_weight(layer, index, tensor, quantized)
        pending.clear()

    for index in range(layout.units(layer)):
        gram = grams(index)
        rows_so_far = sum(layout.weight(layer, i, tensor).shape[0] for i, _ in pending)
        if pending and (pending[0][1] is not gram or gram is None or rows_so_far >= STACK_ROWS):
            flush()
        pending.append((index, gram))
    flush()
    if mark is not None:
        for (module, parameter, scale), (*_, zero) in zip(layout.quantized_parts(layer, tensor, scales),
                                                           layout.quantized_parts(layer, tensor, zeros)):
            mark(module, grids[0], scale, zero, parameter)
    return rows
