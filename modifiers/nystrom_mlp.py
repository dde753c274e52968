"""NystromMLP: prune merged (wide) MLPs back to the config's intermediate size by ridge leverage scores and
refit ``down_proj`` (FlattenGPT §3.2 "MLP pruning", Algorithm 3, Theorem 3.1)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from recipe_engine import LayerModifier, register
from recipe_engine.linalg import (mean_eigenvalue, ridge_compensation, ridge_leverage_scores, ridge_refit,
                                  set_linear_weight)
from recipe_engine.shape import ModelShape
from recipe_engine.stats import InputCovariance, Statistic


class _LastInput(Statistic):
    """The input of the hooked module in the batch that just ran (for per-batch cross moments)."""

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        self.value = inputs


@register
class NystromMLP(LayerModifier):
    """Keep the ``intermediate_size`` channels with the highest ridge leverage and refit ``down_proj``.

    ``G = Σ_t σ_tᵀ σ_t`` (fp64) is the Gram of the activation entering ``down_proj``
    (``σ = up(x) ⊙ act(gate(x))``), ``λ = lambda_scale × trace(G)/n`` (Appendix C.2: 10 × the mean
    eigenvalue), leverage ``s_i = [G (G + λI)⁻¹]_ii``. The top channels ``K`` (ascending order) are kept:
    gate/up keep rows ``K``; with ``W = down_proj.weight`` (out × in) the kept columns become
    ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` (Theorem 3.1 in torch orientation; Algorithm 3 line 4 adds
    the update to the full ``W_D`` — a dimension slip — it belongs to the kept rows of the paper's
    ``W_D``, i.e. the kept columns here). ``compensation_scale`` sets the λ of this refit separately
    (``None``: the leverage λ). Layers: ``layers`` if given, else every layer with a wider MLP than the config.
    """

    layers: list[int] | None = Field(None, description="layer indices to prune (default: the merged layers)")
    lambda_scale: float = Field(10.0, gt=0, description="leverage ridge λ as a multiple of the mean eigenvalue")
    compensation_scale: float | None = Field(None, gt=0, description="refit ridge λ multiple (None: lambda_scale)")
    target: Literal["merged", "serial", "original"] = Field(
        "original", description="what the kept down_proj is refitted to reproduce (merged = Theorem 3.1 only)")
    target_scale: float = Field(0.1, gt=0, description="ridge λ multiple of the refit towards target")

    modifies = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    example = ("FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP")  # needs merged layers
    needs = ("down_proj input Gram (fp64)", "target serial/original: the original layers' outputs "
             "(original weights on CPU)")

    def check_calibration(self, calibration) -> None:
        """``target: original`` fits each layer to the original hidden state, absorbing the drift of the
        layers before it; with ``propagate: original`` that drift is the unpruned stream's, which the pruned
        model never sees, so every layer re-corrects it (measured on SmolLM2: PPL 3954 vs 39.01)."""
        if self.target == "original" and calibration.propagate == "original":
            raise self.fail("target: original needs calibration.propagate: compressed (it absorbs the drift "
                            "of the compressed layers before it); use target: serial or merged with "
                            "propagate: original", field="target")

    def check(self, shape: ModelShape) -> None:
        targets = self.layers if self.layers is not None else shape.oversized_layers("mlp")
        if not targets:
            raise self.fail("no layer has a wider MLP than the config: put NystromMLP after FlattenAdjacent "
                            "or list layers", field="layers")
        for index in targets:
            if not 0 <= index < shape.num_layers:
                raise self.fail(f"layer {index} out of range (model has {shape.num_layers})", field="layers")
            layer = shape.layers[index]
            if layer.intermediate_size <= shape.intermediate_size:
                raise self.fail(f"layer {index} has intermediate size {layer.intermediate_size}; nothing to "
                                f"prune to {shape.intermediate_size}", field="layers")
            shape.layers[index] = type(layer)(layer.num_heads, layer.num_kv_heads, shape.intermediate_size,
                                              layer.origin)

    @property
    def needs_reference(self) -> bool:  # the serial/original targets run the original layers
        return self.target != "merged"

    def target_layers(self, session) -> list[int]:
        return list(self.layers) if self.layers is not None else session.oversized_layers("mlp")

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """The fp64 ``down_proj`` input Gram of the widest target, its Cholesky factor and one panel of
        ``L⁻¹`` (``ridge_leverage_scores``), plus the target refit's cross moment."""
        targets = self.layers if self.layers is not None else shape.oversized_layers("mlp")
        width = max((shape.layers[i].intermediate_size for i in targets), default=0)
        return 8 * (2 * width * width + width * 2048 + width * shape.hidden_size)

    def statistics(self, session, layer_index: int) -> list[InputCovariance]:
        return [InputCovariance("mlp.down_proj")]

    @torch.no_grad()
    def compress_layer(self, session, layer_index: int, stats: dict[str, Any]) -> dict[str, Any]:
        mlp = session.adapter.mlp(session.layers[layer_index])
        gram = stats["InputCovariance:mlp.down_proj"].gram
        scale = mean_eigenvalue(gram)
        leverage = ridge_leverage_scores(gram, self.lambda_scale * scale)
        keep = leverage.topk(session.model.config.intermediate_size).indices.sort().values
        refit_scale = self.compensation_scale if self.compensation_scale is not None else self.lambda_scale
        down = ridge_compensation(mlp.down_proj.weight, gram, keep, refit_scale * scale)
        for linear in (mlp.gate_proj, mlp.up_proj):
            set_linear_weight(linear, linear.weight[keep], linear.bias[keep] if linear.bias is not None else None)
        set_linear_weight(mlp.down_proj, down, mlp.down_proj.bias)
        entry = {"channels_before": gram.shape[0], "channels_kept": len(keep),
                 "leverage_kept": float(leverage[keep].sum()), "leverage_total": float(leverage.sum())}
        if self.target != "merged":
            entry.update(self._refit_towards_target(session, layer_index, gram[keep][:, keep]))
        return entry

    def _refit_towards_target(self, session, index: int, gram: torch.Tensor) -> dict[str, float]:
        """Second ridge refit of the kept ``down_proj`` so the whole layer's output approaches the target
        ``y*``: the original layers run serially on this layer's inputs (``serial``) or the original model's
        hidden state at this depth (``original``). With the pruned layer's errors ``e = y* − layer(x)`` and
        ``σ`` the kept ``down_proj`` input, ``W' = W + ((G_KK + λI)⁻¹ Σ σ eᵀ)ᵀ`` (``ridge_refit``)."""
        inputs, kwargs_list = session.current_inputs()
        targets = (session.reference_outputs(index) if self.target == "original"
                   else session.original_outputs(index, inputs, kwargs_list))
        layer = session.layers[index]
        down = session.adapter.mlp(layer).down_proj
        sigma = _LastInput("mlp.down_proj")
        cross = torch.zeros(gram.shape[0], down.out_features, dtype=torch.float64, device=session.device)
        error = [0.0]

        def accumulate(k: int, output: torch.Tensor) -> None:
            residual = (targets[k].to(output.device) - output).reshape(-1, output.shape[-1]).to(torch.float64)
            cross.add_(sigma.value.reshape(-1, gram.shape[0]).to(torch.float64).T @ residual)
            error[0] += float(residual.pow(2).sum())

        session.run_layer(layer, inputs, kwargs_list, hooks=[sigma], on_batch=accumulate)
        gram = gram.to(cross.device)
        refit = ridge_refit(down.weight, gram, cross, self.target_scale * mean_eigenvalue(gram))
        delta = refit - down.weight.to(torch.float64)
        # ‖e − σΔᵀ‖² = ‖e‖² − 2⟨C, Δᵀ⟩ + tr(Δ G Δᵀ): the error left on the calibration tokens
        after = error[0] - 2 * float((cross * delta.T).sum()) + float(torch.einsum("oi,ij,oj->", delta, gram, delta))
        set_linear_weight(down, refit, down.bias)
        return {"target_error_before": error[0], "target_error_after": after}
