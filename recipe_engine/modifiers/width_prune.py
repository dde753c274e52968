"""WidthPrune: training-free width pruning of every decoder layer to one narrower width (FlattenGPT §3.2's
channel pruning, Algorithms 2–3 and Theorem 3.1, applied to the unmerged model as in its Appendix D.4)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, PrivateAttr, field_validator

from recipe_engine.api import (ADAPTERS, InputCovariance, LayerModifier, LayerShape, ModelShape, ModifierSession,
                               Statistic, best_groups_by_error, eq12_group_scores, group_channels, mean_eigenvalue,
                               obs_kept_columns, percentage_field, reconstruction_error, refit_down_proj, register,
                               ridge_compensation, ridge_leverage_scores, set_linear_weight, share_of, submatrix,
                               target_moments)


class InputMean(Statistic):
    """``Σ_t x_t`` (fp64) of a module's input and the token count: the centre of FLAP's fluctuation."""

    sums = ("total", "count")

    def __init__(self, module: str):
        super().__init__(module)
        self.total: torch.Tensor | None = None
        self.count = 0

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        x = inputs.reshape(-1, inputs.shape[-1]).to(torch.float64)
        self.total = x.sum(0) if self.total is None else self.total + x.sum(0)
        self.count += x.shape[0]


def fluctuation_scores(gram: torch.Tensor, mean: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """FLAP's channel score ``Var(σ_j) · ‖W_down[:, j]‖²`` (An et al., AAAI 2024, Eq. 5; the population
    variance ``G_jj / N − μ_j²``, the ranking of the paper's ``1 / (N − 1)``) from the input Gram ``G`` of
    ``N`` tokens (``G / N`` given) and the mean ``μ``."""
    variance = (torch.diagonal(gram) - mean ** 2).clamp(min=0)
    return variance * down.detach().double().pow(2).sum(0)


@register
class WidthPrune(LayerModifier):
    """Cut every layer to one narrower width: MLP channels by ridge leverage, optionally whole KV groups.

    MLP (NystromMLP's machinery): with ``G = Σ σᵀσ`` the fp64 Gram of the ``down_proj`` input ``σ`` and
    ``λ = lambda_scale × trace(G)/n``, the ``intermediate_size`` (or ``round(mlp_keep × n)``) channels of
    highest ridge leverage ``s_i = [G (G + λI)⁻¹]_ii`` are kept (Algorithm 3); gate/up keep those rows and
    ``down_proj``'s kept columns become ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` (Theorem 3.1). Attention
    (HeadPrune's, with ``kv_groups_keep``): whole KV groups chosen by the compensated ``o_proj``
    reconstruction error (or Eq. 12), ``o_proj`` refitted the same way (``head_lambda_scale``), then the
    MLP statistics are recollected. Last, ``down_proj`` is refitted towards ``target`` (``original``: the
    original model's hidden state; ``layer``: the original layer on this layer's inputs), ``W'' = W' +
    ((G_KK + λ_t I)⁻¹ Σ σ_K eᵀ)ᵀ`` with ``e = y* − layer(x)``. Every layer gets the same widths and the
    config follows (``intermediate_size``, head counts), so the output is a stock checkpoint. Deviations:
    one width in all layers (the paper's D.4 takes ModeGPT's per-layer sparsities), and the target refit.

    ``criterion: fluctuation`` keeps FLAP's channels instead (An et al., AAAI 2024: ``Var(σ_j) · ‖W_:,j‖²``,
    :func:`fluctuation_scores`), as the published training-free width method to compare with; deviations from
    FLAP: one width in all layers (FLAP's adaptive structure varies it), and the same ridge compensation and
    target refit instead of FLAP's bias (these architectures' down_proj has none, and a stock checkpoint
    cannot add one).

    ``criterion: obs`` keeps the channels greedy Optimal Brain Surgeon elimination leaves (ZipLM; SlimGPT's
    structured OBS, Ling et al. NeurIPS 2024, :func:`obs_kept_columns`): each drop costs ``‖W_:,j‖² / [H⁻¹]_jj``
    with ``H = G + λI`` and the survivors compensated as it goes, so the choice weighs what ``down_proj`` reads
    from a channel and what the others can take over; the kept weights are the same Theorem 3.1 refit.
    Deviations from SlimGPT: one width in all layers (its incremental ratio varies it), ``obs_block`` channels
    per step instead of its dynamic group size, and the same target refit.
    """

    mlp_keep: float = Field(0.75, gt=0, le=1, description="fraction of the MLP channels kept in every layer "
                                                          "(rounded half up; 1 keeps them all)")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width kept in every layer, below the "
                                                                  "current one (instead of mlp_keep)")
    parameters: str | None = Field(None, description=(
        "instead of mlp_keep / intermediate_size: keep at most this share of the decoder layers' parameters "
        "(80%: a 20 % depth cut's size); the MLP width is the largest multiple of `multiple_of` that fits, after "
        "kv_groups_keep"))
    multiple_of: int = Field(32, ge=1, description="parameters: the MLP width is a multiple of this")
    kv_groups_keep: int | None = Field(None, ge=1, description="KV groups (a KV head and its query heads) kept "
                                                               "in every layer (None: keep all)")
    criterion: Literal["leverage", "fluctuation", "obs"] = Field("leverage", description=(
        "MLP channels kept: leverage (ridge leverage of the down_proj input's Gram, FlattenGPT Algorithm 3), "
        "fluctuation (FLAP's variance × squared down_proj column norm) or obs (greedy Optimal Brain Surgeon "
        "elimination on down_proj, SlimGPT's structured OBS); the same ridge compensation"))
    obs_block: int = Field(16, ge=1, description="criterion obs: channels dropped per elimination step (1: exact "
                                                 "greedy)")
    lambda_scale: float = Field(10.0, gt=0, description="leverage and Theorem 3.1 ridge λ as a multiple of the "
                                                        "mean eigenvalue")
    head_criterion: Literal["reconstruction", "eq12"] = Field(
        "reconstruction", description="KV group choice: o_proj reconstruction error or the paper's Eq. 12")
    head_lambda_scale: float = Field(0.01, gt=0, description="o_proj ridge λ as a multiple of the mean eigenvalue")
    exhaustive_limit: int = Field(1024, ge=1, description="score all KV group subsets up to this many, else greedy")
    target: Literal["auto", "original", "layer", "none"] = Field(
        "auto", description="down_proj refitted towards the original model's hidden state, the original layer "
                            "on this layer's inputs, or not (auto: original, none where the MLP output is normalized)")
    target_scale: float = Field(0.1, gt=0, description="ridge λ multiple of the refit towards target")

    example = ("WidthPrune<kv_groups_keep:1>",)  # heads and MLP channels both
    needs = ("o_proj input Gram (fp64, with kv_groups_keep)", "down_proj input Gram (fp64)",
             "target original/layer: the original layers' outputs (original weights on CPU)")

    @property
    def modifies(self) -> tuple[str, ...]:
        return ("self_attn", "mlp") if self.kv_groups_keep is not None else ("mlp",)

    @property
    def needs_reference(self) -> bool:  # auto may resolve to none (Gemma 3): a reference is then unused
        return self.target != "none"

    #: ``parameters``: the width ``check`` resolved on the shape this step receives.
    _resolved_width: int | None = PrivateAttr(None)

    @field_validator("parameters", mode="before")
    @classmethod
    def _percentage(cls, value: Any) -> str | None:
        return value if value is None else percentage_field(
            value, what="a percentage of the decoder layers' parameters", example="80%")

    def mlp_width(self, current: int) -> int:
        """The MLP width every layer keeps, given the config's ``current`` one."""
        if self.parameters is not None:
            if self._resolved_width is None:
                raise RuntimeError("WidthPrune<parameters> runs after its check resolved the width")
            return self._resolved_width
        return self.intermediate_size if self.intermediate_size is not None else int(self.mlp_keep * current + 0.5)

    def width_for_parameters(self, shape: ModelShape, heads: int | None, kv: int | None) -> int:
        """The largest multiple of ``multiple_of`` whose layers (with ``heads``/``kv`` when given) hold at most
        ``parameters`` of the decoder layers' parameters of ``shape``: ``Σ_l P(heads, kv, w) ≤ p · Σ_l P_l``."""
        before = sum(shape.layer_parameters(layer) for layer in shape.layers)
        limit = share_of(self.parameters, before)

        def total(width: int) -> int:
            return sum(shape.layer_parameters(LayerShape(heads or layer.num_heads, kv or layer.num_kv_heads, width,
                                                         layer.origin)) for layer in shape.layers)
        width = min(layer.intermediate_size for layer in shape.layers) // self.multiple_of * self.multiple_of
        while width > 0 and total(width) > limit:
            width -= self.multiple_of
        if width < 1:
            raise self.fail(f"no MLP width fits {self.parameters} of the decoder layers' parameters "
                            f"({before:,}) in multiples of {self.multiple_of}", field="parameters")
        return width

    def refit_target(self, model_type: str) -> str:
        """``target`` resolved for the architecture: ``auto`` is ``none`` where a norm sits on the MLP output."""
        normalized = ADAPTERS[model_type].norms.get("mlp_output_norm") if model_type in ADAPTERS else None
        return ("none" if normalized else "original") if self.target == "auto" else self.target

    def passes(self, shape: ModelShape) -> int | tuple[int, int]:
        """The shared pass, plus the original model walked in lockstep with ``target: original``."""
        return (1, 2) if self.refit_target(shape.model_type) == "original" else 1

    def check_calibration(self, calibration) -> None:
        if self.target in ("auto", "original") and calibration.propagate == "original":
            raise self.fail("target: original (auto's choice where the MLP output is not normalized) needs "
                            "calibration.propagate: compressed (it absorbs the drift of the pruned layers before "
                            "it); use target: layer or none with propagate: original", field="target")

    def check(self, shape: ModelShape) -> None:
        if refusal := shape.moe_refusal(channels="cut"):
            raise self.fail(refusal)
        norm = ADAPTERS[shape.model_type].norms.get("mlp_output_norm") if shape.model_type in ADAPTERS else None
        if norm and self.target in ("original", "layer"):
            raise self.fail(f"{shape.model_type} normalizes the MLP output ({norm}) before the residual add, so "
                            f"down_proj's refit towards a hidden state is no least-squares fit; use target: none "
                            f"(or auto)", field="target")
        if self.parameters is not None:
            if self.intermediate_size is not None or self.mlp_keep != type(self).model_fields["mlp_keep"].default:
                raise self.fail("give parameters, or mlp_keep or intermediate_size, not both", field="parameters")
            self._resolved_width = self.width_for_parameters(
                shape, *(self._head_counts(shape) if self.kv_groups_keep is not None else (None, None)))
        current, width = shape.intermediate_size, self.mlp_width(shape.intermediate_size)
        if self.intermediate_size is not None:
            if self.mlp_keep != type(self).model_fields["mlp_keep"].default:
                raise self.fail("give mlp_keep or intermediate_size, not both", field="intermediate_size")
            if width >= current:
                raise self.fail(f"intermediate_size={width} is not below the current width {current}",
                                field="intermediate_size")
        if width < 1:
            raise self.fail(f"mlp_keep={self.mlp_keep} keeps no channel of {current}", field="mlp_keep")
        heads = kv = None
        if self.kv_groups_keep is not None:
            heads, kv = self._head_counts(shape)
        for index, layer in enumerate(shape.layers):
            if layer.intermediate_size < width:
                raise self.fail(f"layer {index} has intermediate size {layer.intermediate_size}, below {width}",
                                field="intermediate_size" if self.intermediate_size is not None else "mlp_keep")
            shape.layers[index] = LayerShape(heads or layer.num_heads, kv or layer.num_kv_heads, width, layer.origin)
        shape.intermediate_size = width
        if heads is not None:
            shape.num_heads, shape.num_kv_heads = heads, kv

    def _head_counts(self, shape: ModelShape) -> tuple[int, int]:
        """(query heads, KV heads) after keeping ``kv_groups_keep`` groups; refuses what cannot be pruned."""
        heads, kv, keep = shape.num_heads, shape.num_kv_heads, self.kv_groups_keep
        if heads % kv:
            raise self.fail(f"{heads} query heads do not divide into {kv} KV groups", field="kv_groups_keep")
        if keep >= kv:
            raise self.fail(f"kv_groups_keep={keep} is not below the current {kv} KV groups", field="kv_groups_keep")
        ratio = heads // kv
        for index, layer in enumerate(shape.layers):
            if layer.num_heads != ratio * layer.num_kv_heads:
                raise self.fail(f"layer {index} has {layer.num_heads} heads / {layer.num_kv_heads} KV heads, not "
                                f"KV groups of {ratio} query heads", field="kv_groups_keep")
        return keep * ratio, keep

    def target_layers(self, session: ModifierSession) -> list[int]:
        return list(range(len(session.layers)))

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """fp64: the widest ``o_proj`` input Gram and two solve buffers (with ``kv_groups_keep``), or at the
        Theorem 3.1 refit the widest ``down_proj`` input Gram, ``G_KK`` factored in place, two ``n × 512``
        panels and the solved right-hand side (as NystromMLP's); with ``criterion: obs`` the Gram, the factor of
        its ridge and the inverse (:func:`obs_kept_columns`) and ``down_proj`` in fp64."""
        n = max(layer.intermediate_size for layer in shape.layers)
        k, hidden = self.mlp_width(shape.intermediate_size), shape.hidden_size
        mlp = 8 * max(n * n + k * k + 2 * n * 512 + k * hidden, 2 * k * k + 2 * k * hidden,
                      3 * n * n + n * hidden if self.criterion == "obs" else 0)
        attention = max(layer.num_heads for layer in shape.layers) * shape.head_dim
        return max(mlp, 3 * attention * attention * 8 if self.kv_groups_keep is not None else 0)

    def statistics(self, session: ModifierSession, layer_index: int) -> list[InputCovariance]:
        if self.kv_groups_keep is not None:  # the MLP's Gram follows once the attention is pruned
            return [InputCovariance(session.adapter.path("o_proj"))]
        return self._mlp_statistics(session)

    def _mlp_statistics(self, session: ModifierSession) -> list[Statistic]:
        """The down_proj input's Gram (and with ``criterion: fluctuation`` its mean)."""
        path = session.adapter.path("down_proj")
        gram = [InputCovariance(path, products=torch.float32)]
        return gram + [InputMean(path)] if self.criterion == "fluctuation" else gram

    @torch.no_grad()
    def compress_layer(self, session: ModifierSession, layer_index: int, stats: dict[str, Any]) -> dict[str, Any]:
        adapter, layer = session.adapter, session.layers[layer_index]
        wanted, entry = self.statistics(session, layer_index), {}
        statistic, mean = stats[wanted[0].key], stats[wanted[1].key] if len(wanted) > 1 else None
        width = self.mlp_width(session.model.config.intermediate_size)
        target = self.refit_target(session.model.config.model_type)
        if self.kv_groups_keep is not None:
            entry.update(self._prune_heads(session, layer, statistic))
            if width == adapter.linear(layer, "down_proj").in_features and target == "none":
                return entry  # the MLP keeps every channel and is not refitted
            recollected = self._mlp_statistics(session)
            session.run_layer(layer, session.current_layer.inputs, hooks=recollected)
            statistic, mean = recollected[0], recollected[1] if len(recollected) > 1 else None
        gram, down = statistic.gram, adapter.linear(layer, "down_proj")
        keep = torch.arange(gram.shape[0], device=gram.device)
        if width < gram.shape[0]:  # else every channel is kept (mlp_keep rounds to all): nothing to compensate
            ridge = self.lambda_scale * mean_eigenvalue(gram)
            if self.criterion == "obs":
                keep = obs_kept_columns(down.weight, gram, width, ridge, self.obs_block)
            else:
                if mean is not None:
                    score = fluctuation_scores(gram / statistic.count, mean.total / mean.count, down.weight)
                    mean.release()
                else:
                    score = ridge_leverage_scores(gram, ridge)
                keep = score.topk(width).indices.sort().values
                entry.update({f"{self.criterion}_kept": float(score[keep].sum()),
                              f"{self.criterion}_total": float(score.sum())})
            new_down = ridge_compensation(down.weight, gram, keep, ridge)
            adapter.keep_rows(layer, {"gate_proj": keep, "up_proj": keep}, session.shape.head_dim)
            set_linear_weight(down, new_down, down.bias)
        entry.update(channels_before=gram.shape[0], channels_kept=len(keep))
        kept_gram = submatrix(gram, keep, keep) if target != "none" else None
        del gram
        statistic.release()  # the target refit needs only G_KK
        if kept_gram is not None:
            targets = (session.original_outputs(layer_index) if target == "original"
                       else session.original_outputs(layer_index, session.current_layer.inputs))
            with session.placed(layer):
                moments = target_moments(session, layer, targets, folds=1, grams=False)
            down = adapter.linear(layer, "down_proj")
            refit, errors = refit_down_proj(down, kept_gram.to(session.device), moments, self.target_scale, None)
            set_linear_weight(down, refit, down.bias)
            entry.update(errors)
        return entry

    def _prune_heads(self, session: ModifierSession, layer: torch.nn.Module, statistic) -> dict[str, Any]:
        """Keep ``kv_groups_keep`` KV groups of ``layer`` and refit ``o_proj`` over them (HeadPrune's choice
        and Theorem 3.1 refit, towards the unpruned ``o_proj`` output)."""
        cfg, head_dim, adapter = session.model.config, session.shape.head_dim, session.adapter
        o_proj = adapter.linear(layer, "o_proj")
        per_group = cfg.num_attention_heads // cfg.num_key_value_heads
        groups = adapter.layer_widths(layer, head_dim)[1]
        o_weight, gram = o_proj.weight.detach(), statistic.gram
        ridge = self.head_lambda_scale * mean_eigenvalue(gram)
        if self.head_criterion == "eq12":
            scores = eq12_group_scores(o_weight, gram, statistic.count, groups, per_group, head_dim)
            kept = sorted(scores.topk(self.kv_groups_keep).indices.tolist())
        else:
            kept = best_groups_by_error(o_weight, gram, groups, self.kv_groups_keep, per_group, head_dim, ridge,
                                        self.exhaustive_limit, session.map)
        query, kv = group_channels(kept, per_group, head_dim)
        error = reconstruction_error(o_weight, gram, query, ridge)
        set_linear_weight(o_proj, ridge_compensation(o_weight, gram, query, ridge), o_proj.bias)
        adapter.keep_rows(layer, {"q_proj": query, "k_proj": kv, "v_proj": kv}, head_dim)
        total = float(torch.einsum("oi,ij,oj->", o_weight.double(), gram, o_weight.double()))
        statistic.release()
        return {"kv_groups_kept": kept, "kv_groups_before": groups, "relative_error": error / total}

    def finish(self, session: ModifierSession) -> dict[str, Any]:
        """The config follows the layers (``intermediate_size``, head counts; ``head_dim`` written out when the
        config derived it from the head count), and modules reading widths from it are synced (Phi-3)."""
        config, head_dim = session.model.config, session.shape.head_dim
        config.intermediate_size = self.mlp_width(config.intermediate_size)
        if self.kv_groups_keep is not None:
            ratio = config.num_attention_heads // config.num_key_value_heads
            if getattr(config, "head_dim", None) is None:
                config.head_dim = head_dim
            config.num_attention_heads, config.num_key_value_heads = self.kv_groups_keep * ratio, self.kv_groups_keep
        for layer in session.layers:
            session.adapter.sync_widths(layer, head_dim)
        return {"intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads}
