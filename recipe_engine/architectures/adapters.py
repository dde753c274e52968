"""Architecture adapters: declarative role maps, the one place that knows how HF decoder models are laid out.

An adapter maps *roles* to module paths (model level: embeddings, layers, final norm, lm_head, rotary; per
layer: the attention and MLP blocks, the linears ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``
or the fused ``qkv_proj`` / ``gate_up_proj``, and the norms) and records capability facts: RMSNorm gain
parameterisation (Gemma's ``(1 + w)``: ``norm_offset = 1``), scaled embeddings, per-head q/k norms, norms on
a block's output (Gemma's sandwich norms), per-layer attention types (``config.layer_types``: sliding /
global). Statistics, modifiers, LoRA targets and quantization targets address roles; adding an architecture
is one :data:`ADAPTERS` entry plus its tests.

Norm roles: ``attention_norm`` (read by q/k/v), ``mlp_norm`` (read by gate/up), ``attention_output_norm`` and
``mlp_output_norm`` (applied to a block's output before the residual add), ``q_norm`` / ``k_norm`` (per head).
The adapter also keeps the config consistent after a change of layer count (``num_hidden_layers``,
``layer_types``, ``max_window_layers``, each attention module's ``layer_idx`` / ``layer_type``).

MoE facts (:class:`ExpertLayout`, an adapter's ``experts``, in ``experts``): where the expert tensors and the
router are and how they are laid out. What an export format needs of an architecture beyond these (the tensor
names and graph of another runtime) lives with that format, keyed by ``model_type``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import RecipeError
from ..numerics.linalg import set_linear_weight
from .experts import UNHANDLED, ExpertLayout, layout_problem

#: Linear roles in dataflow order with their stage (0: reads the attention norm, 1: attention output,
#: 2: reads the MLP norm, 3: MLP output). Fused roles list the roles they stack (output rows in order).
LINEAR_ROLES = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "qkv_proj": 0, "o_proj": 1,
                "gate_proj": 2, "up_proj": 2, "gate_up_proj": 2, "down_proj": 3}
UNFUSED_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The MLP's roles: on a mixture-of-experts architecture they name expert tensors, not linears.
MLP_ROLES = ("gate_proj", "up_proj", "down_proj")
FUSED_ROLES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Key of the per-layer-type keyword arguments inside a captured layer-kwargs dict (``layer_kwargs``).
LAYER_TYPE_KWARGS = "_recipe_layer_type_kwargs"


def _unfused_linears(attention: str = "self_attn", mlp: str = "mlp") -> dict[str, str]:
    return {**{r: f"{attention}.{r}" for r in UNFUSED_ROLES[:4]}, **{r: f"{mlp}.{r}" for r in UNFUSED_ROLES[4:]}}


#: An MoE layer's linears: the attention's (its MLP's experts are 3-D tensors, see ``experts``).
ATTENTION_LINEARS = {r: f"self_attn.{r}" for r in UNFUSED_ROLES[:4]}
LLAMA_NORMS = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class ArchitectureAdapter:
    model_type: str
    #: linear role → path inside a decoder layer (fused roles replace their members)
    linears: dict[str, str] = field(default_factory=_unfused_linears)
    #: norm role → path inside a decoder layer
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    qkv_bias: bool = False
    #: RMSNorm output ``x / rms(x) · (norm_offset + w)``: 0 for Llama-style gains, 1 for Gemma's ``1 + w``
    norm_offset: float = 0.0
    #: the embedding output is multiplied by ``sqrt(hidden_size)`` (Gemma)
    scaled_embeddings: bool = False
    attention_block: str = "self_attn"
    mlp_block: str = "mlp"
    #: model-level roles (paths from the ``*ForCausalLM`` module)
    model_paths: dict[str, str] = field(default_factory=lambda: {
        "layers": "model.layers", "embeddings": "model.embed_tokens", "final_norm": "model.norm",
        "lm_head": "lm_head", "rotary": "model.rotary_emb"})
    #: the MLP is a mixture of experts (3-D expert tensors and a router; None: a dense gated MLP of linears)
    experts: ExpertLayout | None = None
    #: ``o_proj`` has a bias and each attention head a learned sink logit (gpt-oss)
    attention_sinks: bool = False

    # -- role facts -----------------------------------------------------------------------------
    @property
    def head_norms(self) -> tuple[str, ...]:
        """Per-head q/k norm roles this architecture has (Qwen3, Gemma 3)."""
        return tuple(r for r in ("q_norm", "k_norm") if r in self.norms)

    @property
    def output_norms(self) -> tuple[str, ...]:
        """Norms on a block's output before the residual add (Gemma 3's sandwich norms)."""
        return tuple(r for r in ("attention_output_norm", "mlp_output_norm") if r in self.norms)

    @property
    def fused(self) -> dict[str, tuple[str, ...]]:
        return {role: FUSED_ROLES[role] for role in self.linears if role in FUSED_ROLES}

    @property
    def attention_inputs(self) -> tuple[str, ...]:
        """Roles of the linears that read the attention norm (q, k, v or the fused qkv)."""
        return tuple(r for r in self.linears if LINEAR_ROLES[r] == 0)

    @property
    def mlp_inputs(self) -> tuple[str, ...]:
        """Roles of the linears that read the MLP norm (gate, up or the fused gate_up)."""
        return tuple(r for r in self.linears if LINEAR_ROLES[r] == 2)

    @property
    def output_linears(self) -> dict[str, str]:
        """Block path → path of the linear whose result is the block's output (``recipe_engine.execution.staged``);
        an MoE block has none (its output is a routed sum of expert tensors)."""
        blocks = {self.attention_block: self.linears["o_proj"]}
        if "down_proj" in self.linears:
            blocks[self.mlp_block] = self.linears["down_proj"]
        return blocks

    @property
    def norm_reads(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(norm role, roles of the linears reading its output): what ``FuseNorm`` folds. An MoE layer's MLP
        norm is read by the router and the expert tensors, not by linears: it stays."""
        reads = (("attention_norm", self.attention_inputs), ("mlp_norm", self.mlp_inputs))
        return tuple((norm, readers) for norm, readers in reads if readers)

    def intermediate_size(self, config) -> int:
        """The MLP width of the config's layers: one expert's for an MoE architecture."""
        return self.experts.intermediate_size(config) if self.experts else config.intermediate_size

    def path(self, role: str) -> str:
        """Path inside a decoder layer of a linear, norm or block role (``self_attn``/``mlp``: the blocks)."""
        if role in self.linears:
            return self.linears[role]
        if role in self.norms:
            return self.norms[role]
        if role in ("attention", "mlp"):
            return self.attention_block if role == "attention" else self.mlp_block
        fused = next((f for f, members in self.fused.items() if role in members), None)
        where = f" (fused into {fused})" if fused else ""
        raise RecipeError(f"{self.model_type} has no module for role '{role}'{where}")

    def positions(self) -> dict[str, int]:
        """Dataflow position of each linear and block path (see ``recipe_engine.execution.stats``)."""
        return {**{path: LINEAR_ROLES[role] for role, path in self.linears.items()},
                self.attention_block: 0, self.mlp_block: 2}

    def module_roles(self, roles: list[str] | tuple[str, ...], experts: bool = False) -> list[str]:
        """The linear roles of this architecture that ``roles`` (unfused names) select, in dataflow order: a
        fused linear when all its members are selected; a fused linear selected in part is an error. On an
        MoE architecture the MLP roles name expert tensors, not linears: with ``experts`` (a step that handles
        them, :meth:`expert_roles`) they are left out here, otherwise they are an error."""
        wanted = set(roles)
        mlp = sorted(wanted & set(MLP_ROLES))
        if self.experts is not None and mlp and experts:
            self.expert_roles(roles)
            wanted -= set(mlp)
        elif self.experts is not None and mlp:
            raise RecipeError(f"{self.model_type}'s MLP is a mixture of experts (3-D expert tensors and a router, "
                              f"not linears): {', '.join(mlp)} cannot be targeted; target the attention linears "
                              f"(q_proj, k_proj, v_proj, o_proj)")
        chosen = []
        for role in self.linears:
            members = FUSED_ROLES.get(role, (role,))
            picked = wanted & set(members)
            if picked and picked != set(members):
                raise RecipeError(f"{self.model_type} fuses {', '.join(members)} into {role}: target all of "
                                  f"them or none (got {', '.join(sorted(picked))})")
            if picked:
                chosen.append(role)
        return chosen

    def linear_roles(self, roles: list[str] | tuple[str, ...]) -> list[str]:
        """The roles among ``roles`` (unfused names) that name linears here: all of them, less the MLP's on a
        mixture-of-experts architecture (its expert tensors)."""
        return [role for role in roles if self.experts is None or role not in MLP_ROLES]

    def expert_roles(self, roles: list[str] | tuple[str, ...]) -> list[str]:
        """The expert tensors (``gate_up_proj``, ``down_proj``) that ``roles`` select on an MoE architecture, in
        dataflow order ([] on a dense one); gate and up are one fused tensor: both or neither."""
        if self.experts is None:
            return []
        wanted = set(roles)
        picked = wanted & {"gate_proj", "up_proj"}
        if len(picked) == 1:
            raise RecipeError(f"{self.model_type} fuses every expert's gate_proj and up_proj into "
                              f"{self.experts.path}.gate_up_proj: target both or neither (got {picked.pop()})")
        return [name for name, members in (("gate_up_proj", {"gate_proj"}), ("down_proj", {"down_proj"}))
                if members & wanted]

    def expert_paths(self) -> dict[str, tuple[tuple[str, ...], bool]]:
        """Path inside a decoder layer → (expert roles, stacked): the router, the stacked expert tensors
        (``stacked``: parameters of the experts module, ``[experts, rows, columns]``, no ``.weight`` suffix), a
        shared expert's linears and its gate (none on a dense architecture)."""
        if self.experts is None:
            return {}
        experts = self.experts.path
        paths = {self.experts.router: (("router",), False),
                 f"{experts}.gate_up_proj": (("gate_exps", "up_exps"), True),
                 f"{experts}.down_proj": (("down_exps",), True)}
        if self.experts.shared:
            shared = self.experts.shared
            paths.update({f"{shared}.{p}": ((f"shared_{p}",), False) for p in ("gate_proj", "up_proj", "down_proj")})
            paths[f"{shared}_gate"] = (("shared_gate",), False)
        return paths

    def moe_sizes(self, config) -> dict[str, int]:
        """An MoE architecture's sizes from ``config``, in this order: ``count`` (experts per layer), ``used`` (experts
        per token), ``width`` (one expert's intermediate size) and, where there is a shared expert, ``shared_width``;
        empty on a dense architecture."""
        return self.experts.sizes(config) if self.experts is not None else {}

    def router_names(self, model: nn.Module) -> list[str]:
        """Module names of the routers of ``model``'s MoE layers (none on a dense architecture)."""
        router = self.experts.router if self.experts is not None else None
        return [name for name, _ in model.named_modules() if router and name.endswith(f".{router}")]

    @property
    def carries_linear_grids(self) -> bool:
        """Whether a packed source's grids can be carried to the output linear by linear: not on a mixture of
        experts, whose experts are fused into 3-D tensors at load (an output packs every one of them or none)."""
        return self.experts is None

    def writes_hub_names(self, quantized: bool, stacks_packed: bool) -> bool:
        """Whether the writer writes ``save_pretrained``'s on-disk names (the Hub's per-expert names of an MoE
        layer) rather than the in-memory ones: on an MoE architecture, unquantized or with packed experts
        (``stacks_packed``: transformers dequantizes them at load, vLLM reads them); packed attention beside dense
        experts keeps the fused names (transformers' compressed-tensors loading does not convert dense
        per-expert names: 5.24 fails on them)."""
        return self.experts is not None and (stacks_packed or not quantized)

    # -- navigation -------------------------------------------------------------------------------
    def _model_part(self, model: nn.Module, role: str) -> nn.Module:
        return model.get_submodule(self.model_paths[role])

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self._model_part(model, "layers")

    def embeddings(self, model: nn.Module) -> nn.Module:
        return self._model_part(model, "embeddings")

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self._model_part(model, "final_norm")

    def lm_head(self, model: nn.Module) -> nn.Linear:
        return self._model_part(model, "lm_head")

    def rotary(self, model: nn.Module) -> nn.Module:
        return self._model_part(model, "rotary")

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.get_submodule(self.attention_block)

    def mlp(self, layer: nn.Module) -> nn.Module:
        return layer.get_submodule(self.mlp_block)

    def linear(self, layer: nn.Module, role: str) -> nn.Linear:
        return layer.get_submodule(self.path(role))

    def norm(self, layer: nn.Module, role: str) -> nn.Module:
        return layer.get_submodule(self.norms[role])

    def norm_gain(self, norm: nn.Module) -> torch.Tensor:
        """The fp32 gain ``g`` of an RMSNorm as applied (``norm_offset + w``)."""
        return norm.weight.detach().float() + self.norm_offset

    @torch.no_grad()
    def set_norm_gain(self, norm: nn.Module, gain: torch.Tensor | float) -> None:
        """Store gain ``g`` in the norm's parameterisation (``w = g − norm_offset``)."""
        if isinstance(gain, torch.Tensor):
            norm.weight.copy_((gain.float() - self.norm_offset).to(norm.weight.dtype))
        else:
            norm.weight.fill_(gain - self.norm_offset)

    # -- widths of one layer ------------------------------------------------------------------
    def layer_widths(self, layer: nn.Module, head_dim: int) -> tuple[int, int, int]:
        """(query heads, KV heads, intermediate size) read from the weight shapes."""
        heads = self.linear(layer, "o_proj").in_features // head_dim
        if "k_proj" in self.linears:
            kv = self.linear(layer, "k_proj").out_features // head_dim
        else:
            kv = self.member_rows(layer, "qkv_proj", head_dim)["k_proj"] // head_dim
        if self.experts is not None:
            return heads, kv, self.experts.expert_width(layer)
        return heads, kv, self.linear(layer, "down_proj").in_features

    @torch.no_grad()
    def fold_mlp_output(self, layer: nn.Module, transform: torch.Tensor) -> None:
        """``y ← y T`` (row vectors) on the MLP's output, folded into its weights in fp64: ``down_proj``'s
        ``W ← Tᵀ W`` (and bias), or every expert's down projection (and a shared expert's)."""
        if self.experts is not None:
            self.experts.fold_output(layer, transform)
            return
        down = self.linear(layer, "down_proj")
        t = transform.to(down.weight.device, torch.float64)
        bias = t.T @ down.bias.double() if down.bias is not None else None
        set_linear_weight(down, t.T @ down.weight.double(), bias)

    def member_rows(self, layer: nn.Module, role: str, head_dim: int) -> dict[str, int]:
        """Output rows of each member role of linear ``role`` (a plain linear: itself). A fused qkv holds
        ``(r + 2)·KV`` heads for the config's query heads per KV head ``r`` (merging and pruning whole KV
        groups keeps ``r``), so its split is read from its own rows."""
        rows = self.linear(layer, role).out_features
        if role == "qkv_proj":
            config = self.attention(layer).config
            config = getattr(self.attention(layer), "_recipe_shared_config", config)
            kv = rows // head_dim // (config.num_attention_heads // config.num_key_value_heads + 2) * head_dim
            return {"q_proj": rows - 2 * kv, "k_proj": kv, "v_proj": kv}
        if role == "gate_up_proj":
            return {"gate_proj": rows // 2, "up_proj": rows // 2}
        return {role: rows}

    def member_parts(self, layer: nn.Module, role: str, head_dim: int) -> dict[str, tuple[torch.Tensor, Any]]:
        """``{member role: (weight rows, bias rows or None)}`` of linear ``role`` (views, not copies)."""
        linear = self.linear(layer, role)
        rows = self.member_rows(layer, role, head_dim)
        weights = linear.weight.split(list(rows.values()))
        biases = linear.bias.split(list(rows.values())) if linear.bias is not None else [None] * len(rows)
        return {member: (w, b) for member, w, b in zip(rows, weights, biases)}

    @torch.no_grad()
    def keep_rows(self, layer: nn.Module, rows: dict[str, torch.Tensor], head_dim: int) -> None:
        """Keep output rows ``rows[member]`` of the given member roles (q/k/v or gate/up), slicing a fused
        linear member by member; then sync per-module widths (``sync_widths``)."""
        for role in self.module_roles(list(rows)):
            linear = self.linear(layer, role)
            parts = self.member_parts(layer, role, head_dim)
            weight = torch.cat([parts[m][0][rows[m]] for m in parts])
            bias = torch.cat([parts[m][1][rows[m]] for m in parts]) if linear.bias is not None else None
            set_linear_weight(linear, weight, bias)
        self.sync_widths(layer, head_dim)

    def sync_widths(self, layer: nn.Module, head_dim: int) -> None:
        """Make modules that read their widths from the config agree with the weights (Phi-3's attention
        splits ``qkv_proj`` at ``config.num_attention_heads``): a layer wider than the config gets a private
        config copy; a stock-width layer shares the model config again."""
        if "qkv_proj" not in self.linears:
            return
        attention = self.attention(layer)
        heads, kv, _ = self.layer_widths(layer, head_dim)
        shared = getattr(attention, "_recipe_shared_config", attention.config)
        config = shared
        if (heads, kv) != (shared.num_attention_heads, shared.num_key_value_heads):
            config = copy.copy(shared)
            config.num_attention_heads, config.num_key_value_heads = heads, kv
        attention._recipe_shared_config = shared
        attention.config = config
        attention.num_key_value_heads, attention.num_key_value_groups = kv, heads // kv

    # -- layer kwargs -------------------------------------------------------------------------
    @staticmethod
    def layer_type(layer: nn.Module) -> str | None:
        attention = getattr(layer, "self_attn", None)
        return getattr(attention, "layer_type", None)

    def layer_kwargs(self, layer: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments ``layer`` runs with: a captured dict holding per-layer-type variants
        (attention mask, rotary embeddings of sliding vs global layers) gives the layer's own type's."""
        by_type = kwargs.get(LAYER_TYPE_KWARGS)
        if by_type is None:
            return kwargs
        plain = {k: v for k, v in kwargs.items() if k != LAYER_TYPE_KWARGS}
        return {**plain, **by_type[self.layer_type(layer)]}

    # -- structure edits -------------------------------------------------------------------
    def set_layers(self, model: nn.Module, layers: list[nn.Module], kept_origin: list[int]) -> None:
        """Install a new list of decoder layers and fix the config and layer indices.

        ``kept_origin[i]`` is the index (in the current model) whose per-layer config entries
        (``layer_types``) the new layer ``i`` inherits.
        """
        config = model.config
        old_types = getattr(config, "layer_types", None)
        self.set_layer_list(model, nn.ModuleList(layers))
        config.num_hidden_layers = len(layers)
        if old_types is not None:
            config.layer_types = [old_types[i] for i in kept_origin]
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = min(config.max_window_layers, len(layers))
        for index, layer in enumerate(layers):
            attention = self.attention(layer)
            attention.layer_idx = index
            if old_types is not None and hasattr(attention, "layer_type"):
                attention.layer_type = config.layer_types[index]
                sliding = attention.layer_type == "sliding_attention"
                if hasattr(attention, "is_sliding"):
                    attention.is_sliding = sliding
                if hasattr(attention, "sliding_window"):
                    attention.sliding_window = config.sliding_window if sliding else None

    def set_layer_list(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Put ``layers`` at the layers' path (no config change; ``set_layers`` keeps the config in step)."""
        parent, name = self.model_paths["layers"].rsplit(".", 1)
        setattr(model.get_submodule(parent), name, layers)


@torch.no_grad()
def replace_linear(layer: nn.Module, path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """Install a new ``nn.Linear`` holding ``weight`` (and ``bias``) at ``path`` inside ``layer``."""
    linear = install_linear(layer, path, weight.shape[1], weight.shape[0], bias is not None, weight.dtype,
                            weight.device)
    linear.weight.copy_(weight)
    if bias is not None:
        linear.bias.copy_(bias)
    return linear


@torch.no_grad()
def install_linear(layer: nn.Module, path: str, in_features: int, out_features: int, bias: bool,
                   dtype: torch.dtype, device: torch.device) -> nn.Linear:
    """Install a new ``nn.Linear`` at ``path`` inside ``layer`` with uninitialized weights, for the caller to
    fill in place (``skip_init``: no random initialisation of weights about to be overwritten, seconds for an
    8B layer)."""
    linear = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)
    parent, name = path.rsplit(".", 1)
    setattr(layer.get_submodule(parent), name, linear)
    return linear


QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


GEMMA3_NORMS = {"attention_norm": "input_layernorm", "attention_output_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "mlp_output_norm": "post_feedforward_layernorm", **QK_NORMS}
ADAPTERS = {
    "llama": ArchitectureAdapter("llama"),
    "mistral": ArchitectureAdapter("mistral"),
    "qwen2": ArchitectureAdapter("qwen2", qkv_bias=True),
    "qwen3": ArchitectureAdapter("qwen3", norms={**LLAMA_NORMS, **QK_NORMS}),
    "gemma3_text": ArchitectureAdapter(
        "gemma3_text", norm_offset=1.0, scaled_embeddings=True, norms=GEMMA3_NORMS),
    "phi3": ArchitectureAdapter("phi3", linears={"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                                                 "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}),
    # transformers 5 fuses each layer's experts into 3-D tensors (the Hub's per-expert names are converted at load)
    "qwen2_moe": ArchitectureAdapter("qwen2_moe", linears=dict(ATTENTION_LINEARS), qkv_bias=True,
                                     experts=ExpertLayout(width="moe_intermediate_size", shared="mlp.shared_expert")),
    "qwen3_moe": ArchitectureAdapter("qwen3_moe", norms={**LLAMA_NORMS, **QK_NORMS},
                                     linears=dict(ATTENTION_LINEARS),
                                     experts=ExpertLayout(width="moe_intermediate_size")),
    "mixtral": ArchitectureAdapter("mixtral", linears=dict(ATTENTION_LINEARS),
                                   experts=ExpertLayout()),
    "gpt_oss": ArchitectureAdapter("gpt_oss", linears=dict(ATTENTION_LINEARS),
                                   qkv_bias=True, attention_sinks=True,
                                   experts=ExpertLayout(router="mlp.router", transposed=True, interleaved=True,
                                                        biases=True, router_bias=True, packed_problem=(
                                                            "gpt-oss stores its experts as fused 3-D tensors, not "
                                                            "as the per-expert linears a packed format holds"))),
}


def adapter_for(config) -> ArchitectureAdapter:
    """Adapter for ``config.model_type``; anything else is a one-line error."""
    model_type = getattr(config, "model_type", None)
    if model_type in UNHANDLED:
        raise RecipeError(f"unsupported architecture '{model_type}': {UNHANDLED[model_type]} is not handled yet")
    if model_type not in ADAPTERS:
        raise RecipeError(f"unsupported architecture '{model_type}'; supported: "
                          f"{', '.join(sorted(ADAPTERS))}")
    adapter = ADAPTERS[model_type]
    problem = layout_problem(config) if adapter.experts is not None else None
    if problem:
        raise RecipeError(f"unsupported {model_type} variant: {problem}")
    if getattr(config, "attention_bias", False) and not adapter.qkv_bias:
        raise RecipeError(f"unsupported {model_type} variant with attention_bias=true")
    if getattr(config, "mlp_bias", False):
        raise RecipeError(f"unsupported {model_type} variant with mlp_bias=true")
    return adapter


def roles_problem(model_type: str, roles: list[str], experts: bool = False) -> str | None:
    """Why ``roles`` cannot be targeted on ``model_type`` (a fused linear selected in part; MoE MLP roles by a
    step that does not handle ``experts``), or None."""
    if model_type not in ADAPTERS:
        return None
    try:
        ADAPTERS[model_type].module_roles(roles, experts)
    except RecipeError as exc:
        return exc.detail
    return None


@torch.no_grad()
def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
