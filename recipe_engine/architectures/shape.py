"""Symbolic model shape used to validate a recipe without loading weights.

Each modifier's ``check`` reads and updates a :class:`ModelShape` built from the model's config
(no weights, see ``recipe validate --model``), so structural mistakes (``n`` too large, head counts that
cannot be pruned, a non-uniform final model) are caught before anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .adapters import ADAPTERS

WidthPart = Literal["attention", "mlp"]
#: Bytes per value of each of a recipe's ``dtype``s (:attr:`ModelShape.dtype_bytes`).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: The linear roles of a decoder layer's attention and MLP (:meth:`ModelShape.linear_sizes`).
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

#: Which of (query heads, KV heads, intermediate size) each part compares with the config.
WIDTH_INDEX: dict[WidthPart | None, tuple[int, ...]] = {"attention": (0,), "mlp": (2,), None: (0, 1, 2)}


@dataclass(frozen=True)
class LayerShape:
    """Width of one decoder layer; ``origin`` lists the original layer indices it was built from."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    origin: tuple[int, ...]


@dataclass
class ModelShape:
    model_type: str
    hidden_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    layers: list[LayerShape] = field(default_factory=list)
    #: Vocabulary size and q/k/v bias flag (for memory estimates).
    vocab_size: int = 0
    qkv_bias: bool = False
    #: Decoder layers of the model the recipe starts from (``origin`` indexes into these).
    original_layers: int = 0
    #: Name of a step whose result is tied to the current layer list (e.g. a run-time patch registered on
    #: a layer index); a later step that changes the layers' ``origin`` is a validation error.
    pinned: str | None = None
    #: The step that quantized the weights (``Modifier.quantizes``); a later weight change is an error.
    quantized_by: str | None = None
    #: A step that chooses at run time between alternatives leaving different shapes (``BestOf`` under a
    #: budget); no step may follow it, as its shape is not known before the run.
    chosen_by: str | None = None
    #: Average stored bits per weight of the decoder's linears once a quantizing step has run (codes, scales and
    #: zero points as written); None: unquantized (the dtype's bits).
    linear_bits: float | None = None
    #: Whether the run streams its weights (memory estimates: streamed steps may spill to scratch files).
    streamed: bool = False
    #: Bytes per value of the run's weights and activations (the recipe's ``dtype``; memory estimates).
    dtype_bytes: int = 4
    #: Whether the steps' statistics and solves run on an accelerator (memory estimates: some steps batch
    #: more work per call there).
    on_device: bool = False
    #: Windows per calibration batch and tokens per window (memory estimates: a calibration NLL computes a
    #: batch's logits at once, ``recipe.modifier.calibration_nll_bytes``).
    calibration_batch: int = 4
    calibration_seq_len: int = 2048
    #: The result must be a stock checkpoint (the recipe exports it to a file format): a step that chooses between
    #: alternatives (``BestOf``) skips those whose output is not (``Modifier.output_is_stock``).
    stock_only: bool = False
    #: Experts per MoE layer (0: dense MLPs; ``intermediate_size`` is then one expert's width), and the
    #: width of a shared expert beside them (0: none).
    num_experts: int = 0
    shared_expert_size: int = 0
    #: What a step's ``check`` decided that the user should see at ``recipe validate`` without it being an
    #: error (e.g. an alternative the model refuses, to be skipped); one line each.
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        adapter = ADAPTERS.get(config.model_type)
        experts = adapter.experts if adapter is not None else None
        width = adapter.intermediate_size(config) if adapter is not None else config.intermediate_size
        layers = [LayerShape(heads, kv, width, (i,)) for i in range(config.num_hidden_layers)]
        return cls(config.model_type, config.hidden_size, head_dim, heads, kv,
                   width, bool(getattr(config, "tie_word_embeddings", False)), layers,
                   original_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
                   qkv_bias=_has_qkv_bias(config), num_experts=experts.num_experts(config) if experts else 0,
                   shared_expert_size=experts.shared_size(config) if experts else 0)

    def moe_refusal(self, *, channels: str | None = None, unpaired: str | None = None,
                    why: str = "") -> str | None:
        """The one-line reason a step that needs a dense MLP refuses this model, or None on a dense model:
        ``channels``: it cuts (the verb) one ``down_proj``'s channels; ``unpaired``: it combines two layers'
        MLPs (what would not hold); else ``why``, after the expert count."""
        if not self.num_experts:
            return None
        if channels is not None:
            why = f" (3-D expert tensors and a router): there is no one down_proj whose channels could be {channels}"
        elif unpaired is not None:
            why = (f": the experts of two layers have no natural pairing, so {unpaired} (use ShortGPT, SLEB, "
                   f"ReplaceMe or LinearPatch on this architecture)")
        return f"{self.model_type}'s MLP is a mixture of {self.num_experts} experts{why}"

    def token_mlp_width(self, width: int, routed: int) -> int:
        """The MLP width a token's activations span in a layer of intermediate size ``width``: ``width``, or on
        an MoE model that of up to ``routed`` experts and the shared expert's."""
        return width * min(self.num_experts, routed) + self.shared_expert_size if self.num_experts else width

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def oversized_layers(self, part: WidthPart | None = None) -> list[int]:
        """Layers wider than the config (e.g. merged by layer flattening and not yet pruned): in query
        heads (``part="attention"``), in intermediate size (``"mlp"``), or in either (``None``)."""
        picked = WIDTH_INDEX[part]
        standard = (self.num_heads, self.num_kv_heads, self.intermediate_size)
        return [i for i, layer in enumerate(self.layers)
                if [(layer.num_heads, layer.num_kv_heads, layer.intermediate_size)[k] for k in picked]
                != [standard[k] for k in picked]]

    def linear_sizes(self, layer: LayerShape) -> dict[str, tuple[int, int]]:
        """``(rows, columns)`` of one decoder layer's linears by role: q, k, v, o and the MLP's gate, up and down
        (on a mixture-of-experts layer, one expert's)."""
        h, query, kv, mlp = (self.hidden_size, layer.num_heads * self.head_dim, layer.num_kv_heads * self.head_dim,
                             layer.intermediate_size)
        return {"q_proj": (query, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, query),
                "gate_proj": (mlp, h), "up_proj": (mlp, h), "down_proj": (h, mlp)}

    def layer_tensors(self, layer: LayerShape) -> list[int]:
        """Elements of each tensor of one decoder layer of these widths: q, k, v, o (and q/k/v biases when
        present), attention sinks and the ``o_proj`` bias where present, the MLP's gate, up and down (an MoE
        layer: ``ExpertLayout.mlp_tensors``) and the layer's norms (the adapter's: per-head q/k norms, Gemma 3's
        four around attention and MLP; else two)."""
        h, d = self.hidden_size, self.head_dim
        adapter = ADAPTERS.get(self.model_type)
        sizes = self.linear_sizes(layer)
        tensors = [rows * columns for rows, columns in (sizes[role] for role in _ATTENTION)]
        if self.qkv_bias:
            tensors += [layer.num_heads * d, layer.num_kv_heads * d, layer.num_kv_heads * d]
        if adapter is not None:
            tensors += [layer.num_heads, h] if adapter.attention_sinks else []
        if adapter is not None and adapter.experts is not None and self.num_experts:
            tensors += adapter.experts.mlp_tensors(h, layer.intermediate_size, self.num_experts,
                                                   self.shared_expert_size)
        else:
            tensors += [rows * columns for rows, columns in (sizes[role] for role in _MLP)]
        if adapter is None:
            return tensors + [h, h]
        return tensors + [d if role in adapter.head_norms else h for role in adapter.norms]

    def layer_parameters(self, layer: LayerShape) -> int:
        """Parameters of one decoder layer of these widths (:meth:`layer_tensors`)."""
        return sum(self.layer_tensors(layer))

    def layer_linear_weights(self, layer: LayerShape) -> int:
        """Weights of one decoder layer's dense linears, q, k, v, o and the MLP's gate, up and down: those whose
        average stored bits :attr:`linear_bits` counts (an MoE layer: its attention's only)."""
        roles = _ATTENTION if self.num_experts else _ATTENTION + _MLP
        sizes = self.linear_sizes(layer)
        return sum(sizes[role][0] * sizes[role][1] for role in roles)

    def layer_weight_bytes(self, layer: LayerShape) -> float:
        """Bytes of one decoder layer's weights as stored: its dense linears at :attr:`linear_bits` per weight
        (codes, scales and zero points), everything else (norms, biases, experts) in the run's dtype."""
        linear = self.layer_linear_weights(layer)
        bits = self.linear_bits if self.linear_bits is not None else 8.0 * self.dtype_bytes
        return (self.layer_parameters(layer) - linear) * self.dtype_bytes + linear * bits / 8


def _has_qkv_bias(config) -> bool:
    """q/k/v biases: the architecture's own (its adapter: Qwen2) or the config's ``attention_bias``."""
    adapter = ADAPTERS.get(config.model_type)
    return bool(adapter is not None and adapter.qkv_bias) or bool(getattr(config, "attention_bias", False))
