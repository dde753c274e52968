"""Helpers shared by the depth-pruning modifiers (ShortGPT, LaCo, SLEB, LinearPatch, ReplaceMe); not a modifier.
Removing layers is the session's (``remove_layers`` in ``recipe_engine.api``)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from recipe_engine.api import ModelShape, ModifierSession, RecipeError, adapter_for


def token_mask(session: ModifierSession, batch: torch.Tensor) -> torch.Tensor:
    """True for tokens that count in statistics: all of them, except the tokenizer's pad token if it has one."""
    pad = getattr(session.tokenizer, "pad_token_id", None)
    return batch != pad if pad is not None else torch.ones_like(batch, dtype=torch.bool)


def require_uniform(step, shape: ModelShape) -> None:
    """Fail unless every layer has the same widths: which layers a data-driven step removes is only known
    at run time, so the symbolic shape can follow only a count when the layers are interchangeable."""
    widths = {(layer.num_heads, layer.num_kv_heads, layer.intermediate_size) for layer in shape.layers}
    if len(widths) > 1:
        raise step.fail("needs layers of equal widths at this step (an earlier step left layers of "
                        f"different widths: {sorted(widths)}); place it before that step")


def check_search_window(step, calibration) -> None:
    """A loss search scored on the first ``search_samples`` windows × ``search_length`` tokens (SLEB,
    FlattenAdjacent's ``selection: nll``) must fit inside the calibration."""
    if step.search_samples is not None and step.search_samples > calibration.samples:
        raise step.fail(f"search_samples={step.search_samples} exceeds calibration.samples="
                        f"{calibration.samples}", field="search_samples")
    if step.search_length is not None and step.search_length > calibration.seq_len:
        raise step.fail(f"search_length={step.search_length} exceeds calibration.seq_len="
                        f"{calibration.seq_len}", field="search_length")


def drop_symbolic(shape: ModelShape, count: int) -> None:
    """Symbolic removal of ``count`` layers (which ones is data-dependent; the shape drops the last)."""
    shape.layers = shape.layers[: shape.num_layers - count]


@torch.no_grad()
def span_scores(session: ModifierSession, n: int, keep: Callable[[int, list[torch.Tensor]], Any],
                score: Callable[[Any, Any], float], description: str) -> dict[int, float]:
    """``score(keep(ℓ, X_ℓ), keep(ℓ + n, X_{ℓ+n}))`` for every start ``ℓ = 0 … L − n`` of the current layers, in
    one calibration pass: ``X_i`` is layer i's input (one tensor per calibration batch), ``X_L`` the last layer's
    output (before the final norm). At most ``n + 1`` kept states are held at once."""
    last = len(session.layers) - 1
    kept: dict[int, Any] = {}
    scores: dict[int, float] = {}

    def take(index: int, hidden: list[torch.Tensor]) -> None:
        kept[index] = keep(index, hidden)
        if index - n in kept:
            scores[index - n] = score(kept.pop(index - n), kept[index])

    def visit(index: int, inputs, outputs) -> None:
        take(index, inputs)
        if index == last:
            take(last + 1, outputs)

    session.layer_pass(visit, description)
    return scores


def extra_adapter(model, config: dict[str, Any], owner: str, kind: tuple[str, int]):
    """The adapter of ``model`` once a saved extra's ``(type, version)`` is ``kind`` and the layer count it was
    saved for is the model's (LinearPatch's patches and ReplaceMe's hooked map sit on layers by index)."""
    if (config.get("type"), config.get("version")) != kind:
        raise RecipeError(f"{owner} extra of unknown type/version {config.get('type')}/{config.get('version')}")
    adapter = adapter_for(model.config)
    if len(adapter.layers(model)) != config["layers"]:
        raise RecipeError(f"{owner}'s extra was saved for {config['layers']} layers, the model has "
                          f"{len(adapter.layers(model))}")
    return adapter
