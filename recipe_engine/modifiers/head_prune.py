"""HeadPrune: prune the attention of merged (wide) layers back to the config's head count
(FlattenGPT §3.2 "MHA pruning", Algorithm 2, Appendix C.1 for GQA)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from recipe_engine.api import (InputCovariance, LayerModifier, ModelShape, ModifierSession, best_groups_by_error,
                               eq12_group_scores, group_channels, mean_eigenvalue, reconstruction_error, register,
                               ridge_compensation, set_linear_weight)


@register
class HeadPrune(LayerModifier):
    """Remove whole KV groups (a KV head and its query heads) from merged layers down to the config's
    head count, optionally refitting ``o_proj`` over the kept heads.

    ``criterion: eq12`` ranks groups by the paper's head importance (Eq. 12, summed over a group's query
    heads, Appendix C.1); ``criterion: reconstruction`` picks the groups whose ``o_proj`` output is best
    reconstructed, ``min_K ‖Z_K W'_Kᵀ − Z Wᵀ‖²`` (``Z``: the ``o_proj`` input). ``compensate`` refits the
    kept ``o_proj`` columns by ridge least squares, ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` (the Theorem 3.1
    solution applied to heads), with ``λ = lambda_scale × mean eigenvalue of G``; the reconstruction
    criterion then scores the compensated error. The paper's method is ``criterion: eq12, compensate: false``.
    Layers: ``layers`` if given, else every layer with more heads than the config.
    """

    layers: list[int] | None = Field(None, description="layer indices to prune (default: the merged layers)")
    criterion: Literal["reconstruction", "eq12"] = Field(
        "reconstruction", description="group choice: o_proj reconstruction error or the paper's Eq. 12")
    compensate: bool = Field(True, description="refit kept o_proj columns by ridge least squares")
    lambda_scale: float = Field(0.01, gt=0, description="o_proj ridge λ as a multiple of the mean eigenvalue")
    exhaustive_limit: int = Field(1024, ge=1, description="score all subsets up to this many, else greedy")

    modifies = ("self_attn",)
    example = ("FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP")  # needs merged layers
    needs = ("o_proj input Gram (fp64)",)

    def check(self, shape: ModelShape) -> None:
        if refusal := shape.moe_refusal(why=": no step widens its layers (FlattenAdjacent refuses them), so there "
                                            "are no merged heads to prune"):
            raise self.fail(refusal)
        targets = self.layers if self.layers is not None else shape.oversized_layers("attention")
        if not targets:
            raise self.fail("no layer has more heads than the config: put HeadPrune after FlattenAdjacent "
                            "or list layers", field="layers")
        ratio = shape.num_heads // shape.num_kv_heads
        for index in targets:
            if not 0 <= index < shape.num_layers:
                raise self.fail(f"layer {index} out of range (model has {shape.num_layers})", field="layers")
            layer = shape.layers[index]
            if layer.num_kv_heads <= shape.num_kv_heads or layer.num_heads != ratio * layer.num_kv_heads:
                raise self.fail(f"layer {index} has {layer.num_heads} heads / {layer.num_kv_heads} KV heads; "
                                f"need more than {shape.num_kv_heads} KV groups of {ratio} query heads",
                                field="layers")
            shape.layers[index] = type(layer)(shape.num_heads, shape.num_kv_heads, layer.intermediate_size,
                                              layer.origin)

    def target_layers(self, session: ModifierSession) -> list[int]:
        return list(self.layers) if self.layers is not None else session.shape.oversized_layers("attention")

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """The fp64 ``o_proj`` input Gram of the widest target and two solve buffers of its size."""
        targets = self.layers if self.layers is not None else shape.oversized_layers("attention")
        width = max((shape.layers[i].num_heads for i in targets), default=0) * shape.head_dim
        return 3 * width * width * 8

    def statistics(self, session: ModifierSession, layer_index: int) -> list[InputCovariance]:
        return [InputCovariance(session.adapter.path("o_proj"))]

    @torch.no_grad()
    def compress_layer(self, session: ModifierSession, layer_index: int, stats: dict[str, Any]) -> dict[str, Any]:
        cfg, head_dim = session.model.config, session.shape.head_dim
        adapter, layer = session.adapter, session.layers[layer_index]
        o_proj = adapter.linear(layer, "o_proj")
        stat = stats[self.statistics(session, layer_index)[0].key]
        per_group = cfg.num_attention_heads // cfg.num_key_value_heads
        groups = adapter.layer_widths(layer, head_dim)[1]
        o_weight, gram = o_proj.weight.detach(), stat.gram
        ridge = self.lambda_scale * mean_eigenvalue(gram) if self.compensate else None
        if self.criterion == "eq12":
            scores = eq12_group_scores(o_weight, gram, stat.count, groups, per_group, head_dim)
            kept = sorted(scores.topk(cfg.num_key_value_heads).indices.tolist())
        else:
            kept = best_groups_by_error(o_weight, gram, groups, cfg.num_key_value_heads, per_group,
                                        head_dim, ridge, self.exhaustive_limit, session.map)
        query, kv = group_channels(kept, per_group, head_dim)
        error = reconstruction_error(o_weight, gram, query, ridge)
        new_o = ridge_compensation(o_weight, gram, query, ridge) if self.compensate else o_weight[:, query]
        set_linear_weight(o_proj, new_o, o_proj.bias)
        adapter.keep_rows(layer, {"q_proj": query, "k_proj": kv, "v_proj": kv}, head_dim)
        total = float(torch.einsum("oi,ij,oj->", o_weight.double(), gram, o_weight.double()))
        return {"kv_groups_kept": kept, "kv_groups_before": groups,
                "heads_kept": [h for g in kept for h in range(g * per_group, (g + 1) * per_group)],
                "relative_error": error / total}
