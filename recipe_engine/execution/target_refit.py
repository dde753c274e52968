"""A layer's ``down_proj`` refitted towards target hidden states (shared by the MLP-pruning steps).

After pruning, the layer runs once more on its calibration inputs; with ``σ`` the ``down_proj`` input and
``e = y* − layer(x)`` its output errors against targets ``y*`` (e.g. the original model's hidden states,
``ModifierSession.original_outputs``), :func:`target_moments` gathers ``C = Σ σᵀe``, ``E = Σ‖e‖²`` (and per
fold ``G = Σ σᵀσ``) through two statistics on that run, and :func:`refit_down_proj` solves the ridge refit
``W' = W + ((G + λI)⁻¹ C)ᵀ`` (``recipe_engine.numerics.linalg.ridge_refit``), its ``λ`` fixed or chosen by
cross-validation over the folds. Exact when the MLP output is added to the residual stream unnormalized.
"""
from __future__ import annotations

from typing import Any

import torch

from ..numerics.linalg import heldout_ridge_scale, mean_eigenvalue, refit_error, ridge_refit
from .activations import Activations
from .modifier_session import ModifierSession
from .stats import Statistic


class _LastInput(Statistic):
    """The input of the hooked module in the batch that just ran (per-batch scratch: nothing to reduce)."""

    sums = ()

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        self.value = inputs


class _TargetMoments(Statistic):
    """Per fold ``f`` (batches ``k ≡ f mod folds``): ``C = Σ σᵀe``, ``E = Σ‖e‖²`` and optionally
    ``G = Σ σᵀσ``, hooked on the layer output (``σ``: ``sigma.value`` of the same batch)."""

    sums = ("cross", "gram", "error")

    def __init__(self, sigma: _LastInput, targets: Activations, folds: int, channels: int, width: int,
                 grams: bool, device: torch.device):
        super().__init__("")
        self.sigma, self.targets, self.folds = sigma, targets, folds
        self.cross = torch.zeros(folds, channels, width, dtype=torch.float64, device=device)
        self.gram = torch.zeros(folds, channels, channels, dtype=torch.float64, device=device) if grams else None
        self.error = torch.zeros(folds, dtype=torch.float64, device=device)

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        fold = self.batch % self.folds
        target = self.targets.state(self.batch, output.device).double()  # subtract in fp64, not the model dtype
        residual = (target - output.to(torch.float64)).reshape(-1, output.shape[-1])
        flat = self.sigma.value.reshape(-1, self.cross.shape[1])
        self.cross[fold].add_((flat.float().T @ residual.float()).to(torch.float64))
        self.error[fold] += residual.pow(2).sum()
        if self.gram is not None:
            self.gram[fold].add_((flat.float().T @ flat.float()).to(torch.float64))


def target_moments(session: ModifierSession, layer, targets: Activations, folds: int,
                   grams: bool) -> list[dict[str, Any]]:
    """Moments of the ``down_proj`` refit towards ``targets`` for the layer on ``session.current_layer``'s inputs.

    With ``σ`` the ``down_proj`` input and ``e = y* − layer(x)`` the output errors, fold ``f`` (calibration
    batches ``k ≡ f mod folds``) gets ``C = Σ σᵀe`` and, when ``grams``, ``G = Σ σᵀσ`` (each batch's
    product in fp32, summed in fp64), and ``E = Σ‖e‖²`` (fp64; ``e`` is subtracted in fp64).
    """
    inputs = session.current_layer.inputs
    down = session.adapter.linear(layer, "down_proj")
    sigma = _LastInput(session.adapter.path("down_proj"))
    moments = _TargetMoments(sigma, targets, folds, down.in_features, down.out_features, grams, session.device)
    session.run_layer(layer, inputs, hooks=[sigma, moments])
    return [{"cross": moments.cross[f], "gram": moments.gram[f] if grams else None,
             "error": float(moments.error[f])} for f in range(folds)]


def refit_down_proj(down: torch.nn.Linear, gram: torch.Tensor, moments: list[dict[str, Any]],
                    scale: float, scales: list[float] | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Ridge refit ``W' = W + ((G + λI)⁻¹ C)ᵀ`` of ``down_proj`` from :func:`target_moments`; ``λ`` is
    ``scale`` × mean eig(G), or, given ``scales``, the multiple with the least cross-validated error over
    the folds. Returns the new weight (fp64) and the errors before/after (and the held-out errors)."""
    cross = sum(m["cross"] for m in moments).to(gram.device)
    error = sum(m["error"] for m in moments)
    entry: dict[str, Any] = {}
    if scales is not None:
        scale, held = heldout_ridge_scale([m["gram"] for m in moments], [m["cross"] for m in moments],
                                          [m["error"] for m in moments], scales)
        entry = {"target_scale_chosen": scale, "heldout_error": dict(zip(map(str, scales), held))}
    refit = ridge_refit(down.weight, gram, cross, scale * mean_eigenvalue(gram))
    after = refit_error(error, gram, cross, refit - down.weight.to(torch.float64))
    return refit, {"target_error_before": error, "target_error_after": after, **entry}
