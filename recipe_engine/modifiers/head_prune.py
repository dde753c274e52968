"""HeadPrune: prune the attention of merged (wide) layers back to the config's head count
(FlattenGPT §3.2 "MHA pruning", Algorithm 2, Appendix C.1 for GQA)."""
from __future__ import annotations

import itertools
import math
from typing import Any, Literal

import torch
from pydantic import Field

from recipe_engine.api import (InputCovariance, LayerModifier, ModelShape, ModifierSession, mean_eigenvalue,
                               reconstruction_error, register, ridge_compensation, set_linear_weight, submatrix)


def group_channels(groups: list[int], queries_per_group: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query/o_proj channels, key/value channels) of the KV groups ``groups`` (ascending order).

    Query head ``h`` reads KV head ``h // queries_per_group`` (HF ``repeat_kv`` layout), so a group is one
    KV head plus its ``queries_per_group`` consecutive query heads.
    """
    query = [torch.arange(h * head_dim, (h + 1) * head_dim)
             for g in groups for h in range(g * queries_per_group, (g + 1) * queries_per_group)]
    kv = [torch.arange(g * head_dim, (g + 1) * head_dim) for g in groups]
    return torch.cat(query), torch.cat(kv)


def eq12_group_scores(o_weight: torch.Tensor, gram: torch.Tensor, count: int, groups: int,
                      queries_per_group: int, head_dim: int) -> torch.Tensor:
    """Eq. 12 per KV group: the sum over its query heads of ``f_h = (E‖z_h ⊙ r_h‖²)^{1/2}``.

    ``z_h`` is head ``h``'s attention output (its slice of the ``o_proj`` input) and ``r_h`` the row norms
    of ``W_O,h`` in the paper's orientation (column norms of torch's ``o_proj.weight`` slice), so
    ``E‖z_h ⊙ r_h‖² = Σ_c r_c² G_cc / N`` is read from the ``o_proj`` input Gram ``G``. The paper's
    expectation of a vector is taken as this root mean square (a norm is needed to rank heads).
    """
    weighted = o_weight.to(torch.float64).pow(2).sum(0) * torch.diagonal(gram.to(torch.float64)) / count
    per_head = weighted.reshape(groups * queries_per_group, head_dim).sum(1).sqrt()
    return per_head.reshape(groups, queries_per_group).sum(1)


def best_groups_by_error(o_weight: torch.Tensor, gram: torch.Tensor, groups: int, keep: int,
                         queries_per_group: int, head_dim: int, ridge: float | None,
                         exhaustive_limit: int, map_=map) -> list[int]:
    """KV groups whose kept ``o_proj`` output has the least (compensated) reconstruction error.

    Every ``C(groups, keep)`` subset is scored when there are at most ``exhaustive_limit``; otherwise
    greedy backward elimination drops, one at a time, the group whose removal costs least
    (:func:`greedy_group_elimination`, which scores every candidate exactly without a solve). ``map_``
    scores the exhaustive candidates (``session.map`` spreads them over data-parallel ranks); ties: the first.
    """
    def group_error(error: "SubsetError"):
        return lambda subset: error(group_channels(list(subset), queries_per_group, head_dim)[0])

    if math.comb(groups, keep) <= exhaustive_limit:
        error = group_error(SubsetError(o_weight, gram, ridge))
        candidates = list(itertools.combinations(range(groups), keep))
        scores = list(map_(error, candidates))
        return list(candidates[min(range(len(candidates)), key=lambda i: scores[i])])
    members = [group_channels([g], queries_per_group, head_dim)[0] for g in range(groups)]
    return greedy_group_elimination(o_weight, gram, members, keep, ridge)


class SubsetError:
    """``reconstruction_error`` of kept input channels ``K`` from quantities shared by every candidate: with
    ``V = G Wᵀ``, ``U = V + λWᵀ`` and the refit ``Z = (G_KK + λI)⁻¹ U_K`` (``ridge_compensation``'s ``W'_Kᵀ``),
    ``E(K) = tr(WGWᵀ) − 2⟨V_K, Z⟩ + ⟨U_K, Z⟩ − λ‖Z‖²``: one ``|K|``-sized solve per candidate instead of
    a solve plus an ``out × n × n`` product. Uncompensated (``ridge`` None): ``E = tr(W_D G_DD W_Dᵀ)``."""

    def __init__(self, weight: torch.Tensor, gram: torch.Tensor, ridge: float | None):
        self.w, self.g, self.ridge = weight.to(torch.float64), gram.to(torch.float64), ridge
        if ridge is not None:
            self.v = self.g @ self.w.T
            self.u = self.v + ridge * self.w.T
            self.total = float((self.w.T * self.v).sum())

    def __call__(self, keep: torch.Tensor) -> float:
        if self.ridge is None:
            drop = torch.ones(self.g.shape[0], dtype=torch.bool)
            drop[keep] = False
            dropped = self.w[:, drop]
            return float((dropped @ self.g[drop][:, drop] * dropped).sum())
        system = submatrix(self.g, keep, keep)
        system.diagonal().add_(self.ridge)
        z = torch.cholesky_solve(self.u[keep], torch.linalg.cholesky(system))
        return (self.total - 2 * float((self.v[keep] * z).sum()) + float((self.u[keep] * z).sum())
                - self.ridge * float(z.pow(2).sum()))


@torch.no_grad()
def greedy_group_elimination(weight: torch.Tensor, gram: torch.Tensor, members: list[torch.Tensor],
                             keep: int, ridge: float | None) -> list[int]:
    """Backward elimination of input-channel groups: repeatedly drop the group (lowest index on ties)
    whose removal leaves the least ``reconstruction_error`` — the same choice as scoring each candidate
    with ``reconstruction_error``, at a fraction of the cost.

    Uncompensated (``ridge is None``): ``E(D) = Σ_{a,b∈D} tr(W_a G_ab W_bᵀ)``, a sum over a table of group
    pairs. Compensated: with ``V = G Wᵀ``, ``U = V + λWᵀ`` and ``S_K = G_KK + λI``, the refit is
    ``W'_Kᵀ = Z = S_K⁻¹ U_K`` and ``E(K) = tr(WGWᵀ) − 2⟨V_K, Z⟩ + ⟨U_K, Z⟩ − λ‖Z‖²``. Removing group ``r``
    from ``K`` downdates both by the block Schur complement (the OBS update, Hassibi & Stork 1993):
    ``Z' = Z_{K'} − (S_K⁻¹)_{K'r} (S_K⁻¹)_rr⁻¹ Z_r`` and ``S_{K'}⁻¹ = (S_K⁻¹)_{K'K'} − (S_K⁻¹)_{K'r}
    (S_K⁻¹)_rr⁻¹ (S_K⁻¹)_{rK'}``, so one ``n × n`` inverse is made, not one solve per candidate.
    """
    shared = SubsetError(weight, gram, ridge)  # V = G Wᵀ, U = V + λWᵀ and tr(WGWᵀ), as every candidate needs
    w, g = shared.w, shared.g
    kept = list(range(len(members)))
    if ridge is None:
        pair = torch.stack([torch.stack([(w[:, a] @ g[a][:, b] * w[:, b]).sum() for b in members])
                            for a in members])
        while len(kept) > keep:
            def dropped_error(drop: int) -> float:
                dropped = [x for x in range(len(members)) if x not in kept or x == drop]
                return float(pair[dropped][:, dropped].sum())
            kept.remove(min(kept, key=dropped_error))
        return kept
    v, u, total = shared.v, shared.u, shared.total
    system = g.clone()
    system.diagonal().add_(ridge)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(system))
    del system
    z = inverse @ u
    channels = torch.cat([members[k] for k in kept])
    while len(kept) > keep:
        offsets = torch.cumsum(torch.tensor([0] + [len(members[k]) for k in kept]), 0)
        best = None
        for position, group in enumerate(kept):
            r = torch.arange(int(offsets[position]), int(offsets[position + 1]))
            rest = torch.cat([torch.arange(0, int(offsets[position])),
                              torch.arange(int(offsets[position + 1]), len(channels))])
            coupling = inverse[rest.unsqueeze(1), r]
            step = torch.linalg.solve(inverse[r.unsqueeze(1), r], z[r])
            z_new = z[rest] - coupling @ step
            kept_channels = channels[rest]
            error = (total - 2 * float((v[kept_channels] * z_new).sum()) + float((u[kept_channels] * z_new).sum())
                     - ridge * float(z_new.pow(2).sum()))
            if best is None or error < best[0]:
                best = (error, group, rest, r, coupling, z_new)
        _, group, rest, r, coupling, z = best
        inverse = inverse[rest.unsqueeze(1), rest] - coupling @ torch.linalg.solve(inverse[r.unsqueeze(1), r],
                                                                                    coupling.T)
        channels = channels[rest]
        kept.remove(group)
    return kept


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
        if shape.num_experts:
            raise self.fail(f"{shape.model_type}'s MLP is a mixture of {shape.num_experts} experts: no step widens "
                            f"its layers (FlattenAdjacent refuses them), so there are no merged heads to prune")
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
