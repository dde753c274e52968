"""LaCo: Layer Collapse by RDSC layer merge (Yang et al. 2024, §2 and Algorithm 1)."""
from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from pydantic import ConfigDict, Field

from recipe_engine.api import Activations, LayerBudget, Modifier, ModifierSession, RecipeError, budget_field, register

from ._depth import require_uniform, token_mask

MERGED = ("self_attn.", "mlp.")


@torch.no_grad()
def rdsc_merge(layers: list[torch.nn.Module], base: int, count: int) -> torch.nn.Module:
    """``θ*_l = θ_l + Σ_{k=1..K} (θ_{l+k} − θ_l)`` (LaCo Eq. 1) as a new layer, in fp32.

    Every SAN and MLP weight and bias is merged; differences are taken against ``θ_l`` as it was before
    this merge (the paper; the released code updates ``θ_l`` in place and ends up with ``θ_{l+K}``).
    The norms stay those of layer ``l`` (the paper merges SAN and MLP).
    """
    merged = copy.deepcopy(layers[base])
    for name, param in merged.named_parameters():
        if not name.startswith(MERGED):
            continue
        theta = param.detach().float()
        total = theta.clone()
        for k in range(1, count + 1):
            other = layers[base + k].get_parameter(name)
            if other.shape != param.shape:
                raise RecipeError(f"cannot merge layer {base + k} into {base}: {name} is {tuple(other.shape)} "
                                  f"vs {tuple(param.shape)}", modifier="LaCo")
            total += other.detach().float() - theta
        param.copy_(total.to(param.dtype))
    return merged


class Similarity:
    """``Avg_Cos_Sim(M_tmp, M, D)``: mean over samples of the cosine between the final-norm hidden states
    (HF ``hidden_states[-1]``) of ``M_tmp`` and ``M``, each sample flattened to one vector (pad rows zeroed).

    ``M`` is the model as LaCo starts; its layer inputs are cached, since layers below the merge point are
    always ``M``'s (Algorithm 1 merges from the top down).
    """

    def __init__(self, session: ModifierSession, samples: int):
        self.sub = session.branch(session.calibration[:samples], copy=False)
        self.masks = [token_mask(session, batch) for batch in self.sub.batches]
        hidden = self.sub.capture_inputs()
        self.inputs = []
        for layer in self.sub.progress.track(list(self.sub.layers), "LaCo reference"):
            self.inputs.append(hidden)
            hidden = self._run(layer, hidden)
        self.reference = self._represent(hidden)

    def _run(self, layer, hidden):
        with self.sub.placed(layer):
            return self.sub.run_layer(layer, hidden)

    def _represent(self, hidden: Activations) -> list[torch.Tensor]:
        norm = self.sub.adapter.final_norm(self.sub.model)
        with self.sub.placed(norm):
            return [(norm(h).double() * m.to(self.sub.device)[..., None]).flatten(1).cpu()
                    for h, m in zip(hidden.on(self.sub.device), self.masks)]

    @torch.no_grad()
    def __call__(self, layers: list[torch.nn.Module], start: int) -> float:
        self.sub.passes.count()  # from the kept inputs of layer ``start`` to the final norm
        hidden = self.inputs[start]
        for layer in layers[start:]:
            hidden = self._run(layer, hidden)
        cosines = [torch.nn.functional.cosine_similarity(a, b, dim=1)
                   for a, b in zip(self._represent(hidden), self.reference)]
        return float(torch.cat(cosines).mean())


@register
class LaCo(Modifier):
    """Layer Collapse: merge the ``C−1`` layers after layer ``l`` into it (RDSC) while similarity stays > T.

    Parameters carry descriptive names; the paper's letters are aliases (``combine`` = C, ``lowest`` = L,
    ``top`` = H, ``interval`` = I, ``threshold`` = T).

    Algorithm 1 from the top down with 0-based layers: ``l`` starts at ``H − C`` and stops below ``L``;
    a merge of ``K = min(C−1, layers−1−l)`` layers is kept when the mean cosine between the pruned and the
    entry model's final hidden states on ``samples`` calibration windows exceeds ``T`` (then ``l −= I``,
    else ``l −= 1``). With ``target_layers``, ``T`` is found by bisection on [−1, 1]. Defaults: the paper's
    Llama-2-7B setting (C=4, L=1, I=2, T=0.65, 10 sentences). Stock checkpoint.
    """

    needs = ("final hidden states of the merged and the entry model on the few-shot samples",)
    example = ("LaCo<samples:2>",)   # the contract tests calibrate on 4 windows

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)  # the paper's letters as aliases

    combine: int = Field(4, ge=1, alias="C", description="C: layers combined per merge (the base and C−1 after it)")
    lowest: int = Field(1, ge=0, alias="L", description="L: lowest merge base layer (0-based)")
    top: int | None = Field(None, ge=1, alias="H", description="H: merging stays below this layer (0-based, "
                                                                "exclusive); null: all layers "
                                                                "(the paper's H = layer count)")
    interval: int = Field(2, ge=1, alias="I", description="I: minimum interval between two merge bases")
    threshold: float = Field(0.65, ge=-1, le=1, alias="T", description="T: similarity threshold (lower merges more)")
    target_layers: LayerBudget | None = budget_field(None, "search T for this many layers instead")
    search_steps: int = Field(10, ge=1, description="bisection steps of the T search (with target_layers)")
    samples: int = Field(10, ge=1, description="few-shot sentences D: the first N calibration windows")

    def passes(self, shape) -> tuple[int, int]:
        """The entry model's pass, then one (partial) pass per similarity evaluation: each merge base from
        ``H − C`` down to ``L`` is evaluated once per run, and a kept merge skips the next ``I − 1`` bases.
        The ``target_layers`` search runs Algorithm 1 up to ``search_steps`` times (repeats are cached)."""
        bases = (self.top if self.top is not None else shape.num_layers) - self.combine - self.lowest + 1
        fewest, most = (bases - 1) // self.interval + 1, bases
        return 1 + fewest, 1 + most * (self.search_steps if self.target_layers is not None else 1)

    def check_calibration(self, calibration) -> None:
        if self.samples > calibration.samples:
            raise self.fail(f"samples={self.samples} exceeds the {calibration.samples} calibration windows "
                            f"(D is the first N of them)", field="samples")

    def check(self, shape) -> None:
        if refusal := shape.moe_refusal(unpaired="their parameter differences cannot be added"):
            raise self.fail(refusal)
        top = self.top if self.top is not None else shape.num_layers
        if top > shape.num_layers:
            raise self.fail(f"H={self.top} exceeds the {shape.num_layers} layers at this step", field="top")
        if top - self.combine < self.lowest:
            raise self.fail(f"nothing to merge: H − C = {top - self.combine} is below L = {self.lowest}",
                            field="combine")
        if self.target_layers is not None and "threshold" in self.model_fields_set:
            raise self.fail("give T or target_layers, not both (T is searched for target_layers)", field="threshold")
        require_uniform(self, shape)
        layers = list(shape.layers)
        goal = self.target_layers if self.target_layers is not None else len(layers) - (self.combine - 1)
        base = top - self.combine
        while base >= self.lowest and len(layers) > goal:   # symbolic: accept every merge, from the top
            k = min(self.combine - 1, len(layers) - 1 - base, len(layers) - goal)
            span = layers[base: base + k + 1]
            layers[base: base + k + 1] = [replace(span[0], origin=tuple(i for s in span for i in s.origin))]
            base -= self.interval
        if self.target_layers is not None and len(layers) != self.target_layers:
            raise self.fail(f"target_layers={self.target_layers} is out of reach: with C={self.combine}, "
                            f"L={self.lowest}, H={top}, I={self.interval} at most {shape.num_layers - len(layers)} of "
                            f"{shape.num_layers} layers merge away", field="target_layers")
        shape.layers = layers

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        if self.samples > session.calibration.shape[0]:
            raise self.fail(f"samples={self.samples} exceeds the {session.calibration.shape[0]} calibration "
                            f"windows", field="samples")
        run = partial(self._collapse, session, similarity=Similarity(session, self.samples), memo={})
        tried = []
        if self.target_layers is None:
            result, threshold = run(self.threshold), self.threshold
        else:
            result, threshold, tried = self._search(run)
        layers, origin, inherit, merges = result
        session.set_layers(layers, origin, inherit)
        return {"threshold": threshold, "merges": merges, "layers": len(layers),
                "similarity_evaluations": len(run.keywords["memo"]), "search": tried}

    def _collapse(self, session: ModifierSession, threshold: float, similarity: Similarity, memo: dict):
        """One run of Algorithm 1; ``memo`` caches similarities by (merges so far, l) across runs."""
        layers, origin = list(session.layers), list(session.layer_origin)
        inherit, merges = list(range(len(layers))), []
        top = self.top if self.top is not None else len(layers)
        base = top - self.combine
        while base >= self.lowest:
            k = min(self.combine - 1, len(layers) - 1 - base)
            key = (tuple((m["base"], m["merged"]) for m in merges), base)
            merged = None
            if key not in memo:
                merged = rdsc_merge(layers, base, k)
                memo[key] = similarity(layers[:base] + [merged] + layers[base + k + 1:], base)
            if memo[key] > threshold:
                merged = merged if merged is not None else rdsc_merge(layers, base, k)
                merges.append({"base": base, "merged": k, "origin": [i for o in origin[base:base + k + 1]
                                                                     for i in o], "similarity": memo[key]})
                layers = layers[:base] + [merged] + layers[base + k + 1:]
                origin = origin[:base] + [tuple(merges[-1]["origin"])] + origin[base + k + 1:]
                inherit = inherit[:base + 1] + inherit[base + k + 1:]
                base -= self.interval
            else:
                base -= 1
        return layers, origin, inherit, merges

    def _search(self, run):
        """Bisection on T in [−1, 1]: fewer layers than the target → raise T, more → lower it."""
        low, high, tried = -1.0, 1.0, []
        for _ in range(self.search_steps):
            threshold = (low + high) / 2
            result = run(threshold)
            tried.append((threshold, result))
            count = len(result[0])
            if count == self.target_layers:
                break
            low, high = (threshold, high) if count < self.target_layers else (low, threshold)
        threshold, result = min(tried, key=lambda t: (abs(len(t[1][0]) - self.target_layers), -t[0]))
        return result, threshold, [{"T": t, "layers": len(r[0])} for t, r in tried]
