"""Which KV groups of an attention block to keep when pruning heads (shared by the head-pruning steps).

A group is one KV head and the query heads that read it (HF ``repeat_kv`` layout), so pruning whole groups
keeps the query/KV ratio. Groups are ranked by FlattenGPT's head importance (Eq. 12, Appendix C.1:
:func:`eq12_group_scores`) or chosen to minimise the ``o_proj`` output's reconstruction error
(:func:`best_groups_by_error`: every subset, or greedy backward elimination with the OBS downdate,
:func:`greedy_group_elimination`). Notation and solves as in :mod:`recipe_engine.numerics.linalg` (fp64).
"""
from __future__ import annotations

import itertools
import math

import torch

from .linalg import submatrix


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
