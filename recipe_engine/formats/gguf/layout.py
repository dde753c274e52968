"""GGUF facts of the architectures: how llama.cpp names and computes each one (:data:`LAYOUTS`, by the adapter's
``model_type``), and the GGUF name of every tensor of a model (:func:`gguf_tensors`).

The writer reads only these; an architecture without a layout is not exported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...architectures.adapters import ArchitectureAdapter
from ...errors import RecipeError

#: GGUF tensor names of the roles every exported architecture shares (``gguf.TENSOR_NAMES``).
GGUF_MODEL_TENSORS = {"embeddings": "token_embd", "final_norm": "output_norm", "lm_head": "output"}
GGUF_LAYER_TENSORS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                      "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                      "attention_norm": "attn_norm", "mlp_norm": "ffn_norm",
                      "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}


#: GGUF tensor names of a mixture-of-experts layer (``gguf.TENSOR_NAMES``): the router, each expert tensor stacked
#: over the experts (``[experts, rows, columns]``, gate and up apart), and Qwen2-MoE's shared expert and its gate.
GGUF_EXPERT_TENSORS = {"router": "ffn_gate_inp", "gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps",
                       "down_exps": "ffn_down_exps", "shared_gate": "ffn_gate_inp_shexp",
                       "shared_gate_proj": "ffn_gate_shexp", "shared_up_proj": "ffn_up_shexp",
                       "shared_down_proj": "ffn_down_shexp"}
#: ``ArchitectureAdapter.moe_sizes`` → the ``GGUFWriter`` method that writes it (``{arch}.expert_count`` ...).
GGUF_MOE_KEYS = {"count": "add_expert_count", "used": "add_expert_used_count",
                 "width": "add_expert_feed_forward_length", "shared_width": "add_expert_shared_feed_forward_length"}

#: Config attributes of mixture-of-experts widths → the ``{arch}.*`` GGUF key that holds them (llama.cpp's names;
#: transformers' GGUF reader leaves them out, so a model read from GGUF gets them from here).
GGUF_MOE_WIDTHS = {"moe_intermediate_size": "expert_feed_forward_length",
                   "shared_expert_intermediate_size": "expert_shared_feed_forward_length"}


@dataclass(frozen=True)
class GGUFLayout:
    """What llama.cpp expects of one architecture in a GGUF file (read in llama.cpp's ``convert_hf_to_gguf.py``,
    ``gguf-py/gguf/constants.py`` and the architecture's graph in ``src/models/``; not copied).

    ``layer_tensors``: adapter role → tensor name in block ``blk.N`` (linears and norms of a decoder layer);
    ``model_tensors``: model-level role → tensor name. ``rope_adjacent_pairs``: the graph rotates adjacent
    pairs (``LLAMA_ROPE_TYPE_NORM``), so HF's rotate-half q/k rows are reordered; the others rotate halves
    (NEOX) like HF. ``sliding_window``: the graph computes per-layer sliding windows from
    ``attention.sliding_window`` and a per-layer ``attention.sliding_window_pattern`` (else a config with
    sliding layers is refused: the graph would attend fully). ``final_logit_softcapping``: the graph applies
    ``c·tanh(logits/c)``. ``activation``: the MLP activation the graph computes (``hidden_act`` /
    ``hidden_activation``). ``config_problem``: a further check of the config (None: fine), for facts only
    this architecture's graph has (a fixed query scale, square attention output)."""

    arch: str
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(GGUF_LAYER_TENSORS))
    model_tensors: dict[str, str] = field(default_factory=lambda: dict(GGUF_MODEL_TENSORS))
    rope_adjacent_pairs: bool = False
    sliding_window: bool = False
    final_logit_softcapping: bool = False
    activation: str = "silu"
    config_problem: Callable[[Any], str | None] | None = None


def gemma3_gguf_problem(config) -> str | None:
    """llama.cpp's gemma3 graph scales queries by ``1/sqrt(head_dim)`` — ``1/sqrt(hidden/heads)`` when the
    model has 62 layers (its 27B) — and reads no ``query_pre_attn_scalar``; attention logits are not soft-capped
    and attention is causal."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = (config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else head_dim)
    if config.query_pre_attn_scalar != expected:
        return (f"query_pre_attn_scalar {config.query_pre_attn_scalar} differs from the {expected} llama.cpp's "
                f"gemma3 graph scales queries by")
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping is not computed by llama.cpp's gemma3 graph"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not computed by llama.cpp's gemma3 graph"
    return None


def phi3_gguf_problem(config) -> str | None:
    """llama.cpp's phi3 graph sizes the attention output ``hidden × hidden``: heads · head_dim = hidden_size."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        return (f"{config.num_attention_heads} heads of {head_dim} do not fill hidden_size {config.hidden_size}, "
                f"which llama.cpp's phi3 graph requires")
    return None


def routing_problem(normalized: bool) -> Callable[[Any], str | None]:
    """The check of an MoE config whose llama.cpp graph renormalizes the top-k routing weights (``normalized``:
    qwen3moe, Mixtral's llama) or does not (qwen2moe): ``norm_topk_prob`` must agree (Mixtral has none: its
    softmax over the chosen experts is normalized)."""
    def problem(config) -> str | None:
        if bool(getattr(config, "norm_topk_prob", True)) != normalized:
            return (f"norm_topk_prob {config.norm_topk_prob} differs from llama.cpp's graph, which "
                    f"{'renormalizes' if normalized else 'does not renormalize'} the chosen experts' weights")
        return None
    return problem


#: ``model_type`` → how llama.cpp reads the architecture from a GGUF file (absent: GGUF export refuses it).
LAYOUTS = {
    "llama": GGUFLayout("llama", rope_adjacent_pairs=True),
    # llama.cpp has no mistral graph: Mistral without sliding windows is its llama graph
    "mistral": GGUFLayout("llama", rope_adjacent_pairs=True),
    "qwen2": GGUFLayout("qwen2"),
    "qwen3": GGUFLayout("qwen3"),
    "gemma3_text": GGUFLayout("gemma3", layer_tensors={**GGUF_LAYER_TENSORS, "mlp_output_norm": "post_ffw_norm",
                                                       "attention_output_norm": "post_attention_norm"},
                              sliding_window=True, final_logit_softcapping=True, activation="gelu_pytorch_tanh",
                              config_problem=gemma3_gguf_problem),
    # llama.cpp's phi3 keeps HF's fusions: attn_qkv (q, k, v rows) and ffn_up holding [gate; up]
    "phi3": GGUFLayout("phi3", layer_tensors={**GGUF_LAYER_TENSORS, "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"},
                       config_problem=phi3_gguf_problem),
    # llama.cpp: qwen2moe, qwen3moe, and Mixtral as llama with experts (ffn_*_exps, ffn_gate_inp)
    "qwen2_moe": GGUFLayout("qwen2moe", config_problem=routing_problem(False)),
    "qwen3_moe": GGUFLayout("qwen3moe", config_problem=routing_problem(True)),
    "mixtral": GGUFLayout("llama", rope_adjacent_pairs=True, config_problem=routing_problem(True)),
}


def gguf_tensors(adapter: ArchitectureAdapter, num_layers: int) -> dict[str, list[tuple[str, str]]]:
    """HF state-dict tensor name → ``[(GGUF tensor name, role)]``, for the ``.weight`` and ``.bias`` of every
    role of the model and of each of ``num_layers`` layers (role paths + its layout's names); an MoE layer's
    router, shared expert and expert tensors too (``GGUF_EXPERT_TENSORS``: the fused ``gate_up_proj`` gives
    two, roles ``gate_exps`` and ``up_exps``). An adapter without GGUF facts is one line."""
    if adapter.model_type not in LAYOUTS:
        raise RecipeError(f"{adapter.model_type} has no GGUF layout")
    layout = LAYOUTS[adapter.model_type]
    layers = adapter.model_paths["layers"]
    bases = {adapter.model_paths[role]: [(name, role)] for role, name in layout.model_tensors.items()}
    stacked: dict[str, list[tuple[str, str]]] = {}  # parameters of the experts module: no .weight suffix
    for index in range(num_layers):
        block = f"{layers}.{index}"
        for role, name in layout.layer_tensors.items():
            if role in adapter.linears or role in adapter.norms:
                bases[f"{block}.{adapter.path(role)}"] = [(f"blk.{index}.{name}", role)]
        for path, (roles, is_stack) in adapter.expert_paths().items():
            parts = [(f"blk.{index}.{GGUF_EXPERT_TENSORS[role]}", role) for role in roles]
            if is_stack:
                stacked[f"{block}.{path}"] = [(f"{name}.weight", role) for name, role in parts]
            else:
                bases[f"{block}.{path}"] = parts
    return {**{f"{hf}.{suffix}": [(f"{name}.{suffix}", role) for name, role in parts]
               for hf, parts in bases.items() for suffix in ("weight", "bias")}, **stacked}
