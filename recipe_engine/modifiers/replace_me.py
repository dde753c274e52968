"""ReplaceMe: remove a contiguous block of layers and fold a linear map in its place into ``down_proj``.

Shopkhoev et al. 2025, "ReplaceMe: Network Simplification via Depth Pruning and Linear Transformations", §3
(layer selection; estimating the linear transform by least squares or by a cosine objective). With ``fold:
down_proj`` the output is a stock checkpoint: the map is multiplied into the ``down_proj`` of the layer before
the block. With ``fold: hook`` (architectures that normalize the MLP output, Gemma 3) the map is applied by a
forward hook to what the layer adds to the residual stream and saved beside the checkpoint as an extra, which
``recipe_engine.load_model`` restores (not stock).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from recipe_engine.api import (ADAPTERS, LayerBudget, Modifier, ModifierSession, RecipeError, Statistic,
                               budget_field, mean_eigenvalue, refit_error, register, remove_layers, ridge_refit)

from ._depth import drop_symbolic, extra_adapter, require_uniform, span_scores, token_mask

EXTRA_TYPE, EXTRA_VERSION = "replace_me_map", 1


def statistics_mask(session: ModifierSession, batch: torch.Tensor, skip_first: int) -> torch.Tensor:
    """Non-pad tokens (``token_mask``) except the first ``skip_first`` positions of every window."""
    mask = token_mask(session, batch).clone()
    mask[:, :skip_first] = False
    return mask


def last_token_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, positions)`` of the last non-pad token of every window that has one."""
    rows = mask.any(1).nonzero().flatten()
    positions = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    return rows, positions[rows]


@torch.no_grad()
def block_distances(session: ModifierSession, n: int, tokens: Literal["last", "all"],
                    skip_first: int = 0) -> dict[int, float]:
    """``d(ℓ) = E_t arccos(cos(X_{ℓ,t}, X_{ℓ+n,t})) / π`` for every start ``ℓ = 1 … L − n`` (the block
    ``ℓ … ℓ+n−1``): ``X_ℓ`` is layer ℓ's input, ``X_L`` the last layer's output before the final norm.
    ``tokens``: ``all`` non-pad tokens after the first ``skip_first`` of each window, or ``last``, the last
    non-pad token of each calibration window (the authors' code, whose documents end there). Cosines and means
    in fp64; a NaN distance (a zero hidden state) is an error."""
    masks = [statistics_mask(session, batch, skip_first) for batch in session.batches]
    picks = [last_token_rows(mask) for mask in masks] if tokens == "last" else None

    def keep(index: int, hidden: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if index == 0:
            return None  # layer 0 is never removed (the map is folded into the layer before the block)
        if picks is not None:
            return [x[rows.to(x.device), positions.to(x.device)] for x, (rows, positions) in zip(hidden, picks)]
        return [x[mask.to(x.device)] for x, mask in zip(hidden, masks)]

    def score(first: list[torch.Tensor] | None, second: list[torch.Tensor]) -> float:
        if first is None:
            return math.nan
        total, count = 0.0, 0
        for a, b in zip(first, second):
            cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=0.0)
            total += float((cos.clamp(-1.0, 1.0).acos() / math.pi).sum())
            count += cos.numel()
        return total / count

    scores = span_scores(session, n, keep, score, "ReplaceMe block distances")
    scores.pop(0)
    bad = [start for start, value in scores.items() if math.isnan(value)]
    if bad:
        raise RecipeError(f"block distance is NaN for starts {bad} (zero or non-finite hidden states)",
                          modifier="ReplaceMe")
    return scores


class BlockOutput(Statistic):
    """A block's output on the calibration batch being run (one batch at a time, nothing summed)."""

    sums = ()

    def __init__(self, module: str):
        super().__init__(module)
        self.output: torch.Tensor | None = None

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        self.output = output


class Seam:
    """Moments of the replacement problem ``min_T ‖M T + Y − L‖²`` over non-pad calibration tokens (fp64).

    ``M``: the MLP output of the layer before the block; ``H = Y + M`` that layer's output; ``L`` the block's
    output. With the plain drop as starting point (``T = I``) the errors are ``E = L − H``:
    ``gram = MᵀM``, ``cross = MᵀE``, ``error = ‖E‖²`` (what ``ridge_refit`` / ``refit_error`` take, the
    weight being the identity). ``rows`` keeps ``M`` and the target ``L − Y`` in fp32 for the cosine objective.
    """

    def __init__(self, keep_rows: bool):
        self.gram: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None
        self.error = 0.0
        self.tokens = 0
        self.rows: tuple[list[torch.Tensor], list[torch.Tensor]] | None = ([], []) if keep_rows else None

    def add(self, mlp: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> None:
        m, e = mlp.double(), after.double() - before.double()
        if self.gram is None:
            self.gram = torch.zeros(m.shape[1], m.shape[1], dtype=torch.float64, device=m.device)
            self.cross = torch.zeros_like(self.gram)
        self.gram.addmm_(m.T, m)
        self.cross.addmm_(m.T, e)
        self.error += float(e.pow(2).sum())
        self.tokens += m.shape[0]
        if self.rows is not None:
            self.rows[0].append(mlp.float().cpu())
            self.rows[1].append((e + m).float().cpu())


@torch.no_grad()
def seam_moments(session: ModifierSession, start: int, n: int, keep_rows: bool, skip_first: int = 0,
                 branch: str = "mlp") -> Seam:
    """One calibration pass through layers ``0 … start+n−1`` (the layers after the block are not run):
    ``M`` (the output of the layer's submodule ``branch``: the MLP, or the norm on its output) and ``H`` of
    layer ``start − 1`` are kept (non-pad rows after the first ``skip_first`` positions of each window) until
    the block's output ``L`` arrives, batch by batch."""
    masks = [statistics_mask(session, batch, skip_first) for batch in session.batches]
    seam, kept = Seam(keep_rows), []
    mlp = BlockOutput(branch)

    def keep(k: int, output: torch.Tensor) -> None:
        mask = masks[k].to(output.device)
        kept.append((mlp.output[mask].to(session.storage), output[mask].to(session.storage)))

    def fold(k: int, output: torch.Tensor) -> None:
        m, h = kept[k]
        seam.add(m.to(output.device), h.to(output.device), output[masks[k].to(output.device)])
        kept[k] = None

    inputs = session.capture_inputs()
    for index in session.progress.track(range(start + n), "ReplaceMe activations"):
        on_batch = keep if index == start - 1 else fold if index == start + n - 1 else None
        with session.placed(index):
            inputs = session.run_layer(session.layers[index], inputs,
                                       hooks=[mlp] if on_batch is keep else (), on_batch=on_batch)
    seam.gram, seam.cross = seam.gram.cpu(), seam.cross.cpu()
    return seam


class Adam(BaseModel):
    """The cosine objective's optimiser (the authors' code: Adam, lr 1e-4, 10 epochs of 1024-token batches,
    from ``T = I``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: int = Field(10, ge=1, description="passes over the captured calibration tokens")
    lr: float = Field(1e-4, gt=0, description="Adam learning rate")
    batch_tokens: int = Field(1024, ge=1, description="tokens per Adam step (shuffled, seeded)")
    seed: int = Field(0, description="seed of the token shuffle")


def cosine_fit(seam: Seam, adam: Adam, device: torch.device) -> tuple[torch.Tensor, float, float]:
    """``T = argmin 1 − mean_t cos(M_t T, L_t − Y_t)`` by Adam in fp32 from ``T = I``; returns ``T`` (fp64) and
    the loss on all tokens before and after."""
    mlp = torch.cat(seam.rows[0]).to(device)
    target = torch.cat(seam.rows[1]).to(device)
    seam.rows = None

    def loss(t: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        return 1 - torch.nn.functional.cosine_similarity(mlp[rows] @ t, target[rows], dim=-1).mean()

    transform = torch.nn.Parameter(torch.eye(mlp.shape[1], device=device))
    optimizer = torch.optim.Adam([transform], lr=adam.lr)
    generator = torch.Generator().manual_seed(adam.seed)
    with torch.no_grad():
        before = float(loss(transform))
    for _ in range(adam.epochs):
        for rows in torch.randperm(mlp.shape[0], generator=generator).split(adam.batch_tokens):
            optimizer.zero_grad()
            loss(transform, rows.to(device)).backward()
            optimizer.step()
    with torch.no_grad():
        after = float(loss(transform))
    return transform.detach().cpu().double(), before, after


class ByFold:
    """A modifier flag that depends on ``fold``: on an instance, ``down_proj`` gives the first value and a hook
    (``hook``, ``auto``) the second; on the class (what the registry declares), the default ``fold``'s."""

    def __init__(self, folded: Any, hooked: Any):
        self.folded, self.hooked = folded, hooked

    def __get__(self, step, owner=None) -> Any:
        return self.folded if step is None or step.fold == "down_proj" else self.hooked


class MapOutput:
    """Forward hook ``y ← y T`` on a module's output (row vectors): the map of ``fold: hook``."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix

    def __call__(self, _module, _args, output):
        if isinstance(output, tuple):  # gpt-oss's MoE block returns (output, router scores)
            return (self(_module, _args, output[0]), *output[1:])
        return output @ self.matrix.to(output.device, output.dtype)


def _mlp_output_norm(model_type: str) -> str | None:
    """The architecture's norm on the MLP output before the residual add (Gemma 3), or None."""
    adapter = ADAPTERS.get(model_type)
    return adapter.norms.get("mlp_output_norm") if adapter is not None else None


def residual_branch(adapter, fold: str) -> str:
    """Path inside a decoder layer of the module whose output ``M`` is added to the residual stream: the MLP,
    or with ``fold: hook`` the norm on its output where the architecture has one (Gemma 3)."""
    if fold == "hook" and "mlp_output_norm" in adapter.norms:
        return adapter.path("mlp_output_norm")
    return adapter.path("mlp")


def install_map(model, adapter, position: int, module: str, matrix: torch.Tensor) -> MapOutput:
    """Register ``y ← y T`` on submodule ``module`` of decoder layer ``position``."""
    hook = MapOutput(matrix)
    adapter.layers(model)[position].get_submodule(module).register_forward_hook(hook)
    return hook


@register
class ReplaceMe(Modifier):
    """Remove the ``n`` contiguous layers whose input and output are closest; fold a linear map ``T`` in their place.

    Selection (§3): the start ``ℓ ≥ 1`` minimising the mean angular distance ``arccos(cos(X_ℓ, X_{ℓ+n}))/π``
    between the block's input and output hidden states (``block_distances``). Estimation: ``M`` is the MLP
    output of layer ``ℓ−1``, ``Y`` the residual stream it is added to, ``L`` the block's output;
    ``objective: lstsq`` solves ``T = (MᵀM + λI)⁻¹ (Mᵀ(L − Y) + λI)`` in fp64 from Gram matrices
    accumulated over calibration batches (``λ = ridge × mean eigenvalue of MᵀM``, shrinking ``T`` towards the
    plain drop ``T = I``; 0: the paper's plain least squares); ``objective: cosine`` minimises
    ``1 − mean cos(M T, L − Y)`` with Adam (``adam``). ``fold: down_proj``: ``down_proj``'s weight ``W``
    becomes ``Tᵀ W`` (stock; on a mixture-of-experts layer every expert's down projection, and a shared
    expert's: the MLP output is a gate-weighted sum of them, so the fold is exact). ``fold: hook``: ``M`` is what
    the layer adds to the residual stream (on Gemma 3 the normalized MLP output) and ``T`` is applied to it by a
    forward hook, saved as a recipe extra (not stock; the layers are pinned as after LinearPatch).
    ``fold: auto``: down_proj where the architecture allows it, else the hook (the report's ``fold`` says
    which).
    Deviations, measured on SmolLM2 (docs/methods/replaceme.md): the distance averages over every calibration token
    (``distance_tokens: all``; the authors' code: the last token of each sample), and statistics leave out the
    first ``skip_first`` positions of each window (the attention sink's massive hidden state dominates a
    least-squares fit: 96 % of ``‖L − H‖²`` sits at position 0).
    ``fold: down_proj`` is refused on architectures that normalize the MLP output before the residual add
    (Gemma 3), where no stock weight can carry ``T``.
    """

    streams = True
    calibration_passes = 2
    shared_ignores = ("objective", "ridge", "adam", "fold")  # the distances depend on n, distance_tokens, skip_first
    needs = ("angular distance between every block's input and output hidden states",
             "MLP output and residual stream before the block, and the block's output (fp64 Grams)")

    n: LayerBudget = budget_field(1, "number of contiguous layers to remove (paper: 25% of the layers)")
    objective: Literal["lstsq", "cosine"] = Field("lstsq", description="least squares, or the cosine objective")
    distance_tokens: Literal["last", "all"] = Field(
        "all", description="tokens the block distance averages over: all (measured better), or the last of each "
                           "window (the authors' code)")
    ridge: float = Field(0.0, ge=0, description="λ as a multiple of MᵀM's mean eigenvalue (lstsq)")
    skip_first: int = Field(1, ge=0, description="leading positions of every calibration window left out of the "
                                                 "statistics (the attention-sink token's massive activations)")
    adam: Adam | None = Field(None, description="optimiser of objective: cosine (None: the authors' settings)")
    fold: Literal["down_proj", "hook", "auto"] = Field(
        "down_proj", description="where T goes: into down_proj (stock), a hook on the layer's MLP output saved as "
                                 "an extra (not stock), or auto: down_proj where the architecture allows it")

    stock_output = ByFold(True, False)
    refuses_streaming = ByFold(None, "ReplaceMe<fold: hook or auto> keeps its map as a hook on an in-memory "
                                     "layer; use fold: down_proj")

    def folds_into(self, model_type: str) -> str:
        """``down_proj`` or ``hook``: ``fold`` resolved for the architecture."""
        normalized = _mlp_output_norm(model_type) is not None
        return "hook" if self.fold == "hook" or (self.fold == "auto" and normalized) else "down_proj"

    def output_is_stock(self, shape) -> bool:
        return self.folds_into(shape.model_type) == "down_proj"

    def check(self, shape) -> None:
        fold, output_norm = self.folds_into(shape.model_type), _mlp_output_norm(shape.model_type)
        if fold == "down_proj" and output_norm is not None:
            raise self.fail(f"{shape.model_type} normalizes the MLP output ({output_norm}) "
                            f"before the residual add, so the map cannot be folded into down_proj; use "
                            f"fold: hook (the map kept beside the checkpoint, not stock), or SLEB, ShortGPT or "
                            f"LinearPatch<select: contiguous> on this architecture", field="fold")
        if fold == "hook" and shape.pinned:
            raise self.fail(f"the layers are already patched by {shape.pinned}; put ReplaceMe<fold: hook> before it",
                            field="fold")
        if self.n > shape.num_layers - 1:
            raise self.fail(f"n={self.n} is too many: the first of the {shape.num_layers} layers is kept (the map "
                            f"is folded into the layer before the block), so at most {shape.num_layers - 1}",
                            field="n")
        if self.objective == "lstsq" and self.adam is not None:
            raise self.fail("adam applies only with objective: cosine", field="adam")
        if self.objective == "cosine" and "ridge" in self.model_fields_set:
            raise self.fail("ridge applies only with objective: lstsq", field="ridge")
        require_uniform(self, shape)
        drop_symbolic(shape, self.n)
        if fold == "hook":
            shape.pinned = self.step_name()  # the hook sits on a layer by index: later depth changes would move it

    def check_calibration(self, calibration) -> None:
        if self.skip_first >= calibration.seq_len:
            raise self.fail(f"skip_first={self.skip_first} leaves no token of the {calibration.seq_len}-token "
                            f"calibration windows", field="skip_first")

    def working_memory(self, shape, tokens: int) -> int:
        """The larger of: the distance pass's ``n + 1`` kept hidden states (``distance_tokens: all``), and the
        fit's kept ``M`` and ``H`` (fp32) with two fp64 ``hidden²`` moments and the solve's copy; the cosine
        objective adds ``M`` and the target in fp32 and ``T`` with its gradient and Adam moments."""
        h = shape.hidden_size
        distances = (self.n + 1) * tokens * h * 4 if self.distance_tokens == "all" else 0
        fit = 2 * tokens * h * 4 + 3 * h * h * 8
        if self.objective == "cosine":
            fit += 2 * tokens * h * 4 + 4 * h * h * 4
        return max(distances, fit)

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        distances = session.shared(self, "ReplaceMe block distances",
                                   lambda: block_distances(session, self.n, self.distance_tokens, self.skip_first))
        start = min(distances, key=lambda s: (distances[s], s))
        fold = self.folds_into(session.model.config.model_type)
        branch = residual_branch(session.adapter, fold)
        seam = seam_moments(session, start, self.n, self.objective == "cosine", self.skip_first, branch)
        identity = torch.eye(seam.gram.shape[0], dtype=torch.float64)
        fit: dict[str, Any] = {"tokens": seam.tokens}
        if self.objective == "lstsq":
            ridge = self.ridge * mean_eigenvalue(seam.gram)
            try:
                transform = ridge_refit(identity, seam.gram, seam.cross, ridge).T
            except torch.linalg.LinAlgError as exc:
                raise self.fail(f"MᵀM is singular on the calibration tokens ({exc}); set ridge > 0",
                                field="ridge") from exc
            fit["ridge"] = ridge
        else:
            transform, fit["cosine_loss_drop"], fit["cosine_loss"] = cosine_fit(seam, self.adam or Adam(),
                                                                                session.device)
        residual = refit_error(seam.error, seam.gram, seam.cross, transform.T - identity)
        fit.update(drop_error=seam.error / seam.tokens, fit_error=residual / seam.tokens,
                   relative=residual / seam.error if seam.error else 0.0)
        if fold == "down_proj":
            with session.placed(start - 1, on_device=False):
                session.adapter.fold_mlp_output(session.layers[start - 1], transform)
        else:
            install_map(session.model, session.adapter, start - 1, branch, transform.float())
        folded_into = list(session.layer_origin[start - 1])
        removed = remove_layers(session, list(range(start, start + self.n)))
        if fold == "hook":
            session.outputs.add_extra(self.step_name(), {"type": EXTRA_TYPE, "version": EXTRA_VERSION,
                                                         "layers": len(session.layers), "position": start - 1,
                                                         "module": branch}, {"T": transform.float()})
        return {"start": start, "removed": [list(o) for o in removed], "folded_into": folded_into, "fold": fold,
                "map_on": branch,
                "distance": distances[start], "distances": distances, "distance_tokens": self.distance_tokens,
                "skip_first": self.skip_first,
                "objective": self.objective, "fit": fit, "layers": len(session.layers)}

    @classmethod
    def restore_extra(cls, model, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        adapter = extra_adapter(model, config, cls.step_name(), (EXTRA_TYPE, EXTRA_VERSION))
        install_map(model, adapter, config["position"], config["module"], tensors["T"])
