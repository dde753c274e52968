"""LinearPatch: a Hadamard-rotated channel scaling on the residual stream at each pruning interface.

Chen et al. 2025 (LinearPatch), §3.2–3.4. Not a stock layer: ``P`` is applied by a forward pre-hook on the
layer after the interface (the final norm when the last layers were removed) and saved beside the
checkpoint as an extra; ``recipe_engine.load_model`` restores it, stock ``from_pretrained`` ignores it.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from recipe_engine.api import (Activations, LayerBudget, Modifier, ModifierSession, budget_field, register,
                               remove_layers, rotation, top_k_kl)

from ._depth import drop_symbolic, extra_adapter, require_uniform, span_scores, token_mask

EXTRA_TYPE, EXTRA_VERSION = "linear_patch", 1


def interfaces(origin: list[tuple[int, ...]], total: int, merged_as: str) -> list[tuple[int, int, int]]:
    """``(position, start, end)`` for every pruning interface.

    Before current layer ``position`` (``len(origin)``: the final norm) the arriving hidden state stands
    for the original model's input of layer ``start`` while the layer expects that of layer ``end``
    (``total``: the last layer's output). A layer built from several original layers (LaCo, flattening)
    passes on the input of ``min(origin) + 1`` with ``merged_as: base`` (its base layer kept, the rest
    removed), of ``max(origin) + 1`` with ``span`` (a faithful stand-in for the whole span).
    """
    found, arriving = [], 0
    for position, covered in enumerate(list(origin) + [(total,)]):
        if arriving != min(covered):
            found.append((position, arriving, min(covered)))
        arriving = (min(covered) if merged_as == "base" else max(covered)) + 1
    return found


class Patch:
    """Forward pre-hook ``x ← x P`` on the hidden state a module receives (Eq. 8, row vectors)."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.matrix.to(x.device, x.dtype)

    def __call__(self, _module, args, kwargs):
        if args:
            return (self.transform(args[0]),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.transform(kwargs["hidden_states"])}


def install(model, adapter, position: int, matrix: torch.Tensor) -> Patch:
    """Register ``P`` before decoder layer ``position`` (or before the final norm when it is the count)."""
    layers = adapter.layers(model)
    target = layers[position] if position < len(layers) else adapter.final_norm(model)
    patch = Patch(matrix)
    target.register_forward_pre_hook(patch, with_kwargs=True)
    return patch


@torch.no_grad()
def rotated_magnitudes(reference: ModifierSession, wanted: set[int], h: torch.Tensor) -> dict[int, torch.Tensor]:
    """``mean_t |X^{(s)}_t H|`` per channel for each original index ``s`` in ``wanted`` (fp32 products,
    fp64 sums over non-pad tokens); ``X^{(s)}`` is layer s's input, ``X^{(N)}`` the last layer's output."""
    last = len(reference.layers) - 1
    masks = [token_mask(reference, batch) for batch in reference.batches]
    sums: dict[int, torch.Tensor] = {}
    h32 = h.float().to(reference.device)

    def take(index: int, hidden: Activations) -> None:
        total = torch.zeros(h.shape[0], dtype=torch.float64)
        for x, mask in zip(hidden.on(reference.device), masks):
            rotated = x.float() @ h32
            total += rotated[mask.to(rotated.device)].abs().double().sum(0).cpu()
        sums[index] = total / sum(int(m.sum()) for m in masks)

    def visit(index: int, inputs, outputs) -> None:
        if index in wanted:
            take(index, inputs)
        if index == last and last + 1 in wanted:
            take(last + 1, outputs)

    reference.layer_pass(visit, "LinearPatch reference activations")
    return sums


@torch.no_grad()
def contiguous_scores(session: ModifierSession, n: int) -> dict[int, float]:
    """``E_i cos(X_i^{(ℓ)}, X_i^{(ℓ+n)})`` for every ℓ (Eq. 2, LLM-Streamline): each sample's L×C inputs
    flattened (Frobenius cosine, fp64, pad rows zeroed), averaged over calibration samples."""
    masks = [token_mask(session, batch) for batch in session.batches]

    def keep(_index: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        return [(x.double() * m[..., None].to(x.device)).flatten(1) for x, m in zip(hidden, masks)]

    def score(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
        return float(torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=1)
                                for a, b in zip(first, second)]).mean())

    return span_scores(session, n, keep, score, "LinearPatch contiguous selection")


def distil(session: ModifierSession, patches: list[Patch], tune: "Tune") -> list[float]:
    """``min_P KL(z(o_t^K) ‖ z(o_s^K))`` (Eq. 9): teacher = original model, top-K of its logits, student
    logits gathered at the same indices; AdamW on the patches only, one step per calibration batch."""
    teacher, student = session.reference.model, session.model
    params = [torch.nn.Parameter(p.matrix.to(session.device)) for p in patches]
    for patch, param in zip(patches, params):
        patch.matrix = param
    flags = [p.requires_grad for p in student.parameters()]
    student.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=tune.lr, weight_decay=tune.weight_decay)
    losses = []
    try:
        with session.placed(teacher, student):
            for _ in range(tune.epochs):
                session.passes.count()  # teacher and student over every calibration batch
                for batch in session.progress.track(session.batches, "LinearPatch distillation"):
                    ids, mask = batch.to(session.device), token_mask(session, batch).to(session.device)
                    with torch.no_grad():
                        target = teacher(input_ids=ids, use_cache=False).logits
                    loss = top_k_kl(student(input_ids=ids, use_cache=False).logits, target, mask, tune.top_k, "top_k")
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    losses.append(float(loss.detach()))
    finally:
        for param, flag in zip(student.parameters(), flags):
            param.requires_grad_(flag)
        for patch in patches:
            patch.matrix = patch.matrix.detach().cpu()
    return losses


class Tune(BaseModel):
    """Offline distillation of the patches (LinearPatch §3.4; the paper: AdamW, lr 1e-4, one epoch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    top_k: int = Field(50, ge=1, description="teacher logits kept per token (K)")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    epochs: int = Field(1, ge=1, description="passes over the calibration windows")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (0: P is not pulled to zero)")


@register
class LinearPatch(Modifier):
    """Insert ``P = H diag(d) Hᵀ`` at every interface where layers were removed or merged (not stock).

    ``d_k = mean|(X^{(end)} H)_k| / mean|(X^{(start)} H)_k|`` over calibration tokens of the original model
    (``interfaces`` defines start/end), ``H`` an orthonormal Hadamard matrix (``recipe_engine.numerics.hadamard``).
    ``select: contiguous`` first removes the ``n`` contiguous layers whose input and the input ``n`` layers
    later are most similar (LLM-Streamline). Must come after every step that removes or merges layers.
    """

    calibration_passes = 1
    needs = ("original model's inputs at both sides of each interface, Hadamard-rotated",)
    needs_reference = True
    stock_output = False
    changes_weights = False  # adds a separate patch; the linears keep their (quantized) weights
    example = ("ShortGPT<n:1>", "LinearPatch")

    select: Literal["contiguous"] | None = Field(None, description="remove n contiguous layers first (Eq. 2)")
    n: LayerBudget | None = budget_field(None, "layers to remove with select: contiguous")
    merged_as: Literal["base", "span"] = Field("base", description="what a merged layer's output stands for")
    seed: int = Field(0, description="seed of the random orthogonal H when no Hadamard matrix is known")
    tune: Tune | None = Field(None, description="distil P with KL on the teacher's top-K logits")

    def passes(self, shape) -> int:
        return 1 + (self.select is not None) + (self.tune.epochs if self.tune else 0)

    def check(self, shape) -> None:
        if shape.pinned:
            raise self.fail(f"the layers are already patched by {shape.pinned}; LinearPatch applies once, "
                            f"after the last step that removes or merges layers")
        if self.select is None:
            if self.n is not None:
                raise self.fail("n applies only with select: contiguous", field="n")
            if not interfaces([s.origin for s in shape.layers], shape.original_layers, self.merged_as):
                raise self.fail("no layers were removed or merged before LinearPatch: put a depth-reducing step "
                                "(ShortGPT, LaCo, SLEB, ...) before it, or use select: contiguous with n",
                                field="select")
        else:
            if self.n is None or self.n >= shape.num_layers:
                raise self.fail(f"select: contiguous needs n between 1 and {shape.num_layers - 1} "
                                f"(got {self.n})", field="n")
            require_uniform(self, shape)
            drop_symbolic(shape, self.n)
        shape.pinned = self.step_name()

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        report: dict[str, Any] = {}
        if self.select is not None:
            scores = contiguous_scores(session, self.n)
            start = max(scores, key=lambda i: (scores[i], -i))
            report.update(similarity=scores, removed=[list(o) for o in
                                                      remove_layers(session, list(range(start, start + self.n)))])
        reference = session.reference
        found = interfaces(session.layer_origin, len(reference.layers), self.merged_as)
        if not found:
            raise self.fail("no layers were removed or merged before LinearPatch (nothing to patch)")
        h, construction = rotation(session.model.config.hidden_size, self.seed)
        means = rotated_magnitudes(reference, {s for _, a, b in found for s in (a, b)}, h)
        patches = []
        for position, start, end in found:
            d = means[end] / means[start]
            if not bool(torch.isfinite(d).all()):
                raise self.fail(f"channel scales at the interface {start}→{end} are not finite")
            patches.append(install(session.model, session.adapter, position, ((h * d) @ h.T).float()))
        if self.tune is not None:
            report["distillation_loss"] = distil(session, patches, self.tune)
        session.outputs.add_extra(self.step_name(), {"type": EXTRA_TYPE, "version": EXTRA_VERSION, "layers":
                                             len(session.layers), "positions": [p for p, _, _ in found]},
                          {f"P.{i}": patch.matrix for i, patch in enumerate(patches)})
        report.update(rotation=construction, layers=len(session.layers),
                      interfaces=[{"position": p, "start": a, "end": b} for p, a, b in found])
        return report

    @classmethod
    def restore_extra(cls, model, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        adapter = extra_adapter(model, config, cls.step_name(), (EXTRA_TYPE, EXTRA_VERSION))
        for i, position in enumerate(config["positions"]):
            install(model, adapter, position, tensors[f"P.{i}"])
