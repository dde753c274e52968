"""Helpers for the depth-pruning tests: a session over a tiny model and an independent plain-HF reference."""
from __future__ import annotations

import copy

import torch

from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.modifier_view import ModifierView
from recipe_engine.execution.session import Session


def make_session(model, tokens, batch_size: int = 2, tokenizer=None) -> ModifierView:
    """A CPU session (as a modifier sees it) whose reference model is a copy of ``model`` taken now."""
    snapshot = copy.deepcopy(model)
    config = CalibrationConfig(samples=tokens.shape[0], seq_len=tokens.shape[1], batch_size=batch_size)
    return Session(RunContext(tokenizer, adapter_for(model.config), config, torch.device("cpu")),
                   model, tokens, reference_loader=lambda: snapshot).view


def without_layers(model, remove: list[int]):
    """A deep copy of ``model`` with decoder layers ``remove`` deleted (plain torch, config fixed)."""
    pruned = copy.deepcopy(model)
    keep = [layer for i, layer in enumerate(pruned.model.layers) if i not in remove]
    pruned.model.layers = torch.nn.ModuleList(keep)
    pruned.config.num_hidden_layers = len(keep)
    if getattr(pruned.config, "layer_types", None) is not None:
        pruned.config.layer_types = pruned.config.layer_types[: len(keep)]
    for i, layer in enumerate(keep):
        layer.self_attn.layer_idx = i
    return pruned


def layer_io(model, tokens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every decoder layer's input and output hidden states from forward hooks on a plain forward."""
    inputs, outputs = [], []

    def record(_module, args, kwargs, out) -> None:
        inputs.append(args[0] if args else kwargs["hidden_states"])
        outputs.append(out[0] if isinstance(out, tuple) else out)

    handles = [layer.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return inputs, outputs
