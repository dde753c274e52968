"""NystromMLP: prune merged (wide) MLPs back to the config's intermediate size by ridge leverage scores and
refit ``down_proj`` (FlattenGPT §3.2 "MLP pruning", Algorithm 3, Theorem 3.1)."""
from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from pydantic import Field

from recipe_engine.api import (InputCovariance, LayerModifier, ModelShape, ModifierSession, mean_eigenvalue,
                               refit_down_proj, register, ridge_compensation, ridge_leverage_scores,
                               set_linear_weight, submatrix, target_moments)


@register
class NystromMLP(LayerModifier):
    """Keep the ``intermediate_size`` channels with the highest ridge leverage and refit ``down_proj``.

    ``G = Σ_t σ_tᵀ σ_t`` (each batch's product in fp32, summed in fp64; as GPTQ's Hessian) is the Gram of the
    activation entering ``down_proj`` (``σ = up(x) ⊙ act(gate(x))``), ``λ = lambda_scale × trace(G)/n``
    (Appendix C.2: 10 × the mean eigenvalue), leverage ``s_i = [G (G + λI)⁻¹]_ii`` (``criterion: energy``
    ranks by ``G_ii ‖W_:,i‖²`` instead, :func:`channel_energy`). The top channels ``K`` (ascending order) are
    kept: gate/up keep rows ``K``; with ``W = down_proj.weight`` (out × in) the kept columns become
    ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` (Theorem 3.1 in torch orientation; Algorithm 3 line 4 adds
    the update to the full ``W_D`` — a dimension slip — it belongs to the kept rows of the paper's
    ``W_D``, i.e. the kept columns here; ``compensate: false`` keeps ``W_K``). ``compensation_scale`` sets the λ
    of this refit separately (``None``: the leverage λ). Layers: ``layers`` if given, else every layer with a
    wider MLP than the config.
    """

    layers: list[int] | None = Field(None, description="layer indices to prune (default: the merged layers)")
    lambda_scale: float = Field(10.0, gt=0, description="leverage ridge λ as a multiple of the mean eigenvalue")
    criterion: Literal["leverage", "energy"] = Field(
        "leverage", description="channel choice: ridge leverage of G (the paper) or output energy G_ii ‖W_:,i‖²")
    compensate: bool = Field(True, description="Theorem 3.1 refit of the kept down_proj columns (false: slice)")
    compensation_scale: float | None = Field(None, gt=0, description="refit ridge λ multiple (None: lambda_scale)")
    target: Literal["merged", "serial", "original"] = Field(
        "original", description="what the kept down_proj is refitted to reproduce (merged = Theorem 3.1 only)")
    target_scale: float = Field(0.1, gt=0, description="ridge λ multiple of the refit towards target")
    target_scales: list[float] | None = Field(
        None, min_length=2, description="choose λ_t per layer from these multiples by 2-fold cross-validation "
                                        "over calibration batches (None: target_scale)")
    fallback: bool = Field(False, description="per merged layer, keep instead one of its original layers "
                                              "(drop the others) when that, refitted alike, leaves less target "
                                              "error (cross-validated with target_scales)")

    @property
    def modifies(self) -> tuple[str, ...]:  # the fallback may replace the whole layer
        return ("self_attn", "mlp") if self.fallback else ("mlp",)
    example = ("FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP")  # needs merged layers
    needs = ("down_proj input Gram (fp64)", "target serial/original: the original layers' outputs "
             "(original weights on CPU)")

    def passes(self, shape) -> int | tuple[int, int]:
        """The shared pass, plus the original model walked in lockstep with ``target: original`` (none when an
        earlier pass kept the original model's states: ``ModifierSession.layer_pass``'s ``as_received``)."""
        return (1, 2) if self.target == "original" else 1

    def check_calibration(self, calibration) -> None:
        """``target: original`` fits each layer to the original hidden state, absorbing the drift of the
        layers before it; with ``propagate: original`` that drift is the unpruned stream's, which the pruned
        model never sees, so every layer re-corrects it (measured on SmolLM2: PPL 3954 vs 39.01)."""
        if self.fallback and self.target == "merged":
            raise self.fail("fallback compares candidates by their error towards a target: use target: "
                            "original or serial", field="fallback")
        if self.target == "original" and calibration.propagate == "original":
            raise self.fail("target: original needs calibration.propagate: compressed (it absorbs the drift "
                            "of the compressed layers before it); use target: serial or merged with "
                            "propagate: original", field="target")

    def check(self, shape: ModelShape) -> None:
        if refusal := shape.moe_refusal(channels="pruned"):
            raise self.fail(refusal)
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

    def target_layers(self, session: ModifierSession) -> list[int]:
        return list(self.layers) if self.layers is not None else session.shape.oversized_layers("mlp")

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """fp64, at Theorem 3.1's refit (the largest moment): the widest target's ``down_proj`` input Gram
        ``G`` (n × n; the leverage factor was made in its storage), ``G_KK`` factored in place (k × k), two
        ``n × 512`` panels, the right-hand side solved in place (k × hidden). The target refit comes after
        ``G`` is released (``G_KK`` and its factor, 2 k × k)."""
        targets = self.layers if self.layers is not None else shape.oversized_layers("mlp")
        width = max((shape.layers[i].intermediate_size for i in targets), default=0)
        kept, hidden = shape.intermediate_size, shape.hidden_size
        return 8 * max(width * width + kept * kept + 2 * width * 512 + kept * hidden,
                       2 * kept * kept + 2 * kept * hidden)

    def statistics(self, session: ModifierSession, layer_index: int) -> list[InputCovariance]:
        return [InputCovariance(session.adapter.path("down_proj"), products=torch.float32)]

    @torch.no_grad()
    def compress_layer(self, session: ModifierSession, layer_index: int, stats: dict[str, Any]) -> dict[str, Any]:
        adapter, layer = session.adapter, session.layers[layer_index]
        down_proj = adapter.linear(layer, "down_proj")
        statistic = stats[self.statistics(session, layer_index)[0].key]
        gram = statistic.gram
        scale = mean_eigenvalue(gram)
        if self.criterion == "leverage":
            score = ridge_leverage_scores(gram, self.lambda_scale * scale)
        else:
            score = channel_energy(down_proj.weight, gram)
        keep = score.topk(session.model.config.intermediate_size).indices.sort().values
        refit_scale = self.compensation_scale if self.compensation_scale is not None else self.lambda_scale
        down = (ridge_compensation(down_proj.weight, gram, keep, refit_scale * scale) if self.compensate
                else down_proj.weight[:, keep])
        adapter.keep_rows(layer, {"gate_proj": keep, "up_proj": keep}, session.shape.head_dim)
        set_linear_weight(down_proj, down, down_proj.bias)
        entry = {"channels_before": gram.shape[0], "channels_kept": len(keep),
                 f"{self.criterion}_kept": float(score[keep].sum()), f"{self.criterion}_total": float(score.sum())}
        kept_gram = submatrix(gram, keep, keep) if self.target != "merged" else None
        del gram, down
        statistic.release()  # the target refit needs only G_KK: free the merged width's n × n Gram first
        if kept_gram is not None:
            entry.update(self._refit_towards_target(session, layer_index, kept_gram))
        return entry

    def _refit_towards_target(self, session: ModifierSession, index: int, gram: torch.Tensor) -> dict[str, Any]:
        """Second ridge refit of the kept ``down_proj`` so the whole layer's output approaches the target
        ``y*``: the original layers run serially on this layer's inputs (``serial``) or the original model's
        hidden state at this depth (``original``). With the pruned layer's errors ``e = y* − layer(x)`` and
        ``σ`` the kept ``down_proj`` input, ``W' = W + ((G_KK + λI)⁻¹ Σ σ eᵀ)ᵀ`` (``ridge_refit``); with
        ``target_scales`` the λ multiple is chosen by 2-fold cross-validation over calibration batches.

        ``fallback``: the original layers this merged layer stands for are candidates too, each alone (the
        others dropped) with the same refit; the candidate with the least error — held-out error at its
        chosen λ with ``target_scales``, else the error left on the calibration tokens — replaces the layer.
        """
        inputs = session.current_layer.inputs
        targets = (session.original_outputs(index) if self.target == "original"
                   else session.original_outputs(index, inputs))
        layer = session.layers[index]
        folds = 2 if self.target_scales is not None else 1
        if self.target_scales is not None and len(inputs) < 2:
            raise self.fail("target_scales needs at least 2 calibration batches (samples > batch_size)",
                            field="target_scales")
        origin = session.layer_origin[index]
        candidates = [("merged", layer)]
        if self.fallback and len(origin) > 1:
            reference = session.reference
            candidates += [(j, copy.deepcopy(reference.layers[j])) for j in origin]
        results = []
        for name, candidate in candidates:
            with session.placed(candidate):
                moments = target_moments(session, candidate, targets, folds,
                                         grams=self.target_scales is not None or name != "merged")
            down = session.adapter.linear(candidate, "down_proj")
            candidate_gram = gram.to(session.device) if name == "merged" else sum(m["gram"] for m in moments)
            refit, entry = refit_down_proj(down, candidate_gram, moments, self.target_scale, self.target_scales)
            score = (min(entry["heldout_error"].values()) if self.target_scales is not None
                     else entry["target_error_after"])
            results.append((score, name, candidate, refit, entry))
        score, name, winner, refit, entry = min(results, key=lambda r: r[0])
        down = session.adapter.linear(winner, "down_proj")
        set_linear_weight(down, refit, down.bias)
        if winner is not layer:
            copy_layer_weights(winner, layer)
        if len(candidates) > 1:
            entry = {**entry, "kept": str(name), "candidates": {str(r[1]): r[0] for r in results}}
        return entry


def channel_energy(down_weight: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Output energy of each ``down_proj`` input channel, ``E_i = G_ii ‖W_:,i‖²`` (fp64): the squared norm,
    summed over calibration tokens, of what channel ``i`` alone adds to the output. The MLP analogue of
    Eq. 12's head importance (not in the paper, which ranks MLP channels by ridge leverage)."""
    return torch.diagonal(gram).to(torch.float64) * down_weight.to(torch.float64).pow(2).sum(0)


@torch.no_grad()
def copy_layer_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give ``target`` the weights of ``source`` (same architecture, any widths): every Linear is replaced
    through ``set_linear_weight``, every other parameter (norm gains) copied."""
    linears = {name for name, m in source.named_modules() if isinstance(m, torch.nn.Linear)}
    for name in linears:
        module = source.get_submodule(name)
        set_linear_weight(target.get_submodule(name), module.weight, module.bias)
    for name, parameter in source.named_parameters():
        if name.rsplit(".", 1)[0] not in linears:
            target.get_parameter(name).data.copy_(parameter.data)
