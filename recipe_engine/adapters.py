"""Architecture adapters: the one place that knows how HF decoder models are laid out.

Supported: Llama, Mistral, Qwen2 (q/k/v biases). All three share module names
(``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm``, ``lm_head``); the adapter also keeps the config consistent
after a change of layer count (``num_hidden_layers``, ``layer_types``, ``max_window_layers``, each
attention module's ``layer_idx``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .errors import RecipeError


@dataclass(frozen=True)
class ArchitectureAdapter:
    model_type: str
    qkv_bias: bool

    attention_inputs = ("q_proj", "k_proj", "v_proj")
    mlp_inputs = ("gate_proj", "up_proj")
    #: block → the linear whose result is the block's output (see ``recipe_engine.staged``)
    output_linears = {"self_attn": "o_proj", "mlp": "down_proj"}

    # -- navigation -------------------------------------------------------------------------
    @staticmethod
    def layers(model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    @staticmethod
    def attention(layer: nn.Module) -> nn.Module:
        return layer.self_attn

    @staticmethod
    def mlp(layer: nn.Module) -> nn.Module:
        return layer.mlp

    @staticmethod
    def attention_projections(layer: nn.Module) -> list[nn.Linear]:
        """q, k, v: the linears that read ``input_layernorm``."""
        attn = layer.self_attn
        return [attn.q_proj, attn.k_proj, attn.v_proj]

    @staticmethod
    def mlp_projections(layer: nn.Module) -> list[nn.Linear]:
        """gate, up: the linears that read ``post_attention_layernorm``."""
        return [layer.mlp.gate_proj, layer.mlp.up_proj]

    @staticmethod
    def linear_names() -> tuple[str, ...]:
        return ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

    @staticmethod
    def embeddings(model: nn.Module) -> nn.Module:
        return model.model.embed_tokens

    @staticmethod
    def final_norm(model: nn.Module) -> nn.Module:
        return model.model.norm

    @staticmethod
    def lm_head(model: nn.Module) -> nn.Linear:
        return model.lm_head

    @staticmethod
    def rotary(model: nn.Module) -> nn.Module:
        return model.model.rotary_emb

    # -- widths of one layer -----------------------------------------------------------------
    @staticmethod
    def layer_widths(layer: nn.Module, head_dim: int) -> tuple[int, int, int]:
        """(query heads, KV heads, intermediate size) read from the weight shapes."""
        attn = layer.self_attn
        return (attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim,
                layer.mlp.gate_proj.out_features)

    # -- structure edits -------------------------------------------------------------------
    def set_layers(self, model: nn.Module, layers: list[nn.Module], kept_origin: list[int]) -> None:
        """Install a new list of decoder layers and fix the config and layer indices.

        ``kept_origin[i]`` is the index (in the current model) whose per-layer config entries
        (``layer_types``) the new layer ``i`` inherits.
        """
        config = model.config
        old_types = getattr(config, "layer_types", None)
        model.model.layers = nn.ModuleList(layers)
        config.num_hidden_layers = len(layers)
        if old_types is not None:
            config.layer_types = [old_types[i] for i in kept_origin]
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = min(config.max_window_layers, len(layers))
        for index, layer in enumerate(layers):
            layer.self_attn.layer_idx = index
            if old_types is not None and hasattr(layer.self_attn, "layer_type"):
                layer.self_attn.layer_type = config.layer_types[index]

    def check_bias_layout(self, layer: nn.Module) -> None:
        attn = layer.self_attn
        has = attn.q_proj.bias is not None
        if has != self.qkv_bias:
            raise RecipeError(f"{self.model_type}: expected q/k/v bias={self.qkv_bias}, found {has}")


ADAPTERS = {
    "llama": ArchitectureAdapter("llama", qkv_bias=False),
    "mistral": ArchitectureAdapter("mistral", qkv_bias=False),
    "qwen2": ArchitectureAdapter("qwen2", qkv_bias=True),
}


def adapter_for(config) -> ArchitectureAdapter:
    """Adapter for ``config.model_type``; anything else is a one-line error."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise RecipeError(f"unsupported architecture '{model_type}'; supported: "
                          f"{', '.join(sorted(ADAPTERS))}")
    if getattr(config, "attention_bias", False) and model_type != "qwen2":
        raise RecipeError(f"unsupported {model_type} variant with attention_bias=true")
    if getattr(config, "mlp_bias", False):
        raise RecipeError(f"unsupported {model_type} variant with mlp_bias=true")
    return ADAPTERS[model_type]


@torch.no_grad()
def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
